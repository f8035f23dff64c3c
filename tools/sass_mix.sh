#!/usr/bin/env bash
# Instruction mix of the kernels in a binary whose names match a pattern: one line per kernel,
# its instruction count, then its most frequent opcodes with their counts. Needs cuobjdump.
#
#   tools/sass_mix.sh BINARY [PATTERN]        (default pattern: quant_blend)
#
# PATTERN is an awk regular expression matched against the (mangled) kernel names. qbl's kernels
# (include/qbl/detail/*.inl): amax_kernel, amax_partials_kernel, quant_blend_kernel,
# amax_quant_blend_single_block_kernel, quant_blend_backward_kernel, column_sum_kernel,
# column_sum_finish_kernel and gemm_fallback_kernel; the default matches the three with
# quant_blend in their names. Exit status 1 when no kernel matches.
set -euo pipefail
bin=$1
pattern=${2:-quant_blend}
mix=$(cuobjdump -sass "$bin" |
  awk -v pat="$pattern" '
    /Function :/ { fn = $3; keep = (fn ~ pat); next }
    keep && /^ +\/\*[0-9a-f]+\*\/ / {
      line = $0; sub(/^ +\/\*[0-9a-f]+\*\/ +/, "", line); sub(/^@!?U?P[0-9T]+ +/, "", line)
      split(line, w, /[ .;]/); print fn, w[1]
    }' |
  sort | uniq -c | sort -k2,2 -k1,1nr |
  awk '{ if ($2 != fn) { if (fn != "") print fn ": " total " instructions:" ops; fn = $2; total = 0; n = 0; ops = "" }
         total += $1; if (n++ < 16) ops = ops " " $3 "=" $1 }
       END { if (fn != "") print fn ": " total " instructions:" ops }')
if [ -z "$mix" ]; then
  echo "sass_mix.sh: no kernel in $bin matches '$pattern'" >&2
  exit 1
fi
printf '%s\n' "$mix"

#!/usr/bin/env bash
# Instruction mix of the kernels in a binary whose names match a pattern: one line per kernel,
# its instruction count, then its most frequent opcodes with their counts. Needs cuobjdump.
#
#   tools/sass_mix.sh BINARY [PATTERN]        (default pattern: quant_blend)
set -euo pipefail
bin=$1
pattern=${2:-quant_blend}
cuobjdump -sass "$bin" |
  awk -v pat="$pattern" '
    /Function :/ { fn = $3; keep = (fn ~ pat); next }
    keep && /^ +\/\*[0-9a-f]+\*\/ / {
      line = $0; sub(/^ +\/\*[0-9a-f]+\*\/ +/, "", line); sub(/^@!?U?P[0-9T]+ +/, "", line)
      split(line, w, /[ .;]/); print fn, w[1]
    }' |
  sort | uniq -c | sort -k2,2 -k1,1nr |
  awk '{ if ($2 != fn) { if (fn != "") print fn ": " total " instructions:" ops; fn = $2; total = 0; n = 0; ops = "" }
         total += $1; if (n++ < 16) ops = ops " " $3 "=" $1 }
       END { if (fn != "") print fn ": " total " instructions:" ops }'

#!/usr/bin/env bash
# Runs every GPU test binary under compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck; fails on the first tool that reports an error. Needs a GPU and compute-sanitizer.
#
#   tests/run_sanitizers.sh [build-dir] [tool ...]        (default: build, all four tools)
#
# The huge-tensor case (tens of GiB) is left out: under memcheck it would take many minutes.
set -euo pipefail
build=${1:-build}
shift || true
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$sanitizer" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
status=0
for tool in "${tools[@]}"; do
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    case "$name" in test_error|test_two_units) continue ;; esac  # no device code of their own
    log="$build/sanitizer-$tool-$name.log"
    if "$sanitizer" --tool "$tool" --error-exitcode 97 --print-limit 20 "$t" \
         --gtest_filter='-*Huge*:*n16777219*' >"$log" 2>&1; then
      echo "$tool $name: $(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$log" | tail -n 1)"
    else
      echo "$tool $name: FAILED (see $log)"
      status=1
    fi
  done
done
exit $status

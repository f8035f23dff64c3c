#!/usr/bin/env bash
# Runs every GPU test binary under compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck; exits non-zero if any tool reports an error or any test fails under it.
# Needs a GPU and compute-sanitizer.
#
#   tests/run_sanitizers.sh [build-dir] [tool ...]        (default: build, all four tools)
#
# memcheck instruments every kernel, cuBLASLt's included. racecheck, initcheck and synccheck
# instrument qbl's kernels (and the tests' own), whose mangled names contain "qbl": cuBLASLt's
# GEMMs under racecheck take minutes per test binary, and their shared-memory and barrier use is
# not qbl's to check.
#
# Left out: the huge-tensor case (tens of GiB; many minutes under memcheck), the 2^24-element amax
# cases, and the out-of-memory test, whose failing cudaMalloc is the point of the test but counts
# as an API error to the tools. QBL_SANITIZER_EXCLUDE adds gtest filter patterns (':'-separated).
set -euo pipefail
# The randomized property test runs a slice of its cases here (1000 constructions under memcheck
# would take long); its full run belongs to the plain test suite.
export QBL_PROPERTY_CASES=${QBL_PROPERTY_CASES:-100}
build=${1:-build}
shift || true
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$sanitizer" ] || { echo "compute-sanitizer not found" >&2; exit 2; }
# The kernel filter is --kernel-name in current releases, --filter in older ones.
help=$("$sanitizer" --help 2>&1 || true)  # not piped into grep -q: that would SIGPIPE it
if grep -q -- '--kernel-name' <<<"$help"; then
  only_qbl=(--kernel-name kns=qbl)
else
  only_qbl=(--filter kns=qbl)
fi
exclude="*Huge*:*n16777219*:*OutOfMemory*${QBL_SANITIZER_EXCLUDE:+:$QBL_SANITIZER_EXCLUDE}"
status=0
for tool in "${tools[@]}"; do
  scope=()
  [ "$tool" = memcheck ] || scope=("${only_qbl[@]}")
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    case "$name" in test_error|test_two_units) continue ;; esac  # no device code of their own
    log="$build/sanitizer-$tool-$name.log"
    start=$(date +%s)
    if "$sanitizer" --tool "$tool" "${scope[@]}" --error-exitcode 97 --print-limit 20 "$t" \
         --gtest_filter="-$exclude" >"$log" 2>&1; then
      result=ok
    else
      result=FAILED
      status=1
    fi
    echo "$tool $name: $result, $(grep -Eo 'ERROR SUMMARY: [0-9]+ errors?' "$log" | tail -n 1)," \
         "$(grep -Eo '\[  PASSED  \] [0-9]+ tests?' "$log" | tail -n 1)," \
         "$(grep -Eo '\[  FAILED  \] [0-9]+ tests?' "$log" | tail -n 1)" \
         "($(( $(date +%s) - start )) s)"
  done
done
exit $status

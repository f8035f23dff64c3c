#!/usr/bin/env bash
# Runs every GPU test binary under compute-sanitizer's memcheck, racecheck, initcheck and
# synccheck; exits non-zero if any tool reports an error or any test fails under it.
# Needs a GPU and compute-sanitizer.
#
#   tests/run_sanitizers.sh [build-dir] [tool ...]        (default: build, all four tools)
#
# Every kernel is instrumented, cuBLASLt's included. A kernel filter is no way to save time:
# with --kernel-name kns=qbl, racecheck failed to handle hardware exceptions in the layer tests
# whose GEMMs are 16-bit or TF32 (error 700 from then on), measured on an H200. racecheck,
# initcheck and synccheck leave out the tests that autotune the GEMM (hundreds of timed
# cuBLASLt runs, no qbl kernel among them) and the test of the backward
# plan's choices (LayerPlans.TheBackwardPlanChoosesByShapeUnlessForced: it plans for up to 8192
# tokens at 4096 x 1024, whose only GPU work is cuBLASLt's trial launches); the graph test replays
# 200 times instead of 10,000 and the four threads run 5 forwards each instead of 50.
#
# Left out of memcheck: QuantBlendLinearCapture.GlobalModeRefusesAnAllocation, the control of the
# capture test, whose refused cudaMalloc and invalidated capture are the point of the test but
# count as API errors to memcheck (the other tools run it).
# Left out everywhere: the huge-tensor case (tens of GiB; many minutes under memcheck), the
# 2^24-element amax cases, the out-of-memory test, whose failing cudaMalloc is the point of
# the test but counts as an API error to the tools, and the exhaustive 16-bit operand sweeps of
# test_quant_blend_math (2^32 operand pairs each, no shared memory, one atomic per block: they
# test arithmetic, and take minutes instrumented; its fp32 sweep stays in). QBL_SANITIZER_EXCLUDE adds gtest filter
# patterns (':'-separated); QBL_SANITIZER_ONLY (space-separated binary names) runs only those
# binaries; QBL_SANITIZER_SHARDS=N runs each binary as N gtest shards in parallel. A few tool
# processes share one GPU well; dozens do not: with 44 at once on one H200 (16 cores) initcheck
# of the reliability tests took 282 s, against 3 s as 6 shards alone. racecheck of the
# layer-level binaries takes minutes even so: with 14 tool processes at once, 346-431 s for
# three of them, and 179 of the backward binary's then 190 tests in 520 s.
#
# Time limits: QBL_SANITIZER_BINARY_S (seconds, default none) bounds each tool-binary run, and a
# run that reaches it counts as failed; QBL_SANITIZER_DEADLINE (seconds since the epoch) stops
# starting runs after that time, and every run not started is reported and counts as failed.
#
# A run that tested nothing is a failure, not a pass: the binaries run with QBL_REQUIRE_GPU=1 (a
# GPU test fails where no GPU is usable), a run whose gtest log shows no test run, or every test
# skipped, or no gtest summary at all, counts as failed, and so does finding no test binary at all
# (a wrong build folder). So does a binary in which no test made a CUDA call (the tool exits 255);
# in a sharded run a shard that drew only host-side tests is fine if its tests passed, as long as
# another shard reached the GPU. `tests/run_sanitizers.sh --check-log LOG` applies the first
# check to one log.
set -euo pipefail

# Prints why a gtest log (sanitizer output interleaved) shows that nothing was tested; prints
# nothing when some test ran and was not skipped.
empty_run_reason() {
  local log=$1 ran skipped
  # A sharded run's log holds one gtest summary per shard: their counts add up.
  ran=$(grep -Eo '^\[==========\] [0-9]+ tests? from [0-9]+ test suites? ran' "$log" |
        awk '{ n += $2; seen = 1 } END { if (seen) print n }')
  if [ -z "$ran" ]; then echo "no gtest summary in the log (did the binary start?)"; return; fi
  if [ "$ran" -eq 0 ]; then echo "no test ran (the filter left none)"; return; fi
  skipped=$(grep -Eo '^\[  SKIPPED \] [0-9]+ tests?, listed below' "$log" |
            awk '{ n += $4 } END { print n + 0 }')
  if [ "$skipped" -ge "$ran" ]; then echo "every test skipped ($skipped of $ran)"; fi
}

# Sum of the numbers in what `pattern` (an extended regex holding one number) matches in a log.
count() { grep -Eo "$2" "$1" | grep -Eo '[0-9]+' | awk '{ n += $1 } END { print n + 0 }'; }

if [ "${1:-}" = --check-log ]; then
  [ -r "${2:-}" ] || { echo "usage: $0 --check-log LOG" >&2; exit 2; }
  why=$(empty_run_reason "$2")
  if [ -n "$why" ]; then echo "$2: $why"; exit 1; fi
  echo "$2: tests ran"
  exit 0
fi

export QBL_REQUIRE_GPU=1
# The randomized property test runs a slice of its cases here (1000 constructions under memcheck
# would take long); its full run belongs to the plain test suite.
export QBL_PROPERTY_CASES=${QBL_PROPERTY_CASES:-100}
build=${1:-build}
shift || true
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
binaries=()
for t in "$build"/tests/test_*; do
  if [ ! -f "$t" ] || [ ! -x "$t" ]; then continue; fi
  case "$(basename "$t")" in test_error|test_two_units|test_tolerance) continue ;; esac  # no device code of their own
  if [ -n "${QBL_SANITIZER_ONLY:-}" ] && ! [[ " $QBL_SANITIZER_ONLY " == *" $(basename "$t") "* ]]; then
    continue
  fi
  binaries+=("$t")
done
if [ ${#binaries[@]} -eq 0 ]; then
  echo "FAILED: no test binary under $build/tests (wrong build folder, or not built?)" >&2
  exit 2
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$sanitizer" ] || { echo "FAILED: compute-sanitizer not found (looked on PATH and at $sanitizer)" >&2; exit 2; }
export QBL_GRAPH_REPLAYS=${QBL_GRAPH_REPLAYS:-200} QBL_CONCURRENCY_REPS=${QBL_CONCURRENCY_REPS:-5}
exclude="*Huge*:*n16777219*:*OutOfMemory*:QuantBlendMath16/*.Every*${QBL_SANITIZER_EXCLUDE:+:$QBL_SANITIZER_EXCLUDE}"
limit=()
[ -n "${QBL_SANITIZER_BINARY_S:-}" ] && limit=(timeout "$QBL_SANITIZER_BINARY_S")
shards=${QBL_SANITIZER_SHARDS:-1}
no_cuda_call="Target application terminated before first instrumented API call"
tool_summary='(ERROR SUMMARY: [0-9]+ errors?$|RACECHECK SUMMARY: [0-9]+ hazards?)'

status=0
runs=0
for tool in "${tools[@]}"; do
  filter="-$exclude"
  if [ "$tool" = memcheck ]; then
    filter="$filter:QuantBlendLinearCapture.GlobalModeRefusesAnAllocation"
  else
    filter="$filter:*Autotune*:*Determinism*:LayerPlans.TheBackwardPlanChoosesByShapeUnlessForced"
  fi
  for t in "${binaries[@]}"; do
    name=$(basename "$t")
    log="$build/sanitizer-$tool-$name.log"
    start=$(date +%s)
    if [ -n "${QBL_SANITIZER_DEADLINE:-}" ] && [ "$start" -ge "$QBL_SANITIZER_DEADLINE" ]; then
      echo "$tool $name: NOT RUN (deadline)"
      status=1
      continue
    fi
    rc=0
    if [ "$shards" -le 1 ]; then
      "${limit[@]}" "$sanitizer" --tool "$tool" --error-exitcode 97 --print-limit 20 "$t" \
        --gtest_filter="$filter" --gtest_color=no >"$log" 2>&1 || rc=$?
    else
      # gtest's own sharding: each process runs every shards-th test; the first failing
      # shard's status is the run's, and the logs are joined in shard order.
      pids=()
      for ((i = 0; i < shards; ++i)); do
        GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "${limit[@]}" "$sanitizer" --tool "$tool" \
          --error-exitcode 97 --print-limit 20 "$t" --gtest_filter="$filter" --gtest_color=no \
          >"$log.shard$i" 2>&1 &
        pids+=($!)
      done
      host_only=0
      for ((i = 0; i < shards; ++i)); do
        r=0
        wait "${pids[$i]}" || r=$?
        # A shard that drew only host-side tests, or no test (more shards than tests), makes no
        # CUDA call, and the tool exits 255 saying so: such a shard counts as passed if its tests
        # passed; a binary in which every shard did so counts as failed below (the tool checked
        # nothing), and so does one whose shards ran no test at all.
        if [ "$r" -eq 255 ] && grep -q "$no_cuda_call" "$log.shard$i" &&
           grep -Eq '^\[  PASSED  \] [0-9]+ tests?\.' "$log.shard$i" &&
           ! grep -Eq '^\[  FAILED  \] [0-9]+ tests?,' "$log.shard$i"; then
          host_only=$((host_only + 1))
          r=0
        fi
        [ "$rc" -ne 0 ] || rc=$r
      done
      for ((i = 0; i < shards; ++i)); do cat "$log.shard$i"; rm -f "$log.shard$i"; done >"$log"
      if [ "$rc" -eq 0 ] && [ "$host_only" -eq "$shards" ]; then rc=255; fi
    fi
    runs=$((runs + 1))
    case $rc in
      0) result=ok ;;
      124) result="FAILED (time limit ${QBL_SANITIZER_BINARY_S} s)"; status=1 ;;
      *) result="FAILED (rc $rc)"; status=1 ;;
    esac
    why=$(empty_run_reason "$log")
    if [ -z "$why" ] && [ "$rc" -eq 255 ] && ! grep -Eq "$tool_summary" "$log"; then
      why="no test made a CUDA call"
    fi
    if [ -n "$why" ]; then
      if [ "$rc" -eq 0 ]; then result="FAILED ($why)"; else result="$result ($why)"; fi
      status=1
    fi
    echo "$tool $name: $result, $(count "$log" "$tool_summary") errors or hazards," \
         "$(count "$log" '\[  PASSED  \] [0-9]+') passed," \
         "$(count "$log" '\[  SKIPPED \] [0-9]+ tests?,') skipped," \
         "$(count "$log" '\[  FAILED  \] [0-9]+ tests?,') failed" \
         "($(( $(date +%s) - start )) s$([ "$shards" -gt 1 ] && echo ", $shards shards"))"
  done
done
if [ "$runs" -eq 0 ]; then
  echo "FAILED: no test binary was run" >&2
  exit 2
fi
exit $status

#!/usr/bin/env bash
# Everything qbl runs on a GPU, in one go: build, the whole test suite, the sanitizers, the
# property tests under 30 seeds, the PyTorch package (installed, then its pytest suite), the
# PyTorch timings of one layer and of a model's training step, the sharded forward's timings over
# several GPUs (where there are two or more) and the benchmark. Each stage writes its
# log to LOGDIR and has a time limit, so that one slow stage cannot starve the others; the summary
# at the end says what passed.
#
#   tools/gpu_check.sh [stage ...]   stages: build test sanitize seeds package pytest compare
#                                    train train_serial sharded bench (default: all but
#                                    train_serial)
#
# Environment: LOGDIR (default build-gpu/logs), BUILD (default build-gpu), JOBS (default nproc),
# PYTHON (default python3), COMPARE_ARGS / TRAIN_ARGS / BENCH_ARGS / PYTEST_ARGS (extra
# arguments), and per-stage limits in seconds: TEST_S (900), SANITIZE_S (3600), SEEDS_S (900),
# PACKAGE_S (600), PYTEST_S (900), COMPARE_S (900), TRAIN_S (900), SHARDED_S (600), BENCH_S (900);
# SHARDED_ARGS for sharded_timing.py.
# The test, sanitize, seeds and pytest stages run with QBL_REQUIRE_GPU=1: a GPU test fails, not
# skips, where no GPU is usable, so a broken machine cannot report everything passed.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
LOGDIR=${LOGDIR:-$BUILD/logs}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$LOGDIR"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build test sanitize seeds package pytest compare train sharded bench)
PYTHON=${PYTHON:-python3}
summary=()
note() { summary+=("$1"); echo "== $1"; }
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
secs() { echo $(( $(date +%s) - $1 )); }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
  >"$LOGDIR/gpu.txt" 2>&1 || true

if has build; then
  t=$(date +%s)
  if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
       >"$LOGDIR/build.log" 2>&1 &&
     cmake --build "$BUILD" -j"$JOBS" >>"$LOGDIR/build.log" 2>&1; then
    note "build: ok ($(secs $t) s)"
  else
    note "build: FAILED ($(secs $t) s)"; tail -n 40 "$LOGDIR/build.log"; exit 1
  fi
fi

if has test; then
  t=$(date +%s)
  QBL_REQUIRE_GPU=1 timeout "${TEST_S:-900}" ctest --test-dir "$BUILD" -j"${TEST_JOBS:-6}" \
    --output-on-failure \
    --timeout 600 >"$LOGDIR/ctest.log" 2>&1
  rc=$?
  note "ctest (rc $rc, $(secs $t) s): $(grep -E 'tests passed|tests failed' "$LOGDIR/ctest.log" | tail -n 1)"
  grep -E '\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run' "$LOGDIR/ctest.log" | head -n 30
  grep -c 'Skipped' "$LOGDIR/ctest.log" | sed 's/^/   skipped lines: /'
fi

if has sanitize; then
  t=$(date +%s)
  # 4 gtest shards per binary (a few tool processes at once): racecheck alone takes minutes per
  # layer-level binary.
  QBL_REQUIRE_GPU=1 QBL_SANITIZER_SHARDS=${QBL_SANITIZER_SHARDS:-4} timeout "${SANITIZE_S:-3600}" \
    tests/run_sanitizers.sh "$BUILD" >"$LOGDIR/sanitize.log" 2>&1
  rc=$?
  cp "$BUILD"/sanitizer-*.log "$LOGDIR"/ 2>/dev/null
  note "sanitizers (rc $rc, $(secs $t) s):"
  sed 's/^/   /' "$LOGDIR/sanitize.log"
fi

if has seeds; then
  t=$(date +%s)
  timeout "${SEEDS_S:-900}" tools/property_seeds.sh "$BUILD" >"$LOGDIR/seeds.log" 2>&1
  rc=$?
  cp "$BUILD"/property-seeds/*.log "$LOGDIR"/ 2>/dev/null
  note "property seeds (rc $rc, $(secs $t) s): $(tail -n 1 "$LOGDIR/seeds.log")"
  grep FAILED "$LOGDIR/seeds.log" | head -n 10
fi

if has package; then
  t=$(date +%s)
  if TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=$JOBS timeout "${PACKAGE_S:-600}" \
       "$PYTHON" -m pip install --no-build-isolation --no-deps -v ./python >"$LOGDIR/package.log" 2>&1 &&
     (cd /tmp && "$PYTHON" -c 'import qbl, torch; print("qbl", qbl.__file__, "torch", torch.__version__)') \
       >>"$LOGDIR/package.log" 2>&1; then
    note "package: installed ($(secs $t) s): $(tail -n 1 "$LOGDIR/package.log")"
  else
    note "package: FAILED ($(secs $t) s)"; grep -E 'error|Error' "$LOGDIR/package.log" | head -n 40
  fi
fi

if has pytest; then
  t=$(date +%s)
  QBL_REQUIRE_GPU=1 timeout "${PYTEST_S:-900}" "$PYTHON" -m pytest python/tests -q -rfEs \
    -p no:cacheprovider ${PYTEST_ARGS:-} >"$LOGDIR/pytest.log" 2>&1
  rc=$?
  note "pytest (rc $rc, $(secs $t) s): $(tail -n 1 "$LOGDIR/pytest.log")"
  grep -E '^(FAILED|ERROR)' "$LOGDIR/pytest.log" | head -n 30
fi

if has compare; then
  t=$(date +%s)
  timeout "${COMPARE_S:-900}" "$PYTHON" examples/pytorch/compare.py ${COMPARE_ARGS:-} \
    >"$LOGDIR/compare.log" 2>&1
  rc=$?
  note "compare.py ${COMPARE_ARGS:-} (rc $rc, $(secs $t) s): $(tail -n 1 "$LOGDIR/compare.log")"
  grep -E 'FAIL|Error|error' "$LOGDIR/compare.log" | head -n 30
fi

if has train; then
  t=$(date +%s)
  timeout "${TRAIN_S:-900}" "$PYTHON" examples/pytorch/train_qat.py --plot "$LOGDIR/train_qat_loss.png" \
    --json "$LOGDIR/train_qat.json" ${TRAIN_ARGS:-} >"$LOGDIR/train.log" 2>"$LOGDIR/train.err"
  rc=$?
  note "train_qat.py ${TRAIN_ARGS:-} (rc $rc, $(secs $t) s): $(tail -n 1 "$LOGDIR/train.err")"
  grep -E '^(##|\|)' "$LOGDIR/train.log" | head -n 60
  [ "$rc" -eq 0 ] || tail -n 30 "$LOGDIR/train.err"
fi

# The model step with wgrad serialized with dgrad on the caller's stream (QBL_OVERLAP_WGRAD=0),
# timings only: its qbl columns against the train stage's, each against the compiled reference
# of its own run.
if has train_serial; then
  t=$(date +%s)
  QBL_OVERLAP_WGRAD=0 timeout "${TRAIN_S:-900}" "$PYTHON" examples/pytorch/train_qat.py --plot '' \
    --curve-precisions none --json "$LOGDIR/train_serial.json" ${TRAIN_ARGS:-} \
    >"$LOGDIR/train_serial.log" 2>"$LOGDIR/train_serial.err"
  rc=$?
  note "train_qat.py QBL_OVERLAP_WGRAD=0 ${TRAIN_ARGS:-} (rc $rc, $(secs $t) s): $(tail -n 1 "$LOGDIR/train_serial.err")"
  grep -E '^(##|\|)' "$LOGDIR/train_serial.log" | head -n 30
  [ "$rc" -eq 0 ] || tail -n 30 "$LOGDIR/train_serial.err"
fi

if has sharded; then
  gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  if [ "${gpus:-0}" -ge 2 ]; then
    t=$(date +%s)
    timeout "${SHARDED_S:-600}" "$PYTHON" -m torch.distributed.run --nproc-per-node "$gpus" \
      examples/pytorch/sharded_timing.py ${SHARDED_ARGS:-} >"$LOGDIR/sharded.log" 2>&1
    rc=$?
    note "sharded_timing.py on $gpus GPUs (rc $rc, $(secs $t) s)"
    grep -E '^(##|\|)' "$LOGDIR/sharded.log" | head -n 40
    [ "$rc" -eq 0 ] || tail -n 30 "$LOGDIR/sharded.log"
  else
    note "sharded_timing.py: NOT RUN (needs two GPUs, found ${gpus:-0})"
  fi
fi

if has bench; then
  t=$(date +%s)
  timeout "${BENCH_S:-900}" "$BUILD"/benchmarks/qbl_bench ${BENCH_ARGS:-} >"$LOGDIR/bench.log" 2>&1
  rc=$?
  note "qbl_bench ${BENCH_ARGS:-} (rc $rc, $(secs $t) s)"
fi

echo
echo "==== summary"
printf '%s\n' "${summary[@]}"

#!/usr/bin/env bash
# Plants one plausible bug at a time in a scratch copy of the repository and reports whether the
# test suite catches it (some test fails). A mutant that survives is a guarantee without a test
# that can fail.
#
#   tools/mutation_check.sh [--gpu | --python] [--list] [mutant ...]   (default: every mutant)
#   tools/mutation_check.sh --gpu --save-binaries DIR [mutant ...]   (build only, any machine)
#   tools/mutation_check.sh --run-saved DIR                          (run only, on a GPU)
#
# CPU mode (default): builds only the test binaries that test something without a GPU and runs
# them (their GPU tests skip); mutants of device-only code are listed as not run. --gpu (on a GPU
# machine): builds everything and runs the whole ctest with QBL_REQUIRE_GPU=1, for every mutant.
# --python: the PyTorch package's mutants (its CPU kernels and Python), each built with its CPU
# kernels alone (QBL_CPU_ONLY=1) into a folder of the scratch copy and checked by the pytest suite
# on the CPU, as CI's run checks them (needs torch; the CUDA tests skip).
#
# The scratch copy holds the working tree's tracked files and its untracked, not ignored ones
# (git ls-files --cached --others --exclude-standard), as they are now, edits included; the
# repository itself is never touched. The script stops if the unmutated copy does not pass; a
# mutant whose pattern no longer matches its file (the code moved on: update the mutant) or whose
# build fails is reported as such and fails the run, as a surviving mutant does.
#
# Environment: SCRATCH (default: a new temporary folder, removed at the end unless KEEP=1),
# JOBS (default: nproc), CUDA_ARCHS (default 90), CPU_TESTS (the CPU mode's binaries),
# CTEST_ARGS (extra ctest arguments in --gpu mode, e.g. "-E Huge"), MUTANT_S (time limit per
# mutant's test run in seconds, default 1800). GPU_TESTS (--gpu mode): build and run only these
# test binaries, each as GPU_SHARDS (default 4) gtest shards at once, instead of the whole ctest
# (ctest starts a process per test: most of its time is process and CUDA start-up).
# Split between machines (the builds take most of the time, and need no GPU): --save-binaries DIR
# (with --gpu and GPU_TESTS) builds the unmutated copy and every mutant and copies their GPU_TESTS
# binaries to DIR/baseline and DIR/<mutant>, running nothing; --run-saved DIR runs them on a GPU
# machine (baseline first: it must pass), with the same report.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
mode=cpu
list_only=0
save_dir=
run_dir=
wanted=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) mode=gpu ;;
    --python) mode=python ;;
    --list) list_only=1 ;;
    --save-binaries) save_dir=${2:?--save-binaries needs a folder}; shift ;;
    --run-saved) run_dir=${2:?--run-saved needs a folder}; mode=gpu; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) wanted+=("$1") ;;
  esac
  shift
done
if [ -n "$save_dir" ] && { [ $mode != gpu ] || [ -z "${GPU_TESTS:-}" ]; }; then
  echo "--save-binaries needs --gpu and GPU_TESTS (the binaries to save)" >&2; exit 2
fi
JOBS=${JOBS:-$(nproc)}
CPU_TESTS=${CPU_TESTS:-"test_element_math test_quant_blend_math test_quant_blend_backward test_quant_blend_linear_properties test_quant_blend_linear_backward test_activation"}

# ---- the mutants --------------------------------------------------------------------------
# name | where the code runs (host: also on the CPU, so CPU tests can catch it; device: only in
# kernels) | what it plants. Each m_<name> edits the scratch copy's include/ through
# subst FILE OLD NEW, a single-line sed replacement that must match.
mutants=(
  "round_half_away|host|round_half_even rounds half away from zero (roundf / std::round)"
  "abs_bits_drops_nan|host|abs_bits maps NaN to 0, so a max over it drops NaN like fmaxf"
  "amax_fmaxf|device|the amax kernel's max is fmaxf over floats (drops NaN)"
  "sigmoid_tanh|host|sigmoid = 0.5 + 0.5 * tanhf(0.5 * l)"
  "fake_quant_no_clamp|host|fake_quant without the clamp to [-127, 127]"
  "blend_fma|host|blend contracts alpha * x_q + (...) into fmaf"
  "scale_divides|host|scale = amax / 127 instead of amax * fl(1/127)"
  "one_minus_unrounded|host|1 - alpha not rounded to T"
  "grad_x_alpha|host|grad_x multiplies g by alpha instead of 1 - alpha"
  "grad_x_no_zero_term|host|grad_x drops the + 0/scale term (QuantGrad::zero)"
  "grad_logits_plain_sums|device|the backward's row sums are plain fp32 sums (no compensation)"
  "column_sum_half_rows|device|the bias gradient's column sum skips every other group of rows"
  "prologue_one_partial|device|the prologue's amax is the first amax block's maximum only"
  "relu_keeps_negative_zero|host|ReLU passes -0.0 through instead of giving +0.0 as eager's clamp_min"
  "gelu_pdf_grows|host|GELU's backward takes exp(+h^2 / 2) for the normal density"
  "gelu_tanh_backward_kappa|host|tanh-GELU's backward takes kappa for 3 * kappa in the inner derivative"
  "silu_backward_s|host|SiLU's backward takes 1 + h * s for 1 + h * (1 - s)"
  "cpu_amax_fmax|python|the CPU kernel's amax is a float max (std::fmax drops NaN), not the integer max of the bits"
  "cpu_blend_unrounded|python|the CPU kernel's blend skips rounding its products and sum to x's dtype"
  "all_reduce_amax_float_max|python|all_reduce_amax all-reduces the float amax with MAX, not its bits"
)

em=include/qbl/element_math.hpp
m_round_half_away() {
  subst $em 'return rintf(v);' 'return roundf(v);'
  subst $em 'return std::nearbyint(v);' 'return std::round(v);'
}
m_abs_bits_drops_nan() {
  subst $em 'abs_bits(float v) { return detail::float_bits(v) & 0x7fffffffu; }' \
            'abs_bits(float v) { return v != v ? 0u : detail::float_bits(v) \& 0x7fffffffu; }'
}
m_amax_fmaxf() {
  subst include/qbl/detail/amax.inl 'm = max(m, abs_bits_of(v.v\[j\]));' \
        'm = abs_bits(fmaxf(from_abs_bits(m), from_abs_bits(abs_bits_of(v.v[j]))));'
  subst include/qbl/detail/amax.inl 'm = max(m, abs_bits_of(x\[idx\]));' \
        'm = abs_bits(fmaxf(from_abs_bits(m), from_abs_bits(abs_bits_of(x[idx]))));'
}
m_sigmoid_tanh() {
  subst $em 'detail::div_rn(1.0f, detail::add_rn(1.0f, expf(-l)))' '0.5f + 0.5f * tanhf(0.5f * l)'
}
m_fake_quant_no_clamp() {
  subst $em 'detail::round_half_even(detail::round_to<T>(detail::div_rn(x, scale))), -qmax, qmax);' \
            'detail::round_half_even(detail::round_to<T>(detail::div_rn(x, scale))), -HUGE_VALF, HUGE_VALF);'
}
m_blend_fma() {
  subst $em 'detail::add_rn(detail::round_to<T>(detail::mul_rn(alpha, x_q)),' 'fmaf(alpha, x_q,'
}
m_scale_divides() {
  subst $em 'detail::mul_rn(clamped, inv_127)' 'detail::div_rn(clamped, qmax)'
}
m_one_minus_unrounded() {
  subst $em 'return detail::round_to<T>(detail::sub_rn(1.0f, alpha));' 'return detail::sub_rn(1.0f, alpha);'
}
m_grad_x_alpha() {
  subst $em 'const float direct = round_to<T>(mul_rn(g, one_minus_alpha));' \
            'const float direct = round_to<T>(mul_rn(g, alpha));'
}
m_grad_x_no_zero_term() {
  subst $em 'return round_to<T>(add_rn(other, direct));' \
            'return quant_grad == QuantGrad::straight_through ? round_to<T>(add_rn(other, direct)) : direct;'
}

bw=include/qbl/detail/quant_blend_backward.inl
m_grad_logits_plain_sums() {
  subst $bw 'low = fabsf(t) < INFINITY ? sub_rn(sub_rn(t, sum), y) : 0.0f;' 'low = 0.0f;'
}
m_column_sum_half_rows() {
  subst $bw 'r += column_sum_row_lanes \* R)' 'r += 2 * column_sum_row_lanes * R)'
}
m_prologue_one_partial() {
  subst include/qbl/detail/quant_blend.inl 'i < src.count; i += THREADS)' 'i < 1; i += THREADS)'
}

ac=include/qbl/activation.cuh
m_relu_keeps_negative_zero() {
  subst $ac 'return h != h ? h : (h > 0.0f ? h : 0.0f);' 'return h != h ? h : (h >= 0.0f ? h : 0.0f);'
}
m_gelu_pdf_grows() {
  subst $ac 'expf(mul_rn(mul_rn(-0.5f, h), h))' 'expf(mul_rn(mul_rn(0.5f, h), h))'
}
m_gelu_tanh_backward_kappa() {
  subst $ac 'fma_rn(three_kappa, sq, 1.0f)' 'fma_rn(kappa, sq, 1.0f)'
}
m_silu_backward_s() {
  subst $ac 'd\[1\] = fma_rn(h, sub_rn(1.0f, s), 1.0f);' 'd[1] = fma_rn(h, s, 1.0f);'
}

ck=python/csrc/cpu/cpu_kernels.cpp
m_cpu_amax_fmax() {
  subst $ck 'acc = std::max(acc, qbl::abs_bits(to_float(x\[i\])));' \
        'acc = qbl::abs_bits(std::fmax(qbl::from_abs_bits(acc), std::fabs(to_float(x[i]))));'
}
m_cpu_blend_unrounded() {
  subst $ck 'qbl::blend<X>(v, qbl::fake_quant<X>(v, scale), alpha, one_minus_alpha)' \
        'qbl::blend<float>(v, qbl::fake_quant<X>(v, scale), alpha, one_minus_alpha)'
}
m_all_reduce_amax_float_max() {
  subst python/qbl/_ops.py 'all_reduce(stats\[:1\].view(torch.int32), op=' 'all_reduce(stats[:1], op='
}

table() { awk -F'|' '{ printf "%-25s %-6s %s\n", $1, $2, $3; if (NF > 3) printf "%33s%s\n", "", $4 }'; }
if [ $list_only = 1 ]; then printf '%s\n' "${mutants[@]}" | table; exit 0; fi

# Runs the tests (the binaries in BIN, default the build's); returns non-zero when some test failed.
run_tests() {  # log [bin]
  local log=$1 bin=${2:-$build/tests} rc=0 t
  : >"$log"
  if [ $mode = python ]; then
    # From the copy's root (python/ would shadow the built package with its source folder).
    (cd "$src" && env -u QBL_REQUIRE_GPU PYTHONPATH="$scratch/site" timeout "${MUTANT_S:-1800}" \
       python3 -m pytest python/tests -q -x -p no:cacheprovider >"$log" 2>&1) || rc=1
  elif [ $mode = cpu ]; then
    for t in "${targets[@]}"; do
      env -u QBL_REQUIRE_GPU timeout "${MUTANT_S:-1800}" "$bin/$t" --gtest_color=no \
        >>"$log" 2>&1 || rc=1
    done
  elif [ ${#targets[@]} -gt 0 ]; then
    # Every binary's shards at once; each writes its own log, appended in order afterwards.
    local shards=${GPU_SHARDS:-4} pids=() i
    for t in "${targets[@]}"; do
      for ((i = 0; i < shards; i++)); do
        QBL_REQUIRE_GPU=1 GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
          timeout "${MUTANT_S:-1800}" "$bin/$t" --gtest_color=no >"$log.$t.$i" 2>&1 &
        pids+=($!)
      done
    done
    for i in "${pids[@]}"; do wait "$i" || rc=1; done
    for t in "${targets[@]}"; do
      for ((i = 0; i < shards; i++)); do cat "$log.$t.$i" >>"$log" && rm -f "$log.$t.$i"; done
    done
  else
    # shellcheck disable=SC2086
    QBL_REQUIRE_GPU=1 timeout "${MUTANT_S:-1800}" ctest --test-dir "$build" -j"${TEST_JOBS:-4}" \
      --timeout 900 -LE package --stop-on-failure ${CTEST_ARGS:-} >"$log" 2>&1 || rc=1
  fi
  return $rc
}

# "N failing: A, B, ..." -- the count and the first two names, from gtest's or ctest's summary.
failing_tests() {  # log
  local names n
  names=$({ grep -Eo '^\[  FAILED  \] [A-Za-z_][^ ,]*' "$1" | awk '{print $NF}'
            grep -Eo '^FAILED [^ ]+' "$1" | awk '{print $2}'
            grep -Eo '[0-9]+ - [^ ]+ \((Failed|Timeout|Exception|SEGFAULT|Subprocess aborted)\)' "$1" |
              awk '{print $3}'; } | sort -u)
  n=$(printf '%s\n' "$names" | grep -c . || true)
  echo "$n failing: $(printf '%s\n' "$names" | head -n 2 | paste -sd, - | sed 's/,/, /g')$([ "$n" -gt 2 ] && echo ", ...")"
}

# The table of results (global `results`), after a heading with `what` and the time since t0.
report() {  # what
  echo
  echo "==== mutants ($1, $(( $(date +%s) - t0 )) s)"
  { echo "mutant|code|result|bug"; printf '%s\n' "${results[@]}"; } | table
}

# ---- --run-saved: the binaries another machine built ---------------------------------------
if [ -n "$run_dir" ]; then
  [ -d "$run_dir/baseline" ] || { echo "no $run_dir/baseline: build with --save-binaries first" >&2; exit 2; }
  logs=$(mktemp -d "${TMPDIR:-/tmp}/qbl-mutants-logs.XXXXXX")
  targets=()
  for f in "$run_dir"/baseline/*; do [ -x "$f" ] && targets+=("$(basename "$f")"); done
  [ ${#targets[@]} -gt 0 ] || { echo "no binaries in $run_dir/baseline" >&2; exit 2; }
  echo "saved binaries: ${targets[*]}, logs: $logs"
  t0=$(date +%s)
  if ! run_tests "$logs/baseline-test.log" "$run_dir/baseline"; then
    echo "baseline FAILS ($(failing_tests "$logs/baseline-test.log")): $logs/baseline-test.log" >&2
    exit 1
  fi
  echo "baseline passes ($(( $(date +%s) - t0 )) s)"
  results=()
  survivors=0
  for entry in "${mutants[@]}"; do
    IFS='|' read -r name where what <<<"$entry"
    if [ ${#wanted[@]} -gt 0 ] && ! printf '%s\n' "${wanted[@]}" | grep -qx "$name"; then continue; fi
    [ -d "$run_dir/$name" ] || continue
    start=$(date +%s)
    if run_tests "$logs/$name-test.log" "$run_dir/$name"; then
      results+=("$name|$where|SURVIVED ($(( $(date +%s) - start )) s)|$what")
      survivors=$((survivors + 1))
    else
      results+=("$name|$where|caught, $(failing_tests "$logs/$name-test.log") ($(( $(date +%s) - start )) s)|$what")
    fi
    echo "${results[-1]}"
  done
  report "saved binaries"
  [ ${#results[@]} -gt 0 ] || { echo "no mutant's binaries in $run_dir" >&2; exit 1; }
  [ "$survivors" -eq 0 ]
  exit
fi

# ---- scratch copy and build -----------------------------------------------------------------
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
scratch=${SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/qbl-mutants.XXXXXX")}
[ -n "${SCRATCH:-}" ] || [ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$scratch"' EXIT
src=$scratch/src
build=$scratch/build
logs=$scratch/logs
mkdir -p "$src" "$logs"
( cd "$repo" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - ) | tar -xf - -C "$src"
echo "scratch copy: $src ($(find "$src" -type f | wc -l) files), logs: $logs, mode: $mode"

# subst FILE OLD NEW: OLD is a sed pattern (basic regex; the callers escape [ ] and &).
subst() {
  local f=$src/$1
  grep -q -- "$2" "$f" || { echo "mutant pattern not found in $1: $2" >&2; return 1; }
  sed -i "s|$2|$3|g" "$f"
}

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
[ $mode = python ] || cmake -S "$src" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" -DQBL_BUILD_EXAMPLES=OFF \
  -DQBL_BUILD_BENCHMARKS=OFF >"$logs/configure.log" 2>&1 ||
  { echo "configure failed: $logs/configure.log" >&2; exit 1; }

# The binaries run directly (CPU mode, or --gpu with GPU_TESTS); none: the whole ctest.
targets=()
wanted_binaries=$(case $mode in cpu) echo "$CPU_TESTS" ;; gpu) echo "${GPU_TESTS:-}" ;; esac)
for t in $wanted_binaries; do
  if grep -q "qbl_add_test($t " "$src/tests/CMakeLists.txt"; then
    targets+=("$t")
  else
    echo "no test binary $t in tests/CMakeLists.txt" >&2; exit 2
  fi
done
[ ${#targets[@]} -eq 0 ] || echo "test binaries: ${targets[*]}"

build_all() {  # log
  if [ $mode = python ]; then
    (cd "$src" && QBL_CPU_ONLY=1 MAX_JOBS=$JOBS python3 -m pip install --no-build-isolation \
       --no-deps --upgrade --target "$scratch/site" ./python >"$1" 2>&1)
  elif [ ${#targets[@]} -gt 0 ]; then
    cmake --build "$build" -j"$JOBS" --target "${targets[@]}" >"$1" 2>&1
  else
    cmake --build "$build" -j"$JOBS" >"$1" 2>&1
  fi
}

t0=$(date +%s)
# save NAME: copies the built GPU_TESTS binaries to save_dir/NAME (--save-binaries).
save() {
  rm -rf "${save_dir:?}/$1" && mkdir -p "$save_dir/$1" && for t in "${targets[@]}"; do cp "$build/tests/$t" "$save_dir/$1/"; done
}
echo "baseline (no mutant): building ..."
build_all "$logs/baseline-build.log" || { echo "baseline build failed: $logs/baseline-build.log" >&2; exit 1; }
if [ -n "$save_dir" ]; then
  save baseline
elif ! run_tests "$logs/baseline-test.log"; then
  echo "baseline FAILS ($(failing_tests "$logs/baseline-test.log")): fix that first; $logs/baseline-test.log" >&2
  exit 1
fi
[ -n "$save_dir" ] || echo "baseline passes ($(( $(date +%s) - t0 )) s)"

results=()
survivors=0
for entry in "${mutants[@]}"; do
  IFS='|' read -r name where what <<<"$entry"
  if [ ${#wanted[@]} -gt 0 ] && ! printf '%s\n' "${wanted[@]}" | grep -qx "$name"; then continue; fi
  if [ $mode = cpu ] && [ "$where" = device ]; then
    results+=("$name|$where|not run (device code: --gpu)|$what")
    continue
  fi
  if { [ $mode = python ] && [ "$where" != python ]; } || { [ $mode != python ] && [ "$where" = python ]; }; then
    results+=("$name|$where|not run ($([ "$where" = python ] && echo "the package: --python" || echo "the library: CPU or --gpu mode"))|$what")
    continue
  fi
  start=$(date +%s)
  # The sources a mutant edits (python/'s own, not its build folder), kept to be restored.
  for d in include python/csrc python/qbl; do
    rm -rf "$scratch/orig/$d" && mkdir -p "$scratch/orig/$d" && cp -r "$src/$d/." "$scratch/orig/$d"
  done
  if ! "m_$name"; then
    results+=("$name|$where|PATTERN NOT FOUND|$what")
    survivors=$((survivors + 1))
  elif ! build_all "$logs/$name-build.log"; then
    results+=("$name|$where|BUILD FAILED ($logs/$name-build.log)|$what")
    survivors=$((survivors + 1))
  elif [ -n "$save_dir" ]; then
    save "$name"
    results+=("$name|$where|built, saved to $save_dir/$name ($(( $(date +%s) - start )) s)|$what")
  elif run_tests "$logs/$name-test.log"; then
    results+=("$name|$where|SURVIVED ($(( $(date +%s) - start )) s)|$what")
    survivors=$((survivors + 1))
  else
    results+=("$name|$where|caught, $(failing_tests "$logs/$name-test.log") ($(( $(date +%s) - start )) s)|$what")
  fi
  # Restore with a new time stamp, so that the next build recompiles what the mutant touched.
  for d in include python/csrc python/qbl; do
    (cd "$scratch/orig/$d" && find . -type f) | while read -r f; do
      cmp -s "$scratch/orig/$d/$f" "$src/$d/$f" || cat "$scratch/orig/$d/$f" >"$src/$d/$f"
    done
  done
  echo "${results[-1]}"
done

report "$mode mode"
[ "$survivors" -eq 0 ]

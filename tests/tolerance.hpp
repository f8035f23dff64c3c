// The tests' error bounds for every GEMM-derived output (forward out, g_mixed, grad_weight,
// grad_bias), derived from the arithmetic element by element, in one place. Host-only.
//
// One output element is a dot product of k terms a_i * b_i accumulated in fp32, plus `extra`
// terms added to the same accumulator (the bias in the forward's epilogue, the old value with
// beta = 1), then rounded once to the output type T. Whatever the summation order (split-K, a
// tree, the fallback kernel's sequence) and with or without fused multiply-adds, the classical
// bound (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1) holds:
//
//   |acc - S| <= gamma_n * A,   gamma_n = n u / (1 - n u),   A = sum |a_i b_i| + sum |extra|,
//
// n = k + extra terms, u the accumulator's unit roundoff; then |RN_T(acc) - acc| <= u_T |acc|.
// Per arithmetic:
//   - fp32 (CUBLAS_COMPUTE_32F: IEEE FFMA on the CUDA cores, split-K partials reduced in fp32, and
//     qbl's fallback kernel): u = 2^-24, products of fp32 operands inside the FMA;
//   - bf16 / fp16 on the tensor cores: the products of 8- or 11-bit significands are exact in
//     fp32, the accumulation is fp32 but not documented as IEEE round-to-nearest within an MMA
//     (the hardware may align and truncate), so u = 2^-22 (4x fp32's) as a margin; u_T = 2^-8
//     (bf16) or 2^-11 (fp16). The epilogue may round the accumulator to T before it adds the
//     bias or the old value (cuBLASLt does not document the order; on an H200 some bf16
//     algorithms measured errors that only such a rounding explains, up to 2 ulp of a result
//     whose terms cancel): one more rounding, of at most u_T |acc| <= u_T A;
//   - TF32: the same tensor-core accumulation, and each operand first rounded to 10 fraction bits
//     (by whatever rule): at most 2^-10 of a normal operand, and 2^-136 -- ten bits below 2^-126 --
//     of a subnormal one, so each product carries |a| e(b) + e(a) |b| + e(a) e(b) of error before
//     the sum, e(v) = max(2^-10 |v|, 2^-136).
// Below the smallest normal number the arithmetic is absolute, not relative: each of the n
// additions may lose half of fp32's smallest subnormal spacing (2^-150), and the final rounding
// half of T's (2^-150, 2^-134, 2^-25). A float64 reference is itself within about n 2^-53 A of
// S: covered by the margin below.
//
// The bound is not a tolerance picked to make a run pass: it holds for every input, so a test that
// uses it cannot fail at random, whatever seed a run draws. It still catches what goes wrong in
// practice -- a wrong operand, transpose, bias, scale or accumulation moves an element by a
// sizeable fraction of A, against gamma_n ~ n 2^-24 (fp32) or n 2^-22 (16-bit).
#pragma once

#include "reference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace qbl_test {

/// How a GEMM computes: its accumulator, its operands' rounding and its output type.
struct GemmArithmetic {
  double u_acc = 0x1p-24;           ///< unit roundoff of the accumulation
  bool tf32 = false;                ///< operands rounded to TF32 before the products
  double u_out = 0x1p-24;           ///< unit roundoff of the rounding to the output type
  bool rounds_accumulator = false;  ///< the epilogue may round the accumulator to T first
  double eta_out = 0x1p-150;        ///< half the output type's smallest subnormal spacing

  /// The arithmetic of a GEMM whose operands and output are `t` (tf32: fp32 storage, TF32 mode).
  static GemmArithmetic of(DType t) {
    GemmArithmetic a;
    switch (t) {
      case DType::fp32:
        break;
      case DType::tf32:
        a.u_acc = 0x1p-22;
        a.tf32 = true;
        break;
      case DType::bf16:
        a.u_acc = 0x1p-22;
        a.u_out = 0x1p-8;
        a.rounds_accumulator = true;
        a.eta_out = 0x1p-134;
        break;
      case DType::fp16:
        a.u_acc = 0x1p-22;
        a.u_out = 0x1p-11;
        a.rounds_accumulator = true;
        a.eta_out = 0x1p-25;
        break;
    }
    return a;
  }
};

/// One output element's exact value, the sum of its terms' magnitudes, and the error TF32's
/// rounding of the operands can put into its products, in float64.
struct DotValue {
  double exact = 0.0;  ///< S = sum a_i b_i + extra
  double abs = 0.0;    ///< A = sum |a_i b_i| + sum |extra|
  double tf32 = 0.0;   ///< sum |a| e(b) + e(a) |b| + e(a) e(b) (see the top of this file)

  /// Adds the term a * b.
  void add(double a, double b) {
    const double p = a * b;
    exact += p;
    abs += std::fabs(p);
    const double ea = std::max(0x1p-10 * std::fabs(a), 0x1p-136);
    const double eb = std::max(0x1p-10 * std::fabs(b), 0x1p-136);
    tf32 += std::fabs(a) * eb + ea * std::fabs(b) + ea * eb;
  }
  /// Adds a term the accumulator takes as it is (the bias, the old value with beta = 1).
  void add_extra(double v) {
    exact += v;
    abs += std::fabs(v);
  }
};

/// The largest |computed - S| for one element of n = k + extra accumulated terms.
inline double dot_bound(const GemmArithmetic& ar, std::int64_t n, const DotValue& v) {
  const double nu = static_cast<double>(n) * ar.u_acc;
  const double gamma = nu / (1.0 - nu);
  const double operand = ar.tf32 ? v.tf32 : 0.0;
  const double acc_err = gamma * (v.abs + operand) + operand + static_cast<double>(n) * 0x1p-150;
  double bound = acc_err;
  if (ar.rounds_accumulator) bound += ar.u_out * (v.abs + acc_err) + ar.eta_out;
  bound += ar.u_out * (std::fabs(v.exact) + bound) + ar.eta_out;
  return bound * (1.0 + 0x1p-20) + static_cast<double>(n) * 0x1p-53 * v.abs;
}

/// Every element of `got` within dot_bound of the float64 value, NaN exactly where it is NaN, and
/// an infinity only where the value is that infinity or lies beyond the type's largest finite
/// number by more than the bound; on failure the first elements outside, with their bounds.
inline ::testing::AssertionResult within_dot_bounds(const GemmArithmetic& ar, std::int64_t n,
                                                    const std::vector<float>& got,
                                                    const std::vector<DotValue>& want,
                                                    const char* what, double max_finite = 3.4e38) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  std::size_t bad = 0;
  auto failure = ::testing::AssertionFailure();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const DotValue& w = want[i];
    const double g = got[i];
    bool ok;
    double bound = 0.0;
    if (std::isnan(w.exact) || std::isnan(w.abs)) {
      ok = std::isnan(g);
    } else if (std::isinf(w.exact) || std::isinf(w.abs)) {
      ok = !std::isfinite(g) || std::isinf(w.abs);  // an infinite term: any non-finite result
    } else {
      bound = dot_bound(ar, n, w);
      ok = std::isfinite(g) ? std::fabs(g - w.exact) <= bound
                            : !std::isnan(g) && std::fabs(w.exact) + bound > max_finite;
    }
    if (ok) continue;
    if (bad < 8)
      failure << "\n  " << what << "[" << i << "]: actual " << got[i] << ", float64 " << w.exact
              << " +- " << bound << " (sum of |terms| " << w.abs << ", n " << n << ")";
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure << "\n  " << bad << " of " << got.size() << " elements of " << what
                 << " outside the bound";
}

/// The largest finite value of a dtype (tf32 stores fp32).
inline double max_finite(DType t) {
  return t == DType::fp16 ? 65504.0
                          : (t == DType::bf16 ? 3.3895313892515355e38 : 3.4028234663852886e38);
}

// ---- the layer's products, in float64 with their terms' magnitudes ---------------------------

/// out[t, o] = sum_i a[t, i] w[o, i] (+ bias[o]): k = in terms (+1 with a bias).
inline std::vector<DotValue> linear_values(const std::vector<float>& a, const std::vector<float>& w,
                                           const float* bias, std::int64_t tokens, std::int64_t in,
                                           std::int64_t out) {
  std::vector<DotValue> r(static_cast<std::size_t>(tokens * out));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      DotValue v;
      if (bias != nullptr) v.add_extra(bias[o]);
      const float* ar = &a[t * in];
      const float* wr = &w[o * in];
      for (std::int64_t i = 0; i < in; ++i) v.add(ar[i], wr[i]);
      r[t * out + o] = v;
    }
  return r;
}

/// g_a[t, i] = sum_o g[t, o] w[o, i] (dgrad): k = out terms.
inline std::vector<DotValue> dgrad_values(const std::vector<float>& g, const std::vector<float>& w,
                                          std::int64_t tokens, std::int64_t in, std::int64_t out) {
  std::vector<DotValue> r(static_cast<std::size_t>(tokens * in));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      const double go = g[t * out + o];
      DotValue* row = &r[t * in];
      const float* wr = &w[o * in];
      for (std::int64_t i = 0; i < in; ++i) row[i].add(go, wr[i]);
    }
  return r;
}

/// g_w[o, i] = sum_t g[t, o] a[t, i] (+ old[o, i] with beta = 1): k = tokens terms (+1).
inline std::vector<DotValue> wgrad_values(const std::vector<float>& g, const std::vector<float>& a,
                                          const float* old, std::int64_t tokens, std::int64_t in,
                                          std::int64_t out) {
  std::vector<DotValue> r(static_cast<std::size_t>(out * in));
  if (old != nullptr)
    for (std::size_t j = 0; j < r.size(); ++j) r[j].add_extra(old[j]);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      const double go = g[t * out + o];
      DotValue* row = &r[o * in];
      const float* ar = &a[t * in];
      for (std::int64_t i = 0; i < in; ++i) row[i].add(go, ar[i]);
    }
  return r;
}

/// grad_bias[o] = sum_t g[t, o]: k = tokens terms (exact: a_i b_i = g * 1).
inline std::vector<DotValue> bias_grad_values(const std::vector<float>& g, std::int64_t tokens,
                                              std::int64_t out) {
  std::vector<DotValue> r(static_cast<std::size_t>(out));
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) r[o].add_extra(g[t * out + o]);
  return r;
}

/// grad_bias, and grad_bias accumulated into `old` as autograd does, RN_T(old + RN_T(sum)): the
/// sum's bound (fp32 accumulation, k = tokens terms: qbl's column sum sums in fp32) and its one
/// rounding to T, then the fp32 addition and the rounding of the result to T.
inline ::testing::AssertionResult bias_grad_within_bounds(DType t, std::int64_t tokens,
                                                          const std::vector<float>& got,
                                                          const std::vector<DotValue>& sums,
                                                          const float* old, const char* what) {
  GemmArithmetic sum = GemmArithmetic::of(t == DType::tf32 ? DType::fp32 : t);
  sum.u_acc = 0x1p-24;             // the column sum is an fp32 sum...
  sum.rounds_accumulator = false;  // ...rounded once to T
  std::size_t bad = 0;
  auto failure = ::testing::AssertionFailure();
  for (std::size_t o = 0; o < got.size(); ++o) {
    const double s_bound = dot_bound(sum, tokens, sums[o]);  // RN_T(sum) against S
    double want = sums[o].exact, bound = s_bound;
    if (old != nullptr) {
      want += old[o];
      bound = s_bound + (sum.u_out + 0x1p-24) * (std::fabs(want) + s_bound) + sum.eta_out;
    }
    if (std::fabs(got[o] - want) <= bound * (1.0 + 0x1p-20)) continue;
    if (bad < 8)
      failure << "\n  " << what << "[" << o << "]: actual " << got[o] << ", float64 " << want
              << " +- " << bound;
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure << "\n  " << bad << " of " << got.size() << " elements of " << what
                 << " outside the bound";
}

}  // namespace qbl_test

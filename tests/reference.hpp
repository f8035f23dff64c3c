// CPU references written independently of qbl/element_math.hpp: the forward's `mixed` and the
// backward's gradients, as PyTorch eager computes them op by op (each fp32 op done in double and
// rounded to float -- exact for one +, -, * or / of two floats -- then rounded to the dtype by a
// rounding that does not use CUDA's conversions), and float64 references for the products and
// sums whose order eager and qbl choose differently. Host-only; shared by every test of the layer.
#pragma once

#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace qbl_test {

/// Round a float to a binary format with `p` significand bits and minimum normal exponent `emin`,
/// ties to even, overflowing to infinity -- independent of CUDA's conversion functions.
inline float round_binary(float v, int p, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0f) return v;
  int e = 0;
  std::frexp(static_cast<double>(v), &e);  // |v| in [2^(e-1), 2^e)
  const int lsb = std::max(e - p, emin - p + 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(v), -lsb)), lsb);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<float>::infinity(), v);
  return static_cast<float>(r);
}
inline float ref_bf16(float v) { return round_binary(v, 8, -126, 3.3895313892515355e38); }
inline float ref_fp16(float v) { return round_binary(v, 11, -14, 65504.0); }

/// The element types and GEMM modes the tests draw from.
enum class DType { fp32, tf32, bf16, fp16 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::fp32:
      return "fp32";
    case DType::tf32:
      return "tf32";
    case DType::bf16:
      return "bf16";
    case DType::fp16:
      return "fp16";
  }
  return "?";
}

/// The storage dtype of an element type (float is fp32; TF32 is a GEMM mode of float).
template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::fp32
                                  : (std::is_same_v<T, __half> ? DType::fp16 : DType::bf16);
}

/// The three element types for typed tests, each named by its dtype ("fp32", "bf16", "fp16").
using AllTypes = ::testing::Types<float, __nv_bfloat16, __half>;
struct AllTypeNames {
  template <typename T>
  static std::string GetName(int) {
    return dtype_name(dtype_of<T>());
  }
};

/// v rounded to the dtype's storage format (tf32 stores fp32).
inline float ref_round(DType t, float v) {
  return t == DType::bf16 ? ref_bf16(v) : (t == DType::fp16 ? ref_fp16(v) : v);
}

/// Unit roundoff of the dtype's storage format (half an ulp at 1).
inline double unit_roundoff(DType t) {
  return t == DType::bf16 ? 0x1p-8 : (t == DType::fp16 ? 0x1p-11 : 0x1p-24);
}

/// One fp32 op (given exactly in double), rounded to float and then to the dtype, as eager stores
/// the result of an op.
inline float ref_op(DType t, double exact) { return ref_round(t, static_cast<float>(exact)); }

// ---- forward ----------------------------------------------------------------------------------

/// max |x| with NaN on top, as eager's max.
inline float reference_amax(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) {
    if (std::isnan(v)) return v;
    m = std::max(m, std::fabs(v));
  }
  return m;
}

/// eager's scale for that amax in the dtype: clamp(amax, 1e-8 rounded to the dtype), times
/// fl(1/127), rounded to the dtype.
inline float reference_scale(DType t, float amax) {
  const float bound = ref_round(t, 1e-8f);
  const float clamped = amax < bound ? bound : amax;
  return ref_op(t, static_cast<double>(clamped) * static_cast<double>(1.0f / 127.0f));
}

/// x_q = clamp(round_half_even(x / scale), -127, 127) * scale, each op rounded to the dtype.
inline float reference_fake_quant(DType t, float x, float scale) {
  float q = std::nearbyint(ref_op(t, static_cast<double>(x) / scale));
  q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);  // NaN stays NaN
  return ref_op(t, static_cast<double>(q) * scale);
}

/// eager's mixed for one element, op by op (each fp32 op rounded to its tensor's dtype), for x of
/// dtype `xt`, logits of `lt` and a GEMM of `gt` (PyTorch's autocast: fp32 x, a bf16 gate and a
/// bf16 GEMM): alpha is given (already rounded to `lt`), 1 - alpha is rounded to `lt`, x_q and
/// the blend to `xt` (the promoted type of every supported combination), and F.linear's cast of
/// `mixed` to the GEMM's dtype rounds once more.
inline float reference_mixed(DType xt, DType lt, DType gt, float x, float alpha, float scale) {
  const float xq = reference_fake_quant(xt, x, scale);
  const float oma = ref_op(lt, 1.0 - static_cast<double>(alpha));
  const float m = ref_op(xt, static_cast<double>(ref_op(xt, static_cast<double>(alpha) * xq)) +
                                 static_cast<double>(ref_op(xt, static_cast<double>(oma) * x)));
  return ref_round(gt, m);
}

/// One dtype throughout.
inline float reference_mixed(DType t, float x, float alpha, float scale) {
  return reference_mixed(t, t, t, x, alpha, scale);
}

/// eager's mixed [tokens, in] for x [tokens, in] (values of x's dtype) and the per-token alpha
/// (taken from the device's sigmoid in the logits' dtype, as eager's expf is the device's); amax
/// and scale (in x's dtype) returned too.
inline std::vector<float> reference_mixed(DType xt, DType lt, DType gt, const std::vector<float>& x,
                                          const std::vector<float>& alpha, std::int64_t tokens,
                                          std::int64_t in, float* amax = nullptr,
                                          float* scale = nullptr) {
  const float a = reference_amax(x);
  const float s = reference_scale(xt, a);
  if (amax != nullptr) *amax = a;
  if (scale != nullptr) *scale = s;
  std::vector<float> m(static_cast<std::size_t>(tokens * in));
  for (std::int64_t r = 0; r < tokens; ++r)
    for (std::int64_t i = 0; i < in; ++i)
      m[r * in + i] = reference_mixed(xt, lt, gt, x[r * in + i], alpha[r], s);
  return m;
}

/// One dtype throughout.
inline std::vector<float> reference_mixed(DType t, const std::vector<float>& x,
                                          const std::vector<float>& alpha, std::int64_t tokens,
                                          std::int64_t in, float* amax = nullptr,
                                          float* scale = nullptr) {
  return reference_mixed(t, t, t, x, alpha, tokens, in, amax, scale);
}

// ---- backward ---------------------------------------------------------------------------------
// The autograd of the reference module (/work/shared/reference/model.py) as eager rounds it, with
// g = g_mixed = dL/dmixed (the dgrad GEMM's output, values of the dtype).

/// dL/dx for one element. Zero gradient through the quantizer (the reference module):
/// RN(RN(g * RN(1 - alpha)) + 0 / scale) -- autograd adds the quantized branch's zero gradient,
/// torch.round's 0 through div's backward, 0 / scale: +0 for a positive scale (so -0 becomes +0),
/// +0 for an infinite one, NaN for a NaN or zero scale. Straight-through (ModelSTE):
/// RN(RN(g * alpha) + RN(g * RN(1 - alpha))).
inline float reference_grad_x(DType t, float g, float alpha, float scale, bool straight_through,
                              DType logits_t) {
  const float oma = ref_op(logits_t, 1.0 - static_cast<double>(alpha));
  const float direct = ref_op(t, static_cast<double>(g) * oma);
  const float other = straight_through ? ref_op(t, static_cast<double>(g) * alpha)
                                       : ref_op(t, 0.0 / static_cast<double>(scale));
  return ref_op(t, static_cast<double>(other) + static_cast<double>(direct));
}

/// One dtype throughout. (With logits of another dtype -- PyTorch's autocast -- 1 - alpha is
/// rounded to the logits' dtype and the products and sum to x's, the promoted type.)
inline float reference_grad_x(DType t, float g, float alpha, float scale, bool straight_through) {
  return reference_grad_x(t, g, alpha, scale, straight_through, t);
}

/// eager's sigmoid_backward after the two reductions, for grad_alpha = ga: RN(ga * (1 - alpha) *
/// alpha) in fp32 left to right, its 1 - alpha an fp32 op not rounded to the dtype.
inline float reference_sigmoid_backward(DType t, float ga, float alpha) {
  const float oma32 = static_cast<float>(1.0 - static_cast<double>(alpha));
  const float p = static_cast<float>(static_cast<double>(ga) * oma32);
  return ref_op(t, static_cast<double>(p) * alpha);
}

/// dL/dlogit for one token, as an interval that every summation order of eager's two fp32 sums
/// lands in, and its float64 value.
///
/// eager: sum_q = fp32 sum over the features of p_q = RN(g * x_q), sum_x likewise of p_x = RN(g *
/// x) (those products are elementwise, so the reference has their exact bits); grad_alpha =
/// RN(RN(sum_q) - RN(sum_x)); grad_logit = RN(grad_alpha * (1 - alpha) * alpha). Only the order
/// of the fp32 sums is free (qbl: lanes, then a butterfly; eager: its own reduction tree).
/// Bound: whatever the order, an fp32 sum of n terms is within E = (n - 1) * 2^-24 * sum |p| of
/// the exact sum S (each of the n - 1 additions errs by at most 2^-24 of a partial sum, and every
/// partial sum is at most sum |p|; additions with a subnormal result are exact). Every later step
/// -- the rounding of each sum to the dtype, the fp32 difference and its rounding, and the fp32
/// products by 1 - alpha >= 0 and alpha >= 0 and their rounding -- is a monotone function of the
/// sums (increasing in sum_q, decreasing in sum_x). So the result lies in [lo, hi], the same
/// steps applied to S_q - E_q, S_x + E_x and to S_q + E_q, S_x - E_x. That is as tight as a bound
/// valid for every order can be (it is the exact answer when E = 0, e.g. n = 1), and far from
/// vacuous: E / sum |p| is under 2^-24 * n, while dropping sum_x, or using alpha for 1 - alpha,
/// moves the result by about |sum_x| or |1 - 2 alpha| relative
/// (BackwardElementMath.GradLogitBoundHoldsEveryOrderAndRejectsMutants tests this).
struct GradLogitRef {
  bool nan = false;       ///< eager's result is NaN (a NaN term, x_q or alpha; inf - inf in L)
  bool overflow = false;  ///< a sum is infinite: the result is not finite, its value not checked
  /// Within the error bound a sum may or may not overflow (in the accumulator or in L): the
  /// result is not finite, or finite within [lo, hi] (the finite ends of the intervals).
  bool edge = false;
  float lo = 0, hi = 0;              ///< what any summation order gives
  float tight_lo = 0, tight_hi = 0;  ///< what qbl's compensated sums give (see below)
  double exact = 0;  ///< float64: (S_q - S_x) * (1 - alpha) * alpha, no rounding after the products

  /// Does qbl's `got` agree: NaN for NaN, not finite for an overflow, else within both intervals.
  bool admits(float got) const {
    if (nan) return std::isnan(got);
    if (overflow) return !std::isfinite(got);
    if (edge) return !std::isfinite(got) || (lo <= got && got <= hi);
    return lo <= got && got <= hi && tight_lo <= got && got <= tight_hi;
  }
  /// What admits() accepts, in words, with the float64 value.
  std::string expected() const {
    std::string e =
        nan        ? "NaN"
        : overflow ? "not finite"
        : edge ? "not finite, or within [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"
               : "[" + std::to_string(tight_lo) + ", " + std::to_string(tight_hi) + "] within [" +
                     std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return e + " (float64 " + std::to_string(exact) + ")";
  }
};

/// The interval above, for x of dtype `xt` and logits of `lt` (the products and sums in `xt`,
/// each reduced sum cast to `lt` before the difference, as autograd does under autocast), and a
/// tighter one for compensated sums: qbl's lanes each sum in Kahan's way (|error| <= 2u sum |p|
/// to first order, u = 2^-24), after a pairwise sum of at most eight terms per vector on the
/// 16-bit path (at most 3u sum |p| more), the lanes merged by exact two-sums, and the result
/// formed by one more rounding (u |S| <= u sum |p|): E = 6u sum |p| plus a second-order n u^2
/// term (2^-40 n sum |p| covers it with room). Not valid for a plain fp32 sum, whose error grows
/// with n.
inline GradLogitRef reference_grad_logit(DType xt, DType lt, const float* g, const float* x,
                                         std::int64_t n, float alpha, float scale) {
  double sq = 0, sx = 0, aq = 0, ax = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float xq = reference_fake_quant(xt, x[i], scale);
    const double pq = ref_op(xt, static_cast<double>(g[i]) * xq);
    const double px = ref_op(xt, static_cast<double>(g[i]) * x[i]);
    sq += pq;
    sx += px;
    aq += std::fabs(pq);
    ax += std::fabs(px);
  }
  GradLogitRef r;
  r.exact = (sq - sx) * (1.0 - static_cast<double>(alpha)) * alpha;
  if (std::isnan(sq) || std::isnan(sx) || std::isnan(alpha)) {
    r.nan = true;
    return r;
  }
  if (std::isinf(sq) || std::isinf(sx)) {
    r.overflow = true;
    return r;
  }
  // (The float64 sums themselves err by about n * 2^-53 * sum |p|: a 2^-50 margin covers that.)
  const double any = static_cast<double>(n - 1) * 0x1p-24 + static_cast<double>(n) * 0x1p-50;
  const double tight = 6 * 0x1p-24 + static_cast<double>(n) * 0x1p-40;
  auto steps = [&](double q, double xs) {
    const float rq = ref_round(lt, ref_op(xt, q)), rx = ref_round(lt, ref_op(xt, xs));
    const float ga = ref_op(lt, static_cast<double>(rq) - rx);
    return reference_sigmoid_backward(lt, ga, alpha);
  };
  r.lo = steps(sq - any * aq, sx + any * ax);
  r.hi = steps(sq + any * aq, sx - any * ax);
  r.tight_lo = steps(sq - tight * aq, sx + tight * ax);
  r.tight_hi = steps(sq + tight * aq, sx - tight * ax);
  // Sums finite in float64 can still overflow when rounded to the accumulator or to L (a 16-bit
  // L holds at most 65504 or so): inf - inf there is NaN, one infinite sum an infinite result.
  const float ends[4] = {r.lo, r.hi, r.tight_lo, r.tight_hi};
  int nans = 0, finite = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (float e : ends) {
    nans += std::isnan(e);
    if (std::isfinite(e)) ++finite, lo = std::min(lo, e), hi = std::max(hi, e);
  }
  if (nans == 4) {
    r.nan = true;
  } else if (finite == 0) {
    r.overflow = true;
  } else if (finite < 4) {
    r.edge = true, r.lo = lo, r.hi = hi;
  }
  return r;
}

/// One dtype throughout.
inline GradLogitRef reference_grad_logit(DType t, const float* g, const float* x, std::int64_t n,
                                         float alpha, float scale) {
  return reference_grad_logit(t, t, g, x, n, alpha, scale);
}

/// grad_bias[o] = sum_t g[t, o], in double, with sum_t |g[t, o]| for the error bound.
inline std::vector<double> bias_grad_reference(const std::vector<float>& g, std::int64_t tokens,
                                               std::int64_t out, std::vector<double>* abs_sum) {
  std::vector<double> r(static_cast<std::size_t>(out), 0.0);
  if (abs_sum != nullptr) abs_sum->assign(static_cast<std::size_t>(out), 0.0);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      r[o] += g[t * out + o];
      if (abs_sum != nullptr) (*abs_sum)[o] += std::fabs(g[t * out + o]);
    }
  return r;
}

}  // namespace qbl_test

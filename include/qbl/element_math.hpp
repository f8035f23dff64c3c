// qbl/element_math.hpp -- the per-element arithmetic, bit-for-bit what PyTorch eager computes.
//
// Every function here is __host__ __device__ under nvcc and a plain inline function under a C++
// compiler: the exact same expression is tested on the CPU and shared by host code (the PyTorch
// package's CPU kernels), and this header needs none of CUDA's headers. The template parameter T
// is the tensor dtype (float, __nv_bfloat16, __half -- or a host type with the conversions of
// qbl/detail/convert.hpp; float by default). Eager computes each op in fp32 and rounds its result
// to T, op by op; so does every function here (for T = float the rounding is the identity). Values
// of type T travel as the floats that hold them. Each product, quotient and sum is rounded on its
// own (no fused multiply-add): on the device through the __f*_rn intrinsics, which the compiler
// never contracts; on the host through plain IEEE arithmetic, so host code must not let the
// compiler contract it (build with -ffp-contract=off, as qbl's tests and the PyTorch package do:
// GCC's default contracts wherever the target has FMA, which every aarch64 target has).
//
//   float scale = qbl::scale_from_amax(amax);                 // clamp(amax, 1e-8) * fl(1/127)
//   float alpha = qbl::sigmoid(logit);                        // 1 / (1 + exp(-logit))
//   float m     = qbl::quant_blend_value(x, alpha, scale);     // mixed for one element
//
// The backward's element math follows the forward's (the autograd of the reference module, op by
// op as eager rounds it): grad_x_value, grad_product, grad_alpha_value, grad_logit_value.
//
// Eager on the CPU computes the same ops with two differences, both measured against eager: its
// `amax / 127.0` is a true division (scale_from_amax_cpu), where its CUDA kernel multiplies by
// fl(1/127); and its sigmoid (and activations) round an element differently in the vectorized body
// of a loop than in its scalar tail, so no element function reproduces them: the CPU kernels call
// eager's own. Everything else here is eager's CPU arithmetic too.
#pragma once

#include <qbl/detail/convert.hpp>
#include <qbl/detail/host_device.hpp>
#include <qbl/options.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace qbl {

/// Lower clamp of amax before it becomes a scale (eager: `amax.clamp(min=1e-8)`, 1e-8 as float).
inline constexpr float amax_floor = 1e-8f;

/// fl(1/127): eager computes `amax / 127.0` as `amax * (1.0f / 127.0f)` for a CPU scalar divisor.
inline constexpr float inv_127 = 1.0f / 127.0f;

/// Symmetric int8 range.
inline constexpr float qmax = 127.0f;

namespace detail {

QBL_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

QBL_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

QBL_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

QBL_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

/// a * b + c with one rounding (where eager's nvcc-compiled kernels contract a product into a sum).
QBL_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

/// Round to nearest integer, ties to even (torch.round == nearbyint in the default mode).
QBL_HOST_DEVICE float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

QBL_HOST_DEVICE std::uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
#endif
}

QBL_HOST_DEVICE float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

/// v rounded to the nearest T (ties to even), as a float: what eager stores after an fp32 op.
template <typename T>
QBL_HOST_DEVICE float round_to(float v) {
  return to_float(from_float<T>(v));
}

}  // namespace detail

/// The bits of |v| as an unsigned integer. For IEEE floats with the sign cleared, unsigned order is
/// numeric order, and every NaN orders above +Inf: an unsigned max over these bits is a max over
/// |x| that propagates NaN (which fmaxf and a float max would drop). -0.0 maps to 0.
QBL_HOST_DEVICE std::uint32_t abs_bits(float v) { return detail::float_bits(v) & 0x7fffffffu; }

/// The float whose bits `abs_bits` produced.
QBL_HOST_DEVICE float from_abs_bits(std::uint32_t bits) { return detail::bits_float(bits); }

/// clamp(v, lo, hi) as torch.clamp: NaN stays NaN.
QBL_HOST_DEVICE float clamp_keep_nan(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

/// clamp(amax, min=1e-8) with the bound rounded to T, as eager's clamp converts it: for __half
/// that is 0, so an all-zero x gives scale 0 and then NaN everywhere, as in eager. NaN stays NaN.
template <typename T = float>
QBL_HOST_DEVICE float clamp_amax(float amax) {
  const float bound = detail::round_to<T>(amax_floor);
  return amax < bound ? bound : amax;
}

/// scale = clamp(amax, min=1e-8) * fl(1/127), each step rounded to T (eager's CUDA kernel). NaN
/// stays NaN, +Inf stays +Inf.
template <typename T = float>
QBL_HOST_DEVICE float scale_from_amax(float amax) {
  return detail::round_to<T>(detail::mul_rn(clamp_amax<T>(amax), inv_127));
}

/// scale as eager computes it on the CPU: clamp(amax, min=1e-8) / 127, a true division rounded to
/// T (eager's CPU kernel divides by a scalar divisor where its CUDA kernel multiplies by the
/// reciprocal, scale_from_amax). The two differ for some amax.
template <typename T = float>
QBL_HOST_DEVICE float scale_from_amax_cpu(float amax) {
  return detail::round_to<T>(detail::div_rn(clamp_amax<T>(amax), qmax));
}

/// alpha = 1 / (1 + exp(-l)) with IEEE division, as torch.sigmoid: computed in fp32, rounded once
/// to T. On the device this is the CUDA math library's expf (what eager's kernel calls); the host's
/// expf may differ in the last place, so host-side references take alpha from the device.
template <typename T = float>
QBL_HOST_DEVICE float sigmoid(float l) {
  return detail::round_to<T>(detail::div_rn(1.0f, detail::add_rn(1.0f, expf(-l))));
}

/// 1 - alpha, rounded to T (eager's rsub).
template <typename T = float>
QBL_HOST_DEVICE float one_minus(float alpha) {
  return detail::round_to<T>(detail::sub_rn(1.0f, alpha));
}

/// x_q = clamp(round_half_even(x / scale), -127, 127) * scale, with true IEEE division; the
/// quotient and the product are rounded to T (the rounded code is an integer T holds exactly).
template <typename T = float>
QBL_HOST_DEVICE float fake_quant(float x, float scale) {
  const float q = clamp_keep_nan(
      detail::round_half_even(detail::round_to<T>(detail::div_rn(x, scale))), -qmax, qmax);
  return detail::round_to<T>(detail::mul_rn(q, scale));
}

/// mixed = (alpha * x_q) + ((1 - alpha) * x), three separate roundings (each to T).
/// `one_minus_alpha` is passed in so that a caller can compute it once per token.
template <typename T = float>
QBL_HOST_DEVICE float blend(float x, float x_q, float alpha, float one_minus_alpha) {
  return detail::round_to<T>(
      detail::add_rn(detail::round_to<T>(detail::mul_rn(alpha, x_q)),
                     detail::round_to<T>(detail::mul_rn(one_minus_alpha, x))));
}

/// mixed for one element, all steps.
template <typename T = float>
QBL_HOST_DEVICE float quant_blend_value(float x, float alpha, float scale) {
  return blend<T>(x, fake_quant<T>(x, scale), alpha, one_minus<T>(alpha));
}

// ---- backward -------------------------------------------------------------------------------
// With g = dL/dmixed for one element (g_mixed = grad_out · W, rounded to T by the GEMM):

namespace detail {

/// The quantized branch's share of dL/dx under QuantGrad::zero: torch.round's zero gradient
/// through div's backward, 0 / scale (+0, or NaN for a NaN or zero scale). One per launch.
QBL_HOST_DEVICE float zero_quant_grad(float scale) { return div_rn(0.0f, scale); }

/// grad_x_value with zero_quant_grad(scale) given.
template <typename T>
QBL_HOST_DEVICE float grad_x_from(float g, float alpha, float one_minus_alpha, float zero_grad,
                                  QuantGrad quant_grad) {
  const float direct = round_to<T>(mul_rn(g, one_minus_alpha));
  const float other =
      quant_grad == QuantGrad::straight_through ? round_to<T>(mul_rn(g, alpha)) : zero_grad;
  return round_to<T>(add_rn(other, direct));
}

}  // namespace detail

/// dL/dx for one element. QuantGrad::zero (the reference): the blend's direct part
/// RN_T(g * (1 - alpha)) plus what autograd adds from the quantized branch, torch.round's zero
/// gradient divided by the scale (div's backward): +0 for a positive scale, which turns a -0
/// gradient into +0, and NaN where the scale is NaN (NaN in x) or 0 (fp16's all-zero x).
/// QuantGrad::straight_through: RN_T(RN_T(g * alpha) + RN_T(g * (1 - alpha))), as ModelSTE's
/// autograd sums the two paths.
template <typename T = float>
QBL_HOST_DEVICE float grad_x_value(float g, float alpha, float one_minus_alpha, float scale,
                                   QuantGrad quant_grad = QuantGrad::zero) {
  return detail::grad_x_from<T>(g, alpha, one_minus_alpha, detail::zero_quant_grad(scale),
                                quant_grad);
}

/// One term of the per-token sums of grad_alpha: RN_T(g * v) for v = x_q or v = x (eager's
/// elementwise product in T, before its fp32-accumulated sum over the features).
template <typename T = float>
QBL_HOST_DEVICE float grad_product(float g, float v) {
  return detail::round_to<T>(detail::mul_rn(g, v));
}

/// dL/dalpha for one token from the two fp32 sums over its features, sum_q = sum_f RN_T(g * x_q)
/// and sum_x = sum_f RN_T(g * x): each sum rounded to T (eager's sum_to_size), then
/// RN_T(sum_q - sum_x) (the rsub's negated gradient added to the other).
///
/// With logits of another type L (PyTorch's autocast: a bf16 gate beside fp32 x), the products
/// and sums are in T (the blend's promoted type) and autograd casts each reduced sum to L before
/// the two meet: RN_L(RN_L(RN_T(sum_q)) - RN_L(RN_T(sum_x))).
template <typename T = float, typename L = T>
QBL_HOST_DEVICE float grad_alpha_value(float sum_q, float sum_x) {
  return detail::round_to<L>(detail::sub_rn(detail::round_to<L>(detail::round_to<T>(sum_q)),
                                            detail::round_to<L>(detail::round_to<T>(sum_x))));
}

/// dL/dlogit = sigmoid_backward(grad_alpha, alpha) as eager's kernel computes it: in fp32,
/// grad_alpha * (1 - alpha) * alpha left to right, rounded once to T (its 1 - alpha is not
/// rounded to T, unlike the forward's).
template <typename T = float>
QBL_HOST_DEVICE float grad_logit_value(float grad_alpha, float alpha) {
  return detail::round_to<T>(
      detail::mul_rn(detail::mul_rn(grad_alpha, detail::sub_rn(1.0f, alpha)), alpha));
}

}  // namespace qbl

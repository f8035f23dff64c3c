// qbl/activation.cuh -- the input activations a layer can apply to its input before it quantizes:
// the layer then computes Linear(blend(quant(act(x)))), forward and backward, without act(x) ever
// being stored.
//
//   qbl::ForwardPlan<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, qbl::Gelu> fwd(in, out, tokens);
//
// Each activation is a type (like CUTLASS's epilogue functors), chosen when a plan is made and
// inlined into the kernels: never a branch per element or per call. Its element functions are
// __host__ __device__ and compute what PyTorch eager's CUDA kernels compute, bit for bit on the
// device:
//   forward(h)       F.gelu(h) / F.gelu(h, approximate="tanh") / F.relu(h) / F.silu(h) in fp32
//                    (eager's opmath for float, bfloat16 and half), before the rounding to the
//                    tensor's type, which the caller does: act(h) = RN_T(forward(h))
//   backward(dy, h)  the activation's backward (gelu_backward, silu_backward, threshold_backward)
//                    in fp32 from the incoming gradient dy (a value of T) and the input h, before
//                    the rounding to T
//   both(dy, h, y, dh)  the two at once, sharing what both compute (erf, tanh, exp): the same
//                    bits as forward() and backward(), for the backward kernel that needs both
// GELU (both forms) and SiLU split their backward in two: prepare(h, y, d) computes forward(h)
// and the `terms` numbers d the backward needs of h alone, apply(dy, d) the rest, so that
// both() is exactly prepare() then apply(). The kernels keep prepare()'s results for every
// bfloat16 input of a range in a table in shared memory (qbl/detail/activation_table.cuh), made
// by the same device code, and look them up instead of evaluating erf, tanh or exp per element.
// Eager's kernels are compiled without fast math and with nvcc's default contraction of a
// product feeding a sum into one fused multiply-add; the expressions below are eager's, in the
// same order, with each rounding written out (__fmaf_rn where the compiled kernel fuses,
// __fmul_rn / __fadd_rn / __fdiv_rn where it does not), so the bits do not depend on the flags
// qbl is compiled with. Where a sum adds two products (gelu's cdf + h * pdf, the tanh form's
// left_derivative + right_derivative) eager's kernel fuses the first, 0.5 * (...), which is
// exact: a plain sum of the rounded second product, as measured against eager on an H200 over 4M
// float32 inputs. erff, expf and tanhf are the CUDA math library's, as in eager. The test suite
// checks every 16-bit value, and special and random float32 ones, against eager. On the host the
// same expressions run with the host's libm, whose erff / expf / tanhf may differ from CUDA's in
// the last place: host results are for tests with a tolerance, not for bit comparisons.
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>
#include <qbl/types.hpp>

#include <cmath>
#include <type_traits>

namespace qbl {

/// No activation: the layer quantizes its input itself.
struct Identity {
  static constexpr Activation kind = Activation::identity;
  static constexpr bool tabulated = false;
  QBL_HOST_DEVICE static float forward(float h) { return h; }
  QBL_HOST_DEVICE static float backward(float dy, float) { return dy; }
  QBL_HOST_DEVICE static void both(float dy, float h, float& y, float& dh) {
    y = h;
    dh = dy;
  }
};

namespace detail {

/// backward() and both() of an activation that has prepare(h, y, d) and apply(dy, d): both() is
/// prepare() then apply(), and backward() is both()'s gradient.
template <typename Act>
struct PreparedBackward {
  static constexpr bool tabulated = true;
  QBL_HOST_DEVICE static void both(float dy, float h, float& y, float& dh) {
    float d[Act::terms];
    Act::prepare(h, y, d);
    dh = Act::apply(dy, d);
  }
  QBL_HOST_DEVICE static float backward(float dy, float h) {
    float y, dh;
    both(dy, h, y, dh);
    return dh;
  }
};

}  // namespace detail

/// F.gelu(h) (approximate="none"): h * 0.5 * (1 + erf(h / sqrt(2))).
struct Gelu : detail::PreparedBackward<Gelu> {
  static constexpr Activation kind = Activation::gelu;
  static constexpr float alpha = static_cast<float>(0.70710678118654752440);  // M_SQRT1_2
  /// M_2_SQRTPI * M_SQRT1_2 * 0.5 in double, rounded once (eager's constexpr kBeta).
  static constexpr float beta =
      static_cast<float>(1.12837916709551257390 * 0.70710678118654752440 * 0.5);
  static constexpr int terms = 1;
  QBL_HOST_DEVICE static float forward(float h) {
    using namespace detail;
    return mul_rn(mul_rn(h, 0.5f), add_rn(1.0f, erff(mul_rn(h, alpha))));
  }
  /// forward(h), and d[0] = cdf + h * pdf with cdf = 0.5 * (1 + erf(h * alpha)),
  /// pdf = exp(-0.5 * h * h) * beta.
  QBL_HOST_DEVICE static void prepare(float h, float& y, float (&d)[terms]) {
    using namespace detail;
    const float one_plus_erf = add_rn(1.0f, erff(mul_rn(h, alpha)));
    y = mul_rn(mul_rn(h, 0.5f), one_plus_erf);
    const float cdf = mul_rn(0.5f, one_plus_erf);
    const float pdf = mul_rn(expf(mul_rn(mul_rn(-0.5f, h), h)), beta);
    d[0] = add_rn(cdf, mul_rn(h, pdf));
  }
  /// dy * (cdf + h * pdf).
  QBL_HOST_DEVICE static float apply(float dy, const float (&d)[terms]) {
    return detail::mul_rn(dy, d[0]);
  }
};

/// F.gelu(h, approximate="tanh"): 0.5 * h * (1 + tanh(beta * (h + kappa * h^3))).
struct GeluTanh : detail::PreparedBackward<GeluTanh> {
  static constexpr Activation kind = Activation::gelu_tanh;
  /// M_SQRT2 * M_2_SQRTPI * 0.5 in double, rounded once (eager's kBeta).
  static constexpr float beta =
      static_cast<float>(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
  static constexpr float kappa = static_cast<float>(0.044715);
  static constexpr float three_kappa = 3.0f * kappa;  // eager's opmath_t(3) * kKappa, in float
  static constexpr int terms = 1;
  QBL_HOST_DEVICE static float forward(float h) {
    using namespace detail;
    const float cube = mul_rn(mul_rn(h, h), h);
    const float inner = mul_rn(beta, fma_rn(kappa, cube, h));
    return mul_rn(mul_rn(0.5f, h), add_rn(1.0f, tanhf(inner)));
  }
  /// forward(h), and d[0] = left_derivative + right_derivative (eager's names).
  QBL_HOST_DEVICE static void prepare(float h, float& y, float (&d)[terms]) {
    using namespace detail;
    const float sq = mul_rn(h, h);
    const float cube = mul_rn(sq, h);  // forward()'s h * h * h
    const float inner = mul_rn(beta, fma_rn(kappa, cube, h));
    const float t = tanhf(inner);
    const float left = mul_rn(0.5f, h);
    const float right = add_rn(1.0f, t);
    y = mul_rn(left, right);
    const float left_derivative = mul_rn(0.5f, right);
    const float tanh_derivative = fma_rn(-t, t, 1.0f);
    const float inner_derivative = mul_rn(beta, fma_rn(three_kappa, sq, 1.0f));
    const float right_derivative = mul_rn(mul_rn(left, tanh_derivative), inner_derivative);
    d[0] = add_rn(left_derivative, right_derivative);
  }
  /// dy * (left_derivative + right_derivative).
  QBL_HOST_DEVICE static float apply(float dy, const float (&d)[terms]) {
    return detail::mul_rn(dy, d[0]);
  }
};

/// F.relu(h) = clamp_min(h, 0): NaN stays NaN, and every h <= 0, -0.0 included, gives +0.0 (as
/// eager's kernel gives it: its max(h, 0) returns the bound for -0.0). Its backward,
/// threshold_backward(dy, relu(h), 0), passes dy where the output is above 0 (or NaN).
struct Relu {
  static constexpr Activation kind = Activation::relu;
  static constexpr bool tabulated = false;  // a compare and a select: nothing to save
  QBL_HOST_DEVICE static float forward(float h) { return h != h ? h : (h > 0.0f ? h : 0.0f); }
  QBL_HOST_DEVICE static float backward(float dy, float h) {
    return forward(h) <= 0.0f ? 0.0f : dy;
  }
  QBL_HOST_DEVICE static void both(float dy, float h, float& y, float& dh) {
    y = forward(h);
    dh = y <= 0.0f ? 0.0f : dy;
  }
};

/// F.silu(h) = h / (1 + exp(-h)).
struct Silu : detail::PreparedBackward<Silu> {
  static constexpr Activation kind = Activation::silu;
  static constexpr int terms = 2;
  QBL_HOST_DEVICE static float forward(float h) {
    using namespace detail;
    return div_rn(h, add_rn(1.0f, expf(-h)));
  }
  /// forward(h), d[0] = s = 1 / (1 + exp(-h)) and d[1] = 1 + h * (1 - s).
  QBL_HOST_DEVICE static void prepare(float h, float& y, float (&d)[terms]) {
    using namespace detail;
    const float one_plus_exp = add_rn(1.0f, expf(-h));
    y = div_rn(h, one_plus_exp);
    const float s = div_rn(1.0f, one_plus_exp);
    d[0] = s;
    d[1] = fma_rn(h, sub_rn(1.0f, s), 1.0f);
  }
  /// dy * s * (1 + h * (1 - s)): silu_backward.
  QBL_HOST_DEVICE static float apply(float dy, const float (&d)[terms]) {
    using namespace detail;
    return mul_rn(mul_rn(dy, d[0]), d[1]);
  }
};

/// Every activation, for a binding's dispatch and the tests: qbl::Activation's values, in order.
using Activations = TypeList<Identity, Gelu, GeluTanh, Relu, Silu>;

namespace detail {
template <typename... A>
constexpr bool in_activation_order(TypeList<A...>) {
  int i = 0;
  bool ordered = true;
  ((ordered = ordered && static_cast<int>(A::kind) == i++), ...);
  return ordered && i == activation_count;
}
}  // namespace detail
static_assert(detail::in_activation_order(Activations{}),
              "qbl::Activations lists every qbl::Activation once, in the enum's order");

/// What the layer's kernels need to know of an activation beyond its element functions.
template <typename Act>
struct ActivationTraits {
  /// act(h) = h and its backward dy: nothing is evaluated or rounded, and grad_x needs no x.
  static constexpr bool identity = std::is_same_v<Act, Identity>;
  /// Does the gradient of the activation's input read that input (x)?
  static constexpr bool grad_x_reads_x = !identity;
};

/// act(h) for a value h of type T, rounded to T as eager stores it.
template <typename Act, typename T>
QBL_HOST_DEVICE float activate(float h) {
  if constexpr (ActivationTraits<Act>::identity) {
    return h;
  } else {
    return detail::round_to<T>(Act::forward(h));
  }
}

/// The activation's backward for the gradient dy (a value of T) at the input h, rounded to T.
template <typename Act, typename T>
QBL_HOST_DEVICE float activate_backward(float dy, float h) {
  if constexpr (ActivationTraits<Act>::identity) {
    return dy;
  } else {
    return detail::round_to<T>(Act::backward(dy, h));
  }
}

namespace detail {

/// Is Act one of qbl's activations?
template <typename Act>
inline constexpr bool is_activation = contains_type<Activations, Act>;

}  // namespace detail
}  // namespace qbl

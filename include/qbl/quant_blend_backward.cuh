// qbl/quant_blend_backward.cuh -- the quant-blend stage's backward on the device (the bias
// gradient, qbl::bias_grad, is in qbl/bias_grad.cuh, included here).
//
// Given g_mixed = dL/dmixed [tokens, features] (the layer's dgrad GEMM, grad_out · weight), the
// inputs of the forward and its scale, one launch computes
//   grad_x[r, c]   = grad_x_value(g_mixed[r, c], alpha_r, 1 - alpha_r, scale, quant_grad)
//   grad_logits[r] = grad_logit_value(grad_alpha_value(sum_c RN(g * x_q), sum_c RN(g * x)),
//   alpha_r)
// with alpha_r = sigmoid(logits[r]) and x_q = fake_quant(x, scale): the autograd of the reference
// module, op by op as eager rounds it (qbl/element_math.hpp). grad_x is bit-identical to eager's.
// The two sums over the features are compensated (each lane's terms in Kahan's summation, the
// lanes combined by exact two-sums in a fixed order): deterministic, and within a few units of
// fp32's last place of the exact sums whatever the row length, where eager's plain fp32
// reduction loses more as rows grow; so grad_logits differs from eager's only where eager's own
// sums err.
//
//   qbl::quant_blend_backward(d_g_mixed, d_x, d_logits, d_scale, d_grad_x, d_grad_logits,
//                             tokens, features, qbl::QuantGrad::zero, stream);
//
// Element types <X, G, L> as in qbl/quant_blend.cuh: x and grad_x of X, g_mixed of the GEMM's
// type G, logits and grad_logits of L -- one type, or fp32 x with a bf16/fp16 GEMM (PyTorch's
// autocast).
// x, g_mixed and grad_x are row-major and contiguous; any element alignment is accepted (16-byte
// vectors of x where all three allow them and a row is a whole number of vectors).
#pragma once

#include <qbl/activation.cuh>
#include <qbl/bias_grad.cuh>
#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>
#include <qbl/options.hpp>

#include <cstddef>
#include <cstdint>

namespace qbl {

/// grad_x and grad_logits of the quant-blend stage.
///
/// \param d_g_mixed      [tokens, features] dL/dmixed
/// \param d_x            [tokens, features] the forward's input (read for grad_logits, and for
///                       grad_x with an activation)
/// \param d_logits       [tokens] the forward's gate logits
/// \param d_scale        device scalar: the forward's scale (stats[1] of the layer's forward)
/// \param d_grad_x       [tokens, features] output, or nullptr (not wanted). Where G and X are
///                       one type it may be d_g_mixed itself (computed in place); it must not
///                       overlap anything else.
/// \param d_grad_logits  [tokens] output, or nullptr (not wanted)
/// \param quant_grad     the quantizer's gradient: the reference's zero, or straight-through
///
/// One kernel launch, no synchronization, no allocation. tokens == 0, or both outputs null,
/// launches nothing. Returns cudaErrorInvalidValue (nothing launched) for negative sizes or a
/// null input that a wanted output needs. The element types are x's (deduced from d_x), the
/// GEMM's and the logits' (both x's unless given: quant_blend_backward<float, __nv_bfloat16>
/// for fp32 x and logits with a bf16 g_mixed; with a null d_x, name X too). With an activation
/// Act (qbl/activation.cuh), x is the activation's input h, the sums use act(h) as the forward
/// did, and grad_x is the gradient of h: RN_X(act'(RN_X(grad_x), h)) -- then d_x is needed for
/// grad_x too.
template <typename X, typename G = X, typename L = X, typename Act = Identity>
cudaError_t quant_blend_backward(const detail::type_identity_t<G>* d_g_mixed, const X* d_x,
                                 const detail::type_identity_t<L>* d_logits, const float* d_scale,
                                 detail::type_identity_t<X>* d_grad_x,
                                 detail::type_identity_t<L>* d_grad_logits, std::int64_t tokens,
                                 std::int64_t features, QuantGrad quant_grad = QuantGrad::zero,
                                 cudaStream_t stream = nullptr);

}  // namespace qbl

#include <qbl/detail/quant_blend_backward.inl>

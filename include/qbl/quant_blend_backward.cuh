// qbl/quant_blend_backward.cuh -- the quant-blend stage's backward, on the device.
//
// Given g_mixed = dL/dmixed [tokens, features] (the layer's dgrad GEMM, grad_out · weight), the
// inputs of the forward and its scale, one launch computes
//   grad_x[r, c]   = grad_x_value(g_mixed[r, c], alpha_r, 1 - alpha_r, scale, quant_grad)
//   grad_logits[r] = grad_logit_value(grad_alpha_value(sum_c RN_T(g * x_q), sum_c RN_T(g * x)),
//   alpha_r)
// with alpha_r = sigmoid(logits[r]) and x_q = fake_quant(x, scale): the autograd of the reference
// module, op by op as eager rounds it (qbl/element_math.cuh). grad_x is bit-identical to eager's;
// grad_logits differs from eager's only by the order of the two fp32 sums over the features.
//
//   qbl::quant_blend_backward(d_g_mixed, d_x, d_logits, d_scale, d_grad_x, d_grad_logits,
//                             tokens, features, qbl::QuantGrad::zero, stream);
//
// x, g_mixed and grad_x are row-major and contiguous; any element alignment is accepted (16-byte
// vectors where all three allow them and a row is a whole number of vectors).
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/element_math.cuh>
#include <qbl/options.hpp>

#include <cstdint>

namespace qbl {

/// grad_x and grad_logits of the quant-blend stage.
///
/// \param d_g_mixed      [tokens, features] dL/dmixed
/// \param d_x            [tokens, features] the forward's input (read only for grad_logits)
/// \param d_logits       [tokens] the forward's gate logits
/// \param d_scale        device scalar: the forward's scale (QuantBlendLinear's stats[1])
/// \param d_grad_x       [tokens, features] output, or nullptr (not wanted). May be d_g_mixed
///                       itself (computed in place); must not overlap anything else.
/// \param d_grad_logits  [tokens] output, or nullptr (not wanted)
/// \param quant_grad     the quantizer's gradient: the reference's zero, or straight-through
///
/// One kernel launch, no synchronization, no allocation. tokens == 0, or both outputs null,
/// launches nothing. Returns cudaErrorInvalidValue (nothing launched) for negative sizes or a
/// null input that a wanted output needs.
template <typename T>
cudaError_t quant_blend_backward(const T* d_g_mixed, const T* d_x, const T* d_logits,
                                 const float* d_scale, T* d_grad_x, T* d_grad_logits,
                                 std::int64_t tokens, std::int64_t features,
                                 QuantGrad quant_grad = QuantGrad::zero,
                                 cudaStream_t stream = nullptr);

/// grad_bias[o] = sum over tokens of grad_out[t, o]: fp32 accumulation in a fixed order
/// (deterministic), rounded once to T; with `accumulate`, grad_bias[o] = RN_T(grad_bias[o] + that)
/// as autograd accumulates a parameter's .grad. grad_out [tokens, outs] row-major. tokens == 0
/// launches nothing. One launch, no synchronization.
template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate = false, cudaStream_t stream = nullptr);

}  // namespace qbl

#include <qbl/detail/quant_blend_backward.inl>

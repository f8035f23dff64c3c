// qbl/quant_blend.cuh -- the fused fake-quantize + per-token blend, on the device.
//
// Stage 2 of the layer: for every token row r and feature c,
//   mixed[r, c] = alpha_r * fake_quant(x[r, c], scale) + (1 - alpha_r) * x[r, c],
//   alpha_r = sigmoid(logits[r]),  scale = clamp(amax, 1e-8) * fl(1/127),
// each step rounded exactly as PyTorch eager rounds it (qbl/element_math.hpp).
//
//   qbl::amax(d_x, tokens * features, d_amax, stream);
//   qbl::quant_blend(d_x, d_logits, d_amax, d_mixed, tokens, features, d_scale, stream);
//   // or both stages, with no memset and the blend's loads issued before it waits for the max:
//   qbl::amax_quant_blend(d_x, d_logits, d_mixed, tokens, features, d_amax, d_scale, d_workspace,
//                         stream);
//
// Element types: x, logits and mixed of one type (float, __nv_bfloat16, __half), or fp32 x with
// a bf16 or fp16 `mixed` and logits in fp32 or in mixed's type -- what PyTorch's autocast hands
// a layer (fp32 activations, a bf16 gate) and the GEMM type it wants. Then alpha and 1 - alpha
// are rounded to the logits' type, the blend runs in fp32 and `mixed` is rounded once to its
// type: eager's `mixed.to(bf16)` under autocast, bit for bit.
//
// x, logits and mixed are row-major and contiguous; any element alignment is accepted. 16-byte
// vector accesses of x are used when x is 16-byte aligned, mixed aligned to as many of its
// elements and a row is a whole number of vectors; otherwise the kernel runs element by element.
#pragma once

#include <qbl/activation.cuh>
#include <qbl/amax.cuh>
#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>

#include <cstddef>
#include <cstdint>

namespace qbl {

/// mixed = blend of x and fake_quant(x, scale(*d_amax)) with alpha = sigmoid(logits), per token.
///
/// \param d_x        [tokens, features] input
/// \param d_logits   [tokens] gate logits
/// \param d_amax     device scalar max |x| (from qbl::amax); read on the device, never copied back
/// \param d_mixed    [tokens, features] output; must not overlap d_x
/// \param d_scale    optional device scalar that receives the scale used (nullptr: not written)
///
/// One kernel launch, no synchronization. tokens == 0 launches nothing. The element types are
/// x's (deduced), mixed's and the logits' (both x's unless given: quant_blend<float, __nv_bfloat16>
/// for fp32 x and logits into a bf16 mixed). With an activation Act (qbl/activation.cuh), x is
/// the activation's input and the stage blends act(x), rounded to X; d_amax is max |act(x)|.
template <typename X, typename G = X, typename L = X, typename Act = Identity>
cudaError_t quant_blend(const X* d_x, const detail::type_identity_t<L>* d_logits,
                        const float* d_amax, detail::type_identity_t<G>* d_mixed,
                        std::int64_t tokens, std::int64_t features, float* d_scale = nullptr,
                        cudaStream_t stream = nullptr);

/// Both stages: *d_amax = max |x|, *d_scale = its scale, d_mixed as in quant_blend.
///
/// Inputs of at most `amax_quant_blend_single_block_elements` elements run as one single-block
/// launch (the amax stays in shared memory); larger ones as an amax kernel that writes one
/// maximum per block into `d_workspace` and the quant-blend kernel, launched as its programmatic
/// dependent (Hopper and later: it issues its loads of x before it waits for the amax kernel),
/// which combines them. Nothing is memset and the workspace needs no initialization:
/// `amax_quant_blend_workspace_bytes` bytes, 4-byte aligned, not shared with concurrent work.
/// Element types and activation as quant_blend's.
template <typename X, typename G = X, typename L = X, typename Act = Identity>
cudaError_t amax_quant_blend(const X* d_x, const detail::type_identity_t<L>* d_logits,
                             detail::type_identity_t<G>* d_mixed, std::int64_t tokens,
                             std::int64_t features, float* d_amax, float* d_scale,
                             void* d_workspace, cudaStream_t stream = nullptr);

/// Largest tokens * features that amax_quant_blend handles in a single one-block launch.
inline constexpr std::int64_t amax_quant_blend_single_block_elements = std::int64_t{1} << 15;

/// Workspace of amax_quant_blend: one 4-byte maximum per block of the amax kernel (at most 1024).
inline constexpr std::size_t amax_quant_blend_workspace_bytes = 4096;

}  // namespace qbl

#include <qbl/detail/quant_blend.inl>

// qbl/quant_blend.cuh -- the fused fake-quantize + per-token blend, on the device.
//
// Stage 2 of the layer: for every token row r and feature c,
//   mixed[r, c] = alpha_r * fake_quant(x[r, c], scale) + (1 - alpha_r) * x[r, c],
//   alpha_r = sigmoid(logits[r]),  scale = clamp(amax, 1e-8) * fl(1/127),
// each step rounded exactly as PyTorch eager rounds it (qbl/element_math.cuh).
//
//   qbl::amax(d_x, tokens * features, d_amax, stream);
//   qbl::quant_blend(d_x, d_logits, d_amax, d_mixed, tokens, features, d_scale, stream);
//   // or both stages, as one launch for small inputs:
//   qbl::amax_quant_blend(d_x, d_logits, d_mixed, tokens, features, d_amax, d_scale, stream);
//
// x, logits and mixed are row-major and contiguous; any element alignment is accepted. 16-byte
// vector accesses are used when x and mixed are 16-byte aligned and a row is a whole number of
// vectors; otherwise the kernel runs element by element.
#pragma once

#include <qbl/amax.cuh>
#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.cuh>

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
/// One kernel launch, no synchronization. tokens == 0 launches nothing.
template <typename T>
cudaError_t quant_blend(const T* d_x, const T* d_logits, const float* d_amax, T* d_mixed,
                        std::int64_t tokens, std::int64_t features, float* d_scale = nullptr,
                        cudaStream_t stream = nullptr);

/// Both stages: *d_amax = max |x|, *d_scale = its scale, d_mixed as in quant_blend.
///
/// Inputs of at most `amax_quant_blend_single_block_elements` elements run as one single-block
/// launch (the amax stays in shared memory); larger ones as qbl::amax then qbl::quant_blend.
template <typename T>
cudaError_t amax_quant_blend(const T* d_x, const T* d_logits, T* d_mixed, std::int64_t tokens,
                             std::int64_t features, float* d_amax, float* d_scale,
                             cudaStream_t stream = nullptr);

/// Largest tokens * features that amax_quant_blend handles in a single one-block launch.
inline constexpr std::int64_t amax_quant_blend_single_block_elements = std::int64_t{1} << 15;

}  // namespace qbl

#include <qbl/detail/quant_blend.inl>

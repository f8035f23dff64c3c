// Kernels and launcher bodies for qbl/quant_blend_backward.cuh.
#pragma once

#include <qbl/detail/quant_blend_math.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.cuh>
#include <qbl/quant_blend_backward.cuh>

#include <cstdint>

namespace qbl::detail {

inline constexpr int backward_block_threads = 256;
inline constexpr int backward_rows_per_block = backward_block_threads / 32;  // a warp per row

/// One warp per token row: each lane takes every 32nd vector of the row, computes grad_x for it
/// and its share of the two sums, and the warp adds the shares in a fixed butterfly order, so the
/// result is deterministic. grad_x may alias g_mixed (each element is read before the same
/// thread writes it), so neither carries __restrict__.
template <typename T, int N>
QBL_KERNEL void __launch_bounds__(backward_block_threads)
    quant_blend_backward_kernel(const T* g_mixed, const T* __restrict__ x,
                                const T* __restrict__ logits, const float* __restrict__ scale_in,
                                T* grad_x, T* __restrict__ grad_logits, std::int64_t tokens,
                                std::int64_t features, QuantGrad mode) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * backward_rows_per_block +
                           threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= tokens) return;
  const float scale = *scale_in;
  const float alpha = sigmoid<T>(to_float(logits[row]));
  const float one_minus_alpha = one_minus<T>(alpha);
  const float zero_grad = zero_quant_grad(scale);
  const float y = code_reciprocal(scale);
  const std::int64_t cols = features / N;
  const auto* gv = reinterpret_cast<const Vec<T, N>*>(g_mixed + row * features);
  const auto* xv = reinterpret_cast<const Vec<T, N>*>(x + row * features);
  auto* dv = reinterpret_cast<Vec<T, N>*>(grad_x + row * features);
  float sum_q = 0.0f, sum_x = 0.0f;
  for (std::int64_t c = lane; c < cols; c += 32) {
    const Vec<T, N> g = gv[c];
    if (grad_logits != nullptr) {
      const Vec<T, N> xin = xv[c];
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float gj = to_float(g.v[j]), xj = to_float(xin.v[j]);
        sum_q = add_rn(sum_q, grad_product<T>(gj, fake_quant_from_reciprocal<T>(xj, scale, y)));
        sum_x = add_rn(sum_x, grad_product<T>(gj, xj));
      }
    }
    if (grad_x != nullptr) {
      Vec<T, N> out;
#pragma unroll
      for (int j = 0; j < N; ++j)
        out.v[j] = from_float<T>(grad_x_from<T>(to_float(g.v[j]), alpha, one_minus_alpha, zero_grad, mode));
      dv[c] = out;
    }
  }
  if (grad_logits == nullptr) return;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum_q = add_rn(sum_q, __shfl_xor_sync(0xffffffffu, sum_q, offset));
    sum_x = add_rn(sum_x, __shfl_xor_sync(0xffffffffu, sum_x, offset));
  }
  if (lane == 0) grad_logits[row] = from_float<T>(grad_logit_value<T>(grad_alpha_value<T>(sum_q, sum_x), alpha));
}

template <typename T, int N>
cudaError_t launch_quant_blend_backward(const T* g_mixed, const T* x, const T* logits,
                                        const float* scale, T* grad_x, T* grad_logits,
                                        std::int64_t tokens, std::int64_t features, QuantGrad mode,
                                        cudaStream_t stream) {
  const std::int64_t blocks = ceil_div<std::int64_t>(tokens, backward_rows_per_block);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  quant_blend_backward_kernel<T, N><<<static_cast<unsigned>(blocks), backward_block_threads, 0, stream>>>(
      g_mixed, x, logits, scale, grad_x, grad_logits, tokens, features, mode);
  return cudaGetLastError();
}

inline constexpr int bias_grad_cols = 32;   // columns per block, one per lane
inline constexpr int bias_grad_rows = 32;   // row lanes per block, each summing every 32nd row

/// grad_bias[c] for 32 columns per block: 32 row lanes sum every 32nd row of their column in
/// fp32, then lane 0 adds the 32 partial sums in order. Deterministic.
template <typename T>
QBL_KERNEL void __launch_bounds__(bias_grad_cols* bias_grad_rows)
    bias_grad_kernel(const T* __restrict__ g, T* __restrict__ grad_bias, std::int64_t tokens,
                     std::int64_t outs, bool accumulate) {
  __shared__ float partial[bias_grad_rows][bias_grad_cols + 1];
  const int tx = static_cast<int>(threadIdx.x) % bias_grad_cols;
  const int ty = static_cast<int>(threadIdx.x) / bias_grad_cols;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * bias_grad_cols + tx;
  float s = 0.0f;
  if (c < outs)
    for (std::int64_t r = ty; r < tokens; r += bias_grad_rows) s = add_rn(s, to_float(g[r * outs + c]));
  partial[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || c >= outs) return;
  float total = partial[0][tx];
  for (int r = 1; r < bias_grad_rows; ++r) total = add_rn(total, partial[r][tx]);
  float v = round_to<T>(total);
  if (accumulate) v = add_rn(to_float(grad_bias[c]), v);
  grad_bias[c] = from_float<T>(v);
}

/// grad_bias[c] = RN_T(grad_bias[c] + add[c]): autograd's accumulation of a parameter gradient.
template <typename T>
QBL_KERNEL void accumulate_kernel(T* __restrict__ grad_bias, const T* __restrict__ add, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) grad_bias[i] = from_float<T>(add_rn(to_float(grad_bias[i]), to_float(add[i])));
}

template <typename T>
cudaError_t accumulate_into(T* d_dst, const T* d_add, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return n == 0 ? cudaSuccess : cudaErrorInvalidValue;
  const std::int64_t blocks = ceil_div<std::int64_t>(n, 256);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  accumulate_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(d_dst, d_add, n);
  return cudaGetLastError();
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
cudaError_t quant_blend_backward(const T* d_g_mixed, const T* d_x, const T* d_logits,
                                 const float* d_scale, T* d_grad_x, T* d_grad_logits,
                                 std::int64_t tokens, std::int64_t features, QuantGrad quant_grad,
                                 cudaStream_t stream) {
  if (tokens < 0 || features <= 0) return cudaErrorInvalidValue;
  if (tokens == 0 || (d_grad_x == nullptr && d_grad_logits == nullptr)) return cudaSuccess;
  if (d_g_mixed == nullptr || d_logits == nullptr || d_scale == nullptr ||
      (d_grad_logits != nullptr && d_x == nullptr))
    return cudaErrorInvalidValue;
  constexpr int N = detail::vec16<T>;
  const bool vec = features % N == 0 && detail::is_aligned(d_g_mixed, 16) &&
                   (d_grad_logits == nullptr || detail::is_aligned(d_x, 16)) &&
                   (d_grad_x == nullptr || detail::is_aligned(d_grad_x, 16));
  return vec ? detail::launch_quant_blend_backward<T, N>(d_g_mixed, d_x, d_logits, d_scale, d_grad_x,
                                                         d_grad_logits, tokens, features, quant_grad,
                                                         stream)
             : detail::launch_quant_blend_backward<T, 1>(d_g_mixed, d_x, d_logits, d_scale, d_grad_x,
                                                         d_grad_logits, tokens, features, quant_grad,
                                                         stream);
}

template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate, cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr) return cudaErrorInvalidValue;
  const std::int64_t blocks = detail::ceil_div<std::int64_t>(outs, detail::bias_grad_cols);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  detail::bias_grad_kernel<T><<<static_cast<unsigned>(blocks),
                                detail::bias_grad_cols * detail::bias_grad_rows, 0, stream>>>(
      d_grad_out, d_grad_bias, tokens, outs, accumulate);
  return cudaGetLastError();
}

}  // namespace qbl

// Kernels and launcher bodies for qbl/quant_blend_backward.cuh.
#pragma once

#include <qbl/detail/quant_blend_math.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.cuh>
#include <qbl/quant_blend_backward.cuh>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace qbl::detail {

inline constexpr int backward_block_threads = 256;
inline constexpr int backward_rows_per_block = backward_block_threads / 32;  // a warp per row

/// The backward's vector arithmetic for element type T and width N, given one row's gate and the
/// launch's scale: `sums` adds a vector's RN_T(g * x_q) and RN_T(g * x) to the two fp32 sums in
/// element order, `grad_x` is grad_x_from for each element. The general case runs
/// qbl/element_math.cuh element by element (with the division-free code of
/// fake_quant_from_reciprocal).
template <typename T, int N, typename Enable = void>
struct QuantBlendGradMath {
  float scale, y, alpha, one_minus_alpha, zero_grad;
  QuantGrad mode;
  __device__ __forceinline__ QuantBlendGradMath(float s, float a, float oma, QuantGrad m)
      : scale(s),
        y(code_reciprocal(s)),
        alpha(a),
        one_minus_alpha(oma),
        zero_grad(zero_quant_grad(s)),
        mode(m) {}
  __device__ __forceinline__ void sums(const Vec<T, N>& g, const Vec<T, N>& x, float& sum_q,
                                       float& sum_x) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float gj = to_float(g.v[j]), xj = to_float(x.v[j]);
      sum_q = add_rn(sum_q, grad_product<T>(gj, fake_quant_from_reciprocal<T>(xj, scale, y)));
      sum_x = add_rn(sum_x, grad_product<T>(gj, xj));
    }
  }
  __device__ __forceinline__ Vec<T, N> grad_x(const Vec<T, N>& g) const {
    Vec<T, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j)
      out.v[j] =
          from_float<T>(grad_x_from<T>(to_float(g.v[j]), alpha, one_minus_alpha, zero_grad, mode));
    return out;
  }
};

/// bf16 / fp16 vectors of an even width: the forward's codes (QuantBlendMath::codes), then every
/// product and sum on packed pairs with one rounding each -- eager's fp32-then-round bits for T
/// operands (the forward's argument; test_quant_blend_math checks all 2^32 operand pairs of the
/// packed product and sum) -- and the fp32 sums from the exact widened products, in element order.
template <typename T, int N>
struct QuantBlendGradMath<T, N, std::enable_if_t<(N > 1 && N % 2 == 0 && sizeof(T) == 2)>> {
  using P = Pair<T>;
  using T2 = typename P::type;
  static constexpr int pairs = N / 2;
  QuantBlendMath<T, N> forward;
  T2 alpha2, one_minus_alpha2, zero_grad2;
  QuantGrad mode;
  __device__ __forceinline__ QuantBlendGradMath(float s, float a, float oma, QuantGrad m)
      : alpha2(P::broadcast(a)),
        one_minus_alpha2(P::broadcast(oma)),
        zero_grad2(P::broadcast(zero_quant_grad(s))),
        mode(m) {
    forward.set_scale(s);
  }
  __device__ __forceinline__ void sums(const Vec<T, N>& g, const Vec<T, N>& x, float& sum_q,
                                       float& sum_x) const {
    T2 code[pairs], g2[pairs], x2[pairs];
    forward.codes(x, code);
    std::memcpy(g2, &g, sizeof g2);
    std::memcpy(x2, &x, sizeof x2);
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const float2 q = P::to_float2(P::mul(g2[p], P::mul(code[p], forward.scale2)));
      const float2 v = P::to_float2(P::mul(g2[p], x2[p]));
      sum_q = add_rn(add_rn(sum_q, q.x), q.y);
      sum_x = add_rn(add_rn(sum_x, v.x), v.y);
    }
  }
  __device__ __forceinline__ Vec<T, N> grad_x(const Vec<T, N>& g) const {
    T2 g2[pairs], r[pairs];
    std::memcpy(g2, &g, sizeof g2);
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const T2 direct = P::mul(g2[p], one_minus_alpha2);
      r[p] =
          P::add(mode == QuantGrad::straight_through ? P::mul(g2[p], alpha2) : zero_grad2, direct);
    }
    Vec<T, N> out;
    std::memcpy(&out, r, sizeof out);
    return out;
  }
};

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
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * backward_rows_per_block + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= tokens) return;
  const std::int64_t cols = features / N;
  const auto* gv = reinterpret_cast<const Vec<T, N>*>(g_mixed) + row * cols;
  // Issue the first loads before the gate's exp and the scale's reciprocal.
  Vec<T, N> g_first, x_first;
  if (lane < cols) {
    g_first = gv[lane];
    if (grad_logits != nullptr) x_first = reinterpret_cast<const Vec<T, N>*>(x)[row * cols + lane];
  }
  const float alpha = sigmoid<T>(to_float(logits[row]));
  const QuantBlendGradMath<T, N> math(*scale_in, alpha, one_minus<T>(alpha), mode);
  float sum_q = 0.0f, sum_x = 0.0f;
  for (std::int64_t c = lane; c < cols; c += 32) {
    const Vec<T, N> g = c == lane ? g_first : gv[c];
    if (grad_logits != nullptr) {
      math.sums(g, c == lane ? x_first : reinterpret_cast<const Vec<T, N>*>(x)[row * cols + c],
                sum_q, sum_x);
    }
    if (grad_x != nullptr) reinterpret_cast<Vec<T, N>*>(grad_x)[row * cols + c] = math.grad_x(g);
  }
  if (grad_logits == nullptr) return;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum_q = add_rn(sum_q, __shfl_xor_sync(0xffffffffu, sum_q, offset));
    sum_x = add_rn(sum_x, __shfl_xor_sync(0xffffffffu, sum_x, offset));
  }
  if (lane == 0)
    grad_logits[row] = from_float<T>(grad_logit_value<T>(grad_alpha_value<T>(sum_q, sum_x), alpha));
}

template <typename T, int N>
cudaError_t launch_quant_blend_backward(const T* g_mixed, const T* x, const T* logits,
                                        const float* scale, T* grad_x, T* grad_logits,
                                        std::int64_t tokens, std::int64_t features, QuantGrad mode,
                                        cudaStream_t stream) {
  const std::int64_t blocks = ceil_div<std::int64_t>(tokens, backward_rows_per_block);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  quant_blend_backward_kernel<T, N>
      <<<static_cast<unsigned>(blocks), backward_block_threads, 0, stream>>>(
          g_mixed, x, logits, scale, grad_x, grad_logits, tokens, features, mode);
  return cudaGetLastError();
}

inline constexpr int bias_grad_cols = 32;  // columns per block, one per lane
inline constexpr int bias_grad_rows = 32;  // row lanes per block, each summing every 32nd row

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
    for (std::int64_t r = ty; r < tokens; r += bias_grad_rows)
      s = add_rn(s, to_float(g[r * outs + c]));
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
QBL_KERNEL void accumulate_kernel(T* __restrict__ grad_bias, const T* __restrict__ add,
                                  std::int64_t n) {
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
  return vec ? detail::launch_quant_blend_backward<T, N>(d_g_mixed, d_x, d_logits, d_scale,
                                                         d_grad_x, d_grad_logits, tokens, features,
                                                         quant_grad, stream)
             : detail::launch_quant_blend_backward<T, 1>(d_g_mixed, d_x, d_logits, d_scale,
                                                         d_grad_x, d_grad_logits, tokens, features,
                                                         quant_grad, stream);
}

template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate, cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr) return cudaErrorInvalidValue;
  const std::int64_t blocks = detail::ceil_div<std::int64_t>(outs, detail::bias_grad_cols);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  detail::bias_grad_kernel<T>
      <<<static_cast<unsigned>(blocks), detail::bias_grad_cols * detail::bias_grad_rows, 0,
         stream>>>(d_grad_out, d_grad_bias, tokens, outs, accumulate);
  return cudaGetLastError();
}

}  // namespace qbl

// The GEMM for what cuBLASLt does not serve: out = a · wᵀ + bias with any sizes and any element
// alignment (on an H200: bf16/fp16 operands whose rows are an odd number of elements, bf16
// pointers aligned to 2 bytes). A plain shared-memory-tiled CUDA-core kernel, fp32 accumulation
// in a fixed order (deterministic), the bias added to the fp32 sum before the one rounding to T,
// as cuBLASLt's bias epilogue does. Correct everywhere; fast nowhere: the layer uses it only where
// cuBLASLt has no algorithm.
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>

#include <cstdint>

namespace qbl::detail {

inline constexpr int fallback_tile = 32;          // tokens x outputs per block, and the k step
inline constexpr int fallback_threads = 256;      // 32 outputs x 8 token rows, 4 tokens each
inline constexpr int fallback_rows = fallback_threads / fallback_tile;

template <typename T>
QBL_KERNEL void __launch_bounds__(fallback_threads)
    linear_fallback_kernel(const T* __restrict__ a, const T* __restrict__ w,
                           const T* __restrict__ bias, T* __restrict__ out, std::int64_t tokens,
                           std::int64_t in, std::int64_t outs) {
  constexpr int tile = fallback_tile, per_thread = tile / fallback_rows;
  // +1 column: the inner loop reads w_tile down a column, a_tile along a row (broadcast).
  __shared__ float a_tile[tile][tile + 1];
  __shared__ float w_tile[tile][tile + 1];
  const int tx = static_cast<int>(threadIdx.x) % tile, ty = static_cast<int>(threadIdx.x) / tile;
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.x) * tile;
  const std::int64_t o0 = static_cast<std::int64_t>(blockIdx.y) * tile;
  float acc[per_thread] = {};
  for (std::int64_t k0 = 0; k0 < in; k0 += tile) {
    const std::int64_t k = k0 + tx;
#pragma unroll
    for (int r = 0; r < per_thread; ++r) {
      const int row = ty + r * fallback_rows;
      const std::int64_t t = t0 + row, o = o0 + row;
      a_tile[row][tx] = t < tokens && k < in ? to_float(a[t * in + k]) : 0.0f;
      w_tile[row][tx] = o < outs && k < in ? to_float(w[o * in + k]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < tile; ++kk) {
      const float wv = w_tile[tx][kk];
#pragma unroll
      for (int r = 0; r < per_thread; ++r) acc[r] = fmaf(a_tile[ty + r * fallback_rows][kk], wv, acc[r]);
    }
    __syncthreads();
  }
  const std::int64_t o = o0 + tx;
  if (o >= outs) return;
  const float b = bias != nullptr ? to_float(bias[o]) : 0.0f;
#pragma unroll
  for (int r = 0; r < per_thread; ++r) {
    const std::int64_t t = t0 + ty + r * fallback_rows;
    // Without a bias the sum is stored as is (adding +0 would turn a -0 sum into +0).
    if (t < tokens) out[t * outs + o] = from_float<T>(bias != nullptr ? __fadd_rn(acc[r], b) : acc[r]);
  }
}

/// out[tokens, outs] = a[tokens, in] · w[outs, in]ᵀ (+ bias[outs]) on `stream`; any alignment of
/// sizeof(T). One launch, no synchronization.
template <typename T>
cudaError_t linear_fallback(const T* a, const T* w, const T* bias, T* out, std::int64_t tokens,
                            std::int64_t in, std::int64_t outs, cudaStream_t stream) {
  if (tokens < 0 || in <= 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const std::int64_t grid_x = ceil_div<std::int64_t>(tokens, fallback_tile);
  const std::int64_t grid_y = ceil_div<std::int64_t>(outs, fallback_tile);
  if (grid_x > 0x7fffffff || grid_y > 65535) return cudaErrorInvalidValue;
  linear_fallback_kernel<T><<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)),
                              fallback_threads, 0, stream>>>(a, w, bias, out, tokens, in, outs);
  return cudaGetLastError();
}

}  // namespace qbl::detail

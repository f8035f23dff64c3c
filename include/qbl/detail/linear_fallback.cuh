// The GEMM for what cuBLASLt does not serve: any sizes and any element alignment (on an H200:
// bf16/fp16 operands whose rows are an odd number of elements, bf16 pointers aligned to 2 bytes
// with a bias). One strided product serves the layer's three,
//   d[r, c] = sum_k A(r, k) * B(c, k)  (+ bias[c])  (+ d[r, c] when accumulating),
// A(r, k) = a[r * a_rs + k * a_ks], B(c, k) = b[c * b_cs + k * b_ks], d row-major [rows, cols]:
//   forward  out[t, o]  = sum_i mixed[t, i] w[o, i] + bias[o]   (a_rs = in,  b_cs = in)
//   dgrad    g_a[t, i]  = sum_o g[t, o] w[o, i]                 (a_rs = out, b_cs = 1, b_ks = in)
//   wgrad    g_w[o, i] += sum_t g[t, o] mixed[t, i]             (a_ks = out, b_cs = 1, b_ks = in)
// A plain shared-memory-tiled CUDA-core kernel, fp32 accumulation in a fixed order
// (deterministic), the bias and the old value added to the fp32 sum before the one rounding to T,
// as cuBLASLt's epilogue and beta do. Correct everywhere; fast nowhere: qbl::GemmPlan runs it only
// where cuBLASLt has no algorithm, with the strides derived from its spec.
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>

#include <cstdint>

namespace qbl::detail {

inline constexpr int fallback_tile = 32;      // rows x cols per block, and the k step
inline constexpr int fallback_threads = 256;  // 32 cols x 8 row groups, 4 rows each
inline constexpr int fallback_rows = fallback_threads / fallback_tile;

/// Strides of the two operands of the fallback product (see the top of this file).
struct FallbackGemm {
  std::int64_t rows, cols, k;
  std::int64_t a_rs, a_ks, b_cs, b_ks;
};

template <typename T>
QBL_KERNEL void __launch_bounds__(fallback_threads)
    gemm_fallback_kernel(const T* __restrict__ a, const T* __restrict__ b,
                         const T* __restrict__ bias, T* __restrict__ d, FallbackGemm g,
                         bool accumulate) {
  constexpr int tile = fallback_tile, per_thread = tile / fallback_rows;
  // +1 column: the inner loop reads b_tile down a column, a_tile along a row (broadcast).
  __shared__ float a_tile[tile][tile + 1];
  __shared__ float b_tile[tile][tile + 1];
  const int tx = static_cast<int>(threadIdx.x) % tile, ty = static_cast<int>(threadIdx.x) / tile;
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.x) * tile;
  const std::int64_t c0 = static_cast<std::int64_t>(blockIdx.y) * tile;
  float acc[per_thread] = {};
  for (std::int64_t k0 = 0; k0 < g.k; k0 += tile) {
    const std::int64_t k = k0 + tx;
#pragma unroll
    for (int i = 0; i < per_thread; ++i) {
      const int row = ty + i * fallback_rows;
      const std::int64_t r = r0 + row, c = c0 + row;
      a_tile[row][tx] = r < g.rows && k < g.k ? to_float(a[r * g.a_rs + k * g.a_ks]) : 0.0f;
      b_tile[row][tx] = c < g.cols && k < g.k ? to_float(b[c * g.b_cs + k * g.b_ks]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < tile; ++kk) {
      const float bv = b_tile[tx][kk];
#pragma unroll
      for (int i = 0; i < per_thread; ++i)
        acc[i] = fmaf(a_tile[ty + i * fallback_rows][kk], bv, acc[i]);
    }
    __syncthreads();
  }
  const std::int64_t c = c0 + tx;
  if (c >= g.cols) return;
  const float bv = bias != nullptr ? to_float(bias[c]) : 0.0f;
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const std::int64_t r = r0 + ty + i * fallback_rows;
    if (r >= g.rows) continue;
    // Without a bias the sum is stored as is (adding +0 would turn a -0 sum into +0).
    float v = bias != nullptr ? __fadd_rn(acc[i], bv) : acc[i];
    if (accumulate) v = __fadd_rn(v, to_float(d[r * g.cols + c]));
    d[r * g.cols + c] = from_float<T>(v);
  }
}

/// The fallback product on `stream`; any alignment of sizeof(T). One launch, no synchronization.
template <typename T>
cudaError_t gemm_fallback(const T* a, const T* b, const T* bias, T* d, const FallbackGemm& g,
                          bool accumulate, cudaStream_t stream) {
  if (g.rows < 0 || g.cols <= 0 || g.k <= 0) return cudaErrorInvalidValue;
  if (g.rows == 0) return cudaSuccess;
  const std::int64_t grid_x = ceil_div<std::int64_t>(g.rows, fallback_tile);
  const std::int64_t grid_y = ceil_div<std::int64_t>(g.cols, fallback_tile);
  if (grid_x > 0x7fffffff || grid_y > 65535) return cudaErrorInvalidValue;
  gemm_fallback_kernel<T><<<dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)),
                            fallback_threads, 0, stream>>>(a, b, bias, d, g, accumulate);
  return cudaGetLastError();
}

}  // namespace qbl::detail

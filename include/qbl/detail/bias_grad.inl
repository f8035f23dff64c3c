// Kernels and launcher bodies for qbl/bias_grad.cuh: the bias gradient's column sums.
#pragma once

#include <qbl/bias_grad.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>

#include <algorithm>
#include <cstdint>

namespace qbl::detail {

inline constexpr int column_sum_threads = 256;
inline constexpr int column_sum_lanes = 32;  ///< column vectors per block (one warp's width)
inline constexpr int column_sum_row_lanes = column_sum_threads / column_sum_lanes;
inline constexpr int column_sum_rows_in_flight = 8;  ///< rows each thread loads before adding
inline constexpr int column_sum_max_splits = 64;     ///< row ranges (bias_grad_workspace_bytes)
static_assert(qbl::bias_grad_workspace_bytes(1) == column_sum_max_splits * sizeof(float),
              "bias_grad_workspace_bytes must hold column_sum_max_splits partial sums per column");

/// Row ranges for a column sum of [rows, cols] in vectors of N on `sms` multiprocessors: enough
/// blocks for about four per multiprocessor, each range at least 64 rows (one pass of eight rows
/// per row lane), at most column_sum_max_splits; 1 without a workspace.
inline int column_sum_splits(std::int64_t rows, std::int64_t cols, int n, int sms, bool workspace) {
  if (!workspace || rows <= 0) return 1;
  const std::int64_t col_blocks =
      ceil_div<std::int64_t>(ceil_div<std::int64_t>(cols, n), column_sum_lanes);
  const std::int64_t want = ceil_div<std::int64_t>(std::int64_t{sms} * 4, col_blocks);
  return static_cast<int>(std::clamp<std::int64_t>(
      std::min<std::int64_t>(want, ceil_div<std::int64_t>(rows, 64)), 1, column_sum_max_splits));
}

/// Column sums of g [rows, cols] over the rows of range blockIdx.y (of gridDim.y equal ranges):
/// 32 lanes of N consecutive columns each, 8 row lanes taking every 8th row (4 rows' loads in
/// flight), fp32 sums combined over the row lanes in order. One range: the result, rounded to T
/// (and accumulated); several: fp32 partials[range][col] for column_sum_finish.
template <typename T, int N>
QBL_KERNEL void __launch_bounds__(column_sum_threads)
    column_sum_kernel(const T* __restrict__ g, std::int64_t rows, std::int64_t cols,
                      float* __restrict__ partials, T* __restrict__ out, bool accumulate) {
  __shared__ float shared[column_sum_row_lanes][column_sum_lanes * N];
  const int lane = static_cast<int>(threadIdx.x % column_sum_lanes);
  const int row_lane = static_cast<int>(threadIdx.x / column_sum_lanes);
  const std::int64_t col0 =
      (static_cast<std::int64_t>(blockIdx.x) * column_sum_lanes + lane) * N;  // first column
  const std::int64_t per_range = ceil_div<std::int64_t>(rows, gridDim.y);
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * per_range;
  const std::int64_t r1 = r0 + per_range < rows ? r0 + per_range : rows;
  float acc[N] = {};
  if (col0 < cols) {
    constexpr int R = column_sum_rows_in_flight;
    for (std::int64_t r = r0 + row_lane; r < r1; r += column_sum_row_lanes * R) {
      Vec<T, N> v[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const std::int64_t rr = r + k * column_sum_row_lanes;
        if (rr < r1) v[k] = *reinterpret_cast<const Vec<T, N>*>(g + rr * cols + col0);
      }
#pragma unroll
      for (int k = 0; k < R; ++k) {
        if (r + k * column_sum_row_lanes >= r1) break;
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = add_rn(acc[j], to_float(v[k].v[j]));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) shared[row_lane][lane * N + j] = acc[j];
  __syncthreads();
  // Thread i of the block finishes columns i, i + 256, ... of the block's 32 * N.
  for (int k = static_cast<int>(threadIdx.x); k < column_sum_lanes * N; k += column_sum_threads) {
    const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * column_sum_lanes * N + k;
    if (c >= cols) continue;
    float total = shared[0][k];
    for (int r = 1; r < column_sum_row_lanes; ++r) total = add_rn(total, shared[r][k]);
    if (gridDim.y > 1) {
      partials[static_cast<std::int64_t>(blockIdx.y) * cols + c] = total;
    } else {
      float v = round_to<T>(total);
      if (accumulate) v = add_rn(to_float(out[c]), v);
      out[c] = from_float<T>(v);
    }
  }
}

/// out[c] = RN_T(sum over ranges of partials[range][c]) (and accumulated): one warp per column,
/// lane l adding ranges l, l + 32 in order, the lanes combined in a fixed butterfly --
/// deterministic, and one round trip to L2 instead of one per range.
inline constexpr int column_sum_finish_threads = 256;

template <typename T>
QBL_KERNEL void __launch_bounds__(column_sum_finish_threads)
    column_sum_finish_kernel(const float* __restrict__ partials, int splits, std::int64_t cols,
                             T* __restrict__ out, bool accumulate) {
  const std::int64_t c =
      static_cast<std::int64_t>(blockIdx.x) * (column_sum_finish_threads / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (c >= cols) return;
  float total = 0.0f;
  for (int s = lane; s < splits; s += 32) total = add_rn(total, partials[s * cols + c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    total = add_rn(total, __shfl_xor_sync(0xffffffffu, total, offset));
  if (lane != 0) return;
  float v = round_to<T>(total);
  if (accumulate) v = add_rn(to_float(out[c]), v);
  out[c] = from_float<T>(v);
}

template <typename T, int N>
cudaError_t launch_column_sum_kernels(const T* g, T* out, std::int64_t rows, std::int64_t cols,
                                      bool accumulate, float* partials, int splits,
                                      cudaStream_t stream) {
  const std::int64_t col_blocks =
      ceil_div<std::int64_t>(ceil_div<std::int64_t>(cols, N), column_sum_lanes);
  if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  column_sum_kernel<T, N>
      <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits)), column_sum_threads,
         0, stream>>>(g, rows, cols, partials, out, accumulate);
  QBL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (splits == 1) return cudaSuccess;
  const std::int64_t blocks = ceil_div<std::int64_t>(cols, column_sum_finish_threads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  column_sum_finish_kernel<T>
      <<<static_cast<unsigned>(blocks), column_sum_finish_threads, 0, stream>>>(
          partials, splits, cols, out, accumulate);
  return cudaGetLastError();
}

/// qbl::bias_grad with the multiprocessor count given (the backward plan asks for it once).
template <typename T>
cudaError_t launch_bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens,
                             std::int64_t outs, bool accumulate, void* d_workspace, int sms,
                             cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr) return cudaErrorInvalidValue;
  if (d_workspace != nullptr && !is_aligned(d_workspace, sizeof(float)))
    return cudaErrorInvalidValue;
  constexpr int V = vec16<T>;
  const bool vec = outs % V == 0 && is_aligned(d_grad_out, 16);
  const int n = vec ? V : 1;
  const int splits = column_sum_splits(tokens, outs, n, sms, d_workspace != nullptr);
  auto* partials = static_cast<float*>(d_workspace);
  return vec ? launch_column_sum_kernels<T, V>(d_grad_out, d_grad_bias, tokens, outs, accumulate,
                                               partials, splits, stream)
             : launch_column_sum_kernels<T, 1>(d_grad_out, d_grad_bias, tokens, outs, accumulate,
                                               partials, splits, stream);
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate, void* d_workspace, cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr ||
      (d_workspace != nullptr && !detail::is_aligned(d_workspace, sizeof(float))))
    return cudaErrorInvalidValue;  // before any CUDA call
  int sms = 0;
  QBL_CUDA_RETURN_IF_ERROR(detail::sm_count(&sms));
  return detail::launch_bias_grad(d_grad_out, d_grad_bias, tokens, outs, accumulate, d_workspace,
                                  sms, stream);
}

}  // namespace qbl

// A float32 buffer cast to a 16-bit GEMM type (round to nearest even, as torch's .to() and
// autocast's cast): the plans' copy of a float32 weight or bias in their workspace.
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace qbl::detail {

inline constexpr int cast_threads = 256;

/// out[i] = RN_T(in[i]) for i < n: N elements per thread and step, a grid-stride loop.
template <typename T, int N>
QBL_KERNEL void __launch_bounds__(cast_threads)
    cast_kernel(const float* __restrict__ in, T* __restrict__ out, std::int64_t n) {
  const std::int64_t vectors = n / N;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * cast_threads;
  for (std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * cast_threads + threadIdx.x;
       v < vectors; v += step) {
    const Vec<float, N> a = reinterpret_cast<const Vec<float, N>*>(in)[v];
    Vec<T, N> b;
#pragma unroll
    for (int j = 0; j < N; ++j) b.v[j] = from_float<T>(a.v[j]);
    reinterpret_cast<Vec<T, N>*>(out)[v] = b;
  }
  // The tail of fewer than N elements, by the first block.
  if (blockIdx.x == 0 && threadIdx.x < n - vectors * N) {
    const std::int64_t i = vectors * N + threadIdx.x;
    out[i] = from_float<T>(in[i]);
  }
}

/// Casts n floats to T on `stream`: 16-byte loads where `in` and `out` allow them, a grid of at
/// most four blocks per multiprocessor (`sms` of them).
template <typename T>
cudaError_t launch_cast(const float* in, T* out, std::int64_t n, int sms, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int N = 4;
  const bool vec = is_aligned(in, N * sizeof(float)) && is_aligned(out, N * sizeof(T));
  const std::int64_t per_block = std::int64_t{cast_threads} * (vec ? N : 1);
  const std::int64_t blocks =
      std::clamp<std::int64_t>(ceil_div<std::int64_t>(n, per_block), 1, std::int64_t{sms} * 4);
  if (vec) {
    cast_kernel<T, N><<<static_cast<unsigned>(blocks), cast_threads, 0, stream>>>(in, out, n);
  } else {
    cast_kernel<T, 1><<<static_cast<unsigned>(blocks), cast_threads, 0, stream>>>(in, out, n);
  }
  return cudaGetLastError();
}

}  // namespace qbl::detail

// Vector types, element conversions and launch helpers shared by the kernels.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/config.cuh>

#include <cstddef>
#include <cstdint>

namespace qbl::detail {

/// N elements of T moved as one aligned access (16 bytes for float x 4).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

/// Elements of T per 16-byte access.
template <typename T>
inline constexpr int vec16 = static_cast<int>(16 / sizeof(T));

template <typename T>
QBL_HOST_DEVICE float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
QBL_HOST_DEVICE T from_float(float v) {
  return static_cast<T>(v);
}

/// Multiprocessor count of the current device (no synchronization, no allocation).
inline cudaError_t sm_count(int* count) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

template <typename I>
QBL_HOST_DEVICE I ceil_div(I a, I b) {
  return (a + b - 1) / b;
}

}  // namespace qbl::detail

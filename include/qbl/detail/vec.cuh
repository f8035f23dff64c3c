// Vector types, element conversions and launch helpers shared by the kernels.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/config.cuh>
#include <qbl/detail/convert.hpp>
#include <qbl/types.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace qbl::detail {

/// N elements of T moved as one aligned access (16 bytes for float x 4).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

/// Elements of T per 16-byte access.
template <typename T>
inline constexpr int vec16 = static_cast<int>(16 / sizeof(T));

/// float, __nv_bfloat16 or __half.
template <typename T>
inline constexpr bool is_element =
    std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

/// T itself, in a context where it is not deduced (C++20's std::type_identity_t): a parameter of
/// a launcher that may be nullptr takes its type from the others.
template <typename T>
struct type_identity {
  using type = T;
};
template <typename T>
using type_identity_t = typename type_identity<T>::type;

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

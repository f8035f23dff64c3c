// Device-side helpers shared by the GPU tests, and the 16-bit type list of the typed tests.
#pragma once

#include <qbl/element_math.cuh>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace qbl_test {

/// alpha as the device computes it, for type T: references take sigmoid from the GPU's expf, as
/// eager does.
template <typename T>
__global__ void device_sigmoid_t(const T* l, float* alpha, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) alpha[i] = qbl::sigmoid<T>(static_cast<float>(l[i]));
}

using Types16 = ::testing::Types<__nv_bfloat16, __half>;

/// "bf16" / "fp16" in the generated test names.
struct Names16 {
  template <typename T>
  static std::string GetName(int) {
    return std::is_same_v<T, __half> ? "fp16" : "bf16";
  }
};

}  // namespace qbl_test

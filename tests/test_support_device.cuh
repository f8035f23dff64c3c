// Device-side helpers shared by the GPU tests, and the type lists of the typed tests: the 16-bit
// types, and fp32 x with a 16-bit GEMM (PyTorch's autocast).
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

/// fp32 x with GEMM type G and logits type L, as a layer under torch.autocast gets them.
template <typename G, typename L>
struct MixedTypes {
  using gemm = G;
  using logits = L;
};
using MixedTypeList =
    ::testing::Types<MixedTypes<__nv_bfloat16, float>, MixedTypes<__nv_bfloat16, __nv_bfloat16>,
                     MixedTypes<__half, float>, MixedTypes<__half, __half>>;

/// "fp32_to_bf16_logits_fp32" and the like in the generated test names.
struct MixedTypeNames {
  template <typename T>
  static const char* name() {
    return std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, __half> ? "fp16" : "bf16";
  }
  template <typename M>
  static std::string GetName(int) {
    return std::string("fp32_to_") + name<typename M::gemm>() + "_logits_" +
           name<typename M::logits>();
  }
};

}  // namespace qbl_test

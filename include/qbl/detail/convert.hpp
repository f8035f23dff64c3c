// Element <-> float conversions of the element math: float always; CUDA's __nv_bfloat16 and __half
// where CUDA's headers are found (under nvcc, or a C++ compiler given the toolkit's include
// directory). Another type joins by specializing both templates: the PyTorch package's CPU kernels
// do so for c10::BFloat16 and c10::Half, whose conversions also round to nearest even.
//
// Conversions go through the named intrinsics, never the implicit ones: PyTorch builds its
// extensions with __CUDA_NO_HALF_CONVERSIONS__ and __CUDA_NO_BFLOAT16_CONVERSIONS__, which remove
// those. from_float rounds to nearest even, as eager does when it stores an fp32 result.
#pragma once

#include <qbl/detail/host_device.hpp>

#if defined(__CUDACC__) || __has_include(<cuda_bf16.h>)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define QBL_HAS_CUDA_TYPES 1
#else
#define QBL_HAS_CUDA_TYPES 0
#endif

namespace qbl::detail {

template <typename T>
QBL_HOST_DEVICE float to_float(T v);
template <typename T>
QBL_HOST_DEVICE T from_float(float v);

template <>
QBL_HOST_DEVICE float to_float<float>(float v) {
  return v;
}
template <>
QBL_HOST_DEVICE float from_float<float>(float v) {
  return v;
}

#if QBL_HAS_CUDA_TYPES
template <>
QBL_HOST_DEVICE float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
QBL_HOST_DEVICE float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
QBL_HOST_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
QBL_HOST_DEVICE __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
#endif

}  // namespace qbl::detail

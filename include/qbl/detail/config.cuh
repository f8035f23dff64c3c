// Internal macros shared by the device headers, and the check that they are compiled as CUDA.
#pragma once

// Every .cuh header of qbl has device code (kernels, CUB): a plain C++ compiler cannot take it.
#if !defined(__CUDACC__)
#error \
    "qbl: <qbl/*.cuh> headers hold device code: compile this file with nvcc (a .cu file, or \
LANGUAGE CUDA in CMake). Host-only headers, for .cpp files: <qbl/error.hpp>, <qbl/options.hpp>, \
<qbl/types.hpp>, <qbl/version.hpp>, <qbl/element_math.hpp>."
#endif

#include <qbl/detail/host_device.hpp>

#include <cuda_runtime.h>

#include <cstdint>

// Kernels get hidden visibility so that two shared objects built from these headers never
// resolve each other's kernel symbols (the same convention as CUB's CUB_DETAIL_KERNEL_ATTRIBUTES).
#if defined(_WIN32)
#define QBL_KERNEL __global__
#else
#define QBL_KERNEL __global__ __attribute__((visibility("hidden")))
#endif

/// In a function returning cudaError_t: return the error of `call` if it failed.
#define QBL_CUDA_RETURN_IF_ERROR(call)                  \
  do {                                                  \
    const cudaError_t qbl_status_ = (call);             \
    if (qbl_status_ != cudaSuccess) return qbl_status_; \
  } while (0)

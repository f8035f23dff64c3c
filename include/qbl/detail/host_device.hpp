// QBL_HOST_DEVICE marks the functions that run on both sides: __host__ __device__ under nvcc, a
// plain inline function under a C++ compiler, so that host-only code (the PyTorch package's CPU
// kernels, a .cpp test) shares them bit for bit. Host-only: needs none of CUDA's headers.
#pragma once

#if defined(__CUDACC__)
#define QBL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define QBL_HOST_DEVICE inline
#endif

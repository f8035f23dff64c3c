// bench_check.hpp -- qbl_bench's error checking: every CUDA / cuBLAS status is checked; a failure
// ends the run (exit status 1) with the call, file:line and the status string. The harness does
// not throw: only qbl's own host API does, and main() reports that the same way.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

[[noreturn]] inline void die(const char* what, const char* detail, const char* file, int line) {
  std::fprintf(stderr, "qbl_bench: %s failed at %s:%d: %s\n", what, file, line, detail);
  std::fflush(stdout);
  std::exit(1);
}

}  // namespace

#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    const cudaError_t bench_status_ = (call);                                              \
    if (bench_status_ != cudaSuccess) {                                                    \
      const std::string bench_msg_ = std::string(cudaGetErrorName(bench_status_)) + " (" + \
                                     cudaGetErrorString(bench_status_) + ")";              \
      die(#call, bench_msg_.c_str(), __FILE__, __LINE__);                                  \
    }                                                                                      \
  } while (0)

#define CUBLAS_CHECK(call)                                                                      \
  do {                                                                                          \
    const cublasStatus_t bench_status_ = (call);                                                \
    if (bench_status_ != CUBLAS_STATUS_SUCCESS) {                                               \
      const std::string bench_msg_ = std::string(cublasLtGetStatusName(bench_status_)) + " (" + \
                                     cublasLtGetStatusString(bench_status_) + ")";              \
      die(#call, bench_msg_.c_str(), __FILE__, __LINE__);                                       \
    }                                                                                           \
  } while (0)

// A kernel launch reports configuration errors only through cudaGetLastError.
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

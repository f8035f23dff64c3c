// qbl/error.hpp -- exception types and the checking macros used by the host API.
//
// Two error layers: device launchers return cudaError_t / cublasStatus_t and never throw;
// the host API (qbl::QuantBlendLinear, the plans' construction and run()) throws the types below.
// Every CUDA / cuBLAS failure carries the failing call, file:line and the library's status string.
//
//   try {
//     layer.forward(x, logits, w, b, out, tokens, stream);
//   } catch (const qbl::invalid_argument& e) {   // bad pointer / size, nothing was launched
//   } catch (const qbl::cuda_error& e) {         // e.code() is the cudaError_t
//   }
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace qbl {

/// A CUDA runtime call failed. `code()` is the status it returned.
class cuda_error : public std::runtime_error {
 public:
  cuda_error(cudaError_t code, const std::string& what) : std::runtime_error(what), code_(code) {}
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

/// A device allocation failed (cudaErrorMemoryAllocation).
class out_of_memory : public cuda_error {
 public:
  using cuda_error::cuda_error;
};

/// A cuBLAS / cuBLASLt call failed. `status()` is the status it returned.
class cublas_error : public std::runtime_error {
 public:
  cublas_error(cublasStatus_t status, const std::string& what)
      : std::runtime_error(what), status_(status) {}
  cublasStatus_t status() const noexcept { return status_; }

 private:
  cublasStatus_t status_;
};

/// An argument was rejected before anything was launched.
class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A size is outside what the object was built for (e.g. tokens > max_tokens).
class out_of_range : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

/// The object is in a state that cannot serve the call (e.g. it was moved from).
class logic_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {

inline std::string where(const char* file, int line) {
  return std::string(file) + ":" + std::to_string(line);
}

// Both throwers clear the thread's last CUDA error first: the failed call's error (a failed
// cudaMalloc's, say) is reported by this exception, and is not reported a second time by the
// caller's next cudaGetLastError or by the next launch check -- qbl's own or torch's. (A sticky
// error stays: nothing clears it.)
[[noreturn]] inline void throw_cuda(cudaError_t code, const char* call, const char* file,
                                    int line) {
  (void)cudaGetLastError();
  std::string msg = std::string("qbl: ") + call + " failed at " + where(file, line) + ": " +
                    cudaGetErrorName(code) + " (" + cudaGetErrorString(code) + ")";
  if (code == cudaErrorMemoryAllocation) throw out_of_memory(code, msg);
  throw cuda_error(code, msg);
}

[[noreturn]] inline void throw_cublas(cublasStatus_t status, const char* call, const char* file,
                                      int line) {
  (void)cudaGetLastError();
  throw cublas_error(status, std::string("qbl: ") + call + " failed at " + where(file, line) +
                                 ": " + cublasLtGetStatusName(status) + " (" +
                                 cublasLtGetStatusString(status) + ")");
}

}  // namespace detail
}  // namespace qbl

/// Throws qbl::cuda_error (or qbl::out_of_memory) if `call` does not return cudaSuccess, clearing
/// the thread's last CUDA error.
#define QBL_CUDA_TRY(call)                                               \
  do {                                                                   \
    const cudaError_t qbl_status_ = (call);                              \
    if (qbl_status_ != cudaSuccess) {                                    \
      ::qbl::detail::throw_cuda(qbl_status_, #call, __FILE__, __LINE__); \
    }                                                                    \
  } while (0)

/// Throws qbl::cublas_error if `call` does not return CUBLAS_STATUS_SUCCESS, clearing the thread's
/// last CUDA error.
#define QBL_CUBLAS_TRY(call)                                               \
  do {                                                                     \
    const cublasStatus_t qbl_status_ = (call);                             \
    if (qbl_status_ != CUBLAS_STATUS_SUCCESS) {                            \
      ::qbl::detail::throw_cublas(qbl_status_, #call, __FILE__, __LINE__); \
    }                                                                      \
  } while (0)

/// Throws `exception_type` with `message` and the location unless `condition` holds.
#define QBL_EXPECTS(condition, exception_type, message)                                 \
  do {                                                                                  \
    if (!(condition)) {                                                                 \
      throw exception_type(std::string("qbl: ") + (message) + " [" #condition "] at " + \
                           ::qbl::detail::where(__FILE__, __LINE__));                   \
    }                                                                                   \
  } while (0)

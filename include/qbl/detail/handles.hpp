// RAII owners for device memory, streams, events and cuBLASLt objects. Destructors never throw.
#pragma once

#include <qbl/error.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

namespace qbl::detail {

struct cuda_free {
  void operator()(void* p) const noexcept { cudaFree(p); }
};

/// Owns one cudaMalloc allocation. Move-only.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    void* p = nullptr;
    QBL_CUDA_TRY(cudaMalloc(&p, bytes));
    ptr_.reset(p);
  }
  void* get() const noexcept { return ptr_.get(); }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_.get());
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::unique_ptr<void, cuda_free> ptr_;
  std::size_t bytes_ = 0;
};

struct cuda_stream_destroy {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};
struct cuda_event_destroy {
  void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
};
/// Own a CUDA stream / event.
using stream_ptr = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, cuda_stream_destroy>;
using event_ptr = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, cuda_event_destroy>;

template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
struct lt_destroy {
  void operator()(Handle h) const noexcept { Destroy(h); }
};

/// unique_ptr over a cuBLASLt opaque handle type (they are all pointers to incomplete structs).
template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
using lt_ptr = std::unique_ptr<std::remove_pointer_t<Handle>, lt_destroy<Handle, Destroy>>;

using lt_handle = lt_ptr<cublasLtHandle_t, cublasLtDestroy>;
using lt_matmul_desc = lt_ptr<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using lt_layout = lt_ptr<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using lt_preference = lt_ptr<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

}  // namespace qbl::detail

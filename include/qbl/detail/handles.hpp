// RAII owners for device memory, streams, events and cuBLASLt objects. Destructors never throw.
#pragma once

#include <qbl/error.hpp>
#include <qbl/options.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace qbl::detail {

/// Owns one device allocation, from cudaMalloc or from a DeviceAllocator. Move-only.
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t bytes, const DeviceAllocator& allocator = {})
      : bytes_(bytes), allocator_(allocator) {
    QBL_EXPECTS((allocator.allocate == nullptr) == (allocator.deallocate == nullptr),
                qbl::invalid_argument,
                "a DeviceAllocator sets both allocate and deallocate, or neither");
    if (bytes == 0) return;
    if (allocator_.allocate == nullptr) {
      QBL_CUDA_TRY(cudaMalloc(&ptr_, bytes));
      return;
    }
    ptr_ = allocator_.allocate(bytes, allocator_.context);
    if (ptr_ == nullptr) {
      throw qbl::out_of_memory(
          cudaErrorMemoryAllocation,
          "qbl: the allocator returned no memory for " + std::to_string(bytes) + " bytes");
    }
  }
  device_buffer(device_buffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        allocator_(other.allocator_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      allocator_ = other.allocator_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { release(); }

  void* get() const noexcept { return ptr_; }
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void release() noexcept {
    if (ptr_ == nullptr) return;
    if (allocator_.deallocate == nullptr) {
      cudaFree(ptr_);
    } else {
      allocator_.deallocate(ptr_, bytes_, allocator_.context);
    }
    ptr_ = nullptr;
  }

  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  DeviceAllocator allocator_;
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

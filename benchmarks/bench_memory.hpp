// bench_memory.hpp -- device memory as the harness holds it: qbl's own owner of an allocation
// (qbl::detail::device_buffer), with what the harness adds on top: a count of the live bytes it
// holds (printed per shape; qbl's own allocations are not in it), and a failed cudaMalloc ends the
// run like every other failed call instead of throwing.
#pragma once

#include <qbl/detail/handles.hpp>
#include <qbl/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "bench_check.hpp"

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

inline std::size_t g_allocated_bytes =
    0;  // live device bytes allocated by this harness (not by qbl)

// One cudaMalloc allocation (none, and a null pointer, for 0 bytes). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : buffer_(allocate(bytes)) {
    g_allocated_bytes += buffer_.bytes();
  }
  ~DeviceBuffer() {
    if (buffer_.get() != nullptr) g_allocated_bytes -= buffer_.bytes();
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : buffer_(std::move(o.buffer_)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {  // the old allocation goes with `o`
    std::swap(buffer_, o.buffer_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return buffer_.as<T>();
  }
  std::size_t bytes() const { return buffer_.bytes(); }

 private:
  static qbl::detail::device_buffer allocate(std::size_t bytes) {
    try {
      return qbl::detail::device_buffer(bytes);
    } catch (const qbl::cuda_error& e) {  // as CUDA_CHECK reports a failed call
      const std::string msg =
          std::string(cudaGetErrorName(e.code())) + " (" + cudaGetErrorString(e.code()) + ")";
      die("cudaMalloc", msg.c_str(), __FILE__, __LINE__);
    }
  }

  qbl::detail::device_buffer buffer_;
};

}  // namespace

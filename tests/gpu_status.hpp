// Whether this machine has a usable GPU, asked once per process: by the GPU tests (from inside a
// test, after gtest has started: nothing calls CUDA before that) and by gpu_probe.cpp, which says
// in ctest's default output why the GPU tests skipped. Host-only, without gtest.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

namespace qbl_test {

/// What a process found when it asked for a GPU.
struct GpuStatus {
  bool usable = false;
  /// No GPU on this machine at all -- no device, or no CUDA driver installed -- as opposed to a
  /// GPU machine whose driver or device is broken. Only absence may be skipped over by default.
  bool absent = false;
  std::string reason;  ///< empty when usable; names the CUDA error otherwise
};

inline const GpuStatus& gpu_status() {
  static const GpuStatus status = [] {
    GpuStatus s;
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      int driver = -1;
      const bool no_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0;
      cudaGetLastError();
      // cudaErrorNoDevice: a driver without a device (or CUDA_VISIBLE_DEVICES hides them all).
      // cudaErrorStubLibrary: the toolkit's libcuda stub stands in for a driver (build machines).
      // cudaErrorInsufficientDriver with driver version 0: no driver installed at all (what a
      // CPU-only machine returns). The same error with a real driver version is an outdated driver
      // on a GPU machine: that, and every other error, is a broken setup and fails the test.
      s.absent = e == cudaErrorNoDevice || e == cudaErrorStubLibrary ||
                 (e == cudaErrorInsufficientDriver && no_driver);
      s.reason = std::string(s.absent ? "no CUDA device here" : "CUDA device unusable") +
                 " (cudaGetDeviceCount: " + cudaGetErrorName(e) + ", " + cudaGetErrorString(e) +
                 "; driver version " + std::to_string(driver) + ")";
      return s;
    }
    if (n == 0) {
      s.absent = true;
      s.reason = "no CUDA device present (cudaGetDeviceCount: 0 devices)";
      return s;
    }
    // A device is listed: it must also take a context, or every GPU test would fail on its own
    // first call with a less clear message.
    const cudaError_t c = cudaFree(nullptr);
    if (c != cudaSuccess) {
      cudaGetLastError();
      s.reason = std::string("CUDA device unusable (cudaFree(0) creating the context: ") +
                 cudaGetErrorName(c) + ", " + cudaGetErrorString(c) + ")";
      return s;
    }
    s.usable = true;
    return s;
  }();
  return status;
}

/// Is QBL_REQUIRE_GPU=1 set? Then a GPU test fails, not skips, where no GPU is usable: on a GPU
/// machine (tools/gpu_check.sh, tests/run_sanitizers.sh) a suite that skipped everything must not
/// read as passed.
inline bool gpu_required() {
  const char* v = std::getenv("QBL_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace qbl_test

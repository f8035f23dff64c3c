// Run by ctest after the tests (CTEST_CUSTOM_POST_TEST, written by tests/CMakeLists.txt): one line
// in ctest's default output that says whether the GPU tests ran, and why not. ctest lists a
// skipped test without gtest's reason, which shows only with ctest -V. Exits 0 whatever it finds:
// the tests themselves pass, skip or fail (QBL_REQUIRE_GPU=1 turns a skip into a failure).
#include "gpu_status.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>

int main() {
  const qbl_test::GpuStatus& s = qbl_test::gpu_status();
  if (s.usable) {
    int device = 0;
    cudaDeviceProp p = {};
    if (cudaGetDevice(&device) == cudaSuccess &&
        cudaGetDeviceProperties(&p, device) == cudaSuccess) {
      std::printf("qbl: the GPU tests ran on device %d, %s (compute capability %d.%d)\n", device,
                  p.name, p.major, p.minor);
    }
    return 0;
  }
  if (qbl_test::gpu_required()) {
    std::printf("qbl: the GPU tests failed, as QBL_REQUIRE_GPU=1 asks where no GPU is usable: %s\n",
                s.reason.c_str());
  } else if (s.absent) {
    std::printf(
        "qbl: the GPU tests skip here (the CPU-side tests run): %s. On a GPU machine, "
        "QBL_REQUIRE_GPU=1 makes a GPU test fail instead of skipping.\n",
        s.reason.c_str());
  } else {
    std::printf("qbl: the GPU tests failed: %s\n", s.reason.c_str());
  }
  return 0;
}

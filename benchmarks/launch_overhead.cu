// qbl_launch_overhead -- stream time per launch of an empty kernel, 2,000 launches back to back
// between two events: plain, cooperative, and cooperative with a grid-wide barrier, at 1, one per
// multiprocessor and four per multiprocessor blocks of 256 threads. The fixed cost every extra
// kernel of a prologue pays, and what a cooperative launch adds to it.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>

namespace {

__global__ void empty_kernel() {}
__global__ void barrier_kernel() { cooperative_groups::this_grid().sync(); }

int check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    std::fprintf(stderr, "qbl_launch_overhead: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("qbl_launch_overhead: no CUDA device available; nothing to measure.\n");
    return 0;
  }
  cudaStream_t s = nullptr;
  cudaEvent_t a = nullptr, b = nullptr;
  int sms = 0;
  if (check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream") ||
      check(cudaEventCreate(&a), "event") || check(cudaEventCreate(&b), "event") ||
      check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "attribute"))
    return 1;
  const char* names[] = {"plain, empty", "cooperative, empty", "cooperative, grid barrier"};
  for (int blocks : {1, sms, 4 * sms}) {
    for (int mode = 0; mode < 3; ++mode) {
      cudaLaunchConfig_t c = {};
      c.gridDim = dim3(static_cast<unsigned>(blocks));
      c.blockDim = dim3(256);
      c.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeCooperative;
      attr[0].val.cooperative = 1;
      c.attrs = attr;
      c.numAttrs = mode == 0 ? 0 : 1;
      auto launch = [&] {
        return mode == 2 ? cudaLaunchKernelEx(&c, barrier_kernel)
                         : cudaLaunchKernelEx(&c, empty_kernel);
      };
      for (int i = 0; i < 200; ++i)
        if (check(launch(), "launch")) return 1;  // warm-up
      check(cudaEventRecord(a, s), "record");
      for (int i = 0; i < 2000; ++i) launch();
      check(cudaEventRecord(b, s), "record");
      if (check(cudaEventSynchronize(b), "synchronize")) return 1;
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a, b), "elapsed");
      std::printf("blocks %4d  %-26s %.2f us per launch\n", blocks, names[mode], ms * 1000 / 2000);
    }
  }
  return 0;
}

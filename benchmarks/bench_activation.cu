// qbl_bench_activation: the element kernels with each input activation against the same kernels
// without one, on bfloat16 at one shape (default 8192 x 8192: train_qat.py's down layer at
// D = 2048), and the device-to-device copy for scale. CUDA events around each run, 5 warm-up
// runs, the median of the timed ones, inputs rotating over two buffer sets (4 x the shape's
// bytes each; at the default 512 MiB, well over 3 x L2), every activation in one process.
//
//   qbl_bench_activation [features [tokens [runs [sd]]]]
//
// h ~ N(0, sd^2) (default sd 0.6, about what the layer's input is in train_qat.py; sd < 0 gives
// the constant -sd everywhere), g_mixed ~ N(0, 1e-6). GB/s counts the bytes each kernel must
// read and write once.
#include <qbl/qbl.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace {

using B = __nv_bfloat16;

__global__ void fill_normal(B* p, std::int64_t n, unsigned seed, float sd) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const unsigned a = static_cast<unsigned>(i) * 2654435761u ^ seed;
    const unsigned b = a * 0x9E3779B9u + 12345u;
    const float u1 = ((a >> 8) + 1) * (1.0f / 16777217.0f), u2 = (b >> 8) * (1.0f / 16777216.0f);
    p[i] = sd < 0 ? __float2bfloat16(-sd)
                  : __float2bfloat16(sd * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
  }
}

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "qbl_bench_activation: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t features = argc > 1 ? std::atoll(argv[1]) : 8192;
  const std::int64_t tokens = argc > 2 ? std::atoll(argv[2]) : 8192;
  const int runs = argc > 3 ? std::atoi(argv[3]) : 20;
  const float sd = argc > 4 ? static_cast<float>(std::atof(argv[4])) : 0.6f;
  const std::int64_t n = tokens * features;
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(B);
  B *h[2] = {}, *g[2] = {}, *mixed = nullptr, *grad_h = nullptr, *logits = nullptr,
    *grad_logits = nullptr;
  float* stats = nullptr;
  void* ws = nullptr;
  bool good = true;
  for (int i = 0; i < 2; ++i) {
    good = good && ok(cudaMalloc(&h[i], bytes), "cudaMalloc") &&
           ok(cudaMalloc(&g[i], bytes), "cudaMalloc");
    if (!good) return 1;
    fill_normal<<<1024, 256>>>(h[i], n, 17u + i, sd);
    fill_normal<<<1024, 256>>>(g[i], n, 99u + i, 1e-3f);
  }
  good = ok(cudaMalloc(&mixed, bytes), "cudaMalloc") &&
         ok(cudaMalloc(&grad_h, bytes), "cudaMalloc") &&
         ok(cudaMalloc(&logits, tokens * sizeof(B)), "cudaMalloc") &&
         ok(cudaMalloc(&grad_logits, tokens * sizeof(B)), "cudaMalloc") &&
         ok(cudaMalloc(&stats, 2 * sizeof(float)), "cudaMalloc") &&
         ok(cudaMalloc(&ws, qbl::amax_quant_blend_workspace_bytes), "cudaMalloc");
  if (!good) return 1;
  fill_normal<<<32, 256>>>(logits, tokens, 5u, 1.0f);
  if (!ok(cudaDeviceSynchronize(), "inputs")) return 1;
  float* amax = stats;
  float* scale = stats + 1;

  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // Median time of f(rotation) over `runs` timed runs after 5 warm-up runs, in us; < 0 on error.
  auto time = [&](const char* name, double moved, const std::function<cudaError_t(int)>& f) {
    std::vector<float> t;
    for (int r = 0; r < runs + 5; ++r) {
      cudaEventRecord(start);
      const cudaError_t e = f(r & 1);
      cudaEventRecord(stop);
      if (!ok(e, name) || !ok(cudaEventSynchronize(stop), name)) return false;
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      if (r >= 5) t.push_back(ms * 1000.0f);
    }
    std::sort(t.begin(), t.end());
    const double us = t[t.size() / 2];
    std::printf("%-40s %9.1f us %7.0f GB/s\n", name, us, moved / us / 1e3);
    return true;
  };
  std::printf("bf16, %lld tokens x %lld features, h sd %g, median of %d\n",
              static_cast<long long>(tokens), static_cast<long long>(features), sd, runs);
  const auto qg = qbl::QuantGrad::zero;
  const double e = static_cast<double>(n) * sizeof(B);  // bytes of one pass over the elements
  auto run = [&](auto act, const char* tag) {
    using Act = decltype(act);
    int blocks = 0;  // what a BackwardPlan would launch
    if (!ok(qbl::detail::backward_max_blocks<B, B, B, Act>(&blocks), "occupancy")) return false;
    auto label = [&](const char* what) {
      static char buf[96];
      std::snprintf(buf, sizeof buf, "%s, %s", tag, what);
      return buf;
    };
    return time(label("forward (amax + blend)"), 3 * e,
                [&](int i) {
                  return qbl::amax_quant_blend<B, B, B, Act>(h[i], logits, mixed, tokens, features,
                                                             amax, scale, ws);
                }) &&
           time(label("backward element, mixed kept"), 3 * e,
                [&](int i) {
                  return qbl::detail::launch_quant_blend_backward<B, B, B, Act>(
                      g[i], h[i], logits, scale, grad_h, grad_logits, static_cast<B*>(nullptr),
                      tokens, features, qg, blocks, nullptr);
                }) &&
           time(label("backward element, writing mixed"), 4 * e,
                [&](int i) {
                  return qbl::detail::launch_quant_blend_backward<B, B, B, Act>(
                      g[i], h[i], logits, scale, grad_h, grad_logits, mixed, tokens, features, qg,
                      blocks, nullptr);
                }) &&
           time(label("recompute mixed alone"), 2 * e, [&](int i) {
             return qbl::detail::launch_quant_blend_backward<B, B, B, Act>(
                 static_cast<const B*>(nullptr), h[i], logits, scale, static_cast<B*>(nullptr),
                 static_cast<B*>(nullptr), mixed, tokens, features, qg, blocks, nullptr);
           });
  };
  good = run(qbl::Identity{}, "identity") && run(qbl::Gelu{}, "gelu") &&
         run(qbl::GeluTanh{}, "gelu_tanh") && run(qbl::Silu{}, "silu") &&
         run(qbl::Relu{}, "relu") && time("copy (read + write)", 2 * e, [&](int i) {
           return cudaMemcpyAsync(mixed, h[i], bytes, cudaMemcpyDeviceToDevice);
         });
  return good ? 0 : 1;
}

// quickstart: a QuantBlendLinear forward on random inputs, checked against a CPU reference,
// then timed; then the same layer with its input activation, GELU, fused in. Copy this file to
// start using qbl.
//
//   ./qbl_quickstart [tokens] [in_features] [out_features]      (defaults 8192 512 512)
#include <qbl/qbl.cuh>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string_view>
#include <vector>

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    const cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "quickstart: %s failed: %s: %s\n", #call, cudaGetErrorName(e_), \
                   cudaGetErrorString(e_));                                                \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

// What the machine offers: a GPU that takes a context, no CUDA device at all (nothing to run,
// nothing wrong), or one that CUDA cannot use (an outdated or broken driver, a failing device).
enum class Gpu { usable, absent, broken };

static Gpu find_gpu() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e == cudaSuccess && devices > 0) {
    const cudaError_t c = cudaFree(nullptr);  // a listed device must also take a context
    if (c == cudaSuccess) return Gpu::usable;
    std::fprintf(stderr, "quickstart: CUDA cannot start: cudaFree(0): %s: %s\n",
                 cudaGetErrorName(c), cudaGetErrorString(c));
    return Gpu::broken;
  }
  // No device: a driver that finds none (or CUDA_VISIBLE_DEVICES hides them all), or no CUDA
  // driver installed at all, for which the runtime reports an insufficient driver and a driver
  // version of 0. The same error with a real driver version is an outdated driver: broken.
  int driver = -1;
  const bool no_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0;
  if (e == cudaSuccess || e == cudaErrorNoDevice ||
      (e == cudaErrorInsufficientDriver && no_driver)) {
    std::printf("quickstart: no CUDA device on this machine (%s); nothing to run.\n",
                e == cudaSuccess ? "0 devices"
                : no_driver      ? "no CUDA driver"
                                 : cudaGetErrorName(e));
    return Gpu::absent;
  }
  std::fprintf(stderr, "quickstart: CUDA cannot start: cudaGetDeviceCount: %s: %s (driver %d)\n",
               cudaGetErrorName(e), cudaGetErrorString(e), driver);
  return Gpu::broken;
}

// alpha on the device, so that the CPU reference uses the same expf as the kernels (and eager).
__global__ void sigmoid_kernel(const float* l, float* a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] = qbl::sigmoid(l[i]);
}

// F.gelu(h) on the device, as eager's kernel computes it (the CUDA math library's erff).
__global__ void gelu_kernel(const float* h, float* x, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = qbl::activate<qbl::Gelu, float>(h[i]);
}

// The CPU reference of a forward whose input (after the activation) was x: mixed exactly as
// eager computes it, the product in double. Prints and returns whether the layer's matched.
static bool check(const char* what, const std::vector<float>& x, const std::vector<float>& alpha,
                  const std::vector<float>& w, const std::vector<float>& b,
                  const std::vector<float>& mixed, const std::vector<float>& got,
                  std::int64_t tokens, std::int64_t in, std::int64_t out) {
  std::uint32_t m = 0;
  for (float v : x) m = std::max(m, qbl::abs_bits(v));
  const float scale = qbl::scale_from_amax(qbl::from_abs_bits(m));
  std::int64_t mixed_mismatch = 0;
  double num = 0, den = 0;
  std::vector<float> ref_mixed(in);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < in; ++i) {
      ref_mixed[i] = qbl::quant_blend_value(x[t * in + i], alpha[t], scale);
      mixed_mismatch += ref_mixed[i] != mixed[t * in + i];
    }
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b[o];
      for (std::int64_t i = 0; i < in; ++i) s += static_cast<double>(ref_mixed[i]) * w[o * in + i];
      const double d = got[t * out + o] - s;
      num += d * d;
      den += s * s;
    }
  }
  const double rel = std::sqrt(num / den);
  std::printf("%s: mixed vs CPU reference: %lld of %lld elements differ (bit-exact expected)\n",
              what, static_cast<long long>(mixed_mismatch), static_cast<long long>(tokens * in));
  std::printf("%s: out relative error vs float64: %.3e (limit 1e-5)\n", what, rel);
  return mixed_mismatch == 0 && rel < 1e-5;
}

int main(int argc, char** argv) {
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 8192;
  const std::int64_t in = argc > 2 ? std::atoll(argv[2]) : 512;
  const std::int64_t out = argc > 3 ? std::atoll(argv[3]) : 512;

  switch (find_gpu()) {
    case Gpu::absent: {  // nothing wrong, unless QBL_REQUIRE_GPU=1 says a GPU must be there
      const char* require = std::getenv("QBL_REQUIRE_GPU");
      return require != nullptr && std::string_view(require) == "1" ? 1 : 0;
    }
    case Gpu::broken:
      return 1;
    case Gpu::usable:
      break;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)  tokens %lld  in %lld  out %lld  fp32\n", prop.name, prop.major,
              prop.minor, static_cast<long long>(tokens), static_cast<long long>(in),
              static_cast<long long>(out));

  // Random inputs, like torch.randn; nn.Linear-sized weights.
  std::mt19937_64 gen(std::random_device{}());
  std::normal_distribution<float> randn(0.0f, 1.0f);
  std::vector<float> x(tokens * in), logits(tokens), w(out * in), b(out);
  for (auto& v : x) v = randn(gen);
  for (auto& v : logits) v = randn(gen);
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  std::uniform_real_distribution<float> uw(-bound, bound);
  for (auto& v : w) v = uw(gen);
  for (auto& v : b) v = uw(gen);

  float *dx, *dl, *dw, *db, *dout, *dalpha;
  CHECK_CUDA(cudaMalloc(&dx, x.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dl, logits.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dw, w.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&db, b.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dout, tokens * out * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dalpha, tokens * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dl, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, w.data(), w.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(db, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice));

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  try {
    // The layer: plans the GEMM and allocates its workspace once.
    qbl::QuantBlendLinear<float> layer(in, out, tokens);
    layer.forward(dx, dl, dw, db, dout, tokens, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));

    // CPU reference: alpha from the device (the kernels' expf), the rest on the host.
    sigmoid_kernel<<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl, dalpha,
                                                                         static_cast<int>(tokens));
    std::vector<float> alpha(tokens), got(tokens * out), mixed(tokens * in);
    CHECK_CUDA(cudaMemcpy(alpha.data(), dalpha, tokens * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(mixed.data(), layer.device_mixed(), mixed.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
    bool ok = check("layer", x, alpha, w, b, mixed, got, tokens, in, out);

    // The layer with an input activation: it quantizes and blends GELU(x), computed inside (x is
    // now the activation's input h). Reference: eager's F.gelu on the device, then as above.
    qbl::QuantBlendLinear<float, float, float, qbl::Gelu> gelu_layer(in, out, tokens);
    gelu_layer.forward(dx, dl, dw, db, dout, tokens, stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    float* dgelu;
    CHECK_CUDA(cudaMalloc(&dgelu, x.size() * sizeof(float)));
    gelu_kernel<<<static_cast<unsigned>((x.size() + 255) / 256), 256>>>(
        dx, dgelu, static_cast<std::int64_t>(x.size()));
    std::vector<float> gelu_x(x.size());
    CHECK_CUDA(cudaMemcpy(gelu_x.data(), dgelu, x.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(dgelu));
    CHECK_CUDA(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(mixed.data(), gelu_layer.device_mixed(), mixed.size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
    ok = check("layer with GELU", gelu_x, alpha, w, b, mixed, got, tokens, in, out) && ok;

    // Time the forward: warm-up, then the median of 50 event-timed runs.
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < 10; ++i) layer.forward(dx, dl, dw, db, dout, tokens, stream);
    std::vector<float> ms(50);
    for (auto& t : ms) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      layer.forward(dx, dl, dw, db, dout, tokens, stream);
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    }
    std::sort(ms.begin(), ms.end());
    std::printf("forward: %.4f ms median of %zu runs\n", ms[ms.size() / 2], ms.size());
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::printf("%s\n", ok ? "quickstart: OK" : "quickstart: FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "quickstart: %s\n", e.what());
    return 1;
  }
}

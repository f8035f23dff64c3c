// qbl_bench -- fp32 benchmark of qbl::QuantBlendLinear against its floor and an eager-like chain.
//
// For every shape (B, T, D) of the table below (tokens = B * T, in = out = D) one process times,
// side by side on one non-default stream:
//   forward      qbl::QuantBlendLinear<float>::forward (one object per shape, max_tokens = tokens)
//   graph        the same forward captured once into a CUDA graph and replayed (launch-bound
//                shapes only: tokens * D < 2^20)
//   amax         qbl::amax alone
//   quant_blend  qbl::quant_blend alone, given a ready d_amax
//   fused_prol.  qbl::amax_quant_blend (the prologue exactly as forward() issues it)
//   gemm         qbl::LinearGemm<float>::run on a ready `mixed`
//   bare_gemm    cuBLASLt set up here directly: TN, CUBLAS_COMPUTE_32F, EPILOGUE_BIAS, top
//                heuristic algorithm, 32 MiB workspace -- the "GEMM floor"
//   eager        an unfused chain that mirrors eager PyTorch kernel by kernel (abs, max,
//                clamp_min, scale, div, round, clamp, mul, sigmoid, mul, rsub, mul, add), each
//                step its own kernel and its own temporary, then the same bare GEMM
//   copy         a 1 GiB device-to-device cudaMemcpyAsync: the bandwidth a streaming kernel can
//                hope for, measured in the same run (bytes read + bytes written over time)
//
// Method. Each item gets warm-up runs first (doubling rounds until one round lasts >= 10 ms), then
// at least --reps runs and enough that they add up to >= --min-ms. Every run is bracketed by its
// own event pair and the MEDIAN of the per-run times is reported (robust to the occasional
// preempted or clock-throttled run). Inputs rotate run by run over K independent sets of x and
// logits with K * bytes(x) >= 3 x L2, so that x comes from HBM as it does in a real network
// where the previous layer's output has long left L2. W, b and the GEMM's `mixed` operand do not
// rotate: in real use the same weights are read every step, and `mixed` is consumed right after
// it is written. All inputs are random, generated on the device (never zeros: zeros would make
// the fake-quantize degenerate and may let the GPU run at lower power).
//
// Before timing, each shape is checked once: the chain's `mixed` must be bit-identical to
// QuantBlendLinear::device_mixed(), and the two `out`s must agree to ~1e-6 relative (they differ
// only if cuBLASLt picked different algorithms for the two GEMMs).
//
// Derived numbers: floor_ms = bare_gemm_ms + 2 * tokens * D * 4 B / copy bandwidth (read x once,
// write mixed once, at copy speed); prologue GB/s = 3 * tokens * D * 4 B / (amax_ms +
// quant_blend_ms) (amax reads x; quant_blend reads x and writes mixed); GEMM TFLOP/s =
// 2 * tokens * D^2 / bare_gemm_ms.
//
//   qbl_bench [--shapes 0,3,6] [--csv results.csv] [--md results.md] [--min-ms 50] [--reps 20]

#include <qbl/qbl.cuh>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace {

// ---- error checking: every CUDA / cuBLAS status is checked; a failure ends the run ----------

[[noreturn]] void die(const char* what, const char* detail, const char* file, int line) {
  std::fprintf(stderr, "qbl_bench: %s failed at %s:%d: %s\n", what, file, line, detail);
  std::fflush(stdout);
  std::exit(1);
}

#define CUDA_CHECK(call)                                                                 \
  do {                                                                                   \
    const cudaError_t bench_status_ = (call);                                            \
    if (bench_status_ != cudaSuccess) {                                                  \
      const std::string bench_msg_ = std::string(cudaGetErrorName(bench_status_)) + " (" + \
                                     cudaGetErrorString(bench_status_) + ")";            \
      die(#call, bench_msg_.c_str(), __FILE__, __LINE__);                                \
    }                                                                                    \
  } while (0)

#define CUBLAS_CHECK(call)                                                               \
  do {                                                                                   \
    const cublasStatus_t bench_status_ = (call);                                         \
    if (bench_status_ != CUBLAS_STATUS_SUCCESS) {                                        \
      const std::string bench_msg_ = std::string(cublasLtGetStatusName(bench_status_)) + \
                                     " (" + cublasLtGetStatusString(bench_status_) + ")"; \
      die(#call, bench_msg_.c_str(), __FILE__, __LINE__);                                \
    }                                                                                    \
  } while (0)

// A kernel launch reports configuration errors only through cudaGetLastError.
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// ---- the shape table ---------------------------------------------------------------------------

struct Shape {
  std::int64_t b, t, d;
};

constexpr Shape shape_table[] = {{1, 8, 1024},    {16, 512, 512},  {64, 512, 256}, {128, 128, 768},
                                 {32, 1024, 1024}, {8, 2048, 2048}, {4, 4096, 4096}};
constexpr int shape_count = static_cast<int>(sizeof shape_table / sizeof shape_table[0]);

// Shapes below this many elements are launch-bound: the graph replay is timed for them.
constexpr std::int64_t launch_bound_elements = std::int64_t{1} << 20;

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t gemm_workspace_bytes = 32 * mib;  // Hopper's recommended cuBLASLt workspace
// The rotating x/logits sets stay under this; with everything else per shape (<= ~4 GiB for the
// biggest) and the copy buffers (2 GiB) the process stays well under 10 GiB.
constexpr std::size_t rotation_cap_bytes = 2048 * mib;
constexpr int max_graph_sets = 8192;  // one instantiated graph per rotating input set, at most
constexpr double warmup_round_ms = 10.0;

// ---- command line ------------------------------------------------------------------------------

struct Args {
  std::string csv_path, md_path;
  std::vector<int> shapes;
  double min_ms = 50.0;
  int reps = 20;
  int max_runs = 100000;
  std::size_t copy_mib = 1024;
  int device = 0;
  bool graph = true;
};

void print_usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "  --shapes i,j,...   indices into the shape table (default: all)\n"
      "  --csv PATH         write one CSV row per shape\n"
      "  --md PATH          write a markdown table\n"
      "  --min-ms X         timed runs per item add up to at least X ms (default 50)\n"
      "  --reps N           at least N timed runs per item (default 20)\n"
      "  --max-runs N       at most N timed runs per item (default 100000)\n"
      "  --copy-mib N       size of the device-to-device copy (default 1024)\n"
      "  --device N         CUDA device (default 0)\n"
      "  --no-graph         skip the CUDA-graph replay of launch-bound shapes\n"
      "shapes (B, T, D):\n",
      argv0);
  for (int i = 0; i < shape_count; ++i) {
    const Shape& s = shape_table[i];
    std::printf("  %d: (%" PRId64 ", %" PRId64 ", %" PRId64 ")  tokens %" PRId64 "\n", i, s.b, s.t,
                s.d, s.b * s.t);
  }
}

[[noreturn]] void bad_args(const std::string& msg) {
  std::fprintf(stderr, "qbl_bench: %s (see --help)\n", msg.c_str());
  std::exit(2);
}

long long parse_int(const std::string& flag, const char* s) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0') bad_args("bad integer for " + flag + ": " + s);
  return v;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) bad_args("missing value for " + flag);
      return argv[++i];
    };
    if (flag == "--help" || flag == "-h") {
      print_usage(argv[0]);
      std::exit(0);
    } else if (flag == "--csv") {
      a.csv_path = value();
    } else if (flag == "--md") {
      a.md_path = value();
    } else if (flag == "--shapes") {
      const std::string list = value();
      std::size_t pos = 0;
      while (pos <= list.size()) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        const std::string item = list.substr(pos, comma - pos);
        const long long idx = parse_int(flag, item.c_str());
        if (idx < 0 || idx >= shape_count) bad_args("shape index out of range: " + item);
        a.shapes.push_back(static_cast<int>(idx));
        pos = comma + 1;
      }
    } else if (flag == "--min-ms") {
      const char* s = value();
      char* end = nullptr;
      a.min_ms = std::strtod(s, &end);
      if (end == s || *end != '\0' || !(a.min_ms >= 0)) bad_args(std::string("bad --min-ms: ") + s);
    } else if (flag == "--reps") {
      a.reps = static_cast<int>(parse_int(flag, value()));
      if (a.reps < 1) bad_args("--reps must be >= 1");
    } else if (flag == "--max-runs") {
      a.max_runs = static_cast<int>(parse_int(flag, value()));
      if (a.max_runs < 1) bad_args("--max-runs must be >= 1");
    } else if (flag == "--copy-mib") {
      const long long v = parse_int(flag, value());
      if (v < 1) bad_args("--copy-mib must be >= 1");
      a.copy_mib = static_cast<std::size_t>(v);
    } else if (flag == "--device") {
      a.device = static_cast<int>(parse_int(flag, value()));
    } else if (flag == "--no-graph") {
      a.graph = false;
    } else {
      bad_args("unknown option " + flag);
    }
  }
  if (a.shapes.empty()) {
    for (int i = 0; i < shape_count; ++i) a.shapes.push_back(i);
  }
  a.max_runs = std::max(a.max_runs, a.reps);
  return a;
}

// ---- device memory ---------------------------------------------------------------------------

std::size_t g_allocated_bytes = 0;  // live device bytes allocated by this harness (not by qbl)

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    CUDA_CHECK(cudaMalloc(&ptr_, std::max<std::size_t>(bytes, 1)));
    g_allocated_bytes += bytes_;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) {
      cudaFree(ptr_);  // a failure here cannot be acted on; the next checked call reports it
      g_allocated_bytes -= bytes_;
    }
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(o.bytes_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T = float>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// ---- random inputs, generated on the device -------------------------------------------------

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Box-Muller over two 24-bit uniforms from one 64-bit hash of (seed, i): randn-like, |z| <= 5.8.
__global__ void fill_randn_kernel(float* __restrict__ p, std::int64_t n, std::uint64_t seed,
                                  float stddev) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u1 = static_cast<float>((h >> 40) + 1) * 0x1p-24f;  // (0, 1]
    const float u2 = static_cast<float>(h & 0xffffffu) * 0x1p-24f;  // [0, 1)
    p[i] = stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
  }
}

// Uniform in [-bound, bound): nn.Linear's default init for W and b with bound = 1/sqrt(in).
__global__ void fill_uniform_kernel(float* __restrict__ p, std::int64_t n, std::uint64_t seed,
                                    float bound) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;
    p[i] = bound * (2.0f * u - 1.0f);
  }
}

unsigned fill_grid(std::int64_t n, int sms) {
  return static_cast<unsigned>(std::max<std::int64_t>(
      1, std::min<std::int64_t>((n + 255) / 256, std::int64_t{sms} * 32)));
}

void fill_randn(float* p, std::int64_t n, std::uint64_t seed, float stddev, int sms,
                cudaStream_t s) {
  fill_randn_kernel<<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, stddev);
  LAUNCH_CHECK();
}

void fill_uniform(float* p, std::int64_t n, std::uint64_t seed, float bound, int sms,
                  cudaStream_t s) {
  fill_uniform_kernel<<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, bound);
  LAUNCH_CHECK();
}

// ---- the eager-like chain's kernels ------------------------------------------------------------
//
// One kernel per eager op, each writing its own temporary. Like PyTorch's vectorized elementwise
// kernel: 128 threads, one float4 per thread, a one-shot grid. (Eager's broadcast ops -- alpha
// [tokens, 1] times x_q -- take PyTorch's slower non-vectorized path; here they stay vectorized,
// so this chain is, if anything, faster than eager and the speedup over it is conservative.)
// Arithmetic uses the _rn intrinsics: no contraction, IEEE rounding of every step, as eager.

constexpr int ew_threads = 128;

struct AbsOp {
  __device__ float operator()(float v) const { return fabsf(v); }
};
struct ClampMinOp {  // amax.clamp(min=1e-8); NaN stays NaN (NaN < x is false)
  __device__ float operator()(float v) const { return v < 1e-8f ? 1e-8f : v; }
};
struct ScaleOp {  // amax / 127.0: eager multiplies by fl(1/127) for a CPU-scalar divisor
  __device__ float operator()(float v) const { return __fmul_rn(v, 1.0f / 127.0f); }
};
struct RoundOp {  // torch.round: ties to even
  __device__ float operator()(float v) const { return rintf(v); }
};
struct ClampQOp {  // clamp(-127, 127); NaN stays NaN
  __device__ float operator()(float v) const { return v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v); }
};
struct SigmoidOp {  // torch.sigmoid in fp32: 1 / (1 + exp(-l)), accurate expf, IEEE division
  __device__ float operator()(float v) const { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v))); }
};
struct RsubOneOp {  // 1 - alpha
  __device__ float operator()(float v) const { return __fsub_rn(1.0f, v); }
};
struct DivOp {
  __device__ float operator()(float a, float b) const { return __fdiv_rn(a, b); }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return __fmul_rn(a, b); }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// out[i] = op(a[i])
template <bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    unary_kernel(const float* __restrict__ a, float* __restrict__ out, std::int64_t n, Op op) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * 4;
  if (VEC && i + 4 <= n) {
    const float4 v = *reinterpret_cast<const float4*>(a + i);
    *reinterpret_cast<float4*>(out + i) = make_float4(op(v.x), op(v.y), op(v.z), op(v.w));
  } else {
    for (std::int64_t j = i; j < n && j < i + 4; ++j) out[j] = op(a[j]);
  }
}

// out[i] = op(a[i], b[i])
template <bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    binary_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                  std::int64_t n, Op op) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * 4;
  if (VEC && i + 4 <= n) {
    const float4 u = *reinterpret_cast<const float4*>(a + i);
    const float4 v = *reinterpret_cast<const float4*>(b + i);
    *reinterpret_cast<float4*>(out + i) =
        make_float4(op(u.x, v.x), op(u.y, v.y), op(u.z, v.z), op(u.w, v.w));
  } else {
    for (std::int64_t j = i; j < n && j < i + 4; ++j) out[j] = op(a[j], b[j]);
  }
}

// out[i] = op(a[i], *s): a 0-dim device tensor on the right (x / scale, q * scale)
template <bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    scalar_rhs_kernel(const float* __restrict__ a, const float* __restrict__ s,
                      float* __restrict__ out, std::int64_t n, Op op) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * 4;
  const float sv = *s;
  if (VEC && i + 4 <= n) {
    const float4 v = *reinterpret_cast<const float4*>(a + i);
    *reinterpret_cast<float4*>(out + i) = make_float4(op(v.x, sv), op(v.y, sv), op(v.z, sv), op(v.w, sv));
  } else {
    for (std::int64_t j = i; j < n && j < i + 4; ++j) out[j] = op(a[j], sv);
  }
}

// out[i] = op(r[i / cols], a[i]): a [rows, 1] tensor broadcast over a [rows, cols] one
template <bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    row_lhs_kernel(const float* __restrict__ r, const float* __restrict__ a, float* __restrict__ out,
                   std::int64_t n, std::int64_t cols, Op op) {
  const std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * 4;
  if (VEC && i + 4 <= n) {  // cols % 4 == 0 here, so the four share one row
    const float rv = r[i / cols];
    const float4 v = *reinterpret_cast<const float4*>(a + i);
    *reinterpret_cast<float4*>(out + i) = make_float4(op(rv, v.x), op(rv, v.y), op(rv, v.z), op(rv, v.w));
  } else {
    for (std::int64_t j = i; j < n && j < i + 4; ++j) out[j] = op(r[j / cols], a[j]);
  }
}

// *out = op(*a): the 0-dim ops (clamp_min, the scale)
template <typename Op>
__global__ void scalar_unary_kernel(const float* __restrict__ a, float* __restrict__ out, Op op) {
  *out = op(*a);
}

// NaN-propagating max (eager's max): fmaxf would return the non-NaN operand instead.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

constexpr int reduce_threads = 512;

// Max over the block's values, valid in thread 0. `scratch` holds one float per warp.
__device__ __forceinline__ float block_nan_max(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < reduce_threads / 32 ? scratch[lane] : -INFINITY;
    for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, off));
  }
  return v;
}

// Full reduction to one value in ONE launch, as eager's reduce kernel: every block writes a
// partial, the last block to finish (ticket from an atomic counter) combines them and resets the
// counter for the next launch. `a` is 16-byte aligned.
__global__ void __launch_bounds__(reduce_threads)
    max_reduce_kernel(const float* __restrict__ a, std::int64_t n, float* __restrict__ partials,
                      unsigned* __restrict__ counter, float* __restrict__ out) {
  __shared__ float scratch[reduce_threads / 32];
  __shared__ bool is_last;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * reduce_threads;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * reduce_threads + threadIdx.x;
  float m = -INFINITY;
  const std::int64_t n4 = n / 4;
  for (std::int64_t i = tid; i < n4; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(a)[i];
    m = nan_max(nan_max(m, v.x), nan_max(nan_max(v.y, v.z), v.w));
  }
  for (std::int64_t i = n4 * 4 + tid; i < n; i += stride) m = nan_max(m, a[i]);
  m = block_nan_max(m, scratch);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = m;
    __threadfence();  // the partial is visible device-wide before the ticket is taken
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  float v = -INFINITY;
  for (unsigned i = threadIdx.x; i < gridDim.x; i += reduce_threads) v = nan_max(v, __ldcg(partials + i));
  v = block_nan_max(v, scratch);
  if (threadIdx.x == 0) {
    *out = v;
    *counter = 0;
  }
}

unsigned ew_grid(std::int64_t n) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (n + 4 * ew_threads - 1) / (4 * ew_threads)));
}

template <typename Op>
void launch_unary(const float* a, float* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && n % 4 == 0) {
    unary_kernel<true><<<ew_grid(n), ew_threads, 0, s>>>(a, out, n, op);
  } else {
    unary_kernel<false><<<ew_grid(n), ew_threads, 0, s>>>(a, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename Op>
void launch_binary(const float* a, const float* b, float* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(b) && aligned16(out) && n % 4 == 0) {
    binary_kernel<true><<<ew_grid(n), ew_threads, 0, s>>>(a, b, out, n, op);
  } else {
    binary_kernel<false><<<ew_grid(n), ew_threads, 0, s>>>(a, b, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename Op>
void launch_scalar_rhs(const float* a, const float* scalar, float* out, std::int64_t n, Op op,
                       cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && n % 4 == 0) {
    scalar_rhs_kernel<true><<<ew_grid(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  } else {
    scalar_rhs_kernel<false><<<ew_grid(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename Op>
void launch_row_lhs(const float* r, const float* a, float* out, std::int64_t n, std::int64_t cols,
                    Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && n % 4 == 0 && cols % 4 == 0) {
    row_lhs_kernel<true><<<ew_grid(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  } else {
    row_lhs_kernel<false><<<ew_grid(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  }
  LAUNCH_CHECK();
}

template <typename Op>
void launch_scalar_unary(const float* a, float* out, Op op, cudaStream_t s) {
  scalar_unary_kernel<<<1, 1, 0, s>>>(a, out, op);
  LAUNCH_CHECK();
}

// ---- the bare cuBLASLt GEMM + bias: the floor ---------------------------------------------
//
// Row-major out[tokens, D] = mixed[tokens, D] · W[D, D]ᵀ + b as the column-major product
// outᵀ = W · mixedᵀ: m = out, n = tokens, k = in, A = W (k x m, ld k) transposed, B = mixed
// (k x n, ld k), C = D = out (m x n, ld m). Default preferences besides the workspace (cuBLASLt
// then assumes 256-byte-aligned pointers, which every cudaMalloc buffer here is) and the first
// heuristic result, as a straightforward user of cuBLASLt would do it.

class BareGemm {
 public:
  BareGemm(std::int64_t in, std::int64_t out, std::int64_t tokens, const float* w, const float* bias)
      : w_(w), workspace_(gemm_workspace_bytes) {
    CUBLAS_CHECK(cublasLtCreate(&handle_));
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                sizeof epilogue));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof bias));
    const auto k = static_cast<std::uint64_t>(in), m = static_cast<std::uint64_t>(out),
               n = static_cast<std::uint64_t>(tokens);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a_, CUDA_R_32F, k, m, static_cast<std::int64_t>(k)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b_, CUDA_R_32F, k, n, static_cast<std::int64_t>(k)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c_, CUDA_R_32F, m, n, static_cast<std::int64_t>(m)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref_));
    const std::size_t ws = gemm_workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &ws, sizeof ws));
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, desc_, a_, b_, c_, c_, pref_, 1, &result,
                                                &found));
    if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
      die("cublasLtMatmulAlgoGetHeuristic", "no algorithm for the bare GEMM", __FILE__, __LINE__);
    }
    algo_ = result.algo;
  }
  ~BareGemm() {
    cublasLtMatmulPreferenceDestroy(pref_);
    cublasLtMatrixLayoutDestroy(c_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatmulDescDestroy(desc_);
    cublasLtDestroy(handle_);
  }
  BareGemm(const BareGemm&) = delete;
  BareGemm& operator=(const BareGemm&) = delete;

  void run(const float* mixed, float* out, cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle_, desc_, &one, w_, a_, mixed, b_, &zero, out, c_, out, c_,
                                &algo_, workspace_.as<void>(), gemm_workspace_bytes, s));
  }

  // "id=.. tile=.. stages=.. splitk=.." of the chosen algorithm, to compare runs and machines.
  std::string describe() const {
    auto attr = [&](cublasLtMatmulAlgoConfigAttributes_t a) {
      std::uint32_t v = 0;
      std::size_t written = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo_, a, &v, sizeof v, &written) !=
          CUBLAS_STATUS_SUCCESS) {
        return std::string("?");
      }
      return std::to_string(v);
    };
    return "id=" + attr(CUBLASLT_ALGO_CONFIG_ID) + " tile=" + attr(CUBLASLT_ALGO_CONFIG_TILE_ID) +
           " stages=" + attr(CUBLASLT_ALGO_CONFIG_STAGES_ID) +
           " splitk=" + attr(CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  }

 private:
  const float* w_;
  DeviceBuffer workspace_;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, c_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  cublasLtMatmulAlgo_t algo_ = {};
};

// ---- the eager-like chain ----------------------------------------------------------------

class EagerChain {
 public:
  EagerChain(std::int64_t tokens, std::int64_t d, int sms, BareGemm& gemm)
      : tokens_(tokens),
        d_(d),
        n_(tokens * d),
        reduce_blocks_(static_cast<unsigned>(std::max<std::int64_t>(
            1, std::min<std::int64_t>((n_ / 4 + reduce_threads - 1) / reduce_threads,
                                      std::int64_t{sms} * 4)))),
        gemm_(gemm) {
    const std::size_t bytes = static_cast<std::size_t>(n_) * sizeof(float);
    const std::size_t row_bytes = static_cast<std::size_t>(tokens) * sizeof(float);
    for (DeviceBuffer* b : {&abs_, &div_, &round_, &clamp_, &xq_, &axq_, &omax_, &mixed_}) *b = DeviceBuffer(bytes);
    alpha_ = DeviceBuffer(row_bytes);
    one_minus_alpha_ = DeviceBuffer(row_bytes);
    scalars_ = DeviceBuffer(3 * sizeof(float));  // amax, clamped amax, scale
    partials_ = DeviceBuffer(reduce_blocks_ * sizeof(float));
    counter_ = DeviceBuffer(sizeof(unsigned));
    CUDA_CHECK(cudaMemset(counter_.as<void>(), 0, sizeof(unsigned)));
  }

  // out = (eager's mixed) · Wᵀ + b, 13 kernels and the GEMM, in eager's order of ops.
  void run(const float* x, const float* logits, float* out, cudaStream_t s) {
    float* amax = scalars_.as<float>();
    float* amax_clamped = amax + 1;
    float* scale = amax + 2;
    launch_unary(x, abs_.as(), n_, AbsOp{}, s);                                    // x.abs()
    max_reduce_kernel<<<reduce_blocks_, reduce_threads, 0, s>>>(abs_.as(), n_, partials_.as(),
                                                                counter_.as<unsigned>(), amax);
    LAUNCH_CHECK();                                                                // .max()
    launch_scalar_unary(amax, amax_clamped, ClampMinOp{}, s);                     // .clamp(min=1e-8)
    launch_scalar_unary(amax_clamped, scale, ScaleOp{}, s);                       // / 127.0
    launch_scalar_rhs(x, scale, div_.as(), n_, DivOp{}, s);                       // x / scale
    launch_unary(div_.as(), round_.as(), n_, RoundOp{}, s);                       // .round()
    launch_unary(round_.as(), clamp_.as(), n_, ClampQOp{}, s);                    // .clamp(-127, 127)
    launch_scalar_rhs(clamp_.as(), scale, xq_.as(), n_, MulOp{}, s);              // * scale
    launch_unary(logits, alpha_.as(), tokens_, SigmoidOp{}, s);                   // sigmoid(logits)
    launch_row_lhs(alpha_.as(), xq_.as(), axq_.as(), n_, d_, MulOp{}, s);         // alpha * x_q
    launch_unary(alpha_.as(), one_minus_alpha_.as(), tokens_, RsubOneOp{}, s);    // 1 - alpha
    launch_row_lhs(one_minus_alpha_.as(), x, omax_.as(), n_, d_, MulOp{}, s);     // (1 - alpha) * x
    launch_binary(axq_.as(), omax_.as(), mixed_.as(), n_, AddOp{}, s);            // +
    gemm_.run(mixed_.as(), out, s);                                               // linear
  }

  const float* mixed() const { return mixed_.as(); }
  const float* amax() const { return scalars_.as(); }

 private:
  std::int64_t tokens_, d_, n_;
  unsigned reduce_blocks_;
  BareGemm& gemm_;
  DeviceBuffer abs_, div_, round_, clamp_, xq_, axq_, omax_, mixed_;
  DeviceBuffer alpha_, one_minus_alpha_, scalars_, partials_, counter_;
};

// ---- timing ----------------------------------------------------------------------------------

struct Timing {
  double median_ms = NAN;
  double min_ms = NAN;
  int runs = 0;
  bool valid() const { return runs > 0; }
};

class RunTimer {
 public:
  RunTimer(cudaStream_t stream, double min_total_ms, int min_runs, int max_runs)
      : stream_(stream), min_total_ms_(min_total_ms), min_runs_(min_runs), max_runs_(max_runs),
        start_(batch), stop_(batch) {
    for (int i = 0; i < batch; ++i) {
      CUDA_CHECK(cudaEventCreate(&start_[i]));
      CUDA_CHECK(cudaEventCreate(&stop_[i]));
    }
  }
  ~RunTimer() {
    for (int i = 0; i < batch; ++i) {
      cudaEventDestroy(start_[i]);
      cudaEventDestroy(stop_[i]);
    }
  }
  RunTimer(const RunTimer&) = delete;
  RunTimer& operator=(const RunTimer&) = delete;

  // `run_once(i)` enqueues run i on the stream (i picks the rotating input set).
  template <typename F>
  Timing measure(F&& run_once) {
    int index = 0;
    // Warm-up in doubling rounds until one round lasts warmup_round_ms: clocks ramp up, lazy
    // module loading and cuBLASLt's first-call setup happen here, and the round's mean sizes
    // the timed loop.
    double estimate_ms = 0.0;
    for (int round = 4;; round *= 2) {
      CUDA_CHECK(cudaEventRecord(start_[0], stream_));
      for (int r = 0; r < round; ++r) run_once(index++);
      CUDA_CHECK(cudaEventRecord(stop_[0], stream_));
      CUDA_CHECK(cudaEventSynchronize(stop_[0]));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_[0], stop_[0]));
      estimate_ms = static_cast<double>(ms) / round;
      if (ms >= warmup_round_ms || round >= (1 << 14)) break;
    }
    const double wanted = estimate_ms > 0.0 ? std::ceil(min_total_ms_ / estimate_ms) : max_runs_;
    const int runs = static_cast<int>(std::clamp<double>(wanted, min_runs_, max_runs_));

    std::vector<float> times;
    times.reserve(static_cast<std::size_t>(runs));
    while (static_cast<int>(times.size()) < runs) {
      const int count = std::min(batch, runs - static_cast<int>(times.size()));
      for (int j = 0; j < count; ++j) {
        CUDA_CHECK(cudaEventRecord(start_[j], stream_));
        run_once(index++);
        CUDA_CHECK(cudaEventRecord(stop_[j], stream_));
      }
      CUDA_CHECK(cudaEventSynchronize(stop_[count - 1]));
      for (int j = 0; j < count; ++j) {
        float ms = 0.0f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start_[j], stop_[j]));
        times.push_back(ms);
      }
    }
    Timing t;
    t.runs = runs;
    std::sort(times.begin(), times.end());
    const std::size_t mid = times.size() / 2;
    t.median_ms = times.size() % 2 ? times[mid] : 0.5 * (static_cast<double>(times[mid - 1]) + times[mid]);
    t.min_ms = times.front();
    return t;
  }

 private:
  static constexpr int batch = 512;  // event pairs in flight before the host reads them back
  cudaStream_t stream_;
  double min_total_ms_;
  int min_runs_, max_runs_;
  std::vector<cudaEvent_t> start_, stop_;
};

// ---- results ----------------------------------------------------------------------------------

// The timed items, in the order of the CSV columns.
enum Item { forward_item, graph_item, amax_item, quant_blend_item, fused_prologue_item, gemm_item,
            bare_gemm_item, eager_item, copy_item, item_count };
const char* const item_names[item_count] = {"forward", "graph", "amax", "quant_blend", "fused_prologue",
                                            "gemm", "bare_gemm", "eager", "copy"};

struct Row {
  Shape shape{};
  std::int64_t tokens = 0;
  int x_sets = 0, graph_sets = 0;
  Timing t[item_count];
  double copy_bytes = 0;  // bytes of one copy (read once, written once)
  bool mixed_bit_equal = false, amax_bit_equal = false, out_bit_equal = false;
  double out_max_rel_diff = NAN;
  int graph_bit_equal = -1;  // -1: no graph
  std::string bare_algo;

  double n() const { return static_cast<double>(tokens) * static_cast<double>(shape.d); }
  double ms(Item i) const { return t[i].median_ms; }
  double copy_gbps() const { return 2.0 * copy_bytes / (ms(copy_item) * 1e-3) / 1e9; }
  double floor_ms() const { return ms(bare_gemm_item) + 2.0 * n() * 4.0 / (copy_gbps() * 1e9) * 1e3; }
  double over_floor(Item i) const { return t[i].valid() ? ms(i) / floor_ms() : NAN; }
  double prologue_gbps() const { return 3.0 * n() * 4.0 / ((ms(amax_item) + ms(quant_blend_item)) * 1e-3) / 1e9; }
  double amax_gbps() const { return 4.0 * n() / (ms(amax_item) * 1e-3) / 1e9; }
  double quant_blend_gbps() const { return 8.0 * n() / (ms(quant_blend_item) * 1e-3) / 1e9; }
  double gemm_tflops() const {
    return 2.0 * n() * static_cast<double>(shape.d) / (ms(bare_gemm_item) * 1e-3) / 1e12;
  }
  double speedup_vs_eager() const { return ms(eager_item) / ms(forward_item); }
  std::string label() const {
    return std::to_string(shape.b) + "x" + std::to_string(shape.t) + "x" + std::to_string(shape.d);
  }
};

struct GpuInfo {
  std::string name;
  int sms = 0, l2_bytes = 0, driver = 0, runtime = 0, cc_major = 0, cc_minor = 0;
  std::size_t total_mem = 0, cublaslt = 0;
};

std::string version_string(int v) {  // CUDA's 1000 * major + 10 * minor
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

std::string fmt(const char* f, double v) {
  if (std::isnan(v)) return "";  // an item not run (graph) stays blank
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

void write_csv(const std::string& path, const GpuInfo& gpu, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "qbl_bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
  std::fprintf(f, "gpu,sms,l2_bytes,driver,runtime,B,T,D,tokens,x_sets,graph_sets");
  for (int i = 0; i < item_count; ++i) {
    std::fprintf(f, ",%s_ms,%s_min_ms,%s_runs", item_names[i], item_names[i], item_names[i]);
  }
  std::fprintf(f,
               ",copy_gbps,floor_ms,forward_over_floor,graph_over_floor,eager_over_floor,"
               "prologue_gbps,prologue_over_copy,amax_gbps,amax_over_copy,quant_blend_gbps,"
               "quant_blend_over_copy,gemm_over_bare,gemm_tflops,speedup_vs_eager,"
               "mixed_bit_equal,amax_bit_equal,out_bit_equal,out_max_rel_diff,graph_bit_equal,"
               "bare_gemm_algo\n");
  for (const Row& r : rows) {
    std::fprintf(f, "\"%s\",%d,%d,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 ",%d,%d",
                 gpu.name.c_str(), gpu.sms, gpu.l2_bytes, version_string(gpu.driver).c_str(),
                 version_string(gpu.runtime).c_str(), r.shape.b, r.shape.t, r.shape.d, r.tokens,
                 r.x_sets, r.graph_sets);
    for (int i = 0; i < item_count; ++i) {
      if (r.t[i].valid()) {
        std::fprintf(f, ",%.6g,%.6g,%d", r.t[i].median_ms, r.t[i].min_ms, r.t[i].runs);
      } else {
        std::fprintf(f, ",,,");
      }
    }
    const double copy = r.copy_gbps();
    std::fprintf(f, ",%.6g,%.6g,%.6g,%s,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g", copy,
                 r.floor_ms(), r.over_floor(forward_item), fmt("%.6g", r.over_floor(graph_item)).c_str(),
                 r.over_floor(eager_item), r.prologue_gbps(), r.prologue_gbps() / copy, r.amax_gbps(),
                 r.amax_gbps() / copy, r.quant_blend_gbps(), r.quant_blend_gbps() / copy,
                 r.ms(gemm_item) / r.ms(bare_gemm_item), r.gemm_tflops(), r.speedup_vs_eager());
    std::fprintf(f, ",%d,%d,%d,%.3g,%s,\"%s\"\n", r.mixed_bit_equal, r.amax_bit_equal,
                 r.out_bit_equal, r.out_max_rel_diff,
                 r.graph_bit_equal < 0 ? "" : std::to_string(r.graph_bit_equal).c_str(),
                 r.bare_algo.c_str());
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// One table layout shared by stdout (aligned) and markdown.
struct Column {
  const char* header;
  std::string (*cell)(const Row&);
};

const Column columns[] = {
    {"shape", [](const Row& r) { return r.label(); }},
    {"tokens", [](const Row& r) { return std::to_string(r.tokens); }},
    {"D", [](const Row& r) { return std::to_string(r.shape.d); }},
    {"fwd ms", [](const Row& r) { return fmt("%.4f", r.ms(forward_item)); }},
    {"graph ms", [](const Row& r) { return fmt("%.4f", r.ms(graph_item)); }},
    {"amax ms", [](const Row& r) { return fmt("%.4f", r.ms(amax_item)); }},
    {"qb ms", [](const Row& r) { return fmt("%.4f", r.ms(quant_blend_item)); }},
    {"fused ms", [](const Row& r) { return fmt("%.4f", r.ms(fused_prologue_item)); }},
    {"gemm ms", [](const Row& r) { return fmt("%.4f", r.ms(gemm_item)); }},
    {"bare ms", [](const Row& r) { return fmt("%.4f", r.ms(bare_gemm_item)); }},
    {"gemm/bare", [](const Row& r) { return fmt("%.3f", r.ms(gemm_item) / r.ms(bare_gemm_item)); }},
    {"eager ms", [](const Row& r) { return fmt("%.4f", r.ms(eager_item)); }},
    {"copy GB/s", [](const Row& r) { return fmt("%.0f", r.copy_gbps()); }},
    {"floor ms", [](const Row& r) { return fmt("%.4f", r.floor_ms()); }},
    {"fwd/floor", [](const Row& r) { return fmt("%.3f", r.over_floor(forward_item)); }},
    {"prol GB/s", [](const Row& r) { return fmt("%.0f", r.prologue_gbps()); }},
    {"prol/copy", [](const Row& r) { return fmt("%.3f", r.prologue_gbps() / r.copy_gbps()); }},
    {"amax GB/s", [](const Row& r) { return fmt("%.0f", r.amax_gbps()); }},
    {"amax/copy", [](const Row& r) { return fmt("%.3f", r.amax_gbps() / r.copy_gbps()); }},
    {"qb GB/s", [](const Row& r) { return fmt("%.0f", r.quant_blend_gbps()); }},
    {"qb/copy", [](const Row& r) { return fmt("%.3f", r.quant_blend_gbps() / r.copy_gbps()); }},
    {"TFLOP/s", [](const Row& r) { return fmt("%.1f", r.gemm_tflops()); }},
    {"eager/fwd", [](const Row& r) { return fmt("%.2f", r.speedup_vs_eager()); }},
};
constexpr int column_count = static_cast<int>(sizeof columns / sizeof columns[0]);

std::string gpu_line(const GpuInfo& g) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "GPU %s (sm_%d%d), %d SMs, L2 %.1f MiB, %.1f GiB; driver %s, runtime %s, "
                "cuBLASLt %zu; qbl %d.%d.%d",
                g.name.c_str(), g.cc_major, g.cc_minor, g.sms, g.l2_bytes / 1048576.0,
                static_cast<double>(g.total_mem) / (1024.0 * 1048576.0), version_string(g.driver).c_str(),
                version_string(g.runtime).c_str(), g.cublaslt, QBL_VERSION_MAJOR, QBL_VERSION_MINOR,
                QBL_VERSION_PATCH);
  return buf;
}

void print_table(const std::vector<Row>& rows) {
  std::vector<std::vector<std::string>> cells(rows.size());
  std::size_t width[column_count];
  for (int c = 0; c < column_count; ++c) width[c] = std::strlen(columns[c].header);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (int c = 0; c < column_count; ++c) {
      cells[r].push_back(columns[c].cell(rows[r]));
      width[c] = std::max(width[c], cells[r].back().size());
    }
  }
  for (int c = 0; c < column_count; ++c) {
    std::printf(c == 0 ? "%-*s" : "  %*s", static_cast<int>(width[c]), columns[c].header);
  }
  std::printf("\n");
  for (const auto& row : cells) {
    for (int c = 0; c < column_count; ++c) {
      std::printf(c == 0 ? "%-*s" : "  %*s", static_cast<int>(width[c]), row[static_cast<std::size_t>(c)].c_str());
    }
    std::printf("\n");
  }
}

void write_md(const std::string& path, const GpuInfo& gpu, const Args& args, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "qbl_bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::exit(1);
  }
  std::fprintf(f, "# qbl_bench, fp32\n\n%s\n\n", gpu_line(gpu).c_str());
  std::fprintf(f,
               "Median of per-run CUDA-event times (>= %d runs and >= %.0f ms per item), inputs "
               "rotating over >= 3 x L2. floor = bare cuBLASLt GEMM+bias + 2*tokens*D*4 B at copy "
               "bandwidth. prol GB/s = 3*tokens*D*4 B / (amax + quant_blend). fused = "
               "qbl::amax_quant_blend, the prologue as forward() issues it (one single-block launch "
               "up to 2^15 elements).\n\n",
               args.reps, args.min_ms);
  for (int c = 0; c < column_count; ++c) std::fprintf(f, "| %s ", columns[c].header);
  std::fprintf(f, "|\n");
  for (int c = 0; c < column_count; ++c) std::fprintf(f, c == 0 ? "| --- " : "| ---: ");
  std::fprintf(f, "|\n");
  for (const Row& r : rows) {
    for (int c = 0; c < column_count; ++c) std::fprintf(f, "| %s ", columns[c].cell(r).c_str());
    std::fprintf(f, "|\n");
  }
  std::fprintf(f, "\n| shape | mixed bit-equal | amax bit-equal | out max rel diff | out bit-equal | bare GEMM algo |\n");
  std::fprintf(f, "| --- | --- | --- | ---: | --- | --- |\n");
  for (const Row& r : rows) {
    std::fprintf(f, "| %s | %s | %s | %.3g | %s | %s |\n", r.label().c_str(), r.mixed_bit_equal ? "yes" : "no",
                 r.amax_bit_equal ? "yes" : "no", r.out_max_rel_diff, r.out_bit_equal ? "yes" : "no",
                 r.bare_algo.c_str());
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// ---- one shape -------------------------------------------------------------------------------

Row bench_shape(const Shape& shape, const GpuInfo& gpu, const Args& args, cudaStream_t stream,
                RunTimer& timer, const DeviceBuffer& copy_src, const DeviceBuffer& copy_dst) {
  Row row;
  row.shape = shape;
  const std::int64_t tokens = shape.b * shape.t, d = shape.d, n = tokens * d;
  row.tokens = tokens;
  const std::size_t x_bytes = static_cast<std::size_t>(n) * sizeof(float);
  const std::size_t logits_bytes = static_cast<std::size_t>(tokens) * sizeof(float);
  std::printf("\n== shape %s: tokens %" PRId64 ", D %" PRId64 " (x %.2f MiB)\n", row.label().c_str(),
              tokens, d, x_bytes / 1048576.0);

  // Rotating input sets: K * bytes(x) >= 3 x L2 (and at least 2), within the rotation cap.
  // Each set starts on a 256-byte boundary, like a fresh cudaMalloc.
  const std::size_t x_stride = round_up(x_bytes, 256), l_stride = round_up(logits_bytes, 256);
  std::size_t sets = std::max<std::size_t>(2, (3 * static_cast<std::size_t>(gpu.l2_bytes) + x_bytes - 1) / x_bytes);
  sets = std::max<std::size_t>(1, std::min(sets, rotation_cap_bytes / (x_stride + l_stride)));
  row.x_sets = static_cast<int>(sets);
  DeviceBuffer x_sets(sets * x_stride), logit_sets(sets * l_stride);
  auto x_of = [&](std::size_t k) { return reinterpret_cast<const float*>(x_sets.as<char>() + (k % sets) * x_stride); };
  auto logits_of = [&](std::size_t k) {
    return reinterpret_cast<const float*>(logit_sets.as<char>() + (k % sets) * l_stride);
  };

  DeviceBuffer w(static_cast<std::size_t>(d * d) * sizeof(float)), bias(static_cast<std::size_t>(d) * sizeof(float));
  DeviceBuffer out_fwd(x_bytes), out_chain(x_bytes), out_scratch(x_bytes);
  DeviceBuffer mixed_ready(x_bytes), mixed_scratch(x_bytes);
  DeviceBuffer amax_sets(sets * sizeof(float)), stats_scratch(2 * sizeof(float));
  float* amax_scratch = stats_scratch.as();
  float* scale_scratch = amax_scratch + 1;

  const float bound = 1.0f / std::sqrt(static_cast<float>(d));
  fill_randn(x_sets.as(), static_cast<std::int64_t>(x_sets.bytes() / sizeof(float)), 1, 1.0f, gpu.sms, stream);
  fill_randn(logit_sets.as(), static_cast<std::int64_t>(logit_sets.bytes() / sizeof(float)), 2, 1.0f, gpu.sms, stream);
  fill_uniform(w.as(), d * d, 3, bound, gpu.sms, stream);
  fill_uniform(bias.as(), d, 4, bound, gpu.sms, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));

  qbl::QuantBlendLinear<float> layer(d, d, tokens);
  qbl::LinearGemm<float> gemm(d, d, tokens);
  DeviceBuffer gemm_ws(gemm.workspace_bytes());
  BareGemm bare(d, d, tokens, w.as(), bias.as());
  EagerChain chain(tokens, d, gpu.sms, bare);
  row.bare_algo = bare.describe();
  // What construction-time autotuning measured for this token count (bias epilogue).
  for (const qbl::GemmTuning& r : layer.gemm().tuning()) {
    if (r.tokens == tokens && r.bias) {
      std::printf("  autotune: %d candidates, cuBLASLt's first %.4f ms, chosen #%d %.4f ms (%.1f%% faster); %s\n",
                  r.candidates, r.first_ms, r.chosen, r.chosen_ms,
                  100.0 * (r.first_ms - r.chosen_ms) / r.first_ms, layer.gemm().describe(tokens, true).c_str());
    }
  }

  // ---- sanity check on set 0 ----
  layer.forward(x_of(0), logits_of(0), w.as(), bias.as(), out_fwd.as(), tokens, stream);
  chain.run(x_of(0), logits_of(0), out_chain.as(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  {
    std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), layer.device_mixed(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), chain.mixed(), x_bytes, cudaMemcpyDeviceToHost));
    row.mixed_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    float amax_a = 0, amax_b = 0;
    CUDA_CHECK(cudaMemcpy(&amax_a, layer.device_amax(), sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&amax_b, chain.amax(), sizeof(float), cudaMemcpyDeviceToHost));
    row.amax_bit_equal = std::memcmp(&amax_a, &amax_b, sizeof(float)) == 0;
    CUDA_CHECK(cudaMemcpy(a.data(), out_fwd.as(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_chain.as(), x_bytes, cudaMemcpyDeviceToHost));
    row.out_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    // Relative to the largest |out| of the reference: elementwise relative error is meaningless
    // for outputs that cancel to ~0. A NaN anywhere makes the result NaN.
    double max_diff = 0.0, max_ref = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double diff = std::fabs(static_cast<double>(a[i]) - b[i]);
      max_diff = std::isnan(diff) ? NAN : std::max(max_diff, diff);
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
      if (std::isnan(max_diff)) break;
    }
    row.out_max_rel_diff = max_ref > 0.0 ? max_diff / max_ref : max_diff;
    std::printf("  check: amax %.6g, mixed bit-equal to eager chain: %s, amax bit-equal: %s, out max rel "
                "diff %.3g (max|diff| / max|ref|), out bit-equal: %s\n",
                amax_a, row.mixed_bit_equal ? "yes" : "no", row.amax_bit_equal ? "yes" : "no",
                row.out_max_rel_diff, row.out_bit_equal ? "yes" : "no");
    std::printf("  bare GEMM algo: %s; x sets: %d (%.1f MiB)\n", row.bare_algo.c_str(), row.x_sets,
                x_sets.bytes() / 1048576.0);
  }
  CUDA_CHECK(cudaMemcpyAsync(mixed_ready.as(), layer.device_mixed(), x_bytes, cudaMemcpyDeviceToDevice, stream));
  for (std::size_t k = 0; k < sets; ++k) CUDA_CHECK(qbl::amax(x_of(k), n, amax_sets.as() + k, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));

  // ---- CUDA graph of the forward, one per input set (a graph's pointers are fixed) ----
  std::vector<cudaGraphExec_t> graphs;
  if (args.graph && n < launch_bound_elements) {
    const std::size_t g_count = std::min<std::size_t>(sets, max_graph_sets);
    row.graph_sets = static_cast<int>(g_count);
    for (std::size_t k = 0; k < g_count; ++k) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      layer.forward(x_of(k), logits_of(k), w.as(), bias.as(), out_scratch.as(), tokens, stream);
      CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      CUDA_CHECK(cudaGraphUpload(exec, stream));  // the first launch would otherwise pay for it
      graphs.push_back(exec);
    }
    // The replay of set 0 must reproduce the direct forward bit for bit.
    CUDA_CHECK(cudaGraphLaunch(graphs[0], stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), out_scratch.as(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_fwd.as(), x_bytes, cudaMemcpyDeviceToHost));
    row.graph_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    std::printf("  graph: %zu instantiated, replay of set 0 bit-equal to forward: %s\n", g_count,
                row.graph_bit_equal ? "yes" : "no");
  }

  // ---- timing ----
  auto report = [&](Item i) {
    std::printf("  %-15s median %9.4f ms  min %9.4f ms  (%d runs)\n", item_names[i], row.t[i].median_ms,
                row.t[i].min_ms, row.t[i].runs);
    std::fflush(stdout);
  };
  row.copy_bytes = static_cast<double>(copy_src.bytes());
  row.t[copy_item] = timer.measure([&](int) {
    CUDA_CHECK(cudaMemcpyAsync(copy_dst.as<void>(), copy_src.as<void>(), copy_src.bytes(),
                               cudaMemcpyDeviceToDevice, stream));
  });
  report(copy_item);
  row.t[bare_gemm_item] = timer.measure([&](int) { bare.run(mixed_ready.as(), out_scratch.as(), stream); });
  report(bare_gemm_item);
  row.t[gemm_item] = timer.measure([&](int) {
    CUBLAS_CHECK(gemm.run(mixed_ready.as(), w.as(), bias.as(), out_scratch.as(), tokens,
                          gemm_ws.as<void>(), stream));
  });
  report(gemm_item);
  row.t[amax_item] = timer.measure([&](int i) { CUDA_CHECK(qbl::amax(x_of(static_cast<std::size_t>(i)), n, amax_scratch, stream)); });
  report(amax_item);
  row.t[quant_blend_item] = timer.measure([&](int i) {
    const auto k = static_cast<std::size_t>(i) % sets;
    CUDA_CHECK(qbl::quant_blend(x_of(k), logits_of(k), amax_sets.as() + k, mixed_scratch.as(), tokens, d,
                                scale_scratch, stream));
  });
  report(quant_blend_item);
  row.t[fused_prologue_item] = timer.measure([&](int i) {
    const auto k = static_cast<std::size_t>(i);
    CUDA_CHECK(qbl::amax_quant_blend(x_of(k), logits_of(k), mixed_scratch.as(), tokens, d, amax_scratch,
                                     scale_scratch, stream));
  });
  report(fused_prologue_item);
  row.t[forward_item] = timer.measure([&](int i) {
    const auto k = static_cast<std::size_t>(i);
    layer.forward(x_of(k), logits_of(k), w.as(), bias.as(), out_fwd.as(), tokens, stream);
  });
  report(forward_item);
  if (!graphs.empty()) {
    row.t[graph_item] = timer.measure([&](int i) {
      CUDA_CHECK(cudaGraphLaunch(graphs[static_cast<std::size_t>(i) % graphs.size()], stream));
    });
    report(graph_item);
  }
  row.t[eager_item] = timer.measure([&](int i) {
    const auto k = static_cast<std::size_t>(i);
    chain.run(x_of(k), logits_of(k), out_chain.as(), stream);
  });
  report(eager_item);

  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (cudaGraphExec_t g : graphs) CUDA_CHECK(cudaGraphExecDestroy(g));  // before `layer` goes
  std::printf("  copy %.0f GB/s, floor %.4f ms, forward/floor %.3f, eager/forward %.2f; device memory "
              "held by the harness %.2f GiB\n",
              row.copy_gbps(), row.floor_ms(), row.over_floor(forward_item), row.speedup_vs_eager(),
              g_allocated_bytes / (1024.0 * 1048576.0));
  return row;
}

int run(const Args& args) {
  int count = 0;
  const cudaError_t st = cudaGetDeviceCount(&count);
  if (st != cudaSuccess || count == 0) {
    std::printf("qbl_bench: no CUDA device available (%s); nothing to benchmark.\n",
                st != cudaSuccess ? cudaGetErrorString(st) : "cudaGetDeviceCount returned 0");
    return 0;
  }
  if (args.device < 0 || args.device >= count) bad_args("--device out of range");
  CUDA_CHECK(cudaSetDevice(args.device));

  GpuInfo gpu;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, args.device));
  gpu.name = prop.name;
  gpu.total_mem = prop.totalGlobalMem;
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.sms, cudaDevAttrMultiProcessorCount, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.l2_bytes, cudaDevAttrL2CacheSize, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.cc_major, cudaDevAttrComputeCapabilityMajor, args.device));
  CUDA_CHECK(cudaDeviceGetAttribute(&gpu.cc_minor, cudaDevAttrComputeCapabilityMinor, args.device));
  CUDA_CHECK(cudaDriverGetVersion(&gpu.driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&gpu.runtime));
  gpu.cublaslt = cublasLtGetVersion();
  std::printf("%s\n", gpu_line(gpu).c_str());
  std::printf("timing: median of per-run event times, >= %d runs and >= %.0f ms per item (at most %d "
              "runs); copy %zu MiB\n",
              args.reps, args.min_ms, args.max_runs, args.copy_mib);

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Row> rows;
  {
    RunTimer timer(stream, args.min_ms, args.reps, args.max_runs);
    DeviceBuffer copy_src(args.copy_mib * mib), copy_dst(args.copy_mib * mib);
    fill_randn(copy_src.as(), static_cast<std::int64_t>(copy_src.bytes() / sizeof(float)), 5, 1.0f, gpu.sms, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int idx : args.shapes) {
      rows.push_back(bench_shape(shape_table[idx], gpu, args, stream, timer, copy_src, copy_dst));
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));

  std::printf("\n%s\n", gpu_line(gpu).c_str());
  print_table(rows);
  bool all_equal = true;
  for (const Row& r : rows) all_equal = all_equal && r.mixed_bit_equal;
  std::printf("mixed bit-equal to the eager chain on every shape: %s\n", all_equal ? "yes" : "NO");
  if (!args.csv_path.empty()) write_csv(args.csv_path, gpu, rows);
  if (!args.md_path.empty()) write_md(args.md_path, gpu, args, rows);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  try {
    return run(args);
  } catch (const std::exception& e) {  // qbl's host API throws on CUDA / cuBLAS failures
    std::fflush(stdout);
    std::fprintf(stderr, "qbl_bench: %s\n", e.what());
    return 1;
  }
}

// qbl_bench -- benchmark of qbl::QuantBlendLinear against its floor and an eager-like chain, in
// fp32, TF32, bf16 and fp16.
//
// For every shape (B, T, D) of the table below (tokens = B * T, in = out = D) and every dtype of
// --dtypes, one process times, side by side on one non-default stream:
//   forward      qbl::QuantBlendLinear<T>::forward (one object per shape and dtype,
//                max_tokens = tokens)
//   graph        the same forward captured once into a CUDA graph and replayed (launch-bound
//                shapes only: tokens * D < 2^20)
//   amax         qbl::amax alone
//   quant_blend  qbl::quant_blend alone, given a ready d_amax
//   fused_prol.  qbl::amax_quant_blend (the prologue exactly as forward() issues it)
//   gemm         qbl::LinearGemm<T>::run on a ready `mixed`, built with Options::autotune (the
//                forward runs the default: cuBLASLt's first-ranked algorithm, as bare_gemm does)
//   bare_gemm    cuBLASLt set up here directly: TN, A/B/C/D in T, fp32 compute and scale,
//                EPILOGUE_BIAS, top heuristic algorithm, 32 MiB workspace -- the "GEMM floor"
//   eager        an unfused chain that mirrors eager PyTorch kernel by kernel (abs, max,
//                clamp_min, scale, div, round, clamp, mul, sigmoid, mul, rsub, mul, add), each
//                step its own kernel and its own temporary, then the same bare GEMM
//   copy         a 1 GiB device-to-device cudaMemcpyAsync: the bandwidth a streaming kernel can
//                hope for, measured in the same run (bytes read + bytes written over time), once
//                per shape and shared by its dtypes, so that their floors use one bandwidth
// and, unless --no-train, the training items of bench_train.cuh (its header comment defines them):
//   train        one forward into caller-provided mixed/stats + one backward computing grad_x,
//                grad_logits, grad_weight and grad_bias, on a QuantBlendLinear<T> built with
//                Options::backward (x and logits rotating, grad_out one fixed random tensor)
//   train_graph  the same captured into CUDA graphs and replayed (launch-bound shapes only)
//   bare_dgrad   cuBLASLt NN g · W (no epilogue), bare_wgrad cuBLASLt NT gᵀ · mixed with the
//                BGRADB bias-gradient epilogue, both set up as bare_gemm
//
// Dtypes (--dtypes, any of the four; default fp32,tf32,bf16), element type T:
//   fp32   float; every GEMM in CUBLAS_COMPUTE_32F (PyTorch's default fp32 matmul)
//   tf32   float; qbl built with Options::allow_tf32 and the bare GEMM in
//          CUBLAS_COMPUTE_32F_FAST_TF32 (torch.backends.cuda.matmul.allow_tf32 = True); the
//          prologue is fp32's
//   bf16   __nv_bfloat16
//   fp16   __half
// For bf16 and fp16 every tensor is in T and every element op computes in fp32 and rounds its
// result to T, as eager does; the GEMMs run on the tensor cores with fp32 accumulation, split-K
// partials reduced in fp32 only (the bare GEMM is held to the same rule as qbl's).
// For each shape the selected dtypes run one after another, so that they are measured next to
// each other.
//
// Method. Each item gets warm-up runs first (doubling rounds until one round lasts >= 10 ms), then
// at least --reps runs and enough that they add up to >= --min-ms. The items of one shape and
// dtype are timed side by side: rounds of ~2 ms per item go to each item in turn, so that all of
// them see the same clocks and temperature (timed one after another, a later item ran up to 15 %
// slower than an earlier one on an H200 under sustained bf16 GEMM load, the same kernel included).
// Every run is bracketed by its own event pair and the MEDIAN of the per-run times is reported
// (robust to the occasional preempted or clock-throttled run). Inputs rotate run by run over K independent sets of x and
// logits with K * bytes(x) >= 3 x L2 (bytes in T), so that x comes from HBM as it does in a real
// network where the previous layer's output has long left L2. W, b and the GEMM's `mixed` operand
// do not rotate: in real use the same weights are read every step, and `mixed` is consumed right
// after it is written. All inputs are random, generated on the device in T (never zeros: zeros
// would make the fake-quantize degenerate and may let the GPU run at lower power).
//
// Before timing, each shape and dtype is checked once: the chain's `mixed` must be bit-identical
// to QuantBlendLinear<T>::device_mixed() and its amax bit-equal; the two `out`s are compared and
// their largest relative difference reported (they differ only if cuBLASLt picked different
// algorithms for the two GEMMs: ~1e-6 in fp32, a few units in T's last place otherwise).
//
// The training items get their own check before timing (outputs poisoned and then all written and
// finite, gradients against the bare products' outputs; see bench_train.cuh).
//
// Derived numbers: floor_ms = bare_gemm_ms + 2 * tokens * D * sizeof(T) B / copy bandwidth (read x
// once, write mixed once, at copy speed); prologue GB/s = 3 * tokens * D * sizeof(T) B /
// (amax_ms + quant_blend_ms) (amax reads x; quant_blend reads x and writes mixed); GEMM TFLOP/s =
// 2 * tokens * D^2 / bare_gemm_ms; train_floor_ms = floor_ms + bare_dgrad_ms + bare_wgrad_ms +
// 3 * tokens * D * sizeof(T) B / copy bandwidth (the backward's elementwise stage reads g_mixed and
// x and writes grad_x). The training items' CSV columns follow all the earlier ones.
//
//   qbl_bench [--shapes 0,3,6] [--dtypes fp32,tf32,bf16,fp16] [--csv results.csv] [--md results.md]
//             [--min-ms 50] [--reps 20] [--no-graph] [--no-train] [--gemm-probe]

#include <qbl/qbl.cuh>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
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
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
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
// biggest, ~2 GiB more with the training items) and the copy buffers (2 GiB) the process stays
// under ~12 GiB.
constexpr std::size_t rotation_cap_bytes = 2048 * mib;
constexpr int max_graph_sets = 8192;  // one instantiated graph per rotating input set, at most
constexpr double warmup_round_ms = 10.0;

// ---- dtypes ------------------------------------------------------------------------------------

// tf32 shares fp32's element type; it changes only how the GEMMs compute.
enum class Dtype { fp32, tf32, bf16, fp16 };
constexpr Dtype all_dtypes[] = {Dtype::fp32, Dtype::tf32, Dtype::bf16, Dtype::fp16};
constexpr const char* dtype_names[] = {"fp32", "tf32", "bf16", "fp16"};
constexpr const char* default_dtypes = "fp32,tf32,bf16";

const char* dtype_name(Dtype d) { return dtype_names[static_cast<int>(d)]; }

// ---- command line ------------------------------------------------------------------------------

struct Args {
  std::string csv_path, md_path;
  std::vector<int> shapes;
  std::vector<Dtype> dtypes;
  double min_ms = 50.0;
  int reps = 20;
  int max_runs = 100000;
  std::size_t copy_mib = 1024;
  int device = 0;
  bool graph = true;
  bool gemm_probe = false;
  bool train = true;
};

void print_usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "  --shapes i,j,...   indices into the shape table (default: all)\n"
      "  --dtypes LIST      comma-separated from fp32, tf32, bf16, fp16 (default %s);\n"
      "                     for each shape, every dtype listed, in the order given\n"
      "  --csv PATH         write one CSV row per shape and dtype\n"
      "  --md PATH          write a markdown table\n"
      "  --min-ms X         timed runs per item add up to at least X ms (default 50)\n"
      "  --reps N           at least N timed runs per item (default 20)\n"
      "  --max-runs N       at most N timed runs per item (default 100000)\n"
      "  --copy-mib N       size of the device-to-device copy (default 1024)\n"
      "  --device N         CUDA device (default 0)\n"
      "  --no-graph         skip the CUDA-graph replays of launch-bound shapes\n"
      "  --no-train         skip the training items (forward + backward and its floor)\n"
      "  --gemm-probe       also time the bare GEMM planned the ways qbl::LinearGemm plans it\n"
      "                     (heuristic asked for 4 results, no bias pointer while asking,\n"
      "                     explicit 256-byte alignment preferences) and the layer's own GEMM\n"
      "dtypes: fp32 and tf32 run float tensors (tf32: both GEMMs in CUBLAS_COMPUTE_32F_FAST_TF32),\n"
      "        bf16 and fp16 run __nv_bfloat16 and __half tensors with fp32 accumulation\n"
      "shapes (B, T, D):\n",
      argv0, default_dtypes);
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

// "a,b,c" -> {"a", "b", "c"}; an empty item stays (and is rejected by the caller).
std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    const std::size_t comma = std::min(list.find(',', pos), list.size());
    items.push_back(list.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return items;
}

std::vector<Dtype> parse_dtypes(const std::string& list) {
  std::vector<Dtype> dtypes;
  for (const std::string& item : split_list(list)) {
    const auto known = std::find_if(std::begin(all_dtypes), std::end(all_dtypes),
                                    [&](Dtype d) { return item == dtype_name(d); });
    if (known == std::end(all_dtypes)) {
      bad_args("unknown dtype in --dtypes: '" + item + "' (fp32, tf32, bf16 or fp16)");
    }
    dtypes.push_back(*known);
  }
  return dtypes;
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
      for (const std::string& item : split_list(value())) {
        const long long idx = parse_int(flag, item.c_str());
        if (idx < 0 || idx >= shape_count) bad_args("shape index out of range: " + item);
        a.shapes.push_back(static_cast<int>(idx));
      }
    } else if (flag == "--dtypes") {
      a.dtypes = parse_dtypes(value());  // never empty: an empty item is rejected
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
    } else if (flag == "--gemm-probe") {
      a.gemm_probe = true;
    } else if (flag == "--no-train") {
      a.train = false;
    } else {
      bad_args("unknown option " + flag);
    }
  }
  if (a.shapes.empty()) {
    for (int i = 0; i < shape_count; ++i) a.shapes.push_back(i);
  }
  if (a.dtypes.empty()) a.dtypes = parse_dtypes(default_dtypes);
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

// ---- element types -------------------------------------------------------------------------
//
// Conversions go through the named intrinsics only: the harness must also build where the
// implicit __half / __nv_bfloat16 conversions and operators are switched off
// (__CUDA_NO_HALF_CONVERSIONS__ and friends, as PyTorch builds its extensions). Float -> T
// rounds to nearest even, which is what eager does when it stores an fp32 result in T.

template <typename T>
inline constexpr bool is_element_type =
    std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

__host__ __device__ __forceinline__ float to_f32(float v) { return v; }
__host__ __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__host__ __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__host__ __device__ T from_f32(float v);
template <>
__host__ __device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__host__ __device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// v rounded to the nearest T, held as a float (the identity for float).
template <typename T>
__host__ __device__ __forceinline__ float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// cuBLASLt's type code for T.
template <typename T>
constexpr cudaDataType_t cuda_data_type() {
  static_assert(is_element_type<T>, "T is float, __nv_bfloat16 or __half");
  return std::is_same_v<T, float> ? CUDA_R_32F : (std::is_same_v<T, __half> ? CUDA_R_16F : CUDA_R_16BF);
}

// 16 bytes of T moved as one access: 4 floats or 8 bf16 / fp16 values.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int size = static_cast<int>(16 / sizeof(T));
  T v[size];
};

// ---- random inputs, generated on the device -------------------------------------------------

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Box-Muller over two 24-bit uniforms from one 64-bit hash of (seed, i): randn-like, |z| <= 5.8;
// drawn in fp32 and rounded to T, as torch.randn(dtype=T) stores it.
template <typename T>
__global__ void fill_randn_kernel(T* __restrict__ p, std::int64_t n, std::uint64_t seed, float stddev) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u1 = static_cast<float>((h >> 40) + 1) * 0x1p-24f;  // (0, 1]
    const float u2 = static_cast<float>(h & 0xffffffu) * 0x1p-24f;  // [0, 1)
    p[i] = from_f32<T>(stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

// Uniform in [-bound, bound): nn.Linear's default init for W and b with bound = 1/sqrt(in).
template <typename T>
__global__ void fill_uniform_kernel(T* __restrict__ p, std::int64_t n, std::uint64_t seed, float bound) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;
    p[i] = from_f32<T>(bound * (2.0f * u - 1.0f));
  }
}

unsigned fill_grid(std::int64_t n, int sms) {
  return static_cast<unsigned>(std::max<std::int64_t>(
      1, std::min<std::int64_t>((n + 255) / 256, std::int64_t{sms} * 32)));
}

template <typename T>
void fill_randn(T* p, std::int64_t n, std::uint64_t seed, float stddev, int sms, cudaStream_t s) {
  fill_randn_kernel<T><<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, stddev);
  LAUNCH_CHECK();
}

template <typename T>
void fill_uniform(T* p, std::int64_t n, std::uint64_t seed, float bound, int sms, cudaStream_t s) {
  fill_uniform_kernel<T><<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, bound);
  LAUNCH_CHECK();
}

// ---- the eager-like chain's kernels ------------------------------------------------------------
//
// One kernel per eager op, each writing its own temporary in T. Like PyTorch's vectorized
// elementwise kernel: 128 threads, 16 bytes per thread (4 floats, 8 bf16 / fp16 values), a
// one-shot grid. (Eager's broadcast ops -- alpha [tokens, 1] times x_q -- take PyTorch's slower
// non-vectorized path; here they stay vectorized, so this chain is, if anything, faster than
// eager and the speedup over it is conservative.)
// Every op reads T, computes in fp32 and rounds its result to T once, as eager's kernels do for
// bf16 / fp16 (for float the rounding is the identity). Arithmetic uses the _rn intrinsics: no
// contraction, IEEE rounding of every step, as eager.

constexpr int ew_threads = 128;

struct AbsOp {
  __device__ float operator()(float v) const { return fabsf(v); }
};
// amax.clamp(min=1e-8): eager converts the bound to T before it compares (1e-8 is 0 in fp16).
// NaN stays NaN (NaN < x is false).
template <typename T>
struct ClampMinOp {
  __device__ float operator()(float v) const {
    const float bound = round_to<T>(1e-8f);
    return v < bound ? bound : v;
  }
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

// First element of this thread's 16 bytes.
template <typename T>
__device__ __forceinline__ std::int64_t ew_first() {
  return (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * Vec16<T>::size;
}

// out[i] = op(a[i])
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    unary_kernel(const T* __restrict__ a, T* __restrict__ out, std::int64_t n, Op op) {
  constexpr int N = Vec16<T>::size;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_f32<T>(op(to_f32(u.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) out[j] = from_f32<T>(op(to_f32(a[j])));
  }
}

// out[i] = op(a[i], b[i])
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    binary_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                  std::int64_t n, Op op) {
  constexpr int N = Vec16<T>::size;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    const Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(b + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_f32<T>(op(to_f32(u.v[j]), to_f32(v.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) out[j] = from_f32<T>(op(to_f32(a[j]), to_f32(b[j])));
  }
}

// out[i] = op(a[i], *s): a 0-dim device tensor on the right (x / scale, q * scale). The scalar is
// held as a float whose value T represents exactly.
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    scalar_rhs_kernel(const T* __restrict__ a, const float* __restrict__ s, T* __restrict__ out,
                      std::int64_t n, Op op) {
  constexpr int N = Vec16<T>::size;
  const std::int64_t i = ew_first<T>();
  const float sv = *s;
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_f32<T>(op(to_f32(u.v[j]), sv));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) out[j] = from_f32<T>(op(to_f32(a[j]), sv));
  }
}

// out[i] = op(r[i / cols], a[i]): a [rows, 1] tensor broadcast over a [rows, cols] one
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    row_lhs_kernel(const T* __restrict__ r, const T* __restrict__ a, T* __restrict__ out,
                   std::int64_t n, std::int64_t cols, Op op) {
  constexpr int N = Vec16<T>::size;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {  // cols % N == 0 here, so the N elements share one row
    const float rv = to_f32(r[i / cols]);
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = from_f32<T>(op(rv, to_f32(u.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = o;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) {
      out[j] = from_f32<T>(op(to_f32(r[j / cols]), to_f32(a[j])));
    }
  }
}

// *out = op(*a), rounded to T: the 0-dim ops (clamp_min, the scale) on 0-dim T tensors, whose
// values are held as floats.
template <typename T, typename Op>
__global__ void scalar_unary_kernel(const float* __restrict__ a, float* __restrict__ out, Op op) {
  *out = round_to<T>(op(*a));
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
// counter for the next launch. `a` is 16-byte aligned. A max of T values is a T value, so the
// result, held as a float, needs no rounding.
template <typename T>
__global__ void __launch_bounds__(reduce_threads)
    max_reduce_kernel(const T* __restrict__ a, std::int64_t n, float* __restrict__ partials,
                      unsigned* __restrict__ counter, float* __restrict__ out) {
  constexpr int N = Vec16<T>::size;
  __shared__ float scratch[reduce_threads / 32];
  __shared__ bool is_last;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * reduce_threads;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * reduce_threads + threadIdx.x;
  float m = -INFINITY;
  const std::int64_t nv = n / N;
  for (std::int64_t i = tid; i < nv; i += stride) {
    const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(a)[i];
#pragma unroll
    for (int j = 0; j < N; ++j) m = nan_max(m, to_f32(v.v[j]));
  }
  for (std::int64_t i = nv * N + tid; i < n; i += stride) m = nan_max(m, to_f32(a[i]));
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

template <typename T>
unsigned ew_grid(std::int64_t n) {
  constexpr std::int64_t per_block = std::int64_t{Vec16<T>::size} * ew_threads;
  return static_cast<unsigned>(std::max<std::int64_t>(1, (n + per_block - 1) / per_block));
}

// 16-byte accesses when every buffer is 16-byte aligned and n is a whole number of them.
template <typename T>
bool whole_vectors(std::int64_t n) {
  return n % Vec16<T>::size == 0;
}

template <typename T, typename Op>
void launch_unary(const T* a, T* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n)) {
    unary_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, out, n, op);
  } else {
    unary_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_binary(const T* a, const T* b, T* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(b) && aligned16(out) && whole_vectors<T>(n)) {
    binary_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, b, out, n, op);
  } else {
    binary_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, b, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_scalar_rhs(const T* a, const float* scalar, T* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n)) {
    scalar_rhs_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  } else {
    scalar_rhs_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_row_lhs(const T* r, const T* a, T* out, std::int64_t n, std::int64_t cols, Op op,
                    cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n) && whole_vectors<T>(cols)) {
    row_lhs_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  } else {
    row_lhs_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_scalar_unary(const float* a, float* out, Op op, cudaStream_t s) {
  scalar_unary_kernel<T><<<1, 1, 0, s>>>(a, out, op);
  LAUNCH_CHECK();
}

// ---- the bare cuBLASLt GEMM + bias: the floor ---------------------------------------------
//
// Row-major out[tokens, D] = mixed[tokens, D] · W[D, D]ᵀ + b as the column-major product
// outᵀ = W · mixedᵀ: m = out, n = tokens, k = in, A = W (k x m, ld k) transposed, B = mixed
// (k x n, ld k), C = D = out (m x n, ld m), all in T; fp32 compute (TF32 when asked) and scale.
// Default preferences besides the workspace (cuBLASLt then assumes 256-byte-aligned pointers,
// which every cudaMalloc buffer here is) and the first heuristic result, as a straightforward
// user of cuBLASLt would do it. For 16-bit T the bias is in T and split-K partials may only be
// reduced in fp32 (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): qbl::LinearGemm holds itself to that
// rule, and a floor allowed to sum partials in bf16 could pick algorithms qbl may not.

// cuBLASLt objects owned through the library's RAII types (qbl/detail/handles.hpp), so that no
// Create needs a Destroy paired by hand; a failure to create ends the run like every other status.
qbl::detail::lt_handle make_lt_handle() {
  cublasLtHandle_t h = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&h));
  return qbl::detail::lt_handle(h);
}

// fp32 scale type always: alpha and beta are floats for every dtype here.
qbl::detail::lt_matmul_desc make_lt_desc(cublasComputeType_t compute) {
  cublasLtMatmulDesc_t d = nullptr;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  return qbl::detail::lt_matmul_desc(d);
}

// A contiguous column-major rows x cols matrix (ld = rows).
qbl::detail::lt_layout make_lt_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols) {
  cublasLtMatrixLayout_t l = nullptr;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                          static_cast<std::uint64_t>(cols), rows));
  return qbl::detail::lt_layout(l);
}

// The bare products' preference: the 32 MiB workspace and, for 16-bit T, split-K partials
// reduced in fp32 only (the rule qbl's GEMMs hold themselves to).
template <typename T>
qbl::detail::lt_preference make_bare_preference() {
  cublasLtMatmulPreference_t p = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p));
  qbl::detail::lt_preference pref(p);
  const std::uint64_t ws = gemm_workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws));
  if (cuda_data_type<T>() != CUDA_R_32F) {
    const std::uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                      &schemes, sizeof schemes));
  }
  return pref;
}

// "id=.. tile=.. stages=.. splitk=.." of an algorithm, to compare runs and machines.
std::string algo_summary(const cublasLtMatmulAlgo_t& algo) {
  auto attr = [&](cublasLtMatmulAlgoConfigAttributes_t a) {
    std::uint32_t v = 0;
    std::size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, a, &v, sizeof v, &written) !=
        CUBLAS_STATUS_SUCCESS) {
      return std::string("?");
    }
    return std::to_string(v);
  };
  return "id=" + attr(CUBLASLT_ALGO_CONFIG_ID) + " tile=" + attr(CUBLASLT_ALGO_CONFIG_TILE_ID) +
         " stages=" + attr(CUBLASLT_ALGO_CONFIG_STAGES_ID) +
         " splitk=" + attr(CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
}

/// How the bare GEMM asks cuBLASLt's heuristic (--gemm-probe varies it; the default is the
/// straightforward query described above).
struct BareQuery {
  int requested = 1;           // results asked for; the first is used
  bool bias_at_query = true;   // bias pointer set on the descriptor before asking
  bool align_prefs = false;    // MIN_ALIGNMENT_{A,B,C,D}_BYTES = 256 set explicitly
  std::string name() const {
    return "req" + std::to_string(requested) + (bias_at_query ? "+bias" : "-bias") +
           (align_prefs ? "+align" : "");
  }
};

template <typename T>
class BareGemm {
 public:
  BareGemm(std::int64_t in, std::int64_t out, std::int64_t tokens, const T* w, const T* bias,
           cublasComputeType_t compute, BareQuery query = {})
      : w_(w), workspace_(gemm_workspace_bytes) {
    constexpr cudaDataType_t type = cuda_data_type<T>();
    handle_ = make_lt_handle();
    desc_ = make_lt_desc(compute);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                &epilogue, sizeof epilogue));
    if (query.bias_at_query) {
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &bias, sizeof bias));
    }
    if (type != CUDA_R_32F) {
      const std::int32_t bias_type = type;  // nn.Linear's bias is in T too
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                  &bias_type, sizeof bias_type));
    }
    a_ = make_lt_layout(type, in, out);      // W: k x m, transposed
    b_ = make_lt_layout(type, in, tokens);   // mixed: k x n
    c_ = make_lt_layout(type, out, tokens);  // out: m x n
    pref_ = make_bare_preference<T>();
    if (query.align_prefs) {
      const std::uint32_t align = 256;
      for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref_.get(), attr, &align, sizeof align));
      }
    }
    cublasLtMatmulHeuristicResult_t results[8] = {};
    int found = 0;
    const int requested = std::clamp(query.requested, 1, 8);
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_.get(), desc_.get(), a_.get(), b_.get(),
                                                c_.get(), c_.get(), pref_.get(), requested, results,
                                                &found));
    if (found < 1 || results[0].state != CUBLAS_STATUS_SUCCESS) {
      die("cublasLtMatmulAlgoGetHeuristic", "no algorithm for the bare GEMM", __FILE__, __LINE__);
    }
    algo_ = results[0].algo;
    if (!query.bias_at_query) {
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                  &bias, sizeof bias));
    }
  }
  BareGemm(const BareGemm&) = delete;
  BareGemm& operator=(const BareGemm&) = delete;

  void run(const T* mixed, T* out, cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;  // scale type CUDA_R_32F
    CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), &one, w_, a_.get(), mixed, b_.get(),
                                &zero, out, c_.get(), out, c_.get(), &algo_, workspace_.as<void>(),
                                gemm_workspace_bytes, s));
  }

  // Every configuration attribute of the chosen algorithm, to compare runs, planners and machines.
  std::string describe_all() const {
    std::string r;
    const std::pair<cublasLtMatmulAlgoConfigAttributes_t, const char*> attrs[] = {
        {CUBLASLT_ALGO_CONFIG_ID, "id"}, {CUBLASLT_ALGO_CONFIG_TILE_ID, "tile"},
        {CUBLASLT_ALGO_CONFIG_STAGES_ID, "stages"}, {CUBLASLT_ALGO_CONFIG_SPLITK_NUM, "splitk"},
        {CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, "reduction"}, {CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, "swizzle"},
        {CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, "custom"}, {CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, "inner"},
        {CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, "cluster"}};
    for (const auto& [attr, name] : attrs) {
      std::size_t size = 0;
      std::uint64_t v = 0;
      const bool ok = cublasLtMatmulAlgoConfigGetAttribute(&algo_, attr, nullptr, 0, &size) == CUBLAS_STATUS_SUCCESS &&
                      size <= sizeof v &&
                      cublasLtMatmulAlgoConfigGetAttribute(&algo_, attr, &v, size, &size) == CUBLAS_STATUS_SUCCESS;
      r += std::string(r.empty() ? "" : " ") + name + "=" + (ok ? std::to_string(v) : "?");
    }
    return r;
  }

  // "id=.. tile=.. stages=.. splitk=.." of the chosen algorithm, to compare runs and machines.
  std::string describe() const { return algo_summary(algo_); }

 private:
  const T* w_;
  DeviceBuffer workspace_;
  // Declared in creation order, destroyed in reverse (the handle last).
  qbl::detail::lt_handle handle_;
  qbl::detail::lt_matmul_desc desc_;
  qbl::detail::lt_layout a_, b_, c_;
  qbl::detail::lt_preference pref_;
  cublasLtMatmulAlgo_t algo_ = {};
};

// ---- the eager-like chain ----------------------------------------------------------------
//
// Every temporary is a T tensor, as in eager; the three 0-dim results (amax, clamped amax, scale)
// are held as floats on the device, each rounded to T by the op that makes it.

template <typename T>
class EagerChain {
 public:
  EagerChain(std::int64_t tokens, std::int64_t d, int sms, BareGemm<T>& gemm)
      : tokens_(tokens),
        d_(d),
        n_(tokens * d),
        reduce_blocks_(static_cast<unsigned>(std::max<std::int64_t>(
            1, std::min<std::int64_t>((n_ / Vec16<T>::size + reduce_threads - 1) / reduce_threads,
                                      std::int64_t{sms} * 4)))),
        gemm_(gemm) {
    const std::size_t bytes = static_cast<std::size_t>(n_) * sizeof(T);
    const std::size_t row_bytes = static_cast<std::size_t>(tokens) * sizeof(T);
    for (DeviceBuffer* b : {&abs_, &div_, &round_, &clamp_, &xq_, &axq_, &omax_, &mixed_}) *b = DeviceBuffer(bytes);
    alpha_ = DeviceBuffer(row_bytes);
    one_minus_alpha_ = DeviceBuffer(row_bytes);
    scalars_ = DeviceBuffer(3 * sizeof(float));  // amax, clamped amax, scale
    partials_ = DeviceBuffer(reduce_blocks_ * sizeof(float));
    counter_ = DeviceBuffer(sizeof(unsigned));
    CUDA_CHECK(cudaMemset(counter_.as<void>(), 0, sizeof(unsigned)));
  }

  // out = (eager's mixed) · Wᵀ + b, 13 kernels and the GEMM, in eager's order of ops.
  void run(const T* x, const T* logits, T* out, cudaStream_t s) {
    float* amax = scalars_.as<float>();
    float* amax_clamped = amax + 1;
    float* scale = amax + 2;
    launch_unary(x, abs_.as<T>(), n_, AbsOp{}, s);                                 // x.abs()
    max_reduce_kernel<T><<<reduce_blocks_, reduce_threads, 0, s>>>(abs_.as<T>(), n_, partials_.as(),
                                                                   counter_.as<unsigned>(), amax);
    LAUNCH_CHECK();                                                                // .max()
    launch_scalar_unary<T>(amax, amax_clamped, ClampMinOp<T>{}, s);                // .clamp(min=1e-8)
    launch_scalar_unary<T>(amax_clamped, scale, ScaleOp{}, s);                     // / 127.0
    launch_scalar_rhs(x, scale, div_.as<T>(), n_, DivOp{}, s);                     // x / scale
    launch_unary(div_.as<T>(), round_.as<T>(), n_, RoundOp{}, s);                  // .round()
    launch_unary(round_.as<T>(), clamp_.as<T>(), n_, ClampQOp{}, s);               // .clamp(-127, 127)
    launch_scalar_rhs(clamp_.as<T>(), scale, xq_.as<T>(), n_, MulOp{}, s);         // * scale
    launch_unary(logits, alpha_.as<T>(), tokens_, SigmoidOp{}, s);                 // sigmoid(logits)
    launch_row_lhs(alpha_.as<T>(), xq_.as<T>(), axq_.as<T>(), n_, d_, MulOp{}, s); // alpha * x_q
    launch_unary(alpha_.as<T>(), one_minus_alpha_.as<T>(), tokens_, RsubOneOp{}, s);  // 1 - alpha
    launch_row_lhs(one_minus_alpha_.as<T>(), x, omax_.as<T>(), n_, d_, MulOp{}, s);   // (1 - alpha) * x
    launch_binary(axq_.as<T>(), omax_.as<T>(), mixed_.as<T>(), n_, AddOp{}, s);       // +
    gemm_.run(mixed_.as<T>(), out, s);                                                // linear
  }

  const T* mixed() const { return mixed_.as<T>(); }
  const float* amax() const { return scalars_.as<float>(); }

 private:
  std::int64_t tokens_, d_, n_;
  unsigned reduce_blocks_;
  BareGemm<T>& gemm_;
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

  // Times several items side by side: after each item's warm-up, rounds of about round_ms per
  // item go to every item in turn until each has its runs, so that every item is timed across
  // the same stretch of clocks and temperature. (Timed one after another, the items timed last
  // ran up to 15 % slower on an H200 under sustained bf16 GEMM load, the same kernel included.)
  std::vector<Timing> measure_together(const std::vector<std::function<void(int)>>& items) {
    const std::size_t n = items.size();
    std::vector<int> index(n, 0), chunk(n), wanted(n);
    for (std::size_t k = 0; k < n; ++k) {
      const double estimate_ms = warm_up(items[k], index[k]);
      const double runs = estimate_ms > 0.0 ? std::ceil(min_total_ms_ / estimate_ms) : max_runs_;
      wanted[k] = static_cast<int>(std::clamp<double>(runs, min_runs_, max_runs_));
      const double per_round = estimate_ms > 0.0 ? std::ceil(round_ms / estimate_ms) : 1.0;
      chunk[k] = static_cast<int>(std::clamp<double>(per_round, 1.0, batch));
    }
    std::vector<std::vector<float>> times(n);
    for (bool more = true; more;) {
      more = false;
      for (std::size_t k = 0; k < n; ++k) {
        if (static_cast<int>(times[k].size()) >= wanted[k]) continue;
        timed_runs(items[k], index[k], std::min(chunk[k], wanted[k] - static_cast<int>(times[k].size())), times[k]);
        more = more || static_cast<int>(times[k].size()) < wanted[k];
      }
    }
    std::vector<Timing> result(n);
    for (std::size_t k = 0; k < n; ++k) result[k] = summarize(times[k]);
    return result;
  }

  // `run_once(i)` enqueues run i on the stream (i picks the rotating input set).
  template <typename F>
  Timing measure(F&& run_once) {
    int index = 0;
    const double estimate_ms = warm_up(run_once, index);
    const double wanted = estimate_ms > 0.0 ? std::ceil(min_total_ms_ / estimate_ms) : max_runs_;
    const int runs = static_cast<int>(std::clamp<double>(wanted, min_runs_, max_runs_));
    std::vector<float> times;
    times.reserve(static_cast<std::size_t>(runs));
    while (static_cast<int>(times.size()) < runs) {
      timed_runs(run_once, index, std::min(batch, runs - static_cast<int>(times.size())), times);
    }
    return summarize(times);
  }

 private:
  // Warm-up in doubling rounds until one round lasts warmup_round_ms: clocks ramp up, lazy
  // module loading and cuBLASLt's first-call setup happen here. Returns the last round's mean.
  template <typename F>
  double warm_up(F&& run_once, int& index) {
    for (int round = 4;; round *= 2) {
      CUDA_CHECK(cudaEventRecord(start_[0], stream_));
      for (int r = 0; r < round; ++r) run_once(index++);
      CUDA_CHECK(cudaEventRecord(stop_[0], stream_));
      CUDA_CHECK(cudaEventSynchronize(stop_[0]));
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start_[0], stop_[0]));
      if (ms >= warmup_round_ms || round >= (1 << 14)) return static_cast<double>(ms) / round;
    }
  }

  // `count` (<= batch) runs, each bracketed by its own event pair; their times are appended.
  template <typename F>
  void timed_runs(F&& run_once, int& index, int count, std::vector<float>& times) {
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

  static Timing summarize(std::vector<float>& times) {
    Timing t;
    t.runs = static_cast<int>(times.size());
    std::sort(times.begin(), times.end());
    const std::size_t mid = times.size() / 2;
    t.median_ms = times.size() % 2 ? times[mid] : 0.5 * (static_cast<double>(times[mid - 1]) + times[mid]);
    t.min_ms = times.front();
    return t;
  }

  static constexpr int batch = 512;  // event pairs in flight before the host reads them back
  static constexpr double round_ms = 2.0;  // per item and round in measure_together
  cudaStream_t stream_;
  double min_total_ms_;
  int min_runs_, max_runs_;
  std::vector<cudaEvent_t> start_, stop_;
};

}  // namespace

// The training items (train, train_graph, bare_dgrad, bare_wgrad): a part of this file, kept apart
// for length; it uses everything above.
#include "bench_train.cuh"

namespace {

// ---- results ----------------------------------------------------------------------------------

// The timed items, in the order of the CSV columns.
enum Item { forward_item, graph_item, amax_item, quant_blend_item, fused_prologue_item, gemm_item,
            bare_gemm_item, eager_item, copy_item, item_count };
const char* const item_names[item_count] = {"forward", "graph", "amax", "quant_blend", "fused_prologue",
                                            "gemm", "bare_gemm", "eager", "copy"};

std::string shape_label(const Shape& s) {
  return std::to_string(s.b) + "x" + std::to_string(s.t) + "x" + std::to_string(s.d);
}

struct Row {
  Shape shape{};
  Dtype dtype = Dtype::fp32;
  double elem_bytes = 4;  // sizeof(T): every byte count below is in T
  std::int64_t tokens = 0;
  int x_sets = 0, graph_sets = 0;
  Timing t[item_count];
  double copy_bytes = 0;  // bytes of one copy (read once, written once)
  bool mixed_bit_equal = false, amax_bit_equal = false, out_bit_equal = false;
  double out_max_rel_diff = NAN;
  int graph_bit_equal = -1;  // -1: no graph
  std::string bare_algo;
  TrainRow train;  // the training items (bench_train.cuh); untimed with --no-train

  double n() const { return static_cast<double>(tokens) * static_cast<double>(shape.d); }
  double ms(Item i) const { return t[i].median_ms; }
  double copy_gbps() const { return 2.0 * copy_bytes / (ms(copy_item) * 1e-3) / 1e9; }
  double floor_ms() const {
    return ms(bare_gemm_item) + 2.0 * n() * elem_bytes / (copy_gbps() * 1e9) * 1e3;
  }
  double over_floor(Item i) const { return t[i].valid() ? ms(i) / floor_ms() : NAN; }
  // The forward's floor + bare dgrad + bare wgrad (with BGRADB) + reading g_mixed and x and
  // writing grad_x once at copy bandwidth.
  double train_floor_ms() const {
    if (!train.timed()) return NAN;
    return floor_ms() + train.ms(bare_dgrad_item) + train.ms(bare_wgrad_item) +
           3.0 * n() * elem_bytes / (copy_gbps() * 1e9) * 1e3;
  }
  double train_over_floor(TrainItem i) const {
    return train.t[i].valid() ? train.ms(i) / train_floor_ms() : NAN;
  }
  double prologue_gbps() const {
    return 3.0 * n() * elem_bytes / ((ms(amax_item) + ms(quant_blend_item)) * 1e-3) / 1e9;
  }
  double amax_gbps() const { return n() * elem_bytes / (ms(amax_item) * 1e-3) / 1e9; }
  double quant_blend_gbps() const { return 2.0 * n() * elem_bytes / (ms(quant_blend_item) * 1e-3) / 1e9; }
  double gemm_tflops() const {
    return 2.0 * n() * static_cast<double>(shape.d) / (ms(bare_gemm_item) * 1e-3) / 1e12;
  }
  double speedup_vs_eager() const { return ms(eager_item) / ms(forward_item); }
  std::string label() const { return shape_label(shape); }
  const char* dtype_label() const { return dtype_name(dtype); }
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
  // dtype follows the shape (B, T, D); every other column keeps its name, so readers that pick
  // columns by name (plot.py) still work.
  std::fprintf(f, "gpu,sms,l2_bytes,driver,runtime,B,T,D,dtype,tokens,x_sets,graph_sets");
  for (int i = 0; i < item_count; ++i) {
    std::fprintf(f, ",%s_ms,%s_min_ms,%s_runs", item_names[i], item_names[i], item_names[i]);
  }
  std::fprintf(f,
               ",copy_gbps,floor_ms,forward_over_floor,graph_over_floor,eager_over_floor,"
               "prologue_gbps,prologue_over_copy,amax_gbps,amax_over_copy,quant_blend_gbps,"
               "quant_blend_over_copy,gemm_over_bare,gemm_tflops,speedup_vs_eager,"
               "mixed_bit_equal,amax_bit_equal,out_bit_equal,out_max_rel_diff,graph_bit_equal,"
               "bare_gemm_algo");
  // The training items' columns come last, so that every earlier column keeps its position; they
  // stay blank where the items did not run (--no-train).
  for (int i = 0; i < train_item_count; ++i) {
    std::fprintf(f, ",%s_ms,%s_min_ms,%s_runs", train_item_names[i], train_item_names[i],
                 train_item_names[i]);
  }
  std::fprintf(f,
               ",train_floor_ms,train_over_floor,train_graph_over_floor,bare_wgrad_bgradb,"
               "train_check_ok,train_unwritten,train_nonfinite,train_mixed_bit_equal,"
               "train_grad_x_rel_diff,train_grad_weight_rel_diff,train_grad_bias_rel_diff,"
               "train_graph_bit_equal,bare_dgrad_algo,bare_wgrad_algo\n");
  for (const Row& r : rows) {
    std::fprintf(f, "\"%s\",%d,%d,%s,%s,%" PRId64 ",%" PRId64 ",%" PRId64 ",%s,%" PRId64 ",%d,%d",
                 gpu.name.c_str(), gpu.sms, gpu.l2_bytes, version_string(gpu.driver).c_str(),
                 version_string(gpu.runtime).c_str(), r.shape.b, r.shape.t, r.shape.d,
                 r.dtype_label(), r.tokens, r.x_sets, r.graph_sets);
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
    std::fprintf(f, ",%d,%d,%d,%.3g,%s,\"%s\"", r.mixed_bit_equal, r.amax_bit_equal,
                 r.out_bit_equal, r.out_max_rel_diff,
                 r.graph_bit_equal < 0 ? "" : std::to_string(r.graph_bit_equal).c_str(),
                 r.bare_algo.c_str());
    const TrainRow& tr = r.train;
    for (int i = 0; i < train_item_count; ++i) {
      if (tr.t[i].valid()) {
        std::fprintf(f, ",%.6g,%.6g,%d", tr.t[i].median_ms, tr.t[i].min_ms, tr.t[i].runs);
      } else {
        std::fprintf(f, ",,,");
      }
    }
    if (tr.timed()) {
      std::fprintf(
          f, ",%.6g,%.6g,%s,%d,%d,%" PRId64 ",%" PRId64 ",%d,%.3g,%.3g,%.3g,%s,\"%s\",\"%s\"\n",
          r.train_floor_ms(), r.train_over_floor(train_item),
          fmt("%.6g", r.train_over_floor(train_graph_item)).c_str(), tr.bgradb, tr.check_ok(),
          tr.unwritten, tr.nonfinite, tr.mixed_bit_equal, tr.grad_x_rel_diff,
          tr.grad_weight_rel_diff, tr.grad_bias_rel_diff,
          tr.graph_bit_equal < 0 ? "" : std::to_string(tr.graph_bit_equal).c_str(),
          tr.dgrad_algo.c_str(), tr.wgrad_algo.c_str());
    } else {
      std::fprintf(f, ",,,,,,,,,,,,,,\n");  // the 14 columns after the items' times
    }
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// One table layout shared by stdout (aligned) and markdown.
struct Column {
  const char* header;
  std::string (*cell)(const Row&);
  bool train = false;  // shown only when some row timed the training items
};

const Column columns[] = {
    {"shape", [](const Row& r) { return r.label(); }},
    {"dtype", [](const Row& r) { return std::string(r.dtype_label()); }},
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
    {"train ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_item)); }, true},
    {"tgraph ms", [](const Row& r) { return fmt("%.4f", r.train.ms(train_graph_item)); }, true},
    {"dgrad ms", [](const Row& r) { return fmt("%.4f", r.train.ms(bare_dgrad_item)); }, true},
    {"wgrad ms", [](const Row& r) { return fmt("%.4f", r.train.ms(bare_wgrad_item)); }, true},
    {"tfloor ms", [](const Row& r) { return fmt("%.4f", r.train_floor_ms()); }, true},
    {"train/floor", [](const Row& r) { return fmt("%.3f", r.train_over_floor(train_item)); }, true},
    {"tgraph/floor", [](const Row& r) { return fmt("%.3f", r.train_over_floor(train_graph_item)); },
     true},
};
constexpr int column_count = static_cast<int>(sizeof columns / sizeof columns[0]);
constexpr int text_columns = 2;  // shape and dtype, left-aligned; the numbers right-aligned

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

bool any_train(const std::vector<Row>& rows) {
  return std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.train.timed(); });
}

// Indices of the columns to show: the training columns only when some row has them.
std::vector<int> shown_columns(const std::vector<Row>& rows) {
  std::vector<int> shown;
  const bool train = any_train(rows);
  for (int c = 0; c < column_count; ++c) {
    if (train || !columns[c].train) shown.push_back(c);
  }
  return shown;
}

void print_table(const std::vector<Row>& rows) {
  const std::vector<int> shown = shown_columns(rows);
  std::vector<std::vector<std::string>> cells(rows.size());
  std::size_t width[column_count];
  for (int c : shown) width[c] = std::strlen(columns[c].header);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (int c : shown) {
      cells[r].push_back(columns[c].cell(rows[r]));
      width[c] = std::max(width[c], cells[r].back().size());
    }
  }
  for (int c : shown) {
    std::printf(c == 0 ? "%-*s" : (c < text_columns ? "  %-*s" : "  %*s"), static_cast<int>(width[c]),
                columns[c].header);
  }
  std::printf("\n");
  for (const auto& row : cells) {
    for (std::size_t j = 0; j < shown.size(); ++j) {
      const int c = shown[j];
      std::printf(c == 0 ? "%-*s" : (c < text_columns ? "  %-*s" : "  %*s"),
                  static_cast<int>(width[c]), row[j].c_str());
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
  std::string dtypes;
  for (Dtype d : args.dtypes) dtypes += std::string(dtypes.empty() ? "" : ", ") + dtype_name(d);
  std::fprintf(f, "# qbl_bench, %s\n\n%s\n\n", dtypes.c_str(), gpu_line(gpu).c_str());
  std::fprintf(f,
               "Median of per-run CUDA-event times (>= %d runs and >= %.0f ms per item), inputs "
               "rotating over >= 3 x L2. fp32: float tensors, fp32 GEMMs; tf32: float tensors, both "
               "GEMMs in CUBLAS_COMPUTE_32F_FAST_TF32; bf16 / fp16: every tensor in the dtype, GEMMs "
               "with fp32 accumulation. Byte counts use the element size E (4 for fp32 and tf32, 2 "
               "for bf16 and fp16): floor = bare cuBLASLt GEMM+bias + 2*tokens*D*E B at copy "
               "bandwidth (copy measured once per shape). prol GB/s = 3*tokens*D*E B / (amax + "
               "quant_blend). fused = qbl::amax_quant_blend, the prologue as forward() issues it "
               "(one single-block launch up to 2^15 elements).\n\n",
               args.reps, args.min_ms);
  const bool train = any_train(rows);
  if (train) {
    std::fprintf(
        f,
        "train = one forward into caller buffers + one backward computing grad_x, "
        "grad_logits, grad_weight and grad_bias (QuantBlendLinear built with "
        "Options::backward), x and logits rotating, grad_out fixed; tgraph = the same "
        "replayed from a CUDA graph. dgrad / wgrad = bare cuBLASLt NN g*W and NT g^T*mixed "
        "(+ BGRADB bias gradient). tfloor = floor + dgrad + wgrad + 3*tokens*D*E B at copy "
        "bandwidth (read g_mixed and x, write grad_x).\n\n");
  }
  const std::vector<int> shown = shown_columns(rows);
  for (int c : shown) std::fprintf(f, "| %s ", columns[c].header);
  std::fprintf(f, "|\n");
  for (int c : shown) std::fprintf(f, c < text_columns ? "| --- " : "| ---: ");
  std::fprintf(f, "|\n");
  for (const Row& r : rows) {
    for (int c : shown) std::fprintf(f, "| %s ", columns[c].cell(r).c_str());
    std::fprintf(f, "|\n");
  }
  std::fprintf(f, "\n| shape | dtype | mixed bit-equal | amax bit-equal | out max rel diff | out bit-equal | bare GEMM algo |\n");
  std::fprintf(f, "| --- | --- | --- | --- | ---: | --- | --- |\n");
  for (const Row& r : rows) {
    std::fprintf(f, "| %s | %s | %s | %s | %.3g | %s | %s |\n", r.label().c_str(), r.dtype_label(),
                 r.mixed_bit_equal ? "yes" : "no", r.amax_bit_equal ? "yes" : "no", r.out_max_rel_diff,
                 r.out_bit_equal ? "yes" : "no", r.bare_algo.c_str());
  }
  if (train) {
    std::fprintf(
        f,
        "\nTraining check (input set 0; max rel diff = max|diff| / max|ref| against the "
        "bare products' outputs, grad_x through qbl::grad_x_value on the host):\n\n"
        "| shape | dtype | ok | unwritten | non-finite | mixed bit-equal | grad_x | "
        "grad_weight | grad_bias | tolerance | graph bit-equal | BGRADB | bare dgrad algo | "
        "bare wgrad algo |\n"
        "| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | "
        "--- |\n");
    for (const Row& r : rows) {
      const TrainRow& t = r.train;
      if (!t.timed()) continue;
      std::fprintf(f,
                   "| %s | %s | %s | %" PRId64 " | %" PRId64
                   " | %s | %.3g | %.3g | %.3g | %.0e | %s | %s | %s | %s |\n",
                   r.label().c_str(), r.dtype_label(), t.check_ok() ? "yes" : "NO", t.unwritten,
                   t.nonfinite, t.mixed_bit_equal ? "yes" : "no", t.grad_x_rel_diff,
                   t.grad_weight_rel_diff, t.grad_bias_rel_diff, t.tolerance,
                   t.graph_bit_equal < 0 ? "" : (t.graph_bit_equal ? "yes" : "no"),
                   t.bgradb ? "yes" : "no (wgrad without epilogue)", t.dgrad_algo.c_str(),
                   t.wgrad_algo.c_str());
    }
  }
  for (const Row& r : rows) {
    if (!r.train.skipped.empty()) {
      std::fprintf(f, "\nTraining items skipped for %s %s: %s\n", r.label().c_str(),
                   r.dtype_label(), r.train.skipped.c_str());
    }
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// ---- one shape -------------------------------------------------------------------------------
// ---- one shape, one dtype ---------------------------------------------------------------------

void report(const char* dtype, Item i, const Timing& t) {
  std::printf("  %-4s %-15s median %9.4f ms  min %9.4f ms  (%d runs)\n", dtype, item_names[i],
              t.median_ms, t.min_ms, t.runs);
  std::fflush(stdout);
}

// Everything for one shape in element type T; `dtype` tells fp32 from tf32 when T is float.
// `copy` is this shape's copy measurement, shared by its dtypes.
template <typename T>
Row bench_shape(const Shape& shape, Dtype dtype, const GpuInfo& gpu, const Args& args,
                cudaStream_t stream, RunTimer& timer, const Timing& copy, std::size_t copy_bytes) {
  static_assert(is_element_type<T>, "T is float, __nv_bfloat16 or __half");
  Row row;
  row.shape = shape;
  row.dtype = dtype;
  row.elem_bytes = sizeof(T);
  const char* dt = row.dtype_label();
  const std::int64_t tokens = shape.b * shape.t, d = shape.d, n = tokens * d;
  row.tokens = tokens;
  const std::size_t x_bytes = static_cast<std::size_t>(n) * sizeof(T);
  const std::size_t logits_bytes = static_cast<std::size_t>(tokens) * sizeof(T);
  std::printf("-- %s %s: x %.2f MiB\n", row.label().c_str(), dt, x_bytes / 1048576.0);

  // Rotating input sets: K * bytes(x) >= 3 x L2 (and at least 2), within the rotation cap.
  // Each set starts on a 256-byte boundary, like a fresh cudaMalloc.
  const std::size_t x_stride = round_up(x_bytes, 256), l_stride = round_up(logits_bytes, 256);
  std::size_t sets = std::max<std::size_t>(2, (3 * static_cast<std::size_t>(gpu.l2_bytes) + x_bytes - 1) / x_bytes);
  sets = std::max<std::size_t>(1, std::min(sets, rotation_cap_bytes / (x_stride + l_stride)));
  row.x_sets = static_cast<int>(sets);
  DeviceBuffer x_sets(sets * x_stride), logit_sets(sets * l_stride);
  auto x_of = [&](std::size_t k) { return reinterpret_cast<const T*>(x_sets.as<char>() + (k % sets) * x_stride); };
  auto logits_of = [&](std::size_t k) {
    return reinterpret_cast<const T*>(logit_sets.as<char>() + (k % sets) * l_stride);
  };

  DeviceBuffer w(static_cast<std::size_t>(d * d) * sizeof(T)), bias(static_cast<std::size_t>(d) * sizeof(T));
  DeviceBuffer out_fwd(x_bytes), out_chain(x_bytes), out_scratch(x_bytes);
  DeviceBuffer mixed_ready(x_bytes), mixed_scratch(x_bytes);
  DeviceBuffer amax_sets(sets * sizeof(float)), stats_scratch(2 * sizeof(float));
  float* amax_scratch = stats_scratch.as<float>();
  float* scale_scratch = amax_scratch + 1;

  const float bound = 1.0f / std::sqrt(static_cast<float>(d));
  fill_randn(x_sets.as<T>(), static_cast<std::int64_t>(x_sets.bytes() / sizeof(T)), 1, 1.0f, gpu.sms, stream);
  fill_randn(logit_sets.as<T>(), static_cast<std::int64_t>(logit_sets.bytes() / sizeof(T)), 2, 1.0f, gpu.sms, stream);
  fill_uniform(w.as<T>(), d * d, 3, bound, gpu.sms, stream);
  fill_uniform(bias.as<T>(), d, 4, bound, gpu.sms, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));

  const bool tf32 = dtype == Dtype::tf32;
  qbl::Options options;
  options.allow_tf32 = tf32;
  qbl::QuantBlendLinear<T> layer(d, d, tokens, options);
  // The `gemm` item is the autotuned LinearGemm: gemm/bare is what Options::autotune gains over
  // cuBLASLt's first choice (which the default forward and the bare GEMM both run).
  qbl::Options tuned = options;
  tuned.autotune = true;
  qbl::LinearGemm<T> gemm(d, d, tokens, tuned);
  DeviceBuffer gemm_ws(gemm.workspace_bytes());
  BareGemm<T> bare(d, d, tokens, w.as<T>(), bias.as<T>(),
                   tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  EagerChain<T> chain(tokens, d, gpu.sms, bare);
  row.bare_algo = bare.describe();
  // What construction-time autotuning measured for this token count (bias epilogue).
  for (const qbl::GemmTuning& r : gemm.tuning()) {
    if (r.tokens == tokens && r.bias) {
      std::printf("  %-4s autotune: %d candidates, cuBLASLt's first %.4f ms, chosen #%d %.4f ms (%.1f%% faster); %s\n",
                  dt, r.candidates, r.first_ms, r.chosen, r.chosen_ms,
                  100.0 * (r.first_ms - r.chosen_ms) / r.first_ms, gemm.describe(tokens, true).c_str());
    }
  }

  // ---- sanity check on set 0 ----
  layer.forward(x_of(0), logits_of(0), w.as<T>(), bias.as<T>(), out_fwd.as<T>(), tokens, stream);
  chain.run(x_of(0), logits_of(0), out_chain.as<T>(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  {
    // Raw elements of T: bit-equality is a comparison of bytes, whatever T is.
    std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), layer.device_mixed(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), chain.mixed(), x_bytes, cudaMemcpyDeviceToHost));
    row.mixed_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    float amax_a = 0, amax_b = 0;
    CUDA_CHECK(cudaMemcpy(&amax_a, layer.device_amax(), sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&amax_b, chain.amax(), sizeof(float), cudaMemcpyDeviceToHost));
    row.amax_bit_equal = std::memcmp(&amax_a, &amax_b, sizeof(float)) == 0;
    CUDA_CHECK(cudaMemcpy(a.data(), out_fwd.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_chain.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    row.out_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    // Relative to the largest |out| of the reference: elementwise relative error is meaningless
    // for outputs that cancel to ~0. A NaN anywhere makes the result NaN.
    double max_diff = 0.0, max_ref = 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double ref = to_f32(b[i]);
      const double diff = std::fabs(static_cast<double>(to_f32(a[i])) - ref);
      max_diff = std::isnan(diff) ? NAN : std::max(max_diff, diff);
      max_ref = std::max(max_ref, std::fabs(ref));
      if (std::isnan(max_diff)) break;
    }
    row.out_max_rel_diff = max_ref > 0.0 ? max_diff / max_ref : max_diff;
    std::printf("  %-4s check: amax %.6g, mixed bit-equal to eager chain: %s, amax bit-equal: %s, out max rel "
                "diff %.3g (max|diff| / max|ref|), out bit-equal: %s\n",
                dt, amax_a, row.mixed_bit_equal ? "yes" : "no", row.amax_bit_equal ? "yes" : "no",
                row.out_max_rel_diff, row.out_bit_equal ? "yes" : "no");
    std::printf("  %-4s bare GEMM algo: %s; x sets: %d (%.1f MiB)\n", dt, row.bare_algo.c_str(), row.x_sets,
                x_sets.bytes() / 1048576.0);
  }
  CUDA_CHECK(cudaMemcpyAsync(mixed_ready.as<T>(), layer.device_mixed(), x_bytes, cudaMemcpyDeviceToDevice, stream));
  for (std::size_t k = 0; k < sets; ++k) CUDA_CHECK(qbl::amax(x_of(k), n, amax_sets.as<float>() + k, stream));
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
      layer.forward(x_of(k), logits_of(k), w.as<T>(), bias.as<T>(), out_scratch.as<T>(), tokens, stream);
      CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      CUDA_CHECK(cudaGraphDestroy(g));
      CUDA_CHECK(cudaGraphUpload(exec, stream));  // the first launch would otherwise pay for it
      graphs.push_back(exec);
    }
    // The replay of set 0 must reproduce the direct forward bit for bit.
    CUDA_CHECK(cudaGraphLaunch(graphs[0], stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
    CUDA_CHECK(cudaMemcpy(a.data(), out_scratch.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), out_fwd.as<T>(), x_bytes, cudaMemcpyDeviceToHost));
    row.graph_bit_equal = std::memcmp(a.data(), b.data(), x_bytes) == 0;
    std::printf("  %-4s graph: %zu instantiated, replay of set 0 bit-equal to forward: %s\n", dt, g_count,
                row.graph_bit_equal ? "yes" : "no");
  }

  // ---- the training items (bench_train.cuh): the layer built for training, checked, graphs ----
  std::unique_ptr<TrainBench<T>> train;
  if (args.train) {
    const InputSets<T> inputs{x_sets.as<char>(), logit_sets.as<char>(), x_stride, l_stride, sets};
    try {
      train = std::make_unique<TrainBench<T>>(tokens, d, w.as<T>(), bias.as<T>(), inputs, tf32,
                                              gpu.sms, stream);
    } catch (const std::exception& e) {  // qbl could not plan the backward: report, time the rest
      row.train.skipped = e.what();
      std::printf(
          "  %-4s train: SKIPPED, QuantBlendLinear with Options::backward could not be built: %s\n",
          dt, e.what());
    }
  }
  if (train) {
    train->check(dt, mixed_ready.as<T>(), row.train);
    if (args.graph && n < launch_bound_elements) {
      train->capture_graphs(std::min<std::size_t>(sets, max_graph_sets), dt, row.train);
    }
  }

  // ---- timing: every item of this shape and dtype side by side (RunTimer::measure_together) ----
  row.copy_bytes = static_cast<double>(copy_bytes);
  row.t[copy_item] = copy;
  std::vector<Item> ids;
  std::vector<std::function<void(int)>> runs;
  auto item = [&](Item i, std::function<void(int)> f) {
    ids.push_back(i);
    runs.push_back(std::move(f));
  };
  item(bare_gemm_item, [&](int) { bare.run(mixed_ready.as<T>(), out_scratch.as<T>(), stream); });
  item(gemm_item, [&](int) {
    CUBLAS_CHECK(gemm.run(mixed_ready.as<T>(), w.as<T>(), bias.as<T>(), out_scratch.as<T>(), tokens,
                          gemm_ws.as<void>(), stream));
  });
  item(amax_item, [&](int i) { CUDA_CHECK(qbl::amax(x_of(static_cast<std::size_t>(i)), n, amax_scratch, stream)); });
  item(quant_blend_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i) % sets;
    CUDA_CHECK(qbl::quant_blend(x_of(k), logits_of(k), amax_sets.as<float>() + k, mixed_scratch.as<T>(),
                                tokens, d, scale_scratch, stream));
  });
  item(fused_prologue_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    CUDA_CHECK(qbl::amax_quant_blend(x_of(k), logits_of(k), mixed_scratch.as<T>(), tokens, d, amax_scratch,
                                     scale_scratch, stream));
  });
  item(forward_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    layer.forward(x_of(k), logits_of(k), w.as<T>(), bias.as<T>(), out_fwd.as<T>(), tokens, stream);
  });
  if (!graphs.empty()) {
    item(graph_item, [&](int i) {
      CUDA_CHECK(cudaGraphLaunch(graphs[static_cast<std::size_t>(i) % graphs.size()], stream));
    });
  }
  item(eager_item, [&](int i) {
    const auto k = static_cast<std::size_t>(i);
    chain.run(x_of(k), logits_of(k), out_chain.as<T>(), stream);
  });
  if (train) train->add_items(runs);  // train, [train_graph], bare_dgrad, bare_wgrad
  // --gemm-probe: the bare GEMM planned as qbl::LinearGemm plans it, one difference at a time, and
  // the layer's own first-ranked GEMM, on the same operands and timed with the rest.
  const std::size_t first_probe = runs.size();
  const BareQuery probes[] = {{4, true, false}, {1, false, false}, {1, true, true}, {4, false, true}};
  std::vector<std::unique_ptr<BareGemm<T>>> variants;
  DeviceBuffer plain_ws(args.gemm_probe ? layer.gemm().workspace_bytes() : 0);
  std::unique_ptr<qbl::LinearGemm<T>> plain;
  if (args.gemm_probe) {
    const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    for (const BareQuery& q : probes) {
      variants.push_back(std::make_unique<BareGemm<T>>(d, d, tokens, w.as<T>(), bias.as<T>(), compute, q));
      BareGemm<T>* v = variants.back().get();
      runs.push_back([&, v](int) { v->run(mixed_ready.as<T>(), out_scratch.as<T>(), stream); });
    }
    plain = std::make_unique<qbl::LinearGemm<T>>(d, d, tokens, options);
    runs.push_back([&](int) {
      CUBLAS_CHECK(plain->run(mixed_ready.as<T>(), w.as<T>(), bias.as<T>(), out_scratch.as<T>(), tokens,
                              plain_ws.as<void>(), stream));
    });
  }
  const std::vector<Timing> timed = timer.measure_together(runs);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    row.t[ids[k]] = timed[k];
    report(dt, ids[k], timed[k]);
  }
  if (train) train->collect(timed, dt, row.train);
  if (args.gemm_probe) {
    std::printf("  %-4s probe bare default          %.4f ms  %s\n", dt, row.ms(bare_gemm_item),
                bare.describe_all().c_str());
    for (std::size_t v = 0; v < variants.size(); ++v) {
      std::printf("  %-4s probe bare %-20s %.4f ms  %s\n", dt, probes[v].name().c_str(),
                  timed[first_probe + v].median_ms, variants[v]->describe_all().c_str());
    }
    std::printf("  %-4s probe LinearGemm, default options %.4f ms  %s\n", dt, timed.back().median_ms,
                plain->describe(tokens, true).c_str());
  }

  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (cudaGraphExec_t g : graphs) CUDA_CHECK(cudaGraphExecDestroy(g));  // before `layer` goes
  std::printf("  %-4s copy %.0f GB/s, floor %.4f ms, forward/floor %.3f, eager/forward %.2f; device memory "
              "held by the harness %.2f GiB\n",
              dt, row.copy_gbps(), row.floor_ms(), row.over_floor(forward_item), row.speedup_vs_eager(),
              g_allocated_bytes / (1024.0 * 1048576.0));
  if (row.train.timed()) {
    std::printf(
        "  %-4s train floor %.4f ms (floor + bare_dgrad + bare_wgrad%s + 3 x tokens x D x E B at "
        "copy), train/floor %.3f%s\n",
        dt, row.train_floor_ms(), row.train.bgradb ? "" : " WITHOUT BGRADB",
        row.train_over_floor(train_item),
        row.train.t[train_graph_item].valid()
            ? (", train_graph/floor " + fmt("%.3f", row.train_over_floor(train_graph_item))).c_str()
            : "");
  }
  return row;
}

Row bench_dtype(const Shape& shape, Dtype dtype, const GpuInfo& gpu, const Args& args,
                cudaStream_t stream, RunTimer& timer, const Timing& copy, std::size_t copy_bytes) {
  switch (dtype) {
    case Dtype::fp32:
    case Dtype::tf32:
      return bench_shape<float>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
    case Dtype::bf16:
      return bench_shape<__nv_bfloat16>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
    case Dtype::fp16:
      return bench_shape<__half>(shape, dtype, gpu, args, stream, timer, copy, copy_bytes);
  }
  die("bench_dtype", "unknown dtype", __FILE__, __LINE__);
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
  std::string dtypes;
  for (Dtype d : args.dtypes) dtypes += std::string(dtypes.empty() ? "" : ",") + dtype_name(d);
  std::printf("timing: median of per-run event times, >= %d runs and >= %.0f ms per item (at most %d "
              "runs); copy %zu MiB; dtypes %s\n",
              args.reps, args.min_ms, args.max_runs, args.copy_mib, dtypes.c_str());

  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Row> rows;
  {
    RunTimer timer(stream, args.min_ms, args.reps, args.max_runs);
    DeviceBuffer copy_src(args.copy_mib * mib), copy_dst(args.copy_mib * mib);
    fill_randn(copy_src.as<float>(), static_cast<std::int64_t>(copy_src.bytes() / sizeof(float)), 5, 1.0f,
               gpu.sms, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int idx : args.shapes) {
      const Shape& shape = shape_table[idx];
      std::printf("\n== shape %s: tokens %" PRId64 ", D %" PRId64 "\n", shape_label(shape).c_str(),
                  shape.b * shape.t, shape.d);
      // Once per shape, shared by its dtypes: their floors then divide by the same bandwidth.
      const Timing copy = timer.measure([&](int) {
        CUDA_CHECK(cudaMemcpyAsync(copy_dst.as<void>(), copy_src.as<void>(), copy_src.bytes(),
                                   cudaMemcpyDeviceToDevice, stream));
      });
      report("all", copy_item, copy);
      for (Dtype dtype : args.dtypes) {
        rows.push_back(bench_dtype(shape, dtype, gpu, args, stream, timer, copy, copy_src.bytes()));
      }
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));

  std::printf("\n%s\n", gpu_line(gpu).c_str());
  print_table(rows);
  std::string unequal;  // "shape dtype" of every row whose mixed differs from the chain's
  for (const Row& r : rows) {
    if (r.mixed_bit_equal) continue;
    unequal += std::string(unequal.empty() ? "" : ", ") + r.label() + " " + r.dtype_label();
  }
  std::printf("mixed bit-equal to the eager chain on every shape and dtype: %s\n",
              unequal.empty() ? "yes" : ("NO (" + unequal + ")").c_str());
  if (args.train) {
    std::string failed, skipped, no_bgradb;  // "shape dtype" lists
    auto add = [](std::string& list, const Row& r) {
      list += std::string(list.empty() ? "" : ", ") + r.label() + " " + r.dtype_label();
    };
    for (const Row& r : rows) {
      if (!r.train.timed()) {
        add(skipped, r);
        continue;
      }
      if (!r.train.check_ok()) add(failed, r);
      if (!r.train.bgradb) add(no_bgradb, r);
    }
    std::printf(
        "training check (outputs written and finite, mixed bit-equal, gradients within "
        "tolerance of the bare products) on every shape and dtype timed: %s\n",
        failed.empty() ? "yes" : ("NO (" + failed + ")").c_str());
    if (!skipped.empty()) std::printf("training items SKIPPED for: %s\n", skipped.c_str());
    if (!no_bgradb.empty()) {
      std::printf(
          "NOTE: no cuBLASLt BGRADB algorithm for: %s -- their bare_wgrad ran without the "
          "bias-gradient epilogue\n",
          no_bgradb.c_str());
    }
  }
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

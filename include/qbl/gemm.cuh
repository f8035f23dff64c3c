// qbl/gemm.cuh -- a thin cuBLASLt wrapper for nn.Linear's three products, row-major: the forward
// out = a · wᵀ + bias, the input gradient g · w and the weight gradient gᵀ · a. One plan type,
// qbl::GemmPlan, parameterized by the transposes and the epilogue (qbl::GemmSpec), with qbl's own
// fallback kernel inside for what cuBLASLt does not serve.
//
// Stage 3 of the layer. Row-major [tokens, out] = [tokens, in] · [out, in]ᵀ is computed as the
// column-major product outᵀ = w · aᵀ (m = out, n = tokens, k = in; A = w transposed, B = a),
// which is the same TN product PyTorch issues for nn.Linear; the bias is added by the GEMM's
// CUBLASLT_EPILOGUE_BIAS.
//
// Everything cuBLASLt needs to choose -- the algorithm for each token-count bucket, pointer
// alignment and epilogue case -- is decided in the constructor, and so is where the fallback
// runs. run() describes the call on the stack (no allocation, no heuristic query, no
// synchronization) and enqueues cublasLtMatmul or the fallback kernel: the plan is immutable,
// run() is const and may be called from several threads and streams at once, and it can be
// captured in a CUDA graph.
//
//   qbl::GemmPlan<float> gemm(qbl::GemmSpec::linear_forward(in, out), max_tokens);
//   void* ws;  cudaMalloc(&ws, gemm.workspace_bytes());
//   gemm.run(d_w, d_a, d_out, d_bias, tokens, 0.0f, ws, stream);   // out = a · wᵀ + bias
#pragma once

#include <qbl/detail/config.cuh>  // first: it stops a non-CUDA compile with one clear error

#include <qbl/detail/handles.hpp>
#include <qbl/detail/linear_fallback.cuh>
#include <qbl/error.hpp>
#include <qbl/options.hpp>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace qbl {

/// cuBLASLt type codes for an element type: float, __nv_bfloat16, __half. Every type accumulates
/// and scales in fp32; 16-bit types run on the tensor cores.
template <typename T>
struct gemm_traits;

template <>
struct gemm_traits<float> {
  static constexpr cudaDataType_t data_type = CUDA_R_32F;
  static cublasComputeType_t compute_type(const Options& o) {
    return o.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }
  /// Split-K reduction schemes allowed: all (partials are fp32 either way).
  static constexpr std::uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_MASK;
};

template <>
struct gemm_traits<__nv_bfloat16> {
  static constexpr cudaDataType_t data_type = CUDA_R_16BF;
  static cublasComputeType_t compute_type(const Options&) { return CUBLAS_COMPUTE_32F; }
  /// Split-K partials reduced in fp32 only: the in-place and output-type schemes would sum the
  /// partials (and add the bias) in bf16.
  static constexpr std::uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
};

template <>
struct gemm_traits<__half> {
  static constexpr cudaDataType_t data_type = CUDA_R_16F;
  static cublasComputeType_t compute_type(const Options&) { return CUBLAS_COMPUTE_32F; }
  static constexpr std::uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
};

/// What autotuning measured for one token-count bucket (16-byte-or-better aligned pointers).
struct GemmTuning {
  std::int64_t tokens = 0;  ///< the bucket's top token count, the size timed
  bool bias = false;        ///< with the vector epilogue (the bias)
  int candidates = 0;       ///< heuristic candidates that cuBLASLt accepted and were timed
  int chosen = 0;           ///< heuristic rank of the fastest (0: cuBLASLt's first choice)
  float first_ms = 0.0f;    ///< median time of the first-ranked candidate
  float chosen_ms = 0.0f;   ///< median time of the chosen one
};

/// One product, in cuBLASLt's column-major terms: D[m, n] = op(A)[m, k] · op(B)[k, n] (+ the
/// vector epilogue), every operand contiguous (leading dimension = its stored rows), one of n
/// and k being the token count, which each run() sets (up to the plan's max_tokens). The three
/// products of a linear layer, for row-major tensors, come from the factories below.
struct GemmSpec {
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  std::int64_t m = 0, n = 0, k = 0;  ///< the token dimension's value here is ignored
  enum class Tokens { n, k } tokens = Tokens::n;
  /// CUBLASLT_EPILOGUE_BIAS (adds a vector of m) or CUBLASLT_EPILOGUE_DEFAULT (none). A run()
  /// with a null vector pointer runs without it. (The bias gradient is qbl::bias_grad's column
  /// sum, not cuBLASLt's BGRADB epilogue: benchmarks/HISTORY.md has the measurements.)
  cublasLtEpilogue_t vector_epilogue = CUBLASLT_EPILOGUE_DEFAULT;

  /// nn.Linear's forward, out[t, o] = a[t, i] · w[o, i] + bias[o]: outᵀ = w(ᵀ) · aᵀ, the TN
  /// product PyTorch issues (A = w, B = a, D = out, vector = bias).
  static GemmSpec linear_forward(std::int64_t in_features, std::int64_t out_features) {
    return {CUBLAS_OP_T, CUBLAS_OP_N, out_features,          0,
            in_features, Tokens::n,   CUBLASLT_EPILOGUE_BIAS};
  }
  /// Its input gradient (dgrad), g_a[t, i] = g[t, o] · w[o, i]: the NN product (A = w, B = g,
  /// D = g_a).
  static GemmSpec linear_dgrad(std::int64_t in_features, std::int64_t out_features) {
    return {CUBLAS_OP_N,
            CUBLAS_OP_N,
            in_features,
            0,
            out_features,
            Tokens::n,
            CUBLASLT_EPILOGUE_DEFAULT};
  }
  /// Its weight gradient (wgrad), g_w[o, i] = sum_t g[t, o] a[t, i]: the NT product (A = a,
  /// B = g, D = g_w).
  static GemmSpec linear_wgrad(std::int64_t in_features, std::int64_t out_features) {
    return {CUBLAS_OP_N,
            CUBLAS_OP_T,
            in_features,
            out_features,
            0,
            Tokens::k,
            CUBLASLT_EPILOGUE_DEFAULT};
  }
};

/// A product planned once for every token count in [1, max_tokens], then run many times.
///
/// The constructor picks, for each token-count bucket, pointer alignment class and epilogue
/// case, cuBLASLt's algorithm -- or none, when the heuristic offers none valid over the whole
/// bucket, or when (for pointers aligned below 16 bytes) cublasLtMatmul refuses the algorithm
/// its heuristic offered at a trial launch on scratch operands (seen on an H200: bf16 with a
/// bias at 2-byte alignment). Where there is none, run() runs qbl's fallback kernel instead: a
/// plain fp32-accumulating product, deterministic, correct for any size and alignment, slower.
/// uses_cublaslt() says which, from the plan
/// alone. The constructor needs scratch operands for the trial launches (A, B and D at the
/// largest bucket's smallest token count, max_tokens / 2 + 1 at most; at max_tokens with
/// autotuning) and frees them on return. Move-only.
template <typename T>
class GemmPlan {
 public:
  using value_type = T;

  /// \throws qbl::invalid_argument for non-positive sizes or a spec the plan cannot serve,
  ///         qbl::cublas_error / qbl::cuda_error if cuBLASLt or the trial launches fail.
  GemmPlan(const GemmSpec& spec, std::int64_t max_tokens, const Options& options = {});

  GemmPlan(GemmPlan&&) noexcept = default;
  GemmPlan& operator=(GemmPlan&&) noexcept = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  /// D = op(A) · op(B) + beta * D (+ the vector epilogue when `vector` is not null), enqueued on
  /// `stream`: on cuBLASLt where uses_cublaslt(), else on the fallback kernel. `workspace` holds
  /// workspace_bytes() bytes (or is nullptr when that is 0). `vector` is the BIAS epilogue's
  /// vector (read). tokens == 0 does nothing.
  /// \throws qbl::invalid_argument (tokens outside [0, max_tokens], a null operand, a vector for
  ///         a spec without a vector epilogue), qbl::logic_error (moved-from plan) -- before
  ///         anything is enqueued; qbl::cublas_error / qbl::cuda_error if the launch fails.
  void run(const T* a, const T* b, T* d, const void* vector, std::int64_t tokens, float beta,
           void* workspace, cudaStream_t stream = nullptr) const;

  /// Does run() take these pointers and `tokens` in [1, max_tokens] to cuBLASLt (true) or to the
  /// fallback kernel (false)? Host-only, no CUDA call.
  bool uses_cublaslt(const T* a, const T* b, const T* d, const void* vector,
                     std::int64_t tokens) const noexcept;

  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }
  const GemmSpec& spec() const noexcept { return spec_; }
  /// False for a moved-from plan (which run() refuses).
  bool valid() const noexcept { return handle_ != nullptr; }
  std::int64_t max_tokens() const noexcept { return max_tokens_; }

  /// The token-count buckets planned: bucket i serves tokens in (bucket(i-1), bucket(i)].
  const std::vector<std::int64_t>& buckets() const noexcept { return buckets_; }

  /// Autotuning's measurements, one entry per bucket and epilogue case (empty without autotune).
  const std::vector<GemmTuning>& tuning() const noexcept { return tuning_; }

  /// The algorithm run() uses for `tokens` with 256-byte-aligned pointers, as
  /// "algo <id> tile <id> stages <id> splitK <n> reduction <scheme> swizzle <n> custom <n>
  /// inner <id> cluster <id>" ("none": the fallback kernel).
  std::string describe(std::int64_t tokens, bool vector) const;

 private:
  // Alignment classes of a call's pointers, by the largest power of two all of them are aligned
  // to: 256 bytes (cuBLASLt's default assumption, what fresh allocations give), 16, 8, 4 and 2
  // (classes below sizeof(T) stay unused). Classes below 16 bytes get a trial launch at planning.
  static constexpr int align_classes = 5;
  static constexpr std::uint32_t class_bytes[align_classes] = {256u, 16u, 8u, 4u, 2u};
  static constexpr int first_trial_class = 2;
  static int alignment_class(const void* a, const void* b, const void* vector,
                             const void* d) noexcept;
  std::size_t bucket_of(std::int64_t tokens) const noexcept;

  struct Plan {
    cublasLtMatmulAlgo_t algo[2][align_classes];  // [vector epilogue][alignment class]
    bool found[2][align_classes] = {};            // false: the fallback kernel serves that case
  };
  struct Scratch;
  /// One call's descriptors, on the caller's stack (cuBLASLt's "Init" functions allocate nothing).
  struct Call {
    cublasLtMatmulDescOpaque_t desc;
    cublasLtMatrixLayoutOpaque_t a, b, d;
  };

  cublasStatus_t describe_call(Call& call, int vec, std::int64_t tokens,
                               const void* vector) const noexcept;
  void plan_bucket(std::size_t i, Scratch& scratch);
  bool valid_for_bucket(const cublasLtMatmulAlgo_t& algo, int vec, std::size_t i) const;
  cublasStatus_t launch(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens, int cls,
                        Scratch& scratch) const;
  float time_algo(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens, Scratch& scratch,
                  int reps) const;
  void warm_up(Scratch& scratch) const;
  void run_fallback(const T* a, const T* b, T* d, const void* vector, std::int64_t tokens,
                    float beta, cudaStream_t stream) const;

  GemmSpec spec_;
  std::int64_t max_tokens_ = 0;
  std::size_t workspace_bytes_ = 0;
  cublasComputeType_t compute_ = CUBLAS_COMPUTE_32F;
  bool vector_planned_ = false;  ///< the vector epilogue has cuBLASLt plans (see the constructor)
  detail::lt_handle handle_;
  std::vector<std::int64_t> buckets_;
  std::vector<Plan> plans_;
  std::vector<GemmTuning> tuning_;
  int autotune_candidates_ = 0;
};

}  // namespace qbl

#include <qbl/detail/gemm.inl>

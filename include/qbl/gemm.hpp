// qbl/gemm.hpp -- a thin cuBLASLt wrapper for nn.Linear's three products, row-major: the forward
// out = a · wᵀ + bias, the input gradient g · w and the weight gradient gᵀ · a with the bias
// gradient. One plan type, qbl::GemmPlan, parameterized by the transposes and the epilogue
// (GemmSpec); qbl::LinearGemm is the forward's.
//
// Stage 3 of the layer. Row-major [tokens, out] = [tokens, in] · [out, in]ᵀ is computed as the
// column-major product outᵀ = w · aᵀ (m = out, n = tokens, k = in; A = w transposed, B = a),
// which is the same TN product PyTorch issues for nn.Linear; the bias is added by the GEMM's
// CUBLASLT_EPILOGUE_BIAS. Host-only: include it from plain C++.
//
// Everything cuBLASLt needs -- handle, descriptors, layouts, preference and the algorithm for each
// token-count bucket, pointer alignment and bias/no-bias case -- is created in the constructor.
// run() sets the token count and bias pointer on the existing descriptors and enqueues
// cublasLtMatmul: no allocation, no heuristic query, no synchronization, so it can be captured in a
// CUDA graph.
//
//   qbl::LinearGemm<float> gemm(in, out, max_tokens);
//   void* ws;  cudaMalloc(&ws, gemm.workspace_bytes());
//   cublasStatus_t s = gemm.run(d_a, d_w, d_bias, d_out, tokens, ws, stream);
#pragma once

#include <qbl/detail/handles.hpp>
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
  bool bias = false;        ///< with the vector epilogue (bias, or bias gradient)
  int candidates = 0;       ///< heuristic candidates that cuBLASLt accepted and were timed
  int chosen = 0;           ///< heuristic rank of the fastest (0: cuBLASLt's first choice)
  float first_ms = 0.0f;    ///< median time of the first-ranked candidate
  float chosen_ms = 0.0f;   ///< median time of the chosen one
};

/// One cuBLASLt product, in cuBLASLt's column-major terms: D[m, n] = op(A)[m, k] · op(B)[k, n]
/// (+ the vector epilogue), every operand contiguous (leading dimension = its stored rows), one
/// of n and k being the token count, which each run() sets (up to the plan's max_tokens).
/// The three products of a linear layer, for row-major tensors, come from the factories below.
struct GemmSpec {
  cublasOperation_t trans_a = CUBLAS_OP_N;
  cublasOperation_t trans_b = CUBLAS_OP_N;
  std::int64_t m = 0, n = 0, k = 0;  ///< the token dimension's value here is ignored
  enum class Tokens { n, k } tokens = Tokens::n;
  /// CUBLASLT_EPILOGUE_BIAS (adds a vector of m), CUBLASLT_EPILOGUE_BGRADB (writes the sum of
  /// op(B) over k, a vector of n) or CUBLASLT_EPILOGUE_DEFAULT (none). A run() with a null
  /// vector pointer runs without it.
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
  /// B = g, D = g_w) with the bias gradient sum_t g[t, o] from BGRADB (vector = grad_bias):
  /// the reduction runs over the GEMM's k, the tokens, on the B operand, which is g. (Not
  /// planned for in_features == 1: see GemmPlan's constructor.)
  static GemmSpec linear_wgrad(std::int64_t in_features, std::int64_t out_features) {
    return {CUBLAS_OP_N,
            CUBLAS_OP_T,
            in_features,
            out_features,
            0,
            Tokens::k,
            CUBLASLT_EPILOGUE_BGRADB};
  }
};

/// A cuBLASLt product planned once for every token count in [1, max_tokens], then run many times.
///
/// Everything cuBLASLt needs -- handle, descriptors, layouts, preference and the algorithm for
/// each token-count bucket, pointer alignment class and epilogue case -- is made in the
/// constructor. So is the decision where cuBLASLt cannot serve: a case gets no algorithm when
/// the heuristic offers none valid over its whole bucket, or when (for pointers aligned below 16
/// bytes) cublasLtMatmul refuses at a trial launch on scratch operands the algorithm its
/// heuristic offered (seen on an H200: bf16 with a bias at 2-byte alignment). supports() answers
/// from that plan alone, the same before and after any run(). Move-only; one instance serves one
/// stream at a time (run() sets the token count on descriptors it owns). The constructor needs
/// scratch operands for the trial launches (A, B and D at the largest bucket's smallest token
/// count, max_tokens / 2 + 1 at most; at max_tokens with autotuning) and frees them on return.
template <typename T>
class GemmPlan {
 public:
  /// \throws qbl::invalid_argument for non-positive sizes, qbl::cublas_error / qbl::cuda_error
  ///         if cuBLASLt or the trial launches fail otherwise.
  GemmPlan(const GemmSpec& spec, std::int64_t max_tokens, const Options& options = {});

  GemmPlan(GemmPlan&&) noexcept = default;
  GemmPlan& operator=(GemmPlan&&) noexcept = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  /// D = op(A) · op(B) + beta * D (+ the vector epilogue when `vector` is not null), enqueued on
  /// `stream`. `workspace` holds workspace_bytes() bytes (or is nullptr when that is 0).
  /// Returns CUBLAS_STATUS_INVALID_VALUE for tokens outside [0, max_tokens], a null operand or a
  /// vector for a spec without a vector epilogue, and CUBLAS_STATUS_NOT_SUPPORTED, having
  /// enqueued nothing, where supports() is false; tokens == 0 does nothing.
  cublasStatus_t run(const T* a, const T* b, T* d, const void* vector, std::int64_t tokens,
                     float beta, void* workspace, cudaStream_t stream = nullptr);

  /// Does the plan hold an algorithm for these pointers and `tokens` in [1, max_tokens]?
  /// Host-only, no CUDA call, no state.
  bool supports(const T* a, const T* b, const T* d, const void* vector,
                std::int64_t tokens) const noexcept;

  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }
  const GemmSpec& spec() const noexcept { return spec_; }
  std::int64_t max_tokens() const noexcept { return max_tokens_; }

  /// The token-count buckets planned: bucket i serves tokens in (bucket(i-1), bucket(i)].
  const std::vector<std::int64_t>& buckets() const noexcept { return buckets_; }

  /// Autotuning's measurements, one entry per bucket and epilogue case (empty without autotune).
  const std::vector<GemmTuning>& tuning() const noexcept { return tuning_; }

  /// The algorithm run() uses for `tokens` with 256-byte-aligned pointers, as
  /// "algo <id> tile <id> stages <id> splitK <n> reduction <scheme> swizzle <n> custom <n>
  /// inner <id> cluster <id>" ("none" if cuBLASLt has none).
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
    bool found[2][align_classes] = {};            // false: cuBLASLt serves none for that case
  };
  struct Scratch;

  void plan_bucket(std::size_t i, Scratch& scratch);
  void set_tokens(std::int64_t tokens);
  bool valid_for_bucket(const cublasLtMatmulAlgo_t& algo, int vec, std::size_t i);
  cublasStatus_t launch(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens, int cls,
                        Scratch& scratch);
  float time_algo(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens, Scratch& scratch,
                  int reps);
  void warm_up(Scratch& scratch);

  GemmSpec spec_;
  std::int64_t max_tokens_ = 0;
  std::size_t workspace_bytes_ = 0;
  detail::lt_handle handle_;
  detail::lt_matmul_desc desc_[2];  // [vector epilogue]
  detail::lt_layout a_layout_, b_layout_, d_layout_;
  bool a_tokens_ = false, b_tokens_ = false, d_tokens_ = false;  // token count = the layout's cols
  detail::lt_preference pref_[align_classes];
  std::vector<std::int64_t> buckets_;
  std::vector<Plan> plans_;
  std::vector<GemmTuning> tuning_;
  int autotune_candidates_ = 0;
};

/// out[tokens, out_features] = a[tokens, in_features] · w[out_features, in_features]ᵀ (+ bias):
/// the forward product, GemmSpec::linear_forward planned by a GemmPlan, with nn.Linear's names.
///
/// Move-only; owns its cuBLASLt handle and descriptors. One instance serves one stream at a time.
template <typename T>
class LinearGemm {
 public:
  /// Plans the product for every token count in [1, max_tokens]. Token counts, alignments and
  /// shapes cuBLASLt offers no algorithm for are recorded, not fatal: supports() says so and
  /// run() answers CUBLAS_STATUS_NOT_SUPPORTED for them (QuantBlendLinear then runs its fallback
  /// kernel).
  /// \throws qbl::invalid_argument for non-positive sizes, qbl::cublas_error if cuBLASLt fails.
  LinearGemm(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
             const Options& options = {})
      : plan_(GemmSpec::linear_forward(in_features, out_features), max_tokens, options) {}

  /// Enqueues the product on `stream`. `bias` may be nullptr (no bias). `workspace` must hold
  /// workspace_bytes() bytes (or be nullptr when that is 0). 16-byte-aligned pointers get the
  /// fastest algorithms; less aligned ones run where cuBLASLt has an algorithm for them (see
  /// supports()).
  /// Returns CUBLAS_STATUS_INVALID_VALUE for tokens outside [0, max_tokens] or a null operand and
  /// CUBLAS_STATUS_NOT_SUPPORTED, having enqueued nothing, where supports() is false; tokens == 0
  /// does nothing.
  cublasStatus_t run(const T* a, const T* w, const T* bias, T* out, std::int64_t tokens,
                     void* workspace, cudaStream_t stream = nullptr) {
    return plan_.run(w, a, out, bias, tokens, 0.0f, workspace, stream);
  }

  /// Would run() take these pointers for `tokens` in [1, max_tokens]? False where cuBLASLt offered
  /// no algorithm at construction or refused it at the trial launch. Seen on an H200: bf16 and
  /// fp16 with an odd in_features, bf16 pointers aligned to 2 bytes only with a bias.
  /// Host-only, no CUDA call.
  bool supports(const T* a, const T* w, const T* bias, const T* out,
                std::int64_t tokens) const noexcept {
    return plan_.supports(w, a, out, bias, tokens);
  }

  std::size_t workspace_bytes() const noexcept { return plan_.workspace_bytes(); }
  const std::vector<std::int64_t>& buckets() const noexcept { return plan_.buckets(); }
  const std::vector<GemmTuning>& tuning() const noexcept { return plan_.tuning(); }
  std::string describe(std::int64_t tokens, bool bias) const {
    return plan_.describe(tokens, bias);
  }
  const GemmPlan<T>& plan() const noexcept { return plan_; }

  std::int64_t in_features() const noexcept { return plan_.spec().k; }
  std::int64_t out_features() const noexcept { return plan_.spec().m; }
  std::int64_t max_tokens() const noexcept { return plan_.max_tokens(); }

 private:
  GemmPlan<T> plan_;
};

}  // namespace qbl

#include <qbl/detail/gemm.inl>

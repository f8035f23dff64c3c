// qbl/gemm.hpp -- a thin cuBLASLt wrapper for nn.Linear: out = a · wᵀ + bias, row-major.
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
  std::int64_t tokens = 0;      ///< the bucket's top token count, the size timed
  bool bias = false;            ///< with the bias epilogue
  int candidates = 0;           ///< heuristic candidates that cuBLASLt accepted and were timed
  int chosen = 0;               ///< heuristic rank of the fastest (0: cuBLASLt's first choice)
  float first_ms = 0.0f;        ///< median time of the first-ranked candidate
  float chosen_ms = 0.0f;       ///< median time of the chosen one
};

/// out[tokens, out_features] = a[tokens, in_features] · w[out_features, in_features]ᵀ (+ bias).
///
/// Move-only; owns its cuBLASLt handle and descriptors. One instance serves one stream at a time:
/// run() updates the descriptors it owns before it enqueues the product.
template <typename T>
class LinearGemm {
 public:
  /// Plans the product for every token count in [1, max_tokens]. Token counts, alignments and
  /// shapes cuBLASLt offers no algorithm for are recorded, not fatal: run() answers
  /// CUBLAS_STATUS_NOT_SUPPORTED for them (QuantBlendLinear then runs its fallback kernel).
  /// \throws qbl::invalid_argument for non-positive sizes, qbl::cublas_error if cuBLASLt fails.
  LinearGemm(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
             const Options& options = {});

  LinearGemm(LinearGemm&&) noexcept = default;
  LinearGemm& operator=(LinearGemm&&) noexcept = default;
  LinearGemm(const LinearGemm&) = delete;
  LinearGemm& operator=(const LinearGemm&) = delete;

  /// Enqueues the product on `stream`. `bias` may be nullptr (no bias). `workspace` must hold
  /// workspace_bytes() bytes (or be nullptr when that is 0). 16-byte-aligned pointers get the
  /// fastest algorithms; less aligned ones run where cuBLASLt has an algorithm for them (see
  /// supports()).
  /// Returns CUBLAS_STATUS_INVALID_VALUE for tokens outside [0, max_tokens] or a null operand and
  /// CUBLAS_STATUS_NOT_SUPPORTED, having enqueued nothing, where cuBLASLt has no algorithm for the
  /// token count and pointer alignment (see supports()); tokens == 0 does nothing.
  cublasStatus_t run(const T* a, const T* w, const T* bias, T* out, std::int64_t tokens,
                     void* workspace, cudaStream_t stream = nullptr);

  /// Would run() take these pointers for `tokens` in [1, max_tokens]? False where cuBLASLt offered
  /// no algorithm at construction, or refused at launch one it had offered (from then on). Seen on
  /// an H200: bf16 and fp16 with an odd in_features, bf16 pointers aligned to 2 bytes only.
  /// Host-only, no CUDA call.
  bool supports(const T* a, const T* w, const T* bias, const T* out, std::int64_t tokens) const noexcept;

  /// Workspace bytes run() may use.
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }

  /// The token-count buckets planned: bucket i serves tokens in (bucket(i-1), bucket(i)].
  const std::vector<std::int64_t>& buckets() const noexcept { return buckets_; }

  /// Autotuning's measurements, one entry per bucket and bias case (empty without autotune).
  const std::vector<GemmTuning>& tuning() const noexcept { return tuning_; }

  /// The algorithm run() uses for `tokens` with 256-byte-aligned pointers, as
  /// "algo <id> tile <id> stages <id> splitK <n> reduction <scheme> swizzle <n> custom <n>
  /// inner <id> cluster <id>" ("none" if
  /// cuBLASLt has none).
  std::string describe(std::int64_t tokens, bool bias) const;

  std::int64_t in_features() const noexcept { return k_; }
  std::int64_t out_features() const noexcept { return m_; }
  std::int64_t max_tokens() const noexcept { return max_tokens_; }

 private:
  // Alignment classes of a call's pointers, by the largest power of two all of them are aligned
  // to: 256 bytes (cuBLASLt's default assumption, what fresh allocations give), 16, 8, 4 and 2
  // (classes below sizeof(T) stay unused).
  static constexpr int align_classes = 5;
  static constexpr std::uint32_t class_bytes[align_classes] = {256u, 16u, 8u, 4u, 2u};
  static int alignment_class(const void* a, const void* w, const void* bias, const void* out) noexcept;
  std::size_t bucket_of(std::int64_t tokens) const noexcept;

  struct Plan {
    cublasLtMatmulAlgo_t algo[2][align_classes];  // [has_bias][alignment class]
    bool found[2][align_classes] = {};            // false: cuBLASLt has none for that case
  };
  struct Scratch;

  void plan_bucket(std::size_t i, Scratch* scratch);
  void set_tokens(std::int64_t tokens);
  bool valid_for_bucket(const cublasLtMatmulAlgo_t& algo, int has_bias, std::size_t i);
  float time_algo(const cublasLtMatmulAlgo_t& algo, int has_bias, std::int64_t tokens,
                  Scratch& scratch, int reps);
  void warm_up(Scratch& scratch);

  std::int64_t k_ = 0, m_ = 0, max_tokens_ = 0;
  std::size_t workspace_bytes_ = 0;
  detail::lt_handle handle_;
  detail::lt_matmul_desc desc_[2];  // [has_bias]
  detail::lt_layout a_layout_, b_layout_, c_layout_;
  detail::lt_preference pref_[align_classes];
  std::vector<std::int64_t> buckets_;
  std::vector<Plan> plans_;
  std::vector<GemmTuning> tuning_;
  int autotune_candidates_ = 0;
};

}  // namespace qbl

#include <qbl/detail/gemm.inl>

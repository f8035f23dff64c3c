// Member definitions of qbl::LinearGemm (host-only).
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/gemm.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

namespace qbl::detail {

template <typename V>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V& v) {
  QBL_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof v));
}

template <typename V>
void set_layout(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, const V& v) {
  QBL_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(l, attr, &v, sizeof v));
}

template <typename V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
  QBL_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof v));
}

inline lt_layout make_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols,
                             std::int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  QBL_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                            static_cast<std::uint64_t>(cols), ld));
  return lt_layout(l);
}

/// 1, 2, 4, ... below max_tokens, then max_tokens itself.
inline std::vector<std::int64_t> token_buckets(std::int64_t max_tokens) {
  std::vector<std::int64_t> b;
  for (std::int64_t t = 1; t < max_tokens; t *= 2) b.push_back(t);
  b.push_back(max_tokens);
  return b;
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
LinearGemm<T>::LinearGemm(std::int64_t in_features, std::int64_t out_features,
                          std::int64_t max_tokens, const Options& options)
    : k_(in_features),
      m_(out_features),
      max_tokens_(max_tokens),
      workspace_bytes_(options.cublas_workspace_bytes) {
  QBL_EXPECTS(in_features > 0 && out_features > 0, qbl::invalid_argument,
              "features must be positive");
  QBL_EXPECTS(max_tokens > 0, qbl::invalid_argument, "max_tokens must be positive");

  constexpr cudaDataType_t type = gemm_traits<T>::data_type;
  cublasLtHandle_t h = nullptr;
  QBL_CUBLAS_TRY(cublasLtCreate(&h));
  handle_.reset(h);

  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  for (int has_bias = 0; has_bias < 2; ++has_bias) {
    cublasLtMatmulDesc_t d = nullptr;
    QBL_CUBLAS_TRY(cublasLtMatmulDescCreate(&d, gemm_traits<T>::compute_type(options), CUDA_R_32F));
    desc_[has_bias].reset(d);
    detail::set_desc(d, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
    detail::set_desc(d, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
    const cublasLtEpilogue_t epilogue = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    detail::set_desc(d, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  }
  // Column-major views: w is k x m (ld k) used transposed, a is k x n (ld k), out is m x n (ld m).
  a_layout_ = detail::make_layout(type, k_, m_, k_);
  b_layout_ = detail::make_layout(type, k_, max_tokens_, k_);
  c_layout_ = detail::make_layout(type, m_, max_tokens_, m_);

  const std::uint32_t align_bytes[2] = {16u, static_cast<std::uint32_t>(sizeof(T))};
  for (int cls = 0; cls < 2; ++cls) {
    cublasLtMatmulPreference_t p = nullptr;
    QBL_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&p));
    pref_[cls].reset(p);
    detail::set_pref(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes_);
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      detail::set_pref(p, attr, align_bytes[cls]);
    }
  }

  buckets_ = detail::token_buckets(max_tokens_);
  plans_.resize(buckets_.size());
  for (std::size_t i = 0; i < buckets_.size(); ++i) plan_bucket(i);
}

template <typename T>
void LinearGemm<T>::set_tokens(std::int64_t tokens) {
  const auto n = static_cast<std::uint64_t>(tokens);
  detail::set_layout(b_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, n);
  detail::set_layout(c_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, n);
}

// Takes the best-ranked heuristic candidate that cuBLASLt accepts at both ends of the bucket.
template <typename T>
void LinearGemm<T>::plan_bucket(std::size_t i) {
  const std::int64_t hi = buckets_[i];
  const std::int64_t lo = i == 0 ? 1 : buckets_[i - 1] + 1;
  constexpr int max_candidates = 8;
  for (int has_bias = 0; has_bias < 2; ++has_bias) {
    for (int cls = 0; cls < 2; ++cls) {
      cublasLtMatmulHeuristicResult_t results[max_candidates] = {};
      int found = 0;
      set_tokens(hi);
      QBL_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(
          handle_.get(), desc_[has_bias].get(), a_layout_.get(), b_layout_.get(), c_layout_.get(),
          c_layout_.get(), pref_[cls].get(), max_candidates, results, &found));
      bool chosen = false;
      for (int r = 0; r < found && !chosen; ++r) {
        if (results[r].state != CUBLAS_STATUS_SUCCESS) continue;
        bool ok = true;
        for (std::int64_t n : {lo, hi}) {
          set_tokens(n);
          cublasLtMatmulHeuristicResult_t check = {};
          ok = ok && cublasLtMatmulAlgoCheck(handle_.get(), desc_[has_bias].get(), a_layout_.get(),
                                             b_layout_.get(), c_layout_.get(), c_layout_.get(),
                                             &results[r].algo, &check) == CUBLAS_STATUS_SUCCESS &&
               check.workspaceSize <= workspace_bytes_;
        }
        if (ok) {
          plans_[i].algo[has_bias][cls] = results[r].algo;
          chosen = true;
        }
      }
      if (!chosen) {
        detail::throw_cublas(CUBLAS_STATUS_NOT_SUPPORTED,
                             ("cublasLtMatmulAlgoGetHeuristic (tokens " + std::to_string(lo) + ".." +
                              std::to_string(hi) + ")")
                                 .c_str(),
                             __FILE__, __LINE__);
      }
    }
  }
}

template <typename T>
cublasStatus_t LinearGemm<T>::run(const T* a, const T* w, const T* bias, T* out,
                                  std::int64_t tokens, void* workspace, cudaStream_t stream) {
  if (tokens < 0 || tokens > max_tokens_ || !handle_) return CUBLAS_STATUS_INVALID_VALUE;
  if (tokens == 0) return CUBLAS_STATUS_SUCCESS;
  if (a == nullptr || w == nullptr || out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const std::size_t bucket = static_cast<std::size_t>(
      std::lower_bound(buckets_.begin(), buckets_.end(), tokens) - buckets_.begin());
  const bool aligned = detail::is_aligned(a, 16) && detail::is_aligned(w, 16) && detail::is_aligned(out, 16) &&
                       (bias == nullptr || detail::is_aligned(bias, 16));
  const int has_bias = bias != nullptr ? 1 : 0;
  const auto n = static_cast<std::uint64_t>(tokens);
  cublasStatus_t s = cublasLtMatrixLayoutSetAttribute(b_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, &n, sizeof n);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutSetAttribute(c_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, &n, sizeof n);
  if (s == CUBLAS_STATUS_SUCCESS && has_bias)
    s = cublasLtMatmulDescSetAttribute(desc_[1].get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const float one = 1.0f, zero = 0.0f;
  return cublasLtMatmul(handle_.get(), desc_[has_bias].get(), &one, w, a_layout_.get(), a,
                        b_layout_.get(), &zero, out, c_layout_.get(), out, c_layout_.get(),
                        &plans_[bucket].algo[has_bias][aligned ? aligned16 : unaligned], workspace,
                        workspace_bytes_, stream);
}

}  // namespace qbl

// bench_gemm.hpp -- the bare cuBLASLt products, set up here directly as a straightforward user of
// cuBLASLt would: the forward's GEMM + bias (bare_gemm, the "GEMM floor", also the last step of
// the eager-like chain) and the training floor's dgrad and wgrad (bench_train.cuh).
#pragma once

#include <qbl/detail/handles.hpp>
#include <qbl/gemm.cuh>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "bench_check.hpp"
#include "bench_memory.hpp"

namespace {

constexpr std::size_t gemm_workspace_bytes = 32 * mib;  // Hopper's recommended cuBLASLt workspace

// ---- the bare cuBLASLt GEMM + bias: the floor ---------------------------------------------
//
// Row-major out[tokens, D] = mixed[tokens, D] · W[D, D]ᵀ + b as the column-major product
// outᵀ = W · mixedᵀ: m = out, n = tokens, k = in, A = W (k x m, ld k) transposed, B = mixed
// (k x n, ld k), C = D = out (m x n, ld m), all in T; fp32 compute (TF32 when asked) and scale.
// Default preferences besides the workspace (cuBLASLt then assumes 256-byte-aligned pointers,
// which every cudaMalloc buffer here is) and the first heuristic result, as a straightforward
// user of cuBLASLt would do it. For 16-bit T the bias is in T and split-K partials may only be
// reduced in fp32 (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): qbl::GemmPlan holds itself to that
// rule, and a floor allowed to sum partials in bf16 could pick algorithms qbl may not.

// cuBLASLt objects owned through the library's RAII types (qbl/detail/handles.hpp), so that no
// Create needs a Destroy paired by hand; a failure to create ends the run like every other status.
inline qbl::detail::lt_handle make_lt_handle() {
  cublasLtHandle_t h = nullptr;
  CUBLAS_CHECK(cublasLtCreate(&h));
  return qbl::detail::lt_handle(h);
}

// fp32 scale type always: alpha and beta are floats for every dtype here.
inline qbl::detail::lt_matmul_desc make_lt_desc(cublasComputeType_t compute) {
  cublasLtMatmulDesc_t d = nullptr;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, compute, CUDA_R_32F));
  return qbl::detail::lt_matmul_desc(d);
}

// A contiguous column-major rows x cols matrix (ld = rows).
inline qbl::detail::lt_layout make_lt_layout(cudaDataType_t type, std::int64_t rows,
                                             std::int64_t cols) {
  cublasLtMatrixLayout_t l = nullptr;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                          static_cast<std::uint64_t>(cols), rows));
  return qbl::detail::lt_layout(l);
}

// The bare products' preference: the 32 MiB workspace and, for 16-bit T, split-K partials
// reduced in fp32 only (the rule qbl's GEMMs hold themselves to: qbl::gemm_traits<T>; for float,
// where every scheme is allowed, cuBLASLt's default is left as it is).
template <typename T>
qbl::detail::lt_preference make_bare_preference() {
  cublasLtMatmulPreference_t p = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p));
  qbl::detail::lt_preference pref(p);
  const std::uint64_t ws = gemm_workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof ws));
  if constexpr (qbl::gemm_traits<T>::reduction_schemes != CUBLASLT_REDUCTION_SCHEME_MASK) {
    const std::uint32_t schemes = qbl::gemm_traits<T>::reduction_schemes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                      &schemes, sizeof schemes));
  }
  return pref;
}

// "id=.. tile=.. stages=.. splitk=.." of an algorithm, to compare runs and machines.
inline std::string algo_summary(const cublasLtMatmulAlgo_t& algo) {
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
  int requested = 1;          // results asked for; the first is used
  bool bias_at_query = true;  // bias pointer set on the descriptor before asking
  bool align_prefs = false;   // MIN_ALIGNMENT_{A,B,C,D}_BYTES = 256 set explicitly
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
    constexpr cudaDataType_t type = qbl::gemm_traits<T>::data_type;
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
      for (auto attr :
           {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
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
        {CUBLASLT_ALGO_CONFIG_ID, "id"},
        {CUBLASLT_ALGO_CONFIG_TILE_ID, "tile"},
        {CUBLASLT_ALGO_CONFIG_STAGES_ID, "stages"},
        {CUBLASLT_ALGO_CONFIG_SPLITK_NUM, "splitk"},
        {CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, "reduction"},
        {CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, "swizzle"},
        {CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, "custom"},
        {CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, "inner"},
        {CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, "cluster"}};
    for (const auto& [attr, name] : attrs) {
      std::size_t size = 0;
      std::uint64_t v = 0;
      const bool ok = cublasLtMatmulAlgoConfigGetAttribute(&algo_, attr, nullptr, 0, &size) ==
                          CUBLAS_STATUS_SUCCESS &&
                      size <= sizeof v &&
                      cublasLtMatmulAlgoConfigGetAttribute(&algo_, attr, &v, size, &size) ==
                          CUBLAS_STATUS_SUCCESS;
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

// ---- the training floor's bare products: dgrad and wgrad ------------------------------------

// One bare cuBLASLt product D = op(A) · op(B), no epilogue, over contiguous column-major operands
// in T, planned once: the top heuristic result for the exact shape.
struct BareSpec {
  cublasOperation_t ta, tb;
  std::int64_t a_rows, a_cols, b_rows, b_cols, d_rows, d_cols;  // as stored, ld = rows
};

template <typename T>
class BareProduct {
 public:
  // found() is false when cuBLASLt's heuristic offers no algorithm; run() must not be called then.
  BareProduct(const BareSpec& spec, cublasComputeType_t compute)
      : workspace_(gemm_workspace_bytes) {
    constexpr cudaDataType_t type = qbl::gemm_traits<T>::data_type;
    handle_ = make_lt_handle();
    desc_ = make_lt_desc(compute);
    set_desc(CUBLASLT_MATMUL_DESC_TRANSA, spec.ta);
    set_desc(CUBLASLT_MATMUL_DESC_TRANSB, spec.tb);
    a_ = make_lt_layout(type, spec.a_rows, spec.a_cols);
    b_ = make_lt_layout(type, spec.b_rows, spec.b_cols);
    d_ = make_lt_layout(type, spec.d_rows, spec.d_cols);
    pref_ = make_bare_preference<T>();
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle_.get(), desc_.get(), a_.get(), b_.get(), d_.get(),
                                       d_.get(), pref_.get(), 1, &result, &found);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED) return;  // no algorithm for this configuration
    if (st != CUBLAS_STATUS_SUCCESS) {
      die("cublasLtMatmulAlgoGetHeuristic (bare training product)", cublasLtGetStatusString(st),
          __FILE__, __LINE__);
    }
    found_ = found >= 1 && result.state == CUBLAS_STATUS_SUCCESS;
    algo_ = result.algo;
  }
  BareProduct(const BareProduct&) = delete;
  BareProduct& operator=(const BareProduct&) = delete;

  bool found() const { return found_; }
  std::string describe() const { return found_ ? algo_summary(algo_) : std::string("none"); }

  void run(const T* a, const T* b, T* d, cudaStream_t s) {
    if (!found_) die("BareProduct::run", "no cuBLASLt algorithm was found", __FILE__, __LINE__);
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle_.get(), desc_.get(), &one, a, a_.get(), b, b_.get(), &zero,
                                d, d_.get(), d, d_.get(), &algo_, workspace_.as<void>(),
                                gemm_workspace_bytes, s));
  }

 private:
  template <typename V>
  void set_desc(cublasLtMatmulDescAttributes_t attr, const V& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_.get(), attr, &v, sizeof v));
  }

  DeviceBuffer workspace_;
  qbl::detail::lt_handle handle_;  // declared first: destroyed last
  qbl::detail::lt_matmul_desc desc_;
  qbl::detail::lt_layout a_, b_, d_;
  qbl::detail::lt_preference pref_;
  cublasLtMatmulAlgo_t algo_ = {};
  bool found_ = false;
};

// Row-major g_mixed[tokens, in] = g[tokens, out] · W[out, in] as the column-major product
// g_mixedᵀ (in x tokens) = Wᵀ-view (in x out, ld in) · gᵀ-view (out x tokens, ld out): NN.
inline BareSpec dgrad_spec(std::int64_t in, std::int64_t out, std::int64_t tokens) {
  return {CUBLAS_OP_N, CUBLAS_OP_N, in, out, out, tokens, in, tokens};
}

// Row-major grad_W[out, in] = gᵀ · mixed as the column-major product grad_Wᵀ (in x out) =
// mixedᵀ-view (in x tokens) · (gᵀ-view (out x tokens))ᵀ: NT, k = tokens. No bias-gradient
// epilogue: the training floor counts the bias gradient as one read of grad_out (bench_train.cuh
// says why).
inline BareSpec wgrad_spec(std::int64_t in, std::int64_t out, std::int64_t tokens) {
  return {CUBLAS_OP_N, CUBLAS_OP_T, in, tokens, out, tokens, in, out};
}

}  // namespace

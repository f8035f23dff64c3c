// Member definitions of qbl::LinearGemm (host-only).
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/handles.hpp>
#include <qbl/gemm.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <random>
#include <string>
#include <vector>

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

/// Fills device memory with random-looking bits of small floats (timings on zeros run fast).
inline void fill_scratch(void* d, std::size_t bytes, std::size_t elem) {
  if (bytes == 0) return;
  std::vector<unsigned char> block(std::min<std::size_t>(bytes, std::size_t{1} << 20));
  std::mt19937 gen(12345);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::size_t i = 0; i + elem <= block.size(); i += elem) {
    const float v = u(gen);
    if (elem == sizeof(float)) {
      std::memcpy(&block[i], &v, sizeof v);
    } else {  // 2-byte types: the top half of the float is a valid bf16; close enough for fp16
      std::uint32_t bits;
      std::memcpy(&bits, &v, sizeof bits);
      const auto top = static_cast<std::uint16_t>(bits >> 16);
      std::memcpy(&block[i], &top, sizeof top);
    }
  }
  auto* p = static_cast<unsigned char*>(d);
  QBL_CUDA_TRY(cudaMemcpy(p, block.data(), block.size(), cudaMemcpyHostToDevice));
  for (std::size_t done = block.size(); done < bytes;) {
    const std::size_t n = std::min(done, bytes - done);
    QBL_CUDA_TRY(cudaMemcpy(p + done, p, n, cudaMemcpyDeviceToDevice));
    done += n;
  }
}

struct cuda_stream_destroy {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};
struct cuda_event_destroy {
  void operator()(cudaEvent_t e) const noexcept { cudaEventDestroy(e); }
};
using stream_ptr = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, cuda_stream_destroy>;
using event_ptr = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, cuda_event_destroy>;

}  // namespace qbl::detail

namespace qbl {

/// Operands for timing candidates at construction; freed when planning ends.
template <typename T>
struct LinearGemm<T>::Scratch {
  detail::device_buffer a, w, bias, out, workspace;
  detail::stream_ptr stream;
  detail::event_ptr start, stop;
};

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
  autotune_candidates_ = options.autotune ? std::clamp(options.autotune_candidates, 1, 16) : 0;

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
    if (has_bias && type != CUDA_R_32F) {
      // The bias vector is stored in T (as nn.Linear's); it is added to the fp32 accumulator.
      detail::set_desc(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, type);
    }
  }
  // Column-major views: w is k x m (ld k) used transposed, a is k x n (ld k), out is m x n (ld m).
  a_layout_ = detail::make_layout(type, k_, m_, k_);
  b_layout_ = detail::make_layout(type, k_, max_tokens_, k_);
  c_layout_ = detail::make_layout(type, m_, max_tokens_, m_);

  for (int cls = 0; cls < align_classes; ++cls) {
    if (class_bytes[cls] < sizeof(T)) continue;
    cublasLtMatmulPreference_t p = nullptr;
    QBL_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&p));
    pref_[cls].reset(p);
    detail::set_pref(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes_);
    if (gemm_traits<T>::reduction_schemes != CUBLASLT_REDUCTION_SCHEME_MASK) {
      detail::set_pref(p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, gemm_traits<T>::reduction_schemes);
    }
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      detail::set_pref(p, attr, class_bytes[cls]);
    }
  }

  buckets_ = detail::token_buckets(max_tokens_);
  plans_.resize(buckets_.size());
  std::unique_ptr<Scratch> scratch;
  if (autotune_candidates_ > 0) {
    scratch = std::make_unique<Scratch>();
    scratch->a = detail::device_buffer(static_cast<std::size_t>(max_tokens_ * k_) * sizeof(T));
    scratch->w = detail::device_buffer(static_cast<std::size_t>(m_ * k_) * sizeof(T));
    scratch->bias = detail::device_buffer(static_cast<std::size_t>(m_) * sizeof(T));
    scratch->out = detail::device_buffer(static_cast<std::size_t>(max_tokens_ * m_) * sizeof(T));
    scratch->workspace = detail::device_buffer(workspace_bytes_);
    for (auto* b : {&scratch->a, &scratch->w, &scratch->bias}) detail::fill_scratch(b->get(), b->bytes(), sizeof(T));
    cudaStream_t s = nullptr;
    QBL_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    scratch->stream.reset(s);
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    QBL_CUDA_TRY(cudaEventCreate(&e0));
    scratch->start.reset(e0);
    QBL_CUDA_TRY(cudaEventCreate(&e1));
    scratch->stop.reset(e1);
  }
  if (scratch) warm_up(*scratch);
  for (std::size_t i = 0; i < buckets_.size(); ++i) plan_bucket(i, scratch.get());
  if (scratch) QBL_CUDA_TRY(cudaStreamSynchronize(scratch->stream.get()));
}

template <typename T>
int LinearGemm<T>::alignment_class(const void* a, const void* w, const void* bias,
                                   const void* out) noexcept {
  auto all = [&](std::size_t bytes) {
    return detail::is_aligned(a, bytes) && detail::is_aligned(w, bytes) &&
           detail::is_aligned(out, bytes) && (bias == nullptr || detail::is_aligned(bias, bytes));
  };
  int cls = 0;
  while (cls + 1 < align_classes && !all(class_bytes[cls])) ++cls;
  return cls;
}

template <typename T>
std::size_t LinearGemm<T>::bucket_of(std::int64_t tokens) const noexcept {
  return static_cast<std::size_t>(std::lower_bound(buckets_.begin(), buckets_.end(), tokens) -
                                  buckets_.begin());
}

template <typename T>
bool LinearGemm<T>::supports(const T* a, const T* w, const T* bias, const T* out,
                             std::int64_t tokens) const noexcept {
  if (tokens < 1 || tokens > max_tokens_ || plans_.empty()) return false;
  return plans_[bucket_of(tokens)].found[bias != nullptr ? 1 : 0][alignment_class(a, w, bias, out)];
}

template <typename T>
void LinearGemm<T>::set_tokens(std::int64_t tokens) {
  const auto n = static_cast<std::uint64_t>(tokens);
  detail::set_layout(b_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, n);
  detail::set_layout(c_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, n);
}

// cuBLASLt must accept the algorithm at both ends of the bucket, within the workspace.
template <typename T>
bool LinearGemm<T>::valid_for_bucket(const cublasLtMatmulAlgo_t& algo, int has_bias, std::size_t i) {
  const std::int64_t hi = buckets_[i];
  const std::int64_t lo = i == 0 ? 1 : buckets_[i - 1] + 1;
  for (std::int64_t n : {lo, hi}) {
    set_tokens(n);
    cublasLtMatmulHeuristicResult_t check = {};
    if (cublasLtMatmulAlgoCheck(handle_.get(), desc_[has_bias].get(), a_layout_.get(),
                                b_layout_.get(), c_layout_.get(), c_layout_.get(), &algo,
                                &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes_) {
      return false;
    }
  }
  return true;
}

// Runs the largest product for a while so that candidates are timed at working clocks, not while
// the GPU ramps up from idle (which would make whichever candidate runs first look slow).
template <typename T>
void LinearGemm<T>::warm_up(Scratch& s) {
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  set_tokens(max_tokens_);
  QBL_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle_.get(), desc_[1].get(), a_layout_.get(),
                                                b_layout_.get(), c_layout_.get(), c_layout_.get(),
                                                pref_[0].get(), 1, &result, &found));
  if (found == 0) return;
  float total = 0.0f;
  for (int i = 0; i < 200 && total < 25.0f; ++i) {
    const float t = time_algo(result.algo, 1, max_tokens_, s, 1);
    if (!(t < std::numeric_limits<float>::infinity())) return;
    total += t;
  }
}

// Median of `reps` event-timed runs after one warm-up; +inf if the algorithm fails to run.
template <typename T>
float LinearGemm<T>::time_algo(const cublasLtMatmulAlgo_t& algo, int has_bias, std::int64_t tokens,
                               Scratch& s, int reps) {
  constexpr int max_reps = 16;
  reps = std::clamp(reps, 1, max_reps);
  set_tokens(tokens);
  const void* bias = s.bias.get();
  QBL_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc_[1].get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &bias, sizeof bias));
  const float one = 1.0f, zero = 0.0f;
  auto launch = [&] {
    return cublasLtMatmul(handle_.get(), desc_[has_bias].get(), &one, s.w.get(), a_layout_.get(),
                          s.a.get(), b_layout_.get(), &zero, s.out.get(), c_layout_.get(),
                          s.out.get(), c_layout_.get(), &algo, s.workspace.get(), workspace_bytes_,
                          s.stream.get());
  };
  if (launch() != CUBLAS_STATUS_SUCCESS) return std::numeric_limits<float>::infinity();
  float ms[max_reps];
  for (int r = 0; r < reps; ++r) {
    float& t = ms[r];
    QBL_CUDA_TRY(cudaEventRecord(s.start.get(), s.stream.get()));
    if (launch() != CUBLAS_STATUS_SUCCESS) return std::numeric_limits<float>::infinity();
    QBL_CUDA_TRY(cudaEventRecord(s.stop.get(), s.stream.get()));
    QBL_CUDA_TRY(cudaEventSynchronize(s.stop.get()));
    QBL_CUDA_TRY(cudaEventElapsedTime(&t, s.start.get(), s.stop.get()));
  }
  std::sort(ms, ms + reps);
  return ms[reps / 2];
}

// Per bias case and alignment class: the best heuristic candidate valid over the whole bucket --
// cuBLASLt's first choice, or with autotuning (256-byte class) the fastest one measured.
template <typename T>
void LinearGemm<T>::plan_bucket(std::size_t i, Scratch* scratch) {
  constexpr int max_candidates = 16;
  const std::int64_t hi = buckets_[i];
  for (int has_bias = 0; has_bias < 2; ++has_bias) {
    for (int cls = 0; cls < align_classes; ++cls) {
      if (class_bytes[cls] < sizeof(T)) continue;
      const bool tune = scratch != nullptr && cls == 0;
      const int wanted = tune ? autotune_candidates_ : 4;
      cublasLtMatmulHeuristicResult_t results[max_candidates] = {};
      int found = 0;
      set_tokens(hi);
      QBL_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(
          handle_.get(), desc_[has_bias].get(), a_layout_.get(), b_layout_.get(), c_layout_.get(),
          c_layout_.get(), pref_[cls].get(), wanted, results, &found));
      std::vector<int> valid;
      for (int r = 0; r < found; ++r) {
        if (results[r].state == CUBLAS_STATUS_SUCCESS && valid_for_bucket(results[r].algo, has_bias, i)) {
          valid.push_back(r);
          if (!tune) break;
        }
      }
      if (valid.empty()) continue;  // run() answers NOT_SUPPORTED for these
      int best = valid.front();
      if (tune) {
        GemmTuning rec;
        rec.tokens = hi;
        rec.bias = has_bias != 0;
        rec.candidates = static_cast<int>(valid.size());
        // Two rounds over the candidates, each candidate's best round counting: a transient
        // (clock change, another process) rarely hits the same candidate twice.
        std::vector<float> ms(valid.size(), std::numeric_limits<float>::infinity());
        for (int round = 0; round < 2; ++round)
          for (std::size_t v = 0; v < valid.size(); ++v)
            ms[v] = std::min(ms[v], time_algo(results[valid[v]].algo, has_bias, hi, *scratch, 5));
        float best_ms = std::numeric_limits<float>::infinity();
        for (std::size_t v = 0; v < valid.size(); ++v) {
          const int r = valid[v];
          const float t = ms[v];
          if (r == valid.front()) rec.first_ms = t;
          // A later candidate must beat cuBLASLt's first choice by 10 %: on the H200 a 6 % win
          // on scratch operands (4096 x 4096 x 16384 fp32) turned into a 9 % loss on real ones,
          // while the real wins (small token counts) were 18 % and more.
          if (t < best_ms * (r == valid.front() ? 1.0f : 0.90f)) {
            best_ms = t;
            best = r;
          }
        }
        rec.chosen = best;
        rec.chosen_ms = best_ms;
        tuning_.push_back(rec);
      }
      plans_[i].algo[has_bias][cls] = results[best].algo;
      plans_[i].found[has_bias][cls] = true;
    }
  }
}

template <typename T>
std::string LinearGemm<T>::describe(std::int64_t tokens, bool bias) const {
  if (tokens < 1 || tokens > max_tokens_ || plans_.empty()) return "none";
  const Plan& plan = plans_[bucket_of(tokens)];
  if (!plan.found[bias ? 1 : 0][0]) return "none";
  const cublasLtMatmulAlgo_t& algo = plan.algo[bias ? 1 : 0][0];
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> long long {
    // The size passed must be the attribute's own: ask for it first.
    std::size_t size = 0;
    std::uint64_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS ||
        size > sizeof v ||
        cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, size, &size) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return static_cast<long long>(v);  // little-endian: a narrower value sits in the low bytes
  };
  return "algo " + std::to_string(get(CUBLASLT_ALGO_CONFIG_ID)) + " tile " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_TILE_ID)) + " stages " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " splitK " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " reduction " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) + " swizzle " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) + " custom " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)) + " inner " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID)) + " cluster " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

template <typename T>
cublasStatus_t LinearGemm<T>::run(const T* a, const T* w, const T* bias, T* out,
                                  std::int64_t tokens, void* workspace, cudaStream_t stream) {
  if (tokens < 0 || tokens > max_tokens_ || !handle_) return CUBLAS_STATUS_INVALID_VALUE;
  if (tokens == 0) return CUBLAS_STATUS_SUCCESS;
  if (a == nullptr || w == nullptr || out == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const std::size_t bucket = bucket_of(tokens);
  const int cls = alignment_class(a, w, bias, out);
  const int has_bias = bias != nullptr ? 1 : 0;
  if (!plans_[bucket].found[has_bias][cls]) return CUBLAS_STATUS_NOT_SUPPORTED;
  const auto n = static_cast<std::uint64_t>(tokens);
  cublasStatus_t s = cublasLtMatrixLayoutSetAttribute(b_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, &n, sizeof n);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutSetAttribute(c_layout_.get(), CUBLASLT_MATRIX_LAYOUT_COLS, &n, sizeof n);
  if (s == CUBLAS_STATUS_SUCCESS && has_bias)
    s = cublasLtMatmulDescSetAttribute(desc_[1].get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  if (s != CUBLAS_STATUS_SUCCESS) return s;
  const float one = 1.0f, zero = 0.0f;
  s = cublasLtMatmul(handle_.get(), desc_[has_bias].get(), &one, w, a_layout_.get(), a,
                     b_layout_.get(), &zero, out, c_layout_.get(), out, c_layout_.get(),
                     &plans_[bucket].algo[has_bias][cls], workspace, workspace_bytes_, stream);
  // cuBLASLt checks the actual pointers at launch and can refuse, before enqueuing anything, an
  // algorithm its heuristic offered for their alignment class (bf16 at 2 bytes on an H200):
  // remember it, so that supports() says so from now on.
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) plans_[bucket].found[has_bias][cls] = false;
  return s;
}

}  // namespace qbl

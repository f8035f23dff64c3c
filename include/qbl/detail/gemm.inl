// Member definitions of qbl::GemmPlan.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/handles.hpp>
#include <qbl/detail/linear_fallback.cuh>
#include <qbl/gemm.cuh>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace qbl::detail {

template <typename V>
cublasStatus_t set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                        const V& v) noexcept {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof v);
}

template <typename V>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V& v) {
  QBL_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof v));
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

/// Which timed candidate autotuning keeps, from their times in heuristic order: the first-ranked
/// unless a later one beats the best so far by 10 % (on the H200 a 6 % win on scratch operands,
/// 4096 x 4096 x 16384 fp32, turned into a 9 % loss on real ones, while the real wins -- small
/// token counts -- were 18 % and more). A candidate that failed to run has time +inf.
inline std::size_t pick_fastest(const std::vector<float>& ms) {
  std::size_t best = 0;
  float best_ms = ms.empty() ? 0.0f : ms[0];
  for (std::size_t v = 1; v < ms.size(); ++v) {
    if (ms[v] < best_ms * 0.90f) {  // inf * 0.9 is inf: any finite time beats a failed first
      best_ms = ms[v];
      best = v;
    }
  }
  return best;
}

/// The fallback kernel's strides for a column-major spec: row-major d[r, c] = D[c, r], so its
/// rows are the spec's n, its columns m, its A(r, k) = op(B)[k, r] and B(c, k) = op(A)[c, k].
inline FallbackGemm fallback_strides(const GemmSpec& s, std::int64_t m, std::int64_t n,
                                     std::int64_t k) {
  FallbackGemm g{n, m, k, 0, 0, 0, 0};
  if (s.trans_b == CUBLAS_OP_N) {  // B stored k x n, ld k
    g.a_rs = k, g.a_ks = 1;
  } else {  // B stored n x k, ld n
    g.a_rs = 1, g.a_ks = n;
  }
  if (s.trans_a == CUBLAS_OP_N) {  // A stored m x k, ld m
    g.b_cs = 1, g.b_ks = m;
  } else {  // A stored k x m, ld k
    g.b_cs = k, g.b_ks = 1;
  }
  return g;
}

}  // namespace qbl::detail

namespace qbl {

/// What planning needs for a while and frees when it ends: the preferences per alignment class,
/// the operands for the trial launches and for timing candidates (zeroed, so that trial launches
/// read initialized memory), a stream and two events.
template <typename T>
struct GemmPlan<T>::Scratch {
  detail::lt_preference pref[align_classes];
  detail::device_buffer a, b, d, vector, workspace;
  detail::stream_ptr stream;
  detail::event_ptr start, stop;
  // Planning may end in a throw with memsets or trial products still queued on `stream`: they
  // finish before the buffers go back (a stream-ordered allocator would hand them out at once).
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (stream) cudaStreamSynchronize(stream.get());
  }
};

template <typename T>
GemmPlan<T>::GemmPlan(const GemmSpec& spec, std::int64_t max_tokens, const Options& options)
    : spec_(spec),
      max_tokens_(max_tokens),
      workspace_bytes_(options.cublas_workspace_bytes),
      compute_(gemm_traits<T>::compute_type(options)) {
  const bool tokens_n = spec.tokens == GemmSpec::Tokens::n;
  QBL_EXPECTS(spec.m > 0 && (tokens_n ? spec.k > 0 : spec.n > 0), qbl::invalid_argument,
              "features must be positive");
  QBL_EXPECTS(max_tokens > 0, qbl::invalid_argument, "max_tokens must be positive");
  const bool ta = spec.trans_a != CUBLAS_OP_N, tb = spec.trans_b != CUBLAS_OP_N;
  // The token count must be a stored column count of every operand that has it: n is the
  // columns of B (untransposed) and D; k is the columns of A (untransposed) and of B (transposed).
  QBL_EXPECTS(tokens_n ? !tb : (!ta && tb), qbl::invalid_argument,
              "the token count must be a stored column count of every operand that has it");
  QBL_EXPECTS(spec.vector_epilogue == CUBLASLT_EPILOGUE_DEFAULT ||
                  spec.vector_epilogue == CUBLASLT_EPILOGUE_BIAS,
              qbl::invalid_argument, "the vector epilogue is BIAS or none");
  (tokens_n ? spec_.n : spec_.k) = max_tokens;
  autotune_candidates_ = options.autotune ? std::clamp(options.autotune_candidates, 1, 16) : 0;
  vector_planned_ = spec_.vector_epilogue != CUBLASLT_EPILOGUE_DEFAULT;

  cublasLtHandle_t h = nullptr;
  QBL_CUBLAS_TRY(cublasLtCreate(&h));
  handle_.reset(h);

  Scratch scratch;
  for (int cls = 0; cls < align_classes; ++cls) {
    if (class_bytes[cls] < sizeof(T)) continue;
    cublasLtMatmulPreference_t p = nullptr;
    QBL_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&p));
    scratch.pref[cls].reset(p);
    detail::set_pref(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes_);
    if (gemm_traits<T>::reduction_schemes != CUBLASLT_REDUCTION_SCHEME_MASK) {
      detail::set_pref(p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                       gemm_traits<T>::reduction_schemes);
    }
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      detail::set_pref(p, attr, class_bytes[cls]);
    }
  }

  buckets_ = detail::token_buckets(max_tokens_);
  plans_.resize(buckets_.size());

  // Scratch operands for the trial launches (at each bucket's smallest token count, so at most
  // max_tokens / 2 + 1 tokens) and, with autotuning, for timing at max_tokens; 256 bytes of slack
  // each so that a trial can place its pointers at exactly a class's alignment. Zeroed on the
  // scratch stream.
  cudaStream_t s = nullptr;
  QBL_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  scratch.stream.reset(s);
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  QBL_CUDA_TRY(cudaEventCreate(&e0));
  scratch.start.reset(e0);
  QBL_CUDA_TRY(cudaEventCreate(&e1));
  scratch.stop.reset(e1);
  const std::int64_t scratch_tokens = autotune_candidates_ > 0 || buckets_.size() < 2
                                          ? max_tokens_
                                          : buckets_[buckets_.size() - 2] + 1;
  const std::int64_t a_rows = ta ? spec_.k : spec_.m, a_cols = ta ? spec_.m : spec_.k;
  const std::int64_t b_rows = tb ? spec_.n : spec_.k;
  constexpr std::size_t slack = 256;
  auto zeroed = [&](std::int64_t rows, std::int64_t cols) {
    const std::size_t bytes = static_cast<std::size_t>(rows * cols) * sizeof(T) + slack;
    detail::device_buffer b(bytes, options.allocator);
    QBL_CUDA_TRY(cudaMemsetAsync(b.get(), 0, bytes, scratch.stream.get()));
    return b;
  };
  scratch.a = zeroed(a_rows, tokens_n ? a_cols : scratch_tokens);
  scratch.b = zeroed(b_rows, scratch_tokens);
  scratch.d = zeroed(spec_.m, tokens_n ? scratch_tokens : spec_.n);
  scratch.vector = zeroed(std::max(spec_.m, spec_.n), 1);
  scratch.workspace = detail::device_buffer(workspace_bytes_, options.allocator);
  QBL_CUDA_TRY(cudaStreamSynchronize(scratch.stream.get()));
  if (autotune_candidates_ > 0) {
    for (auto* b : {&scratch.a, &scratch.b, &scratch.vector})
      detail::fill_scratch(b->get(), b->bytes(), sizeof(T));
    QBL_CUDA_TRY(cudaStreamSynchronize(nullptr));  // fill_scratch copies on the default stream
  }

  if (autotune_candidates_ > 0) warm_up(scratch);
  for (std::size_t i = 0; i < buckets_.size(); ++i) plan_bucket(i, scratch);
  QBL_CUDA_TRY(cudaStreamSynchronize(scratch.stream.get()));
}

template <typename T>
int GemmPlan<T>::alignment_class(const void* a, const void* b, const void* vector,
                                 const void* d) noexcept {
  auto all = [&](std::size_t bytes) {
    return detail::is_aligned(a, bytes) && detail::is_aligned(b, bytes) &&
           detail::is_aligned(d, bytes) && (vector == nullptr || detail::is_aligned(vector, bytes));
  };
  int cls = 0;
  while (cls + 1 < align_classes && !all(class_bytes[cls])) ++cls;
  return cls;
}

template <typename T>
std::size_t GemmPlan<T>::bucket_of(std::int64_t tokens) const noexcept {
  return static_cast<std::size_t>(std::lower_bound(buckets_.begin(), buckets_.end(), tokens) -
                                  buckets_.begin());
}

template <typename T>
bool GemmPlan<T>::uses_cublaslt(const T* a, const T* b, const T* d, const void* vector,
                                std::int64_t tokens) const noexcept {
  if (tokens < 1 || tokens > max_tokens_ || plans_.empty()) return false;
  const int vec = vector != nullptr ? 1 : 0;
  if (vec && !vector_planned_) return false;
  return plans_[bucket_of(tokens)].found[vec][alignment_class(a, b, vector, d)];
}

// The descriptors of one product with `tokens` tokens, initialized in `call`: the matmul
// descriptor (transposes, epilogue, vector pointer and type) and the three layouts, the token
// count being a stored column count of every operand that has it.
template <typename T>
cublasStatus_t GemmPlan<T>::describe_call(Call& call, int vec, std::int64_t tokens,
                                          const void* vector) const noexcept {
  constexpr cudaDataType_t type = gemm_traits<T>::data_type;
  const bool tokens_n = spec_.tokens == GemmSpec::Tokens::n;
  const std::int64_t n = tokens_n ? tokens : spec_.n, k = tokens_n ? spec_.k : tokens;
  const bool ta = spec_.trans_a != CUBLAS_OP_N, tb = spec_.trans_b != CUBLAS_OP_N;
  const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
  cublasStatus_t st = cublasLtMatmulDescInit(&call.desc, compute_, CUDA_R_32F);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = detail::set_desc(&call.desc, CUBLASLT_MATMUL_DESC_TRANSA, spec_.trans_a);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = detail::set_desc(&call.desc, CUBLASLT_MATMUL_DESC_TRANSB, spec_.trans_b);
  if (st == CUBLAS_STATUS_SUCCESS && vec) {
    st = detail::set_desc(&call.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, spec_.vector_epilogue);
    // The vector is stored in T (as nn.Linear's bias and its gradient); the epilogue works on
    // the fp32 accumulator.
    if (st == CUBLAS_STATUS_SUCCESS && type != CUDA_R_32F)
      st = detail::set_desc(&call.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, type);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = detail::set_desc(&call.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, vector);
  }
  // Column-major views of contiguous operands: A stored m x k (or k x m transposed), B k x n (or
  // n x k), D m x n, each with ld = its stored rows.
  const std::int64_t a_rows = ta ? k : spec_.m, a_cols = ta ? spec_.m : k;
  const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutInit(&call.a, type, u(a_rows), u(a_cols), a_rows);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutInit(&call.b, type, u(b_rows), u(b_cols), b_rows);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatrixLayoutInit(&call.d, type, u(spec_.m), u(n), spec_.m);
  return st;
}

// cuBLASLt must accept the algorithm at both ends of the bucket, within the workspace.
template <typename T>
bool GemmPlan<T>::valid_for_bucket(const cublasLtMatmulAlgo_t& algo, int vec, std::size_t i) const {
  const std::int64_t hi = buckets_[i];
  const std::int64_t lo = i == 0 ? 1 : buckets_[i - 1] + 1;
  for (std::int64_t n : {lo, hi}) {
    Call call;
    QBL_CUBLAS_TRY(describe_call(call, vec, n, nullptr));
    cublasLtMatmulHeuristicResult_t check = {};
    if (cublasLtMatmulAlgoCheck(handle_.get(), &call.desc, &call.a, &call.b, &call.d, &call.d,
                                &algo, &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > workspace_bytes_) {
      return false;
    }
  }
  return true;
}

// One product on the scratch operands, every pointer aligned to exactly class_bytes[cls].
template <typename T>
cublasStatus_t GemmPlan<T>::launch(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens,
                                   int cls, Scratch& s) const {
  const std::size_t off = cls == 0 ? 0 : class_bytes[cls];
  auto at = [off](const detail::device_buffer& b) { return static_cast<char*>(b.get()) + off; };
  Call call;
  const cublasStatus_t st = describe_call(call, vec, tokens, vec ? at(s.vector) : nullptr);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const float one = 1.0f, zero = 0.0f;
  return cublasLtMatmul(handle_.get(), &call.desc, &one, at(s.a), &call.a, at(s.b), &call.b, &zero,
                        at(s.d), &call.d, at(s.d), &call.d, &algo, s.workspace.get(),
                        workspace_bytes_, s.stream.get());
}

// Runs the largest product for a while so that candidates are timed at working clocks, not while
// the GPU ramps up from idle (which would make whichever candidate runs first look slow).
template <typename T>
void GemmPlan<T>::warm_up(Scratch& s) const {
  const int vec = vector_planned_ ? 1 : 0;
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  Call call;
  QBL_CUBLAS_TRY(describe_call(call, vec, max_tokens_, nullptr));
  QBL_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle_.get(), &call.desc, &call.a, &call.b,
                                                &call.d, &call.d, s.pref[0].get(), 1, &result,
                                                &found));
  if (found == 0) return;
  float total = 0.0f;
  for (int i = 0; i < 200 && total < 25.0f; ++i) {
    const float t = time_algo(result.algo, vec, max_tokens_, s, 1);
    if (!(t < std::numeric_limits<float>::infinity())) return;
    total += t;
  }
}

// Median of `reps` event-timed runs after one warm-up; +inf if the algorithm fails to run.
template <typename T>
float GemmPlan<T>::time_algo(const cublasLtMatmulAlgo_t& algo, int vec, std::int64_t tokens,
                             Scratch& s, int reps) const {
  constexpr int max_reps = 16;
  reps = std::clamp(reps, 1, max_reps);
  if (launch(algo, vec, tokens, 0, s) != CUBLAS_STATUS_SUCCESS)
    return std::numeric_limits<float>::infinity();
  float ms[max_reps];
  for (int r = 0; r < reps; ++r) {
    float& t = ms[r];
    QBL_CUDA_TRY(cudaEventRecord(s.start.get(), s.stream.get()));
    if (launch(algo, vec, tokens, 0, s) != CUBLAS_STATUS_SUCCESS)
      return std::numeric_limits<float>::infinity();
    QBL_CUDA_TRY(cudaEventRecord(s.stop.get(), s.stream.get()));
    QBL_CUDA_TRY(cudaEventSynchronize(s.stop.get()));
    QBL_CUDA_TRY(cudaEventElapsedTime(&t, s.start.get(), s.stop.get()));
  }
  std::sort(ms, ms + reps);
  return ms[reps / 2];
}

// Per epilogue case and alignment class: the best heuristic candidate valid over the whole bucket
// -- cuBLASLt's first choice, or with autotuning (256-byte class) the fastest one measured --
// and, below 16-byte alignment, one that cublasLtMatmul accepts at a trial launch with the
// bucket's smallest token count.
template <typename T>
void GemmPlan<T>::plan_bucket(std::size_t i, Scratch& scratch) {
  constexpr int max_candidates = 16;
  const std::int64_t hi = buckets_[i];
  const std::int64_t lo = i == 0 ? 1 : buckets_[i - 1] + 1;
  for (int vec = 0; vec < 2; ++vec) {
    if (vec && !vector_planned_) continue;
    for (int cls = 0; cls < align_classes; ++cls) {
      if (class_bytes[cls] < sizeof(T)) continue;
      const bool tune = autotune_candidates_ > 0 && cls == 0;
      const bool trial = cls >= first_trial_class;
      const int wanted = tune ? autotune_candidates_ : 4;
      cublasLtMatmulHeuristicResult_t results[max_candidates] = {};
      int found = 0;
      // No vector pointer while asking: the heuristic reads the one on the descriptor, and a
      // trial launch's (aligned to a small class on purpose) made it offer an algorithm 8x slower
      // for every 256-byte-aligned call after it (bf16, 4096 x 4096 x 16384, on an H200).
      Call call;
      QBL_CUBLAS_TRY(describe_call(call, vec, hi, nullptr));
      QBL_CUBLAS_TRY(cublasLtMatmulAlgoGetHeuristic(handle_.get(), &call.desc, &call.a, &call.b,
                                                    &call.d, &call.d, scratch.pref[cls].get(),
                                                    wanted, results, &found));
      std::vector<int> valid;
      for (int r = 0; r < found; ++r) {
        if (results[r].state != CUBLAS_STATUS_SUCCESS || !valid_for_bucket(results[r].algo, vec, i))
          continue;
        if (trial && launch(results[r].algo, vec, lo, cls, scratch) != CUBLAS_STATUS_SUCCESS)
          continue;
        valid.push_back(r);
        if (!tune) break;
      }
      if (valid.empty()) continue;  // the fallback kernel serves this case
      int best = valid.front();
      if (tune) {
        GemmTuning rec;
        rec.tokens = hi;
        rec.bias = vec != 0;
        rec.candidates = static_cast<int>(valid.size());
        // Two rounds over the candidates, each candidate's best round counting: a transient
        // (clock change, another process) rarely hits the same candidate twice.
        std::vector<float> ms(valid.size(), std::numeric_limits<float>::infinity());
        for (int round = 0; round < 2; ++round)
          for (std::size_t v = 0; v < valid.size(); ++v)
            ms[v] = std::min(ms[v], time_algo(results[valid[v]].algo, vec, hi, scratch, 5));
        const std::size_t pick = detail::pick_fastest(ms);
        best = valid[pick];
        rec.first_ms = ms.front();
        rec.chosen = best;
        rec.chosen_ms = ms[pick];
        tuning_.push_back(rec);
      }
      plans_[i].algo[vec][cls] = results[best].algo;
      plans_[i].found[vec][cls] = true;
    }
  }
}

template <typename T>
std::string GemmPlan<T>::describe(std::int64_t tokens, bool vector) const {
  if (tokens < 1 || tokens > max_tokens_ || plans_.empty()) return "none";
  const Plan& plan = plans_[bucket_of(tokens)];
  if ((vector && !vector_planned_) || !plan.found[vector ? 1 : 0][0]) return "none";
  const cublasLtMatmulAlgo_t& algo = plan.algo[vector ? 1 : 0][0];
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> long long {
    // The size passed must be the attribute's own: ask for it first.
    std::size_t size = 0;
    std::uint64_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) !=
            CUBLAS_STATUS_SUCCESS ||
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

// Where cuBLASLt has no algorithm: the fallback kernel, its strides derived from the spec.
template <typename T>
void GemmPlan<T>::run_fallback(const T* a, const T* b, T* d, const void* vector,
                               std::int64_t tokens, float beta, cudaStream_t stream) const {
  const bool tokens_n = spec_.tokens == GemmSpec::Tokens::n;
  const std::int64_t n = tokens_n ? tokens : spec_.n, k = tokens_n ? spec_.k : tokens;
  QBL_CUDA_TRY(detail::gemm_fallback(b, a, static_cast<const T*>(vector), d,
                                     detail::fallback_strides(spec_, spec_.m, n, k), beta != 0.0f,
                                     stream));
}

template <typename T>
void GemmPlan<T>::run(const T* a, const T* b, T* d, const void* vector, std::int64_t tokens,
                      float beta, void* workspace, cudaStream_t stream) const {
  QBL_EXPECTS(handle_ != nullptr, qbl::logic_error, "run() on a moved-from GemmPlan");
  QBL_EXPECTS(tokens >= 0 && tokens <= max_tokens_, qbl::invalid_argument,
              "tokens must be in [0, max_tokens]");
  if (tokens == 0) return;
  QBL_EXPECTS(a != nullptr && b != nullptr && d != nullptr, qbl::invalid_argument,
              "the operands must not be null");
  QBL_EXPECTS(vector == nullptr || spec_.vector_epilogue != CUBLASLT_EPILOGUE_DEFAULT,
              qbl::invalid_argument, "a vector for a product without a vector epilogue");
  QBL_EXPECTS(beta == 0.0f || beta == 1.0f, qbl::invalid_argument, "beta must be 0 or 1");
  QBL_EXPECTS(workspace != nullptr || workspace_bytes_ == 0, qbl::invalid_argument,
              "the workspace must not be null");
  if (!uses_cublaslt(a, b, d, vector, tokens)) {
    run_fallback(a, b, d, vector, tokens, beta, stream);
    return;
  }
  const int vec = vector != nullptr ? 1 : 0;
  Call call;
  QBL_CUBLAS_TRY(describe_call(call, vec, tokens, vector));
  const float one = 1.0f;
  QBL_CUBLAS_TRY(cublasLtMatmul(
      handle_.get(), &call.desc, &one, a, &call.a, b, &call.b, &beta, d, &call.d, d, &call.d,
      &plans_[bucket_of(tokens)].algo[vec][alignment_class(a, b, vector, d)], workspace,
      workspace_bytes_, stream));
}

}  // namespace qbl

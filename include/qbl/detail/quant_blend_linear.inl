// Member definitions of qbl::QuantBlendLinear.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/nvtx.hpp>
#include <qbl/quant_blend_linear.cuh>

#include <cstdint>
#include <limits>
#include <utility>

namespace qbl::detail {

/// Do [a, a + a_bytes) and [b, b + b_bytes) share a byte?
inline bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

inline std::size_t checked_bytes(std::int64_t rows, std::int64_t cols, std::size_t elem) {
  QBL_EXPECTS(rows >= 0 && cols >= 0, qbl::invalid_argument, "sizes must be non-negative");
  QBL_EXPECTS(
      cols == 0 || static_cast<std::uint64_t>(rows) <= std::numeric_limits<std::size_t>::max() /
                                                           elem / static_cast<std::uint64_t>(cols),
      qbl::invalid_argument, "size overflows size_t");
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * elem;
}

inline int current_device() {
  int d = 0;
  QBL_CUDA_TRY(cudaGetDevice(&d));
  return d;
}

/// Checks the construction sizes before anything is allocated; returns the current device.
inline int validated_device(std::int64_t in_features, std::int64_t out_features,
                            std::int64_t max_tokens, std::size_t elem) {
  QBL_EXPECTS(in_features > 0 && out_features > 0, qbl::invalid_argument,
              "in_features and out_features must be positive");
  QBL_EXPECTS(max_tokens > 0, qbl::invalid_argument, "max_tokens must be positive");
  checked_bytes(max_tokens, in_features, elem);
  checked_bytes(out_features, in_features, elem);
  return current_device();
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
std::size_t QuantBlendLinear<T>::workspace_bytes(std::int64_t in_features,
                                                 std::int64_t out_features, std::int64_t max_tokens,
                                                 const Options& options) {
  const std::size_t rows = detail::checked_bytes(max_tokens, in_features, sizeof(T));
  const std::size_t backward =
      rows + detail::checked_bytes(out_features, 1, sizeof(T)) + options.cublas_workspace_bytes;
  return state_bytes + rows + options.cublas_workspace_bytes + (options.backward ? backward : 0);
}

template <typename T>
QuantBlendLinear<T>::QuantBlendLinear(std::int64_t in_features, std::int64_t out_features,
                                      std::int64_t max_tokens, Options options)
    : in_(in_features),
      out_(out_features),
      max_tokens_(max_tokens),
      options_(options),
      device_(detail::validated_device(in_features, out_features, max_tokens, sizeof(T))),
      stats_(state_bytes, options.allocator),
      mixed_(detail::checked_bytes(max_tokens, in_features, sizeof(T)), options.allocator),
      cublas_workspace_(options.cublas_workspace_bytes, options.allocator),
      gemm_(in_features, out_features, max_tokens, options) {
  QBL_CUDA_TRY(detail::launch_limits<T>(&limits_));
  if (options.one_pass) QBL_CUDA_TRY(detail::one_pass_limits<T>(&one_pass_));
  if (options.backward) {
    dgrad_ =
        std::make_unique<GemmPlan<T>>(GemmSpec::linear_dgrad(in_, out_), max_tokens_, options_);
    wgrad_ =
        std::make_unique<GemmPlan<T>>(GemmSpec::linear_wgrad(in_, out_), max_tokens_, options_);
    g_mixed_ = detail::device_buffer(detail::checked_bytes(max_tokens, in_features, sizeof(T)),
                                     options.allocator);
    bias_scratch_ =
        detail::device_buffer(detail::checked_bytes(out_features, 1, sizeof(T)), options.allocator);
    side_workspace_ = detail::device_buffer(options.cublas_workspace_bytes, options.allocator);
    cudaStream_t side = nullptr;
    QBL_CUDA_TRY(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    side_stream_.reset(side);
    for (detail::event_ptr* e : {&fork_, &join_}) {
      cudaEvent_t ev = nullptr;
      QBL_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      e->reset(ev);
    }
  }
  // A throw below leaves no memset queued on buffers that then go back to the allocator.
  struct SyncOnThrow {
    bool armed = true;
    ~SyncOnThrow() {
      if (armed) cudaStreamSynchronize(nullptr);
    }
  } sync_on_throw;
  // Zero the statistics and the one-pass state, and wait for it: a forward on any stream must
  // never race this memset.
  QBL_CUDA_TRY(cudaMemsetAsync(stats_.get(), 0, state_bytes, nullptr));
  // The backward's scratch too, once: every backward writes what it reads of them, but
  // compute-sanitizer's initcheck does not see the writes of cuBLASLt's bf16/fp16 kernels, and
  // would report the element kernel's reads of a fresh g_mixed scratch that dgrad filled.
  for (detail::device_buffer* b : {&g_mixed_, &bias_scratch_, &side_workspace_})
    if (b->get() != nullptr) QBL_CUDA_TRY(cudaMemsetAsync(b->get(), 0, b->bytes(), nullptr));
  QBL_CUDA_TRY(cudaStreamSynchronize(nullptr));
  sync_on_throw.armed = false;
}

template <typename T>
void QuantBlendLinear<T>::check_forward(const T* x, const T* logits, const T* weight, const T* bias,
                                        const T* out, std::int64_t tokens) const {
  QBL_EXPECTS(x != nullptr && logits != nullptr && weight != nullptr && out != nullptr,
              qbl::invalid_argument, "x, logits, weight and out must not be null");
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(logits),
                        static_cast<const void*>(weight), static_cast<const void*>(bias),
                        static_cast<const void*>(out)}) {
    QBL_EXPECTS(detail::is_aligned(p, sizeof(T)), qbl::invalid_argument,
                "pointers must be aligned to the element size");
  }
  const std::size_t out_bytes = detail::checked_bytes(tokens, out_, sizeof(T));
  QBL_EXPECTS(
      !detail::overlaps(out, out_bytes, x, detail::checked_bytes(tokens, in_, sizeof(T))) &&
          !detail::overlaps(out, out_bytes, logits, detail::checked_bytes(tokens, 1, sizeof(T))) &&
          !detail::overlaps(out, out_bytes, weight, detail::checked_bytes(out_, in_, sizeof(T))) &&
          !detail::overlaps(out, out_bytes, bias, detail::checked_bytes(out_, 1, sizeof(T))),
      qbl::invalid_argument, "out must not overlap x, logits, weight or bias");
  QBL_EXPECTS(detail::current_device() == device_, qbl::invalid_argument,
              "forward() must run on the device the layer was constructed on");
}

template <typename T>
void QuantBlendLinear<T>::run_forward(const T* x, const T* logits, const T* weight, const T* bias,
                                      T* out, std::int64_t tokens, T* mixed, float* stats,
                                      cudaStream_t stream, bool amax_given) {
  if (amax_given) {
    const detail::NvtxRange range("qbl prologue (quant_blend from a given amax)");
    QBL_CUDA_TRY(
        detail::quant_blend_with(x, logits, stats, mixed, tokens, in_, stats + 1, limits_, stream));
  } else {
    const detail::NvtxRange range("qbl prologue (amax + quant_blend)");
    detail::OnePassState* state = one_pass_state();
    QBL_CUDA_TRY(state != nullptr
                     ? detail::amax_quant_blend_layer(x, logits, mixed, tokens, in_, stats, state,
                                                      one_pass_, limits_, stream)
                     : detail::amax_quant_blend_with(x, logits, mixed, tokens, in_, stats,
                                                     stats + 1, limits_, stream));
  }
  const detail::NvtxRange range("qbl gemm");
  if (gemm_.supports(mixed, weight, bias, out, tokens)) {
    QBL_CUBLAS_TRY(gemm_.run(mixed, weight, bias, out, tokens, cublas_workspace_.get(), stream));
  } else {
    QBL_CUDA_TRY(detail::linear_fallback(static_cast<const T*>(mixed), weight, bias, out, tokens,
                                         in_, out_, stream));
  }
}

template <typename T>
void QuantBlendLinear<T>::forward(const T* x, const T* logits, const T* weight, const T* bias,
                                  T* out, std::int64_t tokens, cudaStream_t stream) {
  const detail::NvtxRange range("qbl forward");
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error,
              "forward() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  if (tokens == 0) return;
  check_forward(x, logits, weight, bias, out, tokens);
  run_forward(x, logits, weight, bias, out, tokens, mixed_.as<T>(), stats_.as<float>(), stream);
}

template <typename T>
void QuantBlendLinear<T>::forward(const T* x, const T* logits, const T* weight, const T* bias,
                                  T* out, std::int64_t tokens, T* mixed, float* stats,
                                  cudaStream_t stream) {
  const detail::NvtxRange range("qbl forward");
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error,
              "forward() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  if (tokens == 0) return;
  check_caller_buffers(x, logits, weight, bias, out, tokens, mixed, stats);
  run_forward(x, logits, weight, bias, out, tokens, mixed, stats, stream);
}

template <typename T>
void QuantBlendLinear<T>::forward_local_amax(const T* x, std::int64_t tokens, float* stats,
                                             cudaStream_t stream) {
  const detail::NvtxRange range("qbl local amax");
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error,
              "forward_local_amax() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  QBL_EXPECTS(stats != nullptr && (tokens == 0 || x != nullptr), qbl::invalid_argument,
              "x and stats must not be null");
  QBL_EXPECTS(detail::is_aligned(x, sizeof(T)) && detail::is_aligned(stats, sizeof(float)),
              qbl::invalid_argument, "pointers must be aligned to the element size");
  QBL_EXPECTS(
      !detail::overlaps(stats, sizeof(float), x, detail::checked_bytes(tokens, in_, sizeof(T))),
      qbl::invalid_argument, "stats must not overlap x");
  QBL_EXPECTS(detail::current_device() == device_, qbl::invalid_argument,
              "forward_local_amax() must run on the device the layer was constructed on");
  QBL_CUDA_TRY(detail::amax_launch(x, tokens * in_, stats, limits_.sms, stream));
}

template <typename T>
void QuantBlendLinear<T>::forward_from_amax(const T* x, const T* logits, const T* weight,
                                            const T* bias, T* out, std::int64_t tokens, T* mixed,
                                            float* stats, cudaStream_t stream) {
  const detail::NvtxRange range("qbl forward from amax");
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error,
              "forward_from_amax() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  if (tokens == 0) return;
  check_caller_buffers(x, logits, weight, bias, out, tokens, mixed, stats);
  run_forward(x, logits, weight, bias, out, tokens, mixed, stats, stream, true);
}

template <typename T>
void QuantBlendLinear<T>::check_caller_buffers(const T* x, const T* logits, const T* weight,
                                               const T* bias, const T* out, std::int64_t tokens,
                                               const T* mixed, const float* stats) const {
  check_forward(x, logits, weight, bias, out, tokens);
  QBL_EXPECTS(mixed != nullptr && stats != nullptr, qbl::invalid_argument,
              "mixed and stats must not be null");
  QBL_EXPECTS(detail::is_aligned(mixed, sizeof(T)) && detail::is_aligned(stats, sizeof(float)),
              qbl::invalid_argument, "pointers must be aligned to the element size");
  const std::size_t mixed_bytes = detail::checked_bytes(tokens, in_, sizeof(T));
  const std::size_t n_stats = static_cast<std::size_t>(stats_floats) * sizeof(float);
  for (auto [p, bytes] : {std::pair<const void*, std::size_t>{x, mixed_bytes},
                          {logits, detail::checked_bytes(tokens, 1, sizeof(T))},
                          {weight, detail::checked_bytes(out_, in_, sizeof(T))},
                          {bias, detail::checked_bytes(out_, 1, sizeof(T))},
                          {out, detail::checked_bytes(tokens, out_, sizeof(T))}}) {
    QBL_EXPECTS(!detail::overlaps(mixed, mixed_bytes, p, bytes) &&
                    !detail::overlaps(stats, n_stats, p, bytes),
                qbl::invalid_argument, "mixed and stats must not overlap an input or out");
  }
  QBL_EXPECTS(!detail::overlaps(mixed, mixed_bytes, stats, n_stats), qbl::invalid_argument,
              "mixed and stats must not overlap each other");
}

template <typename T>
void QuantBlendLinear<T>::backward(const T* grad_out, const T* x, const T* logits, const T* weight,
                                   const T* mixed, const float* stats, std::int64_t tokens,
                                   const Gradients& grads, cudaStream_t stream) {
  const detail::NvtxRange range("qbl backward");
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error,
              "backward() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(has_backward(), qbl::logic_error,
              "backward() needs a QuantBlendLinear constructed with Options::backward = true");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  QBL_EXPECTS((mixed == nullptr) == (stats == nullptr), qbl::invalid_argument,
              "mixed and stats are both given or both null (the instance's own)");
  if (mixed == nullptr) {
    mixed = mixed_.as<T>();
    stats = stats_.as<float>();
  }
  const bool want_x = grads.x != nullptr, want_logits = grads.logits != nullptr;
  const bool want_weight = grads.weight != nullptr;
  bool want_bias = grads.bias != nullptr;  // cleared once the wgrad epilogue has served it
  const bool dgrad = want_x || want_logits;
  if (tokens == 0 || !(dgrad || want_weight || want_bias)) return;

  // What each wanted output needs, and nothing else.
  QBL_EXPECTS(grad_out != nullptr, qbl::invalid_argument, "grad_out must not be null");
  QBL_EXPECTS(!dgrad || (weight != nullptr && logits != nullptr), qbl::invalid_argument,
              "grad_x and grad_logits need weight and logits");
  QBL_EXPECTS(!want_logits || x != nullptr, qbl::invalid_argument, "grad_logits needs x");
  const std::size_t x_bytes = detail::checked_bytes(tokens, in_, sizeof(T));
  const std::size_t g_bytes = detail::checked_bytes(tokens, out_, sizeof(T));
  const std::size_t t_bytes = detail::checked_bytes(tokens, 1, sizeof(T));
  const std::size_t w_bytes = detail::checked_bytes(out_, in_, sizeof(T));
  const std::size_t b_bytes = detail::checked_bytes(out_, 1, sizeof(T));
  const std::size_t s_bytes = static_cast<std::size_t>(stats_floats) * sizeof(float);
  struct Span {
    const void* p;
    std::size_t bytes;
  };
  const Span inputs[] = {{grad_out, g_bytes},
                         {want_logits ? x : nullptr, x_bytes},
                         {dgrad ? logits : nullptr, t_bytes},
                         {dgrad ? weight : nullptr, w_bytes},
                         {want_weight ? mixed : nullptr, x_bytes},
                         {dgrad ? stats : nullptr, s_bytes}};
  const Span outputs[] = {
      {grads.x, x_bytes}, {grads.logits, t_bytes}, {grads.weight, w_bytes}, {grads.bias, b_bytes}};
  for (const Span& s : inputs)
    QBL_EXPECTS(detail::is_aligned(s.p, s.p == stats ? sizeof(float) : sizeof(T)),
                qbl::invalid_argument, "pointers must be aligned to the element size");
  for (const Span& o : outputs) {
    QBL_EXPECTS(detail::is_aligned(o.p, sizeof(T)), qbl::invalid_argument,
                "pointers must be aligned to the element size");
    for (const Span& i : inputs)
      QBL_EXPECTS(!detail::overlaps(o.p, o.bytes, i.p, i.bytes), qbl::invalid_argument,
                  "a gradient output must not overlap an input");
    for (const Span& p : outputs)
      QBL_EXPECTS(&p == &o || !detail::overlaps(o.p, o.bytes, p.p, p.bytes), qbl::invalid_argument,
                  "gradient outputs must not overlap each other");
  }
  QBL_EXPECTS(detail::current_device() == device_, qbl::invalid_argument,
              "backward() must run on the device the layer was constructed on");

  // wgrad (and the bias gradient) beside dgrad when both run: on the side stream, forked here.
  const bool fork = dgrad && (want_weight || want_bias);
  cudaStream_t wstream = stream;
  void* wws = cublas_workspace_.get();
  if (fork) {
    QBL_CUDA_TRY(cudaEventRecord(fork_.get(), stream));
    QBL_CUDA_TRY(cudaStreamWaitEvent(side_stream_.get(), fork_.get(), 0));
    wstream = side_stream_.get();
    wws = side_workspace_.get();
  }
  // Joins the side stream back into `stream` on every way out, a throw included: the caller's
  // later work (an allocator reusing grad_out or mixed, the end of a graph capture) must never
  // run ahead of wgrad. The normal way out checks the two calls; a throw's cannot be reported.
  struct Join {
    cudaStream_t main, side;
    cudaEvent_t event;
    bool armed;
    cudaError_t join() noexcept {
      armed = false;
      const cudaError_t e = cudaEventRecord(event, side);
      return e != cudaSuccess ? e : cudaStreamWaitEvent(main, event, 0);
    }
    ~Join() {
      if (armed) join();
    }
  } join{stream, side_stream_.get(), join_.get(), fork};
  if (want_weight) {
    const detail::NvtxRange wgrad_range("qbl wgrad");
    // wgrad: grad_weight = grad_outᵀ · mixed, with grad_bias from its BGRADB epilogue (written,
    // never accumulated, by cuBLASLt: accumulating, it goes to a scratch vector first).
    const float beta = grads.accumulate ? 1.0f : 0.0f;
    T* bias_out = want_bias ? (grads.accumulate ? bias_scratch_.as<T>() : grads.bias) : nullptr;
    if (wgrad_->supports(mixed, grad_out, grads.weight, bias_out, tokens)) {
      QBL_CUBLAS_TRY(
          wgrad_->run(mixed, grad_out, grads.weight, bias_out, tokens, beta, wws, wstream));
      if (bias_out != nullptr && grads.accumulate)
        QBL_CUDA_TRY(
            detail::accumulate_into(grads.bias, static_cast<const T*>(bias_out), out_, wstream));
      want_bias = false;
    } else if (wgrad_->supports(mixed, grad_out, grads.weight, nullptr, tokens)) {
      QBL_CUBLAS_TRY(
          wgrad_->run(mixed, grad_out, grads.weight, nullptr, tokens, beta, wws, wstream));
    } else {
      QBL_CUDA_TRY(detail::gemm_fallback(
          grad_out, mixed, static_cast<const T*>(nullptr), grads.weight,
          detail::FallbackGemm{out_, in_, tokens, 1, out_, 1, in_}, grads.accumulate, wstream));
    }
  }
  if (want_bias) {
    const detail::NvtxRange bias_range("qbl bias_grad");
    QBL_CUDA_TRY(bias_grad(grad_out, grads.bias, tokens, out_, grads.accumulate, wstream));
  }
  if (dgrad) {
    const detail::NvtxRange dgrad_range("qbl dgrad + quant_blend_backward");
    // dgrad: g_mixed = grad_out · weight, formed where grad_x goes (the element kernel then works
    // in place) or in the instance's scratch.
    T* g_mixed = want_x ? grads.x : g_mixed_.as<T>();
    if (dgrad_->supports(weight, grad_out, g_mixed, nullptr, tokens)) {
      QBL_CUBLAS_TRY(dgrad_->run(weight, grad_out, g_mixed, nullptr, tokens, 0.0f,
                                 cublas_workspace_.get(), stream));
    } else {
      QBL_CUDA_TRY(detail::gemm_fallback(grad_out, weight, static_cast<const T*>(nullptr), g_mixed,
                                         detail::FallbackGemm{tokens, in_, out_, out_, 1, 1, in_},
                                         false, stream));
    }
    QBL_CUDA_TRY(quant_blend_backward(static_cast<const T*>(g_mixed), x, logits, stats + 1, grads.x,
                                      grads.logits, tokens, in_, grads.quant_grad, stream));
  }
  if (fork) QBL_CUDA_TRY(join.join());
}

}  // namespace qbl

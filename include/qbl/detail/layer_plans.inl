// Member definitions of qbl::ForwardPlan and qbl::BackwardPlan.
#pragma once

#include <qbl/detail/cast.cuh>
#include <qbl/detail/checks.hpp>
#include <qbl/detail/nvtx.hpp>
#include <qbl/layer_plans.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qbl::detail {

/// Checks the construction sizes before anything is planned; returns the current device.
inline int plan_device(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
                       std::size_t elem) {
  QBL_EXPECTS(in_features > 0 && out_features > 0, qbl::invalid_argument,
              "in_features and out_features must be positive");
  QBL_EXPECTS(max_tokens > 0, qbl::invalid_argument, "max_tokens must be positive");
  checked_bytes(max_tokens, in_features, elem);
  checked_bytes(max_tokens, out_features, elem);
  checked_bytes(out_features, in_features, elem);
  int d = 0;
  QBL_CUDA_TRY(cudaGetDevice(&d));
  return d;
}

}  // namespace qbl::detail

namespace qbl {

// ---- SideStream ---------------------------------------------------------------------------------

inline SideStream::SideStream() {
  QBL_CUDA_TRY(cudaGetDevice(&device_));
  cudaStream_t s = nullptr;
  QBL_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_.reset(s);
  for (detail::event_ptr* e : {&fork_, &join_}) {
    cudaEvent_t ev = nullptr;
    QBL_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    e->reset(ev);
  }
}

inline cudaError_t SideStream::fork(cudaStream_t main) noexcept {
  const cudaError_t e = cudaEventRecord(fork_.get(), main);
  return e != cudaSuccess ? e : cudaStreamWaitEvent(stream_.get(), fork_.get(), 0);
}

inline cudaError_t SideStream::join(cudaStream_t main) noexcept {
  const cudaError_t e = cudaEventRecord(join_.get(), stream_.get());
  return e != cudaSuccess ? e : cudaStreamWaitEvent(main, join_.get(), 0);
}

// ---- ForwardPlan --------------------------------------------------------------------------------

template <typename X, typename G, typename L, typename Act>
ForwardPlan<X, G, L, Act>::ForwardPlan(std::int64_t in_features, std::int64_t out_features,
                                       std::int64_t max_tokens, const Options& options)
    : gemm_((detail::plan_device(in_features, out_features, max_tokens, sizeof(X)),
             GemmSpec::linear_forward(in_features, out_features)),
            max_tokens, options) {
  QBL_CUDA_TRY(cudaGetDevice(&device_));
  QBL_CUDA_TRY((detail::query_launch_limits<X, G, L, Act>(&limits_)));
}

template <typename X, typename G, typename L, typename Act>
std::size_t ForwardPlan<X, G, L, Act>::workspace_bytes_for(
    std::size_t cublas_workspace_bytes) noexcept {
  return detail::align_up(amax_quant_blend_workspace_bytes) + cublas_workspace_bytes;
}

namespace detail {
/// Offsets in a forward's workspace: the amax kernel's maxima, the GEMM's cuBLASLt workspace, and
/// where run() casts a float32 weight and bias (ForwardArgs::weight_fp32).
struct ForwardLayout {
  std::size_t gemm_ws = 0, weight = 0, bias = 0, total = 0;
  ForwardLayout(std::size_t cublas_workspace_bytes, std::int64_t in, std::int64_t out,
                std::size_t elem, bool cast_weight, bool cast_bias) {
    gemm_ws = align_up(amax_quant_blend_workspace_bytes);
    weight = gemm_ws + align_up(cublas_workspace_bytes);
    bias = weight + (cast_weight ? align_up(span_bytes(out, in, elem)) : 0);
    total = bias + (cast_bias ? align_up(span_bytes(out, 1, elem)) : 0);
  }
};
}  // namespace detail

template <typename X, typename G, typename L, typename Act>
std::size_t ForwardPlan<X, G, L, Act>::workspace_bytes(const ForwardArgs& a) const noexcept {
  return detail::ForwardLayout(gemm_.workspace_bytes(), in_features(), out_features(), sizeof(G),
                               a.weight_fp32 != nullptr, a.bias_fp32 != nullptr)
      .total;
}

template <typename X, typename G, typename L, typename Act>
detail::Check ForwardPlan<X, G, L, Act>::check(const ForwardArgs& a) const noexcept {
  QBL_CHECK(gemm_.valid(), logic_error, "a moved-from ForwardPlan cannot run");
  QBL_CHECK(a.tokens >= 0, invalid_argument, "tokens must be non-negative");
  QBL_CHECK(a.tokens <= max_tokens(), out_of_range, "tokens exceeds max_tokens");
  QBL_CHECK(a.amax_source == AmaxSource::x || a.amax_source == AmaxSource::stats, invalid_argument,
            "unknown amax source");
  if (a.tokens == 0) return {};
  constexpr bool fp32_gemm = std::is_same_v<G, float>;
  QBL_CHECK(fp32_gemm ? a.weight_fp32 == nullptr && a.bias_fp32 == nullptr
                      : (a.weight == nullptr || a.weight_fp32 == nullptr) &&
                            (a.bias == nullptr || a.bias_fp32 == nullptr),
            invalid_argument,
            "weight_fp32 and bias_fp32 are for a 16-bit GEMM type, in place of weight and bias: "
            "give one of each pair");
  const void* weight_in = a.weight != nullptr ? static_cast<const void*>(a.weight)
                                              : static_cast<const void*>(a.weight_fp32);
  const void* bias_in =
      a.bias != nullptr ? static_cast<const void*>(a.bias) : static_cast<const void*>(a.bias_fp32);
  const std::size_t w_elem = a.weight != nullptr ? sizeof(G) : sizeof(float);
  const std::size_t b_elem = a.bias != nullptr ? sizeof(G) : sizeof(float);
  QBL_CHECK(a.x != nullptr && a.logits != nullptr && weight_in != nullptr && a.out != nullptr,
            invalid_argument, "x, logits, weight and out must not be null");
  QBL_CHECK(a.mixed != nullptr && a.stats != nullptr, invalid_argument,
            "mixed and stats must not be null");
  QBL_CHECK(detail::is_aligned(a.x, sizeof(X)) && detail::is_aligned(a.logits, sizeof(L)) &&
                detail::is_aligned(weight_in, w_elem) && detail::is_aligned(bias_in, b_elem) &&
                detail::is_aligned(a.out, sizeof(G)) && detail::is_aligned(a.mixed, sizeof(G)) &&
                detail::is_aligned(a.stats, sizeof(float)),
            invalid_argument, "pointers must be aligned to the element size");
  const std::int64_t t = a.tokens, in = in_features(), out = out_features();
  const detail::Span x{a.x, detail::span_bytes(t, in, sizeof(X))};
  const detail::Span logits{a.logits, detail::span_bytes(t, 1, sizeof(L))};
  const detail::Span weight{weight_in, detail::span_bytes(out, in, w_elem)};
  const detail::Span bias{bias_in, detail::span_bytes(out, 1, b_elem)};
  const detail::Span o{a.out, detail::span_bytes(t, out, sizeof(G))};
  const detail::Span mixed{a.mixed, detail::span_bytes(t, in, sizeof(G))};
  const detail::Span stats{a.stats, stats_floats * sizeof(float)};
  for (const detail::Span& input : {x, logits, weight, bias}) {
    QBL_CHECK(!detail::overlaps(o, input), invalid_argument,
              "out must not overlap x, logits, weight or bias");
    QBL_CHECK(!detail::overlaps(mixed, input) && !detail::overlaps(stats, input), invalid_argument,
              "mixed and stats must not overlap an input or out");
  }
  QBL_CHECK(!detail::overlaps(mixed, o) && !detail::overlaps(stats, o), invalid_argument,
            "mixed and stats must not overlap an input or out");
  QBL_CHECK(!detail::overlaps(mixed, stats), invalid_argument,
            "mixed and stats must not overlap each other");
  QBL_CHECK(detail::current_device() == device_, invalid_argument,
            "a plan runs on the device it was made on");
  return {};
}

template <typename X, typename G, typename L, typename Act>
bool ForwardPlan<X, G, L, Act>::supports(const ForwardArgs& args) const noexcept {
  return check(args).ok();
}

template <typename X, typename G, typename L, typename Act>
void ForwardPlan<X, G, L, Act>::run(const ForwardArgs& a, void* workspace,
                                    cudaStream_t stream) const {
  const detail::NvtxRange range("qbl forward");
  detail::raise(check(a));
  if (a.tokens == 0) return;
  QBL_EXPECTS(workspace != nullptr && detail::is_aligned(workspace, 256), qbl::invalid_argument,
              "the workspace must be a 256-byte aligned buffer of workspace_bytes()");
  const std::int64_t in = in_features();
  {
    const detail::NvtxRange prologue("qbl prologue (amax + quant_blend)");
    QBL_CUDA_TRY((a.amax_source == AmaxSource::x
                      ? detail::launch_amax_quant_blend<X, G, L, Act>(
                            a.x, a.logits, a.mixed, a.tokens, in, a.stats, a.stats + 1, workspace,
                            limits_, stream)
                      : detail::launch_quant_blend<X, G, L, Act>(
                            a.x, a.logits, detail::GivenAmax{a.stats, a.stats + 1}, a.mixed,
                            a.tokens, in, limits_, stream)));
  }
  const detail::NvtxRange gemm("qbl gemm");
  auto* ws = static_cast<char*>(workspace);
  const detail::ForwardLayout l(gemm_.workspace_bytes(), in, out_features(), sizeof(G),
                                a.weight_fp32 != nullptr, a.bias_fp32 != nullptr);
  const G* weight = a.weight;
  const G* bias = a.bias;
  if (a.weight_fp32 != nullptr) {
    G* cast = reinterpret_cast<G*>(ws + l.weight);
    QBL_CUDA_TRY(
        detail::launch_cast(a.weight_fp32, cast, out_features() * in, limits_.sms, stream));
    weight = cast;
  }
  if (a.bias_fp32 != nullptr) {
    G* cast = reinterpret_cast<G*>(ws + l.bias);
    QBL_CUDA_TRY(detail::launch_cast(a.bias_fp32, cast, out_features(), limits_.sms, stream));
    bias = cast;
  }
  gemm_.run(weight, a.mixed, a.out, bias, a.tokens, 0.0f, ws + l.gemm_ws, stream);
}

template <typename X, typename G, typename L, typename Act>
void ForwardPlan<X, G, L, Act>::local_amax(const X* x, std::int64_t tokens, float* stats,
                                           cudaStream_t stream) const {
  const detail::NvtxRange range("qbl local amax");
  QBL_EXPECTS(gemm_.valid(), qbl::logic_error, "a moved-from ForwardPlan cannot run");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens(), qbl::out_of_range, "tokens exceeds max_tokens");
  QBL_EXPECTS(stats != nullptr && (tokens == 0 || x != nullptr), qbl::invalid_argument,
              "x and stats must not be null");
  QBL_EXPECTS(detail::is_aligned(x, sizeof(X)) && detail::is_aligned(stats, sizeof(float)),
              qbl::invalid_argument, "pointers must be aligned to the element size");
  QBL_EXPECTS(!detail::overlaps({stats, stats_floats * sizeof(float)},
                                {x, detail::span_bytes(tokens, in_features(), sizeof(X))}),
              qbl::invalid_argument, "stats must not overlap x");
  QBL_EXPECTS(detail::current_device() == device_, qbl::invalid_argument,
              "a plan runs on the device it was made on");
  QBL_CUDA_TRY(detail::launch_amax<Act>(x, tokens * in_features(), stats, sizeof(float),
                                        limits_.sms, stream));
}

// ---- BackwardPlan -------------------------------------------------------------------------------

template <typename X, typename G, typename L, typename Act>
struct BackwardPlan<X, G, L, Act>::Layout {
  std::size_t dgrad_ws = 0, wgrad_ws = 0, partials = 0, g_mixed = 0, mixed = 0, weight = 0,
              total = 0;
};

template <typename X, typename G, typename L, typename Act>
BackwardPlan<X, G, L, Act>::BackwardPlan(std::int64_t in_features, std::int64_t out_features,
                                         std::int64_t max_tokens, const Options& options)
    : dgrad_((detail::plan_device(in_features, out_features, max_tokens, sizeof(X)),
              GemmSpec::linear_dgrad(in_features, out_features)),
             max_tokens, options),
      wgrad_(GemmSpec::linear_wgrad(in_features, out_features), max_tokens, options),
      overlap_tokens_(options.overlap_wgrad == Choice::no ? 0 : max_tokens) {
  QBL_CUDA_TRY(cudaGetDevice(&device_));
  QBL_CUDA_TRY(detail::sm_count(&sms_));
  QBL_CUDA_TRY((detail::backward_max_blocks<X, G, L, Act>(&element_blocks_)));
}

template <typename X, typename G, typename L, typename Act>
BackwardDescription BackwardPlan<X, G, L, Act>::describe(const BackwardArgs& a,
                                                         bool side_stream) const noexcept {
  BackwardDescription d;
  d.dgrad = a.grad_x != nullptr || a.grad_logits != nullptr;
  d.wgrad = a.grad_weight != nullptr;
  d.bias = a.grad_bias != nullptr;
  d.runs = a.tokens > 0 && (d.dgrad || d.wgrad || d.bias);
  if (!d.runs) return BackwardDescription{};
  d.beside = d.dgrad && (d.wgrad || d.bias) && overlaps(a.tokens);
  d.fork = d.beside && side_stream;
  // A null mixed with grad_weight wanted is recomputed from x, logits and stats: by a kernel of its
  // own on the side stream where wgrad forks, else by the element kernel ahead of wgrad.
  if (d.wgrad && a.mixed == nullptr)
    d.mixed = d.fork ? MixedSource::recomputed_beside : MixedSource::recomputed_in_element_kernel;
  d.cast_weight = d.dgrad && a.weight_fp32 != nullptr;
  // dgrad's product goes where grad_x goes when the two are one type, else to the workspace.
  d.g_mixed_scratch = d.dgrad && (!std::is_same_v<G, X> || a.grad_x == nullptr);
  d.element_grad_x = a.grad_x != nullptr;
  d.element_grad_logits = a.grad_logits != nullptr;
  d.element_mixed = d.mixed == MixedSource::recomputed_in_element_kernel;
  d.reads_x =
      detail::backward_reads_x<Act>(d.element_grad_x, d.element_grad_logits, d.recomputes());
  d.reads_gate = d.dgrad || d.recomputes();
  d.reads_weight = d.dgrad;
  d.reads_mixed = d.wgrad && !d.recomputes();
  return d;
}

template <typename X, typename G, typename L, typename Act>
BackwardDescription BackwardPlan<X, G, L, Act>::largest(bool beside) noexcept {
  BackwardDescription d;
  d.runs = d.dgrad = d.wgrad = d.bias = true;
  d.beside = beside;
  d.mixed = MixedSource::recomputed_in_element_kernel;
  d.g_mixed_scratch = true;
  return d;  // without cast_weight: a run with weight_fp32 asks workspace_bytes(args)
}

template <typename X, typename G, typename L, typename Act>
typename BackwardPlan<X, G, L, Act>::Layout BackwardPlan<X, G, L, Act>::layout_for(
    std::int64_t in, std::int64_t out, std::int64_t tokens, std::size_t cublas_workspace_bytes,
    const BackwardDescription& d) noexcept {
  Layout l;
  const std::size_t ws = detail::align_up(cublas_workspace_bytes);
  const std::size_t rows =
      detail::align_up(detail::span_bytes(std::max<std::int64_t>(tokens, 0), in, sizeof(G)));
  l.dgrad_ws = 0;
  l.wgrad_ws = d.beside ? ws : 0;  // one workspace when the GEMMs cannot overlap
  l.partials = l.wgrad_ws + ws;
  l.g_mixed = l.partials + detail::align_up(bias_grad_workspace_bytes(out));
  l.mixed = l.g_mixed + (d.g_mixed_scratch ? rows : 0);
  l.weight = l.mixed + (d.recomputes() ? rows : 0);
  l.total =
      l.weight + (d.cast_weight ? detail::align_up(detail::span_bytes(out, in, sizeof(G))) : 0);
  return l;
}

template <typename X, typename G, typename L, typename Act>
std::size_t BackwardPlan<X, G, L, Act>::workspace_bytes(std::int64_t tokens) const noexcept {
  return layout_for(in_features(), out_features(), std::min(tokens, max_tokens()),
                    dgrad_.workspace_bytes(), largest(overlap_tokens_ > 0))
      .total;
}

template <typename X, typename G, typename L, typename Act>
std::size_t BackwardPlan<X, G, L, Act>::workspace_bytes(const BackwardArgs& args) const noexcept {
  return layout_for(in_features(), out_features(), std::min(args.tokens, max_tokens()),
                    dgrad_.workspace_bytes(), describe(args))
      .total;
}

template <typename X, typename G, typename L, typename Act>
std::size_t BackwardPlan<X, G, L, Act>::workspace_bytes_for(std::int64_t in_features,
                                                            std::int64_t out_features,
                                                            std::int64_t max_tokens,
                                                            std::int64_t tokens,
                                                            const Options& options) noexcept {
  return layout_for(in_features, out_features, std::min(tokens, max_tokens),
                    options.cublas_workspace_bytes, largest(options.overlap_wgrad != Choice::no))
      .total;
}

template <typename X, typename G, typename L, typename Act>
detail::Check BackwardPlan<X, G, L, Act>::check(const BackwardArgs& a,
                                                const BackwardDescription& d) const noexcept {
  QBL_CHECK(dgrad_.valid() && wgrad_.valid(), logic_error, "a moved-from BackwardPlan cannot run");
  QBL_CHECK(a.tokens >= 0, invalid_argument, "tokens must be non-negative");
  QBL_CHECK(a.tokens <= max_tokens(), out_of_range, "tokens exceeds max_tokens");
  if (!d.runs) return {};
  QBL_CHECK(a.grad_out != nullptr, invalid_argument, "grad_out must not be null");
  constexpr bool fp32_gemm = std::is_same_v<G, float>;
  QBL_CHECK(fp32_gemm ? a.weight_fp32 == nullptr : a.weight == nullptr || a.weight_fp32 == nullptr,
            invalid_argument,
            "weight_fp32 is for a 16-bit GEMM type, in place of weight: give one of the two");
  QBL_CHECK(!d.reads_weight || a.weight != nullptr || a.weight_fp32 != nullptr, invalid_argument,
            "grad_x and grad_logits need weight");
  QBL_CHECK(!d.reads_gate || (a.logits != nullptr && a.stats != nullptr), invalid_argument,
            "grad_x, grad_logits and a recomputed mixed need logits and stats");
  QBL_CHECK(!d.reads_x || a.x != nullptr, invalid_argument,
            "grad_logits, a recomputed mixed and an activation's grad_x need x");
  const std::int64_t t = a.tokens, in = in_features(), out = out_features();
  const detail::Span inputs[] = {
      {a.grad_out, detail::span_bytes(t, out, sizeof(G))},
      {d.reads_x ? a.x : nullptr, detail::span_bytes(t, in, sizeof(X))},
      {d.reads_gate ? a.logits : nullptr, detail::span_bytes(t, 1, sizeof(L))},
      {d.reads_weight ? a.weight : nullptr, detail::span_bytes(out, in, sizeof(G))},
      {d.reads_weight ? a.weight_fp32 : nullptr, detail::span_bytes(out, in, sizeof(float))},
      {d.reads_mixed ? a.mixed : nullptr, detail::span_bytes(t, in, sizeof(G))},
      {d.reads_gate ? a.stats : nullptr, stats_floats * sizeof(float)}};
  const detail::Span outputs[] = {{a.grad_x, detail::span_bytes(t, in, sizeof(X))},
                                  {a.grad_logits, detail::span_bytes(t, 1, sizeof(L))},
                                  {a.grad_weight, detail::span_bytes(out, in, sizeof(G))},
                                  {a.grad_bias, detail::span_bytes(out, 1, sizeof(G))}};
  QBL_CHECK(
      detail::is_aligned(a.grad_out, sizeof(G)) && detail::is_aligned(a.x, sizeof(X)) &&
          detail::is_aligned(a.logits, sizeof(L)) && detail::is_aligned(a.weight, sizeof(G)) &&
          detail::is_aligned(a.weight_fp32, sizeof(float)) &&
          detail::is_aligned(a.mixed, sizeof(G)) && detail::is_aligned(a.stats, sizeof(float)) &&
          detail::is_aligned(a.grad_x, sizeof(X)) && detail::is_aligned(a.grad_logits, sizeof(L)) &&
          detail::is_aligned(a.grad_weight, sizeof(G)) &&
          detail::is_aligned(a.grad_bias, sizeof(G)),
      invalid_argument, "pointers must be aligned to the element size");
  for (const detail::Span& o : outputs) {
    for (const detail::Span& i : inputs)
      QBL_CHECK(!detail::overlaps(o, i), invalid_argument,
                "a gradient output must not overlap an input");
    for (const detail::Span& p : outputs)
      QBL_CHECK(&p == &o || !detail::overlaps(o, p), invalid_argument,
                "gradient outputs must not overlap each other");
  }
  QBL_CHECK(detail::current_device() == device_, invalid_argument,
            "a plan runs on the device it was made on");
  return {};
}

template <typename X, typename G, typename L, typename Act>
bool BackwardPlan<X, G, L, Act>::supports(const BackwardArgs& args) const noexcept {
  return check(args, describe(args)).ok();
}

template <typename X, typename G, typename L, typename Act>
void BackwardPlan<X, G, L, Act>::run(const BackwardArgs& a, void* workspace, SideStream* side,
                                     cudaStream_t stream) const {
  const detail::NvtxRange range("qbl backward");
  const BackwardDescription d = describe(a, side != nullptr);
  detail::raise(check(a, d));
  if (!d.runs) return;
  QBL_EXPECTS(workspace != nullptr && detail::is_aligned(workspace, 256), qbl::invalid_argument,
              "the workspace must be a 256-byte aligned buffer of workspace_bytes(tokens)");
  QBL_EXPECTS(side == nullptr || (side->valid() && side->device() == device_),
              qbl::invalid_argument, "the side stream must be a valid one of the plan's device");
  const Layout l = layout_for(in_features(), out_features(), a.tokens, dgrad_.workspace_bytes(), d);
  auto* ws = static_cast<char*>(workspace);
  const std::int64_t in = in_features(), out = out_features();

  // wgrad (and the bias gradient) on the side stream where d.fork, forked here; there a
  // recomputed mixed is the side stream's first kernel (it reads x, the logits and the stats,
  // which this stream does not write), and a float32 weight's cast runs on this stream beside it.
  cudaStream_t wstream = stream;
  if (d.fork) {
    QBL_CUDA_TRY(side->fork(stream));
    wstream = side->stream();
  }
  // Joins the side stream back into `stream` on every way out, a throw included: the caller's
  // later work (an allocator reusing grad_out or mixed, the end of a graph capture) must never
  // run ahead of wgrad. The normal way out checks the join; a throw's cannot be reported.
  struct Join {
    SideStream* side;
    cudaStream_t main;
    cudaError_t join() noexcept {
      SideStream* s = side;
      side = nullptr;
      return s != nullptr ? s->join(main) : cudaSuccess;
    }
    ~Join() { join(); }
  } join{d.fork ? side : nullptr, stream};

  G* const recomputed = d.recomputes() ? reinterpret_cast<G*>(ws + l.mixed) : nullptr;
  const G* const mixed = d.recomputes() ? recomputed : a.mixed;
  auto weight_and_bias = [&](cudaStream_t s, void* gemm_workspace) {
    const detail::NvtxRange wgrad_range("qbl wgrad + bias_grad");
    if (d.wgrad) {
      wgrad_.run(mixed, a.grad_out, a.grad_weight, nullptr, a.tokens, a.accumulate ? 1.0f : 0.0f,
                 gemm_workspace, s);
    }
    if (d.bias) {
      QBL_CUDA_TRY(detail::launch_bias_grad(a.grad_out, a.grad_bias, a.tokens, out, a.accumulate,
                                            ws + l.partials, sms_, s));
    }
  };
  if (d.mixed != MixedSource::recomputed_in_element_kernel) {
    if (d.mixed == MixedSource::recomputed_beside) {
      const detail::NvtxRange range("qbl recompute mixed");
      QBL_CUDA_TRY((detail::launch_quant_blend_backward<X, G, L, Act>(
          static_cast<const G*>(nullptr), a.x, a.logits, a.stats + 1, static_cast<X*>(nullptr),
          static_cast<L*>(nullptr), recomputed, a.tokens, in, a.quant_grad, element_blocks_,
          wstream)));
    }
    if (d.wgrad || d.bias) weight_and_bias(wstream, ws + (d.fork ? l.wgrad_ws : l.dgrad_ws));
  }
  if (d.dgrad || d.element_mixed) {
    const detail::NvtxRange dgrad_range("qbl dgrad + quant_blend_backward");
    // dgrad: g_mixed = grad_out · weight, formed where grad_x goes when the two are one type (the
    // element kernel then works in place), else in the workspace.
    G* g_mixed = nullptr;
    if (d.dgrad) {
      const G* weight = a.weight;
      if (d.cast_weight) {
        G* cast = reinterpret_cast<G*>(ws + l.weight);
        QBL_CUDA_TRY(detail::launch_cast(a.weight_fp32, cast, out * in, sms_, stream));
        weight = cast;
      }
      g_mixed = d.g_mixed_scratch ? reinterpret_cast<G*>(ws + l.g_mixed)
                                  : reinterpret_cast<G*>(static_cast<void*>(a.grad_x));
      dgrad_.run(weight, a.grad_out, g_mixed, nullptr, a.tokens, 0.0f, ws + l.dgrad_ws, stream);
    }
    QBL_CUDA_TRY((detail::launch_quant_blend_backward<X, G, L, Act>(
        g_mixed, a.x, a.logits, a.stats + 1, a.grad_x, a.grad_logits,
        d.element_mixed ? recomputed : nullptr, a.tokens, in, a.quant_grad, element_blocks_,
        stream)));
  }
  if (d.element_mixed) weight_and_bias(stream, ws + l.dgrad_ws);
  QBL_CUDA_TRY(join.join());
}

}  // namespace qbl

// The operators' CUDA kernels: check the arguments, find the cached layer, dispatch on its element
// types, run qbl's plan on the current stream.

#include "layer_registry.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace qbl_torch {
namespace {

/// A workspace of `bytes` from torch's caching allocator on the current stream: freed (for reuse
/// by this stream's later work) when the call returns.
Tensor workspace(std::size_t bytes, const Tensor& like) {
  return at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte));
}

/// A GEMM operand of dtype `g`, contiguous: `t` itself where it has that dtype, else its cast
/// (round to nearest even: autocast's cast of a float32 parameter), which lives for the call.
Tensor gemm_operand(const Tensor& t, ScalarType g) {
  return t.scalar_type() == g
             ? t.contiguous()
             : t.to(g, /*non_blocking=*/false, /*copy=*/false, c10::MemoryFormat::Contiguous);
}

/// The backward of call `c` (both GEMMs wanted, wgrad beside dgrad) whose weight is `weight_in`
/// cast to `gemm`: wgrad's half of the call on `side` (forked from `stream`), then the cast and
/// dgrad's half on `stream`, then `stream` joins `side` -- on every way out, a throw included.
/// The same kernels on the same streams as the plan's one call, so the same bits; the cast, a
/// pass over the weight, runs beside wgrad instead of delaying it.
void backward_beside_cast(const Layer& layer, BackwardCall c, const Tensor& weight_in,
                          ScalarType gemm, const Tensor& like, qbl::SideStream& side,
                          cudaStream_t stream) {
  BackwardCall w = c;  // grad_weight and grad_bias (and a recomputed mixed, where one is)
  w.grad_x = nullptr, w.grad_logits = nullptr, w.weight = nullptr;
  c.grad_weight = nullptr, c.grad_bias = nullptr, c.mixed = nullptr;
  const Tensor ws_w = workspace(layer.plans->backward_workspace_bytes(w), like);
  C10_CUDA_CHECK(side.fork(stream));
  struct Join {
    qbl::SideStream* side;
    cudaStream_t main;
    cudaError_t join() noexcept {
      qbl::SideStream* s = side;
      side = nullptr;
      return s != nullptr ? s->join(main) : cudaSuccess;
    }
    ~Join() { join(); }
  } join{&side, stream};
  translate([&] { layer.plans->backward(w, ws_w.mutable_data_ptr(), nullptr, side.stream()); });
  const Tensor weight = gemm_operand(weight_in, gemm);
  c.weight = weight.const_data_ptr();
  const Tensor ws = workspace(layer.plans->backward_workspace_bytes(c), like);
  translate([&] { layer.plans->backward(c, ws.mutable_data_ptr(), nullptr, stream); });
  C10_CUDA_CHECK(join.join());
}

// The forward, from x's own amax or (stats given) from stats[0]; with an activation, of act(x).
std::tuple<Tensor, Tensor, Tensor> forward_cuda(const Tensor& x_in, const Tensor& logits_in,
                                                const Tensor& weight_in,
                                                const std::optional<Tensor>& bias_in,
                                                const std::optional<Tensor>& stats_in,
                                                c10::string_view activation, bool keep_mixed,
                                                bool straight_through, bool allow_tf32,
                                                std::optional<ScalarType> gemm_dtype) {
  constexpr const char* op = "qbl.forward";
  (void)keep_mixed, (void)straight_through;  // the forward is the same; autograd reads them
  const qbl::Activation act = parse_activation(op, activation);
  const ForwardProblem f =
      check_forward(op, x_in, logits_in, weight_in, bias_in, stats_in, gemm_dtype);
  const Problem& p = f.p;
  const Dtypes& dtypes = f.dtypes;
  const bool from_stats = f.from_stats, has_bias = f.has_bias;
  const auto g_opts = x_in.options().dtype(dtypes.gemm);
  Tensor out = at::empty(p.out_sizes(), g_opts);
  Tensor mixed = at::empty(x_in.sizes(), g_opts);
  Tensor stats = from_stats ? stats_in->clone() : at::empty({2}, x_in.options().dtype(at::kFloat));
  if (p.tokens == 0) return {out, mixed, from_stats ? stats : stats.zero_()};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const Tensor x = x_in.contiguous(), logits = logits_in.contiguous();
  const Tensor weight = gemm_operand(weight_in, dtypes.gemm);
  const Tensor bias = has_bias ? gemm_operand(*bias_in, dtypes.gemm) : Tensor();
  const LayerKey key{x.get_device(), dtypes,         act,
                     p.in_features,  p.out_features, allow_tf32 && dtypes.gemm == at::kFloat};
  // A forward recording autograd will be followed by a backward: plan both now, at one wait.
  const bool training = recorded_by_autograd() || records(x_in, logits_in, weight_in, bias_in);
  const Layer& layer = cached_layer(key, p.tokens, training, stream);
  ForwardCall c;
  c.x = x.const_data_ptr(), c.logits = logits.const_data_ptr(), c.weight = weight.const_data_ptr();
  c.bias = has_bias ? bias.const_data_ptr() : nullptr;
  c.out = out.mutable_data_ptr(), c.mixed = mixed.mutable_data_ptr();
  c.stats = stats.mutable_data_ptr<float>();
  c.tokens = p.tokens;
  c.amax_source = from_stats ? qbl::AmaxSource::stats : qbl::AmaxSource::x;
  const Tensor ws = workspace(layer.plans->forward_workspace_bytes(), x);
  translate([&] { layer.plans->forward(c, ws.mutable_data_ptr(), stream); });
  return {out, mixed, stats};
}

// [max |act(x)| of this shard, 0] in float32: the first step of a sharded forward. stats[0]'s
// bits, read as int32, order like the values (its sign bit is clear), NaN above +Inf: an integer
// MAX all-reduce of them is the NaN-propagating max over the shards.
Tensor local_amax_cuda(const Tensor& x_in, c10::string_view activation) {
  constexpr const char* op = "qbl.local_amax";
  const qbl::Activation act = parse_activation(op, activation);
  check_local_amax(op, x_in);
  Tensor stats;
  dispatch_x_type(x_in.scalar_type(), [&](auto x_type) {
    using X = typename decltype(x_type)::type;
    const c10::cuda::CUDAGuard guard(x_in.device());
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    stats = at::empty({2}, x_in.options().dtype(at::kFloat));
    const Tensor x = x_in.contiguous();
    float* d_stats = stats.mutable_data_ptr<float>();
    C10_CUDA_CHECK(cudaMemsetAsync(d_stats + 1, 0, sizeof(float), stream));
    qbl::for_each_type(qbl::Activations{}, [&](auto a) {
      using Act = decltype(a);
      if (Act::kind == act)
        C10_CUDA_CHECK((qbl::amax<X, Act>(const_data<X>(x), x.numel(), d_stats, stream)));
    });
  });
  return stats;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> backward_cuda(
    const Tensor& grad_out_in, const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const std::optional<Tensor>& mixed_in, const Tensor& stats, bool has_bias,
    std::array<bool, 4> mask, c10::string_view activation, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype) {
  constexpr const char* op = "qbl.backward";
  const qbl::Activation act = parse_activation(op, activation);
  const BackwardProblem bp = check_backward(op, grad_out_in, x_in, logits_in, weight_in, mixed_in,
                                            stats, has_bias, mask, gemm_dtype);
  const Problem& p = bp.p;
  const Dtypes& dtypes = bp.dtypes;
  const ScalarType w_dtype = bp.weight;
  const bool kept = bp.kept, want_bias = bp.want_bias;
  const auto x_opts = x_in.options();
  const auto g_opts = x_opts.dtype(dtypes.gemm), l_opts = x_opts.dtype(dtypes.logits);
  const auto w_opts = x_opts.dtype(w_dtype);
  // The parameter gradients come back in the weight's dtype; the GEMM and the column sum write
  // them in the GEMM's, cast at the end where the two differ. With no token they are sums of
  // nothing: zeros.
  auto param = [&](bool want, c10::IntArrayRef sizes) {
    if (!want) return no_output(w_opts);
    return p.tokens == 0 ? at::zeros(sizes, w_opts) : at::empty(sizes, g_opts);
  };
  Tensor gx = mask[0] ? at::empty(x_in.sizes(), x_opts) : no_output(x_opts);
  Tensor gl = mask[1] ? at::empty(logits_in.sizes(), l_opts) : no_output(l_opts);
  Tensor gw = param(mask[2], weight_in.sizes());
  Tensor gb = param(want_bias, {p.out_features});
  if (p.tokens == 0 || !(mask[0] || mask[1] || mask[2] || want_bias)) return {gx, gl, gw, gb};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // What each wanted output reads (qbl::BackwardArgs): weight for grad_x and grad_logits; logits
  // and stats for those and a recomputed mixed; x for grad_logits, a recomputed mixed and an
  // activation's grad_x; mixed for grad_weight.
  const bool dgrad = mask[0] || mask[1];
  const bool wgrad = mask[2] || want_bias;
  const bool recompute = mask[2] && !kept;
  const bool need_x = mask[1] || recompute || (mask[0] && act != qbl::Activation::identity);
  const Tensor grad_out = grad_out_in.contiguous();
  const Tensor x = need_x ? x_in.contiguous() : Tensor();
  const Tensor logits = dgrad || recompute ? logits_in.contiguous() : Tensor();
  // A float32 weight with a 16-bit GEMM (autocast's parameter) is cast for dgrad below.
  const bool cast_weight = dgrad && w_dtype != dtypes.gemm;
  Tensor weight = dgrad && !cast_weight ? weight_in.contiguous() : Tensor();
  const Tensor mixed = mask[2] && kept ? mixed_in->contiguous() : Tensor();
  const int device = x_in.get_device();
  const LayerKey key{device,        dtypes,         act,
                     p.in_features, p.out_features, allow_tf32 && dtypes.gemm == at::kFloat};
  const Layer& layer = cached_layer(key, p.tokens, true, stream);
  BackwardCall c;
  c.grad_out = grad_out.const_data_ptr();
  c.x = x.defined() ? x.const_data_ptr() : nullptr;
  c.logits = logits.defined() ? logits.const_data_ptr() : nullptr;
  c.weight = weight.defined() ? weight.const_data_ptr() : nullptr;
  c.mixed = mixed.defined() ? mixed.const_data_ptr() : nullptr;
  c.stats = dgrad || recompute ? stats.const_data_ptr<float>() : nullptr;
  c.tokens = p.tokens;
  c.grad_x = mask[0] ? gx.mutable_data_ptr() : nullptr;
  c.grad_logits = mask[1] ? gl.mutable_data_ptr() : nullptr;
  c.grad_weight = mask[2] ? gw.mutable_data_ptr() : nullptr;
  c.grad_bias = want_bias ? gb.mutable_data_ptr() : nullptr;
  c.quant_grad = straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
  // wgrad beside dgrad on this stream's own side stream, where the plan puts it there (with a
  // recomputed mixed, the side stream recomputes it first).
  qbl::SideStream* side =
      dgrad && wgrad && layer.plans->overlaps(p.tokens) ? side_stream(device, stream) : nullptr;
  if (cast_weight && side != nullptr) {
    // The weight's cast beside wgrad rather than ahead of both: the plan's two halves as its one
    // call would run them -- wgrad (after a recompute of mixed, with grad_bias) on the side
    // stream, dgrad and the element kernel on this one -- with the cast on this stream between.
    backward_beside_cast(layer, c, weight_in, dtypes.gemm, grad_out, *side, stream);
  } else {
    if (cast_weight) {
      weight = gemm_operand(weight_in, dtypes.gemm);
      c.weight = weight.const_data_ptr();
    }
    const Tensor ws = workspace(layer.plans->backward_workspace_bytes(c), grad_out);
    translate([&] { layer.plans->backward(c, ws.mutable_data_ptr(), side, stream); });
  }
  if (w_dtype != dtypes.gemm) {
    if (mask[2]) gw = gw.to(w_dtype);
    if (want_bias) gb = gb.to(w_dtype);
  }
  return {gx, gl, gw, gb};
}

}  // namespace
}  // namespace qbl_torch

TORCH_LIBRARY_IMPL(qbl, CUDA, m) {
  m.impl("forward", &qbl_torch::forward_cuda);
  m.impl("backward", &qbl_torch::backward_cuda);
  m.impl("local_amax", &qbl_torch::local_amax_cuda);
}

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

/// A parameter of a layer whose GEMM is of dtype `g`: contiguous, and either of dtype g (`typed`)
/// or float32 with a 16-bit g (`fp32`: autocast's parameter, which the plan casts in its
/// workspace). Both tensors live for the call.
struct Parameter {
  Tensor typed, fp32;
  Parameter() = default;  // not read
  Parameter(const Tensor& t, ScalarType g) {
    (t.scalar_type() == g ? typed : fp32) = t.contiguous();
  }
  template <typename G>
  const G* typed_ptr() const {
    return const_data<G>(typed);
  }
  const float* fp32_ptr() const { return const_data<float>(fp32); }
};

// The forward, from x's own amax or (stats given) from stats[0]; with an activation, of act(x).
std::tuple<Tensor, Tensor, Tensor> forward_cuda(
    const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const std::optional<Tensor>& bias_in, const std::optional<Tensor>& stats_in,
    c10::string_view activation, bool keep_mixed, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype, bool plan_backward) {
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
  const Parameter weight(weight_in, dtypes.gemm);
  const Parameter bias = has_bias ? Parameter(*bias_in, dtypes.gemm) : Parameter();
  const LayerKey key{x.get_device(), dtypes,         act,
                     p.in_features,  p.out_features, allow_tf32 && dtypes.gemm == at::kFloat};
  // A backward will follow (autograd records this call, or the caller says so): plan both now, at
  // one wait.
  const Layer& layer = cached_layer(key, p.tokens, plan_backward, stream);
  dispatch_layer_types(dtypes, [&](auto t) {
    using X = typename decltype(t)::x_type;
    using G = typename decltype(t)::gemm_type;
    using L = typename decltype(t)::logits_type;
    qbl::ForwardArgs<X, G, L> a;
    a.x = const_data<X>(x), a.logits = const_data<L>(logits);
    a.weight = weight.typed_ptr<G>(), a.weight_fp32 = weight.fp32_ptr();
    a.bias = bias.typed_ptr<G>(), a.bias_fp32 = bias.fp32_ptr();
    a.out = mutable_data<G>(out), a.mixed = mutable_data<G>(mixed);
    a.stats = mutable_data<float>(stats), a.tokens = p.tokens;
    a.amax_source = from_stats ? qbl::AmaxSource::stats : qbl::AmaxSource::x;
    const Tensor ws = workspace(layer.plans->forward_workspace_bytes(a), x);
    translate([&] { layer.plans->forward(a, ws.mutable_data_ptr(), stream); });
  });
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

/// The backward's gradient outputs for `mask`: undefined where not wanted; the parameter
/// gradients in the GEMM's dtype (cast to the weight's at the end where the two differ), zeros
/// with no token (sums of nothing).
std::array<Tensor, 4> backward_outputs(const BackwardProblem& bp, const Tensor& x_in,
                                       const Tensor& logits_in, const Tensor& weight_in,
                                       std::array<bool, 4> mask) {
  const auto x_opts = x_in.options();
  const auto g_opts = x_opts.dtype(bp.dtypes.gemm), w_opts = x_opts.dtype(bp.weight);
  auto param = [&](bool want, c10::IntArrayRef sizes) {
    if (!want) return no_output(w_opts);
    return bp.p.tokens == 0 ? at::zeros(sizes, w_opts) : at::empty(sizes, g_opts);
  };
  return {mask[0] ? at::empty(x_in.sizes(), x_opts) : no_output(x_opts),
          mask[1] ? at::empty(logits_in.sizes(), x_opts.dtype(bp.dtypes.logits))
                  : no_output(x_opts.dtype(bp.dtypes.logits)),
          param(mask[2], weight_in.sizes()), param(bp.want_bias, {bp.p.out_features})};
}

/// The backward of layer `layer` with element types <X, G, L> on `stream`: the outputs and
/// whether mixed is given decide what the call reads (the plan's description), and only those
/// inputs are made contiguous and passed.
template <typename X, typename G, typename L>
void run_backward(const Layer& layer, const BackwardProblem& bp, const Tensor& grad_out_in,
                  const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
                  const std::optional<Tensor>& mixed_in, const Tensor& stats,
                  const std::array<Tensor, 4>& grads, std::array<bool, 4> mask,
                  bool straight_through, int device, cudaStream_t stream) {
  qbl::BackwardArgs<X, G, L> a;
  a.tokens = bp.p.tokens;
  a.grad_x = mask[0] ? mutable_data<X>(grads[0]) : nullptr;
  a.grad_logits = mask[1] ? mutable_data<L>(grads[1]) : nullptr;
  a.grad_weight = mask[2] ? mutable_data<G>(grads[2]) : nullptr;
  a.grad_bias = bp.want_bias ? mutable_data<G>(grads[3]) : nullptr;
  a.mixed = bp.kept ? const_data<G>(*mixed_in) : nullptr;
  a.quant_grad = straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
  const qbl::BackwardDescription d = layer.plans->describe(a, true);
  qbl::SideStream* side = d.beside ? side_stream(device, stream) : nullptr;
  const Tensor grad_out = grad_out_in.contiguous();
  const Tensor x = d.reads_x ? x_in.contiguous() : Tensor();
  const Tensor logits = d.reads_gate ? logits_in.contiguous() : Tensor();
  const Parameter weight = d.reads_weight ? Parameter(weight_in, bp.dtypes.gemm) : Parameter();
  const Tensor mixed = d.reads_mixed ? mixed_in->contiguous() : Tensor();
  a.grad_out = const_data<G>(grad_out), a.x = const_data<X>(x), a.logits = const_data<L>(logits);
  a.weight = weight.typed_ptr<G>(), a.weight_fp32 = weight.fp32_ptr();
  a.mixed = const_data<G>(mixed);
  a.stats = d.reads_gate ? const_data<float>(stats) : nullptr;
  const Tensor ws = workspace(layer.plans->backward_workspace_bytes(a), grad_out);
  translate([&] { layer.plans->backward(a, ws.mutable_data_ptr(), side, stream); });
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
  std::array<Tensor, 4> grads = backward_outputs(bp, x_in, logits_in, weight_in, mask);
  auto& [gx, gl, gw, gb] = grads;
  if (bp.p.tokens == 0 || !(mask[0] || mask[1] || mask[2] || bp.want_bias)) return {gx, gl, gw, gb};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const int device = x_in.get_device();
  const LayerKey key{
      device,           bp.dtypes,         act,
      bp.p.in_features, bp.p.out_features, allow_tf32 && bp.dtypes.gemm == at::kFloat};
  const Layer& layer = cached_layer(key, bp.p.tokens, true, stream);
  dispatch_layer_types(bp.dtypes, [&](auto t) {
    using T = decltype(t);
    run_backward<typename T::x_type, typename T::gemm_type, typename T::logits_type>(
        layer, bp, grad_out_in, x_in, logits_in, weight_in, mixed_in, stats, grads, mask,
        straight_through, device, stream);
  });
  if (bp.weight != bp.dtypes.gemm) {
    if (mask[2]) gw = gw.to(bp.weight);
    if (bp.want_bias) gb = gb.to(bp.weight);
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

// The operators' CUDA kernels: check the arguments, find the cached layer, dispatch on its element
// types, run qbl's plan on the current stream. The CPU key reaches the same kernels, whose first
// check says that x must be a CUDA tensor (rather than the dispatcher's "no kernel for CPU").

#include "layer_registry.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

namespace qbl_torch {
namespace {

/// A workspace of `bytes` from torch's caching allocator on the current stream: freed (for reuse
/// by this stream's later work) when the call returns.
Tensor workspace(std::size_t bytes, const Tensor& like) {
  return at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// The forward, from x's own amax or (stats given) from stats[0].
std::tuple<Tensor, Tensor, Tensor> forward_cuda(const Tensor& x_in, const Tensor& logits_in,
                                                const Tensor& weight_in,
                                                const std::optional<Tensor>& bias_in,
                                                const std::optional<Tensor>& stats_in,
                                                bool straight_through, bool allow_tf32,
                                                std::optional<ScalarType> gemm_dtype) {
  constexpr const char* op = "qbl.forward";
  (void)straight_through;  // the forward is the same; autograd reads it
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  const Dtypes dtypes = forward_dtypes(op, x_in, logits_in, weight_in, bias_in, gemm_dtype);
  const bool from_stats = given(stats_in);
  if (from_stats) check_stats(op, *stats_in, x_in, "local_amax()");
  const bool has_bias = given(bias_in);
  if (has_bias) check_bias(op, *bias_in, x_in, p.out_features);
  std::vector<std::int64_t> out_sizes = p.lead;
  out_sizes.push_back(p.out_features);
  const auto g_opts = x_in.options().dtype(dtypes.gemm);
  Tensor out = at::empty(out_sizes, g_opts);
  Tensor mixed = at::empty(x_in.sizes(), g_opts);
  Tensor stats = from_stats ? stats_in->clone() : at::empty({2}, x_in.options().dtype(at::kFloat));
  if (p.tokens == 0) return {out, mixed, from_stats ? stats : stats.zero_()};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const Tensor x = x_in.contiguous(), logits = logits_in.contiguous(),
               weight = weight_in.contiguous();
  const Tensor bias = has_bias ? bias_in->contiguous() : Tensor();
  const LayerKey key{x.get_device(), dtypes, p.in_features, p.out_features,
                     allow_tf32 && dtypes.gemm == at::kFloat};
  // A forward recording autograd will be followed by a backward: plan both now, at one wait.
  const bool training = recorded_by_autograd() || records(x_in, logits_in, weight_in, bias_in);
  Layer& layer = cached_layer(key, p.tokens, training, stream);
  translate([&] {
    std::visit(
        [&](const auto& plans) {
          using Plan = std::decay_t<decltype(plans.forward)>;
          using X = typename Plan::x_type;
          using G = typename Plan::gemm_type;
          using L = typename Plan::logits_type;
          typename Plan::Arguments a;
          a.x = const_data<X>(x), a.logits = const_data<L>(logits);
          a.weight = const_data<G>(weight), a.bias = const_data<G>(bias);
          a.out = mutable_data<G>(out), a.mixed = mutable_data<G>(mixed);
          a.stats = stats.mutable_data_ptr<float>();
          a.tokens = p.tokens;
          a.amax_source = from_stats ? qbl::AmaxSource::stats : qbl::AmaxSource::x;
          const Tensor ws = workspace(plans.forward.workspace_bytes(), x);
          plans.forward.run(a, ws.mutable_data_ptr(), stream);
        },
        layer.plans);
  });
  return {out, mixed, stats};
}

// [max |x| of this shard, 0] in float32: the first step of a sharded forward. stats[0]'s bits,
// read as int32, order like the values (its sign bit is clear), NaN above +Inf: an integer MAX
// all-reduce of them is the NaN-propagating max over the shards.
Tensor local_amax_cuda(const Tensor& x_in) {
  constexpr const char* op = "qbl.local_amax";
  TORCH_CHECK(x_in.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x_in.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x_in.device().str());
  Tensor stats;
  const bool supported_x = dispatch_x_type(x_in.scalar_type(), [&](auto x_type) {
    using X = decltype(x_type);
    const c10::cuda::CUDAGuard guard(x_in.device());
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    stats = at::empty({2}, x_in.options().dtype(at::kFloat));
    const Tensor x = x_in.contiguous();
    float* d_stats = stats.mutable_data_ptr<float>();
    C10_CUDA_CHECK(cudaMemsetAsync(d_stats + 1, 0, sizeof(float), stream));
    C10_CUDA_CHECK(qbl::amax(const_data<X>(x), x.numel(), d_stats, stream));
  });
  TORCH_CHECK_TYPE(supported_x, op, ": unsupported dtype ", c10::toString(x_in.scalar_type()),
                   "; supported: ", supported_x_dtypes());
  return stats;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> backward_cuda(
    const Tensor& grad_out_in, const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const Tensor& mixed_in, const Tensor& stats, bool has_bias, std::array<bool, 4> mask,
    bool straight_through, bool allow_tf32) {
  constexpr const char* op = "qbl.backward";
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  const Dtypes dtypes{x_in.scalar_type(), weight_in.scalar_type(), logits_in.scalar_type()};
  check_supported(op, dtypes);
  check_dense(op, grad_out_in, "grad_out", x_in);
  check_dense(op, mixed_in, "mixed", x_in);
  check_dtype(op, grad_out_in, "grad_out", dtypes.gemm, "weight");
  check_dtype(op, mixed_in, "mixed", dtypes.gemm, "weight");
  std::vector<std::int64_t> out_sizes = p.lead;
  out_sizes.push_back(p.out_features);
  TORCH_CHECK(grad_out_in.sizes() == c10::IntArrayRef(out_sizes), op, ": grad_out must have shape ",
              shape_str(out_sizes), ", got ", shape_str(grad_out_in.sizes()));
  TORCH_CHECK(mixed_in.sizes() == x_in.sizes(), op, ": mixed must have x's shape ",
              shape_str(x_in.sizes()), ", got ", shape_str(mixed_in.sizes()));
  check_stats(op, stats, x_in, "the forward");
  const bool want_bias = mask[3] && has_bias;
  const auto x_opts = x_in.options();
  const auto g_opts = x_opts.dtype(dtypes.gemm), l_opts = x_opts.dtype(dtypes.logits);
  auto none = [&](const at::TensorOptions& o) { return at::empty({0}, o); };
  // With no token the parameter gradients are sums of nothing: zeros.
  auto param = [&](bool want, c10::IntArrayRef sizes) {
    if (!want) return none(g_opts);
    return p.tokens == 0 ? at::zeros(sizes, g_opts) : at::empty(sizes, g_opts);
  };
  Tensor gx = mask[0] ? at::empty(x_in.sizes(), x_opts) : none(x_opts);
  Tensor gl = mask[1] ? at::empty(logits_in.sizes(), l_opts) : none(l_opts);
  Tensor gw = param(mask[2], weight_in.sizes());
  Tensor gb = param(want_bias, {p.out_features});
  if (p.tokens == 0 || !(mask[0] || mask[1] || mask[2] || want_bias)) return {gx, gl, gw, gb};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // x is read only for grad_logits, mixed only for grad_weight, weight, logits and stats only for
  // grad_x and grad_logits.
  const bool dgrad = mask[0] || mask[1];
  const bool wgrad = mask[2] || want_bias;
  const Tensor grad_out = grad_out_in.contiguous();
  const Tensor x = mask[1] ? x_in.contiguous() : Tensor();
  const Tensor logits = dgrad ? logits_in.contiguous() : Tensor();
  const Tensor weight = dgrad ? weight_in.contiguous() : Tensor();
  const Tensor mixed = mask[2] ? mixed_in.contiguous() : Tensor();
  const int device = x_in.get_device();
  const LayerKey key{device, dtypes, p.in_features, p.out_features,
                     allow_tf32 && dtypes.gemm == at::kFloat};
  Layer& layer = cached_layer(key, p.tokens, true, stream);
  translate([&] {
    std::visit(
        [&](const auto& plans) {
          using Plan = typename std::decay_t<decltype(plans.backward)>::element_type;
          using X = typename Plan::x_type;
          using G = typename Plan::gemm_type;
          using L = typename Plan::logits_type;
          typename Plan::Arguments a;
          a.grad_out = const_data<G>(grad_out), a.x = const_data<X>(x);
          a.logits = const_data<L>(logits), a.weight = const_data<G>(weight);
          a.mixed = const_data<G>(mixed);
          a.stats = dgrad ? stats.const_data_ptr<float>() : nullptr;
          a.tokens = p.tokens;
          a.grad_x = mask[0] ? mutable_data<X>(gx) : nullptr;
          a.grad_logits = mask[1] ? mutable_data<L>(gl) : nullptr;
          a.grad_weight = mask[2] ? mutable_data<G>(gw) : nullptr;
          a.grad_bias = want_bias ? mutable_data<G>(gb) : nullptr;
          a.quant_grad = straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
          // wgrad beside dgrad on this stream's own side stream, where the plan puts it there.
          qbl::SideStream* side = dgrad && wgrad && plans.backward->overlaps(p.tokens)
                                      ? side_stream(device, stream)
                                      : nullptr;
          const Tensor ws = workspace(plans.backward->workspace_bytes(p.tokens), grad_out);
          plans.backward->run(a, ws.mutable_data_ptr(), side, stream);
        },
        layer.plans);
  });
  return {gx, gl, gw, gb};
}

}  // namespace
}  // namespace qbl_torch

TORCH_LIBRARY_IMPL(qbl, CUDA, m) {
  m.impl("forward", &qbl_torch::forward_cuda);
  m.impl("backward", &qbl_torch::backward_cuda);
  m.impl("local_amax", &qbl_torch::local_amax_cuda);
}

TORCH_LIBRARY_IMPL(qbl, CPU, m) {
  m.impl("forward", &qbl_torch::forward_cuda);
  m.impl("backward", &qbl_torch::backward_cuda);
  m.impl("local_amax", &qbl_torch::local_amax_cuda);
}

// The forward's kernels for the AutocastCPU and AutocastCUDA keys (xformers' swiglu_packedw.cpp is
// the model), one template for both devices: eager's autocast follows the same lists there.
//
// Under torch.autocast(device, dtype=A), eager computes the reference module as
//   alpha in the logits' dtype L; x_q and the blend in P = promote(X, L); F.linear casting mixed,
//   weight and bias to A (weight and bias through autocast's cast cache); out in A,
// the casts recorded by autograd (../reference/autocast.md, checked against eager in the tests).
// Where P is x's dtype and the logits are fp32 or A -- the combinations qbl computes -- the
// operator runs with gemm_dtype = A: the prologue writes `mixed` in A (eager's mixed.to(A),
// bit for bit), and weight and bias are cast to A as F.linear casts them: float32 parameters
// inside the operator (forward and again in the backward, so that autograd keeps the parameter,
// not a copy of it in A, between the two), any other dtype here. Their gradients come back in
// their own dtype, the casts of the gradients in A, as eager's autograd gives them (a weight
// used by several calls in one region has their gradients summed in float32 here, in A by eager,
// which casts it once through its cache). Any other combination runs the reference's own ops, so
// that it too is what eager computes.
// (torch.library.register_autocast would cast every input to A: not eager's semantics here.)

#include "../qbl_torch.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace qbl_torch {
namespace {

bool fused_under_autocast(ScalarType x, ScalarType logits, ScalarType a) {
  const ScalarType g = x == at::kFloat ? a : x;
  return (x == a || x == at::kFloat) && supported({x, g, logits});
}

/// The straight-through fake quantizer of ModelSTE: its forward, and the identity for backward.
class FakeQuantSTE : public torch::autograd::Function<FakeQuantSTE> {
 public:
  static Tensor forward(torch::autograd::AutogradContext*, const Tensor& x, const Tensor& scale) {
    return at::clamp(at::round(x / scale), -127, 127) * scale;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0], Tensor()};
  }
};

/// weight and bias cast to the autocast dtype `a` as F.linear casts them on `device` (autocast's
/// cast cache).
std::pair<Tensor, std::optional<Tensor>> cast_parameters(ScalarType a, const Tensor& weight,
                                                         const std::optional<Tensor>& bias,
                                                         c10::DeviceType device) {
  Tensor w = at::autocast::cached_cast(a, weight, device);
  if (!given(bias)) return {w, std::nullopt};
  return {w, at::autocast::cached_cast(a, *bias, device)};
}

/// The parameters as the fused operator takes them with gemm_dtype `a`: a float32 leaf weight
/// (a parameter, alive anyway) and its bias as they are (the operator casts them to `a`, and
/// autograd keeps the float32 weight for the backward instead of a cast copy), weight and bias
/// already of `a` as they are, anything else cast as F.linear casts it -- a computed float32
/// weight too, so that autograd keeps the copy in `a`, not the float32 intermediate.
/// Under tracing (torch.compile: a dispatch mode is set, or the weight is a fake or functional
/// tensor) a float32 weight goes in as it is, leaf or not: AOTAutograd traces even parameters
/// as non-leaves, and its partitioner, not autograd, chooses what the compiled graph keeps -- a
/// parameter for nothing, a computed weight saved or recomputed from its inputs.
std::pair<Tensor, std::optional<Tensor>> fused_parameters(ScalarType a, const Tensor& weight,
                                                          const std::optional<Tensor>& bias,
                                                          c10::DeviceType device) {
  const ScalarType w = weight.scalar_type();
  const bool traced = c10::impl::TorchDispatchModeTLS::any_modes_set() ||
                      weight.key_set().has(c10::DispatchKey::Python);
  const bool as_they_are = w == a || (w == at::kFloat && (weight.is_leaf() || traced));
  if (as_they_are && (!given(bias) || bias->scalar_type() == w)) return {weight, bias};
  return cast_parameters(a, weight, bias, device);
}

/// Eager's activation, then the reference module's forward op by op (autograd records every op):
/// the unfused path. A given stats gives the amax (stats[0], detached), as the fused operator
/// reads it.
std::tuple<Tensor, Tensor, Tensor> reference_under_autocast(
    const Tensor& h, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& stats, qbl::Activation act, bool straight_through, ScalarType a,
    c10::DeviceType device) {
  const Tensor x = eager_activation(h, act);
  const Tensor alpha = at::sigmoid(logits).unsqueeze(-1);
  const Tensor raw =
      given(stats) ? stats->detach().select(0, 0).to(x.scalar_type()) : x.detach().abs().max();
  const Tensor scale = raw.clamp_min(1e-8) / 127.0;
  const Tensor x_q = straight_through ? FakeQuantSTE::apply(x, scale)
                                      : at::clamp(at::round(x / scale), -127, 127) * scale;
  const Tensor mixed = alpha * x_q + (1.0 - alpha) * x;
  const auto [w, b] = cast_parameters(a, weight, bias, device);
  const Tensor out = at::linear(mixed.to(a), w, b);
  // [amax before the clamp, scale], as the fused path's stats.
  const Tensor stats_out = at::stack({raw.to(at::kFloat), scale.detach().to(at::kFloat)});
  return {out, mixed.detach(), stats_out};
}

template <c10::DeviceType Device, c10::DispatchKey Key>
std::tuple<Tensor, Tensor, Tensor> forward_autocast(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& stats, c10::string_view activation, bool keep_mixed,
    bool straight_through, bool allow_tf32, std::optional<ScalarType> gemm_dtype,
    bool plan_backward) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(Key);
  const ScalarType a = at::autocast::get_autocast_dtype(Device);
  if (gemm_dtype.has_value() || x.device().type() != Device ||
      !fused_under_autocast(x.scalar_type(), logits.scalar_type(), a)) {
    if (gemm_dtype.has_value() || !x.is_floating_point() || !logits.is_floating_point())
      // Explicit GEMM types (or nothing autocast would touch): as called.
      return forward_op().call(x, logits, weight, bias, stats, activation, keep_mixed,
                               straight_through, allow_tf32, gemm_dtype, plan_backward);
    return reference_under_autocast(x, logits, weight, bias, stats,
                                    parse_activation("qbl.forward", activation), straight_through,
                                    a, Device);
  }
  // The activation runs inside, in x's dtype, as eager's does under autocast.
  const auto [w, b] = fused_parameters(a, weight, bias, Device);
  const ScalarType g = x.scalar_type() == at::kFloat ? a : x.scalar_type();
  return forward_op().call(x, logits, w, b, stats, activation, keep_mixed, straight_through,
                           allow_tf32, g, plan_backward);
}

}  // namespace
}  // namespace qbl_torch

TORCH_LIBRARY_IMPL(qbl, AutocastCPU, m) {
  m.impl("forward",
         &qbl_torch::forward_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

TORCH_LIBRARY_IMPL(qbl, AutocastCUDA, m) {
  m.impl("forward",
         &qbl_torch::forward_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

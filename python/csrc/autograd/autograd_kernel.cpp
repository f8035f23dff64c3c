// The autograd formula, in C++ (a Python formula costs tens of microseconds per call), as
// torchvision's csrc/ops/autograd: a torch::autograd::Function whose backward calls the backward
// operator. The forward saves x (the activation's input, where there is one), logits, weight (as
// given: under autocast the float32 parameter, which the backward casts again, not a cast copy),
// the stats and -- only with keep_mixed and where grad_weight will read it -- mixed; without it
// the backward recomputes mixed from x and the stats. A given stats (the sharded forward's reduced
// amax) is detached, as the amax of the reference module; local_amax's result is not
// differentiable either.

#include "../qbl_torch.h"

#include <torch/autograd.h>
#include <torch/library.h>

namespace qbl_torch {
namespace {

/// Would autograd record a forward of these inputs (grad mode on and an input requiring grad)?
bool records(const Tensor& x, const Tensor& logits, const Tensor& weight,
             const std::optional<Tensor>& bias) {
  return at::GradMode::is_enabled() &&
         (x.requires_grad() || logits.requires_grad() || weight.requires_grad() ||
          (given(bias) && bias->requires_grad()));
}

class LayerFunction : public torch::autograd::Function<LayerFunction> {
 public:
  // bias and stats are optional: apply() makes an input of every defined tensor argument (an
  // undefined Tensor argument is an error there), and the backward's results follow the arguments.
  // recorded: autograd records this call (grad mode is off in here, so it is told, not asked); a
  // backward then follows, and the forward plans it.
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& logits,
      const Tensor& weight, const std::optional<Tensor>& bias, const std::optional<Tensor>& stats,
      const std::string& activation, bool keep_mixed, bool straight_through, bool allow_tf32,
      std::optional<ScalarType> gemm_dtype, bool plan_backward, bool recorded) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, mixed, stats_out] =
        forward_op().call(x, logits, weight, bias, stats, activation, keep_mixed, straight_through,
                          allow_tf32, gemm_dtype, plan_backward || recorded);
    // (needs_input_grad() is only valid where autograd records this call.)
    const bool need_mixed = keep_mixed && recorded && ctx->needs_input_grad(2);
    ctx->save_for_backward({x, logits, weight, need_mixed ? mixed : Tensor(), stats_out});
    ctx->saved_data["has_bias"] = given(bias);
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["straight_through"] = straight_through;
    ctx->saved_data["allow_tf32"] = allow_tf32;
    ctx->saved_data["gemm_dtype"] =
        gemm_dtype.has_value() ? static_cast<std::int64_t>(*gemm_dtype) : std::int64_t{-1};
    ctx->mark_non_differentiable({mixed, stats_out});
    // The gradients of mixed and stats are always undefined: not materialized as zeros (two
    // allocations and fills of mixed's size per backward otherwise).
    ctx->set_materialize_grads(false);
    return {out, mixed, stats_out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    // out's gradient undefined (out reached no loss): every input's gradient is zero, which
    // autograd writes as undefined.
    if (!grads[0].defined()) return torch::autograd::variable_list(12);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 4> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      ctx->needs_input_grad(2),
                                      has_bias && ctx->needs_input_grad(3)};
    // (Edges exist for defined inputs only: edge 3 is bias's where there is a bias.)
    // Not saved (keep_mixed false, or grad_weight not wanted): None, recomputed where needed.
    const std::optional<Tensor> mixed =
        saved[3].defined() ? std::optional<Tensor>(saved[3]) : std::nullopt;
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const std::int64_t g = ctx->saved_data["gemm_dtype"].toInt();
    const std::optional<ScalarType> gemm_dtype =
        g < 0 ? std::nullopt : std::optional<ScalarType>(static_cast<ScalarType>(g));
    auto [gx, gl, gw, gb] =
        backward_op().call(grads[0], x, saved[1], saved[2], mixed, saved[4], has_bias, mask,
                           activation, ctx->saved_data["straight_through"].toBool(),
                           ctx->saved_data["allow_tf32"].toBool(), gemm_dtype);
    torch::autograd::variable_list result(12);
    result[0] = mask[0] ? gx : Tensor();
    result[1] = mask[1] ? gl : Tensor();
    result[2] = mask[2] ? gw : Tensor();
    result[3] = mask[3] ? gb : Tensor();
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_autograd(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& stats, c10::string_view activation, bool keep_mixed,
    bool straight_through, bool allow_tf32, std::optional<ScalarType> gemm_dtype,
    bool plan_backward) {
  const std::optional<Tensor> b = given(bias) ? bias : std::nullopt;
  const std::optional<Tensor> s =
      given(stats) ? std::optional<Tensor>(stats->detach()) : std::nullopt;
  auto r = LayerFunction::apply(x, logits, weight, b, s, std::string(activation), keep_mixed,
                                straight_through, allow_tf32, gemm_dtype, plan_backward,
                                records(x, logits, weight, b));
  return {r[0], r[1], r[2]};
}

/// local_amax's autograd kernel: its result is non-differentiable, as the reference module's
/// detached amax (no graph is recorded, and the result does not require grad).
Tensor local_amax_autograd(const Tensor& x, c10::string_view activation) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qbl::local_amax", "")
                             .typed<Tensor(const Tensor&, c10::string_view)>();
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, activation);
}

}  // namespace

}  // namespace qbl_torch

TORCH_LIBRARY_IMPL(qbl, Autograd, m) {
  m.impl("forward", &qbl_torch::forward_autograd);
  m.impl("local_amax", &qbl_torch::local_amax_autograd);
}

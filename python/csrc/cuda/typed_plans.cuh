// make_plans<Act>'s definition: the plans of one activation for every element type of
// qbl::SupportedTypes. Included by plans_<activation>.cu only, each of which instantiates it for
// its activation -- so each file compiles one activation's kernels.
#pragma once

#include "layer_registry.h"

#include <memory>
#include <type_traits>

namespace qbl_torch {

template <typename T, typename Act>
class PlansOf final : public LayerPlans {
  using X = typename T::x_type;
  using G = typename T::gemm_type;
  using L = typename T::logits_type;
  using Forward = qbl::ForwardPlan<X, G, L, Act>;
  using Backward = qbl::BackwardPlan<X, G, L, Act>;

 public:
  PlansOf(std::int64_t in_features, std::int64_t out_features, std::int64_t capacity, bool backward,
          const qbl::Options& options)
      : forward_(in_features, out_features, capacity, options) {
    if (backward)
      backward_ =
          std::make_unique<Backward>(in_features, out_features, forward_.max_tokens(), options);
  }

  bool has_backward() const override { return backward_ != nullptr; }

  std::size_t forward_workspace_bytes(const ForwardCall& call) const override {
    return forward_.workspace_bytes(typed(call));
  }

  std::size_t backward_workspace_bytes(const BackwardCall& call) const override {
    return backward_ == nullptr ? 0 : backward_->workspace_bytes(typed(call));
  }

  std::size_t max_backward_workspace_bytes() const override {
    return backward_ == nullptr ? 0 : backward_->workspace_bytes();
  }

  qbl::BackwardDescription describe(const BackwardCall& call, bool side) const override {
    return backward_ == nullptr ? qbl::BackwardDescription{}
                                : backward_->describe(typed(call), side);
  }

  void forward(const ForwardCall& c, void* workspace, cudaStream_t stream) const override {
    forward_.run(typed(c), workspace, stream);
  }

  void backward(const BackwardCall& c, void* workspace, qbl::SideStream* side,
                cudaStream_t stream) const override {
    TORCH_INTERNAL_ASSERT(backward_ != nullptr, "qbl: a backward of a layer planned without one");
    backward_->run(typed(c), workspace, side, stream);
  }

 private:
  static typename Forward::ForwardArgs typed(const ForwardCall& c) {
    typename Forward::ForwardArgs a;
    a.x = static_cast<const X*>(c.x), a.logits = static_cast<const L*>(c.logits);
    a.weight = static_cast<const G*>(c.weight), a.bias = static_cast<const G*>(c.bias);
    a.weight_fp32 = c.weight_fp32, a.bias_fp32 = c.bias_fp32;
    a.out = static_cast<G*>(c.out), a.mixed = static_cast<G*>(c.mixed), a.stats = c.stats;
    a.tokens = c.tokens, a.amax_source = c.amax_source;
    return a;
  }

  static typename Backward::BackwardArgs typed(const BackwardCall& c) {
    typename Backward::BackwardArgs a;
    a.grad_out = static_cast<const G*>(c.grad_out), a.x = static_cast<const X*>(c.x);
    a.logits = static_cast<const L*>(c.logits), a.weight = static_cast<const G*>(c.weight);
    a.weight_fp32 = c.weight_fp32;
    a.mixed = static_cast<const G*>(c.mixed), a.stats = c.stats, a.tokens = c.tokens;
    a.grad_x = static_cast<X*>(c.grad_x), a.grad_logits = static_cast<L*>(c.grad_logits);
    a.grad_weight = static_cast<G*>(c.grad_weight), a.grad_bias = static_cast<G*>(c.grad_bias);
    a.quant_grad = c.quant_grad;
    return a;
  }

  const Forward forward_;
  std::unique_ptr<const Backward> backward_;  // set by the constructor only
};

template <typename Act>
std::unique_ptr<LayerPlans> make_plans(const Dtypes& dtypes, std::int64_t in_features,
                                       std::int64_t out_features, std::int64_t capacity,
                                       bool backward, const qbl::Options& options) {
  std::unique_ptr<LayerPlans> made;
  dispatch_layer_types(dtypes, [&](auto t) {
    made = std::make_unique<PlansOf<decltype(t), Act>>(in_features, out_features, capacity,
                                                       backward, options);
  });
  return made;
}

}  // namespace qbl_torch

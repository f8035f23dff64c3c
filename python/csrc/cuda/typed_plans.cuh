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
  using ForwardArgs = qbl::ForwardArgs<X, G, L>;
  using BackwardArgs = qbl::BackwardArgs<X, G, L>;

 public:
  PlansOf(std::int64_t in_features, std::int64_t out_features, std::int64_t capacity, bool backward,
          const qbl::Options& options)
      : forward_(in_features, out_features, capacity, options) {
    if (backward)
      backward_ =
          std::make_unique<Backward>(in_features, out_features, forward_.max_tokens(), options);
  }

  bool has_backward() const override { return backward_ != nullptr; }

  std::size_t forward_workspace_bytes() const override { return forward_.workspace_bytes(); }

  std::size_t forward_workspace_bytes(const ForwardArgs& args) const override {
    return forward_.workspace_bytes(args);
  }

  std::size_t backward_workspace_bytes(const BackwardArgs& args) const override {
    return backward_ == nullptr ? 0 : backward_->workspace_bytes(args);
  }

  std::size_t max_backward_workspace_bytes() const override {
    return backward_ == nullptr ? 0 : backward_->workspace_bytes();
  }

  qbl::BackwardDescription describe(const BackwardArgs& args, bool side) const override {
    return backward_ == nullptr ? qbl::BackwardDescription{} : backward_->describe(args, side);
  }

  void forward(const ForwardArgs& args, void* workspace, cudaStream_t stream) const override {
    forward_.run(args, workspace, stream);
  }

  void backward(const BackwardArgs& args, void* workspace, qbl::SideStream* side,
                cudaStream_t stream) const override {
    TORCH_INTERNAL_ASSERT(backward_ != nullptr, "qbl: a backward of a layer planned without one");
    backward_->run(args, workspace, side, stream);
  }

 private:
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

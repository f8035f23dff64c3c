// The layer cache: one cached layer per (device, dtypes, in_features, out_features, TF32), serving
// forward and backward, for a power-of-two token capacity; and one qbl::SideStream per (device,
// calling stream), where a backward runs wgrad beside dgrad. Plans hold no device memory and
// nothing mutable: every workspace, like every output, comes from torch's caching allocator on
// the current stream, per call -- so the same layer serves several streams and threads at once,
// and CUDA graphs capture its calls with torch's graph pools.
//
// Needs nvcc (qbl's plans): included by the files that plan or run them.
#pragma once

#include "qbl_torch.h"

#include <qbl/layer_plans.cuh>

#include <cstdint>
#include <memory>
#include <tuple>
#include <variant>

namespace qbl_torch {

/// What a cached layer is planned for.
struct LayerKey {
  int device;
  Dtypes dtypes;
  std::int64_t in_features, out_features;
  bool tf32;
  bool operator<(const LayerKey& o) const {
    auto tie = [](const LayerKey& k) {
      return std::make_tuple(k.device, k.dtypes.x, k.dtypes.gemm, k.dtypes.logits, k.in_features,
                             k.out_features, k.tf32);
    };
    return tie(*this) < tie(o);
  }
};

/// One shape's plans for the element types T (a qbl::LayerTypes): the forward, and the backward
/// once a backward is on its way.
template <typename T>
struct Plans {
  using Forward =
      qbl::ForwardPlan<typename T::x_type, typename T::gemm_type, typename T::logits_type>;
  using Backward =
      qbl::BackwardPlan<typename T::x_type, typename T::gemm_type, typename T::logits_type>;
  Forward forward;
  std::unique_ptr<Backward> backward;
};

template <typename List>
struct AnyPlansOf;
template <typename... T>
struct AnyPlansOf<qbl::TypeList<T...>> {
  using type = std::variant<Plans<T>...>;
};
/// The plans of one layer, of any element types in qbl::SupportedTypes.
using AnyPlans = typename AnyPlansOf<qbl::SupportedTypes>::type;

struct Layer {
  LayerKey key;
  std::int64_t capacity;  // the most tokens a call may have
  AnyPlans plans;
};

/// The layer for `key` with room for `tokens`, planned on first use (on the current device, which
/// is key.device), with a backward plan too when `backward`. Planning waits for `stream` once and
/// cannot happen while `stream` is being captured into a CUDA graph: that raises RuntimeError.
/// The layer stays valid until clear_cache().
Layer& cached_layer(const LayerKey& key, std::int64_t tokens, bool backward, cudaStream_t stream);

/// The side stream of calling stream `stream` on the current device `device`, made on first use;
/// nullptr (run wgrad after dgrad, the same bits) where none exists yet and `stream` is being
/// captured into a CUDA graph, as no CUDA object is made during capture. Two calling streams never
/// share one. Valid until clear_cache().
qbl::SideStream* side_stream(int device, cudaStream_t stream);

}  // namespace qbl_torch

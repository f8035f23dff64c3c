// The layer cache: one cached layer per (device, dtypes, activation, in_features, out_features,
// TF32), serving forward and backward, for a power-of-two token capacity; and one
// qbl::SideStream per (device, calling stream), where a backward runs wgrad beside dgrad. Plans
// hold no device memory and nothing mutable: every workspace, like every output, comes from
// torch's caching allocator on the current stream, per call -- so the same layer serves several
// streams and threads at once, and CUDA graphs capture its calls with torch's graph pools.
//
// A layer's plans are behind LayerPlans, made by make_plans<Act>: each activation's plans (for
// every element type of qbl::SupportedTypes) are compiled in a file of their own (plans_*.cu),
// so that the kernels of the 5 activations x 7 type combinations build in parallel.
#pragma once

#include "../qbl_torch.h"

#include <qbl/error.hpp>
#include <qbl/layer_plans.cuh>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <tuple>

namespace qbl_torch {

// qbl's exceptions as torch's, so that Python sees ValueError, IndexError, torch.OutOfMemoryError
// or RuntimeError with qbl's message.
template <typename F>
decltype(auto) translate(F&& f) {
  try {
    return f();
  } catch (const qbl::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const qbl::out_of_range& e) {
    TORCH_CHECK_INDEX(false, e.what());
  } catch (const qbl::out_of_memory& e) {
    (void)cudaGetLastError();
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const qbl::cuda_error& e) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, e.what());
  } catch (const qbl::cublas_error& e) {
    TORCH_CHECK(false, e.what());
  } catch (const qbl::logic_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

/// What a cached layer is planned for.
struct LayerKey {
  int device;
  Dtypes dtypes;
  qbl::Activation activation;
  std::int64_t in_features, out_features;
  bool tf32;
  bool operator<(const LayerKey& o) const {
    auto tie = [](const LayerKey& k) {
      return std::make_tuple(k.device, k.dtypes.x, k.dtypes.gemm, k.dtypes.logits, k.activation,
                             k.in_features, k.out_features, k.tf32);
    };
    return tie(*this) < tie(o);
  }
};

/// A layer's calls for element types T (a qbl::LayerTypes<X, G, L>), with the library's own
/// argument structs. Every layer answers them for its own types only: a call of other types is a
/// binding error (the layer cache keys layers by their dtypes).
template <typename T>
class CallsOf {
 public:
  using X = typename T::x_type;
  using G = typename T::gemm_type;
  using L = typename T::logits_type;
  using ForwardArgs = qbl::ForwardArgs<X, G, L>;
  using BackwardArgs = qbl::BackwardArgs<X, G, L>;
  virtual ~CallsOf() = default;
  virtual std::size_t forward_workspace_bytes(const ForwardArgs&) const { return other_types(); }
  /// What backward(args) needs (0 without a backward plan).
  virtual std::size_t backward_workspace_bytes(const BackwardArgs&) const { return other_types(); }
  /// What backward(args) does, with a side stream or not (qbl::BackwardPlan::describe).
  virtual qbl::BackwardDescription describe(const BackwardArgs&, bool) const {
    other_types();
    return {};
  }
  virtual void forward(const ForwardArgs&, void*, cudaStream_t) const { other_types(); }
  virtual void backward(const BackwardArgs&, void*, qbl::SideStream*, cudaStream_t) const {
    other_types();
  }

 private:
  static std::size_t other_types() {
    TORCH_INTERNAL_ASSERT(false, "qbl: a call of other element types than the layer's");
    return 0;
  }
};

/// The calls of every type triple of qbl::SupportedTypes, as overloads of one name each.
template <typename List>
class CallsOfEach;
template <typename... T>
class CallsOfEach<qbl::TypeList<T...>> : public CallsOf<T>... {
 public:
  using CallsOf<T>::forward_workspace_bytes...;
  using CallsOf<T>::backward_workspace_bytes...;
  using CallsOf<T>::describe...;
  using CallsOf<T>::forward...;
  using CallsOf<T>::backward...;
};

/// One layer's plans, of whatever element types and activation: the forward, and the backward
/// where it was planned with one. Immutable once made.
class LayerPlans : public CallsOfEach<qbl::SupportedTypes> {
 public:
  virtual bool has_backward() const = 0;
  /// What a forward with a weight of the GEMM's type needs.
  virtual std::size_t forward_workspace_bytes() const = 0;
  using CallsOfEach::forward_workspace_bytes;
  /// The most any backward needs, at the capacity (0 without a backward plan).
  virtual std::size_t max_backward_workspace_bytes() const = 0;
};

/// The plans of a layer with activation Act, of the element types `dtypes` (one of
/// qbl::SupportedTypes: checked before), for up to `capacity` tokens on the current device, the
/// backward's too where `backward`. Defined in plans_<activation>.cu.
template <typename Act>
std::unique_ptr<LayerPlans> make_plans(const Dtypes& dtypes, std::int64_t in_features,
                                       std::int64_t out_features, std::int64_t capacity,
                                       bool backward, const qbl::Options& options);

struct Layer {
  LayerKey key;
  std::int64_t capacity;  // the most tokens a call may have
  std::unique_ptr<LayerPlans> plans;
};

/// The layer for `key` with room for `tokens`, planned on first use (on the current device, which
/// is key.device), with a backward plan too when `backward`. Planning waits for `stream` once and
/// cannot happen while `stream` is being captured into a CUDA graph: that raises RuntimeError.
/// One thread plans at a time; a call whose layer is planned never waits for it. The layer stays
/// valid until clear_cache().
Layer& cached_layer(const LayerKey& key, std::int64_t tokens, bool backward, cudaStream_t stream);

/// The side stream of calling stream `stream` on the current device `device`, made on first use;
/// nullptr (run wgrad on `stream` too, the same bits) where none exists yet and `stream` is being
/// captured into a CUDA graph, as no CUDA object is made during capture. Two calling streams never
/// share one. Valid until clear_cache().
qbl::SideStream* side_stream(int device, cudaStream_t stream);

}  // namespace qbl_torch

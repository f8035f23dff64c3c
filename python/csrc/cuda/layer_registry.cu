// The process-wide layer cache and side streams (layer_registry.h), clear_cache and cache_info.

#include "layer_registry.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

namespace qbl_torch {
namespace {

// Planning's scratch through torch's caching allocator (on the current device and stream).
void* torch_allocate(std::size_t bytes, void*) {
  return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
}
void torch_deallocate(void* p, std::size_t, void*) {
  c10::cuda::CUDACachingAllocator::raw_delete(p);
}

std::int64_t capacity_for(std::int64_t tokens) {
  std::int64_t c = 64;
  while (c < tokens) c <<= 1;
  return c;
}

/// Is `stream` being captured into a CUDA graph? The legacy default stream while another stream
/// captures in global mode (cudaErrorStreamCaptureImplicit) counts as capturing: no CUDA object
/// may be made then either. Any other error is raised as itself (an invalid stream, an earlier
/// kernel's failure), not taken for a capture.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();
    return true;
  }
  C10_CUDA_CHECK(e);
  return status != cudaStreamCaptureStatusNone;
}

/// A backward choice from the environment, read when a layer is planned: "1" yes, "0" no, unset
/// or empty by shape (the library's rule).
qbl::Choice env_choice(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return qbl::Choice::by_shape;
  const std::string s(v);
  TORCH_CHECK_VALUE(s == "0" || s == "1", "qbl: ", name, "=", s,
                    " is not a choice; use 1 (yes), 0 (no) or leave it unset (by shape)");
  return s == "1" ? qbl::Choice::yes : qbl::Choice::no;
}

qbl::Options plan_options(const LayerKey& key) {
  qbl::Options o;
  o.allow_tf32 = key.tf32;
  o.overlap_wgrad = env_choice("QBL_OVERLAP_WGRAD");
  o.allocator = {&torch_allocate, &torch_deallocate, nullptr};
  return o;
}

/// The plans of a layer of key `key` for `capacity` tokens (make_plans of its activation).
std::unique_ptr<LayerPlans> plans_for(const LayerKey& key, std::int64_t capacity, bool backward,
                                      const qbl::Options& o) {
  std::unique_ptr<LayerPlans> made;
  qbl::for_each_type(qbl::Activations{}, [&](auto act) {
    using Act = decltype(act);
    if (Act::kind == key.activation)
      made = make_plans<Act>(key.dtypes, key.in_features, key.out_features, capacity, backward, o);
  });
  return made;
}

// A layer outgrown by a larger token count, or planned without a backward that is now wanted, is
// retired, not freed: a call on another thread may still be using it (plans are host objects;
// the work they enqueued owns nothing of theirs). Looking a planned layer up takes layers_mutex_
// only, never the wait for a stream and the planning of another thread's new layer.
// clear() frees retired and live layers and the side streams after synchronizing their devices.
class Registry {
 public:
  static Registry& get() {
    static auto* r = new Registry();  // never destroyed: no CUDA calls after the runtime is gone
    return *r;
  }

  Layer& layer(const LayerKey& key, std::int64_t tokens, bool backward, cudaStream_t stream) {
    {
      std::lock_guard<std::mutex> lock(layers_mutex_);
      if (Layer* ready = planned(key, tokens, backward)) return *ready;
    }
    if (capturing(stream)) {
      // Another thread may be planning this very layer: wait for it (no CUDA call meanwhile),
      // then look again.
      std::lock_guard<std::mutex> planning(planning_mutex_);
      std::lock_guard<std::mutex> lock(layers_mutex_);
      if (Layer* ready = planned(key, tokens, backward)) return *ready;
      TORCH_CHECK(false, "qbl: planning a layer for ", std::to_string(tokens),
                  " tokens during CUDA graph capture is not possible (planning allocates and "
                  "synchronizes); run the same call once before capturing");
    }
    // One planning at a time, outside layers_mutex_: calls of layers already planned go on
    // while a thread waits for its stream and plans.
    std::lock_guard<std::mutex> planning(planning_mutex_);
    std::int64_t capacity = capacity_for(tokens);
    bool with_backward = backward;
    {
      std::lock_guard<std::mutex> lock(layers_mutex_);
      if (Layer* ready = planned(key, tokens, backward)) return *ready;  // planned meanwhile
      auto it = live_.find(key);
      if (it != live_.end()) {  // outgrown, or planned without a backward: planned anew
        capacity = std::max(capacity, it->second->capacity);
        with_backward = with_backward || it->second->plans->has_backward();
      }
    }
    // Planning allocates from torch's pool of this stream and works on streams of its own (and
    // the legacy default stream): let this stream's queued work finish first, so that no block
    // it frees on the way is still in use. Planning synchronizes anyway.
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    const qbl::Options o = plan_options(key);
    std::unique_ptr<Layer> made;
    translate([&] {
      made =
          std::make_unique<Layer>(Layer{key, capacity, plans_for(key, capacity, with_backward, o)});
    });
    TORCH_INTERNAL_ASSERT(made->plans != nullptr, "qbl: a layer of unsupported dtypes");
    std::lock_guard<std::mutex> lock(layers_mutex_);
    std::unique_ptr<Layer>& slot = live_[key];
    if (slot != nullptr) retired_.push_back(std::move(slot));
    slot = std::move(made);
    return *slot;
  }

  qbl::SideStream* side_stream(int device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(side_streams_mutex_);
    const auto key = std::make_pair(device, stream);
    auto it = side_streams_.find(key);
    if (it != side_streams_.end()) return it->second.get();
    if (capturing(stream)) return nullptr;
    std::unique_ptr<qbl::SideStream> made;
    translate([&] { made = std::make_unique<qbl::SideStream>(); });
    return side_streams_.emplace(key, std::move(made)).first->second.get();
  }

  void clear() {
    std::lock_guard<std::mutex> planning(planning_mutex_);
    std::lock_guard<std::mutex> layers_lock(layers_mutex_);
    std::lock_guard<std::mutex> side_streams_lock(side_streams_mutex_);
    std::vector<int> devices;
    for (const auto& [key, layer] : live_) devices.push_back(key.device);
    for (const auto& [key, side] : side_streams_) devices.push_back(key.first);
    std::sort(devices.begin(), devices.end());
    devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
    for (const int device : devices) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    }
    retired_.clear();
    live_.clear();
    side_streams_.clear();
  }

  std::tuple<std::vector<std::int64_t>, std::vector<std::string>> info() {
    std::lock_guard<std::mutex> lock(layers_mutex_);
    std::vector<std::int64_t> numbers;
    std::vector<std::string> names;
    for (const auto& [k, layer] : live_) {
      const LayerPlans& p = *layer->plans;
      for (std::int64_t v : {std::int64_t{k.device}, k.in_features, k.out_features,
                             std::int64_t{k.tf32}, std::int64_t{p.has_backward()}, layer->capacity,
                             static_cast<std::int64_t>(p.forward_workspace_bytes()),
                             static_cast<std::int64_t>(p.max_backward_workspace_bytes())})
        numbers.push_back(v);
      for (ScalarType t : {k.dtypes.x, k.dtypes.gemm, k.dtypes.logits})
        names.emplace_back(c10::toString(t));
      names.emplace_back(activation_name(k.activation));
    }
    return {numbers, names};
  }

 private:
  /// The live layer of `key` if it serves `tokens` tokens (and a backward, where `backward`).
  /// Called with layers_mutex_ held. A published layer never changes: a layer that must serve
  /// more tokens, or a backward it was not planned for, is planned anew and replaces it.
  Layer* planned(const LayerKey& key, std::int64_t tokens, bool backward) const {
    auto it = live_.find(key);
    if (it == live_.end() || it->second->capacity < tokens) return nullptr;
    Layer* l = it->second.get();
    return !backward || l->plans->has_backward() ? l : nullptr;
  }

  std::mutex planning_mutex_;  // one planning at a time; taken before layers_mutex_
  std::mutex layers_mutex_;    // live_ and retired_
  std::map<LayerKey, std::unique_ptr<Layer>> live_;
  std::vector<std::unique_ptr<Layer>> retired_;
  std::mutex side_streams_mutex_;  // side_streams_
  std::map<std::pair<int, cudaStream_t>, std::unique_ptr<qbl::SideStream>> side_streams_;
};

}  // namespace

Layer& cached_layer(const LayerKey& key, std::int64_t tokens, bool backward, cudaStream_t stream) {
  return Registry::get().layer(key, tokens, backward, stream);
}

qbl::SideStream* side_stream(int device, cudaStream_t stream) {
  return Registry::get().side_stream(device, stream);
}

void clear_cache() { Registry::get().clear(); }

std::tuple<std::vector<std::int64_t>, std::vector<std::string>> cache_info() {
  return Registry::get().info();
}

}  // namespace qbl_torch

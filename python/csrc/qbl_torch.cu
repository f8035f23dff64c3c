// The qbl operators for PyTorch: torch.ops.qbl.forward and torch.ops.qbl.backward, registered in
// C++ (TORCH_LIBRARY) and served by qbl::QuantBlendLinear. Their fake (meta) implementations and
// the autograd formula are registered from Python (qbl/_ops.py).
//
// Every tensor an operator returns comes from torch's caching allocator, and so does every layer's
// workspace (qbl::Options::allocator). Work is enqueued on the current CUDA stream. Layers are
// planned once per (device, dtype, in_features, out_features, TF32, forward-only or training) and
// token capacity (a power of two), kept in a process-wide registry; a later call looks its layer
// up without touching the device.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <qbl/qbl.cuh>

#include <Python.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace qbl_torch {

// ---- errors ------------------------------------------------------------------------------------

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

std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

// ---- the layers --------------------------------------------------------------------------------

// qbl's device memory through torch's caching allocator (on the current device and stream).
void* torch_allocate(std::size_t bytes, void*) {
  return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
}
void torch_deallocate(void* p, std::size_t, void*) {
  c10::cuda::CUDACachingAllocator::raw_delete(p);
}

struct Key {
  int device;
  int dtype;
  std::int64_t in, out;
  bool tf32, backward;
  auto tie() const { return std::tie(device, dtype, in, out, tf32, backward); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

template <typename T>
struct Element;
template <>
struct Element<float> {
  using type = float;
};
template <>
struct Element<at::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct Element<at::Half> {
  using type = __half;
};

// One qbl::QuantBlendLinear for torch tensors of one dtype. Calls into one layer are serialized
// by its mutex (autograd runs backward on its own thread, and a layer's cuBLASLt descriptors are
// host state that each call sets).
class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::int64_t max_tokens() const = 0;
  virtual std::size_t workspace_bytes() const = 0;
  virtual void forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
                       const at::Tensor* bias, at::Tensor& out, at::Tensor& mixed,
                       at::Tensor& stats, std::int64_t tokens, bool amax_given,
                       cudaStream_t stream) = 0;
  virtual void backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& logits,
                        const at::Tensor& weight, const at::Tensor& mixed, const at::Tensor& stats,
                        std::int64_t tokens, at::Tensor* gx, at::Tensor* gl, at::Tensor* gw,
                        at::Tensor* gb, bool straight_through, cudaStream_t stream) = 0;
  std::mutex mutex;
};

template <typename S>
class TypedLayer final : public Layer {
  using T = typename Element<S>::type;
  static_assert(sizeof(T) == sizeof(S));

 public:
  TypedLayer(std::int64_t in, std::int64_t out, std::int64_t max_tokens, const qbl::Options& o)
      : impl_(in, out, max_tokens, o) {}

  std::int64_t max_tokens() const override { return impl_.max_tokens(); }
  std::size_t workspace_bytes() const override {
    return qbl::QuantBlendLinear<T>::workspace_bytes(impl_.in_features(), impl_.out_features(),
                                                     impl_.max_tokens(), impl_.options());
  }

  void forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
               const at::Tensor* bias, at::Tensor& out, at::Tensor& mixed, at::Tensor& stats,
               std::int64_t tokens, bool amax_given, cudaStream_t stream) override {
    if (amax_given) {
      impl_.forward_from_amax(in(x), in(logits), in(weight), bias ? in(*bias) : nullptr, ptr(out),
                              tokens, ptr(mixed), stats.mutable_data_ptr<float>(), stream);
    } else {
      impl_.forward(in(x), in(logits), in(weight), bias ? in(*bias) : nullptr, ptr(out), tokens,
                    ptr(mixed), stats.mutable_data_ptr<float>(), stream);
    }
  }

  void backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& logits,
                const at::Tensor& weight, const at::Tensor& mixed, const at::Tensor& stats,
                std::int64_t tokens, at::Tensor* gx, at::Tensor* gl, at::Tensor* gw, at::Tensor* gb,
                bool straight_through, cudaStream_t stream) override {
    typename qbl::QuantBlendLinear<T>::Gradients g;
    g.x = gx ? ptr(*gx) : nullptr;
    g.logits = gl ? ptr(*gl) : nullptr;
    g.weight = gw ? ptr(*gw) : nullptr;
    g.bias = gb ? ptr(*gb) : nullptr;
    g.quant_grad = straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
    impl_.backward(in(grad_out), in(x), in(logits), in(weight), in(mixed),
                   stats.const_data_ptr<float>(), tokens, g, stream);
  }

 private:
  static const T* in(const at::Tensor& t) {
    return t.defined() ? reinterpret_cast<const T*>(t.const_data_ptr<S>()) : nullptr;
  }
  static T* ptr(at::Tensor& t) { return reinterpret_cast<T*>(t.mutable_data_ptr<S>()); }

  qbl::QuantBlendLinear<T> impl_;
};

std::int64_t capacity_for(std::int64_t tokens) {
  std::int64_t c = 64;
  while (c < tokens) c <<= 1;
  return c;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // cannot tell: do not plan
  }
  return status != cudaStreamCaptureStatusNone;
}

// The process-wide registry. A layer outgrown by a larger token count is retired, not freed:
// work already enqueued may still use its workspace; clear_cache() frees retired and live layers
// after synchronizing their devices.
class Registry {
 public:
  static Registry& get() {
    static auto* r = new Registry();  // never destroyed: no CUDA calls after the runtime is gone
    return *r;
  }

  Layer& layer(const Key& key, std::int64_t tokens, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(key);
    if (it != live_.end() && it->second->max_tokens() >= tokens) return *it->second;
    TORCH_CHECK(!capturing(stream), "qbl: planning a layer for ", std::to_string(tokens),
                " tokens during CUDA graph capture is not possible (planning allocates and "
                "synchronizes); run the same call once before capturing");
    // Planning allocates from torch's pool of this stream and works on streams of its own (and
    // the legacy default stream): let this stream's queued work finish first, so that no block
    // it frees on the way is still in use. Planning synchronizes anyway.
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    qbl::Options o;
    o.allow_tf32 = key.tf32;
    o.backward = key.backward;
    o.allocator = {&torch_allocate, &torch_deallocate, nullptr};
    const std::int64_t capacity = capacity_for(tokens);
    std::unique_ptr<Layer> made = translate([&]() -> std::unique_ptr<Layer> {
      switch (static_cast<at::ScalarType>(key.dtype)) {
        case at::kFloat:
          return std::make_unique<TypedLayer<float>>(key.in, key.out, capacity, o);
        case at::kBFloat16:
          return std::make_unique<TypedLayer<at::BFloat16>>(key.in, key.out, capacity, o);
        default:
          return std::make_unique<TypedLayer<at::Half>>(key.in, key.out, capacity, o);
      }
    });
    if (it != live_.end()) {
      retired_.push_back(std::move(it->second));
      it->second = std::move(made);
      return *it->second;
    }
    return *live_.emplace(key, std::move(made)).first->second;
  }

  // Synchronizes every device that holds a layer, then frees them all.
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int> devices;
    for (const auto& [key, layer] : live_) devices.push_back(key.device);
    for (const int d : devices) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(d));
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    }
    // A layer frees on the device it was made on (raw_delete finds the device itself).
    retired_.clear();
    live_.clear();
  }

  // [device, dtype, in, out, tf32, backward, max_tokens, workspace_bytes] per live layer.
  std::vector<std::int64_t> info() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::int64_t> r;
    for (const auto& [k, layer] : live_) {
      for (std::int64_t v : {std::int64_t{k.device}, std::int64_t{k.dtype}, k.in, k.out,
                             std::int64_t{k.tf32}, std::int64_t{k.backward}, layer->max_tokens(),
                             static_cast<std::int64_t>(layer->workspace_bytes())})
        r.push_back(v);
    }
    return r;
  }

 private:
  std::mutex mutex_;
  std::map<Key, std::unique_ptr<Layer>> live_;
  std::vector<std::unique_ptr<Layer>> retired_;
};

// ---- validation --------------------------------------------------------------------------------

void check_tensor(const char* op, const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device().str(),
              " but x is on ", x.device().str(), "; all tensors must be on one CUDA device");
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), op, ": ", name, " has dtype ",
                   c10::toString(t.scalar_type()), " but x has ", c10::toString(x.scalar_type()),
                   "; all tensors must have one dtype");
}

struct Problem {
  std::int64_t tokens, in, out;
  std::vector<std::int64_t> lead;  // x.shape[:-1]
};

Problem check_problem(const char* op, const at::Tensor& x, const at::Tensor& logits,
                      const at::Tensor& weight) {
  TORCH_CHECK(x.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x.device().str());
  const auto dt = x.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
                   ": unsupported dtype ", c10::toString(dt),
                   "; supported: torch.float32, torch.bfloat16, torch.float16");
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (features last)");
  check_tensor(op, logits, "logits", x);
  check_tensor(op, weight, "weight", x);
  Problem p;
  p.in = x.size(-1);
  p.lead.assign(x.sizes().begin(), x.sizes().end() - 1);
  TORCH_CHECK(logits.sizes() == c10::IntArrayRef(p.lead), op,
              ": logits must have shape x.shape[:-1] = ", shape_str(p.lead), ", got ",
              shape_str(logits.sizes()));
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == p.in, op,
              ": weight must be [out_features, in_features] with in_features = x.shape[-1] = ",
              std::to_string(p.in), ", got ", shape_str(weight.sizes()));
  p.out = weight.size(0);
  TORCH_CHECK(p.in > 0 && p.out > 0, op, ": in_features and out_features must be positive, got ",
              shape_str(weight.sizes()));
  p.tokens = 1;
  for (const std::int64_t s : p.lead) p.tokens *= s;
  return p;
}

// ---- the operators -----------------------------------------------------------------------------

// The forward, from x's own amax or (amax_in defined) from a given one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_impl(
    const char* op, const at::Tensor& x_in, const at::Tensor& logits_in,
    const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    const at::Tensor* amax_in, bool allow_tf32) {
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  if (amax_in != nullptr) {
    TORCH_CHECK(amax_in->device() == x_in.device() && amax_in->scalar_type() == at::kFloat &&
                    amax_in->numel() == 2 && amax_in->is_contiguous(),
                op, ": amax must be local_amax()'s float32 [2] tensor on x's device");
  }
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  if (has_bias) {
    check_tensor(op, *bias_in, "bias", x_in);
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == p.out, op,
                ": bias must be [out_features] = [", std::to_string(p.out), "] or None, got ",
                shape_str(bias_in->sizes()));
  }
  std::vector<std::int64_t> out_sizes = p.lead;
  out_sizes.push_back(p.out);
  at::Tensor out = at::empty(out_sizes, x_in.options());
  at::Tensor mixed = at::empty(x_in.sizes(), x_in.options());
  at::Tensor stats =
      amax_in != nullptr ? amax_in->clone() : at::empty({2}, x_in.options().dtype(at::kFloat));
  if (p.tokens == 0) return {out, mixed, amax_in != nullptr ? stats : stats.zero_()};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const at::Tensor x = x_in.contiguous(), logits = logits_in.contiguous(),
                   weight = weight_in.contiguous();
  at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  const Key key{x.get_device(), static_cast<int>(x.scalar_type()),           p.in,
                p.out,          allow_tf32 && x.scalar_type() == at::kFloat, false};
  Layer& layer = Registry::get().layer(key, p.tokens, stream);
  std::lock_guard<std::mutex> lock(layer.mutex);
  translate([&] {
    layer.forward(x, logits, weight, has_bias ? &bias : nullptr, out, mixed, stats, p.tokens,
                  amax_in != nullptr, stream);
  });
  return {out, mixed, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x,
                                                       const at::Tensor& logits,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       bool straight_through, bool allow_tf32) {
  (void)straight_through;  // the forward is the same; autograd reads it
  return forward_impl("qbl.forward", x, logits, weight, bias, nullptr, allow_tf32);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_from_amax(
    const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& amax, bool straight_through,
    bool allow_tf32) {
  (void)straight_through;
  return forward_impl("qbl.forward_from_amax", x, logits, weight, bias, &amax, allow_tf32);
}

// [max |x| of this shard, 0] in float32: the first step of a sharded forward. stats[0]'s bits,
// read as int32, order like the values (its sign bit is clear), NaN above +Inf: an integer MAX
// all-reduce of them is the NaN-propagating max over the shards.
at::Tensor local_amax(const at::Tensor& x_in) {
  constexpr const char* op = "qbl.local_amax";
  TORCH_CHECK(x_in.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x_in.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x_in.device().str());
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
                   ": unsupported dtype ", c10::toString(dt),
                   "; supported: torch.float32, torch.bfloat16, torch.float16");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  at::Tensor stats = at::empty({2}, x_in.options().dtype(at::kFloat));
  C10_CUDA_CHECK(cudaMemsetAsync(stats.mutable_data_ptr<float>(), 0, 2 * sizeof(float), stream));
  if (x_in.numel() == 0) return stats;
  const at::Tensor x = x_in.contiguous();
  cudaError_t e = cudaSuccess;
  float* d = stats.mutable_data_ptr<float>();
  if (dt == at::kFloat) {
    e = qbl::amax(x.const_data_ptr<float>(), x.numel(), d, stream);
  } else if (dt == at::kBFloat16) {
    e = qbl::amax(reinterpret_cast<const __nv_bfloat16*>(x.const_data_ptr<at::BFloat16>()),
                  x.numel(), d, stream);
  } else {
    e = qbl::amax(reinterpret_cast<const __half*>(x.const_data_ptr<at::Half>()), x.numel(), d,
                  stream);
  }
  C10_CUDA_CHECK(e);
  return stats;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_out_in, const at::Tensor& x_in, const at::Tensor& logits_in,
    const at::Tensor& weight_in, const at::Tensor& mixed_in, const at::Tensor& stats, bool has_bias,
    std::array<bool, 4> mask, bool straight_through, bool allow_tf32) {
  constexpr const char* op = "qbl.backward";
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  check_tensor(op, grad_out_in, "grad_out", x_in);
  check_tensor(op, mixed_in, "mixed", x_in);
  std::vector<std::int64_t> out_sizes = p.lead;
  out_sizes.push_back(p.out);
  TORCH_CHECK(grad_out_in.sizes() == c10::IntArrayRef(out_sizes), op, ": grad_out must have shape ",
              shape_str(out_sizes), ", got ", shape_str(grad_out_in.sizes()));
  TORCH_CHECK(mixed_in.sizes() == x_in.sizes(), op, ": mixed must have x's shape ",
              shape_str(x_in.sizes()), ", got ", shape_str(mixed_in.sizes()));
  TORCH_CHECK(stats.device() == x_in.device() && stats.scalar_type() == at::kFloat &&
                  stats.numel() == 2 && stats.is_contiguous(),
              op, ": stats must be the forward's float32 [2] tensor on x's device");
  const bool want_bias = mask[3] && has_bias;
  auto none = [&] { return at::empty({0}, x_in.options()); };
  // With no token the parameter gradients are sums of nothing: zeros.
  auto param = [&](bool want, c10::IntArrayRef sizes) {
    if (!want) return none();
    return p.tokens == 0 ? at::zeros(sizes, x_in.options()) : at::empty(sizes, x_in.options());
  };
  at::Tensor gx = mask[0] ? at::empty(x_in.sizes(), x_in.options()) : none();
  at::Tensor gl = mask[1] ? at::empty(logits_in.sizes(), x_in.options()) : none();
  at::Tensor gw = param(mask[2], weight_in.sizes());
  at::Tensor gb = param(want_bias, {p.out});
  if (p.tokens == 0 || !(mask[0] || mask[1] || mask[2] || want_bias)) return {gx, gl, gw, gb};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const at::Tensor grad_out = grad_out_in.contiguous(), x = x_in.contiguous(),
                   logits = logits_in.contiguous(), weight = weight_in.contiguous(),
                   mixed = mixed_in.contiguous();
  const Key key{x.get_device(), static_cast<int>(x.scalar_type()),           p.in,
                p.out,          allow_tf32 && x.scalar_type() == at::kFloat, true};
  Layer& layer = Registry::get().layer(key, p.tokens, stream);
  std::lock_guard<std::mutex> lock(layer.mutex);
  translate([&] {
    layer.backward(grad_out, x, logits, weight, mixed, stats, p.tokens, mask[0] ? &gx : nullptr,
                   mask[1] ? &gl : nullptr, mask[2] ? &gw : nullptr, want_bias ? &gb : nullptr,
                   straight_through, stream);
  });
  return {gx, gl, gw, gb};
}

void clear_cache() { Registry::get().clear(); }

std::vector<std::int64_t> cache_info() { return Registry::get().info(); }

}  // namespace qbl_torch

TORCH_LIBRARY(qbl, m) {
  m.def(
      "forward(Tensor x, Tensor logits, Tensor weight, Tensor? bias, bool straight_through=False, "
      "bool allow_tf32=False) -> (Tensor out, Tensor mixed, Tensor stats)");
  m.def(
      "backward(Tensor grad_out, Tensor x, Tensor logits, Tensor weight, Tensor mixed, "
      "Tensor stats, bool has_bias, bool[4] output_mask, bool straight_through=False, "
      "bool allow_tf32=False) -> (Tensor grad_x, Tensor grad_logits, Tensor grad_weight, "
      "Tensor grad_bias)");
  m.def("local_amax(Tensor x) -> Tensor");
  m.def(
      "forward_from_amax(Tensor x, Tensor logits, Tensor weight, Tensor? bias, Tensor amax, "
      "bool straight_through=False, bool allow_tf32=False) -> (Tensor out, Tensor mixed, "
      "Tensor stats)");
  m.def("clear_cache() -> ()", &qbl_torch::clear_cache);
  m.def("cache_info() -> int[]", &qbl_torch::cache_info);
}

TORCH_LIBRARY_IMPL(qbl, CUDA, m) {
  m.impl("forward", &qbl_torch::forward);
  m.impl("backward", &qbl_torch::backward);
  m.impl("local_amax", &qbl_torch::local_amax);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax);
}

// CPU tensors reach the same functions, whose first check says that x must be a CUDA tensor
// (rather than the dispatcher's "no kernel for CPU").
TORCH_LIBRARY_IMPL(qbl, CPU, m) {
  m.impl("forward", &qbl_torch::forward);
  m.impl("backward", &qbl_torch::backward);
  m.impl("local_amax", &qbl_torch::local_amax);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax);
}

// Importing qbl._C registers the operators above; the module itself is empty.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

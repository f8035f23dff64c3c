// The qbl operators for PyTorch, registered in C++:
//
//   torch.ops.qbl.forward            out, and the `mixed` and [amax, scale] the backward reads
//   torch.ops.qbl.forward_from_amax  the same from a given amax (a sharded x's second step)
//   torch.ops.qbl.backward           the four gradients
//   torch.ops.qbl.local_amax         [max |x|, 0] of a shard (the sharded forward's first step)
//
// with kernels for CUDA (the computation, by qbl's plans), Autograd (the autograd formula, a
// torch::autograd::Function calling the backward operator) and AutocastCUDA (what eager computes
// for the reference module under torch.autocast). Their fake implementations are registered from
// Python (qbl/_ops.py), so torch.compile traces them.
//
// Plans: one cached layer per (device, x / GEMM / logits dtypes, in_features, out_features, TF32),
// serving forward and backward, for a power-of-two token capacity. Plans hold no device memory:
// every workspace, like every output, comes from torch's caching allocator on the current stream,
// per call -- so the same layer serves several streams and threads at once, and CUDA graphs
// capture its calls with torch's graph pools.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <qbl/qbl.cuh>

#include <Python.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace qbl_torch {

using at::ScalarType;
using at::Tensor;

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

// ---- element types -----------------------------------------------------------------------------

template <typename T>
struct Scalar;
template <>
struct Scalar<float> {
  static constexpr ScalarType value = at::kFloat;
};
template <>
struct Scalar<__nv_bfloat16> {
  static constexpr ScalarType value = at::kBFloat16;
};
template <>
struct Scalar<__half> {
  static constexpr ScalarType value = at::kHalf;
};

/// The element types of one layer: x's, the GEMM's, the logits'.
struct Types {
  ScalarType x, gemm, logits;
  auto tie() const { return std::tie(x, gemm, logits); }
};

/// Calls f(X{}, G{}, L{}) with the C++ element types of `t`, one of the combinations qbl supports
/// (one type; or fp32 x with a 16-bit GEMM and the logits in fp32 or the GEMM's type); returns
/// false for any other.
template <typename F>
bool with_types(const Types& t, F&& f) {
  bool done = false;
  auto try_one = [&](auto x, auto g, auto l) {
    using X = decltype(x);
    using G = decltype(g);
    using L = decltype(l);
    if (!done && t.x == Scalar<X>::value && t.gemm == Scalar<G>::value &&
        t.logits == Scalar<L>::value) {
      f(x, g, l);
      done = true;
    }
  };
  try_one(float{}, float{}, float{});
  try_one(__nv_bfloat16{}, __nv_bfloat16{}, __nv_bfloat16{});
  try_one(__half{}, __half{}, __half{});
  try_one(float{}, __nv_bfloat16{}, float{});
  try_one(float{}, __nv_bfloat16{}, __nv_bfloat16{});
  try_one(float{}, __half{}, float{});
  try_one(float{}, __half{}, __half{});
  return done;
}

bool supported(const Types& t) {
  return with_types(t, [](auto, auto, auto) {});
}

template <typename T>
const T* in(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.const_data_ptr()) : nullptr;
}
template <typename T>
T* out(Tensor& t) {
  return t.defined() ? static_cast<T*>(t.mutable_data_ptr()) : nullptr;
}

// ---- the layers --------------------------------------------------------------------------------

// Planning's scratch through torch's caching allocator (on the current device and stream).
void* torch_allocate(std::size_t bytes, void*) {
  return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
}
void torch_deallocate(void* p, std::size_t, void*) {
  c10::cuda::CUDACachingAllocator::raw_delete(p);
}

struct Key {
  int device;
  Types types;
  std::int64_t in, out;
  bool tf32;
  auto tie() const {
    return std::make_tuple(device, types.x, types.gemm, types.logits, in, out, tf32);
  }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

/// One shape's plans: the forward, and the backward once a backward is on its way.
template <typename X, typename G, typename L>
struct Plans {
  qbl::ForwardPlan<X, G, L> forward;
  std::unique_ptr<qbl::BackwardPlan<X, G, L>> backward;
};
using AnyPlans =
    std::variant<Plans<float, float, float>, Plans<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>,
                 Plans<__half, __half, __half>, Plans<float, __nv_bfloat16, float>,
                 Plans<float, __nv_bfloat16, __nv_bfloat16>, Plans<float, __half, float>,
                 Plans<float, __half, __half>>;

struct Layer {
  Key key;
  std::int64_t capacity;
  AnyPlans plans;
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

qbl::Options plan_options(const Key& key) {
  qbl::Options o;
  o.allow_tf32 = key.tf32;
  o.overlap_wgrad = env_choice("QBL_OVERLAP_WGRAD");
  o.bias_from_epilogue = env_choice("QBL_BIAS_FROM_EPILOGUE");
  o.allocator = {&torch_allocate, &torch_deallocate, nullptr};
  return o;
}

// The process-wide registry. A layer outgrown by a larger token count is retired, not freed: a
// call on another thread may still be using it (plans are host objects; the work they enqueued
// owns nothing of theirs). clear_cache() frees retired and live layers after synchronizing their
// devices.
class Registry {
 public:
  static Registry& get() {
    static auto* r = new Registry();  // never destroyed: no CUDA calls after the runtime is gone
    return *r;
  }

  /// The layer for `key` with room for `tokens`, planned on first use, with a backward plan too
  /// when `backward`: planning waits for the stream once and cannot happen during graph capture.
  Layer& layer(const Key& key, std::int64_t tokens, bool backward, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(key);
    Layer* found = it != live_.end() && it->second->capacity >= tokens ? it->second.get() : nullptr;
    if (found != nullptr && (!backward || has_backward(*found))) return *found;
    TORCH_CHECK(!capturing(stream), "qbl: planning a layer for ", std::to_string(tokens),
                " tokens during CUDA graph capture is not possible (planning allocates and "
                "synchronizes); run the same call once before capturing");
    // Planning allocates from torch's pool of this stream and works on streams of its own (and
    // the legacy default stream): let this stream's queued work finish first, so that no block
    // it frees on the way is still in use. Planning synchronizes anyway.
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    const qbl::Options o = plan_options(key);
    if (found != nullptr) {  // the forward is planned; the backward now too
      translate([&] {
        std::visit(
            [&](auto& p) {
              using P = std::decay_t<decltype(p)>;
              using B = typename decltype(P::backward)::element_type;
              p.backward = std::make_unique<B>(key.in, key.out, found->capacity, o);
            },
            found->plans);
      });
      return *found;
    }
    const std::int64_t capacity = capacity_for(tokens);
    std::unique_ptr<Layer> made;
    translate([&] {
      with_types(key.types, [&](auto x, auto g, auto l) {
        using X = decltype(x);
        using G = decltype(g);
        using L = decltype(l);
        Plans<X, G, L> p{qbl::ForwardPlan<X, G, L>(key.in, key.out, capacity, o), nullptr};
        if (backward || (it != live_.end() && has_backward(*it->second)))
          p.backward = std::make_unique<qbl::BackwardPlan<X, G, L>>(key.in, key.out, capacity, o);
        made = std::make_unique<Layer>(Layer{key, capacity, AnyPlans(std::move(p))});
      });
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
    for (const auto& [key, layer] : live_) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(key.device));
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    }
    retired_.clear();
    live_.clear();
  }

  // [device, in, out, tf32, backward, max_tokens, forward workspace, backward workspace] and
  // [x dtype, gemm dtype, logits dtype] per live layer.
  std::tuple<std::vector<std::int64_t>, std::vector<std::string>> info() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::int64_t> numbers;
    std::vector<std::string> names;
    for (const auto& [k, layer] : live_) {
      std::int64_t fwd_ws = 0, bwd_ws = 0;
      std::visit(
          [&](const auto& p) {
            fwd_ws = static_cast<std::int64_t>(p.forward.workspace_bytes());
            bwd_ws = p.backward ? static_cast<std::int64_t>(p.backward->workspace_bytes()) : 0;
          },
          layer->plans);
      for (std::int64_t v : {std::int64_t{k.device}, k.in, k.out, std::int64_t{k.tf32},
                             std::int64_t{has_backward(*layer)}, layer->capacity, fwd_ws, bwd_ws})
        numbers.push_back(v);
      for (ScalarType t : {k.types.x, k.types.gemm, k.types.logits})
        names.emplace_back(c10::toString(t));
    }
    return {numbers, names};
  }

 private:
  static bool has_backward(const Layer& l) {
    return std::visit([](const auto& p) { return p.backward != nullptr; }, l.plans);
  }
  std::mutex mutex_;
  std::map<Key, std::unique_ptr<Layer>> live_;
  std::vector<std::unique_ptr<Layer>> retired_;
};

/// A workspace of `bytes` from torch's caching allocator on the current stream: freed (for reuse
/// by this stream's later work) when the call returns.
Tensor workspace(std::size_t bytes, const Tensor& like) {
  return at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// ---- validation --------------------------------------------------------------------------------

void check_dense(const char* op, const Tensor& t, const char* name, const Tensor& x) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device().str(),
              " but x is on ", x.device().str(), "; all tensors must be on one CUDA device");
}

void check_dtype(const char* op, const Tensor& t, const char* name, ScalarType want,
                 const char* whose) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, op, ": ", name, " has dtype ",
                   c10::toString(t.scalar_type()), " but ", whose, " is ", c10::toString(want),
                   "; all tensors must have one dtype (mixed dtypes only under torch.autocast)");
}

std::string dtype_list(const Types& t) {
  return std::string("x ") + c10::toString(t.x) + ", GEMM " + c10::toString(t.gemm) + ", logits " +
         c10::toString(t.logits);
}

void check_supported(const char* op, const Types& t) {
  TORCH_CHECK_TYPE(supported(t), op, ": unsupported dtypes (", dtype_list(t),
                   "); supported: float32, bfloat16 or float16 throughout, or float32 x with a "
                   "bfloat16/float16 GEMM and float32 or GEMM-typed logits");
}

struct Problem {
  std::int64_t tokens, in, out;
  std::vector<std::int64_t> lead;  // x.shape[:-1]
};

Problem check_problem(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight) {
  TORCH_CHECK(x.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x.device().str());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (features last)");
  check_dense(op, logits, "logits", x);
  check_dense(op, weight, "weight", x);
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

/// The forward's dtypes: one, or (gemm_dtype given, as the autocast kernel gives it) the GEMM's
/// for weight and bias with x and logits as they come.
Types forward_types(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight,
                    const std::optional<Tensor>& bias, std::optional<ScalarType> gemm_dtype) {
  const Types t{x.scalar_type(), gemm_dtype.value_or(x.scalar_type()), logits.scalar_type()};
  if (!gemm_dtype.has_value()) {
    check_dtype(op, logits, "logits", t.x, "x");
    check_dtype(op, weight, "weight", t.x, "x");
    if (bias.has_value() && bias->defined()) check_dtype(op, *bias, "bias", t.x, "x");
  } else {
    check_dtype(op, weight, "weight", t.gemm, "gemm_dtype");
    if (bias.has_value() && bias->defined()) check_dtype(op, *bias, "bias", t.gemm, "gemm_dtype");
  }
  check_supported(op, t);
  return t;
}

// ---- the CUDA kernels --------------------------------------------------------------------------

/// True on this thread while the autograd kernel runs a forward that autograd records.
thread_local bool recording = false;

/// Sets `recording` for its scope.
struct Recording {
  bool saved;
  explicit Recording(bool on) : saved(recording) { recording = on; }
  ~Recording() { recording = saved; }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
};

bool records(const Tensor& x, const Tensor& logits, const Tensor& weight,
             const std::optional<Tensor>& bias) {
  return at::GradMode::is_enabled() &&
         (x.requires_grad() || logits.requires_grad() || weight.requires_grad() ||
          (bias.has_value() && bias->defined() && bias->requires_grad()));
}

// The forward, from x's own amax or (amax_in defined) from a given one.
std::tuple<Tensor, Tensor, Tensor> forward_impl(const char* op, const Tensor& x_in,
                                                const Tensor& logits_in, const Tensor& weight_in,
                                                const std::optional<Tensor>& bias_in,
                                                const Tensor* amax_in, bool allow_tf32,
                                                std::optional<ScalarType> gemm_dtype) {
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  const Types types = forward_types(op, x_in, logits_in, weight_in, bias_in, gemm_dtype);
  if (amax_in != nullptr) {
    TORCH_CHECK(amax_in->device() == x_in.device() && amax_in->scalar_type() == at::kFloat &&
                    amax_in->numel() == 2 && amax_in->is_contiguous(),
                op, ": amax must be local_amax()'s float32 [2] tensor on x's device");
  }
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  if (has_bias) {
    check_dense(op, *bias_in, "bias", x_in);
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == p.out, op,
                ": bias must be [out_features] = [", std::to_string(p.out), "] or None, got ",
                shape_str(bias_in->sizes()));
  }
  std::vector<std::int64_t> out_sizes = p.lead;
  out_sizes.push_back(p.out);
  const auto g_opts = x_in.options().dtype(types.gemm);
  Tensor out = at::empty(out_sizes, g_opts);
  Tensor mixed = at::empty(x_in.sizes(), g_opts);
  Tensor stats =
      amax_in != nullptr ? amax_in->clone() : at::empty({2}, x_in.options().dtype(at::kFloat));
  if (p.tokens == 0) return {out, mixed, amax_in != nullptr ? stats : stats.zero_()};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const Tensor x = x_in.contiguous(), logits = logits_in.contiguous(),
               weight = weight_in.contiguous();
  const Tensor bias = has_bias ? bias_in->contiguous() : Tensor();
  const Key key{x.get_device(), types, p.in, p.out, allow_tf32 && types.gemm == at::kFloat};
  // A forward recording autograd will be followed by a backward: plan both now, at one wait.
  // (Below the autograd kernel grad mode is off: that kernel says so through `recording`.)
  const bool training = recording || records(x_in, logits_in, weight_in, bias_in);
  Layer& layer = Registry::get().layer(key, p.tokens, training, stream);
  translate([&] {
    std::visit(
        [&](const auto& plans) {
          using F = std::decay_t<decltype(plans.forward)>;
          using X = std::remove_const_t<std::remove_pointer_t<decltype(F::Arguments::x)>>;
          using G = std::remove_const_t<std::remove_pointer_t<decltype(F::Arguments::weight)>>;
          using L = std::remove_const_t<std::remove_pointer_t<decltype(F::Arguments::logits)>>;
          typename F::Arguments a;
          a.x = in<X>(x), a.logits = in<L>(logits), a.weight = in<G>(weight);
          a.bias = has_bias ? in<G>(bias) : nullptr, a.out = qbl_torch::out<G>(out);
          a.mixed = qbl_torch::out<G>(mixed), a.stats = stats.mutable_data_ptr<float>();
          a.tokens = p.tokens;
          Tensor ws = workspace(plans.forward.workspace_bytes(), x);
          plans.forward.run(a, ws.mutable_data_ptr(), stream,
                            amax_in != nullptr ? qbl::AmaxSource::stats : qbl::AmaxSource::x);
        },
        layer.plans);
  });
  return {out, mixed, stats};
}

std::tuple<Tensor, Tensor, Tensor> forward_cuda(const Tensor& x, const Tensor& logits,
                                                const Tensor& weight,
                                                const std::optional<Tensor>& bias,
                                                bool straight_through, bool allow_tf32,
                                                std::optional<ScalarType> gemm_dtype) {
  (void)straight_through;  // the forward is the same; autograd reads it
  return forward_impl("qbl.forward", x, logits, weight, bias, nullptr, allow_tf32, gemm_dtype);
}

std::tuple<Tensor, Tensor, Tensor> forward_from_amax_cuda(const Tensor& x, const Tensor& logits,
                                                          const Tensor& weight,
                                                          const std::optional<Tensor>& bias,
                                                          const Tensor& amax, bool straight_through,
                                                          bool allow_tf32,
                                                          std::optional<ScalarType> gemm_dtype) {
  (void)straight_through;
  return forward_impl("qbl.forward_from_amax", x, logits, weight, bias, &amax, allow_tf32,
                      gemm_dtype);
}

// [max |x| of this shard, 0] in float32: the first step of a sharded forward. stats[0]'s bits,
// read as int32, order like the values (its sign bit is clear), NaN above +Inf: an integer MAX
// all-reduce of them is the NaN-propagating max over the shards. One memset, one kernel.
Tensor local_amax(const Tensor& x_in) {
  constexpr const char* op = "qbl.local_amax";
  TORCH_CHECK(x_in.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x_in.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x_in.device().str());
  const auto dt = x_in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
                   ": unsupported dtype ", c10::toString(dt),
                   "; supported: torch.float32, torch.bfloat16, torch.float16");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  Tensor stats = at::empty({2}, x_in.options().dtype(at::kFloat));
  const Tensor x = x_in.contiguous();
  int sms = 0;
  C10_CUDA_CHECK(qbl::detail::sm_count(&sms));
  float* d = stats.mutable_data_ptr<float>();
  cudaError_t e = cudaSuccess;
  const std::size_t both = 2 * sizeof(float);
  if (dt == at::kFloat) {
    e = qbl::detail::amax_launch(x.const_data_ptr<float>(), x.numel(), d, sms, stream, both);
  } else if (dt == at::kBFloat16) {
    e = qbl::detail::amax_launch(in<__nv_bfloat16>(x), x.numel(), d, sms, stream, both);
  } else {
    e = qbl::detail::amax_launch(in<__half>(x), x.numel(), d, sms, stream, both);
  }
  C10_CUDA_CHECK(e);
  return stats;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> backward_cuda(
    const Tensor& grad_out_in, const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const Tensor& mixed_in, const Tensor& stats, bool has_bias, std::array<bool, 4> mask,
    bool straight_through, bool allow_tf32) {
  constexpr const char* op = "qbl.backward";
  const Problem p = check_problem(op, x_in, logits_in, weight_in);
  const Types types{x_in.scalar_type(), weight_in.scalar_type(), logits_in.scalar_type()};
  check_supported(op, types);
  check_dense(op, grad_out_in, "grad_out", x_in);
  check_dense(op, mixed_in, "mixed", x_in);
  check_dtype(op, grad_out_in, "grad_out", types.gemm, "weight");
  check_dtype(op, mixed_in, "mixed", types.gemm, "weight");
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
  const auto x_opts = x_in.options();
  const auto g_opts = x_opts.dtype(types.gemm), l_opts = x_opts.dtype(types.logits);
  auto none = [&](const at::TensorOptions& o) { return at::empty({0}, o); };
  // With no token the parameter gradients are sums of nothing: zeros.
  auto param = [&](bool want, c10::IntArrayRef sizes) {
    if (!want) return none(g_opts);
    return p.tokens == 0 ? at::zeros(sizes, g_opts) : at::empty(sizes, g_opts);
  };
  Tensor gx = mask[0] ? at::empty(x_in.sizes(), x_opts) : none(x_opts);
  Tensor gl = mask[1] ? at::empty(logits_in.sizes(), l_opts) : none(l_opts);
  Tensor gw = param(mask[2], weight_in.sizes());
  Tensor gb = param(want_bias, {p.out});
  if (p.tokens == 0 || !(mask[0] || mask[1] || mask[2] || want_bias)) return {gx, gl, gw, gb};

  const c10::cuda::CUDAGuard guard(x_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // x is read only for grad_logits, mixed only for grad_weight, weight, logits and stats only for
  // grad_x and grad_logits.
  const bool dgrad = mask[0] || mask[1];
  const Tensor grad_out = grad_out_in.contiguous();
  const Tensor x = mask[1] ? x_in.contiguous() : Tensor();
  const Tensor logits = dgrad ? logits_in.contiguous() : Tensor();
  const Tensor weight = dgrad ? weight_in.contiguous() : Tensor();
  const Tensor mixed = mask[2] ? mixed_in.contiguous() : Tensor();
  const Key key{x_in.get_device(), types, p.in, p.out, allow_tf32 && types.gemm == at::kFloat};
  Layer& layer = Registry::get().layer(key, p.tokens, true, stream);
  translate([&] {
    std::visit(
        [&](const auto& plans) {
          using B = typename std::decay_t<decltype(plans.backward)>::element_type;
          using X = std::remove_const_t<std::remove_pointer_t<decltype(B::Arguments::x)>>;
          using G = std::remove_const_t<std::remove_pointer_t<decltype(B::Arguments::weight)>>;
          using L = std::remove_const_t<std::remove_pointer_t<decltype(B::Arguments::logits)>>;
          typename B::Arguments a;
          a.grad_out = in<G>(grad_out), a.x = in<X>(x), a.logits = in<L>(logits);
          a.weight = in<G>(weight), a.mixed = in<G>(mixed);
          a.stats = dgrad ? stats.const_data_ptr<float>() : nullptr;
          a.tokens = p.tokens;
          a.grad_x = mask[0] ? out<X>(gx) : nullptr;
          a.grad_logits = mask[1] ? out<L>(gl) : nullptr;
          a.grad_weight = mask[2] ? out<G>(gw) : nullptr;
          a.grad_bias = want_bias ? out<G>(gb) : nullptr;
          a.quant_grad = straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
          Tensor ws = workspace(plans.backward->workspace_bytes(p.tokens), grad_out);
          plans.backward->run(a, ws.mutable_data_ptr(), stream);
        },
        layer.plans);
  });
  return {gx, gl, gw, gb};
}

void clear_cache() { Registry::get().clear(); }

std::tuple<std::vector<std::int64_t>, std::vector<std::string>> cache_info() {
  return Registry::get().info();
}

// ---- autograd ----------------------------------------------------------------------------------

// The operators as the dispatcher knows them, for calls below the autograd and autocast keys.
const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qbl::forward", "")
                             .typed<decltype(forward_cuda)>();
  return op;
}
const auto& forward_from_amax_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qbl::forward_from_amax", "")
                             .typed<decltype(forward_from_amax_cuda)>();
  return op;
}
const auto& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qbl::backward", "")
                             .typed<decltype(backward_cuda)>();
  return op;
}

// The autograd formula, in C++ (a Python formula costs tens of microseconds per call): the forward
// saves x, logits, weight, the stats and -- only where grad_weight will read it -- mixed; the
// backward calls qbl::backward for the gradients asked for. amax (the sharded forward's given
// amax) is detached, as in the reference module.
class LayerFunction : public torch::autograd::Function<LayerFunction> {
 public:
  // bias and amax are optional: apply() makes an input of every defined tensor argument (an
  // undefined Tensor argument is an error there), and the backward's results follow the arguments.
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& logits,
      const Tensor& weight, const std::optional<Tensor>& bias, const std::optional<Tensor>& amax,
      bool straight_through, bool allow_tf32, std::optional<ScalarType> gemm_dtype) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, mixed, stats] =
        amax.has_value()
            ? forward_from_amax_op().call(x, logits, weight, bias, *amax, straight_through,
                                          allow_tf32, gemm_dtype)
            : forward_op().call(x, logits, weight, bias, straight_through, allow_tf32, gemm_dtype);
    // (needs_input_grad() is only valid where autograd records this call: `recording`.)
    const bool need_mixed = recording && ctx->needs_input_grad(2);
    ctx->save_for_backward({x, logits, weight, need_mixed ? mixed : Tensor(), stats});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["straight_through"] = straight_through;
    ctx->saved_data["allow_tf32"] = allow_tf32;
    ctx->mark_non_differentiable({mixed, stats});
    // The gradients of mixed and stats are always undefined: not materialized as zeros (two
    // allocations and fills of mixed's size per backward otherwise).
    ctx->set_materialize_grads(false);
    return {out, mixed, stats};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    // out's gradient undefined (out reached no loss): every input's gradient is zero, which
    // autograd writes as undefined.
    if (!grads[0].defined()) return torch::autograd::variable_list(8);
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 4> mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                      ctx->needs_input_grad(2),
                                      has_bias && ctx->needs_input_grad(3)};
    // (Edges exist for defined inputs only: edge 3 is bias's where there is a bias.)
    // Not saved: grad_weight is not wanted, so the operator does not read mixed; a stand-in of
    // its shape and dtype that holds one element.
    const Tensor mixed =
        saved[3].defined()
            ? saved[3]
            : at::empty({1}, x.options().dtype(saved[2].scalar_type())).expand(x.sizes());
    auto [gx, gl, gw, gb] = backward_op().call(
        grads[0], x, saved[1], saved[2], mixed, saved[4], has_bias, mask,
        ctx->saved_data["straight_through"].toBool(), ctx->saved_data["allow_tf32"].toBool());
    return {mask[0] ? gx : Tensor(),
            mask[1] ? gl : Tensor(),
            mask[2] ? gw : Tensor(),
            mask[3] ? gb : Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> forward_autograd(const Tensor& x, const Tensor& logits,
                                                    const Tensor& weight,
                                                    const std::optional<Tensor>& bias,
                                                    bool straight_through, bool allow_tf32,
                                                    std::optional<ScalarType> gemm_dtype) {
  const std::optional<Tensor> b = bias.has_value() && bias->defined() ? bias : std::nullopt;
  const Recording on(records(x, logits, weight, b));
  auto r = LayerFunction::apply(x, logits, weight, b, std::optional<Tensor>(), straight_through,
                                allow_tf32, gemm_dtype);
  return {r[0], r[1], r[2]};
}

std::tuple<Tensor, Tensor, Tensor> forward_from_amax_autograd(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const Tensor& amax, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype) {
  const std::optional<Tensor> b = bias.has_value() && bias->defined() ? bias : std::nullopt;
  const Recording on(records(x, logits, weight, b));
  auto r = LayerFunction::apply(x, logits, weight, b, std::optional<Tensor>(amax.detach()),
                                straight_through, allow_tf32, gemm_dtype);
  return {r[0], r[1], r[2]};
}

// ---- autocast ----------------------------------------------------------------------------------

// Under torch.autocast("cuda", dtype=A), eager computes the reference module as
//   alpha in the logits' dtype L; x_q and the blend in P = promote(X, L); F.linear casting mixed,
//   weight and bias to A (weight and bias through autocast's cast cache); out in A,
// the casts recorded by autograd (../reference/autocast.md, checked against eager in the tests).
// Where P is x's dtype and the logits are fp32 or A -- the combinations qbl computes -- the
// operator runs with gemm_dtype = A: the prologue writes `mixed` in A (eager's mixed.to(A),
// bit for bit), weight and bias are cast as F.linear casts them, and their gradients flow back
// through those casts. Any other combination runs the reference's own ops, so that it too is
// what eager computes.

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

/// weight and bias cast to the autocast dtype `a` as F.linear casts them (autocast's cast cache).
std::pair<Tensor, std::optional<Tensor>> cast_parameters(ScalarType a, const Tensor& weight,
                                                         const std::optional<Tensor>& bias) {
  Tensor w = at::autocast::cached_cast(a, weight, c10::DeviceType::CUDA);
  if (!bias.has_value() || !bias->defined()) return {w, std::nullopt};
  return {w, at::autocast::cached_cast(a, *bias, c10::DeviceType::CUDA)};
}

/// The reference module's forward op by op (autograd records every op): the unfused path.
std::tuple<Tensor, Tensor, Tensor> reference_under_autocast(const Tensor& x, const Tensor& logits,
                                                            const Tensor& weight,
                                                            const std::optional<Tensor>& bias,
                                                            const Tensor* amax,
                                                            bool straight_through, ScalarType a) {
  const Tensor alpha = at::sigmoid(logits).unsqueeze(-1);
  const Tensor raw =
      amax != nullptr ? amax->detach().select(0, 0).to(x.scalar_type()) : x.detach().abs().max();
  const Tensor scale = raw.clamp_min(1e-8) / 127.0;
  const Tensor x_q = straight_through ? FakeQuantSTE::apply(x, scale)
                                      : at::clamp(at::round(x / scale), -127, 127) * scale;
  const Tensor mixed = alpha * x_q + (1.0 - alpha) * x;
  const auto [w, b] = cast_parameters(a, weight, bias);
  const Tensor out = at::linear(mixed.to(a), w, b);
  // [amax before the clamp, scale], as the fused path's stats.
  const Tensor stats = at::stack({raw.to(at::kFloat), scale.detach().to(at::kFloat)});
  return {out, mixed.detach(), stats};
}

std::tuple<Tensor, Tensor, Tensor> autocast_impl(const Tensor& x, const Tensor& logits,
                                                 const Tensor& weight,
                                                 const std::optional<Tensor>& bias,
                                                 const Tensor* amax, bool straight_through,
                                                 bool allow_tf32,
                                                 std::optional<ScalarType> gemm_dtype) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const ScalarType a = at::autocast::get_autocast_dtype(at::kCUDA);
  if (gemm_dtype.has_value() || !x.is_cuda() ||
      !fused_under_autocast(x.scalar_type(), logits.scalar_type(), a)) {
    if (gemm_dtype.has_value() || !x.is_floating_point() || !logits.is_floating_point())
      // Explicit GEMM types (or nothing autocast would touch): as called.
      return amax != nullptr ? forward_from_amax_op().call(x, logits, weight, bias, *amax,
                                                           straight_through, allow_tf32, gemm_dtype)
                             : forward_op().call(x, logits, weight, bias, straight_through,
                                                 allow_tf32, gemm_dtype);
    return reference_under_autocast(x, logits, weight, bias, amax, straight_through, a);
  }
  const auto [w, b] = cast_parameters(a, weight, bias);
  const std::optional<ScalarType> g =
      std::optional<ScalarType>(x.scalar_type() == at::kFloat ? a : x.scalar_type());
  return amax != nullptr
             ? forward_from_amax_op().call(x, logits, w, b, *amax, straight_through, allow_tf32, g)
             : forward_op().call(x, logits, w, b, straight_through, allow_tf32, g);
}

std::tuple<Tensor, Tensor, Tensor> forward_autocast(const Tensor& x, const Tensor& logits,
                                                    const Tensor& weight,
                                                    const std::optional<Tensor>& bias,
                                                    bool straight_through, bool allow_tf32,
                                                    std::optional<ScalarType> gemm_dtype) {
  return autocast_impl(x, logits, weight, bias, nullptr, straight_through, allow_tf32, gemm_dtype);
}

std::tuple<Tensor, Tensor, Tensor> forward_from_amax_autocast(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const Tensor& amax, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype) {
  return autocast_impl(x, logits, weight, bias, &amax, straight_through, allow_tf32, gemm_dtype);
}

}  // namespace qbl_torch

TORCH_LIBRARY(qbl, m) {
  m.def(
      "forward(Tensor x, Tensor logits, Tensor weight, Tensor? bias, bool straight_through=False, "
      "bool allow_tf32=False, ScalarType? gemm_dtype=None) -> (Tensor out, Tensor mixed, "
      "Tensor stats)");
  m.def(
      "backward(Tensor grad_out, Tensor x, Tensor logits, Tensor weight, Tensor mixed, "
      "Tensor stats, bool has_bias, bool[4] output_mask, bool straight_through=False, "
      "bool allow_tf32=False) -> (Tensor grad_x, Tensor grad_logits, Tensor grad_weight, "
      "Tensor grad_bias)");
  m.def("local_amax(Tensor x) -> Tensor");
  m.def(
      "forward_from_amax(Tensor x, Tensor logits, Tensor weight, Tensor? bias, Tensor amax, "
      "bool straight_through=False, bool allow_tf32=False, ScalarType? gemm_dtype=None) -> "
      "(Tensor out, Tensor mixed, Tensor stats)");
  m.def("clear_cache() -> ()", &qbl_torch::clear_cache);
  m.def("cache_info() -> (int[], str[])", &qbl_torch::cache_info);
}

TORCH_LIBRARY_IMPL(qbl, CUDA, m) {
  m.impl("forward", &qbl_torch::forward_cuda);
  m.impl("backward", &qbl_torch::backward_cuda);
  m.impl("local_amax", &qbl_torch::local_amax);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax_cuda);
}

// CPU tensors reach the same functions, whose first check says that x must be a CUDA tensor
// (rather than the dispatcher's "no kernel for CPU").
TORCH_LIBRARY_IMPL(qbl, CPU, m) {
  m.impl("forward", &qbl_torch::forward_cuda);
  m.impl("backward", &qbl_torch::backward_cuda);
  m.impl("local_amax", &qbl_torch::local_amax);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax_cuda);
}

TORCH_LIBRARY_IMPL(qbl, Autograd, m) {
  m.impl("forward", &qbl_torch::forward_autograd);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax_autograd);
}

TORCH_LIBRARY_IMPL(qbl, AutocastCUDA, m) {
  m.impl("forward", &qbl_torch::forward_autocast);
  m.impl("forward_from_amax", &qbl_torch::forward_from_amax_autocast);
}

// Importing qbl._C registers the operators above; the module itself is empty.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

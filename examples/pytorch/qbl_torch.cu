// examples/pytorch/qbl_torch.cu -- PyTorch binding of qbl::QuantBlendLinear.
//
// Built just-in-time by qbl_ext.load() (torch.utils.cpp_extension, pybind11). Everything the GPU
// runs comes from the library's own headers; this file only validates torch tensors, picks the
// stream and device, and owns the layer objects.
//
// Python API (module `qbl_torch`):
//
//   Layer(in_features, out_features, max_tokens, allow_tf32=False, dtype=None)
//       One qbl::QuantBlendLinear on the current CUDA device (dtype None = torch.float32).
//       .forward(x, logits, weight, bias=None) -> Tensor      (also callable: layer(x, ...))
//       .last_mixed(tokens=None) -> Tensor [tokens, in]        copy of device_mixed()
//       .last_scale() -> Tensor []   .last_amax() -> Tensor []  copies of the statistics
//       .in_features .out_features .max_tokens .allow_tf32 .dtype .device .last_tokens
//       .workspace_bytes                                       device bytes owned (outside
//                                                              torch's caching allocator)
//   forward(x, logits, weight, bias=None, allow_tf32=False) -> Tensor
//       Same computation through a per-process cache of Layer objects keyed by
//       (device index, in_features, out_features, dtype, allow_tf32); a layer is re-created with
//       max_tokens = next power of two when a call needs more tokens than it holds.
//   cache_info() -> list[dict]   clear_cache()   get_cached_layer(device, in, out, dtype=None,
//                                                                   allow_tf32=False) -> Layer|None
//
// Shapes: x [..., in] (2-D or 3-D), logits == x.shape[:-1], weight [out, in], bias [out] or None;
// the result is x.shape[:-1] + (out,). All tensors: CUDA, one device, one dtype (float32 for
// now), contiguous. Work is enqueued on torch's current CUDA stream of that device.
//
// Errors: argument checks are TORCH_CHECKs (RuntimeError / TypeError); qbl exceptions keep
// pybind11's standard mapping (qbl::invalid_argument -> ValueError, qbl::out_of_range ->
// IndexError) except qbl::cuda_error / qbl::cublas_error, which become qbl_torch.CudaError /
// qbl_torch.CublasError (both subclasses of RuntimeError).
//
// Autograd: none. Outputs never require grad; use it for inference (torch.no_grad semantics).

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <qbl/qbl.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace qbl_torch_ext {

// ------------------------------------------------------------------------------------------------
// dtype plumbing (float32, bfloat16, float16). Adding an element type takes three edits, here:
//   1. a qbl_element specialization, e.g.
//        template <> struct qbl_element<at::BFloat16> { using type = __nv_bfloat16; };
//      (and #include <cuda_bf16.h>),
//   2. the dtype in is_supported_dtype(),
//   3. a case in make_typed_layer().
// Everything else (validation, caching, the Python API) is dtype-agnostic.
// ------------------------------------------------------------------------------------------------

/// torch's C++ scalar type -> the element type qbl is instantiated with.
template <typename scalar_t>
struct qbl_element;

template <>
struct qbl_element<float> {
  using type = float;
};

template <>
struct qbl_element<at::BFloat16> {
  using type = __nv_bfloat16;
};

template <>
struct qbl_element<at::Half> {
  using type = __half;
};

inline bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

inline const char* supported_dtypes() { return "torch.float32, torch.bfloat16, torch.float16"; }

// ------------------------------------------------------------------------------------------------
// Small helpers.
// ------------------------------------------------------------------------------------------------

/// Throws a clear error if `stream` is capturing a CUDA graph: constructing a qbl layer
/// allocates (cudaMalloc) and synchronizes, neither of which is legal during capture.
inline void check_not_capturing(cudaStream_t stream, const std::string& what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) (void)cudaGetLastError();  // do not leave a stale error for torch
  TORCH_CHECK(err == cudaSuccess && status == cudaStreamCaptureStatusNone, "qbl_torch: ", what,
              " while a CUDA graph is being captured is not possible (it allocates device memory "
              "and synchronizes). Run one forward with the largest token count before capturing.");
}

/// Smallest power of two >= n (n >= 1).
inline std::int64_t round_up_pow2(std::int64_t n) {
  if (n > (std::int64_t{1} << 62)) return n;
  std::int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

/// Runs `make` (which constructs qbl objects); if cudaMalloc runs out of memory, returns torch's
/// cached blocks to the driver and tries once more. qbl allocates with cudaMalloc, outside torch's
/// caching allocator, so memory torch holds but does not use can block it. A failed CUDA call also
/// sets the runtime's "last error", which torch's launch checks would later report as their own:
/// it is cleared before the exception leaves.
template <typename Make>
auto with_oom_retry(Make&& make) -> decltype(make()) {
  try {
    return make();
  } catch (const qbl::out_of_memory&) {
    (void)cudaGetLastError();  // fall through to the retry
  } catch (...) {
    (void)cudaGetLastError();
    throw;
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
  try {
    return make();
  } catch (...) {
    (void)cudaGetLastError();
    throw;
  }
}

// ------------------------------------------------------------------------------------------------
// Argument validation shared by Layer.forward and the module-level forward.
// ------------------------------------------------------------------------------------------------

struct Problem {
  std::int64_t tokens = 0;
  std::int64_t in = 0;
  std::int64_t out = 0;
  std::vector<std::int64_t> out_sizes;  // x.shape[:-1] + (out,)
};

/// "[2, 5, 64]". Shapes and integers in messages are formatted here: on the H200's torch 2.11
/// build, passing an IntArrayRef or an int64_t to TORCH_CHECK's message crashed the process.
inline std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

inline void check_operand(const char* who, const at::Tensor& t, const char* name,
                          const at::Tensor& x) {
  TORCH_CHECK(t.defined(), who, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.layout() == c10::kStrided, who, ": ", name, " must be a dense (strided) tensor");
  TORCH_CHECK(t.is_cuda(), who, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == x.device(), who, ": ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; all tensors must be on the same device");
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), who, ": ", name, " has dtype ",
                   t.scalar_type(), " but x has dtype ", x.scalar_type(),
                   "; all tensors must have the same dtype");
  TORCH_CHECK(t.is_contiguous(), who, ": ", name, " must be contiguous (call .contiguous())");
}

inline Problem check_problem(const char* who, const at::Tensor& x, const at::Tensor& logits,
                             const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.defined(), who, ": x is an undefined tensor");
  TORCH_CHECK(x.layout() == c10::kStrided, who, ": x must be a dense (strided) tensor");
  TORCH_CHECK(x.is_cuda(), who, ": x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK_TYPE(is_supported_dtype(x.scalar_type()), who, ": unsupported dtype ",
                   x.scalar_type(), "; supported: ", supported_dtypes());
  TORCH_CHECK(x.is_contiguous(), who, ": x must be contiguous (call .contiguous())");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, who,
              ": x must be 2-D [tokens, in] or 3-D [batch, seq, in], got shape ",
              shape_str(x.sizes()));
  check_operand(who, logits, "logits", x);
  check_operand(who, weight, "weight", x);

  Problem p;
  p.in = x.size(-1);
  const auto lead = x.sizes().slice(0, static_cast<std::size_t>(x.dim() - 1));
  TORCH_CHECK(logits.sizes() == lead, who,
              ": logits must have shape x.shape[:-1] = ", shape_str(lead), ", got ",
              shape_str(logits.sizes()));
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == p.in, who,
              ": weight must be [out_features, in_features] with in_features = x.shape[-1] = ",
              std::to_string(p.in), ", got ", shape_str(weight.sizes()));
  p.out = weight.size(0);
  if (bias.has_value() && bias->defined()) {
    check_operand(who, *bias, "bias", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == p.out, who,
                ": bias must be [out_features] = [", std::to_string(p.out), "] or None, got ",
                shape_str(bias->sizes()));
  }
  p.tokens = 1;
  for (const std::int64_t s : lead) p.tokens *= s;
  p.out_sizes.assign(lead.begin(), lead.end());
  p.out_sizes.push_back(p.out);
  return p;
}

inline const at::Tensor* bias_or_null(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? &*bias : nullptr;
}

// ------------------------------------------------------------------------------------------------
// The type-erased qbl layer.
// ------------------------------------------------------------------------------------------------

class LayerBase {
 public:
  virtual ~LayerBase() = default;
  /// All tensors validated; out is a fresh [tokens, out_features] tensor.
  virtual void forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
                       const at::Tensor* bias, at::Tensor& out, std::int64_t tokens,
                       cudaStream_t stream) = 0;
  virtual const void* device_mixed() const = 0;
  virtual const float* device_scale() const = 0;
  virtual const float* device_amax() const = 0;
  virtual std::size_t workspace_bytes() const = 0;
};

template <typename scalar_t>
class TypedLayer final : public LayerBase {
  using elem_t = typename qbl_element<scalar_t>::type;
  static_assert(sizeof(elem_t) == sizeof(scalar_t), "qbl element type must match torch's");

 public:
  TypedLayer(std::int64_t in, std::int64_t out, std::int64_t max_tokens, const qbl::Options& opt)
      : impl_(in, out, max_tokens, opt) {}

  void forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
               const at::Tensor* bias, at::Tensor& out, std::int64_t tokens,
               cudaStream_t stream) override {
    elem_t* out_ptr = reinterpret_cast<elem_t*>(out.mutable_data_ptr<scalar_t>());
    const elem_t* w = in_ptr(weight);
    const elem_t* b = bias ? in_ptr(*bias) : nullptr;
    // A view at an odd element offset can leave weight or bias at an alignment cuBLASLt has no
    // algorithm for (bf16 at 2 bytes), which qbl serves with its slower fallback GEMM; fresh
    // copies from torch's allocator are 256-byte aligned. `out` is always a fresh tensor.
    at::Tensor w_copy, b_copy;
    const bool aligned = is_aligned16(w) && (b == nullptr || is_aligned16(b));
    if (!aligned && !impl_.uses_cublaslt(w, b, out_ptr, tokens)) {
      w_copy = weight.clone();
      w = in_ptr(w_copy);
      if (bias) {
        b_copy = bias->clone();
        b = in_ptr(b_copy);
      }
    }
    impl_.forward(in_ptr(x), in_ptr(logits), w, b, out_ptr, tokens, stream);
  }
  const void* device_mixed() const override { return impl_.device_mixed(); }
  const float* device_scale() const override { return impl_.device_scale(); }
  const float* device_amax() const override { return impl_.device_amax(); }
  std::size_t workspace_bytes() const override {
    return qbl::QuantBlendLinear<elem_t>::workspace_bytes(impl_.in_features(), impl_.out_features(),
                                                          impl_.max_tokens(), impl_.options());
  }

 private:
  static bool is_aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

  static const elem_t* in_ptr(const at::Tensor& t) {
    return reinterpret_cast<const elem_t*>(t.const_data_ptr<scalar_t>());
  }

  qbl::QuantBlendLinear<elem_t> impl_;
};

inline std::unique_ptr<LayerBase> make_typed_layer(at::ScalarType dtype, std::int64_t in,
                                                   std::int64_t out, std::int64_t max_tokens,
                                                   const qbl::Options& opt) {
  switch (dtype) {
    case at::kFloat:
      return std::make_unique<TypedLayer<float>>(in, out, max_tokens, opt);
    case at::kBFloat16:
      return std::make_unique<TypedLayer<at::BFloat16>>(in, out, max_tokens, opt);
    case at::kHalf:
      return std::make_unique<TypedLayer<at::Half>>(in, out, max_tokens, opt);
    default:
      break;
  }
  TORCH_CHECK_TYPE(false, "qbl_torch: unsupported dtype ", dtype,
                   "; supported: ", supported_dtypes());
  return nullptr;  // unreachable
}

// ------------------------------------------------------------------------------------------------
// Layer: the Python-visible object.
// ------------------------------------------------------------------------------------------------

class Layer {
 public:
  Layer(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
        bool allow_tf32, at::ScalarType dtype)
      : in_(in_features),
        out_(out_features),
        max_tokens_(max_tokens),
        allow_tf32_(allow_tf32),
        dtype_(dtype) {
    TORCH_CHECK(in_features > 0 && out_features > 0,
                "qbl_torch.Layer: in_features and out_features must be positive, got ",
                std::to_string(in_features), " and ", std::to_string(out_features));
    TORCH_CHECK(max_tokens > 0, "qbl_torch.Layer: max_tokens must be positive, got ",
                std::to_string(max_tokens));
    TORCH_CHECK_TYPE(is_supported_dtype(dtype), "qbl_torch.Layer: unsupported dtype ", dtype,
                     "; supported: ", supported_dtypes());
    device_ = c10::cuda::current_device();
    c10::cuda::CUDAGuard guard(device_);
    check_not_capturing(at::cuda::getCurrentCUDAStream(device_).stream(),
                        "constructing a qbl_torch.Layer");
    qbl::Options options;  // library defaults (GEMM autotuning where the headers provide it)
    options.allow_tf32 = allow_tf32;
    // Construction plans (and may time) the GEMM on the device: let queued work finish first so
    // that it runs on an idle GPU. Construction is rare; it already allocates and synchronizes.
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    impl_ = with_oom_retry(
        [&] { return make_typed_layer(dtype, in_features, out_features, max_tokens, options); });
    // qbl's constructor zeroes its statistics with cudaMemset on the default stream, which is not
    // ordered with torch's side streams (created non-blocking): wait for it here, once.
    C10_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }

  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  ~Layer() {
    // Free on the layer's own device; never throw from here.
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    impl_.reset();
    if (switched) (void)cudaSetDevice(previous);
    (void)cudaGetLastError();
  }

  /// Layer.forward: validates, including that the tensors match this layer.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
    constexpr const char* who = "qbl_torch.Layer.forward";
    const Problem p = check_problem(who, x, logits, weight, bias);
    TORCH_CHECK(
        x.device().index() == device_, who, ": tensors are on ", x.device(),
        " but the layer was constructed on cuda:", std::to_string(static_cast<int>(device_)));
    TORCH_CHECK_TYPE(x.scalar_type() == dtype_, who, ": tensors have dtype ", x.scalar_type(),
                     " but the layer was constructed for ", dtype_);
    TORCH_CHECK(p.in == in_ && p.out == out_, who, ": weight is [", std::to_string(p.out), ", ",
                std::to_string(p.in), "] but the layer was constructed for [", std::to_string(out_),
                ", ", std::to_string(in_), "]");
    return run(p, x, logits, weight, bias);
  }

  /// Enqueues the forward of an already validated problem that matches this layer.
  at::Tensor run(const Problem& p, const at::Tensor& x, const at::Tensor& logits,
                 const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    if (p.tokens == 0) return at::empty(p.out_sizes, x.options());
    if (p.tokens > max_tokens_) {
      throw std::out_of_range(
          "qbl_torch.Layer.forward: " + std::to_string(p.tokens) +
          " tokens exceed this layer's max_tokens = " + std::to_string(max_tokens_));
    }
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device_).stream();
    at::Tensor out = at::empty({p.tokens, out_}, x.options());
    impl_->forward(x, logits, weight, bias_or_null(bias), out, p.tokens, stream);
    last_tokens_ = p.tokens;
    return out.view(p.out_sizes);
  }

  /// Copy of device_mixed() as [tokens, in_features] (default: the last forward's token count),
  /// enqueued on the current stream, so it is ordered after forwards on that stream.
  at::Tensor last_mixed(std::optional<std::int64_t> tokens) const {
    const std::int64_t n = tokens.value_or(last_tokens_);
    TORCH_CHECK(n >= 0 && n <= max_tokens_, "qbl_torch.Layer.last_mixed: tokens must be in [0, ",
                std::to_string(max_tokens_), "], got ", std::to_string(n));
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor mixed = at::empty({n, in_}, options(dtype_));
    if (n > 0) {
      C10_CUDA_CHECK(cudaMemcpyAsync(mixed.mutable_data_ptr(), impl_->device_mixed(),
                                     static_cast<std::size_t>(n * in_) * mixed.element_size(),
                                     cudaMemcpyDeviceToDevice,
                                     at::cuda::getCurrentCUDAStream(device_).stream()));
    }
    return mixed;
  }

  /// 0-dim float32 copy of device_scale() (last forward's scale).
  at::Tensor last_scale() const { return copy_stat(impl_->device_scale()); }

  /// 0-dim float32 copy of device_amax() (last forward's max |x|, before the clamp).
  at::Tensor last_amax() const { return copy_stat(impl_->device_amax()); }

  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  std::int64_t max_tokens() const { return max_tokens_; }
  std::int64_t last_tokens() const { return last_tokens_; }
  bool allow_tf32() const { return allow_tf32_; }
  at::ScalarType dtype() const { return dtype_; }
  c10::DeviceIndex device_index() const { return device_; }
  std::size_t workspace_bytes() const { return impl_->workspace_bytes(); }

 private:
  at::TensorOptions options(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, device_));
  }

  at::Tensor copy_stat(const float* src) const {
    c10::cuda::CUDAGuard guard(device_);
    at::Tensor t = at::empty(at::IntArrayRef{}, options(at::kFloat));
    C10_CUDA_CHECK(cudaMemcpyAsync(t.mutable_data_ptr(), src, sizeof(float),
                                   cudaMemcpyDeviceToDevice,
                                   at::cuda::getCurrentCUDAStream(device_).stream()));
    return t;
  }

  std::int64_t in_ = 0, out_ = 0, max_tokens_ = 0, last_tokens_ = 0;
  bool allow_tf32_ = false;
  at::ScalarType dtype_ = at::kFloat;
  c10::DeviceIndex device_ = 0;
  std::unique_ptr<LayerBase> impl_;
};

// ------------------------------------------------------------------------------------------------
// Module-level forward with a cache of layers.
// ------------------------------------------------------------------------------------------------

// (device index, in_features, out_features, dtype, allow_tf32)
using CacheKey = std::tuple<int, std::int64_t, std::int64_t, int, bool>;

/// Never destroyed: freeing CUDA / cuBLASLt objects from a static destructor at process exit can
/// run after the CUDA runtime has shut down.
inline std::map<CacheKey, std::shared_ptr<Layer>>& layer_cache() {
  static auto* cache = new std::map<CacheKey, std::shared_ptr<Layer>>();
  return *cache;
}

inline CacheKey make_key(int device, std::int64_t in, std::int64_t out, at::ScalarType dtype,
                         bool allow_tf32) {
  return CacheKey{device, in, out, static_cast<int>(dtype), allow_tf32};
}

at::Tensor module_forward(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, bool allow_tf32) {
  const Problem p = check_problem("qbl_torch.forward", x, logits, weight, bias);
  if (p.tokens == 0 || p.out == 0) return at::empty(p.out_sizes, x.options());
  TORCH_CHECK(p.in > 0, "qbl_torch.forward: in_features (x.shape[-1]) must be positive");

  const c10::DeviceIndex device = x.device().index();
  c10::cuda::CUDAGuard guard(device);
  auto& cache = layer_cache();
  const CacheKey key = make_key(device, p.in, p.out, x.scalar_type(), allow_tf32);
  auto it = cache.find(key);
  if (it == cache.end() || it->second->max_tokens() < p.tokens) {
    check_not_capturing(
        at::cuda::getCurrentCUDAStream(device).stream(),
        "creating or growing the cached qbl layer (to " + std::to_string(p.tokens) + " tokens)");
    if (it != cache.end()) {
      // Work already enqueued (on any stream) may still use the old layer's buffers: let it
      // finish before they are freed. Happens only when the token count grows.
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      cache.erase(it);  // frees now unless Python still holds the old Layer
    }
    auto layer =
        std::make_shared<Layer>(p.in, p.out, round_up_pow2(p.tokens), allow_tf32, x.scalar_type());
    it = cache.emplace(key, std::move(layer)).first;
  }
  return it->second->run(p, x, logits, weight, bias);
}

void clear_cache() {
  auto& cache = layer_cache();
  for (const auto& entry : cache) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(std::get<0>(entry.first)));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }
  cache.clear();
}

py::list cache_info() {
  py::list info;
  for (const auto& [key, layer] : layer_cache()) {
    py::dict d;
    d["device"] = std::get<0>(key);
    d["in_features"] = layer->in_features();
    d["out_features"] = layer->out_features();
    d["dtype"] = layer->dtype();
    d["allow_tf32"] = layer->allow_tf32();
    d["max_tokens"] = layer->max_tokens();
    d["workspace_bytes"] = layer->workspace_bytes();
    info.append(d);
  }
  return info;
}

std::shared_ptr<Layer> get_cached_layer(int device, std::int64_t in, std::int64_t out,
                                        std::optional<at::ScalarType> dtype, bool allow_tf32) {
  const auto it =
      layer_cache().find(make_key(device, in, out, dtype.value_or(at::kFloat), allow_tf32));
  return it == layer_cache().end() ? nullptr : it->second;
}

}  // namespace qbl_torch_ext

// ------------------------------------------------------------------------------------------------
// Python bindings.
// ------------------------------------------------------------------------------------------------

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using qbl_torch_ext::Layer;

  m.doc() =
      "PyTorch binding of qbl::QuantBlendLinear: out = Linear(alpha * fake_quant_int8(x) + "
      "(1 - alpha) * x), alpha = sigmoid(logits). Inference only (no autograd).";
  m.attr("qbl_version") = std::to_string(QBL_VERSION_MAJOR) + "." +
                          std::to_string(QBL_VERSION_MINOR) + "." +
                          std::to_string(QBL_VERSION_PATCH);

  // Module-local translators: tried before any global ones, so these always apply.
  py::register_local_exception<qbl::cuda_error>(m, "CudaError", PyExc_RuntimeError);
  py::register_local_exception<qbl::cublas_error>(m, "CublasError", PyExc_RuntimeError);

  py::class_<Layer, std::shared_ptr<Layer>>(
      m, "Layer",
      "One qbl::QuantBlendLinear (float32) on the current CUDA device, with its own workspace "
      "for up to max_tokens tokens. One instance serves one stream at a time.")
      .def(py::init([](std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
                       bool allow_tf32, std::optional<at::ScalarType> dtype) {
             return std::make_shared<Layer>(in_features, out_features, max_tokens, allow_tf32,
                                            dtype.value_or(at::kFloat));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("max_tokens"),
           py::arg("allow_tf32") = false, py::arg("dtype") = py::none())
      .def("forward", &Layer::forward, py::arg("x"), py::arg("logits"), py::arg("weight"),
           py::arg("bias") = py::none(),
           "out = Linear(quant_blend(x, logits)); x [..., in], logits x.shape[:-1], "
           "weight [out, in], bias [out] or None.")
      .def("__call__", &Layer::forward, py::arg("x"), py::arg("logits"), py::arg("weight"),
           py::arg("bias") = py::none())
      .def("last_mixed", &Layer::last_mixed, py::arg("tokens") = py::none(),
           "Copy of the last forward's `mixed` as [tokens, in_features] (default: that "
           "forward's token count).")
      .def("last_scale", &Layer::last_scale, "0-dim float32 copy of the last forward's scale.")
      .def("last_amax", &Layer::last_amax, "0-dim float32 copy of the last forward's max |x|.")
      .def_property_readonly("in_features", &Layer::in_features)
      .def_property_readonly("out_features", &Layer::out_features)
      .def_property_readonly("max_tokens", &Layer::max_tokens)
      .def_property_readonly("last_tokens", &Layer::last_tokens)
      .def_property_readonly("allow_tf32", &Layer::allow_tf32)
      .def_property_readonly("dtype", &Layer::dtype)
      .def_property_readonly("device",
                             [](const Layer& l) { return at::Device(at::kCUDA, l.device_index()); })
      .def_property_readonly("workspace_bytes", &Layer::workspace_bytes)
      .def("__repr__", [](const Layer& l) {
        return "qbl_torch.Layer(in_features=" + std::to_string(l.in_features()) +
               ", out_features=" + std::to_string(l.out_features()) +
               ", max_tokens=" + std::to_string(l.max_tokens()) +
               ", allow_tf32=" + (l.allow_tf32() ? "True" : "False") +
               ", device=cuda:" + std::to_string(static_cast<int>(l.device_index())) + ")";
      });

  m.def("forward", &qbl_torch_ext::module_forward, py::arg("x"), py::arg("logits"),
        py::arg("weight"), py::arg("bias") = py::none(), py::arg("allow_tf32") = false,
        "Layer.forward through a per-process cache of layers keyed by (device, in_features, "
        "out_features, dtype, allow_tf32); grows max_tokens to the next power of two on demand.");
  m.def("clear_cache", &qbl_torch_ext::clear_cache,
        "Synchronizes the devices involved and drops every cached layer.");
  m.def("cache_info", &qbl_torch_ext::cache_info, "One dict per cached layer.");
  m.def("get_cached_layer", &qbl_torch_ext::get_cached_layer, py::arg("device"),
        py::arg("in_features"), py::arg("out_features"), py::arg("dtype") = py::none(),
        py::arg("allow_tf32") = false, "The cached Layer for that key, or None.");
}

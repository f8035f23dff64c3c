// What the binding's files share. The operators (schema in ops.cpp):
//
//   torch.ops.qbl.forward     out, and the `mixed` and stats = [amax, scale] the backward reads;
//                             with `stats` given, the sharded forward's second step (amax read
//                             from stats[0]); `activation` applies F.gelu / ... to x inside;
//                             `keep_mixed` says whether autograd keeps mixed for the backward
//   torch.ops.qbl.backward    the four gradients (mixed None: recomputed from x and stats); with
//                             gemm_dtype, the weight may be float32 (cast for dgrad inside)
//   torch.ops.qbl.local_amax  [max |act(x)|, 0] of a shard (the sharded forward's first step)
//
// A kernel per dispatch key, in a folder per backend, as torchvision's csrc/ops: the schema
// (ops.cpp) and the argument checks (checks.cpp) are shared; cpu/ holds the CPU kernels (eager's
// CPU arithmetic, on qbl's element math), cuda/ the CUDA kernels (qbl's plans, cached per layer in
// layer_registry.cu, each activation's plans compiled in plans_<activation>.cu), autograd/ the
// autograd formula and autocast/ the AutocastCPU and AutocastCUDA kernels. Their fake
// implementations are registered from Python (qbl/_ops.py), so torch.compile traces them.
//
// This header and everything outside cuda/ is plain C++ that needs none of CUDA's headers: a torch
// without CUDA builds the package from them alone (setup.py), with QBL_WITH_CUDA undefined.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <qbl/types.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace qbl_torch {

using at::ScalarType;
using at::Tensor;

// ---- element types -----------------------------------------------------------------------------

/// The torch dtype of a C++ element type, and its name as Python writes it.
template <typename T>
struct DtypeOf;
template <>
struct DtypeOf<float> {
  static constexpr ScalarType value = at::kFloat;
  static constexpr const char* name = "torch.float32";
};
template <>
struct DtypeOf<__nv_bfloat16> {
  static constexpr ScalarType value = at::kBFloat16;
  static constexpr const char* name = "torch.bfloat16";
};
template <>
struct DtypeOf<__half> {
  static constexpr ScalarType value = at::kHalf;
  static constexpr const char* name = "torch.float16";
};

/// The dtypes of one layer: x's, the GEMM's, the logits'.
struct Dtypes {
  ScalarType x, gemm, logits;
  bool operator==(const Dtypes& o) const {
    return x == o.x && gemm == o.gemm && logits == o.logits;
  }
};

/// The dtypes of a qbl::LayerTypes.
template <typename T>
constexpr Dtypes dtypes_of() {
  return {DtypeOf<typename T::x_type>::value, DtypeOf<typename T::gemm_type>::value,
          DtypeOf<typename T::logits_type>::value};
}

/// Calls f(T{}) with the qbl::LayerTypes of qbl::SupportedTypes whose dtypes are `d`; returns
/// false (calling nothing) where none is.
template <typename F>
bool dispatch_layer_types(const Dtypes& d, F&& f) {
  bool done = false;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
    if (!done && dtypes_of<decltype(t)>() == d) {
      f(t);
      done = true;
    }
  });
  return done;
}

/// A type as a value (CUDA's 16-bit types are incomplete outside cuda/: no object of them).
template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls f(TypeTag<X>{}) with the C++ type X of x's dtype `x`, one of qbl::SupportedTypes' x
/// types; returns false (calling nothing) for any other.
template <typename F>
bool dispatch_x_type(ScalarType x, F&& f) {
  bool done = false;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
    using X = typename decltype(t)::x_type;
    if (!done && DtypeOf<X>::value == x) {
      f(TypeTag<X>{});
      done = true;
    }
  });
  return done;
}

inline bool supported(const Dtypes& d) {
  return dispatch_layer_types(d, [](auto) {});
}

/// "torch.float32, torch.bfloat16, ...": x's dtypes in qbl::SupportedTypes, each once.
inline std::string supported_x_dtypes() {
  std::string s;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
    const std::string name = DtypeOf<typename decltype(t)::x_type>::name;
    if (s.find(name) == std::string::npos) s += (s.empty() ? "" : ", ") + name;
  });
  return s;
}

// ---- tensors -----------------------------------------------------------------------------------

/// A tensor's data as a T*, nullptr for an undefined tensor.
template <typename T>
const T* const_data(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.const_data_ptr()) : nullptr;
}
template <typename T>
T* mutable_data(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.mutable_data_ptr()) : nullptr;
}

// ---- activations -------------------------------------------------------------------------------

/// The name of an activation in the operators' `activation` argument (qbl::activation_names).
inline const char* activation_name(qbl::Activation a) {
  return qbl::activation_names[static_cast<int>(a)];
}

/// Every activation's name, in qbl::Activation's order: the operator qbl::activations().
std::vector<std::string> activations();

/// The activation named `name`; ValueError naming the choices for any other.
qbl::Activation parse_activation(const char* op, c10::string_view name);

/// Eager's activation of h in h's dtype (at::gelu, ...; h itself for none), and its backward as
/// eager's autograd computes it from the gradient of y = eager_activation(h) (eager_ops.cpp).
Tensor eager_activation(const Tensor& h, qbl::Activation act);
Tensor eager_activation_backward(const Tensor& grad, const Tensor& h, const Tensor& y,
                                 qbl::Activation act);

/// Is an optional tensor argument given (present and defined)?
inline bool given(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

// ---- argument checks (checks.cpp) --------------------------------------------------------------
// Each raises torch's error type (TypeError for a dtype, ValueError for an unknown activation,
// RuntimeError otherwise) naming the operator, before any output is allocated: the CPU and CUDA
// kernels make the same checks, through check_forward and check_backward.

std::string shape_str(c10::IntArrayRef sizes);

/// The sizes that x, logits and weight give a call.
struct Problem {
  std::int64_t tokens, in_features, out_features;
  std::vector<std::int64_t> lead;  // x.shape[:-1]
  /// x.shape[:-1] + [out_features]: out's and grad_out's shape.
  std::vector<std::int64_t> out_sizes() const;
};

/// A forward's checked arguments.
struct ForwardProblem {
  Problem p;
  Dtypes dtypes;
  bool from_stats;  // stats given: amax is stats[0]
  bool has_bias;
};

/// A backward's checked arguments.
struct BackwardProblem {
  Problem p;
  Dtypes dtypes;
  ScalarType weight;  // the weight's dtype (float32 with a 16-bit gemm_dtype: cast inside)
  bool kept;          // mixed given (else recomputed where grad_weight needs it)
  bool want_bias;     // output_mask[3] and has_bias
};

/// Everything a forward's arguments must be: x dense with features last, logits x.shape[:-1],
/// weight [out, in], bias [out] or None, stats a float32 [2] or None, all on x's device; dtypes
/// one, or (gemm_dtype given, as the autocast kernels give it) weight and bias of the GEMM's dtype
/// or float32 -- one of qbl::SupportedTypes.
ForwardProblem check_forward(const char* op, const Tensor& x, const Tensor& logits,
                             const Tensor& weight, const std::optional<Tensor>& bias,
                             const std::optional<Tensor>& stats,
                             std::optional<ScalarType> gemm_dtype);
/// Everything a backward's arguments must be: the forward's, grad_out of out's shape and the GEMM's
/// dtype, mixed of x's shape and the GEMM's dtype or None, stats the forward's.
BackwardProblem check_backward(const char* op, const Tensor& grad_out, const Tensor& x,
                               const Tensor& logits, const Tensor& weight,
                               const std::optional<Tensor>& mixed, const Tensor& stats,
                               bool has_bias, std::array<bool, 4> mask,
                               std::optional<ScalarType> gemm_dtype);
/// x of local_amax: dense, of one of qbl::SupportedTypes' x dtypes.
void check_local_amax(const char* op, const Tensor& x);
/// The operators' "not computed" output: an empty [0] tensor of these options.
inline Tensor no_output(const at::TensorOptions& o) { return at::empty({0}, o); }

// ---- the operators (ops.cpp) -------------------------------------------------------------------

using ForwardSignature = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& stats, c10::string_view activation, bool keep_mixed,
    bool straight_through, bool allow_tf32, std::optional<ScalarType> gemm_dtype,
    bool plan_backward);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor& grad_out, const Tensor& x, const Tensor& logits, const Tensor& weight,
    const std::optional<Tensor>& mixed, const Tensor& stats, bool has_bias,
    std::array<bool, 4> output_mask, c10::string_view activation, bool straight_through,
    bool allow_tf32, std::optional<ScalarType> gemm_dtype);

// The operators as the dispatcher knows them, for calls below the autograd and autocast keys.
const c10::TypedOperatorHandle<ForwardSignature>& forward_op();
const c10::TypedOperatorHandle<BackwardSignature>& backward_op();

// ---- the layer cache (cuda/layer_registry.cu; empty without CUDA) -------------------------------

/// Synchronizes the devices that hold layers, then frees every cached layer and side stream.
void clear_cache();
/// [device, in, out, tf32, backward, max_tokens, forward workspace, backward workspace] and
/// [x dtype, gemm dtype, logits dtype, activation] per live layer.
std::tuple<std::vector<std::int64_t>, std::vector<std::string>> cache_info();

}  // namespace qbl_torch

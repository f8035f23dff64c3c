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
// one file per concern, as torchvision's csrc/ops: the schema (ops.cpp), argument checks
// (checks.cpp), the cached plans (layer_registry.cu, with each activation's plans compiled in
// plans_<activation>.cu), the CUDA kernels (cuda_kernels.cu), the autograd formula
// (autograd_kernel.cpp) and the autocast kernel (autocast_kernel.cpp). Their
// fake implementations are registered from Python (qbl/_ops.py), so torch.compile traces them.
//
// Host-only: the .cpp files compile without nvcc; the files that run qbl's plans include
// layer_registry.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <qbl/error.hpp>
#include <qbl/types.hpp>

#include <cuda_runtime_api.h>

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

/// Calls f(X{}) with the C++ type of x's dtype `x`, one of qbl::SupportedTypes' x types; returns
/// false (calling nothing) for any other.
template <typename F>
bool dispatch_x_type(ScalarType x, F&& f) {
  bool done = false;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
    using X = typename decltype(t)::x_type;
    if (!done && DtypeOf<X>::value == x) {
      f(X{});
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

/// The activations' names in the operators' `activation` argument, qbl::Activation's order.
inline constexpr const char* activation_names[] = {"none", "gelu", "gelu_tanh", "relu", "silu"};

inline const char* activation_name(qbl::Activation a) {
  return activation_names[static_cast<int>(a)];
}

/// The activation named `name`; ValueError naming the choices for any other.
qbl::Activation parse_activation(const char* op, c10::string_view name);

/// Is an optional tensor argument given (present and defined)?
inline bool given(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

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

// ---- argument checks (checks.cpp) --------------------------------------------------------------

std::string shape_str(c10::IntArrayRef sizes);

/// The sizes that x, logits and weight give a call.
struct Problem {
  std::int64_t tokens, in_features, out_features;
  std::vector<std::int64_t> lead;  // x.shape[:-1]
};

/// x dense on a CUDA device with features last, logits x.shape[:-1], weight [out, in], all on x's
/// device.
Problem check_problem(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight);
/// `t` dense on x's device.
void check_dense(const char* op, const Tensor& t, const char* name, const Tensor& x);
/// `t` of dtype `want`, which is `whose`'s.
void check_dtype(const char* op, const Tensor& t, const char* name, ScalarType want,
                 const char* whose);
/// `d` one of qbl::SupportedTypes.
void check_supported(const char* op, const Dtypes& d);
/// The forward's dtypes: one, or (gemm_dtype given, as the autocast kernel gives it) the GEMM's,
/// with x and logits as they come and weight and bias as check_parameter_dtypes takes them.
Dtypes forward_dtypes(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight,
                      const std::optional<Tensor>& bias, std::optional<ScalarType> gemm_dtype);
/// With a GEMM dtype given: weight of that dtype or float32 (autocast's master weight, which the
/// operators cast to it), bias of weight's dtype.
void check_parameter_dtypes(const char* op, const Tensor& weight, const std::optional<Tensor>& bias,
                            ScalarType gemm);
/// bias dense on x's device, [out_features].
void check_bias(const char* op, const Tensor& bias, const Tensor& x, std::int64_t out_features);
/// stats a contiguous float32 [2] tensor on x's device; `what` says whose it must be.
void check_stats(const char* op, const Tensor& stats, const Tensor& x, const char* what);

// ---- the operators (ops.cpp) -------------------------------------------------------------------

using ForwardSignature = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor& x, const Tensor& logits, const Tensor& weight, const std::optional<Tensor>& bias,
    const std::optional<Tensor>& stats, c10::string_view activation, bool keep_mixed,
    bool straight_through, bool allow_tf32, std::optional<ScalarType> gemm_dtype);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor& grad_out, const Tensor& x, const Tensor& logits, const Tensor& weight,
    const std::optional<Tensor>& mixed, const Tensor& stats, bool has_bias,
    std::array<bool, 4> output_mask, c10::string_view activation, bool straight_through,
    bool allow_tf32, std::optional<ScalarType> gemm_dtype);

// The operators as the dispatcher knows them, for calls below the autograd and autocast keys.
const c10::TypedOperatorHandle<ForwardSignature>& forward_op();
const c10::TypedOperatorHandle<BackwardSignature>& backward_op();

// ---- autograd (autograd_kernel.cpp) ------------------------------------------------------------

/// Would autograd record a forward of these inputs (grad mode on and an input requiring grad)?
bool records(const Tensor& x, const Tensor& logits, const Tensor& weight,
             const std::optional<Tensor>& bias);
/// True on this thread while the autograd kernel runs a forward that autograd records (below that
/// kernel grad mode is off, so the CUDA kernel cannot tell by itself).
bool recorded_by_autograd();

// ---- the layer cache (layer_registry.cu) -------------------------------------------------------

/// Synchronizes the devices that hold layers, then frees every cached layer and side stream.
void clear_cache();
/// [device, in, out, tf32, backward, max_tokens, forward workspace, backward workspace] and
/// [x dtype, gemm dtype, logits dtype, activation] per live layer.
std::tuple<std::vector<std::int64_t>, std::vector<std::string>> cache_info();

}  // namespace qbl_torch

// qbl/types.hpp -- the element types qbl supports, as one list: the plans check against it, a
// binding dispatches over it and the tests are parameterized by it; and the activations' values.
//
//   qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
//     using T = decltype(t);   // a qbl::LayerTypes<X, G, L>
//     if (matches<typename T::x_type, typename T::gemm_type, typename T::logits_type>()) ...
//   });
//
// Host-only: a plain C++ translation unit can include it, without CUDA's headers (the lists name
// CUDA's 16-bit types and need no definition of them).
#pragma once

#include <type_traits>

// As cuda_bf16.h and cuda_fp16.h declare them.
struct __nv_bfloat16;
struct __half;

namespace qbl {

/// A list of types, for compile-time iteration (for_each_type) and membership (contains_type).
template <typename... T>
struct TypeList {};

/// The element types of one layer: X for x (and grad_x), G for the GEMM (mixed, weight, bias, out
/// and their gradients), L for the logits (and grad_logits).
template <typename X, typename G = X, typename L = X>
struct LayerTypes {
  using x_type = X;
  using gemm_type = G;
  using logits_type = L;
};

/// Every element-type combination of a layer: one type throughout (float, __nv_bfloat16,
/// __half), or fp32 x with a bf16 or fp16 GEMM and the logits in fp32 or in the GEMM's type --
/// what PyTorch's autocast hands a layer (fp32 activations, a 16-bit gate). In each of them the
/// blend's promoted type is X.
using SupportedTypes =
    TypeList<LayerTypes<float>, LayerTypes<__nv_bfloat16>, LayerTypes<__half>,
             LayerTypes<float, __nv_bfloat16, float>,
             LayerTypes<float, __nv_bfloat16, __nv_bfloat16>, LayerTypes<float, __half, float>,
             LayerTypes<float, __half, __half>>;

/// The input activations (qbl/activation.cuh's types Identity, Gelu, GeluTanh, Relu, Silu: each
/// has `kind`, and qbl::Activations lists them in this order), as values: what a binding chooses
/// at run time maps onto those types.
enum class Activation { identity, gelu, gelu_tanh, relu, silu };

/// Their names, in Activation's order, as a binding shows them: PyTorch's (F.gelu, F.gelu with
/// approximate="tanh", F.relu, F.silu), and "none" for the identity.
inline constexpr const char* activation_names[] = {"none", "gelu", "gelu_tanh", "relu", "silu"};
inline constexpr int activation_count =
    static_cast<int>(sizeof activation_names / sizeof activation_names[0]);

/// Calls f(T{}) for each T of the list, in order.
template <typename... T, typename F>
constexpr void for_each_type(TypeList<T...>, F&& f) {
  (f(T{}), ...);
}

/// Is T one of the list's types?
template <typename List, typename T>
inline constexpr bool contains_type = false;
template <typename... Ts, typename T>
inline constexpr bool contains_type<TypeList<Ts...>, T> = (std::is_same_v<Ts, T> || ...);

/// Is <X, G, L> a supported combination (one of SupportedTypes)?
template <typename X, typename G = X, typename L = X>
inline constexpr bool supported_types = contains_type<SupportedTypes, LayerTypes<X, G, L>>;

}  // namespace qbl

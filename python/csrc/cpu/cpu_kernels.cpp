// The operators' CPU kernels: what eager PyTorch computes for the reference module on the CPU.
//
// `mixed`, amax, scale and grad_x are bit for bit eager's CPU arithmetic. The element math is
// qbl's own (qbl/element_math.hpp, shared with the CUDA kernels) wherever its bits are eager's on
// the CPU too -- the fake quantizer, the blend, 1 - alpha, grad_x and the terms of grad_logits --
// plus the CPU's scale (eager's CPU kernel divides amax by 127, its CUDA kernel multiplies by
// fl(1/127): scale_from_amax_cpu). The rest is eager's own kernels, called on the same tensors as
// the reference module calls them: sigmoid and the input activations, because eager's CPU
// kernels round an element differently in the vectorized body of their loop than in its scalar
// tail (so their bits depend on the tensor's size and the thread count, and only the same call
// reproduces them), and the GEMMs and the bias gradient, which then are eager's bit for bit.
// grad_logits (per-token sums over the features, accumulated here in double) is held to bounds.
//
// Threaded with at::parallel_for over token rows; the element loops are plain C++ that the
// compiler vectorizes (built with -ffp-contract=off: no fused multiply-add where eager rounds
// twice, in any clone).

#include "../qbl_torch.h"

#include <qbl/element_math.hpp>

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// The element math's conversions for torch's 16-bit types, bit for bit c10's (round to nearest
// even, NaN to c10's quiet NaN) in branch-free integer and float operations, which the compiler
// vectorizes where it cannot vectorize c10's own. The half conversions are c10's algorithm
// (Maratyszcza's FP16, which c10 uses), restated here.
namespace qbl_torch::cpu_bits {
inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace qbl_torch::cpu_bits

namespace qbl::detail {
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 v) {
  return qbl_torch::cpu_bits::from_bits(std::uint32_t{v.x} << 16);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  const std::uint32_t u = qbl_torch::cpu_bits::bits(v);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<std::uint16_t>(v != v ? 0x7fc0u : rounded),
                       c10::BFloat16::from_bits());
}
template <>
inline float to_float<c10::Half>(c10::Half v) {
  using namespace qbl_torch::cpu_bits;
  const std::uint32_t w = std::uint32_t{v.x} << 16;
  const std::uint32_t two_w = w + w;
  const float normal = from_bits((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  const float subnormal = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits((w & 0x80000000u) | (two_w < (1u << 27) ? bits(subnormal) : bits(normal)));
}
template <>
inline c10::Half from_float<c10::Half>(float v) {
  using namespace qbl_torch::cpu_bits;
  const float to_inf = from_bits(0x77800000u), to_zero = from_bits(0x08800000u);
  float base = (std::fabs(v) * to_inf) * to_zero;
  const std::uint32_t w = bits(v);
  const std::uint32_t shl1_w = w + w;
  std::uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t b = bits(base);
  const std::uint32_t nonsign = ((b >> 13) & 0x7c00u) + (b & 0x0fffu);
  const std::uint32_t h = ((w & 0x80000000u) >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign);
  return c10::Half(static_cast<std::uint16_t>(h), c10::Half::from_bits());
}
}  // namespace qbl::detail

namespace qbl_torch {
namespace {

using qbl::detail::from_float;
using qbl::detail::to_float;

/// The CPU's element type of each of qbl::SupportedTypes' (CUDA's 16-bit types by name only).
template <typename T>
struct CpuElement {
  using type = T;
};
template <>
struct CpuElement<__nv_bfloat16> {
  using type = c10::BFloat16;
};
template <>
struct CpuElement<__half> {
  using type = c10::Half;
};
template <typename T>
using cpu_t = typename CpuElement<T>::type;

/// Calls f(X{}, G{}, L{}) with the CPU element types of the layer types whose dtypes are `d`
/// (checked to be one of qbl::SupportedTypes before).
template <typename F>
void dispatch_cpu_types(const Dtypes& d, F&& f) {
  dispatch_layer_types(d, [&](auto t) {
    using T = decltype(t);
    f(cpu_t<typename T::x_type>{}, cpu_t<typename T::gemm_type>{},
      cpu_t<typename T::logits_type>{});
  });
}

/// Where a kernel's own ATen calls run: as the plain ops, below autograd (the autograd kernel
/// records the operator, not its parts) and below autocast (the autocast kernels have chosen the
/// dtypes), whatever the caller's thread has switched on.
struct BackendScope {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

/// Rows per task of at::parallel_for: about at::internal::GRAIN_SIZE elements.
std::int64_t row_grain(std::int64_t features) {
  return std::max<std::int64_t>(1, at::internal::GRAIN_SIZE / std::max<std::int64_t>(features, 1));
}

// The element loops, one row at a time: compiled once per x86-64 microarchitecture level where the
// compiler can (GCC's and Clang's target_clones, chosen when the library loads), each
// auto-vectorized for its vector width -- the same IEEE operations in every clone (no fast math,
// no contraction; -fno-trapping-math only lets the compiler if-convert), so the same bits on every
// machine.
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define QBL_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "arch=x86-64-v2", "default")))
#else
#define QBL_CPU_CLONES
#endif

/// The integer max of qbl::abs_bits over n elements, from `acc`.
template <typename X>
QBL_CPU_CLONES std::uint32_t abs_bits_max(const X* x, std::int64_t n, std::uint32_t acc) {
  for (std::int64_t i = 0; i < n; ++i) acc = std::max(acc, qbl::abs_bits(to_float(x[i])));
  return acc;
}

/// One row of mixed = alpha * fake_quant(x) + (1 - alpha) * x: the blend in X (the promoted dtype
/// of every supported combination), alpha and 1 - alpha in L, mixed rounded once to G (eager's
/// mixed.to(G) under autocast).
template <typename X, typename G>
QBL_CPU_CLONES void blend_row(const X* x, float scale, float alpha, float one_minus_alpha, G* mixed,
                              std::int64_t n) {
  for (std::int64_t f = 0; f < n; ++f) {
    const float v = to_float(x[f]);
    mixed[f] =
        from_float<G>(qbl::blend<X>(v, qbl::fake_quant<X>(v, scale), alpha, one_minus_alpha));
  }
}

/// One row of grad_x from g_mixed: eager's autograd of the blend, bit for bit.
template <typename X, typename G>
QBL_CPU_CLONES void grad_x_row(const G* g, float alpha, float one_minus_alpha, float zero_grad,
                               qbl::QuantGrad quant_grad, X* grad_x, std::int64_t n) {
  for (std::int64_t f = 0; f < n; ++f)
    grad_x[f] = from_float<X>(
        qbl::detail::grad_x_from<X>(to_float(g[f]), alpha, one_minus_alpha, zero_grad, quant_grad));
}

/// One row's sums of RN_X(g * x_q) and RN_X(g * x) (the two terms of grad_alpha), accumulated in
/// double in `lanes` partial sums each, added up in a fixed order: far below eager's own error.
template <typename X, typename G>
QBL_CPU_CLONES void grad_alpha_sums_row(const G* g, const X* x, float scale, std::int64_t n,
                                        double* sum_q, double* sum_x) {
  constexpr int lanes = 16;
  double q[lanes] = {}, p[lanes] = {};
  std::int64_t f = 0;
  for (; f + lanes <= n; f += lanes) {
    for (int j = 0; j < lanes; ++j) {
      const float gv = to_float(g[f + j]), v = to_float(x[f + j]);
      q[j] += qbl::grad_product<X>(gv, qbl::fake_quant<X>(v, scale));
      p[j] += qbl::grad_product<X>(gv, v);
    }
  }
  for (int j = 0; f < n; ++f, ++j) {
    const float gv = to_float(g[f]), v = to_float(x[f]);
    q[j] += qbl::grad_product<X>(gv, qbl::fake_quant<X>(v, scale));
    p[j] += qbl::grad_product<X>(gv, v);
  }
  double tq = 0.0, tx = 0.0;
  for (int j = 0; j < lanes; ++j) tq += q[j], tx += p[j];
  *sum_q = tq, *sum_x = tx;
}

/// max |x| over n elements, NaN-propagating: the integer max of qbl::abs_bits (unsigned order of
/// the bits of |v| is the order of |v|, with every NaN above +Inf), where a float max drops NaN.
template <typename X>
float amax_of(const X* x, std::int64_t n) {
  const std::uint32_t bits = at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, std::uint32_t{0},
      [&](std::int64_t begin, std::int64_t end, std::uint32_t acc) {
        return abs_bits_max(x + begin, end - begin, acc);
      },
      [](std::uint32_t a, std::uint32_t b) { return std::max(a, b); });
  return qbl::from_abs_bits(bits);
}

/// mixed for every row (blend_row), threaded over rows.
template <typename X, typename G, typename L>
void blend_rows(const X* x, const L* alpha, float scale, G* mixed, std::int64_t tokens,
                std::int64_t features) {
  at::parallel_for(0, tokens, row_grain(features), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      const float a = to_float(alpha[t]);
      blend_row<X, G>(x + t * features, scale, a, qbl::one_minus<L>(a), mixed + t * features,
                      features);
    }
  });
}

/// grad_x (of the activation's output, where there is one) and grad_logits from g_mixed, threaded
/// over rows. grad_logits: the two sums of grad_alpha_sums_row, then eager's roundings of the sums
/// and its sigmoid_backward formula. Either output may be null (not wanted).
template <typename X, typename G, typename L>
void grad_rows(const G* g_mixed, const X* x, const L* alpha, float scale, qbl::QuantGrad quant_grad,
               X* grad_x, L* grad_logits, std::int64_t tokens, std::int64_t features) {
  const float zero_grad = qbl::detail::zero_quant_grad(scale);
  at::parallel_for(0, tokens, row_grain(features), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t t = begin; t < end; ++t) {
      const float a = to_float(alpha[t]);
      const float one_minus_a = qbl::one_minus<L>(a);
      const G* g = g_mixed + t * features;
      if (grad_x != nullptr)
        grad_x_row<X, G>(g, a, one_minus_a, zero_grad, quant_grad, grad_x + t * features, features);
      if (grad_logits != nullptr) {
        double sum_q = 0.0, sum_x = 0.0;
        grad_alpha_sums_row<X, G>(g, x + t * features, scale, features, &sum_q, &sum_x);
        const float grad_alpha =
            qbl::grad_alpha_value<X, L>(static_cast<float>(sum_q), static_cast<float>(sum_x));
        grad_logits[t] = from_float<L>(qbl::grad_logit_value<L>(grad_alpha, a));
      }
    }
  });
}

/// `t` in dtype `g` as autocast's cast makes it (round to nearest even, strides kept), or `t`.
Tensor in_dtype(const Tensor& t, ScalarType g) { return t.scalar_type() == g ? t : t.to(g); }

/// The layer's mixed (of dtype g, x's shape) from the activation's output `x` (contiguous), the
/// logits' sigmoid `alpha` (contiguous) and `scale`.
Tensor blend(const Tensor& x, const Tensor& alpha, float scale, const Dtypes& dtypes) {
  Tensor mixed = at::empty(x.sizes(), x.options().dtype(dtypes.gemm));
  const std::int64_t features = x.size(-1);
  dispatch_cpu_types(dtypes, [&](auto x_t, auto g_t, auto l_t) {
    using X = decltype(x_t);
    using G = decltype(g_t);
    using L = decltype(l_t);
    blend_rows<X, G, L>(x.const_data_ptr<X>(), alpha.const_data_ptr<L>(), scale,
                        mixed.mutable_data_ptr<G>(), x.numel() / features, features);
  });
  return mixed;
}

// The forward: eager's activation and sigmoid on the tensors as given, then amax (or stats[0]),
// the scale and the blend here, then eager's F.linear on mixed of x's shape.
std::tuple<Tensor, Tensor, Tensor> forward_cpu(
    const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const std::optional<Tensor>& bias_in, const std::optional<Tensor>& stats_in,
    c10::string_view activation, bool keep_mixed, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype, bool plan_backward) {
  constexpr const char* op = "qbl.forward";
  // The forward is the same for these; autograd reads the first two, a float32 GEMM on the CPU is
  // exact float32 whatever allow_tf32 says (TF32 is a CUDA tensor-core format), and the CPU plans
  // nothing.
  (void)keep_mixed, (void)straight_through, (void)allow_tf32, (void)plan_backward;
  const qbl::Activation act = parse_activation(op, activation);
  const ForwardProblem f =
      check_forward(op, x_in, logits_in, weight_in, bias_in, stats_in, gemm_dtype);
  const BackendScope scope;
  const auto g_opts = x_in.options().dtype(f.dtypes.gemm);
  Tensor stats =
      f.from_stats ? stats_in->clone() : at::zeros({2}, x_in.options().dtype(at::kFloat));
  if (f.p.tokens == 0)
    return {at::empty(f.p.out_sizes(), g_opts), at::empty(x_in.sizes(), g_opts), stats};

  const Tensor x = eager_activation(x_in, act).contiguous();
  const Tensor alpha = at::sigmoid(logits_in).contiguous();
  float* s = stats.mutable_data_ptr<float>();
  dispatch_cpu_types(f.dtypes, [&](auto x_t, auto, auto) {
    using X = decltype(x_t);
    if (!f.from_stats) s[0] = amax_of(x.const_data_ptr<X>(), x.numel());
    s[1] = qbl::scale_from_amax_cpu<X>(s[0]);
  });
  const Tensor mixed = blend(x, alpha, s[1], f.dtypes);
  const Tensor bias = f.has_bias ? in_dtype(*bias_in, f.dtypes.gemm) : Tensor();
  const Tensor out = at::linear(mixed, in_dtype(weight_in, f.dtypes.gemm), bias);
  return {out, mixed, stats};
}

// [max |act(x)| of this shard, 0] in float32: the first step of a sharded forward (as the CUDA
// kernel's: an integer MAX all-reduce of stats[0]'s bits is the NaN-propagating max).
Tensor local_amax_cpu(const Tensor& x_in, c10::string_view activation) {
  constexpr const char* op = "qbl.local_amax";
  const qbl::Activation act = parse_activation(op, activation);
  check_local_amax(op, x_in);
  const BackendScope scope;
  Tensor stats = at::zeros({2}, x_in.options().dtype(at::kFloat));
  const Tensor x = eager_activation(x_in, act).contiguous();
  dispatch_x_type(x.scalar_type(), [&](auto x_t) {
    using X = cpu_t<typename decltype(x_t)::type>;
    stats.mutable_data_ptr<float>()[0] = amax_of(x.const_data_ptr<X>(), x.numel());
  });
  return stats;
}

// The backward: g_mixed = grad_out @ W and the weight and bias gradients by eager's own calls
// (those of linear's autograd), grad_x and grad_logits here, the activation's backward by eager's.
std::tuple<Tensor, Tensor, Tensor, Tensor> backward_cpu(
    const Tensor& grad_out, const Tensor& x_in, const Tensor& logits_in, const Tensor& weight_in,
    const std::optional<Tensor>& mixed_in, const Tensor& stats, bool has_bias,
    std::array<bool, 4> mask, c10::string_view activation, bool straight_through, bool allow_tf32,
    std::optional<ScalarType> gemm_dtype) {
  constexpr const char* op = "qbl.backward";
  (void)allow_tf32;  // as in the forward
  const qbl::Activation act = parse_activation(op, activation);
  const BackwardProblem b = check_backward(op, grad_out, x_in, logits_in, weight_in, mixed_in,
                                           stats, has_bias, mask, gemm_dtype);
  const BackendScope scope;
  const std::int64_t tokens = b.p.tokens, n_in = b.p.in_features, n_out = b.p.out_features;
  const auto x_opts = x_in.options();
  const auto w_opts = x_opts.dtype(b.weight);
  // With no token the parameter gradients are sums of nothing: zeros.
  Tensor gx = no_output(x_opts), gl = no_output(x_opts.dtype(b.dtypes.logits));
  Tensor gw = mask[2] && tokens == 0 ? at::zeros(weight_in.sizes(), w_opts) : no_output(w_opts);
  Tensor gb = b.want_bias && tokens == 0 ? at::zeros({n_out}, w_opts) : no_output(w_opts);
  if (tokens == 0) {
    if (mask[0]) gx = at::empty(x_in.sizes(), x_opts);
    if (mask[1]) gl = at::empty(logits_in.sizes(), gl.options());
    return {gx, gl, gw, gb};
  }

  const bool dgrad = mask[0] || mask[1];
  const bool recompute = mask[2] && !b.kept;
  const Tensor g2 = grad_out.reshape({tokens, n_out});
  // The activation's output (x itself without one), where something reads it.
  const bool need_x = mask[1] || recompute || (mask[0] && act != qbl::Activation::identity);
  const Tensor x = need_x ? eager_activation(x_in, act).contiguous() : Tensor();
  const Tensor alpha = dgrad || recompute ? at::sigmoid(logits_in).contiguous() : Tensor();
  const float scale = stats.const_data_ptr<float>()[1];
  if (dgrad) {
    const Tensor g_mixed = at::mm(g2, in_dtype(weight_in, b.dtypes.gemm));
    Tensor gx_act = mask[0] ? at::empty(x_in.sizes(), x_opts) : Tensor();
    if (mask[1]) gl = at::empty(logits_in.sizes(), gl.options());
    const qbl::QuantGrad quant_grad =
        straight_through ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;
    dispatch_cpu_types(b.dtypes, [&](auto x_t, auto g_t, auto l_t) {
      using X = decltype(x_t);
      using G = decltype(g_t);
      using L = decltype(l_t);
      grad_rows<X, G, L>(g_mixed.const_data_ptr<G>(), mask[1] ? x.const_data_ptr<X>() : nullptr,
                         alpha.const_data_ptr<L>(), scale, quant_grad,
                         mask[0] ? gx_act.mutable_data_ptr<X>() : nullptr,
                         mask[1] ? gl.mutable_data_ptr<L>() : nullptr, tokens, n_in);
    });
    if (mask[0]) gx = eager_activation_backward(gx_act, x_in, x.defined() ? x : x_in, act);
  }
  if (mask[2]) {
    const Tensor mixed = b.kept ? *mixed_in : blend(x, alpha, scale, b.dtypes);
    gw = at::mm(g2.t(), mixed.reshape({tokens, n_in}));
  }
  if (b.want_bias) gb = g2.sum(0);
  // The gradients of a float32 weight and bias used through a 16-bit GEMM: the GEMM's, cast, as
  // autograd casts them back through autocast's cast.
  if (mask[2]) gw = in_dtype(gw, b.weight);
  if (b.want_bias) gb = in_dtype(gb, b.weight);
  return {gx, gl, gw, gb};
}

}  // namespace
}  // namespace qbl_torch

TORCH_LIBRARY_IMPL(qbl, CPU, m) {
  m.impl("forward", &qbl_torch::forward_cpu);
  m.impl("backward", &qbl_torch::backward_cpu);
  m.impl("local_amax", &qbl_torch::local_amax_cpu);
}

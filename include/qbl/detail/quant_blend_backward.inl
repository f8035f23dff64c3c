// Kernels and launcher bodies for qbl/quant_blend_backward.cuh.
#pragma once

#include <qbl/activation.cuh>
#include <qbl/detail/activation_table.cuh>
#include <qbl/detail/quant_blend_math.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>
#include <qbl/quant_blend_backward.cuh>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace qbl::detail {

inline constexpr int backward_block_threads = 256;
inline constexpr int backward_rows_per_block = backward_block_threads / 32;  // a warp per row
/// Vectors of a row each lane loads before it computes on them: independent loads in flight.
/// Tuned on an H200 (sm_90): the bf16 kernel then stays under 64 registers (benchmarks/HISTORY.md).
inline constexpr int backward_vectors_in_flight = 2;

/// The element kernel's compiled variants: MIXED, it writes a recomputed mixed; BOTH, it writes
/// both gradients, grad_x and grad_logits (training's usual call), so that its loop holds only
/// that path. Within a variant, which one gradient (or none, beside MIXED) a launch writes is a
/// run-time choice. Each variant runs with 16-byte vectors or, where a buffer or the row length
/// does not allow them, element by element. Listed once: the dispatch (backward_kernel_variant)
/// and the block limit (backward_max_blocks) both read this list.
struct BackwardKernelVariant {
  bool mixed;
  bool both;
};
inline constexpr BackwardKernelVariant backward_kernel_variants[] = {
    {false, false}, {false, true}, {true, false}, {true, true}};
inline constexpr int backward_kernel_variant_count =
    static_cast<int>(sizeof backward_kernel_variants / sizeof backward_kernel_variants[0]);

/// The variant that writes these outputs (a non-null pointer: wanted).
constexpr int backward_kernel_variant(bool grad_x, bool grad_logits, bool mixed) {
  for (int i = 0; i < backward_kernel_variant_count; ++i)
    if (backward_kernel_variants[i].mixed == mixed &&
        backward_kernel_variants[i].both == (grad_x && grad_logits))
      return i;
  return -1;
}

/// Does the element kernel read x to write these outputs: for grad_logits's sums, for a
/// recomputed mixed, and for grad_x where the activation's gradient reads its input?
template <typename Act>
QBL_HOST_DEVICE constexpr bool backward_reads_x(bool grad_x, bool grad_logits, bool mixed) {
  return grad_logits || mixed || (grad_x && ActivationTraits<Act>::grad_x_reads_x);
}

/// A compensated fp32 sum (Kahan's): each term's rounding error is carried into the next one, so
/// the result is within about 2u sum |terms| of the exact sum however many terms there are
/// (plain recursive summation: (n - 1) u). Once the running sum is infinite the compensation
/// stays 0, so the sum stays infinite (or NaN) as a plain sum would, instead of turning NaN.
struct CompensatedSum {
  float sum = 0.0f;
  float low = 0.0f;  ///< what `sum` overstates the exact sum by: the value is sum - low

  __device__ __forceinline__ void add(float v) {
    const float y = sub_rn(v, low);
    const float t = add_rn(sum, y);
    low = fabsf(t) < INFINITY ? sub_rn(sub_rn(t, sum), y) : 0.0f;
    sum = t;
  }
  /// Adds another lane's sum: the two sums by an exact two-sum (Knuth), the compensations after.
  /// Symmetric: a.merge(b) and b.merge(a) give the same bits (the two-sum's error is unique).
  __device__ __forceinline__ void merge(float other_sum, float other_low) {
    const float t = add_rn(sum, other_sum);
    const float b = sub_rn(t, sum);
    const float e = add_rn(sub_rn(sum, sub_rn(t, b)), sub_rn(other_sum, b));  // t + e exact
    low = add_rn(add_rn(low, other_low), fabsf(t) < INFINITY ? -e : 0.0f);
    sum = t;
  }
  __device__ __forceinline__ float value() const { return sub_rn(sum, low); }
};

/// The backward's vector arithmetic for x of type X, g_mixed of type G, logits of type L and
/// width N, given one row's gate and the launch's scale: `sums` adds a vector's RN_X(g * x_q)
/// and RN_X(g * x) to the two compensated sums, element by element; `grad_x` is grad_x_from for
/// each element. The general case runs qbl/element_math.hpp element by element (with the
/// division-free code of fake_quant_from_reciprocal); the products and sums are in X, the
/// promoted type of every supported combination.
template <typename X, typename G, typename L, int N, typename Enable = void>
struct QuantBlendGradMath {
  float scale, y, alpha, one_minus_alpha, zero_grad;
  QuantGrad quant_grad;
  __device__ __forceinline__ QuantBlendGradMath(float s, float a, float oma, QuantGrad qg)
      : scale(s),
        y(code_reciprocal(s)),
        alpha(a),
        one_minus_alpha(oma),
        zero_grad(zero_quant_grad(s)),
        quant_grad(qg) {}
  __device__ __forceinline__ void sums(const Vec<G, N>& g, const Vec<X, N>& x, CompensatedSum& q,
                                       CompensatedSum& s) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float gj = to_float(g.v[j]), xj = to_float(x.v[j]);
      q.add(grad_product<X>(gj, fake_quant_from_reciprocal<X>(xj, scale, y)));
      s.add(grad_product<X>(gj, xj));
    }
  }
  __device__ __forceinline__ Vec<X, N> grad_x(const Vec<G, N>& g) const {
    Vec<X, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j)
      out.v[j] = from_float<X>(
          grad_x_from<X>(to_float(g.v[j]), alpha, one_minus_alpha, zero_grad, quant_grad));
    return out;
  }
};

/// bf16 / fp16 vectors of an even width, one type throughout: the forward's codes
/// (QuantBlendMath::codes), then every product on packed pairs with one rounding each -- eager's
/// fp32-then-round bits for T operands (the forward's argument; test_quant_blend_math checks all
/// 2^32 operand pairs of the packed product and sum) -- and the exact widened products added
/// pairwise within the vector (three levels: the T-rounded products are far coarser than the
/// fp32 error) before one compensated addition per vector.
template <typename T, int N>
struct QuantBlendGradMath<T, T, T, N, std::enable_if_t<(N > 1 && N % 2 == 0 && sizeof(T) == 2)>> {
  using P = Pair<T>;
  using T2 = typename P::type;
  static constexpr int pairs = N / 2;
  QuantBlendMath<T, T, T, N> forward;
  T2 alpha2, one_minus_alpha2, zero_grad2;
  QuantGrad quant_grad;
  __device__ __forceinline__ QuantBlendGradMath(float s, float a, float oma, QuantGrad qg)
      : alpha2(P::broadcast(a)),
        one_minus_alpha2(P::broadcast(oma)),
        zero_grad2(P::broadcast(zero_quant_grad(s))),
        quant_grad(qg) {
    forward.set_scale(s);
  }
  static __device__ __forceinline__ float pairwise(float (&v)[pairs]) {
#pragma unroll
    for (int width = pairs / 2; width > 0; width /= 2)
#pragma unroll
      for (int i = 0; i < width; ++i) v[i] = add_rn(v[i], v[i + width]);
    return v[0];
  }
  __device__ __forceinline__ void sums(const Vec<T, N>& g, const Vec<T, N>& x, CompensatedSum& q,
                                       CompensatedSum& s) const {
    T2 code[pairs], g2[pairs], x2[pairs];
    forward.codes(x, code);
    std::memcpy(g2, &g, sizeof g2);
    std::memcpy(x2, &x, sizeof x2);
    float pq[pairs], px[pairs];
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const float2 a = P::to_float2(P::mul(g2[p], P::mul(code[p], forward.scale2)));
      const float2 b = P::to_float2(P::mul(g2[p], x2[p]));
      pq[p] = add_rn(a.x, a.y);
      px[p] = add_rn(b.x, b.y);
    }
    q.add(pairwise(pq));
    s.add(pairwise(px));
  }
  __device__ __forceinline__ Vec<T, N> grad_x(const Vec<T, N>& g) const {
    T2 g2[pairs], r[pairs];
    std::memcpy(g2, &g, sizeof g2);
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const T2 direct = P::mul(g2[p], one_minus_alpha2);
      r[p] = P::add(quant_grad == QuantGrad::straight_through ? P::mul(g2[p], alpha2) : zero_grad2,
                    direct);
    }
    Vec<T, N> out;
    std::memcpy(&out, r, sizeof out);
    return out;
  }
};

/// One warp per token row: each lane takes every 32nd vector of the row, U at a time (all their
/// loads issued before any use), computes grad_x for them and its share of the two sums, and the
/// warp combines the shares in a fixed butterfly order (each merge an exact two-sum, so both lanes
/// of a pair get the same bits), so the result is deterministic. A block's warps take rows
/// blockIdx.x * 8 + warp, then every gridDim.x * 8-th: where the activation has a table, the
/// launch has only as many blocks as are resident at once, so that each fills its table once.
///
/// With an activation Act, x holds the activation's input h: the sums and the recomputed mixed
/// use act(h) rounded to X (as the forward did), and grad_x becomes the gradient of h,
/// RN_X(act'(RN_X(grad_x), h)). MIXED: the row's `mixed` is recomputed from act(h), the gate and
/// the scale with the forward's own arithmetic (QuantBlendMath) and written for the wgrad GEMM, so
/// a forward need not keep it; g_mixed may then be null (no grad_x, no grad_logits wanted).
///
/// grad_x may alias g_mixed where they are one type (each element is read before the same thread
/// writes it, and a lane's loads of a group all come before its stores), so neither carries
/// __restrict__.
///
/// MIXED and BOTH: the variant (backward_kernel_variants).
template <typename X, typename G, typename L, typename Act, bool MIXED, int N, bool BOTH>
QBL_KERNEL void __launch_bounds__(
    backward_block_threads,
    table_min_blocks<ActivationTable<Act, X, true>::enabled>(backward_block_threads))
    quant_blend_backward_kernel(const G* g_mixed, const X* __restrict__ x,
                                const L* __restrict__ logits, const float* __restrict__ scale_in,
                                X* grad_x, L* __restrict__ grad_logits, G* __restrict__ mixed,
                                std::int64_t tokens, std::int64_t features, QuantGrad quant_grad) {
  constexpr int U = backward_vectors_in_flight;
  const bool want_logits = BOTH || grad_logits != nullptr, want_x = BOTH || grad_x != nullptr;
  const bool want_g = want_logits || want_x;
  const bool read_x = backward_reads_x<Act>(want_x, want_logits, MIXED);
  using Table = ActivationTable<Act, X, true>;
  __shared__ Table table;
  fill_table(table, want_x);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t cols = features / N;
  auto one_row = [&](std::int64_t row) {
    const auto* gv = reinterpret_cast<const Vec<G, N>*>(g_mixed) + row * cols;
    const auto* xv = reinterpret_cast<const Vec<X, N>*>(x) + row * cols;
    auto* out = reinterpret_cast<Vec<X, N>*>(grad_x) + row * cols;
    auto* mv = reinterpret_cast<Vec<G, N>*>(mixed) + row * cols;
    Vec<G, N> g[U];
    Vec<X, N> xs[U];
    auto load = [&](std::int64_t c0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const std::int64_t c = c0 + 32 * u;
        if (c < cols) {
          if (want_g) g[u] = gv[c];
          if (read_x) xs[u] = xv[c];
        }
      }
    };
    // The first group's loads go out before the gate's exp and the scale's reciprocal.
    load(lane);
    const float scale = *scale_in;
    const float alpha = sigmoid<L>(to_float(logits[row]));
    const QuantBlendGradMath<X, G, L, N> math(scale, alpha, one_minus<L>(alpha), quant_grad);
    using Forward = QuantBlendMath<X, G, L, N>;
    Forward forward;
    typename Forward::Gate gate{};
    if constexpr (MIXED) {
      forward.set_scale(scale);
      gate = Forward::gate(logits[row]);
    }
    CompensatedSum sum_q, sum_x;
    for (std::int64_t c0 = lane; c0 < cols; c0 += 32 * U) {
      if (c0 != lane) load(c0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const std::int64_t c = c0 + 32 * u;
        if (c >= cols) break;
        // act(h), what the forward quantized, and the gradient of h: where both are needed, the
        // activation is evaluated (or looked up) once for both.
        Vec<X, N> xa, gh;
        if (want_x && (want_logits || MIXED)) {
          activate_both_vec<Act>(math.grad_x(g[u]), xs[u], xa, gh, table);
        } else if (want_x) {
          gh = activate_backward_vec<Act>(math.grad_x(g[u]), xs[u], table);
        } else {
          xa = activate_vec<Act>(xs[u], table);
        }
        if (want_logits) math.sums(g[u], xa, sum_q, sum_x);
        if (want_x) out[c] = gh;
        if constexpr (MIXED) mv[c] = forward.apply(xa, gate);
      }
    }
    if (!want_logits) return;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float qs = __shfl_xor_sync(0xffffffffu, sum_q.sum, offset);
      const float ql = __shfl_xor_sync(0xffffffffu, sum_q.low, offset);
      const float xs_ = __shfl_xor_sync(0xffffffffu, sum_x.sum, offset);
      const float xl = __shfl_xor_sync(0xffffffffu, sum_x.low, offset);
      sum_q.merge(qs, ql);
      sum_x.merge(xs_, xl);
    }
    if (lane == 0)
      grad_logits[row] = from_float<L>(
          grad_logit_value<L>(grad_alpha_value<X, L>(sum_q.value(), sum_x.value()), alpha));
  };
  const std::int64_t first =
      static_cast<std::int64_t>(blockIdx.x) * backward_rows_per_block + threadIdx.x / 32;
  if constexpr (Table::enabled) {
    const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * backward_rows_per_block;
    for (std::int64_t row = first; row < tokens; row += step) one_row(row);
  } else if (first < tokens) {
    one_row(first);  // a block per 8 rows
  }
}

/// Variant V of the element kernel at width N.
template <typename X, typename G, typename L, typename Act, int V, int N>
inline constexpr auto backward_kernel =
    quant_blend_backward_kernel<X, G, L, Act, backward_kernel_variants[V].mixed, N,
                                backward_kernel_variants[V].both>;

/// Calls f(std::integral_constant<int, V>{}) for the variant V == variant.
template <typename F, int... V>
void with_backward_kernel_variant(int variant, F&& f, std::integer_sequence<int, V...>) {
  ((V == variant ? f(std::integral_constant<int, V>{}) : void()), ...);
}

/// Calls f(kernel) for every variant of backward_kernel_variants at both widths.
template <typename X, typename G, typename L, typename Act, typename F, int... V>
void with_each_backward_kernel(F&& f, std::integer_sequence<int, V...>) {
  constexpr int N = vec16<X>;
  (f(reinterpret_cast<const void*>(backward_kernel<X, G, L, Act, V, N>)), ...);
  (f(reinterpret_cast<const void*>(backward_kernel<X, G, L, Act, V, 1>)), ...);
}

/// The element kernel's launch: the variant its outputs call for, with 16-byte vectors where
/// every buffer it touches allows them.
template <typename X, typename G, typename L, typename Act>
cudaError_t launch_backward_kernel(const G* g_mixed, const X* x, const L* logits,
                                   const float* scale, X* grad_x, L* grad_logits, G* mixed,
                                   std::int64_t tokens, std::int64_t features, QuantGrad quant_grad,
                                   int max_blocks, cudaStream_t stream) {
  constexpr int N = vec16<X>;
  const bool want_x = grad_x != nullptr, want_logits = grad_logits != nullptr;
  const bool write_mixed = mixed != nullptr;
  const bool vec =
      features % N == 0 && (!(want_x || want_logits) || is_aligned(g_mixed, N * sizeof(G))) &&
      (!backward_reads_x<Act>(want_x, want_logits, write_mixed) || is_aligned(x, 16)) &&
      (!want_x || is_aligned(grad_x, 16)) && (!write_mixed || is_aligned(mixed, N * sizeof(G)));
  std::int64_t blocks = ceil_div<std::int64_t>(tokens, backward_rows_per_block);
  // Without a table each warp takes one row only: the kernel returns after it.
  if (ActivationTable<Act, X, true>::enabled && max_blocks > 0 && blocks > max_blocks)
    blocks = max_blocks;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  with_backward_kernel_variant(
      backward_kernel_variant(want_x, want_logits, write_mixed),
      [&](auto v) {
        const auto kernel = vec ? backward_kernel<X, G, L, Act, decltype(v)::value, N>
                                : backward_kernel<X, G, L, Act, decltype(v)::value, 1>;
        kernel<<<grid, backward_block_threads, 0, stream>>>(
            g_mixed, x, logits, scale, grad_x, grad_logits, mixed, tokens, features, quant_grad);
      },
      std::make_integer_sequence<int, backward_kernel_variant_count>{});
  return cudaGetLastError();
}

/// The most blocks a backward launch for these types needs (its max_blocks argument): where the
/// activation has a table, as many as the multiprocessors hold at once of the least resident
/// variant of backward_kernel_variants (at either width), so that each block fills its table
/// once and then loops over rows; else 0 (a block per 8 rows). Asked of the current device once
/// per plan (no synchronization).
template <typename X, typename G, typename L, typename Act>
cudaError_t backward_max_blocks(int* max_blocks) {
  *max_blocks = 0;
  if constexpr (ActivationTable<Act, X, true>::enabled) {
    int sms = 0;
    QBL_CUDA_RETURN_IF_ERROR(sm_count(&sms));
    int least = 0;
    cudaError_t error = cudaSuccess;
    auto resident = [&](const void* kernel) {
      int r = 0;
      if (error == cudaSuccess)
        error =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, kernel, backward_block_threads, 0);
      least = least == 0 ? r : std::min(least, r);
    };
    with_each_backward_kernel<X, G, L, Act>(
        resident, std::make_integer_sequence<int, backward_kernel_variant_count>{});
    QBL_CUDA_RETURN_IF_ERROR(error);
    *max_blocks = sms * std::max(least, 1);
  }
  return cudaSuccess;
}

/// The quant-blend stage's backward (qbl::quant_blend_backward's body; the backward plan calls it
/// directly): grad_x (of the activation's input, with an activation) and grad_logits from
/// g_mixed, and -- where `mixed` is not null -- the forward's mixed recomputed for the wgrad GEMM.
/// Checks, then one kernel launch.
template <typename X, typename G, typename L, typename Act = Identity>
cudaError_t launch_quant_blend_backward(const G* d_g_mixed, const X* d_x, const L* d_logits,
                                        const float* d_scale, X* d_grad_x, L* d_grad_logits,
                                        G* d_mixed, std::int64_t tokens, std::int64_t features,
                                        QuantGrad quant_grad, int max_blocks, cudaStream_t stream) {
  if (tokens < 0 || features <= 0) return cudaErrorInvalidValue;
  const bool want_x = d_grad_x != nullptr, want_logits = d_grad_logits != nullptr;
  if (tokens == 0 || !(want_x || want_logits || d_mixed != nullptr)) return cudaSuccess;
  if (((want_x || want_logits) && d_g_mixed == nullptr) || d_logits == nullptr ||
      d_scale == nullptr ||
      (backward_reads_x<Act>(want_x, want_logits, d_mixed != nullptr) && d_x == nullptr))
    return cudaErrorInvalidValue;
  // In place only where the two are one type: grad_x over g_mixed itself.
  if constexpr (!std::is_same_v<G, X>) {
    if (want_x && static_cast<const void*>(d_grad_x) == static_cast<const void*>(d_g_mixed))
      return cudaErrorInvalidValue;
  }
  return launch_backward_kernel<X, G, L, Act>(d_g_mixed, d_x, d_logits, d_scale, d_grad_x,
                                              d_grad_logits, d_mixed, tokens, features, quant_grad,
                                              max_blocks, stream);
}

}  // namespace qbl::detail

namespace qbl {

template <typename X, typename G, typename L, typename Act>
cudaError_t quant_blend_backward(const detail::type_identity_t<G>* d_g_mixed, const X* d_x,
                                 const detail::type_identity_t<L>* d_logits, const float* d_scale,
                                 detail::type_identity_t<X>* d_grad_x,
                                 detail::type_identity_t<L>* d_grad_logits, std::int64_t tokens,
                                 std::int64_t features, QuantGrad quant_grad, cudaStream_t stream) {
  static_assert(supported_types<X, G, L>,
                "quant_blend_backward: one element type, or fp32 x with a bf16/fp16 g_mixed "
                "(logits fp32 or of g_mixed's type)");
  static_assert(detail::is_activation<Act>, "quant_blend_backward: Act is one of qbl::Activations");
  int max_blocks = 0;
  QBL_CUDA_RETURN_IF_ERROR((detail::backward_max_blocks<X, G, L, Act>(&max_blocks)));
  return detail::launch_quant_blend_backward<X, G, L, Act>(
      d_g_mixed, d_x, d_logits, d_scale, d_grad_x, d_grad_logits, static_cast<G*>(nullptr), tokens,
      features, quant_grad, max_blocks, stream);
}

}  // namespace qbl

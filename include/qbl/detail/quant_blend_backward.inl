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

namespace qbl::detail {

inline constexpr int backward_block_threads = 256;
inline constexpr int backward_rows_per_block = backward_block_threads / 32;  // a warp per row
/// Vectors of a row each lane loads before it computes on them: independent loads in flight. Two
/// keep the bf16 kernel under 64 registers, so that a multiprocessor holds 32 of its warps: enough
/// bytes in flight for long rows, and rows enough for short ones.
inline constexpr int backward_vectors_in_flight = 2;

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
/// BOTH: grad_x and grad_logits are both wanted (training's usual call), known when compiling,
/// so that the loop holds only that path: the same arithmetic, fewer instructions (sm_90 PTX,
/// bf16: 289 against 231 for the identity, 1034 against 563 with GELU's table, whose three
/// lookup paths the runtime flags kept).
template <typename X, typename G, typename L, typename Act, bool MIXED, int N, bool BOTH>
QBL_KERNEL void __launch_bounds__(
    backward_block_threads,
    table_min_blocks<ActivationTable<Act, X, true>::enabled>(backward_block_threads))
    quant_blend_backward_kernel(const G* g_mixed, const X* __restrict__ x,
                                const L* __restrict__ logits, const float* __restrict__ scale_in,
                                X* grad_x, L* __restrict__ grad_logits, G* __restrict__ mixed,
                                std::int64_t tokens, std::int64_t features, QuantGrad quant_grad) {
  constexpr int U = backward_vectors_in_flight;
  constexpr bool identity = std::is_same_v<Act, Identity>;
  const bool want_logits = BOTH || grad_logits != nullptr, want_x = BOTH || grad_x != nullptr;
  const bool want_g = want_logits || want_x;
  // x (h) is read for the sums, for the recomputed mixed and for the activation's backward.
  const bool read_x = want_logits || MIXED || (want_x && !identity);
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

template <typename X, typename G, typename L, typename Act, bool MIXED, int N>
cudaError_t launch_quant_blend_backward_kernel(const G* g_mixed, const X* x, const L* logits,
                                               const float* scale, X* grad_x, L* grad_logits,
                                               G* mixed, std::int64_t tokens, std::int64_t features,
                                               QuantGrad quant_grad, int max_blocks,
                                               cudaStream_t stream) {
  std::int64_t blocks = ceil_div<std::int64_t>(tokens, backward_rows_per_block);
  // Without a table each warp takes one row only: the kernel returns after it.
  if (ActivationTable<Act, X, true>::enabled && max_blocks > 0 && blocks > max_blocks)
    blocks = max_blocks;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if (grad_x != nullptr && grad_logits != nullptr) {
    quant_blend_backward_kernel<X, G, L, Act, MIXED, N, true>
        <<<grid, backward_block_threads, 0, stream>>>(
            g_mixed, x, logits, scale, grad_x, grad_logits, mixed, tokens, features, quant_grad);
  } else {
    quant_blend_backward_kernel<X, G, L, Act, MIXED, N, false>
        <<<grid, backward_block_threads, 0, stream>>>(
            g_mixed, x, logits, scale, grad_x, grad_logits, mixed, tokens, features, quant_grad);
  }
  return cudaGetLastError();
}

template <typename X, typename G, typename L, typename Act, bool MIXED>
cudaError_t launch_quant_blend_backward_width(const G* g_mixed, const X* x, const L* logits,
                                              const float* scale, X* grad_x, L* grad_logits,
                                              G* mixed, std::int64_t tokens, std::int64_t features,
                                              QuantGrad quant_grad, int max_blocks,
                                              cudaStream_t stream) {
  constexpr int N = vec16<X>;
  const bool want_g = grad_x != nullptr || grad_logits != nullptr;
  const bool read_x =
      grad_logits != nullptr || MIXED || (grad_x != nullptr && !std::is_same_v<Act, Identity>);
  const bool vec = features % N == 0 && (!want_g || is_aligned(g_mixed, N * sizeof(G))) &&
                   (!read_x || is_aligned(x, 16)) &&
                   (grad_x == nullptr || is_aligned(grad_x, 16)) &&
                   (!MIXED || is_aligned(mixed, N * sizeof(G)));
  return vec ? launch_quant_blend_backward_kernel<X, G, L, Act, MIXED, N>(
                   g_mixed, x, logits, scale, grad_x, grad_logits, mixed, tokens, features,
                   quant_grad, max_blocks, stream)
             : launch_quant_blend_backward_kernel<X, G, L, Act, MIXED, 1>(
                   g_mixed, x, logits, scale, grad_x, grad_logits, mixed, tokens, features,
                   quant_grad, max_blocks, stream);
}

/// The most blocks a backward launch for these types needs (its max_blocks argument): where the
/// activation has a table, as many as the multiprocessors hold at once of the least resident
/// kernel variant, so that each block fills its table once and then loops over rows; else 0 (a
/// block per 8 rows). Asked of the current device once per plan (no synchronization).
template <typename X, typename G, typename L, typename Act>
cudaError_t backward_max_blocks(int* max_blocks) {
  *max_blocks = 0;
  if constexpr (ActivationTable<Act, X, true>::enabled) {
    int sms = 0;
    QBL_CUDA_RETURN_IF_ERROR(sm_count(&sms));
    constexpr int N = vec16<X>;
    const void* kernels[] = {
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, false, N, false>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, true, N, false>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, false, 1, false>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, true, 1, false>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, false, N, true>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, true, N, true>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, false, 1, true>),
        reinterpret_cast<const void*>(quant_blend_backward_kernel<X, G, L, Act, true, 1, true>)};
    int least = 0;
    for (const void* k : kernels) {
      int resident = 0;
      QBL_CUDA_RETURN_IF_ERROR(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, k, backward_block_threads, 0));
      least = least == 0 ? resident : std::min(least, resident);
    }
    *max_blocks = sms * std::max(least, 1);
  }
  return cudaSuccess;
}

/// The quant-blend stage's backward (qbl::quant_blend_backward's body; the backward plan calls it
/// directly): grad_x (of the activation's input, with an activation) and grad_logits from
/// g_mixed, and -- where `mixed` is not null -- the forward's mixed recomputed for the wgrad GEMM.
/// Checks, then one kernel with 16-byte vectors where every buffer allows them.
template <typename X, typename G, typename L, typename Act = Identity>
cudaError_t launch_quant_blend_backward(const G* d_g_mixed, const X* d_x, const L* d_logits,
                                        const float* d_scale, X* d_grad_x, L* d_grad_logits,
                                        G* d_mixed, std::int64_t tokens, std::int64_t features,
                                        QuantGrad quant_grad, int max_blocks, cudaStream_t stream) {
  if (tokens < 0 || features <= 0) return cudaErrorInvalidValue;
  const bool want_g = d_grad_x != nullptr || d_grad_logits != nullptr;
  if (tokens == 0 || (!want_g && d_mixed == nullptr)) return cudaSuccess;
  const bool read_x = d_grad_logits != nullptr || d_mixed != nullptr ||
                      (d_grad_x != nullptr && !std::is_same_v<Act, Identity>);
  if ((want_g && d_g_mixed == nullptr) || d_logits == nullptr || d_scale == nullptr ||
      (read_x && d_x == nullptr))
    return cudaErrorInvalidValue;
  // In place only where the two are one type: grad_x over g_mixed itself.
  if constexpr (!std::is_same_v<G, X>) {
    if (d_grad_x != nullptr &&
        static_cast<const void*>(d_grad_x) == static_cast<const void*>(d_g_mixed))
      return cudaErrorInvalidValue;
  }
  return d_mixed != nullptr ? launch_quant_blend_backward_width<X, G, L, Act, true>(
                                  d_g_mixed, d_x, d_logits, d_scale, d_grad_x, d_grad_logits,
                                  d_mixed, tokens, features, quant_grad, max_blocks, stream)
                            : launch_quant_blend_backward_width<X, G, L, Act, false>(
                                  d_g_mixed, d_x, d_logits, d_scale, d_grad_x, d_grad_logits,
                                  nullptr, tokens, features, quant_grad, max_blocks, stream);
}

// ---- the bias gradient: column sums ----------------------------------------------------------

inline constexpr int column_sum_threads = 256;
inline constexpr int column_sum_lanes = 32;  ///< column vectors per block (one warp's width)
inline constexpr int column_sum_row_lanes = column_sum_threads / column_sum_lanes;
inline constexpr int column_sum_rows_in_flight = 8;  ///< rows each thread loads before adding
inline constexpr int column_sum_max_splits = 64;     ///< row ranges (bias_grad_workspace_bytes)
static_assert(qbl::bias_grad_workspace_bytes(1) == column_sum_max_splits * sizeof(float),
              "bias_grad_workspace_bytes must hold column_sum_max_splits partial sums per column");

/// Row ranges for a column sum of [rows, cols] in vectors of N on `sms` multiprocessors: enough
/// blocks for about four per multiprocessor, each range at least 64 rows (one pass of eight rows
/// per row lane), at most column_sum_max_splits; 1 without a workspace.
inline int column_sum_splits(std::int64_t rows, std::int64_t cols, int n, int sms, bool workspace) {
  if (!workspace || rows <= 0) return 1;
  const std::int64_t col_blocks =
      ceil_div<std::int64_t>(ceil_div<std::int64_t>(cols, n), column_sum_lanes);
  const std::int64_t want = ceil_div<std::int64_t>(std::int64_t{sms} * 4, col_blocks);
  return static_cast<int>(std::clamp<std::int64_t>(
      std::min<std::int64_t>(want, ceil_div<std::int64_t>(rows, 64)), 1, column_sum_max_splits));
}

/// Column sums of g [rows, cols] over the rows of range blockIdx.y (of gridDim.y equal ranges):
/// 32 lanes of N consecutive columns each, 8 row lanes taking every 8th row (4 rows' loads in
/// flight), fp32 sums combined over the row lanes in order. One range: the result, rounded to T
/// (and accumulated); several: fp32 partials[range][col] for column_sum_finish.
template <typename T, int N>
QBL_KERNEL void __launch_bounds__(column_sum_threads)
    column_sum_kernel(const T* __restrict__ g, std::int64_t rows, std::int64_t cols,
                      float* __restrict__ partials, T* __restrict__ out, bool accumulate) {
  __shared__ float shared[column_sum_row_lanes][column_sum_lanes * N];
  const int lane = static_cast<int>(threadIdx.x % column_sum_lanes);
  const int row_lane = static_cast<int>(threadIdx.x / column_sum_lanes);
  const std::int64_t col0 =
      (static_cast<std::int64_t>(blockIdx.x) * column_sum_lanes + lane) * N;  // first column
  const std::int64_t per_range = ceil_div<std::int64_t>(rows, gridDim.y);
  const std::int64_t r0 = static_cast<std::int64_t>(blockIdx.y) * per_range;
  const std::int64_t r1 = r0 + per_range < rows ? r0 + per_range : rows;
  float acc[N] = {};
  if (col0 < cols) {
    constexpr int R = column_sum_rows_in_flight;
    for (std::int64_t r = r0 + row_lane; r < r1; r += column_sum_row_lanes * R) {
      Vec<T, N> v[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const std::int64_t rr = r + k * column_sum_row_lanes;
        if (rr < r1) v[k] = *reinterpret_cast<const Vec<T, N>*>(g + rr * cols + col0);
      }
#pragma unroll
      for (int k = 0; k < R; ++k) {
        if (r + k * column_sum_row_lanes >= r1) break;
#pragma unroll
        for (int j = 0; j < N; ++j) acc[j] = add_rn(acc[j], to_float(v[k].v[j]));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) shared[row_lane][lane * N + j] = acc[j];
  __syncthreads();
  // Thread i of the block finishes columns i, i + 256, ... of the block's 32 * N.
  for (int k = static_cast<int>(threadIdx.x); k < column_sum_lanes * N; k += column_sum_threads) {
    const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * column_sum_lanes * N + k;
    if (c >= cols) continue;
    float total = shared[0][k];
    for (int r = 1; r < column_sum_row_lanes; ++r) total = add_rn(total, shared[r][k]);
    if (gridDim.y > 1) {
      partials[static_cast<std::int64_t>(blockIdx.y) * cols + c] = total;
    } else {
      float v = round_to<T>(total);
      if (accumulate) v = add_rn(to_float(out[c]), v);
      out[c] = from_float<T>(v);
    }
  }
}

/// out[c] = RN_T(sum over ranges of partials[range][c]) (and accumulated): one warp per column,
/// lane l adding ranges l, l + 32 in order, the lanes combined in a fixed butterfly --
/// deterministic, and one round trip to L2 instead of one per range.
inline constexpr int column_sum_finish_threads = 256;

template <typename T>
QBL_KERNEL void __launch_bounds__(column_sum_finish_threads)
    column_sum_finish_kernel(const float* __restrict__ partials, int splits, std::int64_t cols,
                             T* __restrict__ out, bool accumulate) {
  const std::int64_t c =
      static_cast<std::int64_t>(blockIdx.x) * (column_sum_finish_threads / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (c >= cols) return;
  float total = 0.0f;
  for (int s = lane; s < splits; s += 32) total = add_rn(total, partials[s * cols + c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    total = add_rn(total, __shfl_xor_sync(0xffffffffu, total, offset));
  if (lane != 0) return;
  float v = round_to<T>(total);
  if (accumulate) v = add_rn(to_float(out[c]), v);
  out[c] = from_float<T>(v);
}

template <typename T, int N>
cudaError_t launch_column_sum_kernels(const T* g, T* out, std::int64_t rows, std::int64_t cols,
                                      bool accumulate, float* partials, int splits,
                                      cudaStream_t stream) {
  const std::int64_t col_blocks =
      ceil_div<std::int64_t>(ceil_div<std::int64_t>(cols, N), column_sum_lanes);
  if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  column_sum_kernel<T, N>
      <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(splits)), column_sum_threads,
         0, stream>>>(g, rows, cols, partials, out, accumulate);
  QBL_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (splits == 1) return cudaSuccess;
  const std::int64_t blocks = ceil_div<std::int64_t>(cols, column_sum_finish_threads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  column_sum_finish_kernel<T>
      <<<static_cast<unsigned>(blocks), column_sum_finish_threads, 0, stream>>>(
          partials, splits, cols, out, accumulate);
  return cudaGetLastError();
}

/// qbl::bias_grad with the multiprocessor count given (the backward plan asks for it once).
template <typename T>
cudaError_t launch_bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens,
                             std::int64_t outs, bool accumulate, void* d_workspace, int sms,
                             cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr) return cudaErrorInvalidValue;
  if (d_workspace != nullptr && !is_aligned(d_workspace, sizeof(float)))
    return cudaErrorInvalidValue;
  constexpr int V = vec16<T>;
  const bool vec = outs % V == 0 && is_aligned(d_grad_out, 16);
  const int n = vec ? V : 1;
  const int splits = column_sum_splits(tokens, outs, n, sms, d_workspace != nullptr);
  auto* partials = static_cast<float*>(d_workspace);
  return vec ? launch_column_sum_kernels<T, V>(d_grad_out, d_grad_bias, tokens, outs, accumulate,
                                               partials, splits, stream)
             : launch_column_sum_kernels<T, 1>(d_grad_out, d_grad_bias, tokens, outs, accumulate,
                                               partials, splits, stream);
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

template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate, void* d_workspace, cudaStream_t stream) {
  if (tokens < 0 || outs <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (d_grad_out == nullptr || d_grad_bias == nullptr ||
      (d_workspace != nullptr && !detail::is_aligned(d_workspace, sizeof(float))))
    return cudaErrorInvalidValue;  // before any CUDA call
  int sms = 0;
  QBL_CUDA_RETURN_IF_ERROR(detail::sm_count(&sms));
  return detail::launch_bias_grad(d_grad_out, d_grad_bias, tokens, outs, accumulate, d_workspace,
                                  sms, stream);
}

}  // namespace qbl

// bench_eager.cuh -- the eager-like unfused chain: what eager PyTorch runs for the layer, kernel by
// kernel (abs, max, clamp_min, scale, div, round, clamp, mul, sigmoid, mul, rsub, mul, add), each
// step its own kernel and its own temporary, then the bare GEMM + bias (bench_gemm.hpp). Its
// `mixed` and amax are what the fused forward is checked against, bit for bit.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "bench_check.hpp"
#include "bench_gemm.hpp"
#include "bench_memory.hpp"

namespace {

// ---- the eager-like chain's kernels ------------------------------------------------------------
//
// One kernel per eager op, each writing its own temporary in T. Like PyTorch's vectorized
// elementwise kernel: 128 threads, 16 bytes per thread (4 floats, 8 bf16 / fp16 values), a
// one-shot grid. (Eager's broadcast ops -- alpha [tokens, 1] times x_q -- take PyTorch's slower
// non-vectorized path; here they stay vectorized, so this chain is, if anything, faster than
// eager and the speedup over it is conservative.)
// Every op reads T, computes in fp32 and rounds its result to T once, as eager's kernels do for
// bf16 / fp16 (for float the rounding is the identity). Arithmetic uses the _rn intrinsics: no
// contraction, IEEE rounding of every step, as eager.

// Conversions go through the named intrinsics only (qbl's own, qbl/detail/vec.cuh): the harness
// must also build where the implicit __half / __nv_bfloat16 conversions and operators are switched
// off (__CUDA_NO_HALF_CONVERSIONS__ and friends, as PyTorch builds its extensions). Float -> T
// rounds to nearest even, which is what eager does when it stores an fp32 result in T.
using qbl::detail::from_float;
using qbl::detail::to_float;

// 16 bytes of T moved as one access: 4 floats or 8 bf16 / fp16 values.
template <typename T>
using Vec16 = qbl::detail::Vec<T, qbl::detail::vec16<T>>;

inline bool aligned16(const void* p) { return qbl::detail::is_aligned(p, 16); }

constexpr int ew_threads = 128;

struct AbsOp {
  __device__ float operator()(float v) const { return fabsf(v); }
};
// amax.clamp(min=1e-8): eager converts the bound to T before it compares (1e-8 is 0 in fp16).
// NaN stays NaN (NaN < x is false).
template <typename T>
struct ClampMinOp {
  __device__ float operator()(float v) const {
    const float bound = qbl::detail::round_to<T>(1e-8f);
    return v < bound ? bound : v;
  }
};
struct ScaleOp {  // amax / 127.0: eager multiplies by fl(1/127) for a CPU-scalar divisor
  __device__ float operator()(float v) const { return __fmul_rn(v, 1.0f / 127.0f); }
};
struct RoundOp {  // torch.round: ties to even
  __device__ float operator()(float v) const { return rintf(v); }
};
struct ClampQOp {  // clamp(-127, 127); NaN stays NaN
  __device__ float operator()(float v) const {
    return v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
  }
};
struct SigmoidOp {  // torch.sigmoid in fp32: 1 / (1 + exp(-l)), accurate expf, IEEE division
  __device__ float operator()(float v) const { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v))); }
};
struct RsubOneOp {  // 1 - alpha
  __device__ float operator()(float v) const { return __fsub_rn(1.0f, v); }
};
struct DivOp {
  __device__ float operator()(float a, float b) const { return __fdiv_rn(a, b); }
};
struct MulOp {
  __device__ float operator()(float a, float b) const { return __fmul_rn(a, b); }
};
struct AddOp {
  __device__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// First element of this thread's 16 bytes.
template <typename T>
__device__ __forceinline__ std::int64_t ew_first() {
  return (static_cast<std::int64_t>(blockIdx.x) * ew_threads + threadIdx.x) * qbl::detail::vec16<T>;
}

// out[i] = op(a[i])
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    unary_kernel(const T* __restrict__ a, T* __restrict__ out, std::int64_t n, Op op) {
  constexpr int N = qbl::detail::vec16<T>;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_float<T>(op(to_float(u.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) out[j] = from_float<T>(op(to_float(a[j])));
  }
}

// out[i] = op(a[i], b[i])
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    binary_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                  std::int64_t n, Op op) {
  constexpr int N = qbl::detail::vec16<T>;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    const Vec16<T> v = *reinterpret_cast<const Vec16<T>*>(b + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_float<T>(op(to_float(u.v[j]), to_float(v.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j)
      out[j] = from_float<T>(op(to_float(a[j]), to_float(b[j])));
  }
}

// out[i] = op(a[i], *s): a 0-dim device tensor on the right (x / scale, q * scale). The scalar is
// held as a float whose value T represents exactly.
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    scalar_rhs_kernel(const T* __restrict__ a, const float* __restrict__ s, T* __restrict__ out,
                      std::int64_t n, Op op) {
  constexpr int N = qbl::detail::vec16<T>;
  const std::int64_t i = ew_first<T>();
  const float sv = *s;
  if (VEC && i + N <= n) {
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> r;
#pragma unroll
    for (int j = 0; j < N; ++j) r.v[j] = from_float<T>(op(to_float(u.v[j]), sv));
    *reinterpret_cast<Vec16<T>*>(out + i) = r;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j)
      out[j] = from_float<T>(op(to_float(a[j]), sv));
  }
}

// out[i] = op(r[i / cols], a[i]): a [rows, 1] tensor broadcast over a [rows, cols] one
template <typename T, bool VEC, typename Op>
__global__ void __launch_bounds__(ew_threads)
    row_lhs_kernel(const T* __restrict__ r, const T* __restrict__ a, T* __restrict__ out,
                   std::int64_t n, std::int64_t cols, Op op) {
  constexpr int N = qbl::detail::vec16<T>;
  const std::int64_t i = ew_first<T>();
  if (VEC && i + N <= n) {  // cols % N == 0 here, so the N elements share one row
    const float rv = to_float(r[i / cols]);
    const Vec16<T> u = *reinterpret_cast<const Vec16<T>*>(a + i);
    Vec16<T> o;
#pragma unroll
    for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(op(rv, to_float(u.v[j])));
    *reinterpret_cast<Vec16<T>*>(out + i) = o;
  } else {
    for (std::int64_t j = i; j < n && j < i + N; ++j) {
      out[j] = from_float<T>(op(to_float(r[j / cols]), to_float(a[j])));
    }
  }
}

// *out = op(*a), rounded to T: the 0-dim ops (clamp_min, the scale) on 0-dim T tensors, whose
// values are held as floats.
template <typename T, typename Op>
__global__ void scalar_unary_kernel(const float* __restrict__ a, float* __restrict__ out, Op op) {
  *out = qbl::detail::round_to<T>(op(*a));
}

// NaN-propagating max (eager's max): fmaxf would return the non-NaN operand instead.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

constexpr int reduce_threads = 512;

// Max over the block's values, valid in thread 0. `scratch` holds one float per warp.
__device__ __forceinline__ float block_nan_max(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < reduce_threads / 32 ? scratch[lane] : -INFINITY;
    for (int off = 16; off > 0; off >>= 1) v = nan_max(v, __shfl_down_sync(0xffffffffu, v, off));
  }
  return v;
}

// Full reduction to one value in ONE launch, as eager's reduce kernel: every block writes a
// partial, the last block to finish (ticket from an atomic counter) combines them and resets the
// counter for the next launch. `a` is 16-byte aligned. A max of T values is a T value, so the
// result, held as a float, needs no rounding.
template <typename T>
__global__ void __launch_bounds__(reduce_threads)
    max_reduce_kernel(const T* __restrict__ a, std::int64_t n, float* __restrict__ partials,
                      unsigned* __restrict__ counter, float* __restrict__ out) {
  constexpr int N = qbl::detail::vec16<T>;
  __shared__ float scratch[reduce_threads / 32];
  __shared__ bool is_last;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * reduce_threads;
  const std::int64_t tid = static_cast<std::int64_t>(blockIdx.x) * reduce_threads + threadIdx.x;
  float m = -INFINITY;
  const std::int64_t nv = n / N;
  for (std::int64_t i = tid; i < nv; i += stride) {
    const Vec16<T> v = reinterpret_cast<const Vec16<T>*>(a)[i];
#pragma unroll
    for (int j = 0; j < N; ++j) m = nan_max(m, to_float(v.v[j]));
  }
  for (std::int64_t i = nv * N + tid; i < n; i += stride) m = nan_max(m, to_float(a[i]));
  m = block_nan_max(m, scratch);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = m;
    __threadfence();  // the partial is visible device-wide before the ticket is taken
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  float v = -INFINITY;
  for (unsigned i = threadIdx.x; i < gridDim.x; i += reduce_threads)
    v = nan_max(v, __ldcg(partials + i));
  v = block_nan_max(v, scratch);
  if (threadIdx.x == 0) {
    *out = v;
    *counter = 0;
  }
}

template <typename T>
unsigned ew_grid(std::int64_t n) {
  constexpr std::int64_t per_block = std::int64_t{qbl::detail::vec16<T>} * ew_threads;
  return static_cast<unsigned>(std::max<std::int64_t>(1, (n + per_block - 1) / per_block));
}

// 16-byte accesses when every buffer is 16-byte aligned and n is a whole number of them.
template <typename T>
bool whole_vectors(std::int64_t n) {
  return n % qbl::detail::vec16<T> == 0;
}

template <typename T, typename Op>
void launch_unary(const T* a, T* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n)) {
    unary_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, out, n, op);
  } else {
    unary_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_binary(const T* a, const T* b, T* out, std::int64_t n, Op op, cudaStream_t s) {
  if (aligned16(a) && aligned16(b) && aligned16(out) && whole_vectors<T>(n)) {
    binary_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, b, out, n, op);
  } else {
    binary_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, b, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_scalar_rhs(const T* a, const float* scalar, T* out, std::int64_t n, Op op,
                       cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n)) {
    scalar_rhs_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  } else {
    scalar_rhs_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(a, scalar, out, n, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_row_lhs(const T* r, const T* a, T* out, std::int64_t n, std::int64_t cols, Op op,
                    cudaStream_t s) {
  if (aligned16(a) && aligned16(out) && whole_vectors<T>(n) && whole_vectors<T>(cols)) {
    row_lhs_kernel<T, true><<<ew_grid<T>(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  } else {
    row_lhs_kernel<T, false><<<ew_grid<T>(n), ew_threads, 0, s>>>(r, a, out, n, cols, op);
  }
  LAUNCH_CHECK();
}

template <typename T, typename Op>
void launch_scalar_unary(const float* a, float* out, Op op, cudaStream_t s) {
  scalar_unary_kernel<T><<<1, 1, 0, s>>>(a, out, op);
  LAUNCH_CHECK();
}
// ---- the eager-like chain ----------------------------------------------------------------
//
// Every temporary is a T tensor, as in eager; the three 0-dim results (amax, clamped amax, scale)
// are held as floats on the device, each rounded to T by the op that makes it.

template <typename T>
class EagerChain {
 public:
  EagerChain(std::int64_t tokens, std::int64_t d, int sms, BareGemm<T>& gemm)
      : tokens_(tokens),
        d_(d),
        n_(tokens * d),
        reduce_blocks_(static_cast<unsigned>(std::max<std::int64_t>(
            1, std::min<std::int64_t>(
                   (n_ / qbl::detail::vec16<T> + reduce_threads - 1) / reduce_threads,
                   std::int64_t{sms} * 4)))),
        gemm_(gemm) {
    const std::size_t bytes = static_cast<std::size_t>(n_) * sizeof(T);
    const std::size_t row_bytes = static_cast<std::size_t>(tokens) * sizeof(T);
    for (DeviceBuffer* b : {&abs_, &div_, &round_, &clamp_, &xq_, &axq_, &omax_, &mixed_})
      *b = DeviceBuffer(bytes);
    alpha_ = DeviceBuffer(row_bytes);
    one_minus_alpha_ = DeviceBuffer(row_bytes);
    scalars_ = DeviceBuffer(3 * sizeof(float));  // amax, clamped amax, scale
    partials_ = DeviceBuffer(reduce_blocks_ * sizeof(float));
    counter_ = DeviceBuffer(sizeof(unsigned));
    CUDA_CHECK(cudaMemset(counter_.as<void>(), 0, sizeof(unsigned)));
  }

  // out = (eager's mixed) · Wᵀ + b, 13 kernels and the GEMM, in eager's order of ops.
  void run(const T* x, const T* logits, T* out, cudaStream_t s) {
    float* amax = scalars_.as<float>();
    float* amax_clamped = amax + 1;
    float* scale = amax + 2;
    launch_unary(x, abs_.as<T>(), n_, AbsOp{}, s);  // x.abs()
    max_reduce_kernel<T><<<reduce_blocks_, reduce_threads, 0, s>>>(
        abs_.as<T>(), n_, partials_.as<float>(), counter_.as<unsigned>(), amax);
    LAUNCH_CHECK();                                                         // .max()
    launch_scalar_unary<T>(amax, amax_clamped, ClampMinOp<T>{}, s);         // .clamp(min=1e-8)
    launch_scalar_unary<T>(amax_clamped, scale, ScaleOp{}, s);              // / 127.0
    launch_scalar_rhs(x, scale, div_.as<T>(), n_, DivOp{}, s);              // x / scale
    launch_unary(div_.as<T>(), round_.as<T>(), n_, RoundOp{}, s);           // .round()
    launch_unary(round_.as<T>(), clamp_.as<T>(), n_, ClampQOp{}, s);        // .clamp(-127, 127)
    launch_scalar_rhs(clamp_.as<T>(), scale, xq_.as<T>(), n_, MulOp{}, s);  // * scale
    launch_unary(logits, alpha_.as<T>(), tokens_, SigmoidOp{}, s);          // sigmoid(logits)
    launch_row_lhs(alpha_.as<T>(), xq_.as<T>(), axq_.as<T>(), n_, d_, MulOp{}, s);    // alpha * x_q
    launch_unary(alpha_.as<T>(), one_minus_alpha_.as<T>(), tokens_, RsubOneOp{}, s);  // 1 - alpha
    launch_row_lhs(one_minus_alpha_.as<T>(), x, omax_.as<T>(), n_, d_, MulOp{},
                   s);                                                           // (1 - alpha) * x
    launch_binary(axq_.as<T>(), omax_.as<T>(), mixed_.as<T>(), n_, AddOp{}, s);  // +
    gemm_.run(mixed_.as<T>(), out, s);                                           // linear
  }

  const T* mixed() const { return mixed_.as<T>(); }
  const float* amax() const { return scalars_.as<float>(); }

 private:
  std::int64_t tokens_, d_, n_;
  unsigned reduce_blocks_;
  BareGemm<T>& gemm_;
  DeviceBuffer abs_, div_, round_, clamp_, xq_, axq_, omax_, mixed_;
  DeviceBuffer alpha_, one_minus_alpha_, scalars_, partials_, counter_;
};

}  // namespace

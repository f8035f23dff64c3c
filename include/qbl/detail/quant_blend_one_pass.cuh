// The layer's one-pass prologue: amax and quant-blend in one cooperative launch, x read once.
//
// One persistent grid of co-resident blocks. Tile t (THREADS * U consecutive vectors of the flat
// run of rows, as in quant_blend_tiles) belongs to block t mod blocks, as its k-th tile,
// k = t div blocks:
//   phase 1  every block loads all its tiles at once -- tile 0 into registers, tiles 1..held into
//            shared memory by asynchronous copies (cp.async) -- and reduces max |x| over them.
//            It also works out tile 0's gates. The block's max goes to one atomicMax.
//   barrier  one grid-wide barrier (cooperative groups): after it the amax is complete.
//   phase 2  every block blends the tiles it holds and writes `mixed`.
// x is read once, and there is one launch and no memset. It serves x up to what the chip's
// registers and shared memory hold (about 32 MB on an H200); larger x takes the two-pass
// prologue, whose second read the L2 partly serves.
//
// Opt-in (Options::one_pass): on an H200 it measured no faster than the two-pass prologue
// (benchmarks/RESULTS.md, 2026-12-03). The blend's arithmetic cannot start before the barrier,
// so it no longer overlaps the loads, which costs about what the second read and the launch save.
//
// The max needs a zeroed accumulator without a memset node: OnePassState keeps two, and a
// parity word saying which one this launch uses. The launch reads the parity on entry, and after
// the barrier block 0 zeroes the other accumulator and flips the parity; the next launch on the
// stream then finds its accumulator zeroed. The state is zeroed once, when the layer is built.
//
// The launch is cooperative: the runtime refuses a grid that cannot be co-resident
// (cudaErrorCooperativeLaunchTooLarge) rather than let the barrier hang, and the caller then
// runs the two-pass prologue -- except during stream capture, where CUDA invalidates the capture
// on the refusal (cudaErrorStreamCaptureInvalidated, reported to the caller). The grid is sized
// from occupancy asked once per layer, so only a device whose usable multiprocessors shrink after
// that refuses it. Kernels of other streams that hold multiprocessors delay the grid's start; they
// do not make the launch fail.
#pragma once

#include <qbl/amax.cuh>
#include <qbl/detail/quant_blend_math.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.cuh>
#include <qbl/quant_blend.cuh>

#include <cooperative_groups.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace qbl::detail {

inline constexpr int one_pass_threads = quant_blend_block_threads;
/// Vectors per thread per tile (a tile is one_pass_threads * one_pass_vectors vectors).
inline constexpr int one_pass_vectors = vectors_in_flight;
/// Most tiles a block keeps in shared memory.
inline constexpr int one_pass_max_held = 48;

/// Device state of the one-pass prologue: see the top of this file. Zeroed once.
struct OnePassState {
  std::uint32_t parity;
  std::uint32_t accumulator[2];  ///< max of abs_bits; the one parity does not name is zero
  std::uint32_t unused;
};

template <typename T, int N>
inline constexpr std::size_t one_pass_tile_bytes = std::size_t{one_pass_threads} *
                                                   one_pass_vectors * sizeof(Vec<T, N>);

/// Loads the vectors [base, base + THREADS * U) ∩ [0, total) that this thread owns (thread, then
/// every THREADS-th) into v; returns the max of their abs_bits and m.
template <typename T, int N, int THREADS, int U>
__device__ __forceinline__ std::uint32_t load_tile_max(const Vec<T, N>* __restrict__ xv,
                                                       std::int64_t base, std::int64_t total,
                                                       Vec<T, N> (&v)[U], std::uint32_t m) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const std::int64_t g = base + threadIdx.x + u * THREADS;
    if (g < total) v[u] = xv[g];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (base + threadIdx.x + u * THREADS < total) m = max_abs_bits(v[u], m);
  }
  return m;
}

/// *dst = *src for shared dst and global src, asynchronously where the architecture has cp.async
/// (sm_80 on) and the size allows it (4, 8 or 16 bytes); complete after copy_async_wait().
template <typename V>
__device__ __forceinline__ void copy_async(V* dst, const V* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(V) == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(dst))),
                 "l"(src));
    return;
  } else if constexpr (sizeof(V) == 8 || sizeof(V) == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(dst))),
                 "l"(src), "n"(static_cast<int>(sizeof(V))));
    return;
  }
#endif
  *dst = *src;
}

/// Waits for this thread's copy_async copies.
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

template <typename T, int BLOCK_THREADS, int N, int U>
QBL_KERNEL void __launch_bounds__(BLOCK_THREADS)
    amax_quant_blend_one_pass_kernel(const T* __restrict__ x, const T* __restrict__ logits,
                                     T* __restrict__ mixed, std::int64_t tokens,
                                     std::int64_t features, FastDiv cols_div, int held,
                                     OnePassState* __restrict__ state, float* __restrict__ stats) {
  using Math = QuantBlendMath<T, N>;
  using V = Vec<T, N>;
  using BlockAmax = BlockAbsMax<T, BLOCK_THREADS>;
  constexpr std::int64_t tile = std::int64_t{BLOCK_THREADS} * U;
  __shared__ typename BlockAmax::TempStorage temp;
  __shared__ GateTable<Math, BLOCK_THREADS, U> table;
  __shared__ float shared_scale;
  extern __shared__ uint4 held_storage[];  // `held` tiles of this block, 16-byte aligned
  V* const kept = reinterpret_cast<V*>(held_storage);

  const std::int64_t cols = features / N;
  const std::int64_t total = tokens * cols;
  const std::int64_t blocks = gridDim.x;
  const std::int64_t first = blockIdx.x;  // this block's tile 0; its tile k is first + k * blocks
  // The plan gives every block between 1 and held + 1 tiles.
  const std::int64_t tiles_here = ceil_div(ceil_div(total, tile) - first, blocks);
  const int kept_here = tiles_here - 1 < held ? static_cast<int>(tiles_here - 1) : held;
  const TileRows rows_of{cols, tile, cols_div};
  const auto* xv = reinterpret_cast<const V*>(x);
  auto* mv = reinterpret_cast<V*>(mixed);
  const unsigned thread = threadIdx.x;
  const std::uint32_t parity = state->parity;

  // ---- phase 1: every load of this block's tiles in flight at once: tile 0 into registers,
  // tiles 1..kept_here into shared memory; then max |x| over them.
#pragma unroll 1
  for (int k = 1; k <= kept_here; ++k) {
    const std::int64_t base = (first + k * blocks) * tile;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::int64_t g = base + thread + u * BLOCK_THREADS;
      if (g < total) copy_async(&kept[(k - 1) * tile + u * BLOCK_THREADS + thread], &xv[g]);
    }
  }
  V in[U];
  std::uint32_t m = load_tile_max<T, N, BLOCK_THREADS, U>(xv, first * tile, total, in, 0u);
  copy_async_wait();  // each thread reads back only what it copied: no block barrier needed
#pragma unroll 1
  for (int k = 1; k <= kept_here; ++k) {
    const std::int64_t base = (first + k * blocks) * tile;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + thread + u * BLOCK_THREADS < total)
        m = max_abs_bits(kept[(k - 1) * tile + u * BLOCK_THREADS + thread], m);
    }
  }
  // Tile 0's gates while other blocks still load.
  TileRows::Span span = rows_of.span(first * tile, total);
  fill_gates<Math>(logits, span, table, BLOCK_THREADS);
  m = BlockAmax(temp).reduce_bits(m);
  if (thread == 0 && m != 0) atomicMax(&state->accumulator[parity], m);

  cooperative_groups::this_grid().sync();

  if (thread == 0) {
    const float amax = from_abs_bits(atomicOr(&state->accumulator[parity], 0u));
    const float scale = scale_from_amax<T>(amax);
    shared_scale = scale;
    if (blockIdx.x == 0) {
      stats[0] = amax;
      stats[1] = scale;
      // No block of this launch touches the other accumulator; every block has read the parity.
      state->accumulator[parity ^ 1u] = 0;
      state->parity = parity ^ 1u;
    }
  }
  __syncthreads();
  Math math;
  math.set_scale(shared_scale);

  // ---- phase 2: blend the tiles held.
  blend_tile<Math, BLOCK_THREADS, U>(math, in, mv, first * tile, total, span, table, rows_of);
  for (int k = 1; k <= kept_here; ++k) {
    const std::int64_t base = (first + k * blocks) * tile;
    V v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = kept[(k - 1) * tile + u * BLOCK_THREADS + thread];
    span = rows_of.span(base, total);
    __syncthreads();  // the previous tile's gates are no longer read
    fill_gates<Math>(logits, span, table, BLOCK_THREADS);
    __syncthreads();
    blend_tile<Math, BLOCK_THREADS, U>(math, v, mv, base, total, span, table, rows_of);
  }
}

/// Co-resident one-pass blocks per multiprocessor of one kernel instantiation, for each count of
/// held shared-memory tiles, on the current device (asked once per layer).
struct OnePassResidency {
  int max_held = -1;                       ///< -1: this instantiation cannot run one-pass
  int blocks[one_pass_max_held + 1] = {};  ///< [held]: resident blocks per multiprocessor
};

/// What the layer asks once: the device's multiprocessors, whether it launches cooperative
/// kernels, and the residency of the scalar ([0]) and 16-byte-vector ([1]) kernels.
struct OnePassLimits {
  int sms = 0;
  bool cooperative = false;
  OnePassResidency residency[2];
};

/// A one-pass launch: `blocks` blocks each holding up to `held` tiles in shared memory.
/// blocks == 0: run the two-pass prologue.
struct OnePassPlan {
  std::int64_t blocks = 0;
  int held = 0;
};

/// The grid for `tiles` tiles: the fewest held tiles per block that let a co-resident grid hold
/// all of x, then as few blocks as that needs; none (blocks == 0) where no grid holds it all.
/// Pure host arithmetic, tested on the CPU.
inline OnePassPlan plan_one_pass(std::int64_t tiles, int sms, const OnePassResidency& r) {
  if (tiles < 1 || sms < 1) return {};
  for (int held = 0; held <= r.max_held; ++held) {
    const std::int64_t grid = std::int64_t{sms} * r.blocks[held];
    if (grid >= 1 && tiles <= grid * (held + 1))
      return {ceil_div<std::int64_t>(tiles, held + 1), held};
  }
  return {};
}

template <typename T, int N>
cudaError_t one_pass_residency(OnePassResidency* r) {
  constexpr int threads = one_pass_threads;
  constexpr std::size_t tile_bytes = one_pass_tile_bytes<T, N>;
  const auto kernel = amax_quant_blend_one_pass_kernel<T, threads, N, one_pass_vectors>;
  int device = 0, optin = 0;
  QBL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  QBL_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  QBL_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  const std::size_t room =
      static_cast<std::size_t>(optin) > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  const int max_held =
      static_cast<int>(std::min<std::size_t>(one_pass_max_held, room / tile_bytes));
  QBL_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(max_held * tile_bytes)));
  r->max_held = -1;
  for (int held = 0; held <= max_held; ++held) {
    QBL_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &r->blocks[held], kernel, threads, held * tile_bytes));
    if (r->blocks[held] >= 1) r->max_held = held;
  }
  return cudaSuccess;
}

/// The current device's one-pass limits for element type T (no synchronization, no allocation).
template <typename T>
cudaError_t one_pass_limits(OnePassLimits* limits) {
  int device = 0, cooperative = 0;
  QBL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  QBL_CUDA_RETURN_IF_ERROR(sm_count(&limits->sms));
  QBL_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
  limits->cooperative = cooperative != 0;
  QBL_CUDA_RETURN_IF_ERROR((one_pass_residency<T, 1>(&limits->residency[0])));
  return one_pass_residency<T, vec16<T>>(&limits->residency[1]);
}

/// Launches the one-pass kernel for `plan`. Returns cudaErrorCooperativeLaunchTooLarge, with
/// nothing launched and no error left pending, when the device refuses the grid.
template <typename T, int N>
cudaError_t launch_one_pass(const T* x, const T* logits, T* mixed, std::int64_t tokens,
                            std::int64_t features, OnePassPlan plan, OnePassState* state,
                            float* stats, cudaStream_t stream) {
  constexpr int threads = one_pass_threads;
  constexpr std::int64_t tile = std::int64_t{threads} * one_pass_vectors;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(plan.blocks));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<std::size_t>(plan.held) * one_pass_tile_bytes<T, N>;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  const cudaError_t status = cudaLaunchKernelEx(
      &config, amax_quant_blend_one_pass_kernel<T, threads, N, one_pass_vectors>, x, logits, mixed,
      tokens, features, cols_divider(features / N, tile), plan.held, state, stats);
  if (status == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // a launch-configuration error: not sticky, cleared here
    return status;
  }
  QBL_CUDA_RETURN_IF_ERROR(status);
  return cudaGetLastError();
}

/// The layer's prologue: one-pass where `limits` allow it (and the device takes the grid), else
/// qbl::amax_quant_blend's launches. Writes stats[0] = amax, stats[1] = scale and `mixed`.
template <typename T>
cudaError_t amax_quant_blend_layer(const T* x, const T* logits, T* mixed, std::int64_t tokens,
                                   std::int64_t features, float* stats, OnePassState* state,
                                   const OnePassLimits& one_pass, const LaunchLimits& limits,
                                   cudaStream_t stream) {
  QBL_CUDA_RETURN_IF_ERROR(check_quant_blend_args(x, logits, mixed, tokens, features));
  if (tokens == 0) return cudaSuccess;
  const bool vec = rows_vectorizable(x, mixed, features);
  const std::int64_t n = tokens * features;
  if (state != nullptr && one_pass.cooperative && n > amax_quant_blend_single_block_elements) {
    constexpr std::int64_t tile = std::int64_t{one_pass_threads} * one_pass_vectors;
    const std::int64_t vectors = vec ? n / vec16<T> : n;
    const OnePassPlan plan =
        plan_one_pass(ceil_div(vectors, tile), one_pass.sms, one_pass.residency[vec ? 1 : 0]);
    if (plan.blocks > 0) {
      const cudaError_t status =
          vec ? launch_one_pass<T, vec16<T>>(x, logits, mixed, tokens, features, plan, state, stats,
                                             stream)
              : launch_one_pass<T, 1>(x, logits, mixed, tokens, features, plan, state, stats,
                                      stream);
      if (status != cudaErrorCooperativeLaunchTooLarge) return status;
    }
  }
  return amax_quant_blend_with(x, logits, mixed, tokens, features, stats, stats + 1, limits,
                               stream);
}

}  // namespace qbl::detail

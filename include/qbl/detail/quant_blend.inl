// Kernels and launcher bodies for qbl/quant_blend.cuh.
#pragma once

#include <qbl/amax.cuh>
#include <qbl/detail/activation_table.cuh>
#include <qbl/detail/quant_blend_math.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>
#include <qbl/quant_blend.cuh>

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace qbl::detail {

static_assert(qbl::amax_quant_blend_workspace_bytes == amax_max_blocks * sizeof(float),
              "amax_quant_blend's workspace holds one float per amax block");

inline constexpr int quant_blend_block_threads = 256;
inline constexpr int single_block_threads = 1024;

/// Vectors each thread loads before the first use: independent 16-byte loads in flight.
inline constexpr int vectors_in_flight = 4;
/// The same for the single-block kernel (1024 threads; its gate table stays at 16 KiB).
inline constexpr int single_block_vectors = 2;

/// n / d for 0 <= n, d < 2^31 by a multiply-high and a shift (the method of CUTLASS's FastDivmod).
struct FastDiv {
  std::uint32_t d = 1, mul = 0, shr = 0;
  FastDiv() = default;
  QBL_HOST_DEVICE explicit FastDiv(std::uint32_t divisor) : d(divisor) {
    if (d > 1) {
      std::uint32_t log2_ceil = 0;
      while ((std::uint64_t{1} << log2_ceil) < d) ++log2_ceil;
      const std::uint32_t p = 31 + log2_ceil;
      mul = static_cast<std::uint32_t>(((std::uint64_t{1} << p) + d - 1) / d);
      shr = p - 32;
    }
  }
  QBL_HOST_DEVICE std::uint32_t operator()(std::uint32_t n) const {
    if (d == 1) return n;
#if defined(__CUDA_ARCH__)
    return __umulhi(n, mul) >> shr;
#else
    return static_cast<std::uint32_t>((std::uint64_t{n} * mul) >> 32) >> shr;
#endif
  }
};

/// Gates (alpha, 1 - alpha) for the rows one tile of `threads * U` vectors touches: at most one
/// per vector, plus one for a row the tile starts inside.
template <typename Math, int THREADS, int U>
struct GateTable {
  typename Math::Gate gate[THREADS * U + 1];
};

/// Where tiles of `tile` consecutive vectors lie in rows of `cols` vectors.
struct TileRows {
  std::int64_t cols, tile;
  FastDiv cols_div;  ///< cols_divider(cols, tile)

  /// A tile: its first row, the offset of its first vector in that row, the rows it touches.
  struct Span {
    std::int64_t row, offset;
    std::uint32_t rows;
  };

  /// The row, counted from the tile's first, of the vector at `o` = offset + index in the tile.
  /// Rows shorter than a tile: a small quotient (cols_div); otherwise a tile spans at most two.
  __device__ __forceinline__ std::uint32_t row_in_tile(std::int64_t o) const {
    return cols < tile ? cols_div(static_cast<std::uint32_t>(o)) : (o >= cols ? 1u : 0u);
  }
  /// Rows touched by a tile starting at `offset` in its row with `remaining` vectors left in x.
  __device__ __forceinline__ std::uint32_t rows_from(std::int64_t offset,
                                                     std::int64_t remaining) const {
    return row_in_tile(offset + (remaining < tile ? remaining : tile) - 1) + 1;
  }
  /// The tile starting at vector `base` < total.
  __device__ __forceinline__ Span span(std::int64_t base, std::int64_t total) const {
    const std::int64_t row = base / cols, offset = base - row * cols;
    return {row, offset, rows_from(offset, total - base)};
  }
};

/// The gates of a tile's rows into table.gate[0, rows), by the block's `threads` threads (the
/// caller synchronizes the block before they are read).
template <typename Math, typename T, typename Table>
__device__ __forceinline__ void fill_gates(const T* __restrict__ logits, TileRows::Span span,
                                           Table& table, int threads) {
  for (std::uint32_t r = threadIdx.x; r < span.rows; r += threads)
    table.gate[r] = Math::gate(logits[span.row + r]);
}

/// mixed for this thread's vectors of the tile at `base` (thread, then every THREADS-th), from
/// their inputs `in` (act(in) from act_table where it has one) and the tile's gates. Each vector
/// is activated just before its blend, so that only one vector's activation is live at a time.
template <typename Act, typename Math, int THREADS, int U, typename V, typename W, typename Table,
          typename ActTable>
__device__ __forceinline__ void blend_tile(const Math& math, const V (&in)[U], W* __restrict__ mv,
                                           std::int64_t base, std::int64_t total,
                                           TileRows::Span span, const Table& table,
                                           const ActTable& act_table, const TileRows& rows_of) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const std::int64_t g = base + threadIdx.x + u * THREADS;
    if (g < total)
      mv[g] = math.apply(activate_vec<Act>(in[u], act_table),
                         table.gate[rows_of.row_in_tile(span.offset + threadIdx.x + u * THREADS)]);
  }
}

/// mixed for the rows [0, tokens), shared out over `blocks` blocks of THREADS threads, act(x)
/// from `act_table` where it has one (filled before the call).
///
/// The rows are one flat run of `features / N` vectors each, cut into tiles of THREADS * U
/// consecutive vectors, tile i going to block i mod blocks: every thread has U vectors of work
/// whatever the row length, and consecutive threads touch consecutive vectors. Per tile, the
/// block works out each row's gate once into shared memory; the loads of x are issued before
/// that, and before `get_scale()` is first asked for the scale (by every thread of the block at
/// once), so a kernel launched as a programmatic dependent of the amax kernel has its reads in
/// flight while that kernel drains.
template <typename X, typename G, typename L, typename Act, int N, int THREADS, int U,
          typename GetScale, typename ActTable>
__device__ __forceinline__ void quant_blend_tiles(
    const X* __restrict__ x, const L* __restrict__ logits, GetScale get_scale,
    G* __restrict__ mixed, std::int64_t tokens, std::int64_t features, FastDiv cols_div,
    GateTable<QuantBlendMath<X, G, L, N>, THREADS, U>& table, const ActTable& act_table,
    unsigned block, unsigned blocks) {
  using Math = QuantBlendMath<X, G, L, N>;
  constexpr std::int64_t tile = std::int64_t{THREADS} * U;
  const std::int64_t cols = features / N;
  const std::int64_t total = tokens * cols;
  const TileRows rows_of{cols, tile, cols_div};
  std::int64_t base = static_cast<std::int64_t>(block) * tile;
  if (base >= total) return;
  std::int64_t row = base / cols, offset = base - row * cols;  // the tile's first vector
  const std::int64_t step = static_cast<std::int64_t>(blocks) * tile;
  const std::int64_t step_rows = step / cols, step_offset = step - step_rows * cols;
  const auto* xv = reinterpret_cast<const Vec<X, N>*>(x);
  auto* mv = reinterpret_cast<Vec<G, N>*>(mixed);
  Math math;
  bool have_scale = false;
  for (; base < total; base += step) {
    Vec<X, N> in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const std::int64_t g = base + threadIdx.x + u * THREADS;
      if (g < total) in[u] = xv[g];  // the activation's input
    }
    const TileRows::Span span{row, offset, rows_of.rows_from(offset, total - base)};
    fill_gates<Math>(logits, span, table, THREADS);
    __syncthreads();
    if (!have_scale) {
      math.set_scale(get_scale());
      have_scale = true;
    }
    blend_tile<Act, Math, THREADS, U>(math, in, mv, base, total, span, table, act_table, rows_of);
    __syncthreads();  // the next tile's gates overwrite this one's
    row += step_rows;
    offset += step_offset;
    if (offset >= cols) {
      offset -= cols;
      ++row;
    }
  }
}

/// Waits (when launched as a programmatic dependent) until the kernel before it in the stream --
/// the amax kernel -- has finished and its writes are visible. A no-op otherwise.
__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

/// Where the quant-blend kernel takes its amax from: one already in memory (qbl::quant_blend,
/// the sharded forward's second step) -- it writes the scale to *scale_out when that is not null.
struct GivenAmax {
  const float* amax;
  float* scale_out;
};

/// ... or the amax kernel's per-block maxima (the layer's prologue), combined by every block
/// after its grid-dependency wait; block 0 writes the amax and the scale.
struct PartialAmax {
  const std::uint32_t* partials;
  int count;
  float* amax_out;
  float* scale_out;
};

/// The scale for one block from its amax source, called by every thread of the block at once.
template <typename X, int THREADS>
struct ScaleFrom {
  using Reduce = cub::BlockReduce<std::uint32_t, THREADS>;
  struct Shared {
    typename Reduce::TempStorage temp;
    std::uint32_t amax_bits;
  };
  static __device__ __forceinline__ float get(const GivenAmax& src, Shared&) {
    const float s = scale_from_amax<X>(*src.amax);
    if (src.scale_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *src.scale_out = s;
    return s;
  }
  static __device__ __forceinline__ float get(const PartialAmax& src, Shared& shared) {
    wait_for_primary();
    std::uint32_t m = 0;
    for (int i = static_cast<int>(threadIdx.x); i < src.count; i += THREADS)
      m = max(m, src.partials[i]);
    m = Reduce(shared.temp).Reduce(m, ::cuda::maximum<>{});
    if (threadIdx.x == 0) shared.amax_bits = m;
    __syncthreads();
    const float a = from_abs_bits(shared.amax_bits);
    const float s = scale_from_amax<X>(a);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      *src.amax_out = a;
      *src.scale_out = s;
    }
    return s;
  }
};

template <typename X, typename G, typename L, typename Act, int BLOCK_THREADS, int N,
          typename Source>
QBL_KERNEL void __launch_bounds__(
    BLOCK_THREADS, table_min_blocks<ActivationTable<Act, X, false>::enabled>(BLOCK_THREADS))
    quant_blend_kernel(const X* __restrict__ x, const L* __restrict__ logits, Source source,
                       G* __restrict__ mixed, std::int64_t tokens, std::int64_t features,
                       FastDiv cols_div) {
  using Scale = ScaleFrom<X, BLOCK_THREADS>;
  __shared__ GateTable<QuantBlendMath<X, G, L, N>, BLOCK_THREADS, vectors_in_flight> table;
  __shared__ typename Scale::Shared scale_shared;
  __shared__ ActivationTable<Act, X, false> act_table;
  fill_table(act_table, false);  // before any wait: it overlaps the amax kernel's end
  auto get_scale = [&] { return Scale::get(source, scale_shared); };
  quant_blend_tiles<X, G, L, Act, N, BLOCK_THREADS, vectors_in_flight>(
      x, logits, get_scale, mixed, tokens, features, cols_div, table, act_table, blockIdx.x,
      gridDim.x);
}

/// Both stages in one block: the amax never leaves shared memory before the blend reads it. No
/// activation table: for at most amax_quant_blend_single_block_elements elements, filling it
/// would cost about what it saves.
template <typename X, typename G, typename L, typename Act, int BLOCK_THREADS, int N>
QBL_KERNEL void __launch_bounds__(BLOCK_THREADS)
    amax_quant_blend_single_block_kernel(const X* __restrict__ x, const L* __restrict__ logits,
                                         G* __restrict__ mixed, std::int64_t tokens,
                                         std::int64_t features, std::int64_t head, FastDiv cols_div,
                                         float* __restrict__ amax_out,
                                         float* __restrict__ scale_out) {
  using BlockAmax = BlockAbsMax<X, BLOCK_THREADS>;
  __shared__ typename BlockAmax::TempStorage temp;
  __shared__ float shared_scale;
  __shared__ GateTable<QuantBlendMath<X, G, L, N>, BLOCK_THREADS, single_block_vectors> table;
  const NoTable no_table;
  const std::uint32_t m = BlockAmax(temp).reduce_bits(thread_abs_max_bits<X, N, Act>(
      x, tokens * features, head, threadIdx.x, BLOCK_THREADS, no_table));
  if (threadIdx.x == 0) {
    const float a = from_abs_bits(m);
    const float s = scale_from_amax<X>(a);
    shared_scale = s;
    *amax_out = a;
    if (scale_out != nullptr) *scale_out = s;
  }
  __syncthreads();
  const float scale = shared_scale;
  quant_blend_tiles<X, G, L, Act, N, BLOCK_THREADS, single_block_vectors>(
      x, logits, [scale] { return scale; }, mixed, tokens, features, cols_div, table, no_table, 0,
      1);
}

/// The divider quant_blend_tiles needs for rows of `cols` vectors: by cols where rows are shorter
/// than a tile (then every dividend is below 2 * tile), unused otherwise.
inline FastDiv cols_divider(std::int64_t cols, std::int64_t tile) {
  return cols < tile ? FastDiv(static_cast<std::uint32_t>(cols)) : FastDiv();
}

/// 16-byte vectors of x when both row-major buffers allow them (mixed then takes N elements of
/// G per vector), else one element at a time.
template <typename X, typename G>
bool rows_vectorizable(const X* x, const G* mixed, std::int64_t features) {
  return is_aligned(x, 16) && is_aligned(mixed, vec16<X> * sizeof(G)) && features % vec16<X> == 0;
}

template <typename X, typename G, typename L>
cudaError_t check_quant_blend_args(const X* x, const L* logits, const G* mixed, std::int64_t tokens,
                                   std::int64_t features) {
  if (tokens < 0 || features <= 0) return cudaErrorInvalidValue;
  if (tokens > 0 && (x == nullptr || logits == nullptr || mixed == nullptr))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

/// What the launchers need to know of the device and of the kernels compiled for it, asked once:
/// the plans at construction, the free functions per call (they must work on whatever device is
/// current). Index [0] is the element-by-element kernel, [1] the 16-byte-vector one.
struct LaunchLimits {
  int sms = 0;           ///< multiprocessors
  int resident[2] = {};  ///< resident quant_blend_kernel blocks per multiprocessor
  /// May the quant-blend kernel start as the amax kernel's programmatic dependent? Only where its
  /// own compiled code waits for that kernel: wait_for_primary() is compiled in for sm_90 and
  /// later, so a build for an older architecture that runs on Hopper by JIT from its PTX has no
  /// wait in it, and a programmatic launch there could read the partial maxima too early. Decided
  /// from the PTX version of the kernel the runtime picked for this device.
  bool programmatic[2] = {};
};

template <typename X, typename G, typename L, typename Act, int N>
cudaError_t quant_blend_kernel_limits(int* resident, bool* programmatic) {
  constexpr auto kernel =
      quant_blend_kernel<X, G, L, Act, quant_blend_block_threads, N, PartialAmax>;
  *resident = 0;
  QBL_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      resident, kernel, quant_blend_block_threads, 0));
  if (*resident < 1) *resident = 1;
  cudaFuncAttributes attributes = {};
  QBL_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernel));
  *programmatic = attributes.ptxVersion >= 90;
  return cudaSuccess;
}

/// The current device's limits for these element types (no synchronization, no allocation).
template <typename X, typename G, typename L, typename Act = Identity>
cudaError_t query_launch_limits(LaunchLimits* limits) {
  QBL_CUDA_RETURN_IF_ERROR(sm_count(&limits->sms));
  QBL_CUDA_RETURN_IF_ERROR(
      (quant_blend_kernel_limits<X, G, L, Act, 1>(&limits->resident[0], &limits->programmatic[0])));
  return quant_blend_kernel_limits<X, G, L, Act, vec16<X>>(&limits->resident[1],
                                                           &limits->programmatic[1]);
}

/// One quant_blend_kernel launch with vectors of N elements: at most one wave of resident blocks,
/// each looping over tiles.
template <typename X, typename G, typename L, typename Act, int N, typename Source>
cudaError_t launch_quant_blend_kernel(const X* x, const L* logits, const Source& source, G* mixed,
                                      std::int64_t tokens, std::int64_t features,
                                      const LaunchLimits& limits, cudaStream_t stream) {
  constexpr int threads = quant_blend_block_threads;
  constexpr std::int64_t tile = std::int64_t{threads} * vectors_in_flight;
  constexpr int v = N == 1 ? 0 : 1;
  const std::int64_t cols = features / N;
  const std::int64_t blocks = std::min<std::int64_t>(ceil_div(tokens * cols, tile),
                                                     std::int64_t{limits.sms} * limits.resident[v]);
  // From the amax kernel's partial maxima: launched as that kernel's programmatic dependent, it
  // may start, and issue its loads of x and logits, while that kernel drains (the amax kernel
  // only reads x; the partials are read after cudaGridDependencySynchronize()). From a given
  // amax -- after any kernel of the caller's, which may have written x or logits -- a plain
  // launch: loads issued before the dependency wait are only ordered after a kernel that wrote
  // nothing they read.
  const bool dependent = std::is_same_v<Source, PartialAmax> && limits.programmatic[v];
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = dependent ? 1 : 0;
  QBL_CUDA_RETURN_IF_ERROR(
      cudaLaunchKernelEx(&config, quant_blend_kernel<X, G, L, Act, threads, N, Source>, x, logits,
                         source, mixed, tokens, features, cols_divider(cols, tile)));
  return cudaGetLastError();
}

/// The single-block kernel (amax and blend in one block) with vectors of N elements.
template <typename X, typename G, typename L, typename Act, int N>
cudaError_t launch_single_block_kernel(const X* x, const L* logits, G* mixed, std::int64_t tokens,
                                       std::int64_t features, float* amax, float* scale,
                                       cudaStream_t stream) {
  constexpr int threads = single_block_threads;
  const std::int64_t head = N == 1 ? 0 : aligned_head(x, tokens * features);
  amax_quant_blend_single_block_kernel<X, G, L, Act, threads, N><<<1, threads, 0, stream>>>(
      x, logits, mixed, tokens, features, head,
      cols_divider(features / N, std::int64_t{threads} * single_block_vectors), amax, scale);
  return cudaGetLastError();
}

/// mixed from an amax source (GivenAmax: the free function qbl::quant_blend and a forward from
/// given stats; PartialAmax: the prologue's second kernel), 16-byte vectors where the buffers
/// allow them.
template <typename X, typename G, typename L, typename Act, typename Source>
cudaError_t launch_quant_blend(const X* d_x, const L* d_logits, const Source& source, G* d_mixed,
                               std::int64_t tokens, std::int64_t features,
                               const LaunchLimits& limits, cudaStream_t stream) {
  QBL_CUDA_RETURN_IF_ERROR(check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (tokens == 0) return cudaSuccess;
  if (rows_vectorizable(d_x, d_mixed, features)) {
    return launch_quant_blend_kernel<X, G, L, Act, vec16<X>>(d_x, d_logits, source, d_mixed, tokens,
                                                             features, limits, stream);
  }
  return launch_quant_blend_kernel<X, G, L, Act, 1>(d_x, d_logits, source, d_mixed, tokens,
                                                    features, limits, stream);
}

/// Both stages (qbl::amax_quant_blend, the layer's prologue): one single-block launch for small
/// inputs, else the partial-maxima amax kernel and the quant-blend kernel as its programmatic
/// dependent, the partials in d_workspace (amax_quant_blend_workspace_bytes). No memset, no
/// atomics: nothing in the workspace needs initializing, and nothing is left to reset.
template <typename X, typename G, typename L, typename Act>
cudaError_t launch_amax_quant_blend(const X* d_x, const L* d_logits, G* d_mixed,
                                    std::int64_t tokens, std::int64_t features, float* d_amax,
                                    float* d_scale, void* d_workspace, const LaunchLimits& limits,
                                    cudaStream_t stream) {
  QBL_CUDA_RETURN_IF_ERROR(check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (d_amax == nullptr || d_scale == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const bool vec = rows_vectorizable(d_x, d_mixed, features);
  if (tokens * features <= amax_quant_blend_single_block_elements) {
    return vec ? launch_single_block_kernel<X, G, L, Act, vec16<X>>(
                     d_x, d_logits, d_mixed, tokens, features, d_amax, d_scale, stream)
               : launch_single_block_kernel<X, G, L, Act, 1>(d_x, d_logits, d_mixed, tokens,
                                                             features, d_amax, d_scale, stream);
  }
  if (d_workspace == nullptr || !is_aligned(d_workspace, alignof(std::uint32_t)))
    return cudaErrorInvalidValue;
  auto* partials = static_cast<std::uint32_t*>(d_workspace);
  int count = 0;
  QBL_CUDA_RETURN_IF_ERROR(
      launch_amax_partials<Act>(d_x, tokens * features, partials, &count, limits.sms, stream));
  return launch_quant_blend<X, G, L, Act>(d_x, d_logits,
                                          PartialAmax{partials, count, d_amax, d_scale}, d_mixed,
                                          tokens, features, limits, stream);
}

}  // namespace qbl::detail

namespace qbl {

template <typename X, typename G, typename L, typename Act>
cudaError_t quant_blend(const X* d_x, const detail::type_identity_t<L>* d_logits,
                        const float* d_amax, detail::type_identity_t<G>* d_mixed,
                        std::int64_t tokens, std::int64_t features, float* d_scale,
                        cudaStream_t stream) {
  static_assert(supported_types<X, G, L>,
                "quant_blend: x, logits and mixed of one type, or fp32 x with bf16/fp16 mixed "
                "(logits fp32 or of mixed's type)");
  static_assert(detail::is_activation<Act>, "quant_blend: Act is one of qbl::Activations");
  QBL_CUDA_RETURN_IF_ERROR(
      detail::check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (d_amax == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  detail::LaunchLimits limits;
  QBL_CUDA_RETURN_IF_ERROR((detail::query_launch_limits<X, G, L, Act>(&limits)));
  return detail::launch_quant_blend<X, G, L, Act>(d_x, d_logits, detail::GivenAmax{d_amax, d_scale},
                                                  d_mixed, tokens, features, limits, stream);
}

template <typename X, typename G, typename L, typename Act>
cudaError_t amax_quant_blend(const X* d_x, const detail::type_identity_t<L>* d_logits,
                             detail::type_identity_t<G>* d_mixed, std::int64_t tokens,
                             std::int64_t features, float* d_amax, float* d_scale,
                             void* d_workspace, cudaStream_t stream) {
  static_assert(supported_types<X, G, L>,
                "amax_quant_blend: x, logits and mixed of one type, or fp32 x with bf16/fp16 "
                "mixed (logits fp32 or of mixed's type)");
  static_assert(detail::is_activation<Act>, "amax_quant_blend: Act is one of qbl::Activations");
  QBL_CUDA_RETURN_IF_ERROR(
      detail::check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (d_amax == nullptr || d_scale == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (tokens * features > amax_quant_blend_single_block_elements &&
      (d_workspace == nullptr || !detail::is_aligned(d_workspace, alignof(std::uint32_t))))
    return cudaErrorInvalidValue;  // before any CUDA call
  detail::LaunchLimits limits;
  QBL_CUDA_RETURN_IF_ERROR((detail::query_launch_limits<X, G, L, Act>(&limits)));
  return detail::launch_amax_quant_blend<X, G, L, Act>(
      d_x, d_logits, d_mixed, tokens, features, d_amax, d_scale, d_workspace, limits, stream);
}

}  // namespace qbl

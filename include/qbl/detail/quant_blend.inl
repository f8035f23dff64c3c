// Kernels and launcher bodies for qbl/quant_blend.cuh.
#pragma once

#include <qbl/amax.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.cuh>
#include <qbl/quant_blend.cuh>

#include <algorithm>
#include <cstdint>

namespace qbl::detail {

inline constexpr int quant_blend_block_threads = 256;
inline constexpr int single_block_threads = 1024;

/// Rows each thread keeps in flight: R independent 16-byte loads before the first use.
inline constexpr int rows_in_flight = 4;

/// The rows [0, tokens) of mixed, shared out over `blocks` blocks of `threads` threads.
///
/// A row holds `features / N` vectors. When a row has fewer vectors than the block has threads,
/// the block covers several rows per step, so that short rows leave no thread idle for long.
/// Each thread works on R rows at a time: their loads are all issued before `get_scale()` is
/// asked for the scale, so a kernel launched as a programmatic dependent of the amax kernel has
/// its reads in flight while that kernel drains.
template <typename T, int N, int R, typename GetScale>
__device__ __forceinline__ void quant_blend_rows(const T* __restrict__ x,
                                                 const T* __restrict__ logits, GetScale get_scale,
                                                 T* __restrict__ mixed, std::int64_t tokens,
                                                 std::int64_t features, unsigned block,
                                                 unsigned blocks, unsigned thread,
                                                 unsigned threads) {
  const std::int64_t cols = features / N;
  const unsigned span = cols >= threads ? threads : static_cast<unsigned>(cols);
  const unsigned rows_per_step = threads / span;
  const unsigned lane_row = thread / span;
  if (lane_row >= rows_per_step) return;
  const unsigned col0 = thread - lane_row * span;
  const std::int64_t row_step = static_cast<std::int64_t>(blocks) * rows_per_step;
  float scale = 0.0f;
  bool have_scale = false;
  for (std::int64_t row0 = static_cast<std::int64_t>(block) * rows_per_step + lane_row;
       row0 < tokens; row0 += R * row_step) {
    float alpha[R], one_minus_alpha[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const std::int64_t row = row0 + r * row_step;
      alpha[r] = row < tokens ? sigmoid<T>(to_float(logits[row])) : 0.0f;
      one_minus_alpha[r] = one_minus<T>(alpha[r]);
    }
    for (std::int64_t c = col0; c < cols; c += span) {
      Vec<T, N> in[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const std::int64_t row = row0 + r * row_step;
        if (row < tokens) in[r] = reinterpret_cast<const Vec<T, N>*>(x + row * features)[c];
      }
      if (!have_scale) {
        scale = get_scale();
        have_scale = true;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const std::int64_t row = row0 + r * row_step;
        if (row >= tokens) continue;
        Vec<T, N> out;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float xv = to_float(in[r].v[j]);
          out.v[j] = from_float<T>(blend<T>(xv, fake_quant<T>(xv, scale), alpha[r], one_minus_alpha[r]));
        }
        reinterpret_cast<Vec<T, N>*>(mixed + row * features)[c] = out;
      }
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

template <typename T, int BLOCK_THREADS, int N>
QBL_KERNEL void __launch_bounds__(BLOCK_THREADS)
    quant_blend_kernel(const T* __restrict__ x, const T* __restrict__ logits,
                       const float* __restrict__ amax, T* __restrict__ mixed, std::int64_t tokens,
                       std::int64_t features, float* __restrict__ scale_out) {
  auto get_scale = [&] {
    wait_for_primary();
    return scale_from_amax<T>(*amax);
  };
  if (scale_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *scale_out = get_scale();
  quant_blend_rows<T, N, rows_in_flight>(x, logits, get_scale, mixed, tokens, features, blockIdx.x,
                                         gridDim.x, threadIdx.x, BLOCK_THREADS);
}

/// Both stages in one block: the amax never leaves shared memory before the blend reads it.
template <typename T, int BLOCK_THREADS, int N>
QBL_KERNEL void __launch_bounds__(BLOCK_THREADS)
    amax_quant_blend_single_block_kernel(const T* __restrict__ x, const T* __restrict__ logits,
                                         T* __restrict__ mixed, std::int64_t tokens,
                                         std::int64_t features, std::int64_t head,
                                         float* __restrict__ amax_out,
                                         float* __restrict__ scale_out) {
  using BlockAmax = BlockAbsMax<T, BLOCK_THREADS>;
  __shared__ typename BlockAmax::TempStorage temp;
  __shared__ float shared_scale;
  const std::uint32_t m = BlockAmax(temp).reduce_bits(
      thread_abs_max_bits<T, N>(x, tokens * features, head, threadIdx.x, BLOCK_THREADS));
  if (threadIdx.x == 0) {
    const float a = from_abs_bits(m);
    const float s = scale_from_amax<T>(a);
    shared_scale = s;
    *amax_out = a;
    if (scale_out != nullptr) *scale_out = s;
  }
  __syncthreads();
  const float scale = shared_scale;
  quant_blend_rows<T, N, rows_in_flight>(x, logits, [scale] { return scale; }, mixed, tokens,
                                         features, 0, 1, threadIdx.x, BLOCK_THREADS);
}

/// 16-byte vectors when both row-major buffers allow them, else one element at a time.
template <typename T>
bool rows_vectorizable(const T* x, const T* mixed, std::int64_t features) {
  return is_aligned(x, 16) && is_aligned(mixed, 16) && features % vec16<T> == 0;
}

template <typename T>
cudaError_t check_quant_blend_args(const T* x, const T* logits, const void* mixed,
                                   std::int64_t tokens, std::int64_t features) {
  if (tokens < 0 || features <= 0) return cudaErrorInvalidValue;
  if (tokens > 0 && (x == nullptr || logits == nullptr || mixed == nullptr))
    return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <typename T, int N>
cudaError_t launch_quant_blend(const T* x, const T* logits, const float* amax, T* mixed,
                               std::int64_t tokens, std::int64_t features, float* scale,
                               cudaStream_t stream) {
  constexpr int threads = quant_blend_block_threads;
  int sms = 0;
  QBL_CUDA_RETURN_IF_ERROR(sm_count(&sms));
  const std::int64_t cols = features / N;
  const std::int64_t rows_per_step = cols >= threads ? 1 : threads / cols;
  // One wave of resident blocks at most; each thread then loops.
  static const int resident = [] {
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, quant_blend_kernel<T, threads, N>,
                                                         threads, 0) == cudaSuccess && n > 0
               ? n
               : 1;
  }();
  const std::int64_t blocks = std::min<std::int64_t>(
      ceil_div(tokens, rows_per_step * rows_in_flight), std::int64_t{sms} * resident);
  // Launched as a programmatic dependent of the kernel before it (the amax): it may start, and
  // issue its loads of x and logits, while that kernel drains; it reads amax only after
  // cudaGridDependencySynchronize(). After any other work the attribute changes nothing.
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  QBL_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, quant_blend_kernel<T, threads, N>, x, logits,
                                              amax, mixed, tokens, features, scale));
  return cudaGetLastError();
}

template <typename T, int N>
cudaError_t launch_single_block(const T* x, const T* logits, T* mixed, std::int64_t tokens,
                                std::int64_t features, float* amax, float* scale,
                                cudaStream_t stream) {
  constexpr int threads = single_block_threads;
  const std::int64_t head = N == 1 ? 0 : aligned_head(x, tokens * features);
  amax_quant_blend_single_block_kernel<T, threads, N>
      <<<1, threads, 0, stream>>>(x, logits, mixed, tokens, features, head, amax, scale);
  return cudaGetLastError();
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
cudaError_t quant_blend(const T* d_x, const T* d_logits, const float* d_amax, T* d_mixed,
                        std::int64_t tokens, std::int64_t features, float* d_scale,
                        cudaStream_t stream) {
  QBL_CUDA_RETURN_IF_ERROR(detail::check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (d_amax == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (detail::rows_vectorizable(d_x, d_mixed, features)) {
    return detail::launch_quant_blend<T, detail::vec16<T>>(d_x, d_logits, d_amax, d_mixed, tokens,
                                                           features, d_scale, stream);
  }
  return detail::launch_quant_blend<T, 1>(d_x, d_logits, d_amax, d_mixed, tokens, features, d_scale,
                                          stream);
}

template <typename T>
cudaError_t amax_quant_blend(const T* d_x, const T* d_logits, T* d_mixed, std::int64_t tokens,
                             std::int64_t features, float* d_amax, float* d_scale,
                             cudaStream_t stream) {
  QBL_CUDA_RETURN_IF_ERROR(detail::check_quant_blend_args(d_x, d_logits, d_mixed, tokens, features));
  if (d_amax == nullptr) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  const bool vec = detail::rows_vectorizable(d_x, d_mixed, features);
  if (tokens * features <= amax_quant_blend_single_block_elements) {
    return vec ? detail::launch_single_block<T, detail::vec16<T>>(d_x, d_logits, d_mixed, tokens,
                                                                  features, d_amax, d_scale, stream)
               : detail::launch_single_block<T, 1>(d_x, d_logits, d_mixed, tokens, features, d_amax,
                                                   d_scale, stream);
  }
  QBL_CUDA_RETURN_IF_ERROR(amax(d_x, tokens * features, d_amax, stream));
  return quant_blend(d_x, d_logits, d_amax, d_mixed, tokens, features, d_scale, stream);
}

}  // namespace qbl

// Kernels and launcher bodies for qbl/amax.cuh.
#pragma once

#include <qbl/amax.cuh>
#include <qbl/detail/activation_table.cuh>
#include <qbl/detail/vec.cuh>

#include <algorithm>
#include <cstdint>

namespace qbl::detail {

inline constexpr int amax_block_threads = 512;

/// abs_bits of act(v), act(v) rounded to T as eager stores the activation's output.
template <typename Act, typename T>
__device__ __forceinline__ std::uint32_t abs_bits_of(T v) {
  return abs_bits(activate<Act, T>(to_float(v)));
}

/// The max of m and abs_bits over act(v), from the table where it has one.
template <typename Act, typename T, int N, typename Table>
__device__ __forceinline__ std::uint32_t max_abs_bits(const Vec<T, N>& v, std::uint32_t m,
                                                      const Table& table) {
  const Vec<T, N> a = activate_vec<Act>(v, table);
#pragma unroll
  for (int j = 0; j < N; ++j) m = max(m, abs_bits(to_float(a.v[j])));
  return m;
}

/// Per-thread max of abs_bits over act(x[0, n)): elements [0, head) and the tail scalar, the
/// aligned middle as N-wide vectors (act from `table` where it has one), four independent loads
/// in flight per iteration. `thread` / `threads` are this thread's rank and the count taking part.
template <typename T, int N, typename Act, typename Table>
__device__ __forceinline__ std::uint32_t thread_abs_max_bits(const T* __restrict__ x,
                                                             std::int64_t n, std::int64_t head,
                                                             std::int64_t thread,
                                                             std::int64_t threads,
                                                             const Table& table) {
  std::uint32_t m = 0;
  const std::int64_t nvec = (n - head) / N;
  const auto* xv = reinterpret_cast<const Vec<T, N>*>(x + head);
  std::int64_t i = thread;
  for (; i + 3 * threads < nvec; i += 4 * threads) {
    const Vec<T, N> a = xv[i];
    const Vec<T, N> b = xv[i + threads];
    const Vec<T, N> c = xv[i + 2 * threads];
    const Vec<T, N> d = xv[i + 3 * threads];
    m = max_abs_bits<Act>(a, m, table);
    m = max_abs_bits<Act>(b, m, table);
    m = max_abs_bits<Act>(c, m, table);
    m = max_abs_bits<Act>(d, m, table);
  }
  for (; i < nvec; i += threads) m = max_abs_bits<Act>(xv[i], m, table);
  // Scalar head [0, head) and tail [head + nvec * N, n): fewer than 2 * N elements.
  const std::int64_t tail = head + nvec * N;
  const std::int64_t rest = head + (n - tail);
  for (std::int64_t r = thread; r < rest; r += threads) {
    const std::int64_t idx = r < head ? r : tail + (r - head);
    m = max(m, abs_bits_of<Act>(x[idx]));
  }
  return m;
}

template <typename T, int BLOCK_THREADS, int N, typename Act>
QBL_KERNEL void __launch_bounds__(
    BLOCK_THREADS, table_min_blocks<ActivationTable<Act, T, false>::enabled>(BLOCK_THREADS))
    amax_kernel(const T* __restrict__ x, std::int64_t n, std::int64_t head,
                std::uint32_t* __restrict__ amax_bits) {
  using BlockAmax = BlockAbsMax<T, BLOCK_THREADS>;
  __shared__ typename BlockAmax::TempStorage temp;
  __shared__ ActivationTable<Act, T, false> table;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A programmatic dependent (the quant-blend kernel) may be scheduled as SMs free up; it waits
  // for this grid's completion before it reads the result.
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * BLOCK_THREADS + threadIdx.x;
  const std::int64_t threads = static_cast<std::int64_t>(gridDim.x) * BLOCK_THREADS;
  fill_table(table, false);
  const std::uint32_t m = BlockAmax(temp).reduce_bits(
      thread_abs_max_bits<T, N, Act>(x, n, head, thread, threads, table));
  if (threadIdx.x == 0 && m != 0) atomicMax(amax_bits, m);
}

/// Per-block maxima for a consumer that combines them itself (the layer's prologue: the
/// quant-blend kernel reduces them after its grid-dependency wait). partials[blockIdx.x] gets the
/// block's max of abs_bits: no atomics, and nothing to reset between calls.
template <typename T, int BLOCK_THREADS, int N, typename Act>
QBL_KERNEL void __launch_bounds__(
    BLOCK_THREADS, table_min_blocks<ActivationTable<Act, T, false>::enabled>(BLOCK_THREADS))
    amax_partials_kernel(const T* __restrict__ x, std::int64_t n, std::int64_t head,
                         std::uint32_t* __restrict__ partials) {
  using BlockAmax = BlockAbsMax<T, BLOCK_THREADS>;
  __shared__ typename BlockAmax::TempStorage temp;
  __shared__ ActivationTable<Act, T, false> table;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * BLOCK_THREADS + threadIdx.x;
  const std::int64_t threads = static_cast<std::int64_t>(gridDim.x) * BLOCK_THREADS;
  fill_table(table, false);
  const std::uint32_t m = BlockAmax(temp).reduce_bits(
      thread_abs_max_bits<T, N, Act>(x, n, head, thread, threads, table));
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

/// The most blocks an amax launch uses, and so the most partial maxima the prologue combines.
inline constexpr int amax_max_blocks = 1024;

/// Elements before the first 16-byte-aligned one (x must be aligned to sizeof(T)).
template <typename T>
std::int64_t aligned_head(const T* x, std::int64_t n) {
  const auto misalign = reinterpret_cast<std::uintptr_t>(x) % 16;
  const std::int64_t head =
      misalign == 0 ? 0 : static_cast<std::int64_t>((16 - misalign) / sizeof(T));
  return std::min(head, n);
}

}  // namespace qbl::detail

namespace qbl::detail {

/// Blocks of an amax launch over n elements of T starting at `head` aligned ones: enough
/// resident blocks to fill every multiprocessor (each thread then loops), at most amax_max_blocks.
template <typename T>
std::int64_t amax_blocks(std::int64_t n, std::int64_t head, int sms) {
  const std::int64_t work = std::max<std::int64_t>((n - head) / vec16<T>, 1);
  return std::min<std::int64_t>({ceil_div<std::int64_t>(work, amax_block_threads),
                                 std::int64_t{sms} * 4, std::int64_t{amax_max_blocks}});
}

/// qbl::amax with the device's multiprocessor count given (the plans ask for it once).
/// `bytes_to_zero` >= 4 bytes from d_amax are zeroed first (one memset).
template <typename Act, typename T>
cudaError_t launch_amax(const T* d_x, std::int64_t n, float* d_amax, std::size_t bytes_to_zero,
                        int sms, cudaStream_t stream) {
  if (n < 0 || (n > 0 && d_x == nullptr) || d_amax == nullptr || sms < 1)
    return cudaErrorInvalidValue;
  QBL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d_amax, 0, bytes_to_zero, stream));
  if (n == 0) return cudaSuccess;

  constexpr int threads = amax_block_threads;
  constexpr int N = vec16<T>;
  const std::int64_t head = aligned_head(d_x, n);
  const std::int64_t blocks = amax_blocks<T>(n, head, sms);
  amax_kernel<T, threads, N, Act><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      d_x, n, head, reinterpret_cast<std::uint32_t*>(d_amax));
  return cudaGetLastError();
}

/// The per-block maxima of x[0, n) into partials[0, *count) (n > 0); *count is the grid size.
template <typename Act, typename T>
cudaError_t launch_amax_partials(const T* d_x, std::int64_t n, std::uint32_t* partials, int* count,
                                 int sms, cudaStream_t stream) {
  constexpr int threads = amax_block_threads;
  constexpr int N = vec16<T>;
  const std::int64_t head = aligned_head(d_x, n);
  const std::int64_t blocks = amax_blocks<T>(n, head, sms);
  *count = static_cast<int>(blocks);
  amax_partials_kernel<T, threads, N, Act>
      <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(d_x, n, head, partials);
  return cudaGetLastError();
}

}  // namespace qbl::detail

namespace qbl {

template <typename T, typename Act>
cudaError_t amax(const T* d_x, std::int64_t n, float* d_amax, cudaStream_t stream) {
  static_assert(detail::is_activation<Act>, "amax<T, Act>: Act is one of qbl::Activations");
  if (n < 0 || (n > 0 && d_x == nullptr) || d_amax == nullptr) return cudaErrorInvalidValue;
  int sms = 0;
  QBL_CUDA_RETURN_IF_ERROR(detail::sm_count(&sms));
  return detail::launch_amax<Act>(d_x, n, d_amax, sizeof(float), sms, stream);
}

}  // namespace qbl

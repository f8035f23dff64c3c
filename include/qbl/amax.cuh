// qbl/amax.cuh -- max |x| over a whole tensor, NaN-propagating, on the device.
//
// Stage 1 of the layer. The block-level piece is a CUB-style class template over the value type
// and the block size; the device-wide launcher reduces each block with it and combines the blocks
// with one atomicMax on the bits of |x| (see qbl::abs_bits for why unsigned order is the right
// order, NaN included).
//
//   float* d_amax;                 // one float on the device
//   cudaMalloc(&d_amax, sizeof(float));
//   cudaError_t err = qbl::amax(d_x, n, d_amax, stream);   // *d_amax = max |x|, or NaN
//
// The result stays on the device; the launcher never synchronizes.
#pragma once

#include <qbl/activation.cuh>
#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>

#include <cstdint>

namespace qbl {

/// Block-wide max of |x| over values held by the threads of one block.
///
/// \tparam T              element type of the values (float)
/// \tparam BLOCK_THREADS  threads in the block (a multiple of 32)
///
/// Like cub::BlockReduce, the result is valid in thread 0 only, and reusing TempStorage needs a
/// __syncthreads() in between.
///
///   using BlockAmax = qbl::BlockAbsMax<float, 256>;
///   __shared__ typename BlockAmax::TempStorage temp;
///   std::uint32_t m = BlockAmax(temp).reduce_bits(qbl::abs_bits(v));   // thread 0 only
template <typename T, int BLOCK_THREADS>
class BlockAbsMax {
  using Reduce = cub::BlockReduce<std::uint32_t, BLOCK_THREADS>;

 public:
  /// Shared memory the reduction needs.
  using TempStorage = typename Reduce::TempStorage;

  __device__ __forceinline__ explicit BlockAbsMax(TempStorage& temp) : temp_(temp) {}

  /// Max over the threads' `abs_bits` values; valid in thread 0.
  __device__ __forceinline__ std::uint32_t reduce_bits(std::uint32_t thread_bits) {
    return Reduce(temp_).Reduce(thread_bits, ::cuda::maximum<>{});
  }

  /// Max |v| over one value per thread, NaN-propagating; valid in thread 0.
  __device__ __forceinline__ float reduce(T v) {
    return from_abs_bits(reduce_bits(abs_bits(detail::to_float(v))));
  }

 private:
  TempStorage& temp_;
};

/// Writes max |x[i]| over i in [0, n) to *d_amax on `stream`: NaN if any element is NaN, +Inf if
/// any is infinite (and none NaN), 0 for n == 0. Any alignment of d_x is accepted; 16-byte
/// vector loads are used from the first aligned element on. With an activation (qbl::Gelu, ...:
/// qbl/activation.cuh), the max of |act(x[i])|, act(x[i]) rounded to T.
///
/// Enqueues a 4-byte memset of *d_amax and one kernel; no synchronization, no allocation.
/// Returns the first CUDA error (from the launch or the memset).
template <typename T, typename Act = Identity>
cudaError_t amax(const T* d_x, std::int64_t n, float* d_amax, cudaStream_t stream = nullptr);

}  // namespace qbl

#include <qbl/detail/amax.inl>

// bench_inputs.cuh -- qbl_bench's inputs: random tensors generated on the device, and the sets of
// x and logits that the runs rotate over.
//
// Inputs rotate run by run over K independent sets of x and logits with K * bytes(x) >= 3 x L2
// (bytes in T), so that x comes from HBM as it does in a real network where the previous layer's
// output has long left L2. W, b and the GEMM's `mixed` operand do not rotate: in real use the same
// weights are read every step, and `mixed` is consumed right after it is written. All inputs are
// random, generated on the device in T (never zeros: zeros would make the fake-quantize degenerate
// and may let the GPU run at lower power).
#pragma once

#include <qbl/detail/vec.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "bench_check.hpp"
#include "bench_memory.hpp"

namespace {

// The rotating x/logits sets stay under this; with everything else per shape (<= ~4 GiB for the
// biggest, ~2 GiB more with the training items) and the copy buffers (2 GiB) the process stays
// under ~12 GiB.
constexpr std::size_t rotation_cap_bytes = 2048 * mib;

inline std::size_t round_up(std::size_t v, std::size_t to) { return (v + to - 1) / to * to; }

// How many input sets to rotate over: K * bytes(x) >= 3 x L2 (and at least 2), within the
// rotation cap. Each set starts on a 256-byte boundary (x_stride, l_stride), like a fresh
// cudaMalloc.
inline std::size_t rotating_set_count(std::size_t x_bytes, std::size_t x_stride,
                                      std::size_t l_stride, int l2_bytes) {
  const std::size_t sets =
      std::max<std::size_t>(2, (3 * static_cast<std::size_t>(l2_bytes) + x_bytes - 1) / x_bytes);
  return std::max<std::size_t>(1, std::min(sets, rotation_cap_bytes / (x_stride + l_stride)));
}

// The rotating input sets of one shape: set k at x + (k % count) * x_stride, likewise logits.
template <typename T>
struct InputSets {
  const char* x = nullptr;
  const char* logits = nullptr;
  std::size_t x_stride = 0, l_stride = 0, count = 1;

  const T* x_of(std::size_t k) const {
    return reinterpret_cast<const T*>(x + (k % count) * x_stride);
  }
  const T* logits_of(std::size_t k) const {
    return reinterpret_cast<const T*>(logits + (k % count) * l_stride);
  }
};

// ---- random inputs, generated on the device -------------------------------------------------

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Box-Muller over two 24-bit uniforms from one 64-bit hash of (seed, i): randn-like, |z| <= 5.8;
// drawn in fp32 and rounded to T, as torch.randn(dtype=T) stores it.
template <typename T>
__global__ void fill_randn_kernel(T* __restrict__ p, std::int64_t n, std::uint64_t seed,
                                  float stddev) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h =
        splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u1 = static_cast<float>((h >> 40) + 1) * 0x1p-24f;  // (0, 1]
    const float u2 = static_cast<float>(h & 0xffffffu) * 0x1p-24f;  // [0, 1)
    p[i] = qbl::detail::from_float<T>(stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

// Uniform in [-bound, bound): nn.Linear's default init for W and b with bound = 1/sqrt(in).
template <typename T>
__global__ void fill_uniform_kernel(T* __restrict__ p, std::int64_t n, std::uint64_t seed,
                                    float bound) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h =
        splitmix64(seed * 0x632be59bd9b4e019ull + static_cast<std::uint64_t>(i));
    const float u = static_cast<float>(h >> 40) * 0x1p-24f;
    p[i] = qbl::detail::from_float<T>(bound * (2.0f * u - 1.0f));
  }
}

inline unsigned fill_grid(std::int64_t n, int sms) {
  return static_cast<unsigned>(
      std::max<std::int64_t>(1, std::min<std::int64_t>((n + 255) / 256, std::int64_t{sms} * 32)));
}

template <typename T>
void fill_randn(T* p, std::int64_t n, std::uint64_t seed, float stddev, int sms, cudaStream_t s) {
  fill_randn_kernel<T><<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, stddev);
  LAUNCH_CHECK();
}

template <typename T>
void fill_uniform(T* p, std::int64_t n, std::uint64_t seed, float bound, int sms, cudaStream_t s) {
  fill_uniform_kernel<T><<<fill_grid(n, sms), 256, 0, s>>>(p, n, seed, bound);
  LAUNCH_CHECK();
}

}  // namespace

// qbl/options.hpp -- construction-time settings of qbl::QuantBlendLinear and qbl::LinearGemm.
#pragma once

#include <cstddef>

namespace qbl {

/// Where qbl's objects get their device memory: the workspace an instance owns, and the scratch
/// that planning uses for a while at construction. The default (both functions null) is
/// cudaMalloc / cudaFree. A framework passes its own, e.g. PyTorch's caching allocator, so that
/// qbl's memory is counted and reused with the rest:
///
///   qbl::Options opt;
///   opt.allocator.allocate = [](std::size_t n, void*) { return my_alloc(n); };
///   opt.allocator.deallocate = [](void* p, std::size_t, void*) { my_free(p); };
///
/// `allocate` returns memory of the device current at the call, aligned to 256 bytes, usable from
/// any stream, or nullptr (or throws) when it has none; qbl turns nullptr into qbl::out_of_memory.
/// `deallocate` receives what `allocate` returned, with the same size; it is called when the
/// owning object is destroyed or planning ends, on the same device. cudaFree waits for the work
/// still using the memory; a stream-ordered allocator does not, so destroy an instance only after
/// the streams that ran its work have reached that point.
struct DeviceAllocator {
  void* (*allocate)(std::size_t bytes, void* context) = nullptr;
  void (*deallocate)(void* ptr, std::size_t bytes, void* context) = nullptr;
  void* context = nullptr;  ///< passed to both
};

/// Every field has a default that suits an H200; construct with `{}` and override what you need.
///
///   qbl::Options opt;
///   opt.cublas_workspace_bytes = 4u << 20;
///   qbl::QuantBlendLinear<float> layer(4096, 4096, 16384, opt);
struct Options {
  /// cuBLASLt workspace owned by the layer (Hopper's recommended size). 0 restricts the GEMM to
  /// algorithms that need none.
  std::size_t cublas_workspace_bytes = 32u << 20;

  /// fp32 only: run the GEMM as CUBLAS_COMPUTE_32F_FAST_TF32 (torch.backends.cuda.matmul.allow_tf32
  /// = True). Off by default, so results match PyTorch's default fp32 matmul.
  bool allow_tf32 = false;

  /// At construction, time up to `autotune_candidates` cuBLASLt heuristic candidates for every
  /// token-count bucket on scratch data of the real shape and keep the fastest (a candidate must
  /// beat cuBLASLt's first choice by 10 %). Off by default, like torch.backends.cudnn.benchmark:
  /// timing-based choices can differ between instances and runs, and so can the last bits of
  /// `out`; with it off every instance runs cuBLASLt's first-ranked algorithm and results are
  /// bitwise reproducible. On, it costs a few GEMMs per bucket and a scratch allocation of the
  /// operands' size at construction, and pays off mostly at small token counts.
  bool autotune = false;
  int autotune_candidates = 8;

  /// Plan the backward pass at construction (its two GEMMs, dgrad and wgrad) and allocate its
  /// scratch, so that QuantBlendLinear::backward() can run. Off by default: an inference-only
  /// instance plans and allocates nothing for the backward, and backward() throws.
  bool backward = false;

  /// The forward's prologue (amax, then quant-blend) as one cooperative launch that reads x once,
  /// where x fits in the chip's registers and shared memory (about 32 MB on an H200; larger x
  /// keeps the two-pass prologue). Off (the default): the two-pass prologue of
  /// qbl::amax_quant_blend (a memset, the amax kernel, the quant-blend kernel; x read twice).
  /// Both give the same bits. Off by default because on an H200 it measured no faster: the
  /// blend's arithmetic cannot start before the grid-wide barrier, which costs what the second
  /// read saved (benchmarks/RESULTS.md). The cooperative launch needs its whole grid resident at
  /// once; where the device refuses such a grid the forward runs the two-pass prologue instead,
  /// except during stream capture, where CUDA invalidates the capture on the refusal (the grid is
  /// sized at construction from the occupancy calculator, so only a device whose usable
  /// multiprocessors shrink afterwards refuses it).
  bool one_pass = false;

  /// Device memory of the instance and of its planning (default: cudaMalloc / cudaFree).
  DeviceAllocator allocator;
};

/// The gradient that reaches x through the fake quantizer x_q = fake_quant(x, scale).
enum class QuantGrad {
  /// The reference module's: torch.round has a zero gradient, so x gets only the blend's direct
  /// part, grad_x = g_mixed * (1 - alpha) (plus autograd's zero from the quantized branch).
  zero,
  /// The straight-through estimator (ModelSTE): the quantizer passes the gradient unchanged,
  /// grad_x = g_mixed * alpha + g_mixed * (1 - alpha), each product and the sum rounded as eager.
  straight_through,
};

}  // namespace qbl

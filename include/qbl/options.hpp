// qbl/options.hpp -- construction-time settings of qbl's plans and of qbl::QuantBlendLinear.
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

/// A choice a plan makes from its shape when it is made, unless the caller forces it.
enum class Choice {
  by_shape,  ///< the plan decides from its shape (measured rules, see the field's comment)
  yes,       ///< always
  no,        ///< never
};

/// Every field has a default that suits an H200; construct with `{}` and override what you need.
///
///   qbl::Options opt;
///   opt.cublas_workspace_bytes = 4u << 20;
///   qbl::QuantBlendLinear<float> layer(4096, 4096, 16384, opt);
struct Options {
  /// cuBLASLt workspace of each GEMM (Hopper's recommended size). 0 restricts the GEMMs to
  /// algorithms that need none.
  std::size_t cublas_workspace_bytes = 32u << 20;

  /// fp32 GEMMs only: run them as CUBLAS_COMPUTE_32F_FAST_TF32
  /// (torch.backends.cuda.matmul.allow_tf32 = True). Off by default, so results match PyTorch's
  /// default fp32 matmul.
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

  /// qbl::QuantBlendLinear: plan the backward pass at construction (its two GEMMs, dgrad and
  /// wgrad) and size the workspace for it, so that backward() can run. Off by default: an
  /// inference-only instance plans and allocates nothing for the backward, and backward() throws.
  bool backward = false;

  /// The backward's weight gradient (and bias gradient) on a second stream beside its input
  /// gradient, or serialized with it on the caller's stream. by_shape: beside each other at every
  /// shape, as no shape at which that stops paying has been measured (benchmarks/HISTORY.md);
  /// qbl::BackwardPlan::overlaps() says which. The bits are the same either way. Beside each other
  /// needs a qbl::SideStream passed to BackwardPlan::run (qbl::QuantBlendLinear owns one).
  Choice overlap_wgrad = Choice::by_shape;

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

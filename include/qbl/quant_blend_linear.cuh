// qbl/quant_blend_linear.cuh -- the whole layer: amax -> quant-blend -> Linear, as one object
// that owns its memory, forward and backward.
//
//   qbl::QuantBlendLinear<float> layer(in_features, out_features, max_tokens);
//   layer.forward(d_x, d_logits, d_weight, d_bias, d_out, tokens, stream);
//   const float* d_scale = layer.device_scale();   // this forward's scale, still on the device
//
// It computes, bit for bit as PyTorch eager up to the GEMM:
//   alpha = sigmoid(logits); amax = max |x| (NaN-propagating); scale = clamp(amax, 1e-8) *
//   fl(1/127); mixed = alpha * (clamp(round(x / scale), -127, 127) * scale) + (1 - alpha) * x;
//   out = mixed · weightᵀ + bias
//
// Training (Options::backward = true): forward() into buffers the caller keeps per call, then
// backward() from them:
//
//   qbl::Options opt;  opt.backward = true;
//   qbl::QuantBlendLinear<float> layer(in, out, max_tokens, opt);
//   qbl::QuantBlendLinear<float>::ForwardArgs f;
//   f.x = d_x;  f.logits = d_l;  f.weight = d_w;  f.bias = d_b;  f.out = d_out;  f.tokens = t;
//   f.mixed = d_mixed;  f.stats = d_stats;                 // what the backward will read
//   layer.forward(f, stream);
//   qbl::QuantBlendLinear<float>::BackwardArgs b;
//   b.grad_out = d_g;  b.x = d_x;  b.logits = d_l;  b.weight = d_w;  b.tokens = t;
//   b.mixed = d_mixed;  b.stats = d_stats;
//   b.grad_x = d_gx;  b.grad_logits = d_gl;  b.grad_weight = d_gw;  b.grad_bias = d_gb;
//   layer.backward(b, stream);
//
// The object composes a qbl::ForwardPlan and, with Options::backward, a qbl::BackwardPlan and the
// qbl::SideStream its wgrad runs on (qbl/layer_plans.cuh), and owns their workspace and a `mixed`
// and `stats` of its own for calls that pass none. Construction plans and allocates; forward() and
// backward() check their arguments (throwing before anything is launched), then enqueue kernels and
// cuBLASLt products on `stream`: no allocation, no host synchronization, no heuristic query -- so
// they can be captured in a CUDA graph, which stays valid for as long as the object lives.
//
// Thread safety: one instance serves one stream at a time (its workspace and its own buffers are
// reused by every call). Use one instance per concurrent stream, or the plans themselves with a
// workspace per stream.
#pragma once

#include <qbl/detail/config.cuh>  // first: it stops a non-CUDA compile with one clear error

#include <qbl/detail/handles.hpp>
#include <qbl/error.hpp>
#include <qbl/layer_plans.cuh>
#include <qbl/options.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace qbl {

/// The fused quantize-blend-linear layer. X: x's type; G: the GEMM's (mixed, weight, bias, out
/// and their gradients); L: the logits'; Act: the input activation (qbl/activation.cuh: Identity,
/// the default, or Gelu, GeluTanh, Relu, Silu), applied to x inside the layer. float, __nv_bfloat16
/// or __half, one for all three; or fp32 x with a bf16/fp16 GEMM, the logits fp32 or of the GEMM's
/// type (qbl/layer_plans.cuh). For 16-bit types each element op runs in fp32 and is rounded to the
/// type, as eager does; amax and scale are held in fp32 on the device, with the values eager's
/// tensors hold; 16-bit GEMMs run on the tensor cores with fp32 accumulation.
template <typename X, typename G = X, typename L = X, typename Act = Identity>
class QuantBlendLinear {
 public:
  using x_type = X;
  using gemm_type = G;
  using logits_type = L;
  using ForwardArgs = qbl::ForwardArgs<X, G, L>;  // with amax_source for a sharded forward
  using BackwardArgs = qbl::BackwardArgs<X, G, L>;

  /// Plans the forward (and with Options::backward the backward) for up to `max_tokens` tokens
  /// on the current device, which every later call must also run on, and allocates the
  /// workspace, `mixed` and `stats`. Planning needs scratch memory for a while, freed before the
  /// constructor returns: each GEMM's operands at one token more than the largest power of
  /// two below max_tokens (at max_tokens with Options::autotune), one GEMM at a time.
  /// \throws qbl::invalid_argument for non-positive sizes, qbl::out_of_memory if the workspace
  ///         cannot be allocated, qbl::cublas_error if cuBLASLt cannot serve the shape.
  QuantBlendLinear(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
                   Options options = {});

  QuantBlendLinear(QuantBlendLinear&&) noexcept = default;
  QuantBlendLinear& operator=(QuantBlendLinear&&) noexcept = default;
  QuantBlendLinear(const QuantBlendLinear&) = delete;
  QuantBlendLinear& operator=(const QuantBlendLinear&) = delete;
  ~QuantBlendLinear() = default;

  /// out = quant_blend(x, logits) · weightᵀ + bias on `stream`, into the instance's own `mixed`
  /// and `stats` (device_mixed(), device_scale()). The ForwardArgs overload below, with
  /// mixed and stats null.
  void forward(const X* x, const L* logits, const G* weight, const G* bias, G* out,
               std::int64_t tokens, cudaStream_t stream = nullptr) {
    ForwardArgs args;
    args.x = x, args.logits = logits, args.weight = weight, args.bias = bias, args.out = out;
    args.tokens = tokens;
    forward(args, stream);
  }

  /// The forward (ForwardPlan::run). `args.mixed` and `args.stats` both given -- what a
  /// backward will read; a framework keeps one pair per call, so that several forwards
  /// (micro-batches, the layer used twice) can precede their backwards -- or both null: the
  /// instance's own. The GEMM runs on cuBLASLt wherever it has an algorithm for the token count,
  /// the shape and the pointers' alignment, and otherwise on qbl's fallback kernel
  /// (uses_cublaslt() tells which).
  /// \throws as ForwardPlan::run, and qbl::logic_error for a moved-from object.
  void forward(const ForwardArgs& args, cudaStream_t stream = nullptr);

  /// Sharded inputs (tensor or sequence parallelism): the forward in two steps around a
  /// reduction of amax across the shards that the caller runs between them:
  ///
  ///   layer.forward_local_amax(d_x, tokens, d_stats, stream);         // this shard's max |x|
  ///   ncclAllReduce(d_stats, d_stats, 1, ncclUint32, ncclMax, comm, stream);   // amax's bits
  ///   args.stats = d_stats;  args.amax_source = qbl::AmaxSource::stats;  ...
  ///   layer.forward(args, stream);
  ///
  /// Together they equal forward() from x bit for bit (ForwardPlan::local_amax says why an
  /// unsigned integer max is the right reduction). Neither allocates or synchronizes; both can be
  /// captured.
  void forward_local_amax(const X* x, std::int64_t tokens, float* stats,
                          cudaStream_t stream = nullptr);

  /// The backward of forward() (BackwardPlan::run), on `stream`, wgrad beside dgrad on the
  /// instance's own side stream where the plan overlaps them. Needs Options::backward.
  /// `args.mixed` and `args.stats`: what the forward saved, or both null for the instance's own
  /// (those of its last forward without caller buffers). With `args.mixed` given, `args.stats`
  /// may be null where nothing asked for needs it (only grad_weight and grad_bias wanted). With
  /// `args.stats` given and `args.mixed` null, mixed is recomputed from x and the stats (bit for
  /// bit what the forward wrote): a caller that keeps only x, logits and the 8 bytes of stats
  /// between forward and backward passes its forward a scratch `mixed` it reuses.
  /// \throws qbl::logic_error (no Options::backward, moved-from object), else as
  ///         BackwardPlan::run.
  void backward(const BackwardArgs& args, cudaStream_t stream = nullptr);

  /// Will forward(args) run its GEMM on cuBLASLt (true) or on the fallback kernel? (A null
  /// args.mixed counts as the instance's own.) False where cuBLASLt has no algorithm for the
  /// shape (bf16/fp16 with an odd in_features, on an H200) or the pointers' alignment (bf16 at
  /// 2 bytes): aligning weight, bias, out and mixed to 16 bytes avoids the second case.
  bool uses_cublaslt(const ForwardArgs& args) const noexcept {
    ForwardArgs a = args;
    if (a.mixed == nullptr) a.mixed = mixed_.as<G>();
    return forward_.uses_cublaslt(a);
  }

  /// The scale of the last forward into the instance's own stats (one float on the device).
  /// Read it after the forward's stream has reached that point.
  const float* device_scale() const noexcept { return stats_.as<float>() + 1; }

  /// max |x| of that forward, before the clamp (one float on the device).
  const float* device_amax() const noexcept { return stats_.as<float>(); }

  /// `mixed` of that forward, [tokens, in_features] on the device.
  const G* device_mixed() const noexcept { return mixed_.as<G>(); }

  const ForwardPlan<X, G, L, Act>& forward_plan() const noexcept { return forward_; }

  /// The backward plan, or nullptr without Options::backward.
  const BackwardPlan<X, G, L, Act>* backward_plan() const noexcept { return backward_.get(); }

  std::int64_t in_features() const noexcept { return forward_.in_features(); }
  std::int64_t out_features() const noexcept { return forward_.out_features(); }
  std::int64_t max_tokens() const noexcept { return forward_.max_tokens(); }

  /// Device bytes an instance allocates: its stats, its `mixed` and the workspace of its plans
  /// (the larger of the forward's and, with Options::backward, the backward's; they run one at a
  /// time). Callers who manage memory themselves use the plans, or the free functions
  /// (qbl::amax_quant_blend, qbl::quant_blend_backward, qbl::bias_grad, qbl::GemmPlan), with
  /// buffers of their own instead.
  static std::size_t workspace_bytes(std::int64_t in_features, std::int64_t out_features,
                                     std::int64_t max_tokens, const Options& options = {});

 private:
  /// args with a null mixed and stats (both) replaced by the instance's own.
  template <typename Args>
  Args own_buffers(Args args) const;

  ForwardPlan<X, G, L, Act> forward_;
  std::unique_ptr<BackwardPlan<X, G, L, Act>> backward_;
  std::unique_ptr<SideStream> side_;  ///< where the backward plan may overlap its GEMMs
  detail::device_buffer workspace_, mixed_, stats_;
};

}  // namespace qbl

#include <qbl/detail/quant_blend_linear.inl>

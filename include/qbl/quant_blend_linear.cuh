// qbl/quant_blend_linear.cuh -- the whole layer: amax -> quant-blend -> Linear, as one object,
// forward and backward.
//
//   qbl::QuantBlendLinear<float> layer(in_features, out_features, max_tokens);
//   layer.forward(d_x, d_logits, d_weight, d_bias, d_out, tokens, stream);
//   const float* d_scale = layer.device_scale();   // this forward's scale, still on the device
//
// It computes, bit for bit as PyTorch eager in fp32 up to the GEMM:
//   alpha = sigmoid(logits); amax = max |x| (NaN-propagating); scale = clamp(amax, 1e-8) *
//   fl(1/127) mixed = alpha * (clamp(round(x / scale), -127, 127) * scale) + (1 - alpha) * x out =
//   mixed · weightᵀ + bias
//
// Training (Options::backward = true): forward() into caller-provided `mixed` and statistics
// buffers, which a framework keeps per call, then backward() from them:
//
//   qbl::Options opt;  opt.backward = true;
//   qbl::QuantBlendLinear<float> layer(in, out, max_tokens, opt);
//   layer.forward(d_x, d_logits, d_w, d_b, d_out, tokens, d_mixed, d_stats, stream);  // saves both
//   qbl::QuantBlendLinear<float>::Gradients g;
//   g.x = d_grad_x;  g.logits = d_grad_logits;  g.weight = d_grad_w;  g.bias = d_grad_b;
//   layer.backward(d_grad_out, d_x, d_logits, d_w, d_mixed, d_stats, tokens, g, stream);
//
// The object owns every device buffer and cuBLASLt object it uses; construction plans the GEMMs
// and allocates. forward() and backward() validate their arguments (throwing before anything is
// launched), then enqueue kernels and cublasLtMatmul calls (or, where cuBLASLt has no algorithm,
// qbl's fallback GEMM kernel) on `stream`: no allocation, no host synchronization, no heuristic
// query, no copy to the host -- so they can be captured in a CUDA graph, which stays valid for as
// long as the object lives.
//
// Thread safety: one instance serves one stream at a time (its own buffers and descriptors are
// reused by every call). Use one instance per concurrent stream.
#pragma once

#include <qbl/detail/handles.hpp>
#include <qbl/detail/linear_fallback.cuh>
#include <qbl/detail/quant_blend_one_pass.cuh>
#include <qbl/error.hpp>
#include <qbl/gemm.hpp>
#include <qbl/options.hpp>
#include <qbl/quant_blend.cuh>
#include <qbl/quant_blend_backward.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace qbl {

/// The fused quantize-blend-linear layer for element type T: float, __nv_bfloat16 or __half.
/// For 16-bit T, every tensor (x, logits, weight, bias, out, mixed) is in T; each element op runs
/// in fp32 and is rounded to T, as eager does; amax and scale are held in fp32 on the device, with
/// the values eager's T tensors hold; the GEMM runs on the tensor cores with fp32 accumulation.
template <typename T>
class QuantBlendLinear {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> ||
                    std::is_same_v<T, __half>,
                "QuantBlendLinear<T>: T is float, __nv_bfloat16 or __half");

 public:
  using value_type = T;

  /// Allocates the workspace for up to `max_tokens` tokens and plans the GEMMs on the current
  /// device, which every later forward() and backward() must also run on. Planning needs scratch
  /// memory for a while, freed before the constructor returns: each GEMM's operands at up to
  /// max_tokens / 2 + 1 tokens (at max_tokens with Options::autotune), one GEMM at a time.
  /// \throws qbl::invalid_argument for non-positive sizes, qbl::out_of_memory if the workspace
  ///         cannot be allocated, qbl::cublas_error if cuBLASLt cannot serve the shape.
  QuantBlendLinear(std::int64_t in_features, std::int64_t out_features, std::int64_t max_tokens,
                   Options options = {});

  QuantBlendLinear(QuantBlendLinear&&) noexcept = default;
  QuantBlendLinear& operator=(QuantBlendLinear&&) noexcept = default;
  QuantBlendLinear(const QuantBlendLinear&) = delete;
  QuantBlendLinear& operator=(const QuantBlendLinear&) = delete;
  ~QuantBlendLinear() = default;

  /// out = quant_blend(x, logits) · weightᵀ + bias, enqueued on `stream`.
  ///
  /// All pointers are device pointers to contiguous row-major data aligned to sizeof(T):
  /// x [tokens, in_features], logits [tokens], weight [out_features, in_features] (nn.Linear's
  /// layout), bias [out_features] or nullptr, out [tokens, out_features]. `out` must not overlap
  /// any input. tokens == 0 does nothing.
  ///
  /// The GEMM runs on cuBLASLt wherever it has an algorithm for the token count, the shape and
  /// the pointers' alignment, and otherwise on qbl's own fallback kernel (correct for any shape
  /// and alignment, slower; uses_cublaslt() tells which).
  ///
  /// \throws qbl::invalid_argument (null or misaligned pointer, negative tokens, out overlapping
  ///         an input, wrong current device), qbl::out_of_range (tokens > max_tokens),
  ///         qbl::logic_error (moved-from object) -- all before anything is launched, so `out` is
  ///         untouched; qbl::cuda_error / qbl::cublas_error if a launch fails.
  void forward(const T* x, const T* logits, const T* weight, const T* bias, T* out,
               std::int64_t tokens, cudaStream_t stream = nullptr);

  /// The same forward, keeping what backward() needs in the caller's buffers instead of the
  /// instance's: `mixed` [tokens, in_features] in T and `stats` [stats_floats] floats, both on
  /// the device (stats receives amax and the scale). A framework keeps one pair per call, so that
  /// several forwards (micro-batches, the same layer used twice) can precede their backwards.
  /// Neither may overlap an input or `out`; otherwise as forward() above.
  void forward(const T* x, const T* logits, const T* weight, const T* bias, T* out,
               std::int64_t tokens, T* mixed, float* stats, cudaStream_t stream = nullptr);

  /// Floats in a `stats` buffer: [amax, scale].
  static constexpr std::int64_t stats_floats = 2;

  /// Sharded inputs (tensor or sequence parallelism), the forward in two steps around a reduction
  /// of amax across the shards that the caller runs between them (NCCL, torch.distributed):
  ///
  ///   layer.forward_local_amax(d_x, tokens, d_stats, stream);        // this shard's max |x|
  ///   ncclAllReduce(d_stats, d_stats, 1, ncclUint32, ncclMax, comm, stream);   // amax's bits
  ///   layer.forward_from_amax(d_x, d_logits, d_w, d_b, d_out, tokens, d_mixed, d_stats, stream);
  ///
  /// The two steps together equal forward() into caller buffers bit for bit. stats[0] holds max |x|
  /// as a float whose sign bit is clear; for such floats the bit patterns, read as unsigned
  /// integers, order like the values, with every NaN above +Inf. An unsigned integer MAX of those
  /// 32 bits across shards is therefore the NaN-propagating float max (a NaN in any shard makes
  /// every shard's scale NaN, as the unsharded layer's), which a float MAX reduction (fmaxf
  /// semantics, dropping NaN) is not. Neither step allocates or synchronizes; both can be captured.
  ///
  /// forward_local_amax: writes this shard's max |x| to stats[0] (0 for tokens == 0, the identity
  /// of the reduction); reads nothing else, writes nothing else.
  void forward_local_amax(const T* x, std::int64_t tokens, float* stats,
                          cudaStream_t stream = nullptr);

  /// forward_from_amax: the rest of forward() from the amax in stats[0] (any non-negative float
  /// or NaN, e.g. the reduction's result): writes the scale to stats[1], `mixed` and `out`
  /// (tokens == 0 writes nothing, as forward()). Arguments and errors as the caller-buffer
  /// forward().
  void forward_from_amax(const T* x, const T* logits, const T* weight, const T* bias, T* out,
                         std::int64_t tokens, T* mixed, float* stats,
                         cudaStream_t stream = nullptr);

  /// Where backward() writes; a null pointer skips that gradient and the work only it needs.
  struct Gradients {
    T* x = nullptr;       ///< [tokens, in_features]
    T* logits = nullptr;  ///< [tokens]
    T* weight = nullptr;  ///< [out_features, in_features]
    T* bias = nullptr;    ///< [out_features]
    /// weight and bias: add to what they hold (cuBLASLt's beta = 1; the bias as
    /// RN_T(old + RN_T(sum))), as frameworks accumulate over micro-batches. x and logits are
    /// always overwritten.
    bool accumulate = false;
    /// The gradient through the fake quantizer: the reference's zero, or straight-through.
    QuantGrad quant_grad = QuantGrad::zero;
  };

  /// The backward of forward(), enqueued on `stream`. Needs Options::backward at construction.
  ///
  /// grad_out [tokens, out_features] is dL/dout; x, logits and weight are the forward's inputs;
  /// `mixed` and `stats` are what the forward saved (pass nullptr for both to use the instance's
  /// own, i.e. those of its last forward() without caller buffers). It computes, as the autograd
  /// of the reference module:
  ///   g_mixed     = grad_out · weight                           (dgrad GEMM, rounded to T)
  ///   grad_x      = g_mixed * (1 - alpha)  [+ g_mixed * alpha with QuantGrad::straight_through]
  ///   grad_logits = sigmoid_backward(sum_f g_mixed * x_q - sum_f g_mixed * x, alpha)
  ///   grad_weight = grad_outᵀ · mixed                           (wgrad GEMM)
  ///   grad_bias   = sum over tokens of grad_out                 (wgrad's BGRADB epilogue)
  /// Only what a non-null output needs runs: no dgrad without grad_x or grad_logits, no wgrad
  /// without grad_weight. x is read only for grad_logits, `mixed` only for grad_weight, the
  /// scale for grad_x and grad_logits. g_mixed is formed in grad_x's buffer when grad_x is
  /// wanted, else in the instance's scratch. tokens == 0 does nothing. When both GEMMs run, wgrad
  /// (and the bias gradient) runs on the instance's own stream, forked from `stream` and joined
  /// back into it by events (no host synchronization; a graph capture of `stream` takes it in):
  /// all of backward()'s work is ordered before what is enqueued on `stream` after it.
  ///
  /// \throws qbl::logic_error (no Options::backward, moved-from object), qbl::invalid_argument
  ///         (a null input that a wanted output needs, a misaligned pointer, an output
  ///         overlapping an input or another output, wrong current device), qbl::out_of_range
  ///         (tokens > max_tokens) -- before anything is launched, so every output is untouched;
  ///         qbl::cuda_error / qbl::cublas_error if a launch fails.
  void backward(const T* grad_out, const T* x, const T* logits, const T* weight, const T* mixed,
                const float* stats, std::int64_t tokens, const Gradients& grads,
                cudaStream_t stream = nullptr);

  /// Will forward() with these pointers and `tokens` in [1, max_tokens] run its GEMM on cuBLASLt?
  /// False: on the fallback kernel, because cuBLASLt has no algorithm for the shape (bf16/fp16
  /// with an odd in_features, on an H200) or for the pointers' alignment (bf16 at 2 bytes).
  /// Aligning weight, bias and out to 16 bytes avoids the second case.
  bool uses_cublaslt(const T* weight, const T* bias, const T* out,
                     std::int64_t tokens) const noexcept {
    return gemm_.supports(mixed_.as<T>(), weight, bias, out, tokens);
  }

  /// The same for the forward into a caller's `mixed` buffer (its alignment counts too).
  bool uses_cublaslt(const T* mixed, const T* weight, const T* bias, const T* out,
                     std::int64_t tokens) const noexcept {
    return gemm_.supports(mixed, weight, bias, out, tokens);
  }

  /// The scale of the last forward (one float on the device). Read it after the forward's stream
  /// has reached that point.
  const float* device_scale() const noexcept { return stats_.as<float>() + 1; }

  /// max |x| of the last forward, before the clamp (one float on the device).
  const float* device_amax() const noexcept { return stats_.as<float>(); }

  /// `mixed` of the last forward, [tokens, in_features] on the device.
  const T* device_mixed() const noexcept { return mixed_.as<T>(); }

  /// The GEMM stage, for its plan and autotuning record (LinearGemm::describe, ::tuning).
  const LinearGemm<T>& gemm() const noexcept { return gemm_; }

  /// Was the backward planned (Options::backward)?
  bool has_backward() const noexcept { return dgrad_ != nullptr; }

  /// The backward's GEMM plans (nullptr without Options::backward), for what they serve:
  /// dgrad_plan()->supports(weight, grad_out, g_mixed, nullptr, tokens) and
  /// wgrad_plan()->supports(mixed, grad_out, grad_weight, grad_bias, tokens) say whether backward()
  /// runs them on cuBLASLt (true) or on the fallback kernel; describe() names the algorithm.
  const GemmPlan<T>* dgrad_plan() const noexcept { return dgrad_.get(); }
  const GemmPlan<T>* wgrad_plan() const noexcept { return wgrad_.get(); }

  std::int64_t in_features() const noexcept { return in_; }
  std::int64_t out_features() const noexcept { return out_; }
  std::int64_t max_tokens() const noexcept { return max_tokens_; }
  const Options& options() const noexcept { return options_; }

  /// Device bytes an instance allocates: the `mixed` buffer, the two statistics and the cuBLASLt
  /// workspace, and with Options::backward a g_mixed scratch of [max_tokens, in_features] in T,
  /// a vector of out_features in T and a second cuBLASLt workspace (wgrad runs beside dgrad).
  /// Callers who manage memory themselves can run the free functions (qbl::amax,
  /// qbl::quant_blend, qbl::quant_blend_backward, qbl::LinearGemm, qbl::GemmPlan) over buffers of
  /// these sizes instead.
  static std::size_t workspace_bytes(std::int64_t in_features, std::int64_t out_features,
                                     std::int64_t max_tokens, const Options& options = {});

 private:
  static constexpr std::size_t stats_bytes = stats_floats * sizeof(float);
  // The instance's statistics, then the one-pass prologue's state, in one buffer.
  static constexpr std::size_t state_bytes = stats_bytes + sizeof(detail::OnePassState);
  detail::OnePassState* one_pass_state() const noexcept {
    return options_.one_pass
               ? reinterpret_cast<detail::OnePassState*>(stats_.as<unsigned char>() + stats_bytes)
               : nullptr;
  }

  void check_forward(const T* x, const T* logits, const T* weight, const T* bias, const T* out,
                     std::int64_t tokens) const;
  void check_caller_buffers(const T* x, const T* logits, const T* weight, const T* bias,
                            const T* out, std::int64_t tokens, const T* mixed,
                            const float* stats) const;
  void run_forward(const T* x, const T* logits, const T* weight, const T* bias, T* out,
                   std::int64_t tokens, T* mixed, float* stats, cudaStream_t stream,
                   bool amax_given = false);

  std::int64_t in_ = 0, out_ = 0, max_tokens_ = 0;
  Options options_;
  int device_ = 0;
  detail::LaunchLimits limits_;     // of device_, for T
  detail::OnePassLimits one_pass_;  // of device_, for T (Options::one_pass)
  detail::device_buffer stats_;     // [amax, scale], then the one-pass state
  detail::device_buffer mixed_;
  detail::device_buffer cublas_workspace_;
  LinearGemm<T> gemm_;
  // Options::backward only: the dgrad and wgrad plans and g_mixed's scratch.
  std::unique_ptr<GemmPlan<T>> dgrad_, wgrad_;
  detail::device_buffer g_mixed_;
  detail::device_buffer bias_scratch_;  // grad_bias from BGRADB before it is accumulated
  // wgrad runs on a stream of its own, forked from and joined back into the caller's with two
  // events, beside dgrad and the element kernel; it has its own cuBLASLt workspace.
  detail::stream_ptr side_stream_;
  detail::event_ptr fork_, join_;
  detail::device_buffer side_workspace_;
};

}  // namespace qbl

#include <qbl/detail/quant_blend_linear.inl>

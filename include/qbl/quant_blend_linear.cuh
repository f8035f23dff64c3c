// qbl/quant_blend_linear.cuh -- the whole layer: amax -> quant-blend -> Linear, as one object.
//
//   qbl::QuantBlendLinear<float> layer(in_features, out_features, max_tokens);
//   layer.forward(d_x, d_logits, d_weight, d_bias, d_out, tokens, stream);
//   const float* d_scale = layer.device_scale();   // this forward's scale, still on the device
//
// It computes, bit for bit as PyTorch eager in fp32 up to the GEMM:
//   alpha = sigmoid(logits); amax = max |x| (NaN-propagating); scale = clamp(amax, 1e-8) * fl(1/127)
//   mixed = alpha * (clamp(round(x / scale), -127, 127) * scale) + (1 - alpha) * x
//   out   = mixed · weightᵀ + bias
//
// The object owns every device buffer and cuBLASLt object it uses; construction plans the GEMM
// and allocates. forward() validates its arguments (throwing before anything is launched), then
// enqueues two or three kernels and one cublasLtMatmul (or, where cuBLASLt has no
// algorithm, qbl's fallback GEMM kernel) on `stream`: no allocation, no host
// synchronization, no heuristic query, no copy to the host -- so it can be captured in a CUDA
// graph, which stays valid for as long as the object lives.
//
// Thread safety: one instance serves one stream at a time (its `mixed` buffer and descriptors are
// reused by every forward). Use one instance per concurrent stream.
#pragma once

#include <qbl/detail/handles.hpp>
#include <qbl/detail/linear_fallback.cuh>
#include <qbl/error.hpp>
#include <qbl/gemm.hpp>
#include <qbl/options.hpp>
#include <qbl/quant_blend.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace qbl {

/// The fused quantize-blend-linear layer for element type T: float, __nv_bfloat16 or __half.
/// For 16-bit T, every tensor (x, logits, weight, bias, out, mixed) is in T; each element op runs in
/// fp32 and is rounded to T, as eager does; amax and scale are held in fp32 on the device, with the
/// values eager's T tensors hold; the GEMM runs on the tensor cores with fp32 accumulation.
template <typename T>
class QuantBlendLinear {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16> ||
                    std::is_same_v<T, __half>,
                "QuantBlendLinear<T>: T is float, __nv_bfloat16 or __half");

 public:
  using value_type = T;

  /// Allocates the workspace for up to `max_tokens` tokens and plans the GEMM on the current
  /// device, which every later forward() must also run on.
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

  /// Will forward() with these pointers and `tokens` in [1, max_tokens] run its GEMM on cuBLASLt?
  /// False: on the fallback kernel, because cuBLASLt has no algorithm for the shape (bf16/fp16
  /// with an odd in_features, on an H200) or for the pointers' alignment (bf16 at 2 bytes).
  /// Aligning weight, bias and out to 16 bytes avoids the second case.
  bool uses_cublaslt(const T* weight, const T* bias, const T* out, std::int64_t tokens) const noexcept {
    return gemm_.supports(mixed_.as<T>(), weight, bias, out, tokens);
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

  std::int64_t in_features() const noexcept { return in_; }
  std::int64_t out_features() const noexcept { return out_; }
  std::int64_t max_tokens() const noexcept { return max_tokens_; }
  const Options& options() const noexcept { return options_; }

  /// Device bytes an instance allocates: the `mixed` buffer, the two statistics and the cuBLASLt
  /// workspace. Callers who manage memory themselves can run the free functions (qbl::amax,
  /// qbl::quant_blend, qbl::LinearGemm) over buffers of these sizes instead.
  static std::size_t workspace_bytes(std::int64_t in_features, std::int64_t max_tokens,
                                     const Options& options = {});

 private:
  static constexpr std::size_t stats_bytes = 2 * sizeof(float);

  std::int64_t in_ = 0, out_ = 0, max_tokens_ = 0;
  Options options_;
  int device_ = 0;
  detail::device_buffer stats_;  // [amax, scale]
  detail::device_buffer mixed_;
  detail::device_buffer cublas_workspace_;
  LinearGemm<T> gemm_;
};

}  // namespace qbl

#include <qbl/detail/quant_blend_linear.inl>

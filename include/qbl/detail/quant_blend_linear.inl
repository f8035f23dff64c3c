// Member definitions of qbl::QuantBlendLinear.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/quant_blend_linear.cuh>

#include <cstdint>
#include <limits>

namespace qbl::detail {

/// Do [a, a + a_bytes) and [b, b + b_bytes) share a byte?
inline bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

inline std::size_t checked_bytes(std::int64_t rows, std::int64_t cols, std::size_t elem) {
  QBL_EXPECTS(rows >= 0 && cols >= 0, qbl::invalid_argument, "sizes must be non-negative");
  QBL_EXPECTS(cols == 0 || static_cast<std::uint64_t>(rows) <=
                               std::numeric_limits<std::size_t>::max() / elem /
                                   static_cast<std::uint64_t>(cols),
              qbl::invalid_argument, "size overflows size_t");
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * elem;
}

inline int current_device() {
  int d = 0;
  QBL_CUDA_TRY(cudaGetDevice(&d));
  return d;
}

/// Checks the construction sizes before anything is allocated; returns the current device.
inline int validated_device(std::int64_t in_features, std::int64_t out_features,
                            std::int64_t max_tokens, std::size_t elem) {
  QBL_EXPECTS(in_features > 0 && out_features > 0, qbl::invalid_argument,
              "in_features and out_features must be positive");
  QBL_EXPECTS(max_tokens > 0, qbl::invalid_argument, "max_tokens must be positive");
  checked_bytes(max_tokens, in_features, elem);
  checked_bytes(out_features, in_features, elem);
  return current_device();
}

}  // namespace qbl::detail

namespace qbl {

template <typename T>
std::size_t QuantBlendLinear<T>::workspace_bytes(std::int64_t in_features, std::int64_t max_tokens,
                                                 const Options& options) {
  return stats_bytes + detail::checked_bytes(max_tokens, in_features, sizeof(T)) +
         options.cublas_workspace_bytes;
}

template <typename T>
QuantBlendLinear<T>::QuantBlendLinear(std::int64_t in_features, std::int64_t out_features,
                                      std::int64_t max_tokens, Options options)
    : in_(in_features),
      out_(out_features),
      max_tokens_(max_tokens),
      options_(options),
      device_(detail::validated_device(in_features, out_features, max_tokens, sizeof(T))),
      stats_(stats_bytes),
      mixed_(detail::checked_bytes(max_tokens, in_features, sizeof(T))),
      cublas_workspace_(options.cublas_workspace_bytes),
      gemm_(in_features, out_features, max_tokens, options) {
  // Zero the statistics and wait for it: a forward on any stream must never race this memset.
  QBL_CUDA_TRY(cudaMemsetAsync(stats_.get(), 0, stats_bytes, nullptr));
  QBL_CUDA_TRY(cudaStreamSynchronize(nullptr));
}

template <typename T>
void QuantBlendLinear<T>::forward(const T* x, const T* logits, const T* weight, const T* bias,
                                  T* out, std::int64_t tokens, cudaStream_t stream) {
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error, "forward() on a moved-from QuantBlendLinear");
  QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
  QBL_EXPECTS(tokens <= max_tokens_, qbl::out_of_range, "tokens exceeds max_tokens");
  if (tokens == 0) return;
  QBL_EXPECTS(x != nullptr && logits != nullptr && weight != nullptr && out != nullptr,
              qbl::invalid_argument, "x, logits, weight and out must not be null");
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(logits),
                        static_cast<const void*>(weight), static_cast<const void*>(bias),
                        static_cast<const void*>(out)}) {
    QBL_EXPECTS(detail::is_aligned(p, sizeof(T)), qbl::invalid_argument,
                "pointers must be aligned to the element size");
  }
  const std::size_t out_bytes = detail::checked_bytes(tokens, out_, sizeof(T));
  QBL_EXPECTS(!detail::overlaps(out, out_bytes, x, detail::checked_bytes(tokens, in_, sizeof(T))) &&
                  !detail::overlaps(out, out_bytes, logits, detail::checked_bytes(tokens, 1, sizeof(T))) &&
                  !detail::overlaps(out, out_bytes, weight, detail::checked_bytes(out_, in_, sizeof(T))) &&
                  !detail::overlaps(out, out_bytes, bias, detail::checked_bytes(out_, 1, sizeof(T))),
              qbl::invalid_argument, "out must not overlap x, logits, weight or bias");
  QBL_EXPECTS(detail::current_device() == device_, qbl::invalid_argument,
              "forward() must run on the device the layer was constructed on");

  float* stats = stats_.as<float>();
  T* mixed = mixed_.as<T>();
  QBL_CUDA_TRY(amax_quant_blend(x, logits, mixed, tokens, in_, stats, stats + 1, stream));
  const cublasStatus_t gemm = gemm_.run(mixed, weight, bias, out, tokens, cublas_workspace_.get(), stream);
  if (gemm == CUBLAS_STATUS_NOT_SUPPORTED) {  // nothing was enqueued: the fallback kernel instead
    QBL_CUDA_TRY(detail::linear_fallback(static_cast<const T*>(mixed), weight, bias, out, tokens,
                                         in_, out_, stream));
  } else if (gemm != CUBLAS_STATUS_SUCCESS) {
    detail::throw_cublas(gemm, "LinearGemm::run (cublasLtMatmul)", __FILE__, __LINE__);
  }
}

}  // namespace qbl

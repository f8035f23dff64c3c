// Member definitions of qbl::QuantBlendLinear.
#pragma once

#include <qbl/detail/checks.hpp>
#include <qbl/quant_blend_linear.cuh>

#include <algorithm>
#include <cstdint>

namespace qbl {

template <typename X, typename G, typename L, typename Act>
std::size_t QuantBlendLinear<X, G, L, Act>::workspace_bytes(std::int64_t in_features,
                                                            std::int64_t out_features,
                                                            std::int64_t max_tokens,
                                                            const Options& options) {
  const std::size_t mixed = detail::checked_bytes(max_tokens, in_features, sizeof(G));
  std::size_t ws = ForwardPlan<X, G, L, Act>::workspace_bytes_for(options.cublas_workspace_bytes);
  if (options.backward) {
    ws = std::max(ws, BackwardPlan<X, G, L, Act>::workspace_bytes_for(
                          in_features, out_features, max_tokens, max_tokens, options));
  }
  return stats_floats * sizeof(float) + mixed + ws;
}

template <typename X, typename G, typename L, typename Act>
QuantBlendLinear<X, G, L, Act>::QuantBlendLinear(std::int64_t in_features,
                                                 std::int64_t out_features, std::int64_t max_tokens,
                                                 Options options)
    : forward_(in_features, out_features, max_tokens, options),
      backward_(options.backward ? std::make_unique<BackwardPlan<X, G, L, Act>>(
                                       in_features, out_features, max_tokens, options)
                                 : nullptr),
      side_(backward_ && backward_->overlaps(1) ? std::make_unique<SideStream>() : nullptr),
      workspace_(std::max(forward_.workspace_bytes(),
                          backward_ ? backward_->workspace_bytes() : std::size_t{0}),
                 options.allocator),
      mixed_(detail::checked_bytes(max_tokens, in_features, sizeof(G)), options.allocator),
      stats_(stats_floats * sizeof(float), options.allocator) {
  // A throw below leaves no memset queued on buffers that then go back to the allocator.
  struct SyncOnThrow {
    bool armed = true;
    ~SyncOnThrow() {
      if (armed) cudaStreamSynchronize(nullptr);
    }
  } sync_on_throw;
  // The statistics zeroed (device_scale() before any forward reads 0), and the workspace once:
  // every call writes what it reads of it, but compute-sanitizer's initcheck does not see the
  // writes of cuBLASLt's bf16/fp16 kernels, and would report the element kernel's reads of a
  // g_mixed scratch that dgrad filled. Waited for: a call on any stream must never race them.
  QBL_CUDA_TRY(cudaMemsetAsync(stats_.get(), 0, stats_.bytes(), nullptr));
  QBL_CUDA_TRY(cudaMemsetAsync(workspace_.get(), 0, workspace_.bytes(), nullptr));
  QBL_CUDA_TRY(cudaStreamSynchronize(nullptr));
  sync_on_throw.armed = false;
}

template <typename X, typename G, typename L, typename Act>
template <typename Args>
Args QuantBlendLinear<X, G, L, Act>::own_buffers(Args args) const {
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error, "a moved-from QuantBlendLinear");
  if (args.mixed == nullptr && args.stats == nullptr) {
    args.mixed = mixed_.as<G>();
    args.stats = stats_.as<float>();
  }
  return args;
}

template <typename X, typename G, typename L, typename Act>
void QuantBlendLinear<X, G, L, Act>::forward(const ForwardArgs& args, cudaStream_t stream) {
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error, "a moved-from QuantBlendLinear");
  QBL_EXPECTS((args.mixed == nullptr) == (args.stats == nullptr), qbl::invalid_argument,
              "mixed and stats are both given or both null (the instance's own)");
  forward_.run(own_buffers(args), workspace_.get(), stream);
}

template <typename X, typename G, typename L, typename Act>
void QuantBlendLinear<X, G, L, Act>::forward_local_amax(const X* x, std::int64_t tokens,
                                                        float* stats, cudaStream_t stream) {
  QBL_EXPECTS(stats_.get() != nullptr, qbl::logic_error, "a moved-from QuantBlendLinear");
  forward_.local_amax(x, tokens, stats, stream);
}

template <typename X, typename G, typename L, typename Act>
void QuantBlendLinear<X, G, L, Act>::backward(const BackwardArgs& args, cudaStream_t stream) {
  const BackwardArgs a = own_buffers(args);
  QBL_EXPECTS(backward_ != nullptr, qbl::logic_error,
              "backward() needs a QuantBlendLinear constructed with Options::backward = true");
  backward_->run(a, workspace_.get(), side_.get(), stream);
}

}  // namespace qbl

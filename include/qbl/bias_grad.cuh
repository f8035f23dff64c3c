// qbl/bias_grad.cuh -- the bias gradient on the device: the column sums of grad_out.
//
//   qbl::bias_grad(d_grad_out, d_grad_bias, tokens, outs, /*accumulate=*/false, d_ws, stream);
#pragma once

#include <qbl/detail/config.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qbl {

/// Workspace bias_grad uses for `outs` columns: fp32 partial sums of up to 64 row ranges.
constexpr std::size_t bias_grad_workspace_bytes(std::int64_t outs) {
  return outs > 0 ? static_cast<std::size_t>(outs) * 64 * sizeof(float) : 0;
}

/// grad_bias[o] = sum over tokens of grad_out[t, o]: fp32 accumulation in a fixed order
/// (deterministic for a given device: the row ranges follow its multiprocessor count), rounded
/// once to T; with `accumulate`, grad_bias[o] = RN_T(grad_bias[o] + that) as autograd
/// accumulates a parameter's .grad. grad_out [tokens, outs] row-major.
///
/// With a workspace of bias_grad_workspace_bytes(outs) bytes (4-byte aligned), the rows are
/// split into ranges summed by separate blocks and a second launch adds the ranges' sums, in
/// order: two launches at memory bandwidth. With d_workspace == nullptr, one launch of one
/// range per column block (slower for many tokens; other bits than with a workspace).
/// tokens == 0 launches nothing. No synchronization.
template <typename T>
cudaError_t bias_grad(const T* d_grad_out, T* d_grad_bias, std::int64_t tokens, std::int64_t outs,
                      bool accumulate = false, void* d_workspace = nullptr,
                      cudaStream_t stream = nullptr);

}  // namespace qbl

#include <qbl/detail/bias_grad.inl>

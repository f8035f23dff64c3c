// Eager's own activation ops, where the operators must compute what they compute bit for bit on
// every device: the CPU kernels (whose eager activations round an element differently in the
// vectorized body of their loop than in its scalar tail, so no element function reproduces them)
// and the autocast kernels' unfused path.

#include "qbl_torch.h"

namespace qbl_torch {

Tensor eager_activation(const Tensor& h, qbl::Activation act) {
  switch (act) {
    case qbl::Activation::gelu:
      return at::gelu(h);
    case qbl::Activation::gelu_tanh:
      return at::gelu(h, "tanh");
    case qbl::Activation::relu:
      return at::relu(h);
    case qbl::Activation::silu:
      return at::silu(h);
    case qbl::Activation::identity:
      break;
  }
  return h;
}

Tensor eager_activation_backward(const Tensor& grad, const Tensor& h, const Tensor& y,
                                 qbl::Activation act) {
  // The formulas of tools/autograd/derivatives.yaml, as eager's autograd calls them outside
  // create_graph (relu's reads the output).
  switch (act) {
    case qbl::Activation::gelu:
      return at::gelu_backward(grad, h);
    case qbl::Activation::gelu_tanh:
      return at::gelu_backward(grad, h, "tanh");
    case qbl::Activation::relu:
      return at::threshold_backward(grad, y, 0);
    case qbl::Activation::silu:
      return at::silu_backward(grad, h);
    case qbl::Activation::identity:
      break;
  }
  return grad;
}

}  // namespace qbl_torch

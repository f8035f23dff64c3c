// The qbl operators' schema, and the module that registers them. Their kernels: CPU
// (cpu/cpu_kernels.cpp), CUDA (cuda/cuda_kernels.cu, by qbl's plans; built where torch has CUDA),
// Autograd (autograd/autograd_kernel.cpp) and AutocastCPU / AutocastCUDA
// (autocast/autocast_kernel.cpp).

#include "qbl_torch.h"

#include <torch/library.h>

#include <Python.h>

namespace qbl_torch {

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("qbl::forward", "").typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qbl::backward", "")
                             .typed<BackwardSignature>();
  return op;
}

#if !defined(QBL_WITH_CUDA)
// Built without CUDA, no layer is ever planned: the layer cache is empty.
void clear_cache() {}
std::tuple<std::vector<std::int64_t>, std::vector<std::string>> cache_info() { return {}; }
#endif

}  // namespace qbl_torch

TORCH_LIBRARY(qbl, m) {
  // stats given: the sharded forward's second step -- amax is stats[0] as given (local_amax's,
  // reduced over the shards), and the returned stats is a copy of it with the scale written.
  // activation: one of activations() (none, gelu, ...), applied to x inside the layer. keep_mixed:
  // autograd keeps mixed for the backward (else the backward recomputes it); the computation
  // itself is the same. gemm_dtype: the GEMM's dtype where it is not x's (autocast); weight and
  // bias are then of it or float32, cast to it inside (under autocast the operators take the
  // float32 parameters, so that autograd keeps the parameter itself for the backward rather than
  // a cast copy). plan_backward: a backward of this layer will follow, so its backward is planned
  // with the forward, at the forward's one wait (else on the first backward); the autograd kernel
  // sets it where autograd records the call. The computation is the same.
  m.def(
      "forward(Tensor x, Tensor logits, Tensor weight, Tensor? bias, Tensor? stats=None, "
      "str activation=\"none\", bool keep_mixed=True, bool straight_through=False, "
      "bool allow_tf32=False, ScalarType? gemm_dtype=None, bool plan_backward=False) -> "
      "(Tensor out, Tensor mixed, Tensor stats)");
  // mixed None: recomputed from x and stats (the forward kept none). gemm_dtype as the forward's;
  // a float32 weight is cast to it for dgrad, and grad_weight and grad_bias come back in the
  // weight's dtype (the GEMM dtype's gradients cast, as autograd casts them through a cast).
  m.def(
      "backward(Tensor grad_out, Tensor x, Tensor logits, Tensor weight, Tensor? mixed, "
      "Tensor stats, bool has_bias, bool[4] output_mask, str activation=\"none\", "
      "bool straight_through=False, bool allow_tf32=False, ScalarType? gemm_dtype=None) -> "
      "(Tensor grad_x, Tensor grad_logits, Tensor grad_weight, Tensor grad_bias)");
  m.def("local_amax(Tensor x, str activation=\"none\") -> Tensor");
  m.def("clear_cache() -> ()", &qbl_torch::clear_cache);
  m.def("cache_info() -> (int[], str[])", &qbl_torch::cache_info);
  // The names `activation` takes, in the library's order (qbl::activation_names).
  m.def("activations() -> str[]", &qbl_torch::activations);
}

// Importing qbl._C registers the operators; the module itself is empty.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

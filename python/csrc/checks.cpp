// The operators' argument checks: each raises torch's error type (TypeError for a dtype,
// RuntimeError otherwise) with the operator's name, before anything is allocated or launched.

#include "qbl_torch.h"

namespace qbl_torch {

std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

void check_dense(const char* op, const Tensor& t, const char* name, const Tensor& x) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device().str(),
              " but x is on ", x.device().str(), "; all tensors must be on one CUDA device");
}

void check_dtype(const char* op, const Tensor& t, const char* name, ScalarType want,
                 const char* whose) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, op, ": ", name, " has dtype ",
                   c10::toString(t.scalar_type()), " but ", whose, " is ", c10::toString(want),
                   "; all tensors must have one dtype (mixed dtypes only under torch.autocast)");
}

void check_supported(const char* op, const Dtypes& d) {
  TORCH_CHECK_TYPE(supported(d), op, ": unsupported dtypes (x ", c10::toString(d.x), ", GEMM ",
                   c10::toString(d.gemm), ", logits ", c10::toString(d.logits),
                   "); supported: float32, bfloat16 or float16 throughout, or float32 x with a "
                   "bfloat16/float16 GEMM and float32 or GEMM-typed logits");
}

Problem check_problem(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight) {
  TORCH_CHECK(x.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x.device().str());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (features last)");
  check_dense(op, logits, "logits", x);
  check_dense(op, weight, "weight", x);
  Problem p;
  p.in_features = x.size(-1);
  p.lead.assign(x.sizes().begin(), x.sizes().end() - 1);
  TORCH_CHECK(logits.sizes() == c10::IntArrayRef(p.lead), op,
              ": logits must have shape x.shape[:-1] = ", shape_str(p.lead), ", got ",
              shape_str(logits.sizes()));
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == p.in_features, op,
              ": weight must be [out_features, in_features] with in_features = x.shape[-1] = ",
              std::to_string(p.in_features), ", got ", shape_str(weight.sizes()));
  p.out_features = weight.size(0);
  TORCH_CHECK(p.in_features > 0 && p.out_features > 0, op,
              ": in_features and out_features must be positive, got ", shape_str(weight.sizes()));
  p.tokens = 1;
  for (const std::int64_t s : p.lead) p.tokens *= s;
  return p;
}

Dtypes forward_dtypes(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight,
                      const std::optional<Tensor>& bias, std::optional<ScalarType> gemm_dtype) {
  const Dtypes d{x.scalar_type(), gemm_dtype.value_or(x.scalar_type()), logits.scalar_type()};
  if (!gemm_dtype.has_value()) {
    check_dtype(op, logits, "logits", d.x, "x");
    check_dtype(op, weight, "weight", d.x, "x");
    if (given(bias)) check_dtype(op, *bias, "bias", d.x, "x");
  } else {
    check_parameter_dtypes(op, weight, bias, d.gemm);
  }
  check_supported(op, d);
  return d;
}

void check_parameter_dtypes(const char* op, const Tensor& weight, const std::optional<Tensor>& bias,
                            ScalarType gemm) {
  const ScalarType w = weight.scalar_type();
  TORCH_CHECK_TYPE(w == gemm || w == at::kFloat, op, ": weight has dtype ", c10::toString(w),
                   " but gemm_dtype is ", c10::toString(gemm),
                   "; with gemm_dtype, weight and bias are of gemm_dtype or float32 (cast to it)");
  if (given(bias)) check_dtype(op, *bias, "bias", w, "weight");
}

void check_bias(const char* op, const Tensor& bias, const Tensor& x, std::int64_t out_features) {
  check_dense(op, bias, "bias", x);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features, op,
              ": bias must be [out_features] = [", std::to_string(out_features), "] or None, got ",
              shape_str(bias.sizes()));
}

void check_stats(const char* op, const Tensor& stats, const Tensor& x, const char* what) {
  TORCH_CHECK(stats.device() == x.device() && stats.scalar_type() == at::kFloat &&
                  stats.numel() == 2 && stats.is_contiguous(),
              op, ": stats must be ", what, "'s float32 [2] tensor on x's device");
}

qbl::Activation parse_activation(const char* op, c10::string_view name) {
  for (int i = 0; i < static_cast<int>(std::size(activation_names)); ++i)
    if (name == activation_names[i]) return static_cast<qbl::Activation>(i);
  TORCH_CHECK_VALUE(false, op, ": unknown activation '", std::string(name),
                    "'; one of none, gelu, gelu_tanh, relu, silu");
}

}  // namespace qbl_torch

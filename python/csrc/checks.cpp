// The operators' argument checks, shared by the CPU and CUDA kernels: each raises torch's error
// type (TypeError for a dtype, RuntimeError otherwise) with the operator's name, before anything is
// allocated or launched.

#include "qbl_torch.h"

#include <c10/util/StringUtil.h>

namespace qbl_torch {
namespace {

/// `t` dense on x's device.
void check_dense(const char* op, const Tensor& t, const char* name, const Tensor& x) {
  TORCH_CHECK(t.layout() == c10::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " is on ", t.device().str(),
              " but x is on ", x.device().str(), "; all tensors must be on one device");
}

/// `t` of dtype `want`, which is `whose`'s.
void check_dtype(const char* op, const Tensor& t, const char* name, ScalarType want,
                 const char* whose) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, op, ": ", name, " has dtype ",
                   c10::toString(t.scalar_type()), " but ", whose, " is ", c10::toString(want),
                   "; all tensors must have one dtype (mixed dtypes only under torch.autocast)");
}

/// `d` one of qbl::SupportedTypes.
void check_supported(const char* op, const Dtypes& d) {
  TORCH_CHECK_TYPE(supported(d), op, ": unsupported dtypes (x ", c10::toString(d.x), ", GEMM ",
                   c10::toString(d.gemm), ", logits ", c10::toString(d.logits),
                   "); supported: float32, bfloat16 or float16 throughout, or float32 x with a "
                   "bfloat16/float16 GEMM and float32 or GEMM-typed logits");
}

/// x dense with features last, logits x.shape[:-1], weight [out, in], all on x's device.
Problem check_problem(const char* op, const Tensor& x, const Tensor& logits, const Tensor& weight) {
  TORCH_CHECK(x.layout() == c10::kStrided, op, ": x must be a dense tensor");
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

/// With a GEMM dtype given: weight of that dtype or float32 (autocast's master weight, which the
/// operators cast to it), bias of weight's dtype.
void check_parameter_dtypes(const char* op, const Tensor& weight, const std::optional<Tensor>& bias,
                            ScalarType gemm) {
  const ScalarType w = weight.scalar_type();
  TORCH_CHECK_TYPE(w == gemm || w == at::kFloat, op, ": weight has dtype ", c10::toString(w),
                   " but gemm_dtype is ", c10::toString(gemm),
                   "; with gemm_dtype, weight and bias are of gemm_dtype or float32 (cast to it)");
  if (given(bias)) check_dtype(op, *bias, "bias", w, "weight");
}

/// stats a contiguous float32 [2] tensor on x's device; `what` says whose it must be.
void check_stats(const char* op, const Tensor& stats, const Tensor& x, const char* what) {
  TORCH_CHECK(stats.device() == x.device() && stats.scalar_type() == at::kFloat &&
                  stats.numel() == 2 && stats.is_contiguous(),
              op, ": stats must be ", what, "'s float32 [2] tensor on x's device");
}

}  // namespace

std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::vector<std::int64_t> Problem::out_sizes() const {
  std::vector<std::int64_t> sizes = lead;
  sizes.push_back(out_features);
  return sizes;
}

ForwardProblem check_forward(const char* op, const Tensor& x, const Tensor& logits,
                             const Tensor& weight, const std::optional<Tensor>& bias,
                             const std::optional<Tensor>& stats,
                             std::optional<ScalarType> gemm_dtype) {
  ForwardProblem f;
  f.p = check_problem(op, x, logits, weight);
  f.dtypes = {x.scalar_type(), gemm_dtype.value_or(x.scalar_type()), logits.scalar_type()};
  if (!gemm_dtype.has_value()) {
    check_dtype(op, logits, "logits", f.dtypes.x, "x");
    check_dtype(op, weight, "weight", f.dtypes.x, "x");
    if (given(bias)) check_dtype(op, *bias, "bias", f.dtypes.x, "x");
  } else {
    check_parameter_dtypes(op, weight, bias, f.dtypes.gemm);
  }
  check_supported(op, f.dtypes);
  f.from_stats = given(stats);
  if (f.from_stats) check_stats(op, *stats, x, "local_amax()");
  f.has_bias = given(bias);
  if (f.has_bias) {
    check_dense(op, *bias, "bias", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == f.p.out_features, op,
                ": bias must be [out_features] = [", std::to_string(f.p.out_features),
                "] or None, got ", shape_str(bias->sizes()));
  }
  return f;
}

BackwardProblem check_backward(const char* op, const Tensor& grad_out, const Tensor& x,
                               const Tensor& logits, const Tensor& weight,
                               const std::optional<Tensor>& mixed, const Tensor& stats,
                               bool has_bias, std::array<bool, 4> mask,
                               std::optional<ScalarType> gemm_dtype) {
  BackwardProblem b;
  b.p = check_problem(op, x, logits, weight);
  b.weight = weight.scalar_type();
  b.dtypes = {x.scalar_type(), gemm_dtype.value_or(b.weight), logits.scalar_type()};
  if (gemm_dtype.has_value()) check_parameter_dtypes(op, weight, std::nullopt, b.dtypes.gemm);
  check_supported(op, b.dtypes);
  check_dense(op, grad_out, "grad_out", x);
  const char* gemm_name = gemm_dtype.has_value() ? "gemm_dtype" : "weight";
  check_dtype(op, grad_out, "grad_out", b.dtypes.gemm, gemm_name);
  b.kept = given(mixed);
  if (b.kept) {
    check_dense(op, *mixed, "mixed", x);
    check_dtype(op, *mixed, "mixed", b.dtypes.gemm, gemm_name);
    TORCH_CHECK(mixed->sizes() == x.sizes(), op, ": mixed must have x's shape ",
                shape_str(x.sizes()), " or be None (recomputed), got ", shape_str(mixed->sizes()));
  }
  const std::vector<std::int64_t> out_sizes = b.p.out_sizes();
  TORCH_CHECK(grad_out.sizes() == c10::IntArrayRef(out_sizes), op, ": grad_out must have shape ",
              shape_str(out_sizes), ", got ", shape_str(grad_out.sizes()));
  check_stats(op, stats, x, "the forward");
  b.want_bias = mask[3] && has_bias;
  return b;
}

void check_local_amax(const char* op, const Tensor& x) {
  TORCH_CHECK(x.layout() == c10::kStrided, op, ": x must be a dense tensor");
  TORCH_CHECK_TYPE(dispatch_x_type(x.scalar_type(), [](auto) {}), op, ": unsupported dtype ",
                   c10::toString(x.scalar_type()), "; supported: ", supported_x_dtypes());
}

std::vector<std::string> activations() {
  return {std::begin(qbl::activation_names), std::end(qbl::activation_names)};
}

qbl::Activation parse_activation(const char* op, c10::string_view name) {
  for (int i = 0; i < qbl::activation_count; ++i)
    if (name == qbl::activation_names[i]) return static_cast<qbl::Activation>(i);
  TORCH_CHECK_VALUE(false, op, ": unknown activation '", std::string(name), "'; one of ",
                    c10::Join(", ", activations()));
}

}  // namespace qbl_torch

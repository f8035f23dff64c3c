// qbl/activation.cuh: each activation's element functions against float64 formulas written out
// here (on the CPU, which runs in CI, and on the GPU), their special values, and the stages with an
// activation -- amax, amax_quant_blend, quant_blend_backward and the backward's recomputed mixed --
// against the same stages without one, fed act(h) and followed by act's backward in separate
// kernels. Bit-identity with PyTorch eager's own F.gelu / F.silu / F.relu kernels, over every
// 16-bit value, is checked by the package's pytest suite (python/tests/test_activation.py).
#include <qbl/activation.cuh>
#include <qbl/amax.cuh>
#include <qbl/detail/activation_table.cuh>
#include <qbl/quant_blend.cuh>
#include <qbl/quant_blend_backward.cuh>

#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl_test::bits;

constexpr float inf = std::numeric_limits<float>::infinity();
const float nan = std::numeric_limits<float>::quiet_NaN();

// ---- float64 formulas, written from the activations' definitions (not from qbl's code) --------

constexpr double pi = 3.14159265358979323846;
/// GELU's tanh form is 0.5 h (1 + tanh(inner(h))): inner and its derivative.
double tanh_inner(double h) { return std::sqrt(2.0 / pi) * (h + 0.044715 * h * h * h); }
double tanh_inner_derivative(double h) {
  return std::sqrt(2.0 / pi) * (1.0 + 3.0 * 0.044715 * h * h);
}

double erf_gelu(double h) { return 0.5 * h * (1.0 + std::erf(h / std::sqrt(2.0))); }
double erf_gelu_grad(double h) {
  return 0.5 * (1.0 + std::erf(h / std::sqrt(2.0))) +
         h * std::exp(-0.5 * h * h) / std::sqrt(2 * pi);
}
double tanh_gelu(double h) { return 0.5 * h * (1.0 + std::tanh(tanh_inner(h))); }
double tanh_gelu_grad(double h) {
  const double t = std::tanh(tanh_inner(h));
  return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * tanh_inner_derivative(h);
}
double silu(double h) { return h / (1.0 + std::exp(-h)); }
double silu_grad(double h) {
  const double s = 1.0 / (1.0 + std::exp(-h));
  return s * (1.0 + h * (1.0 - s));
}
double relu(double h) { return h > 0 ? h : 0.0; }
double relu_grad(double h) { return h > 0 ? 1.0 : 0.0; }

// ---- what fp32 arithmetic on each expression may lose, derived from its operations ------------
//
// Beyond a few units of fp32's last place of the result (the relative part, 8u, in close()
// below), an expression loses what a cancellation amplifies: 1 + erf(h / sqrt(2)) and 1 + tanh(.)
// near h << 0, where erf and tanh are near -1 and carry an absolute error of up to E (the CUDA
// math library's erff and tanhf: 2 ulp, 2u for values in [0.5, 1); E leaves 2x), and the rounding
// of an exponent's argument (exp(-0.5 h h) grows its relative error by 0.5 h^2 u). The absolute
// parts below are these losses only: no term in |h| alone, so that a wrong tail (gelu(-5) =
// -1.4e-6, silu(-20) = -4.1e-8) is caught wherever fp32 can represent it at all.
constexpr double u = 0x1p-24;
constexpr double E = 4 * u;

double sigmoid64(double h) { return 1.0 / (1.0 + std::exp(-h)); }

double erf_gelu_loss(double h) { return 0.5 * std::fabs(h) * E; }
double erf_gelu_grad_loss(double h) {
  const double cdf = 0.5 * (1.0 + std::erf(h / std::sqrt(2.0)));
  const double h_pdf = h * std::exp(-0.5 * h * h) / std::sqrt(2 * pi);
  return 0.5 * E + 8 * u * std::fabs(cdf) + (8 + 0.5 * h * h) * u * std::fabs(h_pdf);
}
/// The tanh form: the argument's relative error (4u) moves tanh by (1 - t^2) |inner| 4u, which the
/// cancellation in 1 + t amplifies as E does.
double tanh_gelu_error_of_one_plus_t(double h) {
  const double inner = tanh_inner(h);
  const double t = std::tanh(inner);
  return E + (1.0 - t * t) * std::fabs(inner) * 4 * u;
}
double tanh_gelu_loss(double h) { return 0.5 * std::fabs(h) * tanh_gelu_error_of_one_plus_t(h); }
double tanh_gelu_grad_loss(double h) {
  const double t = std::tanh(tanh_inner(h));
  const double e = tanh_gelu_error_of_one_plus_t(h);
  const double inner_derivative = tanh_inner_derivative(h);
  const double left = 0.5 * (1.0 + t), right = 0.5 * h * (1.0 - t * t) * inner_derivative;
  // 1 - t^2 = fma(-t, t, 1) with t off by e: off by 2|t| e.
  return 0.5 * e + std::fabs(h) * inner_derivative * e +
         8 * u * (std::fabs(left) + std::fabs(right));
}
/// Where exp(-h) overflows fp32 (-h above log(FLT_MAX)), 1 + exp(-h) is Inf and SiLU and its
/// gradient are 0 instead of a value below 1e-36: all of it lost.
bool silu_exp_overflows(double h) { return -h > std::log(static_cast<double>(FLT_MAX)); }
/// No cancellation in h / (1 + exp(-h)).
double silu_loss(double h) { return silu_exp_overflows(h) ? std::fabs(silu(h)) : 0.0; }
/// s (1 + h (1 - s)): 1 - s off by about 6u s, times h; the sum with 1 may cancel.
double silu_grad_loss(double h) {
  if (silu_exp_overflows(h)) return std::fabs(silu_grad(h));
  return 8 * u * sigmoid64(h) * (1.0 + std::fabs(h));
}
double exact_loss(double) { return 0.0; }  // relu: a compare and a select

struct Formula {
  double (*f)(double);
  double (*grad)(double);
  double (*f_loss)(double);     ///< the forward's absolute loss beyond 8u of the result
  double (*grad_loss)(double);  ///< the gradient's, per unit of the incoming dy
};

template <typename Act>
Formula formula() {
  if constexpr (std::is_same_v<Act, qbl::Gelu>)
    return {erf_gelu, erf_gelu_grad, erf_gelu_loss, erf_gelu_grad_loss};
  if constexpr (std::is_same_v<Act, qbl::GeluTanh>)
    return {tanh_gelu, tanh_gelu_grad, tanh_gelu_loss, tanh_gelu_grad_loss};
  if constexpr (std::is_same_v<Act, qbl::Silu>) return {silu, silu_grad, silu_loss, silu_grad_loss};
  if constexpr (std::is_same_v<Act, qbl::Relu>) return {relu, relu_grad, exact_loss, exact_loss};
}

/// The inputs the element tests take: a fine grid over [-12, 12], wide random values and the
/// boundaries of the fp32 range.
std::vector<float> element_inputs() {
  std::vector<float> h;
  for (int i = -24000; i <= 24000; ++i) h.push_back(static_cast<float>(i) * 5e-4f);
  std::mt19937_64 gen(20261204);
  std::normal_distribution<float> wide(0.0f, 30.0f);
  for (int i = 0; i < 20000; ++i) h.push_back(wide(gen));
  for (float v : {1e-30f, -1e-30f, 1e-38f, 80.0f, -80.0f, 1e4f, -1e4f}) h.push_back(v);
  return h;
}

/// |value - exact| within 8u of the exact result plus the expression's derived absolute `loss`
/// (and 1e-37 for results in fp32's subnormal range).
::testing::AssertionResult close(float value, double exact, double loss, float h,
                                 const char* what) {
  const double bound = 8.0 * u * std::fabs(exact) + loss + 1e-37;
  if (std::fabs(static_cast<double>(value) - exact) <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << "(" << h << ") = " << value << ", exact " << exact
                                       << " (bound " << bound << ")";
}

template <typename Act>
class ActivationElement : public ::testing::Test {};
using Activations = ::testing::Types<qbl::Gelu, qbl::GeluTanh, qbl::Relu, qbl::Silu>;
struct ActivationNames {
  template <typename A>
  static std::string GetName(int) {
    return qbl_test::activation_name<A>();
  }
};
TYPED_TEST_SUITE(ActivationElement, Activations, ActivationNames);

template <typename Act>
void expect_formula(const std::vector<float>& h, const std::vector<float>& y,
                    const std::vector<float>& dh, const std::vector<float>& dy) {
  const Formula fm = formula<Act>();
  int bad = 0;
  for (std::size_t i = 0; i < h.size() && bad < 8; ++i) {
    const auto fwd = close(y[i], fm.f(h[i]), fm.f_loss(h[i]), h[i], "forward");
    const auto bwd = close(dh[i], dy[i] * fm.grad(h[i]), std::fabs(dy[i]) * fm.grad_loss(h[i]),
                           h[i], "backward");
    if (!fwd || !bwd) ++bad;
    EXPECT_TRUE(fwd);
    EXPECT_TRUE(bwd) << " (dy " << dy[i] << ")";
  }
}

TYPED_TEST(ActivationElement, HostFunctionsFollowTheFormulas) {
  using Act = TypeParam;
  const std::vector<float> h = element_inputs();
  std::vector<float> y(h.size()), dy = qbl_test::randn(h.size(), 7), dh(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) {
    y[i] = Act::forward(h[i]);
    dh[i] = Act::backward(dy[i], h[i]);
  }
  expect_formula<Act>(h, y, dh, dy);
}

TYPED_TEST(ActivationElement, BothGivesTheBitsOfForwardAndBackwardOnTheHost) {
  // both() is what the backward's element kernel calls; forward() and backward() are what the
  // formulas above check. On the GPU the stage tests compare the kernels built on each.
  using Act = TypeParam;
  const std::vector<float> h = element_inputs();
  const std::vector<float> dy = qbl_test::randn(h.size(), 11);
  int bad = 0;
  for (std::size_t i = 0; i < h.size() && bad < 8; ++i) {
    float y = 0.0f, dh = 0.0f;
    Act::both(dy[i], h[i], y, dh);
    const bool same =
        bits(y) == bits(Act::forward(h[i])) && bits(dh) == bits(Act::backward(dy[i], h[i]));
    if (!same) ++bad;
    EXPECT_TRUE(same) << "h " << h[i] << ", dy " << dy[i] << ": both() gives " << y << ", " << dh
                      << "; forward() " << Act::forward(h[i]) << ", backward() "
                      << Act::backward(dy[i], h[i]);
  }
}

template <typename Act>
__global__ void evaluate(const float* h, const float* dy, float* y, float* dh, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  y[i] = Act::forward(h[i]);
  dh[i] = Act::backward(dy[i], h[i]);
}

TYPED_TEST(ActivationElement, DeviceFunctionsFollowTheFormulas) {
  QBL_REQUIRE_GPU();
  using Act = TypeParam;
  const std::vector<float> h = element_inputs();
  const std::vector<float> dy = qbl_test::randn(h.size(), 7);
  const std::size_t n = h.size();
  qbl_test::DeviceArray<float> dh_in(n), ddy(n), dout(n), dgrad(n);
  ASSERT_TRUE(dh_in.ok() && ddy.ok() && dout.ok() && dgrad.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dh_in.get(), h));
  QBL_ASSERT_CUDA(qbl_test::to_device(ddy.get(), dy));
  evaluate<Act><<<static_cast<unsigned>((n + 255) / 256), 256>>>(
      dh_in.get(), ddy.get(), dout.get(), dgrad.get(), static_cast<std::int64_t>(n));
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> y(n), dh(n);
  QBL_ASSERT_CUDA(qbl_test::to_host(y, dout.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(dh, dgrad.get()));
  expect_formula<Act>(h, y, dh, dy);
}

TYPED_TEST(ActivationElement, SpecialValuesFollowEager) {
  using Act = TypeParam;
  // NaN stays NaN forward and backward; every activation is 0 at 0 with eager's sign; +Inf maps
  // to +Inf.
  EXPECT_TRUE(std::isnan(Act::forward(nan)));
  EXPECT_TRUE((std::isnan(Act::backward(1.0f, nan)) || std::is_same_v<Act, qbl::Relu>));
  EXPECT_EQ(bits(Act::forward(0.0f)), bits(0.0f));
  EXPECT_EQ(Act::forward(inf), inf);
  if constexpr (std::is_same_v<Act, qbl::Relu>) {
    // eager's clamp_min gives +0.0 for -0.0 and every negative (the pytest suite checks eager)
    EXPECT_EQ(bits(Act::forward(-0.0f)), bits(0.0f));
    EXPECT_EQ(bits(Act::forward(-inf)), bits(0.0f));
    EXPECT_EQ(bits(Act::forward(-3.0f)), bits(0.0f));
    EXPECT_EQ(bits(Act::backward(3.0f, -0.0f)), bits(0.0f));  // output <= 0: +0
    EXPECT_EQ(bits(Act::backward(-3.0f, -2.0f)), bits(0.0f));
    EXPECT_EQ(Act::backward(3.0f, nan), 3.0f);  // a NaN output passes the gradient
    EXPECT_EQ(Act::backward(3.0f, 1e-30f), 3.0f);
  } else {
    EXPECT_EQ(bits(Act::forward(-0.0f)), bits(-0.0f));  // -0 * 0.5 * ... and -0 / 2 keep the sign
  }
}

// ---- the stages with an activation against the stages without one -------------------------

/// x[i] = act(h[i]) rounded to T: what eager's activation kernel stores.
template <typename Act, typename T>
__global__ void activate_kernel(const T* h, T* x, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = qbl::detail::from_float<T>(qbl::activate<Act, T>(qbl::detail::to_float(h[i])));
}

/// dh[i] = act'(dx[i], h[i]) rounded to T: eager's activation backward applied to grad_x.
template <typename Act, typename T>
__global__ void activate_backward_kernel(const T* dx, const T* h, T* dh, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n)
    dh[i] = qbl::detail::from_float<T>(
        qbl::activate_backward<Act, T>(qbl::detail::to_float(dx[i]), qbl::detail::to_float(h[i])));
}

using qbl_test::ActivationCase;
using StageCases = ::testing::Types<
    ActivationCase<qbl::Gelu, float>, ActivationCase<qbl::Gelu, __nv_bfloat16>,
    ActivationCase<qbl::GeluTanh, __half>, ActivationCase<qbl::GeluTanh, __nv_bfloat16>,
    ActivationCase<qbl::Silu, __nv_bfloat16>,
    ActivationCase<qbl::GeluTanh, float, __nv_bfloat16, float>,
    ActivationCase<qbl::Relu, __nv_bfloat16>, ActivationCase<qbl::Relu, float, __half, __half>,
    ActivationCase<qbl::Silu, __half>, ActivationCase<qbl::Silu, float>,
    ActivationCase<qbl::Gelu, __half>, ActivationCase<qbl::Relu, __half>,
    ActivationCase<qbl::Identity, __nv_bfloat16>>;
template <typename C>
class ActivationStages : public ::testing::Test {};
TYPED_TEST_SUITE(ActivationStages, StageCases, qbl_test::ActivationCaseNames);

template <typename T>
std::vector<float> download(const T* d, std::size_t n) {
  std::vector<T> h(n);
  if (qbl_test::to_host(h, d) != cudaSuccess) return {};
  return qbl_test::widen(h);
}

TYPED_TEST(ActivationStages, FusedStagesEqualTheActivationFollowedByThePlainStages) {
  QBL_REQUIRE_GPU();
  using C = TypeParam;
  using Act = typename C::Act;
  using X = typename C::x_type;
  using G = typename C::gemm_type;
  using L = typename C::logits_type;
  // (tokens, features, element offset, inputs): vector and element-wise paths, the single-block
  // prologue and the two-kernel one, rows shorter and longer than a tile; for 16-bit x, every
  // value of the type once (inside and outside the range of a bf16 activation table, NaN and Inf
  // included), and every finite one (so that the amax and mixed are finite too).
  enum Inputs { random, every_value, every_finite_value };
  const struct {
    std::int64_t tokens, features;
    std::size_t offset;
    Inputs inputs;
  } shapes[] = {{1, 1, 0, random},          {7, 96, 0, random},
                {65, 256, 1, random},       {217, 2049, 0, random},
                {2047, 64, 0, random},      {300, 512, 0, random},
                {256, 256, 0, every_value}, {512, 128, 0, every_finite_value}};
  for (const auto& s : shapes) {
    if (s.inputs != random && sizeof(X) != 2) continue;
    const std::uint64_t seed = qbl_test::fresh_seed();
    SCOPED_TRACE("tokens " + std::to_string(s.tokens) + ", features " + std::to_string(s.features) +
                 ", offset " + std::to_string(s.offset) + ", inputs " + std::to_string(s.inputs) +
                 ", seed " + std::to_string(seed));
    const std::size_t n = static_cast<std::size_t>(s.tokens * s.features);
    const std::size_t t = static_cast<std::size_t>(s.tokens);
    // h spread over the activation's interesting range, with a few exact zeros and signed zeros;
    // or every 16-bit pattern, shuffled so that rows mix magnitudes.
    std::vector<X> h;
    if (s.inputs == random) {
      std::vector<float> hf = qbl_test::randn(n, seed, 3.0f);
      for (std::size_t i = 0; i < n; i += 11) hf[i] = (i % 22 == 0) ? -0.0f : 0.0f;
      h = qbl_test::convert<X>(hf);
    } else if constexpr (sizeof(X) == 2) {
      using Raw = std::conditional_t<std::is_same_v<X, __half>, __half_raw, __nv_bfloat16_raw>;
      const std::uint16_t exponent = std::is_same_v<X, __half> ? 0x7c00 : 0x7f80;
      for (std::size_t i = 0; i < n; ++i) {
        // a bijection of [0, 65536) (an odd multiplier) gives the pattern
        Raw r;
        r.x = static_cast<std::uint16_t>((i % 65536) * 40503u);
        if (s.inputs == every_finite_value && (r.x & exponent) == exponent) r.x = 0;
        h.push_back(X(r));
      }
    }
    const std::vector<L> logits = qbl_test::convert<L>(qbl_test::randn(t, seed + 1, 2.0f));
    const std::vector<G> g = qbl_test::convert<G>(qbl_test::randn(n, seed + 2));
    const std::size_t o = s.offset;
    qbl_test::DeviceArray<X> dh(n, o), dx(n, o), dgh(n, o), dgx(n, o), dgh2(n, o), dref_gh(n, o);
    qbl_test::DeviceArray<G> dmix(n, o), dmix_ref(n, o), dmix_re(n, o), dmix_re2(n, o), dg(n, o);
    qbl_test::DeviceArray<L> dl(t, o), dgl(t, o), dgl_ref(t, o), dgl2(t, o);
    qbl_test::DeviceArray<float> stats(8), ws(1024);
    ASSERT_TRUE(dh.ok() && dx.ok() && dgh.ok() && dgx.ok() && dgh2.ok() && dref_gh.ok() &&
                dmix.ok() && dmix_ref.ok() && dmix_re.ok() && dmix_re2.ok() && dg.ok() && dl.ok() &&
                dgl.ok() && dgl_ref.ok() && dgl2.ok() && stats.ok() && ws.ok());
    QBL_ASSERT_CUDA(qbl_test::to_device(dh.get(o), h));
    QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(o), logits));
    QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(o), g));
    QBL_ASSERT_CUDA(cudaMemset(stats.get(), 0, 8 * sizeof(float)));  // all 8 are downloaded
    for (auto* p : {dmix_re.get(o), dmix_re2.get(o)})
      QBL_ASSERT_CUDA(cudaMemset(p, qbl_test::poison_byte, n * sizeof(G)));
    QBL_ASSERT_CUDA(cudaMemset(dgh2.get(o), qbl_test::poison_byte, n * sizeof(X)));
    QBL_ASSERT_CUDA(cudaMemset(dgl2.get(o), qbl_test::poison_byte, t * sizeof(L)));
    const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
    const auto sn = static_cast<std::int64_t>(n);
    float* amax = stats.get(0);
    float* scale = stats.get(1);
    float* amax_ref = stats.get(2);
    float* scale_ref = stats.get(3);
    float* amax_alone = stats.get(4);

    // Forward: fused against act(h) through the plain stages.
    activate_kernel<Act, X><<<blocks, 256>>>(dh.get(o), dx.get(o), sn);
    QBL_ASSERT_CUDA(cudaGetLastError());
    QBL_ASSERT_CUDA((qbl::amax_quant_blend<X, G, L, Act>(
        dh.get(o), dl.get(o), dmix.get(o), s.tokens, s.features, amax, scale, ws.get())));
    QBL_ASSERT_CUDA((qbl::amax_quant_blend<X, G, L>(dx.get(o), dl.get(o), dmix_ref.get(o), s.tokens,
                                                    s.features, amax_ref, scale_ref, ws.get())));
    QBL_ASSERT_CUDA((qbl::amax<X, Act>(dh.get(o), sn, amax_alone)));
    std::vector<float> st(8);
    QBL_ASSERT_CUDA(qbl_test::to_host(st, stats.get()));
    EXPECT_EQ(bits(st[0]), bits(st[2])) << "amax";
    EXPECT_EQ(bits(st[1]), bits(st[3])) << "scale";
    EXPECT_EQ(bits(st[4]), bits(st[2])) << "qbl::amax with the activation";
    EXPECT_TRUE(qbl_test::bits_equal(download(dmix.get(o), n), download(dmix_ref.get(o), n),
                                     static_cast<std::size_t>(s.features)))
        << "mixed";

    // Backward: grad_h and grad_logits fused against the plain backward of act(h), then act's
    // backward; the recomputed mixed against the forward's.
    QBL_ASSERT_CUDA((qbl::quant_blend_backward<X, G, L, Act>(
        dg.get(o), dh.get(o), dl.get(o), scale, dgh.get(o), dgl.get(o), s.tokens, s.features)));
    QBL_ASSERT_CUDA((qbl::quant_blend_backward<X, G, L>(
        dg.get(o), dx.get(o), dl.get(o), scale, dgx.get(o), dgl_ref.get(o), s.tokens, s.features)));
    activate_backward_kernel<Act, X><<<blocks, 256>>>(dgx.get(o), dh.get(o), dref_gh.get(o), sn);
    QBL_ASSERT_CUDA(cudaGetLastError());
    // With a table, one block (max_blocks 1) whose 8 warps each loop over every 8th row: the
    // row loop that launches of fewer blocks than rows / 8 take.
    QBL_ASSERT_CUDA((qbl::detail::launch_quant_blend_backward<X, G, L, Act>(
        dg.get(o), dh.get(o), dl.get(o), scale, dgh2.get(o), dgl2.get(o), dmix_re.get(o), s.tokens,
        s.features, qbl::QuantGrad::zero, 1, nullptr)));
    // Only the recomputed mixed: no g_mixed, no gradient.
    QBL_ASSERT_CUDA((qbl::detail::launch_quant_blend_backward<X, G, L, Act>(
        static_cast<const G*>(nullptr), dh.get(o), dl.get(o), scale, static_cast<X*>(nullptr),
        static_cast<L*>(nullptr), dmix_re2.get(o), s.tokens, s.features, qbl::QuantGrad::zero, 0,
        nullptr)));
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> grad_h = download(dgh.get(o), n);
    EXPECT_TRUE(qbl_test::bits_equal(grad_h, download(dref_gh.get(o), n),
                                     static_cast<std::size_t>(s.features)))
        << "grad_h";
    EXPECT_TRUE(qbl_test::bits_equal(download(dgl.get(o), t), download(dgl_ref.get(o), t)))
        << "grad_logits";
    EXPECT_TRUE(qbl_test::bits_equal(download(dgh2.get(o), n), grad_h)) << "grad_h, recomputing";
    EXPECT_TRUE(qbl_test::bits_equal(download(dgl2.get(o), t), download(dgl.get(o), t)))
        << "grad_logits, recomputing, one block";
    const std::vector<float> mixed = download(dmix.get(o), n);
    EXPECT_TRUE(qbl_test::bits_equal(download(dmix_re.get(o), n), mixed,
                                     static_cast<std::size_t>(s.features)))
        << "recomputed mixed";
    EXPECT_TRUE(qbl_test::bits_equal(download(dmix_re2.get(o), n), mixed,
                                     static_cast<std::size_t>(s.features)))
        << "recomputed mixed, alone";
  }
}

TEST(ActivationTable, IndexCoversEachInputOfItsRangeOnce) {
  // Host-side: table_index maps exactly the bf16 values of magnitude in [2^-12, 16) (each sign)
  // one-to-one onto the table's entries, and table_input_bits gives each entry's input back.
  std::vector<int> hits(qbl::detail::table_entries, 0);
  int inside = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits16 = static_cast<std::uint16_t>(b);
    std::uint32_t f32 = b << 16;
    float v;
    std::memcpy(&v, &f32, sizeof v);
    const bool in_range = std::fabs(v) >= 0x1p-12f && std::fabs(v) < 16.0f;  // false for NaN
    const int i = qbl::detail::table_index(bits16);
    ASSERT_EQ(i >= 0, in_range) << "bits " << b;
    if (i < 0) continue;
    ASSERT_LT(i, qbl::detail::table_entries);
    ++hits[static_cast<std::size_t>(i)];
    ++inside;
    EXPECT_EQ(qbl::detail::table_input_bits(i), bits16);
  }
  EXPECT_EQ(inside, qbl::detail::table_entries);
  for (int i = 0; i < qbl::detail::table_entries; ++i) EXPECT_EQ(hits[i], 1) << "entry " << i;
}

TEST(ActivationStagesArgs, RecomputingNeedsXLogitsAndScale) {
  // Checked before any launch: no GPU needed to see the refusals.
  float scale = 1.0f;
  float buf[4] = {};
  const float* none = nullptr;
  EXPECT_EQ(
      (qbl::detail::launch_quant_blend_backward<float, float, float, qbl::Gelu>(
          none, none, buf, &scale, nullptr, nullptr, buf, 1, 4, qbl::QuantGrad::zero, 0, nullptr)),
      cudaErrorInvalidValue)
      << "a recomputed mixed without x";
  EXPECT_EQ(
      (qbl::detail::launch_quant_blend_backward<float, float, float, qbl::Gelu>(
          none, buf, none, &scale, nullptr, nullptr, buf, 1, 4, qbl::QuantGrad::zero, 0, nullptr)),
      cudaErrorInvalidValue)
      << "a recomputed mixed without logits";
  EXPECT_EQ((qbl::quant_blend_backward<float, float, float, qbl::Gelu>(buf, none, buf, &scale,
                                                                       buf + 1, nullptr, 1, 1)),
            cudaErrorInvalidValue)
      << "an activation's grad_x without x";
  EXPECT_EQ((qbl::quant_blend_backward<float, float, float, qbl::Gelu>(buf, none, buf, &scale,
                                                                       nullptr, nullptr, 1, 4)),
            cudaSuccess)
      << "nothing wanted launches nothing";
}

}  // namespace

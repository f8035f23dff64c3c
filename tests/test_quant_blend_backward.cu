// qbl/quant_blend_backward.cuh and the backward's element math (qbl/element_math.hpp): the host
// functions against the independent reference of tests/reference.hpp (CPU, runs in CI), the
// reference's own grad_logits bound against mutants of the formula (CPU), and the launchers
// qbl::quant_blend_backward and qbl::bias_grad against the reference on the GPU, each in one suite
// over type and shape.
#include <qbl/quant_blend_backward.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl_test::bits;
using qbl_test::DType;

constexpr float inf = std::numeric_limits<float>::infinity();
const float nan = std::numeric_limits<float>::quiet_NaN();

bool same_bits_or_both_nan(float a, float b) {
  return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b));
}

/// Are all bytes of the element still the poison (never written)?
template <typename T>
bool unwritten(const T& v) {
  const auto* p = reinterpret_cast<const unsigned char*>(&v);
  return std::all_of(p, p + sizeof(T), [](unsigned char b) { return b == qbl_test::poison_byte; });
}

/// T-valued random floats: normal(0, stddev) rounded to the dtype.
std::vector<float> rand_t(DType t, std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::vector<float> v = qbl_test::randn(n, seed, stddev);
  for (auto& e : v) e = qbl_test::ref_round(t, e);
  return v;
}

// ---- host element math against the reference (CPU) ------------------------------------------

template <typename T>
class BackwardElementMath : public ::testing::Test {};
TYPED_TEST_SUITE(BackwardElementMath, qbl_test::AllTypes, qbl_test::AllTypeNames);

TYPED_TEST(BackwardElementMath, HostFunctionsMatchTheReference) {
  using T = TypeParam;
  constexpr DType dt = qbl_test::dtype_of<T>();
  std::mt19937_64 gen(20261203);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ua(0.0f, 1.0f);
  auto rt = [](float v) { return qbl_test::ref_round(dt, v); };
  const float scales[] = {rt(0.0157f), rt(3.0e-3f), 1.0f, 0.0f, inf, nan};
  int checked = 0;
  for (int i = 0; i < 20000; ++i) {
    float g = rt(nd(gen) * (i % 3 == 0 ? 100.0f : 1.0f));
    if (i % 17 == 0) g = -0.0f;
    if (i % 19 == 0) g = 0.0f;
    float alpha = rt(ua(gen));
    if (i % 23 == 0) alpha = 0.0f;
    if (i % 29 == 0) alpha = 1.0f;
    if (i % 31 == 0) alpha = nan;
    const float scale = scales[i % 6];
    const float oma = rt(1.0f - alpha);  // one rounding of an exact fp32 difference
    for (qbl::QuantGrad quant_grad : {qbl::QuantGrad::zero, qbl::QuantGrad::straight_through}) {
      const bool ste = quant_grad == qbl::QuantGrad::straight_through;
      const float want = qbl_test::reference_grad_x(dt, g, alpha, scale, ste);
      const float got = qbl::grad_x_value<T>(g, alpha, oma, scale, quant_grad);
      ASSERT_TRUE(same_bits_or_both_nan(got, want))
          << "g " << g << " alpha " << alpha << " scale " << scale << " ste " << ste
          << ": expected " << want << " (0x" << std::hex << bits(want) << "), actual " << got
          << " (0x" << bits(got) << ")";
      ++checked;
    }
    const float x = rt(nd(gen) * 4.0f);
    ASSERT_EQ(bits(qbl::grad_product<T>(g, x)), bits(qbl_test::ref_op(dt, double(g) * x)))
        << g << " * " << x;
    const float sq = nd(gen) * 50.0f, sx = nd(gen) * 50.0f;  // fp32 sums
    const float ga = qbl::grad_alpha_value<T>(sq, sx);
    ASSERT_EQ(bits(ga), bits(qbl_test::ref_op(dt, double(rt(sq)) - rt(sx)))) << sq << " " << sx;
    ASSERT_TRUE(same_bits_or_both_nan(qbl::grad_logit_value<T>(ga, alpha),
                                      qbl_test::reference_sigmoid_backward(dt, ga, alpha)))
        << "ga " << ga << " alpha " << alpha;
  }
  EXPECT_EQ(checked, 40000);
}

TYPED_TEST(BackwardElementMath, ZeroModeTurnsMinusZeroIntoPlusZeroAndFollowsTheScale) {
  using T = TypeParam;
  const float oma = 0.75f, alpha = 0.25f;
  // +0 from 0 / scale for a positive finite or infinite scale: -0 * 0.75 + 0 = +0.
  EXPECT_EQ(bits(qbl::grad_x_value<T>(-0.0f, alpha, oma, 0.5f)), 0u);
  EXPECT_EQ(bits(qbl::grad_x_value<T>(-0.0f, alpha, oma, inf)), 0u);
  EXPECT_EQ(bits(qbl::detail::zero_quant_grad(0.5f)), 0u);
  EXPECT_EQ(bits(qbl::detail::zero_quant_grad(inf)), 0u);
  // Straight-through keeps the sign: -0 * 0.25 + -0 * 0.75 = -0.
  EXPECT_EQ(bits(qbl::grad_x_value<T>(-0.0f, alpha, oma, 0.5f, qbl::QuantGrad::straight_through)),
            0x80000000u);
  // NaN scale (NaN in x) and zero scale (fp16's all-zero x): 0 / scale is NaN, so is grad_x --
  // but not under straight-through, which has no division.
  EXPECT_TRUE(std::isnan(qbl::grad_x_value<T>(1.0f, alpha, oma, nan)));
  EXPECT_TRUE(std::isnan(qbl::grad_x_value<T>(1.0f, alpha, oma, 0.0f)));
  EXPECT_EQ(qbl::grad_x_value<T>(2.0f, alpha, oma, nan, qbl::QuantGrad::straight_through), 2.0f);
  // The finite case: exactly the direct product.
  EXPECT_EQ(qbl::grad_x_value<T>(2.0f, alpha, oma, 0.5f), 1.5f);
}

// ---- the reference's grad_logits bound is not vacuous (CPU) -------------------------------------

// The interval of reference_grad_logit must hold what any summation order gives (checked here with
// fp32 sums left to right, right to left and pairwise, through the library's host functions), and
// must reject the formula's likely mistakes: sum_x dropped, alpha in place of 1 - alpha, the
// 1 - alpha of sigmoid_backward rounded to the dtype (16-bit only: a one-rounding difference).
TYPED_TEST(BackwardElementMath, GradLogitBoundHoldsEveryOrderAndRejectsMutants) {
  using T = TypeParam;
  constexpr DType dt = qbl_test::dtype_of<T>();
  int rejected_drop = 0, rejected_alpha = 0, tokens = 0;
  for (std::int64_t n : {1, 7, 65, 512, 2048}) {
    for (int rep = 0; rep < 20; ++rep, ++tokens) {
      const std::uint64_t seed =
          1000 * static_cast<std::uint64_t>(n) + static_cast<std::uint64_t>(rep);
      const auto g = rand_t(dt, static_cast<std::size_t>(n), seed, 0.3f);
      const auto x = rand_t(dt, static_cast<std::size_t>(n), seed + 1, 2.0f);
      std::mt19937 gen(static_cast<unsigned>(seed));
      const float alpha =
          qbl_test::ref_round(dt, std::uniform_real_distribution<float>(0.02f, 0.98f)(gen));
      const float scale = qbl_test::reference_scale(dt, 6.0f);
      const auto r = qbl_test::reference_grad_logit(dt, g.data(), x.data(), n, alpha, scale);
      ASSERT_FALSE(r.nan || r.overflow);
      ASSERT_LE(r.lo, r.hi);
      std::vector<float> pq(static_cast<std::size_t>(n)), px(pq.size());
      for (std::int64_t i = 0; i < n; ++i) {
        pq[i] = qbl::grad_product<T>(g[i], qbl::fake_quant<T>(x[i], scale));
        px[i] = qbl::grad_product<T>(g[i], x[i]);
      }
      auto forward_sum = [](const std::vector<float>& v) {
        float s = 0.0f;
        for (float e : v) s += e;
        return s;
      };
      auto backward_sum = [](const std::vector<float>& v) {
        float s = 0.0f;
        for (auto it = v.rbegin(); it != v.rend(); ++it) s += *it;
        return s;
      };
      auto pairwise_sum = [](std::vector<float> v) {
        while (v.size() > 1) {
          std::vector<float> h((v.size() + 1) / 2);
          for (std::size_t i = 0; i < h.size(); ++i)
            h[i] = 2 * i + 1 < v.size() ? v[2 * i] + v[2 * i + 1] : v[2 * i];
          v.swap(h);
        }
        return v.empty() ? 0.0f : v[0];
      };
      for (int order = 0; order < 3; ++order) {
        const float sq =
            order == 0 ? forward_sum(pq) : (order == 1 ? backward_sum(pq) : pairwise_sum(pq));
        const float sx =
            order == 0 ? forward_sum(px) : (order == 1 ? backward_sum(px) : pairwise_sum(px));
        const float got = qbl::grad_logit_value<T>(qbl::grad_alpha_value<T>(sq, sx), alpha);
        EXPECT_TRUE(r.lo <= got && got <= r.hi)
            << "n " << n << " order " << order << ": " << got << " outside [" << r.lo << ", "
            << r.hi << "], float64 " << r.exact;
      }
      // Mutants, each from the same sums (left to right).
      const float sq = forward_sum(pq), sx = forward_sum(px);
      const float no_x = qbl::grad_logit_value<T>(qbl::grad_alpha_value<T>(sq, 0.0f), alpha);
      const float ga = qbl::grad_alpha_value<T>(sq, sx);
      const float alpha_sq = qbl::detail::round_to<T>(ga * alpha * alpha);
      rejected_drop += no_x < r.lo || no_x > r.hi;
      rejected_alpha += alpha_sq < r.lo || alpha_sq > r.hi;
    }
  }
  // Random data: sum_x is rarely near zero, alpha rarely near 1/2 (then alpha * alpha and
  // (1 - alpha) * alpha coincide).
  EXPECT_GE(rejected_drop, tokens * 9 / 10) << "of " << tokens;
  EXPECT_GE(rejected_alpha, tokens * 8 / 10) << "of " << tokens;
}

// ---- launcher arguments (CPU: nothing reaches CUDA) ---------------------------------------------

TEST(QuantBlendBackwardArgs, RejectsBadArgumentsWithoutLaunching) {
  float d = 0;
  const float* c = &d;
  using qbl::QuantGrad;
  EXPECT_EQ(qbl::quant_blend_backward<float>(c, c, c, c, &d, &d, -1, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend_backward<float>(c, c, c, c, &d, &d, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend_backward<float>(nullptr, c, c, c, &d, &d, 4, 4),
            cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend_backward<float>(c, c, nullptr, c, &d, &d, 4, 4),
            cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend_backward<float>(c, c, c, nullptr, &d, &d, 4, 4),
            cudaErrorInvalidValue);
  // x is needed for grad_logits only.
  EXPECT_EQ(qbl::quant_blend_backward<float>(c, nullptr, c, c, nullptr, &d, 4, 4),
            cudaErrorInvalidValue);
  // No-ops: tokens == 0, or neither output wanted; null inputs allowed then.
  EXPECT_EQ(qbl::quant_blend_backward<float>(nullptr, nullptr, nullptr, nullptr, &d, &d, 0, 4),
            cudaSuccess);
  EXPECT_EQ(
      qbl::quant_blend_backward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 4, 4),
      cudaSuccess);
  EXPECT_EQ(qbl::bias_grad<float>(c, &d, -1, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::bias_grad<float>(c, &d, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::bias_grad<float>(nullptr, &d, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::bias_grad<float>(c, nullptr, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::bias_grad<float>(nullptr, nullptr, 0, 4), cudaSuccess);
}

// ---- qbl::quant_blend_backward on the GPU ------------------------------------------------------

enum class ScaleKind { from_x, nan_scale, zero_scale, inf_scale };

const char* scale_name(ScaleKind s) {
  switch (s) {
    case ScaleKind::from_x:
      return "scale";
    case ScaleKind::nan_scale:
      return "nanscale";
    case ScaleKind::zero_scale:
      return "zeroscale";
    case ScaleKind::inf_scale:
      return "infscale";
  }
  return "?";
}

/// A launch's shape and the scale it is given (x's own, or a NaN, zero or infinite one).
struct LaunchShape {
  std::int64_t tokens, features;
  ScaleKind scale = ScaleKind::from_x;
};

void PrintTo(const LaunchShape& c, std::ostream* os) {
  *os << "tokens=" << c.tokens << " features=" << c.features << " " << scale_name(c.scale);
}

std::string shape_name(const LaunchShape& c) {
  return "t" + std::to_string(c.tokens) + "_f" + std::to_string(c.features) + "_" +
         scale_name(c.scale);
}

std::vector<LaunchShape> launch_shapes() {
  std::vector<LaunchShape> v = {{1, 1},    {3, 7},     {7, 65},    {65, 217},  {217, 64},
                                {9, 2048}, {2049, 33}, {100, 512}, {65, 1024}, {3, 2048}};
  for (ScaleKind s : {ScaleKind::nan_scale, ScaleKind::zero_scale, ScaleKind::inf_scale})
    v.push_back({37, 96, s});
  return v;
}

/// Which outputs a run asks for, and whether grad_x is formed in g_mixed's own buffer (one type
/// only).
enum class Outputs { both, in_place, x_only, logits_only };

/// One launch shape with g_mixed, x and grad_x at element offset `off` (1: the scalar kernel) and
/// the quantizer's gradient `ste` or zero, every subset of the outputs: grad_x bit for bit the
/// reference's, grad_logits within its intervals, nothing written that was not asked for.
template <typename Types>
void run_launcher_case(const LaunchShape& c, std::size_t off, bool ste, std::uint64_t seed) {
  using X = typename Types::x_type;
  using G = typename Types::gemm_type;
  using L = typename Types::logits_type;
  constexpr DType xt = qbl_test::dtype_of<X>(), gt = qbl_test::dtype_of<G>(),
                  lt = qbl_test::dtype_of<L>();
  constexpr bool one_type = std::is_same_v<G, X>;
  const std::int64_t tokens = c.tokens, f = c.features;
  const auto n = static_cast<std::size_t>(tokens * f);
  std::vector<float> g = rand_t(gt, n, seed, 0.5f);
  for (std::size_t i = 0; i < n; i += 7) g[i] = -0.0f;  // -0 -> +0 in zero mode
  for (std::size_t i = 3; i < n; i += 11) g[i] = 0.0f;
  const std::vector<float> x = rand_t(xt, n, seed + 1, 1.5f);
  const std::vector<float> logits = rand_t(lt, static_cast<std::size_t>(tokens), seed + 2, 2.0f);
  float scale = qbl_test::reference_scale(xt, qbl_test::reference_amax(x));
  if (c.scale == ScaleKind::nan_scale) scale = nan;
  if (c.scale == ScaleKind::zero_scale) scale = 0.0f;
  if (c.scale == ScaleKind::inf_scale) scale = inf;

  qbl_test::DeviceArray<G> dg(n + off);
  qbl_test::DeviceArray<X> dx(n + off), dgx(n + off);
  qbl_test::DeviceArray<L> dl(static_cast<std::size_t>(tokens)),
      dgl(static_cast<std::size_t>(tokens) + off);
  qbl_test::DeviceArray<float> dscale(1), dalpha(static_cast<std::size_t>(tokens));
  ASSERT_TRUE(dg.ok() && dx.ok() && dl.ok() && dgx.ok() && dgl.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(off), qbl_test::convert<X>(x)));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), qbl_test::convert<L>(logits)));
  QBL_ASSERT_CUDA(cudaMemcpy(dscale.get(), &scale, sizeof scale, cudaMemcpyHostToDevice));
  qbl_test::device_sigmoid_t<L>
      <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(), dalpha.get(), tokens);
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> alpha(static_cast<std::size_t>(tokens));
  QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));

  // The reference, from the same operands (g_mixed widened exactly from G to X).
  std::vector<float> want_x(n);
  std::vector<qbl_test::GradLogitRef> want_l(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t i = 0; i < f; ++i)
      want_x[t * f + i] = qbl_test::reference_grad_x(xt, g[t * f + i], alpha[t], scale, ste, lt);
    want_l[t] = qbl_test::reference_grad_logit(xt, lt, &g[t * f], &x[t * f], f, alpha[t], scale);
  }
  const qbl::QuantGrad quant_grad = ste ? qbl::QuantGrad::straight_through : qbl::QuantGrad::zero;

  for (Outputs outs : {Outputs::both, Outputs::in_place, Outputs::x_only, Outputs::logits_only}) {
    if (outs == Outputs::in_place && !one_type) continue;
    SCOPED_TRACE("outputs " + std::to_string(static_cast<int>(outs)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(off), qbl_test::convert<G>(g)));
    QBL_ASSERT_CUDA(cudaMemset(dgx.get(), qbl_test::poison_byte, (n + off) * sizeof(X)));
    QBL_ASSERT_CUDA(cudaMemset(dgl.get(), qbl_test::poison_byte, (tokens + off) * sizeof(L)));
    if (outs == Outputs::in_place)  // the element before g_mixed is poisoned too
      QBL_ASSERT_CUDA(cudaMemset(dg.get(), qbl_test::poison_byte, off * sizeof(G)));
    X* gx = outs == Outputs::logits_only ? nullptr : dgx.get(off);
    if constexpr (one_type) {
      if (outs == Outputs::in_place) gx = dg.get(off);
    }
    L* gl = outs == Outputs::x_only ? nullptr : dgl.get(off);
    QBL_ASSERT_CUDA((qbl::quant_blend_backward<X, G, L>(
        dg.get(off), dx.get(off), dl.get(), dscale.get(), gx, gl, tokens, f, quant_grad)));
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<X> raw_x(n + off);
    std::vector<L> raw_l(static_cast<std::size_t>(tokens) + off);
    if constexpr (one_type) {
      QBL_ASSERT_CUDA(qbl_test::to_host(raw_x, outs == Outputs::in_place ? dg.get() : dgx.get()));
    } else {
      QBL_ASSERT_CUDA(qbl_test::to_host(raw_x, dgx.get()));
    }
    QBL_ASSERT_CUDA(qbl_test::to_host(raw_l, dgl.get()));
    for (std::size_t i = 0; i < off; ++i) {
      EXPECT_TRUE(unwritten(raw_x[i])) << "grad_x: wrote before the output";
      EXPECT_TRUE(unwritten(raw_l[i])) << "grad_logits: wrote before the output";
    }
    if (gx == nullptr) {
      for (std::size_t i = 0; i < raw_x.size(); ++i)
        ASSERT_TRUE(unwritten(raw_x[i])) << "grad_x not wanted, written at " << i;
    } else {
      std::vector<float> got(n);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_FALSE(unwritten(raw_x[off + i])) << "grad_x unwritten at " << i;
        got[i] = qbl_test::to_f(raw_x[off + i]);
      }
      EXPECT_TRUE(qbl_test::bits_equal(got, want_x, static_cast<std::size_t>(f)));
    }
    if (gl == nullptr) {
      for (std::size_t i = 0; i < raw_l.size(); ++i)
        ASSERT_TRUE(unwritten(raw_l[i])) << "grad_logits not wanted, written at " << i;
    } else {
      // Within what any summation order gives, and within the compensated sums' tighter bound.
      int bad = 0;
      for (std::int64_t t = 0; t < tokens; ++t) {
        ASSERT_FALSE(unwritten(raw_l[off + t])) << "grad_logits unwritten at " << t;
        const float got = qbl_test::to_f(raw_l[off + t]);
        const auto& w = want_l[t];
        if (!w.admits(got) && bad++ < 8)
          ADD_FAILURE() << "grad_logits[" << t << "]: actual " << got << ", expected "
                        << w.expected();
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

class QuantBlendBackwardDevice : public ::testing::TestWithParam<qbl_test::Typed<LaunchShape>> {};

TEST_P(QuantBlendBackwardDevice, MatchesTheReference) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto& c = GetParam();
  for (const std::size_t off : {0, 1})
    for (const bool ste : {false, true}) {
      SCOPED_TRACE("offset " + std::to_string(off) + (ste ? ", straight-through" : ", zero"));
      ASSERT_TRUE(qbl_test::with_types(
          c.types, [&](auto t) { run_launcher_case<decltype(t)>(c.shape, off, ste, seed); }));
      if (HasFatalFailure()) return;
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantBlendBackwardDevice,
                         ::testing::ValuesIn(qbl_test::over_supported_types(launch_shapes())),
                         qbl_test::TypedName{});

// ---- qbl::bias_grad on the GPU ------------------------------------------------------------------

// grad_bias[o] = RN(fp32 sum over tokens) (+ old, rounded again, when accumulating). Element-wise
// bound against the float64 sum S: any fp32 order errs by at most (tokens - 1) 2^-24 sum |g|, and
// the rounding to the dtype by u |S| (u = 2^-24, 2^-8, 2^-11); accumulating adds one more
// rounding, u |old + S|. A margin of 2^-20 relative covers the float64 sum's own error.
template <typename T>
void run_bias_grad_case(std::int64_t tokens, std::int64_t outs, std::size_t off,
                        std::uint64_t seed) {
  constexpr DType dt = qbl_test::dtype_of<T>();
  const auto n = static_cast<std::size_t>(tokens * outs);
  const std::vector<float> g = rand_t(dt, n, seed, 2.0f);
  const std::vector<float> old = rand_t(dt, static_cast<std::size_t>(outs), seed + 1, 3.0f);
  std::vector<double> abs_sum;
  const std::vector<double> sum = qbl_test::bias_grad_reference(g, tokens, outs, &abs_sum);
  qbl_test::DeviceArray<T> dg(n + off), db(static_cast<std::size_t>(outs) + off);
  QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(off), qbl_test::convert<T>(g)));
  const double u = qbl_test::unit_roundoff(dt);
  qbl_test::DeviceArray<unsigned char> ws(qbl::bias_grad_workspace_bytes(outs));
  for (int k = 0; k < 4; ++k) {
    const bool accumulate = k % 2 == 1, with_workspace = k >= 2;
    SCOPED_TRACE(std::string(accumulate ? "accumulate" : "overwrite") +
                 (with_workspace ? ", row ranges in a workspace" : ", one range"));
    QBL_ASSERT_CUDA(cudaMemset(db.get(), qbl_test::poison_byte, (outs + off) * sizeof(T)));
    QBL_ASSERT_CUDA(cudaMemset(ws.get(), qbl_test::poison_byte, ws.size()));
    if (accumulate) QBL_ASSERT_CUDA(qbl_test::to_device(db.get(off), qbl_test::convert<T>(old)));
    QBL_ASSERT_CUDA(qbl::bias_grad<T>(dg.get(off), db.get(off), tokens, outs, accumulate,
                                      with_workspace ? ws.get() : nullptr));
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<T> raw(static_cast<std::size_t>(outs) + off);
    QBL_ASSERT_CUDA(qbl_test::to_host(raw, db.get()));
    for (std::size_t i = 0; i < off; ++i)
      EXPECT_TRUE(unwritten(raw[i])) << "wrote before the output";
    int bad = 0;
    for (std::int64_t o = 0; o < outs; ++o) {
      ASSERT_FALSE(unwritten(raw[off + o])) << "unwritten at " << o;
      const double got = qbl_test::to_f(raw[off + o]);
      const double want = sum[o] + (accumulate ? old[o] : 0.0);
      const double bound = static_cast<double>(tokens - 1) * 0x1p-24 * abs_sum[o] +
                           u * std::fabs(sum[o]) + (accumulate ? u * std::fabs(want) : 0.0) +
                           0x1p-20 * abs_sum[o];
      if (std::fabs(got - want) > bound && bad++ < 8)
        ADD_FAILURE() << "grad_bias[" << o << "]: expected " << want << " +- " << bound
                      << ", actual " << got;
    }
    EXPECT_EQ(bad, 0);
  }
}

/// The column sum's element type (the GEMM's, G) and shape.
struct BiasShape {
  DType type;
  std::int64_t tokens, outs;
};

void PrintTo(const BiasShape& c, std::ostream* os) {
  *os << qbl_test::dtype_name(c.type) << " tokens=" << c.tokens << " outs=" << c.outs;
}

std::vector<BiasShape> bias_shapes() {
  std::vector<BiasShape> v;
  for (DType t : {DType::fp32, DType::bf16, DType::fp16})
    for (auto [tokens, outs] : {std::pair<std::int64_t, std::int64_t>{1, 1},
                                {3, 7},
                                {7, 65},
                                {65, 217},
                                {2049, 40},
                                {217, 1000},
                                {8192, 1024},
                                {4099, 64}})
      v.push_back({t, tokens, outs});
  return v;
}

class BiasGradDevice : public ::testing::TestWithParam<BiasShape> {};

TEST_P(BiasGradDevice, SumsOverTokensWithinTheFp32Bound) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const BiasShape& c = GetParam();
  for (std::size_t off : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(off));
    switch (c.type) {
      case DType::fp32:
      case DType::tf32:
        run_bias_grad_case<float>(c.tokens, c.outs, off, seed);
        break;
      case DType::bf16:
        run_bias_grad_case<__nv_bfloat16>(c.tokens, c.outs, off, seed);
        break;
      case DType::fp16:
        run_bias_grad_case<__half>(c.tokens, c.outs, off, seed);
        break;
    }
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BiasGradDevice, ::testing::ValuesIn(bias_shapes()),
                         [](const ::testing::TestParamInfo<BiasShape>& i) {
                           return std::string(qbl_test::dtype_name(i.param.type)) + "_t" +
                                  std::to_string(i.param.tokens) + "_o" +
                                  std::to_string(i.param.outs);
                         });

// ---- grad_logits as accurate as the arithmetic allows -----------------------------------------

// The two row sums compensated: qbl's grad_logits, against the float64 value of the formula, is no
// less accurate than the same formula from plain fp32 sums of the same products in element order
// -- the order a straightforward kernel, or a reduction over few threads, uses. fp32 (also with a
// 16-bit GEMM's g_mixed) and rows long enough that accumulation error is what separates them (the
// issue's case: D = 1000, few tokens): a plain sum of n terms errs by about n u |p| / sqrt(2) where
// the compensated one keeps only the roundings every method shares. (In bf16 and fp16 the
// rounding of each sum to the dtype dominates both, and they agree nearly everywhere.)
template <typename G>
void compare_with_plain_sums(std::int64_t tokens, std::int64_t f, std::uint64_t seed) {
  const auto n = static_cast<std::size_t>(tokens * f);
  const std::vector<float> g = rand_t(qbl_test::dtype_of<G>(), n, seed, 0.5f);
  const std::vector<float> x = rand_t(DType::fp32, n, seed + 1, 1.5f);
  const std::vector<float> logits = rand_t(DType::fp32, static_cast<std::size_t>(tokens), seed + 2);
  const float scale = qbl_test::reference_scale(DType::fp32, qbl_test::reference_amax(x));
  qbl_test::DeviceArray<G> dg(n);
  qbl_test::DeviceArray<float> dx(n), dl(tokens), dgl(tokens), dscale(1), dalpha(tokens);
  QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(), qbl_test::convert<G>(g)));
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), x));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), logits));
  QBL_ASSERT_CUDA(cudaMemcpy(dscale.get(), &scale, sizeof scale, cudaMemcpyHostToDevice));
  qbl_test::device_sigmoid_t<float>
      <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(), dalpha.get(), tokens);
  QBL_ASSERT_CUDA((qbl::quant_blend_backward<float, G>(dg.get(), dx.get(), dl.get(), dscale.get(),
                                                       nullptr, dgl.get(), tokens, f)));
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(tokens), alpha(tokens), plain(tokens);
  std::vector<double> exact(tokens);
  QBL_ASSERT_CUDA(qbl_test::to_host(got, dgl.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
  for (std::int64_t t = 0; t < tokens; ++t) {
    exact[t] =
        qbl_test::reference_grad_logit(DType::fp32, &g[t * f], &x[t * f], f, alpha[t], scale).exact;
    float sq = 0.0f, sx = 0.0f;
    for (std::int64_t i = 0; i < f; ++i) {
      const float gi = g[t * f + i], xi = x[t * f + i];
      sq += qbl::grad_product<float>(gi, qbl::fake_quant<float>(xi, scale));
      sx += qbl::grad_product<float>(gi, xi);
    }
    plain[t] = qbl::grad_logit_value<float>(qbl::grad_alpha_value<float>(sq, sx), alpha[t]);
  }
  const double e_qbl = qbl_test::relative_error(got, exact);
  const double e_plain = qbl_test::relative_error(plain, exact);
  std::printf(
      "[ grad_logits fp32%s tokens %lld D %lld ] error against float64: compensated %.3g, "
      "plain fp32 sums %.3g\n",
      std::is_same_v<G, float> ? "" : " (16-bit g_mixed)", static_cast<long long>(tokens),
      static_cast<long long>(f), e_qbl, e_plain);
  EXPECT_LE(e_qbl, e_plain);
}

TEST(QuantBlendBackwardAccuracy, GradLogitsNoWorseThanPlainFp32Sums) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (auto [tokens, f] : {std::pair<std::int64_t, std::int64_t>{4, 1000},
                           {16, 1000},
                           {64, 2048},
                           {8, 4096},
                           {256, 1024}}) {
    SCOPED_TRACE("tokens " + std::to_string(tokens) + " D " + std::to_string(f));
    compare_with_plain_sums<float>(tokens, f, seed);
    compare_with_plain_sums<__nv_bfloat16>(tokens, f, seed + 7);
  }
}

// Rows where a plain fp32 sum drifts: x = [1, c, c, ..., c] with g = [0, 1, 1, ..., 1] (the 1
// sets amax and adds nothing), so each of the two row sums adds D - 1 equal terms (x_q = q, or c)
// and grad_alpha is (D - 1)(q - c), a difference 36 to 900 times smaller than either sum.
// Recursive fp32 summation of equal terms errs by a fixed amount per term; a compensated sum by
// about 2u of its total however many terms there are. At D = 16384 (512 terms per lane of the
// row's warp) plain fp32 sums in the kernel's order miss the tight interval below by 4 to 14
// times its half-width for every c here (a model of that order in numpy float32); the compensated
// ones lie within it, deterministically: these inputs have no seed.
template <typename G>
void drifting_rows() {
  constexpr std::int64_t f = 16384;
  const std::vector<float> cs = {0.1f, 0.3f, 0.7f, 0.123f, 0.0567f, 0.211f};
  const auto tokens = static_cast<std::int64_t>(cs.size());
  const auto n = static_cast<std::size_t>(tokens * f);
  std::vector<float> g(n, 1.0f), x(n);
  std::vector<float> logits(static_cast<std::size_t>(tokens));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::fill(x.begin() + t * f, x.begin() + (t + 1) * f, cs[t]);
    x[t * f] = 1.0f;
    g[t * f] = 0.0f;
    logits[t] = 0.25f * static_cast<float>(t) - 0.5f;
  }
  const float scale = qbl_test::reference_scale(DType::fp32, qbl_test::reference_amax(x));
  qbl_test::DeviceArray<G> dg(n);
  qbl_test::DeviceArray<float> dx(n), dl(tokens), dgl(tokens), dscale(1), dalpha(tokens);
  QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(), qbl_test::convert<G>(g)));
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), x));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), logits));
  QBL_ASSERT_CUDA(cudaMemcpy(dscale.get(), &scale, sizeof scale, cudaMemcpyHostToDevice));
  qbl_test::device_sigmoid_t<float>
      <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(), dalpha.get(), tokens);
  QBL_ASSERT_CUDA((qbl::quant_blend_backward<float, G>(dg.get(), dx.get(), dl.get(), dscale.get(),
                                                       nullptr, dgl.get(), tokens, f)));
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(tokens), alpha(tokens);
  QBL_ASSERT_CUDA(qbl_test::to_host(got, dgl.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
  for (std::int64_t t = 0; t < tokens; ++t) {
    const auto want =
        qbl_test::reference_grad_logit(DType::fp32, &g[t * f], &x[t * f], f, alpha[t], scale);
    EXPECT_TRUE(want.admits(got[t]))
        << "c = " << cs[t] << ": grad_logits " << got[t] << ", expected " << want.expected();
  }
}

TEST(QuantBlendBackwardAccuracy, CompensatedSumsKeepWhatPlainSumsDrop) {
  QBL_REQUIRE_GPU();
  drifting_rows<float>();
  drifting_rows<__nv_bfloat16>();
}

}  // namespace

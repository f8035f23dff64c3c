// qbl/element_math.cuh: the element arithmetic against the eager formulas, on the CPU (runs in CI)
// and the same functions on the GPU against the CPU, bit for bit.
#include <qbl/element_math.cuh>

#include "property_cases.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using qbl_test::bits;

constexpr float inf = std::numeric_limits<float>::infinity();
const float nan = std::numeric_limits<float>::quiet_NaN();

TEST(ElementMath, Inv127IsTheFloatReciprocal) {
  // eager's `amax / 127.0` multiplies by the float reciprocal of 127.
  volatile float one = 1.0f, d = 127.0f;
  EXPECT_EQ(bits(qbl::inv_127), bits(one / d));
  EXPECT_EQ(bits(qbl::inv_127), 0x3c010204u);
  EXPECT_EQ(qbl::amax_floor, static_cast<float>(1e-8));
}

TEST(ElementMath, ScaleFromAmaxClampsAndKeepsNaN) {
  EXPECT_EQ(bits(qbl::scale_from_amax(0.0f)), bits(1e-8f * qbl::inv_127));
  EXPECT_EQ(bits(qbl::scale_from_amax(1e-30f)), bits(1e-8f * qbl::inv_127));
  EXPECT_EQ(bits(qbl::scale_from_amax(2.0f)), bits(2.0f * qbl::inv_127));
  EXPECT_TRUE(std::isnan(qbl::scale_from_amax(nan)));
  EXPECT_EQ(qbl::scale_from_amax(inf), inf);
  // A multiply by fl(1/127), not a division by 127: they differ for some amax.
  int differ = 0;
  for (float a = 1.0f; a < 2.0f; a += 1.0f / 4096) differ += (a * qbl::inv_127) != (a / 127.0f);
  EXPECT_GT(differ, 0) << "no amax separates the multiply from the division";
}

TEST(ElementMath, AbsBitsOrderIsAbsOrderWithNaNOnTop) {
  const std::vector<float> ascending = {0.0f, FLT_TRUE_MIN, FLT_MIN, 1e-8f, 0.5f, 1.0f, 127.0f,
                                        FLT_MAX, inf};
  for (std::size_t i = 1; i < ascending.size(); ++i) {
    EXPECT_LT(qbl::abs_bits(ascending[i - 1]), qbl::abs_bits(ascending[i]));
    EXPECT_EQ(qbl::abs_bits(ascending[i]), qbl::abs_bits(-ascending[i]));
  }
  EXPECT_EQ(qbl::abs_bits(-0.0f), 0u);
  EXPECT_GT(qbl::abs_bits(nan), qbl::abs_bits(inf));
  EXPECT_GT(qbl::abs_bits(-nan), qbl::abs_bits(inf));
  EXPECT_EQ(qbl::from_abs_bits(qbl::abs_bits(-3.5f)), 3.5f);
}

TEST(ElementMath, ClampKeepsNaN) {
  EXPECT_EQ(qbl::clamp_keep_nan(200.0f, -127.0f, 127.0f), 127.0f);
  EXPECT_EQ(qbl::clamp_keep_nan(-200.0f, -127.0f, 127.0f), -127.0f);
  EXPECT_EQ(qbl::clamp_keep_nan(3.0f, -127.0f, 127.0f), 3.0f);
  EXPECT_TRUE(std::isnan(qbl::clamp_keep_nan(nan, -127.0f, 127.0f)));
  EXPECT_EQ(qbl::clamp_keep_nan(inf, -127.0f, 127.0f), 127.0f);
  EXPECT_EQ(qbl::clamp_keep_nan(-inf, -127.0f, 127.0f), -127.0f);
}

TEST(ElementMath, FakeQuantRoundsHalfToEven) {
  const float scale = 0.5f;  // x / scale exact: 2x
  EXPECT_EQ(qbl::fake_quant(1.25f, scale), 1.0f);    // 2.5 -> 2
  EXPECT_EQ(qbl::fake_quant(1.75f, scale), 2.0f);    // 3.5 -> 4
  EXPECT_EQ(qbl::fake_quant(-1.25f, scale), -1.0f);  // -2.5 -> -2
  EXPECT_EQ(qbl::fake_quant(0.25f, scale), 0.0f);    // 0.5 -> 0
  EXPECT_EQ(qbl::fake_quant(0.75f, scale), 1.0f);    // 1.5 -> 2
  EXPECT_EQ(qbl::fake_quant(0.26f, scale), 0.5f);
}

TEST(ElementMath, FakeQuantClampsAtPlusMinus127) {
  const float scale = 1.0f;
  EXPECT_EQ(qbl::fake_quant(126.5f, scale), 126.0f);  // tie to even
  EXPECT_EQ(qbl::fake_quant(127.0f, scale), 127.0f);
  EXPECT_EQ(qbl::fake_quant(127.5f, scale), 127.0f);  // rounds to 128, clamped
  EXPECT_EQ(qbl::fake_quant(1000.0f, scale), 127.0f);
  EXPECT_EQ(qbl::fake_quant(-127.49f, scale), -127.0f);
  EXPECT_EQ(qbl::fake_quant(-1000.0f, scale), -127.0f);
  // x == amax lands on the top code or one below it, never above.
  for (float amax : {1.0f, 3.3f, 1e-3f, 12345.678f, 1e30f}) {
    const float s = qbl::scale_from_amax(amax);
    const float xq = qbl::fake_quant(amax, s);
    EXPECT_TRUE(xq == 127.0f * s || xq == 126.0f * s) << "amax " << amax << " x_q " << xq;
    EXPECT_EQ(qbl::fake_quant(-amax, s), -xq);
  }
}

TEST(ElementMath, FakeQuantNonFinite) {
  EXPECT_TRUE(std::isnan(qbl::fake_quant(nan, 1.0f)));
  EXPECT_EQ(qbl::fake_quant(inf, 1.0f), 127.0f);
  EXPECT_EQ(qbl::fake_quant(-inf, 1.0f), -127.0f);
  // An infinite amax makes the scale infinite: 0 * inf = NaN for every finite x, as in eager.
  EXPECT_TRUE(std::isnan(qbl::fake_quant(1.0f, inf)));
  EXPECT_TRUE(std::isnan(qbl::fake_quant(inf, inf)));
  EXPECT_TRUE(std::isnan(qbl::fake_quant(1.0f, nan)));
}

TEST(ElementMath, FakeQuantSignedZeroAndDenormals) {
  const float s = qbl::scale_from_amax(1.0f);
  EXPECT_EQ(bits(qbl::fake_quant(-0.0f, s)), bits(-0.0f));
  EXPECT_EQ(bits(qbl::fake_quant(0.0f, s)), bits(0.0f));
  EXPECT_EQ(bits(qbl::fake_quant(-1e-3f, s)), bits(-0.0f));  // rounds to -0, times s stays -0
  // All-denormal x: amax is clamped to 1e-8, every code is 0, mixed keeps (1 - alpha) * x.
  const float sd = qbl::scale_from_amax(FLT_TRUE_MIN * 1000);
  EXPECT_EQ(qbl::fake_quant(FLT_TRUE_MIN * 1000, sd), 0.0f);
  const float m = qbl::quant_blend_value(FLT_TRUE_MIN * 1000, 0.25f, sd);
  EXPECT_EQ(bits(m), bits(0.75f * (FLT_TRUE_MIN * 1000)));
  EXPECT_NE(m, 0.0f) << "denormals must not be flushed";
}

TEST(ElementMath, SigmoidEdges) {
  EXPECT_EQ(qbl::sigmoid(0.0f), 0.5f);
  EXPECT_EQ(qbl::sigmoid(inf), 1.0f);
  EXPECT_EQ(bits(qbl::sigmoid(-inf)), bits(0.0f));
  EXPECT_EQ(bits(qbl::sigmoid(-200.0f)), bits(0.0f));  // exp overflows to inf, 1 / inf
  EXPECT_EQ(qbl::sigmoid(200.0f), 1.0f);
  EXPECT_TRUE(std::isnan(qbl::sigmoid(nan)));
  EXPECT_NEAR(qbl::sigmoid(1.0f), 0.7310585786f, 1e-7f);
}

TEST(ElementMath, BlendRoundsThreeTimes) {
  // With one rounding per op the result is fl(fl(a * q) + fl(b * x)); a fused a * q + fl(b * x)
  // differs for some inputs. Find such inputs, and check blend gives the three-rounding value.
  std::mt19937 gen(1234);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f), ua(0.0f, 1.0f);
  int fused_differs = 0;
  for (int i = 0; i < 20000; ++i) {
    const float x = u(gen), xq = u(gen), a = ua(gen);
    volatile float b = 1.0f - a;
    volatile float p = a * xq, r = b * x;
    volatile float want = p + r;
    const float got = qbl::blend(x, xq, a, b);
    ASSERT_EQ(bits(got), bits(want)) << "x " << x << " xq " << xq << " alpha " << a;
    fused_differs += bits(std::fma(a, xq, static_cast<float>(r))) != bits(want);
  }
  EXPECT_GT(fused_differs, 0) << "the sample never separates fused from unfused arithmetic";
}

TEST(ElementMath, QuantBlendNaNAndInfPropagate) {
  const float s = qbl::scale_from_amax(2.0f);
  EXPECT_TRUE(std::isnan(qbl::quant_blend_value(nan, 0.3f, s)));
  EXPECT_TRUE(std::isnan(qbl::quant_blend_value(1.0f, nan, s)));  // NaN logit -> NaN alpha
  EXPECT_TRUE(std::isnan(qbl::quant_blend_value(1.0f, 0.3f, qbl::scale_from_amax(inf))));
  // alpha == 1 (logit +inf): the (1 - alpha) * x term is +0, mixed == x_q.
  EXPECT_EQ(qbl::quant_blend_value(1.1f, 1.0f, s), qbl::fake_quant(1.1f, s));
  // alpha == 0 (logit -inf): mixed == x.
  EXPECT_EQ(qbl::quant_blend_value(1.1f, 0.0f, s), 1.1f);
}

// A fixed slice of random cases, against the formula written out with volatile temporaries.
TEST(ElementMath, RandomSliceMatchesTheFormula) {
  std::mt19937 gen(20261202);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> ua(0.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::fabs(n(gen)) * 4 + 1e-3f;
    const float x = n(gen), alpha = ua(gen);
    volatile float scale = amax * (1.0f / 127.0f);
    volatile float qdiv = x / scale;
    float q = std::nearbyint(static_cast<float>(qdiv));
    q = q < -127 ? -127 : (q > 127 ? 127 : q);
    volatile float xq = q * scale;
    volatile float one_minus = 1.0f - alpha;
    volatile float p = alpha * xq, r = one_minus * x;
    volatile float want = p + r;
    ASSERT_EQ(bits(qbl::quant_blend_value(x, alpha, qbl::scale_from_amax(amax))), bits(want))
        << "case " << i << ": x " << x << " alpha " << alpha << " amax " << amax;
  }
}

// ---- the same functions on the device ----------------------------------------------------

__global__ void device_element_math(const float* x, const float* alpha, const float* amax,
                                    float* quant_blend, float* scale, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  scale[i] = qbl::scale_from_amax(amax[i]);
  quant_blend[i] = qbl::quant_blend_value(x[i], alpha[i], scale[i]);
}

TEST(ElementMathDevice, MatchesHostBitForBit) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int n = 1 << 20;
  std::vector<float> x = qbl_test::randn(n, seed), alpha(n), amax(n);
  std::mt19937 gen(static_cast<unsigned>(seed));
  std::uniform_real_distribution<float> ua(0.0f, 1.0f), um(1e-9f, 8.0f);
  for (int i = 0; i < n; ++i) {
    alpha[i] = ua(gen);
    amax[i] = um(gen);
  }
  // Edge values at the front.
  const float edges[] = {nan, inf, -inf, -0.0f, 0.0f, FLT_TRUE_MIN, -FLT_MIN, 1e30f, -1e-30f};
  for (int i = 0; i < 9; ++i) x[i] = edges[i];
  amax[9] = 0.0f;
  amax[10] = nan;
  amax[11] = inf;
  alpha[12] = nan;
  alpha[13] = 0.0f;
  alpha[14] = 1.0f;
  qbl_test::DeviceArray<float> dx(n), da(n), dm(n), dq(n), ds(n);
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), x));
  QBL_ASSERT_CUDA(qbl_test::to_device(da.get(), alpha));
  QBL_ASSERT_CUDA(qbl_test::to_device(dm.get(), amax));
  device_element_math<<<(n + 255) / 256, 256>>>(dx.get(), da.get(), dm.get(), dq.get(), ds.get(), n);
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> q(n), s(n), want_q(n), want_s(n);
  QBL_ASSERT_CUDA(qbl_test::to_host(q, dq.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(s, ds.get()));
  for (int i = 0; i < n; ++i) {
    want_s[i] = qbl::scale_from_amax(amax[i]);
    want_q[i] = qbl::quant_blend_value(x[i], alpha[i], want_s[i]);
  }
  EXPECT_TRUE(qbl_test::bits_equal(s, want_s));
  EXPECT_TRUE(qbl_test::bits_equal(q, want_q));
}

}  // namespace

// ---- bf16 and fp16: eager rounds every fp32 op's result to the tensor dtype ------------------

namespace {

using qbl_test::ref_bf16;
using qbl_test::ref_fp16;

template <typename T>
struct Format;
template <>
struct Format<__nv_bfloat16> {
  static float round(float v) { return ref_bf16(v); }
  static constexpr float half_ulp_at_one = 0x1p-8f;
};
template <>
struct Format<__half> {
  static float round(float v) { return ref_fp16(v); }
  static constexpr float half_ulp_at_one = 0x1p-11f;
};

template <typename T>
class ElementMath16 : public ::testing::Test {};
using qbl_test::Names16;
using qbl_test::Types16;
TYPED_TEST_SUITE(ElementMath16, Types16, Names16);

TYPED_TEST(ElementMath16, RoundToMatchesAnIndependentRounding) {
  using T = TypeParam;
  std::mt19937 gen(99);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t u = any_bits(gen);
    float v;
    std::memcpy(&v, &u, sizeof v);
    if (std::isnan(v)) continue;
    ASSERT_EQ(bits(qbl::detail::round_to<T>(v)), bits(Format<T>::round(v))) << "v " << v;
  }
  // Ties to even at the last place of the format.
  EXPECT_EQ(qbl::detail::round_to<T>(1.0f + Format<T>::half_ulp_at_one), 1.0f);
  EXPECT_EQ(qbl::detail::round_to<T>(1.0f + 3 * Format<T>::half_ulp_at_one),
            1.0f + 4 * Format<T>::half_ulp_at_one);
}

TYPED_TEST(ElementMath16, ScaleClampBoundIsTheRoundedEpsilon) {
  using T = TypeParam;
  const float bound = Format<T>::round(1e-8f);
  EXPECT_EQ(bits(qbl::scale_from_amax<T>(0.0f)), bits(Format<T>::round(bound * qbl::inv_127)));
  EXPECT_EQ(bits(qbl::scale_from_amax<T>(3.0f)), bits(Format<T>::round(3.0f * qbl::inv_127)));
  EXPECT_TRUE(std::isnan(qbl::scale_from_amax<T>(std::numeric_limits<float>::quiet_NaN())));
}

TEST(ElementMath16, AllZeroXIsNaNInFp16AndZeroInBf16) {
  // fp16 rounds eager's 1e-8 clamp bound to 0: scale 0, 0 / 0 = NaN, as eager computes.
  EXPECT_EQ(qbl::scale_from_amax<__half>(0.0f), 0.0f);
  EXPECT_TRUE(std::isnan(qbl::quant_blend_value<__half>(0.0f, 0.3f, qbl::scale_from_amax<__half>(0.0f))));
  EXPECT_GT(qbl::scale_from_amax<__nv_bfloat16>(0.0f), 0.0f);
  EXPECT_EQ(qbl::quant_blend_value<__nv_bfloat16>(0.0f, 0.3f, qbl::scale_from_amax<__nv_bfloat16>(0.0f)), 0.0f);
}

TYPED_TEST(ElementMath16, RandomSliceMatchesTheFormulaOpByOp) {
  using T = TypeParam;
  const auto rt = [](float v) { return Format<T>::round(v); };
  std::mt19937 gen(4242);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> ua(0.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = rt(n(gen)), alpha = rt(ua(gen));
    const float amax = rt(std::fabs(n(gen)) * 4 + 1e-3f);
    const float scale = rt(amax * qbl::inv_127);
    float q = std::nearbyint(rt(x / scale));
    q = q < -127 ? -127 : (q > 127 ? 127 : q);
    const float xq = rt(q * scale);
    const float oma = rt(1.0f - alpha);
    const float want = rt(rt(alpha * xq) + rt(oma * x));
    ASSERT_EQ(bits(qbl::scale_from_amax<T>(amax)), bits(scale));
    ASSERT_EQ(bits(qbl::quant_blend_value<T>(x, alpha, scale)), bits(want))
        << "case " << i << ": x " << x << " alpha " << alpha << " amax " << amax;
  }
}

}  // namespace

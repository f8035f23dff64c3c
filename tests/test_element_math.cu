// qbl/element_math.hpp: the element arithmetic against the eager formulas, on the CPU (runs in CI)
// and the same functions on the GPU against the CPU, bit for bit.
#include <qbl/element_math.hpp>

#include "property_cases.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using qbl_test::bits;

constexpr float inf = std::numeric_limits<float>::infinity();
const float nan = std::numeric_limits<float>::quiet_NaN();

float bits_to_float(std::uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

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

TEST(ElementMath, CpuScaleDividesBy127) {
  // eager on the CPU divides `amax / 127.0` (its CUDA kernel multiplies by fl(1/127)).
  volatile float d = 127.0f;
  int differ = 0;
  for (float a = 1.0f; a < 2.0f; a += 1.0f / 4096) {
    EXPECT_EQ(bits(qbl::scale_from_amax_cpu(a)), bits(a / d)) << a;
    differ += qbl::scale_from_amax_cpu(a) != qbl::scale_from_amax(a);
  }
  EXPECT_GT(differ, 0) << "no amax separates the CPU's division from the CUDA multiply";
  EXPECT_EQ(bits(qbl::scale_from_amax_cpu(0.0f)), bits(1e-8f / d));
  EXPECT_TRUE(std::isnan(qbl::scale_from_amax_cpu(nan)));
  EXPECT_EQ(qbl::scale_from_amax_cpu(inf), inf);
  // 16-bit: the quotient rounded to the dtype; fp16's clamp bound rounds to 0 (scale 0).
  EXPECT_EQ(bits(qbl::scale_from_amax_cpu<__nv_bfloat16>(3.0f)),
            bits(__bfloat162float(__float2bfloat16_rn(3.0f / d))));
  EXPECT_EQ(qbl::scale_from_amax_cpu<__half>(0.0f), 0.0f);
}

TEST(ElementMath, AbsBitsOrderIsAbsOrderWithNaNOnTop) {
  const std::vector<float> ascending = {0.0f, FLT_TRUE_MIN, FLT_MIN, 1e-8f, 0.5f,
                                        1.0f, 127.0f,       FLT_MAX, inf};
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
  const float scale = 0.5f;                          // x / scale exact: 2x
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

// eager's sigmoid written out here, independently of qbl::sigmoid: fp32 exp, then 1 + e and 1 / d,
// each rounded on its own (volatile temporaries: nothing contracted or kept wider). The host's
// expf may differ in the last place from the device's, so on the host this is compared with
// qbl::sigmoid's host build, which calls the same host expf; the device test below compares the
// device's.
float eager_sigmoid_host(float l) {
  volatile float e = ::expf(-l);
  volatile float d = 1.0f + e;
  volatile float r = 1.0f / d;
  return r;
}

/// Same bits, or both NaN.
bool same_or_both_nan(float a, float b) {
  return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b));
}

TEST(ElementMath, SigmoidMatchesEagersFormulaOnTheHost) {
  // Values that do not depend on expf's last place.
  EXPECT_EQ(bits(qbl::sigmoid(0.0f)), 0x3f000000u);
  EXPECT_EQ(bits(qbl::sigmoid(-0.0f)), 0x3f000000u);
  EXPECT_EQ(bits(qbl::sigmoid(FLT_TRUE_MIN)), 0x3f000000u);  // exp(-tiny) == 1
  EXPECT_EQ(bits(qbl::sigmoid(-FLT_TRUE_MIN)), 0x3f000000u);
  EXPECT_EQ(bits(qbl::sigmoid(inf)), 0x3f800000u);
  EXPECT_EQ(bits(qbl::sigmoid(FLT_MAX)), 0x3f800000u);
  EXPECT_EQ(bits(qbl::sigmoid(17.0f)), 0x3f800000u);  // 1 + e^-17 rounds to 1
  EXPECT_EQ(bits(qbl::sigmoid(16.0f)), 0x3f7ffffeu);  // 1 + e^-16 rounds to 1 + 2^-23
  EXPECT_EQ(bits(qbl::sigmoid(-inf)), 0u);            // +0, not -0
  EXPECT_EQ(bits(qbl::sigmoid(-FLT_MAX)), 0u);
  EXPECT_EQ(bits(qbl::sigmoid(-89.0f)), 0u);  // e^89 overflows: 1 / inf
  const float tiny = qbl::sigmoid(-88.0f);    // 1 / (1 + e^88): a denormal
  EXPECT_GT(tiny, 0.0f) << "denormal alpha flushed";
  EXPECT_LT(tiny, FLT_MIN);
  EXPECT_TRUE(std::isnan(qbl::sigmoid(nan)));
  EXPECT_TRUE(std::isnan(qbl::sigmoid(-nan)));
  EXPECT_TRUE(std::isnan(qbl::sigmoid(bits_to_float(0x7f800001u))));  // signalling-NaN pattern
  // Every 1021st fp32 bit pattern (all exponents, both signs, NaNs included), and every 61st
  // logit of magnitude 2^-12 to 128, where sigmoid is neither 1/2 nor saturated.
  std::uint64_t checked = 0;
  const auto check = [&](std::uint32_t u) {
    const float l = bits_to_float(u);
    ++checked;
    if (same_or_both_nan(qbl::sigmoid(l), eager_sigmoid_host(l))) return true;
    ADD_FAILURE() << "logit " << l << " (0x" << std::hex << u << "): qbl 0x"
                  << bits(qbl::sigmoid(l)) << ", eager's formula 0x" << bits(eager_sigmoid_host(l))
                  << std::dec;
    return false;
  };
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 1021)
    if (!check(static_cast<std::uint32_t>(u))) return;
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (std::uint32_t u = bits(0x1p-12f); u <= bits(128.0f); u += 61)
      if (!check(sign | u)) return;
  EXPECT_GT(checked, 4000000u);
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
  device_element_math<<<(n + 255) / 256, 256>>>(dx.get(), da.get(), dm.get(), dq.get(), ds.get(),
                                                n);
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

// eager's sigmoid on the device, written out here rather than taken from qbl::sigmoid: the CUDA
// math library's expf (what eager's kernel calls), then IEEE add and divide, never contracted.
__device__ float eager_sigmoid_device(float l) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-l)));
}

struct SigmoidSweep {
  unsigned long long mismatches;
  unsigned first;  ///< the smallest mismatching logit's bits (0xffffffff: none)
};

/// qbl::sigmoid<float> against eager's formula for every one of the 2^32 fp32 logit bit patterns.
__global__ void sigmoid_every_fp32(SigmoidSweep* r) {
  unsigned long long bad = 0;
  unsigned first = 0xffffffffu;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t u = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       u < (std::uint64_t{1} << 32); u += stride) {
    const float l = __uint_as_float(static_cast<unsigned>(u));
    const float want = eager_sigmoid_device(l), got = qbl::sigmoid<float>(l);
    if (__float_as_uint(want) != __float_as_uint(got) && !(want != want && got != got)) {
      ++bad;
      first = min(first, static_cast<unsigned>(u));
    }
  }
  if (bad != 0) {
    atomicAdd(&r->mismatches, bad);
    atomicMin(&r->first, first);
  }
}

TEST(ElementMathDevice, SigmoidEveryFp32LogitMatchesEagersFormula) {
  QBL_REQUIRE_GPU();
  qbl_test::DeviceArray<SigmoidSweep> d(1);
  ASSERT_TRUE(d.ok());
  const SigmoidSweep init{0, 0xffffffffu};
  QBL_ASSERT_CUDA(cudaMemcpy(d.get(), &init, sizeof init, cudaMemcpyHostToDevice));
  sigmoid_every_fp32<<<4096, 256>>>(d.get());
  QBL_ASSERT_CUDA(cudaGetLastError());
  SigmoidSweep r{};
  QBL_ASSERT_CUDA(cudaMemcpy(&r, d.get(), sizeof r, cudaMemcpyDeviceToHost));
  EXPECT_EQ(r.mismatches, 0u) << "of 2^32 logits; the first is 0x" << std::hex << r.first << " ("
                              << bits_to_float(r.first) << ")";
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

/// Every value of T (as its float), from its 16 bits.
template <typename T>
std::vector<float> every_value() {
  std::vector<float> v(65536);
  for (std::uint32_t u = 0; u < 65536; ++u) {
    T t;
    const auto h = static_cast<std::uint16_t>(u);
    std::memcpy(static_cast<void*>(&t), &h, sizeof h);
    v[u] = static_cast<float>(t);
  }
  return v;
}

TYPED_TEST(ElementMath16, SigmoidOfEveryLogitIsEagersFormulaRoundedOnce) {
  using T = TypeParam;
  for (float l : every_value<T>()) {
    const float want = Format<T>::round(eager_sigmoid_host(l));
    ASSERT_TRUE(same_or_both_nan(qbl::sigmoid<T>(l), want))
        << "logit " << l << ": qbl " << qbl::sigmoid<T>(l) << ", eager's formula " << want;
  }
}

template <typename T>
__global__ void sigmoid_every_16(const float* logits, float* eager_fp32, float* qbl_t) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536) return;
  eager_fp32[i] = eager_sigmoid_device(logits[i]);
  qbl_t[i] = qbl::sigmoid<T>(logits[i]);
}

// On the device, every logit of T: qbl::sigmoid<T> against eager's fp32 formula on the device,
// rounded to T on the host by the tests' own rounding (not CUDA's conversions).
TYPED_TEST(ElementMath16, SigmoidOfEveryLogitOnTheDeviceIsEagersFormulaRoundedOnce) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::vector<float> logits = every_value<T>();
  qbl_test::DeviceArray<float> dl(65536), de(65536), dq(65536);
  ASSERT_TRUE(dl.ok() && de.ok() && dq.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), logits));
  QBL_ASSERT_CUDA(cudaMemset(dq.get(), qbl_test::poison_byte, 65536 * sizeof(float)));
  sigmoid_every_16<T><<<256, 256>>>(dl.get(), de.get(), dq.get());
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> eager(65536), got(65536);
  QBL_ASSERT_CUDA(qbl_test::to_host(eager, de.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(got, dq.get()));
  int bad = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float want = Format<T>::round(eager[i]);
    if (same_or_both_nan(got[i], want) && bits(got[i]) != 0xffffffffu) continue;
    if (++bad <= 8)
      ADD_FAILURE() << "logit " << logits[i] << " (0x" << std::hex << i << "): qbl 0x"
                    << bits(got[i]) << ", eager's formula 0x" << bits(want) << std::dec;
  }
  EXPECT_EQ(bad, 0) << "of 65536 logits";
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
  EXPECT_TRUE(
      std::isnan(qbl::quant_blend_value<__half>(0.0f, 0.3f, qbl::scale_from_amax<__half>(0.0f))));
  EXPECT_GT(qbl::scale_from_amax<__nv_bfloat16>(0.0f), 0.0f);
  EXPECT_EQ(
      qbl::quant_blend_value<__nv_bfloat16>(0.0f, 0.3f, qbl::scale_from_amax<__nv_bfloat16>(0.0f)),
      0.0f);
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

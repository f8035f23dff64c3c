// qbl/detail/quant_blend_math.cuh: the kernel's arithmetic against qbl/element_math.hpp.
//
// The kernel finds codes without a division and does the 16-bit products and the sum on packed
// instructions. Both are claims about every possible operand, so the GPU tests check every
// operand pair of each 16-bit type (2^32 each), and the fp32 code on sweeps around every
// rounding boundary; slices of the same checks run on the CPU (in CI).
#include <qbl/detail/quant_blend.inl>
#include <qbl/detail/quant_blend_math.cuh>

#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl::detail::code_reciprocal;
using qbl::detail::FastDiv;
using qbl::detail::quant_code;
using qbl::detail::quotient16;
using qbl_test::bits;

/// The reference code: clamp(rint(RN_T(x / s)), -127, 127), as qbl::fake_quant computes it.
template <typename T>
QBL_HOST_DEVICE float reference_code(float x, float s) {
  return qbl::clamp_keep_nan(
      qbl::detail::round_half_even(qbl::detail::round_to<T>(qbl::detail::div_rn(x, s))), -qbl::qmax,
      qbl::qmax);
}

QBL_HOST_DEVICE bool same(float a, float b) {
  return qbl::detail::float_bits(a) == qbl::detail::float_bits(b) || (a != a && b != b);
}

/// The value of the 16 bits `b` as a T, widened to float.
template <typename T>
QBL_HOST_DEVICE T bits_as(std::uint32_t b) {
  const auto h = static_cast<unsigned short>(b);
  if constexpr (std::is_same_v<T, __half>) {
    return __ushort_as_half(h);
  } else {
    return __ushort_as_bfloat16(h);
  }
}

template <typename T>
QBL_HOST_DEVICE float value_of(std::uint32_t b) {
  return qbl::detail::to_float(bits_as<T>(b));
}

/// splitmix64: a counter-based generator the device and the host share.
QBL_HOST_DEVICE std::uint64_t mix(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---- CPU ---------------------------------------------------------------------------------

TEST(FastDiv, MatchesIntegerDivision) {
  // Every divisor and dividend the kernel can ask for (below 2 * tile) ...
  constexpr std::uint32_t tile = 1024 * 8;
  for (std::uint32_t d = 1; d <= tile; ++d) {
    const FastDiv div(d);
    for (std::uint32_t n = 0; n < 2 * tile; ++n) ASSERT_EQ(div(n), n / d) << n << " / " << d;
  }
  // ... and random ones over the whole documented range.
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> u(0, 0x7fffffffu);
  for (int i = 0; i < 2000000; ++i) {
    const std::uint32_t d = std::max<std::uint32_t>(u(gen), 1), n = u(gen);
    ASSERT_EQ(FastDiv(d)(n), n / d) << n << " / " << d;
  }
}

TEST(QuantBlendMath, CodeReciprocalOnlyForPositiveNormalScales) {
  EXPECT_EQ(code_reciprocal(2.0f), 0.5f);
  EXPECT_EQ(code_reciprocal(0x1p-126f), 0x1p126f);
  EXPECT_EQ(code_reciprocal(0x1p125f), 0x1p-125f);
  for (float s : {0.0f, -0.0f, -1.0f, 0x1p-127f, FLT_TRUE_MIN, 0x1.000002p125f, FLT_MAX,
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    EXPECT_TRUE(std::isnan(code_reciprocal(s))) << s;
}

/// fp32 cases near every rounding boundary (x within `ulps` of (k + 1/2) * s for every code k)
/// and random bit patterns; calls check(x, s) for each.
template <typename Check>
void fp32_code_sweep(int scales, int ulps, int random, std::uint64_t seed, Check&& check) {
  for (int i = 0; i < scales; ++i) {
    const std::uint64_t r = mix(seed + i);
    const float amax =
        std::ldexp(1.0f + static_cast<float>(r >> 41) * 0x1p-23f, static_cast<int>(r % 220) - 110);
    const float s = qbl::scale_from_amax(amax);
    for (int k = -128; k <= 128; ++k) {
      const std::uint32_t c = bits((static_cast<float>(k) + 0.5f) * s);
      for (int d = -ulps; d <= ulps; ++d) {
        float x;
        const std::uint32_t b = c + static_cast<std::uint32_t>(d);
        std::memcpy(&x, &b, sizeof x);
        check(x, s);
      }
    }
  }
  for (int i = 0; i < random; ++i) {
    const std::uint64_t r = mix(seed ^ (0x5555ull + i));
    float x, s;
    const auto xb = static_cast<std::uint32_t>(r), sb = static_cast<std::uint32_t>(r >> 32);
    std::memcpy(&x, &xb, sizeof x);
    std::memcpy(&s, &sb, sizeof s);
    // Half the scales as the layer makes them (from an amax near |x|), half any bits at all.
    if (i % 2 == 0)
      s = qbl::scale_from_amax(std::fabs(x) * (1.0f + static_cast<float>(r % 64) / 32.0f));
    check(x, s);
  }
}

TEST(QuantBlendMath, Fp32CodeMatchesTheDivisionOnTheCpu) {
  std::int64_t n = 0, bad = 0;
  fp32_code_sweep(600, 24, 4000000, 20261202, [&](float x, float s) {
    ++n;
    const float want = reference_code<float>(x, s), got = quant_code(x, s, code_reciprocal(s));
    if (!same(got, want) && bad++ < 8)
      ADD_FAILURE() << "x " << x << " (0x" << std::hex << bits(x) << ") s " << s << " (0x"
                    << bits(s) << std::dec << "): code " << got << ", division " << want;
  });
  EXPECT_EQ(bad, 0) << "of " << n;
}

template <typename T>
class QuantBlendMath16 : public ::testing::Test {};
using qbl_test::Names16;
using qbl_test::Types16;
TYPED_TEST_SUITE(QuantBlendMath16, Types16, Names16);

// The quotient method itself (the packed code is checked on the GPU): every x against the edge
// scales and a sample of the rest.
TYPED_TEST(QuantBlendMath16, QuotientCodeMatchesTheDivisionOnTheCpu) {
  using T = TypeParam;
  std::vector<std::uint32_t> scales = {0x0000, 0x8000, 0x0001, 0x03ff, 0x0400, 0x0080, 0x007f,
                                       0x3c00, 0x3f80, 0x7bff, 0x7c00, 0x7f80, 0x7e00, 0x7fc0,
                                       0xbc00, 0xbf80, 0x0081, 0x00ff, 0x7eff, 0x7f7f};
  for (std::uint32_t i = 0; i < 108; ++i)
    scales.push_back(static_cast<std::uint32_t>(mix(i)) & 0x7fffu);
  std::int64_t bad = 0;
  for (std::uint32_t sb : scales) {
    const float s = value_of<T>(sb), y = code_reciprocal(s);
    for (std::uint32_t xb = 0; xb < 65536; ++xb) {
      const float x = value_of<T>(xb);
      float t = quotient16(x, s, y, -y);
      if (t != t) t = qbl::detail::div_rn(x, s);
      const float got = qbl::clamp_keep_nan(
          qbl::detail::round_half_even(qbl::detail::round_to<T>(t)), -qbl::qmax, qbl::qmax);
      const float want = reference_code<T>(x, s);
      if (!same(got, want) && bad++ < 8)
        ADD_FAILURE() << "x " << x << " s " << s << ": code " << got << ", division " << want;
    }
  }
  EXPECT_EQ(bad, 0);
}

// ---- GPU: every operand pair ---------------------------------------------------------------

struct Mismatches {
  unsigned long long count;
  unsigned first;  // (a bits << 16) | b bits of one mismatch, 0xffffffff if none
};

__device__ void note_mismatch(Mismatches* m, unsigned long long n, unsigned pair) {
  if (n == 0) return;
  atomicAdd(&m->count, n);
  atomicCAS(&m->first, 0xffffffffu, pair);
}

/// Block s (every 16-bit pattern) runs the kernel's code on every x, eight at a time.
template <typename T>
__global__ void every_code(Mismatches* m) {
  using Math = qbl::detail::QuantBlendMath<T, T, T, 8>;
  using T2 = typename Math::T2;
  const float s = value_of<T>(blockIdx.x);
  Math math;
  math.set_scale(s);
  unsigned long long bad = 0;
  unsigned pair = 0;
  for (unsigned x0 = threadIdx.x * 8; x0 < 65536; x0 += blockDim.x * 8) {
    qbl::detail::Vec<T, 8> in;
    for (int j = 0; j < 8; ++j) in.v[j] = bits_as<T>(x0 + j);
    T2 code[4];
    math.codes(in, code);
    for (int j = 0; j < 8; ++j) {
      const float got = qbl::detail::to_float(j % 2 == 0 ? code[j / 2].x : code[j / 2].y);
      const float want = reference_code<T>(value_of<T>(x0 + j), s);
      if (!same(got, want)) {
        ++bad;
        pair = (blockIdx.x << 16) | (x0 + j);
      }
    }
  }
  note_mismatch(m, bad, pair);
}

/// Block a runs the packed product and sum on every b: each against fp32 then one rounding to T.
template <typename T>
__global__ void every_product_and_sum(Mismatches* mul, Mismatches* add) {
  using P = qbl::detail::Pair<T>;
  const float a = value_of<T>(blockIdx.x);
  const typename P::type a2 = P::broadcast(a);
  unsigned long long bad_mul = 0, bad_add = 0;
  unsigned pair_mul = 0, pair_add = 0;
  for (unsigned b0 = threadIdx.x * 2; b0 < 65536; b0 += blockDim.x * 2) {
    const std::uint32_t both = b0 | ((b0 + 1) << 16);
    typename P::type b2;
    std::memcpy(&b2, &both, sizeof b2);
    const typename P::type p = P::mul(a2, b2), q = P::add(a2, b2);
    for (int j = 0; j < 2; ++j) {
      const float b = value_of<T>(b0 + j);
      const float got_p = qbl::detail::to_float(j == 0 ? p.x : p.y);
      const float got_q = qbl::detail::to_float(j == 0 ? q.x : q.y);
      if (!same(got_p, qbl::detail::round_to<T>(qbl::detail::mul_rn(a, b)))) {
        ++bad_mul;
        pair_mul = (blockIdx.x << 16) | (b0 + j);
      }
      if (!same(got_q, qbl::detail::round_to<T>(qbl::detail::add_rn(a, b)))) {
        ++bad_add;
        pair_add = (blockIdx.x << 16) | (b0 + j);
      }
    }
  }
  note_mismatch(mul, bad_mul, pair_mul);
  note_mismatch(add, bad_add, pair_add);
}

std::string describe(const char* what, const Mismatches& m, bool has_pair = true) {
  std::string s = std::string(what) + ": " + std::to_string(m.count) + " mismatches";
  if (has_pair && m.count > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " (e.g. 0x%04x, 0x%04x)", m.first >> 16, m.first & 0xffffu);
    s += buf;
  }
  return s;
}

TYPED_TEST(QuantBlendMath16, EveryCodeMatchesTheDivision) {
  QBL_REQUIRE_GPU();
  qbl_test::DeviceArray<Mismatches> d(1);
  QBL_ASSERT_CUDA(cudaMemset(d.get(), 0, sizeof(Mismatches)));
  QBL_ASSERT_CUDA(cudaMemset(&d.get()->first, 0xff, sizeof(unsigned)));
  every_code<TypeParam><<<65536, 256>>>(d.get());
  QBL_ASSERT_CUDA(cudaGetLastError());
  Mismatches m{};
  QBL_ASSERT_CUDA(cudaMemcpy(&m, d.get(), sizeof m, cudaMemcpyDeviceToHost));
  EXPECT_EQ(m.count, 0u) << describe("code (scale, x)", m);
}

TYPED_TEST(QuantBlendMath16, EveryPackedProductAndSumRoundsLikeEager) {
  QBL_REQUIRE_GPU();
  qbl_test::DeviceArray<Mismatches> d(2);
  QBL_ASSERT_CUDA(cudaMemset(d.get(), 0, 2 * sizeof(Mismatches)));
  QBL_ASSERT_CUDA(cudaMemset(&d.get(0)->first, 0xff, sizeof(unsigned)));
  QBL_ASSERT_CUDA(cudaMemset(&d.get(1)->first, 0xff, sizeof(unsigned)));
  every_product_and_sum<TypeParam><<<65536, 256>>>(d.get(0), d.get(1));
  QBL_ASSERT_CUDA(cudaGetLastError());
  Mismatches m[2]{};
  QBL_ASSERT_CUDA(cudaMemcpy(m, d.get(), sizeof m, cudaMemcpyDeviceToHost));
  EXPECT_EQ(m[0].count, 0u) << describe("product (a, b)", m[0]);
  EXPECT_EQ(m[1].count, 0u) << describe("sum (a, b)", m[1]);
}

/// The fp32 sweep on the device: block i takes scale i of the boundary sweep.
__global__ void fp32_code_boundaries(std::uint64_t seed, int ulps, Mismatches* m,
                                     unsigned long long* n) {
  const std::uint64_t r = mix(seed + blockIdx.x);
  const float amax =
      ldexpf(1.0f + static_cast<float>(r >> 41) * 0x1p-23f, static_cast<int>(r % 220) - 110);
  const float s = qbl::scale_from_amax(amax), y = code_reciprocal(s);
  unsigned long long bad = 0, count = 0;
  unsigned pair = 0;
  const int per_k = 2 * ulps + 1;
  for (int i = threadIdx.x; i < 257 * per_k; i += blockDim.x) {
    const int k = i / per_k - 128, d = i % per_k - ulps;
    const float x = __uint_as_float(__float_as_uint((static_cast<float>(k) + 0.5f) * s) + d);
    ++count;
    if (!same(quant_code(x, s, y), reference_code<float>(x, s))) {
      ++bad;
      pair = blockIdx.x;
    }
  }
  note_mismatch(m, bad, pair);
  atomicAdd(n, count);
}

/// Random bit patterns for x and the scale, half the scales made from an amax near |x|.
__global__ void fp32_code_random(std::uint64_t seed, std::uint64_t cases, Mismatches* m) {
  unsigned long long bad = 0;
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
       i < cases; i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix(seed ^ i);
    const float x = __uint_as_float(static_cast<std::uint32_t>(r));
    float s = __uint_as_float(static_cast<std::uint32_t>(r >> 32));
    if (i % 2 == 0)
      s = qbl::scale_from_amax(fabsf(x) * (1.0f + static_cast<float>(r % 64) / 32.0f));
    if (!same(quant_code(x, s, code_reciprocal(s)), reference_code<float>(x, s))) ++bad;
  }
  note_mismatch(m, bad, 0);
}

TEST(QuantBlendMathDevice, Fp32CodeMatchesTheDivisionAtEveryBoundary) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  qbl_test::DeviceArray<Mismatches> d(2);
  qbl_test::DeviceArray<unsigned long long> n(1);
  QBL_ASSERT_CUDA(cudaMemset(d.get(), 0, 2 * sizeof(Mismatches)));
  QBL_ASSERT_CUDA(cudaMemset(n.get(), 0, sizeof(unsigned long long)));
  constexpr int scales = 1 << 16, ulps = 64;
  constexpr std::uint64_t random_cases = std::uint64_t{1} << 32;
  fp32_code_boundaries<<<scales, 256>>>(seed, ulps, d.get(0), n.get());
  fp32_code_random<<<132 * 16, 256>>>(seed, random_cases, d.get(1));
  QBL_ASSERT_CUDA(cudaGetLastError());
  Mismatches m[2]{};
  unsigned long long count = 0;
  QBL_ASSERT_CUDA(cudaMemcpy(m, d.get(), sizeof m, cudaMemcpyDeviceToHost));
  QBL_ASSERT_CUDA(cudaMemcpy(&count, n.get(), sizeof count, cudaMemcpyDeviceToHost));
  EXPECT_EQ(count, std::uint64_t{scales} * 257 * (2 * ulps + 1));
  EXPECT_EQ(m[0].count, 0u) << describe("boundary sweep (first bad scale index in the low bits)",
                                        m[0]);
  EXPECT_EQ(m[1].count, 0u) << describe("random x and scale", m[1], false);
}

}  // namespace

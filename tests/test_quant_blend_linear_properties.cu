// qbl/quant_blend_linear.cuh against a reference written independently of the library
// (tests/property_cases.hpp): a table of non-finite and edge inputs with eager's answers, and a
// randomized property test over dtype, sizes, alignment, bias and special values.
//
// QBL_PROPERTY_CASES (default 1000) and QBL_PROPERTY_SEED (default: fresh) control the random
// run; a failure prints the seed and the case, and the same seed replays it.
#include <qbl/quant_blend_linear.cuh>

#include "property_cases.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"
#include "tolerance.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl_test::bits;
using qbl_test::DType;
using qbl_test::PropertyCase;
using qbl_test::PropertyData;
using qbl_test::Special;

/// What one forward produced, widened to float.
struct Outcome {
  bool cublaslt = true;  ///< false: the GEMM ran on the fallback kernel
  std::vector<float> mixed, out, alpha;
  float amax = 0.0f, scale = 0.0f;
};

/// Runs one case through QuantBlendLinear<T> with the case's offsets; `out` was poisoned first.
template <typename T>
Outcome run_case(const PropertyCase& c, const PropertyData& d) {
  Outcome r;
  const std::size_t xo = c.x_offset, go = c.gemm_offset;
  qbl_test::DeviceArray<T> dx(d.x.size() + xo), dl(d.logits.size() + xo), dw(d.w.size() + go),
      db(d.b.size() + go), dout(static_cast<std::size_t>(c.tokens * c.out) + go);
  qbl_test::DeviceArray<float> dalpha(d.logits.size());
  EXPECT_TRUE(dx.ok() && dl.ok() && dw.ok() && db.ok() && dout.ok() && dalpha.ok());
  EXPECT_EQ(qbl_test::to_device(dx.get(xo), qbl_test::convert<T>(d.x)), cudaSuccess);
  EXPECT_EQ(qbl_test::to_device(dl.get(xo), qbl_test::convert<T>(d.logits)), cudaSuccess);
  EXPECT_EQ(qbl_test::to_device(dw.get(go), qbl_test::convert<T>(d.w)), cudaSuccess);
  EXPECT_EQ(qbl_test::to_device(db.get(go), qbl_test::convert<T>(d.b)), cudaSuccess);
  EXPECT_EQ(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(T)), cudaSuccess);
  qbl::Options o;
  o.allow_tf32 = c.dtype == DType::tf32;
  qbl::QuantBlendLinear<T> layer(c.in, c.out, c.max_tokens, o);
  const T* bias = c.bias ? db.get(go) : nullptr;
  std::vector<T> raw_out(static_cast<std::size_t>(c.tokens * c.out));
  layer.forward(dx.get(xo), dl.get(xo), dw.get(go), bias, dout.get(go), c.tokens);
  typename qbl::QuantBlendLinear<T>::ForwardArgs args;
  args.weight = dw.get(go), args.bias = bias, args.out = dout.get(go), args.tokens = c.tokens;
  r.cublaslt = layer.uses_cublaslt(args);
  qbl_test::device_sigmoid_t<T>
      <<<static_cast<unsigned>((c.tokens + 255) / 256), 256>>>(dl.get(xo), dalpha.get(), c.tokens);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<T> raw_mixed(d.x.size());
  r.alpha.resize(d.logits.size());
  EXPECT_EQ(qbl_test::to_host(raw_mixed, layer.device_mixed()), cudaSuccess);
  EXPECT_EQ(qbl_test::to_host(raw_out, dout.get(go)), cudaSuccess);
  EXPECT_EQ(qbl_test::to_host(r.alpha, dalpha.get()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&r.amax, layer.device_amax(), sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&r.scale, layer.device_scale(), sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  // An element still all 0xff bytes was never written (no kernel produces that NaN pattern).
  for (std::size_t i = 0; i < raw_out.size(); ++i) {
    const auto* e = reinterpret_cast<const unsigned char*>(&raw_out[i]);
    if (std::all_of(e, e + sizeof(T), [](unsigned char b) { return b == qbl_test::poison_byte; })) {
      ADD_FAILURE() << "out element " << i << " unwritten";
      break;
    }
  }
  r.mixed = qbl_test::widen(raw_mixed);
  r.out = qbl_test::widen(raw_out);
  return r;
}

Outcome run_case(const PropertyCase& c, const PropertyData& d) {
  switch (c.dtype) {
    case DType::fp32:
    case DType::tf32:
      return run_case<float>(c, d);
    case DType::bf16:
      return run_case<__nv_bfloat16>(c, d);
    case DType::fp16:
      return run_case<__half>(c, d);
  }
  return {};
}

/// The reference's mixed for the case (tests/reference.hpp), with alpha as the device computed it
/// (eager's expf).
std::vector<float> reference_mixed(const PropertyCase& c, const PropertyData& d,
                                   const std::vector<float>& alpha, float* amax, float* scale) {
  return qbl_test::reference_mixed(c.dtype, d.x, alpha, c.tokens, c.in, amax, scale);
}

/// out must be NaN exactly where the float64 product of the reference mixed is, and every other
/// element within the GEMM's bound derived from its arithmetic (tests/tolerance.hpp): the same
/// bound for every seed, so the property test cannot fail at random.
::testing::AssertionResult out_matches(const PropertyCase& c, const PropertyData& d,
                                       const std::vector<float>& mixed,
                                       const std::vector<float>& out) {
  return qbl_test::within_dot_bounds(
      qbl_test::GemmArithmetic::of(c.dtype), c.in + (c.bias ? 1 : 0), out,
      qbl_test::linear_values(mixed, d.w, c.bias ? d.b.data() : nullptr, c.tokens, c.in, c.out),
      "out", qbl_test::max_finite(c.dtype));
}

// ---- non-finite and edge inputs: eager's answers, per dtype -----------------------------------

struct EdgeCase {
  const char* name;
  std::function<void(PropertyData&)> edit;
  std::function<void(const PropertyCase&, const PropertyData&, const Outcome&)> expect;
};

using qbl_test::dtype_of;

template <typename T>
class NonFiniteTable : public ::testing::Test {};
TYPED_TEST_SUITE(NonFiniteTable, qbl_test::AllTypes, qbl_test::AllTypeNames);

TYPED_TEST(NonFiniteTable, EachCaseGivesEagersAnswer) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  PropertyCase c;
  c.dtype = dtype_of<T>();
  c.tokens = 37;
  c.in = 96;
  c.out = 24;
  c.max_tokens = 64;
  c.data_seed = seed;
  constexpr std::int64_t row = 11;
  const float inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  const bool fp16 = std::is_same_v<T, __half>;
  auto all_nan = [](const PropertyCase&, const PropertyData&, const Outcome& r) {
    for (float v : r.mixed) ASSERT_TRUE(std::isnan(v));
    for (float v : r.out) ASSERT_TRUE(std::isnan(v));
  };
  auto row_nan_only = [](const PropertyCase& k, const PropertyData&, const Outcome& r) {
    for (std::int64_t t = 0; t < k.tokens; ++t)
      for (std::int64_t o = 0; o < k.out; ++o)
        ASSERT_EQ(std::isnan(r.out[t * k.out + o]), t == row) << "token " << t;
  };
  const std::vector<EdgeCase> table = {
      {"NaN in x: every output NaN", [&](PropertyData& d) { d.x[5 * 96 + 7] = nan; }, all_nan},
      {"+Inf in x: every output NaN (inf scale, 0 * inf)", [&](PropertyData& d) { d.x[3] = inf; },
       all_nan},
      {"-Inf in x: every output NaN", [&](PropertyData& d) { d.x[36 * 96 + 95] = -inf; }, all_nan},
      {"NaN logit: its row NaN, the others finite", [&](PropertyData& d) { d.logits[row] = nan; },
       row_nan_only},
      {"+Inf logit: alpha 1, its row of mixed is x_q",
       [&](PropertyData& d) { d.logits[row] = inf; },
       [](const PropertyCase& k, const PropertyData& d, const Outcome& r) {
         const float s = qbl_test::reference_scale(k.dtype, qbl_test::reference_amax(d.x));
         for (std::int64_t i = 0; i < k.in; ++i) {
           const float x = d.x[row * k.in + i];
           float q = std::nearbyint(qbl_test::ref_round(k.dtype, x / s));
           q = std::min(127.0f, std::max(-127.0f, q));
           ASSERT_EQ(bits(r.mixed[row * k.in + i]), bits(qbl_test::ref_round(k.dtype, q * s))) << i;
         }
       }},
      {"-Inf logit: alpha 0, its row of mixed is x", [&](PropertyData& d) { d.logits[row] = -inf; },
       [](const PropertyCase& k, const PropertyData& d, const Outcome& r) {
         for (std::int64_t i = 0; i < k.in; ++i)
           ASSERT_EQ(bits(r.mixed[row * k.in + i]), bits(d.x[row * k.in + i])) << i;
       }},
      {fp16 ? "all-zero x: fp16's clamp bound rounds to 0, so 0 / 0: every output NaN"
            : "all-zero x: mixed +0, out = bias",
       [&](PropertyData& d) { std::fill(d.x.begin(), d.x.end(), 0.0f); },
       [all_nan](const PropertyCase& k, const PropertyData& d, const Outcome& r) {
         if constexpr (std::is_same_v<T, __half>) {
           all_nan(k, d, r);
         } else {
           for (float v : r.mixed) ASSERT_EQ(bits(v), 0u);
           for (std::int64_t t = 0; t < k.tokens; ++t)
             for (std::int64_t o = 0; o < k.out; ++o) ASSERT_EQ(r.out[t * k.out + o], d.b[o]);
         }
       }},
      {fp16 ? "all -0.0 x: NaN in fp16 as above" : "all -0.0 x: mixed -0.0 everywhere",
       [&](PropertyData& d) { std::fill(d.x.begin(), d.x.end(), -0.0f); },
       [all_nan](const PropertyCase& k, const PropertyData& d, const Outcome& r) {
         if constexpr (std::is_same_v<T, __half>) {
           all_nan(k, d, r);
         } else {
           for (float v : r.mixed) ASSERT_EQ(bits(v), 0x80000000u);
         }
       }},
      {"-0.0 among normal values: mixed -0.0 there",
       [&](PropertyData& d) {
         for (std::size_t i = 0; i < d.x.size(); i += 5) d.x[i] = -0.0f;
       },
       [](const PropertyCase&, const PropertyData& d, const Outcome& r) {
         for (std::size_t i = 0; i < d.x.size(); i += 5)
           ASSERT_EQ(bits(r.mixed[i]), 0x80000000u) << i;
       }},
      {"denormal x: kept, not flushed to zero",
       [&](PropertyData& d) {
         for (auto& v : d.x) v = qbl_test::ref_round(dtype_of<T>(), v * (fp16 ? 1e-5f : 1e-39f));
       },
       [](const PropertyCase&, const PropertyData& d, const Outcome& r) {
         std::size_t nonzero = 0;
         for (std::size_t i = 0; i < d.x.size(); ++i) nonzero += r.mixed[i] != 0.0f;
         ASSERT_GT(nonzero, d.x.size() / 2);
       }},
  };
  for (const EdgeCase& e : table) {
    SCOPED_TRACE(e.name);
    PropertyData d = qbl_test::make_property_data(c);
    e.edit(d);
    const Outcome r = run_case<T>(c, d);
    float amax = 0.0f, scale = 0.0f;
    const auto want = reference_mixed(c, d, r.alpha, &amax, &scale);
    // Every case also matches the reference everywhere, NaN for NaN, bit for bit otherwise.
    EXPECT_TRUE(qbl_test::bits_equal(r.mixed, want, static_cast<std::size_t>(c.in)));
    EXPECT_TRUE(bits(r.amax) == bits(amax) || (std::isnan(r.amax) && std::isnan(amax)));
    EXPECT_TRUE(bits(r.scale) == bits(scale) || (std::isnan(r.scale) && std::isnan(scale)));
    e.expect(c, d, r);
  }
}

// ---- randomized property test ----------------------------------------------------------------

TEST(QuantBlendLinearProperty, RandomCasesMatchTheIndependentReference) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::env_u64("QBL_PROPERTY_SEED", qbl_test::fresh_seed());
  const int cases = static_cast<int>(qbl_test::env_u64("QBL_PROPERTY_CASES", 1000));
  std::printf("[ property ] %d cases, seed %llu (replay: QBL_PROPERTY_SEED=%llu)\n", cases,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  int ran = 0, fallback = 0, failed = 0;
  int per_type[4] = {};
  for (int i = 0; i < cases && failed < 5; ++i) {
    const PropertyCase c = qbl_test::make_property_case(seed, i);
    SCOPED_TRACE("QBL_PROPERTY_SEED=" + std::to_string(seed) + " case " + std::to_string(i) + ": " +
                 c.describe());
    const PropertyData d = qbl_test::make_property_data(c);
    const Outcome r = run_case(c, d);
    ++ran;
    fallback += !r.cublaslt;
    ++per_type[static_cast<int>(c.dtype)];
    float amax = 0.0f, scale = 0.0f;
    const auto want = reference_mixed(c, d, r.alpha, &amax, &scale);
    const auto mixed_ok = qbl_test::bits_equal(r.mixed, want, static_cast<std::size_t>(c.in));
    const bool stats_ok =
        (bits(r.amax) == bits(amax) || (std::isnan(r.amax) && std::isnan(amax))) &&
        (bits(r.scale) == bits(scale) || (std::isnan(r.scale) && std::isnan(scale)));
    const auto out_ok = out_matches(c, d, want, r.out);
    EXPECT_TRUE(mixed_ok);
    EXPECT_TRUE(stats_ok) << "amax " << r.amax << " vs " << amax << ", scale " << r.scale << " vs "
                          << scale;
    EXPECT_TRUE(out_ok);
    failed += !(mixed_ok && stats_ok && out_ok) || ::testing::Test::HasFatalFailure();
  }
  std::printf(
      "[ property ] ran %d (fp32 %d, tf32 %d, bf16 %d, fp16 %d), GEMM on the fallback kernel "
      "in %d, failed %d\n",
      ran, per_type[0], per_type[1], per_type[2], per_type[3], fallback, failed);
  EXPECT_EQ(ran, cases) << "stopped after 5 failing cases";
}

// The first cases of a fixed seed on the CPU: the library's host element math against the
// independent reference (alpha drawn directly: the host's expf is not the device's).
TEST(QuantBlendLinearProperty, FixedSliceOnTheHostElementMath) {
  constexpr std::uint64_t seed = 20261202;
  for (int i = 0; i < 48; ++i) {
    const PropertyCase c = qbl_test::make_property_case(seed, i);
    SCOPED_TRACE("case " + std::to_string(i) + ": " + c.describe());
    const PropertyData d = qbl_test::make_property_data(c);
    std::mt19937 gen(static_cast<unsigned>(i));
    std::vector<float> alpha(d.logits.size());
    for (auto& a : alpha)
      a = qbl_test::ref_round(c.dtype, std::uniform_real_distribution<float>(0.0f, 1.0f)(gen));
    if (c.special == Special::inf_logits) alpha.front() = 1.0f, alpha.back() = 0.0f;
    float amax = 0.0f, scale = 0.0f;
    const auto want = reference_mixed(c, d, alpha, &amax, &scale);
    float lib_scale = 0.0f;
    std::vector<float> got(d.x.size());
    switch (c.dtype) {
      case DType::fp32:
      case DType::tf32:
        lib_scale = qbl::scale_from_amax<float>(amax);
        break;
      case DType::bf16:
        lib_scale = qbl::scale_from_amax<__nv_bfloat16>(amax);
        break;
      case DType::fp16:
        lib_scale = qbl::scale_from_amax<__half>(amax);
        break;
    }
    ASSERT_TRUE(bits(lib_scale) == bits(scale) || (std::isnan(lib_scale) && std::isnan(scale)));
    for (std::int64_t t = 0; t < c.tokens; ++t) {
      for (std::int64_t k = 0; k < c.in; ++k) {
        const float x = d.x[t * c.in + k];
        float& m = got[t * c.in + k];
        switch (c.dtype) {
          case DType::fp32:
          case DType::tf32:
            m = qbl::quant_blend_value<float>(x, alpha[t], scale);
            break;
          case DType::bf16:
            m = qbl::quant_blend_value<__nv_bfloat16>(x, alpha[t], scale);
            break;
          case DType::fp16:
            m = qbl::quant_blend_value<__half>(x, alpha[t], scale);
            break;
        }
      }
    }
    ASSERT_TRUE(qbl_test::bits_equal(got, want, static_cast<std::size_t>(c.in)));
  }
}

}  // namespace

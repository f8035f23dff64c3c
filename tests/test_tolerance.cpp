// tests/tolerance.hpp on the CPU: the GEMM bounds hold for fp32 dot products computed in every
// order a GEMM may use (in order, reversed, pairwise, split-K, with fused multiply-adds,
// truncating), for every seed drawn here -- cancellation included -- and they are not vacuous:
// the mistakes a GEMM can make (a term lost, a wrong sign, the bias left out, another operand)
// fall outside them.
#include "tolerance.hpp"

#include "test_support.hpp"

#include <cfenv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

using qbl_test::DotValue;
using qbl_test::DType;
using qbl_test::GemmArithmetic;

/// a . b in fp32, as a GEMM may compute it.
enum class Order { forward, reverse, pairwise, split8, fma, truncating };

float fp32_dot(const std::vector<float>& a, const std::vector<float>& b, Order order) {
  const std::size_t n = a.size();
  std::vector<float> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = a[i] * b[i];
  switch (order) {
    case Order::forward:
      return std::accumulate(p.begin(), p.end(), 0.0f);
    case Order::reverse:
      return std::accumulate(p.rbegin(), p.rend(), 0.0f);
    case Order::pairwise: {
      while (p.size() > 1) {
        std::vector<float> h((p.size() + 1) / 2);
        for (std::size_t i = 0; i < h.size(); ++i)
          h[i] = 2 * i + 1 < p.size() ? p[2 * i] + p[2 * i + 1] : p[2 * i];
        p.swap(h);
      }
      return p.empty() ? 0.0f : p[0];
    }
    case Order::split8: {  // split-K: eight partial sums of strided slices, then their sum
      float part[8] = {};
      for (std::size_t i = 0; i < n; ++i) part[i % 8] += p[i];
      float s = 0.0f;
      for (float v : part) s += v;
      return s;
    }
    case Order::fma: {
      float s = 0.0f;
      for (std::size_t i = 0; i < n; ++i) s = std::fma(a[i], b[i], s);
      return s;
    }
    case Order::truncating: {  // every product and sum rounded toward zero
      const int old = std::fegetround();
      std::fesetround(FE_TOWARDZERO);
      volatile float s = 0.0f;
      for (std::size_t i = 0; i < n; ++i) {
        volatile float q = a[i] * b[i];
        s = s + q;
      }
      std::fesetround(old);
      return s;
    }
  }
  return 0.0f;
}

DotValue exact_dot(const std::vector<float>& a, const std::vector<float>& b) {
  DotValue v;
  for (std::size_t i = 0; i < a.size(); ++i) v.add(a[i], b[i]);
  return v;
}

// Every order, every seed here, fp32 and with the result rounded to bf16 / fp16 (through the
// tests' own rounding): inside the bound. Rows near cancellation are what broke a fixed relative
// bound (the 187-term case of the backward's property test): they are drawn on purpose.
TEST(Tolerance, DotProductsOfEveryOrderStayInsideTheBound) {
  int checked = 0;
  double worst_ratio = 0.0;
  for (std::int64_t k : {1, 2, 7, 65, 187, 1000, 4096}) {
    for (int rep = 0; rep < 200; ++rep) {
      std::mt19937_64 gen(1000003u * static_cast<std::uint64_t>(k) + static_cast<unsigned>(rep));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      const float x_std = rep % 3 == 0 ? 0.051f : 1.0f;
      std::vector<float> a(static_cast<std::size_t>(k)), b(a.size());
      for (auto& v : a) v = x_std * nd(gen);
      for (auto& v : b) v = nd(gen) / std::sqrt(static_cast<float>(k));
      if (rep % 5 == 0 && k > 1) {  // a near-cancelling row: the last term undoes the others
        const DotValue head = exact_dot(std::vector<float>(a.begin(), a.end() - 1),
                                        std::vector<float>(b.begin(), b.end() - 1));
        b.back() = 1.0f;
        a.back() = static_cast<float>(-head.exact);
      }
      const DotValue w = exact_dot(a, b);
      for (Order o : {Order::forward, Order::reverse, Order::pairwise, Order::split8, Order::fma,
                      Order::truncating}) {
        const float got = fp32_dot(a, b, o);
        for (DType t : {DType::fp32, DType::bf16, DType::fp16}) {
          // Truncation models the tensor cores' accumulation, for which the 16-bit bounds allow
          // u = 2^-22; the fp32 GEMM runs IEEE round-to-nearest arithmetic.
          if (o == Order::truncating && t == DType::fp32) continue;
          GemmArithmetic ar = GemmArithmetic::of(t);
          const float out = qbl_test::ref_round(t, got);
          const double err = std::fabs(static_cast<double>(out) - w.exact);
          const double bound = qbl_test::dot_bound(ar, k, w);
          ASSERT_LE(err, bound) << "k " << k << " rep " << rep << " order " << static_cast<int>(o)
                                << " type " << qbl_test::dtype_name(t);
          if (t == DType::fp32 && bound > 0) worst_ratio = std::max(worst_ratio, err / bound);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 7 * 200 * (6 * 3 - 1));
  // The bound is a worst case, but not a vacuous one: somewhere the error comes within a few
  // per cent of it.
  EXPECT_GT(worst_ratio, 0.01);
  std::printf("[ tolerance ] %d dot products inside the bound; largest fp32 error / bound %.3f\n",
              checked, worst_ratio);
}

// The near-cancelling rows above make a fixed relative bound fail where the element-wise one
// holds: such a bound (1.5 x one rounding + 2e-5, relative) is what a seed once broke.
TEST(Tolerance, CancellationBreaksAFixedRelativeBoundButNotTheDerivedOne) {
  int fixed_failed = 0, derived_failed = 0;
  for (int rep = 0; rep < 200; ++rep) {
    std::mt19937_64 gen(777u + static_cast<unsigned>(rep));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const std::int64_t k = 187;
    std::vector<float> a(k), b(k);
    for (auto& v : a) v = 0.051f * nd(gen);
    for (auto& v : b) v = nd(gen);
    const DotValue head = exact_dot(std::vector<float>(a.begin(), a.end() - 1),
                                    std::vector<float>(b.begin(), b.end() - 1));
    b.back() = 1.0f;
    a.back() = static_cast<float>(-head.exact * (1.0 - 1e-4));  // leaves 1e-4 of the sum
    const DotValue w = exact_dot(a, b);
    const float got = fp32_dot(a, b, Order::forward);
    const double err = std::fabs(got - w.exact);
    const double best = std::fabs(static_cast<float>(w.exact) - w.exact);
    fixed_failed += err / std::fabs(w.exact) > 1.5 * best / std::fabs(w.exact) + 2e-5;
    derived_failed += err > qbl_test::dot_bound(GemmArithmetic::of(DType::fp32), k, w);
  }
  EXPECT_GT(fixed_failed, 0) << "cancellation should defeat a fixed relative bound";
  EXPECT_EQ(derived_failed, 0);
}

// Not vacuous: a GEMM's plausible mistakes move an element out of the bound for nearly every row
// -- the fp32 bound (and the 16-bit ones for every mistake but a single lost or flipped term,
// which is 1/k of the sum and sits inside one rounding of a bf16 accumulator).
TEST(Tolerance, TheBoundRejectsWrongProducts) {
  for (DType t : {DType::fp32, DType::bf16}) {
    int rows = 0, dropped = 0, flipped = 0, no_bias = 0, other_operand = 0;
    const GemmArithmetic ar = GemmArithmetic::of(t);
    for (std::int64_t k : {16, 256, 4096}) {
      for (int rep = 0; rep < 100; ++rep, ++rows) {
        std::mt19937_64 gen(31u * static_cast<std::uint64_t>(k) + static_cast<unsigned>(rep));
        std::normal_distribution<float> nd(0.0f, 1.0f);
        std::vector<float> a(static_cast<std::size_t>(k)), b(a.size());
        for (auto& v : a) v = nd(gen);
        for (auto& v : b) v = nd(gen) / std::sqrt(static_cast<float>(k));
        const float bias = nd(gen);
        DotValue w = exact_dot(a, b);
        w.add_extra(bias);
        const double bound = qbl_test::dot_bound(ar, k + 1, w);
        auto outside = [&](double v) { return std::fabs(v - w.exact) > bound; };
        const std::size_t j = static_cast<std::size_t>(rep) % a.size();
        dropped += outside(w.exact - static_cast<double>(a[j]) * b[j]);
        flipped += outside(w.exact - 2.0 * static_cast<double>(a[j]) * b[j]);
        no_bias += outside(w.exact - bias);
        std::vector<float> a2 = a;
        std::shuffle(a2.begin(), a2.end(), gen);  // another row of the operand
        other_operand += outside(exact_dot(a2, b).exact + bias);
      }
    }
    EXPECT_GE(no_bias, rows * 9 / 10) << qbl_test::dtype_name(t);
    EXPECT_GE(other_operand, rows * 9 / 10) << qbl_test::dtype_name(t);
    if (t == DType::fp32) {
      EXPECT_GE(flipped, rows * 3 / 4);
      EXPECT_GE(dropped, rows * 2 / 3);
    }
    std::printf(
        "[ tolerance %s ] of %d rows, outside the bound: a term dropped %d, a sign "
        "flipped %d, the bias left out %d, another operand row %d\n",
        qbl_test::dtype_name(t), rows, dropped, flipped, no_bias, other_operand);
  }
}

// within_dot_bounds: NaN exactly where the value is NaN, infinities only past the largest finite
// value, the first failures reported.
TEST(Tolerance, ElementChecksHandleNonFiniteValues) {
  const GemmArithmetic ar = GemmArithmetic::of(DType::fp16);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<DotValue> w = {{1.0, 1.0}, {nan, 1.0}, {70000.0, 70000.0}, {2.0, 2.0}};
  EXPECT_TRUE(qbl_test::within_dot_bounds(ar, 1, {1.0f, nan, inf, 2.0f}, w, "v", 65504.0));
  EXPECT_FALSE(qbl_test::within_dot_bounds(ar, 1, {nan, nan, inf, 2.0f}, w, "v", 65504.0));
  EXPECT_FALSE(qbl_test::within_dot_bounds(ar, 1, {1.0f, 1.0f, inf, 2.0f}, w, "v", 65504.0));
  EXPECT_FALSE(qbl_test::within_dot_bounds(ar, 1, {1.0f, nan, inf, inf}, w, "v", 65504.0));
  EXPECT_FALSE(qbl_test::within_dot_bounds(ar, 1, {1.0f, nan, inf, 2.1f}, w, "v", 65504.0));
  // Accumulated bias gradients: RN(old + RN(sum)) within the two roundings' bound.
  const std::vector<DotValue> sums = {{3.0, 5.0}};
  const float old = 0.25f;
  EXPECT_TRUE(qbl_test::bias_grad_within_bounds(DType::bf16, 4, {3.25f}, sums, &old, "b"));
  EXPECT_FALSE(qbl_test::bias_grad_within_bounds(DType::bf16, 4, {3.0f}, sums, &old, "b"));
}

}  // namespace

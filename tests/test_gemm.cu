// qbl/gemm.cuh: the GEMM plan -- cuBLASLt, and the fallback kernel where cuBLASLt has no
// algorithm -- against float64 CPU products.
#include <qbl/gemm.cuh>

#include "test_support.hpp"

#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using qbl::GemmPlan;
using qbl::GemmSpec;

TEST(GemmPlan, RejectsBadSizesBeforeTouchingCuda) {
  EXPECT_THROW(GemmPlan<float>(GemmSpec::linear_forward(0, 4), 4), qbl::invalid_argument);
  EXPECT_THROW(GemmPlan<float>(GemmSpec::linear_forward(4, -1), 4), qbl::invalid_argument);
  EXPECT_THROW(GemmPlan<float>(GemmSpec::linear_forward(4, 4), 0), qbl::invalid_argument);
}

TEST(GemmPlan, BucketsCoverEveryTokenCount) {
  QBL_REQUIRE_GPU();
  GemmPlan<float> g(GemmSpec::linear_forward(8, 8), 2049);
  const auto& b = g.buckets();
  ASSERT_FALSE(b.empty());
  EXPECT_EQ(b.front(), 1);
  EXPECT_EQ(b.back(), 2049);
  for (std::size_t i = 1; i < b.size(); ++i) EXPECT_LT(b[i - 1], b[i]);
}

struct GemmCase {
  std::int64_t tokens, in, out;
  bool bias;
  std::size_t offset;  // element offset of w, out and bias
};

void PrintTo(const GemmCase& c, std::ostream* os) {
  *os << "tokens=" << c.tokens << " in=" << c.in << " out=" << c.out << " bias=" << c.bias
      << " offset=" << c.offset;
}

class ForwardGemmDevice : public ::testing::TestWithParam<GemmCase> {};

TEST_P(ForwardGemmDevice, MatchesFloat64) {
  QBL_REQUIRE_GPU();
  const auto [tokens, in, out, has_bias, off] = GetParam();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t max_tokens = 2049;
  auto a = qbl_test::randn(static_cast<std::size_t>(tokens * in), seed);
  auto w = qbl_test::randn(static_cast<std::size_t>(out * in), seed + 1, 0.05f);
  auto b = qbl_test::randn(static_cast<std::size_t>(out), seed + 2);
  qbl_test::DeviceArray<float> da(a.size()), dw(w.size() + off), db(b.size() + off),
      dout(static_cast<std::size_t>(tokens * out) + off);
  QBL_ASSERT_CUDA(qbl_test::to_device(da.get(), a));
  QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), w));
  QBL_ASSERT_CUDA(qbl_test::to_device(db.get(off), b));
  QBL_ASSERT_CUDA(
      cudaMemset(dout.get(), qbl_test::poison_byte, (tokens * out + off) * sizeof(float)));

  GemmPlan<float> gemm(GemmSpec::linear_forward(in, out), max_tokens);
  qbl_test::DeviceArray<unsigned char> ws(gemm.workspace_bytes());
  gemm.run(dw.get(off), da.get(), dout.get(off), has_bias ? db.get(off) : nullptr, tokens, 0.0f,
           ws.get(), nullptr);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(static_cast<std::size_t>(tokens * out));
  QBL_ASSERT_CUDA(qbl_test::to_host(got, dout.get(off)));
  const auto want =
      qbl_test::linear_reference(a, w, has_bias ? b.data() : nullptr, tokens, in, out);
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << "element " << i << " unwritten or NaN";
  }
  EXPECT_LT(qbl_test::relative_error(got, want), 1e-5);
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> c;
  for (std::int64_t t : {1, 3, 7, 65, 217, 2047, 2049}) {
    c.push_back({t, 256, 256, true, 0});
    c.push_back({t, 96, 40, false, 0});
  }
  c.push_back({65, 217, 65, true, 1});
  c.push_back({300, 128, 64, true, 4});  // 16-byte but not 256-byte aligned
  c.push_back({2049, 64, 128, true, 1});
  c.push_back({100, 7, 3, true, 0});
  c.push_back({5, 1, 1, false, 1});
  return c;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ForwardGemmDevice, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& i) {
                           return "t" + std::to_string(i.param.tokens) + "_in" +
                                  std::to_string(i.param.in) + "_out" +
                                  std::to_string(i.param.out) +
                                  (i.param.bias ? "_bias" : "_nobias") + "_off" +
                                  std::to_string(i.param.offset);
                         });

// The selection rule alone (CPU): cuBLASLt's first choice stays unless a later candidate is 10 %
// faster than the best so far; a failed candidate (+inf) never wins.
TEST(GemmPlan, AutotuneKeepsTheFirstChoiceUnlessTenPercentFaster) {
  const float inf = std::numeric_limits<float>::infinity();
  using V = std::vector<float>;
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f}), 0u);
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, 0.95f}), 0u);         // 5 % faster: not enough
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, 0.85f}), 1u);         // 15 % faster
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, 0.85f, 0.80f}), 1u);  // not 10 % below 0.85
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, 0.85f, 0.70f}), 2u);
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, inf, 0.5f}), 2u);
  EXPECT_EQ(qbl::detail::pick_fastest(V{inf, 2.0f}), 1u);  // the first failed to run
  EXPECT_EQ(qbl::detail::pick_fastest(V{1.0f, 1.2f, 0.95f}), 0u);
}

// On the GPU: a record per bucket and bias case whose numbers are consistent with the rule above,
// and the tuned product is still the right product at every bucket's top token count.
TEST(ForwardGemmDevice, AutotuneRecordsEveryBucketAndComputesTheProduct) {
  QBL_REQUIRE_GPU();
  qbl::Options o;
  o.autotune = true;
  const std::int64_t in = 256, out = 128, max_tokens = 1000;
  GemmPlan<float> tuned(GemmSpec::linear_forward(in, out), max_tokens, o);
  ASSERT_EQ(tuned.tuning().size(), 2 * tuned.buckets().size());
  for (const auto& r : tuned.tuning()) {
    EXPECT_GE(r.candidates, 1);
    EXPECT_GE(r.chosen, 0);
    EXPECT_GT(r.first_ms, 0.0f);
    EXPECT_LT(r.first_ms, std::numeric_limits<float>::infinity()) << "first choice failed to run";
    if (r.chosen != 0) {
      EXPECT_LT(r.chosen_ms, 0.9f * r.first_ms) << "tokens " << r.tokens;
    } else {
      EXPECT_EQ(r.chosen_ms, r.first_ms);
    }
  }
  EXPECT_NE(tuned.describe(max_tokens, true).find("algo "), std::string::npos);
  EXPECT_EQ(tuned.describe(max_tokens + 1, true), "none");
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto a = qbl_test::randn(static_cast<std::size_t>(max_tokens * in), seed);
  const auto w = qbl_test::randn(static_cast<std::size_t>(out * in), seed + 1, 0.1f);
  const auto b = qbl_test::randn(static_cast<std::size_t>(out), seed + 2);
  qbl_test::DeviceArray<float> da(a.size()), dw(w.size()), db(b.size()),
      dout(static_cast<std::size_t>(max_tokens * out));
  qbl_test::DeviceArray<unsigned char> ws(tuned.workspace_bytes());
  QBL_ASSERT_CUDA(qbl_test::to_device(da.get(), a));
  QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(), w));
  QBL_ASSERT_CUDA(qbl_test::to_device(db.get(), b));
  for (const std::int64_t tokens : tuned.buckets()) {
    tuned.run(dw.get(), da.get(), dout.get(), db.get(), tokens, 0.0f, ws.get());
    std::vector<float> got(static_cast<std::size_t>(tokens * out));
    QBL_ASSERT_CUDA(qbl_test::to_host(got, dout.get()));
    const auto want = qbl_test::linear_reference(a, w, b.data(), tokens, in, out);
    EXPECT_LT(qbl_test::relative_error(got, want), 1e-5) << "tokens " << tokens;
  }
  o.autotune = false;
  GemmPlan<float> plain(GemmSpec::linear_forward(in, out), max_tokens, o);
  EXPECT_TRUE(plain.tuning().empty());
}

// ---- every element type at every pointer alignment ------------------------------------------

template <typename T>
const char* type_name() {
  return std::is_same_v<T, float> ? "fp32" : (std::is_same_v<T, __half> ? "fp16" : "bf16");
}

template <typename T>
class ForwardGemmTyped : public ::testing::Test {};
using GemmTypes = ::testing::Types<float, __nv_bfloat16, __half>;
struct GemmTypeNames {
  template <typename T>
  static std::string GetName(int) {
    return type_name<T>();
  }
};
TYPED_TEST_SUITE(ForwardGemmTyped, GemmTypes, GemmTypeNames);

// w, bias and out start `off` elements into their allocations (alignment sizeof(T) * off, or
// 256 bytes for off == 0). uses_cublaslt(), asked before the run, says where run() goes; either
// way the product is as accurate as the exact product rounded to T allows (the fallback kernel
// accumulates in fp32 too). The table of what this cuBLASLt serves is printed.
TYPED_TEST(ForwardGemmTyped, EveryAlignmentRunsOnCublasltOrTheFallback) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t tokens = 65, in = 96, out = 40;
  const auto a = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(tokens * in, seed)));
  const auto w = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(out * in, seed + 1, 0.1f)));
  const auto b = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(out, seed + 2)));
  GemmPlan<T> gemm(GemmSpec::linear_forward(in, out), 128);
  qbl_test::DeviceArray<unsigned char> ws(gemm.workspace_bytes());
  for (const bool has_bias : {true, false}) {
    std::string table;
    for (const std::size_t off : {0, 1, 2, 4, 8}) {
      const std::size_t align = off == 0 ? 256 : sizeof(T) * (off & (~off + 1));
      SCOPED_TRACE(std::string(type_name<T>()) + " bias " + (has_bias ? "on" : "off") + " offset " +
                   std::to_string(off));
      qbl_test::DeviceArray<T> da(a.size()), dw(w.size() + off), db(b.size() + off),
          dout(static_cast<std::size_t>(tokens * out) + off);
      QBL_ASSERT_CUDA(qbl_test::to_device(da.get(), qbl_test::convert<T>(a)));
      QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), qbl_test::convert<T>(w)));
      QBL_ASSERT_CUDA(qbl_test::to_device(db.get(off), qbl_test::convert<T>(b)));
      QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(T)));
      const T* bias = has_bias ? db.get(off) : nullptr;
      const bool lt = gemm.uses_cublaslt(dw.get(off), da.get(), dout.get(off), bias, tokens);
      gemm.run(dw.get(off), da.get(), dout.get(off), bias, tokens, 0.0f, ws.get(), nullptr);
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<T> got(static_cast<std::size_t>(tokens * out));
      QBL_ASSERT_CUDA(qbl_test::to_host(got, dout.get(off)));
      table += " " + std::to_string(align) + "B:" + (lt ? "cuBLASLt" : "fallback");
      if (off == 0) {
        EXPECT_TRUE(lt) << "no algorithm for 256-byte-aligned pointers";
      }
      // The plan is fixed at construction: asking again after the run gives the same answer.
      EXPECT_EQ(lt, gemm.uses_cublaslt(dw.get(off), da.get(), dout.get(off), bias, tokens));
      const auto want =
          qbl_test::linear_reference(a, w, has_bias ? b.data() : nullptr, tokens, in, out);
      std::vector<float> rounded(want.size());
      for (std::size_t i = 0; i < want.size(); ++i) {
        rounded[i] = qbl_test::to_f(qbl_test::from_f<T>(static_cast<float>(want[i])));
      }
      const std::vector<float> gotf = qbl_test::widen(got);
      for (std::size_t i = 0; i < gotf.size(); ++i)
        ASSERT_FALSE(std::isnan(gotf[i])) << "unwritten " << i;
      // fp32: the rounding of the exact product is ~1e-8; fp32 accumulation adds ~1e-7.
      const double best = qbl_test::relative_error(rounded, want);
      EXPECT_LE(qbl_test::relative_error(gotf, want), 1.5 * best + 1e-6)
          << "best possible " << best;
    }
    std::printf("[ %s bias %s ] GEMM at alignment:%s\n", type_name<T>(), has_bias ? "on " : "off",
                table.c_str());
  }
}

// The backward's two products through GemmPlan: dgrad (NN, g_a = g · w) and wgrad (NT,
// g_w = gᵀ · a, with BGRADB's bias gradient), at several alignments, overwriting and
// accumulating (beta = 1), against float64 products of the T-valued operands, on cuBLASLt or
// the fallback kernel (and column sum) as uses_cublaslt() says; in_features == 1 takes the
// product to cuBLASLt and the bias gradient to the column sum.
template <typename T>
class GemmPlanTyped : public ::testing::Test {};
TYPED_TEST_SUITE(GemmPlanTyped, GemmTypes, GemmTypeNames);

TYPED_TEST(GemmPlanTyped, DgradAndWgradMatchFloat64) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const std::int64_t in : {48, 1}) {
    SCOPED_TRACE("in_features " + std::to_string(in));
    const std::int64_t tokens = 67, out = 40;
    const auto g = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(tokens * out, seed)));
    const auto w = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(out * in, seed + 1, 0.2f)));
    const auto a = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(tokens * in, seed + 2)));
    const auto old_w = qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(out * in, seed + 3)));
    // float64 references: dgrad[t, i] = sum_o g[t, o] w[o, i]; wgrad[o, i] = sum_t g[t, o] a[t, i];
    // bgrad[o] = sum_t g[t, o].
    std::vector<double> dgrad(tokens * in, 0.0), wgrad(out * in, 0.0), bgrad(out, 0.0);
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t o = 0; o < out; ++o) {
        const double gv = g[t * out + o];
        bgrad[o] += gv;
        for (std::int64_t i = 0; i < in; ++i) {
          dgrad[t * in + i] += gv * w[o * in + i];
          wgrad[o * in + i] += gv * a[t * in + i];
        }
      }
    // fp32: accumulation error ~1e-6; 16-bit: one rounding of T (2^-9 relative for bf16) dominates.
    const double tol = std::is_same_v<T, float> ? 1e-5 : (std::is_same_v<T, __half> ? 2e-3 : 8e-3);
    qbl::GemmPlan<T> dplan(qbl::GemmSpec::linear_dgrad(in, out), 128);
    qbl::GemmPlan<T> wplan(qbl::GemmSpec::linear_wgrad(in, out), 128);
    qbl_test::DeviceArray<unsigned char> ws(dplan.workspace_bytes());
    for (const std::size_t off : {0, 1}) {
      SCOPED_TRACE("offset " + std::to_string(off));
      qbl_test::DeviceArray<T> dg(g.size() + off), dw(w.size() + off), da(a.size() + off),
          dd(a.size() + off), dwg(w.size() + off), dbg(static_cast<std::size_t>(out) + off);
      QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(off), qbl_test::convert<T>(g)));
      QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), qbl_test::convert<T>(w)));
      QBL_ASSERT_CUDA(qbl_test::to_device(da.get(off), qbl_test::convert<T>(a)));
      auto check = [&](const T* d, std::size_t n, const std::vector<double>& want,
                       const char* what) {
        std::vector<T> got(n);
        ASSERT_EQ(qbl_test::to_host(got, d), cudaSuccess);
        const auto gotf = qbl_test::widen(got);
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_FALSE(std::isnan(gotf[i])) << what << " unwritten " << i;
        EXPECT_LT(qbl_test::relative_error(gotf, want), tol) << what;
      };
      auto untouched = [&](const T* d, std::size_t n, const char* what) {
        std::vector<unsigned char> bytes(n * sizeof(T));
        ASSERT_EQ(cudaMemcpy(bytes.data(), d, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        for (std::size_t i = 0; i < bytes.size(); ++i)
          ASSERT_EQ(bytes[i], qbl_test::poison_byte) << what << " byte " << i;
      };
      // dgrad: A = w, B = g, D = g_a.
      QBL_ASSERT_CUDA(cudaMemset(dd.get(), qbl_test::poison_byte, dd.size() * sizeof(T)));
      const bool d_lt = dplan.uses_cublaslt(dw.get(off), dg.get(off), dd.get(off), nullptr, tokens);
      dplan.run(dw.get(off), dg.get(off), dd.get(off), nullptr, tokens, 0.0f, ws.get());
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      if (off == 0 && in > 1) {
        EXPECT_TRUE(d_lt);
      }
      check(dd.get(off), a.size(), dgrad, "dgrad");
      // wgrad with the bias gradient, overwriting, then accumulating onto old_w.
      for (const float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(beta == 0.0f ? "overwrite" : "accumulate");
        QBL_ASSERT_CUDA(cudaMemset(dbg.get(), qbl_test::poison_byte, dbg.size() * sizeof(T)));
        if (beta == 0.0f) {
          QBL_ASSERT_CUDA(cudaMemset(dwg.get(), qbl_test::poison_byte, dwg.size() * sizeof(T)));
        } else {
          QBL_ASSERT_CUDA(qbl_test::to_device(dwg.get(off), qbl_test::convert<T>(old_w)));
        }
        const bool w_lt =
            wplan.uses_cublaslt(da.get(off), dg.get(off), dwg.get(off), dbg.get(off), tokens);
        wplan.run(da.get(off), dg.get(off), dwg.get(off), dbg.get(off), tokens, beta, ws.get());
        QBL_ASSERT_CUDA(cudaDeviceSynchronize());
        if (off == 0 && in > 1) {
          EXPECT_TRUE(w_lt);
        }
        // The epilogue is never planned for a single row (see GemmPlan's constructor).
        if (in == 1) {
          EXPECT_FALSE(w_lt);
        }
        std::vector<double> want = wgrad;
        if (beta != 0.0f)
          for (std::size_t i = 0; i < want.size(); ++i) want[i] += old_w[i];
        check(dwg.get(off), w.size(), want, "wgrad");
        check(dbg.get(off), static_cast<std::size_t>(out), bgrad, "bgrad (BGRADB)");
      }
      // Without the vector, the vector is not written.
      QBL_ASSERT_CUDA(cudaMemset(dbg.get(), qbl_test::poison_byte, dbg.size() * sizeof(T)));
      wplan.run(da.get(off), dg.get(off), dwg.get(off), nullptr, tokens, 0.0f, ws.get());
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      untouched(dbg.get(), dbg.size(), "bgrad without a vector");
      check(dwg.get(off), w.size(), wgrad, "wgrad without the epilogue");
    }
  }
}

TEST(GemmPlan, RejectsBadSpecsBeforeTouchingCuda) {
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_dgrad(0, 4), 4), qbl::invalid_argument);
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_wgrad(4, 0), 4), qbl::invalid_argument);
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_wgrad(4, 4), 0), qbl::invalid_argument);
  // BGRADB sums op(B) over k: only for a transposed B (row-major [k, n]).
  qbl::GemmSpec bgradb = qbl::GemmSpec::linear_dgrad(4, 4);
  bgradb.vector_epilogue = CUBLASLT_EPILOGUE_BGRADB;
  EXPECT_THROW(qbl::GemmPlan<float>(bgradb, 4), qbl::invalid_argument);
  // The token count must be a stored column count: n with B transposed is not, nor is k with A
  // transposed or B not transposed.
  qbl::GemmSpec bad = qbl::GemmSpec::linear_dgrad(4, 4);
  bad.trans_b = CUBLAS_OP_T;
  EXPECT_THROW(qbl::GemmPlan<float>(bad, 4), qbl::invalid_argument);
  for (const auto& [ta, tb] :
       {std::pair{CUBLAS_OP_T, CUBLAS_OP_T}, std::pair{CUBLAS_OP_N, CUBLAS_OP_N},
        std::pair{CUBLAS_OP_T, CUBLAS_OP_N}}) {
    qbl::GemmSpec k_bad = qbl::GemmSpec::linear_wgrad(4, 4);
    k_bad.trans_a = ta;
    k_bad.trans_b = tb;
    EXPECT_THROW(qbl::GemmPlan<float>(k_bad, 4), qbl::invalid_argument) << ta << " " << tb;
  }
}

TEST(GemmPlanDevice, RunRejectsBadArgumentsBeforeLaunching) {
  QBL_REQUIRE_GPU();
  GemmPlan<float> gemm(GemmSpec::linear_forward(8, 8), 16);
  GemmPlan<float> dgrad(GemmSpec::linear_dgrad(8, 8), 16);
  qbl_test::DeviceArray<unsigned char> ws(gemm.workspace_bytes());
  float* p = reinterpret_cast<float*>(16);
  EXPECT_THROW(gemm.run(p, p, p, nullptr, 17, 0.0f, ws.get()), qbl::invalid_argument);
  EXPECT_THROW(gemm.run(p, p, p, nullptr, -1, 0.0f, ws.get()), qbl::invalid_argument);
  EXPECT_THROW(gemm.run(nullptr, p, p, nullptr, 4, 0.0f, ws.get()), qbl::invalid_argument);
  EXPECT_THROW(gemm.run(p, p, p, nullptr, 4, 0.5f, ws.get()), qbl::invalid_argument);
  EXPECT_THROW(gemm.run(p, p, p, nullptr, 4, 0.0f, nullptr), qbl::invalid_argument);
  EXPECT_THROW(dgrad.run(p, p, p, p, 4, 0.0f, ws.get()), qbl::invalid_argument);  // no epilogue
  EXPECT_NO_THROW(gemm.run(nullptr, nullptr, nullptr, nullptr, 0, 0.0f, nullptr));
  GemmPlan<float> moved = std::move(gemm);
  EXPECT_FALSE(gemm.valid());
  EXPECT_TRUE(moved.valid());
  EXPECT_THROW(gemm.run(p, p, p, nullptr, 4, 0.0f, ws.get()), qbl::logic_error);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace

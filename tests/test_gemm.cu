// qbl/gemm.cuh: the GEMM plan -- cuBLASLt, and the fallback kernel where cuBLASLt has no
// algorithm -- against float64 CPU products, every element within the bound that the GEMM's
// arithmetic allows (tests/tolerance.hpp): the forward product and the backward's two, each in one
// suite over element type and shape.
#include <qbl/gemm.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"
#include "tolerance.hpp"

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

/// A GEMM element type (the GEMM's T; TF32 is a mode of fp32, tested with the layer).
std::vector<qbl_test::DType> gemm_types() {
  return {qbl_test::DType::fp32, qbl_test::DType::bf16, qbl_test::DType::fp16};
}

/// Calls f(T{}) for the element type `t` names.
template <typename F>
void with_type(qbl_test::DType t, F&& f) {
  switch (t) {
    case qbl_test::DType::fp32:
    case qbl_test::DType::tf32:
      f(float{});
      break;
    case qbl_test::DType::bf16:
      f(__nv_bfloat16{});
      break;
    case qbl_test::DType::fp16:
      f(__half{});
      break;
  }
}

/// One case of a suite over (element type x shape).
template <typename Shape>
struct TypedGemm {
  qbl_test::DType type;
  Shape shape;
};

template <typename Shape>
std::vector<TypedGemm<Shape>> over_gemm_types(const std::vector<Shape>& shapes) {
  std::vector<TypedGemm<Shape>> v;
  for (qbl_test::DType t : gemm_types())
    for (const Shape& s : shapes) v.push_back({t, s});
  return v;
}

template <typename Shape>
void PrintTo(const TypedGemm<Shape>& c, std::ostream* os) {
  *os << qbl_test::dtype_name(c.type) << " " << ::testing::PrintToString(c.shape);
}

struct TypedGemmName {
  template <typename Shape>
  std::string operator()(const ::testing::TestParamInfo<TypedGemm<Shape>>& i) const {
    return std::string(qbl_test::dtype_name(i.param.type)) + "_" + shape_name(i.param.shape);
  }
};

/// A T-valued copy of `v` (normal(0, stddev) rounded to T), as floats.
template <typename T>
std::vector<float> rand_t(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  return qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(n, seed, stddev)));
}

/// Every element written (no element still the poison) and none NaN.
template <typename T>
::testing::AssertionResult written_and_finite(const std::vector<T>& raw, const char* what) {
  const ::testing::AssertionResult w = qbl_test::all_written(raw, what);
  if (!w) return w;
  for (std::size_t i = 0; i < raw.size(); ++i)
    if (std::isnan(qbl_test::to_f(raw[i])))
      return ::testing::AssertionFailure() << what << " NaN at " << i;
  return ::testing::AssertionSuccess();
}

// ---- the forward product: out = a · wᵀ + bias ---------------------------------------------------

/// A forward shape: in and out features, a bias or none, the token counts and the element offsets
/// of w, bias and out it runs at (alignment sizeof(T) * offset, or 256 bytes for offset 0).
struct ForwardShape {
  std::int64_t in, out;
  bool bias;
  std::vector<std::int64_t> tokens;
  std::vector<std::size_t> offsets;
  /// cuBLASLt must serve this shape at 256-byte alignment (checked where it was measured).
  bool cublaslt_when_aligned = false;
};

void PrintTo(const ForwardShape& s, std::ostream* os) {
  *os << "in=" << s.in << " out=" << s.out << " bias=" << s.bias << " tokens=";
  for (std::size_t i = 0; i < s.tokens.size(); ++i) *os << (i ? "," : "") << s.tokens[i];
  *os << " offsets=";
  for (std::size_t i = 0; i < s.offsets.size(); ++i) *os << (i ? "," : "") << s.offsets[i];
}

std::string shape_name(const ForwardShape& s) {
  std::string n =
      "in" + std::to_string(s.in) + "_out" + std::to_string(s.out) + (s.bias ? "_bias" : "_nobias");
  if (s.tokens.size() == 1) n += "_t" + std::to_string(s.tokens[0]);
  n += s.offsets.size() == 1 ? "_off" + std::to_string(s.offsets[0]) : "_offsets";
  return n;
}

std::vector<ForwardShape> forward_shapes() {
  const std::vector<std::int64_t> sweep = {1, 3, 7, 65, 217, 2047, 2049};
  return {
      {256, 256, true, sweep, {0}},
      {96, 40, false, sweep, {0}},
      {217, 65, true, {65}, {1}},
      {128, 64, true, {300}, {4}},  // 16-byte but not 256-byte aligned (fp32)
      {64, 128, true, {2049}, {1}},
      {7, 3, true, {100}, {0}},
      {1, 1, false, {5}, {1}},
      // every alignment class: where cuBLASLt serves it, and where the fallback does
      {96, 40, true, {65}, {0, 1, 2, 4, 8}, true},
      {96, 40, false, {65}, {0, 1, 2, 4, 8}, true},
  };
}

// uses_cublaslt(), asked before the run, says where run() goes; either way every element of the
// product is within the bound of its arithmetic (the fallback kernel accumulates in fp32 too). The
// plan is fixed at construction: asking again after the run gives the same answer. Where a shape
// runs at several alignments, the table of what this cuBLASLt serves is printed.
template <typename T>
void run_forward(const ForwardShape& sh, std::uint64_t seed) {
  const qbl_test::DType dt = qbl_test::dtype_of<T>();
  const std::int64_t max_tokens = 2049, in = sh.in, out = sh.out;
  GemmPlan<T> gemm(GemmSpec::linear_forward(in, out), max_tokens);
  qbl_test::DeviceArray<unsigned char> ws(gemm.workspace_bytes());
  const auto w = rand_t<T>(static_cast<std::size_t>(out * in), seed + 1, 0.1f);
  const auto b = rand_t<T>(static_cast<std::size_t>(out), seed + 2);
  std::string table;
  for (const std::int64_t tokens : sh.tokens) {
    const auto a = rand_t<T>(static_cast<std::size_t>(tokens * in), seed + tokens);
    const auto want = qbl_test::linear_values(a, w, sh.bias ? b.data() : nullptr, tokens, in, out);
    for (const std::size_t off : sh.offsets) {
      SCOPED_TRACE("tokens " + std::to_string(tokens) + " offset " + std::to_string(off));
      const std::size_t align = off == 0 ? 256 : sizeof(T) * (off & (~off + 1));
      qbl_test::DeviceArray<T> da(a.size()), dw(w.size() + off), db(b.size() + off),
          dout(static_cast<std::size_t>(tokens * out) + off);
      QBL_ASSERT_CUDA(qbl_test::to_device(da.get(), qbl_test::convert<T>(a)));
      QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), qbl_test::convert<T>(w)));
      QBL_ASSERT_CUDA(qbl_test::to_device(db.get(off), qbl_test::convert<T>(b)));
      QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(T)));
      const T* bias = sh.bias ? db.get(off) : nullptr;
      const bool lt = gemm.uses_cublaslt(dw.get(off), da.get(), dout.get(off), bias, tokens);
      gemm.run(dw.get(off), da.get(), dout.get(off), bias, tokens, 0.0f, ws.get(), nullptr);
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<T> got(static_cast<std::size_t>(tokens * out));
      QBL_ASSERT_CUDA(qbl_test::to_host(got, dout.get(off)));
      table += " " + std::to_string(align) + "B:" + (lt ? "cuBLASLt" : "fallback");
      if (off == 0 && sh.cublaslt_when_aligned) {
        EXPECT_TRUE(lt) << "no algorithm for 256-byte-aligned pointers";
      }
      EXPECT_EQ(lt, gemm.uses_cublaslt(dw.get(off), da.get(), dout.get(off), bias, tokens));
      ASSERT_TRUE(written_and_finite(got, "out"));
      EXPECT_TRUE(qbl_test::within_dot_bounds(qbl_test::GemmArithmetic::of(dt),
                                              in + (sh.bias ? 1 : 0), qbl_test::widen(got), want,
                                              "out", qbl_test::max_finite(dt)));
    }
  }
  if (sh.offsets.size() > 1)
    std::printf("[ %s %s ] GEMM at alignment:%s\n", qbl_test::dtype_name(dt),
                shape_name(sh).c_str(), table.c_str());
}

class ForwardGemmDevice : public ::testing::TestWithParam<TypedGemm<ForwardShape>> {};

TEST_P(ForwardGemmDevice, EveryElementWithinTheBound) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  with_type(GetParam().type, [&](auto t) { run_forward<decltype(t)>(GetParam().shape, seed); });
}

INSTANTIATE_TEST_SUITE_P(Shapes, ForwardGemmDevice,
                         ::testing::ValuesIn(over_gemm_types(forward_shapes())), TypedGemmName{});

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
    EXPECT_TRUE(qbl_test::within_dot_bounds(
        qbl_test::GemmArithmetic::of(qbl_test::DType::fp32), in + 1, got,
        qbl_test::linear_values(a, w, b.data(), tokens, in, out), "out"))
        << "tokens " << tokens;
  }
  o.autotune = false;
  GemmPlan<float> plain(GemmSpec::linear_forward(in, out), max_tokens, o);
  EXPECT_TRUE(plain.tuning().empty());
}

// ---- the backward's products: dgrad g_a = g · w, wgrad g_w = gᵀ · a -----------------------------

/// A backward shape: tokens, in and out features.
struct BackwardShape {
  std::int64_t tokens, in, out;
  /// cuBLASLt must serve both products at 256-byte alignment (checked where it was measured).
  bool cublaslt_when_aligned = false;
};

void PrintTo(const BackwardShape& s, std::ostream* os) {
  *os << "tokens=" << s.tokens << " in=" << s.in << " out=" << s.out;
}

std::string shape_name(const BackwardShape& s) {
  return "t" + std::to_string(s.tokens) + "_in" + std::to_string(s.in) + "_out" +
         std::to_string(s.out);
}

std::vector<BackwardShape> backward_shapes() {
  return {{67, 48, 40, true}, {67, 1, 40}, {217, 65, 3}};
}

// The backward's two products through GemmPlan: dgrad (NN, g_a = g · w) and wgrad (NT,
// g_w = gᵀ · a), at element offsets 0 and 1, wgrad overwriting and accumulating (beta = 1),
// against float64 products of the T-valued operands, on cuBLASLt or the fallback kernel as
// uses_cublaslt() says; in_features == 1 makes wgrad's m = 1. wgrad has no vector epilogue (the
// bias gradient is qbl::bias_grad's column sum): a vector is refused before anything runs.
template <typename T>
void run_backward(const BackwardShape& sh, std::uint64_t seed) {
  const qbl_test::DType dt = qbl_test::dtype_of<T>();
  const qbl_test::GemmArithmetic arith = qbl_test::GemmArithmetic::of(dt);
  const std::int64_t tokens = sh.tokens, in = sh.in, out = sh.out;
  const auto g = rand_t<T>(static_cast<std::size_t>(tokens * out), seed);
  const auto w = rand_t<T>(static_cast<std::size_t>(out * in), seed + 1, 0.2f);
  const auto a = rand_t<T>(static_cast<std::size_t>(tokens * in), seed + 2);
  const auto old_w = rand_t<T>(static_cast<std::size_t>(out * in), seed + 3);
  const auto dgrad = qbl_test::dgrad_values(g, w, tokens, in, out);
  const std::int64_t max_tokens = std::max<std::int64_t>(tokens, 128);
  qbl::GemmPlan<T> dplan(qbl::GemmSpec::linear_dgrad(in, out), max_tokens);
  qbl::GemmPlan<T> wplan(qbl::GemmSpec::linear_wgrad(in, out), max_tokens);
  qbl_test::DeviceArray<unsigned char> ws(dplan.workspace_bytes());
  for (const std::size_t off : {0, 1}) {
    SCOPED_TRACE("offset " + std::to_string(off));
    qbl_test::DeviceArray<T> dg(g.size() + off), dw(w.size() + off), da(a.size() + off),
        dd(a.size() + off), dwg(w.size() + off), dbg(static_cast<std::size_t>(out) + off);
    QBL_ASSERT_CUDA(qbl_test::to_device(dg.get(off), qbl_test::convert<T>(g)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), qbl_test::convert<T>(w)));
    QBL_ASSERT_CUDA(qbl_test::to_device(da.get(off), qbl_test::convert<T>(a)));
    auto read = [&](const T* d, std::size_t n) {
      std::vector<T> r(n);
      EXPECT_EQ(qbl_test::to_host(r, d), cudaSuccess);
      return r;
    };
    // dgrad: A = w, B = g, D = g_a.
    QBL_ASSERT_CUDA(cudaMemset(dd.get(), qbl_test::poison_byte, dd.size() * sizeof(T)));
    const bool d_lt = dplan.uses_cublaslt(dw.get(off), dg.get(off), dd.get(off), nullptr, tokens);
    dplan.run(dw.get(off), dg.get(off), dd.get(off), nullptr, tokens, 0.0f, ws.get());
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    if (off == 0 && sh.cublaslt_when_aligned) {
      EXPECT_TRUE(d_lt);
    }
    const auto got_d = read(dd.get(off), a.size());
    ASSERT_TRUE(written_and_finite(got_d, "dgrad"));
    EXPECT_TRUE(qbl_test::within_dot_bounds(arith, out, qbl_test::widen(got_d), dgrad, "dgrad",
                                            qbl_test::max_finite(dt)));
    // wgrad, overwriting, then accumulating onto old_w.
    for (const float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE(beta == 0.0f ? "overwrite" : "accumulate");
      if (beta == 0.0f) {
        QBL_ASSERT_CUDA(cudaMemset(dwg.get(), qbl_test::poison_byte, dwg.size() * sizeof(T)));
      } else {
        QBL_ASSERT_CUDA(qbl_test::to_device(dwg.get(off), qbl_test::convert<T>(old_w)));
      }
      const bool w_lt =
          wplan.uses_cublaslt(da.get(off), dg.get(off), dwg.get(off), nullptr, tokens);
      wplan.run(da.get(off), dg.get(off), dwg.get(off), nullptr, tokens, beta, ws.get());
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      if (off == 0 && sh.cublaslt_when_aligned) {
        EXPECT_TRUE(w_lt);
      }
      const auto got_w = read(dwg.get(off), w.size());
      ASSERT_TRUE(written_and_finite(got_w, "wgrad"));
      EXPECT_TRUE(qbl_test::within_dot_bounds(
          arith, tokens + (beta != 0.0f ? 1 : 0), qbl_test::widen(got_w),
          qbl_test::wgrad_values(g, a, beta != 0.0f ? old_w.data() : nullptr, tokens, in, out),
          "wgrad", qbl_test::max_finite(dt)));
    }
    // A vector for wgrad's spec, which has no epilogue: refused before anything is enqueued.
    QBL_ASSERT_CUDA(cudaMemset(dbg.get(), qbl_test::poison_byte, dbg.size() * sizeof(T)));
    QBL_ASSERT_CUDA(cudaMemset(dwg.get(), qbl_test::poison_byte, dwg.size() * sizeof(T)));
    EXPECT_THROW(
        wplan.run(da.get(off), dg.get(off), dwg.get(off), dbg.get(off), tokens, 0.0f, ws.get()),
        qbl::invalid_argument);
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    for (const T& v : read(dbg.get(), dbg.size()))
      ASSERT_TRUE(qbl_test::is_poison(v)) << "the refused call wrote the vector";
    for (const T& v : read(dwg.get(), dwg.size()))
      ASSERT_TRUE(qbl_test::is_poison(v)) << "the refused call wrote the product";
  }
}

class BackwardGemmDevice : public ::testing::TestWithParam<TypedGemm<BackwardShape>> {};

TEST_P(BackwardGemmDevice, DgradAndWgradWithinTheBound) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  with_type(GetParam().type, [&](auto t) { run_backward<decltype(t)>(GetParam().shape, seed); });
}

INSTANTIATE_TEST_SUITE_P(Shapes, BackwardGemmDevice,
                         ::testing::ValuesIn(over_gemm_types(backward_shapes())), TypedGemmName{});

TEST(GemmPlan, RejectsBadSpecsBeforeTouchingCuda) {
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_dgrad(0, 4), 4), qbl::invalid_argument);
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_wgrad(4, 0), 4), qbl::invalid_argument);
  EXPECT_THROW(qbl::GemmPlan<float>(qbl::GemmSpec::linear_wgrad(4, 4), 0), qbl::invalid_argument);
  // The vector epilogue is BIAS or none: the bias gradient is qbl::bias_grad's column sum, so
  // BGRADB is refused for every spec, the weight gradient's included.
  for (qbl::GemmSpec bgradb :
       {qbl::GemmSpec::linear_dgrad(4, 4), qbl::GemmSpec::linear_wgrad(4, 4)}) {
    bgradb.vector_epilogue = CUBLASLT_EPILOGUE_BGRADB;
    EXPECT_THROW(qbl::GemmPlan<float>(bgradb, 4), qbl::invalid_argument);
  }
  EXPECT_EQ(qbl::GemmSpec::linear_wgrad(4, 4).vector_epilogue, CUBLASLT_EPILOGUE_DEFAULT);
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

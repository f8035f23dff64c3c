// qbl/quant_blend.cuh: the fused quant-blend launchers against a CPU reference, element-exact.
#include <qbl/quant_blend.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl_test::bits;

TEST(QuantBlend, RejectsBadArgumentsWithoutLaunching) {
  float d = 0;
  EXPECT_EQ(qbl::quant_blend<float>(&d, &d, &d, &d, -1, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend<float>(&d, &d, &d, &d, 4, 0), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend<float>(nullptr, &d, &d, &d, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend<float>(&d, nullptr, &d, &d, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend<float>(&d, &d, nullptr, &d, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::quant_blend<float>(&d, &d, &d, nullptr, 4, 4), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::amax_quant_blend<float>(&d, &d, &d, 4, 4, nullptr, &d, &d), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::amax_quant_blend<float>(&d, &d, &d, 4, 4, &d, nullptr, &d), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::amax_quant_blend<float>(&d, &d, &d, 4, -4, &d, &d, &d), cudaErrorInvalidValue);
  // Past the single-block size the per-block maxima need the workspace.
  EXPECT_EQ(qbl::amax_quant_blend<float>(&d, &d, &d, 1 << 10, 1 << 10, &d, &d, nullptr),
            cudaErrorInvalidValue);
  // tokens == 0 is a no-op, null buffers allowed.
  EXPECT_EQ(qbl::quant_blend<float>(nullptr, nullptr, &d, nullptr, 0, 4), cudaSuccess);
}

/// alpha as the device computes it: the reference takes sigmoid from the GPU's expf, as eager does.
__global__ void device_sigmoid(const float* l, float* alpha, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) alpha[i] = qbl::sigmoid(l[i]);
}

struct Inputs {
  std::vector<float> x, logits, alpha;
};

enum class Path { two_stage, combined };

struct Case {
  std::int64_t tokens, features;
  std::size_t offset;  // element offset of x and mixed
  Path path;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "tokens=" << c.tokens << " features=" << c.features << " offset=" << c.offset
      << (c.path == Path::two_stage ? " two-stage" : " combined");
}

class QuantBlendDevice : public ::testing::TestWithParam<Case> {
 protected:
  /// Runs the launcher on fresh random inputs (optionally edited) and compares with the CPU.
  template <typename Edit>
  void run_and_compare(Edit&& edit) {
    QBL_REQUIRE_GPU();
    const auto [tokens, features, offset, path] = GetParam();
    const std::uint64_t seed = qbl_test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const auto n = static_cast<std::size_t>(tokens * features);
    Inputs in{qbl_test::randn(n, seed), qbl_test::randn(tokens, seed + 1, 2.0f), {}};
    edit(in);
    qbl_test::DeviceArray<float> dx(n + offset), dl(tokens), dalpha(tokens), dm(n + offset),
        dstats(2);
    ASSERT_TRUE(dx.ok() && dm.ok());
    QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(offset), in.x));
    QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), in.logits));
    device_sigmoid<<<(tokens + 255) / 256, 256>>>(dl.get(), dalpha.get(), tokens);
    QBL_ASSERT_CUDA(cudaGetLastError());
    in.alpha.resize(tokens);
    QBL_ASSERT_CUDA(qbl_test::to_host(in.alpha, dalpha.get()));

    QBL_ASSERT_CUDA(cudaMemset(dm.get(), qbl_test::poison_byte, (n + offset) * sizeof(float)));
    QBL_ASSERT_CUDA(cudaMemset(dstats.get(), qbl_test::poison_byte, 2 * sizeof(float)));
    float* d_amax = dstats.get();
    float* d_scale = dstats.get(1);
    if (path == Path::two_stage) {
      QBL_ASSERT_CUDA(qbl::amax(dx.get(offset), tokens * features, d_amax));
      QBL_ASSERT_CUDA(qbl::quant_blend(dx.get(offset), dl.get(), d_amax, dm.get(offset), tokens,
                                       features, d_scale));
    } else {
      // The workspace poisoned: the prologue must need no initialized workspace.
      qbl_test::DeviceArray<unsigned char> ws(qbl::amax_quant_blend_workspace_bytes);
      QBL_ASSERT_CUDA(cudaMemset(ws.get(), qbl_test::poison_byte, ws.size()));
      QBL_ASSERT_CUDA(qbl::amax_quant_blend(dx.get(offset), dl.get(), dm.get(offset), tokens,
                                            features, d_amax, d_scale, ws.get()));
    }
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> got(n), stats(2);
    QBL_ASSERT_CUDA(qbl_test::to_host(got, dm.get(offset)));
    QBL_ASSERT_CUDA(qbl_test::to_host(stats, dstats.get()));
    float want_scale = 0;
    mixed_ = qbl_test::reference_mixed(qbl_test::DType::fp32, in.x, in.alpha, tokens, features,
                                       nullptr, &want_scale);
    got_ = got;
    EXPECT_TRUE(qbl_test::bits_equal(got, mixed_, static_cast<std::size_t>(features)));
    if (std::isnan(want_scale)) {
      EXPECT_TRUE(std::isnan(stats[1]));
    } else {
      EXPECT_EQ(bits(stats[1]), bits(want_scale));
    }
    if (offset > 0) {  // the element before the output must stay poisoned
      std::vector<float> before(1);
      QBL_ASSERT_CUDA(qbl_test::to_host(before, dm.get()));
      EXPECT_EQ(bits(before[0]), 0xffffffffu) << "wrote before the output";
    }
  }
  std::vector<float> mixed_, got_;
};

TEST_P(QuantBlendDevice, RandomMatchesCpu) {
  run_and_compare([](Inputs&) {});
}

TEST_P(QuantBlendDevice, NaNInXMakesEverythingNaN) {
  run_and_compare(
      [](Inputs& in) { in.x[in.x.size() / 2] = std::numeric_limits<float>::quiet_NaN(); });
  for (float v : got_) ASSERT_TRUE(std::isnan(v));
}

TEST_P(QuantBlendDevice, InfInXMakesEverythingNaN) {
  run_and_compare([](Inputs& in) { in.x.back() = -std::numeric_limits<float>::infinity(); });
  for (float v : got_) ASSERT_TRUE(std::isnan(v));
}

TEST_P(QuantBlendDevice, NaNLogitMakesItsRowNaN) {
  const std::int64_t features = GetParam().features;
  run_and_compare([](Inputs& in) {
    in.logits[0] = std::numeric_limits<float>::quiet_NaN();
    if (in.logits.size() > 2) {
      in.logits[1] = std::numeric_limits<float>::infinity();
      in.logits[2] = -std::numeric_limits<float>::infinity();
    }
  });
  if (IsSkipped() || got_.empty()) return;
  for (std::int64_t c = 0; c < features; ++c) ASSERT_TRUE(std::isnan(got_[c]));
  for (std::size_t i = features; i < got_.size(); ++i) ASSERT_FALSE(std::isnan(got_[i])) << i;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  const std::pair<std::int64_t, std::int64_t> shapes[] = {
      {1, 1},     {1, 3},     {3, 7},     {7, 65},    {65, 217}, {217, 2047},
      {2047, 3},  {2049, 65}, {65, 2049}, {1, 2048},  {8, 1024}, {64, 256},
      {512, 512}, {33, 4096}, {2, 8192},  {257, 768}, {3, 1}};
  for (auto [t, f] : shapes)
    for (std::size_t off : {0, 1})
      for (Path p : {Path::two_stage, Path::combined}) c.push_back({t, f, off, p});
  return c;
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantBlendDevice, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return "t" + std::to_string(i.param.tokens) + "_f" +
                                  std::to_string(i.param.features) + "_off" +
                                  std::to_string(i.param.offset) +
                                  (i.param.path == Path::two_stage ? "_twostage" : "_combined");
                         });

}  // namespace

// ---- bf16 and fp16 -----------------------------------------------------------------------

namespace {

using qbl_test::device_sigmoid_t;

template <typename T>
class QuantBlendDevice16 : public ::testing::Test {};
using qbl_test::Names16;
using qbl_test::Types16;
TYPED_TEST_SUITE(QuantBlendDevice16, Types16, Names16);

TYPED_TEST(QuantBlendDevice16, MatchesCpuOpByOp) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Shape {
    std::int64_t tokens, features;
    std::size_t offset;
  };
  for (const Shape sh : {Shape{3, 7, 0}, Shape{65, 217, 1}, Shape{8, 1024, 0}, Shape{2049, 512, 0},
                         Shape{257, 768, 1}, Shape{33, 4096, 0}, Shape{4, 3, 1}}) {
    for (Path path : {Path::two_stage, Path::combined}) {
      SCOPED_TRACE("tokens " + std::to_string(sh.tokens) + " features " +
                   std::to_string(sh.features) + " offset " + std::to_string(sh.offset) +
                   (path == Path::two_stage ? " two-stage" : " combined"));
      const auto n = static_cast<std::size_t>(sh.tokens * sh.features);
      const std::vector<T> x = qbl_test::convert<T>(qbl_test::randn(n, seed + sh.features));
      const std::vector<T> l = qbl_test::convert<T>(qbl_test::randn(sh.tokens, seed + 7, 2.0f));
      qbl_test::DeviceArray<T> dx(n + sh.offset), dl(sh.tokens), dm(n + sh.offset);
      qbl_test::DeviceArray<float> dalpha(sh.tokens), dstats(2);
      QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(sh.offset), x));
      QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), l));
      QBL_ASSERT_CUDA(cudaMemset(dm.get(), qbl_test::poison_byte, (n + sh.offset) * sizeof(T)));
      device_sigmoid_t<T><<<static_cast<unsigned>((sh.tokens + 255) / 256), 256>>>(
          dl.get(), dalpha.get(), sh.tokens);
      QBL_ASSERT_CUDA(cudaGetLastError());
      if (path == Path::two_stage) {
        QBL_ASSERT_CUDA(qbl::amax(dx.get(sh.offset), sh.tokens * sh.features, dstats.get()));
        QBL_ASSERT_CUDA(qbl::quant_blend(dx.get(sh.offset), dl.get(), dstats.get(),
                                         dm.get(sh.offset), sh.tokens, sh.features, dstats.get(1)));
      } else {
        qbl_test::DeviceArray<unsigned char> ws(qbl::amax_quant_blend_workspace_bytes);
        QBL_ASSERT_CUDA(cudaMemset(ws.get(), qbl_test::poison_byte, ws.size()));
        QBL_ASSERT_CUDA(qbl::amax_quant_blend(dx.get(sh.offset), dl.get(), dm.get(sh.offset),
                                              sh.tokens, sh.features, dstats.get(), dstats.get(1),
                                              ws.get()));
      }
      std::vector<float> alpha(sh.tokens), stats(2);
      std::vector<T> got(n);
      QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
      QBL_ASSERT_CUDA(qbl_test::to_host(stats, dstats.get()));
      QBL_ASSERT_CUDA(qbl_test::to_host(got, dm.get(sh.offset)));
      const std::vector<float> xf = qbl_test::widen(x);
      float amax = 0, scale = 0;
      const std::vector<float> want = qbl_test::reference_mixed(
          qbl_test::dtype_of<T>(), xf, alpha, sh.tokens, sh.features, &amax, &scale);
      EXPECT_EQ(bits(stats[0]), bits(amax));
      EXPECT_EQ(bits(stats[1]), bits(scale));
      EXPECT_TRUE(
          qbl_test::bits_equal(qbl_test::widen(got), want, static_cast<std::size_t>(sh.features)));
    }
  }
}

}  // namespace

// ---- fp32 x with a bf16 / fp16 mixed (PyTorch's autocast) -----------------------------------

namespace {

template <typename M>
class QuantBlendMixedTypes : public ::testing::Test {};
TYPED_TEST_SUITE(QuantBlendMixedTypes, qbl_test::MixedTypeList, qbl_test::MixedTypeNames);

// alpha and 1 - alpha rounded to the logits' type, the blend in fp32, mixed rounded once to the
// GEMM's type: eager's mixed.to(G) under autocast, bit for bit, both prologues, vector and
// element-by-element paths; amax and scale in fp32.
TYPED_TEST(QuantBlendMixedTypes, MixedIsEagersCastOfTheFp32Blend) {
  QBL_REQUIRE_GPU();
  using G = typename TypeParam::gemm;
  using L = typename TypeParam::logits;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const qbl_test::DType gt = qbl_test::dtype_of<G>(), lt = qbl_test::dtype_of<L>();
  struct Shape {
    std::int64_t tokens, features;
    std::size_t offset;
  };
  for (const Shape sh : {Shape{3, 7, 0}, Shape{65, 217, 1}, Shape{8, 1024, 0}, Shape{2049, 512, 0},
                         Shape{257, 768, 1}, Shape{33, 4096, 0}}) {
    for (Path path : {Path::two_stage, Path::combined}) {
      SCOPED_TRACE("tokens " + std::to_string(sh.tokens) + " features " +
                   std::to_string(sh.features) + " offset " + std::to_string(sh.offset) +
                   (path == Path::two_stage ? " two-stage" : " combined"));
      const auto n = static_cast<std::size_t>(sh.tokens * sh.features);
      std::vector<float> x = qbl_test::randn(n, seed);
      x[n / 3] = -0.0f;
      const std::vector<L> l = qbl_test::convert<L>(qbl_test::randn(sh.tokens, seed + 1, 2.0f));
      qbl_test::DeviceArray<float> dx(n + sh.offset), dalpha(sh.tokens), dstats(2);
      qbl_test::DeviceArray<L> dl(sh.tokens);
      qbl_test::DeviceArray<G> dm(n + sh.offset);
      QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(sh.offset), x));
      QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), l));
      QBL_ASSERT_CUDA(cudaMemset(dm.get(), qbl_test::poison_byte, (n + sh.offset) * sizeof(G)));
      device_sigmoid_t<L><<<static_cast<unsigned>((sh.tokens + 255) / 256), 256>>>(
          dl.get(), dalpha.get(), sh.tokens);
      QBL_ASSERT_CUDA(cudaGetLastError());
      if (path == Path::two_stage) {
        QBL_ASSERT_CUDA(qbl::amax(dx.get(sh.offset), sh.tokens * sh.features, dstats.get()));
        QBL_ASSERT_CUDA((qbl::quant_blend<float, G, L>(dx.get(sh.offset), dl.get(), dstats.get(),
                                                       dm.get(sh.offset), sh.tokens, sh.features,
                                                       dstats.get(1))));
      } else {
        qbl_test::DeviceArray<unsigned char> ws(qbl::amax_quant_blend_workspace_bytes);
        QBL_ASSERT_CUDA((qbl::amax_quant_blend<float, G, L>(
            dx.get(sh.offset), dl.get(), dm.get(sh.offset), sh.tokens, sh.features, dstats.get(),
            dstats.get(1), ws.get())));
      }
      std::vector<float> alpha(sh.tokens), stats(2);
      std::vector<G> got(n + sh.offset);
      QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
      QBL_ASSERT_CUDA(qbl_test::to_host(stats, dstats.get()));
      QBL_ASSERT_CUDA(qbl_test::to_host(got, dm.get()));
      float amax = 0, scale = 0;
      const std::vector<float> want = qbl_test::reference_mixed(
          qbl_test::DType::fp32, lt, gt, x, alpha, sh.tokens, sh.features, &amax, &scale);
      EXPECT_EQ(bits(stats[0]), bits(amax));
      EXPECT_EQ(bits(stats[1]), bits(scale));
      const std::vector<float> all = qbl_test::widen(got);
      const std::vector<float> mixed(all.begin() + static_cast<std::ptrdiff_t>(sh.offset),
                                     all.end());
      EXPECT_TRUE(qbl_test::bits_equal(mixed, want, static_cast<std::size_t>(sh.features)));
      for (std::size_t i = 0; i < sh.offset; ++i)
        EXPECT_TRUE(std::isnan(all[i])) << "wrote before the output";
    }
  }
}

}  // namespace

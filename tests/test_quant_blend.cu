// qbl/quant_blend.cuh: the quant-blend launchers -- qbl::quant_blend after qbl::amax, and
// qbl::amax_quant_blend -- against the CPU reference, element-exact, in one suite over every
// supported type triple and shape; and where the blend may start as the amax kernel's
// programmatic dependent.
#include <qbl/quant_blend.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cmath>
#include <cstddef>
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

// ---- every supported type triple and shape ----------------------------------------------------

struct Shape {
  std::int64_t tokens, features;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "tokens=" << s.tokens << " features=" << s.features;
}

std::string shape_name(const Shape& s) {
  return "t" + std::to_string(s.tokens) + "_f" + std::to_string(s.features);
}

std::vector<Shape> shapes() {
  return {{1, 1},     {1, 3},     {3, 7},    {7, 65},   {65, 217},  {217, 2047}, {2047, 3},
          {2049, 65}, {65, 2049}, {1, 2048}, {8, 1024}, {64, 256},  {512, 512},  {33, 4096},
          {2, 8192},  {257, 768}, {3, 1},    {4, 3},    {2049, 512}};
}

/// The inputs' change that a case makes before running: none, or one non-finite input.
enum class Edit { none, nan_in_x, inf_in_x, non_finite_logits };

const char* edit_name(Edit e) {
  switch (e) {
    case Edit::none:
      return "random inputs";
    case Edit::nan_in_x:
      return "a NaN in x";
    case Edit::inf_in_x:
      return "-Inf in x";
    case Edit::non_finite_logits:
      return "logits NaN, +Inf, -Inf in rows 0, 1, 2";
  }
  return "?";
}

/// Both launch paths (qbl::amax then qbl::quant_blend; qbl::amax_quant_blend, its workspace
/// poisoned: it must need no initialized workspace), with x and mixed at element offset 0 and 1
/// (1: the element-by-element kernels), on fresh random inputs of the triple's types changed by
/// `edit`: stats bit-equal to the reference's amax and scale, every element of mixed bit-equal to
/// eager's (mixed.to(G) of the blend in X under autocast), nothing written before it; and what
/// the edit implies, stated by hand.
template <typename Types>
void run_case(const Shape& sh, Edit edit, std::uint64_t seed) {
  using X = typename Types::x_type;
  using G = typename Types::gemm_type;
  using L = typename Types::logits_type;
  const qbl_test::TypeTriple tt = qbl_test::triple_of<Types>();
  const std::int64_t tokens = sh.tokens, f = sh.features;
  const auto n = static_cast<std::size_t>(tokens * f);
  std::vector<float> x = qbl_test::widen(qbl_test::convert<X>(qbl_test::randn(n, seed)));
  if (n > 2) x[n / 3] = -0.0f;
  std::vector<float> logits =
      qbl_test::widen(qbl_test::convert<L>(qbl_test::randn(tokens, seed + 1, 2.0f)));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  switch (edit) {
    case Edit::none:
      break;
    case Edit::nan_in_x:
      x[n / 2] = nan;
      break;
    case Edit::inf_in_x:
      x.back() = -inf;
      break;
    case Edit::non_finite_logits:
      logits[0] = nan;
      if (tokens > 2) logits[1] = inf, logits[2] = -inf;
      break;
  }
  qbl_test::DeviceArray<L> dl(static_cast<std::size_t>(tokens));
  qbl_test::DeviceArray<float> dalpha(static_cast<std::size_t>(tokens));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), qbl_test::convert<L>(logits)));
  qbl_test::device_sigmoid_t<L>
      <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(), dalpha.get(), tokens);
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> alpha(static_cast<std::size_t>(tokens));
  QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
  float amax = 0, scale = 0;
  const std::vector<float> want =
      qbl_test::reference_mixed(tt.x, tt.logits, tt.gemm, x, alpha, tokens, f, &amax, &scale);
  enum class Path { two_stage, combined };
  for (const std::size_t off : {0, 1}) {
    for (const Path path : {Path::two_stage, Path::combined}) {
      SCOPED_TRACE(std::string(edit_name(edit)) + ", offset " + std::to_string(off) +
                   (path == Path::two_stage ? ", amax then quant_blend" : ", amax_quant_blend"));
      qbl_test::DeviceArray<X> dx(n + off);
      qbl_test::DeviceArray<G> dm(n + off);
      qbl_test::DeviceArray<float> dstats(2);
      ASSERT_TRUE(dx.ok() && dm.ok());
      QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(off), qbl_test::convert<X>(x)));
      QBL_ASSERT_CUDA(cudaMemset(dm.get(), qbl_test::poison_byte, (n + off) * sizeof(G)));
      QBL_ASSERT_CUDA(cudaMemset(dstats.get(), qbl_test::poison_byte, 2 * sizeof(float)));
      if (path == Path::two_stage) {
        QBL_ASSERT_CUDA(qbl::amax(dx.get(off), tokens * f, dstats.get()));
        QBL_ASSERT_CUDA((qbl::quant_blend<X, G, L>(dx.get(off), dl.get(), dstats.get(), dm.get(off),
                                                   tokens, f, dstats.get(1))));
      } else {
        qbl_test::DeviceArray<unsigned char> ws(qbl::amax_quant_blend_workspace_bytes);
        QBL_ASSERT_CUDA(cudaMemset(ws.get(), qbl_test::poison_byte, ws.size()));
        QBL_ASSERT_CUDA((qbl::amax_quant_blend<X, G, L>(dx.get(off), dl.get(), dm.get(off), tokens,
                                                        f, dstats.get(), dstats.get(1), ws.get())));
      }
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<G> raw(n + off);
      std::vector<float> stats(2);
      QBL_ASSERT_CUDA(qbl_test::to_host(raw, dm.get()));
      QBL_ASSERT_CUDA(qbl_test::to_host(stats, dstats.get()));
      EXPECT_TRUE(bits(stats[0]) == bits(amax) || (std::isnan(stats[0]) && std::isnan(amax)))
          << "amax: expected " << amax << ", actual " << stats[0];
      EXPECT_TRUE(bits(stats[1]) == bits(scale) || (std::isnan(stats[1]) && std::isnan(scale)))
          << "scale: expected " << scale << ", actual " << stats[1];
      const std::vector<G> before(raw.begin(), raw.begin() + static_cast<std::ptrdiff_t>(off));
      const std::vector<G> out(raw.begin() + static_cast<std::ptrdiff_t>(off), raw.end());
      for (const G& v : before) EXPECT_TRUE(qbl_test::is_poison(v)) << "wrote before the output";
      ASSERT_TRUE(qbl_test::all_written(out, "mixed"));
      const std::vector<float> got = qbl_test::widen(out);
      EXPECT_TRUE(qbl_test::bits_equal(got, want, static_cast<std::size_t>(f)));
      switch (edit) {
        case Edit::none:
          break;
        case Edit::nan_in_x:  // amax and scale NaN: every x_q NaN
        case Edit::inf_in_x:  // scale Inf: x_q = round(x / Inf) * Inf = 0 * Inf = NaN
          for (std::size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isnan(got[i])) << i;
          break;
        case Edit::non_finite_logits:  // alpha NaN in row 0 only; 1 and 0 in rows 1 and 2
          for (std::size_t i = 0; i < got.size(); ++i)
            ASSERT_EQ(std::isnan(got[i]), i < static_cast<std::size_t>(f)) << i;
          break;
      }
    }
  }
}

class QuantBlendDevice : public ::testing::TestWithParam<qbl_test::Typed<Shape>> {
 protected:
  void run(Edit edit) {
    const std::uint64_t seed = qbl_test::fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    const auto& c = GetParam();
    ASSERT_TRUE(
        qbl_test::with_types(c.types, [&](auto t) { run_case<decltype(t)>(c.shape, edit, seed); }));
  }
};

TEST_P(QuantBlendDevice, MatchesTheReference) {
  QBL_REQUIRE_GPU();
  run(Edit::none);
}

TEST_P(QuantBlendDevice, NonFiniteInputsGiveEagersNaNs) {
  QBL_REQUIRE_GPU();
  for (const Edit e : {Edit::nan_in_x, Edit::inf_in_x, Edit::non_finite_logits}) {
    run(e);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantBlendDevice,
                         ::testing::ValuesIn(qbl_test::over_supported_types(shapes())),
                         qbl_test::TypedName{});

// ---- the programmatic launch ------------------------------------------------------------------

/// The architecture this binary's device code was compiled for, as the runtime picked it for this
/// device (SASS for it, or the PTX it was JIT-compiled from): what a kernel of this binary sees as
/// __CUDA_ARCH__.
__global__ void compiled_arch(int* arch) {
#if defined(__CUDA_ARCH__)
  *arch = __CUDA_ARCH__;
#endif
}

template <typename T>
class ProgrammaticLaunch : public ::testing::Test {};
TYPED_TEST_SUITE(ProgrammaticLaunch, qbl_test::SupportedTypes, qbl_test::SupportedTypeNames);

// The quant-blend kernel starts as the amax kernel's programmatic dependent only where its own
// code waits for that kernel: where it was compiled for sm_90 or later, which is where
// wait_for_primary() is compiled in. A build for an older architecture running on Hopper by JIT
// must not launch it so. The reference is a kernel of this test, compiled with the same flags.
TYPED_TEST(ProgrammaticLaunch, OnlyWhereTheKernelWasCompiledForSm90OrLater) {
  QBL_REQUIRE_GPU();
  using X = typename TypeParam::x_type;
  using G = typename TypeParam::gemm_type;
  using L = typename TypeParam::logits_type;
  qbl_test::DeviceArray<int> d_arch(1);
  QBL_ASSERT_CUDA(cudaMemset(d_arch.get(), 0, sizeof(int)));
  compiled_arch<<<1, 1>>>(d_arch.get());
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<int> arch(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(arch, d_arch.get()));
  ASSERT_GT(arch[0], 0) << "the reference kernel did not run";
  qbl::detail::LaunchLimits limits;
  QBL_ASSERT_CUDA((qbl::detail::query_launch_limits<X, G, L>(&limits)));
  EXPECT_GT(limits.sms, 0);
  for (int v = 0; v < 2; ++v) {
    SCOPED_TRACE(v == 0 ? "element-by-element kernel" : "vector kernel");
    EXPECT_GE(limits.resident[v], 1);
    EXPECT_EQ(limits.programmatic[v], arch[0] >= 900) << "compiled for __CUDA_ARCH__ " << arch[0];
  }
}

}  // namespace

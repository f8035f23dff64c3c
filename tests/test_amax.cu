// qbl/amax.cuh: the device-wide and block-level max |x|, against the CPU, NaN/Inf/-0.0 included.
#include <qbl/amax.cuh>

#include "test_support.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using qbl_test::bits;

float cpu_amax(const std::vector<float>& x, std::size_t offset, std::size_t n) {
  std::uint32_t m = 0;
  for (std::size_t i = offset; i < offset + n; ++i) m = std::max(m, qbl::abs_bits(x[i]));
  return qbl::from_abs_bits(m);
}

TEST(Amax, RejectsBadArgumentsWithoutLaunching) {
  // Argument errors are answered before any CUDA call, so this runs without a GPU.
  float dummy = 0;
  EXPECT_EQ(qbl::amax<float>(nullptr, 4, &dummy), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::amax<float>(&dummy, -1, &dummy), cudaErrorInvalidValue);
  EXPECT_EQ(qbl::amax<float>(&dummy, 4, nullptr), cudaErrorInvalidValue);
}

enum class Special { none, nan, pos_inf, neg_inf, neg_zero_only, largest_negative };

std::string special_name(Special s) {
  switch (s) {
    case Special::none:
      return "random";
    case Special::nan:
      return "nan";
    case Special::pos_inf:
      return "posinf";
    case Special::neg_inf:
      return "neginf";
    case Special::neg_zero_only:
      return "negzero";
    case Special::largest_negative:
      return "largestnegative";
  }
  return "?";
}

struct AmaxCase {
  std::int64_t n;
  std::size_t offset;  // elements; 1 misaligns the start for 16-byte vectors
  Special special;
};

void PrintTo(const AmaxCase& c, std::ostream* os) {
  *os << "n=" << c.n << " offset=" << c.offset << " " << special_name(c.special);
}

class AmaxDevice : public ::testing::TestWithParam<AmaxCase> {};

TEST_P(AmaxDevice, MatchesCpu) {
  QBL_REQUIRE_GPU();
  const auto [n, offset, special] = GetParam();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> h = qbl_test::randn(static_cast<std::size_t>(n) + offset, seed);
  std::mt19937_64 gen(seed);
  const std::size_t where = offset + gen() % static_cast<std::size_t>(n);
  switch (special) {
    case Special::none:
      break;
    case Special::nan:
      h[where] = std::numeric_limits<float>::quiet_NaN();
      break;
    case Special::pos_inf:
      h[where] = std::numeric_limits<float>::infinity();
      break;
    case Special::neg_inf:
      h[where] = -std::numeric_limits<float>::infinity();
      break;
    case Special::neg_zero_only:
      for (auto& v : h) v = -0.0f;
      break;
    case Special::largest_negative:
      h[where] = -1e6f;
      break;
  }
  qbl_test::DeviceArray<float> dx(h.size()), damax(1);
  ASSERT_TRUE(dx.ok() && damax.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), h));
  QBL_ASSERT_CUDA(cudaMemset(damax.get(), qbl_test::poison_byte, sizeof(float)));
  QBL_ASSERT_CUDA(qbl::amax(dx.get(offset), n, damax.get()));
  std::vector<float> got(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(got, damax.get()));
  const float want = cpu_amax(h, offset, static_cast<std::size_t>(n));
  if (special == Special::nan) {
    EXPECT_TRUE(std::isnan(got[0])) << "got " << got[0];
  } else {
    EXPECT_EQ(bits(got[0]), bits(want)) << "got " << got[0] << " want " << want;
  }
  if (special == Special::pos_inf || special == Special::neg_inf) {
    EXPECT_EQ(got[0], std::numeric_limits<float>::infinity());
  }
  if (special == Special::neg_zero_only) EXPECT_EQ(bits(got[0]), 0u);
  if (special == Special::largest_negative) EXPECT_EQ(got[0], 1e6f);
}

std::vector<AmaxCase> amax_cases() {
  std::vector<AmaxCase> c;
  for (std::int64_t n : {1, 3, 7, 65, 217, 2047, 2049, (1 << 24) + 3}) {
    for (std::size_t off : {0, 1}) {
      for (Special s : {Special::none, Special::nan, Special::pos_inf, Special::neg_inf,
                        Special::neg_zero_only, Special::largest_negative}) {
        c.push_back({n, off, s});
      }
    }
  }
  return c;
}

INSTANTIATE_TEST_SUITE_P(Sizes, AmaxDevice, ::testing::ValuesIn(amax_cases()),
                         [](const ::testing::TestParamInfo<AmaxCase>& i) {
                           return "n" + std::to_string(i.param.n) + "_off" +
                                  std::to_string(i.param.offset) + "_" +
                                  special_name(i.param.special);
                         });

TEST(AmaxDevice, EmptyInputGivesZero) {
  QBL_REQUIRE_GPU();
  qbl_test::DeviceArray<float> damax(1);
  QBL_ASSERT_CUDA(cudaMemset(damax.get(), qbl_test::poison_byte, sizeof(float)));
  QBL_ASSERT_CUDA(qbl::amax<float>(nullptr, 0, damax.get()));
  std::vector<float> got(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(got, damax.get()));
  EXPECT_EQ(bits(got[0]), 0u);
}

template <int BLOCK>
__global__ void block_abs_max(const float* x, float* out) {
  using BlockAmax = qbl::BlockAbsMax<float, BLOCK>;
  __shared__ typename BlockAmax::TempStorage temp;
  const float m = BlockAmax(temp).reduce(x[blockIdx.x * BLOCK + threadIdx.x]);
  if (threadIdx.x == 0) out[blockIdx.x] = m;
}

TEST(BlockAbsMax, EachBlockReducesItsOwnValues) {
  QBL_REQUIRE_GPU();
  constexpr int block = 128, blocks = 64;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> h = qbl_test::randn(block * blocks, seed);
  h[5 * block + 17] = std::numeric_limits<float>::quiet_NaN();
  h[9 * block + 3] = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < block; ++i) h[11 * block + i] = -0.0f;
  qbl_test::DeviceArray<float> dx(h.size()), dout(blocks);
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), h));
  block_abs_max<block><<<blocks, block>>>(dx.get(), dout.get());
  QBL_ASSERT_CUDA(cudaGetLastError());
  std::vector<float> got(blocks);
  QBL_ASSERT_CUDA(qbl_test::to_host(got, dout.get()));
  for (int b = 0; b < blocks; ++b) {
    const float want = cpu_amax(h, static_cast<std::size_t>(b) * block, block);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[b])) << "block " << b;
    } else {
      EXPECT_EQ(bits(got[b]), bits(want)) << "block " << b;
    }
  }
  EXPECT_EQ(bits(got[11]), 0u);
}

}  // namespace

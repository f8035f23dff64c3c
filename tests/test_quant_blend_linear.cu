// qbl/quant_blend_linear.cuh: the whole layer -- in one suite over every supported type triple
// and shape, mixed bit-exact against the CPU and out element by element within the GEMM's derived
// bound (tests/tolerance.hpp) of a float64 product of it -- and, in fp32, non-finite inputs,
// argument validation, moves, CUDA graphs and TF32. The plans it composes are tested on their own
// in test_layer_plans.cu.
#include <qbl/quant_blend_linear.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"
#include "tolerance.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using qbl_test::bits;
using Layer = qbl::QuantBlendLinear<float>;
constexpr std::uint32_t poison_bits = 0xffffffffu;

TEST(QuantBlendLinear, RejectsBadSizesBeforeTouchingCuda) {
  EXPECT_THROW(Layer(0, 4, 4), qbl::invalid_argument);
  EXPECT_THROW(Layer(4, 0, 4), qbl::invalid_argument);
  EXPECT_THROW(Layer(4, 4, 0), qbl::invalid_argument);
  EXPECT_THROW(Layer(-3, 4, 4), qbl::invalid_argument);
  EXPECT_THROW(Layer(4, 4, std::numeric_limits<std::int64_t>::max()), qbl::invalid_argument);
}

// The sizes, counted here by hand from the layouts the headers document (each part of a workspace
// 256-byte aligned): stats, the instance's mixed, and the larger of the two plans' workspaces
// (test_layer_plans.cu counts the plans' own).
TEST(QuantBlendLinear, WorkspaceBytesCountsEveryBuffer) {
  auto up = [](std::size_t b) { return (b + 255) / 256 * 256; };
  qbl::Options o;
  o.cublas_workspace_bytes = 1000;
  // Forward: the amax kernel's per-block maxima (4096 bytes), then the cuBLASLt workspace.
  EXPECT_EQ(Layer::workspace_bytes(64, 8, 10, o),
            2 * sizeof(float) + 64 * 10 * sizeof(float) + 4096 + 1000);
  // Backward: one cuBLASLt workspace where wgrad never runs beside dgrad; the column sum's
  // partials (64 ranges of `out` floats); g_mixed.
  // And room for a recomputed mixed (its backward with stats given and mixed null).
  o.backward = true;
  o.overlap_wgrad = qbl::Choice::no;
  const std::size_t one = up(1000) + up(64 * 8 * 4) + 2 * up(64 * 10 * 4);
  EXPECT_EQ(Layer::workspace_bytes(64, 8, 10, o),
            2 * sizeof(float) + 64 * 10 * sizeof(float) + one);
  // Two cuBLASLt workspaces where wgrad may run beside dgrad.
  o.overlap_wgrad = qbl::Choice::yes;
  EXPECT_EQ(Layer::workspace_bytes(64, 8, 10, o),
            2 * sizeof(float) + 64 * 10 * sizeof(float) + one + up(1000));
  EXPECT_EQ(qbl::Options{}.cublas_workspace_bytes, std::size_t{32} << 20);
  EXPECT_FALSE(qbl::Options{}.allow_tf32);
  EXPECT_FALSE(qbl::Options{}.autotune);
  EXPECT_FALSE(qbl::Options{}.backward);
  EXPECT_EQ(qbl::Options{}.overlap_wgrad, qbl::Choice::by_shape);
}

static_assert(!std::is_copy_constructible_v<Layer> && !std::is_copy_assignable_v<Layer>);
static_assert(std::is_nothrow_move_constructible_v<Layer> &&
              std::is_nothrow_move_assignable_v<Layer>);

__global__ void device_sigmoid(const float* l, float* alpha, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) alpha[i] = qbl::sigmoid(l[i]);
}

/// Inputs of one forward on the host and the device, and the CPU reference built from them.
struct Problem {
  std::int64_t tokens, in, out;
  std::size_t offset;
  bool bias;
  std::vector<float> x, logits, w, b;
  qbl_test::DeviceArray<float> dx, dl, dw, db, dout;

  Problem(std::int64_t t, std::int64_t i, std::int64_t o, std::size_t off, bool with_bias,
          std::uint64_t seed)
      : tokens(t),
        in(i),
        out(o),
        offset(off),
        bias(with_bias),
        x(qbl_test::randn(static_cast<std::size_t>(t * i), seed)),
        logits(qbl_test::randn(static_cast<std::size_t>(t), seed + 1, 2.0f)),
        w(qbl_test::randn(static_cast<std::size_t>(o * i), seed + 2, 1.0f / std::sqrt(float(i)))),
        b(qbl_test::randn(static_cast<std::size_t>(o), seed + 3)),
        dx(x.size() + off),
        dl(logits.size() + off),
        dw(w.size() + off),
        db(b.size() + off),
        dout(static_cast<std::size_t>(t * o) + off) {}

  cudaError_t upload() {
    cudaError_t e = qbl_test::to_device(dx.get(offset), x);
    if (e == cudaSuccess) e = qbl_test::to_device(dl.get(offset), logits);
    if (e == cudaSuccess) e = qbl_test::to_device(dw.get(offset), w);
    if (e == cudaSuccess) e = qbl_test::to_device(db.get(offset), b);
    if (e == cudaSuccess) e = poison_out();
    return e;
  }
  cudaError_t poison_out() {
    return cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(float));
  }
  void forward(Layer& layer, cudaStream_t s = nullptr) {
    layer.forward(dx.get(offset), dl.get(offset), dw.get(offset), bias ? db.get(offset) : nullptr,
                  dout.get(offset), tokens, s);
  }
  std::vector<float> result() {
    std::vector<float> r(static_cast<std::size_t>(tokens * out));
    EXPECT_EQ(qbl_test::to_host(r, dout.get(offset)), cudaSuccess);
    return r;
  }
  /// mixed as eager computes it, with alpha from the device's sigmoid.
  std::vector<float> reference_mixed() {
    qbl_test::DeviceArray<float> da(static_cast<std::size_t>(tokens));
    device_sigmoid<<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(offset), da.get(),
                                                                         tokens);
    std::vector<float> alpha(static_cast<std::size_t>(tokens));
    EXPECT_EQ(qbl_test::to_host(alpha, da.get()), cudaSuccess);
    return qbl_test::reference_mixed(qbl_test::DType::fp32, x, alpha, tokens, in);
  }
};

// ---- every supported type triple and shape ----------------------------------------------------

/// A layer shape: in_features, out_features, bias or none, the element offset of every pointer
/// (1: cuBLASLt refuses 16-bit pointers aligned to 2 bytes and the fallback kernel runs), and the
/// token counts a test runs it at, one forward each through one instance planned for 2049.
struct Shape {
  std::int64_t in, out;
  std::size_t offset;
  bool bias;
  std::vector<std::int64_t> tokens;
};

void PrintTo(const Shape& s, std::ostream* os) {
  *os << "in=" << s.in << " out=" << s.out << " offset=" << s.offset << " bias=" << s.bias
      << " tokens=";
  for (std::size_t i = 0; i < s.tokens.size(); ++i) *os << (i ? "," : "") << s.tokens[i];
}

std::string shape_name(const Shape& s) {
  return "in" + std::to_string(s.in) + "_out" + std::to_string(s.out) + "_off" +
         std::to_string(s.offset) + (s.bias ? "_bias" : "_nobias");
}

std::vector<Shape> shapes() {
  const std::vector<std::int64_t> sweep = {1, 3, 7, 65, 217, 2047, 2049};
  return {
      {256, 256, 0, true, sweep},  {96, 40, 1, true, sweep},
      {65, 217, 0, false, sweep},  // odd in_features: no 16-bit cuBLASLt algorithm
      {1024, 1024, 0, true, {8}},  // the single-launch prologue
      {512, 64, 1, true, {2049}},  // misaligned, the two-kernel prologue
      {256, 256, 1, true, {7}},    {256, 256, 0, false, {217}},
      {1024, 64, 0, false, {217}}, {45, 35, 0, true, {36}},
      {45, 64, 1, false, {300}},   {3, 1, 0, true, {5}},
  };
}

/// One forward per token count of the shape through one QuantBlendLinear<X, G, L>, on fresh
/// inputs of the triple's types: mixed bit for bit eager's (mixed.to(G) of the blend in X under
/// autocast), amax and scale eager's, every element of out written and within the G-typed GEMM's
/// bound of the float64 product of that mixed, on cuBLASLt or on the fallback kernel; and the same
/// inputs again give the same bits.
template <typename Types>
void run_shape(const Shape& sh, std::uint64_t seed) {
  using X = typename Types::x_type;
  using G = typename Types::gemm_type;
  using L = typename Types::logits_type;
  const qbl_test::TypeTriple tt = qbl_test::triple_of<Types>();
  const std::size_t off = sh.offset;
  qbl::QuantBlendLinear<X, G, L> layer(sh.in, sh.out, 2049);
  int fallback = 0;
  for (const std::int64_t tokens : sh.tokens) {
    SCOPED_TRACE("tokens " + std::to_string(tokens));
    const std::uint64_t s = seed + static_cast<std::uint64_t>(tokens);
    const auto nx = static_cast<std::size_t>(tokens * sh.in);
    const auto ny = static_cast<std::size_t>(tokens * sh.out);
    const std::vector<float> x = qbl_test::widen(qbl_test::convert<X>(qbl_test::randn(nx, s)));
    const std::vector<float> l =
        qbl_test::widen(qbl_test::convert<L>(qbl_test::randn(tokens, s + 1, 2.0f)));
    const std::vector<float> w = qbl_test::widen(qbl_test::convert<G>(qbl_test::randn(
        static_cast<std::size_t>(sh.out * sh.in), s + 2, 1.0f / std::sqrt(float(sh.in)))));
    const std::vector<float> b =
        qbl_test::widen(qbl_test::convert<G>(qbl_test::randn(sh.out, s + 3)));
    qbl_test::DeviceArray<X> dx(nx + off);
    qbl_test::DeviceArray<L> dl(l.size() + off);
    qbl_test::DeviceArray<G> dw(w.size() + off), db(b.size() + off), dout(ny + off);
    qbl_test::DeviceArray<float> dalpha(l.size());
    QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(off), qbl_test::convert<X>(x)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(off), qbl_test::convert<L>(l)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(off), qbl_test::convert<G>(w)));
    QBL_ASSERT_CUDA(qbl_test::to_device(db.get(off), qbl_test::convert<G>(b)));
    QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(G)));
    const G* bias = sh.bias ? db.get(off) : nullptr;
    layer.forward(dx.get(off), dl.get(off), dw.get(off), bias, dout.get(off), tokens);
    typename qbl::QuantBlendLinear<X, G, L>::ForwardArgs args;
    args.weight = dw.get(off), args.bias = bias, args.out = dout.get(off), args.tokens = tokens;
    fallback += !layer.uses_cublaslt(args);
    qbl_test::device_sigmoid_t<L>
        <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(off), dalpha.get(), tokens);
    QBL_ASSERT_CUDA(cudaGetLastError());
    std::vector<float> alpha(l.size()), stats(2);
    std::vector<G> mixed(nx), out(ny);
    QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
    QBL_ASSERT_CUDA(qbl_test::to_host(mixed, layer.device_mixed()));
    QBL_ASSERT_CUDA(qbl_test::to_host(out, dout.get(off)));
    QBL_ASSERT_CUDA(
        cudaMemcpy(stats.data(), layer.device_amax(), 2 * sizeof(float), cudaMemcpyDeviceToHost));
    float amax = 0, scale = 0;
    const std::vector<float> want_mixed =
        qbl_test::reference_mixed(tt.x, tt.logits, tt.gemm, x, alpha, tokens, sh.in, &amax, &scale);
    EXPECT_EQ(bits(stats[0]), bits(amax)) << "amax";
    EXPECT_EQ(bits(stats[1]), bits(scale)) << "scale";
    EXPECT_TRUE(
        qbl_test::bits_equal(qbl_test::widen(mixed), want_mixed, static_cast<std::size_t>(sh.in)))
        << "mixed";
    ASSERT_TRUE(qbl_test::all_written(out, "out"));
    const std::vector<float> got = qbl_test::widen(out);
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_FALSE(std::isnan(got[i])) << "out " << i;
    EXPECT_TRUE(qbl_test::within_dot_bounds(
        qbl_test::GemmArithmetic::of(tt.gemm), sh.in + (sh.bias ? 1 : 0), got,
        qbl_test::linear_values(want_mixed, w, sh.bias ? b.data() : nullptr, tokens, sh.in, sh.out),
        "out", qbl_test::max_finite(tt.gemm)));
    // Same inputs, same bits.
    QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(G)));
    layer.forward(dx.get(off), dl.get(off), dw.get(off), bias, dout.get(off), tokens);
    std::vector<G> again(ny);
    QBL_ASSERT_CUDA(qbl_test::to_host(again, dout.get(off)));
    EXPECT_TRUE(qbl_test::bits_equal(qbl_test::widen(again), got)) << "a repeated forward";
  }
  std::printf("[ %s %s ] token counts on the fallback GEMM: %d of %zu\n",
              qbl_test::types_name(tt).c_str(), shape_name(sh).c_str(), fallback, sh.tokens.size());
}

class QuantBlendLinearDevice : public ::testing::TestWithParam<qbl_test::Typed<Shape>> {};

TEST_P(QuantBlendLinearDevice, MixedIsExactAndOutWithinTheGemmBound) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto& c = GetParam();
  ASSERT_TRUE(
      qbl_test::with_types(c.types, [&](auto t) { run_shape<decltype(t)>(c.shape, seed); }));
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantBlendLinearDevice,
                         ::testing::ValuesIn(qbl_test::over_supported_types(shapes())),
                         qbl_test::TypedName{});

// ---- fp32: non-finite inputs, arguments, moves, graphs ------------------------------------

class QuantBlendLinearFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    QBL_REQUIRE_GPU();
    seed_ = qbl_test::fresh_seed();
    p_ = std::make_unique<Problem>(300, 128, 64, 0, true, seed_);
    ASSERT_EQ(p_->upload(), cudaSuccess);
    layer_ = std::make_unique<Layer>(128, 64, 512);
  }
  /// Asserts that the output buffer still holds the poison everywhere.
  void expect_out_untouched() {
    std::vector<float> all(p_->dout.size());
    ASSERT_EQ(qbl_test::to_host(all, p_->dout.get()), cudaSuccess);
    for (std::size_t i = 0; i < all.size(); ++i) ASSERT_EQ(bits(all[i]), poison_bits) << i;
  }
  std::uint64_t seed_ = 0;
  std::unique_ptr<Problem> p_;
  std::unique_ptr<Layer> layer_;
};

TEST_F(QuantBlendLinearFixture, NaNInXMakesEveryOutputNaN) {
  p_->x[12345] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(p_->upload(), cudaSuccess);
  p_->forward(*layer_);
  for (float v : p_->result()) ASSERT_TRUE(std::isnan(v));
}

TEST_F(QuantBlendLinearFixture, InfInXMakesEveryOutputNaN) {
  p_->x[7] = std::numeric_limits<float>::infinity();
  ASSERT_EQ(p_->upload(), cudaSuccess);
  p_->forward(*layer_);
  for (float v : p_->result()) ASSERT_TRUE(std::isnan(v));
}

TEST_F(QuantBlendLinearFixture, NaNLogitMakesItsRowNaN) {
  p_->logits[5] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(p_->upload(), cudaSuccess);
  p_->forward(*layer_);
  const auto r = p_->result();
  for (std::int64_t t = 0; t < p_->tokens; ++t)
    for (std::int64_t o = 0; o < p_->out; ++o)
      ASSERT_EQ(std::isnan(r[t * p_->out + o]), t == 5) << "token " << t << " col " << o;
}

TEST_F(QuantBlendLinearFixture, ZeroTokensIsANoOp) {
  EXPECT_NO_THROW(
      layer_->forward(p_->dx.get(), p_->dl.get(), p_->dw.get(), p_->db.get(), p_->dout.get(), 0));
  EXPECT_NO_THROW(layer_->forward(nullptr, nullptr, nullptr, nullptr, nullptr, 0));
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  expect_out_untouched();
}

TEST_F(QuantBlendLinearFixture, BadArgumentsThrowBeforeLaunching) {
  float* x = p_->dx.get();
  float* l = p_->dl.get();
  float* w = p_->dw.get();
  float* b = p_->db.get();
  float* out = p_->dout.get();
  const std::int64_t t = p_->tokens;
  EXPECT_THROW(layer_->forward(nullptr, l, w, b, out, t), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, nullptr, w, b, out, t), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, l, nullptr, b, out, t), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, l, w, b, nullptr, t), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, l, w, b, out, -1), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, l, w, b, out, 513), qbl::out_of_range);
  auto* odd = reinterpret_cast<float*>(reinterpret_cast<char*>(x) + 2);
  EXPECT_THROW(layer_->forward(odd, l, w, b, out, t), qbl::invalid_argument);
  EXPECT_THROW(layer_->forward(x, l, w, b, x, t), qbl::invalid_argument);      // out == x
  EXPECT_THROW(layer_->forward(x, l, w, b, w - 5, t), qbl::invalid_argument);  // out overlaps w
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  expect_out_untouched();
}

TEST_F(QuantBlendLinearFixture, MovedFromObjectThrowsAndMovedToWorks) {
  p_->forward(*layer_);
  const auto want = p_->result();
  Layer moved = std::move(*layer_);
  ASSERT_EQ(p_->poison_out(), cudaSuccess);
  EXPECT_THROW(p_->forward(*layer_), qbl::logic_error);
  expect_out_untouched();
  p_->forward(moved);
  EXPECT_TRUE(qbl_test::bits_equal(p_->result(), want));
  Layer assigned(8, 8, 8);
  assigned = std::move(moved);
  ASSERT_EQ(p_->poison_out(), cudaSuccess);
  p_->forward(assigned);
  EXPECT_TRUE(qbl_test::bits_equal(p_->result(), want));
}

TEST_F(QuantBlendLinearFixture, GraphReplayGivesTheSameBits) {
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // s is non-blocking: only a synchronization orders it after the default stream's uploads and
  // memsets (a memset of device memory, and the end of a copy from pageable memory, are
  // asynchronous to the host).
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  p_->forward(*layer_, s);
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  const auto eager = p_->result();

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  p_->forward(*layer_, s);
  QBL_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    QBL_ASSERT_CUDA(p_->poison_out());
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
    QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
    EXPECT_TRUE(qbl_test::bits_equal(p_->result(), eager)) << "replay " << rep;
  }
  // New inputs written into the captured buffers: the replay follows them.
  p_->x = qbl_test::randn(p_->x.size(), seed_ + 10, 3.0f);
  p_->logits = qbl_test::randn(p_->logits.size(), seed_ + 11);
  QBL_ASSERT_CUDA(p_->upload());
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  const auto replayed = p_->result();
  QBL_ASSERT_CUDA(p_->poison_out());
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  p_->forward(*layer_, s);
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_TRUE(qbl_test::bits_equal(replayed, p_->result()));
  EXPECT_FALSE(qbl_test::bits_equal(replayed, eager)) << "new inputs changed nothing";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// ---- TF32 ---------------------------------------------------------------------------------

TEST(QuantBlendLinearTf32, AllowTf32RunsTheFastModeWithinItsTolerance) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(1024, 512, 512, 0, true, seed);
  QBL_ASSERT_CUDA(p.upload());
  qbl::Options o;
  o.allow_tf32 = true;
  Layer tf32(512, 512, 1024, o), exact(512, 512, 1024);
  p.forward(tf32);
  const auto fast = p.result();
  p.forward(exact);
  const auto slow = p.result();
  const std::vector<float> mixed = p.reference_mixed();
  const auto values = qbl_test::linear_values(mixed, p.w, p.b.data(), p.tokens, p.in, p.out);
  EXPECT_TRUE(qbl_test::within_dot_bounds(qbl_test::GemmArithmetic::of(qbl_test::DType::fp32),
                                          p.in + 1, slow, values, "out (fp32)"));
  EXPECT_TRUE(qbl_test::within_dot_bounds(qbl_test::GemmArithmetic::of(qbl_test::DType::tf32),
                                          p.in + 1, fast, values, "out (TF32)"));
  // It did run in the reduced-precision mode: TF32's operand rounding shows.
  const auto product = qbl_test::linear_reference(mixed, p.w, p.b.data(), p.tokens, p.in, p.out);
  EXPECT_GT(qbl_test::relative_error(fast, product), 10 * qbl_test::relative_error(slow, product));
}

}  // namespace

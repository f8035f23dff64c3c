// qbl/quant_blend_linear.cuh: the whole layer -- mixed bit-exact against the CPU, out element by
// element within the GEMM's derived bound (tests/tolerance.hpp) of a float64 product of it,
// non-finite inputs, argument validation, moves and CUDA graphs.
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
// 256-byte aligned): stats, the instance's mixed, and the larger of the two plans' workspaces.
TEST(QuantBlendLinear, WorkspaceBytesCountsEveryBuffer) {
  auto up = [](std::size_t b) { return (b + 255) / 256 * 256; };
  qbl::Options o;
  o.cublas_workspace_bytes = 1000;
  // Forward: the amax kernel's per-block maxima (4096 bytes), then the cuBLASLt workspace.
  EXPECT_EQ(qbl::ForwardPlan<float>::workspace_bytes_for(1000), 4096u + 1000u);
  EXPECT_EQ(Layer::workspace_bytes(64, 8, 10, o),
            2 * sizeof(float) + 64 * 10 * sizeof(float) + 4096 + 1000);
  // Backward: one cuBLASLt workspace where wgrad never runs beside dgrad, two where it may; the
  // column sum's partials (64 ranges of `out` floats); the bias scratch; g_mixed.
  o.backward = true;
  o.overlap_wgrad = qbl::Choice::no;
  const std::size_t one = up(1000) + up(64 * 8 * 4) + up(8 * 4) + up(64 * 10 * 4);
  EXPECT_EQ(qbl::BackwardPlan<float>::workspace_bytes_for(64, 8, 10, 10, o), one);
  EXPECT_EQ(Layer::workspace_bytes(64, 8, 10, o),
            2 * sizeof(float) + 64 * 10 * sizeof(float) + one);
  o.overlap_wgrad = qbl::Choice::yes;
  EXPECT_EQ(qbl::BackwardPlan<float>::workspace_bytes_for(64, 8, 10, 10, o), one + up(1000));
  // g_mixed scales with the token count asked for; bf16 halves it.
  EXPECT_EQ(qbl::BackwardPlan<float>::workspace_bytes_for(64, 8, 10, 3, o),
            one + up(1000) - up(64 * 10 * 4) + up(64 * 3 * 4));
  EXPECT_EQ((qbl::BackwardPlan<float, __nv_bfloat16>::workspace_bytes_for(64, 8, 10, 10, o)),
            up(1000) * 2 + up(64 * 8 * 4) + up(8 * 2) + up(64 * 10 * 2));
  EXPECT_EQ(qbl::Options{}.cublas_workspace_bytes, std::size_t{32} << 20);
  EXPECT_FALSE(qbl::Options{}.allow_tf32);
  EXPECT_EQ(qbl::Options{}.overlap_wgrad, qbl::Choice::by_shape);
  EXPECT_EQ(qbl::Options{}.bias_from_epilogue, qbl::Choice::by_shape);
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

struct Case {
  std::int64_t tokens, in, out;
  std::size_t offset;
  bool bias;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "tokens=" << c.tokens << " in=" << c.in << " out=" << c.out << " offset=" << c.offset
      << " bias=" << c.bias;
}

class QuantBlendLinearDevice : public ::testing::TestWithParam<Case> {};

TEST_P(QuantBlendLinearDevice, MixedIsExactAndOutMatchesFloat64) {
  QBL_REQUIRE_GPU();
  const auto [tokens, in, out, offset, bias] = GetParam();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem p(tokens, in, out, offset, bias, seed);
  QBL_ASSERT_CUDA(p.upload());
  Layer layer(in, out, 2049);
  p.forward(layer);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());

  const std::vector<float> want_mixed = p.reference_mixed();
  std::vector<float> mixed(want_mixed.size());
  QBL_ASSERT_CUDA(qbl_test::to_host(mixed, layer.device_mixed()));
  EXPECT_TRUE(qbl_test::bits_equal(mixed, want_mixed, static_cast<std::size_t>(in)));

  const std::vector<float> got = p.result();
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NE(bits(got[i]), poison_bits) << "unwritten " << i;
  EXPECT_TRUE(qbl_test::within_dot_bounds(
      qbl_test::GemmArithmetic::of(qbl_test::DType::fp32), in + (bias ? 1 : 0), got,
      qbl_test::linear_values(want_mixed, p.w, bias ? p.b.data() : nullptr, tokens, in, out),
      "out"));

  std::vector<float> scale(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(scale, layer.device_scale()));
  EXPECT_EQ(bits(scale[0]),
            bits(qbl_test::reference_scale(qbl_test::DType::fp32, qbl_test::reference_amax(p.x))));

  // Same inputs, same bits.
  QBL_ASSERT_CUDA(p.poison_out());
  p.forward(layer);
  EXPECT_TRUE(qbl_test::bits_equal(p.result(), got));
}

std::vector<Case> cases() {
  std::vector<Case> c;
  for (std::int64_t t : {1, 3, 7, 65, 217, 2047, 2049}) {
    c.push_back({t, 256, 256, 0, true});
    c.push_back({t, 96, 40, 1, true});
    c.push_back({t, 65, 217, 0, false});
  }
  c.push_back({8, 1024, 1024, 0, true});   // the single-launch prologue
  c.push_back({2049, 512, 512, 1, true});  // misaligned, two-stage prologue
  return c;
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantBlendLinearDevice, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return "t" + std::to_string(i.param.tokens) + "_in" +
                                  std::to_string(i.param.in) + "_out" +
                                  std::to_string(i.param.out) + "_off" +
                                  std::to_string(i.param.offset) +
                                  (i.param.bias ? "_bias" : "_nobias");
                         });

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
    QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
    QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
    EXPECT_TRUE(qbl_test::bits_equal(p_->result(), eager)) << "replay " << rep;
  }
  // New inputs written into the captured buffers: the replay follows them.
  p_->x = qbl_test::randn(p_->x.size(), seed_ + 10, 3.0f);
  p_->logits = qbl_test::randn(p_->logits.size(), seed_ + 11);
  QBL_ASSERT_CUDA(p_->upload());
  QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  const auto replayed = p_->result();
  QBL_ASSERT_CUDA(p_->poison_out());
  p_->forward(*layer_, s);
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_TRUE(qbl_test::bits_equal(replayed, p_->result()));
  EXPECT_FALSE(qbl_test::bits_equal(replayed, eager)) << "new inputs changed nothing";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace

// ---- bf16, fp16 and TF32 -------------------------------------------------------------------

namespace {

using qbl_test::device_sigmoid_t;

template <typename T>
class QuantBlendLinear16 : public ::testing::Test {};
using qbl_test::Names16;
using qbl_test::Types16;
TYPED_TEST_SUITE(QuantBlendLinear16, Types16, Names16);

// Shapes with an even in_features run on cuBLASLt; an odd in_features (45), and pointers at an odd
// element offset where cuBLASLt refuses them, run on the fallback kernel: both must give eager's
// mixed and an out as accurate as the dtype allows.
TYPED_TEST(QuantBlendLinear16, MixedIsExactAndOutWithinTolerance) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Shape {
    std::int64_t tokens, in, out;
    std::size_t offset;
    bool bias;
  };
  int fallback = 0;
  for (const Shape sh :
       {Shape{1, 256, 256, 0, true}, Shape{7, 256, 256, 1, true}, Shape{2049, 256, 256, 0, true},
        Shape{217, 256, 256, 0, false}, Shape{36, 45, 35, 0, true}, Shape{300, 45, 64, 1, false},
        Shape{5, 3, 1, 0, true}}) {
    SCOPED_TRACE("tokens " + std::to_string(sh.tokens) + " in " + std::to_string(sh.in) + " out " +
                 std::to_string(sh.out) + " offset " + std::to_string(sh.offset));
    qbl::QuantBlendLinear<T> layer(sh.in, sh.out, 2049);
    const std::vector<float> xf =
        qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(sh.tokens * sh.in, seed)));
    const std::vector<float> lf =
        qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(sh.tokens, seed + 1, 2.0f)));
    const std::vector<float> wf =
        qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(sh.out * sh.in, seed + 2, 0.0625f)));
    const std::vector<float> bf =
        qbl_test::widen(qbl_test::convert<T>(qbl_test::randn(sh.out, seed + 3)));
    qbl_test::DeviceArray<T> dx(xf.size() + sh.offset), dl(lf.size() + sh.offset),
        dw(wf.size() + sh.offset), db(bf.size() + sh.offset), dout(sh.tokens * sh.out + sh.offset);
    qbl_test::DeviceArray<float> dalpha(sh.tokens);
    QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(sh.offset), qbl_test::convert<T>(xf)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(sh.offset), qbl_test::convert<T>(lf)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(sh.offset), qbl_test::convert<T>(wf)));
    QBL_ASSERT_CUDA(qbl_test::to_device(db.get(sh.offset), qbl_test::convert<T>(bf)));
    QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(T)));
    const T* bias = sh.bias ? db.get(sh.offset) : nullptr;
    layer.forward(dx.get(sh.offset), dl.get(sh.offset), dw.get(sh.offset), bias,
                  dout.get(sh.offset), sh.tokens);
    typename qbl::QuantBlendLinear<T>::ForwardArguments args;
    args.weight = dw.get(sh.offset), args.bias = bias, args.out = dout.get(sh.offset);
    args.tokens = sh.tokens;
    fallback += !layer.uses_cublaslt(args);
    device_sigmoid_t<T><<<static_cast<unsigned>((sh.tokens + 255) / 256), 256>>>(
        dl.get(sh.offset), dalpha.get(), sh.tokens);
    QBL_ASSERT_CUDA(cudaGetLastError());
    std::vector<float> alpha(sh.tokens);
    std::vector<T> mixed(xf.size()), out(sh.tokens * sh.out);
    QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
    QBL_ASSERT_CUDA(qbl_test::to_host(mixed, layer.device_mixed()));
    QBL_ASSERT_CUDA(qbl_test::to_host(out, dout.get(sh.offset)));
    const std::vector<float> want_mixed =
        qbl_test::reference_mixed(qbl_test::dtype_of<T>(), xf, alpha, sh.tokens, sh.in);
    EXPECT_TRUE(
        qbl_test::bits_equal(qbl_test::widen(mixed), want_mixed, static_cast<std::size_t>(sh.in)));
    const std::vector<float> got = qbl_test::widen(out);
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_FALSE(std::isnan(got[i])) << "unwritten or NaN " << i;
    EXPECT_TRUE(qbl_test::within_dot_bounds(
        qbl_test::GemmArithmetic::of(qbl_test::dtype_of<T>()), sh.in + (sh.bias ? 1 : 0), got,
        qbl_test::linear_values(want_mixed, wf, sh.bias ? bf.data() : nullptr, sh.tokens, sh.in,
                                sh.out),
        "out"));
  }
  std::printf("[ %s ] shapes on the fallback GEMM: %d of 7\n",
              std::is_same_v<T, __half> ? "fp16" : "bf16", fallback);
}

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

// ---- fp32 activations with a bf16 / fp16 GEMM (PyTorch's autocast) --------------------------

namespace {

template <typename M>
class QuantBlendLinearMixed : public ::testing::Test {};
TYPED_TEST_SUITE(QuantBlendLinearMixed, qbl_test::MixedTypeList, qbl_test::MixedTypeNames);

// fp32 x (and fp32 or 16-bit logits) into a 16-bit GEMM: mixed is eager's mixed.to(G) under
// autocast bit for bit (the cast fused into the prologue), amax and scale fp32's, and out as
// accurate as the G-typed GEMM of that mixed allows, on cuBLASLt and on the fallback.
TYPED_TEST(QuantBlendLinearMixed, MixedIsTheCastBlendAndOutWithinTolerance) {
  QBL_REQUIRE_GPU();
  using G = typename TypeParam::gemm;
  using L = typename TypeParam::logits;
  using MixedLayer = qbl::QuantBlendLinear<float, G, L>;
  const qbl_test::DType gt = qbl_test::dtype_of<G>(), lt = qbl_test::dtype_of<L>();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Shape {
    std::int64_t tokens, in, out;
    std::size_t offset;
    bool bias;
  };
  for (const Shape sh :
       {Shape{1, 256, 256, 0, true}, Shape{7, 256, 256, 1, true}, Shape{2049, 256, 256, 0, true},
        Shape{217, 1024, 64, 0, false}, Shape{36, 45, 35, 0, true}}) {
    SCOPED_TRACE("tokens " + std::to_string(sh.tokens) + " in " + std::to_string(sh.in) + " out " +
                 std::to_string(sh.out) + " offset " + std::to_string(sh.offset));
    MixedLayer layer(sh.in, sh.out, 2049);
    const std::vector<float> x = qbl_test::randn(sh.tokens * sh.in, seed);
    const std::vector<float> lf =
        qbl_test::widen(qbl_test::convert<L>(qbl_test::randn(sh.tokens, seed + 1, 2.0f)));
    const std::vector<float> wf =
        qbl_test::widen(qbl_test::convert<G>(qbl_test::randn(sh.out * sh.in, seed + 2, 0.0625f)));
    const std::vector<float> bf =
        qbl_test::widen(qbl_test::convert<G>(qbl_test::randn(sh.out, seed + 3)));
    qbl_test::DeviceArray<float> dx(x.size() + sh.offset), dalpha(sh.tokens);
    qbl_test::DeviceArray<L> dl(lf.size() + sh.offset);
    qbl_test::DeviceArray<G> dw(wf.size() + sh.offset), db(bf.size() + sh.offset),
        dout(sh.tokens * sh.out + sh.offset);
    QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(sh.offset), x));
    QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(sh.offset), qbl_test::convert<L>(lf)));
    QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(sh.offset), qbl_test::convert<G>(wf)));
    QBL_ASSERT_CUDA(qbl_test::to_device(db.get(sh.offset), qbl_test::convert<G>(bf)));
    QBL_ASSERT_CUDA(cudaMemset(dout.get(), qbl_test::poison_byte, dout.size() * sizeof(G)));
    const G* bias = sh.bias ? db.get(sh.offset) : nullptr;
    layer.forward(dx.get(sh.offset), dl.get(sh.offset), dw.get(sh.offset), bias,
                  dout.get(sh.offset), sh.tokens);
    device_sigmoid_t<L><<<static_cast<unsigned>((sh.tokens + 255) / 256), 256>>>(
        dl.get(sh.offset), dalpha.get(), sh.tokens);
    QBL_ASSERT_CUDA(cudaGetLastError());
    std::vector<float> alpha(sh.tokens), stats(2);
    std::vector<G> mixed(x.size()), out(sh.tokens * sh.out);
    QBL_ASSERT_CUDA(qbl_test::to_host(alpha, dalpha.get()));
    QBL_ASSERT_CUDA(qbl_test::to_host(mixed, layer.device_mixed()));
    QBL_ASSERT_CUDA(qbl_test::to_host(out, dout.get(sh.offset)));
    QBL_ASSERT_CUDA(
        cudaMemcpy(stats.data(), layer.device_amax(), 2 * sizeof(float), cudaMemcpyDeviceToHost));
    float amax = 0, scale = 0;
    const std::vector<float> want_mixed = qbl_test::reference_mixed(
        qbl_test::DType::fp32, lt, gt, x, alpha, sh.tokens, sh.in, &amax, &scale);
    EXPECT_EQ(bits(stats[0]), bits(amax));
    EXPECT_EQ(bits(stats[1]), bits(scale));
    EXPECT_TRUE(
        qbl_test::bits_equal(qbl_test::widen(mixed), want_mixed, static_cast<std::size_t>(sh.in)));
    const std::vector<float> got = qbl_test::widen(out);
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_FALSE(std::isnan(got[i])) << "unwritten or NaN " << i;
    EXPECT_TRUE(qbl_test::within_dot_bounds(
        qbl_test::GemmArithmetic::of(gt), sh.in + (sh.bias ? 1 : 0), got,
        qbl_test::linear_values(want_mixed, wf, sh.bias ? bf.data() : nullptr, sh.tokens, sh.in,
                                sh.out),
        "out"));
  }
}

}  // namespace

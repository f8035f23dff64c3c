// qbl/layer_plans.cuh: the forward and backward plans used directly, with the caller's workspace
// -- the same bits as qbl::QuantBlendLinear, a workspace that needs no initialization, one plan
// pair serving two streams on two threads at once (each with its own workspace) as it serves
// them one after the other, and the choices a backward plan makes from its shape.
#include <qbl/layer_plans.cuh>
#include <qbl/quant_blend_linear.cuh>

#include "test_support.hpp"

#include <cstring>
#include <thread>
#include <vector>

namespace {

using Fwd = qbl::ForwardPlan<float>;
using Bwd = qbl::BackwardPlan<float>;

/// One layer's inputs and outputs on the device.
struct Problem {
  std::int64_t tokens, in, out;
  qbl_test::DeviceArray<float> x, l, w, b, y, mixed, stats, go, gx, gl, gw, gb;
  Problem(std::int64_t t, std::int64_t i, std::int64_t o, std::uint64_t seed)
      : tokens(t),
        in(i),
        out(o),
        x(t * i),
        l(t),
        w(o * i),
        b(o),
        y(t * o),
        mixed(t * i),
        stats(2),
        go(t * o),
        gx(t * i),
        gl(t),
        gw(o * i),
        gb(o) {
    EXPECT_EQ(qbl_test::to_device(x.get(), qbl_test::randn(t * i, seed)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(l.get(), qbl_test::randn(t, seed + 1, 2.0f)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(w.get(), qbl_test::randn(o * i, seed + 2, 0.05f)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), qbl_test::randn(o, seed + 3)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(go.get(), qbl_test::randn(t * o, seed + 4)), cudaSuccess);
  }
  Fwd::Arguments forward_args() {
    Fwd::Arguments a;
    a.x = x.get(), a.logits = l.get(), a.weight = w.get(), a.bias = b.get(), a.out = y.get();
    a.mixed = mixed.get(), a.stats = stats.get(), a.tokens = tokens;
    return a;
  }
  Bwd::Arguments backward_args() {
    Bwd::Arguments a;
    a.grad_out = go.get(), a.x = x.get(), a.logits = l.get(), a.weight = w.get();
    a.mixed = mixed.get(), a.stats = stats.get(), a.tokens = tokens;
    a.grad_x = gx.get(), a.grad_logits = gl.get(), a.grad_weight = gw.get(), a.grad_bias = gb.get();
    return a;
  }
  /// Every output, as raw floats.
  std::vector<std::vector<float>> outputs(cudaStream_t s = nullptr) {
    std::vector<std::vector<float>> r;
    for (auto* a : {&y, &mixed, &stats, &gx, &gl, &gw, &gb}) {
      r.emplace_back(a->size());
      EXPECT_EQ(cudaMemcpyAsync(r.back().data(), a->get(), a->size() * sizeof(float),
                                cudaMemcpyDeviceToHost, s),
                cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return r;
  }
  void poison() {
    for (auto* a : {&y, &mixed, &stats, &gx, &gl, &gw, &gb})
      EXPECT_EQ(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)),
                cudaSuccess);
  }
};

/// A workspace of `bytes`, 256-byte aligned, filled with the poison: the plans need no
/// initialized workspace.
struct Workspace {
  qbl_test::DeviceArray<unsigned char> buf;
  explicit Workspace(std::size_t bytes) : buf(bytes) {
    EXPECT_EQ(cudaMemset(buf.get(), qbl_test::poison_byte, bytes), cudaSuccess);
  }
  void* get() const { return buf.get(); }
};

// The plans with a caller's workspace compute what the owning class computes, bit for bit, and
// the workspace sizes are what the plans say (QuantBlendLinear's is the larger of the two).
TEST(LayerPlans, PlansWithACallersWorkspaceEqualTheOwningClass) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const qbl::Choice overlap : {qbl::Choice::yes, qbl::Choice::no}) {
    SCOPED_TRACE(overlap == qbl::Choice::yes ? "wgrad beside dgrad" : "wgrad after dgrad");
    Problem p(700, 384, 160, seed), q(700, 384, 160, seed);
    qbl::Options o;
    o.overlap_wgrad = overlap;
    const Fwd fwd(p.in, p.out, 1024, o);
    const Bwd bwd(p.in, p.out, 1024, o);
    EXPECT_EQ(bwd.overlaps(p.tokens), overlap == qbl::Choice::yes);
    EXPECT_EQ(bwd.workspace_bytes(), Bwd::workspace_bytes_for(p.in, p.out, 1024, 1024, o));
    EXPECT_LT(bwd.workspace_bytes(p.tokens), bwd.workspace_bytes());
    Workspace ws(std::max(fwd.workspace_bytes(), bwd.workspace_bytes(p.tokens)));
    p.poison();
    ASSERT_TRUE(fwd.supports(p.forward_args()));
    ASSERT_TRUE(bwd.supports(p.backward_args()));
    fwd.run(p.forward_args(), ws.get());
    bwd.run(p.backward_args(), ws.get());
    const auto got = p.outputs();
    o.backward = true;
    qbl::QuantBlendLinear<float> layer(q.in, q.out, 1024, o);
    EXPECT_EQ(qbl::QuantBlendLinear<float>::workspace_bytes(q.in, q.out, 1024, o),
              2 * sizeof(float) + 1024 * q.in * sizeof(float) +
                  std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
    q.poison();
    qbl::ForwardArgs<float> fa = q.forward_args();
    layer.forward(fa);
    layer.backward(q.backward_args());
    const auto want = q.outputs();
    const char* names[] = {"out",         "mixed",       "stats",    "grad_x",
                           "grad_logits", "grad_weight", "grad_bias"};
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(qbl_test::bits_equal(got[i], want[i])) << names[i];
  }
}

// Plans are immutable: one pair serves two host threads, each with its own stream and workspace,
// at once -- wgrad forked to the plan's second stream from both -- and each thread's results equal
// the serial run of its inputs, every repetition.
TEST(LayerPlans, OnePlanPairServesTwoStreamsAtOnce) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  qbl::Options o;
  o.overlap_wgrad = qbl::Choice::yes;
  const std::int64_t tokens = 512, in = 256, out = 192;
  const Fwd fwd(in, out, tokens, o);
  const Bwd bwd(in, out, tokens, o);
  Problem a(tokens, in, out, seed), b(tokens, in, out, seed + 100);
  Workspace wa(std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
  Workspace wb(std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
  std::vector<std::vector<std::vector<float>>> serial;
  for (auto [p, w] : {std::pair<Problem*, Workspace*>{&a, &wa}, {&b, &wb}}) {
    p->poison();
    fwd.run(p->forward_args(), w->get());
    bwd.run(p->backward_args(), w->get());
    serial.push_back(p->outputs());
  }
  EXPECT_FALSE(qbl_test::bits_equal(serial[0][3], serial[1][3])) << "different inputs, same grad_x";
  const char* env = std::getenv("QBL_CONCURRENCY_REPS");
  const int reps = env != nullptr && *env != '\0' ? std::atoi(env) : 50;
  int mismatches[2] = {0, 0};
  std::vector<std::thread> threads;
  for (int j = 0; j < 2; ++j) {
    threads.emplace_back([&, j] {
      Problem& p = j == 0 ? a : b;
      Workspace& w = j == 0 ? wa : wb;
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        mismatches[j] = -1;
        return;
      }
      for (int rep = 0; rep < reps; ++rep) {
        fwd.run(p.forward_args(), w.get(), s);
        bwd.run(p.backward_args(), w.get(), s);
        const auto got = p.outputs(s);
        bool same = true;
        for (std::size_t i = 0; i < got.size(); ++i)
          same = same && std::memcmp(got[i].data(), serial[j][i].data(),
                                     got[i].size() * sizeof(float)) == 0;
        mismatches[j] += !same;
      }
      cudaStreamDestroy(s);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches[0], 0);
  EXPECT_EQ(mismatches[1], 0);
}

// What a backward plan decides from its shape (the measured rules of qbl/detail/layer_plans.inl):
// wgrad beside dgrad -- at every shape measured so far -- and the bias gradient from qbl's
// column sum, unless forced to the epilogue. Options force either.
TEST(LayerPlans, TheBackwardPlanChoosesByShapeUnlessForced) {
  QBL_REQUIRE_GPU();
  const Bwd small(256, 256, 64);
  EXPECT_TRUE(small.overlaps(64));
  const Bwd model(1024, 4096, 8192);
  EXPECT_TRUE(model.overlaps(1));
  EXPECT_TRUE(model.overlaps(8192));
  EXPECT_FALSE(model.bias_from_epilogue());
  qbl::Options o;
  o.overlap_wgrad = qbl::Choice::no;
  o.bias_from_epilogue = qbl::Choice::yes;
  const Bwd forced(256, 256, 64, o);
  EXPECT_FALSE(forced.overlaps(1));
  EXPECT_TRUE(forced.bias_from_epilogue());
  // Without a second stream the backward needs one cuBLASLt workspace, not two.
  EXPECT_EQ(small.workspace_bytes() - forced.workspace_bytes(), std::size_t{32} << 20);
}

// A moved-from plan refuses to run (and says so without throwing through supports()).
TEST(LayerPlans, MovedFromPlansRefuseToRun) {
  QBL_REQUIRE_GPU();
  Problem p(16, 32, 8, qbl_test::fresh_seed());
  Fwd fwd(p.in, p.out, 16);
  Bwd bwd(p.in, p.out, 16);
  Fwd f2 = std::move(fwd);
  Bwd b2 = std::move(bwd);
  Workspace ws(std::max(f2.workspace_bytes(), b2.workspace_bytes()));
  EXPECT_FALSE(fwd.supports(p.forward_args()));
  EXPECT_FALSE(bwd.supports(p.backward_args()));
  EXPECT_THROW(fwd.run(p.forward_args(), ws.get()), qbl::logic_error);
  EXPECT_THROW(bwd.run(p.backward_args(), ws.get()), qbl::logic_error);
  EXPECT_TRUE(f2.supports(p.forward_args()));
  EXPECT_NO_THROW(f2.run(p.forward_args(), ws.get()));
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
}

}  // namespace

// qbl/layer_plans.cuh: the forward and backward plans used directly, with the caller's workspace
// and side streams -- the same bits as qbl::QuantBlendLinear, the workspace sizes they report,
// the choices a backward plan makes from its shape, every argument check (each throwing its type
// before anything is launched), moved-from plans and side streams, and what an immutable plan
// promises: one plan pair serving two threads and streams at once, each with its own workspace
// and qbl::SideStream, wgrad beside dgrad on both, with the bits of serial runs -- also while one
// thread captures a CUDA graph and the other keeps running. And the plans with an input activation
// against the identity plans fed act(h), and a backward that recomputes mixed against one that
// reads it, bit for bit, each with a workspace of exactly what it asks for.
#include <qbl/activation.cuh>
#include <qbl/layer_plans.cuh>
#include <qbl/quant_blend_linear.cuh>

#include "test_support.hpp"
#include "test_support_device.cuh"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using qbl_test::bits;
using Fwd = qbl::ForwardPlan<float>;
using Bwd = qbl::BackwardPlan<float>;

static_assert(!std::is_copy_constructible_v<Fwd> && !std::is_copy_assignable_v<Fwd>);
static_assert(!std::is_copy_constructible_v<Bwd> && !std::is_copy_assignable_v<Bwd>);
static_assert(!std::is_copy_constructible_v<qbl::SideStream> &&
              !std::is_copy_assignable_v<qbl::SideStream>);
static_assert(std::is_nothrow_move_constructible_v<Bwd> &&
              std::is_nothrow_move_constructible_v<qbl::SideStream>);
static_assert(
    std::is_same_v<qbl::BackwardPlan<float, __nv_bfloat16, float>::gemm_type, __nv_bfloat16> &&
    std::is_same_v<qbl::ForwardPlan<float, __half, __half>::logits_type, __half>);

/// One layer's inputs and outputs on the device (fp32).
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
    upload(seed);
    EXPECT_EQ(qbl_test::to_device(w.get(), qbl_test::randn(o * i, seed + 2, 0.05f)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), qbl_test::randn(o, seed + 3)), cudaSuccess);
  }
  /// New x, logits and grad_out.
  void upload(std::uint64_t seed) {
    EXPECT_EQ(qbl_test::to_device(x.get(), qbl_test::randn(tokens * in, seed)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(l.get(), qbl_test::randn(tokens, seed + 1, 2.0f)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(go.get(), qbl_test::randn(tokens * out, seed + 4)), cudaSuccess);
  }
  Fwd::ForwardArgs forward_args() {
    Fwd::ForwardArgs a;
    a.x = x.get(), a.logits = l.get(), a.weight = w.get(), a.bias = b.get(), a.out = y.get();
    a.mixed = mixed.get(), a.stats = stats.get(), a.tokens = tokens;
    return a;
  }
  Bwd::BackwardArgs backward_args() {
    Bwd::BackwardArgs a;
    a.grad_out = go.get(), a.x = x.get(), a.logits = l.get(), a.weight = w.get();
    a.mixed = mixed.get(), a.stats = stats.get(), a.tokens = tokens;
    a.grad_x = gx.get(), a.grad_logits = gl.get(), a.grad_weight = gw.get(), a.grad_bias = gb.get();
    return a;
  }
  /// The forward's outputs and the backward's, in this order.
  std::vector<qbl_test::DeviceArray<float>*> all() {
    return {&y, &mixed, &stats, &gx, &gl, &gw, &gb};
  }
  std::vector<qbl_test::DeviceArray<float>*> gradients() { return {&gx, &gl, &gw, &gb}; }
  /// Every output, as raw floats.
  std::vector<std::vector<float>> outputs(cudaStream_t s = nullptr) { return read(all(), s); }
  static std::vector<std::vector<float>> read(const std::vector<qbl_test::DeviceArray<float>*>& v,
                                              cudaStream_t s) {
    std::vector<std::vector<float>> r;
    for (auto* a : v) {
      r.emplace_back(a->size());
      EXPECT_EQ(cudaMemcpyAsync(r.back().data(), a->get(), a->size() * sizeof(float),
                                cudaMemcpyDeviceToHost, s),
                cudaSuccess);
    }
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    return r;
  }
  void poison() {
    for (auto* a : all())
      EXPECT_EQ(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)),
                cudaSuccess);
  }
  /// Every gradient output still holds the poison, byte for byte.
  ::testing::AssertionResult gradients_untouched() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const char* names[] = {"grad_x", "grad_logits", "grad_weight", "grad_bias"};
    int k = 0;
    for (const auto& v : read(gradients(), nullptr)) {
      for (std::size_t i = 0; i < v.size(); ++i)
        if (!qbl_test::is_poison(v[i]))
          return ::testing::AssertionFailure() << names[k] << " written at " << i;
      ++k;
    }
    return ::testing::AssertionSuccess();
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

/// A non-blocking stream that destroys itself.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

bool same_bytes(const std::vector<std::vector<float>>& a,
                const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

const char* const output_names[] = {"out",         "mixed",       "stats",    "grad_x",
                                    "grad_logits", "grad_weight", "grad_bias"};

// ---- workspace sizes (CPU) ----------------------------------------------------------------------

// The sizes, counted here by hand from the layouts the headers document, each part 256-byte
// aligned. Forward: the amax kernel's per-block maxima (4096 bytes), then the cuBLASLt workspace.
// Backward: one cuBLASLt workspace where wgrad never runs beside dgrad, two where it may; the
// column sum's partials (64 ranges of `out` floats); g_mixed, [tokens, in] in the GEMM's type
// (where dgrad's product cannot go to grad_x); and, where mixed is recomputed, room for it (the
// same size). The queries without arguments count all of these.
TEST(LayerPlans, WorkspaceQueriesCountEveryPart) {
  auto up = [](std::size_t b) { return (b + 255) / 256 * 256; };
  qbl::Options o;
  o.cublas_workspace_bytes = 1000;
  EXPECT_EQ(Fwd::workspace_bytes_for(1000), 4096u + 1000u);
  EXPECT_EQ((qbl::ForwardPlan<float, __half, __half>::workspace_bytes_for(1000)), 4096u + 1000u);
  o.overlap_wgrad = qbl::Choice::no;
  const std::size_t one = up(1000) + up(64 * 8 * 4) + 2 * up(64 * 10 * 4);
  EXPECT_EQ(Bwd::workspace_bytes_for(64, 8, 10, 10, o), one);
  o.overlap_wgrad = qbl::Choice::yes;
  EXPECT_EQ(Bwd::workspace_bytes_for(64, 8, 10, 10, o), one + up(1000));
  // g_mixed and the recomputed mixed scale with the token count asked for (capped at
  // max_tokens); bf16 halves them.
  EXPECT_EQ(Bwd::workspace_bytes_for(64, 8, 10, 3, o),
            one + up(1000) - 2 * up(64 * 10 * 4) + 2 * up(64 * 3 * 4));
  EXPECT_EQ(Bwd::workspace_bytes_for(64, 8, 10, 100, o), one + up(1000));
  EXPECT_EQ((qbl::BackwardPlan<float, __nv_bfloat16>::workspace_bytes_for(64, 8, 10, 10, o)),
            up(1000) * 2 + up(64 * 8 * 4) + 2 * up(64 * 10 * 2));
  // by_shape puts wgrad beside dgrad at every shape measured so far: two workspaces.
  o.overlap_wgrad = qbl::Choice::by_shape;
  EXPECT_EQ(Bwd::workspace_bytes_for(64, 8, 10, 10, o), one + up(1000));
}

// ---- the plans against the owning class ---------------------------------------------------------

// The plans with a caller's workspace and side stream compute what the owning class computes, bit
// for bit, and the workspace sizes are what the plans say (QuantBlendLinear's is the larger of
// the two).
TEST(LayerPlans, PlansWithACallersWorkspaceEqualTheOwningClass) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  qbl::SideStream side;
  for (const qbl::Choice overlap : {qbl::Choice::yes, qbl::Choice::no}) {
    SCOPED_TRACE(overlap == qbl::Choice::yes ? "wgrad beside dgrad" : "wgrad on the same stream");
    Problem p(700, 384, 160, seed), q(700, 384, 160, seed);
    qbl::Options o;
    o.overlap_wgrad = overlap;
    const Fwd fwd(p.in, p.out, 1024, o);
    const Bwd bwd(p.in, p.out, 1024, o);
    EXPECT_EQ(bwd.overlaps(p.tokens), overlap == qbl::Choice::yes);
    EXPECT_EQ(bwd.workspace_bytes(), Bwd::workspace_bytes_for(p.in, p.out, 1024, 1024, o));
    EXPECT_EQ(fwd.workspace_bytes(), Fwd::workspace_bytes_for(o.cublas_workspace_bytes));
    EXPECT_LT(bwd.workspace_bytes(p.tokens), bwd.workspace_bytes());
    Workspace ws(std::max(fwd.workspace_bytes(), bwd.workspace_bytes(p.tokens)));
    p.poison();
    ASSERT_TRUE(fwd.supports(p.forward_args()));
    ASSERT_TRUE(bwd.supports(p.backward_args()));
    fwd.run(p.forward_args(), ws.get());
    bwd.run(p.backward_args(), ws.get(), &side);
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
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(qbl_test::bits_equal(got[i], want[i])) << output_names[i];
  }
}

// ---- the plan's choices -------------------------------------------------------------------------

// What a backward plan decides from its shape (the rule of qbl/detail/layer_plans.inl): wgrad
// beside dgrad at every shape measured so far. Options force either way.
TEST(LayerPlans, TheBackwardPlanChoosesByShapeUnlessForced) {
  QBL_REQUIRE_GPU();
  const Bwd small(256, 256, 64);
  EXPECT_TRUE(small.overlaps(64));
  const Bwd model(1024, 4096, 8192);
  EXPECT_TRUE(model.overlaps(1));
  EXPECT_TRUE(model.overlaps(8192));
  qbl::Options o;
  o.overlap_wgrad = qbl::Choice::no;
  const Bwd forced(256, 256, 64, o);
  EXPECT_FALSE(forced.overlaps(1));
  o.overlap_wgrad = qbl::Choice::yes;
  const Bwd beside(256, 256, 64, o);
  EXPECT_TRUE(beside.overlaps(64));
  // Without a second stream the backward needs one cuBLASLt workspace, not two.
  EXPECT_EQ(small.workspace_bytes() - forced.workspace_bytes(), std::size_t{32} << 20);
  EXPECT_EQ(beside.workspace_bytes(), small.workspace_bytes());
}

// ---- arguments ----------------------------------------------------------------------------------

// A moved-from plan refuses to run (and says so without throwing through supports()).
TEST(LayerPlans, MovedFromPlansRefuseToRun) {
  QBL_REQUIRE_GPU();
  Problem p(16, 32, 8, qbl_test::fresh_seed());
  Fwd fwd(p.in, p.out, 16);
  Bwd bwd(p.in, p.out, 16);
  Fwd f2 = std::move(fwd);
  Bwd b2 = std::move(bwd);
  Workspace ws(std::max(f2.workspace_bytes(), b2.workspace_bytes()));
  qbl::SideStream side;
  EXPECT_FALSE(fwd.supports(p.forward_args()));
  EXPECT_FALSE(bwd.supports(p.backward_args()));
  EXPECT_THROW(fwd.run(p.forward_args(), ws.get()), qbl::logic_error);
  EXPECT_THROW(bwd.run(p.backward_args(), ws.get(), &side), qbl::logic_error);
  EXPECT_THROW(fwd.local_amax(p.x.get(), p.tokens, p.stats.get()), qbl::logic_error);
  EXPECT_TRUE(f2.supports(p.forward_args()));
  EXPECT_NO_THROW(f2.run(p.forward_args(), ws.get()));
  EXPECT_TRUE(b2.supports(p.backward_args()));
  EXPECT_NO_THROW(b2.run(p.backward_args(), ws.get(), &side));
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
}

// tokens == 0 does nothing, whatever the pointers; so does a backward that wants no output.
TEST(LayerPlans, NothingToDoIsANoOp) {
  QBL_REQUIRE_GPU();
  Problem p(16, 32, 8, qbl_test::fresh_seed());
  const Fwd fwd(p.in, p.out, 16);
  const Bwd bwd(p.in, p.out, 16);
  Workspace ws(std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
  p.poison();
  EXPECT_NO_THROW(fwd.run(Fwd::ForwardArgs{}, nullptr));
  EXPECT_NO_THROW(bwd.run(Bwd::BackwardArgs{}, nullptr, nullptr));
  Bwd::BackwardArgs none = p.backward_args();
  none.grad_x = nullptr, none.grad_logits = nullptr, none.grad_weight = nullptr;
  none.grad_bias = nullptr;
  EXPECT_NO_THROW(bwd.run(none, nullptr, nullptr));
  Bwd::BackwardArgs zero = p.backward_args();
  zero.tokens = 0;
  EXPECT_NO_THROW(bwd.run(zero, ws.get(), nullptr));
  EXPECT_TRUE(p.gradients_untouched());
}

template <typename P>
P* odd(P* p) {
  return reinterpret_cast<P*>(reinterpret_cast<char*>(p) + 1);
}
template <typename P>
const P* odd(const P* p) {
  return reinterpret_cast<const P*>(reinterpret_cast<const char*>(p) + 1);
}

// ---- bad arguments: one named test each ---------------------------------------------------------

/// The exception a bad argument makes run() throw.
using qbl_test::Throws;

/// The forward's bad arguments: each is the full forward with one argument changed.
enum class ForwardBad {
  null_x,
  null_logits,
  null_weight,
  null_out,
  misaligned_x,
  misaligned_logits,
  misaligned_weight,
  misaligned_bias,
  misaligned_out,
  negative_tokens,
  tokens_above_max_tokens,
  unknown_amax_source,
  out_overlaps_x,
  out_overlaps_weight,
  out_overlaps_logits,
  out_overlaps_bias,
  null_mixed,
  null_stats,
  misaligned_mixed,
  misaligned_stats,
  mixed_overlaps_x,
  mixed_overlaps_out,
  stats_in_weight,
  stats_in_mixed,
};

/// One bad argument of the forward: the test's name, the change, what run() throws.
using ForwardCase = qbl_test::BadCase<ForwardBad>;

constexpr ForwardCase forward_cases[] = {
    {"NullX", ForwardBad::null_x, Throws::invalid_argument},
    {"NullLogits", ForwardBad::null_logits, Throws::invalid_argument},
    {"NullWeight", ForwardBad::null_weight, Throws::invalid_argument},
    {"NullOut", ForwardBad::null_out, Throws::invalid_argument},
    {"MisalignedX", ForwardBad::misaligned_x, Throws::invalid_argument},
    {"MisalignedLogits", ForwardBad::misaligned_logits, Throws::invalid_argument},
    {"MisalignedWeight", ForwardBad::misaligned_weight, Throws::invalid_argument},
    {"MisalignedBias", ForwardBad::misaligned_bias, Throws::invalid_argument},
    {"MisalignedOut", ForwardBad::misaligned_out, Throws::invalid_argument},
    {"NegativeTokens", ForwardBad::negative_tokens, Throws::invalid_argument},
    {"TokensAboveMaxTokens", ForwardBad::tokens_above_max_tokens, Throws::out_of_range},
    {"UnknownAmaxSource", ForwardBad::unknown_amax_source, Throws::invalid_argument},
    {"OutOverlapsX", ForwardBad::out_overlaps_x, Throws::invalid_argument},
    {"OutOverlapsWeight", ForwardBad::out_overlaps_weight, Throws::invalid_argument},
    {"OutOverlapsLogits", ForwardBad::out_overlaps_logits, Throws::invalid_argument},
    {"OutOverlapsBias", ForwardBad::out_overlaps_bias, Throws::invalid_argument},
    {"NullMixed", ForwardBad::null_mixed, Throws::invalid_argument},
    {"NullStats", ForwardBad::null_stats, Throws::invalid_argument},
    {"MisalignedMixed", ForwardBad::misaligned_mixed, Throws::invalid_argument},
    {"MisalignedStats", ForwardBad::misaligned_stats, Throws::invalid_argument},
    {"MixedOverlapsX", ForwardBad::mixed_overlaps_x, Throws::invalid_argument},
    {"MixedOverlapsOut", ForwardBad::mixed_overlaps_out, Throws::invalid_argument},
    {"StatsInWeight", ForwardBad::stats_in_weight, Throws::invalid_argument},
    {"StatsInMixed", ForwardBad::stats_in_mixed, Throws::invalid_argument},
};
static_assert(std::size(forward_cases) == 24, "the forward's table has 24 bad arguments");

/// Makes `a`, the arguments over buffers `b`, bad in the way `bad` names. A pointer offset by one
/// byte is misaligned for every type.
template <typename X, typename G, typename L>
void make_bad(ForwardBad bad, qbl::ForwardArgs<X, G, L>& a,
              const qbl_test::ForwardBuffers<X, G, L>& b) {
  G* const W = b.weight.get();
  G* const M = b.mixed.get();
  switch (bad) {
    case ForwardBad::null_x:
      a.x = nullptr;
      return;
    case ForwardBad::null_logits:
      a.logits = nullptr;
      return;
    case ForwardBad::null_weight:
      a.weight = nullptr;
      return;
    case ForwardBad::null_out:
      a.out = nullptr;
      return;
    case ForwardBad::misaligned_x:
      a.x = odd(a.x);
      return;
    case ForwardBad::misaligned_logits:
      a.logits = odd(a.logits);
      return;
    case ForwardBad::misaligned_weight:
      a.weight = odd(a.weight);
      return;
    case ForwardBad::misaligned_bias:
      a.bias = odd(a.bias);
      return;
    case ForwardBad::misaligned_out:
      a.out = odd(a.out);
      return;
    case ForwardBad::negative_tokens:
      a.tokens = -1;
      return;
    case ForwardBad::tokens_above_max_tokens:
      a.tokens = 513;
      return;
    case ForwardBad::unknown_amax_source:
      a.amax_source = static_cast<qbl::AmaxSource>(7);
      return;
    case ForwardBad::out_overlaps_x:
      a.out = reinterpret_cast<G*>(const_cast<X*>(a.x) + 64);
      return;
    case ForwardBad::out_overlaps_weight:
      a.out = W + 4;
      return;
    case ForwardBad::out_overlaps_logits:
      a.out = reinterpret_cast<G*>(const_cast<L*>(a.logits));
      return;
    case ForwardBad::out_overlaps_bias:
      a.out = const_cast<G*>(a.bias);
      return;
    case ForwardBad::null_mixed:
      a.mixed = nullptr;
      return;
    case ForwardBad::null_stats:
      a.stats = nullptr;
      return;
    case ForwardBad::misaligned_mixed:
      a.mixed = odd(a.mixed);
      return;
    case ForwardBad::misaligned_stats:
      a.stats = odd(a.stats);
      return;
    case ForwardBad::mixed_overlaps_x:
      a.mixed = reinterpret_cast<G*>(const_cast<X*>(a.x));
      return;
    case ForwardBad::mixed_overlaps_out:
      a.mixed = a.out + 1;
      return;
    case ForwardBad::stats_in_weight:
      a.stats = reinterpret_cast<float*>(W);
      return;
    case ForwardBad::stats_in_mixed:
      a.stats = reinterpret_cast<float*>(M);
      return;
  }
}

/// A forward plan of type triple T (a qbl::LayerTypes<X, G, L>) for 512 tokens over
/// qbl_test::ForwardBuffers, and a workspace of what the plan asks for.
template <typename T>
struct ForwardSetup {
  using X = typename T::x_type;
  using G = typename T::gemm_type;
  using L = typename T::logits_type;
  using Plan = qbl::ForwardPlan<X, G, L>;
  using Args = typename Plan::ForwardArgs;
  using Buffers = qbl_test::ForwardBuffers<X, G, L>;
  const Buffers buffers;
  Plan plan{Buffers::in, Buffers::out, 512};
  Workspace ws{plan.workspace_bytes()};
  /// The full forward's arguments, every pointer set, for all the tokens.
  Args good() const { return buffers.template arguments<Args>(); }
};

/// A ForwardSetup for every supported type triple, its buffers filled from a fresh seed each.
class ForwardPlanArguments : public qbl_test::EachTypeTriple<ForwardSetup> {};

class ForwardPlanBadArgument : public ForwardPlanArguments,
                               public ::testing::WithParamInterface<ForwardCase> {};

// For every supported type triple and both amax sources, the full forward with one argument
// changed throws its type before anything is launched -- out, mixed and stats keep their poison --
// and supports() says no to the same arguments.
TEST_P(ForwardPlanBadArgument, ThrowsItsTypeAndWritesNothing) {
  const ForwardCase& c = GetParam();
  for_each_triple([&](auto& s) {
    for (const qbl::AmaxSource source : {qbl::AmaxSource::x, qbl::AmaxSource::stats}) {
      SCOPED_TRACE(source == qbl::AmaxSource::x ? "amax from x" : "amax from stats");
      auto args = s.good();
      args.amax_source = source;
      make_bad(c.change, args, s.buffers);
      QBL_ASSERT_CUDA(s.buffers.poison());
      EXPECT_FALSE(s.plan.supports(args));
      qbl_test::expect_throws(c.throws, [&] { s.plan.run(args, s.ws.get()); });
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(s.buffers.untouched());
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Each, ForwardPlanBadArgument, ::testing::ValuesIn(forward_cases),
                         qbl_test::CaseName());

// Good arguments with a null workspace: supports() says yes (it does not see the workspace), run()
// throws qbl::invalid_argument before anything is launched.
TEST_F(ForwardPlanArguments, NullWorkspaceThrowsInvalidArgumentAndWritesNothing) {
  for_each_triple([&](auto& s) {
    QBL_ASSERT_CUDA(s.buffers.poison());
    EXPECT_TRUE(s.plan.supports(s.good()));
    EXPECT_THROW(s.plan.run(s.good(), nullptr), qbl::invalid_argument);
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(s.buffers.untouched());
  });
}

// A moved-from plan says no in supports() and throws qbl::logic_error from run().
TEST_F(ForwardPlanArguments, UseAfterMoveThrowsLogicErrorAndWritesNothing) {
  for_each_triple([&](auto& s) {
    QBL_ASSERT_CUDA(s.buffers.poison());
    typename std::decay_t<decltype(s)>::Plan taken = std::move(s.plan);
    EXPECT_FALSE(s.plan.supports(s.good()));
    EXPECT_THROW(s.plan.run(s.good(), s.ws.get()), qbl::logic_error);
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(s.buffers.untouched());
  });
}

/// The backward's tokens limit in its bad-argument tests.
constexpr std::int64_t backward_max_tokens = 512;

/// One bad argument of the backward (fp32): the test's name, the change made to the full
/// backward's arguments over a Problem, what run() throws.
using BackwardCase = qbl_test::BadCase<void (*)(Bwd::BackwardArgs& a, Problem& p)>;

using BArgs = Bwd::BackwardArgs;
constexpr Throws invalid = Throws::invalid_argument;

const BackwardCase backward_cases[] = {
    {"NullGradOut", [](BArgs& a, Problem&) { a.grad_out = nullptr; }, invalid},
    {"NullWeightGradXWanted", [](BArgs& a, Problem&) { a.weight = nullptr; }, invalid},
    {"NullLogitsGradXWanted", [](BArgs& a, Problem&) { a.logits = nullptr; }, invalid},
    {"NullWeightGradLogitsWanted",
     [](BArgs& a, Problem&) { a.weight = nullptr, a.grad_x = nullptr; }, invalid},
    {"NullLogitsGradLogitsWanted",
     [](BArgs& a, Problem&) { a.logits = nullptr, a.grad_x = nullptr; }, invalid},
    {"NullXGradLogitsWanted", [](BArgs& a, Problem&) { a.x = nullptr; }, invalid},
    {"NullStatsGradXWanted", [](BArgs& a, Problem&) { a.stats = nullptr; }, invalid},
    // A null mixed is recomputed where grad_weight is wanted: from x, logits and stats.
    {"NullMixedAndXOnlyGradWeightAndGradBiasWanted",
     [](BArgs& a, Problem&) {
       a.mixed = nullptr, a.x = nullptr, a.grad_x = nullptr, a.grad_logits = nullptr;
     },
     invalid},
    {"NullMixedAndStatsOnlyGradWeightAndGradBiasWanted",
     [](BArgs& a, Problem&) {
       a.mixed = nullptr, a.stats = nullptr, a.grad_x = nullptr, a.grad_logits = nullptr;
     },
     invalid},
    {"NullMixedAndLogitsOnlyGradWeightWanted",
     [](BArgs& a, Problem&) {
       a.mixed = nullptr, a.logits = nullptr, a.grad_x = nullptr, a.grad_logits = nullptr;
       a.grad_bias = nullptr;
     },
     invalid},
    {"MisalignedGradOut", [](BArgs& a, Problem&) { a.grad_out = odd(a.grad_out); }, invalid},
    {"MisalignedX", [](BArgs& a, Problem&) { a.x = odd(a.x); }, invalid},
    {"MisalignedWeight", [](BArgs& a, Problem&) { a.weight = odd(a.weight); }, invalid},
    {"MisalignedMixed", [](BArgs& a, Problem&) { a.mixed = odd(a.mixed); }, invalid},
    {"MisalignedStats", [](BArgs& a, Problem&) { a.stats = odd(a.stats); }, invalid},
    {"MisalignedGradX", [](BArgs& a, Problem&) { a.grad_x = odd(a.grad_x); }, invalid},
    {"MisalignedGradWeight", [](BArgs& a, Problem&) { a.grad_weight = odd(a.grad_weight); },
     invalid},
    {"MisalignedGradBias", [](BArgs& a, Problem&) { a.grad_bias = odd(a.grad_bias); }, invalid},
    {"NegativeTokens", [](BArgs& a, Problem&) { a.tokens = -1; }, invalid},
    {"TokensAboveMaxTokens", [](BArgs& a, Problem&) { a.tokens = backward_max_tokens + 1; },
     Throws::out_of_range},
    {"GradXIsX", [](BArgs& a, Problem& p) { a.grad_x = p.x.get(); }, invalid},
    {"GradXOverlapsGradOut", [](BArgs& a, Problem& p) { a.grad_x = p.go.get() + 100; }, invalid},
    {"GradLogitsIsLogits", [](BArgs& a, Problem& p) { a.grad_logits = p.l.get(); }, invalid},
    {"GradWeightIsWeight", [](BArgs& a, Problem& p) { a.grad_weight = p.w.get(); }, invalid},
    {"GradWeightOverlapsMixed", [](BArgs& a, Problem& p) { a.grad_weight = p.mixed.get() + 7; },
     invalid},
    {"GradBiasOverlapsStats", [](BArgs& a, Problem& p) { a.grad_bias = p.stats.get(); }, invalid},
    {"GradBiasInsideGradWeight", [](BArgs& a, Problem&) { a.grad_bias = a.grad_weight + 10; },
     invalid},
    {"GradLogitsInsideGradX", [](BArgs& a, Problem&) { a.grad_logits = a.grad_x + 3; }, invalid},
};
static_assert(std::size(backward_cases) == 28, "the backward's table has 28 bad arguments");

/// The backward's bad-argument setup (fp32): a Problem of 300 tokens, 128 -> 64 features, with the
/// forward already run, plans for 512 tokens, a workspace for both, a side stream, and the bits
/// that x and weight held before any backward.
class BackwardPlanArguments : public ::testing::Test {
 protected:
  void SetUp() override {
    QBL_REQUIRE_GPU();
    p_.emplace(300, 128, 64, qbl_test::fresh_seed());
    Problem& p = *p_;
    fwd_.emplace(p.in, p.out, backward_max_tokens);
    bwd_.emplace(p.in, p.out, backward_max_tokens);
    ws_.emplace(std::max(fwd_->workspace_bytes(), bwd_->workspace_bytes()));
    side_.emplace();
    p.poison();
    fwd_->run(p.forward_args(), ws_->get());
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    x_before_.resize(p.x.size());
    w_before_.resize(p.w.size());
    QBL_ASSERT_CUDA(qbl_test::to_host(x_before_, p.x.get()));
    QBL_ASSERT_CUDA(qbl_test::to_host(w_before_, p.w.get()));
  }

  void poison_gradients() {
    for (auto* a : p_->gradients())
      QBL_ASSERT_CUDA(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)));
  }

  /// Every gradient output keeps its poison, x and weight their values.
  void expect_untouched() {
    EXPECT_TRUE(p_->gradients_untouched());
    std::vector<float> x(x_before_.size()), w(w_before_.size());
    QBL_ASSERT_CUDA(qbl_test::to_host(x, p_->x.get()));
    QBL_ASSERT_CUDA(qbl_test::to_host(w, p_->w.get()));
    EXPECT_TRUE(qbl_test::bits_equal(x, x_before_)) << "x changed";
    EXPECT_TRUE(qbl_test::bits_equal(w, w_before_)) << "weight changed";
  }

  std::optional<Problem> p_;
  std::optional<Fwd> fwd_;
  std::optional<Bwd> bwd_;
  std::optional<Workspace> ws_;
  std::optional<qbl::SideStream> side_;
  std::vector<float> x_before_, w_before_;
};

class BackwardPlanBadArgument : public BackwardPlanArguments,
                                public ::testing::WithParamInterface<BackwardCase> {};

// With and without a side stream, the full backward (all four gradients) with one argument changed
// throws its type before anything is launched -- every gradient output keeps its poison, x and
// weight their values -- and supports() says no to the same arguments.
TEST_P(BackwardPlanBadArgument, ThrowsItsTypeAndTouchesNothing) {
  const BackwardCase& c = GetParam();
  for (qbl::SideStream* s : {&*side_, static_cast<qbl::SideStream*>(nullptr)}) {
    SCOPED_TRACE(s != nullptr ? "with a side stream" : "without a side stream");
    poison_gradients();
    BArgs args = p_->backward_args();
    c.change(args, *p_);
    EXPECT_FALSE(bwd_->supports(args)) << "supports() accepted what run() must reject";
    qbl_test::expect_throws(c.throws, [&] { bwd_->run(args, ws_->get(), s); });
    expect_untouched();
  }
}

INSTANTIATE_TEST_SUITE_P(Each, BackwardPlanBadArgument, ::testing::ValuesIn(backward_cases),
                         qbl_test::CaseName());

// Good arguments with a null workspace: supports() says yes, run() throws qbl::invalid_argument
// before anything is launched.
TEST_F(BackwardPlanArguments, NullWorkspaceThrowsInvalidArgumentAndTouchesNothing) {
  poison_gradients();
  EXPECT_TRUE(bwd_->supports(p_->backward_args()));
  EXPECT_THROW(bwd_->run(p_->backward_args(), nullptr, &*side_), qbl::invalid_argument);
  expect_untouched();
}

// ---- side streams -------------------------------------------------------------------------------

/// A backward problem with the forward already run, and the serial backward's results (no side
/// stream: wgrad serialized with dgrad).
struct SideStreamSetup {
  Problem p;
  qbl::Options o;
  Fwd fwd;
  Bwd bwd;
  Workspace ws;
  std::vector<std::vector<float>> serial;
  explicit SideStreamSetup(std::uint64_t seed)
      : p(64, 96, 40, seed),
        o(overlapping()),
        fwd(p.in, p.out, p.tokens, o),
        bwd(p.in, p.out, p.tokens, o),
        ws(std::max(fwd.workspace_bytes(), bwd.workspace_bytes())) {
    p.poison();
    fwd.run(p.forward_args(), ws.get());
    bwd.run(p.backward_args(), ws.get(), nullptr);
    serial = Problem::read(p.gradients(), nullptr);
  }
  static qbl::Options overlapping() {
    qbl::Options o;
    o.overlap_wgrad = qbl::Choice::yes;
    return o;
  }
  void poison_gradients() {
    for (auto* a : p.gradients())
      EXPECT_EQ(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)),
                cudaSuccess);
  }
};

// A moved-from qbl::SideStream is refused with qbl::invalid_argument before anything is launched;
// the one it moved into serves, with the serial run's bits.
TEST(LayerPlans, AMovedFromSideStreamIsRefusedBeforeLaunching) {
  QBL_REQUIRE_GPU();
  SideStreamSetup t(qbl_test::fresh_seed());
  ASSERT_TRUE(t.bwd.overlaps(t.p.tokens));
  qbl::SideStream a;
  EXPECT_TRUE(a.valid());
  qbl::SideStream b = std::move(a);
  EXPECT_FALSE(a.valid());
  EXPECT_TRUE(b.valid());
  t.poison_gradients();
  EXPECT_THROW(t.bwd.run(t.p.backward_args(), t.ws.get(), &a), qbl::invalid_argument);
  EXPECT_TRUE(t.p.gradients_untouched());
  qbl::SideStream c;
  c = std::move(b);
  EXPECT_FALSE(b.valid());
  EXPECT_THROW(t.bwd.run(t.p.backward_args(), t.ws.get(), &b), qbl::invalid_argument);
  EXPECT_TRUE(t.p.gradients_untouched());
  t.bwd.run(t.p.backward_args(), t.ws.get(), &c);
  const auto got = Problem::read(t.p.gradients(), nullptr);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(qbl_test::bits_equal(got[i], t.serial[i])) << output_names[3 + i];
}

// A side stream made on another device is refused with qbl::invalid_argument before anything is
// launched. Needs two devices.
TEST(LayerPlans, ASideStreamOfAnotherDeviceIsRefusedBeforeLaunching) {
  QBL_REQUIRE_GPU();
  int count = 0;
  QBL_ASSERT_CUDA(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices, this machine has " << count;
  QBL_ASSERT_CUDA(cudaSetDevice(0));
  SideStreamSetup t(qbl_test::fresh_seed());
  ASSERT_TRUE(t.bwd.overlaps(t.p.tokens));
  QBL_ASSERT_CUDA(cudaSetDevice(1));
  std::unique_ptr<qbl::SideStream> other = std::make_unique<qbl::SideStream>();
  QBL_ASSERT_CUDA(cudaSetDevice(0));
  EXPECT_EQ(other->device(), 1);
  EXPECT_EQ(t.bwd.device(), 0);
  t.poison_gradients();
  EXPECT_THROW(t.bwd.run(t.p.backward_args(), t.ws.get(), other.get()), qbl::invalid_argument);
  EXPECT_TRUE(t.p.gradients_untouched());
  QBL_ASSERT_CUDA(cudaSetDevice(1));
  other.reset();
  QBL_ASSERT_CUDA(cudaSetDevice(0));
}

// ---- one plan pair, two threads and streams -----------------------------------------------------

// Plans are immutable: one pair serves two host threads at once, each with its own stream,
// workspace and qbl::SideStream -- wgrad forked to each thread's own side stream -- and each
// thread's results, every repetition, equal the serial run of its inputs without a side stream
// (wgrad serialized with dgrad).
TEST(LayerPlans, TwoStreamsWithTheirOwnSideStreamsMatchSerialRuns) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  qbl::Options o;
  o.overlap_wgrad = qbl::Choice::yes;
  const std::int64_t tokens = 512, in = 256, out = 192;
  const Fwd fwd(in, out, tokens, o);
  const Bwd bwd(in, out, tokens, o);
  ASSERT_TRUE(bwd.overlaps(tokens));
  Problem a(tokens, in, out, seed), b(tokens, in, out, seed + 100);
  Workspace wa(std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
  Workspace wb(std::max(fwd.workspace_bytes(), bwd.workspace_bytes()));
  std::vector<std::vector<std::vector<float>>> serial;
  for (auto [p, w] : {std::pair<Problem*, Workspace*>{&a, &wa}, {&b, &wb}}) {
    p->poison();
    fwd.run(p->forward_args(), w->get());
    bwd.run(p->backward_args(), w->get(), nullptr);
    serial.push_back(p->outputs());
  }
  EXPECT_FALSE(qbl_test::bits_equal(serial[0][3], serial[1][3])) << "different inputs, same grad_x";
  int device = 0;
  QBL_ASSERT_CUDA(cudaGetDevice(&device));
  const char* env = std::getenv("QBL_CONCURRENCY_REPS");
  const int reps = env != nullptr && *env != '\0' ? std::atoi(env) : 50;
  int mismatches[2] = {0, 0}, ran[2] = {0, 0};
  std::string errors[2];
  std::vector<std::thread> threads;
  for (int j = 0; j < 2; ++j) {
    threads.emplace_back([&, j] {
      Problem& p = j == 0 ? a : b;
      Workspace& w = j == 0 ? wa : wb;
      try {
        if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
        Stream s;
        qbl::SideStream side;
        for (int rep = 0; rep < reps; ++rep) {
          for (auto* o : p.all())
            if (cudaMemsetAsync(o->get(), qbl_test::poison_byte, o->size() * sizeof(float), s.s) !=
                cudaSuccess)
              throw std::runtime_error("cudaMemsetAsync");
          fwd.run(p.forward_args(), w.get(), s.s);
          bwd.run(p.backward_args(), w.get(), &side, s.s);
          mismatches[j] += !same_bytes(p.outputs(s.s), serial[j]);
          ++ran[j];
        }
      } catch (const std::exception& e) {
        errors[j] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int j = 0; j < 2; ++j) {
    SCOPED_TRACE("thread " + std::to_string(j));
    EXPECT_EQ(errors[j], "");
    EXPECT_EQ(ran[j], reps);
    EXPECT_EQ(mismatches[j], 0);
  }
}

/// Host memory the device copies into without staging (pinned), so that a copy to it is an
/// asynchronous operation of its stream alone.
struct PinnedFloats {
  float* p = nullptr;
  std::size_t n = 0;
  explicit PinnedFloats(std::size_t count) : n(count) {
    if (cudaMallocHost(&p, n * sizeof(float)) != cudaSuccess) p = nullptr;
  }
  ~PinnedFloats() { cudaFreeHost(p); }
  PinnedFloats(const PinnedFloats&) = delete;
  PinnedFloats& operator=(const PinnedFloats&) = delete;
};

/// The capture test's two problems and what they run with: A, captured on stream sa with side_a,
/// and B, run on stream sb with side_b by the other thread, each with its own workspace. Filled
/// in by run_serially (the results both must keep) and prepare_for_capture (B's pinned buffers).
struct CaptureProblems {
  static constexpr int sets = 3;  ///< A's input sets (x, logits and grad_out)
  Problem a, b;
  Workspace wa, wb;
  Stream sa, sb;
  qbl::SideStream side_a, side_b;
  std::vector<std::vector<float>> want_b;  ///< B's gradients from the serial backward
  std::vector<std::unique_ptr<qbl_test::DeviceArray<float>>> xs, ls, gos;  ///< A's input sets
  std::vector<std::vector<std::vector<float>>> want_a;  ///< A's serial outputs of each set
  std::vector<std::unique_ptr<PinnedFloats>> host_b;    ///< where B's thread reads its gradients
  CaptureProblems(const Fwd& fwd, const Bwd& bwd, std::int64_t tokens, std::int64_t in,
                  std::int64_t out, std::uint64_t seed)
      : a(tokens, in, out, seed),
        b(tokens, in, out, seed + 100),
        wa(std::max(fwd.workspace_bytes(), bwd.workspace_bytes())),
        wb(std::max(fwd.workspace_bytes(), bwd.workspace_bytes())) {}
};

/// The serial runs on the default stream, after the uploads and poisons that went there. B: its
/// forward once, then the serial backward's gradients, what B's thread must keep getting. A: the
/// direct serial results of `sets` input sets, the inputs kept on the device for the replays.
void run_serially(CaptureProblems& t, const Fwd& fwd, const Bwd& bwd, std::uint64_t seed) {
  t.b.poison();
  fwd.run(t.b.forward_args(), t.wb.get());
  bwd.run(t.b.backward_args(), t.wb.get(), nullptr);
  t.want_b = Problem::read(t.b.gradients(), nullptr);
  for (int k = 0; k < CaptureProblems::sets; ++k) {
    t.a.upload(seed + 1000 * (k + 1));
    t.a.poison();
    fwd.run(t.a.forward_args(), t.wa.get());
    bwd.run(t.a.backward_args(), t.wa.get(), nullptr);
    t.want_a.push_back(t.a.outputs());
    for (auto [dst, src] : {std::pair{&t.xs, &t.a.x}, {&t.ls, &t.a.l}, {&t.gos, &t.a.go}}) {
      dst->push_back(std::make_unique<qbl_test::DeviceArray<float>>(src->size()));
      QBL_ASSERT_CUDA(cudaMemcpy(dst->back()->get(), src->get(), src->size() * sizeof(float),
                                 cudaMemcpyDeviceToDevice));
    }
  }
  EXPECT_FALSE(qbl_test::bits_equal(t.want_a[0][3], t.want_a[1][3]))
      << "different inputs, same grad_x";
}

/// Streams A and B are non-blocking: nothing orders them after the default stream's work but a
/// synchronization. Then both side streams are used once outside any capture, and B's pinned
/// buffers are allocated.
void prepare_for_capture(CaptureProblems& t, const Bwd& bwd) {
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  bwd.run(t.a.backward_args(), t.wa.get(), &t.side_a, t.sa.s);
  bwd.run(t.b.backward_args(), t.wb.get(), &t.side_b, t.sb.s);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bytes(Problem::read(t.b.gradients(), nullptr), t.want_b));
  for (auto* g : t.b.gradients()) {
    t.host_b.push_back(std::make_unique<PinnedFloats>(g->size()));
    ASSERT_NE(t.host_b.back()->p, nullptr);
  }
}

/// B's thread: backwards until told to stop, each checked against the serial result.
class BackwardRunner {
 public:
  /// `done` counts the finished backwards, and gains 1 << 20 when the thread ends.
  static constexpr int ended = 1 << 20;
  std::atomic<bool> stop{false};
  std::atomic<int> done{0};
  int mismatches = 0;
  std::string error;

  void start(CaptureProblems& t, const Bwd& bwd, int device) {
    thread_ = std::thread([this, &t, &bwd, device] { run(t, bwd, device); });
  }
  void stop_and_join() {
    stop = true;
    thread_.join();
  }
  int finished() const { return done.load() & (ended - 1); }

  /// Waits (no CUDA call) until the runner has finished `n` more backwards, or failed, or 300 s
  /// have passed (generous: under compute-sanitizer a backward takes seconds).
  bool wait_for(int n) {
    const int target = finished() + n;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
    while (done.load() < target && done.load() < ended &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    return done.load() >= target && done.load() < ended;
  }

 private:
  void run(CaptureProblems& t, const Bwd& bwd, int device) {
    try {
      if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice");
      const auto grads = t.b.gradients();
      while (!stop.load()) {
        for (auto* g : grads)
          if (cudaMemsetAsync(g->get(), qbl_test::poison_byte, g->size() * sizeof(float), t.sb.s) !=
              cudaSuccess)
            throw std::runtime_error("cudaMemsetAsync on B");
        bwd.run(t.b.backward_args(), t.wb.get(), &t.side_b, t.sb.s);
        for (std::size_t i = 0; i < grads.size(); ++i)
          if (cudaMemcpyAsync(t.host_b[i]->p, grads[i]->get(), grads[i]->size() * sizeof(float),
                              cudaMemcpyDeviceToHost, t.sb.s) != cudaSuccess)
            throw std::runtime_error("cudaMemcpyAsync on B");
        const cudaError_t e = cudaStreamSynchronize(t.sb.s);
        if (e != cudaSuccess)
          throw std::runtime_error(std::string("cudaStreamSynchronize(B): ") + cudaGetErrorName(e));
        mismatches += !same_pinned(t);
        done.fetch_add(1);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
    done.fetch_add(ended);  // wakes a waiting capture thread whatever happened
  }
  /// Do B's gradients, as last copied to the pinned buffers, equal the serial ones?
  static bool same_pinned(const CaptureProblems& t) {
    bool same = true;
    for (std::size_t i = 0; i < t.want_b.size(); ++i)
      same = same && std::memcmp(t.host_b[i]->p, t.want_b[i].data(),
                                 t.want_b[i].size() * sizeof(float)) == 0;
    return same;
  }
  std::thread thread_;
};

/// The capture of A's forward and backward, on this thread, while the runner runs: held open
/// until the runner has finished two more backwards. Stops the runner and checks what it and the
/// capture did; returns the graph (null where the capture failed to begin or end).
cudaGraph_t capture_while_running(CaptureProblems& t, const Fwd& fwd, const Bwd& bwd,
                                  BackwardRunner& runner, cudaStreamCaptureMode mode) {
  const bool running = runner.wait_for(1);
  EXPECT_TRUE(running) << "the other thread never completed a backward: " << runner.error;
  cudaGraph_t graph = nullptr;
  cudaError_t begin = cudaStreamBeginCapture(t.sa.s, mode), end = cudaErrorUnknown;
  EXPECT_EQ(begin, cudaSuccess);
  bool overlapped = false;
  if (begin == cudaSuccess) {
    std::string thrown;
    try {
      fwd.run(t.a.forward_args(), t.wa.get(), t.sa.s);
      bwd.run(t.a.backward_args(), t.wa.get(), &t.side_a, t.sa.s);
    } catch (const std::exception& e) {
      thrown = e.what();
    }
    overlapped = running && runner.wait_for(2);
    end = cudaStreamEndCapture(t.sa.s, &graph);
    EXPECT_EQ(thrown, "") << "a plan threw inside the capture";
  }
  runner.stop_and_join();
  EXPECT_EQ(end, cudaSuccess) << "the capture broke: " << cudaGetErrorName(end);
  EXPECT_TRUE(overlapped) << "the other thread did not finish two backwards during the capture";
  EXPECT_EQ(runner.error, "") << "the other thread failed";
  EXPECT_EQ(runner.mismatches, 0) << "of " << runner.finished() << " backwards on B";
  return graph;
}

/// The graph replayed with each of A's input sets in turn, twice over, copied into the captured
/// buffers: every replay gives the direct serial results of its set bit for bit. Destroys the
/// graph.
void replay_and_compare(CaptureProblems& t, cudaGraph_t graph) {
  cudaGraphExec_t exec = nullptr;
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2 * CaptureProblems::sets; ++rep) {
    const int k = rep % CaptureProblems::sets;
    SCOPED_TRACE("replay " + std::to_string(rep) + ", input set " + std::to_string(k));
    for (auto [dst, src] : {std::pair{&t.a.x, &t.xs}, {&t.a.l, &t.ls}, {&t.a.go, &t.gos}})
      QBL_ASSERT_CUDA(cudaMemcpyAsync(dst->get(), (*src)[k]->get(), dst->size() * sizeof(float),
                                      cudaMemcpyDeviceToDevice, t.sa.s));
    for (auto* o : t.a.all())
      QBL_ASSERT_CUDA(
          cudaMemsetAsync(o->get(), qbl_test::poison_byte, o->size() * sizeof(float), t.sa.s));
    QBL_ASSERT_CUDA(cudaGraphLaunch(exec, t.sa.s));
    const auto got = t.a.outputs(t.sa.s);
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(qbl_test::bits_equal(got[i], t.want_a[k][i])) << output_names[i];
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// One thread captures a forward and backward on its stream A, wgrad beside dgrad on its own
// qbl::SideStream, while another thread keeps running backwards of the same plans on stream B
// with a second SideStream. The capture must end cleanly -- nothing of B's work enters it, and
// nothing it captures waits on B -- B's backwards keep the serial run's bits all along, and the
// graph, replayed with new inputs copied into the captured buffers, gives the direct serial
// results of those inputs bit for bit. Everything is allocated, and every kernel loaded, before
// the capture begins. Thread-local mode: the running thread checks each backward with a
// synchronization of its own stream, which a global-mode capture forbids to every thread (CUDA
// answers cudaErrorStreamCaptureUnsupported and invalidates the capture, whatever the work).
void capture_while_another_thread_runs(cudaStreamCaptureMode mode) {
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  qbl::Options o;
  o.overlap_wgrad = qbl::Choice::yes;
  const std::int64_t tokens = 256, in = 192, out = 128;
  const Fwd fwd(in, out, tokens, o);
  const Bwd bwd(in, out, tokens, o);
  ASSERT_TRUE(bwd.overlaps(tokens));
  int device = 0;
  QBL_ASSERT_CUDA(cudaGetDevice(&device));
  CaptureProblems t(fwd, bwd, tokens, in, out, seed);
  run_serially(t, fwd, bwd, seed);
  if (::testing::Test::HasFatalFailure()) return;
  prepare_for_capture(t, bwd);
  if (::testing::Test::HasFatalFailure()) return;
  BackwardRunner runner;
  runner.start(t, bwd, device);
  const cudaGraph_t graph = capture_while_running(t, fwd, bwd, runner, mode);
  cudaGetLastError();
  if (graph == nullptr) return;
  replay_and_compare(t, graph);
}

TEST(LayerPlans, GraphCapturedInThreadLocalModeWhileAnotherThreadRunsBackwards) {
  QBL_REQUIRE_GPU();
  capture_while_another_thread_runs(cudaStreamCaptureModeThreadLocal);
}

// ---- the input activation and the recomputed mixed ----------------------------------------------

using qbl_test::ActivationCase;
using ActCases =
    ::testing::Types<ActivationCase<qbl::Gelu, float>, ActivationCase<qbl::Silu, __nv_bfloat16>,
                     ActivationCase<qbl::GeluTanh, float, __half, float>,
                     ActivationCase<qbl::Relu, __half>,
                     ActivationCase<qbl::Identity, __nv_bfloat16>,
                     ActivationCase<qbl::Identity, float, __nv_bfloat16, __nv_bfloat16>>;

template <typename T>
__global__ void activate_elements(const T* h, T* x, std::int64_t n, qbl::Activation which) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float v = qbl::detail::to_float(h[i]);
  float r = v;
  if (which == qbl::Activation::gelu) r = qbl::activate<qbl::Gelu, T>(v);
  if (which == qbl::Activation::gelu_tanh) r = qbl::activate<qbl::GeluTanh, T>(v);
  if (which == qbl::Activation::relu) r = qbl::activate<qbl::Relu, T>(v);
  if (which == qbl::Activation::silu) r = qbl::activate<qbl::Silu, T>(v);
  x[i] = qbl::detail::from_float<T>(r);
}

template <typename T>
__global__ void activate_gradients(const T* dx, const T* h, T* dh, std::int64_t n,
                                   qbl::Activation which) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float d = qbl::detail::to_float(dx[i]), v = qbl::detail::to_float(h[i]);
  float r = d;
  if (which == qbl::Activation::gelu) r = qbl::activate_backward<qbl::Gelu, T>(d, v);
  if (which == qbl::Activation::gelu_tanh) r = qbl::activate_backward<qbl::GeluTanh, T>(d, v);
  if (which == qbl::Activation::relu) r = qbl::activate_backward<qbl::Relu, T>(d, v);
  if (which == qbl::Activation::silu) r = qbl::activate_backward<qbl::Silu, T>(d, v);
  dh[i] = qbl::detail::from_float<T>(r);
}

/// A typed layer problem on the device: inputs, the forward's outputs and the four gradients.
template <typename X, typename G, typename L>
struct TypedProblem {
  std::int64_t tokens, in, out;
  qbl_test::DeviceArray<X> h, x, gx;
  qbl_test::DeviceArray<L> l, gl;
  qbl_test::DeviceArray<G> w, b, y, mixed, go, gw, gb;
  qbl_test::DeviceArray<float> stats;
  TypedProblem(std::int64_t t, std::int64_t i, std::int64_t o, std::uint64_t seed)
      : tokens(t),
        in(i),
        out(o),
        h(t * i),
        x(t * i),
        gx(t * i),
        l(t),
        gl(t),
        w(o * i),
        b(o),
        y(t * o),
        mixed(t * i),
        go(t * o),
        gw(o * i),
        gb(o),
        stats(2) {
    std::vector<float> hv = qbl_test::randn(t * i, seed, 2.0f);
    for (std::size_t k = 0; k < hv.size(); k += 13) hv[k] = (k % 26 == 0) ? -0.0f : 0.0f;
    EXPECT_EQ(qbl_test::to_device(h.get(), qbl_test::convert<X>(hv)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(l.get(), qbl_test::convert<L>(qbl_test::randn(t, seed + 1, 2))),
              cudaSuccess);
    EXPECT_EQ(
        qbl_test::to_device(w.get(), qbl_test::convert<G>(qbl_test::randn(o * i, seed + 2, 0.1f))),
        cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), qbl_test::convert<G>(qbl_test::randn(o, seed + 3))),
              cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(go.get(), qbl_test::convert<G>(qbl_test::randn(t * o, seed + 4))),
              cudaSuccess);
  }
  template <typename T>
  static std::vector<float> read(const qbl_test::DeviceArray<T>& a) {
    std::vector<T> v(a.size());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(qbl_test::to_host(v, a.get()), cudaSuccess);
    return qbl_test::widen(v);
  }
  void poison_gradients() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemset(gx.get(), qbl_test::poison_byte, gx.size() * sizeof(X)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gl.get(), qbl_test::poison_byte, gl.size() * sizeof(L)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gw.get(), qbl_test::poison_byte, gw.size() * sizeof(G)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gb.get(), qbl_test::poison_byte, gb.size() * sizeof(G)), cudaSuccess);
  }
  /// grad_x, grad_logits, grad_weight, grad_bias (widened).
  std::vector<std::vector<float>> gradients() { return {read(gx), read(gl), read(gw), read(gb)}; }
};

template <typename C>
class PlansWithActivation : public ::testing::Test {};
TYPED_TEST_SUITE(PlansWithActivation, ActCases, qbl_test::ActivationCaseNames);

/// A backward with a workspace of exactly workspace_bytes(args), poisoned.
template <typename B>
void run_backward(const B& bwd, const typename B::BackwardArgs& a, qbl::SideStream* side) {
  Workspace ws(bwd.workspace_bytes(a));
  bwd.run(a, ws.get(), side);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TYPED_TEST(PlansWithActivation, RecomputedMixedGivesTheKeptGradients) {
  QBL_REQUIRE_GPU();
  using C = TypeParam;
  using X = typename C::x_type;
  using G = typename C::gemm_type;
  using L = typename C::logits_type;
  using Fwd = qbl::ForwardPlan<X, G, L, typename C::Act>;
  using Bwd = qbl::BackwardPlan<X, G, L, typename C::Act>;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TypedProblem<X, G, L> p(300, 96, 64, seed);  // 300 x 96 > 2^15: the two-kernel prologue
  const Fwd fwd(p.in, p.out, 512);
  const Bwd bwd(p.in, p.out, 512);
  qbl::SideStream side;
  typename Fwd::ForwardArgs f;
  f.x = p.h.get(), f.logits = p.l.get(), f.weight = p.w.get(), f.bias = p.b.get();
  f.out = p.y.get(), f.mixed = p.mixed.get(), f.stats = p.stats.get(), f.tokens = p.tokens;
  Workspace fws(fwd.workspace_bytes());
  fwd.run(f, fws.get());
  typename Bwd::BackwardArgs a;
  a.grad_out = p.go.get(), a.x = p.h.get(), a.logits = p.l.get(), a.weight = p.w.get();
  a.mixed = p.mixed.get(), a.stats = p.stats.get(), a.tokens = p.tokens;
  a.grad_x = p.gx.get(), a.grad_logits = p.gl.get(), a.grad_weight = p.gw.get();
  a.grad_bias = p.gb.get();
  p.poison_gradients();
  run_backward(bwd, a, &side);
  const auto kept = p.gradients();
  const char* names[] = {"grad_x", "grad_logits", "grad_weight", "grad_bias"};
  // Recomputed: every gradient the same bits (the side stream is not used then).
  typename Bwd::BackwardArgs r = a;
  r.mixed = nullptr;
  EXPECT_LE(bwd.workspace_bytes(r), bwd.workspace_bytes());
  p.poison_gradients();
  run_backward(bwd, r, &side);
  auto got = p.gradients();
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(qbl_test::bits_equal(got[k], kept[k])) << names[k];
  // Recomputed without dgrad: only grad_weight and grad_bias wanted.
  r.grad_x = nullptr, r.grad_logits = nullptr, r.weight = nullptr;
  p.poison_gradients();
  run_backward(bwd, r, nullptr);
  got = p.gradients();
  for (int k = 2; k < 4; ++k) EXPECT_TRUE(qbl_test::bits_equal(got[k], kept[k])) << names[k];
  std::vector<X> raw(p.gx.size());
  QBL_ASSERT_CUDA(qbl_test::to_host(raw, p.gx.get()));
  EXPECT_TRUE(std::all_of(raw.begin(), raw.end(), [](const X& v) {
    return qbl_test::is_poison(v);
  })) << "grad_x written";
  // The owning class, its own buffers for the forward and a recomputed mixed for the backward.
  qbl::Options o;
  o.backward = true;
  qbl::QuantBlendLinear<X, G, L, typename C::Act> layer(p.in, p.out, 512, o);
  layer.forward(f);
  typename Bwd::BackwardArgs c = a;
  c.mixed = nullptr;  // stats given, mixed null: recomputed
  p.poison_gradients();
  layer.backward(c);
  got = p.gradients();
  for (int k = 0; k < 4; ++k)
    EXPECT_TRUE(qbl_test::bits_equal(got[k], kept[k])) << names[k] << " (QuantBlendLinear)";
}

TYPED_TEST(PlansWithActivation, EqualTheIdentityPlansFedTheActivation) {
  QBL_REQUIRE_GPU();
  using C = TypeParam;
  using Act = typename C::Act;
  using X = typename C::x_type;
  using G = typename C::gemm_type;
  using L = typename C::logits_type;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  TypedProblem<X, G, L> p(300, 96, 64, seed);
  TypedProblem<X, G, L> q(300, 96, 64, seed);  // the reference run's buffers, same inputs
  const std::int64_t n = p.tokens * p.in;
  const unsigned blocks = static_cast<unsigned>((n + 255) / 256);
  activate_elements<<<blocks, 256>>>(q.h.get(), q.x.get(), n, Act::kind);  // q.x = act(h)
  QBL_ASSERT_CUDA(cudaGetLastError());
  const qbl::ForwardPlan<X, G, L, Act> fwd(p.in, p.out, 512);
  const qbl::BackwardPlan<X, G, L, Act> bwd(p.in, p.out, 512);
  const qbl::ForwardPlan<X, G, L> fwd_id(p.in, p.out, 512);
  const qbl::BackwardPlan<X, G, L> bwd_id(p.in, p.out, 512);
  Workspace ws(std::max({fwd.workspace_bytes(), bwd.workspace_bytes(), fwd_id.workspace_bytes(),
                         bwd_id.workspace_bytes()}));
  auto run = [&](auto& f_plan, auto& b_plan, TypedProblem<X, G, L>& t, const X* input) {
    typename std::decay_t<decltype(f_plan)>::ForwardArgs f;
    f.x = input, f.logits = t.l.get(), f.weight = t.w.get(), f.bias = t.b.get();
    f.out = t.y.get(), f.mixed = t.mixed.get(), f.stats = t.stats.get(), f.tokens = t.tokens;
    f_plan.run(f, ws.get());
    typename std::decay_t<decltype(b_plan)>::BackwardArgs a;
    a.grad_out = t.go.get(), a.x = input, a.logits = t.l.get(), a.weight = t.w.get();
    a.mixed = t.mixed.get(), a.stats = t.stats.get(), a.tokens = t.tokens;
    a.grad_x = t.gx.get(), a.grad_logits = t.gl.get(), a.grad_weight = t.gw.get();
    a.grad_bias = t.gb.get();
    t.poison_gradients();
    b_plan.run(a, ws.get(), nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };
  run(fwd, bwd, p, p.h.get());
  run(fwd_id, bwd_id, q, q.x.get());
  // The reference's grad of h: act's backward of the identity plan's grad_x.
  activate_gradients<<<blocks, 256>>>(q.gx.get(), q.h.get(), q.gx.get(), n, Act::kind);
  QBL_ASSERT_CUDA(cudaGetLastError());
  EXPECT_TRUE(qbl_test::bits_equal(p.read(p.stats), q.read(q.stats))) << "stats";
  EXPECT_TRUE(qbl_test::bits_equal(p.read(p.mixed), q.read(q.mixed), p.in)) << "mixed";
  EXPECT_TRUE(qbl_test::bits_equal(p.read(p.y), q.read(q.y), p.out)) << "out";
  const char* names[] = {"grad of h", "grad_logits", "grad_weight", "grad_bias"};
  const auto got = p.gradients(), want = q.gradients();
  for (int k = 0; k < 4; ++k) EXPECT_TRUE(qbl_test::bits_equal(got[k], want[k])) << names[k];
}

}  // namespace

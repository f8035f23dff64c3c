// qbl/quant_blend_linear.cuh under stress: a bad-input matrix, long graph replays, concurrent
// instances, determinism and tensors past 2^31 elements.
#include <qbl/quant_blend_linear.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"
#include "tolerance.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

namespace {

using qbl_test::bits;
using Layer = qbl::QuantBlendLinear<float>;

/// One forward's buffers on the device, with fresh random contents.
struct Buffers {
  std::int64_t tokens, in, out;
  qbl_test::DeviceArray<float> x, l, w, b, y;
  Buffers(std::int64_t t, std::int64_t i, std::int64_t o, std::uint64_t seed)
      : tokens(t), in(i), out(o), x(t * i + 8), l(t + 8), w(o * i + 8), b(o + 8), y(t * o + 8) {
    upload(seed);
  }
  void upload(std::uint64_t seed) {
    EXPECT_EQ(qbl_test::to_device(x.get(), qbl_test::randn(tokens * in, seed)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(l.get(), qbl_test::randn(tokens, seed + 1, 2.0f)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(w.get(), qbl_test::randn(out * in, seed + 2, 0.05f)),
              cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), qbl_test::randn(out, seed + 3)), cudaSuccess);
  }
  void forward(Layer& layer, cudaStream_t s = nullptr) {
    layer.forward(x.get(), l.get(), w.get(), b.get(), y.get(), tokens, s);
  }
  /// The forward into `out` keeping `mixed` and `stats` for a backward.
  Layer::ForwardArgs args(float* out, float* mixed, float* stats) {
    Layer::ForwardArgs a;
    a.x = x.get(), a.logits = l.get(), a.weight = w.get(), a.bias = b.get(), a.out = out;
    a.mixed = mixed, a.stats = stats, a.tokens = tokens;
    return a;
  }
  /// That forward's backward from grad_out into the four gradients.
  Layer::BackwardArgs backward_args(const float* grad_out, const float* mixed, const float* stats,
                                    float* gx, float* gl, float* gw, float* gb) {
    Layer::BackwardArgs a;
    a.grad_out = grad_out, a.x = x.get(), a.logits = l.get(), a.weight = w.get();
    a.mixed = mixed, a.stats = stats, a.tokens = tokens;
    a.grad_x = gx, a.grad_logits = gl, a.grad_weight = gw, a.grad_bias = gb;
    return a;
  }
  std::vector<float> result() {
    std::vector<float> r(static_cast<std::size_t>(tokens * out));
    EXPECT_EQ(qbl_test::to_host(r, y.get()), cudaSuccess);
    return r;
  }
  cudaError_t poison() {
    return cudaMemset(y.get(), qbl_test::poison_byte, y.size() * sizeof(float));
  }
};

// ---- bad input: each case throws its type before anything is launched ---------------------

TEST(QuantBlendLinearBadInput, WorkspaceThatCannotBeAllocatedIsOutOfMemory) {
  QBL_REQUIRE_GPU();
  // 2^45 bytes of `mixed`: no GPU has that.
  EXPECT_THROW(Layer(4096, 16, std::int64_t{1} << 31), qbl::out_of_memory);
  // The failed cudaMalloc's error went out with the exception: not left behind as the thread's
  // last error, for the caller's next check or qbl's next launch check to report again.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  Layer fine(16, 16, 16);  // the device is still usable
  EXPECT_EQ(fine.max_tokens(), 16);
  Buffers b(16, 16, 16, 5);
  EXPECT_NO_THROW(b.forward(fine));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The layer's own rules, for every supported type triple -- a caller's mixed and stats come as a
// pair (both null: the instance's own), a moved-from instance refuses -- and a plan's refusal
// reaching the caller unchanged: each throws its type before anything is launched, and out, the
// caller's mixed and stats keep their poison. (The plan's checks are tested case by case in
// test_layer_plans.cu.)

/// A QuantBlendLinear of type triple T (a qbl::LayerTypes<X, G, L>) for 512 tokens over
/// qbl_test::ForwardBuffers.
template <typename T>
struct LayerSetup {
  using Layer =
      qbl::QuantBlendLinear<typename T::x_type, typename T::gemm_type, typename T::logits_type>;
  using Args = typename Layer::ForwardArgs;
  using Buffers =
      qbl_test::ForwardBuffers<typename T::x_type, typename T::gemm_type, typename T::logits_type>;
  const Buffers buffers;
  Layer layer{Buffers::in, Buffers::out, 512};
  /// The full forward's arguments, every pointer set, for all the tokens.
  Args good() const { return buffers.template arguments<Args>(); }
};

/// A LayerSetup for every supported type triple, its buffers filled from a fresh seed each.
class QuantBlendLinearArguments : public qbl_test::EachTypeTriple<LayerSetup> {};

/// The layer's own bad arguments (the plan's are test_layer_plans's), and two the plan checks,
/// to show the layer passes them on.
using qbl_test::Throws;
enum class LayerBad { null_mixed_stats_given, null_stats_mixed_given, null_x, tokens_above_max };
using LayerCase = qbl_test::BadCase<LayerBad>;
constexpr LayerCase layer_cases[] = {
    {"NullMixedStatsGiven", LayerBad::null_mixed_stats_given, Throws::invalid_argument},
    {"NullStatsMixedGiven", LayerBad::null_stats_mixed_given, Throws::invalid_argument},
    {"NullXThePlansCheck", LayerBad::null_x, Throws::invalid_argument},
    {"TokensAboveMaxTokensThePlansCheck", LayerBad::tokens_above_max, Throws::out_of_range},
};

template <typename Args>
void make_bad(LayerBad bad, Args& a) {
  switch (bad) {
    case LayerBad::null_mixed_stats_given:
      a.mixed = nullptr;
      return;
    case LayerBad::null_stats_mixed_given:
      a.stats = nullptr;
      return;
    case LayerBad::null_x:
      a.x = nullptr;
      return;
    case LayerBad::tokens_above_max:
      a.tokens = 513;
      return;
  }
}

class QuantBlendLinearBadArgument : public QuantBlendLinearArguments,
                                    public ::testing::WithParamInterface<LayerCase> {};

// For every supported type triple, the forward with one argument changed throws its type before
// anything is launched: out, mixed and stats keep their poison.
TEST_P(QuantBlendLinearBadArgument, ThrowsItsTypeAndWritesNothing) {
  const LayerCase& c = GetParam();
  for_each_triple([&](auto& s) {
    auto args = s.good();
    make_bad(c.change, args);
    QBL_ASSERT_CUDA(s.buffers.poison());
    qbl_test::expect_throws(c.throws, [&] { s.layer.forward(args); });
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(s.buffers.untouched());
  });
}

INSTANTIATE_TEST_SUITE_P(Each, QuantBlendLinearBadArgument, ::testing::ValuesIn(layer_cases),
                         qbl_test::CaseName());

// A moved-from layer's forward (both overloads) throws qbl::logic_error and writes nothing.
TEST_F(QuantBlendLinearArguments, UseAfterMoveThrowsLogicErrorAndWritesNothing) {
  for_each_triple([&](auto& s) {
    QBL_ASSERT_CUDA(s.buffers.poison());
    auto taken = std::move(s.layer);
    const auto& b = s.buffers;
    EXPECT_THROW(s.layer.forward(b.x.get(), b.logits.get(), b.weight.get(), b.bias.get(), b.y.get(),
                                 b.tokens),
                 qbl::logic_error);
    EXPECT_THROW(s.layer.forward_local_amax(b.x.get(), b.tokens, b.stats.get()), qbl::logic_error);
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_TRUE(s.buffers.untouched());
  });
}

// ---- forward and backward allocate nothing and never synchronize --------------------------
// A capture in cudaStreamCaptureModeGlobal prohibits every potentially unsafe call during it:
// cudaMalloc, synchronous copies and memsets, stream, event and device synchronization all fail
// the capture. Forward (both overloads) and backward captured that way must end the capture
// cleanly, and the graph must reproduce the direct calls bit for bit. The control shows that the
// mode does catch an allocation (so the check can fail); its refused calls are API errors to
// compute-sanitizer's memcheck, which leaves it out (tests/run_sanitizers.sh).
TEST(QuantBlendLinearCapture, GlobalModeRefusesAnAllocation) {
  QBL_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void* p = nullptr;
  EXPECT_NE(cudaMalloc(&p, 256), cudaSuccess) << "the capture mode let an allocation through";
  cudaGraph_t g = nullptr;
  EXPECT_NE(cudaStreamEndCapture(s, &g), cudaSuccess);
  if (g != nullptr) cudaGraphDestroy(g);
  if (p != nullptr) cudaFree(p);
  cudaGetLastError();
  cudaStreamDestroy(s);
}

TEST(QuantBlendLinearCapture, ForwardAndBackwardAllocateNothingAndNeverSynchronize) {
  QBL_REQUIRE_GPU();
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::int64_t tokens = 96, in = 160, out = 72;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Buffers io(tokens, in, out, seed);
  qbl_test::DeviceArray<float> go(tokens * out), mixed(tokens * in), stats(2), y2(tokens * out),
      gx(tokens * in), gl(tokens), gw(out * in), gb(out);
  QBL_ASSERT_CUDA(qbl_test::to_device(go.get(), qbl_test::randn(tokens * out, seed + 7)));
  qbl::Options o;
  o.backward = true;
  Layer layer(in, out, tokens, o);
  auto step = [&] {
    io.forward(layer, s);
    layer.forward(io.args(y2.get(), mixed.get(), stats.get()), s);
    layer.backward(io.backward_args(go.get(), mixed.get(), stats.get(), gx.get(), gl.get(),
                                    gw.get(), gb.get()),
                   s);
  };
  auto fetch = [&] {
    std::vector<std::vector<float>> r;
    for (auto* a : {&io.y, &y2, &gx, &gl, &gw, &gb}) {
      r.emplace_back(a->size());
      EXPECT_EQ(qbl_test::to_host(r.back(), a->get()), cudaSuccess);
    }
    return r;
  };
  // Both runs start from poisoned outputs, so the bytes past `out` (Buffers keeps 8 spare
  // elements) are compared too: written by neither.
  auto poison = [&] {
    for (auto* a : {&io.y, &y2, &gx, &gl, &gw, &gb})
      QBL_ASSERT_CUDA(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)));
  };
  poison();
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());  // s is non-blocking: ordered after the memsets
  step();
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  const auto want = fetch();
  poison();
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  step();
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "an unsafe call broke the capture";
  cudaGraphExec_t exec = nullptr;
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  const auto got = fetch();
  const char* names[] = {"out",         "out (caller buffers)", "grad_x",
                         "grad_logits", "grad_weight",          "grad_bias"};
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(qbl_test::bits_equal(got[i], want[i])) << names[i];
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// Options::cublas_workspace_bytes = 0: the GEMMs plan among algorithms that need no workspace;
// forward and backward must still be right: out, grad_weight and grad_bias within the GEMMs'
// bounds of their float64 values (tests/tolerance.hpp), grad_x within dgrad's bound times
// 1 - alpha, and grad_logits against an instance with the default workspace (a difference of
// nearly equal sums, which amplifies the GEMMs' last-bit differences).
__global__ void sigmoid_of(const float* l, float* alpha, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) alpha[i] = qbl::sigmoid(l[i]);
}

TEST(QuantBlendLinearOptions, ZeroCublasWorkspaceStillComputesEverything) {
  QBL_REQUIRE_GPU();
  const std::int64_t tokens = 200, in = 256, out = 96;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Buffers io(tokens, in, out, seed);
  qbl_test::DeviceArray<float> go(tokens * out), mixed(tokens * in), stats(2), gx(tokens * in),
      gl(tokens), gw(out * in), gb(out), alpha(tokens);
  const std::vector<float> g = qbl_test::randn(tokens * out, seed + 7);
  QBL_ASSERT_CUDA(qbl_test::to_device(go.get(), g));
  auto run = [&](std::size_t workspace) {
    qbl::Options o;
    o.backward = true;
    o.cublas_workspace_bytes = workspace;
    o.overlap_wgrad = qbl::Choice::yes;  // two GEMM workspaces
    Layer layer(in, out, tokens, o);
    // stats, mixed, and the larger workspace -- the backward's: two cuBLASLt workspaces, the
    // column sum's 64 x out floats, g_mixed and room for a recomputed mixed, each 256-byte
    // aligned.
    const std::size_t ws = (workspace + 255) / 256 * 256;
    const std::size_t rows = tokens * in * sizeof(float);
    EXPECT_EQ(Layer::workspace_bytes(in, out, tokens, o),
              2 * sizeof(float) + rows +
                  std::max<std::size_t>(4096 + workspace, 2 * ws + 64 * out * 4 + 2 * rows));
    for (auto* a : {&io.y, &gx, &gl, &gw, &gb})
      EXPECT_EQ(cudaMemset(a->get(), qbl_test::poison_byte, a->size() * sizeof(float)),
                cudaSuccess);
    layer.forward(io.args(io.y.get(), mixed.get(), stats.get()));
    layer.backward(io.backward_args(go.get(), mixed.get(), stats.get(), gx.get(), gl.get(),
                                    gw.get(), gb.get()));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::vector<float>> r;
    for (auto* a : {&io.y, &gx, &gl, &gw, &gb, &mixed}) {
      r.emplace_back(a->size());
      EXPECT_EQ(qbl_test::to_host(r.back(), a->get()), cudaSuccess);
    }
    // `out` has 8 spare elements past tokens x out: they must still hold the poison.
    for (std::size_t k = static_cast<std::size_t>(tokens * out); k < r[0].size(); ++k)
      EXPECT_EQ(bits(r[0][k]), 0xffffffffu) << "written past out at " << k;
    r[0].resize(static_cast<std::size_t>(tokens * out));
    return r;
  };
  const auto want = run(qbl::Options{}.cublas_workspace_bytes);
  const auto got = run(0);
  for (std::size_t i = 0; i + 1 < got.size(); ++i)
    for (std::size_t k = 0; k < got[i].size(); ++k)
      ASSERT_FALSE(std::isnan(got[i][k])) << "output " << i << " unwritten at " << k;
  // The inputs as the device holds them, and alpha from the device's sigmoid.
  std::vector<float> x(tokens * in), w(out * in), b(out), a(tokens);
  QBL_ASSERT_CUDA(qbl_test::to_host(x, io.x.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(w, io.w.get()));
  QBL_ASSERT_CUDA(qbl_test::to_host(b, io.b.get()));
  sigmoid_of<<<1, 256>>>(io.l.get(), alpha.get(), tokens);
  QBL_ASSERT_CUDA(qbl_test::to_host(a, alpha.get()));
  const std::vector<float> m = qbl_test::reference_mixed(qbl_test::DType::fp32, x, a, tokens, in);
  EXPECT_TRUE(qbl_test::bits_equal(got[5], m)) << "mixed";
  const auto fp32 = qbl_test::GemmArithmetic::of(qbl_test::DType::fp32);
  EXPECT_TRUE(qbl_test::within_dot_bounds(
      fp32, in + 1, got[0], qbl_test::linear_values(m, w, b.data(), tokens, in, out), "out"));
  EXPECT_TRUE(qbl_test::within_dot_bounds(
      fp32, tokens, got[3], qbl_test::wgrad_values(g, m, nullptr, tokens, in, out), "grad_weight"));
  EXPECT_TRUE(qbl_test::bias_grad_within_bounds(qbl_test::DType::fp32, tokens, got[4],
                                                qbl_test::bias_grad_values(g, tokens, out), nullptr,
                                                "grad_bias"));
  const auto dgrad = qbl_test::dgrad_values(g, w, tokens, in, out);
  int bad = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t i = 0; i < in; ++i) {
      const auto& v = dgrad[t * in + i];
      const double oma = static_cast<float>(1.0 - a[t]);
      const double bound =
          oma * qbl_test::dot_bound(fp32, out, v) + 0x1p-23 * (std::fabs(v.exact * oma) + 1e-30);
      const double e = got[1][t * in + i] - v.exact * oma;
      if (!(std::fabs(e) <= bound * (1 + 0x1p-20)) && bad++ < 8)
        ADD_FAILURE() << "grad_x[" << t << ", " << i << "]: " << got[1][t * in + i] << ", float64 "
                      << v.exact * oma << " +- " << bound;
    }
  EXPECT_EQ(bad, 0) << "grad_x";
  std::vector<double> ref(want[2].begin(), want[2].end());
  EXPECT_LT(qbl_test::relative_error(got[2], ref), 1e-3) << "grad_logits";
}

// Options::allocator: every byte of the instance and of its planning comes from the caller's
// allocator and all of it goes back, once, with the size it was asked with; what stays allocated
// after construction is workspace_bytes(); the results equal a cudaMalloc instance's bit for bit.
// An allocator that runs dry makes the constructor throw qbl::out_of_memory, leaking nothing.
struct CountingAllocator {
  std::map<void*, std::size_t> blocks;
  std::size_t live = 0, calls = 0, fail_at = 0, bad_frees = 0;
  static void* allocate(std::size_t bytes, void* context) {
    auto* self = static_cast<CountingAllocator*>(context);
    if (++self->calls == self->fail_at) return nullptr;
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
    self->blocks[p] = bytes;
    self->live += bytes;
    return p;
  }
  static void deallocate(void* p, std::size_t bytes, void* context) {
    auto* self = static_cast<CountingAllocator*>(context);
    const auto it = self->blocks.find(p);
    if (it == self->blocks.end() || it->second != bytes) {
      ++self->bad_frees;
      return;
    }
    self->live -= bytes;
    self->blocks.erase(it);
    cudaFree(p);
  }
  qbl::DeviceAllocator handle() {
    return {&CountingAllocator::allocate, &CountingAllocator::deallocate, this};
  }
};

TEST(QuantBlendLinearOptions, AllocatorServesEveryAllocationAndGetsItAllBack) {
  QBL_REQUIRE_GPU();
  const std::int64_t tokens = 300, in = 192, out = 80;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Buffers io(tokens, in, out, seed);
  qbl_test::DeviceArray<float> go(tokens * out), mixed(tokens * in), stats(2), gx(tokens * in),
      gl(tokens), gw(out * in), gb(out);
  QBL_ASSERT_CUDA(qbl_test::to_device(go.get(), qbl_test::randn(tokens * out, seed + 7)));
  // Every output is filled with `poison` first, a different byte for each run: an element the
  // layer left unwritten differs between the runs. `out` is read back without its padding.
  auto run = [&](Layer& layer, unsigned char poison) {
    for (auto* a : {&io.y, &mixed, &gx, &gl, &gw, &gb})
      EXPECT_EQ(cudaMemset(a->get(), poison, a->size() * sizeof(float)), cudaSuccess);
    layer.forward(io.args(io.y.get(), mixed.get(), stats.get()));
    layer.backward(io.backward_args(go.get(), mixed.get(), stats.get(), gx.get(), gl.get(),
                                    gw.get(), gb.get()));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::vector<float>> r{io.result()};
    for (auto* a : {&mixed, &gx, &gl, &gw, &gb}) {
      r.emplace_back(a->size());
      EXPECT_EQ(qbl_test::to_host(r.back(), a->get()), cudaSuccess);
    }
    return r;
  };
  qbl::Options plain;
  plain.backward = true;
  std::vector<std::vector<float>> want;
  {
    Layer layer(in, out, tokens, plain);
    want = run(layer, qbl_test::poison_byte);
  }
  CountingAllocator counter;
  qbl::Options o = plain;
  o.allocator = counter.handle();
  {
    Layer layer(in, out, tokens, o);
    EXPECT_EQ(counter.live, Layer::workspace_bytes(in, out, tokens, o));
    // planning took scratch beyond the workspace (trial operands), and gave it back
    EXPECT_GT(counter.calls, counter.blocks.size());
    const auto got = run(layer, 0x7f);
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(qbl_test::bits_equal(got[i], want[i]));
  }
  EXPECT_EQ(counter.live, 0u);
  EXPECT_TRUE(counter.blocks.empty());
  EXPECT_EQ(counter.bad_frees, 0u);

  // An allocator that runs dry at each allocation in turn: the constructor throws
  // qbl::out_of_memory and everything allocated before is given back.
  const std::size_t allocations = counter.calls;
  for (std::size_t fail = 1; fail <= allocations; ++fail) {
    CountingAllocator dry;
    dry.fail_at = fail;
    qbl::Options d = plain;
    d.allocator = dry.handle();
    EXPECT_THROW(Layer(in, out, tokens, d), qbl::out_of_memory) << "failing allocation " << fail;
    EXPECT_EQ(dry.live, 0u) << "failing allocation " << fail;
    EXPECT_EQ(dry.bad_frees, 0u);
  }

  // Half an allocator (one function set) is refused before anything is allocated.
  CountingAllocator half;
  qbl::Options h = plain;
  h.allocator = half.handle();
  h.allocator.deallocate = nullptr;
  EXPECT_THROW(Layer(in, out, tokens, h), qbl::invalid_argument);
  EXPECT_EQ(half.calls, 0u);
}

// ---- graphs, concurrency, determinism -------------------------------------------------------

// A graph of two forwards through one layer (the second overwrites the layer's `mixed` after the
// first GEMM has read it), replayed 10,000 times with new inputs copied into the same buffers
// before each replay: every checked replay equals the direct forward of those inputs, bit for bit.
TEST(QuantBlendLinearGraph, TenThousandReplaysWithChangingInputsGiveTheDirectResult) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int sets = 4;
  const std::int64_t tokens = 64, in = 256, out = 128;
  const std::size_t nx = static_cast<std::size_t>(tokens * in),
                    ny = static_cast<std::size_t>(tokens * out);
  Buffers a(tokens, in, out, seed), b(tokens, in, out, seed + 100);  // both forwards use a's w, b
  std::vector<std::unique_ptr<qbl_test::DeviceArray<float>>> xs, ls;
  for (int k = 0; k < sets; ++k) {
    xs.push_back(std::make_unique<qbl_test::DeviceArray<float>>(nx));
    ls.push_back(std::make_unique<qbl_test::DeviceArray<float>>(static_cast<std::size_t>(tokens)));
    QBL_ASSERT_CUDA(qbl_test::to_device(xs[k]->get(), qbl_test::randn(nx, seed + 10 * k + 1000)));
    QBL_ASSERT_CUDA(
        qbl_test::to_device(ls[k]->get(), qbl_test::randn(tokens, seed + 10 * k + 1001, 2.0f)));
  }
  Layer layer(in, out, tokens);
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // s is non-blocking: only a synchronization orders it after the default stream's uploads.
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  auto load = [&](Buffers& dst, int k) {
    QBL_ASSERT_CUDA(cudaMemcpyAsync(dst.x.get(), xs[k]->get(), nx * sizeof(float),
                                    cudaMemcpyDeviceToDevice, s));
    QBL_ASSERT_CUDA(cudaMemcpyAsync(dst.l.get(), ls[k]->get(), tokens * sizeof(float),
                                    cudaMemcpyDeviceToDevice, s));
  };
  auto forward = [&](Buffers& io) {
    layer.forward(io.x.get(), io.l.get(), a.w.get(), a.b.get(), io.y.get(), tokens, s);
  };
  // The direct (uncaptured) result of each input set.
  std::vector<std::vector<float>> want(sets, std::vector<float>(ny));
  for (int k = 0; k < sets; ++k) {
    load(a, k);
    forward(a);
    QBL_ASSERT_CUDA(
        cudaMemcpyAsync(want[k].data(), a.y.get(), ny * sizeof(float), cudaMemcpyDeviceToHost, s));
  }
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_FALSE(qbl_test::bits_equal(want[0], want[1])) << "different inputs, same output";
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  forward(a);
  forward(b);
  QBL_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  // QBL_GRAPH_REPLAYS shortens the run under the sanitizers (tests/run_sanitizers.sh).
  const char* env = std::getenv("QBL_GRAPH_REPLAYS");
  const int replays = env != nullptr && *env != '\0' ? std::atoi(env) : 10000;
  int checked = 0, bad = 0;
  std::vector<float> got_a(ny), got_b(ny);
  for (int rep = 0; rep < replays; ++rep) {
    const int ka = rep % sets, kb = (rep + 1) % sets;
    load(a, ka);
    load(b, kb);
    QBL_ASSERT_CUDA(cudaMemsetAsync(a.y.get(), qbl_test::poison_byte, ny * sizeof(float), s));
    QBL_ASSERT_CUDA(cudaMemsetAsync(b.y.get(), qbl_test::poison_byte, ny * sizeof(float), s));
    QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
    if (rep < 10 || rep % 100 == 99) {  // a full comparison every 100 replays
      QBL_ASSERT_CUDA(
          cudaMemcpyAsync(got_a.data(), a.y.get(), ny * sizeof(float), cudaMemcpyDeviceToHost, s));
      QBL_ASSERT_CUDA(
          cudaMemcpyAsync(got_b.data(), b.y.get(), ny * sizeof(float), cudaMemcpyDeviceToHost, s));
      QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
      const bool ok = std::memcmp(got_a.data(), want[ka].data(), ny * sizeof(float)) == 0 &&
                      std::memcmp(got_b.data(), want[kb].data(), ny * sizeof(float)) == 0;
      EXPECT_TRUE(ok) << "replay " << rep;
      bad += !ok;
      ++checked;
    }
  }
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_EQ(bad, 0) << "of " << checked << " checked replays";
  EXPECT_GE(checked, std::min(replays, 10));
  EXPECT_EQ(replays >= 10000, checked == 110);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(QuantBlendLinearConcurrency, FourThreadsWithOwnInstancesMatchSerialRuns) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Job {
    std::int64_t tokens, in, out;
  };
  const Job jobs[4] = {{1000, 256, 256}, {37, 96, 40}, {4096, 512, 128}, {8, 1024, 1024}};
  std::vector<std::unique_ptr<Buffers>> bufs;
  std::vector<std::unique_ptr<Layer>> layers;
  std::vector<std::vector<float>> serial;
  for (int j = 0; j < 4; ++j) {
    bufs.push_back(
        std::make_unique<Buffers>(jobs[j].tokens, jobs[j].in, jobs[j].out, seed + 10 * j));
    qbl::Options o;
    o.autotune = false;
    layers.push_back(std::make_unique<Layer>(jobs[j].in, jobs[j].out, jobs[j].tokens, o));
    bufs[j]->forward(*layers[j]);
    serial.push_back(bufs[j]->result());
  }
  // QBL_CONCURRENCY_REPS shortens the run under the sanitizers (tests/run_sanitizers.sh).
  const char* env = std::getenv("QBL_CONCURRENCY_REPS");
  const int reps = env != nullptr && *env != '\0' ? std::atoi(env) : 50;
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int j = 0; j < 4; ++j) {
    threads.emplace_back([&, j] {
      cudaStream_t s = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        mismatches[j] = -1;
        return;
      }
      std::vector<float> got(serial[j].size());
      for (int rep = 0; rep < reps; ++rep) {
        bufs[j]->forward(*layers[j], s);
        cudaMemcpyAsync(got.data(), bufs[j]->y.get(), got.size() * sizeof(float),
                        cudaMemcpyDeviceToHost, s);
        cudaStreamSynchronize(s);
        mismatches[j] += std::memcmp(got.data(), serial[j].data(), got.size() * sizeof(float)) != 0;
      }
      cudaStreamDestroy(s);
    });
  }
  for (auto& t : threads) t.join();
  for (int j = 0; j < 4; ++j) EXPECT_EQ(mismatches[j], 0) << "thread " << j;
}

// Default options: every instance runs cuBLASLt's first-ranked algorithm, so two instances (and
// two processes) give the same bits. With autotuning on, an instance's choice is fixed at
// construction: its own forwards repeat bit for bit.
TEST(QuantBlendLinearDeterminism, SameInputsSameBitsAcrossInstancesAndRepeats) {
  QBL_REQUIRE_GPU();
  Buffers buf(2049, 512, 384, qbl_test::fresh_seed());
  ASSERT_FALSE(qbl::Options{}.autotune);
  Layer a(512, 384, 4096), b(512, 384, 4096);
  EXPECT_EQ(a.forward_plan().gemm().describe(2049, true),
            b.forward_plan().gemm().describe(2049, true));
  buf.forward(a);
  const auto ra = buf.result();
  for (Layer* layer : {&b, &a, &b}) {
    ASSERT_EQ(buf.poison(), cudaSuccess);
    buf.forward(*layer);
    EXPECT_TRUE(qbl_test::bits_equal(buf.result(), ra));
  }
  qbl::Options tuned;
  tuned.autotune = true;
  Layer t(512, 384, 4096, tuned);
  buf.forward(t);
  const auto rt = buf.result();
  for (int rep = 0; rep < 3; ++rep) {
    ASSERT_EQ(buf.poison(), cudaSuccess);
    buf.forward(t);
    EXPECT_TRUE(qbl_test::bits_equal(buf.result(), rt));
  }
}

// ---- past 2^31 elements -------------------------------------------------------------------

TEST(QuantBlendLinearHuge, MoreThanTwoToThe31ElementsOfX) {
  QBL_REQUIRE_GPU();
  const std::int64_t tokens = std::int64_t{1} << 21, in = 1536, out = 16;
  const std::size_t n = static_cast<std::size_t>(tokens * in);  // 3.2e9 > 2^31
  std::size_t free_bytes = 0, total = 0;
  QBL_ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total));
  if (free_bytes < 3 * n * sizeof(float))
    GTEST_SKIP() << "needs " << 3 * n * 4 / (1 << 30) << " GiB of device memory";
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<float> x(n);
  {
    std::mt19937_64 gen(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t i = 0; i < (1u << 20); ++i) x[i] = nd(gen);
    for (std::size_t i = (1u << 20); i < n; ++i)
      x[i] = x[i % (1u << 20)] * (1.0f + (i >> 20) * 1e-7f);
    x[n - 5] = 9.5f;  // the amax sits past 2^31
  }
  const auto logits = qbl_test::randn(tokens, seed + 1, 2.0f);
  const auto w = qbl_test::randn(out * in, seed + 2, 0.02f);
  qbl_test::DeviceArray<float> dx(n), dl(tokens), dw(out * in), dy(tokens * out);
  ASSERT_TRUE(dx.ok() && dy.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), x));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), logits));
  QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(), w));
  QBL_ASSERT_CUDA(cudaMemset(dy.get(), qbl_test::poison_byte, tokens * out * sizeof(float)));
  Layer layer(in, out, tokens);
  layer.forward(dx.get(), dl.get(), dw.get(), nullptr, dy.get(), tokens);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> amax(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(amax, layer.device_amax()));
  EXPECT_EQ(amax[0], 9.5f);
  std::vector<float> y(static_cast<std::size_t>(tokens * out));
  QBL_ASSERT_CUDA(qbl_test::to_host(y, dy.get()));
  for (std::size_t i = 0; i < y.size(); ++i)
    ASSERT_NE(bits(y[i]), 0xffffffffu) << "unwritten " << i;
  // Rows spread over the whole range, the last ones included, against the CPU.
  const float scale = qbl_test::reference_scale(qbl_test::DType::fp32, 9.5f);
  // Rows spread over the whole range, the last one included, against the CPU. alpha comes from the
  // host's expf here, which may differ from the device's in the last place: compare to within that.
  std::vector<float> mixed_row(in);
  for (std::int64_t t :
       {std::int64_t{0}, std::int64_t{1} << 20, std::int64_t{1398101}, tokens - 1}) {
    QBL_ASSERT_CUDA(qbl_test::to_host(mixed_row, layer.device_mixed() + t * in));
    const float alpha = qbl::sigmoid(logits[t]);
    for (std::int64_t c = 0; c < in; ++c) {
      const float xv = x[t * in + c];
      const float want = qbl_test::reference_mixed(qbl_test::DType::fp32, xv, alpha, scale);
      const float slack = 4e-7f * (std::fabs(xv) + std::fabs(qbl_test::reference_fake_quant(
                                                       qbl_test::DType::fp32, xv, scale))) +
                          1e-30f;
      ASSERT_NEAR(mixed_row[c], want, slack) << "row " << t << " col " << c;
    }
  }
}

// The same past 2^31 elements in bf16 and fp16 (6.4 GB of x): the exact amax placed past 2^31,
// and rows from the whole range bit-equal to the reference, with alpha from the device's sigmoid.
template <typename T>
class QuantBlendLinearHuge16 : public ::testing::Test {};
TYPED_TEST_SUITE(QuantBlendLinearHuge16, qbl_test::Types16, qbl_test::Names16);

TYPED_TEST(QuantBlendLinearHuge16, MoreThanTwoToThe31ElementsOfX) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  constexpr qbl_test::DType dt = qbl_test::dtype_of<T>();
  const std::int64_t tokens = std::int64_t{1} << 21, in = 1536, out = 16;
  const std::size_t n = static_cast<std::size_t>(tokens * in);  // 3.2e9 > 2^31
  std::size_t free_bytes = 0, total = 0;
  QBL_ASSERT_CUDA(cudaMemGetInfo(&free_bytes, &total));
  if (free_bytes < 4 * n * sizeof(T))
    GTEST_SKIP() << "needs " << 4 * n * sizeof(T) / (1 << 30) << " GiB of device memory";
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<T> x(n);
  {
    const auto block = qbl_test::convert<T>(qbl_test::randn(std::size_t{1} << 20, seed));
    for (std::size_t i = 0; i < n; ++i) x[i] = block[i % block.size()];
    x[n - 5] = qbl_test::from_f<T>(9.5f);  // the amax sits past 2^31
  }
  const auto logits = qbl_test::convert<T>(qbl_test::randn(tokens, seed + 1, 2.0f));
  const auto w = qbl_test::convert<T>(qbl_test::randn(out * in, seed + 2, 0.02f));
  qbl_test::DeviceArray<T> dx(n), dl(tokens), dw(out * in), dy(tokens * out);
  ASSERT_TRUE(dx.ok() && dy.ok());
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), x));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), logits));
  QBL_ASSERT_CUDA(qbl_test::to_device(dw.get(), w));
  QBL_ASSERT_CUDA(cudaMemset(dy.get(), qbl_test::poison_byte, tokens * out * sizeof(T)));
  qbl::QuantBlendLinear<T> layer(in, out, tokens);
  layer.forward(dx.get(), dl.get(), dw.get(), nullptr, dy.get(), tokens);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> amax(1);
  QBL_ASSERT_CUDA(qbl_test::to_host(amax, layer.device_amax()));
  EXPECT_EQ(amax[0], 9.5f);
  {
    std::vector<T> y(static_cast<std::size_t>(tokens * out));
    QBL_ASSERT_CUDA(qbl_test::to_host(y, dy.get()));
    const auto* bytes = reinterpret_cast<const unsigned char*>(y.data());
    for (std::size_t i = 0; i < y.size(); ++i)
      ASSERT_FALSE(bytes[2 * i] == qbl_test::poison_byte &&
                   bytes[2 * i + 1] == qbl_test::poison_byte)
          << "unwritten " << i;
  }
  qbl_test::DeviceArray<float> da(tokens);
  qbl_test::device_sigmoid_t<T>
      <<<static_cast<unsigned>((tokens + 255) / 256), 256>>>(dl.get(), da.get(), tokens);
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> alpha(static_cast<std::size_t>(tokens));
  QBL_ASSERT_CUDA(qbl_test::to_host(alpha, da.get()));
  const float scale = qbl_test::reference_scale(dt, 9.5f);
  std::vector<T> row(static_cast<std::size_t>(in));
  for (std::int64_t t :
       {std::int64_t{0}, std::int64_t{1} << 20, std::int64_t{1398101}, tokens - 1}) {
    QBL_ASSERT_CUDA(qbl_test::to_host(row, layer.device_mixed() + t * in));
    std::vector<float> got = qbl_test::widen(row), want(got.size());
    for (std::int64_t c = 0; c < in; ++c)
      want[c] = qbl_test::reference_mixed(dt, qbl_test::to_f(x[t * in + c]), alpha[t], scale);
    EXPECT_TRUE(qbl_test::bits_equal(got, want)) << "row " << t;
  }
}

// ---- determinism across processes and devices ----------------------------------------------

// Forward and backward of fixed inputs (a fixed seed: the same in every process), all outputs as
// raw bytes.
std::vector<char> fixed_run() {
  const std::int64_t tokens = 777, in = 384, out = 320;
  Buffers io(tokens, in, out, 20261203);
  qbl_test::DeviceArray<float> go(tokens * out), mixed(tokens * in), stats(2), gx(tokens * in),
      gl(tokens), gw(out * in), gb(out);
  EXPECT_EQ(qbl_test::to_device(go.get(), qbl_test::randn(tokens * out, 7)), cudaSuccess);
  qbl::Options o;
  o.backward = true;
  Layer layer(in, out, 1024, o);
  layer.forward(io.args(io.y.get(), mixed.get(), stats.get()));
  layer.backward(
      io.backward_args(go.get(), mixed.get(), stats.get(), gx.get(), gl.get(), gw.get(), gb.get()));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // `out` without the 8 spare elements Buffers keeps past it: nothing writes those.
  std::vector<char> all;
  auto append = [&all](const std::vector<float>& h) {
    const char* p = reinterpret_cast<const char*>(h.data());
    all.insert(all.end(), p, p + h.size() * sizeof(float));
  };
  append(io.result());
  for (auto* a : {&mixed, &stats, &gx, &gl, &gw, &gb}) {
    std::vector<float> h(a->size());
    EXPECT_EQ(qbl_test::to_host(h, a->get()), cudaSuccess);
    append(h);
  }
  return all;
}

// The default options promise the same bits across processes on the same GPU model: two child
// processes of this binary and this process itself, forward and backward, byte for byte. A child
// is this same test with QBL_DETERMINISM_OUT set: it writes its bytes there and returns.
TEST(QuantBlendLinearDeterminism, SameBitsAcrossProcesses) {
  QBL_REQUIRE_GPU();
  const std::vector<char> mine = fixed_run();
  if (const char* out = std::getenv("QBL_DETERMINISM_OUT")) {
    std::ofstream f(out, std::ios::binary);
    f.write(mine.data(), static_cast<std::streamsize>(mine.size()));
    ASSERT_TRUE(f.good());
    return;
  }
  // The children run this binary by its path: /proc/self/exe inside std::system's command line
  // would name the shell.
  std::string self(4096, '\0');
  const ssize_t len = readlink("/proc/self/exe", self.data(), self.size() - 1);
  ASSERT_GT(len, 0) << "readlink(/proc/self/exe) failed";
  self.resize(static_cast<std::size_t>(len));
  for (int child = 0; child < 2; ++child) {
    const std::string path = ::testing::TempDir() + "qbl_determinism_" + std::to_string(child);
    std::remove(path.c_str());
    // The child runs this one test whatever gtest's sharding or output settings this process
    // was given: with GTEST_TOTAL_SHARDS inherited it would run no test in most shards, and with
    // GTEST_OUTPUT it would overwrite this process's report.
    const std::string cmd =
        "env -u GTEST_TOTAL_SHARDS -u GTEST_SHARD_INDEX -u GTEST_SHARD_STATUS_FILE"
        " -u GTEST_OUTPUT QBL_DETERMINISM_OUT='" +
        path + "' '" + self +
        "' --gtest_filter=QuantBlendLinearDeterminism."
        "SameBitsAcrossProcesses > /dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::ifstream f(path, std::ios::binary);
    ASSERT_TRUE(f.is_open()) << "child " << child << " wrote nothing: " << cmd;
    const std::vector<char> theirs((std::istreambuf_iterator<char>(f)),
                                   std::istreambuf_iterator<char>());
    ASSERT_EQ(theirs.size(), mine.size()) << "child " << child;
    EXPECT_TRUE(theirs == mine) << "child " << child << " computed other bits";
    std::remove(path.c_str());
  }
}

// A layer built on one device and called with another current: qbl::invalid_argument, nothing
// launched. Needs two devices.
TEST(QuantBlendLinearDevice, WrongCurrentDeviceThrowsBeforeLaunching) {
  QBL_REQUIRE_GPU();
  int count = 0;
  QBL_ASSERT_CUDA(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices, this machine has " << count;
  QBL_ASSERT_CUDA(cudaSetDevice(0));
  const std::int64_t tokens = 16, in = 32, out = 8;
  Buffers io(tokens, in, out, qbl_test::fresh_seed());
  qbl::Options o;
  o.backward = true;
  Layer layer(in, out, tokens, o);
  QBL_ASSERT_CUDA(io.poison());
  QBL_ASSERT_CUDA(cudaSetDevice(1));
  EXPECT_THROW(io.forward(layer), qbl::invalid_argument);
  Layer::BackwardArgs g;
  g.grad_out = io.y.get(), g.tokens = tokens, g.grad_bias = io.b.get();
  EXPECT_THROW(layer.backward(g), qbl::invalid_argument);
  QBL_ASSERT_CUDA(cudaSetDevice(0));
  std::vector<float> y(io.y.size());
  QBL_ASSERT_CUDA(qbl_test::to_host(y, io.y.get()));
  for (std::size_t i = 0; i < y.size(); ++i) ASSERT_EQ(bits(y[i]), 0xffffffffu) << "written " << i;
}

}  // namespace

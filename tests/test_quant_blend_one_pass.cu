// The layer's one-pass prologue (qbl/detail/quant_blend_one_pass.cuh): its plan's arithmetic on
// the CPU; on the GPU, each side of every threshold of the plan (the single-block path, all tiles
// held in registers, tiles held in shared memory, x larger than the chip holds, which takes the
// two-pass prologue) against the CPU reference bit
// for bit, in fp32, bf16 and fp16, vectorized and element-wise; repeated launches (the
// accumulator's reset), non-finite x, a refused launch falling back, SMs taken by another
// stream's kernel, graph replay, and the layer with and without Options::one_pass.
#include <qbl/quant_blend_linear.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl::detail::OnePassLimits;
using qbl::detail::OnePassPlan;
using qbl::detail::OnePassResidency;
using qbl::detail::OnePassState;
using qbl::detail::plan_one_pass;
using qbl_test::bits;

OnePassResidency residency(std::initializer_list<int> blocks) {
  OnePassResidency r;
  int h = 0;
  for (int b : blocks) {
    r.blocks[h] = b;
    if (b >= 1) r.max_held = h;
    ++h;
  }
  return r;
}

// ---- the plan (CPU) -----------------------------------------------------------------------

TEST(OnePassPlan, FewestHeldTilesThatHoldEverything) {
  // 2 multiprocessors; resident blocks per multiprocessor for 0..4 held tiles.
  const OnePassResidency r = residency({4, 3, 2, 2, 1});
  auto plan = [&](std::int64_t tiles) { return plan_one_pass(tiles, 2, r); };
  EXPECT_EQ(plan(0).blocks, 0);
  EXPECT_EQ(plan(1).blocks, 1);
  EXPECT_EQ(plan(1).held, 0);
  EXPECT_EQ(plan(8).blocks, 8);  // 2 x 4 blocks, one tile each
  EXPECT_EQ(plan(8).held, 0);
  EXPECT_EQ(plan(9).blocks, 5);  // one held: 2 x 3 blocks hold 12; 5 blocks suffice
  EXPECT_EQ(plan(9).held, 1);
  EXPECT_EQ(plan(12).blocks, 6);
  EXPECT_EQ(plan(12).held, 1);
  EXPECT_EQ(plan(13).blocks, 4);  // two held hold 12 (2 x 2 x 3): not enough; three hold 16
  EXPECT_EQ(plan(13).held, 3);
  EXPECT_EQ(plan(16).blocks, 4);
  EXPECT_EQ(plan(16).held, 3);
  // More than any grid holds: no one-pass plan (the two-pass prologue runs).
  EXPECT_EQ(plan(17).blocks, 0);
  EXPECT_EQ(plan(1000).blocks, 0);
}

TEST(OnePassPlan, NothingWhereNoGridFits) {
  EXPECT_EQ(plan_one_pass(5, 2, OnePassResidency{}).blocks, 0);
  EXPECT_EQ(plan_one_pass(5, 0, residency({4})).blocks, 0);
  // A residency of 0 blocks at some held counts (too much shared memory) is skipped.
  const OnePassResidency gap = residency({1, 0, 1});
  EXPECT_EQ(plan_one_pass(4, 2, gap).blocks, 2);
  EXPECT_EQ(plan_one_pass(4, 2, gap).held, 2);
  EXPECT_EQ(plan_one_pass(7, 2, gap).blocks, 0);
}

TEST(OnePassPlan, EveryBlockHasATileAndHoldsWhatItMust) {
  const OnePassResidency r = residency({8, 6, 4, 3, 3, 2, 1, 1});
  const int sms = 3;
  std::int64_t capacity = 0;
  for (int h = 0; h <= r.max_held; ++h)
    capacity = std::max<std::int64_t>(capacity, std::int64_t{sms} * r.blocks[h] * (h + 1));
  for (std::int64_t tiles = 1; tiles <= 3 * capacity; ++tiles) {
    const OnePassPlan p = plan_one_pass(tiles, sms, r);
    if (tiles > capacity) {
      EXPECT_EQ(p.blocks, 0) << tiles;
      continue;
    }
    ASSERT_GT(p.blocks, 0) << tiles;
    ASSERT_LE(p.blocks, tiles) << tiles;
    ASSERT_LE(p.blocks, std::int64_t{sms} * r.blocks[p.held]) << tiles;  // co-resident
    EXPECT_LE((tiles + p.blocks - 1) / p.blocks, p.held + 1) << tiles;   // every tile held
  }
}

// ---- the kernel against the CPU reference (GPU) --------------------------------------------

template <typename T>
class OnePass : public ::testing::Test {};
TYPED_TEST_SUITE(OnePass, qbl_test::AllTypes, qbl_test::AllTypeNames);

/// One prologue through qbl::detail::amax_quant_blend_layer, checked against the CPU reference.
template <typename T>
struct PrologueRun {
  PrologueRun(std::int64_t t, std::int64_t f, std::size_t o = 0)
      : tokens(t), features(f), offset(o) {}
  std::int64_t tokens, features;
  std::size_t offset;  // elements before x and mixed (1: not 16-byte aligned)
  float x_scale = 1.0f;
  std::uint64_t seed = 1;
  std::vector<std::pair<std::size_t, float>> edits;  // x[i] = v
};

class Runner {
 public:
  explicit Runner(cudaStream_t stream = nullptr) : stream_(stream) {}

  /// Runs `r` with `limits` and the state `state`; expects mixed, amax and scale bit-equal to the
  /// reference and nothing written outside mixed. Returns whether the one-pass kernel ran (the
  /// state's parity flipped).
  template <typename T>
  bool run(const PrologueRun<T>& r, const OnePassLimits& limits, OnePassState* state,
           const qbl::detail::LaunchLimits& two_pass) {
    const auto n = static_cast<std::size_t>(r.tokens * r.features);
    std::vector<float> xf = qbl_test::randn(n, r.seed);
    for (float& v : xf) v *= r.x_scale;
    for (auto [i, v] : r.edits) xf[i] = v;
    const std::vector<T> x = qbl_test::convert<T>(xf);
    const std::vector<T> l = qbl_test::convert<T>(qbl_test::randn(r.tokens, r.seed + 1, 2.0f));
    qbl_test::DeviceArray<T> dx(n + r.offset), dl(r.tokens), dm(n + r.offset + 8);
    qbl_test::DeviceArray<float> dalpha(r.tokens), dstats(2);
    if (!dx.ok() || !dm.ok()) {
      ADD_FAILURE() << "no device memory for " << n << " elements";
      return false;
    }
    EXPECT_EQ(qbl_test::to_device(dx.get(r.offset), x), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(dl.get(), l), cudaSuccess);
    EXPECT_EQ(cudaMemset(dm.get(), qbl_test::poison_byte, (n + r.offset + 8) * sizeof(T)),
              cudaSuccess);
    EXPECT_EQ(cudaMemset(dstats.get(), qbl_test::poison_byte, 2 * sizeof(float)), cudaSuccess);
    qbl_test::device_sigmoid_t<T>
        <<<static_cast<unsigned>((r.tokens + 255) / 256), 256>>>(dl.get(), dalpha.get(), r.tokens);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::uint32_t parity_before = 0, parity_after = 0;
    EXPECT_EQ(cudaMemcpy(&parity_before, &state->parity, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(qbl::detail::amax_quant_blend_layer(dx.get(r.offset), dl.get(), dm.get(r.offset),
                                                  r.tokens, r.features, dstats.get(), state, limits,
                                                  two_pass, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // nothing left pending
    EXPECT_EQ(cudaMemcpy(&parity_after, &state->parity, 4, cudaMemcpyDeviceToHost), cudaSuccess);

    std::vector<float> alpha(r.tokens), stats(2);
    std::vector<T> got(n + r.offset + 8);
    EXPECT_EQ(qbl_test::to_host(alpha, dalpha.get()), cudaSuccess);
    EXPECT_EQ(qbl_test::to_host(stats, dstats.get()), cudaSuccess);
    EXPECT_EQ(qbl_test::to_host(got, dm.get()), cudaSuccess);
    float amax = 0, scale = 0;
    const std::vector<float> want = qbl_test::reference_mixed(
        qbl_test::dtype_of<T>(), qbl_test::widen(x), alpha, r.tokens, r.features, &amax, &scale);
    const std::vector<float> all = qbl_test::widen(got);
    const std::vector<float> body(all.begin() + r.offset, all.begin() + r.offset + n);
    EXPECT_TRUE(qbl_test::bits_equal(body, want, static_cast<std::size_t>(r.features)));
    EXPECT_TRUE(qbl_test::bits_equal({stats[0]}, {amax})) << "amax";
    EXPECT_TRUE(qbl_test::bits_equal({stats[1]}, {scale})) << "scale";
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (i >= r.offset && i < r.offset + n) continue;
      const auto* byte = reinterpret_cast<const unsigned char*>(&got[i]);
      EXPECT_TRUE(std::all_of(byte, byte + sizeof(T),
                              [](unsigned char c) { return c == qbl_test::poison_byte; }))
          << "wrote outside mixed at " << i;
    }
    return parity_after != parity_before;
  }

 private:
  cudaStream_t stream_;
};

/// The device's one-pass limits and two-pass limits for T, and a zeroed state.
template <typename T>
struct Device {
  OnePassLimits one_pass;
  qbl::detail::LaunchLimits two_pass;
  qbl_test::DeviceArray<OnePassState> state{1};
  Device() {
    EXPECT_EQ(qbl::detail::one_pass_limits<T>(&one_pass), cudaSuccess);
    EXPECT_EQ(qbl::detail::launch_limits<T>(&two_pass), cudaSuccess);
    EXPECT_EQ(cudaMemset(state.get(), 0, sizeof(OnePassState)), cudaSuccess);
  }
  /// Elements per tile for the vectorized (true) or element-wise kernel.
  static std::int64_t tile_elements(bool vec) {
    return std::int64_t{qbl::detail::one_pass_threads} * qbl::detail::one_pass_vectors *
           (vec ? qbl::detail::vec16<T> : 1);
  }
  /// Tokens of `features` that fill a full grid with nothing held, plus one tile in shared memory.
  std::int64_t past_registers(std::int64_t features) const {
    const std::int64_t grid = std::int64_t{one_pass.sms} * one_pass.residency[1].blocks[0];
    return (grid + 1) * tile_elements(true) / features;
  }
  /// The most tiles a co-resident grid holds.
  std::int64_t capacity(bool vec) const {
    const OnePassResidency& r = one_pass.residency[vec ? 1 : 0];
    std::int64_t c = 0;
    for (int h = 0; h <= r.max_held; ++h)
      c = std::max<std::int64_t>(c, std::int64_t{one_pass.sms} * r.blocks[h] * (h + 1));
    return c;
  }
};

TYPED_TEST(OnePass, DeviceRunsIt) {
  QBL_REQUIRE_GPU();
  Device<TypeParam> dev;
  EXPECT_TRUE(dev.one_pass.cooperative);
  for (int v : {0, 1}) {
    const OnePassResidency& r = dev.one_pass.residency[v];
    EXPECT_GE(r.max_held, 1) << "kernel " << v;
    EXPECT_GE(r.blocks[0], 2) << "kernel " << v;
    std::printf(
        "[ one-pass ] %s kernel: %d multiprocessors x %d blocks, up to %d held tiles, "
        "holds %.1f MB\n",
        v ? "vector" : "scalar", dev.one_pass.sms, r.blocks[0], r.max_held,
        dev.capacity(v) * Device<TypeParam>::tile_elements(v) * sizeof(TypeParam) / 1e6);
  }
}

TYPED_TEST(OnePass, EveryThresholdOfThePlanMatchesTheReference) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t tile = Device<T>::tile_elements(true);
  const std::int64_t features = tile / 4;  // four rows a tile
  const OnePassResidency& r = dev.one_pass.residency[1];
  const std::int64_t registers_only = std::int64_t{dev.one_pass.sms} * r.blocks[0];
  const std::int64_t capacity = dev.capacity(true);
  struct Size {
    std::int64_t tokens;
    bool one_pass;
    const char* what;
  };
  const std::int64_t single = qbl::amax_quant_blend_single_block_elements / features;
  const Size sizes[] = {
      {single, false, "largest single-block input"},
      {single + 1, true, "smallest one-pass input"},
      {4 * registers_only, true, "every tile in registers, full grid"},
      {4 * registers_only + 1, true, "one row more: a tile held in shared memory"},
      {4 * capacity, true, "all the chip holds"},
      {4 * capacity + 3, false, "a partial tile more: the two-pass prologue"},
  };
  for (const Size& s : sizes) {
    const OnePassPlan p =
        plan_one_pass((s.tokens * features + tile - 1) / tile, dev.one_pass.sms, r);
    SCOPED_TRACE(std::string(s.what) + ": tokens " + std::to_string(s.tokens) + ", features " +
                 std::to_string(features) + ", plan " + std::to_string(p.blocks) + " blocks, " +
                 std::to_string(p.held) + " held");
    PrologueRun<T> run{s.tokens, features};
    run.seed = seed + static_cast<std::uint64_t>(s.tokens);
    EXPECT_EQ(Runner().run(run, dev.one_pass, dev.state.get(), dev.two_pass), s.one_pass);
  }
}

TYPED_TEST(OnePass, ElementWiseKernelOddRowsAndMisalignedX) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t tile = Device<T>::tile_elements(false);
  const OnePassResidency& r = dev.one_pass.residency[0];
  const std::int64_t registers_only = std::int64_t{dev.one_pass.sms} * r.blocks[0] * tile;
  const std::int64_t all = dev.capacity(false) * tile;
  struct Shape {
    std::int64_t features, elements;
    bool one_pass;
  };
  const Shape shapes[] = {{4099, 40000, true},          {7, 40000, true},
                          {1023, registers_only, true}, {7, registers_only + tile, true},
                          {1023, all - 2 * 1023, true}, {7, all + 5 * tile, false}};
  for (const Shape& sh : shapes) {
    const std::int64_t features = sh.features, elements = sh.elements;
    {
      for (std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
        const std::int64_t tokens = (elements + features - 1) / features;
        SCOPED_TRACE("tokens " + std::to_string(tokens) + " features " + std::to_string(features) +
                     " offset " + std::to_string(offset));
        PrologueRun<T> run{tokens, features, offset};
        run.seed = seed + static_cast<std::uint64_t>(elements + features);
        EXPECT_EQ(Runner().run(run, dev.one_pass, dev.state.get(), dev.two_pass), sh.one_pass);
      }
    }
  }
}

TYPED_TEST(OnePass, EachLaunchStartsFromAZeroedAccumulator) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  const std::int64_t features = 1024;
  // Decreasing amax: an accumulator left over from the launch before would show as a larger one.
  for (std::int64_t tokens : {std::int64_t{300}, dev.past_registers(features)}) {
    for (float s : {8.0f, 4.0f, 1.0f, 0.25f, 0.0f, 2.0f}) {
      SCOPED_TRACE("tokens " + std::to_string(tokens) + ", x scaled by " + std::to_string(s));
      PrologueRun<T> run{tokens, features};
      run.x_scale = s;
      EXPECT_TRUE(Runner().run(run, dev.one_pass, dev.state.get(), dev.two_pass));
    }
  }
}

TYPED_TEST(OnePass, NonFiniteX) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::int64_t features = 1024;
  for (std::int64_t tokens : {std::int64_t{300}, dev.past_registers(features)}) {
    const auto n = static_cast<std::size_t>(tokens * features);
    // NaN first in x (the first block's registers), NaN last (the last tile, in shared memory
    // when the grid is full), -Inf with and without NaN.
    for (const auto& edits : std::vector<std::vector<std::pair<std::size_t, float>>>{
             {{0, nan}}, {{n - 1, nan}}, {{n / 2, -inf}}, {{3, inf}, {n - 2, nan}}}) {
      SCOPED_TRACE("tokens " + std::to_string(tokens) + ", first edit at " +
                   std::to_string(edits[0].first));
      PrologueRun<T> run{tokens, features};
      run.edits = edits;
      EXPECT_TRUE(Runner().run(run, dev.one_pass, dev.state.get(), dev.two_pass));
    }
  }
}

// A grid the device cannot hold (residency overstated): the launch is refused and the two-pass
// prologue runs instead, with the same bits and no error left behind. While a graph is captured,
// CUDA invalidates the capture on the refusal (cudaErrorStreamCaptureInvalidated): the launcher
// reports it, nothing hangs, and the device stays usable.
TYPED_TEST(OnePass, RefusedLaunchFallsBack) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  OnePassLimits inflated = dev.one_pass;
  for (OnePassResidency& r : inflated.residency)
    for (int h = 0; h <= r.max_held; ++h) r.blocks[h] *= 16;
  const std::int64_t features = 1024;
  // Twice the tiles of a full grid with nothing held (rows of 1024 are 1024 / vec16 vectors).
  const std::int64_t tokens = 2 * std::int64_t{dev.one_pass.sms} *
                              dev.one_pass.residency[1].blocks[0] * Device<T>::tile_elements(true) /
                              features;
  PrologueRun<T> run{tokens, features};
  EXPECT_FALSE(Runner().run(run, inflated, dev.state.get(), dev.two_pass));
  EXPECT_TRUE(Runner().run(run, dev.one_pass, dev.state.get(), dev.two_pass));

  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto n = static_cast<std::size_t>(tokens * features);
  qbl_test::DeviceArray<T> dx(n), dl(tokens), dm(n);
  qbl_test::DeviceArray<float> dstats(2);
  QBL_ASSERT_CUDA(qbl_test::to_device(dx.get(), qbl_test::convert<T>(qbl_test::randn(n, 5))));
  QBL_ASSERT_CUDA(qbl_test::to_device(dl.get(), qbl_test::convert<T>(qbl_test::randn(tokens, 6))));
  cudaGraph_t graph = nullptr;
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched =
      qbl::detail::amax_quant_blend_layer(dx.get(), dl.get(), dm.get(), tokens, features,
                                          dstats.get(), dev.state.get(), inflated, dev.two_pass, s);
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  EXPECT_EQ(launched, cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(ended, cudaErrorStreamCaptureInvalidated);
  if (graph != nullptr) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  EXPECT_TRUE(Runner(s).run(run, dev.one_pass, dev.state.get(), dev.two_pass));  // still usable
  cudaStreamDestroy(s);
}

/// Holds a block on each multiprocessor slot it gets for about `ns` nanoseconds.
__global__ void occupy(long long ns) {
  const long long start = clock64();
  // clock64 counts SM cycles; 2 GHz is above the H200's clock, so this waits at least ns.
  while (clock64() - start < ns * 2) {
  }
}

// Another stream's kernel holds every multiprocessor when the prologue is launched: the
// cooperative grid waits for room and completes, and its result is right (no hang, no error).
TYPED_TEST(OnePass, WaitsForMultiprocessorsTakenByAnotherStream) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  Device<T> dev;
  cudaStream_t busy = nullptr, work = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking));
  int per_sm = 0;
  QBL_ASSERT_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, occupy, 1024, 0));
  occupy<<<static_cast<unsigned>(dev.one_pass.sms * per_sm), 1024, 0, busy>>>(20'000'000);
  QBL_ASSERT_CUDA(cudaGetLastError());
  PrologueRun<T> run{Device<T>::tile_elements(true) / 1024 * dev.capacity(true) / 2, 1024};
  EXPECT_TRUE(Runner(work).run(run, dev.one_pass, dev.state.get(), dev.two_pass));
  QBL_ASSERT_CUDA(cudaStreamSynchronize(busy));
  cudaStreamDestroy(busy);
  cudaStreamDestroy(work);
}

// ---- through the layer --------------------------------------------------------------------

TYPED_TEST(OnePass, LayerSameBitsWithAndWithoutAndInAGraph) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t in = 512, out = 96, tokens = 3000;
  const auto n = static_cast<std::size_t>(tokens * in);
  qbl::Options on, off;
  on.one_pass = true;
  off.one_pass = false;
  qbl::QuantBlendLinear<T> a(in, out, tokens, on), b(in, out, tokens, off);
  qbl_test::DeviceArray<T> dx(n), dl(tokens), dw(out * in), db(out), ya(tokens * out),
      yb(tokens * out);
  QBL_ASSERT_CUDA(
      qbl_test::to_device(dw.get(), qbl_test::convert<T>(qbl_test::randn(out * in, seed, 0.05f))));
  QBL_ASSERT_CUDA(
      qbl_test::to_device(db.get(), qbl_test::convert<T>(qbl_test::randn(out, seed + 1))));
  QBL_ASSERT_CUDA(
      qbl_test::to_device(dl.get(), qbl_test::convert<T>(qbl_test::randn(tokens, seed + 2))));
  // Written once before the layers write them: compute-sanitizer's initcheck does not count the
  // bf16/fp16 cuBLASLt kernels' writes as initializing, and would flag the copies back.
  for (auto* y : {&ya, &yb})
    QBL_ASSERT_CUDA(cudaMemset(y->get(), qbl_test::poison_byte, y->size() * sizeof(T)));
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  a.forward(dx.get(), dl.get(), dw.get(), db.get(), ya.get(), tokens, s);
  QBL_ASSERT_CUDA(cudaStreamEndCapture(s, &graph));
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  auto fetch = [&](const auto* d, std::size_t count) {
    std::vector<std::remove_const_t<std::remove_pointer_t<decltype(d)>>> h(count);
    EXPECT_EQ(qbl_test::to_host(h, d), cudaSuccess);
    return qbl_test::widen(h);
  };
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE("call " + std::to_string(i));
    // New x each call, its amax falling and rising; replays and direct calls interleaved.
    const float scale = i % 3 == 2 ? 4.0f : 1.0f / static_cast<float>(i + 1);
    QBL_ASSERT_CUDA(qbl_test::to_device(
        dx.get(), qbl_test::convert<T>(qbl_test::randn(n, seed + 10 + i, scale))));
    if (i % 2 == 0) {
      QBL_ASSERT_CUDA(cudaGraphLaunch(exec, s));
    } else {
      a.forward(dx.get(), dl.get(), dw.get(), db.get(), ya.get(), tokens, s);
    }
    b.forward(dx.get(), dl.get(), dw.get(), db.get(), yb.get(), tokens, s);
    QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
    EXPECT_TRUE(qbl_test::bits_equal(fetch(a.device_mixed(), n), fetch(b.device_mixed(), n), in));
    EXPECT_TRUE(qbl_test::bits_equal(fetch(a.device_amax(), 1), fetch(b.device_amax(), 1)));
    EXPECT_TRUE(qbl_test::bits_equal(fetch(a.device_scale(), 1), fetch(b.device_scale(), 1)));
    EXPECT_TRUE(qbl_test::bits_equal(fetch(ya.get(), tokens * out), fetch(yb.get(), tokens * out)));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

}  // namespace

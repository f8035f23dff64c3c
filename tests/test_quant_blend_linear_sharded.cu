// The forward split at the amax (QuantBlendLinear::forward_local_amax, then forward() with
// ForwardArgs::amax_source = qbl::AmaxSource::stats), for sharded inputs: the two steps equal the
// fused forward bit for bit, and shards of x -- along the tokens or along the features -- reduced
// with an unsigned integer MAX of amax's bits (what an NCCL all-reduce of ncclUint32 / ncclMax
// computes) give the unsharded layer's `mixed` and statistics bit for bit, NaN included. The
// shards run on one device here; the reduction is a one-thread kernel standing in for the
// collective.
#include <qbl/quant_blend_linear.cuh>

#include "reference.hpp"
#include "test_support.hpp"
#include "test_support_device.cuh"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// stats[0] of every shard := the unsigned MAX of all shards' stats[0] bits.
__global__ void max_bits_kernel(float* const* stats, int shards) {
  std::uint32_t m = 0;
  for (int i = 0; i < shards; ++i) m = max(m, __float_as_uint(stats[i][0]));
  for (int i = 0; i < shards; ++i) stats[i][0] = __uint_as_float(m);
}

cudaError_t max_bits(float* const* d_stats_list, int shards, cudaStream_t s) {
  max_bits_kernel<<<1, 1, 0, s>>>(d_stats_list, shards);
  return cudaGetLastError();
}

template <typename T>
class ShardedForward : public ::testing::Test {};
TYPED_TEST_SUITE(ShardedForward, qbl_test::AllTypes, qbl_test::AllTypeNames);

// Host data of one problem in T: x [tokens, in], logits [tokens], weight [out, in], bias [out].
template <typename T>
struct Problem {
  std::int64_t tokens, in, out;
  std::vector<T> x, l, w, b;
  Problem(std::int64_t t, std::int64_t i, std::int64_t o, std::uint64_t seed)
      : tokens(t),
        in(i),
        out(o),
        x(qbl_test::convert<T>(qbl_test::randn(t * i, seed))),
        l(qbl_test::convert<T>(qbl_test::randn(t, seed + 1, 2.0f))),
        w(qbl_test::convert<T>(qbl_test::randn(o * i, seed + 2, 0.05f))),
        b(qbl_test::convert<T>(qbl_test::randn(o, seed + 3))) {}
};

// Device buffers and one layer's forward of a problem; results back on the host as floats.
template <typename T>
struct Buffers {
  qbl_test::DeviceArray<T> x, l, w, b, y, mixed;
  qbl_test::DeviceArray<float> stats;
  explicit Buffers(const Problem<T>& p)
      : x(p.tokens * p.in),
        l(p.tokens),
        w(p.out * p.in),
        b(p.out),
        y(p.tokens * p.out),
        mixed(p.tokens * p.in),
        stats(2) {
    EXPECT_EQ(qbl_test::to_device(x.get(), p.x), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(l.get(), p.l), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(w.get(), p.w), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), p.b), cudaSuccess);
    EXPECT_EQ(cudaMemset(y.get(), qbl_test::poison_byte, y.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(mixed.get(), qbl_test::poison_byte, mixed.size() * sizeof(T)),
              cudaSuccess);
    EXPECT_EQ(cudaMemset(stats.get(), qbl_test::poison_byte, 2 * sizeof(float)), cudaSuccess);
  }
  template <typename A>
  static std::vector<float> host(const A& a) {
    std::vector<std::remove_const_t<std::remove_pointer_t<decltype(a.get())>>> h(a.size());
    EXPECT_EQ(qbl_test::to_host(h, a.get()), cudaSuccess);
    return qbl_test::widen(h);
  }
};

// No element still holds the poison bytes (for bf16/fp16 the widened poison is a NaN that
// bits_equal would accept as any other NaN).
template <typename T>
::testing::AssertionResult all_written(const qbl_test::DeviceArray<T>& a) {
  std::vector<T> h(a.size());
  if (qbl_test::to_host(h, a.get()) != cudaSuccess) return ::testing::AssertionFailure() << "copy";
  for (std::size_t i = 0; i < h.size(); ++i) {
    unsigned char raw[sizeof(T)];
    std::memcpy(raw, &h[i], sizeof(T));
    bool poison = true;
    for (unsigned char c : raw) poison = poison && c == qbl_test::poison_byte;
    if (poison) return ::testing::AssertionFailure() << "element " << i << " unwritten";
  }
  return ::testing::AssertionSuccess();
}

/// The forward's arguments over a problem's buffers, keeping mixed and stats.
template <typename T>
typename qbl::QuantBlendLinear<T>::ForwardArgs args_of(Buffers<T>& r, std::int64_t tokens) {
  typename qbl::QuantBlendLinear<T>::ForwardArgs a;
  a.x = r.x.get(), a.logits = r.l.get(), a.weight = r.w.get(), a.bias = r.b.get();
  a.out = r.y.get(), a.mixed = r.mixed.get(), a.stats = r.stats.get(), a.tokens = tokens;
  return a;
}

template <typename T>
void fused(qbl::QuantBlendLinear<T>& layer, Buffers<T>& r, std::int64_t tokens) {
  layer.forward(args_of(r, tokens));
}

/// The split forward's second step: the forward from the amax in stats[0].
template <typename T>
void from_stats(qbl::QuantBlendLinear<T>& layer, Buffers<T>& r, std::int64_t tokens,
                cudaStream_t stream = nullptr) {
  auto a = args_of(r, tokens);
  a.amax_source = qbl::AmaxSource::stats;
  layer.forward(a, stream);
}

TYPED_TEST(ShardedForward, SplitStepsEqualTheFusedForwardBitForBit) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  // 333 x 136 takes the amax + quant-blend kernels, 40 x 96 the single-block kernel.
  for (const auto& [tokens, in] : {std::pair<std::int64_t, std::int64_t>{333, 136}, {40, 96}})
    for (const bool nan : {false, true}) {
      SCOPED_TRACE(nan ? "a NaN in x" : "finite x");
      SCOPED_TRACE("tokens " + std::to_string(tokens) + ", in " + std::to_string(in));
      Problem<T> p(tokens, in, 72, seed);
      if (nan) p.x[7 * in + 5] = qbl_test::from_f<T>(std::numeric_limits<float>::quiet_NaN());
      qbl::QuantBlendLinear<T> layer(p.in, p.out, 512);
      Buffers<T> want(p), got(p);
      fused(layer, want, p.tokens);
      layer.forward_local_amax(got.x.get(), p.tokens, got.stats.get());
      from_stats(layer, got, p.tokens);
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(qbl_test::bits_equal(Buffers<T>::host(got.stats), Buffers<T>::host(want.stats)));
      EXPECT_TRUE(
          qbl_test::bits_equal(Buffers<T>::host(got.mixed), Buffers<T>::host(want.mixed), p.in));
      EXPECT_TRUE(qbl_test::bits_equal(Buffers<T>::host(got.y), Buffers<T>::host(want.y), p.out));
      EXPECT_TRUE(all_written(got.mixed));
      EXPECT_TRUE(all_written(got.y));
      if (nan) EXPECT_TRUE(std::isnan(Buffers<T>::host(got.stats)[1])) << "the scale must be NaN";
    }
}

// Shards along the tokens (sequence parallelism) and along the features (a row-parallel
// linear's input), each shard's layer sized for its part; after the MAX of the amax bits every
// shard's `mixed` is its part of the unsharded layer's, bit for bit, and so are amax and scale.
// With a NaN in one shard only, every shard turns NaN as the unsharded layer does.
TYPED_TEST(ShardedForward, ShardsWithTheMaxOfTheirAmaxBitsEqualTheUnshardedLayer) {
  QBL_REQUIRE_GPU();
  using T = TypeParam;
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::int64_t tokens = 200, in = 160, out = 48;
  for (const bool nan : {false, true}) {
    SCOPED_TRACE(nan ? "a NaN in the second shard" : "finite x");
    Problem<T> whole(tokens, in, out, seed);
    if (nan) whole.x[150 * in + 120] = qbl_test::from_f<T>(std::numeric_limits<float>::quiet_NaN());
    qbl::QuantBlendLinear<T> whole_layer(in, out, tokens);
    Buffers<T> ref(whole);
    fused(whole_layer, ref, tokens);
    QBL_ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> ref_mixed = Buffers<T>::host(ref.mixed);
    const std::vector<float> ref_stats = Buffers<T>::host(ref.stats);
    // The shards are compared with the unsharded layer below, which would agree with them if
    // both dropped the NaN: eager's rule (a NaN in x makes amax and the scale NaN) is checked here.
    if (nan) EXPECT_TRUE(std::isnan(ref_stats[0]) && std::isnan(ref_stats[1]));

    for (const bool by_features : {false, true}) {
      SCOPED_TRACE(by_features ? "sharded along the features" : "sharded along the tokens");
      // Shard s holds rows [r0, r1) and columns [c0, c1) of x.
      struct Cut {
        std::int64_t r0, r1, c0, c1;
      };
      const std::vector<Cut> cuts = by_features
                                        ? std::vector<Cut>{{0, tokens, 0, 64}, {0, tokens, 64, in}}
                                        : std::vector<Cut>{{0, 77, 0, in}, {77, tokens, 0, in}};
      std::vector<Problem<T>> parts;
      for (const Cut& c : cuts) {
        Problem<T> q(c.r1 - c.r0, c.c1 - c.c0, out, seed);
        for (std::int64_t r = c.r0; r < c.r1; ++r) {
          q.l[r - c.r0] = whole.l[r];
          for (std::int64_t i = c.c0; i < c.c1; ++i)
            q.x[(r - c.r0) * q.in + (i - c.c0)] = whole.x[r * in + i];
        }
        for (std::int64_t o = 0; o < out; ++o)
          for (std::int64_t i = c.c0; i < c.c1; ++i)
            q.w[o * q.in + (i - c.c0)] = whole.w[o * in + i];
        parts.push_back(q);
      }
      std::vector<std::unique_ptr<qbl::QuantBlendLinear<T>>> layers;
      std::vector<std::unique_ptr<Buffers<T>>> runs;
      std::vector<float*> stats_list;
      for (const Problem<T>& q : parts) {
        layers.push_back(std::make_unique<qbl::QuantBlendLinear<T>>(q.in, q.out, q.tokens));
        runs.push_back(std::make_unique<Buffers<T>>(q));
        stats_list.push_back(runs.back()->stats.get());
      }
      qbl_test::DeviceArray<float*> d_list(stats_list.size());
      QBL_ASSERT_CUDA(qbl_test::to_device(d_list.get(), stats_list));
      for (std::size_t s = 0; s < parts.size(); ++s)
        layers[s]->forward_local_amax(runs[s]->x.get(), parts[s].tokens, runs[s]->stats.get());
      QBL_ASSERT_CUDA(max_bits(d_list.get(), static_cast<int>(parts.size()), nullptr));
      for (std::size_t s = 0; s < parts.size(); ++s) {
        Buffers<T>& r = *runs[s];
        from_stats(*layers[s], r, parts[s].tokens);
      }
      QBL_ASSERT_CUDA(cudaDeviceSynchronize());
      for (std::size_t s = 0; s < parts.size(); ++s) {
        SCOPED_TRACE("shard " + std::to_string(s));
        const Cut& c = cuts[s];
        std::vector<float> want;
        for (std::int64_t r = c.r0; r < c.r1; ++r)
          for (std::int64_t i = c.c0; i < c.c1; ++i) want.push_back(ref_mixed[r * in + i]);
        EXPECT_TRUE(qbl_test::bits_equal(Buffers<T>::host(runs[s]->mixed), want, parts[s].in));
        EXPECT_TRUE(qbl_test::bits_equal(Buffers<T>::host(runs[s]->stats), ref_stats));
        EXPECT_TRUE(all_written(runs[s]->mixed));
      }
    }
  }
}

// A shard with no token contributes amax 0, the identity of the reduction.
TEST(ShardedForwardEdges, EmptyShardWritesZeroAmax) {
  QBL_REQUIRE_GPU();
  qbl::QuantBlendLinear<float> layer(32, 16, 64);
  qbl_test::DeviceArray<float> stats(2);
  QBL_ASSERT_CUDA(cudaMemset(stats.get(), qbl_test::poison_byte, 2 * sizeof(float)));
  layer.forward_local_amax(nullptr, 0, stats.get());
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> h(2);
  QBL_ASSERT_CUDA(qbl_test::to_host(h, stats.get()));
  EXPECT_EQ(qbl_test::bits(h[0]), 0u);
  EXPECT_EQ(qbl_test::bits(h[1]), 0xffffffffu) << "stats[1] is not the local step's";
}

// Bad arguments throw before anything is launched: stats keep their poison.
TEST(ShardedForwardEdges, BadArgumentsThrowAndWriteNothing) {
  QBL_REQUIRE_GPU();
  const std::int64_t in = 32, out = 16, max_tokens = 64;
  qbl::QuantBlendLinear<float> layer(in, out, max_tokens);
  qbl_test::DeviceArray<float> x(max_tokens * in + 1), stats(2);
  QBL_ASSERT_CUDA(cudaMemset(x.get(), 0, (max_tokens * in + 1) * sizeof(float)));
  QBL_ASSERT_CUDA(cudaMemset(stats.get(), qbl_test::poison_byte, 2 * sizeof(float)));
  EXPECT_THROW(layer.forward_local_amax(x.get(), max_tokens + 1, stats.get()), qbl::out_of_range);
  EXPECT_THROW(layer.forward_local_amax(x.get(), -1, stats.get()), qbl::invalid_argument);
  EXPECT_THROW(layer.forward_local_amax(x.get(), 4, nullptr), qbl::invalid_argument);
  EXPECT_THROW(layer.forward_local_amax(nullptr, 4, stats.get()), qbl::invalid_argument);
  EXPECT_THROW(layer.forward_local_amax(
                   x.get(), 4, reinterpret_cast<float*>(reinterpret_cast<char*>(stats.get()) + 2)),
               qbl::invalid_argument);
  EXPECT_THROW(layer.forward_local_amax(x.get(), 4, x.get() + 5), qbl::invalid_argument)
      << "stats overlapping x";
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<float> h(2);
  QBL_ASSERT_CUDA(qbl_test::to_host(h, stats.get()));
  EXPECT_EQ(qbl_test::bits(h[0]), 0xffffffffu);
  EXPECT_EQ(qbl_test::bits(h[1]), 0xffffffffu);
}

// Both steps and the reduction captured in one graph (nothing in them allocates or synchronizes),
// replayed: the same bits as the direct calls.
TEST(ShardedForwardEdges, CapturedStepsReplayTheDirectResult) {
  QBL_REQUIRE_GPU();
  const std::uint64_t seed = qbl_test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Problem<float> p(120, 96, 40, seed);
  qbl::QuantBlendLinear<float> layer(p.in, p.out, p.tokens);
  Buffers<float> direct(p), graphed(p);
  cudaStream_t s = nullptr;
  QBL_ASSERT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto steps = [&](Buffers<float>& r, float* const* list) {
    layer.forward_local_amax(r.x.get(), p.tokens, r.stats.get(), s);
    EXPECT_EQ(max_bits(list, 1, s), cudaSuccess);
    from_stats(layer, r, p.tokens, s);
  };
  qbl_test::DeviceArray<float*> l1(1), l2(1);
  QBL_ASSERT_CUDA(qbl_test::to_device(l1.get(), std::vector<float*>{direct.stats.get()}));
  QBL_ASSERT_CUDA(qbl_test::to_device(l2.get(), std::vector<float*>{graphed.stats.get()}));
  // s is non-blocking: only a synchronization orders it after the default stream's uploads.
  QBL_ASSERT_CUDA(cudaDeviceSynchronize());
  steps(direct, l1.get());
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  QBL_ASSERT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  steps(graphed, l2.get());
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(s, &g), cudaSuccess);
  cudaGraphExec_t e = nullptr;
  QBL_ASSERT_CUDA(cudaGraphInstantiate(&e, g, 0));
  for (int i = 0; i < 3; ++i) QBL_ASSERT_CUDA(cudaGraphLaunch(e, s));
  QBL_ASSERT_CUDA(cudaStreamSynchronize(s));
  EXPECT_TRUE(qbl_test::bits_equal(Buffers<float>::host(graphed.stats),
                                   Buffers<float>::host(direct.stats)));
  EXPECT_TRUE(qbl_test::bits_equal(Buffers<float>::host(graphed.mixed),
                                   Buffers<float>::host(direct.mixed)));
  EXPECT_TRUE(
      qbl_test::bits_equal(Buffers<float>::host(graphed.y), Buffers<float>::host(direct.y)));
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
}

}  // namespace

// qbl::BackwardPlan's description of a call (describe()) and every variant it leads to: for each
// subset of the four gradients, with `mixed` given or recomputed, with a side stream or none, and
// with x aligned for 16-byte vectors or not (the element kernel's elementwise width), each output
// is bit-identical to the all-outputs call's on the same inputs at the same width, unwanted
// outputs are never written, and each run gets exactly the workspace it asks for. The
// all-outputs call is checked against eager and a float64 reference in
// test_quant_blend_linear_backward, each width of the element kernel in test_quant_blend_backward.
// And a float32 weight (and bias) given to the plans in place of the GEMM type's, cast inside
// their schedule, gives the bits of the weight cast before the call.
#include <qbl/activation.cuh>
#include <qbl/layer_plans.cuh>

#include "test_support.hpp"

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using qbl::MixedSource;
using qbl_test::DeviceArray;

template <typename X_, typename G_, typename L_, typename Act_>
struct Case {
  using X = X_;
  using G = G_;
  using L = L_;
  using Act = Act_;
};

constexpr std::int64_t kTokens = 37, kIn = 96, kOut = 40;

/// Raw bytes of a device buffer.
template <typename T>
std::vector<unsigned char> bytes_of(const T* d, std::size_t n) {
  std::vector<unsigned char> h(n * sizeof(T));
  EXPECT_EQ(cudaMemcpy(h.data(), d, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

/// One layer's inputs (with the forward's mixed and stats) and the backward's outputs.
template <typename C>
struct Layer {
  using X = typename C::X;
  using G = typename C::G;
  using L = typename C::L;
  using Act = typename C::Act;
  using Fwd = qbl::ForwardPlan<X, G, L, Act>;
  using Bwd = qbl::BackwardPlan<X, G, L, Act>;

  std::vector<float> w_fp32 = qbl_test::randn(kOut * kIn, 12, 0.05f);
  std::vector<float> b_fp32 = qbl_test::randn(kOut, 13);
  DeviceArray<X> x{kTokens * kIn}, x_misaligned{kTokens * kIn, 1};
  DeviceArray<L> logits{kTokens};
  DeviceArray<G> w{kOut * kIn}, b{kOut}, out{kTokens * kOut}, mixed{kTokens * kIn};
  DeviceArray<G> grad_out{kTokens * kOut};
  DeviceArray<float> w32{kOut * kIn}, b32{kOut}, stats{2};
  DeviceArray<X> gx{kTokens * kIn};
  DeviceArray<L> gl{kTokens};
  DeviceArray<G> gw{kOut * kIn}, gb{kOut};
  Fwd fwd{kIn, kOut, kTokens};
  Bwd bwd{kIn, kOut, kTokens};

  Layer() {
    const std::vector<X> hx = qbl_test::convert<X>(qbl_test::randn(kTokens * kIn, 10));
    EXPECT_EQ(qbl_test::to_device(x.get(), hx), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(x_misaligned.get(1), hx), cudaSuccess);
    EXPECT_EQ(
        qbl_test::to_device(logits.get(), qbl_test::convert<L>(qbl_test::randn(kTokens, 11, 2.0f))),
        cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(w.get(), qbl_test::convert<G>(w_fp32)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b.get(), qbl_test::convert<G>(b_fp32)), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(w32.get(), w_fp32), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(b32.get(), b_fp32), cudaSuccess);
    EXPECT_EQ(qbl_test::to_device(grad_out.get(),
                                  qbl_test::convert<G>(qbl_test::randn(kTokens * kOut, 14))),
              cudaSuccess);
    typename Fwd::ForwardArgs f;
    f.x = x.get(), f.logits = logits.get(), f.weight = w.get(), f.bias = b.get();
    f.out = out.get(), f.mixed = mixed.get(), f.stats = stats.get(), f.tokens = kTokens;
    run_forward(f);
  }

  void run_forward(const typename Fwd::ForwardArgs& f) {
    DeviceArray<unsigned char> ws{fwd.workspace_bytes(f)};
    fwd.run(f, ws.get());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  /// The gradients wanted by `mask` (bit 0 grad_x, 1 grad_logits, 2 grad_weight, 3 grad_bias).
  typename Bwd::BackwardArgs args(unsigned mask, bool keep_mixed, bool aligned_x) {
    typename Bwd::BackwardArgs a;
    a.grad_out = grad_out.get(), a.x = aligned_x ? x.get() : x_misaligned.get(1);
    a.logits = logits.get(), a.weight = w.get(), a.stats = stats.get(), a.tokens = kTokens;
    a.mixed = keep_mixed ? mixed.get() : nullptr;
    a.grad_x = mask & 1u ? gx.get() : nullptr;
    a.grad_logits = mask & 2u ? gl.get() : nullptr;
    a.grad_weight = mask & 4u ? gw.get() : nullptr;
    a.grad_bias = mask & 8u ? gb.get() : nullptr;
    return a;
  }

  void poison() {
    EXPECT_EQ(cudaMemset(gx.get(), qbl_test::poison_byte, kTokens * kIn * sizeof(X)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gl.get(), qbl_test::poison_byte, kTokens * sizeof(L)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gw.get(), qbl_test::poison_byte, kOut * kIn * sizeof(G)), cudaSuccess);
    EXPECT_EQ(cudaMemset(gb.get(), qbl_test::poison_byte, kOut * sizeof(G)), cudaSuccess);
  }

  /// Runs the backward with a workspace of exactly workspace_bytes(a); returns the four outputs'
  /// bytes (poisoned before the run).
  std::vector<std::vector<unsigned char>> run(const typename Bwd::BackwardArgs& a, bool side) {
    poison();
    DeviceArray<unsigned char> ws{bwd.workspace_bytes(a)};
    qbl::SideStream s;
    bwd.run(a, ws.get(), side ? &s : nullptr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return {bytes_of(gx.get(), kTokens * kIn), bytes_of(gl.get(), kTokens),
            bytes_of(gw.get(), kOut * kIn), bytes_of(gb.get(), kOut)};
  }
};

/// The cases, as a list for the checks below and as gtest's type list.
template <typename... C>
struct CaseList {
  using Types = ::testing::Types<C...>;
  template <typename X, typename G, typename L>
  static constexpr bool has_types() {
    return ((std::is_same_v<X, typename C::X> && std::is_same_v<G, typename C::G> &&
             std::is_same_v<L, typename C::L>) ||
            ...);
  }
  template <typename Act>
  static constexpr bool has_activation() {
    return (std::is_same_v<Act, typename C::Act> || ...);
  }
};

using AllCases =
    CaseList<Case<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, qbl::Gelu>,
             Case<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, qbl::Identity>,
             Case<float, __nv_bfloat16, float, qbl::Silu>, Case<__half, __half, __half, qbl::Relu>,
             Case<float, float, float, qbl::GeluTanh>,
             Case<float, __nv_bfloat16, __nv_bfloat16, qbl::Relu>,
             Case<float, __half, float, qbl::Gelu>, Case<float, __half, __half, qbl::Identity>>;

template <typename... T>
constexpr bool every_type_triple(qbl::TypeList<T...>) {
  return (
      AllCases::has_types<typename T::x_type, typename T::gemm_type, typename T::logits_type>() &&
      ...);
}
template <typename... Act>
constexpr bool every_activation(qbl::TypeList<Act...>) {
  return (AllCases::has_activation<Act>() && ...);
}
static_assert(every_type_triple(qbl::SupportedTypes{}),
              "every type triple of qbl::SupportedTypes is in a case");
static_assert(every_activation(qbl::Activations{}), "every activation is in a case");

using Cases = AllCases::Types;

template <typename C>
class BackwardDescription : public ::testing::Test {};
TYPED_TEST_SUITE(BackwardDescription, Cases);

TYPED_TEST(BackwardDescription, EveryVariantMatchesTheAllOutputsCallBitForBit) {
  QBL_REQUIRE_GPU();
  Layer<TypeParam> layer;
  // The all-outputs call at each width of the element kernel. Elementwise outputs agree across
  // widths; grad_logits's compensated sums take the row's elements in another order (a lane's
  // share of the row follows the vector width), so for float32 x they may differ in the last
  // bits, within the sums' bound (test_quant_blend_backward checks each width against float64).
  const auto all_vectors = layer.run(layer.args(15u, true, true), true);
  const auto all_elementwise = layer.run(layer.args(15u, true, false), true);
  EXPECT_TRUE(all_elementwise[0] == all_vectors[0]) << "grad_x depends on x's alignment";
  EXPECT_TRUE(all_elementwise[2] == all_vectors[2]) << "grad_weight depends on x's alignment";
  EXPECT_TRUE(all_elementwise[3] == all_vectors[3]) << "grad_bias depends on x's alignment";
  const char* names[] = {"grad_x", "grad_logits", "grad_weight", "grad_bias"};
  int variants_seen[qbl::detail::backward_kernel_variant_count] = {};
  for (unsigned mask = 1; mask < 16; ++mask) {
    for (bool keep : {true, false}) {
      for (bool side : {true, false}) {
        for (bool aligned : {true, false}) {
          SCOPED_TRACE("mask " + std::to_string(mask) + (keep ? ", mixed given" : ", recomputed") +
                       (side ? ", side stream" : ", one stream") +
                       (aligned ? ", vectors" : ", x misaligned"));
          const auto a = layer.args(mask, keep, aligned);
          const qbl::BackwardDescription d = layer.bwd.describe(a, side);
          if (d.dgrad || d.element_mixed)
            ++variants_seen[qbl::detail::backward_kernel_variant(
                d.element_grad_x, d.element_grad_logits, d.element_mixed)];
          const auto got = layer.run(a, side);
          const auto& all = aligned ? all_vectors : all_elementwise;
          for (int k = 0; k < 4; ++k) {
            if (mask & (1u << k)) {
              EXPECT_TRUE(got[k] == all[k]) << names[k] << " differs from the all-outputs call's";
            } else {
              EXPECT_TRUE(got[k] ==
                          std::vector<unsigned char>(got[k].size(), qbl_test::poison_byte))
                  << names[k] << " was written though not wanted";
            }
          }
        }
      }
    }
  }
  for (int v = 0; v < qbl::detail::backward_kernel_variant_count; ++v)
    EXPECT_GT(variants_seen[v], 0) << "variant " << v << " of the element kernel never ran";
}

TYPED_TEST(BackwardDescription, SaysWhatACallReadsRunsAndKeeps) {
  QBL_REQUIRE_GPU();
  Layer<TypeParam> layer;
  constexpr bool reads_x_for_grad_x = !std::is_same_v<typename TypeParam::Act, qbl::Identity>;
  // grad_x alone: dgrad and the element kernel only.
  qbl::BackwardDescription d = layer.bwd.describe(layer.args(1u, true, true), true);
  EXPECT_TRUE(d.runs && d.dgrad && !d.wgrad && !d.bias && !d.beside && !d.fork);
  EXPECT_EQ(d.reads_x, reads_x_for_grad_x);
  EXPECT_TRUE(d.reads_gate && d.reads_weight && !d.reads_mixed);
  EXPECT_TRUE(d.element_grad_x && !d.element_grad_logits && !d.element_mixed);
  constexpr bool one_type = std::is_same_v<typename TypeParam::X, typename TypeParam::G>;
  EXPECT_EQ(d.g_mixed_scratch, !one_type);
  // Everything, mixed recomputed: beside dgrad on the side stream, on one stream in the element
  // kernel.
  d = layer.bwd.describe(layer.args(15u, false, true), true);
  EXPECT_TRUE(d.runs && d.dgrad && d.wgrad && d.bias && d.beside && d.fork);
  EXPECT_EQ(d.mixed, MixedSource::recomputed_beside);
  EXPECT_FALSE(d.element_mixed);
  EXPECT_TRUE(d.reads_x && d.reads_gate && d.reads_weight && !d.reads_mixed);
  d = layer.bwd.describe(layer.args(15u, false, true), false);
  EXPECT_TRUE(d.beside && !d.fork);
  EXPECT_EQ(d.mixed, MixedSource::recomputed_in_element_kernel);
  EXPECT_TRUE(d.element_mixed && d.element_grad_x && d.element_grad_logits);
  // grad_weight alone from a kept mixed: wgrad only, reading grad_out and mixed.
  d = layer.bwd.describe(layer.args(4u, true, true), true);
  EXPECT_TRUE(d.runs && !d.dgrad && d.wgrad && !d.beside && !d.fork);
  EXPECT_TRUE(!d.reads_x && !d.reads_gate && !d.reads_weight && d.reads_mixed);
  // grad_bias alone reads grad_out only.
  d = layer.bwd.describe(layer.args(8u, false, true), true);
  EXPECT_TRUE(d.runs && d.bias && !d.wgrad && !d.recomputes());
  EXPECT_TRUE(!d.reads_x && !d.reads_gate && !d.reads_weight && !d.reads_mixed);
  // No token, or nothing wanted: nothing runs.
  auto none = layer.args(15u, true, true);
  none.tokens = 0;
  EXPECT_FALSE(layer.bwd.describe(none, true).runs);
  EXPECT_FALSE(layer.bwd.describe(layer.args(0u, true, true), true).runs);
}

TYPED_TEST(BackwardDescription, AFloat32WeightCastInsideThePlansGivesTheCastWeightsBits) {
  QBL_REQUIRE_GPU();
  using G = typename TypeParam::G;
  Layer<TypeParam> layer;
  if constexpr (std::is_same_v<G, float>) {
    auto a = layer.args(15u, true, true);
    a.weight_fp32 = layer.w32.get();
    EXPECT_FALSE(layer.bwd.supports(a)) << "weight_fp32 is for a 16-bit GEMM type";
  } else {
    // The backward: every mask that runs dgrad, with and without a side stream.
    for (unsigned mask : {1u, 2u, 3u, 15u}) {
      for (bool side : {true, false}) {
        SCOPED_TRACE("mask " + std::to_string(mask) + (side ? ", side stream" : ", one stream"));
        const auto expected = layer.run(layer.args(mask, false, true), side);
        auto a = layer.args(mask, false, true);
        a.weight = nullptr;
        a.weight_fp32 = layer.w32.get();
        EXPECT_TRUE(layer.bwd.describe(a).cast_weight);
        EXPECT_GT(layer.bwd.workspace_bytes(a),
                  layer.bwd.workspace_bytes(layer.args(mask, false, true)));
        EXPECT_TRUE(layer.run(a, side) == expected);
        a.weight = layer.w.get();  // both: an error, nothing written
        layer.poison();
        EXPECT_THROW(layer.bwd.run(a, nullptr, nullptr), qbl::invalid_argument);
        EXPECT_TRUE(bytes_of(layer.gx.get(), kTokens * kIn) ==
                    std::vector<unsigned char>(kTokens * kIn * sizeof(typename TypeParam::X),
                                               qbl_test::poison_byte));
      }
    }
    // The forward: weight and bias in float32.
    const auto out = bytes_of(layer.out.get(), kTokens * kOut);
    const auto mixed = bytes_of(layer.mixed.get(), kTokens * kIn);
    EXPECT_EQ(cudaMemset(layer.out.get(), 0, kTokens * kOut * sizeof(G)), cudaSuccess);
    typename Layer<TypeParam>::Fwd::ForwardArgs f;
    f.x = layer.x.get(), f.logits = layer.logits.get(), f.weight_fp32 = layer.w32.get();
    f.bias_fp32 = layer.b32.get(), f.out = layer.out.get(), f.mixed = layer.mixed.get();
    f.stats = layer.stats.get(), f.tokens = kTokens;
    EXPECT_GT(layer.fwd.workspace_bytes(f), layer.fwd.workspace_bytes());
    layer.run_forward(f);
    EXPECT_TRUE(bytes_of(layer.out.get(), kTokens * kOut) == out);
    EXPECT_TRUE(bytes_of(layer.mixed.get(), kTokens * kIn) == mixed);
  }
}

}  // namespace

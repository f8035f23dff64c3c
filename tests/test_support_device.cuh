// Device-side helpers shared by the GPU tests, and the type lists their suites are parameterized
// by: the 16-bit element types, and the layer's type triples taken from the library's one list,
// qbl::SupportedTypes (qbl/types.hpp) -- as ::testing::Types for a typed test, and as values for
// a suite over (type triple x shape) whose test body dispatches on the triple at run time. Either
// way a generated test is named by its types: "fp32", "bf16", "fp16" for one type throughout,
// "fp32_to_bf16_logits_fp32" and the like for fp32 x with a 16-bit GEMM (PyTorch's autocast).
#pragma once

#include <qbl/activation.cuh>
#include <qbl/element_math.hpp>
#include <qbl/error.hpp>
#include <qbl/types.hpp>

#include "reference.hpp"
#include "test_support.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace qbl_test {

/// alpha as the device computes it, for type T: references take sigmoid from the GPU's expf, as
/// eager does.
template <typename T>
__global__ void device_sigmoid_t(const T* l, float* alpha, std::int64_t n) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) alpha[i] = qbl::sigmoid<T>(static_cast<float>(l[i]));
}

// ---- element types ----------------------------------------------------------------------------

using Types16 = ::testing::Types<__nv_bfloat16, __half>;

/// "bf16" / "fp16" in the generated test names.
struct Names16 {
  template <typename T>
  static std::string GetName(int) {
    return std::is_same_v<T, __half> ? "fp16" : "bf16";
  }
};

// ---- the layer's type triples -----------------------------------------------------------------

/// A triple's element types as values: x's, the GEMM's, the logits'.
struct TypeTriple {
  DType x = DType::fp32, gemm = DType::fp32, logits = DType::fp32;
  bool operator==(const TypeTriple& o) const {
    return x == o.x && gemm == o.gemm && logits == o.logits;
  }
  bool one_type() const { return x == gemm && x == logits; }
};

/// The triple of a qbl::LayerTypes<X, G, L>.
template <typename T>
constexpr TypeTriple triple_of() {
  return {dtype_of<typename T::x_type>(), dtype_of<typename T::gemm_type>(),
          dtype_of<typename T::logits_type>()};
}

/// "fp32", "bf16", "fp16" for one type throughout; "fp32_to_bf16_logits_fp32" for fp32 x with a
/// bf16 GEMM and fp32 logits, and so on.
inline std::string types_name(const TypeTriple& t) {
  if (t.one_type()) return dtype_name(t.x);
  return std::string(dtype_name(t.x)) + "_to_" + dtype_name(t.gemm) + "_logits_" +
         dtype_name(t.logits);
}

template <typename List>
struct AsGtestTypes;
template <typename... T>
struct AsGtestTypes<qbl::TypeList<T...>> {
  using type = ::testing::Types<T...>;
};

/// qbl::SupportedTypes as ::testing::Types: TYPED_TEST_SUITE(Suite, SupportedTypes,
/// SupportedTypeNames), each TypeParam a qbl::LayerTypes<X, G, L>.
using SupportedTypes = AsGtestTypes<qbl::SupportedTypes>::type;

struct SupportedTypeNames {
  template <typename T>
  static std::string GetName(int) {
    return types_name(triple_of<T>());
  }
};

/// An input activation with a layer's element types, for the typed tests of the activations:
/// TYPED_TEST_SUITE(Suite, ::testing::Types<ActivationCase<qbl::Gelu, float>, ...>,
/// ActivationCaseNames).
template <typename A, typename X, typename G = X, typename L = X>
struct ActivationCase {
  using Act = A;
  using x_type = X;
  using gemm_type = G;
  using logits_type = L;
};

/// "identity", "gelu", "gelu_tanh", "relu" or "silu".
template <typename A>
std::string activation_name() {
  constexpr const char* names[] = {"identity", "gelu", "gelu_tanh", "relu", "silu"};
  return names[static_cast<int>(A::kind)];
}

/// "gelu_bf16", "gelu_tanh_fp32_to_bf16_logits_fp32" and the like.
struct ActivationCaseNames {
  template <typename C>
  static std::string GetName(int) {
    return activation_name<typename C::Act>() + "_" + types_name(triple_of<C>());
  }
};

/// qbl::SupportedTypes as values, in its order.
inline std::vector<TypeTriple> supported_triples() {
  std::vector<TypeTriple> v;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) { v.push_back(triple_of<decltype(t)>()); });
  return v;
}

/// Calls f(qbl::LayerTypes<X, G, L>{}) for the supported triple that `t` names; false where none
/// does. f is instantiated for every supported triple.
template <typename F>
bool with_types(const TypeTriple& t, F&& f) {
  bool found = false;
  qbl::for_each_type(qbl::SupportedTypes{}, [&](auto types) {
    if (!found && triple_of<decltype(types)>() == t) {
      found = true;
      f(types);
    }
  });
  return found;
}

/// One case of a suite over (type triple x shape).
template <typename Shape>
struct Typed {
  TypeTriple types;
  Shape shape;
};

/// Every supported triple with every shape, the triples outermost: a suite's cases.
template <typename Shape>
std::vector<Typed<Shape>> over_supported_types(const std::vector<Shape>& shapes) {
  std::vector<Typed<Shape>> v;
  for (const TypeTriple& t : supported_triples())
    for (const Shape& s : shapes) v.push_back({t, s});
  return v;
}

template <typename Shape>
void PrintTo(const Typed<Shape>& c, std::ostream* os) {
  *os << types_name(c.types) << " " << ::testing::PrintToString(c.shape);
}

/// The generated test name "<types>_<shape>": the shape's part is shape_name(shape), a function
/// beside the test's Shape type (found by argument-dependent lookup).
struct TypedName {
  template <typename Shape>
  std::string operator()(const ::testing::TestParamInfo<Typed<Shape>>& i) const {
    return types_name(i.param.types) + "_" + shape_name(i.param.shape);
  }
};

/// Does the element still hold the poison (every byte qbl_test::poison_byte: never written)?
template <typename T>
bool is_poison(const T& v) {
  const auto* b = reinterpret_cast<const unsigned char*>(&v);
  for (std::size_t k = 0; k < sizeof(T); ++k)
    if (b[k] != poison_byte) return false;
  return true;
}

/// Does every element of `v` differ from the poison? For bf16 and fp16 the widened poison is a
/// NaN that bits_equal accepts as any other NaN: this tells an unwritten element from a computed
/// NaN.
template <typename T>
::testing::AssertionResult all_written(const std::vector<T>& v, const char* what) {
  for (std::size_t i = 0; i < v.size(); ++i)
    if (is_poison(v[i])) return ::testing::AssertionFailure() << what << " unwritten at " << i;
  return ::testing::AssertionSuccess();
}

/// The buffers of the forward's bad-argument tests, for type triple (X, G, L): 300 tokens, 128 ->
/// 64 features, every buffer 8 elements longer than it needs. fill() puts random values from a seed
/// in x, logits, weight and bias; poison() and untouched() tell whether a call wrote out, mixed
/// or stats.
template <typename X, typename G, typename L>
struct ForwardBuffers {
  static constexpr std::int64_t tokens = 300, in = 128, out = 64;
  static constexpr std::size_t slack = 8;
  DeviceArray<X> x{tokens * in + slack};
  DeviceArray<L> logits{tokens + slack};
  DeviceArray<G> weight{out * in + slack}, bias{out + slack};
  DeviceArray<G> y{tokens * out + slack}, mixed{tokens * in + slack};
  DeviceArray<float> stats{slack};

  cudaError_t fill(std::uint64_t seed) const {
    cudaError_t e = to_device(x.get(), convert<X>(randn(tokens * in, seed)));
    if (e == cudaSuccess) e = to_device(logits.get(), convert<L>(randn(tokens, seed + 1)));
    if (e == cudaSuccess) e = to_device(weight.get(), convert<G>(randn(out * in, seed + 2)));
    if (e == cudaSuccess) e = to_device(bias.get(), convert<G>(randn(out, seed + 3)));
    return e;
  }

  /// Sets every byte of out, mixed and stats to poison_byte.
  cudaError_t poison() const {
    cudaError_t e = cudaSuccess;
    for (const auto& [p, n] : outputs())
      if (e == cudaSuccess) e = cudaMemset(p, poison_byte, n);
    return e;
  }

  /// Does every byte of out, mixed and stats still hold the poison?
  ::testing::AssertionResult untouched() const {
    for (const auto& [p, n] : outputs()) {
      std::vector<unsigned char> bytes(n);
      const cudaError_t e = cudaMemcpy(bytes.data(), p, n, cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) return ::testing::AssertionFailure() << cudaGetErrorString(e);
      for (std::size_t i = 0; i < n; ++i)
        if (bytes[i] != poison_byte)
          return ::testing::AssertionFailure()
                 << "written at byte " << i << " of a buffer of " << n;
    }
    return ::testing::AssertionSuccess();
  }

  /// A forward's arguments over these buffers, every pointer set, for all the tokens.
  template <typename Args>
  Args arguments() const {
    Args a;
    a.x = x.get(), a.logits = logits.get(), a.weight = weight.get(), a.bias = bias.get();
    a.out = y.get(), a.mixed = mixed.get(), a.stats = stats.get(), a.tokens = tokens;
    return a;
  }

 private:
  std::vector<std::pair<void*, std::size_t>> outputs() const {
    return {{y.get(), y.size() * sizeof(G)},
            {mixed.get(), mixed.size() * sizeof(G)},
            {stats.get(), stats.size() * sizeof(float)}};
  }
};

/// What a bad argument throws.
enum class Throws { invalid_argument, out_of_range };

/// Expects call() to throw `t`'s qbl exception.
template <typename F>
void expect_throws(Throws t, F&& call) {
  if (t == Throws::out_of_range) {
    EXPECT_THROW(call(), qbl::out_of_range);
  } else {
    EXPECT_THROW(call(), qbl::invalid_argument);
  }
}

/// One bad-argument case of a parameterized suite: its test's name, the change (`Change`: an enum
/// the test switches on, or a function), and what the call throws.
template <typename Change>
struct BadCase {
  const char* name;
  Change change;
  Throws throws;
};

/// gtest prints a BadCase by its name.
template <typename Change>
void PrintTo(const BadCase<Change>& c, std::ostream* os) {
  *os << c.name;
}

/// INSTANTIATE_TEST_SUITE_P's name generator for cases that carry a `name`.
struct CaseName {
  template <typename P>
  std::string operator()(const ::testing::TestParamInfo<P>& i) const {
    return i.param.name;
  }
};

/// A fixture for tests over every supported type triple T (a qbl::LayerTypes<X, G, L>): a Per<T>
/// for each, made when a test starts, its ForwardBuffers `buffers` filled from a seed of its own.
/// Per<T> holds the plan or layer under test beside the buffers (the forward's bad-argument
/// suites of the plans and of QuantBlendLinear).
template <template <typename> class Per>
class EachTypeTriple : public ::testing::Test {
 protected:
  void SetUp() override {
    QBL_REQUIRE_GPU();
    qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
      auto& s = setup<decltype(t)>();
      s = std::make_unique<Per<decltype(t)>>();
      QBL_ASSERT_CUDA(s->buffers.fill(fresh_seed()));
    });
  }

  /// f(setup) for every supported type triple, in qbl::SupportedTypes's order, its types traced.
  template <typename F>
  void for_each_triple(F&& f) {
    qbl::for_each_type(qbl::SupportedTypes{}, [&](auto t) {
      SCOPED_TRACE(types_name(triple_of<decltype(t)>()));
      f(*setup<decltype(t)>());
    });
  }

 private:
  template <typename List>
  struct SetupsOf;
  template <typename... T>
  struct SetupsOf<qbl::TypeList<T...>> {
    using type = std::tuple<std::unique_ptr<Per<T>>...>;
  };

  template <typename T>
  std::unique_ptr<Per<T>>& setup() {
    return std::get<std::unique_ptr<Per<T>>>(setups_);
  }
  typename SetupsOf<qbl::SupportedTypes>::type setups_;
};

}  // namespace qbl_test

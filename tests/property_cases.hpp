// Random cases for the forward's property tests; the reference they are checked against, written
// independently of qbl/element_math.hpp, is tests/reference.hpp. Host-only.
#pragma once

#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace qbl_test {

/// Non-finite and edge inputs a case may carry.
enum class Special {
  none,
  nan_x,
  pos_inf_x,
  neg_inf_x,
  nan_logit,
  inf_logits,
  zero_x,
  neg_zero_x,
  denormal_x,
  sprinkled_zeros
};

inline const char* special_name(Special s) {
  switch (s) {
    case Special::none:
      return "none";
    case Special::nan_x:
      return "nan_x";
    case Special::pos_inf_x:
      return "pos_inf_x";
    case Special::neg_inf_x:
      return "neg_inf_x";
    case Special::nan_logit:
      return "nan_logit";
    case Special::inf_logits:
      return "inf_logits";
    case Special::zero_x:
      return "zero_x";
    case Special::neg_zero_x:
      return "neg_zero_x";
    case Special::denormal_x:
      return "denormal_x";
    case Special::sprinkled_zeros:
      return "sprinkled_zeros";
  }
  return "?";
}

struct PropertyCase {
  std::int64_t tokens = 1, in = 1, out = 1, max_tokens = 1;
  DType dtype = DType::fp32;
  std::size_t x_offset = 0;     ///< elements before x and logits in their allocations
  std::size_t gemm_offset = 0;  ///< elements before weight, bias and out
  bool bias = true;
  float x_std = 1.0f;
  Special special = Special::none;
  std::uint64_t data_seed = 0;

  std::string describe() const {
    return std::string(dtype_name(dtype)) + " tokens " + std::to_string(tokens) + " in " +
           std::to_string(in) + " out " + std::to_string(out) + " max_tokens " +
           std::to_string(max_tokens) + " x_offset " + std::to_string(x_offset) + " gemm_offset " +
           std::to_string(gemm_offset) + (bias ? " bias" : " no-bias") + " x_std " +
           std::to_string(x_std) + " special " + special_name(special);
  }
};

/// Case `index` of the run seeded `seed`: the same pair always gives the same case.
inline PropertyCase make_property_case(std::uint64_t seed, int index) {
  std::mt19937_64 gen(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(index));
  auto log_uniform = [&](double lo, double hi) {
    return std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(gen));
  };
  PropertyCase c;
  const DType types[] = {DType::fp32, DType::fp32, DType::tf32,
                         DType::bf16, DType::bf16, DType::fp16};
  c.dtype = types[gen() % 6];
  // Sizes spread log-uniformly; the CPU reference's product is kept under 2^22 multiply-adds.
  do {
    c.tokens = static_cast<std::int64_t>(log_uniform(1, 4097));
    c.in = static_cast<std::int64_t>(log_uniform(1, 2049));
    c.out = static_cast<std::int64_t>(log_uniform(1, 513));
  } while (c.tokens * c.in * c.out > (std::int64_t{1} << 22));
  c.max_tokens =
      c.tokens + static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(c.tokens + 1));
  const std::size_t offsets[] = {0, 0, 0, 1, 2, 3, 4, 8};
  c.x_offset = offsets[gen() % 8];
  c.gemm_offset = offsets[gen() % 8];
  c.bias = gen() % 4 != 0;
  c.x_std = static_cast<float>(log_uniform(1e-3, c.dtype == DType::fp16 ? 30.0 : 1e3));
  const unsigned roll = static_cast<unsigned>(gen() % 100);
  const Special specials[] = {Special::nan_x,      Special::pos_inf_x,  Special::neg_inf_x,
                              Special::nan_logit,  Special::inf_logits, Special::zero_x,
                              Special::neg_zero_x, Special::denormal_x, Special::sprinkled_zeros};
  c.special = roll < 82 ? Special::none : specials[(roll - 82) % 9];
  c.data_seed = gen();
  return c;
}

/// A case's inputs, every value representable in the case's dtype.
struct PropertyData {
  std::vector<float> x, logits, w, b;
};

inline PropertyData make_property_data(const PropertyCase& c) {
  std::mt19937_64 gen(c.data_seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto rt = [&](float v) { return ref_round(c.dtype, v); };
  PropertyData d;
  d.x.resize(static_cast<std::size_t>(c.tokens * c.in));
  d.logits.resize(static_cast<std::size_t>(c.tokens));
  d.w.resize(static_cast<std::size_t>(c.out * c.in));
  d.b.resize(static_cast<std::size_t>(c.out));
  for (auto& v : d.x) v = rt(c.x_std * nd(gen));
  for (auto& v : d.logits) v = rt(2.0f * nd(gen));
  const float w_std = 1.0f / std::sqrt(static_cast<float>(c.in));
  for (auto& v : d.w) v = rt(w_std * nd(gen));
  for (auto& v : d.b) v = rt(nd(gen));
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(gen() % n); };
  const float inf = std::numeric_limits<float>::infinity();
  switch (c.special) {
    case Special::none:
      break;
    case Special::nan_x:
      d.x[pick(d.x.size())] = std::numeric_limits<float>::quiet_NaN();
      break;
    case Special::pos_inf_x:
      d.x[pick(d.x.size())] = inf;
      break;
    case Special::neg_inf_x:
      d.x[pick(d.x.size())] = -inf;
      break;
    case Special::nan_logit:
      d.logits[pick(d.logits.size())] = std::numeric_limits<float>::quiet_NaN();
      break;
    case Special::inf_logits:
      d.logits[pick(d.logits.size())] = inf;
      d.logits[pick(d.logits.size())] = -inf;
      break;
    case Special::zero_x:
      std::fill(d.x.begin(), d.x.end(), 0.0f);
      break;
    case Special::neg_zero_x:
      std::fill(d.x.begin(), d.x.end(), -0.0f);
      break;
    case Special::denormal_x:
      // Below the smallest normal of every dtype here (fp16's is 6.1e-5), and kept apart from the
      // fp32 denormals' lower end so that most stay non-zero when rounded to the dtype.
      for (auto& v : d.x) v = rt((c.dtype == DType::fp16 ? 1e-5f : 1e-39f) * nd(gen));
      break;
    case Special::sprinkled_zeros:
      for (std::size_t i = 0; i < d.x.size(); i += 1 + pick(7)) d.x[i] = (i & 1) ? -0.0f : 0.0f;
      break;
  }
  return d;
}

}  // namespace qbl_test

// Random cases for the property tests, and a reference for `mixed` written independently of
// qbl/element_math.cuh: each fp32 op is done in double and rounded to float (exact for one +, -, *
// or / of two floats), then rounded to the dtype by a rounding that does not use CUDA's
// conversions. Host-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace qbl_test {

/// Round a float to a binary format with `p` significand bits and minimum normal exponent `emin`,
/// ties to even, overflowing to infinity -- independent of CUDA's conversion functions.
inline float round_binary(float v, int p, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0f) return v;
  int e = 0;
  std::frexp(static_cast<double>(v), &e);  // |v| in [2^(e-1), 2^e)
  const int lsb = std::max(e - p, emin - p + 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(v), -lsb)), lsb);
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<float>::infinity(), v);
  return static_cast<float>(r);
}
inline float ref_bf16(float v) { return round_binary(v, 8, -126, 3.3895313892515355e38); }
inline float ref_fp16(float v) { return round_binary(v, 11, -14, 65504.0); }

/// The element types and GEMM modes the property test draws from.
enum class DType { fp32, tf32, bf16, fp16 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::fp32: return "fp32";
    case DType::tf32: return "tf32";
    case DType::bf16: return "bf16";
    case DType::fp16: return "fp16";
  }
  return "?";
}

/// v rounded to the dtype's storage format (tf32 stores fp32).
inline float ref_round(DType t, float v) {
  return t == DType::bf16 ? ref_bf16(v) : (t == DType::fp16 ? ref_fp16(v) : v);
}

/// Non-finite and edge inputs a case may carry.
enum class Special { none, nan_x, pos_inf_x, neg_inf_x, nan_logit, inf_logits, zero_x, neg_zero_x,
                     denormal_x, sprinkled_zeros };

inline const char* special_name(Special s) {
  switch (s) {
    case Special::none: return "none";
    case Special::nan_x: return "nan_x";
    case Special::pos_inf_x: return "pos_inf_x";
    case Special::neg_inf_x: return "neg_inf_x";
    case Special::nan_logit: return "nan_logit";
    case Special::inf_logits: return "inf_logits";
    case Special::zero_x: return "zero_x";
    case Special::neg_zero_x: return "neg_zero_x";
    case Special::denormal_x: return "denormal_x";
    case Special::sprinkled_zeros: return "sprinkled_zeros";
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
  const DType types[] = {DType::fp32, DType::fp32, DType::tf32, DType::bf16, DType::bf16, DType::fp16};
  c.dtype = types[gen() % 6];
  // Sizes spread log-uniformly; the CPU reference's product is kept under 2^22 multiply-adds.
  do {
    c.tokens = static_cast<std::int64_t>(log_uniform(1, 4097));
    c.in = static_cast<std::int64_t>(log_uniform(1, 2049));
    c.out = static_cast<std::int64_t>(log_uniform(1, 513));
  } while (c.tokens * c.in * c.out > (std::int64_t{1} << 22));
  c.max_tokens = c.tokens + static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(c.tokens + 1));
  const std::size_t offsets[] = {0, 0, 0, 1, 2, 3, 4, 8};
  c.x_offset = offsets[gen() % 8];
  c.gemm_offset = offsets[gen() % 8];
  c.bias = gen() % 4 != 0;
  c.x_std = static_cast<float>(log_uniform(1e-3, c.dtype == DType::fp16 ? 30.0 : 1e3));
  const unsigned roll = static_cast<unsigned>(gen() % 100);
  const Special specials[] = {Special::nan_x,  Special::pos_inf_x,  Special::neg_inf_x,
                              Special::nan_logit, Special::inf_logits, Special::zero_x,
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
    case Special::none: break;
    case Special::nan_x: d.x[pick(d.x.size())] = std::numeric_limits<float>::quiet_NaN(); break;
    case Special::pos_inf_x: d.x[pick(d.x.size())] = inf; break;
    case Special::neg_inf_x: d.x[pick(d.x.size())] = -inf; break;
    case Special::nan_logit: d.logits[pick(d.logits.size())] = std::numeric_limits<float>::quiet_NaN(); break;
    case Special::inf_logits:
      d.logits[pick(d.logits.size())] = inf;
      d.logits[pick(d.logits.size())] = -inf;
      break;
    case Special::zero_x: std::fill(d.x.begin(), d.x.end(), 0.0f); break;
    case Special::neg_zero_x: std::fill(d.x.begin(), d.x.end(), -0.0f); break;
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

/// max |x| with NaN on top, as eager's max.
inline float reference_amax(const std::vector<float>& x) {
  float m = 0.0f;
  for (float v : x) {
    if (std::isnan(v)) return v;
    m = std::max(m, std::fabs(v));
  }
  return m;
}

/// eager's scale for that amax in the dtype: clamp(amax, 1e-8 rounded to the dtype), times
/// fl(1/127), rounded to the dtype.
inline float reference_scale(DType t, float amax) {
  const float bound = ref_round(t, 1e-8f);
  const float clamped = amax < bound ? bound : amax;
  return ref_round(t, static_cast<float>(static_cast<double>(clamped) * static_cast<double>(1.0f / 127.0f)));
}

/// eager's mixed for one element, op by op: fp32 op, rounded to the dtype.
inline float reference_mixed(DType t, float x, float alpha, float scale) {
  auto op = [&](double v) { return ref_round(t, static_cast<float>(v)); };
  float q = std::nearbyint(op(static_cast<double>(x) / scale));
  q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
  const float xq = op(static_cast<double>(q) * scale);
  const float oma = op(1.0 - static_cast<double>(alpha));
  return op(static_cast<double>(op(static_cast<double>(alpha) * xq)) +
            static_cast<double>(op(static_cast<double>(oma) * x)));
}

}  // namespace qbl_test

// The quant-blend arithmetic as the kernel runs it: the values of qbl/element_math.hpp, bit for
// bit, in fewer instructions. (Also the backward kernel's: qbl/detail/quant_blend_backward.inl.)
//
// Two changes of method, no change of value:
//
// 1. No division per element. The integer code clamp(rint(RN_T(x / s)), -127, 127) is found from
//    y = RN(1 / s), taken once per thread:
//    - float: t = RN(x * y) is within 3 * 2^-17 of RN(x / s) wherever |x / s| <= 128 (|x*y - x/s|
//      <= |x/s| * 2^-24, plus half an ulp twice), so rint gives both the same integer unless t lies
//      within 2^-14 of a half-integer; there, and for NaN, the exact division decides. Beyond 128
//      both clamp to +-127.
//    - bf16 / fp16: the code rounds x / s to T before rint, so the quotient itself must be exact:
//      q0 = RN(x * y), r = q0 * s - x (exact, one FMA), t = RN(q0 - r * y). For operands that are
//      T values (x is, and so is the scale, which eager rounds to T) this is RN(x / s) for every
//      pair, signed zeros included; the test suite checks all 2^32 pairs of each type on the GPU.
//      A NaN t (x infinite, or no usable y) takes the exact division.
//    y is used only where s and 1 / s are positive normal floats (2^-126 <= s <= 2^125); otherwise
//    it is NaN and every code takes the exact division.
// 2. bf16 / fp16 products and the sum on packed bf16x2 / half2 instructions, one rounding to T
//    each. Eager rounds twice (to fp32, then to T), but for T operands the fp32 result is exact
//    (products: 8- or 11-bit significands) or far from every T midpoint (sums), so one rounding
//    gives the same bits; the test suite checks all 2^32 operand pairs of each op on the GPU.
//
// Device code; the host versions exist for the CPU-side tests.
#pragma once

#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>
#include <qbl/element_math.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace qbl::detail {

QBL_HOST_DEVICE float rcp_rn(float v) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(v);
#else
  return 1.0f / v;
#endif
}

/// RN(1 / scale) where scale and its reciprocal are positive normal floats, else NaN (which sends
/// every code to the exact division).
QBL_HOST_DEVICE float code_reciprocal(float scale) {
  return scale >= 0x1p-126f && scale <= 0x1p125f ? rcp_rn(scale) : bits_float(0x7fffffffu);
}

/// rint(v) for |v| <= 2^22: adding and subtracting 1.5 * 2^23 rounds to an integer, ties to even.
/// A zero result comes out +0; callers put the sign back.
QBL_HOST_DEVICE float rint_unsigned_zero(float v) {
  constexpr float magic = 0x1.8p23f;
  return sub_rn(add_rn(v, magic), magic);
}

/// fp32 code clamp(rint(x / scale), -127, 127), NaN-propagating, from y = code_reciprocal(scale).
QBL_HOST_DEVICE float quant_code(float x, float scale, float y) {
  const float t = mul_rn(x, y);
  // fminf/fmaxf would turn a NaN t into -127; the t == t test below sends NaN to the exact path.
  const float c = fminf(fmaxf(t, -qmax), qmax);
  const float r = copysignf(rint_unsigned_zero(c), c);
  if (fabsf(sub_rn(c, r)) < 0.5f - 0x1p-14f && t == t) return r;
  return clamp_keep_nan(round_half_even(div_rn(x, scale)), -qmax, qmax);
}

/// RN(x / scale) for T-valued x and scale (see the top of this file), from y = RN(1 / scale) and
/// neg_y = -y; NaN where the exact division must decide.
QBL_HOST_DEVICE float quotient16(float x, float scale, float y, float neg_y) {
  const float q0 = mul_rn(x, y);
  // q0 - r * y with r = q0 * s - x: both zeros keep x's sign (no negated FMA result anywhere,
  // which a compiler could fold into an FMA of different zero sign).
  return fma_rn(fma_rn(q0, scale, -x), neg_y, q0);
}

/// fake_quant<T>(x, scale) element by element without the per-element division, from
/// y = code_reciprocal(scale): the same value for every input (the arguments above).
template <typename T>
QBL_HOST_DEVICE float fake_quant_from_reciprocal(float x, float scale, float y) {
  if constexpr (sizeof(T) == 4) {
    return mul_rn(quant_code(x, scale, y), scale);
  } else {
    float t = quotient16(x, scale, y, -y);
    if (t != t) t = div_rn(x, scale);
    const float code = clamp_keep_nan(round_half_even(round_to<T>(t)), -qmax, qmax);
    return round_to<T>(mul_rn(code, scale));
  }
}

/// The pair whose magnitudes are those of the 2 x 16 bits `magnitude` and whose signs are those of
/// `sign` (the magic-number rint loses the sign of a zero: rint(-0.3) is -0).
template <typename T2>
__device__ __forceinline__ T2 with_sign_of(std::uint32_t magnitude, T2 sign) {
  std::uint32_t s;
  std::memcpy(&s, &sign, sizeof s);
  const std::uint32_t r = (magnitude & 0x7fff7fffu) | (s & 0x80008000u);
  T2 out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

/// Packed pairs of a 16-bit type: bf16x2 or half2 and their one-rounding instructions.
template <typename T>
struct Pair;

template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
  static __device__ __forceinline__ type broadcast(float v) { return __float2bfloat162_rn(v); }
  static __device__ __forceinline__ type mul(type a, type b) { return __hmul2_rn(a, b); }
  static __device__ __forceinline__ type add(type a, type b) { return __hadd2_rn(a, b); }
  static __device__ __forceinline__ type clamp_code(type v) {
    return __hmin2_nan(__hmax2_nan(v, broadcast(-qmax)), broadcast(qmax));
  }
  /// rint of a clamped code (|v| <= 127, or NaN): bf16 has no integer grid over [-127, 127], so
  /// in fp32; the integers (and NaN) are exact in bf16, which is their fp32 bits' top half.
  static __device__ __forceinline__ type rint_code(type v) {
    const float2 f = to_float2(v);
    const std::uint32_t lo = __float_as_uint(rint_unsigned_zero(f.x));
    const std::uint32_t hi = __float_as_uint(rint_unsigned_zero(f.y));
    return with_sign_of(__byte_perm(lo, hi, 0x7632), v);
  }
};

template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) {
    return __floats2half2_rn(a, b);
  }
  static __device__ __forceinline__ type broadcast(float v) { return __float2half2_rn(v); }
  static __device__ __forceinline__ type mul(type a, type b) { return __hmul2_rn(a, b); }
  static __device__ __forceinline__ type add(type a, type b) { return __hadd2_rn(a, b); }
  static __device__ __forceinline__ type clamp_code(type v) {
    return __hmin2_nan(__hmax2_nan(v, broadcast(-qmax)), broadcast(qmax));
  }
  /// rint of a clamped code in half2 itself: 1536 = 1.5 * 2^10 puts |v| <= 127 on fp16's integer
  /// grid [1024, 2048), ties to even.
  static __device__ __forceinline__ type rint_code(type v) {
    const type magic = broadcast(1536.0f);
    const type r = __hsub2_rn(__hadd2_rn(v, magic), magic);
    std::uint32_t m;
    std::memcpy(&m, &r, sizeof m);
    return with_sign_of(m, v);
  }
};

/// The vector arithmetic of the quant-blend kernel for x of type X, `mixed` of type G and logits
/// of type L, vector width N: the per-row gate (alpha and 1 - alpha, rounded to L, as the
/// arithmetic wants them), the per-launch scale (in X), and `apply`, mixed for one vector: the
/// blend in X (the promoted type of every supported combination), rounded once to G. The general
/// case is qbl/element_math.hpp element by element.
template <typename X, typename G, typename L, int N, typename Enable = void>
struct QuantBlendMath {
  struct Gate {
    float alpha, one_minus_alpha;
  };
  static __device__ __forceinline__ Gate gate(L logit) {
    const float a = sigmoid<L>(to_float(logit));
    return {a, one_minus<L>(a)};
  }
  float scale = 0.0f;
  __device__ __forceinline__ void set_scale(float s) { scale = s; }
  __device__ __forceinline__ Vec<G, N> apply(const Vec<X, N>& in, Gate g) const {
    Vec<G, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float xv = to_float(in.v[j]);
      out.v[j] = from_float<G>(blend<X>(xv, fake_quant<X>(xv, scale), g.alpha, g.one_minus_alpha));
    }
    return out;
  }
};

/// float x vectors: the division-free code, then fake_quant's product and blend's three
/// roundings in fp32, and one rounding to G (mixed.to(G) under autocast).
template <typename G, typename L, int N>
struct QuantBlendMath<float, G, L, N, std::enable_if_t<(N > 1)>> {
  using Gate = typename QuantBlendMath<float, G, L, 1>::Gate;
  static __device__ __forceinline__ Gate gate(L logit) {
    return QuantBlendMath<float, G, L, 1>::gate(logit);
  }
  float scale = 0.0f, y = 0.0f;
  __device__ __forceinline__ void set_scale(float s) {
    scale = s;
    y = code_reciprocal(s);
  }
  __device__ __forceinline__ Vec<G, N> apply(const Vec<float, N>& in, Gate g) const {
    Vec<G, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float xv = in.v[j];
      const float xq = mul_rn(quant_code(xv, scale, y), scale);
      out.v[j] = from_float<G>(add_rn(mul_rn(g.alpha, xq), mul_rn(g.one_minus_alpha, xv)));
    }
    return out;
  }
};

/// bf16 / fp16 vectors of an even width, one type throughout: codes from the exact quotient,
/// everything after it on packed pairs.
template <typename T, int N>
struct QuantBlendMath<T, T, T, N, std::enable_if_t<(N > 1 && N % 2 == 0 && sizeof(T) == 2)>> {
  using P = Pair<T>;
  using T2 = typename P::type;
  struct Gate {
    T2 alpha, one_minus_alpha;
  };
  static __device__ __forceinline__ Gate gate(T logit) {
    const float a = sigmoid<T>(to_float(logit));
    return {P::broadcast(a), P::broadcast(one_minus<T>(a))};
  }
  float scale = 0.0f, y = 0.0f, neg_y = 0.0f;
  T2 scale2;
  __device__ __forceinline__ void set_scale(float s) {
    scale = s;
    y = code_reciprocal(s);
    neg_y = -y;
    scale2 = P::broadcast(s);
  }
  static constexpr int pairs = N / 2;
  /// clamp(rint(RN_T(x / scale)), -127, 127) for the vector's elements, as pairs.
  __device__ __forceinline__ void codes(const Vec<T, N>& in, T2 (&code)[pairs]) const {
    T2 x2[pairs];
    std::memcpy(x2, &in, sizeof x2);
    float t[N];
    bool exact = false;
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const float2 f = P::to_float2(x2[p]);
      t[2 * p] = quotient16(f.x, scale, y, neg_y);
      t[2 * p + 1] = quotient16(f.y, scale, y, neg_y);
      exact |= t[2 * p] != t[2 * p] || t[2 * p + 1] != t[2 * p + 1];
    }
    if (exact) {  // rare: an infinite x, or no usable reciprocal
#pragma unroll
      for (int j = 0; j < N; ++j)
        if (t[j] != t[j]) t[j] = div_rn(to_float(in.v[j]), scale);
    }
#pragma unroll
    for (int p = 0; p < pairs; ++p)
      code[p] = P::rint_code(P::clamp_code(P::from_floats(t[2 * p], t[2 * p + 1])));
  }
  __device__ __forceinline__ Vec<T, N> apply(const Vec<T, N>& in, Gate g) const {
    T2 code[pairs], x2[pairs], m[pairs];
    codes(in, code);
    std::memcpy(x2, &in, sizeof x2);
#pragma unroll
    for (int p = 0; p < pairs; ++p) {
      const T2 xq = P::mul(code[p], scale2);
      m[p] = P::add(P::mul(g.alpha, xq), P::mul(g.one_minus_alpha, x2[p]));
    }
    Vec<T, N> out;
    std::memcpy(&out, m, sizeof out);
    return out;
  }
};

}  // namespace qbl::detail

// Tables of an activation in shared memory: for bfloat16 inputs, the kernels look act(h) and
// prepare()'s numbers up instead of evaluating erf, tanh or exp per element, and the vector forms
// of the activation that every element kernel calls (activate_vec, activate_backward_vec,
// activate_both_vec), written once for a table or none (NoTable).
//
// Evaluated per element, GELU and SiLU make qbl's element kernels bound by instruction issue
// (benchmarks/HISTORY.md has the measurements). A bfloat16 has only 65,536 values, and those a
// layer sees lie almost all in a few binades, so each block first evaluates the activation for
// the 4,096 bfloat16 values of magnitude in [2^-12, 16) -- with the very device functions the
// kernels would otherwise call, so every entry has their bits -- and then every element of that
// range costs a shared-memory load. Inputs outside the range (zeros, tiny and huge values, Inf,
// NaN) are evaluated as before, after the lookups of their vector, only where a vector has one.
// The results are those of the arithmetic for every input.
//
// fp16 and fp32 inputs, ReLU and the identity have no table (ActivationTable<...> is NoTable):
// their kernels evaluate.
#pragma once

#include <qbl/activation.cuh>
#include <qbl/detail/config.cuh>
#include <qbl/detail/vec.cuh>

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace qbl::detail {

/// The table's range: bfloat16 magnitudes from 2^-12 (bits 115 << 7) for 16 binades of 128 values,
/// each sign: 4096 entries, index = (sign << 11) | (magnitude bits - table_low).
inline constexpr std::uint32_t table_low = 115u << 7;
inline constexpr int table_sign_shift = 11;
inline constexpr std::uint32_t table_span = 1u << table_sign_shift;
inline constexpr int table_entries = 2 * static_cast<int>(table_span);

/// The table entry of a bfloat16 input's bits where the input is inside the table's range; some
/// entry where it is not, and then `outside` becomes nonzero. Branch-free, so that the kernels'
/// loads from the table need no predicate: an input outside the range loads an entry and then
/// has its value evaluated instead.
QBL_HOST_DEVICE std::uint32_t table_slot(std::uint32_t bits, std::uint32_t& outside) {
  const std::uint32_t i = (bits & 0x7fffu) - table_low;  // wraps around below the range
  outside |= i >= table_span ? 1u : 0u;
  return (i & (table_span - 1)) | ((bits >> (15 - table_sign_shift)) & table_span);
}

/// The table entry of a bfloat16 input's bits, or -1 outside the table's range.
QBL_HOST_DEVICE int table_index(std::uint16_t bits) {
  std::uint32_t outside = 0;
  const std::uint32_t slot = table_slot(bits, outside);
  return outside != 0 ? -1 : static_cast<int>(slot);
}

/// The bfloat16 bits of table entry i (table_index's inverse).
QBL_HOST_DEVICE std::uint16_t table_input_bits(int i) {
  const auto u = static_cast<std::uint32_t>(i);
  return static_cast<std::uint16_t>((u >> table_sign_shift << 15) |
                                    ((u & (table_span - 1)) + table_low));
}

/// Registers per thread that kernels with an activation table are held to (through
/// __launch_bounds__' minimum of resident blocks). Tuned on an H200 (sm_90, 8192 x 8192 bf16,
/// GELU); benchmarks/HISTORY.md has the measurements.
inline constexpr int table_max_registers_sm90 = 80;

/// Blocks of `threads` threads a multiprocessor should hold at once where kernels look an
/// activation up in a table (their __launch_bounds__' second argument); 0 elsewhere, which
/// __launch_bounds__ takes as no bound (an explicit 1 changes ptxas's choices).
template <bool TABLE>
inline constexpr int table_min_blocks(int threads) {
  return TABLE ? 65536 / (table_max_registers_sm90 * threads) : 0;
}

/// No table: every lookup evaluates the activation (fp16, fp32, ReLU, the identity).
struct NoTable {
  static constexpr bool enabled = false;
  __device__ __forceinline__ void fill(bool) {}
};

template <typename Act, typename T, bool DERIVATIVE, typename Enable = void>
struct ActivationTable : NoTable {};

/// The table of a tabulated activation for bfloat16 inputs: act(h) rounded to bfloat16 and, with
/// DERIVATIVE, prepare()'s `terms` numbers. A __shared__ object, filled by the whole block. With
/// DERIVATIVE and one term (GELU, tanh-GELU) each entry holds both, 8 bytes, so that a lookup of
/// both is one 8-byte shared load; otherwise act(h) and the terms lie in arrays of their own.
template <typename Act, bool DERIVATIVE>
struct ActivationTable<Act, __nv_bfloat16, DERIVATIVE, std::enable_if_t<Act::tabulated>> {
  static constexpr bool enabled = true;
  static constexpr bool packed = DERIVATIVE && Act::terms == 1;
  /// {bits of d[0], bits of RN_bf16(act(h))}, where packed.
  uint2 entry[packed ? table_entries : 1];
  std::uint16_t y[packed ? 1 : table_entries];  ///< bits of RN_bf16(act(h))
  float d[DERIVATIVE && !packed ? Act::terms : 1][DERIVATIVE && !packed ? table_entries : 1];

  /// Every entry, by every thread of the block (the caller synchronizes the block before the
  /// first lookup); the derivative's numbers only where `derivative` (a backward that computes a
  /// gradient).
  __device__ __forceinline__ void fill(bool derivative) {
    for (int i = static_cast<int>(threadIdx.x); i < table_entries;
         i += static_cast<int>(blockDim.x)) {
      const float h = __bfloat162float(__ushort_as_bfloat16(table_input_bits(i)));
      float v;
      float dv[Act::terms] = {};
      if constexpr (DERIVATIVE) {
        if (derivative) {
          Act::prepare(h, v, dv);
        } else {
          v = Act::forward(h);
        }
      } else {
        v = Act::forward(h);
      }
      const std::uint16_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      if constexpr (packed) {
        entry[i] = make_uint2(__float_as_uint(dv[0]), bits);
      } else {
        y[i] = bits;
        if constexpr (DERIVATIVE) {
#pragma unroll
          for (int t = 0; t < Act::terms; ++t) d[t][i] = dv[t];
        }
      }
    }
  }
  __device__ __forceinline__ __nv_bfloat16 value(std::uint32_t i) const {
    if constexpr (packed) {
      return __ushort_as_bfloat16(static_cast<std::uint16_t>(entry[i].y));
    } else {
      return __ushort_as_bfloat16(y[i]);
    }
  }
  __device__ __forceinline__ float gradient(float dy, std::uint32_t i) const {
    static_assert(DERIVATIVE, "a table without the derivative's numbers");
    float dv[Act::terms];
    if constexpr (packed) {
      dv[0] = __uint_as_float(entry[i].x);
    } else {
#pragma unroll
      for (int t = 0; t < Act::terms; ++t) dv[t] = d[t][i];
    }
    return Act::apply(dy, dv);
  }
  /// value(i) and gradient(dy, i) from one load of the entry where packed.
  __device__ __forceinline__ void both(float dy, std::uint32_t i, __nv_bfloat16& x,
                                       float& dh) const {
    if constexpr (packed) {
      const uint2 e = entry[i];
      x = __ushort_as_bfloat16(static_cast<std::uint16_t>(e.y));
      float dv[Act::terms] = {__uint_as_float(e.x)};
      dh = Act::apply(dy, dv);
    } else {
      x = value(i);
      dh = gradient(dy, i);
    }
  }
};

/// Fills a block's activation table, where it has one, before its first lookup: every
/// thread of the block calls it.
template <typename Table>
__device__ __forceinline__ void fill_table(Table& table, bool derivative) {
  if constexpr (Table::enabled) {
    table.fill(derivative);
    __syncthreads();
  }
}

// One element outside the table's range, evaluated. Out of line and on scalars (passed in
// registers): the hot loops keep only the lookups' registers, and no vector of theirs is ever
// given an address.
template <typename Act, typename T>
__device__ __noinline__ float activate_miss(float h) {
  return to_float(from_float<T>(Act::forward(h)));
}

template <typename Act, typename T>
__device__ __noinline__ float activate_backward_miss(float dy, float h) {
  return to_float(from_float<T>(Act::backward(dy, h)));
}

template <typename Act, typename T>
__device__ __noinline__ float2 activate_both_miss(float dy, float h) {
  float y, d;
  Act::both(dy, h, y, d);
  return make_float2(to_float(from_float<T>(y)), to_float(from_float<T>(d)));
}

/// act applied to each element of a vector of T, rounded to T, from `table` where it has one.
template <typename Act, typename T, int N, typename Table = NoTable>
__device__ __forceinline__ Vec<T, N> activate_vec(const Vec<T, N>& h, const Table& table = {}) {
  if constexpr (ActivationTraits<Act>::identity) {
    return h;
  } else {
    Vec<T, N> x;
    std::uint32_t miss = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (Table::enabled) {
        x.v[j] = table.value(table_slot(__bfloat16_as_ushort(h.v[j]), miss));
      } else {
        x.v[j] = from_float<T>(Act::forward(to_float(h.v[j])));
      }
    }
    if constexpr (Table::enabled) {
      if (miss != 0) {  // rare: outside the table's range
#pragma unroll
        for (int j = 0; j < N; ++j)
          if (table_index(__bfloat16_as_ushort(h.v[j])) < 0)
            x.v[j] = from_float<T>(activate_miss<Act, T>(to_float(h.v[j])));
      }
    }
    return x;
  }
}

/// The activation's backward for a gradient vector dy at the inputs h, rounded to T, from
/// `table` where it has one.
template <typename Act, typename T, int N, typename Table = NoTable>
__device__ __forceinline__ Vec<T, N> activate_backward_vec(const Vec<T, N>& dy, const Vec<T, N>& h,
                                                           const Table& table = {}) {
  if constexpr (ActivationTraits<Act>::identity) {
    return dy;
  } else {
    Vec<T, N> out;
    std::uint32_t miss = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (Table::enabled) {
        const std::uint32_t i = table_slot(__bfloat16_as_ushort(h.v[j]), miss);
        out.v[j] = from_float<T>(table.gradient(to_float(dy.v[j]), i));
      } else {
        out.v[j] = from_float<T>(Act::backward(to_float(dy.v[j]), to_float(h.v[j])));
      }
    }
    if constexpr (Table::enabled) {
      if (miss != 0) {
#pragma unroll
        for (int j = 0; j < N; ++j)
          if (table_index(__bfloat16_as_ushort(h.v[j])) < 0)
            out.v[j] =
                from_float<T>(activate_backward_miss<Act, T>(to_float(dy.v[j]), to_float(h.v[j])));
      }
    }
    return out;
  }
}

/// act(h) and its backward for dy, elementwise, each rounded to T: what activate_vec and
/// activate_backward_vec give, evaluating (or looking up) what the two share once.
template <typename Act, typename T, int N, typename Table = NoTable>
__device__ __forceinline__ void activate_both_vec(const Vec<T, N>& dy, const Vec<T, N>& h,
                                                  Vec<T, N>& x, Vec<T, N>& dh,
                                                  const Table& table = {}) {
  if constexpr (ActivationTraits<Act>::identity) {
    x = h;
    dh = dy;
  } else {
    std::uint32_t miss = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float d;
      if constexpr (Table::enabled) {
        const std::uint32_t i = table_slot(__bfloat16_as_ushort(h.v[j]), miss);
        table.both(to_float(dy.v[j]), i, x.v[j], d);
      } else {
        float y;
        Act::both(to_float(dy.v[j]), to_float(h.v[j]), y, d);
        x.v[j] = from_float<T>(y);
      }
      dh.v[j] = from_float<T>(d);
    }
    if constexpr (Table::enabled) {
      if (miss != 0) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          if (table_index(__bfloat16_as_ushort(h.v[j])) < 0) {
            const float2 r = activate_both_miss<Act, T>(to_float(dy.v[j]), to_float(h.v[j]));
            x.v[j] = from_float<T>(r.x);
            dh.v[j] = from_float<T>(r.y);
          }
        }
      }
    }
  }
}

}  // namespace qbl::detail

// Shared helpers for qbl's tests: the GPU tests' first line, device buffers, random inputs, bit
// comparison. Host-only so that plain C++ tests (test_error.cpp, test_tolerance.cpp) can use it
// too.
#pragma once

#include "gpu_status.hpp"

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace qbl_test {

/// Is a CUDA device usable? `why` gets the reason when not.
inline bool gpu_available(std::string* why = nullptr) {
  const GpuStatus& s = gpu_status();
  if (why != nullptr) *why = s.reason;
  return s.usable;
}

}  // namespace qbl_test

/// The first line of every GPU test. Without a usable GPU the test is skipped, with the reason --
/// but it fails instead where the machine has a GPU that CUDA cannot use (broken or outdated
/// driver, device unavailable), or where QBL_REQUIRE_GPU=1 says a GPU must be there.
#define QBL_REQUIRE_GPU()                                                                   \
  do {                                                                                      \
    const ::qbl_test::GpuStatus& qbl_gpu_ = ::qbl_test::gpu_status();                       \
    if (qbl_gpu_.usable) break;                                                             \
    if (::qbl_test::gpu_required())                                                         \
      GTEST_FAIL() << qbl_gpu_.reason << " -- and QBL_REQUIRE_GPU=1 requires a usable GPU"; \
    if (!qbl_gpu_.absent) GTEST_FAIL() << qbl_gpu_.reason;                                  \
    GTEST_SKIP() << qbl_gpu_.reason;                                                        \
  } while (0)

#define QBL_ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

namespace qbl_test {

/// A device allocation for a test; frees itself.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t n, std::size_t pad = 0) : n_(n) {
    if (cudaMalloc(&base_, (n + pad) * sizeof(T) + 16) != cudaSuccess) base_ = nullptr;
  }
  ~DeviceArray() { cudaFree(base_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  /// Element `offset` of the allocation (offset 1 gives a pointer misaligned for vectors).
  T* get(std::size_t offset = 0) const { return static_cast<T*>(base_) + offset; }
  bool ok() const { return base_ != nullptr; }
  std::size_t size() const { return n_; }

 private:
  void* base_ = nullptr;
  std::size_t n_;
};

template <typename T>
cudaError_t to_device(T* d, const std::vector<T>& h) {
  return cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
}

template <typename T>
cudaError_t to_host(std::vector<T>& h, const T* d) {
  return cudaMemcpy(h.data(), d, h.size() * sizeof(T), cudaMemcpyDeviceToHost);
}

/// The unsigned value of environment variable `name` (decimal, 0x hex or 0 octal), or `fallback`
/// when it is unset or empty: seeds and case counts of the randomized tests.
inline std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 0) : fallback;
}

/// Fresh seed per run; print it with SCOPED_TRACE so a failure can be replayed.
inline std::uint64_t fresh_seed() {
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

inline std::vector<float> randn(std::size_t n, std::uint64_t seed, float stddev = 1.0f) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(gen);
  return v;
}

inline std::uint32_t bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

/// A quiet NaN with a payload no kernel produces: an element left unwritten stays this.
inline constexpr std::uint8_t poison_byte = 0xff;

/// Expects `actual` and `expected` to hold the same bits everywhere; reports the first mismatches.
inline ::testing::AssertionResult bits_equal(const std::vector<float>& actual,
                                             const std::vector<float>& expected,
                                             std::size_t row_length = 0) {
  if (actual.size() != expected.size()) return ::testing::AssertionFailure() << "size mismatch";
  std::size_t bad = 0;
  auto failure = ::testing::AssertionFailure();
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (bits(actual[i]) == bits(expected[i])) continue;
    if (std::isnan(actual[i]) && std::isnan(expected[i]) && bits(actual[i]) != 0xffffffffu)
      continue;
    if (bad < 8) {
      failure << "\n  index " << i;
      if (row_length != 0)
        failure << " (row " << i / row_length << ", col " << i % row_length << ")";
      failure << ": expected " << expected[i] << " (0x" << std::hex << bits(expected[i])
              << "), actual " << actual[i] << " (0x" << bits(actual[i]) << std::dec << ")";
    }
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return failure << "\n  " << bad << " of " << actual.size() << " elements differ";
}

/// ||a - b|| / ||b|| in double.
inline double relative_error(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

/// out[t, o] = sum_i a[t, i] * w[o, i] + bias[o], in double.
inline std::vector<double> linear_reference(const std::vector<float>& a,
                                            const std::vector<float>& w, const float* bias,
                                            std::int64_t tokens, std::int64_t in,
                                            std::int64_t out) {
  std::vector<double> r(static_cast<std::size_t>(tokens * out));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t o = 0; o < out; ++o) {
      double s = bias != nullptr ? bias[o] : 0.0;
      const float* ar = &a[t * in];
      const float* wr = &w[o * in];
      for (std::int64_t i = 0; i < in; ++i) s += static_cast<double>(ar[i]) * wr[i];
      r[t * out + o] = s;
    }
  }
  return r;
}

/// Element conversions for the test's host-side data (float, __nv_bfloat16, __half).
template <typename T>
T from_f(float v) {
  return static_cast<T>(v);
}
template <typename T>
float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
std::vector<T> convert(const std::vector<float>& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = from_f<T>(v[i]);
  return r;
}

template <typename T>
std::vector<float> widen(const std::vector<T>& v) {
  std::vector<float> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = to_f(v[i]);
  return r;
}

}  // namespace qbl_test

// Argument checks of the plans, written once per plan as a function that returns what is wrong
// (supports() asks it, run() throws what it says): host-only.
#pragma once

#include <qbl/detail/align.hpp>
#include <qbl/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace qbl::detail {

/// What a check found: nothing (ok), or the exception run() throws and why.
struct Check {
  enum class Fault { none, invalid_argument, out_of_range, logic_error };
  Fault fault = Fault::none;
  const char* message = "";
  const char* condition = "";
  const char* file = "";
  int line = 0;

  bool ok() const noexcept { return fault == Fault::none; }
};

/// Throws what `c` says is wrong (nothing if it is ok).
inline void raise(const Check& c) {
  if (c.ok()) return;
  const std::string what =
      std::string("qbl: ") + c.message + " [" + c.condition + "] at " + where(c.file, c.line);
  switch (c.fault) {
    case Check::Fault::invalid_argument:
      throw qbl::invalid_argument(what);
    case Check::Fault::out_of_range:
      throw qbl::out_of_range(what);
    case Check::Fault::logic_error:
      throw qbl::logic_error(what);
    case Check::Fault::none:
      break;
  }
}

/// In a function returning Check: return the fault unless `condition` holds.
#define QBL_CHECK(condition, fault, message)                                                 \
  do {                                                                                       \
    if (!(condition))                                                                        \
      return ::qbl::detail::Check{::qbl::detail::Check::Fault::fault, (message), #condition, \
                                  __FILE__, __LINE__};                                       \
  } while (0)

/// A device buffer's extent, for the overlap checks.
struct Span {
  const void* p = nullptr;
  std::size_t bytes = 0;
};

/// Do two spans share a byte? (A null or empty span shares none.)
inline bool overlaps(const Span& a, const Span& b) noexcept {
  if (a.p == nullptr || b.p == nullptr || a.bytes == 0 || b.bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a.p), pb = reinterpret_cast<std::uintptr_t>(b.p);
  return pa < pb + b.bytes && pb < pa + a.bytes;
}

/// rows * cols * elem, or 0 where that overflows (sizes checked at construction never do).
inline std::size_t span_bytes(std::int64_t rows, std::int64_t cols, std::size_t elem) noexcept {
  if (rows <= 0 || cols <= 0) return 0;
  const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  if (r > std::numeric_limits<std::size_t>::max() / elem / c) return 0;
  return static_cast<std::size_t>(r * c * elem);
}

/// rows * cols * elem, throwing qbl::invalid_argument for negative sizes or an overflow.
inline std::size_t checked_bytes(std::int64_t rows, std::int64_t cols, std::size_t elem) {
  QBL_EXPECTS(rows >= 0 && cols >= 0, qbl::invalid_argument, "sizes must be non-negative");
  QBL_EXPECTS(
      cols == 0 || static_cast<std::uint64_t>(rows) <= std::numeric_limits<std::size_t>::max() /
                                                           elem / static_cast<std::uint64_t>(cols),
      qbl::invalid_argument, "size overflows size_t");
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * elem;
}

/// The current device, or -1 if CUDA cannot say (the check then fails on the device test).
inline int current_device() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

/// Offsets of a workspace's parts, each 256-byte aligned.
inline std::size_t align_up(std::size_t bytes) noexcept { return (bytes + 255) / 256 * 256; }

}  // namespace qbl::detail

// Pointer alignment helpers (host-only).
#pragma once

#include <cstddef>
#include <cstdint>

namespace qbl::detail {

inline bool is_aligned(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace qbl::detail

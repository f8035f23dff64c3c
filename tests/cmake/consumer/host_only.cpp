// Plain C++ can include the host-only headers.
#include <qbl/error.hpp>
#include <qbl/options.hpp>
#include <qbl/types.hpp>
#include <qbl/version.hpp>

static_assert(qbl::supported_types<float, __nv_bfloat16, float>, "the library's type list");

std::size_t default_workspace() { return qbl::Options{}.cublas_workspace_bytes; }

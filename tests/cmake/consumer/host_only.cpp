// Plain C++ can include the host-only headers.
#include <qbl/error.hpp>
#include <qbl/options.hpp>
#include <qbl/version.hpp>

std::size_t default_workspace() { return qbl::Options{}.cublas_workspace_bytes; }

// Plain C++ can include the host-only headers.
#include <qbl/error.hpp>
#include <qbl/gemm.hpp>
#include <qbl/options.hpp>

std::size_t default_workspace() { return qbl::Options{}.cublas_workspace_bytes; }

// qbl/version.hpp -- the library version, also exported by the CMake package.
#pragma once

#define QBL_VERSION_MAJOR 0
#define QBL_VERSION_MINOR 3
#define QBL_VERSION_PATCH 0
/// MAJOR * 10000 + MINOR * 100 + PATCH.
#define QBL_VERSION (QBL_VERSION_MAJOR * 10000 + QBL_VERSION_MINOR * 100 + QBL_VERSION_PATCH)

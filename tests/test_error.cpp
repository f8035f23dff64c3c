// qbl/error.hpp: exception types and the checking macros (host-only, runs in CI).
#include <qbl/error.hpp>

#include <gtest/gtest.h>

#include <string>
#include <type_traits>

namespace {

static_assert(std::is_base_of_v<std::runtime_error, qbl::cuda_error>);
static_assert(std::is_base_of_v<qbl::cuda_error, qbl::out_of_memory>);
static_assert(std::is_base_of_v<std::runtime_error, qbl::cublas_error>);
static_assert(std::is_base_of_v<std::invalid_argument, qbl::invalid_argument>);
static_assert(std::is_base_of_v<std::out_of_range, qbl::out_of_range>);
static_assert(std::is_base_of_v<std::logic_error, qbl::logic_error>);

cudaError_t returns(cudaError_t e) { return e; }
cublasStatus_t returns_status(cublasStatus_t s) { return s; }

TEST(Error, CudaTryCarriesCallLocationAndStatus) {
  try {
    QBL_CUDA_TRY(returns(cudaErrorInvalidValue));
    FAIL() << "no throw";
  } catch (const qbl::cuda_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), cudaErrorInvalidValue);
    EXPECT_NE(what.find("returns(cudaErrorInvalidValue)"), std::string::npos) << what;
    EXPECT_NE(what.find("test_error.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
  }
}

TEST(Error, AllocationFailureIsOutOfMemory) {
  EXPECT_THROW(QBL_CUDA_TRY(returns(cudaErrorMemoryAllocation)), qbl::out_of_memory);
}

TEST(Error, CudaTrySucceedsSilently) { EXPECT_NO_THROW(QBL_CUDA_TRY(returns(cudaSuccess))); }

TEST(Error, CublasTryCarriesStatusName) {
  try {
    QBL_CUBLAS_TRY(returns_status(CUBLAS_STATUS_NOT_SUPPORTED));
    FAIL() << "no throw";
  } catch (const qbl::cublas_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.status(), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_NE(what.find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos) << what;
    EXPECT_NE(what.find("test_error.cpp:"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(QBL_CUBLAS_TRY(returns_status(CUBLAS_STATUS_SUCCESS)));
}

TEST(Error, ExpectsThrowsTheNamedType) {
  const int tokens = -1;
  try {
    QBL_EXPECTS(tokens >= 0, qbl::invalid_argument, "tokens must be non-negative");
    FAIL() << "no throw";
  } catch (const qbl::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tokens must be non-negative"), std::string::npos) << what;
    EXPECT_NE(what.find("tokens >= 0"), std::string::npos) << what;
  }
}

}  // namespace

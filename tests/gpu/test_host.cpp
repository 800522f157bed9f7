// Host-side parts of the CUDA and NCCL backends that need no device, so they run on every machine: the dtype
// and operator mapping to NCCL, the errors that CUDA and NCCL failures become, and from_env's id exchange.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include <ddp/comm/nccl/error.hpp>
#include <ddp/comm/nccl/from_env.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/cuda/error.hpp>
#include <support/run_ranks.hpp>

TEST_CASE("every ddp dtype maps to the NCCL type of its size and kind", "[cuda][nccl]") {
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::f32) == ncclFloat32);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::f64) == ncclFloat64);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::bf16) == ncclBfloat16);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::f16) == ncclFloat16);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::i32) == ncclInt32);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::i64) == ncclInt64);
  CHECK(ddp::nccl::detail::datatype(ddp::dtype::u8) == ncclUint8);
}

TEST_CASE("every reduce_op maps to NCCL's operator, avg to the sum the communicator divides", "[cuda][nccl]") {
  CHECK(ddp::nccl::detail::reduction(ddp::reduce_op::sum) == ncclSum);
  CHECK(ddp::nccl::detail::reduction(ddp::reduce_op::avg) == ncclSum);
  CHECK(ddp::nccl::detail::reduction(ddp::reduce_op::min) == ncclMin);
  CHECK(ddp::nccl::detail::reduction(ddp::reduce_op::max) == ncclMax);
  CHECK(ddp::nccl::detail::reduction(ddp::reduce_op::prod) == ncclProd);
}

TEST_CASE("an NCCL failure is a ddp::nccl_error with NCCL's text, the code, the rank and a fix",
          "[cuda][nccl]") {
  try {
    ddp::nccl::detail::fail(ncclInvalidUsage, "ncclAllReduce", 3);
    FAIL("fail() returned");
  } catch (const ddp::nccl_error& e) {
    CHECK(e.rank() == 3);
    CHECK(e.native_code() == static_cast<int>(ncclInvalidUsage));
    const std::string what = e.what();
    CHECK_THAT(what, Catch::StartsWith("ddp [rank 3]: ncclAllReduce failed: "));
    CHECK_THAT(what, Catch::Contains(ncclGetErrorString(ncclInvalidUsage)));
    CHECK_THAT(what, Catch::Contains("NCCL_HOSTID"));
  }
  try {
    ddp::nccl::detail::fail(ncclRemoteError, "all_reduce", 0);
    FAIL("fail() returned");
  } catch (const ddp::error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("a peer died"));
  }
}

TEST_CASE("a CUDA failure is a ddp::cuda_error naming the call, CUDA's error and a fix", "[cuda]") {
  CHECK_NOTHROW(ddp::cuda::check(cudaSuccess, "cudaMalloc"));
  try {
    ddp::cuda::check(cudaErrorMemoryAllocation, "cudaMalloc of 4096 bytes", 1);
    FAIL("check() returned");
  } catch (const ddp::cuda_error& e) {
    CHECK(e.rank() == 1);
    CHECK(e.native_code() == static_cast<int>(cudaErrorMemoryAllocation));
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("cudaMalloc of 4096 bytes failed with cudaErrorMemoryAllocation"));
    CHECK_THAT(what, Catch::Contains("out of memory"));
  }
  try {
    ddp::cuda::check(cudaErrorNoDevice, "cudaGetDeviceCount");
    FAIL("check() returned");
  } catch (const ddp::cuda_error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("ctest -L gpu"));
  }
}

TEST_CASE("nccl from_env: every rank gets rank 0's ncclUniqueId through the rendezvous store alone", "[cuda][nccl]") {
  const auto result = ddp::testing::run_ranks(3, [](int) {
    const ncclUniqueId id = ddp::nccl::detail::env_rendezvous::exchange_id(ddp::tcp::config_from_env());
    const auto* bytes = reinterpret_cast<const unsigned char*>(&id);
    std::string hex;
    for (std::size_t i = 0; i < sizeof id; ++i) {
      char two[3];
      std::snprintf(two, sizeof two, "%02x", bytes[i]);
      hex += two;
    }
    std::printf("id %s\n", hex.c_str());
    std::fflush(stdout);
  });
  ddp::testing::require_all_ok(result);
  const auto id_of = [&](int r) {
    const std::string& out = result.ranks[static_cast<std::size_t>(r)].output;
    const auto at = out.find("id ");
    REQUIRE(at != std::string::npos);
    return out.substr(at + 3, 2 * sizeof(ncclUniqueId));
  };
  CHECK(id_of(0) != std::string(2 * sizeof(ncclUniqueId), '0'));  // rank 0 made one
  CHECK(id_of(1) == id_of(0));
  CHECK(id_of(2) == id_of(0));
}

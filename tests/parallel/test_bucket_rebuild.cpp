// Buckets rebuilt in the first step's ready order over TCP (rebuild_scenarios.hpp), and in one process through
// the recording loopback communicator: after the rebuild the first bucket starts before the backward ends.
#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "rebuild_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first
}  // namespace

TEST_CASE("rebuild: the planned buckets of the reversed model would start fc1's first", "[rebuild]") {
  require_planned_order_is_late();
}

TEST_CASE("tcp rebuild: buckets in the backward's order on every rank, equal to one process", "[rebuild]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_rebuilt_training<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_rebuilt_training<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5, closeness::per_element, 3);  // no_sync
    check_rebuilt_training<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5, closeness::per_element, 1, {},
                                      {.rebuild_buckets = false});
    check_rebuilt_training<tcp, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_momentum, 1e-2,
                                                               closeness::per_tensor);
  });
}

TEST_CASE("tcp rebuild: a rank whose backward runs in another order takes rank 0's buckets", "[rebuild]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_rebuilt_training<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element, 1, {}, {},
                                      true);
  });
}

TEST_CASE("tcp rebuild: deterministic reduction keeps its bits whether buckets are rebuilt or not", "[rebuild][determinism]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) { check_rebuilt_deterministic<tcp>(comm); });
}

// Uneven inputs over the TCP backend (dp.join()): ranks with 5, 7, 3, 6 batches (three epochs, see
// join_scenarios.hpp) equal one process on the union of each step's batches, every policy, N = 1..4.
#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "join_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters
}  // namespace

TEST_CASE("tcp join: replicate with uneven batch counts equals one process on the active ranks' batches, plain, "
          "with no_sync, compressed and deterministic", "[join]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_join<tcp>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_join<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5);
    check_join<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element, {}, 3);  // no_sync
    check_join<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element, {}, 3, true);  // rebuilt
    check_join<tcp, tiny>(comm, optimizer_kind::sgd_nesterov, 1e-5, closeness::per_element,
                          ddp::replicate{.deterministic = true});
    check_join<tcp, tiny, ddp::fp16_compress_hook>(comm, optimizer_kind::sgd_momentum, 1e-2, closeness::per_tensor);
  });
}
TEST_CASE("tcp join: shard_grad_op, full_shard and hybrid with uneven batch counts equal one process", "[join]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_join<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, 1e-5);
    check_join<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5);
    check_join<tcp, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element,
                                     ddp::full_shard{.reshard_after_forward = false, .deterministic = true});
    check_join<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5, closeness::per_element,
                                                        hybrid_groups<ddp::full_shard>(comm.size()));
    check_join<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::sgd_momentum, 1e-5,
                                                           closeness::per_element,
                                                           hybrid_groups<ddp::shard_grad_op>(comm.size()));
  });
}
TEST_CASE("tcp join: a scope dropped without finish(opt) makes the next call throw on every rank, and no_sync and a "
          "second scope are refused", "[join][errors]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) { check_join_errors<tcp>(comm); });
}

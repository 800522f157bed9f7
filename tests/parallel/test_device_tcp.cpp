// data_parallel with the model on fake devices over the TCP backend (device_scenarios.hpp), at N = 1..4 forked
// ranks: buckets staged through host memory by the collective front end, element work and the optimizer on the
// devices' streams. Replicate, hybrid, deterministic reduction and join here; the sharded policies' own cases,
// checkpoints, memory and mixed precision in test_device_sharded_tcp.cpp.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <ddp/comm/tcp/communicator.hpp>

#include "device_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters
}  // namespace
TEST_CASE("tcp device replicate: one device or two, sgd and adamw, no_sync, the compression hooks", "[device]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_device_equivalence<tcp>(comm, optimizer_kind::sgd_momentum, false);
    check_device_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, false);
    check_device_equivalence<tcp, tiny>(comm, optimizer_kind::sgd_nesterov, true);
    check_device_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, true, 2);
    check_device_equivalence<tcp, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_momentum, true, 1, 1e-2,
                                                                 closeness::per_tensor);
    check_device_equivalence<tcp, tiny, ddp::fp16_compress_hook>(comm, optimizer_kind::adamw, false, 1, 1e-2,
                                                                 closeness::per_tensor);
  });
}
TEST_CASE("tcp device hybrid and deterministic reduction", "[device]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_device_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(
        comm, optimizer_kind::adamw, true, 1, 1e-5, closeness::per_element, hybrid_groups<ddp::full_shard>(comm.size()));
    check_device_equivalence<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(
        comm, optimizer_kind::sgd_momentum, false, 1, 1e-5, closeness::per_element,
        hybrid_groups<ddp::shard_grad_op>(comm.size()));
    check_device_equivalence<tcp, tiny>(comm, optimizer_kind::sgd_momentum, true, 1, 1e-5, closeness::per_element,
                                        ddp::replicate{.deterministic = true});
    check_device_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, false, 1, 1e-5,
                                                         closeness::per_element, ddp::full_shard{.deterministic = true});
  });
}
TEST_CASE("tcp device: a device that drops its ordering waits trains wrong, so the suite would catch a lost wait",
          "[device]") {
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [](int) {
    ddp::tcp::communicator comm = ddp::tcp::communicator::from_env();
    mlp got = train_on_devices<tcp, tiny>(comm, optimizer_kind::sgd_momentum, {.forgetful = true});
    mlp want = reference_training(optimizer_kind::sgd_momentum);
    const double worst = worst_difference(got, want);
    INFO("worst relative difference from one process without the ordering waits: " << worst);
    REQUIRE(worst > 1e-3);
    mlp kept = train_on_devices<tcp, tiny>(comm, optimizer_kind::sgd_momentum, {});  // the same with them
    REQUIRE(worst_difference(kept, want) <= 1e-5);
  }));
}
TEST_CASE("tcp device join: uneven batch counts under every policy equal one process", "[device]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_device_join<tcp, tiny>(comm, optimizer_kind::sgd_momentum, true);
    check_device_join<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, false);
    check_device_join<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov, true);
    check_device_join<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, false,
                                                              hybrid_groups<ddp::full_shard>(comm.size()));
  });
}
TEST_CASE("tcp device: a ddp::parameter bound to device memory holds the trained values there once the wrapper is "
          "gone", "[device]") {
  ddp::testing::on_1_to_n_ranks(2, [](ddp::tcp::communicator comm) { check_device_parameter_survives<tcp>(comm); });
}

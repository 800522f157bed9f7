// data_parallel on ddp::local: the scenarios of tests/parallel (every policy, no_sync, the hooks, join,
// deterministic reduction, checkpoints, the model on fake devices, one pair per thread) at N = 1..4 threads of
// this process, against one process on the union of the batches. Checks on the ranks' threads go through
// support/thread_checks.hpp (Catch2 records assertions on one thread only).
#include "support/thread_checks.hpp"

#include <filesystem>
#include <string>

#include <unistd.h>

#include <ddp/comm/local/run.hpp>

#include "parallel/device_scenarios.hpp"
#include "parallel/join_scenarios.hpp"
#include "parallel/scenarios.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::local;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

/// Runs body(comm) on 1 to `max_ranks` threads, each world size its own run; a failed check fails the test.
template <class F>
void on_1_to_n_threads(int max_ranks, F body) {
  ddp::local::config cfg;
  cfg.timeout = std::chrono::seconds(30);
  for (int n = 1; n <= max_ranks; ++n) {
    CAPTURE(n);
    CHECK_NOTHROW(ddp::local::run(n, cfg, body));
  }
}
}  // namespace

TEST_CASE("data_parallel replicate equals one process: sgd, adamw, buckets, no_sync, the compression hooks",
          "[local][equivalence]") {
  on_1_to_n_threads(4, [](ddp::local::communicator comm) {
    check_equivalence<local>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_equivalence<local, tiny>(comm, optimizer_kind::sgd_nesterov, 1e-5);
    check_equivalence<local, tiny>(comm, optimizer_kind::adamw, 1e-5, 2);
    check_equivalence<local, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_momentum, 1e-2, 1,
                                                            closeness::per_tensor);
    check_broadcast<local>(comm);
    check_missing_report<local>(comm);
  });
}
TEST_CASE("data_parallel sharding: shard_grad_op, full_shard, hybrid and sharded no_sync equal one process",
          "[local][sharding]") {
  on_1_to_n_threads(4, [](ddp::local::communicator comm) {
    check_equivalence<local, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, 1e-5);
    check_equivalence<local, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5, 3);
    check_equivalence<local, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5, 1,
                                                                 closeness::per_element,
                                                                 hybrid_groups<ddp::full_shard>(comm.size()));
    check_equivalence<local, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::sgd_momentum, 1e-5, 1,
                                                                    closeness::per_element,
                                                                    hybrid_groups<ddp::shard_grad_op>(comm.size()));
    check_verify_in_sync<local, ddp::replicate>(comm);
  });
}
TEST_CASE("data_parallel deterministic reduction: the bits of one process summing in rank order", "[local][determinism]") {
  on_1_to_n_threads(4, [](ddp::local::communicator comm) {
    check_deterministic<local>(comm, optimizer_kind::sgd_momentum);
    check_deterministic<local>(comm, optimizer_kind::adamw, {}, 3000);
    check_deterministic<local, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov);
  });
}
TEST_CASE("data_parallel join: uneven batch counts equal one process, replicate and full_shard", "[local][join]") {
  on_1_to_n_threads(4, [](ddp::local::communicator comm) {
    check_join<local, tiny>(comm, optimizer_kind::adamw, 1e-5);
    check_join<local, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element, {}, 3);  // no_sync
    check_join<local, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5);
  });
}
TEST_CASE("data_parallel on devices: each thread's replica on fake devices of its own, replicate and full_shard, a checkpoint "
          "rank 0 writes resumes bit for bit", "[local][device]") {
  const std::string dir = "/tmp/ddp_local_ckpt_" + std::to_string(::getpid());
  on_1_to_n_threads(4, [&](ddp::local::communicator comm) {
    check_device_equivalence<local, tiny>(comm, optimizer_kind::adamw, true);
    check_device_equivalence<local, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov, false, 2);
    check_device_checkpoint<local, tiny>(comm, optimizer_kind::adamw, false, false,
                                         dir + "_n" + std::to_string(comm.size()) + ".safetensors");
  });
  std::error_code ignored;
  for (int n = 1; n <= 4; ++n) std::filesystem::remove_all(dir + "_n" + std::to_string(n) + ".safetensors", ignored);
}

// Model state over the TCP backend: buffers synchronized as data_parallel_options::buffers says and frozen
// parameters broadcast once, under every policy at N = 1..4, against a one-process simulation of the replicas
// (state_scenarios.hpp); verify_in_sync over them, a join scope's source rank, and a buffer that differs in shape.
// Models whose framework keeps its own memory (framework_scenarios.hpp): an overwriting backward under no_sync, the
// framework's own optimizer.
#include <filesystem>
#include <string>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "framework_scenarios.hpp"
#include "state_scenarios.hpp"
#include "sync_bn_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket: boundaries inside parameters
}  // namespace

TEST_CASE("tcp model state: buffers under broadcast, mean, construction and never, replicate and full_shard",
          "[state]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    for (const auto how : {ddp::buffer_sync::broadcast, ddp::buffer_sync::mean, ddp::buffer_sync::construction,
                           ddp::buffer_sync::never}) {
      check_model_state<tcp, tiny>(comm, how);
      check_model_state<tcp, tiny, ddp::full_shard>(comm, how);
    }
  });
}
TEST_CASE("tcp model state: rank 0's buffers after every step under shard_grad_op and hybrid", "[state]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_model_state<tcp, tiny, ddp::shard_grad_op>(comm, ddp::buffer_sync::broadcast);
    check_model_state<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, ddp::buffer_sync::broadcast,
                                                               hybrid_groups<ddp::full_shard>(comm.size()));
  });
}
TEST_CASE("tcp model state: verify_in_sync names a differing buffer or frozen parameter, a join scope's buffers "
          "come from the lowest rank still training, a buffer of another shape is named at construction",
          "[state][errors]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_state_verify(comm);
    check_state_join(comm);
    check_state_mismatch(comm);
  });
}
TEST_CASE("tcp model state: checkpoints hold buffers and frozen parameters, save, load, save_sharded and "
          "load_sharded bring them back bit for bit, also at another world size and policy", "[state][checkpoint]") {
  struct scratch {  // removed on every exit path
    std::filesystem::path dir = std::filesystem::temp_directory_path() / ("ddp-state-" + std::to_string(getpid()));
    scratch() { std::filesystem::create_directories(dir); }
    ~scratch() { std::filesystem::remove_all(dir); }
  } scratch;
  const auto& dir = scratch.dir;
  ddp::testing::on_1_to_n_ranks(3, [&](ddp::tcp::communicator comm) {
    check_state_checkpoint<tcp, tiny>(comm, dir);
    check_state_checkpoint<tcp, tiny, ddp::full_shard>(comm, dir);
  });
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [&](int) {
    check_state_checkpoint<tcp, tiny, ddp::full_shard>(ddp::tcp::communicator::from_env(), dir);
  }));
  ddp::testing::require_all_ok(ddp::testing::run_ranks(3, [&](int) {
    check_state_resharded<tcp, tiny>(ddp::tcp::communicator::from_env(), dir);
  }));
}
TEST_CASE("tcp model state: a buffer in a fake device's memory is broadcast, averaged, compared and checkpointed "
          "through its domain", "[state][device]") {
  struct scratch {  // removed on every exit path
    std::filesystem::path file =
        std::filesystem::temp_directory_path() / ("ddp-device-state-" + std::to_string(getpid()) + ".safetensors");
    ~scratch() { std::filesystem::remove(file); }
  } scratch;
  ddp::testing::on_1_to_n_ranks(3, [&](ddp::tcp::communicator comm) { check_device_state(comm, scratch.file); });
}
TEST_CASE("tcp sync_batch_norm: N ranks on uneven parts of a batch equal plain batch norm of the union in one "
          "process (outputs, gradients, running statistics)", "[state][sync_bn]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) { check_sync_batch_norm(comm); });
}
TEST_CASE("tcp framework memory: a backward that overwrites its gradients accumulates no_sync micro-batches under "
          "replicate and shard_grad_op, the framework's own optimizer steps under replicate and is refused sharded",
          "[framework]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) { check_framework_leaves<tcp>(comm); });
}

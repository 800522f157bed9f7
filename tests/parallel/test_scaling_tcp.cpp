// Dynamic loss scaling over the TCP backend, every policy at N = 1..4: an overflow on one rank skips the step on
// every rank, the scale follows GradScaler's rule exactly, the parameters equal one process skipping that step
// (scaling_scenarios.hpp); the scale travels in checkpoints.
#include <filesystem>
#include <string>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "scaling_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket: boundaries inside parameters
}  // namespace

TEST_CASE("tcp loss scaling: an overflow on one rank skips the step everywhere and the scale follows GradScaler's "
          "rule, every policy", "[scaling]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_loss_scaling<tcp, tiny>(comm);
    check_loss_scaling<tcp, tiny, ddp::shard_grad_op>(comm);
    check_loss_scaling<tcp, tiny, ddp::full_shard>(comm);
    check_loss_scaling<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, hybrid_groups<ddp::full_shard>(comm.size()));
  });
}
TEST_CASE("tcp loss scaling: the scale and growth tracker come back with ddp::load, bad settings are refused",
          "[scaling][checkpoint]") {
  struct scratch {  // removed on every exit path
    std::filesystem::path file =
        std::filesystem::temp_directory_path() / ("ddp-scaling-" + std::to_string(getpid()) + ".safetensors");
    ~scratch() { std::filesystem::remove(file); }
  } scratch;
  ddp::testing::on_1_to_n_ranks(2, [&](ddp::tcp::communicator comm) {
    check_loss_scaling_checkpoint<tcp, tiny>(comm, scratch.file);
  });
}

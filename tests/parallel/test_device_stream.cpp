// data_parallel's NCCL path on the fake device: a communicator that takes device tensors as they are and runs every
// operation in call order on the device's stream (stream_comm.hpp), as ddp::nccl does on a GPU. Every policy at
// N = 1..4 forked ranks equals one process on the whole batch and gives the host's bits (device_scenarios.hpp), so
// the wrapper neither touches device memory from the host nor leans on a host wait NCCL would not make.
#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "device_scenarios.hpp"
#include "stream_comm.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters
}  // namespace

TEST_CASE("stream-ordered device replicate: sgd and adamw, no_sync, the compression hooks, deterministic",
          "[device][stream]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator tcp) {
    stream_comm comm(std::move(tcp));
    check_device_equivalence<stream_ordered>(comm, optimizer_kind::sgd_momentum, false);
    check_device_equivalence<stream_ordered, tiny>(comm, optimizer_kind::adamw, false, 2);
    check_device_equivalence<stream_ordered, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_nesterov, false, 1,
                                                                            1e-2, closeness::per_tensor);
    check_device_equivalence<stream_ordered, tiny>(comm, optimizer_kind::sgd_momentum, false, 1, 1e-5,
                                                   closeness::per_element, ddp::replicate{.deterministic = true});
  });
}

TEST_CASE("stream-ordered device shard_grad_op, full_shard and hybrid", "[device][stream]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator tcp) {
    stream_comm comm(std::move(tcp));
    check_device_equivalence<stream_ordered, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, false);
    check_device_equivalence<stream_ordered, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov, false, 3);
    check_device_equivalence<stream_ordered, tiny, ddp::hybrid<ddp::full_shard>>(
        comm, optimizer_kind::adamw, false, 1, 1e-5, closeness::per_element,
        hybrid_groups<ddp::full_shard>(comm.size()));
  });
}

// Gradient norm and clipping over the TCP backend, every policy at N = 1..4, against one process that clips the
// whole batch's gradient (clip_scenarios.hpp); non-finite norms, bad norm types and join scopes.
#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "clip_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket: boundaries inside parameters
}  // namespace

TEST_CASE("tcp clip_grad_norm: replicate and shard_grad_op clip the averaged gradient as one process does, by the "
          "call and by the option, L2 and inf norms", "[clip]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_clip<tcp, tiny>(comm, optimizer_kind::sgd_momentum, clip_by::call);
    check_clip<tcp, tiny>(comm, optimizer_kind::adamw, clip_by::option, ddp::inf_norm);
    check_clip<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, clip_by::call);
    check_clip<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, clip_by::option, 1.0);
  });
}
TEST_CASE("tcp clip_grad_norm: full_shard and hybrid take the norm over the shard group's owned blocks", "[clip]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_clip<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, clip_by::call);
    check_clip<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, clip_by::option, ddp::inf_norm);
    check_clip<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::sgd_momentum, clip_by::call, 2.0,
                                                        hybrid_groups<ddp::full_shard>(comm.size()));
    check_clip<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::adamw, clip_by::option, 2.0,
                                                           hybrid_groups<ddp::shard_grad_op>(comm.size()));
  });
}
TEST_CASE("tcp clip_grad_norm: a NaN gradient is named, a bad norm type and a call inside a join scope are refused, "
          "and the option clips a join scope's shadow steps alike", "[clip][errors]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_clip_errors<tcp, tiny>(comm);
    check_clip_errors<tcp, tiny, ddp::full_shard>(comm);
    check_clip_join<tcp, tiny>(comm);
    check_clip_join<tcp, tiny, ddp::shard_grad_op>(comm);
  });
}

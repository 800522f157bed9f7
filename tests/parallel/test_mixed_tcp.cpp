// Mixed precision (ddp::mixed_precision, bf16 and f16) over the TCP backend: every sharding policy at N = 1, 2, 3 ranks
// (run_ranks: a 60 s job timeout, every collective times out at 45 s), against one process with the same mixed
// precision and against f32 training (mixed_scenarios.hpp states the tolerances and why).
#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "mixed_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters
using mixed = ddp::mixed_precision<ddp::bfloat16>;                         // reduce in f32
using mixed16 = ddp::mixed_precision<ddp::bfloat16, ddp::bfloat16>;        // reduce in bf16
using half = ddp::mixed_precision<ddp::float16>;                            // f16 compute, reduce in f32
using half16 = ddp::mixed_precision<ddp::float16, ddp::float16>;            // f16 compute, reduce in f16
}  // namespace

TEST_CASE("tcp mixed precision: bf16 compute with f32 masters, every policy, equals one process and tracks f32",
          "[mixed]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_mixed<tcp, tiny, mixed>(comm, "replicate", optimizer_kind::adamw, mixed_exact, mixed_track);
    check_mixed<tcp, mixed16>(comm, "replicate, bf16 reduce", optimizer_kind::sgd_momentum, mixed_rounded,
                              mixed_track_rounded);
    check_mixed<tcp, tiny, ddp::shard_grad_op, mixed>(comm, "shard_grad_op", optimizer_kind::adamw, mixed_exact,
                                                      mixed_track);
    check_mixed<tcp, tiny, ddp::full_shard, mixed>(comm, "full_shard", optimizer_kind::sgd_nesterov, mixed_exact,
                                                   mixed_track);
    check_mixed<tcp, tiny, ddp::full_shard, mixed16>(comm, "full_shard, bf16 reduce", optimizer_kind::adamw,
                                                     mixed_rounded, mixed_track_rounded);
    check_mixed<tcp, tiny, ddp::hybrid<ddp::full_shard>, mixed>(comm, "hybrid<full_shard>", optimizer_kind::adamw,
                                                                mixed_exact, mixed_track, 1,
                                                                hybrid_groups<ddp::full_shard>(comm.size()));
    check_mixed<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>, mixed16>(
        comm, "hybrid<shard_grad_op>, bf16 reduce", optimizer_kind::sgd_momentum, mixed_rounded, mixed_track_rounded, 1,
        hybrid_groups<ddp::shard_grad_op>(comm.size()));
    check_mixed<tcp, tiny, ddp::full_shard, half>(comm, "full_shard, f16", optimizer_kind::adamw, mixed_exact,
                                                  mixed_track);
    check_mixed<tcp, tiny, half16>(comm, "replicate, f16, f16 reduce", optimizer_kind::sgd_momentum, mixed_rounded,
                                   mixed_track_rounded);
  });
}
TEST_CASE("tcp mixed precision: with no_sync, a comm hook, deterministic reduction and join", "[mixed]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_mixed<tcp, tiny, mixed>(comm, "replicate, no_sync", optimizer_kind::adamw, mixed_rounded, mixed_track, 2);
    check_mixed<tcp, tiny, ddp::full_shard, mixed>(comm, "full_shard, no_sync", optimizer_kind::adamw, mixed_rounded,
                                                   mixed_track, 3);
    check_mixed<tcp, tiny, mixed, ddp::bf16_compress_hook>(comm, "replicate, bf16_compress_hook",
                                                           optimizer_kind::adamw, mixed_rounded, mixed_track_rounded);
    check_mixed<tcp, tiny, ddp::replicate, mixed>(comm, "replicate, deterministic", optimizer_kind::adamw, mixed_exact,
                                                  mixed_track, 1, {.deterministic = true});
    check_mixed<tcp, tiny, ddp::shard_grad_op, mixed>(comm, "shard_grad_op, deterministic", optimizer_kind::adamw,
                                                      mixed_exact, mixed_track, 1, {.deterministic = true});
    check_mixed_join<tcp, tiny, mixed>(comm, "replicate, join", optimizer_kind::sgd_momentum, mixed_exact);
    check_mixed_join<tcp, tiny, ddp::full_shard, mixed>(comm, "full_shard, join", optimizer_kind::adamw, mixed_exact);
  });
}
TEST_CASE("tcp mixed precision: checkpoints hold the f32 masters and resume bit for bit, and misuse is refused",
          "[mixed]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_mixed_checkpoint<tcp, tiny, ddp::replicate, mixed>(comm, false);
    check_mixed_checkpoint<tcp, tiny, ddp::shard_grad_op, mixed16>(comm, false);
    check_mixed_checkpoint<tcp, tiny, ddp::full_shard, mixed>(comm, false);
    check_mixed_checkpoint<tcp, tiny, ddp::full_shard, mixed>(comm, true);
    check_mixed_checkpoint<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>, half>(
        comm, true, hybrid_groups<ddp::shard_grad_op>(comm.size()));
    check_mixed_misuse<tcp>(comm);
  });
}

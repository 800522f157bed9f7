// data_parallel over the TCP backend: every scenario at N = 1..4 forked ranks (run_ranks: a 60 s job
// timeout, and every collective times out at 45 s so a hang fails instead of blocking).
#include <type_traits>

#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

/// A user comm hook: all-reduces each bucket's sum and divides by the world size itself (the average, by
/// another route), counting the buckets it completed (per-hook state).
struct sum_then_scale_hook {
  using policy_category = ddp::comm_hook_policy;
  std::size_t completed = 0;
  template <class Comm>
  ddp::work start(const ddp::bucket_gradients<Comm>& b) {
    return b.comm.all_reduce(b.grads, ddp::reduce_op::sum);
  }
  template <class Comm>
  void complete(const ddp::bucket_gradients<Comm>& b) {
    for (float& g : b.template elements<float>()) g /= static_cast<float>(b.world_size());
    ++completed;
  }
};
static_assert(ddp::comm_hook<sum_then_scale_hook, ddp::tcp::communicator>);
static_assert(std::is_same_v<ddp::backend_of_t<ddp::tcp::communicator>, tcp>);  // dp{model, comm} deduces backend::tcp
}  // namespace

TEST_CASE("tcp replicate equals one process: sgd momentum/nesterov, adamw, one bucket or many", "[equivalence]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence<tcp>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_equivalence<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_equivalence<tcp, tiny>(comm, optimizer_kind::sgd_nesterov, 1e-5);
    check_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5);
  });
}
TEST_CASE("tcp replicate: no_sync accumulation and the bf16/fp16 hooks", "[equivalence]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence<tcp, tiny>(comm, optimizer_kind::adamw, 1e-5, 2);
    check_equivalence<tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, 3);
    check_equivalence<tcp, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_momentum, 1e-2, 1,
                                                          closeness::per_tensor);
    check_equivalence<tcp, tiny, ddp::fp16_compress_hook>(comm, optimizer_kind::sgd_momentum, 1e-2, 1,
                                                          closeness::per_tensor);
  });
}
TEST_CASE("tcp replicate: a user comm hook (sum, then scale) equals one process and keeps its state", "[equivalence]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence<tcp, tiny, sum_then_scale_hook>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_equivalence<tcp, tiny, sum_then_scale_hook>(comm, optimizer_kind::adamw, 1e-5);
    mlp model = make_mlp(1);
    ddp::data_parallel<mlp, tcp, tiny, sum_then_scale_hook> dp{model, comm};
    auto report = [&](auto& p) { dp.gradient_ready(p); };
    forward_backward(model, make_batch(0, 4), 1.0F, report);
    dp.finish_gradients();
    REQUIRE(dp.comm_hook().completed == dp.bucket_count());
  });
}
TEST_CASE("tcp: ddp::trainable leaves over std::vector (copied) and std::span (adopted) equal one process",
          "[equivalence]") {
  using vectors = foreign_mlp<std::vector<float>>;
  using spans = foreign_mlp<std::span<float>>;
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence_of<vectors, tcp, tiny>(comm, optimizer_kind::adamw, 1e-5);
    check_equivalence_of<vectors, tcp, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, 2);
    check_equivalence_of<vectors, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, 1e-5, 2);
    check_equivalence_of<spans, tcp, tiny>(comm, optimizer_kind::sgd_nesterov, 1e-5);
    check_equivalence_of<spans, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5, 2);
    check_leaf_binding<tcp>(comm);
  });
}
TEST_CASE("tcp replicate: missing report, declared unused, broadcast", "[errors]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_missing_report<tcp>(comm);
    check_declared_unused<tcp>(comm);
    check_broadcast<tcp>(comm);
  });
}
TEST_CASE("tcp replicate: different models raise mismatch_error naming the parameter on each rank", "[errors]") {
  for (int n = 2; n <= 4; ++n)
    ddp::testing::require_all_ok(
        ddp::testing::run_ranks(n, [](int) { check_mismatch<tcp>(ddp::tcp::communicator::from_env()); }));
}
TEST_CASE("tcp verify_in_sync: replicas in step pass, a parameter changed on one rank throws on every rank naming "
          "it, verify_every = 1 catches a divergence (and a gradient reported before it is final) on the step where "
          "it happens", "[errors]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_verify_in_sync<tcp, ddp::replicate>(comm);
    check_verify_in_sync<tcp, ddp::shard_grad_op>(comm);
    check_verify_in_sync<tcp, ddp::full_shard>(comm);  // one owner per value: passes, perturbed or not
    if (comm.size() == 4) check_verify_in_sync<tcp>(comm, ddp::hybrid<ddp::full_shard>{.group_size = 2});
    check_verify_every<tcp>(comm);
    check_early_report_caught<tcp>(comm);
  });
}
TEST_CASE("tcp sharding: shard_grad_op, full_shard, hybrid and sharded no_sync equal one process", "[sharding]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, 1e-5);
    check_equivalence<tcp, ddp::shard_grad_op>(comm, optimizer_kind::sgd_nesterov, 1e-5);
    check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5);
    check_equivalence<tcp, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, 1e-5);
    check_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, 1e-5, 2);
    check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5, 3);
    check_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5, 1,
                                                               closeness::per_element,
                                                               hybrid_groups<ddp::full_shard>(comm.size()));
    check_equivalence<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::sgd_momentum, 1e-5, 1,
                                                                  closeness::per_element,
                                                                  hybrid_groups<ddp::shard_grad_op>(comm.size()));
    check_full_shard_misuse<tcp>(comm);
  });
}
TEST_CASE("tcp parameter groups and schedules: every policy equals one process stepping the same grouped optimizer",
          "[sharding][groups]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    for (const auto k : {optimizer_kind::adamw_grouped, optimizer_kind::sgd_grouped}) {
      check_equivalence<tcp, tiny>(comm, k, 1e-5);
      check_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, k, 1e-5);
      check_equivalence<tcp, tiny, ddp::full_shard>(comm, k, 1e-5);
      check_equivalence<tcp, tiny, ddp::hybrid<ddp::full_shard>>(comm, k, 1e-5, 1, closeness::per_element,
                                                                 hybrid_groups<ddp::full_shard>(comm.size()));
      check_equivalence<tcp, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, k, 1e-5, 1, closeness::per_element,
                                                                    hybrid_groups<ddp::shard_grad_op>(comm.size()));
    }
  });
}

TEST_CASE("tcp sharding: configurable units and freed unit buffers give the same training, a unit covering nothing is named",
          "[sharding]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5, 2, closeness::per_element,
                                                  {.keep_unit_buffers = false});
    check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, 1e-5, 2, closeness::per_element,
                                                  {.reshard_after_forward = false});
    check_equivalence<tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5, 1, closeness::per_element, {},
                                                  per_parameter_units());
    check_equivalence<tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, 1e-5, 2,
                                                     closeness::per_element, {}, per_parameter_units({"fc2"}));
    check_unit_errors<tcp>(comm);
    check_units_by_object<tcp>(comm);
  });
}
TEST_CASE("tcp deterministic reduction: the bits of one process summing in rank order, every policy and bucket size",
          "[determinism]") {
  ddp::testing::on_1_to_n_ranks(4, [](ddp::tcp::communicator comm) {
    check_deterministic<tcp>(comm, optimizer_kind::sgd_momentum);
    check_deterministic<tcp>(comm, optimizer_kind::adamw, {}, 3000);  // 156 KiB buckets: ring all-reduces
    check_deterministic<tcp, ddp::shard_grad_op>(comm, optimizer_kind::adamw);
    check_deterministic<tcp, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov);
    check_deterministic<tcp, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw,
                                                           hybrid_groups<ddp::full_shard>(comm.size()));
    mlp model = make_mlp(1);
    ddp::data_parallel<mlp, tcp, ddp::replicate, ddp::bf16_compress_hook> dp{model, comm,
                                                                            ddp::replicate{.deterministic = true}};
    REQUIRE_THROWS_WITH(forward_backward(model, make_batch(0, 4), 1.0F, [&](auto& p) { dp.gradient_ready(p); }),
                        Catch::Contains("deterministic reduction sums in rank order itself"));
  });
}

// data_parallel over the MPI backend; registered at NP 1..4 (the [multi] cases need two ranks or more).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <type_traits>

#include <catch2/catch.hpp>

#include <ddp/comm/mpi/communicator.hpp>

#include "device_scenarios.hpp"
#include "framework_scenarios.hpp"
#include "join_scenarios.hpp"
#include "mixed_scenarios.hpp"
#include "rebuild_scenarios.hpp"
#include "scenarios.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::mpi;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

static_assert(std::is_same_v<ddp::backend_of_t<ddp::mpi::communicator>, mpi>);  // dp{model, comm} deduces backend::mpi

ddp::mpi::communicator world() { return ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)}); }
}  // namespace

TEST_CASE("mpi replicate: one bucket, sgd momentum equals one process", "[equivalence]") {
  check_equivalence<mpi>(world(), optimizer_kind::sgd_momentum, 1e-5);
}
TEST_CASE("mpi replicate: tiny buckets, sgd momentum equals one process", "[equivalence]") {
  check_equivalence<mpi, tiny>(world(), optimizer_kind::sgd_momentum, 1e-5);
}
TEST_CASE("mpi replicate: tiny buckets, sgd nesterov + weight decay equals one process", "[equivalence]") {
  check_equivalence<tiny, mpi>(world(), optimizer_kind::sgd_nesterov, 1e-5);
}
TEST_CASE("mpi replicate: tiny buckets, adamw equals one process", "[equivalence]") {
  check_equivalence<mpi, tiny>(world(), optimizer_kind::adamw, 1e-5);
}
TEST_CASE("mpi replicate: no_sync accumulation over 2 and 3 micro-batches equals one process", "[equivalence]") {
  check_equivalence<mpi, tiny>(world(), optimizer_kind::adamw, 1e-5, 2);
  check_equivalence<mpi, tiny>(world(), optimizer_kind::sgd_momentum, 1e-5, 3);
}
TEST_CASE("mpi replicate: bf16 and fp16 compression hooks stay within 1e-2 per tensor", "[equivalence]") {
  check_equivalence<mpi, tiny, ddp::bf16_compress_hook>(world(), optimizer_kind::sgd_momentum, 1e-2, 1,
                                                        closeness::per_tensor);
  check_equivalence<mpi, tiny, ddp::fp16_compress_hook>(world(), optimizer_kind::sgd_momentum, 1e-2, 1,
                                                        closeness::per_tensor);
}
TEST_CASE("mpi replicate: different models raise mismatch_error naming the parameter on each rank", "[multi]") {
  check_mismatch<mpi>(world());
}
TEST_CASE("mpi verify_in_sync: replicas in step pass, a parameter changed on one rank throws on every rank", "[errors]") {
  check_verify_in_sync<mpi, ddp::replicate>(world());
}
TEST_CASE("mpi replicate: a parameter that never reports is named", "[errors]") { check_missing_report<mpi>(world()); }
TEST_CASE("mpi replicate: declared-unused parameters are skipped", "[errors]") { check_declared_unused<mpi>(world()); }
TEST_CASE("mpi replicate: rank 0's values are broadcast", "[errors]") { check_broadcast<mpi>(world()); }

// Sharding (issue 6): each strategy equals one process (and so replicate) after several steps.
TEST_CASE("mpi shard_grad_op: sgd momentum and adamw equal one process", "[sharding]") {
  check_equivalence<mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::sgd_momentum, 1e-5);
  check_equivalence<mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::adamw, 1e-5);
  check_equivalence<mpi, ddp::shard_grad_op>(world(), optimizer_kind::sgd_nesterov, 1e-5);
}
TEST_CASE("mpi full_shard: sgd momentum and adamw equal one process, unsharding unit by unit", "[sharding]") {
  check_equivalence<mpi, tiny, ddp::full_shard>(world(), optimizer_kind::sgd_momentum, 1e-5);
  check_equivalence<mpi, tiny, ddp::full_shard>(world(), optimizer_kind::adamw, 1e-5);
  check_equivalence<mpi, ddp::full_shard>(world(), optimizer_kind::sgd_nesterov, 1e-5);
}
TEST_CASE("mpi sharded no_sync accumulates into sharded gradients", "[sharding]") {
  check_equivalence<mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::adamw, 1e-5, 2);
  check_equivalence<mpi, tiny, ddp::full_shard>(world(), optimizer_kind::sgd_momentum, 1e-5, 3);
}
TEST_CASE("mpi hybrid: 2x2 groups (1 per group at odd N) equal one process", "[sharding]") {
  auto comm = world();
  check_equivalence<mpi, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw, 1e-5, 1,
                                                             closeness::per_element,
                                                               hybrid_groups<ddp::full_shard>(comm.size()));
  check_equivalence<mpi, tiny, ddp::hybrid<ddp::shard_grad_op>>(comm, optimizer_kind::sgd_momentum, 1e-5, 1,
                                                                closeness::per_element,
                                                                  hybrid_groups<ddp::shard_grad_op>(comm.size()));
}
TEST_CASE("mpi full_shard: a gradient of a unit outside its unshard scope is misuse", "[sharding]") {
  check_full_shard_misuse<mpi>(world());
}
TEST_CASE("mpi deterministic reduction: the bits of one process summing in rank order, every policy and bucket size",
          "[determinism]") {
  auto comm = world();
  check_deterministic<mpi>(comm, optimizer_kind::sgd_momentum);
  check_deterministic<mpi>(comm, optimizer_kind::adamw);
  check_deterministic<mpi, ddp::shard_grad_op>(comm, optimizer_kind::adamw);
  check_deterministic<mpi, ddp::full_shard>(comm, optimizer_kind::sgd_nesterov);
  check_deterministic<mpi, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::adamw,
                                                         hybrid_groups<ddp::full_shard>(comm.size()));
}

// Uneven inputs (dp.join()): ranks with 5, 7, 3, 6 batches equal one process on each step's active batches.
TEST_CASE("mpi join: replicate, shard_grad_op, full_shard and hybrid with uneven batch counts equal one process",
          "[join]") {
  auto comm = world();
  check_join<mpi, tiny>(comm, optimizer_kind::adamw, 1e-5);
  check_join<mpi, tiny>(comm, optimizer_kind::sgd_momentum, 1e-5, closeness::per_element, {}, 2, true);  // rebuilt
  check_join<mpi, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, 1e-5);
  check_join<mpi, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, 1e-5);
  check_join<mpi, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::sgd_nesterov, 1e-5, closeness::per_element,
                                                      hybrid_groups<ddp::full_shard>(comm.size()));
}
TEST_CASE("mpi join: a scope dropped without finish(opt) makes the next call throw", "[join][errors]") {
  check_join_errors<mpi>(world());
}

// Mixed precision (ddp::mixed_precision): bf16 and f16 compute with f32 masters (mixed_scenarios.hpp states the
// tolerances).
TEST_CASE("mpi mixed precision: replicate, shard_grad_op and full_shard equal one process and track f32", "[mixed]") {
  using mixed = ddp::mixed_precision<ddp::bfloat16>;
  check_mixed<mpi, tiny, mixed>(world(), "mpi replicate", optimizer_kind::adamw, mixed_exact, mixed_track);
  check_mixed<mpi, tiny, ddp::full_shard, mixed>(world(), "mpi full_shard", optimizer_kind::sgd_nesterov, mixed_exact,
                                                 mixed_track);
  check_mixed<mpi, tiny, ddp::shard_grad_op, ddp::mixed_precision<ddp::bfloat16, ddp::bfloat16>>(
      world(), "mpi shard_grad_op, bf16 reduce", optimizer_kind::sgd_momentum, mixed_rounded, mixed_track_rounded);
  check_mixed<mpi, tiny, ddp::mixed_precision<ddp::float16, ddp::float16>>(
      world(), "mpi replicate, f16, f16 reduce", optimizer_kind::adamw, mixed_rounded, mixed_track_rounded);
}
TEST_CASE("mpi mixed precision: the checkpoint holds the f32 masters and resumes bit for bit", "[mixed]") {
  check_mixed_checkpoint<mpi, tiny, ddp::full_shard, ddp::mixed_precision<ddp::bfloat16>>(world(), false);
  check_mixed_checkpoint<mpi, tiny, ddp::shard_grad_op, ddp::mixed_precision<ddp::bfloat16>>(world(), true);
}
TEST_CASE("mpi rebuild: buckets in the backward's order on every rank (rank 1's own order differing), equal to one "
          "process, deterministic bits unchanged by the rebuild", "[rebuild]") {
  check_rebuilt_training<mpi, tiny>(world(), optimizer_kind::sgd_momentum, 1e-5);
  check_rebuilt_training<mpi, tiny>(world(), optimizer_kind::adamw, 1e-5, closeness::per_element, 2, {}, {}, true);
  check_rebuilt_deterministic<mpi>(world());
}

// The model on fake devices (device_scenarios.hpp): device tensors staged through host memory by the front end.
TEST_CASE("mpi device: every policy on one device or two equals one process and the host's bits", "[device]") {
  auto comm = world();
  check_device_equivalence<mpi, tiny>(comm, optimizer_kind::adamw, true, 2);
  check_device_equivalence<mpi, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum, false);
  check_device_equivalence<mpi, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, true, 2);
  check_device_equivalence<mpi, tiny, ddp::hybrid<ddp::full_shard>>(comm, optimizer_kind::sgd_nesterov, false, 1, 1e-5,
                                                                    closeness::per_element,
                                                                    hybrid_groups<ddp::full_shard>(comm.size()));
  check_device_equivalence<mpi, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_momentum, true, 1, 1e-5,
                                                       closeness::per_element, ddp::full_shard{.deterministic = true});
}
TEST_CASE("mpi device: join, mixed precision, the compression hooks and checkpoints on the devices", "[device]") {
  auto comm = world();
  check_device_join<mpi, tiny, ddp::full_shard>(comm, optimizer_kind::adamw, true);
  check_device_mixed<mpi, tiny, ddp::full_shard, ddp::mixed_precision<ddp::bfloat16, float>>(comm, optimizer_kind::adamw,
                                                                                             false);
  check_device_equivalence<mpi, tiny, ddp::bf16_compress_hook>(comm, optimizer_kind::sgd_momentum, true, 1, 1e-2,
                                                               closeness::per_tensor);
  std::string at = "/tmp/ddp_device_ckpt_mpi_" + std::to_string(::getpid()) + "_n" + std::to_string(comm.size());
  ddp::broadcast_object(comm, at, 0);  // rank 0's path on every rank
  check_device_checkpoint<mpi, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw, true, true, at);
  comm.barrier().wait();
  if (comm.rank() == 0) std::filesystem::remove_all(at);
}
TEST_CASE("mpi framework memory: an overwriting backward's no_sync micro-batches sum under every policy that holds "
          "it, the framework's own optimizer steps under replicate", "[framework]") {
  check_framework_leaves<mpi>(world());
}

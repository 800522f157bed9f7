// The LibTorch adapter over the MPI backend; registered at NP 1..3.
#include <chrono>

#include <catch2/catch.hpp>

#include <ddp/comm/mpi/communicator.hpp>

#include "scenarios.hpp"

namespace {
using namespace ddp_torch_test;
using ddp::backend::mpi;
using tiny = ddp::bucket_bytes<200, 60>;

ddp::mpi::communicator world() {
  torch::set_num_threads(1);
  return ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)});
}
}  // namespace

TEST_CASE("mpi replicate: MLP and CNN with torch SGD momentum, Adam and ddp adamw equal one process",
          "[equivalence]") {
  check_equivalence<mlp, mpi>(world(), optimizer_kind::torch_sgd_momentum);
  check_equivalence<mlp, mpi, tiny>(world(), optimizer_kind::torch_adam);
  check_equivalence<cnn, mpi, tiny>(world(), optimizer_kind::ddp_adamw);
}
TEST_CASE("mpi shard_grad_op: torch optimizers over ddp::parameters(dp) and ddp adamw equal one process",
          "[equivalence]") {
  check_equivalence<mlp, mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::torch_sgd_momentum);
  check_equivalence<cnn, mpi, ddp::shard_grad_op>(world(), optimizer_kind::torch_adam);
  check_equivalence<mlp, mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::ddp_adamw);
}
TEST_CASE("mpi full_shard: a 3-unit CNN run through ddp::forward equals one process", "[equivalence]") {
  check_equivalence<deep, mpi, tiny, ddp::full_shard>(world(), optimizer_kind::torch_adam);
  check_equivalence<deep, mpi, ddp::full_shard>(world(), optimizer_kind::ddp_adamw, 1, {.reshard_after_forward = false});
}
TEST_CASE("mpi replicate and shard_grad_op: no_sync accumulation over 2 micro-batches equals one process",
          "[equivalence]") {
  check_equivalence<mlp, mpi, tiny>(world(), optimizer_kind::torch_adam, 2);
  check_equivalence<cnn, mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::torch_sgd_momentum, 2);
}
TEST_CASE("mpi: .grad stays linked across zero_grad, buffers broadcast, unusable leaves named", "[errors]") {
  check_gradient_link<mpi>(world());
  check_errors<mpi>(world());
  check_buffers<mpi>(world());
}

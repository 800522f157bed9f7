// The Eigen MLP over the MPI backend; registered at np 1..3 (3: an uneven split of the batch).
#include <chrono>

#include <catch2/catch.hpp>

#include <ddp/comm/mpi/communicator.hpp>

#include "eigen/eigen_scenarios.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::mpi;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

ddp::mpi::communicator world() { return ddp::mpi::communicator::world({.timeout = std::chrono::seconds(30)}); }
}  // namespace

TEST_CASE("mpi: an Eigen MLP of Matrix members (copied) equals one process, replicate and shard_grad_op",
          "[equivalence]") {
  check_eigen_equivalence<owning_rows, mpi>(world(), optimizer_kind::sgd_momentum);
  check_eigen_equivalence<owning_rows, mpi, tiny>(world(), optimizer_kind::adamw);
  check_eigen_equivalence<owning_rows, mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::sgd_nesterov);
  check_eigen_equivalence<owning_cols, mpi, ddp::shard_grad_op>(world(), optimizer_kind::adamw);
}
TEST_CASE("mpi: an Eigen MLP of Map members (adopted) equals one process, replicate, shard_grad_op and full_shard",
          "[equivalence]") {
  check_eigen_equivalence<mapped_rows, mpi, tiny>(world(), optimizer_kind::adamw);
  check_eigen_equivalence<mapped_rows, mpi, tiny, ddp::shard_grad_op>(world(), optimizer_kind::sgd_momentum);
  check_eigen_equivalence<mapped_rows, mpi, tiny, ddp::full_shard>(world(), optimizer_kind::adamw);
  check_eigen_equivalence<mapped_cols, mpi, ddp::full_shard>(world(), optimizer_kind::sgd_momentum);
}
TEST_CASE("mpi: Map members point into the arenas while wrapped and home afterwards, full_shard refuses Matrix members",
          "[binding]") {
  check_eigen_binding<mpi>(world());
}

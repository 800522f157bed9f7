// The Eigen adapter: its traits in one process, the Eigen MLP over TCP at N = 1..3 forked ranks (run_ranks: every
// collective times out before the job does), and its checkpoint read by PyTorch.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

#include <ddp/comm/tcp/communicator.hpp>

#include "eigen/eigen_scenarios.hpp"
#include "support/run_ranks.hpp"

namespace {
using namespace ddp_test;
using ddp::backend::tcp;
using tiny = ddp::bucket_bytes<200, 60>;  // 50 floats a bucket, 15 in the first: boundaries inside parameters

template <class T>
std::vector<std::size_t> shape_of(T& values, T& grads) {
  return ddp::trainable(values, grads).shape();
}
}  // namespace

TEST_CASE("eigen traits: shape is memory order read row-major, dtypes, maps adopt, matrices copy", "[traits]") {
  row_matrix r(3, 4), dr(3, 4);
  Eigen::MatrixXf c(3, 4), dc(3, 4);
  Eigen::VectorXd v(5), dv(5);
  Eigen::RowVectorXf rv(6), drv(6);
  Eigen::Matrix<float, 2, 3> f, df;
  Eigen::ArrayXXf a(2, 5), da(2, 5);
  REQUIRE(shape_of(r, dr) == std::vector<std::size_t>{3, 4});
  REQUIRE(shape_of(c, dc) == std::vector<std::size_t>{4, 3});  // ColMajor: its transpose
  REQUIRE(shape_of(v, dv) == std::vector<std::size_t>{5});
  REQUIRE(shape_of(rv, drv) == std::vector<std::size_t>{6});
  REQUIRE(shape_of(f, df) == std::vector<std::size_t>{3, 2});
  REQUIRE(shape_of(a, da) == std::vector<std::size_t>{5, 2});
  REQUIRE(ddp::as_raw(v).type == ddp::dtype::f64);
  Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, 1> b(4);
  Eigen::Matrix<Eigen::half, 2, 2> h;
  REQUIRE(ddp::as_raw(b).type == ddp::dtype::bf16);
  REQUIRE(ddp::as_raw(h).type == ddp::dtype::f16);
  REQUIRE(ddp::as_raw(h).size == 4);

  static_assert(!ddp::adopting_leaf<ddp::trainable<row_matrix>>);
  static_assert(ddp::adopting_leaf<ddp::trainable<Eigen::Map<Eigen::MatrixXf>>>);
  std::vector<float> home(12), elsewhere(12, 2.0F);
  Eigen::Map<Eigen::MatrixXf> m(home.data(), 3, 4);
  ddp::tensor_traits<Eigen::Map<Eigen::MatrixXf>>::adopt(m, elsewhere.data());
  REQUIRE(m.data() == elsewhere.data());
  REQUIRE((m.rows() == 3 && m.cols() == 4 && m(2, 3) == 2.0F));
  Eigen::MatrixXf small(2, 2);
  REQUIRE_THROWS_AS(ddp::trainable(c, small), ddp::config_error);  // a gradient of another size
}

TEST_CASE("tcp: an Eigen MLP of Matrix members (copied) equals one process, replicate and shard_grad_op",
          "[equivalence]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_eigen_equivalence<owning_rows, tcp>(comm, optimizer_kind::sgd_momentum);
    check_eigen_equivalence<owning_rows, tcp, tiny>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<owning_rows, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_nesterov);
    check_eigen_equivalence<owning_rows, tcp, ddp::shard_grad_op>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<owning_cols, tcp, tiny>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<owning_cols, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::sgd_momentum);
  });
}

TEST_CASE("tcp: an Eigen MLP of Map members (adopted) equals one process, replicate, shard_grad_op and full_shard",
          "[equivalence]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) {
    check_eigen_equivalence<mapped_rows, tcp>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<mapped_rows, tcp, tiny>(comm, optimizer_kind::sgd_momentum);
    check_eigen_equivalence<mapped_rows, tcp, tiny, ddp::shard_grad_op>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<mapped_rows, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::sgd_momentum);
    check_eigen_equivalence<mapped_rows, tcp, ddp::full_shard>(comm, optimizer_kind::adamw);
    check_eigen_equivalence<mapped_cols, tcp, tiny, ddp::full_shard>(comm, optimizer_kind::adamw);
  });
}

TEST_CASE("tcp: Map members point into the arenas while wrapped and home afterwards, full_shard refuses Matrix members",
          "[binding]") {
  ddp::testing::on_1_to_n_ranks(3, [](ddp::tcp::communicator comm) { check_eigen_binding<tcp>(comm); });
}

TEST_CASE("PyTorch loads a checkpoint of the Eigen MLP into nn.Linear, ddp loads it into any Eigen layout", "[interop]") {
  const auto dir = std::filesystem::temp_directory_path() / ("ddp_eigen_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto rows = dir / "rows.safetensors", cols = dir / "cols.safetensors", maps = dir / "maps.safetensors";
  ddp::testing::require_all_ok(ddp::testing::run_ranks(2, [&](int) {
    auto comm = ddp::tcp::communicator::from_env();
    save_for_torch<owning_rows, tcp>(comm, rows);
    save_for_torch<owning_cols, tcp>(comm, cols);
    save_for_torch<mapped_cols, tcp>(comm, maps);
  }));
  for (const auto& file : {rows, cols, maps}) {
    INFO(file);
    const std::string cmd = "/usr/bin/python3 " DDP_EIGEN_TEST_DIR "/torch_linear.py '" + file.string() + "'";
    REQUIRE(std::system(cmd.c_str()) == 0);
  }
  ddp::testing::require_all_ok(ddp::testing::run_ranks(3, [&](int) {
    auto comm = ddp::tcp::communicator::from_env();
    load_into<mapped_rows, tcp, ddp::full_shard>(comm, cols, cols.string() + ".json");
    load_into<owning_cols, tcp, ddp::replicate>(comm, rows, rows.string() + ".json");
    load_into<owning_rows, tcp, ddp::shard_grad_op>(comm, maps, maps.string() + ".json");
  }));
  std::filesystem::remove_all(dir);
}

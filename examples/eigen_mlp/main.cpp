// Fashion-MNIST with an MLP (784-256-128-10) written with Eigen, trained data-parallel by ddp through the Eigen
// adapter (<ddp/adapters/eigen.hpp>): the model's weights are Eigen members, its GEMMs Eigen's.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/examples/eigen_mlp --backend mpi
//   build/tools/ddp-launch -n 2 build/examples/eigen_mlp --backend tcp
//   build/examples/eigen_mlp --storage map              (one process; Map members, zero copies)
//
// --storage matrix (the default) keeps owning Eigen::Matrix members, which ddp copies at the step's edges;
// --storage map keeps Eigen::Map members, which ddp points at its arenas. Both train the same numbers. Each rank
// trains on its part of every epoch, test accuracy counts every test image on exactly one rank, and a checkpoint
// (PyTorch's nn.Linear layout: weights [out, in]) is saved after every epoch.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>

#include "common/cli.hpp"
#include "common/eigen_mlp.hpp"
#include "common/idx.hpp"
#include "common/training.hpp"

namespace {

struct settings : example::run_settings {
  example::eigen_storage storage = example::eigen_storage::matrix;
};

constexpr const char* usage =
    "usage: eigen_mlp [--backend tcp|mpi] [--storage matrix|map] [--epochs N] [--batch B (per rank)] [--lr X]\n"
    "                 [--momentum X] [--data DIR] [--checkpoint PATH] [--limit N] [--min-accuracy X] [--no-progress]\n";

settings parse(int argc, char** argv) {
  settings s;
  s.epochs = 4;  // lr follows a cosine from --lr down to 0 over all the steps of --epochs
  s.checkpoint = "eigen_mlp.safetensors";
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a != "--storage") return s.take(a, value);
    const std::string v = value();
    if (v != "matrix" && v != "map") throw ddp::config_error("--storage must be matrix or map, not '" + v + "'");
    s.storage = v == "map" ? example::eigen_storage::map : example::eigen_storage::matrix;
    return true;
  });
  s.check();
  return s;
}

template <class Backend, example::eigen_storage Storage>
int train(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  using model_type = example::eigen_mlp<Storage>;
  ddp::logger log(comm);
  const auto data = example::load_fashion_mnist(s.data, s.limit);
  const auto& train_set = data.train;
  const auto& test_set = data.test;
  log.info("eigen_mlp: ", comm.size(), " rank(s) over ", s.backend, ", Eigen ", EIGEN_WORLD_VERSION, ".",
           EIGEN_MAJOR_VERSION, ".", EIGEN_MINOR_VERSION, " ",
           Storage == example::eigen_storage::map ? "Map members (adopted, zero copies)" : "Matrix members (copied)",
           ", ", train_set.size(), " training and ", test_set.size(), " test images, batch ", s.batch, " per rank (",
           s.batch * static_cast<std::size_t>(comm.size()), " global), lr ", s.lr, " (cosine to 0)");

  model_type model(train_set.features(), 256, 128, 10, 1234);
  ddp::data_parallel<model_type, Backend> dp{model, comm};
  ddp::optim::sgd opt({.lr = s.lr, .momentum = s.momentum});
  example::eigen_trainer trainer;
  return example::train_on_fashion_mnist(
      comm, log, s, data, dp, opt,
      [&](std::span<const float> x, std::span<const std::uint8_t> y) {
        dp.zero_grad();
        const auto r = trainer.forward(model, x, y);
        trainer.backward(model, [&](auto& leaf) { dp.gradient_ready(leaf); });
        dp.step(opt);
        return r;
      },
      [&](std::span<const float> x, std::span<const std::uint8_t> y) { return trainer.forward(model, x, y); });
}

template <class Backend>
int train_with(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  if (s.storage == example::eigen_storage::map) return train<Backend, example::eigen_storage::map>(std::move(comm), s);
  return train<Backend, example::eigen_storage::matrix>(std::move(comm), s);
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("eigen_mlp", argc, argv, parse, [](auto comm, const settings& s) {
    return train_with<ddp::backend_of_t<decltype(comm)>>(std::move(comm), s);
  });
}

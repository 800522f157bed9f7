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
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
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

namespace {

struct settings {
  std::string backend = "tcp";
  example::eigen_storage storage = example::eigen_storage::matrix;
  int epochs = 4;
  std::size_t batch = 64;  // per rank
  double lr = 0.05;
  double momentum = 0.9;   // lr follows a cosine from --lr down to 0 over all the steps of --epochs
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::filesystem::path checkpoint = "eigen_mlp.safetensors";
  std::size_t limit = 0;   // use only the first `limit` training images (0: all)
  double min_accuracy = 0; // exit 1 when the final test accuracy is below it (for tests)
  bool progress = true;
};

constexpr const char* usage =
    "usage: eigen_mlp [--backend tcp|mpi] [--storage matrix|map] [--epochs N] [--batch B (per rank)] [--lr X]\n"
    "                 [--momentum X] [--data DIR] [--checkpoint PATH] [--limit N] [--min-accuracy X] [--no-progress]\n";

settings parse(int argc, char** argv) {
  settings s;
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a == "--backend") s.backend = value();
    else if (a == "--storage") {
      const std::string v = value();
      if (v != "matrix" && v != "map") throw ddp::config_error("--storage must be matrix or map, not '" + v + "'");
      s.storage = v == "map" ? example::eigen_storage::map : example::eigen_storage::matrix;
    }
    else if (a == "--epochs") s.epochs = std::stoi(value());
    else if (a == "--batch") s.batch = std::stoul(value());
    else if (a == "--lr") s.lr = std::stod(value());
    else if (a == "--momentum") s.momentum = std::stod(value());
    else if (a == "--data") s.data = value();
    else if (a == "--checkpoint") s.checkpoint = value();
    else if (a == "--limit") s.limit = std::stoul(value());
    else if (a == "--min-accuracy") s.min_accuracy = std::stod(value());
    else if (a == "--no-progress") s.progress = false;
    else return false;
    return true;
  });
  if (s.backend != "tcp" && s.backend != "mpi")
    throw ddp::config_error("--backend must be tcp or mpi, not '" + s.backend + "'");
  if (s.epochs < 1 || s.batch < 1) throw ddp::config_error("--epochs and --batch must be at least 1");
  return s;
}

/// The rows of `data` at `indices`, packed into `x` and `y`.
void gather_batch(const example::image_set& data, std::span<const std::size_t> indices, std::vector<float>& x,
                  std::vector<std::uint8_t>& y) {
  const std::size_t f = data.features();
  x.resize(indices.size() * f);
  y.resize(indices.size());
  for (std::size_t r = 0; r < indices.size(); ++r) {
    std::copy_n(data.pixels.begin() + static_cast<std::ptrdiff_t>(indices[r] * f), f, x.begin() + static_cast<std::ptrdiff_t>(r * f));
    y[r] = data.labels[indices[r]];
  }
}

template <class Backend, example::eigen_storage Storage>
int train(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  using model_type = example::eigen_mlp<Storage>;
  ddp::logger log(comm);
  auto train_set = example::load_idx_split(s.data, "train", 0.2860F, 0.3530F);
  const auto test_set = example::load_idx_split(s.data, "t10k", 0.2860F, 0.3530F);
  if (s.limit > 0 && s.limit < train_set.size()) {
    train_set.labels.resize(s.limit);
    train_set.pixels.resize(s.limit * train_set.features());
  }
  log.info("eigen_mlp: ", comm.size(), " rank(s) over ", s.backend, ", Eigen ", EIGEN_WORLD_VERSION, ".",
           EIGEN_MAJOR_VERSION, ".", EIGEN_MINOR_VERSION, " ",
           Storage == example::eigen_storage::map ? "Map members (adopted, zero copies)" : "Matrix members (copied)",
           ", ", train_set.size(), " training and ", test_set.size(), " test images, batch ", s.batch, " per rank (",
           s.batch * static_cast<std::size_t>(comm.size()), " global), lr ", s.lr, " (cosine to 0)");

  model_type model(train_set.features(), 256, 128, 10, 1234);
  ddp::data_parallel<model_type, Backend> dp{model, comm};
  ddp::optim::sgd opt({.lr = s.lr, .momentum = s.momentum});
  ddp::distributed_sampler train_sampler(train_set.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(test_set.size(), comm, {.shuffle = false, .exact_once = true});

  example::eigen_trainer trainer;
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  double accuracy = 0;
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto batches = train_sampler.batches(static_cast<std::uint64_t>(epoch), s.batch);
    const std::size_t total_steps = batches.size() * static_cast<std::size_t>(s.epochs);
    ddp::progress_bar bar(s.progress ? comm.rank() : -1, batches.size(), "epoch " + std::to_string(epoch + 1));
    ddp::metric_sums train_sums;
    for (const auto batch : batches) {
      gather_batch(train_set, batch, x, y);
      const double pi = 3.14159265358979323846;
      opt.settings().lr = 0.5 * s.lr * (1 + std::cos(pi * static_cast<double>(opt.step_count()) / static_cast<double>(total_steps)));
      dp.zero_grad();
      const auto r = trainer.forward(model, x, y);
      trainer.backward(model, [&](auto& leaf) { dp.gradient_ready(leaf); });
      dp.step(opt);
      train_sums.add(r.loss_sum, static_cast<double>(r.correct), static_cast<double>(batch.size()));
      bar.step(r.loss_sum / static_cast<double>(batch.size()), batch.size() * static_cast<std::size_t>(comm.size()));
    }
    bar.finish();
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    ddp::metric_sums test_sums;
    for (const auto batch : test_sampler.batches(0, 1000)) {
      gather_batch(test_set, batch, x, y);
      const auto r = trainer.forward(model, x, y);
      test_sums.add(r.loss_sum, static_cast<double>(r.correct), static_cast<double>(batch.size()));
    }
    const auto train_all = train_sums.reduced(comm);
    const auto test_all = test_sums.reduced(comm);
    accuracy = test_all.accuracy();
    log.info("epoch ", epoch + 1, "/", s.epochs, ": train loss ", train_all.mean_loss(), " accuracy ",
             train_all.accuracy(), " | test loss ", test_all.mean_loss(), " accuracy ", accuracy, " (",
             static_cast<std::size_t>(test_all.samples), " images) | ", train_seconds, " s training");
    ddp::save(s.checkpoint, dp, opt, {{"epoch", std::to_string(epoch + 1)}, {"test_accuracy", std::to_string(accuracy)}});
  }
  if (accuracy < s.min_accuracy) {
    log.info("test accuracy ", accuracy, " is below the required ", s.min_accuracy);
    return 1;
  }
  return 0;
}

template <class Backend>
int train_with(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  if (s.storage == example::eigen_storage::map) return train<Backend, example::eigen_storage::map>(std::move(comm), s);
  return train<Backend, example::eigen_storage::matrix>(std::move(comm), s);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    if (s.backend == "mpi") {
#if defined(DDP_WITH_MPI)
      return train_with<ddp::backend::mpi>(ddp::mpi::communicator::world(argc, argv), s);
#else
      throw ddp::config_error("this build has no MPI backend; reconfigure with -DDDP_WITH_MPI=ON or use --backend tcp");
#endif
    }
    // Without a launcher (no RANK/WORLD_SIZE, no mpirun), run as a single process.
    const bool launched = std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    return train_with<ddp::backend::tcp>(
        launched ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{}), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eigen_mlp: %s\n", e.what());
    return 2;
  }
}

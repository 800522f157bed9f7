// Fashion-MNIST with an MLP (784-256-128-10) trained data-parallel by ddp.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/examples/fashion_mnist --backend mpi
//   build/tools/ddp-launch -n 2 build/examples/fashion_mnist --backend tcp
//   build/examples/fashion_mnist                      (one process: no launcher needed)
//
// Each rank trains on its part of every epoch (distributed_sampler), gradients are averaged bucket by bucket
// during the backward, test accuracy is computed with every test image on exactly one rank and reduced.
// A checkpoint is saved after every epoch; --resume continues from it (also after ddp-launch --max-restarts
// restarted the ranks: --crash-at-step shows it).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include <cblas.h>

#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>

#include "common/cli.hpp"
#include "common/idx.hpp"
#include "common/mlp.hpp"

namespace {

struct settings {
  std::string backend = "tcp";
  int epochs = 5;
  std::size_t batch = 64;  // per rank
  double lr = 0.05;
  double momentum = 0.9;
  bool cosine = true;              // lr follows a cosine from --lr down to 0 over all the steps of --epochs
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::filesystem::path checkpoint = "fashion_mnist.safetensors";
  bool resume = false;
  std::size_t limit = 0;           // use only the first `limit` training images (0: all)
  double min_accuracy = 0;         // exit 1 when the final test accuracy is below it (for tests)
  bool progress = true;
  std::uint64_t crash_at_step = 0; // the last rank kills itself at this step of the first attempt (0: never)
};

constexpr const char* usage =
    "usage: fashion_mnist [--backend tcp|mpi] [--epochs N] [--batch B (per rank)] [--lr X] [--momentum X]\n"
    "                     [--schedule cosine|constant] [--data DIR] [--checkpoint PATH] [--resume] [--limit N] [--min-accuracy X] [--no-progress]\n"
    "                     [--crash-at-step S]   (the last rank kills itself at step S of the first attempt, when\n"
    "                     DDP_RESTART_COUNT is unset or 0: under ddp-launch --max-restarts 1, with --resume, the job\n"
    "                     resumes from its last checkpoint)\n";

settings parse(int argc, char** argv) {
  settings s;
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a == "--backend") s.backend = value();
    else if (a == "--epochs") s.epochs = std::stoi(value());
    else if (a == "--batch") s.batch = std::stoul(value());
    else if (a == "--lr") s.lr = std::stod(value());
    else if (a == "--momentum") s.momentum = std::stod(value());
    else if (a == "--schedule") {
      const std::string v = value();
      if (v != "cosine" && v != "constant") throw ddp::config_error("--schedule must be cosine or constant, not '" + v + "'");
      s.cosine = v == "cosine";
    }
    else if (a == "--data") s.data = value();
    else if (a == "--checkpoint") s.checkpoint = value();
    else if (a == "--resume") s.resume = true;
    else if (a == "--limit") s.limit = std::stoul(value());
    else if (a == "--min-accuracy") s.min_accuracy = std::stod(value());
    else if (a == "--no-progress") s.progress = false;
    else if (a == "--crash-at-step") s.crash_at_step = std::stoull(value());
    else return false;
    return true;
  });
  if (s.backend != "tcp" && s.backend != "mpi")
    throw ddp::config_error("--backend must be tcp or mpi, not '" + s.backend + "'");
  if (s.epochs < 1 || s.batch < 1) throw ddp::config_error("--epochs and --batch must be at least 1");
  return s;
}

/// The learning rate at `step` of `total`: half a cosine from `peak` down to 0 (resumes exactly: the optimizer
/// saves its step count).
double cosine_lr(double peak, std::size_t step, std::size_t total) {
  const double pi = 3.14159265358979323846;
  return 0.5 * peak * (1 + std::cos(pi * static_cast<double>(std::min(step, total)) / static_cast<double>(total)));
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

template <class Backend>
int train(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  ddp::logger log(comm);
  const auto t_load = std::chrono::steady_clock::now();
  auto train_set = example::load_idx_split(s.data, "train", 0.2860F, 0.3530F);
  const auto test_set = example::load_idx_split(s.data, "t10k", 0.2860F, 0.3530F);
  if (s.limit > 0 && s.limit < train_set.size()) {
    train_set.labels.resize(s.limit);
    train_set.pixels.resize(s.limit * train_set.features());
  }
  log.info("fashion_mnist: ", comm.size(), " rank(s) over ", s.backend, ", ", train_set.size(), " training and ",
           test_set.size(), " test images (read in ",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count(), " s), batch ", s.batch,
           " per rank (", s.batch * static_cast<std::size_t>(comm.size()), " global), lr ", s.lr, s.cosine ? " (cosine to 0)" : " (constant)");

  example::mlp model = example::make_mlp(train_set.features(), 256, 128, 10, 1234);
  ddp::data_parallel dp{model, comm};  // data_parallel<example::mlp, Backend>, from the communicator's type
  ddp::optim::sgd opt({.lr = s.lr, .momentum = s.momentum});
  ddp::distributed_sampler train_sampler(train_set.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(test_set.size(), comm, {.shuffle = false, .exact_once = true});

  const char* restarts = std::getenv("DDP_RESTART_COUNT");  // ddp-launch --max-restarts counts its restarts
  const bool first_attempt = restarts == nullptr || std::string(restarts) == "0";
  int first_epoch = 0;
  if (s.resume) {
    bool exists = std::filesystem::exists(s.checkpoint);
    ddp::broadcast_object(comm, exists, 0);  // rank 0's file system decides
    if (exists) {
      const auto meta = ddp::load(s.checkpoint, dp, opt);
      first_epoch = std::stoi(meta.at("epoch"));
      log.info("resumed from ", s.checkpoint.string(), " after epoch ", first_epoch, " (step ", opt.step_count(), ")");
    } else {
      log.info("no checkpoint at ", s.checkpoint.string(), "; starting from scratch");
    }
  }

  example::mlp_trainer trainer;
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  double accuracy = 0;
  for (int epoch = first_epoch; epoch < s.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto batches = train_sampler.batches(static_cast<std::uint64_t>(epoch), s.batch);
    const std::size_t steps_per_epoch = batches.size();
    ddp::progress_bar bar(s.progress ? comm.rank() : -1, batches.size(), "epoch " + std::to_string(epoch + 1));
    ddp::metric_sums train_sums;
    for (const auto batch : batches) {
      if (s.crash_at_step > 0 && opt.step_count() == s.crash_at_step && comm.rank() == comm.size() - 1 &&
          first_attempt) {
        std::fprintf(stderr, "fashion_mnist: rank %d kills itself at step %llu (--crash-at-step)\n", comm.rank(),
                     static_cast<unsigned long long>(s.crash_at_step));
        ::raise(SIGKILL);
      }
      gather_batch(train_set, batch, x, y);
      if (s.cosine) opt.settings().lr = cosine_lr(s.lr, opt.step_count(), steps_per_epoch * static_cast<std::size_t>(s.epochs));
      dp.zero_grad();
      const auto r = trainer.forward(dp.module(), x, y);
      trainer.backward(dp.module(), [&](auto& p) { dp.gradient_ready(p); });
      dp.step(opt);
      train_sums.add(r.loss_sum, static_cast<double>(r.correct), static_cast<double>(batch.size()));
      bar.step(r.loss_sum / static_cast<double>(batch.size()), batch.size() * static_cast<std::size_t>(comm.size()));
    }
    bar.finish();
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    ddp::metric_sums test_sums;
    for (const auto batch : test_sampler.batches(0, 1000)) {
      gather_batch(test_set, batch, x, y);
      const auto r = trainer.forward(dp.module(), x, y);
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
  if (first_epoch >= s.epochs) log.info("the checkpoint has already reached epoch ", first_epoch, "; nothing to train");
  if (accuracy < s.min_accuracy && first_epoch < s.epochs) {
    log.info("test accuracy ", accuracy, " is below the required ", s.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);  // one rank per core: BLAS must not spawn threads of its own
  try {
    const settings s = parse(argc, argv);
    if (s.backend == "mpi") {
#if defined(DDP_WITH_MPI)
      return train<ddp::backend::mpi>(ddp::mpi::communicator::world(argc, argv), s);
#else
      throw ddp::config_error("this build has no MPI backend; reconfigure with -DDDP_WITH_MPI=ON or use --backend tcp");
#endif
    }
    // Without a launcher (no RANK/WORLD_SIZE, no mpirun), run as a single process.
    const bool launched = std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    return train<ddp::backend::tcp>(launched ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{}), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}

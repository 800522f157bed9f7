#pragma once
/// \file What every example's training program shares: the common flags, the cosine lr schedule's length, the epoch loop
/// (rank 0's progress bar, the metrics reduced across the ranks, rank 0's line per epoch) and main's backend choice.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>

#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>

#include "batch_result.hpp"
#include "idx.hpp"
#include "job.hpp"

namespace example {

/// The flags every example takes; each example sets its own defaults for epochs and the checkpoint.
struct run_settings {
  std::string backend = "tcp";
  int epochs = 1;
  std::size_t batch = 64;  // per rank
  double lr = 0.05;
  double momentum = 0.9;
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::filesystem::path checkpoint;
  std::size_t limit = 0;    // use only the first `limit` training images (0: all)
  double min_accuracy = 0;  // exit 1 when the final test accuracy is below it (for tests)
  bool progress = true;
  int threads = 0;  // --threads N: one process, N ranks as its threads (ddp::local); 0: the process is one rank

  /// Takes flag `a` when it is one of these (value() reads its argument) and returns true; false otherwise.
  template <class Value>
  bool take(std::string_view a, const Value& value) {
    if (a == "--backend") backend = value();
    else if (a == "--epochs") epochs = std::stoi(value());
    else if (a == "--batch") batch = std::stoul(value());
    else if (a == "--lr") lr = std::stod(value());
    else if (a == "--momentum") momentum = std::stod(value());
    else if (a == "--data") data = value();
    else if (a == "--checkpoint") checkpoint = value();
    else if (a == "--limit") limit = std::stoul(value());
    else if (a == "--min-accuracy") min_accuracy = std::stod(value());
    else if (a == "--no-progress") progress = false;
    else if (a == "--threads") threads = std::stoi(value()), backend = "local";
    else return false;
    return true;
  }
  /// Throws ddp::config_error for a backend other than tcp or mpi (or local, which --threads sets), fewer than one
  /// thread, epoch or image per batch.
  void check() const {
    if (backend != "tcp" && backend != "mpi" && !(backend == "local" && threads > 0))
      throw ddp::config_error("--backend must be tcp or mpi (or --threads N for N ranks in this process), not '" +
                              backend + "'");
    if (backend == "local" && threads < 1) throw ddp::config_error("--threads must be at least 1");
    if (epochs < 1 || batch < 1) throw ddp::config_error("--epochs and --batch must be at least 1");
  }
};

/// Trains epochs [first_epoch, s.epochs): train_batch(batch), a batch_result, over this rank's batches of the epoch (rank 0 shows a
/// progress bar unless --no-progress), then evaluate(test_sums) adds this rank's test figures; both sums are reduced
/// across the ranks, rank 0 logs the epoch's line, and end_epoch(epoch, test_accuracy) runs (it saves the
/// checkpoint). Returns the last epoch's test accuracy, 0 when no epoch ran.
template <class Comm, class TrainBatch, class Evaluate, class EndEpoch>
double train_epochs(Comm& comm, ddp::logger& log, const run_settings& s, int first_epoch,
                    const ddp::distributed_sampler& sampler, TrainBatch&& train_batch, Evaluate&& evaluate,
                    EndEpoch&& end_epoch) {
  double accuracy = 0;
  for (int epoch = first_epoch; epoch < s.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto batches = sampler.batches(static_cast<std::uint64_t>(epoch), s.batch);
    ddp::progress_bar bar(s.progress ? comm.rank() : -1, batches.size(), "epoch " + std::to_string(epoch + 1));
    ddp::metric_sums train_sums;
    for (const auto batch : batches) {
      const batch_result r = train_batch(batch);
      const auto n = static_cast<double>(batch.size());
      train_sums.add(r.loss_sum, static_cast<double>(r.correct), n);
      bar.step(r.loss_sum / n, batch.size() * static_cast<std::size_t>(comm.size()));
    }
    bar.finish();
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    ddp::metric_sums test_sums;
    evaluate(test_sums);
    const auto train_all = train_sums.reduced(comm);
    const auto test_all = test_sums.reduced(comm);
    accuracy = test_all.accuracy();
    log.info("epoch ", epoch + 1, "/", s.epochs, ": train loss ", train_all.mean_loss(), " accuracy ",
             train_all.accuracy(), " | test loss ", test_all.mean_loss(), " accuracy ", accuracy, " (",
             static_cast<std::size_t>(test_all.samples), " images) | ", train_seconds, " s training");
    end_epoch(epoch + 1, accuracy);
  }
  return accuracy;
}

/// The checkpoint's metadata after `epoch` (counted from 1) with its test accuracy.
inline ddp::checkpoint_metadata epoch_metadata(int epoch, double accuracy) {
  return {{"epoch", std::to_string(epoch)}, {"test_accuracy", std::to_string(accuracy)}};
}

/// The exit status: 1, with a line saying why, when `accuracy` is below --min-accuracy; else 0.
inline int verdict(ddp::logger& log, double accuracy, const run_settings& s) {
  if (accuracy >= s.min_accuracy) return 0;
  log.info("test accuracy ", accuracy, " is below the required ", s.min_accuracy);
  return 1;
}

/// The MLP examples' whole run on Fashion-MNIST: SGD `opt` with the cosine schedule from s.lr to 0 over every step,
/// the shuffled training set split over the ranks, step(x, y) once per batch (dp.zero_grad, forward, backward,
/// dp.step: it returns the batch's figures), the test set (every image on one rank, the whole model unsharded once)
/// through evaluate(x, y), and `dp` and `opt` saved to s.checkpoint after each epoch. Returns the exit status.
template <class Comm, class DP, class Step, class Evaluate>
int train_on_fashion_mnist(Comm& comm, ddp::logger& log, const run_settings& s, const fashion_mnist& data, DP& dp,
                           ddp::optim::sgd& opt, Step&& step, Evaluate&& evaluate) {
  ddp::distributed_sampler train_sampler(data.train.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(data.test.size(), comm, {.shuffle = false, .exact_once = true});
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::size_t total_steps = train_sampler.batches(0, s.batch).size() * static_cast<std::size_t>(s.epochs);
  opt.settings().lr_schedule = ddp::optim::schedules::cosine{.steps = std::max<std::size_t>(total_steps, 1)};
  const double accuracy = train_epochs(
      comm, log, s, 0, train_sampler,
      [&](std::span<const std::size_t> batch) {
        gather_batch(data.train, batch, x, y);
        return step(std::span<const float>(x), std::span<const std::uint8_t>(y));
      },
      [&](ddp::metric_sums& test_sums) {
        const auto whole = dp.unshard(dp.module());  // full_shard: ranks may evaluate different numbers of batches
        for (const auto batch : test_sampler.batches(0, 1000)) {
          gather_batch(data.test, batch, x, y);
          const batch_result r = evaluate(std::span<const float>(x), std::span<const std::uint8_t>(y));
          test_sums.add(r.loss_sum, static_cast<double>(r.correct), static_cast<double>(batch.size()));
        }
      },
      [&](int epoch, double acc) { ddp::save(s.checkpoint, dp, opt, epoch_metadata(epoch, acc)); });
  return verdict(log, accuracy, s);
}

/// main's body: parse(argc, argv) reads the settings, then train(comm, settings) runs on the backend --backend names
/// (MPI's world; TCP from a launcher's environment, or one process without a launcher), or on each of --threads N
/// threads of this process (ddp::local). An exception is printed as
/// "<name>: <what>" and exits with 2.
template <class Parse, class Train>
int run_main(const char* name, int argc, char** argv, Parse&& parse, Train&& train) {
  try {
    const auto s = parse(argc, argv);
    if (s.backend == "mpi") {
#if defined(DDP_WITH_MPI)
      return train(ddp::mpi::communicator::world(argc, argv), s);
#else
      throw ddp::config_error("this build has no MPI backend; reconfigure with -DDDP_WITH_MPI=ON or use --backend tcp");
#endif
    }
    if (s.threads > 0) {  // one process, one rank per thread; the worst rank's status is the run's
      std::vector<int> status(static_cast<std::size_t>(s.threads), 0);
      ddp::local::run(s.threads, [&](ddp::local::communicator comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        status[r] = train(std::move(comm), s);
      });
      return *std::max_element(status.begin(), status.end());
    }
    // Without a launcher (no RANK/WORLD_SIZE, no mpirun), run as a single process.
    return train(launched() ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{}), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 2;
  }
}

}  // namespace example

// Fashion-MNIST with an MLP (784-256-128-10) trained data-parallel by ddp.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/examples/fashion_mnist --backend mpi
//   build/tools/ddp-launch -n 2 build/examples/fashion_mnist --backend tcp
//   build/examples/fashion_mnist                      (one process: no launcher needed)
//   build/examples/fashion_mnist --threads 4          (one process, 4 ranks as threads: ddp::local)
//
// Each rank trains on its part of every epoch (distributed_sampler), gradients are averaged bucket by bucket
// during the backward, test accuracy is computed with every test image on exactly one rank and reduced.
// A checkpoint is saved after every epoch; --resume continues from it (also after ddp-launch --max-restarts
// restarted the ranks: --crash-at-step shows it).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include <cblas.h>

#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>

#include "common/blas.hpp"
#include "common/cli.hpp"
#include "common/idx.hpp"
#include "common/mlp.hpp"
#include "common/training.hpp"

namespace {

struct settings : example::run_settings {
  bool cosine = true;               // lr follows a cosine from --lr down to 0 over all the steps of --epochs
  bool resume = false;
  std::uint64_t crash_at_step = 0;  // the last rank kills itself at this step of the first attempt (0: never)
};

constexpr const char* usage =
    "usage: fashion_mnist [--backend tcp|mpi | --threads N] [--epochs N] [--batch B (per rank)] [--lr X] [--momentum X]\n"
    "                     [--schedule cosine|constant] [--data DIR] [--checkpoint PATH] [--resume] [--limit N] [--min-accuracy X] [--no-progress]\n"
    "                     [--crash-at-step S]   (the last rank kills itself at step S of the first attempt, when\n"
    "                     DDP_RESTART_COUNT is unset or 0: under ddp-launch --max-restarts 1, with --resume, the job\n"
    "                     resumes from its last checkpoint)\n";

settings parse(int argc, char** argv) {
  settings s;
  s.epochs = 5;
  s.checkpoint = "fashion_mnist.safetensors";
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a == "--schedule") {
      const std::string v = value();
      if (v != "cosine" && v != "constant") throw ddp::config_error("--schedule must be cosine or constant, not '" + v + "'");
      s.cosine = v == "cosine";
    }
    else if (a == "--resume") s.resume = true;
    else if (a == "--crash-at-step") s.crash_at_step = std::stoull(value());
    else return s.take(a, value);
    return true;
  });
  s.check();
  return s;
}

template <class Backend>
int train(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  ddp::logger log(comm);
  const auto t_load = std::chrono::steady_clock::now();
  const auto data = example::load_fashion_mnist(s.data, s.limit);
  const auto& train_set = data.train;
  const auto& test_set = data.test;
  log.info("fashion_mnist: ", comm.size(), " rank(s) over ", s.backend, ", ", train_set.size(), " training and ",
           test_set.size(), " test images (read in ",
           std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count(), " s), batch ", s.batch,
           " per rank (", s.batch * static_cast<std::size_t>(comm.size()), " global), lr ", s.lr, s.cosine ? " (cosine to 0)" : " (constant)");

  log.info("BLAS: ", example::blas_description());
  if (const std::string warning = example::blas_warning(); !warning.empty()) log.warn(warning);
  example::mlp model = example::make_mlp(train_set.features(), 256, 128, 10, 1234);
  ddp::data_parallel dp{model, comm};  // data_parallel<example::mlp, Backend>, from the communicator's type
  ddp::optim::sgd opt({.lr = s.lr, .momentum = s.momentum});
  ddp::distributed_sampler train_sampler(train_set.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(test_set.size(), comm, {.shuffle = false, .exact_once = true});
  const std::size_t total_steps = train_sampler.batches(0, s.batch).size() * static_cast<std::size_t>(s.epochs);
  if (s.cosine) opt.settings().lr_schedule = ddp::optim::schedules::cosine{.steps = std::max<std::size_t>(total_steps, 1)};

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
  const double accuracy = example::train_epochs(
      comm, log, s, first_epoch, train_sampler,
      [&](std::span<const std::size_t> batch) {
        if (s.crash_at_step > 0 && opt.step_count() == s.crash_at_step && comm.rank() == comm.size() - 1 &&
            first_attempt) {
          std::fprintf(stderr, "fashion_mnist: rank %d kills itself at step %llu (--crash-at-step)\n", comm.rank(),
                       static_cast<unsigned long long>(s.crash_at_step));
          ::raise(SIGKILL);
        }
        example::gather_batch(train_set, batch, x, y);
        dp.zero_grad();
        const auto r = trainer.forward(dp.module(), x, y);
        trainer.backward(dp.module(), [&](auto& p) { dp.gradient_ready(p); });
        dp.step(opt);
        return r;
      },
      [&](ddp::metric_sums& test_sums) {
        for (const auto batch : test_sampler.batches(0, 1000)) {
          example::gather_batch(test_set, batch, x, y);
          const auto r = trainer.forward(dp.module(), x, y);
          test_sums.add(r.loss_sum, static_cast<double>(r.correct), static_cast<double>(batch.size()));
        }
      },
      [&](int epoch, double acc) { ddp::save(s.checkpoint, dp, opt, example::epoch_metadata(epoch, acc)); });
  if (first_epoch >= s.epochs) {
    log.info("the checkpoint has already reached epoch ", first_epoch, "; nothing to train");
    return 0;
  }
  return example::verdict(log, accuracy, s);
}

}  // namespace

int main(int argc, char** argv) {
  openblas_set_num_threads(1);  // one rank per core: BLAS must not spawn threads of its own
  return example::run_main("fashion_mnist", argc, argv, parse, [](auto comm, const settings& s) {
    return train<ddp::backend_of_t<decltype(comm)>>(std::move(comm), s);
  });
}

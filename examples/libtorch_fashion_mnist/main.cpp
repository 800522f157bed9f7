// Fashion-MNIST with a small CNN written in LibTorch (torch::nn, torch::optim, autograd), trained data-parallel by
// ddp: the model, the optimizer and the loop are plain LibTorch; ddp wraps the module and steps the optimizer.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/examples/libtorch_fashion_mnist --backend mpi
//   build/tools/ddp-launch -n 2 build/examples/libtorch_fashion_mnist --backend tcp
//   build/examples/libtorch_fashion_mnist                      (one process: no launcher needed)
//   ... --policy full_shard                                    (ZeRO-3: each rank keeps a shard of every layer)
//
// Each rank trains on its part of every epoch (distributed_sampler); autograd reports every finished gradient to
// ddp, which averages them bucket by bucket during the backward. Under --policy full_shard each layer's forward runs
// through ddp::forward, which gathers the layer for its forward and again for its backward, and the optimizer steps
// this rank's shards (ddp::parameters(dp)). Test accuracy is computed with every test image
// on exactly one rank and reduced. The parameters are saved after every epoch (ddp::save, a safetensors file that
// PyTorch and ddp::load_module read).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <ddp/adapters/libtorch.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>

#include "common/cli.hpp"
#include "common/cnn.hpp"
#include "common/idx.hpp"

namespace {

struct settings {
  std::string backend = "tcp";
  std::string policy = "replicate";
  int epochs = 2;
  std::size_t batch = 64;  // per rank
  double lr = 0.05;
  double momentum = 0.9;
  std::filesystem::path data = "/usr/share/datasets/fashion-mnist";
  std::filesystem::path checkpoint = "libtorch_fashion_mnist.safetensors";
  std::size_t limit = 0;      // use only the first `limit` training images (0: all)
  double min_accuracy = 0;    // exit 1 when the final test accuracy is below it (for tests)
  bool progress = true;
};

constexpr const char* usage =
    "usage: libtorch_fashion_mnist [--backend tcp|mpi] [--policy replicate|full_shard] [--epochs N] [--batch B (per rank)] [--lr X] [--momentum X]\n"
    "                              [--data DIR] [--checkpoint PATH] [--limit N] [--min-accuracy X] [--no-progress]\n";

settings parse(int argc, char** argv) {
  settings s;
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a == "--backend") s.backend = value();
    else if (a == "--policy") s.policy = value();
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
  if (s.policy != "replicate" && s.policy != "full_shard")
    throw ddp::config_error("--policy must be replicate or full_shard, not '" + s.policy + "'");
  if (s.epochs < 1 || s.batch < 1) throw ddp::config_error("--epochs and --batch must be at least 1");
  return s;
}

/// The images and labels of `set` as tensors (N×1×28×28 floats, N labels).
std::pair<torch::Tensor, torch::Tensor> to_tensors(const example::image_set& set) {
  const auto n = static_cast<std::int64_t>(set.size());
  auto x = torch::from_blob(const_cast<float*>(set.pixels.data()),
                            {n, 1, static_cast<std::int64_t>(set.rows), static_cast<std::int64_t>(set.cols)}).clone();
  auto y = torch::from_blob(const_cast<std::uint8_t*>(set.labels.data()), {n}, torch::kByte).to(torch::kLong);
  return {x, y};
}

/// The rows of `data` at `indices`.
torch::Tensor rows(const torch::Tensor& data, std::span<const std::size_t> indices) {
  std::vector<std::int64_t> index(indices.begin(), indices.end());
  return data.index_select(0, torch::from_blob(index.data(), {static_cast<std::int64_t>(index.size())}, torch::kLong));
}

template <class Backend, class Sharding>
int train(typename ddp::backend_communicator_t<Backend> comm, const settings& s) {
  ddp::logger log(comm);
  auto train_set = example::load_idx_split(s.data, "train", 0.2860F, 0.3530F);
  const auto test_set = example::load_idx_split(s.data, "t10k", 0.2860F, 0.3530F);
  if (s.limit > 0 && s.limit < train_set.size()) {
    train_set.labels.resize(s.limit);
    train_set.pixels.resize(s.limit * train_set.features());
  }
  const auto [train_x, train_y] = to_tensors(train_set);
  const auto [test_x, test_y] = to_tensors(test_set);
  log.info("libtorch_fashion_mnist: ", comm.size(), " rank(s) over ", s.backend, ", ", s.policy, ", ", train_set.size(), " training and ",
           test_set.size(), " test images, batch ", s.batch, " per rank, SGD lr ", s.lr, " momentum ", s.momentum);

  torch::manual_seed(1234);
  auto net = std::make_shared<example::cnn_impl>();
  ddp::data_parallel<example::cnn_impl, Backend, Sharding> dp{*net, comm};  // rank 0's values reach every rank
  constexpr bool sharded = std::is_same_v<Sharding, ddp::full_shard>;  // full_shard: the rank's shards are stepped
  torch::optim::SGD opt(sharded ? ddp::parameters(dp) : net->parameters(),
                        torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  const auto forward = [&](const torch::Tensor& x) -> torch::Tensor {  // full_shard: each layer gathered per pass
    if constexpr (sharded)
      return net->forward(x, [&](auto& layer, const torch::Tensor& in) { return ddp::forward(dp, layer, in); });
    else
      return net->forward(x);
  };
  ddp::distributed_sampler train_sampler(train_set.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(test_set.size(), comm, {.shuffle = false, .exact_once = true});

  double accuracy = 0;
  for (int epoch = 0; epoch < s.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto batches = train_sampler.batches(static_cast<std::uint64_t>(epoch), s.batch);
    ddp::progress_bar bar(s.progress ? comm.rank() : -1, batches.size(), "epoch " + std::to_string(epoch + 1));
    ddp::metric_sums train_sums;
    net->train();
    for (const auto batch : batches) {
      const auto x = rows(train_x, batch), y = rows(train_y, batch);
      dp.zero_grad();
      const torch::Tensor out = forward(x);
      auto loss = torch::nn::functional::cross_entropy(out, y);
      loss.backward();
      dp.step(opt);
      const auto n = static_cast<double>(batch.size());
      train_sums.add(loss.item<double>() * n, out.argmax(1).eq(y).sum().item<double>(), n);
      bar.step(loss.item<double>(), batch.size() * static_cast<std::size_t>(comm.size()));
    }
    bar.finish();
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    ddp::metric_sums test_sums;
    net->eval();
    {
      torch::NoGradGuard no_grad;
      // full_shard: the whole model gathered once (ranks may evaluate different numbers of batches); replicate: no-op
      const auto whole = dp.unshard(dp.module());
      for (const auto batch : test_sampler.batches(0, 1000)) {
        const auto x = rows(test_x, batch), y = rows(test_y, batch);
        const auto out = net->forward(x);
        test_sums.add(torch::nn::functional::cross_entropy(out, y, torch::nn::functional::CrossEntropyFuncOptions()
                                                                       .reduction(torch::kSum)).item<double>(),
                      out.argmax(1).eq(y).sum().item<double>(), static_cast<double>(batch.size()));
      }
    }
    const auto train_all = train_sums.reduced(comm);
    const auto test_all = test_sums.reduced(comm);
    accuracy = test_all.accuracy();
    log.info("epoch ", epoch + 1, "/", s.epochs, ": train loss ", train_all.mean_loss(), " accuracy ",
             train_all.accuracy(), " | test loss ", test_all.mean_loss(), " accuracy ", accuracy, " (",
             static_cast<std::size_t>(test_all.samples), " images) | ", train_seconds, " s training");
    ddp::save(s.checkpoint, dp, {{"epoch", std::to_string(epoch + 1)}, {"test_accuracy", std::to_string(accuracy)}});
  }
  if (accuracy < s.min_accuracy) {
    log.info("test accuracy ", accuracy, " is below the required ", s.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);  // one rank per core: LibTorch must not spawn threads of its own
  try {
    const settings s = parse(argc, argv);
    if (s.backend == "mpi") {
#if defined(DDP_WITH_MPI)
      auto comm = ddp::mpi::communicator::world(argc, argv);
      return s.policy == "full_shard" ? train<ddp::backend::mpi, ddp::full_shard>(std::move(comm), s)
                                      : train<ddp::backend::mpi, ddp::replicate>(std::move(comm), s);
#else
      throw ddp::config_error("this build has no MPI backend; reconfigure with -DDDP_WITH_MPI=ON or use --backend tcp");
#endif
    }
    // Without a launcher (no RANK/WORLD_SIZE, no mpirun), run as a single process.
    const bool launched = std::getenv("WORLD_SIZE") != nullptr || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    auto comm = launched ? ddp::tcp::communicator::from_env() : ddp::tcp::communicator(ddp::tcp::config{});
    return s.policy == "full_shard" ? train<ddp::backend::tcp, ddp::full_shard>(std::move(comm), s)
                                    : train<ddp::backend::tcp, ddp::replicate>(std::move(comm), s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch_fashion_mnist: %s\n", e.what());
    return 2;
  }
}

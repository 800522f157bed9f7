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
// through ddp::forward, which unshards the layer for its forward and again for its backward, and the optimizer steps
// this rank's shards (ddp::parameters(dp)). Test accuracy is computed with every test image
// on exactly one rank and reduced. The parameters are saved after every epoch (ddp::save, a safetensors file that
// PyTorch and ddp::load_module read).
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
#include "common/training.hpp"

namespace {

struct settings : example::run_settings {
  std::string policy = "replicate";
};

constexpr const char* usage =
    "usage: libtorch_fashion_mnist [--backend tcp|mpi] [--policy replicate|full_shard] [--epochs N] [--batch B (per rank)] [--lr X] [--momentum X]\n"
    "                              [--data DIR] [--checkpoint PATH] [--limit N] [--min-accuracy X] [--no-progress]\n";

settings parse(int argc, char** argv) {
  settings s;
  s.epochs = 2;
  s.checkpoint = "libtorch_fashion_mnist.safetensors";
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a != "--policy") return s.take(a, value);
    s.policy = value();
    return true;
  });
  s.check();
  if (s.policy != "replicate" && s.policy != "full_shard")
    throw ddp::config_error("--policy must be replicate or full_shard, not '" + s.policy + "'");
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
  const auto data = example::load_fashion_mnist(s.data, s.limit);
  const auto& train_set = data.train;
  const auto& test_set = data.test;
  const auto train_tensors = to_tensors(train_set), test_tensors = to_tensors(test_set);
  const torch::Tensor &train_x = train_tensors.first, &train_y = train_tensors.second;
  const torch::Tensor &test_x = test_tensors.first, &test_y = test_tensors.second;
  log.info("libtorch_fashion_mnist: ", comm.size(), " rank(s) over ", s.backend, ", ", s.policy, ", ", train_set.size(), " training and ",
           test_set.size(), " test images, batch ", s.batch, " per rank, SGD lr ", s.lr, " momentum ", s.momentum);

  torch::manual_seed(1234);
  auto net = std::make_shared<example::cnn_impl>();
  ddp::data_parallel<example::cnn_impl, Backend, Sharding> dp{*net, comm};  // rank 0's values reach every rank
  constexpr bool sharded = std::is_same_v<Sharding, ddp::full_shard>;  // full_shard: the rank's shards are stepped
  torch::optim::SGD opt(sharded ? ddp::parameters(dp) : net->parameters(),
                        torch::optim::SGDOptions(s.lr).momentum(s.momentum));
  const auto forward = [&](const torch::Tensor& x) -> torch::Tensor {  // full_shard: each layer unsharded per pass
    if constexpr (sharded)
      return net->forward(x, [&](auto& layer, const torch::Tensor& in) { return ddp::forward(dp, layer, in); });
    else
      return net->forward(x);
  };
  ddp::distributed_sampler train_sampler(train_set.size(), comm, {.shuffle = true, .seed = 42});
  ddp::distributed_sampler test_sampler(test_set.size(), comm, {.shuffle = false, .exact_once = true});

  const double accuracy = example::train_epochs(
      comm, log, s, 0, train_sampler,
      [&](std::span<const std::size_t> batch) {
        const auto x = rows(train_x, batch), y = rows(train_y, batch);
        dp.zero_grad();
        const torch::Tensor out = forward(x);
        auto loss = torch::nn::functional::cross_entropy(out, y);
        loss.backward();
        dp.step(opt);
        return example::batch_result{loss.item<double>() * static_cast<double>(batch.size()),
                                     static_cast<std::size_t>(out.argmax(1).eq(y).sum().item<std::int64_t>())};
      },
      [&](ddp::metric_sums& test_sums) {
        net->eval();
        torch::NoGradGuard no_grad;
        // full_shard: the whole model unsharded once (ranks may evaluate different numbers of batches); replicate: no-op
        const auto whole = dp.unshard(dp.module());
        for (const auto batch : test_sampler.batches(0, 1000)) {
          const auto x = rows(test_x, batch), y = rows(test_y, batch);
          const auto out = net->forward(x);
          test_sums.add(torch::nn::functional::cross_entropy(out, y, torch::nn::functional::CrossEntropyFuncOptions()
                                                                         .reduction(torch::kSum)).item<double>(),
                        out.argmax(1).eq(y).sum().item<double>(), static_cast<double>(batch.size()));
        }
        net->train();  // the next epoch trains
      },
      [&](int epoch, double acc) { ddp::save(s.checkpoint, dp, example::epoch_metadata(epoch, acc)); });
  return example::verdict(log, accuracy, s);
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);  // one rank per core: LibTorch must not spawn threads of its own
  return example::run_main("libtorch_fashion_mnist", argc, argv, parse, [](auto comm, const settings& s) {
    using backend = ddp::backend_of_t<decltype(comm)>;
    return s.policy == "full_shard" ? train<backend, ddp::full_shard>(std::move(comm), s)
                                    : train<backend, ddp::replicate>(std::move(comm), s);
  });
}

// Fashion-MNIST with the examples' MLP (784-256-128-10) on GPUs: parameters, forward and backward (cuBLAS) on each
// rank's device, gradients all-reduced by NCCL bucket by bucket while the backward runs, the optimizer's update as
// a kernel over the flat arenas. Nothing waits for the device in a step but reading the batch's loss at its end.
//
//   build/tools/ddp-launch -n 2 build/examples/cuda_fashion_mnist
//   mpirun --allow-run-as-root -np 2 build/examples/cuda_fashion_mnist     (MASTER_ADDR/MASTER_PORT: 127.0.0.1:29500)
//   build/examples/cuda_fashion_mnist                                     (one process)
//   ... --policy full_shard                                               (FSDP: each layer unsharded for its use)
//
// One GPU per rank: LOCAL_RANK modulo the devices. NCCL refuses two ranks of a job on one GPU; to try several ranks
// on one (a test, not a speed-up) give each its own NCCL_HOSTID:
//   ddp-launch -n 2 sh -c 'NCCL_HOSTID=rank$RANK exec build/examples/cuda_fashion_mnist'
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/checkpoint.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/ddp.hpp>
#include <ddp/log.hpp>
#include <ddp/memory/cuda.hpp>
#include <ddp/memory/devices.hpp>

#include "common/cli.hpp"
#include "common/cuda_mlp.hpp"
#include "common/gpu_rank.hpp"
#include "common/idx.hpp"
#include "common/mlp.hpp"
#include "common/training.hpp"

namespace {

struct settings : example::run_settings {
  std::string policy = "replicate";
};

constexpr const char* usage =
    "usage: cuda_fashion_mnist [--policy replicate|shard_grad_op|full_shard] [--epochs N] [--batch B (per rank)]\n"
    "                          [--lr X] [--momentum X] [--data DIR] [--checkpoint PATH] [--limit N]\n"
    "                          [--min-accuracy X] [--no-progress]\n";

settings parse(int argc, char** argv) {
  settings s;
  s.backend = "nccl";
  s.epochs = 5;
  s.checkpoint = "cuda_fashion_mnist.safetensors";
  example::parse_flags(argc, argv, usage, [&s](std::string_view a, const auto& value) {
    if (a != "--policy") return a != "--backend" && s.take(a, value);
    s.policy = value();
    return true;
  });
  if (s.policy != "replicate" && s.policy != "shard_grad_op" && s.policy != "full_shard")
    throw ddp::config_error("--policy must be replicate, shard_grad_op or full_shard, not '" + s.policy + "'");
  if (s.epochs < 1 || s.batch < 1) throw ddp::config_error("--epochs and --batch must be at least 1");
  return s;
}

template <class Sharding>
int train(const settings& s) {
  const int device = example::gpu::pick_device();
  const ddp::cuda::stream model_stream(device);  // the model's stream: the domain and NCCL follow it
  const ddp::nccl::config on_model{.device = device, .compute_stream = model_stream.get()};
  auto comm = example::gpu::nccl_world(on_model);
  ddp::cuda::domain gpu(device, {.stream = model_stream.get()});
  const ddp::device_registration on_gpu(gpu);
  ddp::logger log(comm);
  const auto data = example::load_fashion_mnist(s.data, s.limit);
  const auto& train_set = data.train;
  const auto& test_set = data.test;
  log.info("cuda_fashion_mnist: ", comm.size(), " rank(s) over nccl on cuda:", device, ", ", s.policy, ", ",
           train_set.size(), " training and ", test_set.size(), " test images, batch ", s.batch, " per rank, SGD lr ",
           s.lr, " momentum ", s.momentum);

  std::vector<ddp::cuda::device_buffer<float>> memory;
  example::gpu::device_mlp model =
      example::gpu::place(example::make_mlp(train_set.features(), 256, 128, 10, 1234), memory);
  ddp::data_parallel<example::gpu::device_mlp, ddp::backend::nccl, Sharding> dp{model, comm};
  ddp::optim::sgd opt({.lr = s.lr, .momentum = s.momentum});
  const auto scope = [&](example::gpu::device_linear& layer) { return dp.unshard(layer); };  // full_shard's
  example::gpu::trainer trainer(model_stream.get());
  return example::train_on_fashion_mnist(
      comm, log, s, data, dp, opt,
      [&](std::span<const float> x, std::span<const std::uint8_t> y) {
        dp.zero_grad();
        trainer.forward(dp.module(), x, y, scope);
        trainer.backward(dp.module(), [&](auto& p) { dp.gradient_ready(p); }, scope);
        dp.step(opt);
        return trainer.last_result();  // read once the step is queued: the device never waits for the host
      },
      [&](std::span<const float> x, std::span<const std::uint8_t> y) {
        trainer.forward(dp.module(), x, y);
        return trainer.last_result();
      });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const settings s = parse(argc, argv);
    if (s.policy == "full_shard") return train<ddp::full_shard>(s);
    if (s.policy == "shard_grad_op") return train<ddp::shard_grad_op>(s);
    return train<ddp::replicate>(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_fashion_mnist: %s\n", e.what());
    return 2;
  }
}

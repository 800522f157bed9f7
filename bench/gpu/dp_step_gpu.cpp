// Step time of an MLP on a GPU (common/cuda_mlp.hpp: cuBLAS GEMMs, ReLU, softmax cross-entropy, SGD with momentum)
// trained by ddp::data_parallel over ddp::nccl (--mode ddp, replicate), or the same model without the wrapper
// (--mode plain: the same kernels, the same optimizer update as a kernel per parameter). Prints one JSON line on
// rank 0: the median step over --steps (each step timed from the host, ending with a wait for the device).
//
//   dp_step_gpu --mode ddp|plain --dims 784,2048,2048,10 --batch 64 [--steps S] [--warmup W]
//   dp_step_gpu --mode ddp --dims 4096,4096,4096,4096,4096,4096,4096,4096,4096 --batch 256   (8 layers, 134 M)
//
// Under a launcher (ddp-launch, mpirun) --mode ddp runs N ranks, one GPU each; alone it is a group of one.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/cuda/element.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/ddp.hpp>
#include <ddp/memory/cuda.hpp>
#include <ddp/memory/devices.hpp>

#include "bench/common/numbers.hpp"
#include "common/cuda_mlp.hpp"
#include "common/gpu_rank.hpp"

namespace {

namespace gpu = example::gpu;

struct settings {
  std::string mode = "ddp";
  std::vector<std::size_t> dims{784, 2048, 2048, 10};
  std::size_t batch = 64;
  int steps = 50;
  int warmup = 10;
};

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i + 1 >= argc) throw ddp::config_error(std::string(a) + " needs a value");
    const std::string v = argv[++i];
    if (a == "--mode") s.mode = v;
    else if (a == "--batch") s.batch = std::stoul(v);
    else if (a == "--steps") s.steps = std::stoi(v);
    else if (a == "--warmup") s.warmup = std::stoi(v);
    else if (a == "--dims") s.dims = bench::comma_list<std::size_t>(v, "--dims");
    else
      throw ddp::config_error("unknown argument '" + std::string(a) + "'");
  }
  if (s.mode != "ddp" && s.mode != "plain") throw ddp::config_error("--mode must be ddp or plain");
  if (s.dims.size() < 2 || s.steps < 1) throw ddp::config_error("--dims needs two sizes at least, --steps one step");
  return s;
}

int run(const settings& s) {
  const int rank = example::job_env().rank;
  const int device = gpu::pick_device();
  const ddp::cuda::stream model_stream(device);
  const cudaStream_t stream = model_stream.get();

  std::mt19937_64 rng(7);
  std::vector<example::linear> host;
  for (std::size_t k = 0; k + 1 < s.dims.size(); ++k) host.push_back(example::make_linear(s.dims[k], s.dims[k + 1], rng));
  std::vector<ddp::cuda::device_buffer<float>> memory;
  std::vector<gpu::device_linear> model;
  std::size_t parameters = 0;
  for (const auto& l : host) {
    model.push_back(gpu::place(l, memory));
    parameters += l.weight.numel() + l.bias.numel();
  }
  host.clear();
  std::mt19937_64 data(static_cast<std::uint64_t>(rank) + 1);
  std::vector<float> x(s.batch * s.dims.front());
  std::vector<std::uint8_t> y(s.batch);
  for (auto& v : x) v = static_cast<float>(data() % 1000) / 1000.0F;
  for (auto& v : y) v = static_cast<std::uint8_t>(data() % s.dims.back());
  gpu::trainer trainer(stream);
  std::vector<double> times;
  int world = 1;
  const auto timed = [&](auto&& step) {
    for (int i = 0; i < s.warmup + s.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ddp::cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (i >= s.warmup) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  };
  if (s.mode == "plain") {
    const ddp::sgd_update first{.lr = 0.01, .momentum = 0.9, .first = true}, later{.lr = 0.01, .momentum = 0.9};
    std::vector<ddp::cuda::device_buffer<float>> momentum;
    std::vector<gpu::device_param*> params;
    for (auto& l : model)
      for (auto* p : {&l.weight, &l.bias}) {
        params.push_back(p);
        momentum.emplace_back(p->numel(), device);
      }
    int step_count = 0;
    const auto tensor = [&](float* p, std::size_t n) { return ddp::raw_tensor{p, n, ddp::dtype::f32, ddp::device::cuda(device)}; };
    timed([&] {
      for (auto* p : params) ddp::cuda::check(cudaMemsetAsync(p->grads, 0, p->numel() * sizeof(float), stream), "zero_grad");
      trainer.forward(model, x, y);
      trainer.backward(model, [](auto&) {});
      for (std::size_t k = 0; k < params.size(); ++k)
        ddp::cuda::sgd(tensor(params[k]->values, params[k]->numel()), tensor(params[k]->grads, params[k]->numel()),
                       tensor(momentum[k].data(), params[k]->numel()), step_count == 0 ? first : later, stream);
      ++step_count;
    });
  } else {
    const ddp::nccl::config on_model{.device = device, .compute_stream = stream};
    auto comm = gpu::nccl_world(on_model);
    world = comm.size();
    ddp::cuda::domain domain(device, {.stream = stream});
    const ddp::device_registration on_gpu(domain);
    ddp::data_parallel<std::vector<gpu::device_linear>, ddp::backend::nccl> dp{model, comm};
    ddp::optim::sgd opt({.lr = 0.01, .momentum = 0.9});
    timed([&] {
      dp.zero_grad();
      trainer.forward(dp.module(), x, y);
      trainer.backward(dp.module(), [&](auto& p) { dp.gradient_ready(p); });
      dp.step(opt);
    });
  }
  if (rank == 0) {
    cudaDeviceProp prop{};
    ddp::cuda::check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    std::string dims;
    for (const auto d : s.dims) dims += (dims.empty() ? "" : "-") + std::to_string(d);
    std::printf("{\"mode\": \"%s\", \"world\": %d, \"dims\": \"%s\", \"parameters\": %zu, \"batch\": %zu, "
                "\"steps\": %d, \"step_ms\": %.4f, \"min_ms\": %.4f, \"gpu\": \"%s\"}\n",
                s.mode.c_str(), world, dims.c_str(), parameters, s.batch, s.steps, bench::median(times),
                *std::min_element(times.begin(), times.end()), prop.name);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_step_gpu: %s\n", e.what());
    return 2;
  }
}

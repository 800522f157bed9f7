#pragma once
// Small torch::nn models for the adapter's tests: an MLP (Linear, ReLU, Linear), a CNN (Conv2d, ReLU, Linear)
// and a deeper CNN of three units whose forward runs each submodule through a runner (full_shard's
// ddp::forward), their deterministic data and the loss that makes N ranks on disjoint shards average to the
// whole batch's mean gradient.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace ddp_torch_test {

struct mlp_impl : torch::nn::Module {
  mlp_impl() : fc1(register_module("fc1", torch::nn::Linear(6, 9))), fc2(register_module("fc2", torch::nn::Linear(9, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE_IMPL(mlp, mlp_impl);

struct cnn_impl : torch::nn::Module {
  cnn_impl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        fc(register_module("fc", torch::nn::Linear(4 * 6 * 6, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(torch::relu(conv(x)).flatten(1)); }
  torch::nn::Conv2d conv;
  torch::nn::Linear fc;
};
TORCH_MODULE_IMPL(cnn, cnn_impl);

/// Three units (conv, fc1, fc2): Conv2d, ReLU, Linear, ReLU, Linear. forward(x, run) calls run(submodule, input)
/// for each unit (ddp::forward under full_shard); forward(x) is the plain model.
struct deep_impl : torch::nn::Module {
  deep_impl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(4 * 6 * 6, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 3))) {}
  template <class Run>
  torch::Tensor forward(const torch::Tensor& x, Run run) {
    const torch::Tensor h = torch::relu(run(conv, x)).flatten(1);
    return run(fc2, torch::relu(run(fc1, h)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return forward(x, [](auto& m, const torch::Tensor& in) { return m(in); });
  }
  torch::nn::Conv2d conv;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE_IMPL(deep, deep_impl);

/// The model's inputs for `samples` samples (MLP: 6 features, CNN: 1×8×8 images).
template <class Net>
std::vector<std::int64_t> input_shape(std::int64_t samples) {
  if constexpr (std::is_same_v<Net, mlp>)
    return {samples, 6};
  else
    return {samples, 1, 8, 8};
}

/// A model whose initial values depend only on `seed`.
template <class Net>
Net make_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return Net();
}

/// Inputs and regression targets of step `step`'s global batch of `samples` (the same in every process).
template <class Net>
std::pair<torch::Tensor, torch::Tensor> make_batch(std::uint64_t step, std::int64_t samples) {
  torch::manual_seed(1000 + step);
  torch::Tensor x = torch::randn(input_shape<Net>(samples));
  torch::Tensor y = torch::randn({samples, 3});
  return {x, y};
}

/// Sum of squared errors over the rows, scaled by `scale` (N / B on each of N ranks: the ranks' average is the
/// mean over the global batch of B).
inline torch::Tensor scaled_loss(const torch::Tensor& out, const torch::Tensor& y, double scale) {
  return (out - y).pow(2).sum() * scale;
}

}  // namespace ddp_torch_test

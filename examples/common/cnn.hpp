#pragma once
/// \file The small LibTorch CNN of the Fashion-MNIST example (1×28×28 images, 10 classes), shared with its bench.

#include <utility>

#include <torch/torch.h>

namespace example {

/// conv(1→8) → pool → conv(8→16) → pool → fc(784→64) → fc(64→10).
struct cnn_impl : torch::nn::Module {
  cnn_impl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(16 * 7 * 7, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}
  /// The logits of a batch of N×1×28×28 images, each layer run as `run(layer, input)` (under ddp::full_shard:
  /// ddp::forward(dp, layer, input), which unshards the layer for its forward and its backward).
  template <class Run>
  torch::Tensor forward(torch::Tensor x, Run run) {
    x = torch::max_pool2d(torch::relu(run(conv1, x)), 2);
    x = torch::max_pool2d(torch::relu(run(conv2, x)), 2);
    return run(fc2, torch::relu(run(fc1, x.flatten(1))));
  }
  /// The logits of a batch of N×1×28×28 images.
  torch::Tensor forward(torch::Tensor x) {
    return forward(std::move(x), [](auto& layer, const torch::Tensor& in) { return layer(in); });
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};

}  // namespace example

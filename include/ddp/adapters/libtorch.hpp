#pragma once
/// \file LibTorch models under ddp: torch::Tensor parameters as zero-copy leaves reported by autograd
/// (libtorch/tensor.hpp), torch::nn::Module walked by its parameter names (libtorch/module.hpp), the tensors a
/// torch::optim optimizer steps (libtorch/optimizer.hpp) and loading a ddp checkpoint into a plain module
/// (libtorch/checkpoint.hpp), with <ddp/ddp.hpp> and <ddp/checkpoint.hpp>. Needs LibTorch (find_package(Torch));
/// not part of the single header. docs/libtorch.md is its manual.
///
///   ddp::data_parallel<Net, ddp::backend::tcp> dp{*net, comm};
///   torch::optim::SGD opt(net->parameters(), 0.1);
///   dp.zero_grad(); auto loss = ...; loss.backward(); dp.step(opt);

#include <ddp/adapters/libtorch/checkpoint.hpp>
#include <ddp/adapters/libtorch/clip.hpp>
#include <ddp/adapters/libtorch/forward.hpp>
#include <ddp/adapters/libtorch/module.hpp>
#include <ddp/adapters/libtorch/optimizer.hpp>
#include <ddp/adapters/libtorch/sync_batch_norm.hpp>
#include <ddp/adapters/libtorch/tensor.hpp>
#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>

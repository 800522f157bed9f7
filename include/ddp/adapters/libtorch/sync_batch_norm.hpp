#pragma once
/// \file ddp::SyncBatchNorm: PyTorch's torch.nn.SyncBatchNorm for LibTorch modules, on the CPU (PyTorch's own runs on
/// CUDA only). In training mode the forward all-reduces one f64 vector [count, Σx, Σx²] per call and the backward
/// (an autograd function) one [Σdy, Σdy·x̂], so the statistics are those of every rank's batch together, uneven
/// batches included, and the running statistics (buffers, under BatchNorm's names) are the same on every rank. The
/// weight's and bias's gradients are the rank's own part, which data_parallel averages as any gradient. In eval mode
/// it is BatchNorm with the running statistics.
///
/// PyTorch converts a model with convert_sync_batchnorm(model), which swaps the registered children. In C++ a
/// module's forward calls its BatchNorm through the member holder the class declares, which a swap in the registry
/// does not reach, so the class declares ddp::SyncBatchNorm where it had torch::nn::BatchNorm1d/2d/3d:
/// `bn = register_module("bn", ddp::SyncBatchNorm(ddp::sync_batch_norm_options(64, comm)))`.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <ddp/ddp.hpp>
#include <ddp/core/error.hpp>

namespace ddp {

/// The all-reduce (sum) of f64 values over the ranks a SyncBatchNorm spans.
using sum_over_ranks = std::function<void(std::span<double>)>;

/// Settings of a SyncBatchNorm: channels, eps, momentum (torch.nn.BatchNorm's), and the ranks it spans.
struct sync_batch_norm_options {
  /// `channels` features, statistics over the ranks of `comm` (any ddp communicator, kept by value).
  template <class Comm>
  sync_batch_norm_options(std::int64_t channels, Comm comm)
      : channels(channels), sum([comm](std::span<double> v) mutable { comm.all_reduce(v, reduce_op::sum).wait(); }) {}
  std::int64_t channels;  ///< C
  double eps = 1e-5;      ///< added to the variance
  double momentum = 0.1;  ///< of the running statistics
  sum_over_ranks sum;     ///< the all-reduce the statistics travel in
};

namespace detail::libtorch {

/// The training forward and backward of SyncBatchNorm over [N, C, ...] inputs (channels in dimension 1).
struct sync_batch_norm_function : torch::autograd::Function<sync_batch_norm_function> {
  /// Normalizes `x` with the statistics of every rank's batch; updates the running statistics (no gradient).
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, torch::Tensor running_mean, torch::Tensor running_var,
                               torch::Tensor num_batches_tracked, const sync_batch_norm_options* o) {
    const auto c = x.size(1);
    const torch::Tensor rows = x.transpose(0, 1).reshape({c, -1}).to(torch::kFloat64);  // [C, count]
    std::vector<double> sums(static_cast<std::size_t>(1 + 2 * c));
    sums[0] = static_cast<double>(rows.size(1));
    const torch::Tensor s1 = rows.sum(1), s2 = (rows * rows).sum(1);
    std::copy_n(s1.data_ptr<double>(), c, sums.begin() + 1);
    std::copy_n(s2.data_ptr<double>(), c, sums.begin() + 1 + c);
    o->sum(sums);
    const double total = sums[0];
    if (total < 2)
      throw config_error("SyncBatchNorm: " + std::to_string(static_cast<std::int64_t>(total)) + " value(s) per channel "
                         "over all ranks; batch statistics need at least 2 (as torch.nn.BatchNorm in training mode)");
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    const torch::Tensor mean = torch::from_blob(sums.data() + 1, {c}, f64).clone() / total;
    const torch::Tensor var = (torch::from_blob(sums.data() + 1 + c, {c}, f64).clone() / total - mean * mean).clamp_min(0);
    const torch::Tensor invstd = (var + o->eps).rsqrt();
    {
      torch::NoGradGuard no_grad;
      running_mean.mul_(1 - o->momentum).add_(mean.to(running_mean.scalar_type()), o->momentum);
      running_var.mul_(1 - o->momentum).add_((var * total / (total - 1)).to(running_var.scalar_type()), o->momentum);
      num_batches_tracked.add_(1);
    }
    std::vector<std::int64_t> shape(static_cast<std::size_t>(x.dim()), 1);
    shape[1] = c;
    const torch::Tensor xhat = (x.to(torch::kFloat64) - mean.view(shape)) * invstd.view(shape);
    ctx->save_for_backward({xhat, invstd, weight});
    ctx->saved_data["total"] = total;
    ctx->saved_data["options"] = reinterpret_cast<std::int64_t>(o);
    return (xhat * weight.to(torch::kFloat64).view(shape) + bias.to(torch::kFloat64).view(shape)).to(x.scalar_type());
  }

  /// dx from the global [Σdy, Σdy·x̂] (one all-reduce); the weight's and bias's gradients from this rank's part.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& xhat = saved[0];
    const torch::Tensor& invstd = saved[1];
    const torch::Tensor& weight = saved[2];
    const double total = ctx->saved_data["total"].toDouble();
    const auto* o = reinterpret_cast<const sync_batch_norm_options*>(ctx->saved_data["options"].toInt());
    const auto c = xhat.size(1);
    const torch::Tensor dy = grads[0].to(torch::kFloat64);
    const torch::Tensor dy_rows = dy.transpose(0, 1).reshape({c, -1}), xhat_rows = xhat.transpose(0, 1).reshape({c, -1});
    const torch::Tensor local = torch::cat({dy_rows.sum(1), (dy_rows * xhat_rows).sum(1)}).contiguous();
    std::vector<double> sums(local.data_ptr<double>(), local.data_ptr<double>() + 2 * c);
    o->sum(sums);
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
    const torch::Tensor sum_dy = torch::from_blob(sums.data(), {c}, f64).clone();
    const torch::Tensor sum_dy_xhat = torch::from_blob(sums.data() + c, {c}, f64).clone();
    std::vector<std::int64_t> shape(static_cast<std::size_t>(xhat.dim()), 1);
    shape[1] = c;
    const torch::Tensor scale = (weight.to(torch::kFloat64) * invstd / total).view(shape);
    const torch::Tensor dx =
        scale * (total * dy - sum_dy.view(shape) - xhat * sum_dy_xhat.view(shape));
    return {dx.to(grads[0].scalar_type()), local.slice(0, c, 2 * c).to(weight.scalar_type()),
            local.slice(0, 0, c).to(weight.scalar_type()), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace detail::libtorch

/// The module: weight, bias (parameters) and running_mean, running_var, num_batches_tracked (buffers), as
/// torch::nn::BatchNorm's, so checkpoints and load_state_dict see the same names.
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// A layer of `options.channels` channels over the ranks `options` names.
  explicit SyncBatchNormImpl(sync_batch_norm_options options) : options_(std::move(options)) { reset(); }
  /// (Re)creates the parameters and buffers: weight 1, bias 0, running mean 0, running variance 1.
  void reset() override {
    const auto c = options_.channels;
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }
  /// Training: statistics over every rank's batch (collective); eval: the running statistics.
  torch::Tensor forward(const torch::Tensor& x) {
    if (x.dim() < 2 || x.size(1) != options_.channels)
      throw config_error("SyncBatchNorm: input of " + std::to_string(x.dim()) + " dimension(s) with " +
                         (x.dim() >= 2 ? std::to_string(x.size(1)) : std::string("no")) + " channel(s) in dimension 1; "
                         "give [N, " + std::to_string(options_.channels) + ", ...]");
    if (!is_training())
      return torch::batch_norm(x, weight, bias, running_mean, running_var, false, options_.momentum, options_.eps,
                               false);
    return detail::libtorch::sync_batch_norm_function::apply(x, weight, bias, running_mean, running_var,
                                                             num_batches_tracked, &options_);
  }

  torch::Tensor weight;               ///< γ
  torch::Tensor bias;                 ///< β
  torch::Tensor running_mean;         ///< buffer
  torch::Tensor running_var;          ///< buffer (unbiased)
  torch::Tensor num_batches_tracked;  ///< buffer

 private:
  sync_batch_norm_options options_;
};
/// The ModuleHolder of SyncBatchNormImpl (as TORCH_MODULE declares).
TORCH_MODULE(SyncBatchNorm);

}  // namespace ddp

#pragma once
/// \file ddp::nn::sync_batch_norm: batch normalization over the batch of every rank (PyTorch's SyncBatchNorm) for
/// models that write their own forward and backward. The forward all-reduces one f64 vector [count, Σx, Σx²] (per
/// channel), the backward one [Σdy, Σdy·x̂]; counts travel with the sums, so uneven batches give the statistics of
/// the union exactly. The running statistics are model state (buffers), updated from the global statistics and
/// so the same on every rank. The weight's and bias's gradients are the rank's own part (Σ over its samples), which
/// data_parallel averages as any gradient: N ranks equal one process with plain batch norm on the union batch.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/state.hpp>

namespace ddp::nn {

/// Batch normalization over the channels of [n, C] inputs (row-major), with statistics over every rank's batch.
/// Visited as weight, bias (parameters) and running_mean, running_var, num_batches_tracked (buffers), as PyTorch's.
template <class T = float>
class sync_batch_norm {
 public:
  /// C channels; eps and momentum as torch.nn.BatchNorm1d's.
  explicit sync_batch_norm(std::size_t channels, double eps = 1e-5, double momentum = 0.1)
      : weight_({channels}, std::vector<T>(channels, T(1))), bias_({channels}), running_mean_({channels}, T(0)),
        running_var_({channels}, T(1)), num_batches_tracked_({}, 0), eps_(eps), momentum_(momentum) {}

  /// Training forward of `x` ([n, C], n ≥ 0 on this rank): normalizes with the mean and biased variance over every
  /// rank's rows and updates the running statistics (unbiased variance, as PyTorch). Collective over `comm`: one
  /// all-reduce. Keeps what backward() needs.
  template <class Comm>
  std::vector<T> forward(Comm& comm, std::span<const T> x) {
    const std::size_t c = channels(), n = rows(x, "forward");
    std::vector<double> sums(1 + 2 * c, 0.0);  // [count, Σx, Σx²]
    sums[0] = static_cast<double>(n);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        const double v = x[i * c + j];
        sums[1 + j] += v;
        sums[1 + c + j] += v * v;
      }
    comm.all_reduce(std::span<double>(sums), reduce_op::sum).wait();
    const double total = sums[0];
    if (total < 2)
      throw config_error("sync_batch_norm: " + std::to_string(static_cast<std::size_t>(total)) + " row(s) over all "
                         "ranks; batch statistics need at least 2 (as torch.nn.BatchNorm1d in training mode)",
                         comm.rank());
    mean_.assign(c, 0.0);
    invstd_.assign(c, 0.0);
    for (std::size_t j = 0; j < c; ++j) {
      mean_[j] = sums[1 + j] / total;
      const double var = std::max(sums[1 + c + j] / total - mean_[j] * mean_[j], 0.0);
      invstd_[j] = 1.0 / std::sqrt(var + eps_);
      const double unbiased = var * total / (total - 1);
      running_mean_.values()[j] = static_cast<T>((1 - momentum_) * running_mean_.values()[j] + momentum_ * mean_[j]);
      running_var_.values()[j] = static_cast<T>((1 - momentum_) * running_var_.values()[j] + momentum_ * unbiased);
    }
    ++num_batches_tracked_.values()[0];
    total_ = total;
    xhat_.assign(n * c, 0.0);
    std::vector<T> y(n * c);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        xhat_[i * c + j] = (x[i * c + j] - mean_[j]) * invstd_[j];
        y[i * c + j] = static_cast<T>(xhat_[i * c + j] * weight_.value()[j] + bias_.value()[j]);
      }
    return y;
  }

  /// Evaluation forward: normalizes with the running statistics. Local.
  [[nodiscard]] std::vector<T> forward_eval(std::span<const T> x) const {
    const std::size_t c = channels(), n = rows(x, "forward_eval");
    std::vector<T> y(n * c);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < c; ++j)
        y[i * c + j] = static_cast<T>((x[i * c + j] - running_mean_.values()[j]) /
                                          std::sqrt(static_cast<double>(running_var_.values()[j]) + eps_) *
                                          weight_.value()[j] + bias_.value()[j]);
    return y;
  }

  /// Backward of the last training forward for `dy` ([n, C]): adds this rank's Σdy·x̂ and Σdy into the weight's and
  /// bias's gradients and returns dx, whose global terms come from one all-reduce of [Σdy, Σdy·x̂]. Collective.
  template <class Comm>
  std::vector<T> backward(Comm& comm, std::span<const T> dy) {
    const std::size_t c = channels(), n = rows(dy, "backward");
    if (n * c != xhat_.size())
      throw config_error("sync_batch_norm: backward of " + std::to_string(n) + " row(s) after a forward of " +
                         std::to_string(xhat_.size() / (c ? c : 1)) + "; call backward once after each training "
                         "forward, with its output's shape", comm.rank());
    std::vector<double> sums(2 * c, 0.0);  // [Σdy, Σdy·x̂]
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        sums[j] += dy[i * c + j];
        sums[c + j] += dy[i * c + j] * xhat_[i * c + j];
      }
    for (std::size_t j = 0; j < c; ++j) {  // this rank's part; data_parallel averages it over the ranks
      bias_.grad()[j] = static_cast<T>(bias_.grad()[j] + sums[j]);
      weight_.grad()[j] = static_cast<T>(weight_.grad()[j] + sums[c + j]);
    }
    comm.all_reduce(std::span<double>(sums), reduce_op::sum).wait();
    std::vector<T> dx(n * c);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < c; ++j)
        dx[i * c + j] = static_cast<T>(weight_.value()[j] * invstd_[j] / total_ *
                                       (total_ * dy[i * c + j] - sums[j] - xhat_[i * c + j] * sums[c + j]));
    return dx;
  }

  /// Visits weight and bias as parameters and the running statistics as buffers, under PyTorch's names.
  template <class F>
  void visit_parameters(F&& f) {
    f("weight", weight_);
    f("bias", bias_);
    f("running_mean", running_mean_);
    f("running_var", running_var_);
    f("num_batches_tracked", num_batches_tracked_);
  }

  /// The scale γ.
  [[nodiscard]] parameter<T>& weight() noexcept { return weight_; }
  /// The shift β.
  [[nodiscard]] parameter<T>& bias() noexcept { return bias_; }
  /// The running mean (a buffer).
  [[nodiscard]] buffer<T>& running_mean() noexcept { return running_mean_; }
  /// The running (unbiased) variance (a buffer).
  [[nodiscard]] buffer<T>& running_var() noexcept { return running_var_; }
  /// Training forwards taken (a buffer).
  [[nodiscard]] buffer<std::int64_t>& num_batches_tracked() noexcept { return num_batches_tracked_; }
  /// C.
  [[nodiscard]] std::size_t channels() const noexcept { return bias_.value().size(); }

 private:
  /// Rows of a [n, C] tensor; a size that is not a multiple of C is a config_error.
  std::size_t rows(std::span<const T> t, const char* where) const {
    if (channels() == 0 || t.size() % channels() != 0)
      throw config_error(std::string("sync_batch_norm::") + where + ": " + std::to_string(t.size()) + " elements are "
                         "not rows of " + std::to_string(channels()) + " channels; pass a row-major [n, C] tensor");
    return t.size() / channels();
  }

  parameter<T> weight_, bias_;
  buffer<T> running_mean_, running_var_;
  buffer<std::int64_t> num_batches_tracked_;
  double eps_, momentum_;
  double total_ = 0;              // rows over every rank in the last training forward
  std::vector<double> mean_, invstd_, xhat_;  // the last training forward's statistics and normalized input
};

}  // namespace ddp::nn

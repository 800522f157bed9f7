#pragma once
/// \file Metric sums (loss, correct predictions, samples) reduced across ranks in one all_reduce.

#include <array>
#include <span>

#include <ddp/comm/reduce_op.hpp>

namespace ddp {

/// Sums a rank accumulates over its batches; reduced() adds them over all ranks.
struct metric_sums {
  double loss_sum = 0;  ///< sum of per-sample losses
  double correct = 0;   ///< number of correct predictions
  double samples = 0;   ///< number of samples seen

  /// Adds one batch: `batch_loss_sum` summed over its `batch_samples` samples, `batch_correct` right.
  void add(double batch_loss_sum, double batch_correct, double batch_samples) noexcept {
    loss_sum += batch_loss_sum;
    correct += batch_correct;
    samples += batch_samples;
  }
  /// Mean loss per sample (0 when no sample was seen).
  [[nodiscard]] double mean_loss() const noexcept { return samples > 0 ? loss_sum / samples : 0.0; }
  /// Fraction of correct predictions (0 when no sample was seen).
  [[nodiscard]] double accuracy() const noexcept { return samples > 0 ? correct / samples : 0.0; }

  /// The sums over every rank of `comm` (one all_reduce of three f64). Collective; throws what the backend
  /// throws, such as ddp::timeout_error when a rank does not join.
  template <class Comm>
  [[nodiscard]] metric_sums reduced(Comm& comm) const {
    std::array<double, 3> v{loss_sum, correct, samples};
    comm.all_reduce(std::span<double>(v), reduce_op::sum).wait();
    return {v[0], v[1], v[2]};
  }
};

}  // namespace ddp

#pragma once
// ddp::nn::sync_batch_norm at N ranks against plain batch normalization of the union batch in one process, written
// here on its own in double (the textbook formulas). REQUIRE only: under run_ranks a rank fails by throwing.
//
// The union batch has 10 rows of 6 channels, split unevenly over the ranks (3/3/4 at N = 3); each rank gives the
// layer its rows and the gradient of the union loss at its rows. Outputs and input gradients of each rank's rows,
// the running statistics on every rank, and the weight's and bias's gradients summed over the ranks equal the
// one-process values within 1e-5 (relative, floored at 1e-3), over three steps (the running statistics compound).

#include <cmath>
#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/core/error.hpp>
#include <ddp/nn/sync_batch_norm.hpp>

#include "mlp.hpp"
#include "scenarios.hpp"

namespace ddp_test {

inline constexpr std::size_t bn_rows = 10, bn_channels = 6;

/// One process, plain batch norm of the union batch: y, dx, dweight, dbias, and the running statistics after.
struct bn_truth {
  std::vector<double> y, dx, dweight, dbias, running_mean, running_var;
};

inline bn_truth plain_batch_norm(const std::vector<float>& x, const std::vector<float>& dy, const std::vector<float>& w,
                                 const std::vector<float>& b, std::vector<double> running_mean,
                                 std::vector<double> running_var) {
  const std::size_t n = bn_rows, c = bn_channels;
  bn_truth t{std::vector<double>(n * c), std::vector<double>(n * c), std::vector<double>(c), std::vector<double>(c), {}, {}};
  for (std::size_t j = 0; j < c; ++j) {
    double mean = 0, var = 0;
    for (std::size_t i = 0; i < n; ++i) mean += x[i * c + j];
    mean /= n;
    for (std::size_t i = 0; i < n; ++i) var += (x[i * c + j] - mean) * (x[i * c + j] - mean);
    var /= n;
    const double invstd = 1 / std::sqrt(var + 1e-5);
    double sum_dy = 0, sum_dy_xhat = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double xhat = (x[i * c + j] - mean) * invstd;
      t.y[i * c + j] = xhat * w[j] + b[j];
      sum_dy += dy[i * c + j];
      sum_dy_xhat += dy[i * c + j] * xhat;
    }
    t.dbias[j] = sum_dy;
    t.dweight[j] = sum_dy_xhat;
    for (std::size_t i = 0; i < n; ++i) {
      const double xhat = (x[i * c + j] - mean) * invstd;
      t.dx[i * c + j] = w[j] * invstd / n * (n * dy[i * c + j] - sum_dy - xhat * sum_dy_xhat);
    }
    running_mean[j] = 0.9 * running_mean[j] + 0.1 * mean;
    running_var[j] = 0.9 * running_var[j] + 0.1 * var * n / (n - 1);
  }
  t.running_mean = std::move(running_mean);
  t.running_var = std::move(running_var);
  return t;
}

inline void require_near(double got, double want, const char* what) {
  INFO(what << ": got " << got << ", want " << want);
  REQUIRE(std::abs(got - want) <= 1e-5 * std::max(std::abs(want), 1e-3));
}

/// N ranks of sync_batch_norm on their rows of the union batch equal plain_batch_norm of the union, three steps.
template <class Comm>
void check_sync_batch_norm(Comm comm) {
  const std::size_t me = static_cast<std::size_t>(comm.rank()), n = static_cast<std::size_t>(comm.size());
  const std::size_t begin = me * bn_rows / n, end = (me + 1) * bn_rows / n, c = bn_channels;
  ddp::nn::sync_batch_norm<float> bn(c);
  lcg g(7);
  std::vector<float> w(c), b(c);
  for (std::size_t j = 0; j < c; ++j) {
    w[j] = 1 + 0.5F * g.next();
    b[j] = 0.5F * g.next();
    bn.weight().value()[j] = w[j];
    bn.bias().value()[j] = b[j];
  }
  std::vector<double> running_mean(c, 0.0), running_var(c, 1.0);
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    std::vector<float> x(bn_rows * c), dy(bn_rows * c);
    for (auto& v : x) v = 2 * g.next() + static_cast<float>(step);
    for (auto& v : dy) v = g.next();
    const auto want = plain_batch_norm(x, dy, w, b, running_mean, running_var);
    running_mean = want.running_mean;
    running_var = want.running_var;
    bn.weight().zero_grad();
    bn.bias().zero_grad();
    const auto mine = [&](const std::vector<float>& t) {
      return std::vector<float>(t.begin() + long(begin * c), t.begin() + long(end * c));
    };
    const auto y = bn.forward(comm, std::span<const float>(mine(x)));
    const auto dx = bn.backward(comm, std::span<const float>(mine(dy)));
    for (std::size_t i = 0; i < y.size(); ++i) {
      require_near(y[i], want.y[begin * c + i], "output");
      require_near(dx[i], want.dx[begin * c + i], "input gradient");
    }
    std::vector<float> grads(2 * c);  // Σ over the ranks of their parts, as data_parallel's sum before averaging
    for (std::size_t j = 0; j < c; ++j) {
      grads[j] = bn.weight().grad()[j];
      grads[c + j] = bn.bias().grad()[j];
    }
    comm.all_reduce(std::span<float>(grads), ddp::reduce_op::sum).wait();
    for (std::size_t j = 0; j < c; ++j) {
      require_near(grads[j], want.dweight[j], "weight gradient");
      require_near(grads[c + j], want.dbias[j], "bias gradient");
      require_near(bn.running_mean().values()[j], want.running_mean[j], "running mean");
      require_near(bn.running_var().values()[j], want.running_var[j], "running variance");
    }
    REQUIRE(bn.num_batches_tracked().values()[0] == step + 1);
  }
  const std::vector<float> probe(2 * c, 0.5F);  // evaluation uses the running statistics
  const auto eval = bn.forward_eval(probe);
  for (std::size_t j = 0; j < c; ++j)
    require_near(eval[j], (0.5 - running_mean[j]) / std::sqrt(running_var[j] + 1e-5) * w[j] + b[j], "evaluation");
  REQUIRE_THROWS_AS(bn.forward(comm, std::span<const float>(probe.data(), 5)), ddp::config_error);
}

}  // namespace ddp_test

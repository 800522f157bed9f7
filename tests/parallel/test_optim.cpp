// The optimizers against torch.optim (python3-torch): same initial values, same gradients, 5 steps;
// values and every state array must agree to |a − b| ≤ 1e-6·max(|b|, 1): the inputs are of order 1 and
// torch's vectorized kernels round differently (FMA), a few ulps of order-1 terms per step.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/optim/adamw.hpp>
#include <ddp/optim/sgd.hpp>

#include "mlp.hpp"

namespace {

constexpr std::size_t count = 37;
constexpr int steps = 5;

std::vector<std::vector<float>> read_rows(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<float>> rows;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    auto& row = rows.emplace_back();
    for (double v = 0; fields >> v;) row.push_back(static_cast<float>(v));
  }
  return rows;
}

/// Steps `opt` over one parameter and compares values and state arrays with torch.optim's `kind` and `args`.
template <class Opt>
void compare_with_torch(Opt opt, const std::string& kind, const std::string& args) {
  ddp_test::lcg g(7);
  ddp::parameter<float> p({count});
  for (auto& v : p.value()) v = g.next();
  char dir_template[] = "/tmp/ddp_optim_XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template, in = dir + "/in.txt", out = dir + "/out.txt";
  std::ofstream file(in);
  file.precision(9);
  for (const float v : p.value()) file << v << ' ';
  file << '\n';
  const std::vector<ddp::optim::flat_buffer> buffers{
      {ddp::raw_tensor::of(p.value()), ddp::raw_tensor::of(p.grad()), {{"w", 0, count, 0}}}};
  for (int s = 0; s < steps; ++s) {
    for (auto& v : p.grad()) v = g.next();
    for (const float v : p.grad()) file << v << ' ';
    file << '\n';
    opt.step(buffers);
  }
  file.close();
  const std::string command = "/usr/bin/python3 " DDP_TORCH_OPTIM_SCRIPT " " + in + " " + out + " " + kind + " " + args;
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
  const auto rows = read_rows(out);
  std::vector<std::vector<float>> mine{std::vector<float>(p.value().begin(), p.value().end())};
  opt.for_each_state([&](const std::string& name, ddp::raw_tensor view) {
    INFO(name);
    const float* data = static_cast<const float*>(view.data);
    mine.emplace_back(data, data + view.size);
  });
  REQUIRE(rows.size() == mine.size());
  for (std::size_t r = 0; r < rows.size(); ++r) {
    REQUIRE(rows[r].size() == count);
    for (std::size_t i = 0; i < count; ++i) {
      INFO("row " << r << " element " << i << ": ddp " << mine[r][i] << ", torch " << rows[r][i]);
      REQUIRE(std::abs(mine[r][i] - rows[r][i]) <= 1e-6 * std::max(std::abs(rows[r][i]), 1.0F));
    }
  }
  REQUIRE(opt.step_count() == steps);
  std::remove(in.c_str());
  std::remove(out.c_str());
  ::rmdir(dir.c_str());
}

}  // namespace

TEST_CASE("sgd matches torch.optim.SGD (momentum + dampening, nesterov, weight decay, plain)", "[optim]") {
  compare_with_torch(ddp::optim::sgd({.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01}), "sgd",
                     "lr=0.1 momentum=0.9 dampening=0.1 nesterov=0 weight_decay=0.01");
  compare_with_torch(ddp::optim::sgd({.lr = 0.05, .momentum = 0.8, .nesterov = true, .weight_decay = 0.01}), "sgd",
                     "lr=0.05 momentum=0.8 dampening=0 nesterov=1 weight_decay=0.01");
  compare_with_torch(ddp::optim::sgd({.lr = 0.1}), "sgd", "lr=0.1 momentum=0 dampening=0 nesterov=0 weight_decay=0");
}

TEST_CASE("adamw matches torch.optim.AdamW (values, exp_avg, exp_avg_sq)", "[optim]") {
  compare_with_torch(ddp::optim::adamw({.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.05}),
                     "adamw", "lr=0.01 beta1=0.9 beta2=0.999 eps=1e-8 weight_decay=0.05");
  compare_with_torch(ddp::optim::adamw({.lr = 0.003, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0}),
                     "adamw", "lr=0.003 beta1=0.8 beta2=0.99 eps=1e-6 weight_decay=0");
}

TEST_CASE("optimizer state is named per parameter and state array and checks its layout", "[optim]") {
  ddp::parameter<float> a({3}), b({2, 2});
  const std::vector<ddp::optim::flat_buffer> buffers{
      {ddp::raw_tensor::of(a.value()), ddp::raw_tensor::of(a.grad()), {{"a", 0, 3, 0}}},
      {ddp::raw_tensor::of(b.value()), ddp::raw_tensor::of(b.grad()), {{"b", 0, 4, 0}}}};
  ddp::optim::adamw opt({});
  opt.attach(buffers);
  std::vector<std::string> names;
  opt.for_each_state([&](const std::string& name, ddp::raw_tensor view) {
    names.push_back(name + ":" + std::to_string(view.size));
  });
  REQUIRE(names == std::vector<std::string>{"a.exp_avg:3", "a.exp_avg_sq:3", "b.exp_avg:4", "b.exp_avg_sq:4"});
  REQUIRE_THROWS_AS(opt.step(std::span(buffers).first(1)), ddp::config_error);
  REQUIRE_THROWS_AS(ddp::optim::sgd({.lr = 0.1, .nesterov = true}), ddp::config_error);
}

// The optimizers against torch.optim (python3-torch): same initial values, same gradients, 5 steps;
// values and every state array must agree to |a − b| ≤ 1e-6·max(|b|, 1): the inputs are of order 1 and
// torch's vectorized kernels round differently (FMA), a few ulps of order-1 terms per step.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/optim/schedule.hpp>
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

TEST_CASE("grouped adamw with a warmup + cosine schedule matches torch.optim.AdamW with the same param_groups (f64)",
          "[optim][groups]") {
  // Four parameters in one f64 flat buffer: the groups step runs of it (no_decay: both biases, fc2: fc2.weight at
  // half the lr with beta1 0.8, fc1.weight the defaults), the 6 steps of the schedule.
  const std::vector<std::pair<std::string, std::size_t>> params{{"fc1.weight", 12}, {"fc1.bias", 5}, {"fc2.weight", 9},
                                                                {"fc2.bias", 3}};
  constexpr int grouped_steps = 6;
  std::size_t total = 0;
  std::vector<ddp::optim::flat_segment> segments;
  for (const auto& [name, n] : params) {
    segments.push_back({name, total, n, 0});
    total += n;
  }
  std::vector<double> values(total), grads(total);
  ddp_test::lcg g(11);
  for (auto& v : values) v = g.next();
  char dir_template[] = "/tmp/ddp_groups_XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template, in = dir + "/in.txt", out = dir + "/out.txt";
  std::ofstream file(in);
  file.precision(17);
  const auto write_rows = [&](const std::vector<double>& v) {
    for (const auto& s : segments) {
      for (std::size_t i = 0; i < s.numel; ++i) file << v[s.offset + i] << ' ';
      file << '\n';
    }
  };
  write_rows(values);
  ddp::optim::adamw opt({.lr = 0.01, .weight_decay = 0.05,
                         .groups = {{.name = "no_decay", .match = {"*.bias"}, .weight_decay = 0},
                                    {.name = "fc2", .match = {"fc2.w*"}, .lr_scale = 0.5, .beta1 = 0.8}},
                         .lr_schedule = ddp::optim::schedules::warmup_cosine{.warmup = 2, .steps = 6, .start_factor = 0.1}});
  const std::vector<ddp::optim::flat_buffer> buffers{
      {ddp::raw_tensor::of(std::span(values)), ddp::raw_tensor::of(std::span(grads)), segments}};
  for (int s = 0; s < grouped_steps; ++s) {
    for (auto& v : grads) v = g.next();
    write_rows(grads);
    opt.step(buffers);
  }
  file.close();
  const std::string command = "/usr/bin/python3 -W ignore " DDP_TORCH_GROUPS_SCRIPT " " + in + " " + out;
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
  std::ifstream result(out);
  std::map<std::string, std::vector<double>> state;
  opt.for_each_state([&](const std::string& name, ddp::raw_tensor view) {
    const double* data = static_cast<const double*>(view.data);
    state[name].assign(data, data + view.size);
  });
  double worst = 0;
  for (const auto& s : segments)
    for (const std::string row : {"", ".exp_avg", ".exp_avg_sq"}) {
      std::string line;
      REQUIRE(std::getline(result, line));
      std::istringstream fields(line);
      const std::vector<double> mine = row.empty() ? std::vector<double>(values.begin() + long(s.offset),
                                                                         values.begin() + long(s.offset + s.numel))
                                                   : state.at(s.name + row);
      std::size_t i = 0;
      for (double want = 0; fields >> want; ++i) {
        INFO(s.name << row << " element " << i << ": ddp " << mine[i] << ", torch " << want);
        const double rel = std::abs(mine[i] - want) / std::max(std::abs(want), 1e-300);
        REQUIRE((mine[i] == want || rel <= 1e-12));
        worst = std::max(worst, mine[i] == want ? 0.0 : rel);
      }
      REQUIRE(i == s.numel);
    }
  WARN("largest relative difference from torch.optim.AdamW: " << worst);
  std::remove(in.c_str());
  std::remove(out.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("parameter groups: a pattern matching nothing or a parameter in two groups is a config_error naming it, "
          "the model's names decide, not the pieces a shard holds", "[optim][groups]") {
  std::vector<float> v(8), gr(8);
  // A shard holding pieces of fc1.weight and fc1.bias only, of a model that also has fc2.weight.
  ddp::optim::flat_buffer shard{ddp::raw_tensor::of(std::span(v)), ddp::raw_tensor::of(std::span(gr)),
                                {{"fc1.weight", 0, 5, 7}, {"fc1.bias", 5, 3, 0}}};
  shard.parameters = std::make_shared<const std::vector<std::string>>(
      std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight"});
  const std::vector<ddp::optim::flat_buffer> buffers{shard};
  const auto message = [&](ddp::optim::adamw::options o) -> std::string {
    ddp::optim::adamw opt(std::move(o));
    try {
      opt.step(buffers);
    } catch (const ddp::config_error& e) {
      return e.what();
    }
    return "";
  };
  REQUIRE(message({.groups = {{.name = "fc2", .match = {"fc2.*"}, .lr_scale = 0.1}}}).empty());  // not here, in the model
  REQUIRE_THAT(message({.groups = {{.name = "norms", .match = {"*norm*"}, .weight_decay = 0}}}),
               Catch::Contains("group 1 ('norms')") && Catch::Contains("*norm*") && Catch::Contains("matches no parameter"));
  REQUIRE_THAT(message({.groups = {{.name = "no_decay", .match = {"*.bias"}, .weight_decay = 0},
                                   {.name = "fc1", .match = {"fc1.*"}, .lr_scale = 2}}}),
               Catch::Contains("'fc1.bias'") && Catch::Contains("('no_decay')") && Catch::Contains("('fc1')"));
  REQUIRE_THAT(message({.groups = {{.name = "x"}}}), Catch::Contains("no patterns"));
  REQUIRE_THROWS_AS(ddp::optim::adamw({.groups = {{.match = {"*"}, .beta1 = 1.0}}}), ddp::config_error);
  REQUIRE_THROWS_AS(ddp::optim::sgd({.lr = 0.1, .momentum = 0.9, .nesterov = true,
                                     .groups = {{.match = {"*.bias"}, .momentum = 0}}}),
                    ddp::config_error);
  REQUIRE(ddp::optim::glob_match("*.bias", "fc1.bias"));
  REQUIRE(ddp::optim::glob_match("fc?.w*", "fc2.weight"));
  REQUIRE_FALSE(ddp::optim::glob_match("*.bias", "fc1.bias_scale"));
  REQUIRE(ddp::optim::glob_match("*norm*", "layers.3.norm1.weight"));
}

TEST_CASE("the optimizer's lr follows its schedule by step count, a restored count continues the curve, and past its "
          "end it warns once", "[optim][schedule]") {
  // Plain SGD with gradient 1: each step moves the value by exactly −lr, so the values show the lr of every step.
  const ddp::optim::schedule cosine = ddp::optim::schedules::cosine{.steps = 4, .eta_min = 0.01};
  std::vector<double> v{0.0}, gr{1.0};
  const std::vector<ddp::optim::flat_buffer> buffers{
      {ddp::raw_tensor::of(std::span(v)), ddp::raw_tensor::of(std::span(gr)), {{"w", 0, 1, 0}}}};
  ddp::optim::sgd opt({.lr = 0.5, .lr_schedule = cosine});
  std::ostringstream captured;
  auto* const old = std::clog.rdbuf(captured.rdbuf());
  double expected = 0;
  for (std::uint64_t t = 0; t < 7; ++t) {
    if (t == 3) {  // a resumed run: a new optimizer whose step count a checkpoint restored
      opt = ddp::optim::sgd({.lr = 0.5, .lr_schedule = cosine});
      opt.set_step_count(3);
    }
    opt.step(buffers);
    expected -= cosine.lr(0.5, t);
    REQUIRE(v[0] == expected);
  }
  std::clog.rdbuf(old);
  REQUIRE(cosine.lr(0.5, 6) == 0.01);
  const std::string warned = captured.str();
  INFO(warned);
  REQUIRE(warned.find("past the lr schedule cosine(steps=4") != std::string::npos);
  REQUIRE(warned.find("step 6 is past") != std::string::npos);
  REQUIRE(warned.find('\n') == warned.size() - 1);  // once
}

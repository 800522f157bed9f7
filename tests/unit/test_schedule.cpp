// The learning-rate schedules against torch.optim.lr_scheduler (torch_schedule.py, run through /usr/bin/python3):
// 300 steps of two groups (base lr 0.1 and 0.02), |ddp − torch| ≤ 1e-12 · base lr at every step. PyTorch steps
// most schedulers recursively (each lr from the previous one), ddp in closed form: they differ by rounding only.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/optim/schedule.hpp>

namespace {

namespace S = ddp::optim::schedules;
using ddp::optim::schedule;

/// The cases of torch_schedule.py, spelled with ddp's schedules.
std::map<std::string, schedule> cases() {
  return {
      {"constant", S::constant{}},
      {"linear", S::linear{.steps = 37, .start_factor = 0.25, .end_factor = 1.0}},
      {"cosine", S::cosine{.steps = 300, .eta_min = 0.001}},
      {"warmup_cosine", S::warmup_cosine{.warmup = 20, .steps = 300, .start_factor = 0.01, .eta_min = 0.001}},
      {"step_decay", S::step_decay{.step_size = 30, .gamma = 0.5}},
      {"one_cycle", S::one_cycle{.steps = 300}},
      {"one_cycle_three_linear", S::one_cycle{.steps = 300, .pct_start = 0.25, .div_factor = 10, .final_div_factor = 100,
                                              .three_phase = true, .linear_anneal = true}},
      {"sequence", S::sequence{{S::step_decay{.step_size = 10, .gamma = 0.7},
                                S::linear{.steps = 40, .start_factor = 0.5, .end_factor = 0.9},
                                S::cosine{.steps = 180, .eta_min = 0.0005}},
                               {50, 120}}},
      {"lambda", S::lambda{.factor = [](std::uint64_t t) { return std::pow(0.95, double(t)) * double(1 + t % 7); },
                           .name = "decay_sawtooth"}},
  };
}

}  // namespace

TEST_CASE("schedules equal torch.optim.lr_scheduler over 300 steps (1e-12 of the base lr)", "[optim][schedule]") {
  char dir_template[] = "/tmp/ddp_schedule_XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template, out = dir + "/lr.txt";
  const std::string command = "/usr/bin/python3 -W ignore " DDP_TORCH_SCHEDULE_SCRIPT " " + out;
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
  const auto all = cases();
  std::map<std::string, int> seen;
  std::ifstream in(out);
  double worst = 0;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string name;
    int group = 0;
    fields >> name >> group;
    INFO("case " << name << ", group " << group);
    REQUIRE(all.contains(name));
    ++seen[name];
    const double base = group == 0 ? 0.1 : 0.02;
    std::uint64_t t = 0;
    for (double want = 0; fields >> want; ++t) {
      const double got = all.at(name).lr(base, t);
      INFO("step " << t << ": ddp " << got << ", torch " << want);
      REQUIRE(std::abs(got - want) <= 1e-12 * base);
      worst = std::max(worst, std::abs(got - want) / base);
    }
    REQUIRE(t == 300);
  }
  REQUIRE(seen.size() == all.size());
  for (const auto& [name, groups] : seen) REQUIRE(groups == 2);
  WARN("largest difference from torch: " << worst << " of the base lr");
  std::remove(out.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("a schedule past its last step holds its last value, bad settings are config_errors", "[optim][schedule]") {
  const schedule cosine = S::cosine{.steps = 10, .eta_min = 0.01};
  REQUIRE(cosine.last_step() == 10U);
  REQUIRE(cosine.lr(1.0, 10) == 0.01);
  REQUIRE(cosine.lr(1.0, 11) == 0.01);
  REQUIRE(cosine.lr(1.0, 1000) == 0.01);
  const schedule cycle = S::one_cycle{.steps = 50};
  REQUIRE(cycle.lr(0.5, 80) == cycle.lr(0.5, 50));
  const schedule warm = S::warmup_cosine{.warmup = 5, .steps = 20};
  REQUIRE(warm.last_step() == 20U);
  REQUIRE(schedule(S::sequence{{S::linear{}, S::cosine{.steps = 7}}, {4}}).last_step() == 11U);
  REQUIRE_FALSE(schedule(S::linear{}).last_step());
  REQUIRE(schedule(S::linear{}).lr(1.0, 1000) == 1.0);  // LinearLR stays at end_factor
  REQUIRE(warm.describe() == "warmup_cosine(warmup=5, steps=20, start_factor=0.001, eta_min=0)");
  REQUIRE(schedule().describe() == "constant");
  REQUIRE_THROWS_AS(schedule(S::cosine{.steps = 0}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::warmup_cosine{.warmup = 10, .steps = 10}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::linear{.start_factor = 0}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::sequence{{S::constant{}}, {3}}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::sequence{{S::constant{}, S::constant{}, S::constant{}}, {5, 5}}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::lambda{}), ddp::config_error);
  REQUIRE_THROWS_AS(schedule(S::step_decay{.step_size = 0}), ddp::config_error);
}

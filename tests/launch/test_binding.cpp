// Rank binding: the plan on synthetic machines, and ddp-launch binding real ranks on this one.

#include <catch2/catch.hpp>

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/launch/binding.hpp>
#include <ddp/launch/spawn.hpp>

namespace dl = ddp::launch;

namespace {

/// 2 NUMA nodes × 4 cores × 2 hardware threads, numbered as Linux does: CPU c and c + 8 share core c.
dl::topology two_nodes() {
  dl::topology t;
  for (int cpu = 0; cpu < 16; ++cpu) t.push_back({cpu, cpu % 8, (cpu % 8) / 4});
  return t;
}

std::vector<int> list(const char* text) { return dl::detail::parse_cpu_list(text); }

/// The "Cpus_allowed_list:" of each "[rank R] " line ddp-launch's ranks printed, by rank.
std::vector<std::vector<int>> allowed_per_rank(const std::string& output, int n) {
  std::vector<std::vector<int>> out(static_cast<std::size_t>(n));
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    for (int r = 0; r < n; ++r) {
      const std::string prefix = "[rank " + std::to_string(r) + "] Cpus_allowed_list:";
      if (line.rfind(prefix, 0) == 0) out[static_cast<std::size_t>(r)] = dl::detail::parse_cpu_list(line.substr(prefix.size()));
    }
  return out;
}

dl::rank_status launch_and_show_affinity(int n, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{DDP_LAUNCH_EXE, "-n", std::to_string(n)};
  args.insert(args.end(), extra.begin(), extra.end());
  for (const char* a : {"--", "/bin/sh", "-c", "grep Cpus_allowed_list /proc/self/status"}) args.emplace_back(a);
  dl::spawn_options o;
  o.output = dl::output_mode::capture;
  o.timeout = std::chrono::seconds(20);
  return dl::spawn_program(1, args, o).ranks[0];
}

}  // namespace

TEST_CASE("binding plan: whole cores in blocks, NUMA nodes, oversubscription, none", "[launch][bind]") {
  const auto machine = two_nodes();
  auto two = dl::plan_binding(dl::bind_mode::core, 2, machine);
  CHECK(two.cpus == std::vector<std::vector<int>>{list("0-3,8-11"), list("4-7,12-15")});
  CHECK(two.summary == "bound to cores: rank 0 on CPUs 0-3,8-11, rank 1 on CPUs 4-7,12-15");
  auto three = dl::plan_binding(dl::bind_mode::core, 3, machine);  // 8 cores: blocks of 2, 3 and 3
  CHECK(three.cpus == std::vector<std::vector<int>>{list("0-1,8-9"), list("2-4,10-12"), list("5-7,13-15")});
  auto eight = dl::plan_binding(dl::bind_mode::core, 8, machine);  // one core (two hardware threads) each
  CHECK(eight.cpus[5] == list("5,13"));
  auto nine = dl::plan_binding(dl::bind_mode::core, 9, machine);
  CHECK(nine.cpus == std::vector<std::vector<int>>(9));
  CHECK_THAT(nine.summary, Catch::Contains("not binding ranks: 9 ranks on 8 cores") && Catch::Contains("oversubscribed"));
  auto numa = dl::plan_binding(dl::bind_mode::numa, 4, machine);
  CHECK(numa.cpus == std::vector<std::vector<int>>{list("0-3,8-11"), list("0-3,8-11"), list("4-7,12-15"),
                                                   list("4-7,12-15")});
  CHECK(dl::plan_binding(dl::bind_mode::none, 2, machine).cpus == std::vector<std::vector<int>>(2));
  CHECK(dl::detail::format_cpu_list(list("0-3,5,7-8")) == "0-3,5,7-8");
  CHECK_THROWS_AS(dl::plan_binding(dl::bind_mode::core, 0, machine), ddp::config_error);
}

TEST_CASE("ddp-launch binds each rank to its own cores by default, and not when oversubscribed or asked not to",
          "[launch][ddp-launch][bind]") {
  const auto machine = dl::read_topology();
  std::set<int> cores, all;
  for (const auto& p : machine) {
    cores.insert(p.core);
    all.insert(p.cpu);
  }
  REQUIRE(!machine.empty());
  const std::vector<int> everywhere(all.begin(), all.end());
  const int n = static_cast<int>(std::min<std::size_t>(cores.size(), 4));
  const auto bound = launch_and_show_affinity(n);
  INFO(bound.output);
  REQUIRE(bound.exit_code == 0);
  CHECK_THAT(bound.output, Catch::Contains("ddp-launch: bound to cores: rank 0 on CPUs "));
  const auto got = allowed_per_rank(bound.output, n);
  std::set<int> seen;
  for (const auto& cpus : got) {
    CHECK(!cpus.empty());
    for (const int c : cpus) CHECK(seen.insert(c).second);  // no CPU is shared by two ranks
  }
  if (n > 1) CHECK(got[0] != everywhere);

  const auto over = launch_and_show_affinity(static_cast<int>(cores.size()) + 1);
  INFO(over.output);
  CHECK_THAT(over.output, Catch::Contains("not binding ranks") && Catch::Contains("oversubscribed"));
  for (const auto& cpus : allowed_per_rank(over.output, static_cast<int>(cores.size()) + 1)) CHECK(cpus == everywhere);

  const auto none = launch_and_show_affinity(n, {"--bind", "none"});
  INFO(none.output);
  CHECK_THAT(none.output, Catch::Contains("not binding ranks (--bind none)"));
  for (const auto& cpus : allowed_per_rank(none.output, n)) CHECK(cpus == everywhere);

  const auto bad = launch_and_show_affinity(n, {"--bind", "socket"});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.output, Catch::Contains("--bind takes none, core or numa, got 'socket'"));
}

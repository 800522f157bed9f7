// The launcher: ddp::launch::spawn (environment, capture, prefixes, failure propagation, timeout,
// ports, tokens), the run_ranks test helper, and the ddp-launch program.

#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include <ddp/launch/spawn.hpp>

#include "kill_trial.hpp"
#include "support/run_ranks.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
namespace dl = ddp::launch;

using ddp::testing::contains;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "<unset>" : v;
}

dl::spawn_options captured(std::chrono::milliseconds timeout = 20s) {
  dl::spawn_options o;
  o.output = dl::output_mode::capture;
  o.timeout = timeout;
  return o;
}

/// Seconds since `t0`.
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("spawn gives every rank torchrun's environment, a free port and a shared random token", "[launch]") {
  const auto r = dl::spawn(
      3,
      [](int rank) {
        std::cout << "rank=" << rank << " RANK=" << env("RANK") << " WORLD_SIZE=" << env("WORLD_SIZE")
                  << " LOCAL_RANK=" << env("LOCAL_RANK") << " LOCAL_WORLD_SIZE=" << env("LOCAL_WORLD_SIZE")
                  << " MASTER_ADDR=" << env("MASTER_ADDR") << " MASTER_PORT=" << env("MASTER_PORT")
                  << " DDP_TOKEN=" << env("DDP_TOKEN") << '\n';
      },
      captured());
  INFO(ddp::testing::all_output(r));
  REQUIRE(r.ok());
  REQUIRE(r.exit_status() == 0);
  REQUIRE(r.token.size() == 32);
  REQUIRE(r.token.find_first_not_of("0123456789abcdef") == std::string::npos);
  REQUIRE(r.port != 0);
  // Outside the kernel's ephemeral range, where no other process's connection can take it before rank 0 binds it.
  const auto [lo, hi] = dl::detail::ephemeral_ports();
  CHECK(r.port >= 20000);
  CHECK((r.port < lo || r.port > hi));
  for (int k = 0; k < 3; ++k) {
    const auto s = std::to_string(k);
    CHECK(r.ranks[static_cast<std::size_t>(k)].output ==
          "rank=" + s + " RANK=" + s + " WORLD_SIZE=3 LOCAL_RANK=" + s + " LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1" +
              " MASTER_PORT=" + std::to_string(r.port) + " DDP_TOKEN=" + r.token + "\n");
  }
}

TEST_CASE("spawn honours the given port, token, address and per-rank extra variables", "[launch]") {
  auto o = captured();
  o.port = 12345;
  o.token = "job-token";
  o.master_addr = "localhost";
  o.extra_env = [](int rank) { return dl::env_list{{"EXTRA", "x" + std::to_string(rank)}, {"RANK", "overridden"}}; };
  const auto r = dl::spawn(
      2, [](int) { std::cout << env("MASTER_ADDR") << ' ' << env("MASTER_PORT") << ' ' << env("DDP_TOKEN") << ' '
                             << env("EXTRA") << ' ' << env("RANK") << '\n'; },
      o);
  INFO(ddp::testing::all_output(r));
  REQUIRE(r.ok());
  CHECK(r.ranks[0].output == "localhost 12345 job-token x0 overridden\n");
  CHECK(r.ranks[1].output == "localhost 12345 job-token x1 overridden\n");
}

TEST_CASE("two tokens and two concurrent jobs' ports differ", "[launch]") {
  // Job A's rank listens on its MASTER_PORT while it starts job B: B must get another port.
  const auto a = dl::spawn(
      1,
      [](int) {
        const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_ANY);
        addr.sin_port = htons(static_cast<std::uint16_t>(std::stoi(env("MASTER_PORT"))));
        if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 1) != 0)
          throw std::runtime_error("the launcher's port was not free");
        const auto b = dl::spawn(1, [](int) {}, captured());
        std::cout << env("MASTER_PORT") << ' ' << b.port << ' ' << env("DDP_TOKEN") << ' ' << b.token << '\n';
        ::close(fd);
      },
      captured());
  INFO(ddp::testing::all_output(a));
  REQUIRE(a.ok());
  std::string port_a, port_b, token_a, token_b;
  std::istringstream(a.ranks[0].output) >> port_a >> port_b >> token_a >> token_b;
  CHECK(port_a == std::to_string(a.port));
  CHECK(port_b != port_a);
  CHECK(token_a == a.token);
  CHECK(token_b == token_a);  // an inherited DDP_TOKEN is kept, as documented
  const auto fresh = dl::spawn(1, [](int) {}, captured());
  CHECK(fresh.token != a.token);
}

TEST_CASE("a throwing rank exits 1 with what() on its stderr", "[launch]") {
  auto o = captured();
  o.stop_on_failure = false;  // rank 0 runs to its end
  const auto r = dl::spawn(
      2,
      [](int rank) {
        if (rank == 1) throw ddp::config_error("bad thing", rank);
        std::cout << "fine\n";
      },
      o);
  INFO(ddp::testing::all_output(r));
  CHECK_FALSE(r.ok());
  CHECK(r.first_failed == 1);
  CHECK(r.ranks[1].exit_code == 1);
  CHECK(r.exit_status() == 1);
  CHECK(contains(r.ranks[1].output, "rank 1 failed with an exception: ddp [rank 1]: bad thing"));
  CHECK(r.ranks[0].output == "fine\n");
  CHECK(contains(r.describe(), "rank 1 failed first with exit code 1"));
  CHECK_THROWS_AS(r.throw_if_failed(), dl::job_failed);
}

TEST_CASE("one failing rank stops the others: SIGTERM, then SIGKILL after the grace period", "[launch]") {
  auto o = captured(30s);
  o.grace = 500ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = dl::spawn(
      4,
      [](int rank) {
        if (rank == 3) ::signal(SIGTERM, SIG_IGN);  // only SIGKILL will stop this one
        if (rank == 2) {
          std::this_thread::sleep_for(500ms);  // rank 3 ignores SIGTERM by then
          std::fflush(nullptr);
          ::_exit(7);
        }
        std::this_thread::sleep_for(30s);
      },
      o);
  const double took = since(t0);
  INFO(ddp::testing::all_output(r));
  CHECK(took < 5.0);
  CHECK(r.first_failed == 2);
  CHECK(r.exit_status() == 7);
  CHECK(r.ranks[2].exit_code == 7);
  CHECK_FALSE(r.ranks[2].stopped_by_launcher);
  for (int k : {0, 1}) {
    CHECK(r.ranks[static_cast<std::size_t>(k)].signal == SIGTERM);
    CHECK(r.ranks[static_cast<std::size_t>(k)].stopped_by_launcher);
  }
  CHECK(r.ranks[3].signal == SIGKILL);
  CHECK(contains(r.describe(), "rank 2 failed first with exit code 7"));
  CHECK(contains(r.describe(), "rank 3: signal 9"));
}

TEST_CASE("a rank killed by a signal is reported as 128 + signal", "[launch]") {
  const auto r = dl::spawn(2, [](int rank) { if (rank == 0) ::raise(SIGABRT); else std::this_thread::sleep_for(30s); },
                           captured());
  CHECK(r.first_failed == 0);
  CHECK(r.ranks[0].signal == SIGABRT);
  CHECK(r.exit_status() == 128 + SIGABRT);
}

TEST_CASE("without stop_on_failure the survivors run to the end", "[launch]") {
  auto o = captured();
  o.stop_on_failure = false;
  const auto r = dl::spawn(
      2,
      [](int rank) {
        if (rank == 0) ::raise(SIGKILL);
        std::this_thread::sleep_for(300ms);
        std::cout << "survived\n";
      },
      o);
  CHECK(r.first_failed == 0);
  CHECK(r.ranks[0].signal == SIGKILL);
  CHECK(r.ranks[1].ok());
  CHECK(r.ranks[1].output == "survived\n");
}

TEST_CASE("the whole-job timeout stops every rank and reports it", "[launch]") {
  auto o = captured(400ms);
  o.grace = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = dl::spawn(2, [](int) { std::this_thread::sleep_for(30s); }, o);
  CHECK(since(t0) < 3.0);
  CHECK(r.timed_out);
  CHECK(r.first_failed == -1);
  CHECK(r.exit_status() == 124);
  CHECK(r.ranks[0].signal == SIGTERM);
  CHECK(r.ranks[1].stopped_by_launcher);
  CHECK(contains(r.describe(), "did not finish within its timeout"));
}

TEST_CASE("forwarded output is prefixed line by line, a last partial line included", "[launch]") {
  // The inner job forwards to the outer rank's stdout/stderr, which the outer job captures.
  const auto outer = dl::spawn(
      1,
      [](int) {
        const auto inner = dl::spawn(2, [](int rank) {
          std::cout << "line one of " << rank << "\nline two" << std::flush;
          std::cerr << "to stderr\n";
        });
        std::fflush(nullptr);
        if (!inner.ok()) throw std::runtime_error(inner.describe());
      },
      captured());
  INFO(ddp::testing::all_output(outer));
  REQUIRE(outer.ok());
  const auto& out = outer.ranks[0].output;
  for (const char* line : {"[rank 0] line one of 0\n", "[rank 0] line two\n", "[rank 1] line one of 1\n",
                           "[rank 1] line two\n", "[rank 0] to stderr\n", "[rank 1] to stderr\n"})
    CHECK(contains(out, line));
  CHECK_FALSE(contains(out, "\nline"));
}

TEST_CASE("spawn_program runs a program per rank, and a missing one exits 127 with the reason", "[launch]") {
  auto o = captured();
  o.stop_on_failure = false;  // rank 0 runs to its end
  const auto r = dl::spawn_program(2, {"/bin/sh", "-c", "echo $RANK/$WORLD_SIZE; exit $RANK"}, o);
  CHECK(r.ranks[0].output == "0/2\n");
  CHECK(r.ranks[1].exit_code == 1);
  CHECK(r.first_failed == 1);
  const auto missing = dl::spawn_program(1, {"/nonexistent/program"}, captured());
  CHECK(missing.exit_status() == 127);
  CHECK(contains(missing.ranks[0].output, "cannot run '/nonexistent/program': No such file or directory"));
}

TEST_CASE("bad arguments raise config_error", "[launch]") {
  CHECK_THROWS_AS(dl::spawn(0, [](int) {}), ddp::config_error);
  CHECK_THROWS_AS(dl::spawn_program(1, {}), ddp::config_error);
}

TEST_CASE("run_ranks captures output and sets a collective timeout below the job's", "[launch]") {
  const auto r = ddp::testing::run_ranks(2, [](int rank) { std::cout << rank << ' ' << env("DDP_TIMEOUT_MS") << '\n'; },
                                         8s);
  ddp::testing::require_all_ok(r);
  CHECK(r.ranks[1].output == "1 " + std::to_string(6000 * ddp::testing::timeout_scale) + "\n");  // 3/4 of 8 s, scaled
}

TEST_CASE("a rank whose status the kernel discarded (SIGCHLD ignored) is reported, not waited for", "[launch]") {
  const auto outer = dl::spawn(
      1,
      [](int) {
        ::signal(SIGCHLD, SIG_IGN);
        const auto inner = dl::spawn(1, [](int) {}, captured(5s));
        std::cout << inner.timed_out << ' ' << inner.ranks[0].unknown_status << ' ' << inner.describe() << '\n';
      },
      captured());
  INFO(ddp::testing::all_output(outer));
  REQUIRE(outer.ok());
  CHECK(contains(outer.ranks[0].output, "0 1 rank 0 failed first with an unknown status (waitpid failed with ECHILD"));
}

TEST_CASE("a failed REQUIRE inside a rank fails that rank and its output shows the expression", "[launch]") {
  dl::spawn_options o;
  o.stop_on_failure = false;  // rank 0 runs to its end
  const auto r = ddp::testing::run_ranks(
      2,
      [](int rank) {
        const int answer = 40 + rank;
        REQUIRE(answer == 40);
      },
      o);
  INFO(ddp::testing::all_output(r));
  CHECK(r.first_failed == 1);
  CHECK(r.ranks[0].ok());
  CHECK(contains(r.ranks[1].output, "REQUIRE( answer == 40 )"));
  CHECK(contains(r.ranks[1].output, "41 == 40"));
}

TEST_CASE("when a pipe cannot be made, the ranks already started are killed and launch_error names errno", "[launch]") {
  const auto outer = dl::spawn(
      1,
      [](int) {
        const auto open_fds = std::distance(std::filesystem::directory_iterator("/proc/self/fd"), {});
        const rlimit few{static_cast<rlim_t>(open_fds + 6), static_cast<rlim_t>(open_fds + 6)};  // 3 pipes' worth
        ::setrlimit(RLIMIT_NOFILE, &few);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          dl::spawn(8, [](int) { std::this_thread::sleep_for(30s); }, captured());
        } catch (const dl::launch_error& e) {
          std::cout << (e.native_code() == EMFILE) << ' ' << (since(t0) < 5.0) << ' ' << e.what() << '\n';
          return;
        }
        throw std::runtime_error("spawn started 8 ranks with room for 3 pipes");
      },
      captured());
  INFO(ddp::testing::all_output(outer));
  REQUIRE(outer.ok());
  CHECK(contains(outer.ranks[0].output, "1 1 ddp: the launcher could not create a pipe for rank "));
  CHECK(contains(outer.ranks[0].output, "Too many open files; check the process and file-descriptor limits"));
}

TEST_CASE("the rank killed first is blamed, never a peer that failed because it died", "[launch][kill]") {
  constexpr int n = 4;
  const int trials = kill_trial::trials(40);
  int wrong = 0;
  double slowest = 0;
  std::string first_wrong;
  for (int t = 0; t < trials; ++t) {
    const int victim = 1 + t % (n - 1);  // a survivor of a lower rank always exists
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = dl::spawn(n, [victim](int rank) { kill_trial::run_rank(rank, n, victim); }, captured(20s));
    const double took = since(t0);
    slowest = std::max(slowest, took);
    const auto& killed = r.ranks[static_cast<std::size_t>(victim)];
    if (r.first_failed != victim || r.exit_status() != 128 + SIGKILL || killed.stopped_by_launcher || took > 10.0) {
      if (wrong++ == 0)
        first_wrong = "trial " + std::to_string(t) + ", victim " + std::to_string(victim) + ", " +
                      std::to_string(took) + " s: " + ddp::testing::all_output(r);
    }
  }
  std::cout << "spawn kill trials: " << trials << ", wrong blames or slow: " << wrong << ", slowest " << slowest
            << " s\n";
  INFO(first_wrong);
  CHECK(wrong == 0);
}

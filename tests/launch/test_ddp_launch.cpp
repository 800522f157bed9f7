// The ddp-launch program, run as a rank of a captured ddp::launch job so its output can be read.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch/spawn.hpp>

#include "kill_trial.hpp"
#include "support/run_ranks.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
namespace dl = ddp::launch;

using ddp::testing::contains;

namespace {

/// Runs ddp-launch with `args` and `env` added to its environment (output captured, SIGTERM to it after
/// `timeout`).
dl::rank_status ddp_launch(std::vector<std::string> args, std::chrono::milliseconds timeout = 20s,
                           dl::env_list env = {}) {
  args.insert(args.begin(), DDP_LAUNCH_EXE);
  dl::spawn_options o;
  o.output = dl::output_mode::capture;
  o.timeout = timeout;
  o.extra_env = [env = std::move(env)](int) { return env; };
  o.grace = 10s;  // ddp-launch stops its own ranks when signalled: give it the time to do so
  return dl::spawn_program(1, args, o).ranks[0];
}

}  // namespace

TEST_CASE("ddp-launch: every rank sees the environment, every line is prefixed", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "3", "--port", "23456", "--", "/bin/sh", "-c",
                             "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
                             "${#DDP_TOKEN}; echo on stderr >&2"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  for (const char* line : {"[rank 0] 0 3 0 3 127.0.0.1 23456 ", "[rank 1] 1 3 1 3 127.0.0.1 23456 ",
                           "[rank 2] 2 3 2 3 127.0.0.1 23456 ", "[rank 2] on stderr\n"})
    CHECK(contains(r.output, line));
}

TEST_CASE("ddp-launch: a carriage return ends a line (progress bars show), and a line without an end goes out in pieces of "
          "64 KiB", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "1", "--", "/bin/sh", "-c",
                             "printf 'bar 1\\rbar 2\\r\\nthen'; head -c 300000 /dev/zero | tr '\\0' x; printf '\\ndone\\n'"});
  CHECK(r.exit_code == 0);
  CHECK(contains(r.output, "[rank 0] bar 1\r[rank 0] bar 2\r\n[rank 0] thenxxx"));
  CHECK(contains(r.output, "[rank 0] done\n"));
  std::size_t xs = 0, pieces = 0, longest = 0;
  for (std::size_t at = 0; at < r.output.size();) {
    const std::size_t end = std::min(r.output.find('\n', at), r.output.size());
    const std::string line = r.output.substr(at, end - at);
    if (line.find('x') != std::string::npos) {
      ++pieces;
      longest = std::max(longest, line.size());
      xs += static_cast<std::size_t>(std::count(line.begin(), line.end(), 'x'));
    }
    at = end + 1;
  }
  CHECK(xs == 300000);  // nothing lost
  CHECK(pieces == 5);   // 300 004 bytes: four pieces of 65 536 and the rest
  CHECK(longest == std::string("[rank 0] ").size() + 65536);
}

TEST_CASE("ddp-launch: torchrun's --nproc-per-node and --master-port spellings work", "[launch][ddp-launch]") {
  const auto r = ddp_launch(
      {"--nproc-per-node", "2", "--master-port", "23457", "/bin/sh", "-c", "echo $WORLD_SIZE $MASTER_PORT"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(contains(r.output, "[rank 1] 2 23457\n"));
}

TEST_CASE("ddp-launch: picks a free port (not torchrun's default) and passes options after the program on",
          "[launch][ddp-launch]") {
  const auto a = ddp_launch({"-n", "1", "/bin/sh", "-c", "echo port=$MASTER_PORT", "--not-an-option-of-ddp-launch"});
  INFO(a.output);
  CHECK(a.exit_code == 0);
  CHECK(contains(a.output, "[rank 0] port="));
  CHECK_FALSE(contains(a.output, "port=29500"));
}

TEST_CASE("ddp-launch: a failing rank stops the others and its status is the exit status", "[launch][ddp-launch]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = ddp_launch({"-n", "3", "--grace", "1", "--", "/bin/sh", "-c",
                             "if [ $RANK = 1 ]; then echo failing; exit 3; fi; exec sleep 30"});
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(r.output);
  CHECK(took < 5s);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.output, "[rank 1] failing\n"));
  CHECK(contains(r.output, "ddp-launch: rank 1 failed first with exit code 3"));
  CHECK(contains(r.output, "rank 0: signal 15 (Terminated) (stopped by the launcher)"));
}

TEST_CASE("ddp-launch: a rank ended by a signal gives 128 + signal", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "2", "--", "/bin/sh", "-c", "if [ $RANK = 0 ]; then kill -9 $$; fi; exec sleep 30"});
  INFO(r.output);
  CHECK(r.exit_code == 128 + SIGKILL);
  CHECK(contains(r.output, "rank 0 failed first with signal 9"));
}

TEST_CASE("ddp-launch: --timeout stops the job and exits 124", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "2", "--timeout", "0.3", "--grace", "0.5", "sleep", "30"});
  INFO(r.output);
  CHECK(r.exit_code == 124);
  CHECK(contains(r.output, "did not finish within its timeout"));
}

TEST_CASE("ddp-launch: a --timeout under half a millisecond is still a limit", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "1", "--timeout", "0.0001", "--grace", "0.5", "sleep", "30"});
  INFO(r.output);
  CHECK(r.exit_code == 124);
}

TEST_CASE("ddp-launch: SIGKILL to the launcher ends its ranks too", "[launch][ddp-launch]") {
  const auto dir = std::filesystem::temp_directory_path() / ("ddp-launch-orphans-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string script = "echo $$ > " + dir.string() + "/pid.$RANK; exec sleep 60";
  const pid_t launcher = ::fork();
  REQUIRE(launcher >= 0);
  if (launcher == 0) {
    const int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, STDOUT_FILENO);
    ::dup2(null, STDERR_FILENO);
    ::execl(DDP_LAUNCH_EXE, DDP_LAUNCH_EXE, "-n", "2", "--", "/bin/sh", "-c", script.c_str(), nullptr);
    ::_exit(127);
  }
  std::vector<pid_t> ranks;
  const auto read_pids = [&] {
    ranks.clear();
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("pid." + std::to_string(r)));
      pid_t p = 0;
      if (in >> p) ranks.push_back(p);
    }
    return ranks.size() == 2;
  };
  for (int i = 0; i < 200 && !read_pids(); ++i) std::this_thread::sleep_for(50ms);
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  REQUIRE(ranks.size() == 2);
  const auto gone = [](pid_t p) {  // no such process, or a zombie nobody reaps yet
    if (::kill(p, 0) != 0 && errno == ESRCH) return true;
    std::ifstream stat("/proc/" + std::to_string(p) + "/stat");
    std::string pid, name, state;
    return stat >> pid >> name >> state && state == "Z";
  };
  bool all_gone = false;
  for (int i = 0; i < 100 && !all_gone; ++i) {
    all_gone = std::all_of(ranks.begin(), ranks.end(), gone);
    if (!all_gone) std::this_thread::sleep_for(50ms);
  }
  for (pid_t p : ranks)
    if (!gone(p)) ::kill(p, SIGKILL);  // leave nothing behind when the check fails
  std::filesystem::remove_all(dir);
  CHECK(all_gone);
}

TEST_CASE("ddp-launch: SIGTERM to the launcher stops every rank", "[launch][ddp-launch]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = ddp_launch({"-n", "2", "--grace", "0.5", "sleep", "30"}, 500ms);
  INFO(r.output);
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(r.exit_code == 128 + SIGTERM);
  CHECK(contains(r.output, "interrupted by signal 15"));
}

TEST_CASE("ddp-launch: a program that does not exist exits 127", "[launch][ddp-launch]") {
  const auto r = ddp_launch({"-n", "1", "/nonexistent/program"});
  INFO(r.output);
  CHECK(r.exit_code == 127);
  CHECK(contains(r.output, "[rank 0] cannot run '/nonexistent/program'"));
}

TEST_CASE("ddp-launch: --help, and bad arguments exit 2 with the reason", "[launch][ddp-launch]") {
  const auto help = ddp_launch({"--help"});
  CHECK(help.exit_code == 0);
  CHECK(contains(help.output, "usage: ddp-launch -n N"));
  struct bad {
    std::vector<std::string> args;
    const char* says;
  };
  for (const auto& b : {bad{{"true"}, "the number of ranks is missing; pass -n N"},
                        bad{{"-n", "2"}, "the program to run is missing"},
                        bad{{"-n", "zero", "true"}, "-n needs a whole number in [1, 4096], got 'zero'"},
                        bad{{"-n", "0", "true"}, "got '0'"},
                        bad{{"-n"}, "-n needs a value"},
                        bad{{"--port", "70000", "-n", "1", "true"}, "--port needs a whole number in [1, 65535]"},
                        bad{{"--timeout", "-1", "-n", "1", "true"}, "--timeout needs a positive number of seconds"},
                        bad{{"--bogus", "-n", "1", "true"}, "unknown option '--bogus'"}}) {
    const auto r = ddp_launch(b.args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.output, b.says));
    CHECK(contains(r.output, "see ddp-launch --help"));
  }
}

// Run by ddp-launch below, not by ctest (hidden tag): one all_reduce over ddp::tcp from the launcher's env.
TEST_CASE("ddp-launch job: all_reduce over ddp::tcp from the environment", "[.ddp-launch-job]") {
  auto comm = ddp::tcp::communicator::from_env();
  std::vector<float> v(1000, static_cast<float>(comm.rank() + 1));
  comm.all_reduce(v).wait();  // bounded by the communicator's timeout and ddp-launch's --timeout
  const int n = comm.size();
  std::cout << "rank " << comm.rank() << " of " << n << ": sum " << v.front() << " " << v.back() << std::endl;
  REQUIRE(v.front() == static_cast<float>(n * (n + 1) / 2));
  REQUIRE(v.back() == v.front());
}

TEST_CASE("ddp-launch: a ddp::tcp job started by ddp-launch finds its peers from the environment",
          "[launch][ddp-launch]") {
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto r = ddp_launch({"-n", "3", "--timeout", "30", self, "[.ddp-launch-job]"});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  for (int rank = 0; rank < 3; ++rank) {
    const auto k = std::to_string(rank);
    CHECK(contains(r.output, "[rank " + k + "] rank " + k + " of 3: sum 6 6\n"));
  }
}

TEST_CASE("ddp-launch: every honest rank passes the rendezvous, however many handshakes are in flight",
          "[launch][ddp-launch][many]") {
  // Each rank connects to every lower rank's mesh port before accepting, and the store takes every rank at once.
  // The cap on handshakes in progress (DDP_MAX_PENDING_HANDSHAKES, 64) once evicted honest ranks beyond it: with
  // the cap at 1, 24 ranks failed every time; the cap now counts beyond the world size.
  const auto self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (int run = 0; run < 3; ++run) {
    const auto r = ddp_launch({"-n", "24", "--timeout", "100", self, "[.ddp-launch-job]"}, 120s,
                              {{"DDP_MAX_PENDING_HANDSHAKES", "1"}});
    INFO("run " << run << ": " << r.output.substr(r.output.size() > 3000 ? r.output.size() - 3000 : 0));
    REQUIRE(r.exit_code == 0);
    CHECK(contains(r.output, "[rank 23] rank 23 of 24: sum 300 300\n"));
  }
  const auto r = ddp_launch({"-n", "100", "--timeout", "200", self, "[.ddp-launch-job]"}, 240s);
  INFO(r.output.substr(r.output.size() > 3000 ? r.output.size() - 3000 : 0));
  REQUIRE(r.exit_code == 0);
  CHECK(contains(r.output, "[rank 99] rank 99 of 100: sum 5050 5050\n"));
}

TEST_CASE("ddp-launch: the rank killed first is blamed and its status is the exit status", "[launch][ddp-launch][kill]") {
  const int trials = kill_trial::trials(40);
  int wrong = 0;
  double slowest = 0;
  std::string first_wrong;
  for (int t = 0; t < trials; ++t) {
    const auto victim = std::to_string(1 + t % 3);  // a survivor of a lower rank always exists
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = ddp_launch({"-n", "4", "--timeout", "20", DDP_KILL_TRIAL_RANK_EXE}, 30s,
                              {{"DDP_KILL_VICTIM", victim}});
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    slowest = std::max(slowest, took);
    if (r.exit_code != 128 + SIGKILL || !contains(r.output, "ddp-launch: rank " + victim + " failed first with signal 9") ||
        contains(r.output, "rank " + victim + ": signal 9 (Killed) (stopped by the launcher)") || took > 10.0) {
      if (wrong++ == 0)
        first_wrong = "trial " + std::to_string(t) + ", victim " + victim + ", " + std::to_string(took) + " s, " +
                      r.describe() + ":\n" + r.output;
    }
  }
  std::cout << "ddp-launch kill trials: " << trials << ", wrong blames or slow: " << wrong << ", slowest " << slowest
            << " s\n";
  INFO(first_wrong);
  CHECK(wrong == 0);
}

TEST_CASE("ddp-launch --max-restarts: a failure restarts every rank with DDP_RESTART_COUNT, up to M times",
          "[launch][ddp-launch][restart]") {
  const std::string body = "echo attempt $DDP_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT; "
                           "if [ $RANK = 1 ] && [ $DDP_RESTART_COUNT -lt 2 ]; then exit 5; fi";
  SECTION("the third attempt succeeds within 2 restarts") {
    const auto r = ddp_launch({"-n", "2", "--bind", "none", "--max-restarts", "2", "--", "/bin/sh", "-c", body});
    INFO(r.output);
    CHECK(r.exit_code == 0);
    CHECK(contains(r.output, "ddp-launch: restarting every rank (restart 1 of 2)"));
    CHECK(contains(r.output, "ddp-launch: restarting every rank (restart 2 of 2)"));
    CHECK(contains(r.output, "[rank 0] attempt 2 2\n"));
  }
  SECTION("one restart is not enough: the second failure's status is the exit status") {
    const auto r = ddp_launch({"-n", "2", "--bind", "none", "--max-restarts", "1", "--", "/bin/sh", "-c", body});
    INFO(r.output);
    CHECK(r.exit_code == 5);
    CHECK(contains(r.output, "[rank 1] attempt 1 1\n"));
    CHECK_FALSE(contains(r.output, "attempt 2"));
  }
}

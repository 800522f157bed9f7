// ddp-launch across nodes (--nnodes): two launchers on 127.0.0.1 stand for two hosts (the multihost tests
// run them on simulated hosts): the torchrun environment, a failure on one node stopping both, the token.

#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/launch/nodes.hpp>
#include <ddp/launch/spawn.hpp>

#include "tcp/helpers.hpp"
#include "support/side_process.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
namespace dl = ddp::launch;

using ddp::testing::contains;

namespace {

/// Runs `launchers` processes, launcher i executing command(i, port), where port is the job's MASTER_PORT (`port`,
/// or a free one), with env(i) added to its environment; none is stopped when another fails. Returns each one's
/// status and output.
dl::spawn_result run_launchers(int launchers,
                               std::function<std::vector<std::string>(int i, const std::string& port)> command,
                               std::function<dl::env_list(int i)> env = {}, int fixed_port = 0) {
  const std::string port = std::to_string(fixed_port != 0 ? fixed_port : ddp::testing::free_port());
  dl::spawn_options o;
  o.output = dl::output_mode::capture;
  o.timeout = 30s;
  o.grace = 10s;
  o.stop_on_failure = false;  // each launcher must stop on its own
  o.extra_env = std::move(env);
  return dl::spawn(
      launchers,
      [&](int i) {
        auto argv = command(i, port);
        std::vector<char*> raw;
        for (auto& a : argv) raw.push_back(a.data());
        raw.push_back(nullptr);
        ::execv(raw[0], raw.data());
        std::_Exit(127);
      },
      o);
}

/// The command line of ddp-launch as node `node` of `nodes` with MASTER_PORT `port`, then `args`.
std::vector<std::string> launcher(int nodes, int node, const std::string& port, const std::vector<std::string>& args) {
  std::vector<std::string> argv{DDP_LAUNCH_EXE, "--nnodes", std::to_string(nodes), "--node-rank", std::to_string(node),
                                "--master-addr", "127.0.0.1", "--master-port", port};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

/// Runs one ddp-launch per node (node r gets --node-rank r and the others, then args(r)) with env(r) added to
/// its environment; neither is stopped when the other fails. Returns each launcher's status and output.
dl::spawn_result launch_nodes(int nodes, std::function<std::vector<std::string>(int node)> args,
                              std::function<dl::env_list(int node)> env = {}) {
  return run_launchers(
      nodes, [&](int node, const std::string& port) { return launcher(nodes, node, port, args(node)); },
      std::move(env));
}

/// launch_nodes with the same `args` on every node.
dl::spawn_result launch_nodes(int nodes, const std::vector<std::string>& args,
                              std::function<dl::env_list(int node)> env = {}) {
  return launch_nodes(nodes, [args](int) { return args; }, std::move(env));
}

/// A launcher's arguments for two ranks (no CPU binding) running `script` under /bin/sh, `options` before the script.
std::vector<std::string> sh_on_two_ranks(const std::string& script, std::vector<std::string> options = {}) {
  std::vector<std::string> args{"--bind", "none", "-n", "2"};
  args.insert(args.end(), options.begin(), options.end());
  args.insert(args.end(), {"--", "/bin/sh", "-c", script});
  return args;
}

/// Two nodes of two ranks: rank 0 exits 1 after 0.2 s, rank 3 kills itself with SIGKILL after `crash_after` seconds;
/// both launchers must blame rank 3's crash and exit with its status.
void require_rank_3_blamed(const std::string& crash_after) {
  const auto rs = launch_nodes(2, sh_on_two_ranks("if [ $RANK = 0 ]; then sleep 0.2; exit 1; fi; if [ $RANK = 3 ]; "
                                                  "then sleep " + crash_after + "; kill -9 $$; fi; exec sleep 30",
                                                  {"--grace", "1"}));
  INFO(rs.ranks[0].output + rs.ranks[1].output);
  for (const auto& node : rs.ranks) {
    CHECK(node.exit_code == 128 + 9);
    CHECK(contains(node.output, "the job failed: rank 3 on node 1 failed with status 137"));
  }
}

}  // namespace

TEST_CASE("ddp-launch --nnodes: RANK = node x K + LOCAL_RANK and torchrun's other variables", "[launch][nodes]") {
  const auto rs = launch_nodes(2, sh_on_two_ranks("echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK "
                                                  "$GROUP_WORLD_SIZE $MASTER_ADDR ${#DDP_TOKEN}"));
  INFO(rs.ranks[0].output + rs.ranks[1].output);
  REQUIRE(rs.ok());
  // rank, world size, local rank, local world size, node, nodes, master address (node r holds ranks 2r and 2r+1)
  const char* const expected[] = {"[rank 0] 0 4 0 2 0 2 127.0.0.1 ", "[rank 1] 1 4 1 2 0 2 127.0.0.1 ",
                                  "[rank 2] 2 4 0 2 1 2 127.0.0.1 ", "[rank 3] 3 4 1 2 1 2 127.0.0.1 "};
  for (std::size_t r = 0; r < 4; ++r) CHECK(contains(rs.ranks[r / 2].output, expected[r]));
}

TEST_CASE("ddp-launch --nnodes: a rank failing on node 1 stops node 0's ranks, both exit with its status",
          "[launch][nodes]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto rs = launch_nodes(2, sh_on_two_ranks("if [ $RANK = 3 ]; then sleep 0.5; exit 7; fi; exec sleep 30",
                                                  {"--grace", "1"}));
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(rs.ranks[0].output + rs.ranks[1].output);
  CHECK(took < 15s);  // far below the ranks' 30 s sleep
  for (const auto& node : rs.ranks) {
    CHECK(node.exit_code == 7);
    CHECK(contains(node.output, "the job failed: rank 3 on node 1 failed with status 7; every node stopped its ranks"));
  }
  CHECK(contains(rs.ranks[0].output, "stopped its ranks after a failure elsewhere"));
  CHECK(contains(rs.ranks[1].output, "rank 3 (local rank 1) failed first with exit code 7"));
}

TEST_CASE("ddp-launch --nnodes: node 0's ranks ended, node 1's still running past --exit-barrier-timeout: both "
          "launchers end at once, naming node 1",
          "[launch][nodes]") {
  const auto t0 = std::chrono::steady_clock::now();
  const auto rs = launch_nodes(2, sh_on_two_ranks("if [ $GROUP_RANK = 1 ]; then exec sleep 30; fi",
                                                  {"--grace", "1", "--exit-barrier-timeout", "2"}));
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(rs.ranks[0].output + rs.ranks[1].output);
  CHECK(took < 15s);  // 2 s barrier, 1 s settling, node 1 stopping its ranks: far below their 30 s
  for (const auto& node : rs.ranks) {
    CHECK(node.exit_code == 124);
    CHECK(contains(node.output, "the job failed: the launcher of node 1 said nothing within the exit barrier"));
  }
}

TEST_CASE("ddp-launch --nnodes: a crash is blamed before an earlier exit with an error (a lost peer's symptom)",
          "[launch][nodes]") {
  require_rank_3_blamed("0.5");
}

TEST_CASE("ddp-launch --nnodes: a crash reported late (its launcher busy) is still blamed before an exit: node 0 "
          "waits for every node's word while only exits were reported", "[launch][nodes]") {
  // Rank 0's exit opens node 0's settle window (1 s); rank 3's crash comes 1.8 s later, as when the crashed rank's
  // launcher is descheduled while the peers it left already exited. Node 1 said nothing yet, so node 0 waits on.
  require_rank_3_blamed("2");
}

TEST_CASE("ddp-launch --nnodes: the token comes from DDP_TOKEN or --token-file, without one, or another one, no "
          "job starts", "[launch][nodes]") {
  SECTION("no token") {
    const auto rs = launch_nodes(2, {"-n", "1", "--join-timeout", "2", "/bin/true"},
                                 [](int) { return dl::env_list{{"DDP_TOKEN", ""}}; });
    for (const auto& node : rs.ranks) {
      CHECK(node.exit_code == 1);
      CHECK(contains(node.output, "needs a token every node shares"));
    }
  }
  SECTION("a token file") {
    const auto file = std::filesystem::temp_directory_path() / ("ddp-token." + std::to_string(::getpid()));
    std::ofstream(file) << "from-the-file\n";
    std::filesystem::permissions(file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
    const auto rs = launch_nodes(2, {"--token-file", file.string(), "-n", "1", "/bin/sh", "-c", "echo token=$DDP_TOKEN"},
                                 [](int) { return dl::env_list{{"DDP_TOKEN", ""}}; });
    std::filesystem::remove(file);
    INFO(rs.ranks[0].output + rs.ranks[1].output);
    REQUIRE(rs.ok());
    CHECK(contains(rs.ranks[1].output, "[rank 1] token=from-the-file\n"));
    CHECK_FALSE(contains(rs.ranks[1].output, "readable by other users"));
  }
  SECTION("node 1 with another token is refused; node 0 gives up at the join timeout") {
    const auto rs = launch_nodes(2, {"--join-timeout", "3", "-n", "1", "/bin/true"}, [](int node) {
      return dl::env_list{{"DDP_TOKEN", node == 0 ? "one" : "two"}};
    });
    INFO(rs.ranks[0].output + rs.ranks[1].output);
    CHECK(rs.ranks[0].exit_code == 1);
    CHECK(contains(rs.ranks[0].output, "wrong job token"));
    CHECK(contains(rs.ranks[0].output, "did not join node 0"));
    CHECK(rs.ranks[1].exit_code == 1);
    CHECK(contains(rs.ranks[1].output, "refused node 1"));
  }
  SECTION("a stranger replaying node 1's hello, or one signed for the store, is refused; node 1 then joins") {
    namespace td = ddp::tcp::detail;
    const int port = ddp::testing::free_port();
    ddp::testing::side_process stranger([port] {
      const auto control = static_cast<std::uint16_t>(port + 1);
      const auto connect = [&](td::challenge& nonce) {
        auto fd = td::connect_with_retry("127.0.0.1", control, td::clock::now() + 10s, -1, "node 0's launcher", "");
        ddp::testing::tcp::expect(td::recv_all(fd.get(), nonce.data(), nonce.size(), td::clock::now() + 5s) ==
                                      td::io_status::ok,
                                  "node 0's challenge");
        return fd;
      };
      dl::detail::control_frame hello;  // node 1 of 2, one rank, no restarts: what the real node 1 sends
      hello.node = 1;
      hello.rank = 1;
      hello.status = 2;
      const td::job_key key = td::job_key_of("shared");
      td::challenge first{}, second{}, third{};
      auto a = connect(first);
      const auto recorded = td::signed_hello(hello, key, "launch", first);  // what a listener could have captured
      auto b = connect(second);
      ddp::testing::tcp::expect(second != first, "a fresh challenge per connection");
      td::send_all(b.get(), &recorded, sizeof recorded, td::clock::now() + 5s);
      auto c = connect(third);
      const auto for_the_store = td::signed_hello(hello, key, "store", third);  // the same key, another context
      td::send_all(c.get(), &for_the_store, sizeof for_the_store, td::clock::now() + 5s);
      for (auto* fd : {&b, &c}) {
        std::uint8_t byte = 0;
        ddp::testing::tcp::expect(td::recv_all(fd->get(), &byte, 1, td::clock::now() + 5s) == td::io_status::closed,
                                  "node 0 refused the stranger");
      }
    });
    const auto rs = run_launchers(
        2,
        [](int node, const std::string& p) {
          auto argv = launcher(2, node, p, {"--join-timeout", "20", "-n", "1", "/bin/true"});
          if (node == 1) argv.insert(argv.begin(), {"/bin/sh", "-c", "sleep 2; exec \"$0\" \"$@\""});
          return argv;
        },
        [](int) { return dl::env_list{{"DDP_TOKEN", "shared"}}; }, port);
    CHECK(stranger.join() == "");
    INFO(rs.ranks[0].output + rs.ranks[1].output);
    REQUIRE(rs.ok());
    CHECK(contains(rs.ranks[0].output, "wrong job token"));
  }
}

TEST_CASE("ddp-launch --nnodes --max-restarts: a rank failing on node 1 restarts every node's ranks",
          "[launch][nodes][restart]") {
  const auto rs = launch_nodes(2, sh_on_two_ranks("echo attempt $DDP_RESTART_COUNT; "
                                                  "if [ $RANK = 3 ] && [ $DDP_RESTART_COUNT = 0 ]; then exit 9; fi",
                                                  {"--max-restarts", "1"}));
  INFO(rs.ranks[0].output + rs.ranks[1].output);
  REQUIRE(rs.ok());
  CHECK(contains(rs.ranks[0].output, "node 0: restarting ranks 0..1 (restart 1 of 1)"));
  CHECK(contains(rs.ranks[1].output, "node 1: restarting ranks 2..3 (restart 1 of 1)"));
  CHECK(contains(rs.ranks[0].output, "[rank 0] attempt 1\n"));
  CHECK(contains(rs.ranks[1].output, "[rank 3] attempt 1\n"));
}

TEST_CASE("ddp-launch --nnodes: launchers with different --max-restarts or --nproc-per-node all stop within seconds "
          "naming both settings", "[launch][nodes]") {
  // three nodes, node 2 started with other settings after node 1 joined: every launcher hears both settings at
  // once (the join deadline stays at its default 300 s)
  const auto check = [](const std::vector<std::string>& other, const std::string& theirs, const std::string& ours) {
    const auto start = std::chrono::steady_clock::now();
    const auto rs = run_launchers(3, [&](int node, const std::string& port) {
      std::vector<std::string> args = node == 2 ? other : std::vector<std::string>{"-n", "1"};
      args.insert(args.end(), {"--", "/bin/true"});
      auto argv = launcher(3, node, port, args);
      if (node == 2) argv.insert(argv.begin(), {"/bin/sh", "-c", "sleep 0.5; exec \"$0\" \"$@\""});
      return argv;
    });
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string all;
    for (const auto& r : rs.ranks) all += r.output + "\n----\n";
    INFO(all);
    CHECK(took < 10.0);
    for (const auto& r : rs.ranks) {
      CHECK(r.exit_code == 1);
      CHECK(contains(r.output, "the launchers disagree on the job"));
      CHECK(contains(r.output, "node 2's was started with " + theirs));
      CHECK(contains(r.output, ours));
    }
  };
  check({"-n", "1", "--max-restarts", "1"}, "--nnodes 3 --nproc-per-node 1 --max-restarts 1",
        "--nnodes 3 --nproc-per-node 1 --max-restarts 0");
  check({"-n", "2"}, "--nnodes 3 --nproc-per-node 2 --max-restarts 0", "--nnodes 3 --nproc-per-node 1 --max-restarts 0");
}

TEST_CASE("ddp-launch --nnodes: a launcher claiming a --node-rank another holds is refused and the job goes on",
          "[launch][nodes]") {
  // A job of 3 nodes: node 1 twice at once (one is refused while node 0 still waits for node 2), node 2 after
  // 1.5 s, and node 2 again after 4 s, while the job's ranks run.
  struct start {
    int node;
    const char* delay;
  };
  const std::vector<start> starts{{0, "0"}, {1, "0"}, {1, "0"}, {2, "1.5"}, {2, "4"}};
  const std::vector<std::string> job{"--bind", "none", "-n", "1", "--", "/bin/sh", "-c", "sleep 5; echo ran $RANK"};
  const auto rs = run_launchers(static_cast<int>(starts.size()), [&](int i, const std::string& port) {
    auto argv = launcher(3, starts[i].node, port, job);
    argv.insert(argv.begin(), {"/bin/sh", "-c", std::string("sleep ") + starts[i].delay + "; exec \"$0\" \"$@\""});
    return argv;
  });
  std::string all;
  for (const auto& r : rs.ranks) all += r.output + "\n----\n";
  INFO(all);
  const auto refused = [&](std::size_t i, int node) {
    return rs.ranks[i].exit_code == 1 &&
           contains(rs.ranks[i].output, "refused node " + std::to_string(node) +
                                            ": another launcher of this job already holds node rank " +
                                            std::to_string(node)) &&
           contains(rs.ranks[i].output, "give every node its own --node-rank in 0..2");
  };
  // Exactly one of the two node-1 launchers joined; the other, and the late node 2, were refused.
  CHECK(refused(1, 1) != refused(2, 1));
  const std::size_t node1 = refused(1, 1) ? 2 : 1;
  CHECK(refused(4, 2));
  for (const std::size_t i : {std::size_t{0}, node1, std::size_t{3}}) {
    CHECK(rs.ranks[i].exit_code == 0);
    CHECK(contains(rs.ranks[i].output, "ran " + std::to_string(starts[i].node)));
  }
  CHECK(contains(rs.ranks[0].output, "it claims node rank 1, which another launcher of this job holds"));
  CHECK(contains(rs.ranks[0].output, "it claims node rank 2, which another launcher of this job holds (give every "
                                     "node its own --node-rank in 0..2); the job goes on"));
}

// ddp-launch: start the ranks of a program with torchrun's environment, on one host (like torchrun
// --standalone) or on each of several (like torchrun --nnodes N --node-rank R --master-addr A).
//
//   ddp-launch -n 4 [--port P] [--bind none|core|numa] [--timeout S] [--grace S] [--] program [args...]
//   ddp-launch --nnodes 2 --node-rank R --nproc-per-node 4 --master-addr A --master-port P program  (per host)
//
// Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT and DDP_TOKEN; each output line is prefixed with "[rank R] "; when a rank fails (on any node)
// every rank is stopped and every ddp-launch exits with its status.

#include <signal.h>
#include <sys/stat.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/launch/flight_report.hpp>
#include <ddp/launch/nodes.hpp>
#include <ddp/launch/spawn.hpp>

namespace {

constexpr std::string_view usage = R"(usage: ddp-launch -n N [options] [--] program [args...]
       ddp-launch --nnodes N --node-rank R -n K --master-addr A [--master-port P] [options] program [args...]

Starts N ranks of `program` on this host, each with the environment of torchrun --standalone:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT and DDP_TOKEN.
Each line a rank prints is prefixed with "[rank R] ". When one rank fails, the others get a second to
end on their own (and write their flight records), then SIGTERM (SIGKILL after the grace period), and
ddp-launch exits with the failing rank's status (128 + signal when a signal ended it) and says where the
ranks' collectives diverged or stalled (DDP_FLIGHT_RECORDER_DIR: where the ranks write their records).

options:
  -n, --nproc N     number of ranks to start (required, 1..4096); torchrun's --nproc-per-node works too
  --port P          MASTER_PORT to use (default: a free port picked by the launcher); or --master-port
  --bind MODE       core (default): each rank on its own physical cores when there are at least as many
                    cores as ranks, else unbound; numa: each rank on the CPUs of one NUMA node; none.
                    Only the CPUs ddp-launch may use count (taskset, cgroups). The choice is printed once.
  --timeout S       stop every rank after S seconds and exit 124 (default: no limit)
  --grace S         seconds between SIGTERM and SIGKILL when stopping ranks (default: 3)
  --max-restarts M  when a rank fails, stop every rank and start them all again, up to M times (default 0);
                    the ranks read the attempt in DDP_RESTART_COUNT (torchrun: TORCHELASTIC_RESTART_COUNT)
                    and resume from their last checkpoint. --timeout applies to each attempt.
  -h, --help        print this help and exit
  --                end of ddp-launch's options; the program and its arguments follow

several nodes (run ddp-launch once on each, as torchrun; RANK = R*K + LOCAL_RANK, WORLD_SIZE = N*K,
GROUP_RANK = R):
  --nnodes N        number of nodes (default 1)
  --node-rank R     this node's rank, 0..N-1 (node 0 runs rank 0 and the launchers' control port)
  --master-addr A   node 0's address, reachable from every node (MASTER_ADDR of every rank)
  --master-port P   rank 0's store port (default 29500); node 0's launcher listens on P+1 for the others
  --token-file F    read the job token from file F (first line); else DDP_TOKEN must be set on every node
  --join-timeout S  every node's launcher must have joined node 0's within S seconds (default 300)
  --exit-barrier-timeout S  once its ranks ended, node 0 waits S seconds (default 300) for the other nodes'
                    to end, the others S + 60 for node 0's verdict; then the silent node is named, and all fail
When a rank fails on any node, node 0 tells every launcher, each stops its ranks, and all exit with the
failing rank's status and name its node and rank.

DDP_TOKEN, when set in ddp-launch's environment, is passed on; otherwise (one node only) 128 random bits are.
The token never goes on a command line: pass it in the environment or a file only you can read.
SIGINT, SIGTERM and SIGHUP sent to ddp-launch stop every rank; it then exits with 128 + signal.
)";

volatile std::sig_atomic_t interrupted = 0;

/// The directory the ranks write their flight records to: DDP_FLIGHT_RECORDER_DIR when set, else
/// /tmp/ddp-flight.<pid>, removed at the end unless a rank wrote a record there (an empty one a killed
/// launcher left is removed by the next launcher).
struct flight_dir {
  std::filesystem::path path;
  bool owned = false;
  bool keep = false;

  flight_dir() {
    if (const char* d = std::getenv("DDP_FLIGHT_RECORDER_DIR"); d != nullptr && *d != '\0') {
      path = d;
      return;
    }
    std::error_code ec;
    const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
    for (const auto& e : std::filesystem::directory_iterator(ec ? "/tmp" : tmp, ec)) {
      const auto name = e.path().filename().string();
      const std::string prefix = "ddp-flight.";
      if (name.rfind(prefix, 0) != 0) continue;
      const auto pid = std::atol(name.c_str() + prefix.size());
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) std::filesystem::remove(e.path(), ec);
    }
    path = (ec ? std::filesystem::path("/tmp") : tmp) / ("ddp-flight." + std::to_string(::getpid()));
    owned = std::filesystem::create_directory(path, ec) && !ec;
    if (!owned) path.clear();
  }
  flight_dir(const flight_dir&) = delete;
  flight_dir& operator=(const flight_dir&) = delete;
  ~flight_dir() {
    std::error_code ec;
    if (owned && !keep) std::filesystem::remove_all(path, ec);
  }
};

extern "C" void on_signal(int sig) { interrupted = sig; }

/// A whole number in [lo, hi], or a config_error naming the option.
long long parse_integer(std::string_view option, std::string_view text, long long lo, long long hi) {
  long long value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size() || value < lo || value > hi)
    throw ddp::config_error(std::string(option) + " needs a whole number in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "], got '" + std::string(text) + "'");
  return value;
}

/// Seconds (decimals allowed, e.g. 0.5) in (0, one week], or a config_error naming the option.
std::chrono::milliseconds parse_seconds(std::string_view option, const std::string& text) {
  std::size_t used = 0;
  double seconds = -1;
  try {
    seconds = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || !(seconds > 0) || seconds > 7 * 24 * 3600.0)
    throw ddp::config_error(std::string(option) + " needs a positive number of seconds, got '" + text + "'");
  // rounded up: a limit under half a millisecond must not round to 0, which means no limit
  return std::chrono::milliseconds(static_cast<long long>(std::ceil(seconds * 1000.0)));
}

struct command_line {
  int nproc = 0;
  int nodes = 1;
  int node_rank = 0;
  std::string token_file;
  bool master_addr_given = false;
  std::chrono::milliseconds join_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds exit_barrier{std::chrono::minutes(5)};
  int max_restarts = 0;
  ddp::launch::bind_mode bind = ddp::launch::bind_mode::core;
  ddp::launch::spawn_options options;
  std::vector<std::string> program;
  bool help = false;
};

command_line parse(int argc, char** argv) {
  command_line c;
  int i = 1;
  const auto value_of = [&](std::string_view option) -> std::string {
    if (i + 1 >= argc) throw ddp::config_error(std::string(option) + " needs a value");
    return argv[++i];
  };
  for (; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.empty() || a.front() != '-') break;
    if (a == "-h" || a == "--help") {
      c.help = true;
      return c;
    }
    if (a == "-n" || a == "--nproc" || a == "--nproc-per-node" || a == "--nproc_per_node") {
      c.nproc = static_cast<int>(parse_integer(a, value_of(a), 1, 4096));
    } else if (a == "--port" || a == "--master-port" || a == "--master_port") {
      c.options.port = static_cast<std::uint16_t>(parse_integer(a, value_of(a), 1, 65535));
    } else if (a == "--nnodes") {
      c.nodes = static_cast<int>(parse_integer(a, value_of(a), 1, 4096));
    } else if (a == "--node-rank" || a == "--node_rank") {
      c.node_rank = static_cast<int>(parse_integer(a, value_of(a), 0, 4095));
    } else if (a == "--master-addr" || a == "--master_addr") {
      c.options.master_addr = value_of(a);
      c.master_addr_given = true;
    } else if (a == "--token-file") {
      c.token_file = value_of(a);
    } else if (a == "--max-restarts" || a == "--max_restarts") {
      c.max_restarts = static_cast<int>(parse_integer(a, value_of(a), 0, 1000));
    } else if (a == "--join-timeout") {
      c.join_timeout = parse_seconds(a, value_of(a));
    } else if (a == "--exit-barrier-timeout" || a == "--exit_barrier_timeout") {
      c.exit_barrier = parse_seconds(a, value_of(a));
    } else if (a == "--bind") {
      const std::string mode = value_of(a);
      if (mode == "none")
        c.bind = ddp::launch::bind_mode::none;
      else if (mode == "core")
        c.bind = ddp::launch::bind_mode::core;
      else if (mode == "numa")
        c.bind = ddp::launch::bind_mode::numa;
      else
        throw ddp::config_error("--bind takes none, core or numa, got '" + mode + "'");
    } else if (a == "--timeout") {
      c.options.timeout = parse_seconds(a, value_of(a));
    } else if (a == "--grace") {
      c.options.grace = parse_seconds(a, value_of(a));
    } else {
      throw ddp::config_error("unknown option '" + std::string(a) + "'");
    }
  }
  for (; i < argc; ++i) c.program.emplace_back(argv[i]);
  if (c.nproc == 0) throw ddp::config_error("the number of ranks is missing; pass -n N");
  if (c.program.empty()) throw ddp::config_error("the program to run is missing; pass it after the options");
  if (c.node_rank >= c.nodes)
    throw ddp::config_error("--node-rank " + std::to_string(c.node_rank) + " is outside 0.." +
                            std::to_string(c.nodes - 1) + " (--nnodes " + std::to_string(c.nodes) + ")");
  if (c.nodes > 1 && !c.master_addr_given)
    throw ddp::config_error("--nnodes " + std::to_string(c.nodes) + " needs --master-addr: node 0's address, the "
                            "same on every node");
  if (c.nodes > 1 && c.options.port == 0) c.options.port = 29500;  // torchrun's default
  if (c.nodes > 1 && c.options.port == 65535)
    throw ddp::config_error("--master-port 65535 leaves no port for the launchers' control channel (master port "
                            "+ 1); pick a lower port");
  return c;
}

/// The job token of a job on several nodes: the first line of --token-file, else DDP_TOKEN.
std::string shared_token(const command_line& cmd) {
  if (!cmd.token_file.empty()) {
    std::ifstream in(cmd.token_file);
    std::string token;
    if (!in || !std::getline(in, token) || token.empty())
      throw ddp::config_error("cannot read a job token from the first line of '" + cmd.token_file +
                              "'; write the same secret there on every node");
    struct stat st {};
    if (::stat(cmd.token_file.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
      std::fprintf(stderr, "ddp-launch: warning: the token file %s is readable by other users; chmod 600 it\n",
                   cmd.token_file.c_str());
    return token;
  }
  if (const char* t = std::getenv("DDP_TOKEN"); t != nullptr && *t != '\0') return t;
  throw ddp::config_error("a job on several nodes needs a token every node shares: set DDP_TOKEN in every "
                          "launcher's environment, or pass --token-file with a file only you can read");
}

/// Runs this node's ranks of a job on several nodes; every launcher stops its ranks when one fails anywhere.
int run_node(command_line& cmd) {
  const int k = cmd.nproc;
  cmd.options.token = shared_token(cmd);
  cmd.options.first_rank = cmd.node_rank * k;
  cmd.options.world_size = cmd.nodes * k;
  cmd.options.node_rank = cmd.node_rank;
  cmd.options.nodes = cmd.nodes;
  const std::string me = "node " + std::to_string(cmd.node_rank);
  ddp::launch::node_link link({cmd.nodes, cmd.node_rank, k, cmd.options.master_addr,
                               static_cast<std::uint16_t>(cmd.options.port + 1), cmd.options.token, cmd.join_timeout,
                               cmd.max_restarts, cmd.exit_barrier, cmd.options.interrupt});
  std::fprintf(stderr, "ddp-launch: %s of %d joined; ranks %d..%d of %d start (store at %s:%u)\n", me.c_str(),
               cmd.nodes, cmd.options.first_rank, cmd.options.first_rank + k - 1, cmd.options.world_size,
               cmd.options.master_addr.c_str(), cmd.options.port);
  const auto report = [&](const ddp::launch::spawn_result& r) {
    if (r.first_failed >= 0) {
      const auto& failed = r.ranks[static_cast<std::size_t>(r.first_failed)];
      link.report_failure(r.first_rank + r.first_failed, failed.shell_status(), failed.ended);
    } else if (r.timed_out || r.interrupted_by != 0) {
      link.report_failure(-1, r.exit_status(), std::chrono::system_clock::now());
    }
  };
  cmd.options.watch = [&](const ddp::launch::spawn_result& r) {
    report(r);
    return link.poll();
  };
  for (;; link.next_round()) {
    const auto result = ddp::launch::spawn_program(k, cmd.program, cmd.options);
    report(result);
    if (!result.ok()) std::fprintf(stderr, "ddp-launch: %s: %s\n", me.c_str(), result.describe().c_str());
    const auto failure = link.finish();
    if (!failure) return 0;
    std::fprintf(stderr, "ddp-launch: %s: the job failed: %s; every node stopped its ranks\n", me.c_str(),
                 failure->describe().c_str());
    if (!failure->restartable() || cmd.options.restart_count == cmd.max_restarts)
      return failure->status != 0 ? failure->status : 1;
    ++cmd.options.restart_count;
    std::fprintf(stderr, "ddp-launch: %s: restarting ranks %d..%d (restart %d of %d)\n", me.c_str(),
                 cmd.options.first_rank, cmd.options.first_rank + k - 1, cmd.options.restart_count, cmd.max_restarts);
  }
}

}  // namespace

int main(int argc, char** argv) {
  command_line cmd;
  try {
    cmd = parse(argc, argv);
  } catch (const ddp::config_error& e) {
    std::fprintf(stderr, "ddp-launch: %s; see ddp-launch --help\n", e.message().c_str());
    return 2;
  }
  if (cmd.help) {
    std::fwrite(usage.data(), 1, usage.size(), stdout);
    return 0;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;  // no SA_RESTART: the launcher's poll wakes up at once
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  cmd.options.interrupt = &interrupted;
  try {
    auto plan = ddp::launch::plan_binding(cmd.bind, cmd.nproc, ddp::launch::read_topology());
    std::fprintf(stderr, "ddp-launch: %s\n", plan.summary.c_str());
    cmd.options.cpus = std::move(plan.cpus);
    cmd.options.settle = std::chrono::seconds(1);  // the other ranks see the failure and write their records
    if (cmd.nodes > 1) return run_node(cmd);
    flight_dir records;
    if (records.owned)
      cmd.options.extra_env = [dir = records.path.string()](int) {
        return ddp::launch::env_list{{"DDP_FLIGHT_RECORDER_DIR", dir}};
      };
    for (;; ++cmd.options.restart_count) {
      const auto started = std::filesystem::file_time_type::clock::now();
      const auto result = ddp::launch::spawn_program(cmd.nproc, cmd.program, cmd.options);
      if (!result.ok()) {
        std::fprintf(stderr, "ddp-launch: %s\n", result.describe().c_str());
        if (!records.path.empty()) {
          const auto written = ddp::launch::read_flight_records(records.path, started);
          std::istringstream report(ddp::launch::analyze_flight_records(written));
          for (std::string line; std::getline(report, line);)
            std::fprintf(stderr, "ddp-launch: flight recorder: %s\n", line.c_str());
          records.keep = !written.empty();
          if (records.keep) std::fprintf(stderr, "ddp-launch: the ranks' flight records are in %s\n", records.path.c_str());
        }
      }
      if (result.first_failed < 0 || cmd.options.restart_count == cmd.max_restarts) return result.exit_status();
      std::fprintf(stderr, "ddp-launch: restarting every rank (restart %d of %d)\n", cmd.options.restart_count + 1,
                   cmd.max_restarts);
    }
  } catch (const ddp::error& e) {
    std::fprintf(stderr, "ddp-launch: %s\n", e.what());
    return interrupted != 0 ? 128 + static_cast<int>(interrupted) : 1;
  }
}

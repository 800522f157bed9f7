#pragma once
/// \file Local launcher (like torch.multiprocessing.spawn and torchrun --standalone): forks N ranks on
/// this host with torchrun's environment set, forwards or captures their output (launch/output.hpp), stops
/// the others when one fails, and reports how every rank ended.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/launch/binding.hpp>
#include <ddp/launch/exit_order.hpp>
#include <ddp/launch/job_identity.hpp>
#include <ddp/launch/output.hpp>

namespace ddp::launch {

/// A rank of a spawned job failed; rank() is the rank that failed first, native_code() its exit status
/// as a shell reports it (the exit code, or 128 + signal).
class job_failed : public ddp::error {
 public:
  using error::error;
};

/// What happens to the ranks' stdout and stderr.
enum class output_mode {
  forward,  ///< every line goes to the launcher's own stdout/stderr, prefixed with "[rank R] "
  capture,  ///< stdout and stderr of each rank are kept, in order, in rank_status::output
};

/// Extra environment variables of one rank, as name/value pairs (applied after the launcher's own).
using env_list = std::vector<std::pair<std::string, std::string>>;

struct spawn_result;

/// How to start a job; every field has a working default.
struct spawn_options {
  std::uint16_t port = 0;                      ///< MASTER_PORT; 0 picks a free port
  std::string master_addr = "127.0.0.1";       ///< MASTER_ADDR
  std::string token;                           ///< DDP_TOKEN; empty: the launcher's own, else 128 random bits
  std::chrono::milliseconds timeout{0};        ///< whole-job limit; 0 means none
  std::chrono::milliseconds grace{3000};       ///< SIGTERM to SIGKILL delay when stopping ranks
  output_mode output = output_mode::forward;   ///< forward with prefixes, or capture
  bool stop_on_failure = true;                 ///< stop the other ranks once one fails (after `settle`)
  /// After a rank failed, how long the others may run on before they are stopped: time to see the failure
  /// themselves (peer_lost within 0.1 s) and write their flight records.
  std::chrono::milliseconds settle{0};
  std::function<env_list(int rank)> extra_env; ///< per-rank additions or overrides of the environment
  std::vector<std::vector<int>> cpus;          ///< per rank, the CPUs it is bound to (none or empty: not bound)
  /// When set and it becomes non-zero (a signal handler writes the signal number), every rank is
  /// stopped and the job reports that signal; ddp-launch uses it to pass on SIGINT/SIGTERM.
  const volatile std::sig_atomic_t* interrupt = nullptr;
  int first_rank = 0;   ///< RANK of local rank 0: node_rank × nproc_per_node on a job of several nodes
  int world_size = 0;   ///< WORLD_SIZE; 0: the number of local ranks (a job on one node)
  int node_rank = 0;    ///< GROUP_RANK, torchrun's node rank
  int nodes = 1;        ///< GROUP_WORLD_SIZE, the number of nodes
  int restart_count = 0;  ///< DDP_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT): restarts so far
  /// Called every tick while ranks run, with the job's state so far; returning true stops every rank (a
  /// rank failed on another node) and the job reports stopped_by_watch.
  std::function<bool(const spawn_result&)> watch;
};

/// How one rank ended.
struct rank_status {
  int rank = 0;                     ///< the rank
  int exit_code = -1;               ///< its exit code, -1 when a signal ended it
  int signal = 0;                   ///< the signal that ended it, 0 when it exited
  bool stopped_by_launcher = false; ///< the launcher signalled it (another rank failed, timeout, interrupt)
  bool unknown_status = false;      ///< it ended but its status could not be read (SIGCHLD set to SIG_IGN)
  std::chrono::system_clock::time_point ended{};  ///< when the launcher reaped it (wall clock)
  std::string output;               ///< its stdout and stderr (output_mode::capture only)

  /// Exited with status 0.
  [[nodiscard]] bool ok() const noexcept { return exit_code == 0; }
  /// The status as a shell reports it: the exit code, or 128 + signal.
  [[nodiscard]] int shell_status() const noexcept { return signal != 0 ? 128 + signal : exit_code; }
  /// "exit code 3", "signal 9 (Killed)".
  [[nodiscard]] std::string describe() const {
    if (unknown_status)
      return "an unknown status (waitpid failed with ECHILD; do not set SIGCHLD to SIG_IGN while spawning)";
    if (signal == 0) return "exit code " + std::to_string(exit_code);
    return "signal " + std::to_string(signal) + " (" + ::strsignal(signal) + ")";
  }
};

/// The outcome of a job: every rank's status and which one failed first.
struct spawn_result {
  std::vector<rank_status> ranks;  ///< indexed by rank
  int first_failed = -1;           ///< the rank that failed first, -1 when none did
  bool timed_out = false;          ///< the whole-job timeout expired and the launcher stopped the ranks
  int interrupted_by = 0;          ///< the signal that interrupted the launcher (spawn_options::interrupt), 0 if none
  bool stopped_by_watch = false;   ///< spawn_options::watch asked to stop the ranks (a failure on another node)
  int first_rank = 0;              ///< RANK of local rank 0 (spawn_options::first_rank)
  std::uint16_t port = 0;          ///< the MASTER_PORT the ranks got
  std::string token;               ///< the DDP_TOKEN the ranks got

  /// Every rank exited with status 0.
  [[nodiscard]] bool ok() const noexcept {
    return first_failed < 0 && !timed_out && interrupted_by == 0 && !stopped_by_watch &&
           std::all_of(ranks.begin(), ranks.end(), [](const rank_status& r) { return r.ok(); });
  }
  /// The job's status as a program should exit with: 0; the first failing rank's shell status;
  /// 124 after the timeout (as timeout(1)); 128 + signal after an interrupt; 1 when stopped by the watch.
  [[nodiscard]] int exit_status() const noexcept {
    if (first_failed >= 0) return ranks[static_cast<std::size_t>(first_failed)].shell_status();
    if (timed_out) return 124;
    if (interrupted_by != 0) return 128 + interrupted_by;
    if (stopped_by_watch) return 1;
    return 0;
  }
  /// "rank G" of local rank `local`, with its local rank when ranks of other nodes come before it.
  [[nodiscard]] std::string name_of(int local) const {
    const std::string global = "rank " + std::to_string(first_rank + local);
    return first_rank == 0 ? global : global + " (local rank " + std::to_string(local) + ")";
  }
  /// One paragraph for humans: what failed first and how every other rank ended.
  [[nodiscard]] std::string describe() const {
    std::string s;
    if (first_failed >= 0)
      s = name_of(first_failed) + " failed first with " +
          ranks[static_cast<std::size_t>(first_failed)].describe();
    else if (timed_out)
      s = "the job did not finish within its timeout and was stopped";
    else if (interrupted_by != 0)
      s = "the launcher was interrupted by signal " + std::to_string(interrupted_by) + " and stopped the job";
    else if (stopped_by_watch)
      s = "the launcher stopped its ranks after a failure elsewhere";
    else
      s = "all " + std::to_string(ranks.size()) + " ranks exited with status 0";
    if (ok()) return s;
    for (const auto& r : ranks) {
      if (r.rank == first_failed) continue;
      s += "; " + name_of(r.rank) + ": " + r.describe();
      if (r.stopped_by_launcher) s += " (stopped by the launcher)";
    }
    return s;
  }
  /// Throws ddp::launch::job_failed with describe() unless ok().
  void throw_if_failed() const {
    if (ok()) return;
    throw job_failed(describe() + "; see the ranks' output above for the cause", first_failed, exit_status());
  }
};

namespace detail {

/// The child's side after fork: environment, output pipes, body, exit status.
[[noreturn]] inline void run_child(int rank, int n, const spawn_options& o, const std::string& port,
                                   const std::string& token, int out_fd, int err_fd, const exit_order& exits,
                                   int sentinel, const std::vector<stream>& parent_ends,
                                   const std::function<void(int)>& body, pid_t parent) {
  for (const auto& s : parent_ends)
    if (s.fd >= 0) ::close(s.fd);
  exits.place_sentinel(sentinel);
  // The parent's handlers (a test framework's, ddp-launch's) must not run in the rank: the launcher
  // stops ranks with SIGTERM and reports crashes by their signal. Every signal is blocked from the fork until here.
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, SIG_DFL);
  // A rank dies with its launcher, even one killed with SIGKILL, which can stop nothing itself: the kernel sends
  // SIGKILL when the thread that forked the rank ends (spawn waits for its ranks, so that is the launcher's end).
  // A launcher that died before this line has already left the rank to another parent: exit at once.
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != parent) ::_exit(128 + SIGKILL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  if (out_fd != STDOUT_FILENO && out_fd != STDERR_FILENO) ::close(out_fd);
  if (err_fd != out_fd && err_fd != STDOUT_FILENO && err_fd != STDERR_FILENO) ::close(err_fd);
  if (static_cast<std::size_t>(rank) < o.cpus.size() && !bind_to(o.cpus[static_cast<std::size_t>(rank)]))
    std::cerr << "rank " << o.first_rank + rank << " could not be bound to its CPUs (" << std::strerror(errno)
              << "); it runs unbound\n";
  const auto set = [](const char* name, int value) { ::setenv(name, std::to_string(value).c_str(), 1); };
  set("RANK", o.first_rank + rank);
  set("WORLD_SIZE", o.world_size > 0 ? o.world_size : n);
  set("LOCAL_RANK", rank);
  set("LOCAL_WORLD_SIZE", n);
  set("GROUP_RANK", o.node_rank);
  set("GROUP_WORLD_SIZE", o.nodes);
  set("DDP_RESTART_COUNT", o.restart_count);
  set("TORCHELASTIC_RESTART_COUNT", o.restart_count);
  ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", port.c_str(), 1);
  ::setenv("DDP_TOKEN", token.c_str(), 1);
  int code = 0;
  try {
    if (o.extra_env)
      for (const auto& [name, value] : o.extra_env(rank)) ::setenv(name.c_str(), value.c_str(), 1);
    body(rank);
  } catch (const std::exception& e) {
    std::cerr << "rank " << o.first_rank + rank << " failed with an exception: " << e.what() << '\n';
    code = 1;
  } catch (...) {
    std::cerr << "rank " << o.first_rank + rank
              << " failed with an exception that is not a std::exception (a test framework's failed assertion, "
                 "reported above, or a thrown non-std type)\n";
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);  // no atexit handlers: they belong to the parent's copy of the program
}

/// Records how `pid` ended in `r` from a waitpid status.
inline void record(rank_status& r, int status) {
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
}

}  // namespace detail

/// Forks `n` ranks that each run body(local rank) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DDP_TOKEN and DDP_RESTART_COUNT set (as torchrun
/// does; RANK is options.first_rank + local rank); a rank exits 0 when body returns and 1 when it throws
/// (what() goes to its stderr). Ranks start with no blocked signals and the default action for
/// termination and crash signals (the caller's handlers do not run in them). Waits for all of them
/// and returns how each ended; when one fails the others get SIGTERM (SIGKILL after options.grace),
/// and so do all after options.timeout. The rank blamed is the failed one whose exit began first in
/// the kernel's order (see detail::exit_order; SIGCHLD is blocked in the calling thread while spawn
/// runs), never a peer that failed because it had died.
/// Throws ddp::config_error for bad arguments and ddp::launch::launch_error when fork or pipe fails.
inline spawn_result spawn(int n, const std::function<void(int rank)>& body, const spawn_options& options = {}) {
  using clock = std::chrono::steady_clock;
  if (n < 1) throw ddp::config_error("spawn needs at least one rank, got n = " + std::to_string(n));
  if (!body) throw ddp::config_error("spawn got an empty body; pass a callable taking the rank");
  if (options.first_rank < 0 || (options.world_size > 0 && options.first_rank + n > options.world_size))
    throw ddp::config_error("ranks " + std::to_string(options.first_rank) + ".." +
                            std::to_string(options.first_rank + n - 1) + " do not fit in a world of " +
                            std::to_string(options.world_size) + "; check the node rank and the ranks per node");
  spawn_result result;
  result.first_rank = options.first_rank;
  result.port = options.port != 0 ? options.port : detail::free_port();
  if (!options.token.empty()) {
    result.token = options.token;
  } else if (const char* inherited = std::getenv("DDP_TOKEN"); inherited != nullptr && *inherited != '\0') {
    result.token = inherited;
  } else {
    result.token = detail::random_token();
  }
  const std::string port = std::to_string(result.port);
  result.ranks.resize(static_cast<std::size_t>(n));
  std::vector<pid_t> pids(static_cast<std::size_t>(n), -1);
  std::vector<detail::stream> streams;
  const bool forward = options.output == output_mode::forward;
  detail::exit_order exits(n);  // before the first fork, so that no exit goes unseen

  // Stops every rank still running: SIGTERM now, SIGKILL once the grace period is over.
  std::optional<clock::time_point> kill_at;
  const auto stop_all = [&] {
    if (kill_at) return;
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0) {
        ::kill(pids[r], SIGTERM);
        result.ranks[r].stopped_by_launcher = exits.began(static_cast<int>(r)) == 0;  // not already ending
      }
    kill_at = clock::now() + options.grace;
  };

  // A pipe or fork failed while starting rank r: kill the ranks already started, reap them, throw.
  const auto abandon = [&](const std::string& what, std::initializer_list<int> fds) {
    const int code = errno;
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGKILL);
    for (auto& s : streams) detail::finish(s);
    for (pid_t p : pids)
      if (p > 0) ::waitpid(p, nullptr, 0);
    errno = code;
    detail::throw_errno(what);
  };

  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);  // the children must not inherit (and repeat) buffered output
  const pid_t launcher = ::getpid();
  for (int r = 0; r < n; ++r) {
    result.ranks[static_cast<std::size_t>(r)].rank = r;
    int out[2] = {-1, -1};
    int err[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0 || (forward && ::pipe2(err, O_CLOEXEC) != 0))
      abandon("create a pipe for rank " + std::to_string(r), {out[0], out[1]});
    if (!forward) err[1] = out[1];
    const int sentinel = exits.open_sentinel(r);
    if (sentinel < 0)
      abandon("create a pipe for rank " + std::to_string(r), {out[0], out[1], err[0], forward ? err[1] : -1});
    // Every signal stays blocked until the child has put the default handlers back (run_child): a SIGTERM that
    // stops a rank right after the fork must not run the parent's handler in it.
    sigset_t all, before;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &before);
    const pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    if (pid < 0)
      abandon("fork rank " + std::to_string(r), {out[0], out[1], err[0], forward ? err[1] : -1, sentinel});
    if (pid == 0) {
      if (err[0] >= 0) ::close(err[0]);
      ::close(out[0]);
      detail::run_child(r, n, options, port, result.token, out[1], err[1], exits, sentinel, streams, body, launcher);
    }
    pids[static_cast<std::size_t>(r)] = pid;
    ::close(sentinel);
    ::close(out[1]);
    auto& capture = result.ranks[static_cast<std::size_t>(r)].output;  // sized before the first fork
    streams.push_back({.fd = out[0], .target = forward ? STDOUT_FILENO : -1, .global = options.first_rank + r,
                       .capture = forward ? nullptr : &capture});
    if (forward) {
      ::close(err[1]);
      streams.push_back({.fd = err[0], .target = STDERR_FILENO, .global = options.first_rank + r});
    }
  }

  const auto deadline = options.timeout.count() > 0 ? clock::now() + options.timeout : clock::time_point::max();
  int running = n;
  // Reaps rank r if it has exited.
  const auto reap = [&](std::size_t r) {
    int status = 0;
    const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
    if (got == 0 || (got < 0 && errno != ECHILD)) return;
    pids[r] = -1;
    --running;
    exits.update();  // its sentinel hung up before it could be reaped: number it, and any earlier, first
    exits.reaped(static_cast<int>(r));
    if (got < 0)
      result.ranks[r].unknown_status = true;  // ECHILD: SIGCHLD is ignored, the kernel reaped it
    else
      detail::record(result.ranks[r], status);
    result.ranks[r].ended = std::chrono::system_clock::now();
  };
  // The job's failure is the reaped failed rank whose exit began first, named once every rank whose
  // exit began before it has been reaped too (it may have failed as well), or a second after. A crash (a rank
  // killed by a signal no launcher sends) is blamed before an exit with an error whose exit began first: a
  // survivor may see the death through shared memory and exit before the victim's sentinel closes, so until the
  // second is over, every rank whose exit began is reaped before one that did not crash is named.
  std::optional<clock::time_point> blame_by;
  std::optional<clock::time_point> stop_at;  // when the ranks still running after a failure are stopped
  const auto crashed = [&](int r) {
    const auto& s = result.ranks[static_cast<std::size_t>(r)];
    return !s.stopped_by_launcher && detail::crash_signal(s.signal);
  };
  const auto blame = [&](clock::time_point now) {
    if (result.first_failed >= 0 || result.timed_out || result.interrupted_by != 0 || result.stopped_by_watch) return;
    int first = -1;
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<std::size_t>(r)] < 0 && !result.ranks[static_cast<std::size_t>(r)].ok() &&
          (first < 0 || (crashed(r) && !crashed(first)) ||
           (crashed(r) == crashed(first) && exits.began(r) < exits.began(first))))
        first = r;
    if (first < 0) return;
    if (!blame_by) blame_by = now + std::chrono::seconds(1);
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<std::size_t>(r)] > 0 && exits.began(r) != 0 &&
          (exits.began(r) < exits.began(first) || !crashed(first)) && now < *blame_by)
        return;
    result.first_failed = first;
  };
  constexpr int tick_ms = 20;  // how often deadlines, interrupts and exits without a SIGCHLD are looked at
  while (running > 0) {
    detail::pump(streams, tick_ms, exits.fd());
    if (options.interrupt != nullptr && *options.interrupt != 0 && result.interrupted_by == 0) {
      result.interrupted_by = static_cast<int>(*options.interrupt);  // before reaping: ^C also hit the ranks
      stop_all();
    }
    exits.update();  // first: every rank reaped below has its exit numbered
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0) reap(r);
    blame(clock::now());
    if (options.watch && !result.stopped_by_watch && options.watch(result)) {
      result.stopped_by_watch = result.first_failed < 0;  // a failure here already names its own rank
      stop_all();
    }
    const auto now = clock::now();
    if (result.first_failed >= 0 && options.stop_on_failure) {
      if (!stop_at) stop_at = now + options.settle;
      if (now >= *stop_at) stop_all();
    }
    if (now >= deadline && running > 0 && !result.timed_out && !kill_at) {
      result.timed_out = true;
      stop_all();
    }
    if (kill_at && now >= *kill_at)
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
  }
  // Everyone has exited: take what is left in the pipes (a grandchild holding a pipe open gets 200 ms).
  const auto drain_until = clock::now() + std::chrono::milliseconds(200);
  while (std::any_of(streams.begin(), streams.end(), [](const detail::stream& s) { return s.fd >= 0; }) &&
         clock::now() < drain_until)
    detail::pump(streams, tick_ms);
  for (auto& s : streams) detail::finish(s);
  return result;
}

/// Spawns `n` copies of the program argv[0] (looked up in PATH) with arguments argv[1..], each with
/// the ranks' environment; a program that cannot be started exits 127 with the reason on its stderr.
inline spawn_result spawn_program(int n, const std::vector<std::string>& argv, const spawn_options& options = {}) {
  if (argv.empty() || argv.front().empty())
    throw ddp::config_error("spawn_program needs a program to run; pass its name and arguments");
  return spawn(
      n,
      [&argv](int) {
        std::vector<char*> args;
        args.reserve(argv.size() + 1);
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        ::execvp(args[0], args.data());
        const int code = errno;
        const std::string msg = "cannot run '" + argv.front() + "': " + std::strerror(code) +
                                "; check the program's name, PATH and permissions\n";
        detail::write_all(STDERR_FILENO, msg);
        ::_exit(127);
      },
      options);
}

}  // namespace ddp::launch

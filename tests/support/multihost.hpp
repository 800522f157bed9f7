#pragma once
// Multi-host tests: run one shell command on each of H simulated hosts (tests/support/multihost.sh: network,
// PID, IPC, UTS and mount namespaces, a bridge, optional rate limit, always cleaned up) and read back every
// host's output, exit status and end time.
//
//   ddp::testing::require_hosts();  // not root, no `ip netns`: prints why and exits 77 (ctest: skipped)
//   auto hosts = ddp::testing::run_on_hosts({.hosts = 2}, "ddp-launch --node-rank $MH_HOST ...");
//   REQUIRE(hosts.ok());

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#ifndef DDP_MULTIHOST_SCRIPT
#error "DDP_MULTIHOST_SCRIPT must name tests/support/multihost.sh (tests/multihost/CMakeLists.txt defines it)"
#endif

namespace ddp::testing {

/// How to simulate the hosts.
struct host_options {
  int hosts = 2;              ///< number of hosts, 10.200.0.1 .. 10.200.0.H on eth0
  int nets = 1;               ///< interfaces per host: eth<k> on 10.200.<k>.0/24, one bridge each
  std::string rate;           ///< tc tbf rate of every host's outgoing traffic ("1gbit"); empty: no limit
  int timeout_s = 45;         ///< every host's command is killed after this (status 124)
};

/// How one host's command ended.
struct host_result {
  int status = -1;            ///< its exit status (124: killed at the timeout)
  std::string output;         ///< its stdout and stderr
  double ended = 0;           ///< when it ended, seconds since the epoch
};

/// Every host's result.
struct hosts_result {
  int status = -1;                ///< the script's exit status
  std::vector<host_result> hosts; ///< by host index

  /// Every host's command exited with 0.
  [[nodiscard]] bool ok() const {
    if (status != 0) return false;
    for (const auto& h : hosts)
      if (h.status != 0) return false;
    return true;
  }
  /// Every host's status and output, for failure messages.
  [[nodiscard]] std::string describe() const {
    std::string s = "multihost.sh exited with " + std::to_string(status) + "\n";
    for (std::size_t i = 0; i < hosts.size(); ++i)
      s += "--- host " + std::to_string(i) + " (status " + std::to_string(hosts[i].status) + ")\n" + hosts[i].output;
    return s;
  }
};

namespace detail {

/// Runs `argv` and returns its exit status (-1 when it could not run or a signal ended it).
inline int run_script(const std::vector<std::string>& argv) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace detail

/// Where hosts cannot be simulated (not root, no `ip netns`, no unshare): prints why and exits with 77, which
/// ctest reports as "Skipped" (never a pass); DDP_MULTIHOST_REQUIRED=1 makes the script fail instead.
inline void require_hosts() {
  const int status = detail::run_script({"bash", DDP_MULTIHOST_SCRIPT, "--check"});
  if (status == 0) return;
  std::fprintf(stderr, status == 77 ? "the multihost tests cannot run here (see the line above); ctest reports them "
                                      "as not run (Skipped)\n"
                                    : "the multihost tests cannot run here (see the line above), and "
                                      "DDP_MULTIHOST_REQUIRED=1 makes that a failure\n");
  std::exit(status == 77 ? 77 : 1);
}

/// Runs `command` (sh -c) on every host at once (MH_HOST, MH_HOSTS, MH_MASTER and DDP_TOKEN in its environment)
/// and returns how each ended. The namespaces are gone when it returns, whatever happened.
inline hosts_result run_on_hosts(const host_options& o, const std::string& command) {
  require_hosts();
  char templ[] = "/tmp/ddp-multihost-XXXXXX";
  REQUIRE(::mkdtemp(templ) != nullptr);
  const std::filesystem::path out = templ;
  hosts_result r;
  r.status = detail::run_script({"bash", DDP_MULTIHOST_SCRIPT, "--hosts", std::to_string(o.hosts), "--nets",
                                 std::to_string(o.nets), "--timeout", std::to_string(o.timeout_s), "--out",
                                 out.string(), "--rate", o.rate, "--", command});
  for (int i = 0; i < o.hosts; ++i) {
    const std::string base = "host" + std::to_string(i);
    host_result h;
    h.output = detail::read_text(out / (base + ".log"));
    const std::string status = detail::read_text(out / (base + ".status"));
    const std::string ended = detail::read_text(out / (base + ".end"));
    h.status = status.empty() ? -1 : std::atoi(status.c_str());
    h.ended = ended.empty() ? 0 : std::atof(ended.c_str());
    r.hosts.push_back(std::move(h));
  }
  std::error_code ec;
  std::filesystem::remove_all(out, ec);
  return r;
}

}  // namespace ddp::testing

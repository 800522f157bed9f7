#pragma once
/// \file Rank binding for the local launcher: which CPUs each rank may run on (like mpirun's --bind-to).
///
/// The machine's topology is read from /sys (hardware threads grouped into physical cores, cores into
/// NUMA nodes), limited to the CPUs the launcher itself may use (its affinity: taskset, cgroups, a batch
/// system's allocation). `core` gives each rank a contiguous block of whole physical cores (hyperthreads
/// stay with their core) when there are at least as many cores as ranks, and binds nothing otherwise, since
/// pinning oversubscribed ranks only makes them wait on each other; `numa` gives each rank the CPUs of one
/// NUMA node (ranks spread over the nodes in blocks, several ranks sharing a node when there are more ranks
/// than nodes).

#include <sched.h>

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/core/error.hpp>

namespace ddp::launch {

/// How ranks are bound to CPUs.
enum class bind_mode {
  none,  ///< every rank may run anywhere the launcher may
  core,  ///< each rank gets its own whole physical cores (the default when ranks <= cores)
  numa,  ///< each rank gets the CPUs of one NUMA node
};

/// One hardware thread (logical CPU) and where it sits.
struct cpu_place {
  int cpu = 0;   ///< the logical CPU number
  int core = 0;  ///< its physical core (hardware threads of one core share it), unique across packages
  int node = 0;  ///< its NUMA node
};

/// The CPUs ranks may be bound to.
using topology = std::vector<cpu_place>;

/// The CPUs of each rank (empty: not bound) and one line telling what was chosen.
struct binding_plan {
  std::vector<std::vector<int>> cpus;  ///< per rank, ascending
  std::string summary;                 ///< e.g. "bound to cores: rank 0 on CPUs 0-1, rank 1 on CPUs 2-3"
};

namespace detail {

/// "0-3,8,10-11": Linux's CPU list format.
inline std::vector<int> parse_cpu_list(std::string_view text) {
  std::vector<int> out;
  std::stringstream in{std::string(text)};
  std::string part;
  while (std::getline(in, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == ' ' || c == '\n'; }), part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    const int lo = std::stoi(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  return out;
}

/// The inverse of parse_cpu_list for an ascending list.
inline std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(cpus[j]);
    }
    i = j + 1;
  }
  return out;
}

inline std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

/// Blocks of `items` for `n` ranks: rank r gets items [r*k/n, (r+1)*k/n) — sizes differ by at most one.
template <class T>
std::vector<std::vector<T>> split_in_blocks(const std::vector<T>& items, int n) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  const std::size_t k = items.size(), ranks = static_cast<std::size_t>(n);
  for (std::size_t r = 0; r < ranks; ++r)
    out[r].assign(items.begin() + static_cast<long>(r * k / ranks), items.begin() + static_cast<long>((r + 1) * k / ranks));
  return out;
}

}  // namespace detail

/// The CPUs this process may run on, with their cores and NUMA nodes read from /sys.
inline topology read_topology() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  std::vector<int> node_of(CPU_SETSIZE, 0);
  for (int node = 0; node < 4096; ++node) {
    const std::string list = detail::read_line("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (list.empty()) {
      if (node > 0 && detail::read_line("/sys/devices/system/node/node" + std::to_string(node + 1) + "/cpulist").empty())
        break;  // node numbers may have holes; two missing in a row end the scan
      continue;
    }
    for (const int c : detail::parse_cpu_list(list))
      if (c >= 0 && c < CPU_SETSIZE) node_of[static_cast<std::size_t>(c)] = node;
  }
  topology t;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &allowed)) continue;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    // The first hardware thread of the core names it: unique across packages, unlike core_id.
    const auto siblings = detail::parse_cpu_list(detail::read_line(base + "thread_siblings_list"));
    t.push_back({c, siblings.empty() ? c : siblings.front(), node_of[static_cast<std::size_t>(c)]});
  }
  return t;
}

/// Which CPUs each of `n` ranks gets under `mode` on `machine`.
inline binding_plan plan_binding(bind_mode mode, int n, const topology& machine) {
  if (n < 1) throw config_error("plan_binding needs at least one rank, got n = " + std::to_string(n));
  binding_plan plan;
  plan.cpus.resize(static_cast<std::size_t>(n));
  std::vector<int> groups;  // cores (core) or nodes (numa), in the order of their first CPU
  for (const auto& p : machine) {
    const int g = mode == bind_mode::numa ? p.node : p.core;
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  const char* what = mode == bind_mode::numa ? "NUMA nodes" : "cores";
  if (mode == bind_mode::none) {
    plan.summary = "not binding ranks (--bind none)";
    return plan;
  }
  const std::size_t can_take = mode == bind_mode::numa ? machine.size() : groups.size();
  if (machine.empty() || static_cast<std::size_t>(n) > can_take) {
    plan.summary = "not binding ranks: " + std::to_string(n) + " ranks on " + std::to_string(can_take) + " " +
                   (mode == bind_mode::numa ? "CPUs" : what) + " would share them (oversubscribed)";
    return plan;
  }
  // numa: every rank gets a whole node (ranks in blocks over the nodes); core: a block of whole cores.
  const auto blocks = mode == bind_mode::numa ? std::vector<std::vector<int>>{} : detail::split_in_blocks(groups, n);
  plan.summary = std::string("bound to ") + what + ":";
  for (int r = 0; r < n; ++r) {
    const auto rank = static_cast<std::size_t>(r);
    std::set<int> mine;
    if (mode == bind_mode::numa)
      mine.insert(groups[rank * groups.size() / static_cast<std::size_t>(n)]);
    else
      mine.insert(blocks[rank].begin(), blocks[rank].end());
    for (const auto& p : machine)
      if (mine.count(mode == bind_mode::numa ? p.node : p.core)) plan.cpus[rank].push_back(p.cpu);
    std::sort(plan.cpus[rank].begin(), plan.cpus[rank].end());
    plan.summary += r ? ", rank " : " rank ";
    plan.summary += std::to_string(r);
    plan.summary += " on CPUs ";
    plan.summary += detail::format_cpu_list(plan.cpus[rank]);
  }
  return plan;
}

/// Binds the calling process to `cpus` (nothing when empty); false when the kernel refused.
inline bool bind_to(const std::vector<int>& cpus) noexcept {
  if (cpus.empty()) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return ::sched_setaffinity(0, sizeof set, &set) == 0;
}

}  // namespace ddp::launch

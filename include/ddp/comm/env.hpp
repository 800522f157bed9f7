#pragma once
/// \file Reading a rank's place in the job from the environment: torchrun's env:// variables, else Open MPI's
/// (mpirun), else Slurm's (srun), which has no MASTER_ADDR: rank 0's host is the first of the step's nodes.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <ddp/core/error.hpp>

namespace ddp {

/// Where this process sits in the job, as the launcher described it.
struct env_config {
  int rank = 0;                     ///< RANK (or OMPI_COMM_WORLD_RANK, or SLURM_PROCID)
  int world_size = 1;               ///< WORLD_SIZE (or OMPI_COMM_WORLD_SIZE, or SLURM_NTASKS)
  int local_rank = 0;               ///< LOCAL_RANK (or OMPI_COMM_WORLD_LOCAL_RANK, or SLURM_LOCALID), 0 if unset
  int local_world_size = 1;         ///< LOCAL_WORLD_SIZE (or OMPI_COMM_WORLD_LOCAL_SIZE, or this node's count in
                                    ///< SLURM_STEP_TASKS_PER_NODE), world_size if unset
  std::string master_addr = "127.0.0.1";  ///< MASTER_ADDR, or under srun the step's first node; 127.0.0.1 if unset
  std::uint16_t master_port = 29500;      ///< MASTER_PORT, or under srun 20000 + SLURM_JOB_ID % 20000; 29500 if unset
};

namespace detail {

inline std::optional<std::string> env_string(const char* name) {
  const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read once at start-up
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

/// An integer variable in [lo, hi]; `why` tells the user what the variable is for.
inline std::optional<long long> env_integer(const char* name, long long lo, long long hi, std::string_view why) {
  const auto text = env_string(name);
  if (!text) return std::nullopt;
  long long value = 0;
  const auto* end = text->data() + text->size();
  const auto [ptr, ec] = std::from_chars(text->data(), end, value);
  if (ec != std::errc{} || ptr != end || value < lo || value > hi)
    throw config_error("environment variable " + std::string(name) + "='" + *text + "' is not an integer in [" +
                       std::to_string(lo) + ", " + std::to_string(hi) + "]; set it to " + std::string(why));
  return value;
}

/// A variable that names one of `choices` (its spelling, its value); `why` tells the user what it sets, and the
/// error names `rank` where given.
template <class T, std::size_t N>
std::optional<T> env_choice(const char* name, const std::pair<std::string_view, T> (&choices)[N], std::string_view why,
                            int rank = -1) {
  const auto text = env_string(name);
  if (!text) return std::nullopt;
  std::string listed;
  for (std::size_t i = 0; i < N; ++i) {
    if (*text == choices[i].first) return choices[i].second;
    listed += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(choices[i].first);
  }
  throw config_error("environment variable " + std::string(name) + "='" + *text + "' is not " + listed + "; set it to " +
                         std::string(why),
                     rank);
}

/// The first of the launchers' variables that is set: torchrun's name, Open MPI's, then (where the process is a
/// task of srun) Slurm's.
inline std::optional<long long> env_integer_either(const char* name, const char* mpi_name, long long lo, long long hi,
                                                   std::string_view why, const char* slurm_name = nullptr) {
  if (auto v = env_integer(name, lo, hi, why)) return v;
  if (auto v = env_integer(mpi_name, lo, hi, why)) return v;
  return slurm_name ? env_integer(slurm_name, lo, hi, why) : std::nullopt;
}

/// The first host of a Slurm host list: "gpu[07-09,12],login1" gives "gpu07", "rack[1-2]-n[01-04]" "rack1-n01".
inline std::string first_slurm_host(std::string_view list) {
  std::string host;
  int depth = 0;
  bool skipping = false;  // inside brackets, past the first number or range
  for (const char c : list) {
    if (c == '[') {
      ++depth;
      skipping = false;
    } else if (c == ']') {
      --depth;
    } else if (depth > 0) {
      if (c == '-' || c == ',') skipping = true;
      else if (!skipping) host += c;
    } else if (c == ',') {
      break;
    } else {
      host += c;
    }
  }
  return host;
}

/// The tasks on node `node` (0-based) of a Slurm tasks-per-node list such as "4(x2),3" (nodes 0 and 1 run 4, node
/// 2 runs 3); nothing where the list is malformed or shorter.
inline std::optional<long long> slurm_tasks_on(std::string_view list, long long node) {
  while (!list.empty()) {
    const std::size_t comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    long long tasks = 0, repeat = 1;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), tasks);
    if (ec != std::errc{}) return std::nullopt;
    item.remove_prefix(static_cast<std::size_t>(end - item.data()));
    if (!item.empty()) {
      if (!item.starts_with("(x") || !item.ends_with(")")) return std::nullopt;
      item = item.substr(2, item.size() - 3);
      const auto [rend, rec] = std::from_chars(item.data(), item.data() + item.size(), repeat);
      if (rec != std::errc{} || rend != item.data() + item.size()) return std::nullopt;
    }
    if (node < repeat) return tasks;
    node -= repeat;
  }
  return std::nullopt;
}

/// True in a task srun started (SLURM_PROCID set) that no other launcher describes: salloc and sbatch shells have
/// some of Slurm's variables too, describing the allocation rather than this process.
inline bool started_by_srun() {
  return env_string("SLURM_PROCID").has_value() && !env_string("RANK") && !env_string("OMPI_COMM_WORLD_RANK");
}

/// The processes on this host: LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, or under srun this node's count in
/// SLURM_STEP_TASKS_PER_NODE; nothing where none says.
inline std::optional<long long> env_local_world_size() {
  constexpr long long max_ranks = 1 << 20;
  if (auto v = env_integer_either("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1, max_ranks,
                                  "the number of processes on this host"))
    return v;
  if (!started_by_srun()) return std::nullopt;
  const auto list = env_string("SLURM_STEP_TASKS_PER_NODE");
  if (!list) return std::nullopt;
  const auto node = env_integer("SLURM_NODEID", 0, max_ranks - 1, "this task's node in the step (srun sets it)");
  if (!node)
    throw config_error("SLURM_STEP_TASKS_PER_NODE is set but SLURM_NODEID is not: ddp cannot tell how many tasks "
                       "run on this node; start the task with srun, which sets both, or set LOCAL_WORLD_SIZE");
  if (auto tasks = slurm_tasks_on(*list, *node)) return tasks;
  throw config_error("SLURM_STEP_TASKS_PER_NODE='" + *list + "' has no entry for SLURM_NODEID=" +
                     std::to_string(*node) + " (expected counts such as '4(x2),3'); start the task with srun, which "
                     "sets both, or set LOCAL_WORLD_SIZE");
}

}  // namespace detail

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (Open MPI's
/// OMPI_COMM_WORLD_* stand in for the first four, then Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
/// SLURM_STEP_TASKS_PER_NODE; under srun rank 0's host is the first of SLURM_STEP_NODELIST and its port 20000 +
/// SLURM_JOB_ID % 20000); throws ddp::config_error naming the variable and the fix.
inline env_config read_env_config() {
  constexpr long long max_ranks = 1 << 20;
  env_config c;
  const bool srun = detail::started_by_srun();
  const auto world = detail::env_integer_either("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", 1, max_ranks,
                                                "the number of processes in the job (torchrun, mpirun, srun and "
                                                "ddp-launch set it)",
                                                srun ? "SLURM_NTASKS" : nullptr);
  const auto rank = detail::env_integer_either("RANK", "OMPI_COMM_WORLD_RANK", 0, max_ranks - 1,
                                               "this process's rank in 0..WORLD_SIZE-1", srun ? "SLURM_PROCID" : nullptr);
  if (srun && !world)
    throw config_error("SLURM_PROCID is set but SLURM_NTASKS is not: under srun the job's size comes from "
                       "SLURM_NTASKS (srun sets it); start the task with srun, or export WORLD_SIZE");
  if (!world || !rank)
    throw config_error(std::string("environment variable ") + (!rank ? "RANK" : "WORLD_SIZE") +
                       " is not set; start the job with ddp-launch -n N, torchrun, mpirun or srun, or export RANK "
                       "and WORLD_SIZE (plus MASTER_ADDR and MASTER_PORT) yourself");
  c.world_size = static_cast<int>(*world);
  c.rank = static_cast<int>(*rank);
  if (c.rank >= c.world_size)
    throw config_error("RANK=" + std::to_string(c.rank) + " is not below WORLD_SIZE=" + std::to_string(c.world_size) +
                           "; ranks run from 0 to WORLD_SIZE-1",
                       c.rank);
  c.local_rank = static_cast<int>(detail::env_integer_either("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", 0,
                                                             max_ranks - 1, "this process's rank on its host",
                                                             srun ? "SLURM_LOCALID" : nullptr)
                                      .value_or(0));
  c.local_world_size = static_cast<int>(detail::env_local_world_size().value_or(c.world_size));
  if (c.local_rank >= c.local_world_size)
    throw config_error("LOCAL_RANK=" + std::to_string(c.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                           std::to_string(c.local_world_size) + "; fix the launcher's per-host settings",
                       c.rank);
  if (auto addr = detail::env_string("MASTER_ADDR"))
    c.master_addr = *addr;
  else if (auto nodes = srun ? detail::env_string("SLURM_STEP_NODELIST") : std::nullopt)
    c.master_addr = detail::first_slurm_host(*nodes);
  if (auto port = detail::env_integer("MASTER_PORT", 0, 65535, "the TCP port rank 0 listens on (0..65535)"))
    c.master_port = static_cast<std::uint16_t>(*port);
  else if (auto job = srun ? detail::env_integer("SLURM_JOB_ID", 0, (1LL << 62), "the Slurm job's id") : std::nullopt)
    c.master_port = static_cast<std::uint16_t>(20000 + *job % 20000);  // apart for jobs sharing a node
  return c;
}

}  // namespace ddp

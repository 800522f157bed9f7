#pragma once
/// \file Reading a rank's place in the job from the environment (torchrun's env:// and Open MPI's variables).

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
  int rank = 0;                     ///< RANK (or OMPI_COMM_WORLD_RANK)
  int world_size = 1;               ///< WORLD_SIZE (or OMPI_COMM_WORLD_SIZE)
  int local_rank = 0;               ///< LOCAL_RANK (or OMPI_COMM_WORLD_LOCAL_RANK), 0 if unset
  int local_world_size = 1;         ///< LOCAL_WORLD_SIZE (or OMPI_COMM_WORLD_LOCAL_SIZE), world_size if unset
  std::string master_addr = "127.0.0.1";  ///< MASTER_ADDR, 127.0.0.1 if unset
  std::uint16_t master_port = 29500;      ///< MASTER_PORT, 29500 if unset
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

/// The first of two variables that is set (the torchrun name, then Open MPI's).
inline std::optional<long long> env_integer_either(const char* name, const char* mpi_name, long long lo, long long hi,
                                                   std::string_view why) {
  if (auto v = env_integer(name, lo, hi, why)) return v;
  return env_integer(mpi_name, lo, hi, why);
}

}  // namespace detail

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (Open MPI's
/// OMPI_COMM_WORLD_* stand in for the first four); throws ddp::config_error naming the variable and the fix.
inline env_config read_env_config() {
  constexpr long long max_ranks = 1 << 20;
  env_config c;
  const auto world = detail::env_integer_either("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", 1, max_ranks,
                                                "the number of processes in the job (torchrun, mpirun and "
                                                "ddp-launch set it)");
  const auto rank = detail::env_integer_either("RANK", "OMPI_COMM_WORLD_RANK", 0, max_ranks - 1,
                                               "this process's rank in 0..WORLD_SIZE-1");
  if (!world || !rank)
    throw config_error(std::string("environment variable ") + (!rank ? "RANK" : "WORLD_SIZE") +
                       " is not set; start the job with ddp-launch -n N, torchrun or mpirun, or export RANK and "
                       "WORLD_SIZE (plus MASTER_ADDR and MASTER_PORT) yourself");
  c.world_size = static_cast<int>(*world);
  c.rank = static_cast<int>(*rank);
  if (c.rank >= c.world_size)
    throw config_error("RANK=" + std::to_string(c.rank) + " is not below WORLD_SIZE=" + std::to_string(c.world_size) +
                           "; ranks run from 0 to WORLD_SIZE-1",
                       c.rank);
  c.local_rank = static_cast<int>(detail::env_integer_either("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", 0,
                                                             max_ranks - 1, "this process's rank on its host")
                                      .value_or(0));
  c.local_world_size = static_cast<int>(detail::env_integer_either("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1,
                                                                   max_ranks, "the number of processes on this host")
                                            .value_or(c.world_size));
  if (c.local_rank >= c.local_world_size)
    throw config_error("LOCAL_RANK=" + std::to_string(c.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                           std::to_string(c.local_world_size) + "; fix the launcher's per-host settings",
                       c.rank);
  if (auto addr = detail::env_string("MASTER_ADDR")) c.master_addr = *addr;
  if (auto port = detail::env_integer("MASTER_PORT", 0, 65535, "the TCP port rank 0 listens on (0..65535)"))
    c.master_port = static_cast<std::uint16_t>(*port);
  return c;
}

}  // namespace ddp

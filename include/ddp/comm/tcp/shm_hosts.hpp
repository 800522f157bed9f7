#pragma once
/// \file Which ranks of a job share a host, and what a group spanning hosts makes of it. The rendezvous leaves
/// the job's shared memory as shm_hosts: this host's segment and each world rank's host. A group with every
/// member on this host runs over one segment of its own; a group spanning hosts with two members or more on
/// some host gets a host_plan: its members on this host (over their own segment) and one member per host
/// that speaks for it over the sockets (hierarchical.hpp runs the collectives).

#include <cstdint>
#include <memory>
#include <vector>

#include <ddp/comm/tcp/shm_group.hpp>
#include <ddp/comm/tcp/shm_world.hpp>

namespace ddp::tcp::detail {

/// The job's shared memory as the rendezvous left it (absent where any rank cannot use it, or DDP_SHM=0).
struct shm_hosts {
  /// This host's segment (the job's only one where every rank is on this host); null where this rank is its
  /// host's only rank.
  std::shared_ptr<shm_world> segment;
  /// Per world rank, its host: the lowest world rank on the same host.
  std::vector<int> host_of;
};

/// A group spanning hosts, with two members or more on some host: its hosts in the order of their lowest group
/// rank, and this rank's host's members.
struct host_plan {
  std::vector<int> host_of;        ///< per group rank, the index of its host
  std::vector<int> leads;          ///< per host, its lowest group rank
  std::vector<int> lead_world;     ///< per host, its lowest group rank's world rank
  std::vector<int> by_host;        ///< the group ranks by host (in host order), ascending within each
  std::vector<int> host_start;     ///< where host j's ranks start in `by_host` (one more entry: the group's size)
  std::vector<int> local;          ///< the group ranks on this rank's host, ascending
  int me_local = 0;                ///< this rank's place in `local`
  std::shared_ptr<shm_group> shm;  ///< `local`'s segment; null where this rank is its host's only member
  std::uint32_t across = 0;        ///< the group id the frames of the steps across hosts carry

  /// The number of hosts the group spans.
  [[nodiscard]] int hosts() const { return static_cast<int>(leads.size()); }
  /// The number of group ranks on host `j`.
  [[nodiscard]] int ranks_on(int j) const {
    return host_start[static_cast<std::size_t>(j) + 1] - host_start[static_cast<std::size_t>(j)];
  }
  /// The index of this rank's host.
  [[nodiscard]] int host() const { return host_of[static_cast<std::size_t>(local.front())]; }
  /// The place in `local` of group rank `r`, which is on this host.
  [[nodiscard]] int local_index(int r) const {
    int i = 0;
    while (local[static_cast<std::size_t>(i)] != r) ++i;
    return i;
  }
};

}  // namespace ddp::tcp::detail

#pragma once
/// \file Collectives of a group spanning hosts with two members or more on some host (shm_hosts.hpp): shared
/// memory inside each host, the sockets across them, so each host's bytes cross its link once. all_reduce:
/// the members of each host reduce into their lowest (shm_reduce, in group-rank order), these leads all-reduce
/// over the sockets (all_reduce: one member per host, in host order), and each lead broadcasts the result to
/// its host (shm_broadcast); avg divides once at the end, by the group's size. broadcast: the root sends to the
/// lead of every other host over the sockets (broadcast), and each of them, or the root on its own host,
/// broadcasts it inside its host. The other collectives run over the sockets as in a group without shared
/// memory. Every step runs on the engine thread: the shared-memory steps serve the sockets between their
/// sleeps, and a death on either transport fails the call as it fails a flat one.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/tcp/algorithms.hpp>
#include <ddp/comm/tcp/call.hpp>
#include <ddp/comm/tcp/channel.hpp>
#include <ddp/comm/tcp/engine.hpp>
#include <ddp/comm/tcp/reduce.hpp>
#include <ddp/comm/tcp/shm_algorithms.hpp>
#include <ddp/comm/tcp/shm_channel.hpp>
#include <ddp/comm/tcp/shm_hosts.hpp>

namespace ddp::tcp::detail {

/// A group identifier all members compute alike from (parent id, split number, color).
inline std::uint32_t mix_id(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (const std::uint64_t v : {a, b, c}) {
    h = (h ^ v) * 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
  }
  return static_cast<std::uint32_t>(h) | 1U;  // 0 stays unused
}

/// Gives group `g` (its members, place and id set) its share of the job's shared memory `hosts`: one segment
/// for the whole group where every member is on this host; a host_plan where it spans hosts and some host
/// holds two members or more; else nothing (the sockets carry everything).
inline void use_shared_memory(group& g, std::shared_ptr<const shm_hosts> hosts) {
  g.hosts = std::move(hosts);
  if (!g.hosts || g.size() < 2) return;
  auto plan = std::make_shared<host_plan>();
  for (int r = 0; r < g.size(); ++r) {
    const int host = g.hosts->host_of[static_cast<std::size_t>(g.members[static_cast<std::size_t>(r)])];
    int k = 0;
    while (k < plan->hosts() && g.hosts->host_of[static_cast<std::size_t>(plan->lead_world[static_cast<std::size_t>(k)])] != host) ++k;
    if (k == plan->hosts()) {
      plan->leads.push_back(r);
      plan->lead_world.push_back(g.members[static_cast<std::size_t>(r)]);
    }
    plan->host_of.push_back(k);
  }
  if (plan->hosts() == 1) {  // every member on this host
    if (g.hosts->segment) g.shm = std::make_shared<shm_group>(g.hosts->segment, g.id, g.members, g.me);
    return;
  }
  if (plan->hosts() == g.size()) return;  // one member per host: nothing to share
  const int mine = plan->host_of[static_cast<std::size_t>(g.me)];
  std::vector<int> world;
  for (int r = 0; r < g.size(); ++r) {
    if (plan->host_of[static_cast<std::size_t>(r)] != mine) continue;
    if (r == g.me) plan->me_local = static_cast<int>(plan->local.size());
    plan->local.push_back(r);
    world.push_back(g.members[static_cast<std::size_t>(r)]);
  }
  if (world.size() > 1)
    plan->shm = std::make_shared<shm_group>(g.hosts->segment, mix_id(g.id, 0x686f7374, static_cast<std::uint64_t>(world.front())),
                                            std::move(world), plan->me_local, plan->local);
  g.hier = std::move(plan);
}

/// Call `c` as its partial steps run it: avg sums (the whole call divides once, at the end).
inline call partial_step(const call& c) {
  call step = c;
  if (step.op == reduce_op::avg) step.op = reduce_op::sum;
  return step;
}

/// Runs shared-memory step `f(shm_channel&)` of `step` among this host's members of the group, on the engine
/// thread, serving the sockets between its sleeps.
template <class F>
void on_this_host(engine& e, const call& step, host_plan& p, F f) {
  shm_waiting how;
  how.slice = std::chrono::milliseconds(1);
  how.spin = p.shm->oversubscribed() ? std::chrono::nanoseconds(0) : how.spin;
  how.between = [&e] { e.serve_sockets(); };
  // One slice past the call's deadline, as run_shm_on_engine gives: wait() gives up first.
  shm_channel ch(*p.shm, step, e.deadline() + how.slice, std::move(how));
  f(ch);
}

/// all_reduce: reduce into each host's lead, all_reduce among the leads, broadcast inside each host.
inline void hierarchical_all_reduce(engine& e, call& c, host_plan& p) {
  call step = partial_step(c);
  step.root = 0;  // the lead, in `local`
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_reduce(ch); });
  if (p.me_local == 0) {
    channel ch(e, step, p.lead_world, p.host());
    all_reduce(ch);
  }
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
  finish_avg_bytes(c.type, c.out, c.count, c.op, c.grp->size());
}

/// broadcast: from the root to the lead of every other host, then inside each host.
inline void hierarchical_broadcast(engine& e, call& c, host_plan& p) {
  const int root_host = p.host_of[static_cast<std::size_t>(c.root)];
  const int speaker = p.host() == root_host ? c.root : p.leads[static_cast<std::size_t>(p.host())];
  call step = c;
  if (c.grp->me == speaker) {
    std::vector<int> speakers = p.lead_world;
    speakers[static_cast<std::size_t>(root_host)] = c.grp->members[static_cast<std::size_t>(c.root)];
    step.root = root_host;
    channel ch(e, step, speakers, p.host());
    broadcast(ch);
  }
  step.root = p.local_index(speaker);
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
}

/// The engine's executor: runs collective call `c` on the engine thread, hierarchically where its group has a
/// host_plan and the collective a hierarchical algorithm.
inline void run_group_collective(engine& e, call& c) {
  host_plan* p = c.grp->hier.get();
  if (p == nullptr || c.count == 0) return run_collective(e, c);
  switch (c.kind) {
    case collective::all_reduce: return hierarchical_all_reduce(e, c, *p);
    case collective::broadcast: return hierarchical_broadcast(e, c, *p);
    default: return run_collective(e, c);
  }
}

}  // namespace ddp::tcp::detail

#pragma once
/// \file Collectives of a group spanning hosts with two members or more on some host (shm_hosts.hpp): shared
/// memory inside each host, the sockets across them, so each host's bytes cross its link once. all_reduce:
/// the members of each host reduce into their lowest (shm_reduce, in group-rank order), these leads all-reduce
/// over the sockets (all_reduce: one member per host, in host order), and each lead broadcasts the result to
/// its host (shm_broadcast); avg divides once at the end, by the group's size. broadcast: the root sends to the
/// lead of every other host over the sockets (broadcast), and each of them, or the root on its own host,
/// broadcasts it inside its host. all_gather: gather into each lead, the leads exchange their hosts' blocks,
/// each lead broadcasts the whole result inside its host. reduce_scatter: reduce into each lead, each lead
/// sends every other lead the partial sums of that host's blocks and sums what it receives in host order, each
/// lead scatters its host's blocks. reduce, gather, scatter, all_to_all and barrier run over the sockets as in
/// a group without shared memory. Every step runs on the engine thread: the shared-memory steps serve the
/// sockets between their sleeps, and a death on either transport fails the call as it fails a flat one.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
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

/// A group identifier all members compute alike from three numbers (a split's: parent id, split number, color).
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
  for (int j = 0; j < plan->hosts(); ++j) {
    plan->host_start.push_back(static_cast<int>(plan->by_host.size()));
    for (int r = 0; r < g.size(); ++r)
      if (plan->host_of[static_cast<std::size_t>(r)] == j) plan->by_host.push_back(r);
  }
  plan->host_start.push_back(g.size());
  const int mine = plan->host_of[static_cast<std::size_t>(g.me)];
  std::vector<int> world;
  for (int r = 0; r < g.size(); ++r) {
    if (plan->host_of[static_cast<std::size_t>(r)] != mine) continue;
    if (r == g.me) plan->me_local = static_cast<int>(plan->local.size());
    plan->local.push_back(r);
    world.push_back(g.members[static_cast<std::size_t>(r)]);
  }
  plan->across = mix_id(g.id, 0x61637273, 0);
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
  shm_waiting how = waiting_among(*p.shm);
  how.slice = std::chrono::milliseconds(1);
  how.longest_slice = std::chrono::milliseconds(8);  // a lead's sockets carry this call's bytes between hosts
  how.between = [&e] { e.serve_sockets(); };
  // One slice past the call's deadline, as run_shm_on_engine gives: wait() gives up first.
  shm_channel ch(*p.shm, step, e.deadline() + how.slice, std::move(how));
  f(ch);
}

/// Runs step `f(channel&)` of `step` over the sockets among `members`, one per host (world ranks, in host order).
template <class F>
void across_hosts(engine& e, const call& step, const host_plan& p, const std::vector<int>& members, F f) {
  call across = step;
  across.wire_group = p.across;
  channel ch(e, across, members, p.host());
  f(ch);
}

/// all_reduce: reduce into each host's lead, all_reduce among the leads, broadcast inside each host.
inline void hierarchical_all_reduce(engine& e, call& c, host_plan& p) {
  call step = partial_step(c);
  step.root = 0;  // the lead, in `local`
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_reduce(ch); });
  if (p.me_local == 0) across_hosts(e, step, p, p.lead_world, [](channel& ch) { all_reduce(ch); });
  step.op = c.op;  // no arithmetic: the description says avg, so a host's ranks calling avg and sum differ
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
    across_hosts(e, step, p, speakers, [](channel& ch) { broadcast(ch); });
  }
  step.root = p.local_index(speaker);
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
}

/// all_gather: gather into each host's lead, the leads exchange their hosts' blocks over the sockets, each lead
/// broadcasts the whole result inside its host.
inline void hierarchical_all_gather(engine& e, call& c, host_plan& p) {
  const std::size_t block = c.count * size_of(c.type), n = static_cast<std::size_t>(c.grp->size());
  const bool lead = p.me_local == 0;
  char* bundles = lead ? e.scratch(1, n * block) : nullptr;  // every host's blocks, host after host
  const auto bundle = [&](int j) { return bundles + static_cast<std::size_t>(p.host_start[static_cast<std::size_t>(j)]) * block; };
  call step = c;
  step.root = 0;  // the lead, in `local`
  step.out = lead ? bundle(p.host()) : nullptr;
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_gather(ch); });
  else std::memmove(bundle(p.host()), c.in, block);
  auto* out = static_cast<char*>(c.out);
  if (lead) {
    across_hosts(e, step, p, p.lead_world, [&](channel& ch) {
      thread_local std::vector<recv_part> parts;
      parts.clear();
      for (int j = 0; j < p.hosts(); ++j) {
        if (j == p.host()) continue;
        ch.send(j, bundle(p.host()), static_cast<std::size_t>(p.local.size()) * block);
        parts.push_back({j, bundle(j), static_cast<std::size_t>(p.ranks_on(j)) * block});
      }
      ch.recv_all(parts);
      ch.flush();
    });
    for (std::size_t i = 0; i < n; ++i) std::memcpy(out + static_cast<std::size_t>(p.by_host[i]) * block, bundles + i * block, block);
  }
  step.count = c.count * n;
  step.out = out;
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
}

/// reduce_scatter: reduce the whole input into each host's lead, the leads send each other lead the partial
/// blocks of its host's ranks over the sockets and sum what they receive in host order, each lead scatters its
/// host's blocks inside it.
inline void hierarchical_reduce_scatter(engine& e, call& c, host_plan& p) {
  const std::size_t block = c.count * size_of(c.type), n = static_cast<std::size_t>(c.grp->size());
  const bool lead = p.me_local == 0;
  const std::size_t here = p.local.size();
  char* sum = lead ? e.scratch(0, n * block) : nullptr;  // this host's partial sums of every block
  // Per other host j, its partial sums of this host's blocks; then the results, in `local` order.
  char* parts_in = lead ? e.scratch(1, static_cast<std::size_t>(p.hosts()) * here * block) : nullptr;
  const auto part = [&](int j, std::size_t i) { return parts_in + (static_cast<std::size_t>(j) * here + i) * block; };
  call step = partial_step(c);
  step.root = 0;  // the lead, in `local`
  step.count = c.count * n;
  if (lead) std::memcpy(sum, c.in, n * block);
  // shm_reduce only reads the buffer of a rank other than the root: the input stays untouched.
  step.out = lead ? sum : const_cast<void*>(c.in);
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_reduce(ch); });
  step.count = c.count;
  if (lead) {
    across_hosts(e, step, p, p.lead_world, [&](channel& ch) {
      for (int j = 0; j < p.hosts(); ++j)
        for (int k = p.host_start[static_cast<std::size_t>(j)]; j != p.host() && k < p.host_start[static_cast<std::size_t>(j) + 1]; ++k)
          ch.send(j, sum + static_cast<std::size_t>(p.by_host[static_cast<std::size_t>(k)]) * block, block);
      thread_local std::vector<recv_part> parts;
      for (std::size_t i = 0; i < here; ++i) {  // one frame from each other lead per block of this host
        parts.clear();
        for (int j = 0; j < p.hosts(); ++j)
          if (j != p.host()) parts.push_back({j, part(j, i), block});
        ch.recv_all(parts);
      }
      ch.flush();
    });
    const int me = p.host();
    for (std::size_t i = 0; i < here; ++i) {
      const char* own = sum + static_cast<std::size_t>(p.local[i]) * block;
      reduce_ranks(step, part(me, i), p.hosts(), c.count, [&](int j) { return j == me ? own : part(j, i); });
    }
  }
  step.in = lead ? part(p.host(), 0) : nullptr;
  step.out = c.out;
  step.op = c.op;  // no arithmetic: the description says avg, so a host's ranks calling avg and sum differ
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_scatter(ch); });
  else std::memcpy(c.out, part(p.host(), 0), block);
  finish_avg_bytes(c.type, c.out, c.count, c.op, c.grp->size());
}

/// The engine's executor: runs collective call `c` on the engine thread, hierarchically where its group has a
/// host_plan and the collective a hierarchical algorithm.
inline void run_group_collective(engine& e, call& c) {
  host_plan* p = c.grp->hier.get();
  if (p == nullptr || c.count == 0) return run_collective(e, c);
  switch (c.kind) {
    case collective::all_reduce: return hierarchical_all_reduce(e, c, *p);
    case collective::broadcast: return hierarchical_broadcast(e, c, *p);
    case collective::all_gather: return hierarchical_all_gather(e, c, *p);
    case collective::reduce_scatter: return hierarchical_reduce_scatter(e, c, *p);
    default: return run_collective(e, c);
  }
}

}  // namespace ddp::tcp::detail

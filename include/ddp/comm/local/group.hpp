#pragma once
/// \file A group of ddp::local's ranks and its rendezvous: collectives matched by their place in the group's order
/// (checked against the first rank's call), sends and recvs matched by (from, to, tag) in posting order, the
/// groups split() makes, and what a rank's departure does to the rendezvous still waiting for it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/call_check.hpp>
#include <ddp/comm/local/shares.hpp>
#include <ddp/comm/local/slot.hpp>
#include <ddp/comm/local/world.hpp>
#include <ddp/comm/reduce_op.hpp>

namespace ddp::local::detail {

/// A group: its members' world ranks and its rendezvous. Every field is guarded by the world's mutex.
struct group_state {
  /// The group of world ranks `ranks` (in group order) of `w`.
  group_state(std::shared_ptr<world> w, std::vector<int> ranks)
      : home(std::move(w)), members(std::move(ranks)), next(members.size()) {}

  std::shared_ptr<world> home;                           ///< the run's threads
  std::vector<int> members;                              ///< group rank -> world rank
  std::vector<std::uint64_t> next;                       ///< per group rank: its next collective's place in order
  std::map<std::uint64_t, std::shared_ptr<slot>> open;   ///< collectives some member has not reached yet
  using route = std::tuple<int, int, int>;               ///< (from, to, tag) in group ranks
  std::map<route, std::deque<std::shared_ptr<slot>>> sends, recvs;  ///< unmatched, in posting order
  std::map<std::pair<std::uint64_t, int>, std::pair<std::shared_ptr<group_state>, int>> children;  ///< split's
  std::vector<std::uint64_t> splits;                     ///< per group rank: split() calls so far

  /// Number of members.
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members.size()); }
  /// "rank 2", with its world rank where the group is a split one.
  [[nodiscard]] std::string label(int q) const {
    const int w = members[static_cast<std::size_t>(q)];
    return "rank " + std::to_string(q) + (size() == home->size() && w == q ? "" : " (world rank " + std::to_string(w) + ")");
  }
};

/// The whole world as a group.
inline std::shared_ptr<group_state> world_group(const std::shared_ptr<world>& w) {
  std::vector<int> ranks(static_cast<std::size_t>(w->size()));
  for (int r = 0; r < w->size(); ++r) ranks[static_cast<std::size_t>(r)] = r;
  auto g = std::make_shared<group_state>(w, std::move(ranks));
  g->splits.resize(g->members.size());
  std::lock_guard lock(w->mutex);
  w->groups.push_back(g);
  return g;
}

/// The fault of a rendezvous whose participant `q` (group rank) can no longer arrive or run its share.
inline fault lost_fault(const group_state& g, int q) {
  const member& m = g.home->members[static_cast<std::size_t>(g.members[static_cast<std::size_t>(q)])];
  return {fault::kind::lost, q,
          g.label(q) + " left the function ddp::local::run runs for it (it " + m.cause +
              ") before taking part; fix that rank's failure, or make every rank run the same collectives"};
}

/// Participant `index` (group rank `q`) arrives at `s` with `p`. The caller holds the world's mutex.
inline void arrive_at(group_state& g, slot& s, const std::shared_ptr<slot>& owner, int index, int q, const part& p,
                      bool owes) {
  const auto i = static_cast<std::size_t>(index);
  s.parts[i] = p;
  s.arrived[i] = 1;
  s.ranks[i] = q;
  s.owes[i] = owes ? 1 : 0;
  ++s.arrivals;
  if (owes) g.home->members[static_cast<std::size_t>(g.members[static_cast<std::size_t>(q)])].agenda.push_back({owner, index});
}

/// Rank `q` of `g` reaches its next collective `c` with `p`: the rendezvous of that place in the group's order,
/// made by the first rank to reach it; a different call there fails it for every participant.
inline std::shared_ptr<slot> arrive(group_state& g, int q, const ddp::detail::call_info& c, const part& p, reduce_op run) {
  world& w = *g.home;
  std::lock_guard lock(w.mutex);
  const std::uint64_t place = g.next[static_cast<std::size_t>(q)]++;
  auto& entry = g.open[place];
  if (!entry) entry = std::make_shared<slot>(g.size(), c, q, share_of(c.kind), run);
  const std::shared_ptr<slot> s = entry;
  if (ddp::detail::fingerprint(s->call) != ddp::detail::fingerprint(c))
    s->fail({fault::kind::mismatch, -1,
             g.label(s->first) + " called " + ddp::detail::describe_call(s->call) + " where " + g.label(q) +
                 " called " + ddp::detail::describe_call(c) +
                 "; every rank of the group must call the same collectives in the same order with the same counts, "
                 "dtypes, operators and roots"});
  arrive_at(g, *s, s, q, q, p, c.kind != collective::barrier && s->failure.what == fault::kind::none);
  for (int r = 0; r < g.size(); ++r)
    if (s->arrived[static_cast<std::size_t>(r)] == 0 && w.members[static_cast<std::size_t>(g.members[static_cast<std::size_t>(r)])].departed)
      s->fail(lost_fault(g, r));
  if (s->full()) g.open.erase(place);
  w.notify();
  return s;
}

/// Rank `q` of `g` posts a send (`c.receive()` false: `p.in`) or a recv (`p.out`) with peer c.peer and tag c.tag:
/// matched with the oldest unmatched opposite of the same route, else queued. The sender is participant 0 and has
/// no share; the receiver copies.
inline std::shared_ptr<slot> post(group_state& g, int q, const ddp::detail::call_info& c, const part& p) {
  world& w = *g.home;
  std::lock_guard lock(w.mutex);
  const bool receive = c.receive();
  const group_state::route way = receive ? group_state::route{c.peer, q, c.tag} : group_state::route{q, c.peer, c.tag};
  auto& mine = receive ? g.recvs[way] : g.sends[way];
  auto& theirs = receive ? g.sends[way] : g.recvs[way];
  std::shared_ptr<slot> s;
  if (!theirs.empty()) {
    s = theirs.front();
    theirs.pop_front();
    if (s->call.type != c.type || s->call.count != c.count) {
      const auto& send = receive ? s->call : c;
      const auto& recv = receive ? c : s->call;
      s->fail({fault::kind::mismatch, -1,
               g.label(std::get<0>(way)) + " sends " + std::to_string(send.count) + " " + std::string(to_string(send.type)) +
                   " with tag " + std::to_string(c.tag) + " where " + g.label(std::get<1>(way)) + " receives " +
                   std::to_string(recv.count) + " " + std::string(to_string(recv.type)) +
                   "; a recv must take the count and dtype of its send"});
    }
  } else {
    s = std::make_shared<slot>(2, c, q, share_of(collective::send_recv), reduce_op::sum);
    mine.push_back(s);
    if (w.members[static_cast<std::size_t>(g.members[static_cast<std::size_t>(c.peer)])].departed)
      s->fail(lost_fault(g, c.peer));
  }
  arrive_at(g, *s, s, receive ? 1 : 0, q, p, receive && s->failure.what == fault::kind::none);
  w.notify();
  return s;
}

/// Takes the unmatched send or recv `s` out of its queue: its rank gave up on it, and a later opposite must not
/// match it. The caller holds the world's mutex.
inline void withdraw(group_state& g, const std::shared_ptr<slot>& s) {
  for (auto* queues : {&g.sends, &g.recvs})
    for (auto& [way, waiting] : *queues) std::erase(waiting, s);
}

/// The group of `ranks` (group ranks of `g`, in their new order) that the `nth` split() of `g` makes for `color`:
/// the first member to ask makes it, the others find it.
inline std::shared_ptr<group_state> child_of(group_state& g, std::uint64_t nth, int color, const std::vector<int>& ranks) {
  world& w = *g.home;
  std::lock_guard lock(w.mutex);
  const auto key = std::make_pair(nth, color);
  auto it = g.children.find(key);
  if (it == g.children.end()) {
    std::vector<int> world_ranks;
    for (const int r : ranks) world_ranks.push_back(g.members[static_cast<std::size_t>(r)]);
    auto child = std::make_shared<group_state>(g.home, std::move(world_ranks));
    child->splits.resize(child->members.size());
    w.groups.push_back(child);
    it = g.children.emplace(key, std::make_pair(std::move(child), 0)).first;
  }
  auto made = it->second.first;
  if (++it->second.second == static_cast<int>(ranks.size())) g.children.erase(it);  // every member has it
  return made;
}

/// World rank `r` has left its function (it `cause`: "returned", "threw ..."): every rendezvous that still waits
/// for it fails, so its peers raise ddp::peer_lost instead of waiting out the timeout.
inline void depart(world& w, int r, std::string cause) {
  std::lock_guard lock(w.mutex);
  member& m = w.members[static_cast<std::size_t>(r)];
  m.departed = true;
  m.cause = std::move(cause);
  for (const auto& weak : w.groups) {
    const auto g = weak.lock();
    if (!g) continue;
    for (int q = 0; q < g->size(); ++q) {
      if (g->members[static_cast<std::size_t>(q)] != r) continue;
      for (auto& [place, s] : g->open)
        if (s->arrived[static_cast<std::size_t>(q)] == 0) s->fail(lost_fault(*g, q));
      for (auto* queues : {&g->sends, &g->recvs})
        for (auto& [way, waiting] : *queues)
          if (std::get<0>(way) == q || std::get<1>(way) == q)
            for (auto& s : waiting) s->fail(lost_fault(*g, q));
    }
  }
  for (auto& item : m.agenda) {
    const int q = item.at->ranks[static_cast<std::size_t>(item.index)];
    item.at->fail({fault::kind::lost, q, "rank " + std::to_string(q) + " left with its share of this call unrun (it " +
                                             m.cause + ")"});
  }
  m.agenda.clear();
  w.notify();
}

}  // namespace ddp::local::detail

#pragma once
/// \file ddp::detail::archetype_communicator: the least type that models ddp::communicator (declarations only,
/// never called), so the parallel room can check its concepts (comm_hook, sharding_strategy) with a static_assert
/// beside each type that models them, without naming a backend.

#include <ddp/comm/communicator.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>

namespace ddp::detail {

/// Declares every operation of ddp::communicator over any tensor; used only in unevaluated concept checks.
struct archetype_communicator {
  [[nodiscard]] int rank() const;
  [[nodiscard]] int size() const;
  archetype_communicator split(int color, int key);
  template <class T> work all_reduce(T&& t, reduce_op op);
  template <class I, class O> work reduce_scatter(I&& in, O&& out, reduce_op op);
  template <class I, class O> work all_gather(I&& in, O&& out);
  template <class T> work broadcast(T&& t, int root);
  template <class T> work reduce(T&& t, reduce_op op, int root);
  template <class I, class O> work gather(I&& in, O&& out, int root);
  template <class I, class O> work scatter(I&& in, O&& out, int root);
  template <class I, class O> work all_to_all(I&& in, O&& out);
  work barrier();
  template <class T> work send(T&& t, int peer, int tag);
  template <class T> work recv(T&& t, int peer, int tag);
  [[nodiscard]] comm_stats stats() const;
};
static_assert(communicator<archetype_communicator>,
              "ddp: archetype_communicator must declare every operation ddp::communicator requires; add the missing one.");

}  // namespace ddp::detail

#pragma once
/// \file The collective front end every backend shares: the public collective methods of ddp::communicator with
/// the argument checks, the description of each operation, sequence numbers, statistics, avg and the opt-in
/// cross-rank call check (DDP_CHECK_COLLECTIVES=1), calling the backend's starts.
///
/// A backend `B` derives from collective_front<B>, befriends it and implements, for checked arguments:
///   start_all_reduce(c, buffer, op), start_reduce_scatter(c, in, out, op), start_all_gather(c, in, out),
///   start_broadcast(c, buffer), start_reduce(c, buffer, op), start_gather(c, in, out),
///   start_scatter(c, in, out), start_all_to_all(c, in, out), start_barrier(c), start_send(c, buffer),
///   start_recv(c, buffer)   (c: the call_info; roots, peers and tags are c.peer and c.tag), each returning work;
/// rank(), size(), max_tag(), flight() (the group's flight recorder, null when off), `static constexpr front_duties duties`, and front() (a front_state shared by the
/// copies of a group) where a duty needs it. A public device() puts "on cuda:N" into the messages. Device tensors
/// reach the starts through host memory (comm/staging.hpp) unless a public moves_device_memory() returns true.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/call_check.hpp>
#include <ddp/comm/checks.hpp>
#include <ddp/comm/flight_recorder.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/staging.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::detail {

/// What the front end does for a backend beyond the argument checks; a backend that does a duty itself says false.
struct front_duties {
  std::string_view group = "a group";  ///< how messages name the group: "an MPI group"
  bool sequence = true;                ///< number every operation (front_state::sequence)
  bool stats = true;                   ///< count calls and the algorithm-independent payload bytes (front_state::stats)
  bool average = true;                 ///< run avg as sum and have the start divide call_info::average when done
  bool call_check = true;              ///< exchange the call before each collective when front_state::call_check
};

/// The front end's state, shared by the copies of a group.
struct front_state {
  stats_counter stats;
  std::shared_ptr<flight_recorder> flight = make_flight_recorder(next_group_label());  ///< the group's last collectives
  std::atomic<std::uint64_t> sequence{0};
  bool call_check = call_check_requested();  ///< DDP_CHECK_COLLECTIVES=1 when the group was made
};

/// The public collectives of a ddp::communicator, for backend `Derived` (see the file comment).
template <class Derived>
class collective_front : public object_collectives<Derived> {
 public:
  /// Reduces `buffer` in place across the group.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::all_reduce, "all_reduce", op, b, -1);
    verify(c);
    auto h = host_side<1>({{{b, true, true}}});
    const reduce_op run = average(c, op, h[0]);
    return counted(c, share(b.bytes(), 2), h.finish(self().start_all_reduce(c, h[0], run)));
  }

  /// Reduces N·k input elements and leaves block rank() (k elements) in `output`.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::reduce_scatter, "reduce_scatter", op, out, -1);
    same_type(c, in, out);
    blocks(c, in.size, out.size, "input", "output");
    verify(c);
    auto h = host_side<2>({{{in, true, false}, {out, false, true}}});
    const reduce_op run = average(c, op, h[1]);
    return counted(c, share(in.bytes(), 1), h.finish(self().start_reduce_scatter(c, h[0], h[1], run)));
  }

  /// Gathers k elements from every rank into N·k elements, rank r's at block r.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::all_gather, "all_gather", std::nullopt, in, -1);
    same_type(c, in, out);
    blocks(c, out.size, in.size, "output", "input");
    verify(c);
    auto h = host_side<2>({{{in, true, false}, {out, false, true}}});
    return counted(c, static_cast<std::uint64_t>(self().size() - 1) * in.bytes(),
                   h.finish(self().start_all_gather(c, h[0], h[1])));
  }

  /// Copies root's `buffer` to every rank.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::broadcast, "broadcast", std::nullopt, b, root);
    check_rank(c, root, "root");
    verify(c);
    const std::uint64_t sent = self().rank() == root && self().size() > 1 ? b.bytes() : 0;
    auto h = host_side<1>({{{b, self().rank() == root, self().rank() != root}}});
    return counted(c, sent, h.finish(self().start_broadcast(c, h[0])));
  }

  /// Reduces `buffer` onto root, in place there; other ranks' buffers are left as they were.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::reduce, "reduce", op, b, root);
    check_rank(c, root, "root");
    verify(c);
    const bool at_root = self().rank() == root;
    auto h = host_side<1>({{{b, true, at_root}}});
    const reduce_op run = average(c, op, at_root ? h[0] : raw_tensor{});
    return counted(c, at_root ? 0 : b.bytes(), h.finish(self().start_reduce(c, h[0], run)));
  }

  /// Gathers k elements from every rank into root's N·k-element `output` (unused on other ranks).
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open_rooted(collective::gather, "gather", in, out, root);
    const bool at_root = self().rank() == root;
    auto h = host_side<2>({{{in, true, false}, {at_root ? out : raw_tensor{}, false, true}}});
    return counted(c, at_root ? 0 : in.bytes(), h.finish(self().start_gather(c, h[0], at_root ? h[1] : out)));
  }

  /// Sends block r of root's N·k-element `input` (unused on other ranks) to rank r's k-element `output`.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open_rooted(collective::scatter, "scatter", in, out, root);
    const bool at_root = self().rank() == root;
    auto h = host_side<2>({{{at_root ? in : raw_tensor{}, true, false}, {out, false, true}}});
    return counted(c, at_root ? share(in.bytes(), 1) : 0, h.finish(self().start_scatter(c, at_root ? h[0] : in, h[1])));
  }

  /// Sends block i of the N·k-element `input` to rank i; block j of `output` comes from rank j.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::all_to_all, "all_to_all", std::nullopt, in, -1);
    same_type(c, in, out);
    const auto n = static_cast<std::size_t>(self().size());
    if (in.size != out.size || in.size % n != 0)
      fail(c, "input has " + std::to_string(in.size) + " elements and output " + std::to_string(out.size) +
                  "; both must hold the same multiple of size()=" + std::to_string(n));
    verify(c);
    auto h = host_side<2>({{{in, true, false}, {out, false, true}}});
    return counted(c, share(in.bytes(), 1), h.finish(self().start_all_to_all(c, h[0], h[1])));
  }

  /// Completes once every rank of the group has entered the barrier.
  work barrier() {
    call_info c = open(collective::barrier, "barrier", std::nullopt, raw_tensor{}, -1);
    verify(c);
    return counted(c, 0, self().start_barrier(c));
  }

  /// Sends `buffer` to rank `peer`, matched by the recv on `peer` with the same tag (0 ≤ tag ≤ max_tag()).
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::send_recv, "send", std::nullopt, b, peer, tag);
    check_peer(c);
    auto h = host_side<1>({{{b, true, false}}});
    return counted(c, b.bytes(), h.finish(self().start_send(c, h[0])));
  }

  /// Receives into `buffer` what rank `peer` sends with `tag`.
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::send_recv, "recv", std::nullopt, b, peer, tag);
    check_peer(c);
    auto h = host_side<1>({{{b, false, true}}});
    return counted(c, 0, h.finish(self().start_recv(c, h[0])));
  }

 protected:
  /// Throws ddp::error "<the call>: <what>" on this rank.
  [[noreturn]] void fail(const call_info& c, const std::string& what) const {
    throw error(describe(c) + ": " + what, self().rank());
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  /// The arguments as the backend takes them: device tensors through host memory (comm/staging.hpp) unless the
  /// backend's `moves_device_memory()` says it takes them itself.
  template <std::size_t N>
  host_staging<N> host_side(const std::array<staging_argument, N>& args) const {
    return host_staging<N>(args, [&] {
      if constexpr (requires { self().moves_device_memory(); })
        return static_cast<bool>(self().moves_device_memory());
      else
        return false;
    });
  }

  call_info open(collective kind, const char* name, std::optional<reduce_op> op, const raw_tensor& t, int peer,
                 int tag = -1) {
    call_info c{kind, name, op, t.type, t.size, peer, tag, std::nullopt, self().size(), Derived::duties.group, -1, {}};
    if constexpr (Derived::duties.sequence)
      c.sequence = self().front().sequence.fetch_add(1, std::memory_order_relaxed);
    if constexpr (requires { self().device(); }) c.device = self().device();
    return c;
  }

  /// Opens gather or scatter: each rank's k elements (gather's input, scatter's output) travel between it and its
  /// block of root's N·k elements (the other buffer), which the root checks.
  call_info open_rooted(collective kind, const char* name, const raw_tensor& in, const raw_tensor& out, int root) {
    const bool to_root = kind == collective::gather;
    const raw_tensor& mine = to_root ? in : out;
    call_info c = open(kind, name, std::nullopt, mine, root);
    check_rank(c, root, "root");
    if (self().rank() == root) {
      same_type(c, in, out);
      blocks(c, (to_root ? out : in).size, mine.size, to_root ? "output" : "input", to_root ? "input" : "output");
    }
    verify(c);
    return c;
  }

  /// The opt-in cross-rank call check: every rank shares the call's fingerprint through the backend's own
  /// all_gather (not counted in the statistics but in comm_stats::call_checks) and compares.
  void verify(const call_info& c) {
    if constexpr (Derived::duties.call_check) {
      if (!self().front().call_check) return;
      const call_fingerprint mine = fingerprint(c);
      std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(self().size()));
      call_info exchange = c;
      exchange.kind = collective::all_gather;
      exchange.name = "all_gather of the call check before";
      exchange.op.reset();
      const raw_tensor in = as_raw(std::span<const std::int64_t>(mine)), out = as_raw(std::span<std::int64_t>(all));
      exchange.type = in.type;
      exchange.count = in.size;
      self().start_all_gather(exchange, in, out).wait();
      self().front().stats.add_call_check();
      compare_calls(c, all, self().rank());
    }
  }

  /// The operator to start: avg becomes sum when the front end averages for the backend, and `target` (the
  /// output this rank divides; empty where none) goes into the call.
  reduce_op average(call_info& c, reduce_op op, const raw_tensor& target) const noexcept {
    if constexpr (Derived::duties.average) {
      if (op != reduce_op::avg) return op;
      c.average = target;
      return reduce_op::sum;
    } else {
      return op;
    }
  }

  work counted(const call_info& c, std::uint64_t bytes_sent, work w) {
    if constexpr (Derived::duties.stats) {
      self().front().stats.add_call(c.kind);
      self().front().stats.add_bytes(c.kind, bytes_sent);
    }
    if (c.kind != collective::send_recv)
      if (const auto& recorder = self().flight()) return record(recorder, c, self().size(), std::move(w));
    return w;
  }

  /// (N-1)/N of `bytes`, times `factor`: what leaves a rank in a reduce-scatter (1) or all-reduce (2).
  [[nodiscard]] std::uint64_t share(std::size_t bytes, std::uint64_t factor) const noexcept {
    const auto n = static_cast<std::uint64_t>(self().size());
    return factor * static_cast<std::uint64_t>(bytes) * (n - 1) / n;
  }

  void same_type(const call_info& c, const raw_tensor& a, const raw_tensor& b) const {
    if (auto problem = dtype_problem(a, b); !problem.empty()) fail(c, problem);
  }

  /// `whole` must hold size() blocks of `block` elements.
  void blocks(const call_info& c, std::size_t whole, std::size_t block, const char* whole_name,
              const char* block_name) const {
    if (auto problem = blocks_problem(whole, block, self().size(), whole_name, block_name); !problem.empty())
      fail(c, problem);
  }

  void check_rank(const call_info& c, int r, const char* what) const {
    if (auto problem = rank_problem(r, self().size(), what); !problem.empty()) fail(c, problem);
  }

  void check_peer(const call_info& c) const {
    check_rank(c, c.peer, "peer");
    if (c.tag < 0 || c.tag > self().max_tag())
      fail(c, "tag " + std::to_string(c.tag) + " is outside 0.." + std::to_string(self().max_tag()) +
                  "; pass a tag in that range");
  }
};

}  // namespace ddp::detail

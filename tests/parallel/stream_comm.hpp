#pragma once
// A communicator shaped like ddp::nccl on the fake device (tests/support/fake_device.hpp), to prove data_parallel's
// NCCL path without a GPU: it takes device tensors as they are (moves_device_memory(), no staging), and every
// operation, on device or host memory, runs in call order on the device's stream after the work queued there before
// it (NCCL's stream waiting for its compute stream), the ddp::tcp collective inside a stream operation that opens the
// device ranges to it. Its work completes when that operation has run. Bind it to the device with bind_stream(); until
// then (host models) it calls ddp::tcp directly.

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/backend.hpp>
#include <ddp/comm/front_end.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/core/work.hpp>

#include "support/fake_device.hpp"

namespace ddp_test {

/// The backend tag of stream_comm.
struct stream_ordered {
  using policy_category = ddp::detail::backend_category;
};

/// ddp::tcp's collectives, ordered on a fake device's stream (see the file comment).
class stream_comm : public ddp::detail::collective_front<stream_comm> {
 public:
  using backend_tag = stream_ordered;  ///< what data_parallel deduces
  explicit stream_comm(ddp::tcp::communicator inner) : state_(std::make_shared<state>(std::move(inner))) {}

  [[nodiscard]] int rank() const { return state_->inner.rank(); }
  [[nodiscard]] int size() const { return state_->inner.size(); }
  [[nodiscard]] ddp::comm_stats stats() const { return state_->inner.stats(); }
  [[nodiscard]] stream_comm split(int color, int key) const {
    stream_comm out(state_->inner.split(color, key));
    out.state_->device = state_->device;
    return out;
  }
  /// Device tensors go to the starts as they are, as with NCCL.
  [[nodiscard]] static constexpr bool moves_device_memory() noexcept { return true; }
  /// Operations from now on run on `d`'s stream (null: directly).
  void bind(ddp::testing::fake_device* d) { state_->device = d; }

 private:
  friend class ddp::detail::collective_front<stream_comm>;
  using call = ddp::detail::call_info;
  static constexpr ddp::detail::front_duties duties{.group = "a stream-ordered group", .sequence = false,
                                                    .stats = false, .average = false, .call_check = false};
  struct state {
    explicit state(ddp::tcp::communicator c) : inner(std::move(c)) {}
    ddp::tcp::communicator inner;
    ddp::testing::fake_device* device = nullptr;
  };

  [[nodiscard]] static constexpr int max_tag() noexcept { return 1 << 20; }
  [[nodiscard]] std::shared_ptr<ddp::detail::flight_recorder> flight() const { return nullptr; }

  /// `t` as host memory: what the tcp collective touches while the stream operation holds the range open.
  static ddp::raw_tensor host(ddp::raw_tensor t) {
    t.where = ddp::device::cpu();
    return t;
  }
  /// Runs start() (the tcp collective over `ranges`) on the device's stream and waits for it there.
  template <class Start>
  ddp::work on_stream(const call& c, std::vector<ddp::raw_tensor> ranges, Start start) {
    auto* d = state_->device;
    if (d == nullptr) return start();
    auto done = std::make_shared<ddp::detail::completion>(rank(), std::chrono::minutes(2),
                                                          std::string(c.name) + " on the fake device's stream");
    d->run(std::move(ranges), [done, start]() mutable {
      try {
        start().wait();
        done->finish();
      } catch (...) {
        done->fail(std::current_exception());
      }
    });
    return ddp::work(done);
  }

  ddp::work start_all_reduce(const call& c, const ddp::raw_tensor& b, ddp::reduce_op op) {
    return on_stream(c, {b}, [s = state_, b, op] { return s->inner.all_reduce(host(b), op); });
  }
  ddp::work start_reduce_scatter(const call& c, const ddp::raw_tensor& in, const ddp::raw_tensor& out,
                                 ddp::reduce_op op) {
    return on_stream(c, {in, out}, [s = state_, in, out, op] { return s->inner.reduce_scatter(host(in), host(out), op); });
  }
  ddp::work start_all_gather(const call& c, const ddp::raw_tensor& in, const ddp::raw_tensor& out) {
    return on_stream(c, {in, out}, [s = state_, in, out] { return s->inner.all_gather(host(in), host(out)); });
  }
  ddp::work start_broadcast(const call& c, const ddp::raw_tensor& b) {
    return on_stream(c, {b}, [s = state_, b, root = c.peer] { return s->inner.broadcast(host(b), root); });
  }
  ddp::work start_reduce(const call& c, const ddp::raw_tensor& b, ddp::reduce_op op) {
    return on_stream(c, {b}, [s = state_, b, op, root = c.peer] { return s->inner.reduce(host(b), op, root); });
  }
  ddp::work start_gather(const call& c, const ddp::raw_tensor& in, const ddp::raw_tensor& out) {
    return on_stream(c, {in, out}, [s = state_, in, out, root = c.peer] { return s->inner.gather(host(in), host(out), root); });
  }
  ddp::work start_scatter(const call& c, const ddp::raw_tensor& in, const ddp::raw_tensor& out) {
    return on_stream(c, {in, out}, [s = state_, in, out, root = c.peer] { return s->inner.scatter(host(in), host(out), root); });
  }
  ddp::work start_all_to_all(const call& c, const ddp::raw_tensor& in, const ddp::raw_tensor& out) {
    return on_stream(c, {in, out}, [s = state_, in, out] { return s->inner.all_to_all(host(in), host(out)); });
  }
  ddp::work start_barrier(const call& c) {
    return on_stream(c, {}, [s = state_] { return s->inner.barrier(); });
  }
  ddp::work start_send(const call& c, const ddp::raw_tensor& b) {
    return on_stream(c, {b}, [s = state_, b, peer = c.peer, tag = c.tag] { return s->inner.send(host(b), peer, tag); });
  }
  ddp::work start_recv(const call& c, const ddp::raw_tensor& b) {
    return on_stream(c, {b}, [s = state_, b, peer = c.peer, tag = c.tag] { return s->inner.recv(host(b), peer, tag); });
  }

  std::shared_ptr<state> state_;
};

/// While it lives, `comm`'s operations run on `d`'s stream.
class stream_binding {
 public:
  stream_binding(stream_comm& comm, ddp::testing::fake_device& d) : comm_(comm) { comm_.bind(&d); }
  stream_binding(const stream_binding&) = delete;
  stream_binding& operator=(const stream_binding&) = delete;
  ~stream_binding() { comm_.bind(nullptr); }

 private:
  stream_comm& comm_;
};

/// device_scenarios.hpp's hook: a stream_comm's operations follow the device's stream while the devices live.
inline stream_binding bind_stream(stream_comm& comm, ddp::testing::fake_device& d) { return {comm, d}; }

}  // namespace ddp_test

template <>
struct ddp::backend_traits<ddp_test::stream_ordered> : ddp::detail::backend_binding<ddp_test::stream_comm> {};

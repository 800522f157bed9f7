#pragma once
/// \file ddp::staged<Comm>: a communicator that moves device tensors through host memory, for backends that move
/// host memory only (ddp::tcp, an MPI without CUDA support). A collective whose tensors are all on the host (or a
/// backend that takes device memory itself, ddp::nccl) goes straight to the backend. Otherwise each device tensor
/// is copied into a host buffer by its device's memory domain (memory/devices.hpp), the copies are waited for (a
/// host backend must read them), the backend runs the collective on the host buffers, and once it completes the
/// outputs are copied back to the device and waited for, so the host buffers can go back to the staging pool.

#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/communicator.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/comm/work.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp {

/// Whether Comm's collectives take device memory themselves: a communicator says so with
/// `static constexpr bool takes_device_memory = true;` (ddp::nccl's does).
template <class Comm>
inline constexpr bool takes_device_memory = [] {
  if constexpr (requires { Comm::takes_device_memory; })
    return static_cast<bool>(Comm::takes_device_memory);
  else
    return false;
}();

namespace detail {

/// Host buffers for staging, reused: a collective takes the smallest idle one that fits and gives it back once
/// its outputs are home. Shared by the copies of a staged communicator.
class staging_pool {
 public:
  /// An idle host buffer of at least `bytes`, now busy.
  domain_buffer take(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    std::size_t best = idle_.size();
    for (std::size_t i = 0; i < idle_.size(); ++i)
      if (idle_[i].size() >= bytes && (best == idle_.size() || idle_[i].size() < idle_[best].size())) best = i;
    if (best == idle_.size()) return host_memory().allocate(bytes);
    domain_buffer b = std::move(idle_[best]);
    idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
    return b;
  }
  /// Gives `b` back.
  void give(domain_buffer b) {
    std::lock_guard lock(mutex_);
    idle_.push_back(std::move(b));
  }

 private:
  std::mutex mutex_;
  std::vector<domain_buffer> idle_;
};

/// One device tensor of a collective and its host stand-in.
struct staged_tensor {
  raw_tensor device;        ///< the caller's tensor
  raw_tensor host;          ///< its stand-in, in `buffer`
  domain_buffer buffer;     ///< from the pool
  memory_domain* domain;    ///< the device's domain
  bool output;              ///< written by the collective: copied back once it completes
};

/// The work of a staged collective: the backend's, then the outputs copied home once it completes.
class staged_state final : public work_state {
 public:
  staged_state(work inner, std::vector<staged_tensor> tensors, std::shared_ptr<staging_pool> pool)
      : inner_(std::move(inner)), tensors_(std::move(tensors)), pool_(std::move(pool)) {}
  bool test() override {
    if (!inner_.done()) return false;
    bring_home();
    return true;
  }
  bool wait_until(clock::time_point deadline) override {
    auto& s = work_access::state(inner_);
    if (s && !s->wait_until(deadline)) return false;
    bring_home();
    return true;
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return inner().timeout(); }
  [[nodiscard]] int rank() const override { return inner().rank(); }
  [[nodiscard]] std::string describe() const override { return inner().describe() + " (staged through the host)"; }
  [[nodiscard]] std::string waiting_for() const override { return inner().waiting_for(); }
  std::string diagnosis() override { return work_access::state(inner_) ? work_access::state(inner_)->diagnosis() : ""; }

 private:
  [[nodiscard]] const work_state& inner() const { return *work_access::state(const_cast<work&>(inner_)); }
  /// Once: the outputs copied back to their devices and waited for, the host buffers returned.
  void bring_home() {
    std::call_once(home_, [&] {
      for (auto& t : tensors_)
        if (t.output) t.domain->copy(t.host, t.device);
      for (auto& t : tensors_)
        if (t.output) t.domain->synchronize();
      for (auto& t : tensors_) pool_->give(std::move(t.buffer));
    });
  }
  work inner_;
  std::vector<staged_tensor> tensors_;
  std::shared_ptr<staging_pool> pool_;
  std::once_flag home_;
};

}  // namespace detail

/// A communicator over `Comm` whose collectives also take device tensors, staged through host memory (see the
/// file comment). Copies share the staging pool; split() stages the subgroup alike.
template <class Comm>
class staged {
  static_assert(communicator<Comm>, "ddp::staged<Comm>: Comm must model ddp::communicator; stage a backend's communicator.");
 public:
  /// Stages `comm`'s collectives.
  explicit staged(Comm comm) : comm_(std::move(comm)), pool_(std::make_shared<detail::staging_pool>()) {}

  /// The backend's communicator.
  [[nodiscard]] Comm& inner() noexcept { return comm_; }
  /// The backend's communicator.
  [[nodiscard]] const Comm& inner() const noexcept { return comm_; }
  /// This process's rank in the group.
  [[nodiscard]] int rank() const { return comm_.rank(); }
  /// Number of ranks.
  [[nodiscard]] int size() const { return comm_.size(); }
  /// The backend's traffic counts.
  [[nodiscard]] comm_stats stats() const { return comm_.stats(); }
  /// Collective: the backend's split, staged alike (sharing the staging pool).
  staged split(int color, int key) { return staged(comm_.split(color, key), pool_); }

  /// all_reduce, staged where `buffer` is on a device.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.all_reduce(h[0], op); });
  }
  /// reduce_scatter, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.reduce_scatter(h[0], h[1], op); });
  }
  /// all_gather, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.all_gather(h[0], h[1]); });
  }
  /// broadcast, staged where `buffer` is on a device.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.broadcast(h[0], root); });
  }
  /// reduce, staged where `buffer` is on a device.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.reduce(h[0], op, root); });
  }
  /// gather, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.gather(h[0], h[1], root); });
  }
  /// scatter, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.scatter(h[0], h[1], root); });
  }
  /// all_to_all, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.all_to_all(h[0], h[1]); });
  }
  /// The backend's barrier.
  work barrier() { return comm_.barrier(); }
  /// send, staged where `buffer` is on a device.
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    return run({{as_raw(buffer), true, false}}, [&](auto& h) { return comm_.send(h[0], peer, tag); });
  }
  /// recv, staged where `buffer` is on a device.
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    return run({{as_raw(buffer), false, true}}, [&](auto& h) { return comm_.recv(h[0], peer, tag); });
  }

 private:
  staged(Comm comm, std::shared_ptr<detail::staging_pool> pool) : comm_(std::move(comm)), pool_(std::move(pool)) {}

  struct argument {
    raw_tensor tensor;
    bool reads;   // the collective reads it: copied to the host first
    bool writes;  // the collective writes it: copied back once it completes
  };
  /// Runs `launch` on the arguments, or on host stand-ins of those on a device (see the file comment).
  template <class Launch>
  work run(std::initializer_list<argument> args, Launch&& launch) {
    std::vector<raw_tensor> use;
    std::vector<detail::staged_tensor> staged_tensors;
    for (const auto& a : args) {
      if (!a.tensor.where.is_cuda() || takes_device_memory<Comm> || a.tensor.size == 0) {
        use.push_back(a.tensor);
        continue;
      }
      memory_domain& d = require_domain_of(a.tensor.where, "ddp::staged");
      domain_buffer b = pool_->take(a.tensor.bytes());
      const raw_tensor host = b.view(a.tensor.type, 0, a.tensor.size);
      if (a.reads) d.copy(a.tensor, host);
      use.push_back(host);
      staged_tensors.push_back({a.tensor, host, std::move(b), &d, a.writes});
    }
    if (staged_tensors.empty()) return launch(use);
    for (auto& t : staged_tensors) t.domain->synchronize();  // the host backend reads the copies now
    work w = launch(use);
    return work(std::make_shared<detail::staged_state>(std::move(w), std::move(staged_tensors), pool_));
  }

  Comm comm_;
  std::shared_ptr<detail::staging_pool> pool_;
};

}  // namespace ddp

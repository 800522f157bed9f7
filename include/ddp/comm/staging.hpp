#pragma once
/// \file Device tensors on a host backend (ddp::tcp, an MPI without CUDA support), as Gloo takes CUDA tensors:
/// the collective front end hands each device argument's bytes to the backend through a host buffer. The device's
/// memory domain (memory/devices.hpp) copies the inputs out and is waited for (the backend reads them now); the
/// backend runs on the host buffers; the copy of each output back to its device is queued at once on the device's
/// domain, ordered after the collective there (the domain's order_after), so later work on that domain sees the
/// result without the host waiting; the host buffers go back to the pool once the domain has run the copies.
/// Waiting for the work on the host returns once the outputs are home.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/work.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp::detail {

/// Host buffers for staging, reused by every communicator of the process: a collective takes the smallest idle
/// one that fits and gives it back once its outputs are home.
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

/// The process's staging pool.
inline staging_pool& host_staging_pool() {
  static staging_pool pool;
  return pool;
}

/// One argument of a collective: the tensor, and whether the collective reads it and writes it.
struct staging_argument {
  raw_tensor tensor;
  bool reads = true;
  bool writes = true;
};

/// The device arguments of one collective and their host stand-ins, until the outputs are home.
struct staged_record {
  struct entry {
    raw_tensor device;      ///< the caller's tensor
    raw_tensor host;        ///< its stand-in, in `buffer`
    domain_buffer buffer;   ///< from the pool
    memory_domain* domain;  ///< the device's domain
    bool output;            ///< written by the collective: copied back
  };
  std::vector<entry> entries;
  std::mutex mutex;
  std::condition_variable home_cv;
  int away = 0;       ///< domains whose copies back have not run yet
  bool home = false;  ///< every output is on its device and the buffers are back in the pool

  /// One domain ran its copies back; the last one gives the buffers back.
  void arrived() noexcept {
    std::lock_guard lock(mutex);
    if (--away > 0) return;
    for (auto& e : entries) host_staging_pool().give(std::move(e.buffer));
    home = true;
    home_cv.notify_all();
  }
};

/// The work of a staged collective: the backend's, then its outputs home on their devices.
class staged_state final : public work_state {
 public:
  /// Queues, on each output's domain, the wait for `inner` and the copy back (see the file comment).
  staged_state(work inner, std::shared_ptr<staged_record> record) : inner_(std::move(inner)), record_(std::move(record)) {
    std::vector<memory_domain*> domains;
    for (const auto& e : record_->entries)
      if (e.output && std::find(domains.begin(), domains.end(), e.domain) == domains.end()) domains.push_back(e.domain);
    record_->away = static_cast<int>(domains.size()) + 1;  // + the collective's completion, seen by test or wait
    for (memory_domain* d : domains) {
      d->order_after(inner_);
      for (const auto& e : record_->entries)
        if (e.output && e.domain == d) d->copy(e.host, e.device);
      d->when_done([r = record_] { r->arrived(); });
    }
  }
  staged_state(const staged_state&) = delete;
  staged_state& operator=(const staged_state&) = delete;
  /// The backend may still be using the host buffers of a collective dropped before it completed: waits for it
  /// (its errors dropped: nobody is left to hear them), so the buffers outlive it.
  ~staged_state() override {
    if (seen_.load()) return;
    try {
      if (auto& s = work_access::state(inner_)) (void)s->wait_until(clock::now() + s->timeout());
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor reports nothing
    }
  }
  bool test() override {
    if (!inner_.done()) return false;
    completed();
    std::lock_guard lock(record_->mutex);
    return record_->home;
  }
  bool wait_until(clock::time_point deadline) override {
    auto& s = work_access::state(inner_);
    if (s && !s->wait_until(deadline)) return false;
    completed();
    std::unique_lock lock(record_->mutex);
    return record_->home_cv.wait_until(lock, deadline, [&] { return record_->home; });
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const override {
    return inner() ? inner()->timeout() : std::chrono::milliseconds(std::chrono::minutes(10));
  }
  [[nodiscard]] int rank() const override { return inner() ? inner()->rank() : -1; }
  [[nodiscard]] std::string describe() const override {
    return (inner() ? inner()->describe() : std::string("a collective")) + " (staged through the host)";
  }
  [[nodiscard]] std::string waiting_for() const override { return inner() ? inner()->waiting_for() : std::string(); }
  std::string diagnosis() override { return inner() ? work_access::state(inner_)->diagnosis() : std::string(); }

 private:
  /// The backend's state (null: the backend completed the collective at once).
  [[nodiscard]] const work_state* inner() const { return work_access::state(const_cast<work&>(inner_)).get(); }
  /// The collective completed (the host buffers of its inputs are free once the outputs are home).
  void completed() noexcept {
    if (!seen_.exchange(true)) record_->arrived();
  }
  std::atomic<bool> seen_{false};
  work inner_;
  std::shared_ptr<staged_record> record_;
};

/// The N arguments of one collective as the backend sees them: host tensors as they are, device tensors through
/// host stand-ins (see the file comment). Costs a test of each argument's device when none is on one.
template <std::size_t N>
class host_staging {
 public:
  /// Stages the device arguments among `args` (inputs copied out and waited for), unless `direct()` says the
  /// backend moves device memory itself (asked only when an argument is on a device).
  template <class Direct>
  host_staging(const std::array<staging_argument, N>& args, Direct&& direct) {
    for (std::size_t i = 0; i < N; ++i) use_[i] = args[i].tensor;  // each as it is, unless staged below
    bool checked = false;
    for (std::size_t i = 0; i < N; ++i) {
      const raw_tensor& t = args[i].tensor;
      if (!t.where.is_cuda() || t.size == 0) continue;
      if (!checked) {
        if (direct()) return;
        checked = true;
      }
      if (!record_) record_ = std::make_shared<staged_record>();
      memory_domain& d = require_domain_of(t.where, "a host backend's collective");
      domain_buffer b = host_staging_pool().take(t.bytes());
      use_[i] = b.view(t.type, 0, t.size);
      if (args[i].reads) d.copy(t, use_[i]);
      record_->entries.push_back({t, use_[i], std::move(b), &d, args[i].writes});
    }
    if (record_)
      for (auto& e : record_->entries) e.domain->synchronize();  // the backend reads the copies now
  }
  /// Argument `i` as the backend takes it.
  [[nodiscard]] const raw_tensor& operator[](std::size_t i) const noexcept { return use_[i]; }
  /// The collective's work: `w` itself without device arguments, else `w` and the outputs' way home.
  work finish(work w) {
    if (!record_) return w;
    return work(std::make_shared<staged_state>(std::move(w), std::move(record_)));
  }

 private:
  std::array<raw_tensor, N> use_{};
  std::shared_ptr<staged_record> record_;
};

}  // namespace ddp::detail

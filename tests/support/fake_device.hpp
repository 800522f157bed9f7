#pragma once
// A device the host cannot touch, to prove ddp's device paths on machines without one (docs/gpu.md): memory
// tagged cuda:N whose pages stay PROT_NONE except while the device's own stream runs an operation on them, and a
// stream that is an in-order worker thread sleeping a random time before each operation, so a missing wait shows
// as a wrong value or a fault instead of passing by luck. Every operation of ddp::memory_domain is enqueued;
// order_after makes the stream (not the host) wait for a collective; synchronize waits for the stream to drain.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cerrno>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/core/work.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp::testing {

class fake_device final : public ddp::memory_domain {
 public:
  /// Device cuda:`index`; the stream sleeps a random time in [min_delay, max_delay] before each operation.
  explicit fake_device(int index, std::chrono::microseconds min_delay = std::chrono::microseconds(0),
                       std::chrono::microseconds max_delay = std::chrono::microseconds(100), unsigned seed = 1)
      : index_(index), min_(min_delay), max_(max_delay), random_(seed + static_cast<unsigned>(index)),
        worker_([this] { serve(); }) {}
  fake_device(const fake_device&) = delete;
  fake_device& operator=(const fake_device&) = delete;
  ~fake_device() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  [[nodiscard]] ddp::device where() const noexcept override { return ddp::device::cuda(index_); }

  /// Zeroed memory no host code may touch: its pages are PROT_NONE outside this device's operations.
  [[nodiscard]] ddp::domain_buffer allocate(std::size_t bytes) override {
    if (bytes == 0) return {};
    const std::size_t mapped = round_up(bytes);
    void* p = ::mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    allocated_ += mapped;
    ++allocations_;
    std::shared_ptr<std::byte> owner(static_cast<std::byte*>(p), [this, mapped](std::byte* q) {
      drain();  // as cudaFree: the operations queued before it run first
      allocated_ -= mapped;
      ::munmap(q, mapped);
    });
    return {std::move(owner), bytes, this};
  }
  void release(const ddp::domain_buffer& b, std::size_t begin, std::size_t end) override {
    zero({b.data() + begin, end - begin, ddp::dtype::u8, where()});
  }
  /// As a GPU's: released memory stays resident.
  [[nodiscard]] bool releases_pages() const noexcept override { return false; }
  void zero(const ddp::raw_tensor& t) override {
    enqueue({t}, [t] { ddp::host_memory().zero(t); });
  }
  void copy(const ddp::raw_tensor& from, const ddp::raw_tensor& to) override {
    enqueue({from, to}, [from, to] { ddp::host_memory().copy(from, to); });
  }
  void accumulate(const ddp::raw_tensor& from, const ddp::raw_tensor& into) override {
    enqueue({from, into}, [from, into] { ddp::host_memory().accumulate(from, into); });
  }
  using ddp::memory_domain::convert;
  void convert(const ddp::raw_tensor& from, const ddp::raw_tensor& to, double factor) override {
    enqueue({from, to}, [from, to, factor] { ddp::host_memory().convert(from, to, factor); });
  }
  void scale(const ddp::raw_tensor& t, double factor) override {
    enqueue({t}, [t, factor] { ddp::host_memory().scale(t, factor); });
  }
  void fill(const ddp::raw_tensor& t, double value) override {
    enqueue({t}, [t, value] { ddp::host_memory().fill(t, value); });
  }
  void sgd(const ddp::raw_tensor& values, const ddp::raw_tensor& grads, const ddp::raw_tensor& momentum,
           const ddp::sgd_update& u) override {
    enqueue({values, grads, momentum}, [=] { ddp::host_memory().sgd(values, grads, momentum, u); });
  }
  void adamw(const ddp::raw_tensor& values, const ddp::raw_tensor& grads, const ddp::raw_tensor& exp_avg,
             const ddp::raw_tensor& exp_avg_sq, const ddp::adamw_update& u) override {
    enqueue({values, grads, exp_avg, exp_avg_sq}, [=] { ddp::host_memory().adamw(values, grads, exp_avg, exp_avg_sq, u); });
  }
  /// The stream waits for `w` before its next operation; the host goes on (nothing after forget_ordering()).
  void order_after(ddp::work& w) override {
    if (forgetful_) return;
    enqueue({}, [w]() mutable { w.wait(); });
  }
  /// From now on order_after does nothing: a device that loses its ordering waits, to show a test catches it.
  void forget_ordering() noexcept { forgetful_ = true; }
  /// Waits until every operation enqueued so far has run; rethrows the first that failed.
  void synchronize() override {
    if (std::this_thread::get_id() == worker_.get_id())
      throw ddp::error("fake_device: synchronize() called from the device's own stream, which would wait for itself");
    drain();
    std::unique_lock lock(mutex_);
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
  }

  /// Calls `f` on the stream once everything enqueued before has run.
  void when_done(std::function<void()> f) override { enqueue({}, std::move(f)); }

  /// Runs `kernel` on the stream with `ranges` (this device's memory, or host memory) open to it: a test's own
  /// compute on the device (a forward, a backward).
  void run(std::vector<ddp::raw_tensor> ranges, std::function<void()> kernel) {
    enqueue(std::move(ranges), std::move(kernel));
  }
  /// `t`'s bytes, copied to the host once the stream has run everything enqueued before.
  template <class T>
  std::vector<T> read(const ddp::raw_tensor& t) {
    std::vector<T> out(t.size);
    copy(t, ddp::raw_tensor::of(std::span<T>(out)));
    synchronize();
    return out;
  }
  /// Operations run so far.
  [[nodiscard]] std::size_t operations() const noexcept { return operations_.load(); }
  /// Bytes of device memory held now (whole pages) and allocations made: the memory a rank's sharding uses.
  [[nodiscard]] std::size_t allocated_bytes() const noexcept { return allocated_.load(); }
  /// Allocations made so far.
  [[nodiscard]] std::size_t allocations() const noexcept { return allocations_.load(); }

 private:
  struct task {
    std::vector<ddp::raw_tensor> open;  // this device's ranges the task may touch
    std::function<void()> run;
  };
  static constexpr std::size_t page = 4096;
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + page - 1) / page * page; }

  /// Waits until the stream is idle (at once on the stream itself: an operation freeing memory).
  void drain() {
    if (std::this_thread::get_id() == worker_.get_id()) return;
    std::unique_lock lock(mutex_);
    drained_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }

  void enqueue(std::vector<ddp::raw_tensor> ranges, std::function<void()> f) {
    std::vector<ddp::raw_tensor> mine;
    for (const auto& r : ranges)
      if (r.where == where() && r.size) mine.push_back(r);
      else if (r.where.is_cuda() && r.size)
        throw ddp::error("fake_device cuda:" + std::to_string(index_) + ": an operation touches memory of " +
                         r.where.to_string() + "; copy it to this device or to the host first");
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({std::move(mine), std::move(f)});
    }
    wake_.notify_one();
  }
  /// Pages of the device ranges a task touches become readable and writable while it runs, PROT_NONE after.
  static void protect(const std::vector<ddp::raw_tensor>& ranges, int how) {
    for (const auto& r : ranges) {
      const auto begin = reinterpret_cast<std::uintptr_t>(r.data) / page * page;
      const auto end = round_up(reinterpret_cast<std::uintptr_t>(r.data) + r.bytes());
      if (::mprotect(reinterpret_cast<void*>(begin), end - begin, how) != 0)
        throw std::runtime_error("fake_device: mprotect of " + std::to_string(end - begin) + " bytes failed: " +
                                 std::strerror(errno) + " (memory freed while an operation on it was queued?)");
    }
  }
  void serve() {
    while (true) {
      task t;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, drained
        t = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      const auto span = static_cast<std::uint64_t>((max_ - min_).count());
      const auto delay = min_ + std::chrono::microseconds(span ? random_() % (span + 1) : 0);
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      try {
        protect(t.open, PROT_READ | PROT_WRITE);
        t.run();
        protect(t.open, PROT_NONE);
      } catch (...) {
        protect(t.open, PROT_NONE);
        std::lock_guard lock(mutex_);
        if (!failure_) failure_ = std::current_exception();
      }
      ++operations_;
      {
        std::lock_guard lock(mutex_);
        busy_ = false;
      }
      drained_.notify_all();
    }
  }

  int index_;
  std::chrono::microseconds min_, max_;
  std::minstd_rand random_;
  std::mutex mutex_;
  std::condition_variable wake_, drained_;
  std::deque<task> queue_;
  bool forgetful_ = false;  // order_after does nothing (forget_ordering)
  bool busy_ = false;
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::atomic<std::size_t> operations_{0}, allocated_{0}, allocations_{0};
  std::thread worker_;  // last: it starts once everything above exists
};

}  // namespace ddp::testing

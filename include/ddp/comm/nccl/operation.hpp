#pragma once
/// \file One operation of ddp::nccl::communicator after its start: staging host buffers in and out, the queued
/// send/recv started as one NCCL group, and the work state polled until the completion event fires.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/call.hpp>
#include <ddp/comm/nccl/error.hpp>
#include <ddp/comm/nccl/group.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/error.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>

namespace ddp::nccl::detail {

/// Copies each staged host argument into a device scratch (stream-ordered) and fills `rec.pointers`.
inline void stage_in(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = nullptr;
    cuda::check(cudaMallocAsync(&scratch, bytes, g.stream()), "cudaMallocAsync of a staging buffer", g.rank);
    rec.pointers[s.index] = scratch;
    if (s.copy_in)
      cuda::check(cudaMemcpyAsync(scratch, s.pinned.data(), bytes, cudaMemcpyHostToDevice, g.stream()),
                  "cudaMemcpyAsync of a host buffer to its staging buffer", g.rank);
  }
}

/// Copies staged outputs back to pinned memory, frees the scratch and records completion.
inline void stage_out(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = rec.pointers[s.index];
    if (s.copy_back)
      cuda::check(cudaMemcpyAsync(s.pinned.data(), scratch, bytes, cudaMemcpyDeviceToHost, g.stream()),
                  "cudaMemcpyAsync of a staging buffer to the host", g.rank);
    cuda::check(cudaFreeAsync(scratch, g.stream()), "cudaFreeAsync of a staging buffer", g.rank);
  }
  rec.done.record(g.stream());
  rec.started.store(true, std::memory_order_release);
}

/// Starts every queued send/recv as one NCCL group, tags ascending (stable). Caller holds g.mutex.
inline void flush_locked(group& g) {
  if (g.queue.empty()) return;
  std::vector<p2p_entry> entries = std::move(g.queue);
  g.queue.clear();
  std::stable_sort(entries.begin(), entries.end(), [](const p2p_entry& a, const p2p_entry& b) { return a.tag < b.tag; });
  g.alive_locked(entries.front().what);
  const cuda::device_guard on(g.device);
  for (auto& e : entries) {
    e.ready.make_wait(g.stream());
    stage_in(g, *e.rec);
  }
  g.call(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t first_error = ncclSuccess;
  std::string failed;
  for (auto& e : entries) {
    void* p = e.rec->pointers[0];
    const auto type = datatype(e.buffer.type);
    const ncclResult_t r = e.send ? ncclSend(p, e.buffer.size, type, e.peer, g.comm, g.stream())
                                  : ncclRecv(p, e.buffer.size, type, e.peer, g.comm, g.stream());
    if (r != ncclSuccess && r != ncclInProgress && first_error == ncclSuccess) {
      first_error = r;
      failed = e.what;
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (first_error != ncclSuccess) fail(first_error, failed, g.rank, g.comm);
  g.settle(end, "the NCCL group of " + std::to_string(entries.size()) + " queued send/recv (first: " +
                    entries.front().what + ")");
  for (auto& e : entries) stage_out(g, *e.rec);
}

/// One operation's completion: its event, its host copy-back, the communicator's health and the timeout.
class op_state final : public ddp::detail::work_state {
 public:
  op_state(std::shared_ptr<group> g, ddp::detail::call_info info, std::shared_ptr<record> rec)
      : group_(std::move(g)), info_(info), rec_(std::move(rec)), started_(clock::now()) {}

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    const auto start = clock::now();
    std::chrono::microseconds pause{1};
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (poll()) return true;
      }
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, group_->cfg.max_sleep);
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return ddp::detail::describe(info_); }

  /// Starts the operation if it is queued, then makes `cuda_stream` wait for its completion event. A host buffer's
  /// copy-back happens on the host, so a staged operation is waited for there (false).
  bool order_stream(void* cuda_stream) override {
    std::lock_guard lock(mutex_);
    if (poll()) return true;
    if (!rec_->staged.empty()) return false;
    rec_->done.make_wait(static_cast<cudaStream_t>(cuda_stream));
    return true;
  }

 private:
  /// One look at the operation; the caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    try {
      if (!rec_->started.load(std::memory_order_acquire)) {
        std::lock_guard lock(group_->mutex);
        flush_locked(*group_);
      }
      if (rec_->done.query()) {
        for (auto& s : rec_->staged)
          if (s.copy_back && s.host.bytes() != 0) std::memcpy(s.host.data, s.pinned.data(), s.host.bytes());
        rec_.reset();
        done_ = true;
        return true;
      }
      if (auto e = group_->health(describe())) std::rethrow_exception(e);
      if (clock::now() - started_ >= group_->cfg.timeout) {
        {
          std::lock_guard lock(group_->mutex);
          group_->abort_locked();
        }
        throw timeout_error(describe() + " did not complete within " + std::to_string(group_->cfg.timeout.count()) +
                                " ms, so the NCCL communicator was aborted: a peer is stuck, dead or calling a "
                                "different collective; check every rank's log, or raise config::timeout",
                            group_->rank);
      }
    } catch (const error&) {
      error_ = std::current_exception();
      throw;
    }
    return false;
  }

  std::shared_ptr<group> group_;
  ddp::detail::call_info info_;
  std::shared_ptr<record> rec_;
  clock::time_point started_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace ddp::nccl::detail

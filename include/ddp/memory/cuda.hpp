#pragma once
/// \file ddp::cuda::domain: the memory domain of one CUDA device. cudaMalloc'd memory, and element work as the
/// kernels of <ddp/cuda/element.hpp> on the domain's stream, so nothing inside a step blocks the host: a
/// collective's completion is waited for on the stream where the backend records an event (ddp::nccl), and on the
/// host where it cannot. synchronize() is the one host wait, bounded by the domain's timeout.
///
/// The domain's stream is the one the model computes on, as PyTorch's reducer works on the current stream: the
/// gradients a backward reports were only queued there, so the domain's work on them (and ddp::nccl's collectives,
/// which wait for their compute stream) must follow that stream. Both default to the default stream; a model on a
/// stream of its own gives it to both (domain_options::stream, nccl::config::compute_stream).
///
///     ddp::cuda::domain gpu(0);                 // cuda:0, on the default stream
///     ddp::cuda::domain gpu(0, {.stream = s});  // or on the model's stream (LibTorch's current stream)
///     ddp::device_registration on_gpu(gpu);     // data_parallel and the host backends find it by device

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <ddp/core/work.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/cuda/element.hpp>
#include <ddp/cuda/error.hpp>
#include <ddp/cuda/runtime.hpp>
#include <ddp/memory/domain.hpp>

namespace ddp::cuda {

/// How a domain runs its work.
struct domain_options {
  /// The stream element work runs on: the model's (LibTorch's current stream, say); null: the default stream,
  /// where ddp::nccl's collectives wait by default too.
  cudaStream_t stream = nullptr;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  ///< the longest synchronize() waits
};

/// The memory domain of one CUDA device (see the file comment).
class domain final : public memory_domain {
 public:
  /// The domain of cuda:`device`.
  explicit domain(int device, domain_options o = {})
      : device_(device), timeout_(o.timeout), done_([device] {
          const device_guard on(device);
          return event();
        }()), stream_(o.stream) {}

  /// The stream element work runs on.
  [[nodiscard]] cudaStream_t work_stream() const noexcept { return stream_; }

  [[nodiscard]] ddp::device where() const noexcept override { return ddp::device::cuda(device_); }

  [[nodiscard]] domain_buffer allocate(std::size_t bytes) override {
    if (bytes == 0) return {};
    const device_guard on(device_);
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc of " + std::to_string(bytes) + " bytes on cuda:" + std::to_string(device_));
    const int owner = device_;
    std::shared_ptr<std::byte> memory(static_cast<std::byte*>(p), [owner](std::byte* q) {
      const device_guard back(owner);
      (void)cudaFree(q);
    });
    check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync of a new buffer");
    return {std::move(memory), bytes, this};
  }
  /// Zeroes the range: device memory stays allocated (size buffers to what must be resident).
  void release(const domain_buffer& b, std::size_t begin, std::size_t end) override {
    const device_guard on(device_);
    check(cudaMemsetAsync(b.data() + begin, 0, end - begin, stream_), "cudaMemsetAsync of a released range");
  }
  /// Device memory cannot be handed back page by page: the sharded strategies free their full-size arenas.
  [[nodiscard]] bool releases_pages() const noexcept override { return false; }
  void zero(const raw_tensor& t) override {
    mine(t, "zero");
    const device_guard on(device_);
    if (t.size) check(cudaMemsetAsync(t.data, 0, t.bytes(), stream_), "cudaMemsetAsync");
  }
  /// Either side may be host memory: a copy from pageable host memory returns once the source is read, one to it
  /// once the copy is done.
  void copy(const raw_tensor& from, const raw_tensor& to) override {
    detail::same_shape(from, to, "domain::copy");
    if (!from.where.is_cuda() && !to.where.is_cuda()) mine(to, "copy");
    const device_guard on(device_);
    if (from.size && from.data != to.data)
      check(cudaMemcpyAsync(to.data, from.data, from.bytes(), cudaMemcpyDefault, stream_), "cudaMemcpyAsync");
  }
  void accumulate(const raw_tensor& from, const raw_tensor& into) override {
    mine(from, "accumulate");
    mine(into, "accumulate");
    const device_guard on(device_);
    cuda::accumulate(from, into, stream_);
  }
  using memory_domain::convert;
  void convert(const raw_tensor& from, const raw_tensor& to, double factor) override {
    mine(from, "convert");
    mine(to, "convert");
    const device_guard on(device_);
    cuda::convert(from, to, factor, stream_);
  }
  void scale(const raw_tensor& t, double factor) override {
    mine(t, "scale");
    const device_guard on(device_);
    cuda::scale(t, factor, stream_);
  }
  void fill(const raw_tensor& t, double value) override {
    mine(t, "fill");
    const device_guard on(device_);
    cuda::fill(t, value, stream_);
  }
  void sgd(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& momentum, const sgd_update& u) override {
    mine(values, "sgd");
    mine(grads, "sgd");
    mine(momentum, "sgd");
    const device_guard on(device_);
    cuda::sgd(values, grads, momentum, u, stream_);
  }
  void adamw(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& exp_avg, const raw_tensor& exp_avg_sq,
             const adamw_update& u) override {
    for (const raw_tensor* t : {&values, &grads, &exp_avg, &exp_avg_sq}) mine(*t, "adamw");
    const device_guard on(device_);
    cuda::adamw(values, grads, exp_avg, exp_avg_sq, u, stream_);
  }
  /// Enqueues the wait for `w` on the stream where its backend can (ddp::nccl), else waits on the host.
  void order_after(work& w) override {
    if (w.done()) return;
    const auto& state = ddp::detail::work_access::state(w);
    const device_guard on(device_);
    if (!state->order_stream(stream_)) w.wait();
  }
  /// Calls `f` from CUDA's host-function thread once the stream has run everything given to it so far.
  void when_done(std::function<void()> f) override {
    const device_guard on(device_);
    auto* heap = new std::function<void()>(std::move(f));
    const cudaError_t e = cudaLaunchHostFunc(stream_, [](void* p) {
      const std::unique_ptr<std::function<void()>> call(static_cast<std::function<void()>*>(p));
      (*call)();
    }, heap);
    if (e != cudaSuccess) delete heap;
    check(e, "cudaLaunchHostFunc");
  }
  /// Waits on the host, at most the domain's timeout, for every operation given to the domain.
  void synchronize() override {
    const device_guard on(device_);
    done_.record(stream_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::chrono::microseconds pause{1};
    while (!done_.query()) {
      if (std::chrono::steady_clock::now() >= deadline)
        throw timeout_error("ddp::cuda::domain: the work queued on cuda:" + std::to_string(device_) +
                            " did not finish within " + std::to_string(timeout_.count()) + " ms; a collective it "
                            "waits for may be stuck on a peer (check every rank's log), or raise domain_options::timeout");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

 private:
  void mine(const raw_tensor& t, const char* what) const {
    if (t.size != 0 && t.where != where())
      throw error(std::string("ddp::cuda::domain::") + what + ": memory on " + t.where.to_string() +
                  " given to the domain of cuda:" + std::to_string(device_) + "; use the domain of the memory's "
                  "device (ddp::domain_of)");
  }

  int device_;
  std::chrono::milliseconds timeout_;
  event done_;  // recorded by synchronize()
  cudaStream_t stream_ = nullptr;
};

}  // namespace ddp::cuda

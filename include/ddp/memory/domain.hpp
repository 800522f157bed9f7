#pragma once
/// \file ddp::memory_domain: where a wrapper's memory lives and how element work runs on it. What data_parallel
/// allocates or touches element by element (arenas, the unit pool, the reduce staging, the owned blocks, master
/// weights, the optimizers' flat state and their updates, leaf copies, the comm hooks' conversions, join's rescale) goes through the
/// domain of the memory's device: the host domain (memory/host.hpp) for the CPU, a device domain for an
/// accelerator. A domain also orders its work: the host runs each operation before returning; a device domain
/// enqueues it on its stream, and orders it after a collective by enqueueing the wait (order_after) rather than
/// blocking the host.
///
/// An abstract class, not a concept: the arenas of one wrapper may live in several domains (a model split over
/// devices, or over the CPU and a device), known only at run time from the leaves' devices, and every operation is
/// a bulk one over a buffer, so one virtual call per operation costs nothing measurable.

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include <ddp/core/work.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/updates.hpp>

namespace ddp {

class memory_domain;

/// Memory a domain allocated, zeroed when made and freed with the last handle.
class domain_buffer {
 public:
  domain_buffer() = default;
  /// `size` bytes at `data` of `domain`, freed by `owner`'s deleter.
  domain_buffer(std::shared_ptr<std::byte> owner, std::size_t size, memory_domain* domain) noexcept
      : data_(std::move(owner)), size_(size), domain_(domain) {}
  /// The first byte.
  [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
  /// Bytes.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The domain it lives in (null for an empty buffer).
  [[nodiscard]] memory_domain* domain() const noexcept { return domain_; }
  /// Elements [begin, begin + count) of `type`, viewed on the domain's device.
  [[nodiscard]] raw_tensor view(dtype type, std::size_t begin, std::size_t count) const noexcept;
  /// Zeroes bytes [begin, end), their whole pages handed back where the domain can (memory_domain::release).
  void release(std::size_t begin, std::size_t end) const;

 private:
  std::shared_ptr<std::byte> data_;
  std::size_t size_ = 0;
  memory_domain* domain_ = nullptr;
};

/// Where memory lives and how element work runs there (see the file comment).
class memory_domain {
 public:
  memory_domain() = default;
  memory_domain(const memory_domain&) = delete;
  memory_domain& operator=(const memory_domain&) = delete;
  virtual ~memory_domain() = default;

  /// The device its memory is on.
  [[nodiscard]] virtual device where() const noexcept = 0;
  /// `bytes` of zeroed memory of this domain.
  [[nodiscard]] virtual domain_buffer allocate(std::size_t bytes) = 0;
  /// Zeroes bytes [begin, end) of `b`; where the domain can, the whole pages inside take no memory until touched
  /// again (the host's madvise). A domain that cannot only zeroes: size buffers to what must be resident.
  virtual void release(const domain_buffer& b, std::size_t begin, std::size_t end) = 0;
  /// Whether release() hands whole pages back while the range stays usable (the host); where it does not, the
  /// sharded strategies free their full-size arenas instead of releasing them.
  [[nodiscard]] virtual bool releases_pages() const noexcept = 0;
  /// Every element of `t` becomes zero.
  virtual void zero(const raw_tensor& t) = 0;
  /// to = from, element for element (same dtype and size); one side may be host memory (staging, owning leaves).
  virtual void copy(const raw_tensor& from, const raw_tensor& to) = 0;
  /// into += from, element for element (same dtype and size).
  virtual void accumulate(const raw_tensor& from, const raw_tensor& into) = 0;
  /// to = from × factor converted to `to`'s dtype: the product in from's dtype (factor rounded to it), then the
  /// conversion (16-bit floats through float, rounding to nearest even); factor 1 converts alone.
  virtual void convert(const raw_tensor& from, const raw_tensor& to, double factor) = 0;
  /// to = from converted to `to`'s dtype.
  void convert(const raw_tensor& from, const raw_tensor& to) { convert(from, to, 1.0); }
  /// Every element of `t` times `factor` (rounded once, as ddp::detail::scale does on the host).
  virtual void scale(const raw_tensor& t, double factor) = 0;
  /// Every element of `t` becomes `value`.
  virtual void fill(const raw_tensor& t, double value) = 0;
  /// One torch.optim.SGD step over `values` with `grads` (see ddp::sgd_update); `momentum` is empty when
  /// u.momentum is 0.
  virtual void sgd(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& momentum,
                   const sgd_update& u) = 0;
  /// One torch.optim.AdamW step over `values` with `grads` and the moments (see ddp::adamw_update).
  virtual void adamw(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& exp_avg,
                     const raw_tensor& exp_avg_sq, const adamw_update& u) = 0;
  /// Work given to this domain later runs after `w` completes: the host waits for it now, a device enqueues the
  /// wait on its stream.
  virtual void order_after(work& w) = 0;
  /// Returns once every operation given to this domain has run (the optimizer's end of a step).
  virtual void synchronize() = 0;
  /// Calls `f` once every operation given to this domain so far has run: at once on the host, from the stream on a
  /// device (on no thread of the caller's; `f` must not throw or give the domain work).
  virtual void when_done(std::function<void()> f) = 0;
};

inline raw_tensor domain_buffer::view(dtype type, std::size_t begin, std::size_t count) const noexcept {
  return {data_.get() + begin * size_of(type), count, type, domain_ ? domain_->where() : device::cpu()};
}
inline void domain_buffer::release(std::size_t begin, std::size_t end) const {
  if (domain_ && begin < end) domain_->release(*this, begin, end);
}

}  // namespace ddp

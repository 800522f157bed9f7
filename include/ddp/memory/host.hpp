#pragma once
/// \file ddp::host_domain: the memory domain of the CPU. Page-aligned zeroed memory whose whole pages can go back
/// to the OS while the range stays mapped (madvise), and element work as loops on the calling thread, which
/// has run when the call returns (so order_after waits for the collective, and synchronize has nothing to do).

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <type_traits>

#include <sys/mman.h>

#include <ddp/memory/average.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/detail/blocked.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/updates.hpp>

namespace ddp {

/// The CPU's memory domain (see the file comment).
class host_domain final : public memory_domain {
 public:
  static constexpr std::size_t page_bytes = 4096;  ///< allocations are aligned to, and released in, whole pages

  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] domain_buffer allocate(std::size_t bytes) override {
    if (bytes == 0) return {};
    std::shared_ptr<std::byte> p(static_cast<std::byte*>(::operator new(round_up(bytes), std::align_val_t{page_bytes})),
                                 [](std::byte* q) { ::operator delete(q, std::align_val_t{page_bytes}); });
    std::fill_n(p.get(), bytes, std::byte{0});
    return {std::move(p), bytes, this};
  }
  void release(const domain_buffer& b, std::size_t begin, std::size_t end) override {
    std::byte* data = b.data();
    const std::size_t first_page = round_up(begin), last_page = end / page_bytes * page_bytes;
    if (first_page < last_page) {
      std::fill(data + begin, data + first_page, std::byte{0});
      std::fill(data + last_page, data + end, std::byte{0});
      if (::madvise(data + first_page, last_page - first_page, MADV_DONTNEED) == 0) return;
    }
    std::fill(data + begin, data + end, std::byte{0});
  }
  [[nodiscard]] bool releases_pages() const noexcept override { return true; }
  void zero(const raw_tensor& t) override {
    if (t.size) std::memset(t.data, 0, t.bytes());
  }
  void copy(const raw_tensor& from, const raw_tensor& to) override {
    same_shape(from, to, "copy");
    if (from.size && from.data != to.data) std::memcpy(to.data, from.data, from.bytes());
  }
  void accumulate(const raw_tensor& from, const raw_tensor& into) override {
    same_shape(from, into, "accumulate");
    visit_dtype(from.type, [&]<class T>(T) {
      const T* src = static_cast<const T*>(from.data);
      T* dst = static_cast<T*>(into.data);
      for (std::size_t i = 0; i < from.size; ++i) dst[i] = static_cast<T>(dst[i] + src[i]);
    });
  }
  using memory_domain::convert;
  void convert(const raw_tensor& from, const raw_tensor& to, double factor) override {
    if (from.size != to.size)
      throw error("host_domain::convert: " + std::to_string(from.size) + " elements into " + std::to_string(to.size) +
                  "; give both sides the same length");
    if (factor == 1.0) return detail::convert(from, to);
    visit_dtype(from.type, [&]<class F>(F) {
      visit_dtype(to.type, [&]<class T>(T) {
        if constexpr (std::is_floating_point_v<F>) {
          using wide = std::conditional_t<sizeof(F) == 2 || sizeof(T) == 2, float, double>;
          const F* src = static_cast<const F*>(from.data);
          T* dst = static_cast<T*>(to.data);
          const F f = static_cast<F>(factor);
          detail::for_each_blocked(from.size, [&](std::size_t i) {
            dst[i] = static_cast<T>(static_cast<wide>(static_cast<F>(src[i] * f)));
          });
        } else {
          throw error("host_domain::convert: a factor applies to f32 and f64 sources, not " +
                      std::string(to_string(from.type)));
        }
      });
    });
  }
  void scale(const raw_tensor& t, double factor) override { detail::scale(t, factor); }
  void fill(const raw_tensor& t, double value) override {
    visit_dtype(t.type, [&]<class T>(T) {
      T v{};
      if constexpr (std::is_arithmetic_v<T>)
        v = static_cast<T>(value);
      else
        v = T(static_cast<float>(value));  // bf16, f16: through float
      std::fill_n(static_cast<T*>(t.data), t.size, v);
    });
  }
  void sgd(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& momentum, const sgd_update& u) override {
    detail::host_sgd(values, grads, momentum, u);
  }
  void adamw(const raw_tensor& values, const raw_tensor& grads, const raw_tensor& exp_avg, const raw_tensor& exp_avg_sq,
             const adamw_update& u) override {
    detail::host_adamw(values, grads, exp_avg, exp_avg_sq, u);
  }
  void order_after(work& w) override { w.wait(); }
  void synchronize() override {}
  void when_done(std::function<void()> f) override { f(); }

 private:
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + page_bytes - 1) / page_bytes * page_bytes; }
  static void same_shape(const raw_tensor& a, const raw_tensor& b, const char* what) {
    if (a.type != b.type || a.size != b.size)
      throw error(std::string("host_domain::") + what + ": " + std::to_string(a.size) + " " +
                  std::string(to_string(a.type)) + " against " + std::to_string(b.size) + " " +
                  std::string(to_string(b.type)) + "; give both sides the same dtype and length");
  }
};

/// The process's host domain: every wrapper's CPU memory comes from it (it keeps no state but its identity).
inline host_domain& host_memory() {
  static host_domain domain;
  return domain;
}

}  // namespace ddp

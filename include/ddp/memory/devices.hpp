#pragma once
/// \file The memory domain of each device of this process: the host's for the CPU; for a device, the domain its
/// owner registered (ddp::device_registration: the CUDA runtime's, a test's fake device). Whatever meets a
/// tensor on a device (data_parallel laying a leaf into an arena, a host backend staging a buffer) finds the
/// domain that can touch it here.

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp {

namespace detail {
/// The registered device domains.
struct device_table {
  std::mutex mutex;
  std::vector<std::pair<device, memory_domain*>> entries;
};
inline device_table& device_domains() {
  static device_table table;
  return table;
}
}  // namespace detail

/// The memory domain of `d`: the host's for the CPU, else the one registered for `d`, else null.
inline memory_domain* domain_of(device d) {
  if (!d.is_cuda()) return &host_memory();
  auto& t = detail::device_domains();
  std::lock_guard lock(t.mutex);
  const auto it = std::find_if(t.entries.begin(), t.entries.end(), [&](const auto& e) { return e.first == d; });
  return it == t.entries.end() ? nullptr : it->second;
}

/// The memory domain of `d`, or a ddp::config_error naming the fix (`who` names the caller in the message).
inline memory_domain& require_domain_of(device d, const std::string& who) {
  if (memory_domain* m = domain_of(d)) return *m;
  throw config_error(who + ": memory on " + d.to_string() + " has no memory domain in this process; register "
                     "one (ddp::device_registration: the CUDA runtime's domain of ddp::cuda, or a test's fake "
                     "device) before handing ddp device memory, or keep the tensors on the CPU");
}

/// Registers `domain` as the memory domain of its device for the registration's lifetime; a device has one.
class [[nodiscard]] device_registration {
 public:
  /// Registers `domain` (which must outlive the registration) for `domain.where()`.
  explicit device_registration(memory_domain& domain) : device_(domain.where()) {
    if (!device_.is_cuda()) throw config_error("device_registration: the CPU's domain is the host's; register devices");
    auto& t = detail::device_domains();
    std::lock_guard lock(t.mutex);
    for (const auto& e : t.entries)
      if (e.first == device_)
        throw config_error("device_registration: " + device_.to_string() + " has a memory domain registered "
                           "already; one domain per device (drop the first registration before making another)");
    t.entries.emplace_back(device_, &domain);
  }
  device_registration(const device_registration&) = delete;
  device_registration& operator=(const device_registration&) = delete;
  ~device_registration() {
    auto& t = detail::device_domains();
    std::lock_guard lock(t.mutex);
    std::erase_if(t.entries, [&](const auto& e) { return e.first == device_; });
  }

 private:
  device device_;
};

}  // namespace ddp

#pragma once
// A steady-state step under the wrapper allocates no tensor plain LibTorch does not: LibTorch's CPU allocator is
// wrapped by one that counts, and the same model trains in plain LibTorch and under data_parallel side by side.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include "scenarios.hpp"

namespace ddp_torch_test {

/// Counts the CPU tensors LibTorch allocates (c10::SetCPUAllocator over the allocator in place), delegating each.
class counting_allocator final : public c10::Allocator {
 public:
  counting_allocator() : base_(c10::GetCPUAllocator()) {}
  c10::DataPtr allocate(std::size_t bytes) const override {
    calls_.fetch_add(1, std::memory_order_relaxed);
    bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return base_->allocate(bytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif
  /// Allocations so far.
  [[nodiscard]] std::int64_t calls() const { return calls_.load(); }
  /// Bytes allocated so far.
  [[nodiscard]] std::uint64_t bytes() const { return bytes_.load(); }

 private:
  c10::Allocator* base_;
  mutable std::atomic<std::int64_t> calls_{0};
  mutable std::atomic<std::uint64_t> bytes_{0};
};

/// The counting allocator in place of LibTorch's CPU allocator for the rest of the process (a rank of a test).
inline counting_allocator& count_cpu_allocations() {
  static counting_allocator counter;
  static const bool installed = (c10::SetCPUAllocator(&counter, /*priority=*/100), true);
  (void)installed;
  return counter;
}

/// Tensor allocations and bytes per step of `step` over `steps` steps, after three steps of warm-up.
template <class Step>
std::pair<double, double> allocations_per_step(counting_allocator& counter, Step&& step, int steps = 6) {
  for (int s = 0; s < 3; ++s) step();
  const std::int64_t calls = counter.calls();
  const std::uint64_t bytes = counter.bytes();
  for (int s = 0; s < steps; ++s) step();
  return {static_cast<double>(counter.calls() - calls) / steps, static_cast<double>(counter.bytes() - bytes) / steps};
}

/// Net under policies Ps with a torch SGD (momentum) step, against the same model and optimizer without the wrapper:
/// the wrapper's steady-state step allocates no more tensors, and no more bytes, than plain LibTorch's. (A torch
/// optimizer over ddp::parameters(dp) allocates a few scalars per tensor it steps, one tensor per bucket's shard:
/// default buckets give this model fewer tensors than its own parameters, 25-byte buckets would give more.)
template <class Net, class... Ps, class Comm>
void check_steady_state_allocations(Comm comm) {
  counting_allocator& counter = count_cpu_allocations();
  const auto [x, y] = make_batch<Net>(0, global_batch);
  const auto [begin, count] = shard_of(comm.rank(), comm.size());
  const auto mx = x.narrow(0, begin, count).contiguous(), my = y.narrow(0, begin, count).contiguous();
  const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.9);

  Net plain = make_model<Net>(1);
  torch::optim::SGD plain_opt(plain->parameters(), sgd);
  const auto [plain_calls, plain_bytes] = allocations_per_step(counter, [&] {
    plain_opt.zero_grad();
    scaled_loss(plain->forward(mx), my, 1.0).backward();
    plain_opt.step();
  });

  Net net = make_model<Net>(1);
  ddp::data_parallel<wrapped_t<Net>, Ps...> dp{wrapped(net), comm};
  using dp_type = decltype(dp);
  torch::optim::SGD opt(std::is_same_v<typename dp_type::sharding, ddp::replicate> ? net->parameters()
                                                                                   : ddp::parameters(dp),
                        sgd);
  const auto [calls, bytes] = allocations_per_step(counter, [&] {
    dp.zero_grad();
    if constexpr (std::is_same_v<Net, deep>)
      scaled_loss(net->forward(mx, [&](auto& unit, const torch::Tensor& in) { return ddp::forward(dp, unit, in); }),
                  my, 1.0)
          .backward();
    else
      scaled_loss(net->forward(mx), my, 1.0).backward();
    dp.step(opt);
  });
  INFO("tensor allocations per step: plain LibTorch " << plain_calls << " (" << plain_bytes << " bytes), under ddp "
                                                      << calls << " (" << bytes << " bytes)");
  REQUIRE(calls <= plain_calls);
  REQUIRE(bytes <= plain_bytes);
}

}  // namespace ddp_torch_test

#pragma once
/// \file Flat buffers: the contiguous spans of values and gradients optimizers step over, and the
/// optimizer state kept per flat buffer and exposed per parameter and state array (for checkpoints).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>
#include <ddp/core/updates.hpp>

namespace ddp::optim {

/// The part of one parameter that lies in a flat buffer (the whole parameter unless the buffer is a shard).
struct flat_segment {
  std::string name;         ///< the parameter's dotted name ("fc1.weight")
  std::size_t offset = 0;   ///< first element inside the flat buffer
  std::size_t numel = 0;    ///< elements of the parameter inside the flat buffer
  std::size_t start = 0;    ///< index, within the parameter, of the segment's first element (0 unless sharded)
};

/// A contiguous span of parameter values and their gradients (same dtype, same length) with the
/// parameters laid in it. data_parallel hands one per arena (or per owned shard) to the optimizer.
struct flat_buffer {
  raw_tensor values;                   ///< the values the optimizer updates
  raw_tensor grads;                    ///< the gradients, already averaged across ranks
  std::vector<flat_segment> segments;  ///< the parameters in `values`, in order
  memory_domain* domain = nullptr;     ///< where values and gradients live (null: the host); its state goes there
  /// Every parameter name of the model, also those whose pieces lie in other ranks' shards (parameter groups check
  /// their patterns against it); null: the segments' names are the whole model.
  std::shared_ptr<const std::vector<std::string>> parameters{};

  /// The domain of its memory: `domain`, else the host's.
  [[nodiscard]] memory_domain& memory() const noexcept { return domain ? *domain : host_memory(); }
};

/// An optimizer data_parallel can step: attach() allocates its state for a layout, step() updates values.
template <class O>
concept flat_optimizer = requires(O& o, std::span<const flat_buffer> buffers) {
  o.attach(buffers);
  o.step(buffers);
};

/// Specialize for an optimizer that holds its own tensors (a framework's, such as torch::optim) with
///   static void prepare(const Opt&, std::span<const flat_buffer> owned, int rank);
/// throwing ddp::config_error unless it steps tensors over the `owned` buffers, and pointing each tensor's gradient
/// at its buffer's gradients again where the framework dropped it (its own zero_grad): data_parallel calls it
/// before each step under the sharded policies, where only the owned blocks receive the averaged gradients.
template <class Opt>
struct optimizer_traits {};

namespace detail {

/// Elements [begin, begin + count) of `t`.
inline raw_tensor part(const raw_tensor& t, std::size_t begin, std::size_t count) noexcept {
  return {static_cast<std::byte*>(t.data) + begin * size_of(t.type), count, t.type, t.where};
}

/// Optimizer state: per flat buffer, one state array per name ("momentum_buffer", "exp_avg", ...) of the buffer's
/// dtype and length, in the buffer's memory domain, zero when created; plus the number of steps taken.
class flat_state {
 public:
  /// `names` names the per-element state arrays (possibly none).
  explicit flat_state(std::vector<std::string_view> names) : array_names_(std::move(names)) {}

  /// Allocates zeroed state for `buffers` on first use; afterwards checks that the layout is the same.
  void attach(std::span<const flat_buffer> buffers) {
    if (layout_.empty() && state_.empty()) {
      for (const auto& b : buffers) {
        layout_.push_back(b);
        auto& arrays = state_.emplace_back();
        for (std::size_t s = 0; s < array_names_.size(); ++s) arrays.push_back(b.memory().allocate(b.values.bytes()));
      }
      return;
    }
    if (buffers.size() != layout_.size())
      throw config_error("optimizer: stepped over " + std::to_string(buffers.size()) + " flat buffers but its state "
                         "was made for " + std::to_string(layout_.size()) + "; use one optimizer per data_parallel");
    for (std::size_t i = 0; i < buffers.size(); ++i)
      if (buffers[i].values.size != layout_[i].values.size || buffers[i].values.type != layout_[i].values.type)
        throw config_error("optimizer: flat buffer " + std::to_string(i) + " has " +
                           std::to_string(buffers[i].values.size) + " " + std::string(to_string(buffers[i].values.type)) +
                           " elements but the state holds " + std::to_string(layout_[i].values.size) + " " +
                           std::string(to_string(layout_[i].values.type)) + "; use one optimizer per data_parallel");
  }

  /// Calls `f(name, view)` for every parameter and state array ("fc1.weight.exp_avg"); views are writable, so
  /// a checkpoint loader fills them. Empty until attach() or the first step. Under sharding a view holds
  /// only the owned piece of the parameter, and a parameter may come in several pieces: then give `f` a
  /// third parameter, `const flat_segment&`, whose `start` says where the piece lies in the parameter.
  template <class F>
  void for_each_state(F&& f) {
    for (std::size_t i = 0; i < layout_.size(); ++i)
      for (const auto& seg : layout_[i].segments)
        for (std::size_t s = 0; s < array_names_.size(); ++s) {
          const std::size_t width = size_of(layout_[i].values.type);
          const raw_tensor view{state_[i][s].data() + seg.offset * width, seg.numel, layout_[i].values.type,
                                layout_[i].values.where};
          if constexpr (std::is_invocable_v<F&, std::string, raw_tensor, const flat_segment&>)
            f(seg.name + "." + std::string(array_names_[s]), view, seg);
          else
            f(seg.name + "." + std::string(array_names_[s]), view);
        }
  }

  /// Steps taken so far (PyTorch's per-parameter "step", shared by all parameters here).
  [[nodiscard]] std::uint64_t step_count() const noexcept { return steps_; }
  /// Sets the step counter (checkpoint loading).
  void set_step_count(std::uint64_t steps) noexcept { steps_ = steps; }

 protected:
  /// Runs `update(index, buffer, domain, arrays)` for every buffer after attach(): `arrays` are its state arrays as
  /// tensors of the buffer's domain, where the update runs (core/updates.hpp).
  template <class Update>
  void for_each_buffer(std::span<const flat_buffer> buffers, std::string_view who, Update&& update) {
    attach(buffers);
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const auto& b = buffers[i];
      if (b.grads.type != b.values.type || b.grads.size != b.values.size)
        throw config_error(std::string(who) + ": values and gradients of flat buffer " + std::to_string(i) +
                           " differ in dtype or length; pass matching spans");
      ddp::detail::steppable(b.values.type, std::string(who).c_str());
      std::vector<raw_tensor> arrays;
      for (auto& s : state_[i]) arrays.push_back(s.view(b.values.type, 0, b.values.size));
      update(i, b, b.memory(), std::span<const raw_tensor>(arrays));
    }
  }

  std::uint64_t steps_ = 0;  ///< steps taken

 private:
  std::vector<std::string_view> array_names_;
  std::vector<flat_buffer> layout_;
  std::vector<std::vector<domain_buffer>> state_;  // [buffer][state array]
};

}  // namespace detail
}  // namespace ddp::optim

#pragma once
/// \file leaf_binding: ties one leaf of the model (any type with ddp::storage_traits) to its place in the
/// flat arenas. An adopting leaf points at that place; an owning leaf keeps its memory and is copied at the
/// step's edges: its gradient in when reported, its values out whenever the arena's values changed.

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp::detail {

/// One leaf, type-erased: where it is bound and how to move its elements.
class leaf_binding {
 public:
  virtual ~leaf_binding() = default;
  /// True when the leaf computes on ddp's memory (no copies at the step's edges).
  [[nodiscard]] virtual bool adopts() const noexcept = 0;
  /// Copies the leaf's current values and gradient to `values`/`grads` (`bytes` each, memory of `domain`) and binds
  /// it there; later copies between the leaf's own memory and ddp's run on `domain`.
  virtual void bind(std::byte* values, std::byte* grads, std::size_t bytes, memory_domain& domain) = 0;
  /// Binds the leaf to other memory of the same size, copying nothing (the sharded strategies' pooled buffers).
  /// `present` false: `values` do not hold the leaf's values (a sharded unit), and a leaf type that can refuse
  /// use until the next rebind does (storage_traits<T>::vacate).
  virtual void rebind(std::byte* values, std::byte* grads, bool present) = 0;
  /// Gives the leaf its values back in memory of its own (the arena is going away).
  virtual void unbind() = 0;
  /// Owning leaves: copies the leaf's gradient to where it is bound (at report time); where micro-batches were
  /// held there (hold_gradient), adds it to their sum.
  virtual void gradient_in() = 0;
  /// Owning leaves whose backward overwrites the gradient: adds this micro-batch's to ddp's memory, since the leaf
  /// will not keep it (a report inside no_sync); other leaves accumulate in their own memory and hold nothing.
  virtual void hold_gradient() = 0;
  /// Owning leaves: copies the gradient where it is bound into the leaf's own (a framework's optimizer reads it).
  virtual void gradient_out() = 0;
  /// Owning leaves: copies the values where it is bound to the leaf (after they changed there).
  virtual void values_out() = 0;
  /// Owning leaves: copies the leaf's values to where it is bound (a framework's optimizer changed them).
  virtual void values_in() = 0;
  /// Owning leaves: zeroes the leaf's own gradient and forgets held micro-batches (zero_grad, a moved gradient).
  virtual void zero_own_gradient() = 0;
  /// Watching leaves: calls `ready` whenever the leaf's gradient is final (kept while the returned handle lives).
  virtual std::shared_ptr<void> watch(std::function<void()> ready) = 0;
  /// Watching leaves whose framework can: runs `f` when the backward in progress ends (true), else nothing (false).
  virtual bool at_backward_end(std::function<void()> f) = 0;
};

/// The binding of a leaf of type T, kept by pointer (a member of the model) or by value (a view leaf). An owning
/// leaf's memory is asked for anew at every copy (storage_traits: "the values now"), so a framework may move it
/// between steps; memory it freed is named, never written.
template <storage_leaf T>
class leaf_binding_of final : public leaf_binding {
  using traits = storage_traits<T>;
  static constexpr bool adopting = adopting_leaf<T>;
  static constexpr bool overwrites = leaf_overwrites_gradient<T>;

 public:
  /// Binds `leaf`, known in errors as the parameter `name`.
  leaf_binding_of(T& leaf, std::string name) requires(!leaf_is_view<T>) : leaf_(&leaf), name_(std::move(name)) {}
  leaf_binding_of(const T& leaf, std::string name) requires(leaf_is_view<T>)
      : copy_(leaf), leaf_(&*copy_), name_(std::move(name)) {}
  leaf_binding_of(const leaf_binding_of&) = delete;
  leaf_binding_of& operator=(const leaf_binding_of&) = delete;

  [[nodiscard]] bool adopts() const noexcept override { return adopting; }

  void bind(std::byte* values, std::byte* grads, std::size_t bytes, memory_domain& domain) override {
    home_values_ = static_cast<std::byte*>(traits::values(*leaf_));
    home_grads_ = static_cast<std::byte*>(traits::grads(*leaf_));
    bytes_ = bytes;
    domain_ = &domain;
    if constexpr (requires { traits::device(*leaf_); }) where_ = traits::device(*leaf_);
    to_ddp(values, home_values_);
    to_ddp(grads, home_grads_);
    rebind(values, grads, true);
  }
  void rebind(std::byte* values, std::byte* grads, bool present) override {
    values_ = values;
    grads_ = grads;
    if constexpr (requires { traits::vacate(*leaf_, values, grads); }) {
      if (!present) {
        traits::vacate(*leaf_, values, grads);
        return;
      }
    }
    if constexpr (adopting) traits::adopt(*leaf_, values, grads);
  }
  void unbind() override {
    if constexpr (adopting) {
      if constexpr (requires { traits::release(*leaf_); }) {
        if constexpr (std::is_same_v<decltype(traits::release(*leaf_)), bool>) {
          if (traits::release(*leaf_)) return;
        } else {
          traits::release(*leaf_);
          return;
        }
      }
      to_home(home_values_, values_);
      to_home(home_grads_, grads_);
      domain_->synchronize();  // the leaf's memory holds its values once the wrapper is gone
      traits::adopt(*leaf_, home_values_, home_grads_);
    }
  }
  void gradient_in() override {
    if constexpr (!adopting) {
      take_gradient();
      held_ = false;
    }
  }
  void hold_gradient() override {
    if constexpr (!adopting && overwrites) {
      take_gradient();
      held_ = true;
    }
  }
  void gradient_out() override {
    if constexpr (!adopting) to_home(own(traits::grads(*leaf_), "gradient"), grads_);
  }
  void values_out() override {
    if constexpr (!adopting) to_home(own(traits::values(*leaf_), "values"), values_);
  }
  void values_in() override {
    if constexpr (!adopting) to_ddp(values_, own(traits::values(*leaf_), "values"));
  }
  void zero_own_gradient() override {
    if constexpr (!adopting) {
      held_ = false;
      if (bytes_) domain_->zero(home(own(traits::grads(*leaf_), "gradient")));
    }
  }
  std::shared_ptr<void> watch(std::function<void()> ready) override {
    if constexpr (watching_leaf<T>)
      return traits::watch(*leaf_, std::move(ready));
    else
      return nullptr;
  }
  bool at_backward_end(std::function<void()> f) override {
    if constexpr (requires { traits::at_backward_end(*leaf_, std::move(f)); }) {
      traits::at_backward_end(*leaf_, std::move(f));
      return true;
    } else {
      return false;
    }
  }

 private:
  /// An owning leaf's memory now (`p`, its `what`): where the framework freed it, the error that says so.
  [[nodiscard]] std::byte* own(void* p, const char* what) const {
    if (!p && bytes_)
      throw error("data_parallel: parameter '" + name_ + "' has no " + what + " memory now: its framework freed it "
                  "while ddp holds the model (dlib's net.clean(), a cleared or resized tensor); free a leaf's memory "
                  "only after the data_parallel wrapper is destroyed, and keep its shape while the wrapper lives");
    return static_cast<std::byte*>(p);
  }
  /// The leaf's gradient into ddp's: added to the micro-batches held there, else copied.
  void take_gradient() const {
    std::byte* g = own(traits::grads(*leaf_), "gradient");
    if (!held_) {
      to_ddp(grads_, g);
      return;
    }
    const auto type = traits::dtype(*leaf_);
    const std::size_t n = bytes_ / size_of(type);
    if (n) domain_->accumulate({g, n, type, where_}, {grads_, n, type, domain_->where()});
  }
  /// The leaf's own bytes at `p`, on its device.
  [[nodiscard]] raw_tensor home(const std::byte* p) const noexcept {
    return {const_cast<std::byte*>(p), bytes_, dtype::u8, where_};
  }
  /// ddp's bytes at `p`, in the bound domain.
  [[nodiscard]] raw_tensor ours(const std::byte* p) const noexcept {
    return {const_cast<std::byte*>(p), bytes_, dtype::u8, domain_->where()};
  }
  /// The leaf's bytes at `from` into ddp's at `to`.
  void to_ddp(std::byte* to, const std::byte* from) const {
    if (bytes_ && to && to != from) domain_->copy(home(from), ours(to));
  }
  /// ddp's bytes at `from` into the leaf's at `to` (nothing where ddp holds none: a freed sharded arena).
  void to_home(std::byte* to, const std::byte* from) const {
    if (bytes_ && from && to != from) domain_->copy(ours(from), home(to));
  }
  std::optional<T> copy_;            // view leaves: the leaf itself
  T* leaf_;                          // the leaf
  std::string name_;                 // its parameter's name
  std::byte* home_values_ = nullptr;  // adopting leaves: their own memory, as first found
  std::byte* home_grads_ = nullptr;
  std::byte* values_ = nullptr;       // where it is bound now
  std::byte* grads_ = nullptr;
  std::size_t bytes_ = 0;
  bool held_ = false;                 // ddp's gradient holds micro-batches the leaf no longer has
  device where_ = device::cpu();            // the leaf's device
  memory_domain* domain_ = &host_memory();  // where ddp's copy lives, the domain of the leaf's device (bind sets it)
};

}  // namespace ddp::detail

#pragma once
/// \file leaf_binding: ties one leaf of the model (any type with ddp::storage_traits) to its place in the
/// flat arenas. An adopting leaf points at that place; an owning leaf keeps its memory and is copied at the
/// step's edges: its gradient in when reported, its values out whenever the arena's values changed.

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
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
  /// Owning leaves: copies the leaf's gradient to where it is bound (at report time).
  virtual void gradient_in() = 0;
  /// Owning leaves: copies the values where it is bound to the leaf (after they changed there).
  virtual void values_out() = 0;
  /// Owning leaves: zeroes the leaf's own gradient (zero_grad).
  virtual void zero_own_gradient() = 0;
  /// Watching leaves: calls `ready` whenever the leaf's gradient is final (kept while the returned handle lives).
  virtual std::shared_ptr<void> watch(std::function<void()> ready) = 0;
  /// Watching leaves whose framework can: runs `f` when the backward in progress ends (true), else nothing (false).
  virtual bool at_backward_end(std::function<void()> f) = 0;
};

/// The binding of a leaf of type T, kept by pointer (a member of the model) or by value (a view leaf).
template <storage_leaf T>
class leaf_binding_of final : public leaf_binding {
  using traits = storage_traits<T>;
  static constexpr bool adopting = adopting_leaf<T>;

 public:
  explicit leaf_binding_of(T& leaf) requires(!leaf_is_view<T>) : leaf_(&leaf) {}
  explicit leaf_binding_of(const T& leaf) requires(leaf_is_view<T>) : copy_(leaf), leaf_(&*copy_) {}
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
        traits::release(*leaf_);
      } else {
        to_home(home_values_, values_);
        to_home(home_grads_, grads_);
        traits::adopt(*leaf_, home_values_, home_grads_);
      }
    }
  }
  void gradient_in() override {
    if constexpr (!adopting) to_ddp(grads_, home_grads_);
  }
  void values_out() override {
    if constexpr (!adopting) to_home(home_values_, values_);
  }
  void zero_own_gradient() override {
    if constexpr (!adopting) domain_->zero(home(home_grads_));
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
  std::byte* home_values_ = nullptr;  // its own memory, as first found
  std::byte* home_grads_ = nullptr;
  std::byte* values_ = nullptr;       // where it is bound now
  std::byte* grads_ = nullptr;
  std::size_t bytes_ = 0;
  device where_ = device::cpu();            // the leaf's device
  memory_domain* domain_ = &host_memory();  // where ddp's copy lives, the domain of the leaf's device (bind sets it)
};

}  // namespace ddp::detail

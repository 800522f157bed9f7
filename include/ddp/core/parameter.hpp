#pragma once
/// \file ddp::parameter: a trainable tensor (value and gradient) whose storage can live in an external arena.

#include <algorithm>
#include <cstddef>
#include <functional>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

/// A trainable tensor: value and gradient of the same shape. It owns host storage until bind()
/// points it at an external flat arena (the wrapper's), which makes buckets zero-copy slices.
template <element T = float>
class parameter {
 public:
  using value_type = T;  ///< element type

  parameter() = default;
  /// A host parameter of `shape`, values and gradient zero.
  explicit parameter(std::vector<std::size_t> shape)
      : shape_(std::move(shape)), value_store_(numel_of(shape_)), grad_store_(value_store_.size()) {
    point_at_own_storage();
  }
  /// A host parameter of `shape` holding `values` (sizes must agree).
  parameter(std::vector<std::size_t> shape, std::vector<T> values) : parameter(std::move(shape)) {
    if (values.size() != value_store_.size())
      throw config_error("parameter: " + std::to_string(values.size()) + " values given for a shape of " +
                         std::to_string(value_store_.size()) + " elements; pass exactly one value per element");
    value_store_ = std::move(values);
    point_at_own_storage();
  }

  /// Copies take the values and gradient into storage of their own.
  parameter(const parameter& other) : shape_(other.shape_), device_(other.device_) {
    value_store_.assign(other.value().begin(), other.value().end());
    grad_store_.assign(other.grad().begin(), other.grad().end());
    point_at_own_storage();
  }
  parameter& operator=(const parameter& other) {
    if (this != &other) *this = parameter(other);
    return *this;
  }
  parameter(parameter&& other) noexcept { swap(other); }
  parameter& operator=(parameter&& other) noexcept {
    parameter moved(std::move(other));
    swap(moved);
    return *this;
  }
  ~parameter() = default;

  /// The values.
  [[nodiscard]] std::span<T> value() noexcept { return {value_, numel_}; }
  /// The values, read-only.
  [[nodiscard]] std::span<const T> value() const noexcept { return {value_, numel_}; }
  /// The gradient.
  [[nodiscard]] std::span<T> grad() noexcept { return {grad_, numel_}; }
  /// The gradient, read-only.
  [[nodiscard]] std::span<const T> grad() const noexcept { return {grad_, numel_}; }
  /// The shape, outermost dimension first.
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }
  /// Number of elements.
  [[nodiscard]] std::size_t numel() const noexcept { return numel_; }
  /// Where value and gradient live.
  [[nodiscard]] ddp::device device() const noexcept { return device_; }
  /// True while the storage is an external arena's.
  [[nodiscard]] bool bound() const noexcept { return value_store_.empty() && numel_ > 0; }

  /// Moves value and gradient into external storage (`numel()` elements each, on `where`); the
  /// current host values are copied there when `copy_values` and both sides are host memory.
  void bind(T* value_storage, T* grad_storage, ddp::device where = device::cpu(), bool copy_values = true) {
    if (copy_values && !where.is_cuda() && !device_.is_cuda()) {
      std::copy_n(value_, numel_, value_storage);
      std::copy_n(grad_, numel_, grad_storage);
    }
    value_store_ = std::vector<T>();  // move-assign frees the capacity (= {} would keep it)
    grad_store_ = std::vector<T>();
    value_ = value_storage;
    grad_ = grad_storage;
    device_ = where;
  }
  /// Takes host values back into storage of its own (the arena is about to go away).
  void unbind() {
    if (!bound()) return;
    if (device_.is_cuda())
      throw config_error("parameter::unbind: a CUDA parameter cannot be copied back by the core; "
                         "copy it to the host with the CUDA helpers first");
    value_store_.assign(value_, value_ + numel_);
    grad_store_.assign(grad_, grad_ + numel_);
    point_at_own_storage();
  }
  /// Sets every gradient element to zero (host parameters).
  void zero_grad() noexcept { std::fill_n(grad_, numel_, T{}); }

 private:
  static std::size_t numel_of(const std::vector<std::size_t>& shape) {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
  }
  void point_at_own_storage() noexcept {
    numel_ = value_store_.size();
    value_ = value_store_.data();
    grad_ = grad_store_.data();
  }
  void swap(parameter& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(device_, other.device_);
    std::swap(value_store_, other.value_store_);
    std::swap(grad_store_, other.grad_store_);
    std::swap(value_, other.value_);
    std::swap(grad_, other.grad_);
    std::swap(numel_, other.numel_);
  }

  std::vector<std::size_t> shape_;
  ddp::device device_{};
  std::vector<T> value_store_;
  std::vector<T> grad_store_;
  T* value_ = nullptr;
  T* grad_ = nullptr;
  std::size_t numel_ = 0;
};

/// tensor_traits of a parameter describe its values.
template <element E>
struct tensor_traits<parameter<E>> {
  static const E* data(const parameter<E>& p) noexcept { return p.value().data(); }
  static std::size_t size(const parameter<E>& p) noexcept { return p.numel(); }
  static constexpr ddp::dtype dtype(const parameter<E>&) noexcept { return dtype_v<E>; }
  static ddp::device device(const parameter<E>& p) noexcept { return p.device(); }
};

/// storage_traits of a parameter: it adopts the arena (bind) and takes its values back (unbind).
template <element E>
struct storage_traits<parameter<E>> {
  static constexpr ddp::dtype dtype(const parameter<E>&) noexcept { return dtype_v<E>; }
  static std::vector<std::size_t> shape(const parameter<E>& p) { return p.shape(); }
  static ddp::device device(const parameter<E>& p) noexcept { return p.device(); }
  static void* values(parameter<E>& p) noexcept { return p.value().data(); }
  static void* grads(parameter<E>& p) noexcept { return p.grad().data(); }
  /// Points the parameter at ddp's memory, which is on the parameter's own device (ddp lays each leaf there).
  static void adopt(parameter<E>& p, void* values, void* grads) {
    p.bind(static_cast<E*>(values), static_cast<E*>(grads), p.device(), false);
  }
  /// Host parameters take their values into storage of their own; a device parameter cannot (the core copies no
  /// device memory), so ddp copies its values back to the device memory it was bound to and points it there.
  static bool release(parameter<E>& p) {
    if (p.device() != device::cpu()) return false;
    p.unbind();
    return true;
  }
};

static_assert(tensor<parameter<float>>);
static_assert(adopting_leaf<parameter<float>>);

}  // namespace ddp

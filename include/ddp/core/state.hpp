#pragma once
/// \file Model state: the tensors of a model that are not trained but belong to it — buffers (BatchNorm's running
/// statistics, counters; kept in sync across ranks as data_parallel_options::buffers says) and frozen parameters
/// (never reduced or stepped; the same on every rank from construction). Both are saved and loaded by the
/// checkpoints under their visited names and compared by verify_in_sync. A model hands them out beside its
/// parameters: ddp::buffer<T> fields of an aggregate, or `f(name, ddp::state(x))` / `f(name, ddp::frozen(x))`
/// from a visitor for tensors the model keeps itself.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

/// What a tensor of model state is to training.
enum class state_kind : std::uint8_t {
  buffer,  ///< changed by the forward (running statistics): synchronized as data_parallel_options::buffers says
  frozen,  ///< a parameter that is not trained: rank 0's at construction, then never changed by ddp
};

/// One tensor of model state as a visitor hands it out: where its elements are, its shape and its kind.
struct state_view {
  raw_tensor tensor;                ///< the elements (host or device memory), any dtype
  std::vector<std::size_t> shape;   ///< outermost first; its product is tensor.size
  state_kind kind = state_kind::buffer;  ///< buffer or frozen parameter
};

/// A type a visitor hands out as model state (ddp::state, ddp::buffer): it says where its elements are.
template <class T>
concept state_leaf = requires(const std::remove_cvref_t<T>& t) {
  { t.view() } -> std::same_as<state_view>;
};

namespace detail {
/// The tensor's shape through its tensor_traits (one dimension of all its elements where it has none).
template <tensor T>
std::vector<std::size_t> shape_of(const T& t) {
  if constexpr (requires { tensor_traits<T>::shape(t); })
    return tensor_traits<T>::shape(t);
  else
    return {tensor_traits<T>::size(t)};
}
}  // namespace detail

/// Model state kept in a tensor of the model (std::vector, std::span, an adapter's matrix...): hand it from a
/// visitor as `f("bn.running_mean", ddp::state(mean))`, or `ddp::frozen(w)` for a parameter that is not trained.
/// It refers to the tensor, which must outlive the wrapper and keep its memory where it is.
template <tensor V>
class state {
 public:
  /// Refers to `values`; `shape` defaults to the tensor's own (or one dimension of all its elements).
  explicit state(V& values, std::vector<std::size_t> shape = {}, state_kind kind = state_kind::buffer)
      : values_(&values), shape_(shape.empty() ? detail::shape_of(values) : std::move(shape)), kind_(kind) {
    std::size_t n = 1;
    for (const auto d : shape_) n *= d;
    if (n != tensor_traits<V>::size(values))
      throw config_error("ddp::state: a shape of " + std::to_string(n) + " elements was given for a tensor of " +
                         std::to_string(tensor_traits<V>::size(values)) + "; give a shape whose product is its size");
  }
  /// Where the elements are, the shape and the kind.
  [[nodiscard]] state_view view() const { return {as_raw(*values_), shape_, kind_}; }

 private:
  V* values_;
  std::vector<std::size_t> shape_;
  state_kind kind_;
};

template <class V>
state(V&) -> state<V>;
template <class V>
state(V&, std::vector<std::size_t>) -> state<V>;

/// A parameter the model does not train, handed from a visitor: `f("embed.weight", ddp::frozen(w))`.
template <tensor V>
state<V> frozen(V& values, std::vector<std::size_t> shape = {}) {
  return state<V>(values, std::move(shape), state_kind::frozen);
}

/// A buffer an aggregate model owns (running statistics, a step counter): host elements of type T (any ddp
/// dtype, integers too) of a fixed shape, visited as model state under its field's name.
template <element T>
class buffer {
 public:
  using value_type = T;  ///< element type

  buffer() = default;
  /// A buffer of `shape`, every element `fill`.
  explicit buffer(std::vector<std::size_t> shape, T fill = T{}) : shape_(std::move(shape)) {
    std::size_t n = 1;
    for (const auto d : shape_) n *= d;
    values_.assign(n, fill);
  }
  /// The elements.
  [[nodiscard]] std::span<T> values() noexcept { return values_; }
  /// The elements.
  [[nodiscard]] std::span<const T> values() const noexcept { return values_; }
  /// The shape, outermost first.
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }
  /// Where the elements are (host memory), the shape and the kind (buffer).
  [[nodiscard]] state_view view() const {
    return {raw_tensor{const_cast<T*>(values_.data()), values_.size(), dtype_v<T>, device::cpu()}, shape_,
            state_kind::buffer};
  }

 private:
  std::vector<std::size_t> shape_;
  std::vector<T> values_;
};

static_assert(state_leaf<buffer<float>> && state_leaf<buffer<std::int64_t>> && state_leaf<state<std::vector<float>>>);

}  // namespace ddp

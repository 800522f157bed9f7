#pragma once
/// \file ddp::trainable: a leaf made of two tensors a model already keeps, its values and its gradient.

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

namespace detail {
template <class T>
concept adoptable_tensor = requires(T& t, void* p) { tensor_traits<T>::adopt(t, p); };
}  // namespace detail

/// A trainable tensor whose values and gradient are two tensors of the model (std::vector, std::span, an
/// adapter's matrix type...). Hand it from a visitor: `f("fc1.weight", ddp::trainable(w, dw, {out, in}))`.
/// It refers to both (they must outlive the wrapper); where both types can adopt outside memory (spans, maps)
/// ddp lays them zero-copy, otherwise it copies gradients in and values out at the step's edges.
template <tensor V, tensor G = V>
class trainable {
 public:
  /// Refers to `values` and `grads` (same element type and count); `shape` defaults to the tensor's own
  /// shape (or one dimension of all its elements).
  trainable(V& values, G& grads, std::vector<std::size_t> shape = {})
      : values_(&values), grads_(&grads), shape_(std::move(shape)) {
    if (shape_.empty()) {
      if constexpr (requires { tensor_traits<V>::shape(values); })
        shape_ = tensor_traits<V>::shape(values);
      else
        shape_ = {tensor_traits<V>::size(values)};
    }
    std::size_t n = 1;
    for (const auto d : shape_) n *= d;
    const auto v = as_raw(values), g = as_raw(grads);
    if (v.type != g.type || v.size != g.size || v.size != n)
      throw config_error("ddp::trainable: values (" + std::string(to_string(v.type)) + ", " + std::to_string(v.size) +
                         " elements), gradient (" + std::string(to_string(g.type)) + ", " + std::to_string(g.size) +
                         " elements) and shape (" + std::to_string(n) + " elements) disagree; give a gradient of "
                         "the values' type and size, and a shape whose product is their size");
  }
  /// The values.
  [[nodiscard]] V& values() const noexcept { return *values_; }
  /// The gradient.
  [[nodiscard]] G& grads() const noexcept { return *grads_; }
  /// The shape, outermost first.
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }

 private:
  V* values_;
  G* grads_;
  std::vector<std::size_t> shape_;
};

template <class V, class G>
trainable(V&, G&) -> trainable<V, G>;
template <class V, class G>
trainable(V&, G&, std::vector<std::size_t>) -> trainable<V, G>;

/// storage_traits of a trainable: through its two tensors' tensor_traits; adopting when both can adopt.
template <class V, class G>
struct storage_traits<trainable<V, G>> {
  static constexpr bool view = true;
  static ddp::dtype dtype(const trainable<V, G>& t) { return tensor_traits<V>::dtype(t.values()); }
  static std::vector<std::size_t> shape(const trainable<V, G>& t) { return t.shape(); }
  static ddp::device device(const trainable<V, G>& t) { return tensor_traits<V>::device(t.values()); }
  static void* values(const trainable<V, G>& t) { return as_raw(t.values()).data; }
  static void* grads(const trainable<V, G>& t) { return as_raw(t.grads()).data; }
  static const void* key(const trainable<V, G>& t) noexcept { return &t.values(); }
  static void adopt(const trainable<V, G>& t, void* values, void* grads)
    requires(detail::adoptable_tensor<V> && detail::adoptable_tensor<G>)
  {
    tensor_traits<V>::adopt(t.values(), values);
    tensor_traits<G>::adopt(t.grads(), grads);
  }
};

static_assert(storage_leaf<trainable<std::vector<float>>> && !adopting_leaf<trainable<std::vector<float>>>);
static_assert(adopting_leaf<trainable<std::span<float>>>);

}  // namespace ddp

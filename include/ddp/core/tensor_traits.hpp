#pragma once
/// \file tensor_traits: the customization point that tells the library where a tensor keeps its elements.

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include <ddp/core/detail/blocked.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>

namespace ddp {

/// Specialize for a tensor type: static data(t), size(t) (elements), dtype(t) and device(t); optionally
/// shape(t) (a std::vector<std::size_t>, outermost first; default {size(t)}) and adopt(t, void*) for types that
/// can be pointed at outside memory without copying (spans, maps), which ddp::trainable lays zero-copy.
template <class T>
struct tensor_traits;

/// An untyped view of elements: pointer, element count, dtype and device (a "raw buffer").
struct raw_tensor {
  void* data = nullptr;           ///< first element
  std::size_t size = 0;           ///< number of elements
  ddp::dtype type = dtype::f32;   ///< element type
  ddp::device where{};            ///< where the elements live

  /// Views a typed span of host memory.
  template <element E>
  static raw_tensor of(std::span<E> s, ddp::device d = device::cpu()) noexcept {
    return {const_cast<std::remove_const_t<E>*>(s.data()), s.size(), dtype_v<E>, d};
  }
  /// Bytes covered.
  [[nodiscard]] std::size_t bytes() const noexcept { return size * size_of(type); }
};

template <element E>
struct tensor_traits<std::vector<E>> {
  static E* data(std::vector<E>& t) noexcept { return t.data(); }
  static const E* data(const std::vector<E>& t) noexcept { return t.data(); }
  static std::size_t size(const std::vector<E>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const std::vector<E>&) noexcept { return dtype_v<E>; }
  static constexpr ddp::device device(const std::vector<E>&) noexcept { return device::cpu(); }
};

template <class E, std::size_t Extent>
  requires element<std::remove_const_t<E>>
struct tensor_traits<std::span<E, Extent>> {
  static E* data(std::span<E, Extent> t) noexcept { return t.data(); }
  static std::size_t size(std::span<E, Extent> t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(std::span<E, Extent>) noexcept { return dtype_v<std::remove_const_t<E>>; }
  static constexpr ddp::device device(std::span<E, Extent>) noexcept { return device::cpu(); }
  static void adopt(std::span<E, Extent>& t, void* p) noexcept { t = std::span<E, Extent>(static_cast<E*>(p), t.size()); }
};

template <>
struct tensor_traits<raw_tensor> {
  static void* data(const raw_tensor& t) noexcept { return t.data; }
  static std::size_t size(const raw_tensor& t) noexcept { return t.size; }
  static ddp::dtype dtype(const raw_tensor& t) noexcept { return t.type; }
  static ddp::device device(const raw_tensor& t) noexcept { return t.where; }
};

/// A type whose tensor_traits tell where its elements are.
template <class T>
concept tensor = requires(const std::remove_cvref_t<T>& t) {
  tensor_traits<std::remove_cvref_t<T>>::data(t);
  { tensor_traits<std::remove_cvref_t<T>>::size(t) } -> std::convertible_to<std::size_t>;
  { tensor_traits<std::remove_cvref_t<T>>::dtype(t) } -> std::same_as<ddp::dtype>;
  { tensor_traits<std::remove_cvref_t<T>>::device(t) } -> std::same_as<ddp::device>;
};

/// Untyped view of any tensor, through its tensor_traits.
template <tensor T>
raw_tensor as_raw(T&& t) {
  using traits = tensor_traits<std::remove_cvref_t<T>>;
  return {const_cast<void*>(static_cast<const void*>(traits::data(t))), traits::size(t), traits::dtype(t),
          traits::device(t)};
}

static_assert(tensor<std::vector<float>> && tensor<std::span<const bfloat16>> && tensor<raw_tensor>);

namespace detail {
/// Copies the host elements of `from` into `to` (same length), converting each to `to`'s dtype (16-bit floats
/// through float, rounding to nearest even; a NaN stays a NaN), in blocks that vectorize (for_each_blocked).
inline void convert(raw_tensor from, raw_tensor to) {
  visit_dtype(from.type, [&]<class F>(F) {
    visit_dtype(to.type, [&]<class T>(T) {
      using wide = std::conditional_t<sizeof(F) == 2 || sizeof(T) == 2, float, double>;
      const F* src = static_cast<const F*>(from.data);
      T* dst = static_cast<T*>(to.data);
      for_each_blocked(from.size, [&](std::size_t i) { dst[i] = static_cast<T>(static_cast<wide>(src[i])); });
    });
  });
}
}  // namespace detail

}  // namespace ddp

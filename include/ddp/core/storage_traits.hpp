#pragma once
/// \file ddp::storage_traits: the customization point that lets a model hand ddp any trainable tensor type.
///
/// A leaf is one trainable tensor: values and a gradient of the same shape. `storage_traits<T>` tells ddp
/// its element type, shape and where its elements are now; a type that can point at outside memory also
/// says how (`adopt`), and ddp then lays it straight into its flat arenas (zero copies). A type that cannot
/// (an owning matrix, a std::vector) keeps its own memory: ddp copies its gradient in when it is reported
/// and its values out after every change (the broadcast at construction, each step, a checkpoint load).
///
/// Required members of a specialization:
///   static ddp::dtype dtype(const T&);                  element type
///   static std::vector<std::size_t> shape(const T&);    shape, outermost first (row-major order)
///   static void* values(T&);                            the values now (host, contiguous)
///   static void* grads(T&);                             the gradient now (same size)
/// Optional members:
///   static void adopt(T&, void* values, void* grads);   points the leaf at outside memory, copying nothing
///   static void release(T&);                            after adopt: takes the values into storage of its
///                                                       own (without it, or where a `bool release` returns
///                                                       false, ddp copies them back to where values()/grads()
///                                                       pointed first and adopts that)
///   static void vacate(T&, void* values, void* grads);  full_shard: the leaf's unit is sharded, so `values`
///                                                       (its place, zeros) are not its values; the leaf is
///                                                       pointed there but made unusable until the next
///                                                       adopt, so a computation outside an unshard scope
///                                                       fails instead of reading zeros (without it, ddp
///                                                       adopts `values`)
///   static ddp::device device(const T&);                where the elements live (default: host memory)
///   static const void* key(const T&);                   the address gradient_ready knows it by (default &t)
///   static std::shared_ptr<void> watch(T&, std::function<void()> ready);  leaves whose framework knows when a
///                                                       gradient is final call ready() then (autograd)
///   static void at_backward_end(const T&, std::function<void()> f);  watching leaves whose framework can run code
///                                                       when the backward in progress ends (autograd's final
///                                                       callbacks), called from a watch callback: data_parallel
///                                                       finishes the gradients there, so they are averaged when the
///                                                       framework's backward() returns (as PyTorch DDP's are)
///   static constexpr bool overwrites_gradient = true;   owning leaves whose framework's backward writes the gradient
///                                                       instead of adding to it (dlib): ddp sums the micro-batches
///                                                       of a no_sync span on its side, so every policy accumulates
///                                                       as PyTorch's does (without it, the leaf's own gradient is
///                                                       taken to add up the span)
///   static constexpr bool view = true;                  the leaf refers to the model's memory and is handed
///                                                       out as a temporary (ddp keeps a copy of it)

#include <cstddef>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include <ddp/core/dtype.hpp>

namespace ddp {

/// Specialize for a trainable tensor type (see this header's description for the members).
template <class T>
struct storage_traits;

/// A type whose storage_traits describe a trainable tensor: a leaf of the model tree.
template <class T>
concept storage_leaf = requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& c) {
  { storage_traits<std::remove_cvref_t<T>>::dtype(c) } -> std::same_as<ddp::dtype>;
  { storage_traits<std::remove_cvref_t<T>>::shape(c) } -> std::convertible_to<std::vector<std::size_t>>;
  { storage_traits<std::remove_cvref_t<T>>::values(t) } -> std::convertible_to<void*>;
  { storage_traits<std::remove_cvref_t<T>>::grads(t) } -> std::convertible_to<void*>;
};

/// A leaf that can point at ddp's memory (zero-copy).
template <class T>
concept adopting_leaf = storage_leaf<T> && requires(std::remove_cvref_t<T>& t, void* p) {
  storage_traits<std::remove_cvref_t<T>>::adopt(t, p, p);
};

/// A leaf that reports its own gradients (its framework calls back when each is final).
template <class T>
concept watching_leaf = storage_leaf<T> && requires(std::remove_cvref_t<T>& t, std::function<void()> f) {
  { storage_traits<std::remove_cvref_t<T>>::watch(t, f) } -> std::convertible_to<std::shared_ptr<void>>;
};

/// An owning leaf whose framework's backward overwrites its gradient (storage_traits<T>::overwrites_gradient).
template <class T>
concept leaf_overwrites_gradient = storage_leaf<T> && requires {
  requires storage_traits<std::remove_cvref_t<T>>::overwrites_gradient;
};

/// The address data_parallel::gradient_ready knows a leaf (or the object a leaf refers to) by.
template <class T>
const void* leaf_key(const T& t) noexcept {
  if constexpr (requires { storage_traits<T>::key(t); })
    return storage_traits<T>::key(t);
  else
    return static_cast<const void*>(&t);
}

/// True when visitors hand the leaf out as a temporary view of the model's memory (ddp keeps a copy).
template <class T>
inline constexpr bool leaf_is_view = [] {
  if constexpr (requires { storage_traits<T>::view; })
    return storage_traits<T>::view;
  else
    return false;
}();

}  // namespace ddp

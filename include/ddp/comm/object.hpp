#pragma once
/// \file all_gather_object / broadcast_object: collectives over values of any serializable type
/// (trivially copyable types, std::string, std::vector of serializable, aggregates of serializable).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/core/detail/reflect.hpp>
#include <ddp/core/error.hpp>

namespace ddp {

namespace detail {

template <class T>
struct is_std_vector : std::false_type {};
template <class E, class A>
struct is_std_vector<std::vector<E, A>> : std::true_type {};

/// Appends the bytes of `value` to `out`.
template <class T>
void serialize(const T& value, std::vector<std::uint8_t>& out) {
  if constexpr (std::is_trivially_copyable_v<T>) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
    out.insert(out.end(), p, p + sizeof(T));
  } else if constexpr (std::is_same_v<T, std::string> || is_std_vector<T>::value) {
    serialize(static_cast<std::uint64_t>(value.size()), out);
    for (const auto& element : value) serialize(element, out);
  } else {
    static_assert(reflectable_aggregate<T>,
                  "ddp: this type cannot travel in an object collective; use a trivially copyable type, "
                  "std::string, std::vector, or an aggregate of those.");
    for_each_field(value, [&](std::string_view, const auto& field) { serialize(field, out); });
  }
}

/// Reads a value from `in`, advancing it; throws ddp::mismatch_error when the bytes run out.
template <class T>
void deserialize(T& value, std::span<const std::uint8_t>& in) {
  const auto take = [&](void* dst, std::size_t n) {
    if (in.size() < n)
      throw mismatch_error("object collective: the received bytes end early; every rank must pass the same C++ type");
    std::memcpy(dst, in.data(), n);
    in = in.subspan(n);
  };
  if constexpr (std::is_trivially_copyable_v<T>) {
    take(&value, sizeof(T));
  } else if constexpr (std::is_same_v<T, std::string> || is_std_vector<T>::value) {
    std::uint64_t n = 0;
    take(&n, sizeof n);
    if (n > in.size())
      throw mismatch_error("object collective: a length field exceeds the received bytes; every rank must pass the "
                           "same C++ type");
    value.resize(n);
    for (auto& element : value) deserialize(element, in);
  } else {
    for_each_field(value, [&](std::string_view, auto& field) { deserialize(field, in); });
  }
}

}  // namespace detail

/// Gathers `value` from every rank; element r of the result is rank r's value.
template <class Comm, class T>
std::vector<T> all_gather_object(Comm& comm, const T& value) {
  std::vector<std::uint8_t> mine;
  detail::serialize(value, mine);
  const auto n = static_cast<std::size_t>(comm.size());
  const std::int64_t my_size = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(n);
  comm.all_gather(std::span<const std::int64_t>(&my_size, 1), std::span<std::int64_t>(sizes)).wait();
  const auto widest = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  mine.resize(widest);
  std::vector<std::uint8_t> all(widest * n);
  comm.all_gather(std::span<const std::uint8_t>(mine), std::span<std::uint8_t>(all)).wait();
  std::vector<T> out(n);
  for (std::size_t r = 0; r < n; ++r) {
    std::span<const std::uint8_t> in(all.data() + r * widest, static_cast<std::size_t>(sizes[r]));
    detail::deserialize(out[r], in);
  }
  return out;
}

/// Replaces `value` on every rank with root's.
template <class Comm, class T>
void broadcast_object(Comm& comm, T& value, int root = 0) {
  std::vector<std::uint8_t> bytes;
  if (comm.rank() == root) detail::serialize(value, bytes);
  std::int64_t size = static_cast<std::int64_t>(bytes.size());
  comm.broadcast(std::span<std::int64_t>(&size, 1), root).wait();
  bytes.resize(static_cast<std::size_t>(size));
  comm.broadcast(std::span<std::uint8_t>(bytes), root).wait();
  if (comm.rank() != root) {
    std::span<const std::uint8_t> in(bytes);
    detail::deserialize(value, in);
  }
}

namespace detail {
/// Gives a communicator the member spellings comm.all_gather_object(v) and comm.broadcast_object(v, root).
template <class Derived>
class object_collectives {
 public:
  /// See ddp::all_gather_object.
  template <class T>
  std::vector<T> all_gather_object(const T& value) {
    return ddp::all_gather_object(static_cast<Derived&>(*this), value);
  }
  /// See ddp::broadcast_object.
  template <class T>
  void broadcast_object(T& value, int root = 0) {
    ddp::broadcast_object(static_cast<Derived&>(*this), value, root);
  }
};
}  // namespace detail

}  // namespace ddp

#pragma once
/// \file Minimal aggregate reflection: field count, field references and field names (g++ >= 12, clang >= 15).
///
/// Boost.PFR 1.81 (Debian 12) makes g++ 12 fail with an internal compiler error on aggregates that
/// hold std::array fields, and it cannot name fields; this header does both with standard C++20.

#include <cstddef>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ddp/core/detail/reflect_tie.hpp>

namespace ddp::detail {

/// Converts to any field type; used to count how many initializers an aggregate accepts.
struct any_field {
  std::size_t index;
  template <class U>
  operator U&() const;  // NOLINT(google-explicit-constructor)
  template <class U>
  operator U&&() const;  // NOLINT(google-explicit-constructor)
};

template <class T, std::size_t... I>
concept brace_initializable_with = requires { T{any_field{I}...}; };

template <class T, std::size_t N>
consteval bool accepts_initializers() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return brace_initializable_with<T, I...>;
  }(std::make_index_sequence<N>{});
}

template <class T, std::size_t N = 0>
consteval std::size_t count_fields_from() {
  if constexpr (N < max_reflected_fields + 1 && accepts_initializers<T, N + 1>())
    return count_fields_from<T, N + 1>();
  else
    return N;
}

/// True for the class types whose fields can be reflected.
template <class T>
concept reflectable_aggregate =
    std::is_class_v<T> && std::is_aggregate_v<T> && !std::is_union_v<T> && std::is_default_constructible_v<T>;

/// Number of fields of aggregate T.
template <reflectable_aggregate T>
inline constexpr std::size_t field_count_v = count_fields_from<T>();

/// Field I of aggregate `t`, by reference.
template <std::size_t I, class T>
constexpr auto& get_field(T& t) noexcept {
  return std::get<I>(tie_fields<field_count_v<std::remove_cv_t<T>>>(t));
}

/// Type of field I of aggregate T.
template <std::size_t I, class T>
using field_type_t = std::remove_cvref_t<decltype(get_field<I>(std::declval<T&>()))>;

template <class T>
extern const T reflected_object;

template <auto FieldAddress>
consteval std::string_view signature_naming() {
  return __PRETTY_FUNCTION__;
}

/// Name of field I of aggregate T, read from the compiler's spelling of a pointer to that field.
template <class T, std::size_t I>
consteval std::string_view field_name() {
  constexpr std::string_view text = signature_naming<&get_field<I>(reflected_object<T>)>();
  constexpr auto end = text.rfind(')');
  constexpr auto start = text.substr(0, end).find_last_of(":.") + 1;
  return text.substr(start, end - start);
}

/// Calls `f(name, field)` for each field of aggregate `t`, in declaration order.
template <class T, class F>
constexpr void for_each_field(T& t, F&& f) {
  using plain = std::remove_cv_t<T>;
  auto fields = tie_fields<field_count_v<plain>>(t);
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (f(field_name<plain, I>(), std::get<I>(fields)), ...);
  }(std::make_index_sequence<field_count_v<plain>>{});
}

}  // namespace ddp::detail

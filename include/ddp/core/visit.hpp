#pragma once
/// \file ddp::visit_parameters: walks every parameter of a model, giving dotted names ("fc1.weight").
///
/// Lookup order for a node of the model tree: a ddp::parameter is a leaf; else a member
/// `visit_parameters(f)`; else an ADL `visit_parameters(node, f)`; else a std::array or std::vector
/// of nodes (names "0", "1", ...); else recursion over the fields of an aggregate. The
/// callback a visitor receives may be given parameters or whole sub-modules: both are walked.

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/core/detail/reflect.hpp>
#include <ddp/core/parameter.hpp>

namespace ddp {

namespace detail {

/// A callback of the shape visitors are called with; used to detect visitors.
struct probe_visitor {
  template <class P>
  void operator()(std::string_view, P&&) const {}
};

template <class M>
concept has_member_visitor = requires(M& m, probe_visitor f) { m.visit_parameters(f); };

template <class M>
concept has_adl_visitor = requires(M& m, probe_visitor f) { visit_parameters(m, f); };

template <class T>
struct is_sequence : std::false_type {};
template <class E, std::size_t N>
struct is_sequence<std::array<E, N>> : std::true_type { using element = E; };
template <class E, class A>
struct is_sequence<std::vector<E, A>> : std::true_type { using element = E; };

template <class T>
constexpr bool node_has_parameters();

template <class T, std::size_t... I>
constexpr bool any_field_has_parameters(std::index_sequence<I...>) {
  return (node_has_parameters<field_type_t<I, T>>() || ...);
}

/// True when walking a T can reach a parameter (decided at compile time).
template <class T>
constexpr bool node_has_parameters() {
  if constexpr (is_parameter_v<T> || has_member_visitor<T> || has_adl_visitor<T>) {
    return true;
  } else if constexpr (is_sequence<T>::value) {
    return node_has_parameters<typename is_sequence<T>::element>();
  } else if constexpr (reflectable_aggregate<T>) {
    return any_field_has_parameters<T>(std::make_index_sequence<field_count_v<T>>{});
  } else {
    return false;
  }
}

inline std::string join_name(std::string_view prefix, std::string_view name) {
  std::string out;
  out.reserve(prefix.size() + name.size() + 1);
  out.append(prefix);
  if (!prefix.empty() && !name.empty()) out.push_back('.');
  out.append(name);
  return out;
}

template <class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f);

template <class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f) {
  using plain = std::remove_cv_t<Node>;
  // A user's visitor is usually written for a mutable model; a const model is walked through it
  // and its parameters are handed on as const, so both give the same names.
  auto& mutable_node = const_cast<plain&>(node);
  auto descend = [&](std::string_view name, auto& child) {
    if constexpr (std::is_const_v<Node>)
      visit_node(std::as_const(child), join_name(prefix, name), f);
    else
      visit_node(child, join_name(prefix, name), f);
  };
  if constexpr (is_parameter_v<plain>) {
    f(prefix, node);
  } else if constexpr (has_member_visitor<plain>) {
    mutable_node.visit_parameters(descend);
  } else if constexpr (has_adl_visitor<plain>) {
    visit_parameters(mutable_node, descend);
  } else if constexpr (is_sequence<plain>::value) {
    for (std::size_t i = 0; i < node.size(); ++i) visit_node(node[i], join_name(prefix, std::to_string(i)), f);
  } else {
    for_each_field(node, [&](std::string_view name, auto& field) {
      if constexpr (node_has_parameters<std::remove_cvref_t<decltype(field)>>())
        visit_node(field, join_name(prefix, name), f);
    });
  }
}

struct visit_parameters_fn {
  template <class Model, class F>
  void operator()(Model& model, F&& f) const {
    static_assert(node_has_parameters<std::remove_cv_t<Model>>(),
                  "ddp::visit_parameters: this model has no parameters to visit. Give it a member "
                  "visit_parameters(f) calling f(name, param) for each ddp::parameter or sub-module, an ADL "
                  "visit_parameters(model, f), or make it an aggregate whose fields are ddp::parameter, "
                  "std::array/std::vector of layers, or such aggregates.");
    visit_node(model, std::string_view{}, f);
  }
};

}  // namespace detail

/// A model type in which ddp::visit_parameters finds at least one parameter.
template <class Model>
concept parameter_visitable = detail::node_has_parameters<std::remove_cv_t<Model>>();

inline namespace cpo {
/// Calls `f(dotted_name, parameter&)` for every parameter of `model`, in a stable order.
inline constexpr detail::visit_parameters_fn visit_parameters{};
}  // namespace cpo

}  // namespace ddp

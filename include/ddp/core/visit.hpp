#pragma once
/// \file ddp::visit_parameters: walks every parameter of a model, giving dotted names ("fc1.weight").
///
/// Lookup order for a node of the model tree: a type with ddp::storage_traits (ddp::parameter,
/// ddp::trainable, an adapter's tensor) is a leaf; else a ddp::parameter_visitor specialization (an adapter's
/// module class, e.g. torch::nn::Module); else a member
/// `visit_parameters(f)`; else an ADL `visit_parameters(node, f)`; else a std::array or std::vector
/// of nodes (names "0", "1", ...); else recursion over the fields of an aggregate. The
/// callback a visitor receives may be given parameters, model state (ddp::state, ddp::frozen, ddp::buffer;
/// core/state.hpp) or whole sub-modules: all are walked. ddp::visit_state walks the same tree for the state.

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/core/detail/dependent_false.hpp>
#include <ddp/core/detail/reflect.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/state.hpp>
#include <ddp/core/storage_traits.hpp>

namespace ddp {

/// Specialize for model types of a framework (an adapter's module class) with
///   template <class F> static void visit(M& m, F&& f);          f(name, leaf) for each trainable tensor
/// and optionally
///   template <class F> static void visit_state(M& m, F&& f);    f(name, ddp::state_view) for the buffers and
///                                                               frozen parameters (model state, core/state.hpp)
template <class M>
struct parameter_visitor {};

namespace detail {

/// A callback of the shape visitors are called with; used to detect visitors.
struct probe_visitor {
  template <class P>
  void operator()(std::string_view, P&&) const {}
};

template <class M>
concept has_parameter_visitor = requires(M& m, probe_visitor f) { parameter_visitor<M>::visit(m, f); };

template <class M>
concept has_member_visitor = requires(M& m, probe_visitor f) { m.visit_parameters(f); };

template <class M>
concept has_adl_visitor = requires(M& m, probe_visitor f) { visit_parameters(m, f); };

/// A callback of the shape state visitors are called with.
struct probe_state_visitor {
  void operator()(std::string_view, const state_view&) const {}
};

template <class M>
concept has_state_visitor = requires(M& m, probe_state_visitor f) { parameter_visitor<M>::visit_state(m, f); };

template <class T>
struct is_sequence : std::false_type {};
template <class E, std::size_t N>
struct is_sequence<std::array<E, N>> : std::true_type { using element = E; };
template <class E, class A>
struct is_sequence<std::vector<E, A>> : std::true_type { using element = E; };

template <class T>
constexpr bool node_has_parameters();
template <class T>
constexpr bool node_has_state();

/// A framework's tensor or matrix type (elements and rows/cols, or data_ptr and grad) without storage_traits.
template <class T>
concept tensor_lookalike = !storage_leaf<T> && (requires(T& t) {
                                                  t.data();
                                                  t.rows();
                                                  t.cols();
                                                } || requires(T& t) {
                                                  t.data_ptr();
                                                  t.grad();
                                                });

/// Stops the build where the model holds `T` and ddp cannot train it; the compiler names T in this
/// function's instantiation.
template <class T>
constexpr bool no_storage_traits_for() {
  static_assert(dependent_false<T>,
                "ddp::visit_parameters: the model holds an object of a type ddp cannot train (the compiler names it "
                "as T in no_storage_traits_for<T> [with T = ...]). Include its adapter (<ddp/adapters/libtorch.hpp> "
                "for torch::Tensor and torch::nn::Module, <ddp/adapters/eigen.hpp> for Eigen matrices and maps), hand "
                "values and gradient together as ddp::trainable(values, grads), or specialize ddp::storage_traits<T>.");
  return true;
}

template <class T, std::size_t... I>
constexpr bool any_field_has_parameters(std::index_sequence<I...>) {
  return (node_has_parameters<field_type_t<I, T>>() || ...);
}
template <class T, std::size_t... I>
constexpr bool any_field_has_state(std::index_sequence<I...>) {
  return (node_has_state<field_type_t<I, T>>() || ...);
}

/// True when walking a T can reach a parameter (decided at compile time).
template <class T>
constexpr bool node_has_parameters() {
  if constexpr (storage_leaf<T> || has_parameter_visitor<T> || has_member_visitor<T> || has_adl_visitor<T>) {
    return true;
  } else if constexpr (state_leaf<T>) {
    return false;
  } else if constexpr (tensor_lookalike<T>) {
    return no_storage_traits_for<T>();
  } else if constexpr (is_sequence<T>::value) {
    return node_has_parameters<typename is_sequence<T>::element>();
  } else if constexpr (reflectable_aggregate<T>) {
    return any_field_has_parameters<T>(std::make_index_sequence<field_count_v<T>>{});
  } else {
    return false;
  }
}

/// True when walking a T can reach model state (decided at compile time; visitors may hand out some).
template <class T>
constexpr bool node_has_state() {
  if constexpr (state_leaf<T> || has_parameter_visitor<T> || has_member_visitor<T> || has_adl_visitor<T>) {
    return true;
  } else if constexpr (storage_leaf<T>) {
    return false;
  } else if constexpr (is_sequence<T>::value) {
    return node_has_state<typename is_sequence<T>::element>();
  } else if constexpr (reflectable_aggregate<T>) {
    return any_field_has_state<T>(std::make_index_sequence<field_count_v<T>>{});
  } else {
    return false;
  }
}

/// Whether a walk of `Node` in this mode (parameters, or model state) can reach something to visit.
template <bool State, class Node>
constexpr bool node_reaches() {
  if constexpr (State)
    return node_has_state<Node>();
  else
    return node_has_parameters<Node>();
}

inline std::string join_name(std::string_view prefix, std::string_view name) {
  std::string out;
  out.reserve(prefix.size() + name.size() + 1);
  out.append(prefix);
  if (!prefix.empty() && !name.empty()) out.push_back('.');
  out.append(name);
  return out;
}

/// Walks `node` calling `f(name, leaf)` for its parameters, or (State) `f(name, state_view)` for its model state.
template <bool State, class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f);

template <bool State, class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f) {
  using plain = std::remove_cv_t<Node>;
  // A user's visitor is usually written for a mutable model; a const model is walked through it
  // and its parameters are handed on as const, so both give the same names.
  auto& mutable_node = const_cast<plain&>(node);
  auto descend = [&](std::string_view name, auto&& child) {
    if constexpr (std::is_const_v<Node>)
      visit_node<State>(std::as_const(child), join_name(prefix, name), f);
    else
      visit_node<State>(child, join_name(prefix, name), f);
  };
  if constexpr (storage_leaf<plain>) {
    if constexpr (!State) f(prefix, node);
  } else if constexpr (state_leaf<plain>) {
    if constexpr (State) f(prefix, node.view());
  } else if constexpr (has_parameter_visitor<plain>) {
    if constexpr (!State)
      parameter_visitor<plain>::visit(mutable_node, descend);
    else if constexpr (has_state_visitor<plain>)
      parameter_visitor<plain>::visit_state(
          mutable_node, [&](std::string_view name, const state_view& v) { f(join_name(prefix, name), v); });
  } else if constexpr (has_member_visitor<plain>) {
    mutable_node.visit_parameters(descend);
  } else if constexpr (has_adl_visitor<plain>) {
    visit_parameters(mutable_node, descend);
  } else if constexpr (is_sequence<plain>::value && node_reaches<State, plain>()) {
    for (std::size_t i = 0; i < node.size(); ++i)
      visit_node<State>(node[i], join_name(prefix, std::to_string(i)), f);
  } else if constexpr (reflectable_aggregate<plain> && node_reaches<State, plain>()) {
    for_each_field(node, [&](std::string_view name, auto& field) {
      if constexpr (node_reaches<State, std::remove_cvref_t<decltype(field)>>())
        visit_node<State>(field, join_name(prefix, name), f);
    });
  } else if constexpr (!State) {
    no_storage_traits_for<plain>();
  }
}

struct visit_parameters_fn {
  template <class Model, class F>
  void operator()(Model& model, F&& f) const {
    static_assert(node_has_parameters<std::remove_cv_t<Model>>(),
                  "ddp::visit_parameters: this model has no parameters to visit. Give it a member "
                  "visit_parameters(f) calling f(name, leaf) for each trainable tensor (ddp::parameter, "
                  "ddp::trainable(values, grads), an adapter's tensor) or sub-module, an ADL "
                  "visit_parameters(model, f), or make it an aggregate whose fields are such leaves, "
                  "std::array/std::vector of layers, or such aggregates.");
    visit_node<false>(model, std::string_view{}, f);
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

/// Calls `f(dotted_name, const ddp::state_view&)` for every buffer and frozen parameter of `model` (its model
/// state, core/state.hpp), in a stable order; nothing for a model without any.
template <class Model, class F>
void visit_state(Model& model, F&& f) {
  if constexpr (detail::node_has_state<std::remove_cv_t<Model>>()) detail::visit_node<true>(model, std::string_view{}, f);
}

}  // namespace ddp

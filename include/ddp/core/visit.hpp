#pragma once
/// \file ddp::visit_parameters: walks every parameter of a model, giving dotted names ("fc1.weight").
///
/// Lookup order for a node of the model tree: a type with ddp::storage_traits (ddp::parameter,
/// ddp::trainable, an adapter's tensor) is a leaf; else a ddp::parameter_visitor specialization (an adapter's
/// module class, e.g. torch::nn::Module); else a member
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

#include <ddp/core/detail/dependent_false.hpp>
#include <ddp/core/detail/reflect.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/storage_traits.hpp>

namespace ddp {

/// Specialize for model types of a framework (an adapter's module class) with
///   template <class F> static void visit(M& m, F&& f);          f(name, leaf) for each trainable tensor
/// and optionally
///   template <class F> static void visit_buffers(M& m, F&& f);  f(name, ddp::raw_tensor) for the state that
///                                                               is not trained but must match across ranks
/// (data_parallel broadcasts it from rank 0 at construction, as PyTorch's DDP broadcasts module buffers).
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

template <class T>
struct is_sequence : std::false_type {};
template <class E, std::size_t N>
struct is_sequence<std::array<E, N>> : std::true_type { using element = E; };
template <class E, class A>
struct is_sequence<std::vector<E, A>> : std::true_type { using element = E; };

template <class T>
constexpr bool node_has_parameters();

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

/// True when walking a T can reach a parameter (decided at compile time).
template <class T>
constexpr bool node_has_parameters() {
  if constexpr (storage_leaf<T> || has_parameter_visitor<T> || has_member_visitor<T> || has_adl_visitor<T>) {
    return true;
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
  auto descend = [&](std::string_view name, auto&& child) {
    if constexpr (std::is_const_v<Node>)
      visit_node(std::as_const(child), join_name(prefix, name), f);
    else
      visit_node(child, join_name(prefix, name), f);
  };
  if constexpr (storage_leaf<plain>) {
    f(prefix, node);
  } else if constexpr (has_parameter_visitor<plain>) {
    parameter_visitor<plain>::visit(mutable_node, descend);
  } else if constexpr (has_member_visitor<plain>) {
    mutable_node.visit_parameters(descend);
  } else if constexpr (has_adl_visitor<plain>) {
    visit_parameters(mutable_node, descend);
  } else if constexpr (is_sequence<plain>::value && node_has_parameters<plain>()) {
    for (std::size_t i = 0; i < node.size(); ++i) visit_node(node[i], join_name(prefix, std::to_string(i)), f);
  } else if constexpr (reflectable_aggregate<plain> && node_has_parameters<plain>()) {
    for_each_field(node, [&](std::string_view name, auto& field) {
      if constexpr (node_has_parameters<std::remove_cvref_t<decltype(field)>>())
        visit_node(field, join_name(prefix, name), f);
    });
  } else {
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
    visit_node(model, std::string_view{}, f);
  }
};

/// Calls `f(name, ddp::raw_tensor)` for the buffers of `model` (its parameter_visitor's visit_buffers); does
/// nothing for a model without any.
template <class Model, class F>
void visit_buffers(Model& model, F&& f) {
  if constexpr (requires { parameter_visitor<Model>::visit_buffers(model, f); })
    parameter_visitor<Model>::visit_buffers(model, f);
}

}  // namespace detail

/// A model type in which ddp::visit_parameters finds at least one parameter.
template <class Model>
concept parameter_visitable = detail::node_has_parameters<std::remove_cv_t<Model>>();

inline namespace cpo {
/// Calls `f(dotted_name, parameter&)` for every parameter of `model`, in a stable order.
inline constexpr detail::visit_parameters_fn visit_parameters{};
}  // namespace cpo

}  // namespace ddp

#pragma once
// The test MLP with leaves of other types than ddp::parameter: each tensor keeps its values and gradient in
// two std::vector<float> (owning: ddp copies at the step's edges) or two std::span<float> over memory the
// model owns elsewhere (adopting: ddp points them at its arenas), handed out as ddp::trainable by a member
// visitor, or in two framework_vector, a framework's memory (dlib's kind) whose tensor is a leaf type with
// storage_traits of its own. The forward and backward of mlp.hpp run on it unchanged.

#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include <ddp/core/trainable.hpp>

#include "mlp.hpp"

namespace ddp_test {

/// A framework's tensor memory (dlib's kind): its tensors are leaves of their own type, and its backward writes
/// the gradient instead of adding to it (the scenarios clear it before each backward, as such a framework does).
struct framework_vector : std::vector<float> {
  using std::vector<float>::vector;
};

/// One tensor: values and gradient of type Storage (std::vector<float>, std::span<float> or framework_vector).
template <class Storage>
struct foreign_tensor {
  Storage v, g;
  std::vector<std::size_t> shape;
  std::span<float> value() { return {v.data(), v.size()}; }
  std::span<const float> value() const { return {v.data(), v.size()}; }
  std::span<float> grad() { return {g.data(), g.size()}; }
  [[nodiscard]] std::size_t numel() const { return v.size(); }
};

template <class Storage>
struct foreign_linear {
  foreign_tensor<Storage> weight, bias;
  template <class F>
  void visit_parameters(F&& f) {
    if constexpr (std::is_same_v<Storage, framework_vector>) {
      f("weight", weight);
      f("bias", bias);
    } else {
      f("weight", ddp::trainable(weight.v, weight.g, weight.shape));
      f("bias", ddp::trainable(bias.v, bias.g, bias.shape));
    }
  }
};

/// fc1..fc3 of leaves kept in Storage; `memory` backs the spans of the adopting kind.
template <class Storage>
struct foreign_mlp {
  using storage = Storage;
  foreign_linear<Storage> fc1, fc2, fc3;
  std::vector<std::vector<float>> memory;
  /// Every tensor, fc1.weight first.
  [[nodiscard]] std::vector<foreign_tensor<Storage>*> tensors() {
    return {&fc1.weight, &fc1.bias, &fc2.weight, &fc2.bias, &fc3.weight, &fc3.bias};
  }
};

/// What data_parallel::gradient_ready is given for a tensor of either model.
inline ddp::parameter<float>& leaf_of(ddp::parameter<float>& p) { return p; }
template <class Storage>
decltype(auto) leaf_of(foreign_tensor<Storage>& t) {
  if constexpr (std::is_same_v<Storage, framework_vector>)
    return (t);
  else
    return (t.v);
}

/// The same values as `m`, in foreign leaves.
template <class Storage>
foreign_mlp<Storage> make_foreign(mlp& m) {
  foreign_mlp<Storage> out;
  out.memory.reserve(12);
  auto convert = [&](ddp::parameter<float>& p, foreign_tensor<Storage>& t) {
    t.shape = p.shape();
    if constexpr (!std::is_same_v<Storage, std::span<float>>) {
      t.v.assign(p.value().begin(), p.value().end());
      t.g.assign(p.numel(), 0.0F);
    } else {
      auto& v = out.memory.emplace_back(p.value().begin(), p.value().end());
      auto& g = out.memory.emplace_back(p.numel(), 0.0F);
      t.v = std::span<float>(v);
      t.g = std::span<float>(g);
    }
  };
  convert(m.fc1.weight, out.fc1.weight);
  convert(m.fc1.bias, out.fc1.bias);
  convert(m.fc2.weight, out.fc2.weight);
  convert(m.fc2.bias, out.fc2.bias);
  convert(m.fc3.weight, out.fc3.weight);
  convert(m.fc3.bias, out.fc3.bias);
  return out;
}

/// Copies the foreign model's values into `m` (to compare with require_close).
template <class Storage>
void copy_back(const foreign_mlp<Storage>& f, mlp& m) {
  auto one = [](const foreign_tensor<Storage>& t, ddp::parameter<float>& p) {
    std::copy(t.value().begin(), t.value().end(), p.value().begin());
  };
  one(f.fc1.weight, m.fc1.weight);
  one(f.fc1.bias, m.fc1.bias);
  one(f.fc2.weight, m.fc2.weight);
  one(f.fc2.bias, m.fc2.bias);
  one(f.fc3.weight, m.fc3.weight);
  one(f.fc3.bias, m.fc3.bias);
}

}  // namespace ddp_test

/// The framework's tensor as a leaf of its own type: four members of storage_traits say what ddp needs, and
/// overwrites_gradient that its backward writes the gradient instead of adding to it.
template <>
struct ddp::storage_traits<ddp_test::foreign_tensor<ddp_test::framework_vector>> {
  using tensor = ddp_test::foreign_tensor<ddp_test::framework_vector>;
  static constexpr bool overwrites_gradient = true;
  static ddp::dtype dtype(const tensor& /*t*/) { return ddp::dtype::f32; }
  static std::vector<std::size_t> shape(const tensor& t) { return t.shape; }
  static void* values(tensor& t) { return t.v.data(); }
  static void* grads(tensor& t) { return t.g.data(); }
};

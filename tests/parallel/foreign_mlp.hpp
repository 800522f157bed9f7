#pragma once
// The test MLP with leaves of other types than ddp::parameter: each tensor keeps its values and gradient in
// two std::vector<float> (owning: ddp copies at the step's edges) or two std::span<float> over memory the
// model owns elsewhere (adopting: ddp points them at its arenas), handed out as ddp::trainable by a member
// visitor. The forward and backward of mlp.hpp run on it unchanged.

#include <cstddef>
#include <span>
#include <string_view>
#include <vector>

#include <ddp/core/trainable.hpp>

#include "mlp.hpp"

namespace ddp_test {

/// One tensor: values and gradient of type Storage (std::vector<float> or std::span<float>).
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
    f("weight", ddp::trainable(weight.v, weight.g, weight.shape));
    f("bias", ddp::trainable(bias.v, bias.g, bias.shape));
  }
};

/// fc1..fc3 of leaves kept in Storage; `memory` backs the spans of the adopting kind.
template <class Storage>
struct foreign_mlp {
  using storage = Storage;
  foreign_linear<Storage> fc1, fc2, fc3;
  std::vector<std::vector<float>> memory;
};

/// What data_parallel::gradient_ready is given for a tensor of either model.
inline ddp::parameter<float>& leaf_of(ddp::parameter<float>& p) { return p; }
template <class Storage>
Storage& leaf_of(foreign_tensor<Storage>& t) {
  return t.v;
}

/// The same values as `m`, in foreign leaves.
template <class Storage>
foreign_mlp<Storage> make_foreign(mlp& m) {
  foreign_mlp<Storage> out;
  out.memory.reserve(12);
  auto convert = [&](ddp::parameter<float>& p, foreign_tensor<Storage>& t) {
    t.shape = p.shape();
    if constexpr (std::is_same_v<Storage, std::vector<float>>) {
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

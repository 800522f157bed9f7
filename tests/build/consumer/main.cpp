// A consumer of ddp: includes the one header and lists a model's parameters by name.
#include <ddp/ddp.hpp>

#include <array>
#include <cstdio>
#include <string>
#include <vector>

namespace {
struct linear {
  ddp::parameter<float> weight{{4, 3}};
  ddp::parameter<float> bias{{4}};
};
struct mlp {
  linear fc1;
  std::array<linear, 2> hidden;
  linear out;
};
}  // namespace

int main() {
  static_assert(ddp::parameter_visitable<mlp>);
  mlp model;
  std::string names;
  std::size_t elements = 0;
  ddp::visit_parameters(model, [&](std::string_view name, auto& p) {
    names += std::string(name) + " ";
    elements += p.numel();
  });
  std::printf("%s(%zu elements)\n", names.c_str(), elements);
  return names == "fc1.weight fc1.bias hidden.0.weight hidden.0.bias hidden.1.weight hidden.1.bias out.weight out.bias "
                 && elements == 4 * 16 ? 0 : 1;
}

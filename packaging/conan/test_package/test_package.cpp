// Compiles the umbrella headers with the package's usage requirements and checks a model's parameters
// are found by name.
#include <ddp/checkpoint.hpp>
#include <ddp/ddp.hpp>
#include <ddp/launch.hpp>
#include <ddp/log.hpp>

#include <cstdio>
#include <string>

struct layer {
  ddp::parameter<float> weight{{2, 3}};
  ddp::parameter<float> bias{{2}};
};
struct model {
  layer first, second;
};

int main() {
  static_assert(ddp::communicator<ddp::tcp::communicator>);
#if defined(DDP_WITH_MPI)
  static_assert(ddp::communicator<ddp::mpi::communicator>);
#endif
  model m;
  std::string names;
  ddp::visit_parameters(m, [&](std::string_view name, auto&) { names += std::string(name) + ' '; });
  std::printf("ddp test_package: %s\n", names.c_str());
  return names == "first.weight first.bias second.weight second.bias " ? 0 : 1;
}

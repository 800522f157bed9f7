// Expected to fail: a model without parameters gets visit_parameters' static_assert sentence.
#include <ddp/core/visit.hpp>

struct no_parameters {
  int layers = 3;
  float rate = 0.1F;
};

int main() {
  no_parameters model;
  ddp::visit_parameters(model, [](std::string_view, auto&) {});
}

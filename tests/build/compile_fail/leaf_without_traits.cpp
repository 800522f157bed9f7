// Expected to fail: a model holding a matrix type that has no ddp::storage_traits gets the sentence naming the
// fix (and the compiler names the type in the instantiation of no_storage_traits_for<user::matrix>).
#include <ddp/core/visit.hpp>

namespace user {
struct matrix {
  float* data();
  long rows() const;
  long cols() const;
};
}  // namespace user

struct model {
  ddp::parameter<float> bias;
  user::matrix weight;
};

int main() {
  model m;
  ddp::visit_parameters(m, [](std::string_view, auto&) {});
}

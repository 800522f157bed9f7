// Expected to fail: a type that is not a policy gets data_parallel's static_assert sentence.
#include <ddp/ddp.hpp>

struct model {
  ddp::parameter<float> weight{{2}};
};

int main() { return sizeof(ddp::data_parallel<model, ddp::replicate, int>) > 0 ? 0 : 1; }

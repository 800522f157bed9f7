// Expected to fail: mixed_precision's Param names the model's compute dtype, which must be 16 bits wide; f32 training
// needs no policy, and the static_assert sentence says so.
#include <ddp/ddp.hpp>

struct model {
  ddp::parameter<float> weight{{2}};
};

int main() { return sizeof(ddp::data_parallel<model, ddp::mixed_precision<float>>) > 0 ? 0 : 1; }

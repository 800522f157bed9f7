// Expected to fail: gradients are reduced in float or in the compute dtype, not in f16 under bf16 compute.
#include <ddp/ddp.hpp>

struct model {
  ddp::parameter<ddp::bfloat16> weight{{2}};
};

int main() {
  return sizeof(ddp::data_parallel<model, ddp::mixed_precision<ddp::bfloat16, ddp::float16>>) > 0 ? 0 : 1;
}

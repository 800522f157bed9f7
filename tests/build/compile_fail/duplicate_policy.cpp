// Expected to fail: two sharding policies get data_parallel's static_assert sentence.
#include <ddp/ddp.hpp>

struct model {
  ddp::parameter<float> weight{{2}};
};

int main() { return sizeof(ddp::data_parallel<model, ddp::replicate, ddp::full_shard>) > 0 ? 0 : 1; }

// One rank of a flight recorder trial under ddp-launch: five all_reduces, then rank 1 misbehaves as argv[1]
// says -- "stall" (sleeps instead of the sixth all_reduce) or "diverge" (calls broadcast instead) -- while
// the other ranks call the sixth all_reduce.

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "stall" && mode != "diverge") {
    std::fprintf(stderr, "usage: flight_rank stall|diverge (under ddp-launch)\n");
    return 2;
  }
  auto comm = ddp::tcp::communicator::from_env();
  std::vector<float> v(1024, 1.0F);
  for (int i = 0; i < 5; ++i) comm.all_reduce(v).wait();
  if (comm.rank() == 1) {
    if (mode == "stall") std::this_thread::sleep_for(std::chrono::seconds(30));
    if (mode == "diverge") comm.broadcast(v, 0).wait();
    return 0;
  }
  comm.all_reduce(v).wait();
  return 0;
}

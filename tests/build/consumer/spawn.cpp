// A consumer of the launcher API (<ddp/launch.hpp>, target ddp::launch): two forked ranks, each checking the
// environment the launcher gave it; exits 0 only when both ranks did.
#include <ddp/launch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

int main() {
  auto result = ddp::launch::spawn(2, [](int rank) {
    const char* env_rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    if (env_rank == nullptr || std::stoi(env_rank) != rank || world == nullptr || std::string(world) != "2")
      throw ddp::config_error("rank " + std::to_string(rank) + " did not get RANK and WORLD_SIZE=2");
  });
  std::printf("%s\n", result.describe().c_str());
  return result.ok() ? 0 : 1;
}

// One rank of a kill trial under ddp-launch (see kill_trial.hpp): the victim's rank is DDP_KILL_VICTIM.
// A program of its own, so that a trial starts small processes even in a sanitizer build.

#include <cstdlib>
#include <string>

#include "kill_trial.hpp"

int main() {
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  const char* victim = std::getenv("DDP_KILL_VICTIM");
  if (rank == nullptr || size == nullptr || victim == nullptr || std::getenv("MASTER_PORT") == nullptr)
    kill_trial::leave(2, "kill_trial_rank needs RANK, WORLD_SIZE, MASTER_PORT and DDP_KILL_VICTIM; run it under "
                         "ddp-launch with DDP_KILL_VICTIM set");
  kill_trial::run_rank(std::atoi(rank), std::atoi(size), std::atoi(victim));
}

#pragma once
/// \file A group's shared-memory segment: per group rank, a phase counter (a futex word) and two regions,
/// each a call description and `shm_region_bytes` of data. A collective runs in phases: a rank fills its
/// region of the phase, posts the phase, waits until every rank posted it, then reads any rank's region of
/// the phase and may fill its region of the next one. Regions alternate, so a rank is never more than one
/// phase ahead of a reader and no region is overwritten while read. Every member maps it at split (or the
/// rendezvous) with O_CREAT, so none waits for another; the last to map it unlinks it.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/comm/tcp/protocol.hpp>
#include <ddp/comm/tcp/scratch.hpp>
#include <ddp/comm/tcp/shm_algo_choice.hpp>
#include <ddp/comm/tcp/shm_segment.hpp>
#include <ddp/comm/tcp/shm_world.hpp>

namespace ddp::tcp::detail {

/// Data bytes of one region: the most a rank publishes in one phase. Measured on the 2-core VM (N = 2), 1 MiB
/// regions beat 256 KiB ones (1 MiB all_reduce: 60 us against 126 us; 4 MiB: 0.26-0.45 ms against 0.58 ms)
/// and larger ones add nothing.
inline constexpr std::size_t shm_region_bytes = 1 << 20;

/// One group rank's counters, each on its own cache line.
struct shm_counters {
  alignas(64) std::atomic<std::uint32_t> posted{0};  ///< phases this rank has posted (its futex word)
  alignas(64) std::atomic<std::uint32_t> sleepers{0};  ///< ranks sleeping on `posted`: the poster wakes them
};

/// A region's head: the call the phase belongs to, compared by every reader.
struct alignas(64) shm_region_head {
  frame_header call;
};

/// The group's segment, mapped by this rank, and the group's phase count.
class shm_group {
 public:
  /// Maps (creating it if first) the segment of the group `id` of `members` (world ranks) in the job segment `world`;
  /// `ranks`, where given, are the members' ranks in the group the messages name (a hierarchical group's).
  shm_group(std::shared_ptr<shm_world> world, std::uint32_t id, std::vector<int> members, int me,
            std::vector<int> ranks = {})
      : world_(std::move(world)), members_(std::move(members)), ranks_(std::move(ranks)), me_(me) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", id);
    const std::string name = world_->name() + "-" + hex;
    const auto n = members_.size();
    map_ = shm_mapping::open(name, 64 + n * (sizeof(shm_counters) + 2 * region_stride()), true, false, members_[me_]);
    count_mapping(*reinterpret_cast<std::atomic<std::uint32_t>*>(map_.data()), name, static_cast<int>(n));
  }
  shm_group(const shm_group&) = delete;

  [[nodiscard]] shm_world& world() { return *world_; }
  [[nodiscard]] int me() const { return me_; }
  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }
  [[nodiscard]] int world_rank(int r) const { return members_[static_cast<std::size_t>(r)]; }
  /// Member `r`'s rank in the group the messages name.
  [[nodiscard]] int group_rank(int r) const { return ranks_.empty() ? r : ranks_[static_cast<std::size_t>(r)]; }

  /// Group rank `r`'s counters.
  shm_counters& counters(int r) { return reinterpret_cast<shm_counters*>(map_.data() + 64)[r]; }
  /// Group rank `r`'s region for phase `phase`: its head, then shm_region_bytes of data.
  shm_region_head& head(int r, std::uint32_t phase) {
    const std::size_t at = 64 + members_.size() * sizeof(shm_counters) +
                           (2 * static_cast<std::size_t>(r) + (phase & 1U)) * region_stride();
    return *reinterpret_cast<shm_region_head*>(map_.data() + at);
  }
  char* data(int r, std::uint32_t phase) { return reinterpret_cast<char*>(&head(r, phase)) + sizeof(shm_region_head); }

  /// True where the job has more ranks on this host than the host has cores: waits sleep at once instead of spinning.
  [[nodiscard]] bool oversubscribed() const { return oversubscribed_; }

  /// Phases this rank has completed (posted and seen every rank post); the engine's queue orders the calls.
  std::uint32_t phase = 0;

  /// True when every rank of the host can copy straight out of every other one's memory (the same answer on each).
  [[nodiscard]] bool reads_all() const { return world_->single_copy; }
  /// The members' buffer addresses of the executing single-copy call.
  std::vector<std::uint64_t> addresses;
  /// The algorithm this rank would run a `kind` call of `bytes` with where reads_all() (the group's rank 0 decides
  /// for all).
  [[nodiscard]] shm_algo algo(collective kind, std::size_t bytes) const {
    return world_->algo == shm_algo::automatic ? algos.choose(kind, bytes) : world_->algo;
  }
  /// Rank 0's timings of the large calls and the algorithm each collective and size class runs.
  algo_choice algos;
  /// A scratch buffer of at least `bytes`, kept for later calls: it only grows, uninitialized.
  char* scratch(std::size_t bytes) { return scratch_.get(bytes); }

 private:
  static constexpr std::size_t region_stride() { return sizeof(shm_region_head) + shm_region_bytes; }
  std::shared_ptr<shm_world> world_;
  std::vector<int> members_;
  std::vector<int> ranks_;
  int me_;
  shm_mapping map_;
  scratch_buffer scratch_;
  /// Read once: the count of cores costs a file read (glibc reads /sys), more than a small collective.
  bool oversubscribed_ = static_cast<unsigned>(world_->local_size()) > std::max(1U, std::thread::hardware_concurrency());
};

}  // namespace ddp::tcp::detail

#pragma once
/// \file The MPI side of ddp::mpi::communicator: its settings, MPI's initialization, error handlers of borrowed
/// communicators, and the group state every copy of a communicator shares.

#include <ddp/comm/mpi/datatypes.hpp>  // first: it keeps MPI's C++ bindings out of <mpi.h>

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>

#include <ddp/comm/front_end.hpp>

namespace ddp::mpi {

/// When ddp::mpi's progress thread drives in-flight operations (comm/mpi/progress.hpp).
enum class progress_mode {
  off,          ///< never: operations move only inside the caller's MPI calls (waits, tests)
  on,           ///< always
  spare_cores,  ///< where this process may run on two cores or more and the host has two for each of its ranks
};

/// Settings of an MPI communicator, shared by the groups split from it.
///
/// MPI moves a non-blocking operation forward only inside MPI calls, so a wait polls MPI_Test: back to back for
/// `spin` (as MPI_Wait does, so short operations see MPI's own latency; Open MPI's progress loop yields the core
/// by itself on a host running more ranks than cores), then sleeping between polls, the sleeps growing from
/// 1 µs to `max_sleep`, so that a long operation neither burns a core nor stalls for long.
///
/// Open MPI's non-blocking collectives (libnbc) are slower than its blocking ones (coll/tuned) on small
/// buffers: a collective of at most `eager_bytes` (see communicator::eager) therefore runs MPI's blocking call
/// inside the ddp call and returns a completed work. Such a call cannot time out (a stuck peer blocks it) and
/// overlaps nothing; 0 makes every collective non-blocking.
struct config {
  /// How long wait() waits before it raises ddp::timeout_error.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// How long a wait polls back to back before it starts sleeping between polls.
  std::chrono::microseconds spin{std::chrono::milliseconds(5)};
  /// The longest sleep between two polls after that.
  std::chrono::microseconds max_sleep{50};
  /// Collectives on at most this many bytes run blocking and complete on start; must be equal on every rank.
  std::size_t eager_bytes{std::size_t{256} << 10};
  /// Whether a thread drives in-flight operations while the caller computes; DDP_MPI_PROGRESS=1 or 0 overrides.
  progress_mode progress = progress_mode::spare_cores;
  /// How often that thread calls into MPI while operations are in flight.
  std::chrono::microseconds progress_interval{50};
};

namespace detail {

class progress_thread;

/// True once MPI_Finalize has run (handles must not be touched any more).
inline bool finalized() noexcept {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

/// Initializes MPI once (MPI_THREAD_MULTIPLE) and finalizes it at exit if this library initialized it.
/// Before MPI_Init it selects libnbc's Rabenseifner all-reduce (reduce-scatter then all-gather) unless
/// OMPI_MCA_coll_libnbc_iallreduce_algorithm is set: Open MPI 4.1 otherwise runs in-place MPI_Iallreduce as a
/// binomial reduce + broadcast, up to twice as slow as blocking MPI_Allreduce on large buffers.
class runtime {
 public:
  /// Makes sure MPI is initialized; argc/argv may be null.
  static void ensure(int* argc, char*** argv) { static const runtime instance(argc, argv); }
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;
  ~runtime() {
    if (owned_ && !finalized()) MPI_Finalize();
  }

 private:
  runtime(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return;  // the application owns MPI; it finalizes it too
    ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread", -1);
    owned_ = true;
  }
  bool owned_ = false;
};

/// Keeps MPI_ERRORS_RETURN on a communicator ddp does not own while any wrapper of it lives, then restores the
/// handler it had before the first one; wrappers are counted, so the order they go away in does not matter.
class borrowed_error_handlers {
 public:
  static void acquire(MPI_Comm comm, int rank) {
    std::lock_guard lock(mutex());
    entry& e = entries()[comm];
    if (e.users == 0) {
      check(MPI_Comm_get_errhandler(comm, &e.previous), "MPI_Comm_get_errhandler", rank);
      check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    }
    ++e.users;
  }
  static void release(MPI_Comm comm) {
    std::lock_guard lock(mutex());
    const auto it = entries().find(comm);
    if (it == entries().end() || --it->second.users > 0) return;
    MPI_Comm_set_errhandler(comm, it->second.previous);
    MPI_Errhandler_free(&it->second.previous);
    entries().erase(it);
  }

 private:
  struct entry {
    int users = 0;
    MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<MPI_Comm, entry>& entries() {
    static std::map<MPI_Comm, entry> e;
    return e;
  }
};

/// The state every copy of a communicator shares: the MPI_Comm, its settings and the front end's state.
struct group {
  group(MPI_Comm c, bool own, config settings) : comm(c), owned(own), cfg(settings) {
    check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", -1);
    check(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank);
    void* value = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm, MPI_TAG_UB, &value, &found), "MPI_Comm_get_attr(MPI_TAG_UB)", rank);
    if (found != 0) max_tag = *static_cast<int*>(value);
    if (owned) check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    else borrowed_error_handlers::acquire(comm, rank);
  }
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    if (finalized()) return;
    if (owned) MPI_Comm_free(&comm);
    else borrowed_error_handlers::release(comm);
  }

  MPI_Comm comm;
  bool owned;
  config cfg;
  int rank = 0;
  int size = 1;
  int max_tag = 32767;  // the MPI standard's guaranteed minimum of MPI_TAG_UB
  ddp::detail::front_state front;  ///< statistics, sequence numbers and the call check of the collective front end
  std::once_flag progress_once;           ///< progress_of() decides once whether the progress thread runs
  progress_thread* progress = nullptr;    ///< the progress thread operations claim, null where none runs
};

}  // namespace detail
}  // namespace ddp::mpi

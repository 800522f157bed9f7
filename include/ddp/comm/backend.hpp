#pragma once
/// \file Backend policy tags and the mappings between a tag and its communicator type.
/// Each backend's header specializes backend_traits for its tag (deriving from detail::backend_binding, which checks
/// the communicator against the concept); its communicator names its tag as `using backend_tag = ...;`.

#include <type_traits>

#include <ddp/comm/communicator.hpp>
#include <ddp/core/detail/dependent_false.hpp>

namespace ddp {

namespace detail {
struct backend_category {};
}  // namespace detail

/// Backend policies: which communicator data_parallel expects.
namespace backend {
/// The library's own TCP transport (ddp::tcp::communicator); the default.
struct tcp { using policy_category = detail::backend_category; };
/// Open MPI (ddp::mpi::communicator).
struct mpi { using policy_category = detail::backend_category; };
/// NCCL over CUDA device memory (ddp::nccl::communicator).
struct nccl { using policy_category = detail::backend_category; };
/// Threads of one process sharing their buffers (ddp::local::communicator, started by ddp::local::run).
struct local { using policy_category = detail::backend_category; };
}  // namespace backend

/// Maps a backend tag to `using communicator = ...;`. Specialized by each backend's header.
template <class Backend>
struct backend_traits {
  static_assert(detail::dependent_false<Backend>,
                "ddp: this backend's header is not included. Include <ddp/ddp.hpp> and link ddp::ddp for "
                "backend::tcp and backend::local, ddp::mpi for backend::mpi (DDP_WITH_MPI), ddp::nccl for backend::nccl "
                "(DDP_WITH_NCCL).");
};

/// The communicator type of backend tag B.
template <class B>
using backend_communicator_t = typename backend_traits<B>::communicator;

namespace detail {
/// What backend_traits<Tag> holds for a backend whose communicator is Comm; checks that Comm models the concept.
template <class Comm>
struct backend_binding {
  static_assert(ddp::communicator<Comm>,
                "ddp: this backend's communicator must model ddp::communicator; add the missing member the concept "
                "in <ddp/comm/communicator.hpp> names.");
  using communicator = Comm;  ///< the backend's communicator
};
}  // namespace detail

/// Maps a communicator type to its backend tag, `using type = ...;` (what `ddp::data_parallel dp{model, comm};`
/// deduces the backend from): the communicator's `backend_tag`, or a specialization of backend_of.
template <class Comm>
struct backend_of {
  static_assert(detail::dependent_false<Comm>,
                "ddp: no backend is known for this communicator type. Pass a ddp::tcp, ddp::local, ddp::mpi or "
                "ddp::nccl communicator, or specialize ddp::backend_of<YourCommunicator> with `using type = your_backend_tag;`.");
};
/// A communicator that names its tag (`using backend_tag = backend::mpi;`) deduces it.
template <class Comm>
  requires requires { typename Comm::backend_tag; }
struct backend_of<Comm> {
  using type = typename Comm::backend_tag;  ///< the communicator's backend tag
};

/// The backend tag of communicator type Comm.
template <class Comm>
using backend_of_t = typename backend_of<Comm>::type;

}  // namespace ddp

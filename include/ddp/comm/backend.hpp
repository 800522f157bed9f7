#pragma once
/// \file Backend policy tags and the mappings between a tag and its communicator type.
/// Each backend's header specializes backend_traits for its tag and backend_of for its communicator.

#include <type_traits>

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
}  // namespace backend

/// Maps a backend tag to `using communicator = ...;`. Specialized by each backend's header.
template <class Backend>
struct backend_traits {
  static_assert(detail::dependent_false<Backend>,
                "ddp: this backend's header is not included. Include <ddp/ddp.hpp> and link ddp::ddp for "
                "backend::tcp, ddp::mpi for backend::mpi (DDP_WITH_MPI), ddp::nccl for backend::nccl (DDP_WITH_NCCL).");
};

/// The communicator type of backend tag B.
template <class B>
using backend_communicator_t = typename backend_traits<B>::communicator;

/// Maps a communicator type to its backend tag, `using type = ...;` (what `ddp::data_parallel dp{model, comm};`
/// deduces the backend from). Specialized by each backend's header beside backend_traits.
template <class Comm>
struct backend_of {
  static_assert(detail::dependent_false<Comm>,
                "ddp: no backend is known for this communicator type. Pass a ddp::tcp, ddp::mpi or ddp::nccl "
                "communicator, or specialize ddp::backend_of<YourCommunicator> with `using type = your_backend_tag;`.");
};

/// The backend tag of communicator type Comm.
template <class Comm>
using backend_of_t = typename backend_of<Comm>::type;

}  // namespace ddp

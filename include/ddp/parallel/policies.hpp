#pragma once
/// \file Compile-time policies of ddp::data_parallel: backend, sharding strategy, bucket size, comm hook, precision.
/// Policies may be given in any order; a missing category takes its default. The sharding policies carry
/// their run-time settings as members with defaults (ddp::full_shard{.reshard_after_forward = false}).

#include <cstddef>
#include <type_traits>

#include <ddp/comm/backend.hpp>
#include <ddp/parallel/comm_hooks.hpp>
#include <ddp/parallel/mixed_precision.hpp>
#include <ddp/parallel/options.hpp>

namespace ddp {

namespace detail {
struct sharding_category {};
struct bucket_category {};
}  // namespace detail

/// Every rank holds the whole model, gradients are all-reduced (PyTorch DDP); the default.
struct replicate {
  using policy_category = detail::sharding_category;
  /// Sum every gradient element in rank order on the host (parallel/ordered_reduction.hpp): training bitwise
  /// reproducible across runs, backends and bucket sizes at one world size; the all-reduces become all_gathers
  /// (N/2 times the bytes beyond N = 2). Not with a comm hook.
  bool deterministic = false;
};
/// Gradients and optimizer state are sharded, parameters kept whole (ZeRO-2, FSDP SHARD_GRAD_OP).
struct shard_grad_op {
  using policy_category = detail::sharding_category;
  /// Keep the pooled per-unit buffers (full gradients) resident between steps, so steady-state steps allocate
  /// nothing and fault in no page (true), or free them after every step, so that between steps a rank holds
  /// only its shards (false: the lowest memory, page faults each step).
  bool keep_unit_buffers = true;
  /// Sum every gradient element in rank order on the host, as replicate's (the reduce-scatters become
  /// all_to_alls of the same bytes); under hybrid the inner policy's knob also orders the sums across groups.
  bool deterministic = false;
};
/// Parameters, gradients and optimizer state are sharded (ZeRO-3, FSDP FULL_SHARD).
struct full_shard {
  using policy_category = detail::sharding_category;
  /// Free a unit's unsharded parameters when its last unshard scope closes (false keeps them until the step).
  bool reshard_after_forward = true;
  /// Keep the pooled per-unit buffers (unsharded values, full gradients) resident between steps (true), or
  /// free them after every step (false), as shard_grad_op's.
  bool keep_unit_buffers = true;
  /// Sum every gradient element in rank order on the host, as shard_grad_op's.
  bool deterministic = false;
};
/// Inner sharding inside groups of `group_size` ranks, replication across groups (HSDP).
template <class Inner = full_shard>
struct hybrid {
  static_assert(std::is_same_v<Inner, full_shard> || std::is_same_v<Inner, shard_grad_op>,
                "ddp::hybrid<Inner>: Inner must be ddp::full_shard or ddp::shard_grad_op.");
  using policy_category = detail::sharding_category;
  using inner_type = Inner;  ///< sharding inside a group
  /// Ranks per shard group; 0 takes LOCAL_WORLD_SIZE (or OMPI_COMM_WORLD_LOCAL_SIZE), else the world.
  int group_size = 0;
  /// The settings of the sharding inside a group (ddp::hybrid<>{.inner = {.reshard_after_forward = false}}).
  Inner inner{};
};

/// Gradient bucket capacity in bytes, and the (smaller) capacity of the first bucket, which starts soonest.
template <std::size_t Capacity, std::size_t First = (std::size_t{1} << 20)>
struct bucket_bytes {
  static_assert(Capacity > 0 && First > 0, "ddp::bucket_bytes: capacities must be positive byte counts.");
  using policy_category = detail::bucket_category;
  static constexpr std::size_t capacity = Capacity;  ///< bytes per bucket
  static constexpr std::size_t first = First;        ///< bytes of the first bucket
};

namespace detail {

template <class P>
concept policy = requires { typename P::policy_category; };

template <class P>
constexpr bool check_policy() {
  static_assert(policy<P>,
                "ddp::data_parallel: one of the policies is not a ddp policy; use a backend (ddp::backend::tcp, "
                "mpi, nccl), a sharding (ddp::replicate, shard_grad_op, full_shard, hybrid<...>), "
                "ddp::bucket_bytes<N>, a comm hook (ddp::plain_hook, bf16_compress_hook, fp16_compress_hook, or your "
                "own type with `using policy_category = ddp::comm_hook_policy;`) or ddp::mixed_precision<...>.");
  return true;
}

template <class Category, class P>
constexpr int in_category() {
  if constexpr (policy<P>)
    return std::is_same_v<typename P::policy_category, Category> ? 1 : 0;
  else
    return 0;
}

template <class Category, class Default, class... Ps>
struct pick {
  using type = Default;
};
template <class Category, class Default, class P, class... Ps>
struct pick<Category, Default, P, Ps...> {
  using type = std::conditional_t<in_category<Category, P>() == 1, P, typename pick<Category, Default, Ps...>::type>;
};

/// T is one of Ts.
template <class T, class... Ts>
concept one_of = (std::is_same_v<T, Ts> || ...);

/// The first of `args` of type T, else T{} (a wrapper's constructor arguments: policy values, options).
template <class T>
T value_of() {
  return T{};
}
template <class T, class A, class... Rest>
T value_of(const A& first, const Rest&... rest) {
  if constexpr (std::is_same_v<A, T>)
    return first;
  else
    return value_of<T>(rest...);
}

/// data_parallel_options, if among Args, comes last and once (checked by data_parallel's constructor).
template <class... Args>
constexpr bool options_last() {
  constexpr std::size_t n = sizeof...(Args);
  std::size_t count = 0, at = 0, i = 0;
  ((std::is_same_v<Args, data_parallel_options> ? (++count, at = i++) : i++), ...);
  return count == 0 || (count == 1 && at + 1 == n);
}

}  // namespace detail

/// The resolved policy set of data_parallel<Model, Ps...>.
template <class... Ps>
struct policies {
  static_assert((detail::check_policy<Ps>() && ...));
  static_assert((detail::in_category<detail::backend_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two backend policies were given; keep one of ddp::backend::tcp, mpi, nccl.");
  static_assert((detail::in_category<detail::sharding_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two sharding policies were given; keep one of ddp::replicate, shard_grad_op, "
                "full_shard, hybrid<...>.");
  static_assert((detail::in_category<detail::bucket_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two ddp::bucket_bytes policies were given; keep one.");
  static_assert((detail::in_category<detail::hook_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two comm hooks were given; keep one of ddp::plain_hook, bf16_compress_hook, "
                "fp16_compress_hook.");
  static_assert((detail::in_category<detail::precision_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two precision policies were given; keep one ddp::mixed_precision<...>.");

  using backend = typename detail::pick<detail::backend_category, backend::tcp, Ps...>::type;        ///< transport
  using sharding = typename detail::pick<detail::sharding_category, replicate, Ps...>::type;         ///< strategy
  using buckets = typename detail::pick<detail::bucket_category, bucket_bytes<(25U << 20)>, Ps...>::type;  ///< sizes
  using hook = typename detail::pick<detail::hook_category, plain_hook, Ps...>::type;                ///< compression
  using precision = typename detail::pick<detail::precision_category, full_precision, Ps...>::type;  ///< masters
};

namespace detail {
/// T is one of the policy types data_parallel<Model, Ps...> resolves (a constructor argument may be a value of it).
template <class T, class... Ps>
concept policy_of = one_of<T, typename policies<Ps...>::backend, typename policies<Ps...>::sharding,
                           typename policies<Ps...>::buckets, typename policies<Ps...>::hook,
                           typename policies<Ps...>::precision>;
}  // namespace detail

}  // namespace ddp

#include <catch2/catch.hpp>

#include <type_traits>

#include <ddp/parallel/policies.hpp>

TEST_CASE("policies take any order and default the missing categories", "[policies]") {
  using defaults = ddp::policies<>;
  STATIC_REQUIRE(std::is_same_v<defaults::backend, ddp::backend::tcp>);
  STATIC_REQUIRE(std::is_same_v<defaults::sharding, ddp::replicate>);
  STATIC_REQUIRE(defaults::buckets::capacity == (25U << 20));
  STATIC_REQUIRE(defaults::buckets::first == (1U << 20));
  STATIC_REQUIRE(std::is_same_v<defaults::hook, ddp::plain_hook>);

  using mixed = ddp::policies<ddp::bucket_bytes<4096, 512>, ddp::full_shard, ddp::backend::mpi>;
  STATIC_REQUIRE(std::is_same_v<mixed::backend, ddp::backend::mpi>);
  STATIC_REQUIRE(std::is_same_v<mixed::sharding, ddp::full_shard>);
  STATIC_REQUIRE(mixed::buckets::capacity == 4096);
  STATIC_REQUIRE(std::is_same_v<ddp::policies<ddp::hybrid<>>::sharding::inner_type, ddp::full_shard>);
}

TEST_CASE("sharding policies carry their settings, with defaults", "[policies]") {
  STATIC_REQUIRE(ddp::full_shard{}.reshard_after_forward && ddp::full_shard{}.keep_unit_buffers);
  STATIC_REQUIRE(ddp::shard_grad_op{}.keep_unit_buffers);
  constexpr ddp::hybrid<> h{.group_size = 4, .inner = {.reshard_after_forward = false}};
  STATIC_REQUIRE(h.group_size == 4 && !h.inner.reshard_after_forward && h.inner.keep_unit_buffers);
  STATIC_REQUIRE(ddp::hybrid<ddp::shard_grad_op>{}.group_size == 0);
}

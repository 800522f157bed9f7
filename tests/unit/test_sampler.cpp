#include <ddp/data/distributed_sampler.hpp>
#include <ddp/data/metrics.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

namespace {

std::vector<std::vector<std::size_t>> all_ranks(std::size_t n, int world, ddp::distributed_sampler::options o,
                                                std::uint64_t epoch) {
  std::vector<std::vector<std::size_t>> out;
  for (int r = 0; r < world; ++r) out.push_back(ddp::distributed_sampler(n, world, r, o).indices(epoch));
  return out;
}

/// A stand-in communicator for the reduction helper: a world of one, where all_reduce leaves values as they are.
struct single_rank {
  struct done { void wait() const {} };
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class S>
  done all_reduce(S, ddp::reduce_op) { ++calls; return {}; }
  int calls = 0;
};

}  // namespace

TEST_CASE("sampler without shuffle follows PyTorch's pad-by-repetition and rank striding", "[sampler]") {
  // PyTorch: 10 samples, 3 ranks -> total 12, list 0..9,0,1 -> rank r takes positions r, r+3, ...
  const auto got = all_ranks(10, 3, {.shuffle = false}, 0);
  CHECK(got[0] == std::vector<std::size_t>{0, 3, 6, 9});
  CHECK(got[1] == std::vector<std::size_t>{1, 4, 7, 0});
  CHECK(got[2] == std::vector<std::size_t>{2, 5, 8, 1});
  // drop_last: total 9 -> 0..8.
  const auto dropped = all_ranks(10, 3, {.shuffle = false, .drop_last = true}, 0);
  CHECK(dropped[0] == std::vector<std::size_t>{0, 3, 6});
  CHECK(dropped[2] == std::vector<std::size_t>{2, 5, 8});
}

TEST_CASE("padding repeats the list as often as needed when the dataset is smaller than the world", "[sampler]") {
  const auto got = all_ranks(2, 5, {.shuffle = false}, 0);
  std::vector<std::size_t> flat;
  for (const auto& r : got) {
    REQUIRE(r.size() == 1);
    flat.push_back(r[0]);
  }
  CHECK(flat == std::vector<std::size_t>{0, 1, 0, 1, 0});
}

TEST_CASE("every rank gets num_samples and the union covers the dataset", "[sampler]") {
  for (const std::size_t n : {0UL, 1UL, 7UL, 64UL, 1001UL})
    for (const int world : {1, 2, 3, 4, 7})
      for (const bool drop : {false, true}) {
        const ddp::distributed_sampler::options o{.shuffle = true, .seed = 5, .drop_last = drop};
        const auto got = all_ranks(n, world, o, 3);
        std::multiset<std::size_t> seen;
        for (int r = 0; r < world; ++r) {
          const ddp::distributed_sampler s(n, world, r, o);
          CHECK(got[static_cast<std::size_t>(r)].size() == s.num_samples());
          seen.insert(got[static_cast<std::size_t>(r)].begin(), got[static_cast<std::size_t>(r)].end());
        }
        const ddp::distributed_sampler s0(n, world, 0, o);
        CHECK(seen.size() == s0.total_size());
        const std::set<std::size_t> distinct(seen.begin(), seen.end());
        if (drop) {
          CHECK(distinct.size() == seen.size());  // no sample twice
          CHECK(seen.size() == n / static_cast<std::size_t>(world) * static_cast<std::size_t>(world));
        } else {
          CHECK(distinct.size() == n);  // every sample at least once
          CHECK(seen.size() - n < static_cast<std::size_t>(world));
        }
        for (const auto i : seen) CHECK(i < n);
      }
}

TEST_CASE("exact_once puts every sample on exactly one rank with uneven counts", "[sampler]") {
  for (const std::size_t n : {0UL, 5UL, 10UL, 10001UL})
    for (const int world : {1, 2, 3, 4})
      for (const bool shuffle : {false, true}) {
        const auto got = all_ranks(n, world, {.shuffle = shuffle, .seed = 1, .exact_once = true}, 2);
        std::vector<std::size_t> flat;
        for (int r = 0; r < world; ++r) {
          CHECK(got[static_cast<std::size_t>(r)].size() ==
                ddp::distributed_sampler(n, world, r, {.exact_once = true}).num_samples());
          flat.insert(flat.end(), got[static_cast<std::size_t>(r)].begin(), got[static_cast<std::size_t>(r)].end());
        }
        std::sort(flat.begin(), flat.end());
        std::vector<std::size_t> expected(n);
        std::iota(expected.begin(), expected.end(), std::size_t{0});
        CHECK(flat == expected);
      }
  CHECK_THROWS_AS(ddp::distributed_sampler(10, 2, 0, {.drop_last = true, .exact_once = true}), ddp::config_error);
}

TEST_CASE("the shuffle is deterministic per (seed, epoch), differs across epochs and is a permutation", "[sampler]") {
  const ddp::distributed_sampler a(1000, 1, 0, {.seed = 42}), b(1000, 1, 0, {.seed = 42}), c(1000, 1, 0, {.seed = 43});
  CHECK(a.indices(0) == b.indices(0));
  CHECK(a.indices(7) == b.indices(7));
  CHECK(a.indices(0) != a.indices(1));
  CHECK(a.indices(1) != c.indices(1));
  auto sorted = a.indices(3);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::size_t> expected(1000);
  std::iota(expected.begin(), expected.end(), std::size_t{0});
  CHECK(sorted == expected);
  // Ranks share one permutation: seed + epoch, not the rank, drives it.
  const auto r0 = ddp::distributed_sampler(1000, 2, 0, {.seed = 42}).indices(4);
  const auto whole = a.indices(4);
  for (std::size_t i = 0; i < r0.size(); ++i) CHECK(r0[i] == whole[2 * i]);
}

TEST_CASE("shuffled positions are close to uniform", "[sampler]") {
  // Where does sample 0 land, over 4000 epochs of a 4-sample dataset? Each position ~1000 times.
  std::map<std::size_t, int> where;
  const ddp::distributed_sampler s(4, 1, 0, {.seed = 9});
  for (std::uint64_t e = 0; e < 4000; ++e) {
    const auto idx = s.indices(e);
    where[static_cast<std::size_t>(std::find(idx.begin(), idx.end(), 0) - idx.begin())]++;
  }
  for (const auto& [pos, count] : where) CHECK(std::abs(count - 1000) < 150);
}

TEST_CASE("batches split a rank's indices, with an optional short tail", "[sampler]") {
  const ddp::distributed_sampler s(23, 2, 1, {.shuffle = false});  // rank 1: 12 samples
  const auto batches = s.batches(0, 5);
  REQUIRE(batches.size() == 3);
  std::vector<std::size_t> joined;
  std::size_t count = 0;
  for (const auto batch : batches) {
    CHECK(batch.size() == (count < 2 ? 5U : 2U));
    joined.insert(joined.end(), batch.begin(), batch.end());
    ++count;
  }
  CHECK(joined == s.indices(0));
  CHECK(s.batches(0, 5, true).size() == 2);
  CHECK_THROWS_AS(s.batches(0, 0), ddp::config_error);
  CHECK_THROWS_AS(ddp::distributed_sampler(10, 2, 2), ddp::config_error);
}

TEST_CASE("metric sums give mean loss and accuracy and reduce in one all_reduce", "[metrics]") {
  ddp::metric_sums m;
  CHECK(m.accuracy() == 0.0);
  m.add(3.0, 2, 4);
  m.add(1.0, 1, 4);
  CHECK(m.mean_loss() == Approx(0.5));
  CHECK(m.accuracy() == Approx(3.0 / 8.0));
  single_rank comm;
  const auto r = m.reduced(comm);
  CHECK(comm.calls == 1);
  CHECK(r.samples == 8);
}

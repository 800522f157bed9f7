#pragma once
/// \file The conformance suite of the ddp::communicator concept, shared by every backend (tcp, mpi, nccl).
/// It does not depend on Catch2: a failed check throws ddp::testing::check_failure with
/// "rank R: file:line: text", so it runs in forked children as well as under mpirun.
/// Call run_conformance(comm) on every rank of a group; each wait is bounded by the communicator's timeout.
///
/// Values are small integers (|v| ≤ 256, so exact in bf16 and f16 up to 8 ranks) that depend on the rank and
/// the element index; each rank computes the exact expected result independently.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <ddp/comm/communicator.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/comm/reduce_op.hpp>
#include <ddp/comm/stats.hpp>
#include <ddp/core/work.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp::testing {

/// A failed DDP_CHECK: "rank R: file:line: check failed: expression: details".
struct check_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

/// The rank DDP_CHECK reports; set by each check_* function.
inline int& current_rank() {
  thread_local int rank = -1;
  return rank;
}

template <class... Parts>
[[noreturn]] void fail(const char* file, int line, const char* text, const Parts&... parts) {
  std::ostringstream out;
  out << "rank " << current_rank() << ": " << file << ":" << line << ": " << text;
  if constexpr (sizeof...(Parts) > 0) {
    out << ": ";
    (out << ... << parts);
  }
  throw check_failure(out.str());
}

}  // namespace detail

/// Throws check_failure("rank R: file:line: check failed: cond: <the streamed extra arguments>") when !cond.
#define DDP_CHECK(cond, ...)                                                                            \
  do {                                                                                                  \
    if (!(cond)) ::ddp::testing::detail::fail(__FILE__, __LINE__, "check failed: " #cond __VA_OPT__(, ) \
                                                  __VA_ARGS__);                                         \
  } while (false)

/// The element types the suite covers.
using conformance_types = std::tuple<float, double, bfloat16, float16, std::int32_t, std::int64_t>;

/// The reduction operators the suite covers.
inline constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::min, reduce_op::max,
                                        reduce_op::prod};

/// Elements of the large case: over a million, crossing any backend's segmenting.
inline constexpr std::size_t large_count = (std::size_t{1} << 20) + 3;

/// Calls f(T{}) for every type of the tuple Types.
template <class Types, class F>
void for_each_type(F&& f) {
  std::apply([&](auto... zero) { (f(zero), ...); }, Types{});
}

/// `v` as element type T (exact for the suite's small integers).
template <class T>
T make(double v) {
  if constexpr (std::is_arithmetic_v<T>) return static_cast<T>(v);
  else return T(static_cast<float>(v));
}

/// Element `x` widened to double.
template <class T>
double value_of(T x) {
  if constexpr (std::is_arithmetic_v<T>) return static_cast<double>(x);
  else return static_cast<double>(static_cast<float>(x));
}

/// Rank r's input element i for a reduction with `op`.
inline double reduce_input(reduce_op op, int r, std::size_t i) {
  const auto k = static_cast<long long>(i);
  switch (op) {
    case reduce_op::sum: return static_cast<double>((k % 5 + 1) * (r + 1));
    case reduce_op::avg: return static_cast<double>((k % 3 + 1) * (2 * r + 1));  // sum = (k%3+1)·N², avg exact
    case reduce_op::min: case reduce_op::max: return static_cast<double>((k + 3 * r) % 11 - 5);
    case reduce_op::prod: return (k + r) % 3 == 0 ? -2.0 : static_cast<double>(1 + (k + r) % 2);
  }
  return 0;
}

/// The exact result of reducing element i with `op` over ranks 0..n-1.
inline double reduce_expected(reduce_op op, int n, std::size_t i) {
  double acc = reduce_input(op, 0, i);
  for (int r = 1; r < n; ++r) {
    const double v = reduce_input(op, r, i);
    switch (op) {
      case reduce_op::sum: case reduce_op::avg: acc += v; break;
      case reduce_op::min: acc = std::min(acc, v); break;
      case reduce_op::max: acc = std::max(acc, v); break;
      case reduce_op::prod: acc *= v; break;
    }
  }
  return op == reduce_op::avg ? acc / n : acc;
}

/// A rank- and index-dependent value for data movement, exact in every dtype.
inline double code(int r, std::size_t i) {
  return static_cast<double>((r * 37 + static_cast<long long>(i)) % 211 - 60);
}

/// Element counts every collective runs with: empty, one, small odd, not divisible by the group size.
template <class C>
std::vector<std::size_t> small_counts(const C& comm) {
  return {0, 1, 7, 13, 5 * static_cast<std::size_t>(comm.size()) + 1};
}

template <class C>
void enter(const C& comm) {
  detail::current_rank() = comm.rank();
}

/// all_reduce of every op and dtype, through typed spans (all counts and a large one) and raw_tensor.
template <ddp::communicator C>
void check_all_reduce(C& comm) {
  enter(comm);
  auto counts = small_counts(comm);
  counts.push_back(large_count);
  for_each_type<conformance_types>([&](auto zero) {
    using T = decltype(zero);
    for (const reduce_op op : all_ops) {
      for (const std::size_t n : counts) {
        for (const bool raw : {false, true}) {
          if (raw && n == large_count) continue;  // the raw path is the same transport; small counts cover it
          std::vector<T> buf(n);
          for (std::size_t i = 0; i < n; ++i) buf[i] = make<T>(reduce_input(op, comm.rank(), i));
          if (raw) comm.all_reduce(raw_tensor::of(std::span<T>(buf)), op).wait();
          else comm.all_reduce(std::span<T>(buf), op).wait();
          for (std::size_t i = 0; i < n; ++i) {
            const double want = value_of(make<T>(reduce_expected(op, comm.size(), i)));
            DDP_CHECK(value_of(buf[i]) == want, "all_reduce(", to_string(op), ") of ", n, " ",
                      to_string(dtype_v<T>), raw ? " via raw_tensor" : " via span", ": element ", i, " is ",
                      value_of(buf[i]), ", expected ", want);
          }
        }
      }
    }
  });
}

/// reduce_scatter of every op and dtype; a large case for f32 and bf16 sums.
template <ddp::communicator C>
void check_reduce_scatter(C& comm) {
  enter(comm);
  const auto N = static_cast<std::size_t>(comm.size());
  for_each_type<conformance_types>([&](auto zero) {
    using T = decltype(zero);
    for (const reduce_op op : all_ops) {
      auto counts = small_counts(comm);
      if (op == reduce_op::sum && (dtype_v<T> == dtype::f32 || dtype_v<T> == dtype::bf16))
        counts.push_back(large_count / N + 1);
      for (const std::size_t k : counts) {
        std::vector<T> in(N * k), out(k, make<T>(-99));
        for (std::size_t j = 0; j < in.size(); ++j) in[j] = make<T>(reduce_input(op, comm.rank(), j));
        comm.reduce_scatter(std::span<const T>(in), std::span<T>(out), op).wait();
        const std::size_t base = static_cast<std::size_t>(comm.rank()) * k;
        for (std::size_t i = 0; i < k; ++i) {
          const double want = value_of(make<T>(reduce_expected(op, comm.size(), base + i)));
          DDP_CHECK(value_of(out[i]) == want, "reduce_scatter(", to_string(op), ") of ", k, " ",
                    to_string(dtype_v<T>), " per rank: element ", i, " is ", value_of(out[i]), ", expected ", want);
        }
      }
    }
  });
}

/// all_gather of every dtype (typed and raw_tensor) with small counts, and a large f32 case.
template <ddp::communicator C>
void check_all_gather(C& comm) {
  enter(comm);
  const auto N = static_cast<std::size_t>(comm.size());
  for_each_type<conformance_types>([&](auto zero) {
    using T = decltype(zero);
    auto counts = small_counts(comm);
    if (dtype_v<T> == dtype::f32) counts.push_back(large_count / N + 1);
    for (const std::size_t k : counts) {
      for (const bool raw : {false, true}) {
        std::vector<T> in(k), out(N * k, make<T>(-99));
        for (std::size_t i = 0; i < k; ++i) in[i] = make<T>(code(comm.rank(), i));
        if (raw) comm.all_gather(raw_tensor::of(std::span<T>(in)), raw_tensor::of(std::span<T>(out))).wait();
        else comm.all_gather(std::span<const T>(in), std::span<T>(out)).wait();
        for (std::size_t j = 0; j < N * k; ++j) {
          const double want = code(static_cast<int>(j / k), j % k);
          DDP_CHECK(value_of(out[j]) == want, "all_gather of ", k, " ", to_string(dtype_v<T>),
                    raw ? " via raw_tensor" : " via span", ": element ", j, " is ", value_of(out[j]), ", expected ",
                    want);
        }
      }
    }
  });
}

/// broadcast from every root, every dtype, and a large f32 case from the last root.
template <ddp::communicator C>
void check_broadcast(C& comm) {
  enter(comm);
  for_each_type<conformance_types>([&](auto zero) {
    using T = decltype(zero);
    for (int root = 0; root < comm.size(); ++root) {
      auto counts = small_counts(comm);
      if (dtype_v<T> == dtype::f32 && root == comm.size() - 1) counts.push_back(large_count);
      for (const std::size_t n : counts) {
        std::vector<T> buf(n);
        for (std::size_t i = 0; i < n; ++i) buf[i] = make<T>(comm.rank() == root ? code(root, i) : -99.0);
        comm.broadcast(std::span<T>(buf), root).wait();
        for (std::size_t i = 0; i < n; ++i)
          DDP_CHECK(value_of(buf[i]) == code(root, i), "broadcast of ", n, " ", to_string(dtype_v<T>), " from root ",
                    root, ": element ", i, " is ", value_of(buf[i]), ", expected ", code(root, i));
      }
    }
  });
}

/// reduce onto every root with every op, for f32, i64 and bf16 (the result is checked on the root).
template <ddp::communicator C>
void check_reduce(C& comm) {
  enter(comm);
  for_each_type<std::tuple<float, std::int64_t, bfloat16>>([&](auto zero) {
    using T = decltype(zero);
    for (int root = 0; root < comm.size(); ++root) {
      for (const reduce_op op : all_ops) {
        for (const std::size_t n : small_counts(comm)) {
          std::vector<T> buf(n);
          for (std::size_t i = 0; i < n; ++i) buf[i] = make<T>(reduce_input(op, comm.rank(), i));
          comm.reduce(std::span<T>(buf), op, root).wait();
          if (comm.rank() != root) continue;
          for (std::size_t i = 0; i < n; ++i) {
            const double want = value_of(make<T>(reduce_expected(op, comm.size(), i)));
            DDP_CHECK(value_of(buf[i]) == want, "reduce(", to_string(op), ") of ", n, " ", to_string(dtype_v<T>),
                      " onto root ", root, ": element ", i, " is ", value_of(buf[i]), ", expected ", want);
          }
        }
      }
    }
  });
}

/// gather and scatter at every root, for f32, i32 and f16; the non-root side of each passes an empty span.
template <ddp::communicator C>
void check_gather_scatter(C& comm) {
  enter(comm);
  const auto N = static_cast<std::size_t>(comm.size());
  for_each_type<std::tuple<float, std::int32_t, float16>>([&](auto zero) {
    using T = decltype(zero);
    for (int root = 0; root < comm.size(); ++root) {
      const bool at_root = comm.rank() == root;
      for (const std::size_t k : small_counts(comm)) {
        std::vector<T> mine(k), whole(at_root ? N * k : 0, make<T>(-99));
        for (std::size_t i = 0; i < k; ++i) mine[i] = make<T>(code(comm.rank(), i));
        comm.gather(std::span<const T>(mine), std::span<T>(whole), root).wait();
        for (std::size_t j = 0; j < whole.size(); ++j) {
          const double want = code(static_cast<int>(j / k), j % k);
          DDP_CHECK(value_of(whole[j]) == want, "gather of ", k, " ", to_string(dtype_v<T>), " onto root ", root,
                    ": element ", j, " is ", value_of(whole[j]), ", expected ", want);
        }

        std::vector<T> part(k, make<T>(-99)), source(at_root ? N * k : 0);
        for (std::size_t j = 0; j < source.size(); ++j)
          source[j] = make<T>(code(static_cast<int>(j / k) + root, j % k));
        comm.scatter(std::span<const T>(source), std::span<T>(part), root).wait();
        for (std::size_t i = 0; i < k; ++i) {
          const double want = code(comm.rank() + root, i);
          DDP_CHECK(value_of(part[i]) == want, "scatter of ", k, " ", to_string(dtype_v<T>), " from root ", root,
                    ": element ", i, " is ", value_of(part[i]), ", expected ", want);
        }
      }
    }
  });
}

/// all_to_all for f32, i64 and f16: block j of rank r's input carries (r, j) and must land at block r of rank j.
template <ddp::communicator C>
void check_all_to_all(C& comm) {
  enter(comm);
  const auto N = static_cast<std::size_t>(comm.size());
  const auto tag = [](int from, std::size_t to, std::size_t i) {
    return static_cast<double>((from * 53 + static_cast<long long>(to) * 17 + static_cast<long long>(i)) % 233 - 70);
  };
  for_each_type<std::tuple<float, std::int64_t, float16>>([&](auto zero) {
    using T = decltype(zero);
    for (const std::size_t k : small_counts(comm)) {
      std::vector<T> in(N * k), out(N * k, make<T>(-99));
      for (std::size_t j = 0; j < N * k; ++j) in[j] = make<T>(tag(comm.rank(), j / k, j % k));
      comm.all_to_all(std::span<const T>(in), std::span<T>(out)).wait();
      for (std::size_t j = 0; j < N * k; ++j) {
        const double want = tag(static_cast<int>(j / k), static_cast<std::size_t>(comm.rank()), j % k);
        DDP_CHECK(value_of(out[j]) == want, "all_to_all of ", k, " ", to_string(dtype_v<T>), " per block: element ",
                  j, " is ", value_of(out[j]), ", expected ", want);
      }
    }
  });
}

/// send/recv around a ring: two tags received in the opposite order of sending, plus a large message.
template <ddp::communicator C>
void check_send_recv(C& comm) {
  enter(comm);
  const int next = (comm.rank() + 1) % comm.size();
  const int prev = (comm.rank() + comm.size() - 1) % comm.size();
  std::vector<float> small_out(7), big_out(large_count), small_in(7, -99.0F), big_in(large_count, -99.0F);
  std::vector<std::int64_t> tagged_out(3), tagged_in(3, -99);
  for (std::size_t i = 0; i < small_out.size(); ++i) small_out[i] = static_cast<float>(code(comm.rank(), i));
  for (std::size_t i = 0; i < big_out.size(); ++i) big_out[i] = static_cast<float>(code(comm.rank(), i));
  for (std::size_t i = 0; i < tagged_out.size(); ++i) tagged_out[i] = comm.rank() * 1000 + static_cast<int>(i);

  work recv_tagged = comm.recv(std::span<std::int64_t>(tagged_in), prev, 9);
  work recv_small = comm.recv(std::span<float>(small_in), prev, 1);
  work recv_big = comm.recv(std::span<float>(big_in), prev, 2);
  work send_small = comm.send(std::span<const float>(small_out), next, 1);
  work send_big = comm.send(std::span<const float>(big_out), next, 2);
  work send_tagged = comm.send(std::span<const std::int64_t>(tagged_out), next, 9);
  recv_tagged.wait();
  recv_big.wait();
  recv_small.wait();
  send_tagged.wait();
  send_small.wait();
  send_big.wait();
  for (std::size_t i = 0; i < small_in.size(); ++i)
    DDP_CHECK(small_in[i] == static_cast<float>(code(prev, i)), "ring recv (tag 1) from rank ", prev, ": element ", i,
              " is ", small_in[i]);
  for (std::size_t i = 0; i < big_in.size(); ++i)
    DDP_CHECK(big_in[i] == static_cast<float>(code(prev, i)), "ring recv of ", large_count, " f32 (tag 2) from rank ",
              prev, ": element ", i, " is ", big_in[i]);
  for (std::size_t i = 0; i < tagged_in.size(); ++i)
    DDP_CHECK(tagged_in[i] == prev * 1000 + static_cast<int>(i), "ring recv (tag 9) from rank ", prev, ": element ",
              i, " is ", tagged_in[i]);
}

/// Barriers complete, and a send posted before a barrier is received after it.
template <ddp::communicator C>
void check_barrier(C& comm) {
  enter(comm);
  for (int i = 0; i < 3; ++i) comm.barrier().wait();
  const int next = (comm.rank() + 1) % comm.size();
  const int prev = (comm.rank() + comm.size() - 1) % comm.size();
  std::int32_t out = comm.rank(), in = -1;
  work sent = comm.send(std::span<const std::int32_t>(&out, 1), next, 5);
  comm.barrier().wait();
  comm.recv(std::span<std::int32_t>(&in, 1), prev, 5).wait();
  sent.wait();
  DDP_CHECK(in == prev, "recv after a barrier got ", in, " from rank ", prev);
}

/// A quick all_reduce check of every op on f32 and bf16 (used on subgroups).
template <ddp::communicator C>
void check_all_reduce_small(C& comm) {
  enter(comm);
  for_each_type<std::tuple<float, bfloat16>>([&](auto zero) {
    using T = decltype(zero);
    for (const reduce_op op : all_ops) {
      std::vector<T> buf(11);
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = make<T>(reduce_input(op, comm.rank(), i));
      comm.all_reduce(std::span<T>(buf), op).wait();
      for (std::size_t i = 0; i < buf.size(); ++i) {
        const double want = value_of(make<T>(reduce_expected(op, comm.size(), i)));
        DDP_CHECK(value_of(buf[i]) == want, "all_reduce(", to_string(op), ") of 11 ", to_string(dtype_v<T>),
                  " in a group of ", comm.size(), ": element ", i, " is ", value_of(buf[i]), ", expected ", want);
      }
    }
  });
}

/// split into even/odd colors with reversed keys, collectives on the subgroups and the parent at the same time,
/// and the degenerate splits (everyone together, everyone alone).
template <ddp::communicator C>
void check_split(C& comm) {
  enter(comm);
  const int r = comm.rank(), n = comm.size();
  C sub = comm.split(r % 2, n - r);
  int same = 0, above = 0;
  for (int q = r % 2; q < n; q += 2) {
    ++same;
    if (q > r) ++above;
  }
  DDP_CHECK(sub.size() == same, "split by parity: size ", sub.size(), ", expected ", same);
  DDP_CHECK(sub.rank() == above, "split by parity with keys n-rank: rank ", sub.rank(), ", expected ", above);

  std::vector<std::int64_t> in_sub(5), in_world(5);
  for (std::size_t i = 0; i < 5; ++i) {
    in_sub[i] = (r + 1) * static_cast<std::int64_t>(i + 1);
    in_world[i] = (r + 1) * static_cast<std::int64_t>(i + 2);
  }
  std::vector<float> root_value{comm.rank() * 1.0F};  // the subgroup's rank 0 is the highest rank of its parity
  work on_sub = sub.all_reduce(std::span<std::int64_t>(in_sub), reduce_op::sum);
  work on_world = comm.all_reduce(std::span<std::int64_t>(in_world), reduce_op::sum);
  work sub_bcast = sub.broadcast(std::span<float>(root_value), 0);
  on_world.wait();
  sub_bcast.wait();
  on_sub.wait();
  std::int64_t sub_sum = 0;
  for (int q = r % 2; q < n; q += 2) sub_sum += q + 1;
  const std::int64_t world_sum = static_cast<std::int64_t>(n) * (n + 1) / 2;
  for (std::size_t i = 0; i < 5; ++i) {
    DDP_CHECK(in_sub[i] == sub_sum * static_cast<std::int64_t>(i + 1), "subgroup all_reduce: element ", i, " is ",
              in_sub[i]);
    DDP_CHECK(in_world[i] == world_sum * static_cast<std::int64_t>(i + 2),
              "parent all_reduce beside a subgroup's: element ", i, " is ", in_world[i]);
  }
  int highest = r % 2;
  while (highest + 2 < n) highest += 2;
  DDP_CHECK(root_value[0] == static_cast<float>(highest), "subgroup broadcast from its rank 0 gave ", root_value[0],
            ", expected world rank ", highest);
  check_all_reduce_small(sub);

  C together = comm.split(0, r);
  DDP_CHECK(together.size() == n && together.rank() == r, "split with one color: rank ", together.rank(), " of ",
            together.size());
  C alone = comm.split(r, 0);
  DDP_CHECK(alone.size() == 1 && alone.rank() == 0, "split with a color per rank: rank ", alone.rank(), " of ",
            alone.size());
  std::vector<double> mine{1.5, -2.0};
  alone.all_reduce(std::span<double>(mine), reduce_op::sum).wait();
  DDP_CHECK(mine[0] == 1.5 && mine[1] == -2.0, "all_reduce in a group of one changed the buffer");
  enter(comm);
}

/// An aggregate travelling through the object collectives.
struct conformance_record {
  std::int32_t id = 0;
  double weight = 0;
  std::string name;
  std::vector<std::int64_t> values;
};

/// all_gather_object and broadcast_object with a string of rank-dependent length and an aggregate.
template <ddp::communicator C>
void check_objects(C& comm) {
  enter(comm);
  const auto text_of = [](int r) {
    return "rank " + std::to_string(r) + " " + std::string(static_cast<std::size_t>(r) * 3, 'x');
  };
  const auto record_of = [&](int r) {
    return conformance_record{r * 10, r * 0.5, text_of(r),
                              std::vector<std::int64_t>(static_cast<std::size_t>(r) + 1, r)};
  };
  const std::vector<std::string> texts = all_gather_object(comm, text_of(comm.rank()));
  DDP_CHECK(static_cast<int>(texts.size()) == comm.size(), "all_gather_object returned ", texts.size(), " strings");
  for (int r = 0; r < comm.size(); ++r)
    DDP_CHECK(texts[static_cast<std::size_t>(r)] == text_of(r), "all_gather_object string from rank ", r, " is '",
              texts[static_cast<std::size_t>(r)], "'");
  const auto records = all_gather_object(comm, record_of(comm.rank()));
  for (int r = 0; r < comm.size(); ++r) {
    const auto& got = records[static_cast<std::size_t>(r)];
    const auto want = record_of(r);
    DDP_CHECK(got.id == want.id && got.weight == want.weight && got.name == want.name && got.values == want.values,
              "all_gather_object aggregate from rank ", r, " differs (id ", got.id, ", name '", got.name, "')");
  }
  for (int root = 0; root < comm.size(); ++root) {
    std::string text = comm.rank() == root ? text_of(root) : std::string("stale");
    broadcast_object(comm, text, root);
    DDP_CHECK(text == text_of(root), "broadcast_object string from root ", root, " is '", text, "'");
    conformance_record record = comm.rank() == root ? record_of(root) : conformance_record{};
    broadcast_object(comm, record, root);
    const auto want = record_of(root);
    DDP_CHECK(record.id == want.id && record.weight == want.weight && record.name == want.name &&
                  record.values == want.values,
              "broadcast_object aggregate from root ", root, " differs (id ", record.id, ")");
  }
}

/// Many operations in flight at once, completed in the reverse order of issue, some polled with done().
template <ddp::communicator C>
void check_out_of_order(C& comm) {
  enter(comm);
  constexpr std::size_t ops = 24;
  const auto N = static_cast<std::size_t>(comm.size());
  std::vector<std::vector<float>> sums(ops), gathered(ops), sent(ops);
  std::vector<work> works;
  for (std::size_t j = 0; j < ops; ++j) {
    const std::size_t n = 100 + 37 * j;
    if (j % 3 == 0) {
      sums[j].assign(n, static_cast<float>(comm.rank() + 1) * static_cast<float>(j + 1));
      works.push_back(comm.all_reduce(std::span<float>(sums[j]), reduce_op::sum));
    } else if (j % 3 == 1) {
      sent[j].assign(n, static_cast<float>(comm.rank() * 100 + static_cast<int>(j)));
      gathered[j].assign(n * N, -1.0F);
      works.push_back(comm.all_gather(std::span<const float>(sent[j]), std::span<float>(gathered[j])));
    } else {
      const int root = static_cast<int>(j % N);
      sums[j].assign(n, comm.rank() == root ? static_cast<float>(j) : -1.0F);
      works.push_back(comm.broadcast(std::span<float>(sums[j]), root));
    }
  }
  for (std::size_t j = 0; j < ops; j += 2) (void)works[j].done();
  for (std::size_t j = ops; j-- > 0;) works[j].wait();
  const auto total = static_cast<float>(N * (N + 1) / 2);
  for (std::size_t j = 0; j < ops; ++j) {
    if (j % 3 == 0) {
      for (const float v : sums[j])
        DDP_CHECK(v == total * static_cast<float>(j + 1), "out-of-order all_reduce #", j, " gave ", v);
    } else if (j % 3 == 1) {
      const std::size_t n = sent[j].size();
      for (std::size_t q = 0; q < gathered[j].size(); ++q)
        DDP_CHECK(gathered[j][q] == static_cast<float>(static_cast<int>(q / n) * 100 + static_cast<int>(j)),
                  "out-of-order all_gather #", j, ": element ", q, " is ", gathered[j][q]);
    } else {
      for (const float v : sums[j]) DDP_CHECK(v == static_cast<float>(j), "out-of-order broadcast #", j, " gave ", v);
    }
  }
}

/// stats() counts the operations started, and bytes when there is a peer to send to.
template <ddp::communicator C>
void check_stats(C& comm) {
  enter(comm);
  const comm_stats before = comm.stats();
  std::vector<float> buf(4096, 1.0F), gathered(16 * static_cast<std::size_t>(comm.size()));
  comm.all_reduce(std::span<float>(buf), reduce_op::sum).wait();
  comm.all_gather(std::span<const float>(buf.data(), 16), std::span<float>(gathered)).wait();
  const comm_stats after = comm.stats();
  DDP_CHECK(after.count(collective::all_reduce) > before.count(collective::all_reduce),
            "stats() all_reduce calls did not increase: ", after.count(collective::all_reduce));
  DDP_CHECK(after.count(collective::all_gather) > before.count(collective::all_gather),
            "stats() all_gather calls did not increase: ", after.count(collective::all_gather));
  if (comm.size() > 1) {
    DDP_CHECK(after.bytes(collective::all_reduce) > before.bytes(collective::all_reduce),
              "stats() all_reduce bytes did not increase: ", after.bytes(collective::all_reduce));
    DDP_CHECK(after.total_bytes() > before.total_bytes(), "stats() total bytes did not increase");
  }
}

/// The whole suite; every rank of `comm` must call it.
template <ddp::communicator C>
void run_conformance(C& comm) {
  check_all_reduce(comm);
  check_reduce_scatter(comm);
  check_all_gather(comm);
  check_broadcast(comm);
  check_reduce(comm);
  check_gather_scatter(comm);
  check_all_to_all(comm);
  check_send_recv(comm);
  check_barrier(comm);
  check_split(comm);
  check_objects(comm);
  check_out_of_order(comm);
  check_stats(comm);
  comm.barrier().wait();
}

}  // namespace ddp::testing

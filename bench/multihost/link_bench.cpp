// One rank of the rate-limited-link benchmarks (bench/multihost/run_link.py starts it with ddp-launch --nnodes 2
// on each simulated host of tests/support/multihost.sh). Prints JSON lines: rank 0 the timings, and the first rank
// of every host (LOCAL_RANK 0) the bytes its host sent on eth0 (the link) between two barriers.
//
//   link_bench allreduce [--min-bytes 1048576] [--max-bytes 67108864] [--iters 5]
//       f32 all_reduce(sum) from min to max bytes (×2): median of the slowest rank's time, busbw = bytes*2(N-1)/N/t
//   link_bench policy --policy replicate|shard_grad_op|full_shard|hybrid [--dims 1024,1024,...] [--steps 5] [--batch 4]
//       bytes sent across the link per step by each host under a sharding policy (hybrid<full_shard>: groups of
//       LOCAL_WORLD_SIZE, one per host), beside Ψ (the parameters' bytes) and the payload ddp counted
//   link_bench step --hook plain|bf16 --after-backward 0|1 [--dims ...] [--steps 7] [--batch 8]
//       median step time of replicate with 4 MiB buckets (first 1 MiB) overlapping the backward, or with one
//       bucket larger than the model (--after-backward 1), which starts once the whole backward has run;
//       with --trace 1 every rank also prints, per step, when its backward began and ended and when each bucket
//       started and completed (seconds since the backward began), what the hook's start and complete cost, and
//       how often the scheduler preempted the starting thread inside the start
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <sys/resource.h>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/ddp.hpp>

#include "naive_mlp.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using tcp_comm = ddp::tcp::communicator;

/// The command line's --key value pairs after the mode.
struct arguments {
  std::map<std::string, std::string> values;
  [[nodiscard]] std::string get(const std::string& key, const std::string& fallback) const {
    const auto it = values.find(key);
    return it == values.end() ? fallback : it->second;
  }
  [[nodiscard]] long number(const std::string& key, long fallback) const {
    return std::stol(get(key, std::to_string(fallback)));
  }
  [[nodiscard]] std::vector<std::size_t> dims() const {
    std::vector<std::size_t> d;
    std::stringstream in(get("--dims", "1024,1024,1024,1024,1024,1024,1024,1024,1024"));
    for (std::string w; std::getline(in, w, ',');) d.push_back(std::stoul(w));
    return d;
  }
};

/// Bytes eth0 (this host's end of the link) has sent.
std::uint64_t link_tx_bytes() {
  std::ifstream in("/sys/class/net/eth0/statistics/tx_bytes");
  std::uint64_t n = 0;
  in >> n;
  return n;
}

bool first_on_host() {
  const char* local = std::getenv("LOCAL_RANK");
  return local == nullptr || std::string_view(local) == "0";
}

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

/// The median over `times` of each iteration's slowest rank.
double slowest_median(tcp_comm& comm, std::vector<double> times) {
  comm.all_reduce(std::span<double>(times), ddp::reduce_op::max).wait();
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int run_allreduce(tcp_comm& comm, const arguments& a) {
  const auto min_bytes = static_cast<std::size_t>(a.number("--min-bytes", 1 << 20));
  const auto max_bytes = static_cast<std::size_t>(a.number("--max-bytes", 64 << 20));
  const int iters = static_cast<int>(a.number("--iters", 5));
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    std::vector<float> v(bytes / sizeof(float), 1.0F);
    comm.all_reduce(v).wait();  // warm-up: the sockets' buffers grow
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      std::fill(v.begin(), v.end(), 1.0F);
      comm.barrier().wait();
      const auto t0 = clock_type::now();
      comm.all_reduce(v).wait();
      times.push_back(seconds_since(t0));
    }
    if (v.front() != static_cast<float>(comm.size()) || v.back() != static_cast<float>(comm.size()))
      throw ddp::error("rank " + std::to_string(comm.rank()) + ": all_reduce gave a wrong sum; the benchmark is void");
    const double t = slowest_median(comm, times);
    const int n = comm.size();
    if (comm.rank() == 0)
      std::printf("{\"mode\": \"allreduce\", \"world\": %d, \"bytes\": %zu, \"seconds\": %.6f, \"busbw\": %.0f}\n", n,
                  bytes, t, static_cast<double>(bytes) * 2.0 * (n - 1) / n / t);
    std::fflush(stdout);
  }
  return 0;
}

/// One step's timeline on this rank, in seconds since its backward began: when each bucket started, what the
/// hook's start (the bf16 hook's narrowing included) and complete cost, and when its reduction completed, which
/// a watcher thread sees by blocking on each bucket's work in start order (it sleeps otherwise).
class step_trace {
 public:
  step_trace() : watcher_([this] { watch(); }) {}
  step_trace(const step_trace&) = delete;
  ~step_trace() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    watcher_.join();
  }
  /// The process's trace (the hooks are default-constructed by data_parallel, so they find it here).
  static step_trace& get() {
    static step_trace t;
    return t;
  }
  /// The backward begins: a new timeline.
  void begin_backward() {
    std::lock_guard lock(mutex_);
    t0_ = clock_type::now();
    buckets_.clear();
  }
  /// Bucket `b` started at `start`; its start took until now, during which the scheduler took the CPU from
  /// this thread `preempted` times; `w` completes with its reduction.
  void started(std::size_t b, clock_type::time_point start, long preempted, ddp::work w) {
    std::lock_guard lock(mutex_);
    if (buckets_.size() <= b) buckets_.resize(b + 1);
    buckets_[b].start = since(start);
    buckets_[b].launch_cost = std::chrono::duration<double>(clock_type::now() - start).count();
    buckets_[b].preempted = preempted;
    queue_.emplace_back(b, std::move(w));
    cv_.notify_all();
  }
  /// Bucket `b`'s hook completed it, which took since `start`.
  void completed(std::size_t b, clock_type::time_point start) {
    std::lock_guard lock(mutex_);
    if (buckets_.size() > b) buckets_[b].complete_cost = std::chrono::duration<double>(clock_type::now() - start).count();
  }
  /// The step's timeline as JSON, once the watcher has seen every started bucket complete.
  std::string json(int rank, int step, double forward_start, double backward_end, double reduced, double step_end) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return queue_.empty() && !watching_; });
    std::string out = "{\"mode\": \"trace\", \"rank\": " + std::to_string(rank) + ", \"step\": " + std::to_string(step) +
                      ", \"forward_start\": " + std::to_string(forward_start) + ", \"backward_end\": " +
                      std::to_string(backward_end) + ", \"reduced\": " + std::to_string(reduced) + ", \"step_end\": " +
                      std::to_string(step_end) + ", \"buckets\": [";
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto& r = buckets_[b];
      out += (b ? ", " : "") + std::string("[") + std::to_string(r.start) + ", " + std::to_string(r.launch_cost) + ", " +
             std::to_string(r.done) + ", " + std::to_string(r.complete_cost) + ", " + std::to_string(r.preempted) + "]";
    }
    return out + "]}";
  }
  /// Seconds from the backward's start to `t`.
  double since(clock_type::time_point t) const { return std::chrono::duration<double>(t - t0_).count(); }

 private:
  struct bucket_times {
    double start = 0, launch_cost = 0, done = 0, complete_cost = 0;
    long preempted = 0;
  };
  void watch() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      auto [b, w] = std::move(queue_.front());
      queue_.erase(queue_.begin());
      watching_ = true;
      lock.unlock();
      try {
        w.wait();
      } catch (const std::exception&) {  // the step's own wait reports the failure
      }
      const auto t = clock_type::now();
      lock.lock();
      watching_ = false;
      buckets_[b].done = since(t);
      cv_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  clock_type::time_point t0_ = clock_type::now();
  std::vector<bucket_times> buckets_;
  std::vector<std::pair<std::size_t, ddp::work>> queue_;
  bool watching_ = false;
  bool stop_ = false;
  std::thread watcher_;
};

/// Involuntary context switches of the calling thread so far (the scheduler took the CPU from it).
long preemptions() {
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return u.ru_nivcsw;
}

/// CPU seconds (user + system) used so far by the calling thread (RUSAGE_THREAD) or the whole process.
double cpu_seconds(int who) {
  rusage u{};
  ::getrusage(who, &u);
  const auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

/// `Hook` with every start and complete recorded in step_trace::get().
template <class Hook>
struct traced_hook : Hook {
  template <class Comm>
  ddp::work start(const ddp::bucket_gradients<Comm>& b) {
    const long preempted = preemptions();
    const auto start = clock_type::now();
    ddp::work w = Hook::start(b);
    step_trace::get().started(b.index, start, preemptions() - preempted, w);
    return w;
  }
  template <class Comm>
  void complete(const ddp::bucket_gradients<Comm>& b) {
    const auto start = clock_type::now();
    Hook::complete(b);
    step_trace::get().completed(b.index, start);
  }
};

/// Step times: whole steps, and their forward + backward (bucket starts included, before dp.step's wait).
struct step_times {
  std::vector<double> step, forward_backward;
};

/// Runs `steps` training steps of `dp` after one warm-up step and times them; with `trace`, prints every step's
/// timeline (step_trace) after it.
template <class DP, class Opt>
step_times train(DP& dp, bench::mlp& model, Opt& opt, std::size_t batch, int steps, bool trace = false) {
  step_times times;
  double thread_cpu = 0, process_cpu = 0;
  auto timed_from = clock_type::now();
  for (int i = 0; i <= steps; ++i) {
    if (i == 1) {
      thread_cpu = cpu_seconds(RUSAGE_THREAD);
      process_cpu = cpu_seconds(RUSAGE_SELF);
      timed_from = clock_type::now();
    }
    const auto t0 = clock_type::now();
    dp.zero_grad();
    bench::forward_backward(dp, model, batch, [&] {
      if (trace) step_trace::get().begin_backward();
    });
    const auto backward_end = clock_type::now();
    dp.finish_gradients();
    const auto reduced = clock_type::now();
    dp.step(opt);
    if (trace) {
      auto& t = step_trace::get();
      std::printf("%s\n", t.json(dp.rank(), i, t.since(t0), t.since(backward_end), t.since(reduced),
                                 t.since(clock_type::now())).c_str());
    }
    if (i == 0) continue;
    times.step.push_back(seconds_since(t0));
    times.forward_backward.push_back(std::chrono::duration<double>(backward_end - t0).count());
  }
  if (trace)  // the training thread's CPU time and the rest of the process's (the progress engine's) per step
    std::printf("{\"mode\": \"cpu\", \"rank\": %d, \"wall\": %.6f, \"training_thread\": %.6f, \"other_threads\": %.6f}\n",
                dp.rank(), seconds_since(timed_from) / steps, (cpu_seconds(RUSAGE_THREAD) - thread_cpu) / steps,
                (cpu_seconds(RUSAGE_SELF) - process_cpu - cpu_seconds(RUSAGE_THREAD) + thread_cpu) / steps);
  return times;
}

double parameter_bytes(bench::mlp& m) {
  double n = 0;
  for (auto& l : m.fc) n += static_cast<double>(l.weight.numel() + l.bias.numel());
  return 4 * n;
}

template <class Sharding>
int run_policy(tcp_comm& comm, const arguments& a, std::string_view name) {
  bench::mlp model = bench::make_mlp(a.dims());
  const double psi = parameter_bytes(model);
  const int steps = static_cast<int>(a.number("--steps", 5));
  const auto batch = static_cast<std::size_t>(a.number("--batch", 4));
  ddp::data_parallel dp{model, comm, Sharding{}, ddp::bucket_bytes<(25U << 20)>{}};
  ddp::optim::sgd opt({.lr = 1e-3});
  (void)train(dp, model, opt, batch, 0);  // one warm-up step: every buffer made, every connection open
  const auto payload = [&] {  // the world's bytes; under hybrid also the shard group's and the replica group's
    std::uint64_t b = comm.stats().total_bytes();
    if (name.starts_with("hybrid")) b += dp.shard_group().stats().total_bytes();
    if (const auto replicas = dp.replica_group()) b += replicas->stats().total_bytes();
    return b;
  };
  comm.barrier().wait();
  const auto tx0 = link_tx_bytes();
  const auto payload0 = payload();
  (void)train(dp, model, opt, batch, steps - 1);  // `steps` steps, the first untimed
  comm.barrier().wait();
  const auto tx = link_tx_bytes() - tx0;
  const auto sent = payload() - payload0;
  if (first_on_host())
    std::printf("{\"mode\": \"policy\", \"policy\": \"%s\", \"world\": %d, \"local_world\": %s, \"rank\": %d, "
                "\"psi_bytes\": %.0f, \"steps\": %d, \"link_tx_bytes\": %llu, \"rank_payload_bytes\": %llu}\n",
                std::string(name).c_str(), comm.size(), std::getenv("LOCAL_WORLD_SIZE"), comm.rank(), psi, steps,
                static_cast<unsigned long long>(tx), static_cast<unsigned long long>(sent));
  std::fflush(stdout);
  return 0;
}

template <class Hook, class Buckets>
int run_step(tcp_comm& comm, const arguments& a, const char* hook, bool after) {
  bench::mlp model = bench::make_mlp(a.dims());
  const double psi = parameter_bytes(model);
  ddp::data_parallel dp{model, comm, ddp::replicate{}, Hook{}, Buckets{}};
  ddp::optim::sgd opt({.lr = 1e-3, .momentum = 0.9});
  const auto batch = static_cast<std::size_t>(a.number("--batch", 8));
  comm.barrier().wait();
  auto times = train(dp, model, opt, batch, static_cast<int>(a.number("--steps", 7)), a.number("--trace", 0) != 0);
  // This rank's compute per step without communication (forward + backward under no_sync): median of 3.
  std::vector<double> alone;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = clock_type::now();
    dp.zero_grad();
    auto no_sync = dp.no_sync();
    bench::forward_backward(dp, model, batch);
    alone.push_back(seconds_since(t0));
  }
  std::sort(alone.begin(), alone.end());
  const double compute = alone[1];
  const double median = slowest_median(comm, times.step);
  std::sort(times.forward_backward.begin(), times.forward_backward.end());
  const double fb = times.forward_backward[times.forward_backward.size() / 2];
  if (comm.rank() == 0)
    std::printf("{\"mode\": \"step\", \"hook\": \"%s\", \"after_backward\": %s, \"world\": %d, \"psi_bytes\": %.0f, "
                "\"buckets\": %zu, \"batch\": %zu, \"step_seconds\": %.6f, \"forward_backward_seconds\": %.6f, "
                "\"compute_seconds\": %.6f}\n",
                hook, after ? "true" : "false", comm.size(), psi, dp.bucket_count(), batch, median, fb, compute);
  std::fflush(stdout);
  return 0;
}

template <class Hook, bool Traced = false>
int run_step_with(tcp_comm& comm, const arguments& a, const char* hook) {
  if constexpr (!Traced)
    if (a.number("--trace", 0) != 0) return run_step_with<traced_hook<Hook>, true>(comm, a, hook);
  if (a.number("--after-backward", 0) != 0)
    return run_step<Hook, ddp::bucket_bytes<(1U << 30), (1U << 30)>>(comm, a, hook, true);
  return run_step<Hook, ddp::bucket_bytes<(4U << 20), (1U << 20)>>(comm, a, hook, false);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) throw ddp::config_error("usage: link_bench allreduce|policy|step [--key value ...]");
    const std::string mode = argv[1];
    arguments a;
    for (int i = 2; i + 1 < argc; i += 2) a.values[argv[i]] = argv[i + 1];
    auto comm = tcp_comm::from_env();
    if (mode == "allreduce") return run_allreduce(comm, a);
    if (mode == "policy") {
      const std::string policy = a.get("--policy", "replicate");
      if (policy == "replicate") return run_policy<ddp::replicate>(comm, a, policy);
      if (policy == "shard_grad_op") return run_policy<ddp::shard_grad_op>(comm, a, policy);
      if (policy == "full_shard") return run_policy<ddp::full_shard>(comm, a, policy);
      if (policy == "hybrid") return run_policy<ddp::hybrid<ddp::full_shard>>(comm, a, "hybrid<full_shard>");
      throw ddp::config_error("--policy takes replicate, shard_grad_op, full_shard or hybrid, got '" + policy + "'");
    }
    if (mode == "step") {
      const std::string hook = a.get("--hook", "plain");
      if (hook == "plain") return run_step_with<ddp::plain_hook>(comm, a, "plain");
      if (hook == "bf16") return run_step_with<ddp::bf16_compress_hook>(comm, a, "bf16");
      throw ddp::config_error("--hook takes plain or bf16, got '" + hook + "'");
    }
    throw ddp::config_error("unknown mode '" + mode + "'; use allreduce, policy or step");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "link_bench: %s\n", e.what());
    return 2;
  }
}

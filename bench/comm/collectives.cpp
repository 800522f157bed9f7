// f32 all_reduce(sum) from 4 KiB to 64 MiB, in one mpirun invocation, over three transports:
// ddp::tcp (rendezvous from OMPI_COMM_WORLD_* and MASTER_PORT) two ways -- as configured by default,
// where ranks on one host run collectives through shared memory (DDP_SHM=0: through the sockets, copying
// large frames straight from each other's memory), and with shared_memory and same_host_copy off, every
// byte through the sockets as between hosts --, Gloo over gloo::transport::tcp
// (FileStore rendezvous) two ways -- gloo::allreduce(AllreduceOptions), the call PyTorch's
// ProcessGroupGloo makes, and a cached gloo::AllreduceHalvingDoubling, Gloo's fastest path for small
// messages -- and raw MPI_Allreduce. Ratios compare ddp with the better of the two Gloo paths. Every iteration starts after an
// MPI_Barrier; its time is the slowest rank's; the table shows the median and
// busbw = bytes * 2(N-1)/N / time. Each result is checked against the exact sum.
// With --ddp-only, started by ddp-launch instead of mpirun (as users launch ddp, with its default binding), it
// measures ddp::tcp alone, without MPI: its own barrier starts each iteration and its own max reduction finds the
// slowest rank's time.
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench/comm/ddp_bench_collectives [--max-bytes B] [--csv]
//   build/tools/ddp-launch -n 2 build/bench/comm/ddp_bench_collectives --ddp-only [--max-bytes B] [--csv]

#include <mpi.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/comm/tcp/socket.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

int g_rank = 0;
int g_size = 1;
bool g_mpi = true;  // false under --ddp-only: no MPI at all

/// How the ranks start an iteration together and agree on its time (the slowest rank's).
struct fence {
  std::function<void()> barrier;
  std::function<void(double&)> max;  ///< replaces the value with its maximum over the ranks
};

/// The fence through MPI (under mpirun).
fence mpi_fence() {
  return {[] { MPI_Barrier(MPI_COMM_WORLD); },
          [](double& t) { MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD); }};
}

void fail() {
  if (g_mpi) MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

/// A free port chosen by rank 0 and shared with every rank.
int shared_free_port() {
  int port = 0;
  if (g_rank == 0) {
    auto fd = ddp::tcp::detail::listen_on("127.0.0.1", 0, 0, "a port probe");
    port = ddp::tcp::detail::local_endpoint(fd.get()).port;
  }
  MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return port;
}

/// CPU seconds (user + system, all threads) this process has used.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

/// Median over iterations of the slowest rank's time of `op` (after an untimed `prepare`), in seconds; `cpu` gets the mean CPU
/// seconds per iteration of rank 0's process (all its threads: the caller's and the transport's).
double time_op(const fence& f, const std::function<void()>& prepare, const std::function<void()>& op, std::size_t bytes,
               double& cpu) {
  prepare();
  f.barrier();
  auto t0 = clock_type::now();
  op();  // warm-up, also sizes the run
  double first = std::chrono::duration<double>(clock_type::now() - t0).count();
  f.max(first);
  // Up to 1000 timed calls in about 0.3 s, after a tenth as many untimed: a small size's median then spans
  // milliseconds, not the first few hundred microseconds after the previous size (or the job's start).
  const int iters = std::clamp(static_cast<int>(0.3 / std::max(first, 1e-7)), bytes >= (16U << 20) ? 3 : 5, 1000);
  for (int i = 0; i < iters / 10; ++i) {
    prepare();
    op();
  }
  std::vector<double> times;
  double cpu_in_op = 0;
  for (int i = 0; i < iters; ++i) {
    prepare();
    f.barrier();
    const double c0 = cpu_seconds();
    t0 = clock_type::now();
    op();
    double t = std::chrono::duration<double>(clock_type::now() - t0).count();
    cpu_in_op += cpu_seconds() - c0;
    f.max(t);
    times.push_back(t);
  }
  cpu = cpu_in_op / iters;
  std::nth_element(times.begin(), times.begin() + iters / 2, times.end());
  return times[static_cast<std::size_t>(iters / 2)];
}

void fill(std::vector<float>& v) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((g_rank + static_cast<int>(i % 13)) % 7);
}

/// Throws unless v holds the sum over ranks of fill()'s values.
void verify(const std::vector<float>& v, const char* who) {
  for (std::size_t i = 0; i < v.size(); i += 1 + v.size() / 4096) {
    float want = 0;
    for (int r = 0; r < g_size; ++r) want += static_cast<float>((r + static_cast<int>(i % 13)) % 7);
    if (v[i] != want) {
      std::fprintf(stderr, "rank %d: %s gave %f at %zu, expected %f\n", g_rank, who, v[i], i, want);
      fail();
    }
  }
}

/// --ddp-only: ddp::tcp as configured by default, ranks and rendezvous from ddp-launch's environment, no MPI.
int run_ddp_only(std::size_t max_bytes, bool csv) {
  auto comm = ddp::tcp::communicator::from_env();
  g_rank = comm.rank();
  g_size = comm.size();
  const fence f{[&] { comm.barrier().wait(); },
                [&](double& t) { comm.all_reduce(std::span<double>(&t, 1), ddp::reduce_op::max).wait(); }};
  if (g_rank == 0)
    std::printf("# f32 all_reduce(sum), ddp::tcp alone under ddp-launch, N=%d ranks, median (slowest rank)\n%10s %10s %9s\n",
                g_size, "bytes", "ddp_us", "ddp_GB/s");
  for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    std::vector<float> buf(bytes / sizeof(float));
    double cpu = 0;
    const double t = time_op(f, [&] { fill(buf); }, [&] { comm.all_reduce(buf).wait(); }, bytes, cpu);
    verify(buf, "ddp::tcp");
    if (g_rank == 0) {
      std::printf("%10zu %10.1f %9.2f\n", bytes, t * 1e6, 2.0 * (g_size - 1) / g_size * static_cast<double>(bytes) / 1e9 / t);
      if (csv) std::printf("CSVDDP,%d,%zu,%.9f,%.9f\n", g_size, bytes, t, cpu);
      std::fflush(stdout);
    }
  }
  return 0;
}

int run(int argc, char** argv) {
  std::size_t max_bytes = 64U << 20;
  bool csv = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--max-bytes") == 0 && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10);
    if (std::strcmp(argv[i], "--csv") == 0) csv = true;
    if (std::strcmp(argv[i], "--ddp-only") == 0) g_mpi = false;
  }
  if (!g_mpi) return run_ddp_only(max_bytes, csv);
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const fence f = mpi_fence();

  // ddp::tcp: rank and size come from OMPI_COMM_WORLD_*; the port from MASTER_PORT or rank 0's pick.
  if (std::getenv("MASTER_PORT") == nullptr) setenv("MASTER_PORT", std::to_string(shared_free_port()).c_str(), 1);
  auto comm = ddp::tcp::communicator::from_env();
  // The same over the sockets only: a second job on another store port.
  ddp::tcp::config sockets_only = ddp::tcp::communicator::config_from_env();
  sockets_only.master_port = static_cast<std::uint16_t>(shared_free_port());
  sockets_only.same_host_copy = false;
  sockets_only.shared_memory = false;
  ddp::tcp::communicator comm_sockets(sockets_only);

  // Gloo: TCP transport on loopback, rendezvous through a FileStore in a directory rank 0 creates.
  char dir[256] = "/tmp/ddp-bench-gloo-XXXXXX";
  if (g_rank == 0 && mkdtemp(dir) == nullptr) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(dir);
  gloo::rendezvous::PrefixStore store("bench", file_store);
  auto gloo_ctx = std::make_shared<gloo::rendezvous::Context>(g_rank, g_size);
  gloo_ctx->connectFullMesh(store, device);

  if (g_rank == 0) {
    std::printf("# f32 all_reduce(sum), N=%d ranks, median of iterations (slowest rank), busbw = bytes*2(N-1)/N/time\n",
                g_size);
    std::printf("%10s %10s %10s %10s %10s %10s %9s %9s %9s %9s %9s %8s %8s\n", "bytes", "ddp_us", "ddpsock_us",
                "gloo_us", "gloohd_us", "mpi_us", "ddp_GB/s", "sock_GB/s", "gloo_GB/s", "hd_GB/s", "mpi_GB/s", "busbw x",
                "sock x");
  }
  for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> buf(count);
    const auto prepare = [&] { fill(buf); };
    double c_ddp = 0, c_gloo = 0, c_mpi = 0;
    const double t_ddp = time_op(f, prepare, [&] { comm.all_reduce(buf).wait(); }, bytes, c_ddp);
    verify(buf, "ddp::tcp");
    double c_sock = 0;
    const double t_sock = time_op(f, prepare, [&] { comm_sockets.all_reduce(buf).wait(); }, bytes, c_sock);
    verify(buf, "ddp::tcp over the sockets only");
    const double t_gloo = time_op(
        f, prepare,
        [&] {
          gloo::AllreduceOptions opts(gloo_ctx);
          opts.setOutput(buf.data(), count);
          opts.setReduceFunction(
              static_cast<void (*)(void*, const void*, const void*, std::size_t)>(&gloo::sum<float>));
          gloo::allreduce(opts);
        },
        bytes, c_gloo);
    verify(buf, "gloo");
    double c_hd = 0;
    gloo::AllreduceHalvingDoubling<float> halving_doubling(gloo_ctx, {buf.data()}, static_cast<int>(count));
    const double t_hd = time_op(f, prepare, [&] { halving_doubling.run(); }, bytes, c_hd);
    verify(buf, "gloo halving-doubling");
    const double t_mpi = time_op(
        f, prepare,
        [&] {
          MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        },
        bytes, c_mpi);
    verify(buf, "MPI_Allreduce");
    if (g_rank == 0) {
      const double factor = 2.0 * (g_size - 1) / g_size * static_cast<double>(bytes) / 1e9;
      const auto bw = [&](double t) { return g_size == 1 ? 0.0 : factor / t; };
      const double best_gloo = std::min(t_gloo, t_hd);
      std::printf("%10zu %10.1f %10.1f %10.1f %10.1f %10.1f %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f\n", bytes,
                  t_ddp * 1e6, t_sock * 1e6, t_gloo * 1e6, t_hd * 1e6, t_mpi * 1e6, bw(t_ddp), bw(t_sock), bw(t_gloo),
                  bw(t_hd), bw(t_mpi), best_gloo / t_ddp, best_gloo / t_sock);
      if (csv)
        std::printf("CSV,%d,%zu,%.9f,%.9f,%.9f,%.9f,%.9f,%.9f,%.9f,%.9f,%.9f,%.9f\n", g_size, bytes, t_ddp, t_gloo, t_hd,
                    t_mpi, c_ddp, c_gloo, c_hd, c_mpi, t_sock, c_sock);
      std::fflush(stdout);
    }
  }
  if (g_rank == 0)
    std::printf("# busbw x = ddp busbw / best Gloo busbw (= best Gloo time / ddp time); sock x = the same for ddp over "
                "the sockets only\n");
  MPI_Barrier(MPI_COMM_WORLD);
  gloo_ctx.reset();
  if (g_rank == 0) {
    std::string cmd = std::string("rm -rf ") + dir;
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir);
  }
  MPI_Finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // a ddp::config_error where no launcher set the job's environment, ...
    std::fprintf(stderr, "ddp_bench_collectives: rank %d: %s\n", g_rank, e.what());
    fail();
  }
  return 1;
}

#pragma once
/// \file The launchers of a job on several nodes (ddp-launch --nnodes N, like torchrun's agents) talk over a
/// small control channel: node 0's launcher listens on MASTER_PORT + 1, every other launcher connects and
/// answers node 0's challenge with a hello signed under the job's key (tcp/auth.hpp: the token never travels);
/// the ranks start once all N launchers have joined. A launcher
/// whose rank fails reports it to node 0, which waits a moment for reports from other nodes (longer while no
/// crash was reported and some node said nothing yet: the crash that made a peer exit may still be on its way),
/// blames a crash before an exit and else the failure that ended first, and tells every node to stop its ranks; at the end
/// node 0 sends every node the job's verdict. Every frame is 40 bytes; the hello's MAC admits its connection; joining
/// has a deadline, strangers are refused, and a launcher whose peer's connection ends (its host died: TCP
/// keepalive) stops its ranks. Node 0 keeps listening while the job runs: a launcher of this job that claims a
/// node rank another launcher holds (while joining or later) is told so in a `taken` frame and refused, and
/// the job goes on.

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ddp/comm/tcp/accept.hpp>
#include <ddp/comm/tcp/auth.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>
#include <ddp/launch/exit_order.hpp>

namespace ddp::launch {

/// Where this launcher stands in a job of several nodes.
struct node_plan {
  int nodes = 1;                            ///< --nnodes
  int node_rank = 0;                        ///< --node-rank
  int nproc_per_node = 1;                   ///< --nproc-per-node
  std::string master_addr;                  ///< --master-addr: node 0's address
  std::uint16_t control_port = 0;          ///< node 0's control port (MASTER_PORT + 1)
  std::string token;                        ///< the job token every launcher shares
  std::chrono::milliseconds join_timeout{std::chrono::minutes(5)};  ///< every launcher must join by then
  int max_restarts = 0;                     ///< --max-restarts, the same on every node
  /// --exit-barrier-timeout: once this node's ranks ended, how long node 0 waits for every other node's to end,
  /// and another node for node 0's verdict (this long plus a minute), before it names the silent node and ends.
  std::chrono::milliseconds exit_barrier{std::chrono::minutes(5)};
  /// When set and it becomes non-zero (a signal handler writes the signal number), joining and waiting for
  /// the other nodes give up with ddp::error.
  const volatile std::sig_atomic_t* interrupt = nullptr;
};

/// A failed rank of a job of several nodes (or a node whose launcher vanished: rank -1; or stayed silent past
/// the exit barrier: rank -2).
struct node_failure {
  /// The rank of a node_failure whose launcher said nothing within the exit barrier.
  static constexpr int silent = -2;

  int node = 0;                ///< the node it ran on
  int rank = -1;               ///< its global rank; -1: the node's launcher itself was lost; silent
  int status = 1;              ///< its status as a shell reports it
  std::int64_t began_us = 0;   ///< when its launcher saw it end (wall clock, microseconds)

  /// Killed by a signal no launcher sends (SIGKILL, SIGSEGV, ...: a crash, the OOM killer): a root cause, since
  /// the peers of a lost rank fail with an exception (an exit code, or SIGABRT from std::terminate).
  [[nodiscard]] bool crashed() const noexcept { return rank >= 0 && detail::crash_signal(status - 128); }
  /// Blamed before `o`: a crash before an exit, else the one that ended first.
  [[nodiscard]] bool before(const node_failure& o) const noexcept {
    if (crashed() != o.crashed()) return crashed();
    return began_us < o.began_us;
  }

  /// A rank failed, as opposed to a launcher: the job may restart.
  [[nodiscard]] bool restartable() const noexcept { return rank >= 0; }

  /// "rank 3 on node 1 failed with status 137", or the launcher's line.
  [[nodiscard]] std::string describe() const {
    if (rank == silent)
      return "the launcher of node " + std::to_string(node) + " said nothing within the exit barrier after the " +
             "other nodes' ranks ended (stopped, hung, or its ranks still running; --exit-barrier-timeout sets it)";
    if (rank < 0)
      return "the launcher of node " + std::to_string(node) + " stopped (interrupted, timed out, or lost with its " +
             "host) with status " + std::to_string(status);
    return "rank " + std::to_string(rank) + " on node " + std::to_string(node) + " failed with status " +
           std::to_string(status);
  }
};

namespace detail {

inline constexpr std::uint32_t control_magic = 0x6464704c;  // "ddpL"

/// What a control frame says.
enum class control_kind : std::uint32_t { hello = 1, go, failed, stop, done, verdict, taken, mismatch };

/// The one frame of the control channel.
struct control_frame {
  std::uint32_t magic = control_magic;
  control_kind kind = control_kind::hello;
  std::int32_t node = 0;     ///< hello, taken: the sender's node rank; failed, stop, verdict: the failing node;
                             ///< mismatch: the node whose settings follow
  std::int32_t rank = -1;    ///< failed, stop, verdict: the failing rank (-1: a launcher); hello, mismatch: ranks per node
  std::int32_t status = 0;   ///< failed, stop, verdict: its status; hello, mismatch: the number of nodes
  std::int32_t restarts = 0; ///< hello, mismatch: --max-restarts
  std::int64_t began_us = 0; ///< failed: when it failed
  std::uint64_t mac = 0;     ///< hello: signed_hello's MAC under the job's key, context "launch"; else 0
};
static_assert(sizeof(control_frame) == 40, "control_frame must stay 40 bytes: every launcher reads exactly that.");

/// "--nnodes 2 --nproc-per-node 4 --max-restarts 0": the settings every node's launcher must share.
inline std::string launch_settings(const control_frame& f) {
  return "--nnodes " + std::to_string(f.status) + " --nproc-per-node " + std::to_string(f.rank) + " --max-restarts " +
         std::to_string(f.restarts);
}

/// The job-wide error of launchers started with different settings: node `a.node`'s are `a`, node `b.node`'s `b`.
inline config_error launchers_disagree(const control_frame& a, const control_frame& b) {
  return config_error("the launchers disagree on the job: node " + std::to_string(a.node) + "'s was started with " +
                      launch_settings(a) + ", node " + std::to_string(b.node) + "'s with " + launch_settings(b) +
                      "; start ddp-launch on every node with the same --nnodes, --nproc-per-node and --max-restarts");
}

/// Wall-clock microseconds at `t`.
inline std::int64_t wall_us(std::chrono::system_clock::time_point t = std::chrono::system_clock::now()) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

/// TCP keepalive: a peer whose host died is noticed within about 11 seconds.
inline void keep_alive(int fd) {
  const int on = 1, idle = 5, interval = 2, count = 3;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

}  // namespace detail

/// This launcher's end of the control channel (node 0 holds one connection per other node, the others one).
class node_link {
 public:
  /// Joins the launchers of `plan`: node 0 waits for all others, the others connect to it; all by the join
  /// timeout. Throws config_error for a stranger's mistakes that stop the job, timeout_error at the deadline.
  explicit node_link(node_plan plan) : plan_(std::move(plan)), key_(tcp::detail::job_key_of(plan_.token)) {
    const auto deadline = tcp::detail::clock::now() + plan_.join_timeout;
    if (plan_.node_rank == 0)
      accept_nodes(deadline);
    else
      join_node_0(deadline);
  }

  /// Reports that rank `rank` of this node failed with `status` at `when` (once; later calls are ignored).
  void report_failure(int rank, int status, std::chrono::system_clock::time_point when) {
    if (reported_) return;
    reported_ = true;
    const node_failure f{plan_.node_rank, rank, status, detail::wall_us(when)};
    if (plan_.node_rank == 0)
      note(f);
    else
      send(peers_[0], frame(detail::control_kind::failed, f));
  }

  /// Handles what arrived, without waiting; true once every node must stop its ranks.
  bool poll() {
    service(0);
    return stop_.has_value();
  }

  /// After this node's ranks ended (a failure among them reported first): tells node 0 and waits for the
  /// job's verdict (node 0: for every node's end, then sends it); returns the failure every node stopped for,
  /// or nothing when every rank of every node succeeded.
  std::optional<node_failure> finish() {
    const auto barrier = tcp::detail::clock::now() + plan_.exit_barrier;
    if (plan_.node_rank == 0) {
      done_[0] = true;
      while (!all_done() || (blame_at_ && !stop_)) {
        check_interrupt("waiting for the other nodes' ranks to end");
        if (tcp::detail::clock::now() >= barrier && !all_done()) {
          for (std::size_t k = 1; k < done_.size(); ++k)
            if (!done_[k] && peers_[k].valid()) {
              note({static_cast<int>(k), node_failure::silent, 124, detail::wall_us()});
              done_[k] = true;
            }
        }
        service(100);
      }
      const node_failure none{0, -1, 0, 0};
      const auto verdict = frame(detail::control_kind::verdict, stop_ ? *stop_ : none);
      for (std::size_t k = 1; k < peers_.size(); ++k) send(peers_[k], verdict);
      return stop_;
    }
    send(peers_[0], frame(detail::control_kind::done, {}));
    while (!verdict_) {
      check_interrupt("waiting for node 0's verdict");
      if (tcp::detail::clock::now() >= barrier + std::chrono::minutes(1))  // node 0 waits the barrier itself first
        verdict_ = stop_ ? stop_ : node_failure{0, node_failure::silent, 124, detail::wall_us()};
      service(100);
    }
    return verdict_->status == 0 ? std::nullopt : verdict_;
  }

  /// After finish() returned a restartable failure: forgets the round, keeping the connections; every node
  /// does the same, since every node got the same verdict.
  void next_round() {
    reported_ = false;
    first_.reset();
    blame_at_.reset();
    stop_.reset();
    verdict_.reset();
    done_.assign(done_.size(), false);
    heard_.assign(heard_.size(), false);
  }

 private:
  /// How long node 0 collects reports after the first failure before it blames the one that began first.
  static constexpr std::chrono::milliseconds settle{1000};
  /// How much longer node 0 waits when only exits were reported and some node has not reported or ended yet: a
  /// peer of a crashed rank may exit before the crash's own launcher, busy or descheduled, gets its report out.
  static constexpr std::chrono::milliseconds settle_for_crash{2000};

  [[nodiscard]] detail::control_frame frame(detail::control_kind kind, const node_failure& f) const {
    detail::control_frame c;
    c.kind = kind;
    c.node = f.node;
    c.rank = f.rank;
    c.status = f.status;
    c.began_us = f.began_us;
    return c;
  }

  void check_interrupt(const std::string& what) const {
    if (plan_.interrupt != nullptr && *plan_.interrupt != 0)
      throw error("node " + std::to_string(plan_.node_rank) + "'s launcher was interrupted by signal " +
                  std::to_string(static_cast<int>(*plan_.interrupt)) + " while " + what);
  }

  static void send(tcp::detail::socket_fd& fd, const detail::control_frame& c) {
    if (!fd.valid()) return;
    const auto deadline = tcp::detail::clock::now() + std::chrono::seconds(5);
    if (tcp::detail::send_all(fd.get(), &c, sizeof c, deadline) != tcp::detail::io_status::ok) fd.reset();
  }

  void accept_nodes(tcp::detail::clock::time_point deadline) {
    acceptor_.emplace(tcp::detail::listen_on("0.0.0.0", plan_.control_port, 0, "the launchers' control port"),
                      sizeof(detail::control_frame), tcp::detail::handshake_limits{}, 0, "the launchers' control port");
    peers_.resize(static_cast<std::size_t>(plan_.nodes));
    done_.assign(static_cast<std::size_t>(plan_.nodes), false);
    heard_.assign(static_cast<std::size_t>(plan_.nodes), false);
    buffers_.resize(peers_.size());
    std::vector<pollfd> fds;
    for (int missing = plan_.nodes - 1; missing > 0;) {
      check_interrupt("waiting for the other nodes to join");
      if (tcp::detail::clock::now() >= deadline)
        throw timeout_error(std::to_string(missing) + " of the other " + std::to_string(plan_.nodes - 1) +
                            " nodes' launchers did not join node 0 at port " + std::to_string(plan_.control_port) +
                            " in time; start ddp-launch on every node with the same --nnodes, --master-addr, "
                            "--master-port and DDP_TOKEN, or raise --join-timeout");
      fds.clear();
      acceptor_->fill(fds);
      ::poll(fds.data(), fds.size(), std::min(tcp::detail::poll_ms(deadline), 1000));
      for (auto& a : acceptor_->on_events(fds, 0))
        if (admit(a, true)) --missing;
    }
    for (std::size_t k = 1; k < peers_.size(); ++k) send(peers_[k], frame(detail::control_kind::go, {}));
  }

  /// Node 0: why the launcher that sent `got` for challenge `nonce` may not join this job, or nothing (settings
  /// checked apart: disagrees).
  [[nodiscard]] std::string refusal(const detail::control_frame& got, const tcp::detail::challenge& nonce) const {
    if (got.magic != detail::control_magic || got.kind != detail::control_kind::hello)
      return "its first bytes are not a ddp-launch hello";
    if (!tcp::detail::is_signed(got, key_, "launch", nonce)) return "wrong job token";
    if (got.node <= 0 || got.node >= plan_.nodes)
      return "it claims node rank " + std::to_string(got.node) + ", outside 1.." + std::to_string(plan_.nodes - 1);
    return {};
  }
  /// This launcher's settings as a control frame from node `node` (hello, mismatch).
  [[nodiscard]] detail::control_frame settings(detail::control_kind kind) const {
    auto f = frame(kind, {plan_.node_rank, plan_.nproc_per_node, plan_.nodes, 0});
    f.restarts = plan_.max_restarts;
    return f;
  }
  /// Node 0: whether the launcher that sent `got` (this job's) was started with other settings than node 0's.
  [[nodiscard]] bool disagrees(const detail::control_frame& got) const {
    return got.status != plan_.nodes || got.rank != plan_.nproc_per_node || got.restarts != plan_.max_restarts;
  }

  /// Node 0: the launcher of arrival `a` joins, if it may and the job is `joining` and its node rank is free
  /// (true); else it is refused (one of this job whose node rank is taken hears why in a `taken` frame) and
  /// the job goes on. A launcher of this job with other settings, while the job is joining, ends it at once on every
  /// node: it and the nodes already joined hear each other's settings in a `mismatch` frame, and node 0 throws.
  bool admit(tcp::detail::arrival& a, bool joining) {
    detail::control_frame got;
    std::memcpy(&got, a.hello.data(), sizeof got);
    const std::string why = refusal(got, a.nonce);
    if (why.empty() && disagrees(got)) {
      if (joining) {
        send(a.fd, settings(detail::control_kind::mismatch));
        auto theirs = got;
        theirs.kind = detail::control_kind::mismatch;
        for (std::size_t k = 1; k < peers_.size(); ++k) send(peers_[k], theirs);
        throw detail::launchers_disagree(got, settings(detail::control_kind::hello));
      }
      acceptor_->refuse(a.fd, a.from, "it was started with " + detail::launch_settings(got) + ", node 0 with " +
                                          detail::launch_settings(settings(detail::control_kind::hello)));
      return false;  // the job runs already: it goes on
    }
    if (why.empty() && (!joining || peers_[static_cast<std::size_t>(got.node)].valid())) {
      send(a.fd, frame(detail::control_kind::taken, {got.node, -1, 0, 0}));
      if (a.fd.valid())
        acceptor_->refuse(a.fd, a.from,
                          "it claims node rank " + std::to_string(got.node) + ", which another launcher of this job holds",
                          "give every node its own --node-rank in 0.." + std::to_string(plan_.nodes - 1));
      return false;
    }
    if (!why.empty()) {
      acceptor_->refuse(a.fd, a.from, why);
      return false;
    }
    detail::keep_alive(a.fd.get());
    peers_[static_cast<std::size_t>(got.node)] = std::move(a.fd);
    return true;
  }

  void join_node_0(tcp::detail::clock::time_point deadline) {
    peers_.resize(1);
    buffers_.resize(1);
    constexpr auto slice = std::chrono::seconds(1);  // how often a signal is looked for
    while (!peers_[0].valid()) {
      check_interrupt("joining node 0's launcher");
      try {
        peers_[0] = tcp::detail::connect_with_retry(
            plan_.master_addr, plan_.control_port, std::min(deadline, tcp::detail::clock::now() + slice), -1,
            "node 0's launcher",
            "start ddp-launch --node-rank 0 on the --master-addr host, with the same --master-port, or raise "
            "--join-timeout");
      } catch (const timeout_error&) {
        if (tcp::detail::clock::now() >= deadline) throw;
      }
    }
    detail::keep_alive(peers_[0].get());
    const auto hello = settings(detail::control_kind::hello);
    const bool sent =
        tcp::detail::send_signed_hello(peers_[0].get(), hello, key_, "launch", deadline) == tcp::detail::io_status::ok;
    for (pollfd p{peers_[0].get(), POLLIN, 0}; sent && p.revents == 0 && tcp::detail::clock::now() < deadline;) {
      check_interrupt("waiting for node 0's launcher to start the job");
      ::poll(&p, 1, static_cast<int>(std::chrono::milliseconds(slice).count()));
    }
    detail::control_frame go;
    const bool answered = sent && tcp::detail::recv_all(peers_[0].get(), &go, sizeof go, deadline) == tcp::detail::io_status::ok &&
                          go.magic == detail::control_magic;
    if (answered && go.kind == detail::control_kind::mismatch)  // node 0's settings, or another node's
      throw detail::launchers_disagree(go.node == 0 ? hello : go, go.node == 0 ? go : settings(detail::control_kind::hello));
    if (answered && go.kind == detail::control_kind::taken)
      throw config_error("node 0's launcher at " + plan_.master_addr + ":" + std::to_string(plan_.control_port) +
                         " refused node " + std::to_string(plan_.node_rank) + ": another launcher of this job already "
                         "holds node rank " + std::to_string(plan_.node_rank) + " (the job goes on without this one); "
                         "give every node its own --node-rank in 0.." + std::to_string(plan_.nodes - 1));
    if (!answered || go.kind != detail::control_kind::go)
      throw config_error("node 0's launcher at " + plan_.master_addr + ":" + std::to_string(plan_.control_port) +
                         " refused node " + std::to_string(plan_.node_rank) +
                         " or did not answer in time: give every launcher the same DDP_TOKEN and --nnodes, and "
                         "every node its own --node-rank");
  }

  /// Node 0: a failure reported here or by a node; the first opens the settle window.
  void note(const node_failure& f) {
    if (stop_) return;
    heard_[static_cast<std::size_t>(f.node)] = true;
    if (!first_ || f.before(*first_)) first_ = f;
    if (!blame_at_) blame_at_ = tcp::detail::clock::now() + settle;
  }

  /// Node 0: the settle window is over, and a crash was reported, or every node reported or ended, or the longer
  /// wait for a crash is over too.
  [[nodiscard]] bool settled(tcp::detail::clock::time_point now) const {
    if (!blame_at_ || now < *blame_at_) return false;
    if (first_->crashed() || now >= *blame_at_ + settle_for_crash) return true;
    for (std::size_t k = 0; k < heard_.size(); ++k)
      if (!heard_[k] && !done_[k] && (k == 0 || peers_[k].valid())) return false;
    return true;
  }

  [[nodiscard]] bool all_done() const {
    for (std::size_t k = 0; k < done_.size(); ++k)
      if (!done_[k] && (k == 0 || peers_[k].valid())) return false;
    return true;
  }

  /// Reads the frames that arrived (waiting up to `wait_ms` for the first), handles them, and on node 0
  /// decides the failure once the settle window is over.
  void service(int wait_ms) {
    std::vector<pollfd> fds;
    for (auto& p : peers_) fds.push_back({p.valid() ? p.get() : -1, POLLIN, 0});
    if (acceptor_) acceptor_->fill(fds);  // node 0: a late launcher is refused while the job goes on
    ::poll(fds.data(), fds.size(), wait_ms);
    if (acceptor_)
      for (auto& a : acceptor_->on_events(fds, peers_.size())) admit(a, false);
    for (std::size_t k = 0; k < peers_.size(); ++k) {
      if (fds[k].revents == 0 || !peers_[k].valid()) continue;
      auto& buf = buffers_[k];
      char chunk[sizeof(detail::control_frame) * 4];
      const ssize_t got = ::recv(peers_[k].get(), chunk, sizeof chunk, 0);
      if (got > 0) buf.append(chunk, static_cast<std::size_t>(got));
      bool lost = got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR);
      while (!lost && buf.size() >= sizeof(detail::control_frame)) {
        detail::control_frame c;
        std::memcpy(&c, buf.data(), sizeof c);
        buf.erase(0, sizeof c);
        if (c.magic != detail::control_magic) {
          lost = true;
          break;
        }
        handle(k, c);
      }
      if (lost) on_lost(k);
    }
    if (plan_.node_rank == 0 && !stop_ && settled(tcp::detail::clock::now())) {
      stop_ = first_;
      for (std::size_t k = 1; k < peers_.size(); ++k) send(peers_[k], frame(detail::control_kind::stop, *stop_));
    }
  }

  void handle(std::size_t from, const detail::control_frame& c) {
    const node_failure f{c.node, c.rank, c.status, c.began_us};
    switch (c.kind) {
      case detail::control_kind::failed:
        if (plan_.node_rank == 0) note(f);
        break;
      case detail::control_kind::done:
        if (plan_.node_rank == 0) done_[from] = true;
        break;
      case detail::control_kind::stop:
        if (!stop_) stop_ = f;
        break;
      case detail::control_kind::verdict:
        verdict_ = f;
        if (c.status != 0 && !stop_) stop_ = f;
        break;
      default:
        break;
    }
  }

  /// A peer's connection ended: on node 0 that node's launcher is lost (unless it had finished); on another
  /// node, node 0's is, and nothing more will come.
  void on_lost(std::size_t k) {
    peers_[k].reset();
    if (plan_.node_rank == 0) {
      if (!done_[k]) note({static_cast<int>(k), -1, 1, detail::wall_us()});
      done_[k] = true;
      return;
    }
    const node_failure lost{0, -1, 1, detail::wall_us()};
    if (!stop_) stop_ = lost;
    if (!verdict_) verdict_ = stop_;
  }

  node_plan plan_;
  tcp::detail::job_key key_;
  std::vector<tcp::detail::socket_fd> peers_;  ///< node 0: index = node rank (0 unused); others: [0] = node 0
  std::vector<std::string> buffers_;           ///< bytes of a frame not yet whole, per peer
  std::optional<tcp::detail::handshake_acceptor> acceptor_;  ///< node 0: the control port, open for the whole job
  std::vector<bool> done_;                     ///< node 0: which nodes' ranks all ended (or who was lost)
  std::vector<bool> heard_;                    ///< node 0: which nodes reported a failure this round
  bool reported_ = false;
  std::optional<node_failure> first_;          ///< node 0: the failure that began first so far
  std::optional<tcp::detail::clock::time_point> blame_at_;
  std::optional<node_failure> stop_;           ///< the failure every node stops for
  std::optional<node_failure> verdict_;        ///< other nodes: node 0's verdict
};

}  // namespace ddp::launch

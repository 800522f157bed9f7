// Records seeds for fuzz_store from real rendezvous traffic: a 3-rank job (forked, on 127.0.0.1) whose
// ranks 1 and 2 reach rank 0's store through a recording relay. Writes, in fuzz_store's input format, one
// file per recorded connection and one with all of them interleaved in arrival order.
//
//   record_store_corpus tests/fuzz/corpus/store

#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/launch/spawn.hpp>

namespace d = ddp::tcp::detail;
using namespace std::chrono_literals;

namespace {

/// What one connection's client sent, chunk by chunk, in arrival order across connections.
struct recording {
  std::mutex mutex;
  std::vector<std::pair<std::uint8_t, std::vector<std::uint8_t>>> chunks;  ///< (session, bytes)
};

/// Copies `from` to `to` until either closes or the deadline passes; records the bytes as session `session`.
void relay(int from, int to, recording* rec, std::uint8_t session, d::clock::time_point deadline) {
  std::uint8_t buf[65535];
  while (d::clock::now() < deadline) {
    pollfd p{from, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t k = ::recv(from, buf, sizeof buf, MSG_DONTWAIT);
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) break;
    if (k < 0) continue;
    if (rec != nullptr) {
      std::lock_guard lock(rec->mutex);
      rec->chunks.emplace_back(session, std::vector<std::uint8_t>(buf, buf + k));
    }
    if (d::send_all(to, buf, static_cast<std::size_t>(k), deadline) != d::io_status::ok) break;
  }
  ::shutdown(to, SHUT_WR);
}

/// One fuzz_store chunk: control byte (the session; bit 6: its client holds the key, so fuzz_store signs the hello
/// for its own challenge, as the relay's bytes answer another), 2-byte little-endian length, the bytes.
void put_chunk(std::ofstream& out, std::uint8_t session, const std::vector<std::uint8_t>& bytes) {
  const char head[3] = {static_cast<char>(session), static_cast<char>(bytes.size() & 0xff),
                        static_cast<char>(bytes.size() >> 8)};
  out.write(head, 3);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: record_store_corpus <output directory>\n");
    return 2;
  }
  const std::string dir = argv[1];
  constexpr int ranks = 3;
  auto relay_listener = d::listen_on("127.0.0.1", 0, -1, "the recording relay");
  const auto relay_port = d::local_endpoint(relay_listener.get()).port;
  auto probe = d::listen_on("127.0.0.1", 0, -1, "a port probe");
  const auto store_port = d::local_endpoint(probe.get()).port;
  probe.reset();

  recording rec;
  const auto deadline = d::clock::now() + 30s;
  std::thread relays([&] {
    std::vector<d::socket_fd> sockets;
    std::vector<std::thread> pumps;
    for (std::uint8_t session = 0; session < ranks - 1 && d::clock::now() < deadline;) {
      pollfd p{relay_listener.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      d::socket_fd client(::accept4(relay_listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!client.valid()) continue;
      auto server = d::connect_with_retry("127.0.0.1", store_port, deadline, -1, "rank 0's store", "");
      pumps.emplace_back(relay, client.get(), server.get(), &rec, session, deadline);
      pumps.emplace_back(relay, server.get(), client.get(), nullptr, session, deadline);
      sockets.push_back(std::move(client));
      sockets.push_back(std::move(server));
      ++session;
    }
    for (auto& t : pumps) t.join();
  });

  ddp::launch::spawn_options options;
  options.port = store_port;
  options.token = "fuzz-corpus";
  options.timeout = 30s;
  options.extra_env = [relay_port](int rank) {
    return rank == 0 ? ddp::launch::env_list{} : ddp::launch::env_list{{"MASTER_PORT", std::to_string(relay_port)}};
  };
  const auto result = ddp::launch::spawn(ranks, [](int) {
    auto comm = ddp::tcp::communicator::from_env();
    comm.barrier().wait();
  }, options);
  relays.join();
  if (!result.ok()) {
    std::fprintf(stderr, "the recorded job failed: %s\n", result.describe().c_str());
    return 1;
  }
  std::ofstream all(dir + "/rendezvous-interleaved", std::ios::binary);
  for (std::uint8_t session = 0; session < ranks - 1; ++session) {
    std::ofstream one(dir + "/rendezvous-rank" + std::to_string(session + 1), std::ios::binary);
    for (const auto& [s, bytes] : rec.chunks)
      if (s == session) put_chunk(one, 0x40, bytes);
  }
  for (const auto& [s, bytes] : rec.chunks) put_chunk(all, static_cast<std::uint8_t>(s | 0x40), bytes);
  std::printf("recorded %zu chunks from %d connections into %s\n", rec.chunks.size(), ranks - 1, dir.c_str());
  return 0;
}

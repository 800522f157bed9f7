#pragma once
/// \file The file:// rendezvous: rank 0 serves its store on a free port and publishes, in one file (0600) on a
/// filesystem every rank shares, "ddp-store 2 <job nonce> <tag> <port> <address>...": the nonce is random per
/// job and the tag the MAC of the rest under the job's key (auth.hpp), so the file holds nothing the token can be
/// derived from or replayed with. It is written to a claimed temporary and renamed into place, so a reader never
/// sees half a file and concurrent or killed writers leave no debris; the other ranks read it, check the tag, try
/// its addresses in order, and sign the store's challenge. A file a crashed earlier job left behind is told
/// apart: another job's tag does not check, and a dead address is refused, so readers look again until rank 0
/// replaces the file. Rank 0 removes it once every rank joined.

#include <ifaddrs.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/tcp/auth.hpp>
#include <ddp/comm/tcp/config.hpp>
#include <ddp/comm/tcp/socket.hpp>
#include <ddp/comm/tcp/store_client.hpp>
#include <ddp/core/detail/hash.hpp>
#include <ddp/core/error.hpp>
#include <ddp/io/atomic_file.hpp>

namespace ddp::tcp::detail {

/// The first word of a store file.
inline constexpr std::string_view store_file_magic = "ddp-store";
/// The store file's format: 2 carries a job nonce and a tag instead of the token's hash.
inline constexpr int store_file_version = 2;

/// "<port> <address>...": what a store file's tag signs.
inline std::string store_file_body(std::uint16_t port, const std::vector<std::string>& addresses) {
  std::string body = std::to_string(port);
  for (const auto& a : addresses) body += " " + a;
  return body;
}

/// The tag of a store file with `body` and job nonce `nonce` under `key`.
inline std::uint64_t store_file_tag(const job_key& key, const challenge& nonce, const std::string& body) {
  return mac_of(key, "store file", nonce, body.data(), body.size());
}

/// The IPv4 addresses of this host other ranks may reach rank 0's store at: DDP_INTERFACE's alone when set,
/// else every interface's, loopback last.
inline std::vector<std::string> store_addresses(const config& cfg) {
  if (!cfg.interface.empty()) return {interface_address(cfg.interface, cfg.rank)};
  std::vector<std::string> found, loopback;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
      if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET) {
        const auto host = to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host;
        (host.rfind("127.", 0) == 0 ? loopback : found).push_back(host);
      }
    ::freeifaddrs(list);
  }
  found.insert(found.end(), loopback.begin(), loopback.end());
  return found;
}

/// Rank 0: writes where its store listens (`port` on `addresses`) to cfg.store_file, replacing any old file.
inline void publish_store(const config& cfg, const job_key& key, std::uint16_t port,
                          const std::vector<std::string>& addresses) {
  const challenge nonce = random_challenge();
  std::uint64_t words[2];
  std::memcpy(words, nonce.data(), sizeof words);
  const std::string body = store_file_body(port, addresses);
  const std::string bytes = std::string(store_file_magic) + ' ' + std::to_string(store_file_version) + ' ' +
                            ddp::detail::hex(words[0]) + ddp::detail::hex(words[1]) + ' ' +
                            ddp::detail::hex(store_file_tag(key, nonce, body)) + ' ' + body + '\n';
  try {
    ddp::detail::atomic_file file(cfg.store_file, 0600);  // where the job's store listens: its owner's alone
    file.write(std::as_bytes(std::span(bytes.data(), bytes.size())));
    file.commit();
  } catch (const io_error& e) {
    throw config_error("rank 0 cannot write the rendezvous file of file://" + cfg.store_file + ": " + e.message() +
                           "; pass a path in a writable directory every rank shares",
                       cfg.rank);
  }
}

/// What a store file says; nothing when it is missing, malformed, or another job's (its tag does not check).
struct store_file_entry {
  std::uint16_t port = 0;
  std::vector<std::string> addresses;
};

/// Reads cfg.store_file; `why` says what was wrong with it when the answer is nothing.
inline std::optional<store_file_entry> read_store_file(const config& cfg, const job_key& key, std::string& why) {
  std::ifstream in(cfg.store_file);
  if (!in) {
    why = "the file does not exist yet (rank 0 writes it when it starts)";
    return std::nullopt;
  }
  std::string magic, nonce_hex;
  int version = 0;
  std::uint64_t tag = 0;
  unsigned port = 0;
  if (!(in >> magic >> version) || magic != store_file_magic) {
    why = "it is not a ddp store file";
    return std::nullopt;
  }
  if (version != store_file_version) {
    why = "it is a store file of format " + std::to_string(version) + ", this release's is " +
          std::to_string(store_file_version) + " (rank 0 runs another ddp release, or an old job left it)";
    return std::nullopt;
  }
  challenge nonce{};
  if (!(in >> nonce_hex >> std::hex >> tag >> std::dec >> port) || nonce_hex.size() != 2 * nonce.size() ||
      nonce_hex.find_first_not_of("0123456789abcdef") != std::string::npos || port == 0 || port > 65535) {
    why = "it is not a ddp store file";
    return std::nullopt;
  }
  const std::uint64_t words[2] = {std::stoull(nonce_hex.substr(0, 16), nullptr, 16),
                                  std::stoull(nonce_hex.substr(16), nullptr, 16)};
  std::memcpy(nonce.data(), words, sizeof words);
  store_file_entry e;
  e.port = static_cast<std::uint16_t>(port);
  for (std::string a; in >> a;) e.addresses.push_back(a);
  if (e.addresses.empty()) {
    why = "it lists no address";
    return std::nullopt;
  }
  if (store_file_tag(key, nonce, store_file_body(e.port, e.addresses)) != tag) {
    why = "it belongs to another job (another DDP_TOKEN), or to an earlier job that did not end cleanly";
    return std::nullopt;
  }
  return e;
}

/// Connects to the store cfg.store_file names, looking again until `deadline` while the file is missing,
/// another job's, or its addresses refuse (an earlier job's file, not yet replaced by this job's rank 0).
inline store_client find_store(const config& cfg, const job_key& key, clock::time_point deadline) {
  constexpr auto attempt = std::chrono::seconds(1);
  constexpr auto pause = std::chrono::milliseconds(50);
  std::string why;
  while (true) {
    if (const auto entry = read_store_file(cfg, key, why)) {
      for (const auto& host : entry->addresses) {
        try {
          return store_client(host, entry->port, key, cfg.rank, deadline, std::min(deadline, clock::now() + attempt));
        } catch (const error& e) {
          why = "no listed address answered; the last, " + host + ":" + std::to_string(entry->port) +
                ", said: " + e.message();
        }
      }
    }
    if (clock::now() + pause >= deadline)
      throw timeout_error("found no rendezvous store through file://" + cfg.store_file +
                              " before the connect deadline: " + why +
                              "; start rank 0 with the same path on a filesystem every rank shares and the same "
                              "DDP_TOKEN, or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
                          cfg.rank);
    std::this_thread::sleep_for(pause);
  }
}

/// Rank 0, once every rank joined: removes the store file, so that a later job never reads this one's.
inline void retire_store_file(const config& cfg) {
  std::error_code ec;
  std::filesystem::remove(cfg.store_file, ec);
}

}  // namespace ddp::tcp::detail

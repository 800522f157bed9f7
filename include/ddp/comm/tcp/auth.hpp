#pragma once
/// \file How a connection proves it belongs to the job without the token ever leaving the process: the
/// accepting side sends a fresh random challenge first, and the connecting side's fixed-size hello carries a
/// keyed MAC (SipHash-2-4 under a key derived from the token) of a context word, the challenge and the hello
/// itself. A recorded handshake proves nothing later (the next challenge differs), and what travels or is stored
/// (challenges, MACs, the store file's tag) gives no key for another context: the store, the mesh and the
/// launchers' control channel each MAC under their own word.

#include <sys/random.h>

#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include <ddp/comm/tcp/socket.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp::detail {

/// The 128-bit key a job's token gives (job_key_of); two processes share it exactly when they share the token.
struct job_key {
  std::uint64_t k0 = 0;
  std::uint64_t k1 = 0;
  friend bool operator==(const job_key&, const job_key&) = default;
};

/// What an accepting side sends first on every connection: 16 random bytes.
using challenge = std::array<std::uint8_t, 16>;

/// SipHash-2-4 of `n` bytes at `m` under the key (k0, k1): a 64-bit pseudo-random function of the message.
inline std::uint64_t siphash24(std::uint64_t k0, std::uint64_t k1, const std::uint8_t* m, std::size_t n) {
  std::uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
  std::uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
  const auto rotl = [](std::uint64_t x, int b) { return (x << b) | (x >> (64 - b)); };
  const auto round = [&] {
    v0 += v1, v1 = rotl(v1, 13), v1 ^= v0, v0 = rotl(v0, 32);
    v2 += v3, v3 = rotl(v3, 16), v3 ^= v2;
    v0 += v3, v3 = rotl(v3, 21), v3 ^= v0;
    v2 += v1, v1 = rotl(v1, 17), v1 ^= v2, v2 = rotl(v2, 32);
  };
  const auto absorb = [&](std::uint64_t word) {
    v3 ^= word;
    round();
    round();
    v0 ^= word;
  };
  const std::size_t whole = n - n % 8;
  for (std::size_t i = 0; i < whole; i += 8) {
    std::uint64_t word = 0;
    for (std::size_t b = 0; b < 8; ++b) word |= static_cast<std::uint64_t>(m[i + b]) << (8 * b);
    absorb(word);
  }
  std::uint64_t last = static_cast<std::uint64_t>(n) << 56;
  for (std::size_t b = 0; b < n % 8; ++b) last |= static_cast<std::uint64_t>(m[whole + b]) << (8 * b);
  absorb(last);
  v2 ^= 0xff;
  for (int r = 0; r < 4; ++r) round();
  return v0 ^ v1 ^ v2 ^ v3;
}

/// The job's key from its token (an empty token gives a key too: file:// refuses one unless allowed).
inline job_key job_key_of(const std::string& token) {
  const auto half = [&](char which) {
    const std::string m = std::string("ddp job key ") + which + '\0' + token;
    return siphash24(0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL, reinterpret_cast<const std::uint8_t*>(m.data()),
                     m.size());
  };
  return {half('0'), half('1')};
}

/// The MAC under `key` of `context`, `nonce` and the `n` bytes at `data`.
inline std::uint64_t mac_of(const job_key& key, std::string_view context, const challenge& nonce, const void* data,
                            std::size_t n) {
  std::string m(context);
  m.push_back('\0');
  m.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  m.append(static_cast<const char*>(data), n);
  return siphash24(key.k0, key.k1, reinterpret_cast<const std::uint8_t*>(m.data()), m.size());
}

/// `hello` with its `mac` field set to the MAC, under `key` and `context`, of the acceptor's `nonce` and the hello
/// with that field zero.
template <class Hello>
Hello signed_hello(Hello hello, const job_key& key, std::string_view context, const challenge& nonce) {
  hello.mac = 0;
  hello.mac = mac_of(key, context, nonce, &hello, sizeof hello);
  return hello;
}

/// True when `hello` carries the MAC signed_hello gives it: its sender holds the job's key.
template <class Hello>
bool is_signed(Hello hello, const job_key& key, std::string_view context, const challenge& nonce) {
  const std::uint64_t got = hello.mac;
  return got == signed_hello(hello, key, context, nonce).mac;  // one word: no early exit to time
}

/// The connecting side of a handshake on `fd`: reads the acceptor's challenge and sends `hello` signed for it, all
/// by `deadline`.
template <class Hello>
io_status send_signed_hello(int fd, const Hello& hello, const job_key& key, std::string_view context,
                            clock::time_point deadline) {
  challenge nonce{};
  if (const io_status got = recv_all(fd, nonce.data(), nonce.size(), deadline); got != io_status::ok) return got;
  const Hello signed_one = signed_hello(hello, key, context, nonce);
  return send_all(fd, &signed_one, sizeof signed_one, deadline);
}

/// 16 bytes from the kernel's random source.
inline challenge random_challenge() {
  challenge c{};
  for (std::size_t have = 0; have < c.size();) {
    const ssize_t k = ::getrandom(c.data() + have, c.size() - have, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw error("cannot read the kernel's random source (getrandom): " + std::string(std::strerror(errno)));
    have += static_cast<std::size_t>(k);
  }
  return c;
}

}  // namespace ddp::tcp::detail

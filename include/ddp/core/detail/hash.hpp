#pragma once
/// \file 64-bit FNV-1a and hex digits: the hash behind checkpoint checksums, replica checks and temporaries' names.
/// FNV-1a detects every change of a single byte (each step, xor then multiplication by an odd prime, is a bijection
/// of the state).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ddp::detail {

/// FNV-1a's offset basis: the hash of nothing.
inline constexpr std::uint64_t fnv1a_basis = 14695981039346656037ULL;

/// 64-bit FNV-1a of `data`, continued from `h`.
inline std::uint64_t fnv1a(std::span<const std::byte> data, std::uint64_t h = fnv1a_basis) noexcept {
  for (const std::byte b : data) h = (h ^ static_cast<std::uint8_t>(b)) * 1099511628211ULL;
  return h;
}

/// 64-bit FNV-1a of the characters of `text`, continued from `h`.
inline std::uint64_t fnv1a(std::string_view text, std::uint64_t h = fnv1a_basis) noexcept {
  return fnv1a(std::as_bytes(std::span(text.data(), text.size())), h);
}

/// `v` as 16 lower-case hex digits.
inline std::string hex(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = digits[v & 0xf];
  return s;
}

}  // namespace ddp::detail

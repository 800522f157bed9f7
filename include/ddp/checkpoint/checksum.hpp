#pragma once
/// \file The checksum of ddp's checkpoint files: 64-bit FNV-1a (hex, 16 digits), taken over every byte of a file
/// including the text that records it. A "sealed" text holds its own checksum: the 16 digits after a marker such as
/// `"ddp.checksum":"` count as sixteen '0' when the checksum is taken, so a writer puts '0's there, hashes the
/// bytes as written and then writes the digits in their place. FNV-1a detects every change of a single byte (each
/// step, xor then multiplication by an odd prime, is a bijection of the state), so any flipped bit is caught.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <ddp/core/detail/hash.hpp>

namespace ddp::detail {

/// What a sealed text holds in place of its checksum's digits while the checksum is taken.
inline constexpr std::string_view unsealed_digits = "0000000000000000";

/// Where the 16 checksum digits of the sealed `text` start: right after `marker`, which must occur exactly once
/// and be followed by 16 characters and a closing quote. npos when the text is not sealed that way.
inline std::size_t find_seal(std::string_view text, std::string_view marker) noexcept {
  const std::size_t at = text.find(marker);
  if (at == std::string_view::npos || text.find(marker, at + 1) != std::string_view::npos) return std::string_view::npos;
  const std::size_t digits = at + marker.size();
  return digits + 17 <= text.size() && text[digits + 16] == '"' ? digits : std::string_view::npos;
}

/// FNV-1a of `text`, continued from `h`, with its 16 characters at `seal` counted as unsealed_digits.
inline std::uint64_t fnv1a_sealed(std::string_view text, std::size_t seal, std::uint64_t h = fnv1a_basis) noexcept {
  h = fnv1a(text.substr(0, seal), h);
  h = fnv1a(unsealed_digits, h);
  return fnv1a(text.substr(seal + unsealed_digits.size()), h);
}

}  // namespace ddp::detail

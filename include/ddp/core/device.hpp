#pragma once
/// \file Where memory lives: the host or a CUDA device.

#include <compare>
#include <cstdint>
#include <string>

namespace ddp {

/// The kind of memory a buffer lives in.
enum class device_kind : std::uint8_t { cpu, cuda };

/// A memory location: the host, or CUDA device `index`.
struct device {
  device_kind kind = device_kind::cpu;  ///< host or CUDA
  int index = 0;                        ///< CUDA ordinal; 0 for the host

  /// The host.
  static constexpr device cpu() noexcept { return {}; }
  /// CUDA device `ordinal`.
  static constexpr device cuda(int ordinal) noexcept { return {device_kind::cuda, ordinal}; }
  /// True for CUDA memory.
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return kind == device_kind::cuda; }
  /// "cpu" or "cuda:N".
  [[nodiscard]] std::string to_string() const { return is_cuda() ? "cuda:" + std::to_string(index) : "cpu"; }

  friend constexpr bool operator==(const device&, const device&) noexcept = default;
};

}  // namespace ddp

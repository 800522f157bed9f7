#pragma once
/// \file Element types: the dtype enumeration and CPU bfloat16/float16 value types.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace ddp {

/// The element type of a buffer.
enum class dtype : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

namespace detail {

/// Rounds to nearest, ties to even; a NaN stays a (quiet) NaN. Without branches, so that loops over it vectorize.
constexpr std::uint16_t float_to_bf16_bits(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t rounded = (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16;
  const std::uint32_t quiet_nan = (bits >> 16) | 0x40U;
  const std::uint32_t is_nan = 0U - static_cast<std::uint32_t>((bits & 0x7fffffffU) > 0x7f800000U);  // all ones or 0
  return static_cast<std::uint16_t>((rounded & ~is_nan) | (quiet_nan & is_nan));
}

constexpr float bf16_bits_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

/// Rounds to nearest, ties to even; beyond the largest half, infinity; a NaN stays a (quiet) NaN with the top of its
/// payload. Without branches (masks, not conditionals), so that loops over it vectorize: a subnormal half is rounded by the float adder itself
/// (|value| + 0.5 has its last place at the smallest subnormal half, and IEEE addition, in the default rounding
/// mode, rounds ties to even).
constexpr std::uint16_t float_to_f16_bits(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000U;
  const std::uint32_t abs = bits & 0x7fffffffU;
  const std::uint32_t normal = (abs - 0x38000000U + 0xfffU + ((abs >> 13) & 1U)) >> 13;  // rebiased, rounded
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(std::bit_cast<float>(abs) + 0.5F) - 0x3f000000U;
  const std::uint32_t is_nan = 0U - static_cast<std::uint32_t>(abs > 0x7f800000U);      // all ones or 0
  const std::uint32_t is_small = 0U - static_cast<std::uint32_t>(abs < 0x38800000U);    // a subnormal half or 0
  const std::uint32_t is_huge = 0U - static_cast<std::uint32_t>(abs >= 0x477ff000U);    // rounds to infinity
  const std::uint32_t finite = (normal & ~is_small & ~is_huge) | (subnormal & is_small) | (0x7c00U & is_huge);
  const std::uint32_t nan = 0x7e00U | ((abs >> 13) & 0x3ffU);
  return static_cast<std::uint16_t>(sign | (finite & ~is_nan) | (nan & is_nan));
}

/// Widens exactly; without branches (masks, not conditionals), so that loops over it vectorize: the bits move into
/// float's places and are rebiased; infinity and NaN take the top exponent, and a subnormal half is renormalized by an
/// exact float subtraction.
constexpr float f16_bits_to_float(std::uint16_t half) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000U) << 16;
  const std::uint32_t shifted = static_cast<std::uint32_t>(half & 0x7fffU) << 13;  // exponent and mantissa in place
  const std::uint32_t exponent = shifted & 0x0f800000U;
  const std::uint32_t normal = shifted + 0x38000000U;   // exponent rebiased from 15 to 127
  const std::uint32_t is_special = 0U - static_cast<std::uint32_t>(exponent == 0x0f800000U);  // infinity, NaN
  const std::uint32_t is_tiny = 0U - static_cast<std::uint32_t>(exponent == 0);               // subnormal, zero
  const std::uint32_t tiny = std::bit_cast<std::uint32_t>(std::bit_cast<float>(normal + 0x00800000U) - 0x1p-14F);
  const std::uint32_t top = normal + (is_special & 0x38000000U);  // infinity and NaN: exponent 255
  const std::uint32_t magnitude = (top & ~is_tiny) | (tiny & is_tiny);
  return std::bit_cast<float>(magnitude | sign);
}

}  // namespace detail

/// Brain floating point (8-bit exponent, 7-bit mantissa); converts from float rounding to nearest even.
struct bfloat16 {
  std::uint16_t bits = 0;  ///< raw storage
  constexpr bfloat16() noexcept = default;
  /// Rounds `value` to the nearest bfloat16, ties to even.
  constexpr bfloat16(float value) noexcept : bits(detail::float_to_bf16_bits(value)) {}  // NOLINT(google-explicit-constructor)
  /// Widens exactly to float.
  constexpr operator float() const noexcept { return detail::bf16_bits_to_float(bits); }  // NOLINT(google-explicit-constructor)
  /// Builds a value from its bit pattern.
  static constexpr bfloat16 from_bits(std::uint16_t raw) noexcept { bfloat16 b; b.bits = raw; return b; }
};

/// IEEE 754 half precision; converts from float rounding to nearest even.
struct float16 {
  std::uint16_t bits = 0;  ///< raw storage
  constexpr float16() noexcept = default;
  /// Rounds `value` to the nearest half, ties to even.
  constexpr float16(float value) noexcept : bits(detail::float_to_f16_bits(value)) {}  // NOLINT(google-explicit-constructor)
  /// Widens exactly to float.
  constexpr operator float() const noexcept { return detail::f16_bits_to_float(bits); }  // NOLINT(google-explicit-constructor)
  /// Builds a value from its bit pattern.
  static constexpr float16 from_bits(std::uint16_t raw) noexcept { float16 h; h.bits = raw; return h; }
};

static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// True for the element types the library moves and reduces.
template <class T>
concept element = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16> ||
                  std::is_same_v<T, float16> || std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t> ||
                  std::is_same_v<T, std::uint8_t>;

namespace detail {
template <class T>
struct dtype_of_impl {
  static_assert(element<T>,
                "ddp: this element type has no ddp::dtype; use float, double, ddp::bfloat16, ddp::float16, "
                "std::int32_t, std::int64_t or std::uint8_t.");
};
template <> struct dtype_of_impl<float> { static constexpr dtype value = dtype::f32; };
template <> struct dtype_of_impl<double> { static constexpr dtype value = dtype::f64; };
template <> struct dtype_of_impl<bfloat16> { static constexpr dtype value = dtype::bf16; };
template <> struct dtype_of_impl<float16> { static constexpr dtype value = dtype::f16; };
template <> struct dtype_of_impl<std::int32_t> { static constexpr dtype value = dtype::i32; };
template <> struct dtype_of_impl<std::int64_t> { static constexpr dtype value = dtype::i64; };
template <> struct dtype_of_impl<std::uint8_t> { static constexpr dtype value = dtype::u8; };
}  // namespace detail

/// The dtype of element type T.
template <class T>
inline constexpr dtype dtype_v = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

/// Size in bytes of one element of `t`.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f64: case dtype::i64: return 8;
    case dtype::f32: case dtype::i32: return 4;
    case dtype::bf16: case dtype::f16: return 2;
    case dtype::u8: return 1;
  }
  return 0;
}

/// Short name of `t` ("f32", "bf16", ...).
constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
    case dtype::bf16: return "bf16";
    case dtype::f16: return "f16";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::u8: return "u8";
  }
  return "?";
}

/// Calls `f(T{})` with the C++ element type of the runtime dtype `t`.
template <class F>
constexpr decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f64: return f(double{});
    case dtype::bf16: return f(bfloat16{});
    case dtype::f16: return f(float16{});
    case dtype::i32: return f(std::int32_t{});
    case dtype::i64: return f(std::int64_t{});
    case dtype::u8: return f(std::uint8_t{});
    case dtype::f32: break;
  }
  return f(float{});
}

}  // namespace ddp

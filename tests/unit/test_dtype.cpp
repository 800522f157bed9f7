#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

TEST_CASE("float16 rounds every float like the hardware conversion", "[dtype]") {
  // _Float16 conversions in g++ round to nearest even; walk a dense stride of all float bit patterns.
  std::uint64_t mismatches = 0;
  for (std::uint64_t bits = 0; bits <= 0xffffffffULL; bits += 4099) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    const auto ours = ddp::float16(f).bits;
    const auto reference = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    const bool both_nan = std::isnan(f) && (ours & 0x7c00U) == 0x7c00U && (ours & 0x3ffU) != 0;
    if (ours != reference && !both_nan) ++mismatches;
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("float16 widens exactly and keeps edge values", "[dtype]") {
  for (std::uint32_t h = 0; h < 0x10000U; ++h) {
    const float wide = ddp::float16::from_bits(static_cast<std::uint16_t>(h));
    const float reference = static_cast<float>(std::bit_cast<_Float16>(static_cast<std::uint16_t>(h)));
    if (std::isnan(reference)) {
      REQUIRE(std::isnan(wide));
    } else {
      REQUIRE(std::bit_cast<std::uint32_t>(wide) == std::bit_cast<std::uint32_t>(reference));
    }
  }
  CHECK(static_cast<float>(ddp::float16(65504.0F)) == 65504.0F);
  CHECK(std::isinf(static_cast<float>(ddp::float16(65520.0F))));
  CHECK(static_cast<float>(ddp::float16(0x1p-24F)) == 0x1p-24F);
  CHECK(static_cast<float>(ddp::float16(0x1p-25F)) == 0.0F);  // tie rounds to even zero
}

TEST_CASE("bfloat16 rounds to nearest even", "[dtype]") {
  CHECK(ddp::bfloat16(1.0F).bits == 0x3f80);
  CHECK(ddp::bfloat16(std::bit_cast<float>(0x3f808000U)).bits == 0x3f80);  // tie, even stays
  CHECK(ddp::bfloat16(std::bit_cast<float>(0x3f818000U)).bits == 0x3f82);  // tie, odd rounds up
  CHECK(ddp::bfloat16(std::bit_cast<float>(0x3f808001U)).bits == 0x3f81);  // above the tie
  CHECK(std::isnan(static_cast<float>(ddp::bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(static_cast<float>(ddp::bfloat16(std::numeric_limits<float>::max()))));
  for (std::uint32_t b = 0; b < 0x10000U; b += 7) {
    const auto value = ddp::bfloat16::from_bits(static_cast<std::uint16_t>(b));
    if (!std::isnan(static_cast<float>(value))) REQUIRE(ddp::bfloat16(static_cast<float>(value)).bits == value.bits);
  }
}

TEST_CASE("bfloat16 rounds every float to the nearer neighbour, ties to even, and keeps NaN a NaN", "[dtype]") {
  // Walk a dense stride of all float bit patterns: the result is the truncation `down` or the next value up in
  // magnitude, whichever is nearer (ties: the even one). The top finite binade's round-up to infinity is left to the
  // case above (float's max rounds to infinity), since infinity has no distance to compare.
  std::uint64_t mismatches = 0;
  for (std::uint64_t bits = 0; bits <= 0xffffffffULL; bits += 4099) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    const auto ours = ddp::bfloat16(f).bits;
    if (std::isnan(f)) {
      if (!std::isnan(static_cast<float>(ddp::bfloat16::from_bits(ours)))) ++mismatches;
      continue;
    }
    const auto down = static_cast<std::uint16_t>(bits >> 16);
    const auto up = static_cast<std::uint16_t>(down + 1U);
    if ((down & 0x7fffU) >= 0x7f7fU) continue;  // the top finite binade's last value, and infinity
    const double below = std::fabs(double(f) - double(static_cast<float>(ddp::bfloat16::from_bits(down))));
    const double above = std::fabs(double(f) - double(static_cast<float>(ddp::bfloat16::from_bits(up))));
    const auto expected = below < above ? down : above < below ? up : (down & 1U) != 0 ? up : down;
    if (ours != expected) ++mismatches;
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("dtype metadata", "[dtype]") {
  STATIC_REQUIRE(ddp::dtype_v<float> == ddp::dtype::f32);
  STATIC_REQUIRE(ddp::dtype_v<ddp::bfloat16> == ddp::dtype::bf16);
  STATIC_REQUIRE(ddp::size_of(ddp::dtype::f64) == 8);
  STATIC_REQUIRE(ddp::size_of(ddp::dtype::u8) == 1);
  CHECK(ddp::to_string(ddp::dtype::f16) == "f16");
  CHECK(ddp::visit_dtype(ddp::dtype::i64, [](auto v) { return sizeof(v); }) == 8);
}

TEST_CASE("detail::convert rounds each element as the 16-bit types do, blocks and tails alike, NaN staying NaN",
          "[dtype]") {
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17},
                              std::size_t{40}}) {
    std::vector<float> wide(n);
    for (std::size_t i = 0; i < n; ++i)  // ties, subnormals, overflow, infinities and NaNs among ordinary values
      wide[i] = i % 5 == 4 ? std::numeric_limits<float>::quiet_NaN()
                           : std::ldexp(1.0F + static_cast<float>(i) * 0x1p-9F, static_cast<int>(i % 41) - 26) *
                                 (i % 2 == 0 ? 1.0F : -1.0F) * (i % 7 == 6 ? 1e30F : 1.0F);
    std::vector<ddp::bfloat16> b(n);
    std::vector<ddp::float16> h(n);
    std::vector<float> back(n);
    ddp::detail::convert(ddp::as_raw(wide), ddp::as_raw(b));
    ddp::detail::convert(ddp::as_raw(wide), ddp::as_raw(h));
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(b[i].bits == ddp::bfloat16(wide[i]).bits);
      CHECK(h[i].bits == ddp::float16(wide[i]).bits);
      CHECK(std::isnan(static_cast<float>(h[i])) == std::isnan(wide[i]));
    }
    ddp::detail::convert(ddp::as_raw(h), ddp::as_raw(back));
    for (std::size_t i = 0; i < n; ++i)
      CHECK(std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(static_cast<float>(h[i])));
  }
}

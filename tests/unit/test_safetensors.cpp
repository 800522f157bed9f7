#include <ddp/checkpoint/safetensors.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <catch2/catch.hpp>

namespace {

namespace st = ddp::safetensors;

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("ddp_st_" + std::to_string(::getpid()) + "_" + name);
}

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

std::vector<char> slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void spit(const std::filesystem::path& p, const std::vector<char>& data) {
  std::ofstream(p, std::ios::binary).write(data.data(), static_cast<std::streamsize>(data.size()));
}

/// Writes a two-tensor file and returns its path.
std::filesystem::path sample_file(const std::string& name) {
  const std::vector<float> w{1.5F, -2.0F, 3.25F, 0.0F, 7.0F, -1.0F};
  const std::vector<std::int64_t> step{42};
  const std::vector<st::tensor_view> views{{"w", ddp::dtype::f32, {2, 3}, bytes_of(w)},
                                           {"step", ddp::dtype::i64, {}, bytes_of(step)}};
  const auto path = temp_file(name);
  st::write(path, views, {{"note", "hello"}});
  return path;
}

std::string message_of(const std::filesystem::path& p) {
  try {
    (void)st::file::read(p);
  } catch (const ddp::io_error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("safetensors round-trips every dtype, shape and the metadata", "[safetensors]") {
  const std::vector<double> d{1.0, 2.5, -3.0};
  const std::vector<ddp::bfloat16> b{ddp::bfloat16(1.0F), ddp::bfloat16(-0.5F)};
  const std::vector<ddp::float16> h{ddp::float16(0.25F)};
  const std::vector<std::int32_t> i{-7, 8, 9, 10};
  const std::vector<std::uint8_t> u{255, 0, 1};
  const std::vector<float> empty;
  const std::vector<st::tensor_view> views{{"a.d", ddp::dtype::f64, {3}, bytes_of(d)},
                                           {"a.b", ddp::dtype::bf16, {1, 2}, bytes_of(b)},
                                           {"h", ddp::dtype::f16, {1}, bytes_of(h)},
                                           {"i", ddp::dtype::i32, {2, 2}, bytes_of(i)},
                                           {"u", ddp::dtype::u8, {3}, bytes_of(u)},
                                           {"e", ddp::dtype::f32, {0, 4}, bytes_of(empty)}};
  const auto path = temp_file("roundtrip");
  st::write(path, views, {{"epoch", "3"}});
  const auto f = st::file::read(path);
  REQUIRE(f.entries().size() == views.size());
  for (std::size_t k = 0; k < views.size(); ++k) {
    const auto& e = f.entries()[k];  // file order is write order
    CHECK(e.name == views[k].name);
    CHECK(e.type == views[k].type);
    CHECK(e.shape == views[k].shape);
    CHECK(std::equal(e.bytes.begin(), e.bytes.end(), views[k].bytes.begin(), views[k].bytes.end()));
  }
  CHECK(f.metadata().at("epoch") == "3");
  CHECK(f.metadata().at("ddp.format") == st::format_version);
  CHECK(f.metadata().at("ddp.checksum").size() == 16);
  CHECK(f.find("i") != nullptr);
  CHECK(f.find("nope") == nullptr);
  const auto raw = slurp(path);
  std::uint64_t header = 0;
  for (int k = 0; k < 8; ++k) header |= static_cast<std::uint64_t>(static_cast<unsigned char>(raw[static_cast<std::size_t>(k)])) << (8 * k);
  CHECK(header % 8 == 0);  // the data section is 8-byte aligned
  CHECK_FALSE(std::filesystem::exists(path.string() + ".tmp." + std::to_string(::getpid())));
  std::filesystem::remove(path);
}

TEST_CASE("safetensors write rejects wrong sizes and repeated names", "[safetensors]") {
  const std::vector<float> w{1, 2, 3};
  const auto path = temp_file("bad_write");
  const std::vector<st::tensor_view> wrong{{"w", ddp::dtype::f32, {2, 2}, bytes_of(w)}};
  CHECK_THROWS_WITH(st::write(path, wrong), Catch::Contains("need 16"));
  const std::vector<st::tensor_view> twice{{"w", ddp::dtype::f32, {3}, bytes_of(w)}, {"w", ddp::dtype::f32, {3}, bytes_of(w)}};
  CHECK_THROWS_AS(st::write(path, twice), ddp::io_error);
  CHECK_FALSE(std::filesystem::exists(path));
  CHECK_THROWS_WITH(st::write("/nonexistent_dir_ddp/x.safetensors", std::span<const st::tensor_view>{}),
                    Catch::Contains("directory exists"));
}

TEST_CASE("safetensors reading names truncated and corrupt files", "[safetensors]") {
  const auto path = sample_file("corrupt");
  const auto good = slurp(path);
  REQUIRE(message_of(path) == "no error");

  SECTION("missing file") { CHECK_THAT(message_of(temp_file("missing")), Catch::Contains("cannot be opened")); }
  SECTION("shorter than the length field") {
    spit(path, {good.begin(), good.begin() + 5});
    CHECK_THAT(message_of(path), Catch::Contains("truncated") && Catch::Contains(path.string()));
  }
  SECTION("cut inside the header") {
    spit(path, {good.begin(), good.begin() + 20});
    CHECK_THAT(message_of(path), Catch::Contains("truncated: the header claims"));
  }
  SECTION("cut inside the data") {
    spit(path, {good.begin(), good.end() - 3});
    CHECK_THAT(message_of(path), Catch::Contains("truncated or corrupt: tensor"));
  }
  SECTION("a huge header length") {
    auto bad = good;
    bad[7] = 0x7f;
    spit(path, bad);
    CHECK_THAT(message_of(path), Catch::Contains("not a safetensors file"));
  }
  SECTION("garbage JSON") {
    auto bad = good;
    bad[8] = '#';
    spit(path, bad);
    CHECK_THAT(message_of(path), Catch::Contains("does not parse"));
  }
  SECTION("a flipped data byte fails the checksum") {
    auto bad = good;
    bad[bad.size() - 10] ^= 0x01;
    spit(path, bad);
    CHECK_THAT(message_of(path), Catch::Contains("checksum") && Catch::Contains("write the file again"));
  }
  SECTION("trailing bytes") {
    auto bad = good;
    bad.push_back(0);
    spit(path, bad);
    CHECK_THAT(message_of(path), Catch::Contains("trailing data"));
  }
  SECTION("an unknown dtype") {
    std::string text(good.begin() + 8, good.end());
    const auto at = text.find("\"F32\"");
    REQUIRE(at != std::string::npos);
    auto bad = good;
    bad[8 + at + 1] = 'X';
    spit(path, bad);
    CHECK_THAT(message_of(path), Catch::Contains("does not read"));
  }
  std::filesystem::remove(path);
}

// The checksum covers a checkpoint's header and data ([durability], one process, a world of one over TCP): a bit
// flipped in any byte of a ddp::save file (header length, JSON header with its metadata values and tensor names,
// data) or of a sharded checkpoint (manifest, part) is refused with ddp::io_error naming the damaged file — never
// loaded, never reported as a model mismatch — and leaves the model untouched. Files of ddp's earlier format 1
// (checksum over the data only) are still read.
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/parallel/data_parallel.hpp>

#include "fixtures.hpp"
#include "world_of_one.hpp"

namespace {

namespace fs = std::filesystem;

std::vector<char> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void spit(const fs::path& p, const std::vector<char>& data) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(data.data(), static_cast<std::streamsize>(data.size()));
}

/// Where `needle` starts in `bytes`; fails when it is absent.
std::size_t offset_of(const std::vector<char>& bytes, const std::string& needle) {
  const auto it = std::search(bytes.begin(), bytes.end(), needle.begin(), needle.end());
  REQUIRE(it != bytes.end());
  return static_cast<std::size_t>(it - bytes.begin());
}

/// Flips one bit of every byte of `file` in turn (bit i mod 8 of byte i), calls `load` on each damaged copy and
/// returns a line for every flip that was not refused with an io_error naming `file`. Restores the file.
template <class Load>
std::vector<std::string> unrefused_flips(const fs::path& file, Load&& load) {
  const auto good = slurp(file);
  std::vector<std::string> wrong;
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] = static_cast<char>(bad[i] ^ (1 << (i % 8)));
    spit(file, bad);
    try {
      load();
      wrong.push_back("byte " + std::to_string(i) + ": loaded silently");
    } catch (const ddp::io_error& e) {
      if (std::string(e.what()).find(file.string()) == std::string::npos)
        wrong.push_back("byte " + std::to_string(i) + ": io_error without the path: " + e.what());
    } catch (const std::exception& e) {
      wrong.push_back("byte " + std::to_string(i) + ": another exception: " + e.what());
    }
  }
  spit(file, good);
  return wrong;
}

}  // namespace

TEST_CASE("a bit flipped anywhere in a checkpoint file is refused with io_error naming it", "[durability]") {
  auto comm = solo();
  shared_path file(comm, "flips");
  net model = make_net(0.5F);
  dp_t<ddp::backend::tcp> dp(model, comm);
  ddp::optim::adamw opt({.lr = 0.01});
  train_steps(dp, opt, 2);
  ddp::save(file.path, dp, opt, {{"epoch", "2"}});
  const auto before = snapshot(dp, opt);

  // Every region is among the flipped bytes: the length, metadata values, tensor names, the data.
  const auto bytes = slurp(file.path);
  std::uint64_t header = 0;
  for (int k = 0; k < 8; ++k) header |= std::uint64_t(static_cast<unsigned char>(bytes[std::size_t(k)])) << (8 * k);
  REQUIRE(offset_of(bytes, "\"epoch\":\"2\"") < 8 + header);
  REQUIRE(offset_of(bytes, "\"optim.step\":\"2\"") < 8 + header);
  REQUIRE(offset_of(bytes, "\"fc1.weight\"") < 8 + header);
  REQUIRE(8 + header < bytes.size());

  const auto wrong = unrefused_flips(file.path, [&] { ddp::load(file.path, dp, opt); });
  INFO(wrong.size() << " of " << bytes.size() << " flips not refused; first: " << (wrong.empty() ? "" : wrong.front()));
  CHECK(wrong.empty());
  CHECK(snapshot(dp, opt) == before);  // a refused load changed nothing
  REQUIRE(ddp::load(file.path, dp, opt).at("epoch") == "2");
}

TEST_CASE("a bit flipped anywhere in a sharded checkpoint is refused with io_error naming the file", "[durability]") {
  auto comm = solo();
  shared_path dir(comm, "sharded_flips", "");
  net model = make_net(0.5F);
  dp_t<ddp::backend::tcp, ddp::full_shard> dp(model, comm);
  ddp::optim::adamw opt({.lr = 0.01});
  train_steps(dp, opt, 2);
  ddp::save_sharded(dir.path, dp, opt, {{"epoch", "2"}});
  const auto before = parameters_of(dp);
  const auto manifest = dir.path / "manifest.json", part = dir.path / ddp::detail::part_name(0, 1);
  REQUIRE(offset_of(slurp(manifest), "\"epoch\": \"2\"") > 0);

  for (const auto& file : {manifest, part}) {
    const auto wrong = unrefused_flips(file, [&] { ddp::load_sharded(dir.path, dp, opt); });
    INFO(file << ": " << wrong.size() << " flips not refused; first: " << (wrong.empty() ? "" : wrong.front()));
    CHECK(wrong.empty());
  }
  CHECK(parameters_of(dp) == before);
  REQUIRE(ddp::load_sharded(dir.path, dp, opt).at("epoch") == "2");
}

TEST_CASE("a file of ddp's format 1 (checksum over the data only) is still read and its data still checked",
          "[durability]") {
  namespace st = ddp::safetensors;
  const fs::path original = DDP_CHECKPOINT_TEST_DIR "/data/ddp_format1.safetensors";
  const auto f = st::file::read(original);
  REQUIRE(f.metadata().at("ddp.format") == "1");
  REQUIRE(f.metadata().at("note") == "written by ddp before format 2");
  const auto* w = f.find("w");
  REQUIRE(w != nullptr);
  REQUIRE(w->shape == std::vector<std::size_t>{2, 3});
  REQUIRE(reinterpret_cast<const float*>(w->bytes.data())[2] == 3.25F);

  const auto copy = fs::temp_directory_path() / ("ddp_format1_" + std::to_string(::getpid()) + ".safetensors");
  auto bytes = slurp(original);
  bytes[bytes.size() - 3] ^= 0x10;  // inside the last tensor's data
  spit(copy, bytes);
  CHECK_THROWS_WITH(st::file::read(copy), Catch::Contains("checksum") && Catch::Contains(copy.string()));
  fs::remove(copy);
}

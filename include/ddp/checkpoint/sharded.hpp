#pragma once
/// \file ddp::save_sharded / ddp::load_sharded: the training state as a directory with one safetensors part per
/// rank (the ranges of the tensors that rank holds, each under "<tensor>[<first>:<end>]" with flattened element
/// offsets) and a `manifest.json` by rank 0 (world size, every tensor's dtype and shape, which part holds which
/// ranges, each part's checksum, the metadata, and its own checksum). The directory is written under a temporary
/// name that rank 0 claims (<ddp/io/atomic_file.hpp>) and moved into place when complete. Loading reads, on each rank, the ranges overlapping what it holds, so a checkpoint saved
/// at one world size (or policy) loads at another. The directory must be visible to every rank.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>

#include <nlohmann/json.hpp>

#include <ddp/checkpoint/checksum.hpp>
#include <ddp/checkpoint/safetensors.hpp>
#include <ddp/checkpoint/state.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/io/atomic_file.hpp>

namespace ddp {

namespace detail {

/// Format of the manifest, stored as "format": "/2" carries "manifest_checksum", the checksum of the manifest's
/// text (its own digits counted as '0'); "/1" (without it) is still read.
inline constexpr std::string_view sharded_format = "ddp.sharded/2";
/// Where the manifest's checksum digits follow (nlohmann's indented dump writes ": ").
inline constexpr std::string_view manifest_marker = "\"manifest_checksum\": \"";

/// File name of rank r's part in a checkpoint of n ranks.
inline std::string part_name(int r, int n) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.safetensors", r, n);
  return name;
}

/// Key of a range inside a part: "fc1.weight[0:35]" (flattened elements [0, 35) of fc1.weight).
inline std::string piece_key(const std::string& tensor, std::size_t start, std::size_t numel) {
  return tensor + "[" + std::to_string(start) + ":" + std::to_string(start + numel) + "]";
}

/// What a part's writer reports to rank 0 for the manifest.
struct part_report {
  std::string checksum;         ///< the part's ddp.checksum
  std::uint64_t data_bytes = 0;  ///< bytes of its data section
};

/// A manifest, read and validated.
struct sharded_manifest {
  /// A range of a tensor in a part.
  struct range {
    std::size_t part = 0, start = 0, numel = 0;
  };
  /// A part file.
  struct part {
    std::string file, checksum;
    std::uint64_t data_bytes = 0;
  };
  int world_size = 0;
  checkpoint_metadata metadata;
  std::vector<safetensors::tensor_header> tensors;
  std::vector<std::vector<range>> ranges;  // per tensor, ascending and covering it exactly
  std::vector<part> parts;
};

[[noreturn]] inline void corrupt_manifest(const std::filesystem::path& path, const std::string& what) {
  throw io_error("sharded checkpoint manifest '" + path.string() + "': corrupt: " + what +
                     "; save the checkpoint again (or resume from an older one)",
                 -1);
}

/// Parses the manifest text read from `path`; throws ddp::io_error naming the path for anything malformed.
inline sharded_manifest parse_manifest(const std::filesystem::path& path, const std::string& text) {
  sharded_manifest m;
  try {
    const auto j = nlohmann::json::parse(text);
    const auto format = j.at("format").get<std::string>();
    if (format != sharded_format && format != "ddp.sharded/1")
      corrupt_manifest(path, "its format is '" + format + "', not '" + std::string(sharded_format) + "'");
    if (format == sharded_format) {
      const auto seal = find_seal(text, manifest_marker);
      if (seal == std::string::npos) corrupt_manifest(path, "its manifest_checksum is not where ddp writes it");
      const auto actual = hex(fnv1a_sealed(text, seal));
      if (actual != text.substr(seal, 16))
        corrupt_manifest(path, "its checksum is " + actual + " but it records " + text.substr(seal, 16) +
                                   " (it was damaged after writing)");
    }
    m.world_size = j.at("world_size").get<int>();
    m.metadata = j.at("metadata").get<checkpoint_metadata>();
    std::map<std::string, std::size_t> index;
    for (const auto& t : j.at("tensors")) {
      const auto type = safetensors::dtype_from_name(t.at("dtype").get<std::string>());
      if (!type) corrupt_manifest(path, "tensor " + t.dump() + " has an unknown dtype");
      index[t.at("name").get<std::string>()] = m.tensors.size();
      m.tensors.push_back({t.at("name").get<std::string>(), *type, t.at("shape").get<std::vector<std::size_t>>()});
    }
    m.ranges.resize(m.tensors.size());
    for (const auto& p : j.at("parts")) {
      const auto file = p.at("file").get<std::string>();
      if (file.empty() || std::filesystem::path(file).filename().string() != file)
        corrupt_manifest(path, "part file name '" + file + "' is not a plain file name");
      for (const auto& r : p.at("ranges")) {
        const auto it = index.find(r.at("tensor").get<std::string>());
        if (it == index.end()) corrupt_manifest(path, "a range names tensor '" + r.at("tensor").get<std::string>() + "', which it does not list");
        m.ranges[it->second].push_back({m.parts.size(), r.at("start").get<std::size_t>(), r.at("numel").get<std::size_t>()});
      }
      m.parts.push_back({file, p.at("checksum").get<std::string>(), p.at("data_bytes").get<std::uint64_t>()});
    }
  } catch (const nlohmann::json::exception& e) {
    corrupt_manifest(path, std::string("it does not parse as a ddp manifest (") + e.what() + ")");
  }
  if (m.world_size <= 0 || static_cast<std::size_t>(m.world_size) != m.parts.size())
    corrupt_manifest(path, "world_size " + std::to_string(m.world_size) + " but " + std::to_string(m.parts.size()) + " parts");
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    auto& ranges = m.ranges[t];
    std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) { return a.start < b.start; });
    std::size_t end = 0;
    bool exact = true;  // ascending, without gaps or overlaps, up to the last element
    for (const auto& r : ranges) {
      exact = exact && r.start == end;
      end = r.start + r.numel;
    }
    if (!exact || end != safetensors::detail::numel_of(m.tensors[t].shape))
      corrupt_manifest(path, "the ranges of '" + m.tensors[t].name + "' do not cover its elements exactly once");
  }
  return m;
}

/// The manifest of `dir` as text; throws ddp::io_error naming the path when it cannot be read.
inline std::string read_manifest_text(const std::filesystem::path& dir) {
  const auto path = dir / "manifest.json";
  std::ifstream in(path);
  if (!in)
    throw io_error("sharded checkpoint '" + dir.string() + "': '" + path.string() + "' cannot be opened; check the "
                   "path (is it a directory written by ddp::save_sharded? is it visible to rank 0?)",
                   -1);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

/// Throws unless `dir` is absent, an empty directory or a sharded checkpoint: what save_sharded may replace.
inline void check_replaceable(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  if (!fs::is_directory(dir, ec) || (!fs::is_empty(dir, ec) && !fs::exists(dir / "manifest.json", ec)))
    throw io_error("save_sharded: '" + dir.string() + "' exists and is not a sharded checkpoint (no manifest.json), "
                   "so it is not replaced; choose another directory or remove it",
                   -1);
}

/// Moves the complete directory `tmp` to `dir`: a rename, or an atomic exchange with the checkpoint already
/// there, which is then removed. A concurrent saver may install `dir` between the look and the rename; the
/// rename then fails with ENOTEMPTY and the move is tried again as an exchange (a bounded number of times).
inline void install_directory(const std::filesystem::path& tmp, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  bool replacing = false;
  int rc = -1;
  for (int attempt = 0; attempt < 3 && rc != 0; ++attempt) {
    replacing = fs::exists(dir, ec);
    rc = replacing ? ::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE)
                   : ::rename(tmp.c_str(), dir.c_str());
    const bool raced = replacing ? errno == ENOENT : (errno == ENOTEMPTY || errno == EEXIST);
    if (rc != 0 && !raced) break;
  }
  if (rc != 0)
    throw io_error("save_sharded: moving '" + tmp.string() + "' to '" + dir.string() + "' failed (" +
                       std::generic_category().message(errno) + "); check permissions of the parent directory and "
                       "that the file system supports renameat2",
                   -1, errno);
  if (replacing) fs::remove_all(tmp, ec);  // the previous checkpoint, now under the temporary name
  sync_directory(parent_of(dir));
}

template <class DP, class Opt>
checkpoint_metadata load_sharded_impl(const std::filesystem::path& dir, DP& dp, Opt* opt) {
  const auto st = collect_state(dp, opt);
  auto& comm = dp.comm();
  const int me = comm.rank();
  const auto manifest_path = dir / "manifest.json";
  std::string text;
  on_rank0_then_share(comm, [&] {
    text = read_manifest_text(dir);
    const auto m = parse_manifest(manifest_path, text);
    auto problem = compare_state(manifest_path.string(), m.tensors, st.tensors, std::is_void_v<Opt>);
    if (problem.empty()) problem = compare_settings(manifest_path.string(), m.metadata, opt);
    if (!problem.empty()) throw mismatch_error(problem, 0);
  });
  broadcast_object(comm, text, 0);
  const auto m = parse_manifest(manifest_path, text);
  std::map<std::string, std::size_t> index;
  for (std::size_t t = 0; t < m.tensors.size(); ++t) index[m.tensors[t].name] = t;

  // Every range of a part that overlaps a piece this rank holds.
  struct copy {
    std::size_t part;
    std::size_t tensor;       // index into the manifest's tensors
    std::string key;
    std::size_t numel;        // elements of the range in the part
    std::uint64_t offset;     // first byte to read inside the range
    std::span<std::byte> to;  // where the bytes go
  };
  std::vector<copy> copies;
  for (const auto& p : st.mine) {
    const auto& tensor = st.tensors[p.tensor];
    const std::size_t width = size_of(tensor.type);
    for (const auto& r : m.ranges[index.at(tensor.name)]) {
      const std::size_t lo = std::max(p.start, r.start), hi = std::min(p.start + p.numel, r.start + r.numel);
      if (lo < hi)
        copies.push_back({r.part, index.at(tensor.name), piece_key(tensor.name, r.start, r.numel), r.numel, (lo - r.start) * width,
                          {p.data + (lo - p.start) * width, (hi - lo) * width}});
    }
  }
  // Open and verify every part needed before changing anything, then read.
  std::map<std::size_t, safetensors::reader> parts;
  first_failure failed;
  failed.run([&] {
    for (const auto& c : copies) {
      if (!parts.contains(c.part)) {
        const auto& part = m.parts[c.part];
        auto r = safetensors::reader::open(dir / part.file);
        r.verify_checksum();
        const auto it = r.metadata().find("ddp.checksum");
        if (it == r.metadata().end() || it->second != part.checksum)
          throw io_error("sharded checkpoint part '" + (dir / part.file).string() + "' has checksum " +
                         (it == r.metadata().end() ? std::string("(none)") : it->second) + " but the manifest records " +
                         part.checksum + ": it comes from another save; save the checkpoint again (or resume from an "
                         "older one)");
        parts.emplace(c.part, std::move(r));
      }
      const auto* e = parts.at(c.part).find(c.key);
      if (e == nullptr || e->type != m.tensors[c.tensor].type ||
          e->shape != std::vector<std::size_t>{c.numel})
        throw io_error("sharded checkpoint part '" + (dir / m.parts[c.part].file).string() + "' lacks '" + c.key +
                       "' (or holds it with another dtype or shape), which the manifest places there; save the "
                       "checkpoint again (or resume from an older one)");
    }
  });
  agree_on_failure(comm, failed.message(me));
  failed.run([&] {
    for (const auto& c : copies) {
      const auto& r = parts.at(c.part);
      r.read(*r.find(c.key), c.offset, c.to);
    }
  });
  agree_on_failure(comm, failed.message(me));
  st.to_devices();
  refresh_parameters(dp, st);
  restore_step_count(manifest_path, m.metadata, opt, me);
  restore_loss_scale(manifest_path, m.metadata, dp);
  return m.metadata;
}

}  // namespace detail

/// Saves the training state of `dp` and `opt` as the directory `dir` (created, or replaced when it holds a
/// sharded checkpoint): each rank writes the ranges it holds (under hybrid, replicas are written once) as
/// `rank-<r>-of-<n>.safetensors`; rank 0 writes `manifest.json` with `metadata`, then moves the directory into
/// place. Rank 0 first removes the temporary directories that killed saves to `dir` left. Collective; a failure
/// on any rank is thrown on every rank.
template <class DP, class Opt>
void save_sharded(const std::filesystem::path& dir, DP& dp, Opt& opt, const checkpoint_metadata& metadata = {}) {
  namespace fs = std::filesystem;
  const auto st = detail::collect_state(dp, &opt);
  auto& comm = dp.comm();
  const int me = comm.rank(), n = comm.size();
  std::optional<detail::temp_claim> claim;  // rank 0's, held until the directory is in place or removed
  std::string tmp;
  detail::on_rank0_then_share(comm, [&] {
    detail::check_replaceable(dir);
    std::error_code ec;
    fs::create_directories(detail::parent_of(dir), ec);
    detail::remove_stale_temps(dir);
    if (!ec) claim.emplace(dir);
    if (!ec) fs::create_directory(claim->path(), ec);
    if (ec)
      throw io_error("save_sharded: cannot create a temporary directory beside '" + dir.string() + "' (" +
                     ec.message() + "); check that the parent directory exists or can be created and is writable",
                     0, ec.value());
    tmp = claim->path().string();
  });
  broadcast_object(comm, tmp, 0);

  std::vector<safetensors::tensor_header> headers;
  std::vector<std::span<const std::byte>> bytes;
  for (std::size_t t = 0; t < st.tensors.size(); ++t)
    for (const auto& c : st.cover[t])
      if (c.rank == me) {
        headers.push_back({detail::piece_key(st.tensors[t].name, c.start, c.numel), st.tensors[t].type, {c.numel}});
        bytes.emplace_back(st.at(t, c.start, c.numel), c.numel * size_of(st.tensors[t].type));
      }
  detail::part_report report;
  detail::first_failure failed;
  failed.run([&] {
    safetensors::writer w(fs::path(tmp) / detail::part_name(me, n), headers,
                          {{"ddp.rank", std::to_string(me)}, {"ddp.world_size", std::to_string(n)}});
    for (const auto& b : bytes) w.append(b);
    w.commit();
    report = {detail::hex(w.checksum()), w.data_bytes()};
  });
  try {
    detail::agree_on_failure(comm, failed.message(me));
  } catch (const error&) {
    std::error_code ec;
    if (me == 0) fs::remove_all(tmp, ec);
    throw;
  }
  const auto reports = all_gather_object(comm, report);
  detail::on_rank0_then_share(comm, [&] {
    nlohmann::json tensors = nlohmann::json::array(), parts = nlohmann::json::array();
    for (const auto& t : st.tensors)
      tensors.push_back({{"name", t.name}, {"dtype", safetensors::dtype_name(t.type)}, {"shape", t.shape}});
    for (int r = 0; r < n; ++r) {
      nlohmann::json ranges = nlohmann::json::array();
      for (std::size_t t = 0; t < st.tensors.size(); ++t)
        for (const auto& c : st.cover[t])
          if (c.rank == r) ranges.push_back({{"tensor", st.tensors[t].name}, {"start", c.start}, {"numel", c.numel}});
      const auto& rep = reports[static_cast<std::size_t>(r)];
      parts.push_back({{"file", detail::part_name(r, n)}, {"rank", r}, {"checksum", rep.checksum},
                       {"data_bytes", rep.data_bytes}, {"ranges", std::move(ranges)}});
    }
    auto meta = metadata;
    detail::record_optimizer(meta, opt);
    detail::note_loss_scale(dp, meta);
    meta["ddp.world_size"] = std::to_string(n);
    const nlohmann::json manifest = {{"format", detail::sharded_format}, {"world_size", n}, {"metadata", meta},
                                     {"tensors", std::move(tensors)}, {"parts", std::move(parts)},
                                     {"manifest_checksum", detail::unsealed_digits}};
    std::string text = manifest.dump(1);
    const auto seal = detail::find_seal(text, detail::manifest_marker);
    text.replace(seal, detail::unsealed_digits.size(), detail::hex(detail::fnv1a(text)));
    try {
      {  // closed before the move: its claim's lock file is removed by the path it had in the temporary directory
        detail::atomic_file file(fs::path(tmp) / "manifest.json");
        file.write(std::as_bytes(std::span(text)));
        file.commit();
      }
      detail::install_directory(tmp, dir);
    } catch (const error&) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      throw;
    }
  });
}

/// Loads what save_sharded() wrote — at any world size and under any sharding policy — into `dp`'s parameters
/// and `opt`'s state and step count: each rank reads the ranges overlapping what it holds, after verifying the
/// parts it needs (checksums, the manifest's ranges). A missing, truncated or corrupt part, or a manifest that
/// does not match the model, throws on every rank (ddp::io_error / ddp::mismatch_error naming the file and
/// the rank). Returns the metadata. Collective.
template <class DP, class Opt>
checkpoint_metadata load_sharded(const std::filesystem::path& dir, DP& dp, Opt& opt) {
  return detail::load_sharded_impl(dir, dp, &opt);
}

/// Loads only the parameters of a sharded checkpoint (its optimizer ranges are not read). Collective.
template <class DP>
checkpoint_metadata load_sharded(const std::filesystem::path& dir, DP& dp) {
  return detail::load_sharded_impl(dir, dp, static_cast<void*>(nullptr));
}

}  // namespace ddp

#pragma once
/// \file Reading and writing the safetensors format (what PyTorch's safetensors package reads): an 8-byte
/// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the
/// data. ddp adds `__metadata__` entries "ddp.format" ("2") and "ddp.checksum": the checksum of the whole file
/// (<ddp/checkpoint/checksum.hpp>: length, header and data, the checksum's own digits counted as '0'), verified on
/// reading; files of format "1" carry a checksum of the data section only, still verified. Writes are atomic
/// (<ddp/io/atomic_file.hpp>): a claimed temporary is written, flushed, renamed over `path`, and the
/// directory is flushed; stale temporaries of killed saves to `path` are removed first.

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <ddp/checkpoint/checksum.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/io/atomic_file.hpp>

namespace ddp::safetensors {

/// Version of ddp's metadata conventions, stored as "ddp.format": "2", the checksum covers the whole file ("1":
/// the data section only; still read).
inline constexpr std::string_view format_version = "2";
/// Largest JSON header accepted on reading (the safetensors library's own bound).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

/// One named tensor to write: its dtype, shape and the bytes of its elements (row-major, little-endian).
struct tensor_view {
  std::string name;                 ///< key in the file ("fc1.weight")
  ddp::dtype type = dtype::f32;     ///< element type
  std::vector<std::size_t> shape;   ///< dimensions, outermost first (empty: a scalar)
  std::span<const std::byte> bytes; ///< exactly numel(shape) * size_of(type) bytes
};

/// One tensor of a file that was read: the bytes point into the file's buffer.
struct entry {
  std::string name;                 ///< key in the file
  ddp::dtype type = dtype::f32;     ///< element type
  std::vector<std::size_t> shape;   ///< dimensions, outermost first
  std::span<const std::byte> bytes; ///< the elements' bytes
  /// Number of elements.
  [[nodiscard]] std::size_t numel() const noexcept {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
  }
};

/// The safetensors name of a dtype ("F32", "BF16", ...).
constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::f64: return "F64";
    case dtype::bf16: return "BF16";
    case dtype::f16: return "F16";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
  }
  return "?";
}

/// The dtype of a safetensors name, or nothing for names ddp does not handle.
inline std::optional<dtype> dtype_from_name(std::string_view name) noexcept {
  for (const dtype t : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16, dtype::i32, dtype::i64, dtype::u8})
    if (dtype_name(t) == name) return t;
  return std::nullopt;
}

namespace detail {

/// Where a ddp header's checksum digits follow (nlohmann's compact dump writes no spaces).
inline constexpr std::string_view checksum_marker = "\"ddp.checksum\":\"";

inline std::size_t numel_of(const std::vector<std::size_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
}

[[noreturn]] inline void fail(const std::filesystem::path& path, const std::string& what, const std::string& fix,
                              int err = 0) {
  ddp::detail::fail_on("safetensors file", path, what, fix, err);
}

}  // namespace detail

/// Name, dtype and shape of one tensor, without its bytes: what the header of a file says about it.
struct tensor_header {
  std::string name;                ///< key in the file
  ddp::dtype type = dtype::f32;    ///< element type
  std::vector<std::size_t> shape;  ///< dimensions, outermost first
  /// Bytes of its elements.
  [[nodiscard]] std::size_t bytes() const { return detail::numel_of(shape) * size_of(type); }
};

/// Writes a safetensors file tensor by tensor, so that no more than the bytes being appended need be in
/// memory: the header (with '0's for the checksum's digits) goes first, append() streams the data in header order,
/// commit() writes the checksum of all the bytes in place of the '0's, checks the size and renames the file into
/// place atomically.
class writer {
 public:
  /// Starts `path` (through a temporary file) for `tensors` in this order; adds "ddp.format" and "ddp.checksum"
  /// to `metadata`. Throws ddp::io_error for repeated or reserved names and when the file cannot be created.
  writer(const std::filesystem::path& path, std::span<const tensor_header> tensors,
         const std::map<std::string, std::string>& metadata = {})
      : file_(path) {
    nlohmann::json header = nlohmann::json::object();
    for (const auto& t : tensors) {
      if (t.name == "__metadata__" || header.contains(t.name))
        throw io_error("safetensors::write: tensor name '" + t.name + "' is reserved or repeated; give every tensor a "
                       "unique name other than __metadata__");
      header[t.name] = {{"dtype", dtype_name(t.type)}, {"shape", t.shape}, {"data_offsets", {size_, size_ + t.bytes()}}};
      size_ += t.bytes();
    }
    nlohmann::json meta = nlohmann::json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    meta["ddp.format"] = std::string(format_version);
    meta["ddp.checksum"] = std::string(ddp::detail::unsealed_digits);  // replaced by commit()
    header["__metadata__"] = meta;
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned, as safetensors pads
    checksum_at_ = 8 + ddp::detail::find_seal(text, detail::checksum_marker);  // JSON escapes quotes in values
    std::byte length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);
    for (const auto bytes : {std::span<const std::byte>(length), std::as_bytes(std::span(text))}) {
      file_.write(bytes);
      checksum_ = ddp::detail::fnv1a(bytes, checksum_);
    }
  }

  /// Appends the next bytes of the data section (tensors in header order, a tensor in any number of pieces).
  void append(std::span<const std::byte> bytes) {
    if (written_ + bytes.size() > size_)
      throw io_error("safetensors::writer: appending " + std::to_string(bytes.size()) + " bytes after " +
                     std::to_string(written_) + " overflows the " + std::to_string(size_) +
                     " bytes the header declares; append exactly the declared tensors' bytes");
    file_.write(bytes);
    checksum_ = ddp::detail::fnv1a(bytes, checksum_);
    written_ += bytes.size();
  }

  /// Writes the checksum into the header and moves the file into place; throws unless every byte was appended.
  void commit() {
    if (written_ != size_)
      throw io_error("safetensors::writer: " + std::to_string(written_) + " of the " + std::to_string(size_) +
                     " declared bytes were appended; append every tensor before commit()");
    const std::string hex = ddp::detail::hex(checksum_);
    file_.write_at(checksum_at_, std::as_bytes(std::span(hex)));
    file_.commit();
  }

  /// The checksum of the bytes written so far (after commit(): the file's, as its "ddp.checksum" records it).
  [[nodiscard]] std::uint64_t checksum() const noexcept { return checksum_; }
  /// Bytes of the data section declared by the header.
  [[nodiscard]] std::uint64_t data_bytes() const noexcept { return size_; }

 private:
  ddp::detail::atomic_file file_;
  std::uint64_t size_ = 0, written_ = 0, checksum_at_ = 0;
  std::uint64_t checksum_ = ddp::detail::fnv1a_basis;
};

/// Writes `tensors` (in this order) and `metadata` to `path` atomically (temporary file, fsync, rename, fsync of
/// the directory; stale temporaries of `path` removed first); adds "ddp.format" and "ddp.checksum" to the
/// metadata. Throws ddp::io_error on failure.
inline void write(const std::filesystem::path& path, std::span<const tensor_view> tensors,
                  const std::map<std::string, std::string>& metadata = {}) {
  std::vector<tensor_header> headers;
  for (const auto& t : tensors) {
    headers.push_back({t.name, t.type, t.shape});
    if (t.bytes.size() != headers.back().bytes())
      throw io_error("safetensors::write: tensor '" + t.name + "' has " + std::to_string(t.bytes.size()) +
                     " bytes but its shape and dtype need " + std::to_string(headers.back().bytes()) +
                     "; pass matching shape and data");
  }
  writer w(path, headers, metadata);
  for (const auto& t : tensors) w.append(t.bytes);
  w.commit();
}

/// Where one tensor lies in a file's data section, besides its name, dtype and shape.
struct located_header : tensor_header {
  std::uint64_t begin = 0;  ///< first byte in the data section
};

namespace detail {

inline const std::string& rewrite_fix() {
  static const std::string fix = "write the file again (a checkpoint: resume from an older one)";
  return fix;
}

/// Parses and validates the JSON header `text` of a file whose data section holds `data_size` bytes: dtypes,
/// shapes, offsets in range, contiguous, covering the data section. Returns the tensors in file order.
inline std::vector<located_header> parse_header(const std::filesystem::path& path, std::string_view text,
                                                std::uint64_t data_size, std::map<std::string, std::string>& metadata) {
  const std::string& rewrite = rewrite_fix();
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("corrupt: the JSON header does not parse (") + e.what() + ")", rewrite);
  }
  if (!header.is_object()) fail(path, "corrupt: the JSON header is not an object", rewrite);
  std::vector<located_header> found;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail(path, "corrupt: __metadata__ is not an object of strings", rewrite);
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail(path, "corrupt: __metadata__ entry '" + k + "' is not a string", rewrite);
        metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const auto bad = [&](const std::string& why) { fail(path, "corrupt: tensor '" + name + "' " + why, rewrite); };
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets"))
      bad("lacks dtype, shape or data_offsets");
    const auto& dt = value["dtype"];
    const auto type = dt.is_string() ? dtype_from_name(dt.get<std::string>()) : std::nullopt;
    if (!type)
      fail(path, "tensor '" + name + "' has dtype " + dt.dump() + ", which ddp does not read",
           "convert it to F32, F64, BF16, F16, I32, I64 or U8 before loading");
    located_header e;
    e.name = name;
    e.type = *type;
    if (!value["shape"].is_array()) bad("has a shape that is not an array");
    for (const auto& d : value["shape"]) {
      if (!d.is_number_unsigned()) bad("has a shape with a negative or non-integer dimension");
      e.shape.push_back(d.get<std::size_t>());
    }
    const auto& off = value["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("has data_offsets that are not two unsigned integers");
    const auto begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end || end > data_size)
      fail(path, "truncated or corrupt: tensor '" + name + "' spans bytes [" + std::to_string(begin) + ", " +
                     std::to_string(end) + ") of a data section of " + std::to_string(data_size) + " bytes",
           rewrite);
    if (end - begin != e.bytes())
      bad("has " + std::to_string(end - begin) + " bytes but shape and dtype need " + std::to_string(e.bytes()));
    e.begin = begin;
    found.push_back(std::move(e));
  }
  std::sort(found.begin(), found.end(), [](const located_header& a, const located_header& b) { return a.begin < b.begin; });
  std::uint64_t expect = 0;
  for (const auto& e : found) {
    if (e.begin != expect)
      fail(path, "corrupt: tensor '" + e.name + "' starts at byte " + std::to_string(e.begin) +
                     " of the data section but the previous tensor ends at " + std::to_string(expect) +
                     " (tensors must be contiguous, without gaps or overlaps)",
           rewrite);
    expect = e.begin + e.bytes();
  }
  if (expect != data_size)
    fail(path, "corrupt: " + std::to_string(data_size - expect) + " bytes follow the last tensor (the file has trailing data)",
         rewrite);
  return found;
}

/// What a file's checksum covers and what it should be: `basis` is the checksum of the bytes before the data
/// section that it covers, `recorded` the value its header records (none for files of other writers).
struct checksum_plan {
  std::optional<std::string> recorded;
  std::uint64_t basis = ddp::detail::fnv1a_basis;
};

/// The checksum plan of a file whose 8-byte length field holds `length` and whose header is `text`, given its
/// metadata: format "2" covers length and header (the digits counted as '0'), "1" the data only. Throws
/// ddp::io_error for an unknown format, or a ddp.checksum without a format or without its place in the header.
inline checksum_plan plan_checksum(const std::filesystem::path& path, std::span<const std::byte> length,
                                   std::string_view text, const std::map<std::string, std::string>& metadata) {
  const auto format = metadata.find("ddp.format"), recorded = metadata.find("ddp.checksum");
  if (format == metadata.end() && recorded == metadata.end()) return {};  // another writer's file: no checksum
  if (format == metadata.end() || recorded == metadata.end())
    fail(path, "corrupt: its metadata has ddp.format or ddp.checksum but not both", rewrite_fix());
  if (format->second == "1") return {recorded->second, ddp::detail::fnv1a_basis};
  if (format->second != format_version)
    fail(path, "its ddp.format is '" + format->second + "', which this ddp does not know (it knows 1 and " +
                   std::string(format_version) + ")",
         "read it with the ddp version that wrote it, or " + rewrite_fix());
  const std::size_t seal = ddp::detail::find_seal(text, checksum_marker);
  if (seal == std::string_view::npos || text.substr(seal, 16) != recorded->second)
    fail(path, "corrupt: the header's ddp.checksum entry is not where ddp writes it", rewrite_fix());
  return {recorded->second, ddp::detail::fnv1a_sealed(text, seal, ddp::detail::fnv1a(length))};
}

/// Throws unless `actual` equals the checksum the plan records (files without one pass).
inline void check_checksum(const std::filesystem::path& path, const checksum_plan& plan, std::uint64_t actual) {
  if (plan.recorded && ddp::detail::hex(actual) != *plan.recorded)
    fail(path, "corrupt: its checksum is " + ddp::detail::hex(actual) + " but the header records " + *plan.recorded +
                   " (the file was damaged after writing)",
         rewrite_fix());
}

/// Reads the 8-byte length (into `length`) and the header text at the start of `fd`; returns the header and the
/// data size.
inline std::pair<std::string, std::uint64_t> read_header(int fd, const std::filesystem::path& path, std::uint64_t size,
                                                         std::uint8_t (&length)[8]) {
  if (size < 8)
    fail(path, "truncated: " + std::to_string(size) + " bytes, shorter than the 8-byte header length", rewrite_fix());
  if (::pread(fd, length, 8, 0) != 8) fail(path, "reading failed", "check the disk and the file's permissions", errno);
  std::uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<std::uint64_t>(length[i]) << (8 * i);
  if (header_len > max_header_bytes)
    fail(path, "corrupt: the header claims " + std::to_string(header_len) + " bytes (more than " +
                   std::to_string(max_header_bytes) + "); this is not a safetensors file or its start is damaged",
         rewrite_fix());
  if (header_len > size - 8)
    fail(path, "truncated: the header claims " + std::to_string(header_len) + " bytes but only " +
                   std::to_string(size - 8) + " follow the length field",
         rewrite_fix());
  std::string text(header_len, '\0');
  if (::pread(fd, text.data(), header_len, 8) != static_cast<ssize_t>(header_len))
    fail(path, "reading failed", "check the disk and the file's permissions", errno);
  return {std::move(text), size - 8 - header_len};
}

}  // namespace detail

/// A safetensors file opened for reading piece by piece: the header is read and validated at once (as
/// file::read does), the data stays on disk until read() asks for a range of a tensor.
class reader {
 public:
  /// Opens `path` and validates its header; throws ddp::io_error saying what is wrong and what to do.
  static reader open(const std::filesystem::path& path) {
    reader r;
    r.path_ = path;
    r.fd_ = std::shared_ptr<int>(new int(::open(path.c_str(), O_RDONLY | O_CLOEXEC)), [](int* fd) {
      if (*fd >= 0) ::close(*fd);
      delete fd;
    });
    if (*r.fd_ < 0) detail::fail(path, "cannot be opened", "check the path (does the file exist? is it readable?)", errno);
    const off_t size = ::lseek(*r.fd_, 0, SEEK_END);
    if (size < 0) detail::fail(path, "reading failed", "check the disk and the file's permissions", errno);
    std::uint8_t length[8];
    auto [text, data_size] = detail::read_header(*r.fd_, path, static_cast<std::uint64_t>(size), length);
    r.data_at_ = static_cast<std::uint64_t>(size) - data_size;
    r.entries_ = detail::parse_header(path, text, data_size, r.metadata_);
    r.checksum_ = detail::plan_checksum(path, std::as_bytes(std::span(length)), text, r.metadata_);
    return r;
  }

  /// Reads the whole data section once and throws ddp::io_error unless the file matches its recorded checksum.
  void verify_checksum() const {
    if (!checksum_.recorded) return;
    std::vector<std::byte> chunk(std::size_t{1} << 20);
    std::uint64_t h = checksum_.basis, at = data_at_;
    const std::uint64_t end = data_at_ + (entries_.empty() ? 0 : entries_.back().begin + entries_.back().bytes());
    while (at < end) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), end - at));
      read_bytes(at, std::span(chunk).first(n));
      h = ddp::detail::fnv1a(std::span<const std::byte>(chunk).first(n), h);
      at += n;
    }
    detail::check_checksum(path_, checksum_, h);
  }

  /// Throws ddp::io_error unless `data`, the file's whole data section already read, matches the recorded checksum.
  void verify_checksum(std::span<const std::byte> data) const {
    detail::check_checksum(path_, checksum_, ddp::detail::fnv1a(data, checksum_.basis));
  }

  /// Copies bytes [offset, offset + out.size()) of tensor `t` into `out`.
  void read(const located_header& t, std::uint64_t offset, std::span<std::byte> out) const {
    if (offset + out.size() > t.bytes())
      throw io_error("safetensors::reader: bytes [" + std::to_string(offset) + ", " + std::to_string(offset + out.size()) +
                     ") lie outside tensor '" + t.name + "' of " + std::to_string(t.bytes()) + " bytes in '" +
                     path_.string() + "'; read within the tensor");
    read_bytes(data_at_ + t.begin + offset, out);
  }

  /// The tensors in file order (ascending offsets).
  [[nodiscard]] const std::vector<located_header>& entries() const noexcept { return entries_; }
  /// The tensor named `name`, or nullptr.
  [[nodiscard]] const located_header* find(std::string_view name) const noexcept {
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const auto& e) { return e.name == name; });
    return it == entries_.end() ? nullptr : &*it;
  }
  /// The `__metadata__` string map (empty when absent).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// The path the file was opened from.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void read_bytes(std::uint64_t at, std::span<std::byte> out) const {
    while (!out.empty()) {
      const ssize_t n = ::pread(*fd_, out.data(), out.size(), static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        detail::fail(path_, n == 0 ? "truncated: it ended while being read" : "reading failed",
                     n == 0 ? detail::rewrite_fix() : "check the disk and the file's permissions", n == 0 ? 0 : errno);
      out = out.subspan(static_cast<std::size_t>(n));
      at += static_cast<std::uint64_t>(n);
    }
  }

  std::filesystem::path path_;
  std::shared_ptr<int> fd_;
  std::uint64_t data_at_ = 0;
  std::vector<located_header> entries_;
  std::map<std::string, std::string> metadata_;
  detail::checksum_plan checksum_;
};

/// A safetensors file read into memory and validated: header bound, JSON, dtypes, offsets in range and
/// contiguous, sizes equal to shape × dtype, and the checksum when the file carries one.
class file {
 public:
  /// Reads and validates `path`; throws ddp::io_error saying what is wrong and what to do.
  static file read(const std::filesystem::path& path) {
    const auto r = reader::open(path);
    file f;
    f.path_ = path;
    f.metadata_ = r.metadata();
    std::uint64_t total = 0;
    for (const auto& e : r.entries()) total += e.bytes();
    f.buffer_.resize(total);
    for (const auto& e : r.entries()) {
      const auto bytes = std::span(f.buffer_).subspan(e.begin, e.bytes());
      r.read(e, 0, bytes);
      f.entries_.push_back({e.name, e.type, e.shape, bytes});
    }
    r.verify_checksum(f.buffer_);
    return f;
  }

  /// The tensors in file order (ascending offsets).
  [[nodiscard]] const std::vector<entry>& entries() const noexcept { return entries_; }
  /// The tensor named `name`, or nullptr.
  [[nodiscard]] const entry* find(std::string_view name) const noexcept {
    const auto it = std::find_if(entries_.begin(), entries_.end(), [&](const entry& e) { return e.name == name; });
    return it == entries_.end() ? nullptr : &*it;
  }
  /// The `__metadata__` string map (empty when absent).
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /// The path the file was read from.
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
  std::vector<std::byte> buffer_;  // the data section
  std::vector<entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace ddp::safetensors

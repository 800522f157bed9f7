#pragma once
/// \file Reading gzip'd IDX files (MNIST, Fashion-MNIST) as Debian's dataset packages ship them.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <zlib.h>

#include <ddp/core/error.hpp>

namespace example {

/// Images (row-major, one float per pixel, normalized) and their labels.
struct image_set {
  std::vector<float> pixels;         ///< count × rows·cols values
  std::vector<std::uint8_t> labels;  ///< count labels
  std::size_t rows = 0, cols = 0;    ///< image size
  /// Number of images.
  [[nodiscard]] std::size_t size() const noexcept { return labels.size(); }
  /// Values per image.
  [[nodiscard]] std::size_t features() const noexcept { return rows * cols; }
};

namespace detail {

inline std::vector<std::uint8_t> gunzip(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path))
    throw ddp::io_error("dataset file '" + path.string() + "' does not exist; install the data set (apt-get install "
                        "dataset-fashion-mnist) or pass --data DIR with the {train,t10k}-*-ubyte.gz files");
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw ddp::io_error("cannot open '" + path.string() + "'; check its permissions");
  std::vector<std::uint8_t> out;
  std::uint8_t chunk[1 << 16];
  int n = 0;
  while ((n = gzread(f, chunk, sizeof chunk)) > 0) out.insert(out.end(), chunk, chunk + n);
  int err = Z_OK;
  const std::string what = n < 0 ? gzerror(f, &err) : "";
  gzclose(f);
  if (n < 0)
    throw ddp::io_error("'" + path.string() + "' is not a valid gzip file (" + what +
                        "); reinstall it (apt-get install --reinstall dataset-fashion-mnist)");
  return out;
}

inline std::uint32_t big_endian(const std::vector<std::uint8_t>& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) | (std::uint32_t{b[at + 2]} << 8) | b[at + 3];
}

/// The payload of an IDX file of unsigned bytes with `dims` dimensions, checked against its header.
inline std::vector<std::uint8_t> read_idx(const std::filesystem::path& path, std::size_t dims, std::vector<std::size_t>& shape) {
  auto raw = gunzip(path);
  const std::size_t header = 4 + 4 * dims;
  const auto corrupt = [&](const std::string& why) {
    return ddp::io_error("'" + path.string() + "' is not an IDX file of " + std::to_string(dims) + " dimension(s): " +
                         why + "; reinstall the data set (apt-get install --reinstall dataset-fashion-mnist)");
  };
  if (raw.size() < header) throw corrupt("it is shorter than its header");
  if (big_endian(raw, 0) != (0x0800U | dims)) throw corrupt("its magic number is wrong");
  std::size_t count = 1;
  shape.clear();
  for (std::size_t d = 0; d < dims; ++d) {
    shape.push_back(big_endian(raw, 4 + 4 * d));
    count *= shape.back();
  }
  if (raw.size() != header + count) throw corrupt("its payload has " + std::to_string(raw.size() - header) +
                                                  " bytes, not the " + std::to_string(count) + " its header declares");
  return {raw.begin() + static_cast<std::ptrdiff_t>(header), raw.end()};
}

}  // namespace detail

/// Reads `<dir>/<split>-images-idx3-ubyte.gz` and `<dir>/<split>-labels-idx1-ubyte.gz` (split: "train" or "t10k"),
/// scaling pixels to [0, 1] and standardizing with `mean` and `stddev`. Throws ddp::io_error with the fix.
inline image_set load_idx_split(const std::filesystem::path& dir, const std::string& split, float mean, float stddev) {
  std::vector<std::size_t> image_shape, label_shape;
  const auto pixels = detail::read_idx(dir / (split + "-images-idx3-ubyte.gz"), 3, image_shape);
  auto labels = detail::read_idx(dir / (split + "-labels-idx1-ubyte.gz"), 1, label_shape);
  if (image_shape[0] != label_shape[0])
    throw ddp::io_error("'" + split + "' has " + std::to_string(image_shape[0]) + " images but " +
                        std::to_string(label_shape[0]) + " labels in " + dir.string() + "; reinstall the data set");
  image_set s;
  s.rows = image_shape[1];
  s.cols = image_shape[2];
  s.labels = std::move(labels);
  s.pixels.resize(pixels.size());
  for (std::size_t i = 0; i < pixels.size(); ++i) s.pixels[i] = (static_cast<float>(pixels[i]) / 255.0F - mean) / stddev;
  return s;
}

/// Fashion-MNIST's two splits.
struct fashion_mnist {
  image_set train;  ///< the training images
  image_set test;   ///< the test images
};
/// Fashion-MNIST's training and test splits from `dir`, standardized with the training set's mean and deviation;
/// the training split cut to its first `limit` images (0: all).
inline fashion_mnist load_fashion_mnist(const std::filesystem::path& dir, std::size_t limit) {
  fashion_mnist d{load_idx_split(dir, "train", 0.2860F, 0.3530F), load_idx_split(dir, "t10k", 0.2860F, 0.3530F)};
  if (limit > 0 && limit < d.train.size()) {
    d.train.labels.resize(limit);
    d.train.pixels.resize(limit * d.train.features());
  }
  return d;
}

/// The rows of `data` at `indices`, packed into `x` and `y`.
inline void gather_batch(const image_set& data, std::span<const std::size_t> indices, std::vector<float>& x,
                         std::vector<std::uint8_t>& y) {
  const std::size_t f = data.features();
  x.resize(indices.size() * f);
  y.resize(indices.size());
  for (std::size_t r = 0; r < indices.size(); ++r) {
    std::copy_n(data.pixels.begin() + static_cast<std::ptrdiff_t>(indices[r] * f), f,
                x.begin() + static_cast<std::ptrdiff_t>(r * f));
    y[r] = data.labels[indices[r]];
  }
}

}  // namespace example

#pragma once
// ddp: data-parallel training for any C++ model, as one header.
// Generated from include/ddp/ddp.hpp, include/ddp/checkpoint.hpp, include/ddp/log.hpp, include/ddp/launch.hpp
// by scripts/amalgamate.py; do not edit.
// Regenerate with: python3 scripts/amalgamate.py
// The MPI and NCCL backends are compiled in when DDP_WITH_MPI / DDP_WITH_NCCL are defined
// (the ddp::mpi and ddp::nccl CMake targets define them), exactly as with include/.
// ---- begin <ddp/ddp.hpp>
/// \file Training: models and parameters (core), communicators (comm), memory domains and staging device tensors
/// through the host (memory), the data_parallel wrapper and its policies (parallel), optimizers (optim), the
/// sampler and metric reduction (data). Backends that need a
/// library (MPI, NCCL) are included when their CMake target (ddp::mpi, ddp::nccl) defines DDP_WITH_MPI /
/// DDP_WITH_NCCL. Checkpoints, logging and the launcher have their own umbrella headers:
/// <ddp/checkpoint.hpp>, <ddp/log.hpp>, <ddp/launch.hpp>.

// ---- begin <ddp/core/device.hpp>
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
// ---- end <ddp/core/device.hpp>
// ---- begin <ddp/core/dtype.hpp>
/// \file Element types: the dtype enumeration and CPU bfloat16/float16 value types.

#include <bit>
#include <cstddef>
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
// ---- end <ddp/core/dtype.hpp>
// ---- begin <ddp/core/error.hpp>
/// \file Error hierarchy: every failure the library reports derives from ddp::error.

#include <stdexcept>
#include <utility>

namespace ddp {

/// Base of every exception the library throws; carries the reporting rank and the backend's native code.
class error : public std::runtime_error {
 public:
  /// Builds "ddp [rank R]: message"; rank < 0 means "not known yet".
  explicit error(std::string message, int rank = -1, int native_code = 0)
      : std::runtime_error(format(message, rank)), message_(std::move(message)), rank_(rank), code_(native_code) {}

  /// The rank that raised the error, or -1 when it is not known.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The backend's own error code (errno, MPI error class, ncclResult_t, cudaError_t), 0 when none.
  [[nodiscard]] int native_code() const noexcept { return code_; }
  /// The message without the rank prefix.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  static std::string format(const std::string& message, int rank) {
    return rank < 0 ? "ddp: " + message : "ddp [rank " + std::to_string(rank) + "]: " + message;
  }
  std::string message_;
  int rank_;
  int code_;
};

/// An operation did not complete within its deadline.
class timeout_error : public error {
 public:
  using error::error;
};

/// A peer closed its connection or died; peer() names it.
class peer_lost : public error {
 public:
  /// `peer` is the rank that went away, as seen from `rank`.
  peer_lost(std::string message, int rank, int peer, int native_code = 0)
      : error(std::move(message), rank, native_code), peer_(peer) {}
  /// The rank that was lost.
  [[nodiscard]] int peer() const noexcept { return peer_; }

 private:
  int peer_;
};

/// Ranks disagree: different collectives, models, shapes or dtypes.
class mismatch_error : public error {
 public:
  using error::error;
};

/// An MPI call failed; native_code() is the MPI error code.
class mpi_error : public error {
 public:
  using error::error;
};

/// An NCCL call failed; native_code() is the ncclResult_t.
class nccl_error : public error {
 public:
  using error::error;
};

/// A CUDA runtime call failed; native_code() is the cudaError_t.
class cuda_error : public error {
 public:
  using error::error;
};

/// The configuration (environment variables, arguments, files) is wrong.
class config_error : public error {
 public:
  using error::error;
};

/// A file (checkpoint, dataset) is missing, truncated or corrupt.
class io_error : public error {
 public:
  using error::error;
};

}  // namespace ddp
// ---- end <ddp/core/error.hpp>
// ---- begin <ddp/core/parameter.hpp>
/// \file ddp::parameter: a trainable tensor (value and gradient) whose storage can live in an external arena.

#include <algorithm>
#include <functional>
#include <numeric>
#include <span>
#include <vector>

// ---- begin <ddp/core/storage_traits.hpp>
/// \file ddp::storage_traits: the customization point that lets a model hand ddp any trainable tensor type.
///
/// A leaf is one trainable tensor: values and a gradient of the same shape. `storage_traits<T>` tells ddp
/// its element type, shape and where its elements are now; a type that can point at outside memory also
/// says how (`adopt`), and ddp then lays it straight into its flat arenas (zero copies). A type that cannot
/// (an owning matrix, a std::vector) keeps its own memory: ddp copies its gradient in when it is reported
/// and its values out after every change (the broadcast at construction, each step, a checkpoint load).
///
/// Required members of a specialization:
///   static ddp::dtype dtype(const T&);                  element type
///   static std::vector<std::size_t> shape(const T&);    shape, outermost first (row-major order)
///   static void* values(T&);                            the values now (host, contiguous)
///   static void* grads(T&);                             the gradient now (same size)
/// Optional members:
///   static void adopt(T&, void* values, void* grads);   points the leaf at outside memory, copying nothing
///   static void release(T&);                            after adopt: takes the values into storage of its
///                                                       own (without it, ddp copies them back to where
///                                                       values()/grads() pointed first and adopts that)
///   static void vacate(T&, void* values, void* grads);  full_shard: the leaf's unit is sharded, so `values`
///                                                       (its place, zeros) are not its values; the leaf is
///                                                       pointed there but made unusable until the next
///                                                       adopt, so a computation outside an unshard scope
///                                                       fails instead of reading zeros (without it, ddp
///                                                       adopts `values`)
///   static ddp::device device(const T&);                where the elements live (default: host memory)
///   static const void* key(const T&);                   the address gradient_ready knows it by (default &t)
///   static std::shared_ptr<void> watch(T&, std::function<void()> ready);  leaves whose framework knows when a
///                                                       gradient is final call ready() then (autograd)
///   static constexpr bool view = true;                  the leaf refers to the model's memory and is handed
///                                                       out as a temporary (ddp keeps a copy of it)

#include <memory>


namespace ddp {

/// Specialize for a trainable tensor type (see this header's description for the members).
template <class T>
struct storage_traits;

/// A type whose storage_traits describe a trainable tensor: a leaf of the model tree.
template <class T>
concept storage_leaf = requires(std::remove_cvref_t<T>& t, const std::remove_cvref_t<T>& c) {
  { storage_traits<std::remove_cvref_t<T>>::dtype(c) } -> std::same_as<ddp::dtype>;
  { storage_traits<std::remove_cvref_t<T>>::shape(c) } -> std::convertible_to<std::vector<std::size_t>>;
  { storage_traits<std::remove_cvref_t<T>>::values(t) } -> std::convertible_to<void*>;
  { storage_traits<std::remove_cvref_t<T>>::grads(t) } -> std::convertible_to<void*>;
};

/// A leaf that can point at ddp's memory (zero-copy).
template <class T>
concept adopting_leaf = storage_leaf<T> && requires(std::remove_cvref_t<T>& t, void* p) {
  storage_traits<std::remove_cvref_t<T>>::adopt(t, p, p);
};

/// A leaf that reports its own gradients (its framework calls back when each is final).
template <class T>
concept watching_leaf = storage_leaf<T> && requires(std::remove_cvref_t<T>& t, std::function<void()> f) {
  { storage_traits<std::remove_cvref_t<T>>::watch(t, f) } -> std::convertible_to<std::shared_ptr<void>>;
};

/// The address data_parallel::gradient_ready knows a leaf (or the object a leaf refers to) by.
template <class T>
const void* leaf_key(const T& t) noexcept {
  if constexpr (requires { storage_traits<T>::key(t); })
    return storage_traits<T>::key(t);
  else
    return static_cast<const void*>(&t);
}

/// True when visitors hand the leaf out as a temporary view of the model's memory (ddp keeps a copy).
template <class T>
inline constexpr bool leaf_is_view = [] {
  if constexpr (requires { storage_traits<T>::view; })
    return storage_traits<T>::view;
  else
    return false;
}();

}  // namespace ddp
// ---- end <ddp/core/storage_traits.hpp>
// ---- begin <ddp/core/tensor_traits.hpp>
/// \file tensor_traits: the customization point that tells the library where a tensor keeps its elements.


// ---- begin <ddp/core/detail/blocked.hpp>
/// \file ddp::detail::for_each_blocked: an element loop the compiler vectorizes also at -O2, for the conversions
/// between f32 and the 16-bit floats (mixed precision's masters, the compression hooks' buckets).


namespace ddp::detail {

/// Calls f(i) for every i below n, in blocks of 16 with a fixed trip count, which compilers vectorize also at -O2
/// (GCC's cost model there refuses a loop of unknown length but takes a fixed block): narrowing f32 to bf16 runs
/// several times faster than over the plain loop.
template <class F>
void for_each_blocked(std::size_t n, F&& f) {
  constexpr std::size_t block = 16;
  std::size_t i = 0;
  for (; i + block <= n; i += block)
    for (std::size_t k = 0; k < block; ++k) f(i + k);
  for (; i < n; ++i) f(i);
}

}  // namespace ddp::detail
// ---- end <ddp/core/detail/blocked.hpp>

namespace ddp {

/// Specialize for a tensor type: static data(t), size(t) (elements), dtype(t) and device(t); optionally
/// shape(t) (a std::vector<std::size_t>, outermost first; default {size(t)}) and adopt(t, void*) for types that
/// can be pointed at outside memory without copying (spans, maps), which ddp::trainable lays zero-copy.
template <class T>
struct tensor_traits;

/// An untyped view of elements: pointer, element count, dtype and device (a "raw buffer").
struct raw_tensor {
  void* data = nullptr;           ///< first element
  std::size_t size = 0;           ///< number of elements
  ddp::dtype type = dtype::f32;   ///< element type
  ddp::device where{};            ///< where the elements live

  /// Views a typed span of host memory.
  template <element E>
  static raw_tensor of(std::span<E> s, ddp::device d = device::cpu()) noexcept {
    return {const_cast<std::remove_const_t<E>*>(s.data()), s.size(), dtype_v<E>, d};
  }
  /// Bytes covered.
  [[nodiscard]] std::size_t bytes() const noexcept { return size * size_of(type); }
};

template <element E>
struct tensor_traits<std::vector<E>> {
  static E* data(std::vector<E>& t) noexcept { return t.data(); }
  static const E* data(const std::vector<E>& t) noexcept { return t.data(); }
  static std::size_t size(const std::vector<E>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const std::vector<E>&) noexcept { return dtype_v<E>; }
  static constexpr ddp::device device(const std::vector<E>&) noexcept { return device::cpu(); }
};

template <class E, std::size_t Extent>
  requires element<std::remove_const_t<E>>
struct tensor_traits<std::span<E, Extent>> {
  static E* data(std::span<E, Extent> t) noexcept { return t.data(); }
  static std::size_t size(std::span<E, Extent> t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(std::span<E, Extent>) noexcept { return dtype_v<std::remove_const_t<E>>; }
  static constexpr ddp::device device(std::span<E, Extent>) noexcept { return device::cpu(); }
  static void adopt(std::span<E, Extent>& t, void* p) noexcept { t = std::span<E, Extent>(static_cast<E*>(p), t.size()); }
};

template <>
struct tensor_traits<raw_tensor> {
  static void* data(const raw_tensor& t) noexcept { return t.data; }
  static std::size_t size(const raw_tensor& t) noexcept { return t.size; }
  static ddp::dtype dtype(const raw_tensor& t) noexcept { return t.type; }
  static ddp::device device(const raw_tensor& t) noexcept { return t.where; }
};

/// A type whose tensor_traits tell where its elements are.
template <class T>
concept tensor = requires(const std::remove_cvref_t<T>& t) {
  tensor_traits<std::remove_cvref_t<T>>::data(t);
  { tensor_traits<std::remove_cvref_t<T>>::size(t) } -> std::convertible_to<std::size_t>;
  { tensor_traits<std::remove_cvref_t<T>>::dtype(t) } -> std::same_as<ddp::dtype>;
  { tensor_traits<std::remove_cvref_t<T>>::device(t) } -> std::same_as<ddp::device>;
};

/// Untyped view of any tensor, through its tensor_traits.
template <tensor T>
raw_tensor as_raw(T&& t) {
  using traits = tensor_traits<std::remove_cvref_t<T>>;
  return {const_cast<void*>(static_cast<const void*>(traits::data(t))), traits::size(t), traits::dtype(t),
          traits::device(t)};
}

static_assert(tensor<std::vector<float>> && tensor<std::span<const bfloat16>> && tensor<raw_tensor>);

namespace detail {
/// Copies the host elements of `from` into `to` (same length), converting each to `to`'s dtype (16-bit floats
/// through float, rounding to nearest even; a NaN stays a NaN), in blocks that vectorize (for_each_blocked).
inline void convert(raw_tensor from, raw_tensor to) {
  visit_dtype(from.type, [&]<class F>(F) {
    visit_dtype(to.type, [&]<class T>(T) {
      using wide = std::conditional_t<sizeof(F) == 2 || sizeof(T) == 2, float, double>;
      const F* src = static_cast<const F*>(from.data);
      T* dst = static_cast<T*>(to.data);
      for_each_blocked(from.size, [&](std::size_t i) { dst[i] = static_cast<T>(static_cast<wide>(src[i])); });
    });
  });
}
}  // namespace detail

}  // namespace ddp
// ---- end <ddp/core/tensor_traits.hpp>

namespace ddp {

/// A trainable tensor: value and gradient of the same shape. It owns host storage until bind()
/// points it at an external flat arena (the wrapper's), which makes buckets zero-copy slices.
template <element T = float>
class parameter {
 public:
  using value_type = T;  ///< element type

  parameter() = default;
  /// A host parameter of `shape`, values and gradient zero.
  explicit parameter(std::vector<std::size_t> shape)
      : shape_(std::move(shape)), value_store_(numel_of(shape_)), grad_store_(value_store_.size()) {
    point_at_own_storage();
  }
  /// A host parameter of `shape` holding `values` (sizes must agree).
  parameter(std::vector<std::size_t> shape, std::vector<T> values) : parameter(std::move(shape)) {
    if (values.size() != value_store_.size())
      throw config_error("parameter: " + std::to_string(values.size()) + " values given for a shape of " +
                         std::to_string(value_store_.size()) + " elements; pass exactly one value per element");
    value_store_ = std::move(values);
    point_at_own_storage();
  }

  /// Copies take the values and gradient into storage of their own.
  parameter(const parameter& other) : shape_(other.shape_), device_(other.device_) {
    value_store_.assign(other.value().begin(), other.value().end());
    grad_store_.assign(other.grad().begin(), other.grad().end());
    point_at_own_storage();
  }
  parameter& operator=(const parameter& other) {
    if (this != &other) *this = parameter(other);
    return *this;
  }
  parameter(parameter&& other) noexcept { swap(other); }
  parameter& operator=(parameter&& other) noexcept {
    parameter moved(std::move(other));
    swap(moved);
    return *this;
  }
  ~parameter() = default;

  /// The values.
  [[nodiscard]] std::span<T> value() noexcept { return {value_, numel_}; }
  /// The values, read-only.
  [[nodiscard]] std::span<const T> value() const noexcept { return {value_, numel_}; }
  /// The gradient.
  [[nodiscard]] std::span<T> grad() noexcept { return {grad_, numel_}; }
  /// The gradient, read-only.
  [[nodiscard]] std::span<const T> grad() const noexcept { return {grad_, numel_}; }
  /// The shape, outermost dimension first.
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }
  /// Number of elements.
  [[nodiscard]] std::size_t numel() const noexcept { return numel_; }
  /// Where value and gradient live.
  [[nodiscard]] ddp::device device() const noexcept { return device_; }
  /// True while the storage is an external arena's.
  [[nodiscard]] bool bound() const noexcept { return value_store_.empty() && numel_ > 0; }

  /// Moves value and gradient into external storage (`numel()` elements each, on `where`); the
  /// current host values are copied there when `copy_values` and both sides are host memory.
  void bind(T* value_storage, T* grad_storage, ddp::device where = device::cpu(), bool copy_values = true) {
    if (copy_values && !where.is_cuda() && !device_.is_cuda()) {
      std::copy_n(value_, numel_, value_storage);
      std::copy_n(grad_, numel_, grad_storage);
    }
    value_store_ = std::vector<T>();  // move-assign frees the capacity (= {} would keep it)
    grad_store_ = std::vector<T>();
    value_ = value_storage;
    grad_ = grad_storage;
    device_ = where;
  }
  /// Takes host values back into storage of its own (the arena is about to go away).
  void unbind() {
    if (!bound()) return;
    if (device_.is_cuda())
      throw config_error("parameter::unbind: a CUDA parameter cannot be copied back by the core; "
                         "copy it to the host with the CUDA helpers first");
    value_store_.assign(value_, value_ + numel_);
    grad_store_.assign(grad_, grad_ + numel_);
    point_at_own_storage();
  }
  /// Sets every gradient element to zero (host parameters).
  void zero_grad() noexcept { std::fill_n(grad_, numel_, T{}); }

 private:
  static std::size_t numel_of(const std::vector<std::size_t>& shape) {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>{});
  }
  void point_at_own_storage() noexcept {
    numel_ = value_store_.size();
    value_ = value_store_.data();
    grad_ = grad_store_.data();
  }
  void swap(parameter& other) noexcept {
    std::swap(shape_, other.shape_);
    std::swap(device_, other.device_);
    std::swap(value_store_, other.value_store_);
    std::swap(grad_store_, other.grad_store_);
    std::swap(value_, other.value_);
    std::swap(grad_, other.grad_);
    std::swap(numel_, other.numel_);
  }

  std::vector<std::size_t> shape_;
  ddp::device device_{};
  std::vector<T> value_store_;
  std::vector<T> grad_store_;
  T* value_ = nullptr;
  T* grad_ = nullptr;
  std::size_t numel_ = 0;
};

/// tensor_traits of a parameter describe its values.
template <element E>
struct tensor_traits<parameter<E>> {
  static const E* data(const parameter<E>& p) noexcept { return p.value().data(); }
  static std::size_t size(const parameter<E>& p) noexcept { return p.numel(); }
  static constexpr ddp::dtype dtype(const parameter<E>&) noexcept { return dtype_v<E>; }
  static ddp::device device(const parameter<E>& p) noexcept { return p.device(); }
};

/// storage_traits of a parameter: it adopts the arena (bind) and takes its values back (unbind).
template <element E>
struct storage_traits<parameter<E>> {
  static constexpr ddp::dtype dtype(const parameter<E>&) noexcept { return dtype_v<E>; }
  static std::vector<std::size_t> shape(const parameter<E>& p) { return p.shape(); }
  static ddp::device device(const parameter<E>& p) noexcept { return p.device(); }
  static void* values(parameter<E>& p) noexcept { return p.value().data(); }
  static void* grads(parameter<E>& p) noexcept { return p.grad().data(); }
  static void adopt(parameter<E>& p, void* values, void* grads) {
    p.bind(static_cast<E*>(values), static_cast<E*>(grads), device::cpu(), false);
  }
  static void release(parameter<E>& p) { p.unbind(); }
};

static_assert(tensor<parameter<float>>);
static_assert(adopting_leaf<parameter<float>>);

}  // namespace ddp
// ---- end <ddp/core/parameter.hpp>
// ---- begin <ddp/core/trainable.hpp>
/// \file ddp::trainable: a leaf made of two tensors a model already keeps, its values and its gradient.



namespace ddp {

namespace detail {
template <class T>
concept adoptable_tensor = requires(T& t, void* p) { tensor_traits<T>::adopt(t, p); };
}  // namespace detail

/// A trainable tensor whose values and gradient are two tensors of the model (std::vector, std::span, an
/// adapter's matrix type...). Hand it from a visitor: `f("fc1.weight", ddp::trainable(w, dw, {out, in}))`.
/// It refers to both (they must outlive the wrapper); where both types can adopt outside memory (spans, maps)
/// ddp lays them zero-copy, otherwise it copies gradients in and values out at the step's edges.
template <tensor V, tensor G = V>
class trainable {
 public:
  /// Refers to `values` and `grads` (same element type and count); `shape` defaults to the tensor's own
  /// shape (or one dimension of all its elements).
  trainable(V& values, G& grads, std::vector<std::size_t> shape = {})
      : values_(&values), grads_(&grads), shape_(std::move(shape)) {
    if (shape_.empty()) {
      if constexpr (requires { tensor_traits<V>::shape(values); })
        shape_ = tensor_traits<V>::shape(values);
      else
        shape_ = {tensor_traits<V>::size(values)};
    }
    std::size_t n = 1;
    for (const auto d : shape_) n *= d;
    const auto v = as_raw(values), g = as_raw(grads);
    if (v.type != g.type || v.size != g.size || v.size != n)
      throw config_error("ddp::trainable: values (" + std::string(to_string(v.type)) + ", " + std::to_string(v.size) +
                         " elements), gradient (" + std::string(to_string(g.type)) + ", " + std::to_string(g.size) +
                         " elements) and shape (" + std::to_string(n) + " elements) disagree; give a gradient of "
                         "the values' type and size, and a shape whose product is their size");
  }
  /// The values.
  [[nodiscard]] V& values() const noexcept { return *values_; }
  /// The gradient.
  [[nodiscard]] G& grads() const noexcept { return *grads_; }
  /// The shape, outermost first.
  [[nodiscard]] const std::vector<std::size_t>& shape() const noexcept { return shape_; }

 private:
  V* values_;
  G* grads_;
  std::vector<std::size_t> shape_;
};

template <class V, class G>
trainable(V&, G&) -> trainable<V, G>;
template <class V, class G>
trainable(V&, G&, std::vector<std::size_t>) -> trainable<V, G>;

/// storage_traits of a trainable: through its two tensors' tensor_traits; adopting when both can adopt.
template <class V, class G>
struct storage_traits<trainable<V, G>> {
  static constexpr bool view = true;
  static ddp::dtype dtype(const trainable<V, G>& t) { return tensor_traits<V>::dtype(t.values()); }
  static std::vector<std::size_t> shape(const trainable<V, G>& t) { return t.shape(); }
  static ddp::device device(const trainable<V, G>& t) { return tensor_traits<V>::device(t.values()); }
  static void* values(const trainable<V, G>& t) { return as_raw(t.values()).data; }
  static void* grads(const trainable<V, G>& t) { return as_raw(t.grads()).data; }
  static const void* key(const trainable<V, G>& t) noexcept { return &t.values(); }
  static void adopt(const trainable<V, G>& t, void* values, void* grads)
    requires(detail::adoptable_tensor<V> && detail::adoptable_tensor<G>)
  {
    tensor_traits<V>::adopt(t.values(), values);
    tensor_traits<G>::adopt(t.grads(), grads);
  }
};

static_assert(storage_leaf<trainable<std::vector<float>>> && !adopting_leaf<trainable<std::vector<float>>>);
static_assert(adopting_leaf<trainable<std::span<float>>>);

}  // namespace ddp
// ---- end <ddp/core/trainable.hpp>
// ---- begin <ddp/core/visit.hpp>
/// \file ddp::visit_parameters: walks every parameter of a model, giving dotted names ("fc1.weight").
///
/// Lookup order for a node of the model tree: a type with ddp::storage_traits (ddp::parameter,
/// ddp::trainable, an adapter's tensor) is a leaf; else a ddp::parameter_visitor specialization (an adapter's
/// module class, e.g. torch::nn::Module); else a member
/// `visit_parameters(f)`; else an ADL `visit_parameters(node, f)`; else a std::array or std::vector
/// of nodes (names "0", "1", ...); else recursion over the fields of an aggregate. The
/// callback a visitor receives may be given parameters or whole sub-modules: both are walked.

#include <array>

// ---- begin <ddp/core/detail/dependent_false.hpp>
/// \file dependent_false: a false that depends on a template argument, for static_asserts in templates.

namespace ddp::detail {
template <class>
inline constexpr bool dependent_false = false;
}  // namespace ddp::detail
// ---- end <ddp/core/detail/dependent_false.hpp>
// ---- begin <ddp/core/detail/reflect.hpp>
/// \file Minimal aggregate reflection: field count, field references and field names (g++ >= 12, clang >= 15).
///
/// Boost.PFR 1.81 (Debian 12) makes g++ 12 fail with an internal compiler error on aggregates that
/// hold std::array fields, and it cannot name fields; this header does both with standard C++20.

#include <tuple>

// ---- begin <ddp/core/detail/reflect_tie.hpp>
/// \file Generated by scripts/gen_reflect_tie.py; do not edit. Ties the fields of an aggregate.


namespace ddp::detail {

/// Largest aggregate field count reflected.
inline constexpr std::size_t max_reflected_fields = 48;

/// A tuple of references to the N fields of aggregate `t`.
template <std::size_t N, class T>
constexpr auto tie_fields(T& t) noexcept {
  if constexpr (N == 0) {
    return std::tuple<>{};
  } else if constexpr (N == 1) {
    auto& [f0] = t;
    return std::tie(f0);
  } else if constexpr (N == 2) {
    auto& [f0, f1] = t;
    return std::tie(f0, f1);
  } else if constexpr (N == 3) {
    auto& [f0, f1, f2] = t;
    return std::tie(f0, f1, f2);
  } else if constexpr (N == 4) {
    auto& [f0, f1, f2, f3] = t;
    return std::tie(f0, f1, f2, f3);
  } else if constexpr (N == 5) {
    auto& [f0, f1, f2, f3, f4] = t;
    return std::tie(f0, f1, f2, f3, f4);
  } else if constexpr (N == 6) {
    auto& [f0, f1, f2, f3, f4, f5] = t;
    return std::tie(f0, f1, f2, f3, f4, f5);
  } else if constexpr (N == 7) {
    auto& [f0, f1, f2, f3, f4, f5, f6] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6);
  } else if constexpr (N == 8) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7);
  } else if constexpr (N == 9) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8);
  } else if constexpr (N == 10) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9);
  } else if constexpr (N == 11) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10);
  } else if constexpr (N == 12) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11);
  } else if constexpr (N == 13) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12);
  } else if constexpr (N == 14) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13);
  } else if constexpr (N == 15) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14);
  } else if constexpr (N == 16) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15);
  } else if constexpr (N == 17) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16);
  } else if constexpr (N == 18) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17);
  } else if constexpr (N == 19) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18);
  } else if constexpr (N == 20) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19);
  } else if constexpr (N == 21) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20);
  } else if constexpr (N == 22) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21);
  } else if constexpr (N == 23) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22);
  } else if constexpr (N == 24) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23);
  } else if constexpr (N == 25) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24);
  } else if constexpr (N == 26) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25);
  } else if constexpr (N == 27) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26);
  } else if constexpr (N == 28) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27);
  } else if constexpr (N == 29) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28);
  } else if constexpr (N == 30) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29);
  } else if constexpr (N == 31) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30);
  } else if constexpr (N == 32) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31);
  } else if constexpr (N == 33) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32);
  } else if constexpr (N == 34) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33);
  } else if constexpr (N == 35) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34);
  } else if constexpr (N == 36) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35);
  } else if constexpr (N == 37) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36);
  } else if constexpr (N == 38) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37);
  } else if constexpr (N == 39) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38);
  } else if constexpr (N == 40) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39);
  } else if constexpr (N == 41) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40);
  } else if constexpr (N == 42) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41);
  } else if constexpr (N == 43) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42);
  } else if constexpr (N == 44) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43);
  } else if constexpr (N == 45) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44);
  } else if constexpr (N == 46) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45);
  } else if constexpr (N == 47) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45, f46] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45, f46);
  } else if constexpr (N == 48) {
    auto& [f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45, f46, f47] = t;
    return std::tie(f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11, f12, f13, f14, f15, f16, f17, f18, f19, f20, f21, f22, f23, f24, f25, f26, f27, f28, f29, f30, f31, f32, f33, f34, f35, f36, f37, f38, f39, f40, f41, f42, f43, f44, f45, f46, f47);
  } else {
    static_assert(N <= max_reflected_fields, "ddp: this aggregate has more fields than the reflection "
                  "supports; give it a member visit_parameters(f) instead.");
  }
}

}  // namespace ddp::detail
// ---- end <ddp/core/detail/reflect_tie.hpp>

namespace ddp::detail {

/// Converts to any field type; used to count how many initializers an aggregate accepts.
struct any_field {
  std::size_t index;
  template <class U>
  operator U&() const;  // NOLINT(google-explicit-constructor)
  template <class U>
  operator U&&() const;  // NOLINT(google-explicit-constructor)
};

template <class T, std::size_t... I>
concept brace_initializable_with = requires { T{any_field{I}...}; };

template <class T, std::size_t N>
consteval bool accepts_initializers() {
  return []<std::size_t... I>(std::index_sequence<I...>) {
    return brace_initializable_with<T, I...>;
  }(std::make_index_sequence<N>{});
}

template <class T, std::size_t N = 0>
consteval std::size_t count_fields_from() {
  if constexpr (N < max_reflected_fields + 1 && accepts_initializers<T, N + 1>())
    return count_fields_from<T, N + 1>();
  else
    return N;
}

/// True for the class types whose fields can be reflected.
template <class T>
concept reflectable_aggregate =
    std::is_class_v<T> && std::is_aggregate_v<T> && !std::is_union_v<T> && std::is_default_constructible_v<T>;

/// Number of fields of aggregate T.
template <reflectable_aggregate T>
inline constexpr std::size_t field_count_v = count_fields_from<T>();

/// Field I of aggregate `t`, by reference.
template <std::size_t I, class T>
constexpr auto& get_field(T& t) noexcept {
  return std::get<I>(tie_fields<field_count_v<std::remove_cv_t<T>>>(t));
}

/// Type of field I of aggregate T.
template <std::size_t I, class T>
using field_type_t = std::remove_cvref_t<decltype(get_field<I>(std::declval<T&>()))>;

template <class T>
extern const T reflected_object;

template <auto FieldAddress>
consteval std::string_view signature_naming() {
  return __PRETTY_FUNCTION__;
}

/// Name of field I of aggregate T, read from the compiler's spelling of a pointer to that field.
template <class T, std::size_t I>
consteval std::string_view field_name() {
  constexpr std::string_view text = signature_naming<&get_field<I>(reflected_object<T>)>();
  constexpr auto end = text.rfind(')');
  constexpr auto start = text.substr(0, end).find_last_of(":.") + 1;
  return text.substr(start, end - start);
}

/// Calls `f(name, field)` for each field of aggregate `t`, in declaration order.
template <class T, class F>
constexpr void for_each_field(T& t, F&& f) {
  using plain = std::remove_cv_t<T>;
  auto fields = tie_fields<field_count_v<plain>>(t);
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (f(field_name<plain, I>(), std::get<I>(fields)), ...);
  }(std::make_index_sequence<field_count_v<plain>>{});
}

}  // namespace ddp::detail
// ---- end <ddp/core/detail/reflect.hpp>

namespace ddp {

/// Specialize for model types of a framework (an adapter's module class) with
///   template <class F> static void visit(M& m, F&& f);          f(name, leaf) for each trainable tensor
/// and optionally
///   template <class F> static void visit_buffers(M& m, F&& f);  f(name, ddp::raw_tensor) for the state that
///                                                               is not trained but must match across ranks
/// (data_parallel broadcasts it from rank 0 at construction, as PyTorch's DDP broadcasts module buffers).
template <class M>
struct parameter_visitor {};

namespace detail {

/// A callback of the shape visitors are called with; used to detect visitors.
struct probe_visitor {
  template <class P>
  void operator()(std::string_view, P&&) const {}
};

template <class M>
concept has_parameter_visitor = requires(M& m, probe_visitor f) { parameter_visitor<M>::visit(m, f); };

template <class M>
concept has_member_visitor = requires(M& m, probe_visitor f) { m.visit_parameters(f); };

template <class M>
concept has_adl_visitor = requires(M& m, probe_visitor f) { visit_parameters(m, f); };

template <class T>
struct is_sequence : std::false_type {};
template <class E, std::size_t N>
struct is_sequence<std::array<E, N>> : std::true_type { using element = E; };
template <class E, class A>
struct is_sequence<std::vector<E, A>> : std::true_type { using element = E; };

template <class T>
constexpr bool node_has_parameters();

/// A framework's tensor or matrix type (elements and rows/cols, or data_ptr and grad) without storage_traits.
template <class T>
concept tensor_lookalike = !storage_leaf<T> && (requires(T& t) {
                                                  t.data();
                                                  t.rows();
                                                  t.cols();
                                                } || requires(T& t) {
                                                  t.data_ptr();
                                                  t.grad();
                                                });

/// Stops the build where the model holds `T` and ddp cannot train it; the compiler names T in this
/// function's instantiation.
template <class T>
constexpr bool no_storage_traits_for() {
  static_assert(dependent_false<T>,
                "ddp::visit_parameters: the model holds an object of a type ddp cannot train (the compiler names it "
                "as T in no_storage_traits_for<T> [with T = ...]). Include its adapter (<ddp/adapters/libtorch.hpp> "
                "for torch::Tensor and torch::nn::Module, <ddp/adapters/eigen.hpp> for Eigen matrices and maps), hand "
                "values and gradient together as ddp::trainable(values, grads), or specialize ddp::storage_traits<T>.");
  return true;
}

template <class T, std::size_t... I>
constexpr bool any_field_has_parameters(std::index_sequence<I...>) {
  return (node_has_parameters<field_type_t<I, T>>() || ...);
}

/// True when walking a T can reach a parameter (decided at compile time).
template <class T>
constexpr bool node_has_parameters() {
  if constexpr (storage_leaf<T> || has_parameter_visitor<T> || has_member_visitor<T> || has_adl_visitor<T>) {
    return true;
  } else if constexpr (tensor_lookalike<T>) {
    return no_storage_traits_for<T>();
  } else if constexpr (is_sequence<T>::value) {
    return node_has_parameters<typename is_sequence<T>::element>();
  } else if constexpr (reflectable_aggregate<T>) {
    return any_field_has_parameters<T>(std::make_index_sequence<field_count_v<T>>{});
  } else {
    return false;
  }
}

inline std::string join_name(std::string_view prefix, std::string_view name) {
  std::string out;
  out.reserve(prefix.size() + name.size() + 1);
  out.append(prefix);
  if (!prefix.empty() && !name.empty()) out.push_back('.');
  out.append(name);
  return out;
}

template <class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f);

template <class Node, class F>
void visit_node(Node& node, std::string_view prefix, F& f) {
  using plain = std::remove_cv_t<Node>;
  // A user's visitor is usually written for a mutable model; a const model is walked through it
  // and its parameters are handed on as const, so both give the same names.
  auto& mutable_node = const_cast<plain&>(node);
  auto descend = [&](std::string_view name, auto&& child) {
    if constexpr (std::is_const_v<Node>)
      visit_node(std::as_const(child), join_name(prefix, name), f);
    else
      visit_node(child, join_name(prefix, name), f);
  };
  if constexpr (storage_leaf<plain>) {
    f(prefix, node);
  } else if constexpr (has_parameter_visitor<plain>) {
    parameter_visitor<plain>::visit(mutable_node, descend);
  } else if constexpr (has_member_visitor<plain>) {
    mutable_node.visit_parameters(descend);
  } else if constexpr (has_adl_visitor<plain>) {
    visit_parameters(mutable_node, descend);
  } else if constexpr (is_sequence<plain>::value && node_has_parameters<plain>()) {
    for (std::size_t i = 0; i < node.size(); ++i) visit_node(node[i], join_name(prefix, std::to_string(i)), f);
  } else if constexpr (reflectable_aggregate<plain> && node_has_parameters<plain>()) {
    for_each_field(node, [&](std::string_view name, auto& field) {
      if constexpr (node_has_parameters<std::remove_cvref_t<decltype(field)>>())
        visit_node(field, join_name(prefix, name), f);
    });
  } else {
    no_storage_traits_for<plain>();
  }
}

struct visit_parameters_fn {
  template <class Model, class F>
  void operator()(Model& model, F&& f) const {
    static_assert(node_has_parameters<std::remove_cv_t<Model>>(),
                  "ddp::visit_parameters: this model has no parameters to visit. Give it a member "
                  "visit_parameters(f) calling f(name, leaf) for each trainable tensor (ddp::parameter, "
                  "ddp::trainable(values, grads), an adapter's tensor) or sub-module, an ADL "
                  "visit_parameters(model, f), or make it an aggregate whose fields are such leaves, "
                  "std::array/std::vector of layers, or such aggregates.");
    visit_node(model, std::string_view{}, f);
  }
};

/// Calls `f(name, ddp::raw_tensor)` for the buffers of `model` (its parameter_visitor's visit_buffers); does
/// nothing for a model without any.
template <class Model, class F>
void visit_buffers(Model& model, F&& f) {
  if constexpr (requires { parameter_visitor<Model>::visit_buffers(model, f); })
    parameter_visitor<Model>::visit_buffers(model, f);
}

}  // namespace detail

/// A model type in which ddp::visit_parameters finds at least one parameter.
template <class Model>
concept parameter_visitable = detail::node_has_parameters<std::remove_cv_t<Model>>();

inline namespace cpo {
/// Calls `f(dotted_name, parameter&)` for every parameter of `model`, in a stable order.
inline constexpr detail::visit_parameters_fn visit_parameters{};
}  // namespace cpo

}  // namespace ddp
// ---- end <ddp/core/visit.hpp>

// ---- begin <ddp/comm/backend.hpp>
/// \file Backend policy tags and the mappings between a tag and its communicator type.
/// Each backend's header specializes backend_traits for its tag (deriving from detail::backend_binding, which checks
/// the communicator against the concept); its communicator names its tag as `using backend_tag = ...;`.


// ---- begin <ddp/comm/communicator.hpp>
/// \file The ddp::communicator concept every backend (tcp, mpi, nccl) models.
///
/// Buffers are any ddp::tensor (std::span, std::vector, ddp::raw_tensor for device memory or a
/// runtime dtype). Sizes: with N = size(), reduce_scatter takes N*k elements in and gives k out;
/// all_gather takes k and gives N*k; gather and scatter use the N*k side on the root only;
/// all_to_all sends block i of its N*k input to rank i and receives block j from rank j. All
/// ranks of a group must call the same collectives in the same order with the same counts,
/// dtypes, operators and roots; a backend reports a difference as ddp::mismatch_error where it
/// can see it, and as ddp::timeout_error otherwise.

#include <concepts>

// ---- begin <ddp/comm/reduce_op.hpp>
/// \file Reduction operators of the collectives.


namespace ddp {

/// How all_reduce, reduce and reduce_scatter combine the ranks' elements (avg divides the sum by the group size).
enum class reduce_op : std::uint8_t { sum, avg, min, max, prod };

/// "sum", "avg", ...
constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::prod: return "prod";
  }
  return "?";
}

}  // namespace ddp
// ---- end <ddp/comm/reduce_op.hpp>
// ---- begin <ddp/comm/stats.hpp>
/// \file Always-on traffic statistics: bytes each communicator sends, by operation.

#include <atomic>

namespace ddp {

/// The operations a communicator counts.
enum class collective : std::uint8_t {
  all_reduce, reduce_scatter, all_gather, broadcast, reduce, gather, scatter, all_to_all, barrier, send_recv
};

/// Number of collective kinds.
inline constexpr std::size_t collective_count = 10;

/// "all_reduce", ...
constexpr std::string_view to_string(collective c) noexcept {
  constexpr std::array<std::string_view, collective_count> names{
      "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
      "gather",     "scatter",        "all_to_all", "barrier",   "send_recv"};
  return names[static_cast<std::size_t>(c)];
}

/// A snapshot of a communicator's counters.
struct comm_stats {
  std::array<std::uint64_t, collective_count> bytes_sent{};  ///< payload bytes this rank sent, by operation
  std::array<std::uint64_t, collective_count> calls{};       ///< operations started, by operation
  std::uint64_t call_checks = 0;  ///< cross-rank call checks exchanged (DDP_CHECK_COLLECTIVES=1), not counted above

  /// Bytes sent for operation `c`.
  [[nodiscard]] std::uint64_t bytes(collective c) const noexcept { return bytes_sent[static_cast<std::size_t>(c)]; }
  /// Operations `c` started.
  [[nodiscard]] std::uint64_t count(collective c) const noexcept { return calls[static_cast<std::size_t>(c)]; }
  /// Bytes sent for all operations.
  [[nodiscard]] std::uint64_t total_bytes() const noexcept {
    return std::accumulate(bytes_sent.begin(), bytes_sent.end(), std::uint64_t{0});
  }
};

namespace detail {

/// Thread-safe counters behind comm_stats; cheap enough to stay on always.
class stats_counter {
 public:
  void add_call(collective c) noexcept { calls_[index(c)].fetch_add(1, std::memory_order_relaxed); }
  void add_bytes(collective c, std::uint64_t n) noexcept { bytes_[index(c)].fetch_add(n, std::memory_order_relaxed); }
  void add_call_check() noexcept { call_checks_.fetch_add(1, std::memory_order_relaxed); }
  [[nodiscard]] comm_stats snapshot() const noexcept {
    comm_stats s;
    for (std::size_t i = 0; i < collective_count; ++i) {
      s.bytes_sent[i] = bytes_[i].load(std::memory_order_relaxed);
      s.calls[i] = calls_[i].load(std::memory_order_relaxed);
    }
    s.call_checks = call_checks_.load(std::memory_order_relaxed);
    return s;
  }
  void reset() noexcept {
    for (std::size_t i = 0; i < collective_count; ++i) {
      bytes_[i].store(0, std::memory_order_relaxed);
      calls_[i].store(0, std::memory_order_relaxed);
    }
    call_checks_.store(0, std::memory_order_relaxed);
  }

 private:
  static constexpr std::size_t index(collective c) noexcept { return static_cast<std::size_t>(c); }
  std::array<std::atomic<std::uint64_t>, collective_count> bytes_{};
  std::array<std::atomic<std::uint64_t>, collective_count> calls_{};
  std::atomic<std::uint64_t> call_checks_{0};
};

}  // namespace detail
}  // namespace ddp
// ---- end <ddp/comm/stats.hpp>
// ---- begin <ddp/comm/work.hpp>
/// \file ddp::work: the handle of an in-flight operation; errors and timeouts surface here.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>


namespace ddp {

namespace detail {

/// What a backend implements for one in-flight operation.
class work_state {
 public:
  using clock = std::chrono::steady_clock;
  virtual ~work_state() = default;
  /// Makes progress if the backend needs polling; true once complete. Rethrows the operation's error.
  virtual bool test() = 0;
  /// Blocks until complete or `deadline`; true once complete. Rethrows the operation's error.
  virtual bool wait_until(clock::time_point deadline) = 0;
  /// The deadline wait() applies, counted from its call.
  [[nodiscard]] virtual std::chrono::milliseconds timeout() const = 0;
  /// The rank that started the operation.
  [[nodiscard]] virtual int rank() const = 0;
  /// A phrase naming the operation, such as "all_reduce of 1024 f32 (sequence 17)".
  [[nodiscard]] virtual std::string describe() const = 0;
  /// The ranks the operation waits for right now ("rank 1, rank 3"), where the backend knows; else empty.
  [[nodiscard]] virtual std::string waiting_for() const { return {}; }
  /// Called once when wait() times out: what else the message should say (the flight recorder's view).
  virtual std::string diagnosis() { return {}; }
};

/// What a progress engine waits for while it stalls ("rank 1"); empty while it moves. The engine writes
/// it only after a stall, so the fast path never touches it; wait() reads it when it times out.
class stall_note {
 public:
  /// Publishes what the engine waits for now (empty: nothing, or it moves again).
  void set(std::string text) {
    std::lock_guard lock(mutex_);
    text_ = std::move(text);
  }
  /// What the engine waits for, as last published.
  [[nodiscard]] std::string get() const {
    std::lock_guard lock(mutex_);
    return text_;
  }

 private:
  mutable std::mutex mutex_;
  std::string text_;
};

/// A work_state completed from another thread (a progress engine) with finish() or fail().
class completion : public work_state {
 public:
  completion(int rank, std::chrono::milliseconds timeout, std::string what,
             std::shared_ptr<const stall_note> note = nullptr)
      : rank_(rank), timeout_(timeout), what_(std::move(what)), note_(std::move(note)) {}

  /// Marks the operation complete.
  void finish() {
    { std::lock_guard lock(mutex_); done_ = true; }
    cv_.notify_all();
  }
  /// Marks the operation failed with `e`.
  void fail(std::exception_ptr e) {
    { std::lock_guard lock(mutex_); error_ = std::move(e); done_ = true; }
    cv_.notify_all();
  }
  bool test() override {
    std::lock_guard lock(mutex_);
    return settled();
  }
  bool wait_until(clock::time_point deadline) override {
    std::unique_lock lock(mutex_);
    cv_.wait_until(lock, deadline, [&] { return done_; });
    return settled();
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return timeout_; }
  [[nodiscard]] int rank() const override { return rank_; }
  [[nodiscard]] std::string describe() const override { return what_; }
  [[nodiscard]] std::string waiting_for() const override { return note_ ? note_->get() : std::string(); }

 private:
  bool settled() const {
    if (error_) std::rethrow_exception(error_);
    return done_;
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::string what_;
  std::shared_ptr<const stall_note> note_;
};

}  // namespace detail

/// Handle of an asynchronous operation. A default-constructed work is already complete.
class work;

namespace detail {
/// The state inside a work handle, for the front end that wraps it.
struct work_access {
  static std::shared_ptr<work_state>& state(work& w) noexcept;
};
}  // namespace detail

/// Handle of an asynchronous operation. A default-constructed work is already complete.
class work {
 public:
  work() = default;
  /// Wraps a backend's state.
  explicit work(std::shared_ptr<detail::work_state> state) : state_(std::move(state)) {}

  /// Blocks until done; throws the operation's error, or ddp::timeout_error past the communicator's timeout.
  void wait() {
    if (!state_ || state_->test()) return;  // done already: no clock reading on the fast path
    const auto limit = state_->timeout();
    if (!state_->wait_until(detail::work_state::clock::now() + limit)) {
      const std::string who = state_->waiting_for();
      const std::string record = state_->diagnosis();
      throw timeout_error(state_->describe() + " did not complete within " + std::to_string(limit.count()) + " ms" +
                              (who.empty() ? std::string() : ", waiting for " + who) +
                              ": a peer is stuck, dead or calling a different collective; check every rank's "
                              "log, or raise the timeout in the communicator's config" +
                              (record.empty() ? std::string() : " (" + record + ")"),
                          state_->rank());
    }
  }
  /// Waits at most `d`; true once done, false if still running. Throws the operation's error.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) {
    if (!state_) return true;
    return state_->wait_until(detail::work_state::clock::now() +
                              std::chrono::duration_cast<detail::work_state::clock::duration>(d));
  }
  /// True once done, without blocking. Throws the operation's error.
  [[nodiscard]] bool done() { return !state_ || state_->test(); }

 private:
  friend struct detail::work_access;
  std::shared_ptr<detail::work_state> state_;
};

inline std::shared_ptr<detail::work_state>& detail::work_access::state(work& w) noexcept { return w.state_; }

/// Waits for every handle in `works`, in order.
inline void wait_all(std::span<work> works) {
  for (auto& w : works) w.wait();
}

}  // namespace ddp
// ---- end <ddp/comm/work.hpp>

namespace ddp {

/// A group of ranks with asynchronous collectives and point-to-point transfers.
template <class C>
concept communicator =
    std::copy_constructible<C> &&
    requires(C& c, const C& cc, std::span<float> s, std::span<const float> in, raw_tensor r, int i, reduce_op op) {
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      { c.split(i, i) } -> std::same_as<C>;
      { c.all_reduce(s, op) } -> std::same_as<work>;
      { c.all_reduce(r, op) } -> std::same_as<work>;
      { c.reduce_scatter(in, s, op) } -> std::same_as<work>;
      { c.all_gather(in, s) } -> std::same_as<work>;
      { c.all_gather(r, r) } -> std::same_as<work>;
      { c.broadcast(s, i) } -> std::same_as<work>;
      { c.reduce(s, op, i) } -> std::same_as<work>;
      { c.gather(in, s, i) } -> std::same_as<work>;
      { c.scatter(in, s, i) } -> std::same_as<work>;
      { c.all_to_all(in, s) } -> std::same_as<work>;
      { c.barrier() } -> std::same_as<work>;
      { c.send(in, i, i) } -> std::same_as<work>;
      { c.recv(s, i, i) } -> std::same_as<work>;
      { cc.stats() } -> std::same_as<comm_stats>;
    };

}  // namespace ddp
// ---- end <ddp/comm/communicator.hpp>

namespace ddp {

namespace detail {
struct backend_category {};
}  // namespace detail

/// Backend policies: which communicator data_parallel expects.
namespace backend {
/// The library's own TCP transport (ddp::tcp::communicator); the default.
struct tcp { using policy_category = detail::backend_category; };
/// Open MPI (ddp::mpi::communicator).
struct mpi { using policy_category = detail::backend_category; };
/// NCCL over CUDA device memory (ddp::nccl::communicator).
struct nccl { using policy_category = detail::backend_category; };
}  // namespace backend

/// Maps a backend tag to `using communicator = ...;`. Specialized by each backend's header.
template <class Backend>
struct backend_traits {
  static_assert(detail::dependent_false<Backend>,
                "ddp: this backend's header is not included. Include <ddp/ddp.hpp> and link ddp::ddp for "
                "backend::tcp, ddp::mpi for backend::mpi (DDP_WITH_MPI), ddp::nccl for backend::nccl (DDP_WITH_NCCL).");
};

/// The communicator type of backend tag B.
template <class B>
using backend_communicator_t = typename backend_traits<B>::communicator;

namespace detail {
/// What backend_traits<Tag> holds for a backend whose communicator is Comm; checks that Comm models the concept.
template <class Comm>
struct backend_binding {
  static_assert(ddp::communicator<Comm>,
                "ddp: this backend's communicator must model ddp::communicator; add the missing member the concept "
                "in <ddp/comm/communicator.hpp> names.");
  using communicator = Comm;  ///< the backend's communicator
};
}  // namespace detail

/// Maps a communicator type to its backend tag, `using type = ...;` (what `ddp::data_parallel dp{model, comm};`
/// deduces the backend from): the communicator's `backend_tag`, or a specialization of backend_of.
template <class Comm>
struct backend_of {
  static_assert(detail::dependent_false<Comm>,
                "ddp: no backend is known for this communicator type. Pass a ddp::tcp, ddp::mpi or ddp::nccl "
                "communicator, or specialize ddp::backend_of<YourCommunicator> with `using type = your_backend_tag;`.");
};
/// A communicator that names its tag (`using backend_tag = backend::mpi;`) deduces it.
template <class Comm>
  requires requires { typename Comm::backend_tag; }
struct backend_of<Comm> {
  using type = typename Comm::backend_tag;  ///< the communicator's backend tag
};

/// The backend tag of communicator type Comm.
template <class Comm>
using backend_of_t = typename backend_of<Comm>::type;

}  // namespace ddp
// ---- end <ddp/comm/backend.hpp>
// ---- begin <ddp/comm/env.hpp>
/// \file Reading a rank's place in the job from the environment (torchrun's env:// and Open MPI's variables).

#include <charconv>
#include <cstdlib>
#include <optional>


namespace ddp {

/// Where this process sits in the job, as the launcher described it.
struct env_config {
  int rank = 0;                     ///< RANK (or OMPI_COMM_WORLD_RANK)
  int world_size = 1;               ///< WORLD_SIZE (or OMPI_COMM_WORLD_SIZE)
  int local_rank = 0;               ///< LOCAL_RANK (or OMPI_COMM_WORLD_LOCAL_RANK), 0 if unset
  int local_world_size = 1;         ///< LOCAL_WORLD_SIZE (or OMPI_COMM_WORLD_LOCAL_SIZE), world_size if unset
  std::string master_addr = "127.0.0.1";  ///< MASTER_ADDR, 127.0.0.1 if unset
  std::uint16_t master_port = 29500;      ///< MASTER_PORT, 29500 if unset
};

namespace detail {

inline std::optional<std::string> env_string(const char* name) {
  const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read once at start-up
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

/// An integer variable in [lo, hi]; `why` tells the user what the variable is for.
inline std::optional<long long> env_integer(const char* name, long long lo, long long hi, std::string_view why) {
  const auto text = env_string(name);
  if (!text) return std::nullopt;
  long long value = 0;
  const auto* end = text->data() + text->size();
  const auto [ptr, ec] = std::from_chars(text->data(), end, value);
  if (ec != std::errc{} || ptr != end || value < lo || value > hi)
    throw config_error("environment variable " + std::string(name) + "='" + *text + "' is not an integer in [" +
                       std::to_string(lo) + ", " + std::to_string(hi) + "]; set it to " + std::string(why));
  return value;
}

/// A variable that names one of `choices` (its spelling, its value); `why` tells the user what it sets, and the
/// error names `rank` where given.
template <class T, std::size_t N>
std::optional<T> env_choice(const char* name, const std::pair<std::string_view, T> (&choices)[N], std::string_view why,
                            int rank = -1) {
  const auto text = env_string(name);
  if (!text) return std::nullopt;
  std::string listed;
  for (std::size_t i = 0; i < N; ++i) {
    if (*text == choices[i].first) return choices[i].second;
    listed += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(choices[i].first);
  }
  throw config_error("environment variable " + std::string(name) + "='" + *text + "' is not " + listed + "; set it to " +
                         std::string(why),
                     rank);
}

/// The first of two variables that is set (the torchrun name, then Open MPI's).
inline std::optional<long long> env_integer_either(const char* name, const char* mpi_name, long long lo, long long hi,
                                                   std::string_view why) {
  if (auto v = env_integer(name, lo, hi, why)) return v;
  return env_integer(mpi_name, lo, hi, why);
}

}  // namespace detail

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (Open MPI's
/// OMPI_COMM_WORLD_* stand in for the first four); throws ddp::config_error naming the variable and the fix.
inline env_config read_env_config() {
  constexpr long long max_ranks = 1 << 20;
  env_config c;
  const auto world = detail::env_integer_either("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", 1, max_ranks,
                                                "the number of processes in the job (torchrun, mpirun and "
                                                "ddp-launch set it)");
  const auto rank = detail::env_integer_either("RANK", "OMPI_COMM_WORLD_RANK", 0, max_ranks - 1,
                                               "this process's rank in 0..WORLD_SIZE-1");
  if (!world || !rank)
    throw config_error(std::string("environment variable ") + (!rank ? "RANK" : "WORLD_SIZE") +
                       " is not set; start the job with ddp-launch -n N, torchrun or mpirun, or export RANK and "
                       "WORLD_SIZE (plus MASTER_ADDR and MASTER_PORT) yourself");
  c.world_size = static_cast<int>(*world);
  c.rank = static_cast<int>(*rank);
  if (c.rank >= c.world_size)
    throw config_error("RANK=" + std::to_string(c.rank) + " is not below WORLD_SIZE=" + std::to_string(c.world_size) +
                           "; ranks run from 0 to WORLD_SIZE-1",
                       c.rank);
  c.local_rank = static_cast<int>(detail::env_integer_either("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", 0,
                                                             max_ranks - 1, "this process's rank on its host")
                                      .value_or(0));
  c.local_world_size = static_cast<int>(detail::env_integer_either("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1,
                                                                   max_ranks, "the number of processes on this host")
                                            .value_or(c.world_size));
  if (c.local_rank >= c.local_world_size)
    throw config_error("LOCAL_RANK=" + std::to_string(c.local_rank) + " is not below LOCAL_WORLD_SIZE=" +
                           std::to_string(c.local_world_size) + "; fix the launcher's per-host settings",
                       c.rank);
  if (auto addr = detail::env_string("MASTER_ADDR")) c.master_addr = *addr;
  if (auto port = detail::env_integer("MASTER_PORT", 0, 65535, "the TCP port rank 0 listens on (0..65535)"))
    c.master_port = static_cast<std::uint16_t>(*port);
  return c;
}

}  // namespace ddp
// ---- end <ddp/comm/env.hpp>
// ---- begin <ddp/comm/object.hpp>
/// \file all_gather_object / broadcast_object: collectives over values of any serializable type
/// (trivially copyable types, std::string, std::vector of serializable, aggregates of serializable).

#include <cstring>


namespace ddp {

namespace detail {

template <class T>
struct is_std_vector : std::false_type {};
template <class E, class A>
struct is_std_vector<std::vector<E, A>> : std::true_type {};

/// Appends the bytes of `value` to `out`.
template <class T>
void serialize(const T& value, std::vector<std::uint8_t>& out) {
  if constexpr (std::is_trivially_copyable_v<T>) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
    out.insert(out.end(), p, p + sizeof(T));
  } else if constexpr (std::is_same_v<T, std::string> || is_std_vector<T>::value) {
    serialize(static_cast<std::uint64_t>(value.size()), out);
    for (const auto& element : value) serialize(element, out);
  } else {
    static_assert(reflectable_aggregate<T>,
                  "ddp: this type cannot travel in an object collective; use a trivially copyable type, "
                  "std::string, std::vector, or an aggregate of those.");
    for_each_field(value, [&](std::string_view, const auto& field) { serialize(field, out); });
  }
}

/// Reads a value from `in`, advancing it; throws ddp::mismatch_error when the bytes run out.
template <class T>
void deserialize(T& value, std::span<const std::uint8_t>& in) {
  const auto take = [&](void* dst, std::size_t n) {
    if (in.size() < n)
      throw mismatch_error("object collective: the received bytes end early; every rank must pass the same C++ type");
    std::memcpy(dst, in.data(), n);
    in = in.subspan(n);
  };
  if constexpr (std::is_trivially_copyable_v<T>) {
    take(&value, sizeof(T));
  } else if constexpr (std::is_same_v<T, std::string> || is_std_vector<T>::value) {
    std::uint64_t n = 0;
    take(&n, sizeof n);
    if (n > in.size())
      throw mismatch_error("object collective: a length field exceeds the received bytes; every rank must pass the "
                           "same C++ type");
    value.resize(n);
    for (auto& element : value) deserialize(element, in);
  } else {
    for_each_field(value, [&](std::string_view, auto& field) { deserialize(field, in); });
  }
}

}  // namespace detail

/// Gathers `value` from every rank; element r of the result is rank r's value.
template <class Comm, class T>
std::vector<T> all_gather_object(Comm& comm, const T& value) {
  std::vector<std::uint8_t> mine;
  detail::serialize(value, mine);
  const auto n = static_cast<std::size_t>(comm.size());
  const std::int64_t my_size = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(n);
  comm.all_gather(std::span<const std::int64_t>(&my_size, 1), std::span<std::int64_t>(sizes)).wait();
  const auto widest = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  mine.resize(widest);
  std::vector<std::uint8_t> all(widest * n);
  comm.all_gather(std::span<const std::uint8_t>(mine), std::span<std::uint8_t>(all)).wait();
  std::vector<T> out(n);
  for (std::size_t r = 0; r < n; ++r) {
    std::span<const std::uint8_t> in(all.data() + r * widest, static_cast<std::size_t>(sizes[r]));
    detail::deserialize(out[r], in);
  }
  return out;
}

/// Replaces `value` on every rank with root's.
template <class Comm, class T>
void broadcast_object(Comm& comm, T& value, int root = 0) {
  std::vector<std::uint8_t> bytes;
  if (comm.rank() == root) detail::serialize(value, bytes);
  std::int64_t size = static_cast<std::int64_t>(bytes.size());
  comm.broadcast(std::span<std::int64_t>(&size, 1), root).wait();
  bytes.resize(static_cast<std::size_t>(size));
  comm.broadcast(std::span<std::uint8_t>(bytes), root).wait();
  if (comm.rank() != root) {
    std::span<const std::uint8_t> in(bytes);
    detail::deserialize(value, in);
  }
}

namespace detail {
/// Gives a communicator the member spellings comm.all_gather_object(v) and comm.broadcast_object(v, root).
template <class Derived>
class object_collectives {
 public:
  /// See ddp::all_gather_object.
  template <class T>
  std::vector<T> all_gather_object(const T& value) {
    return ddp::all_gather_object(static_cast<Derived&>(*this), value);
  }
  /// See ddp::broadcast_object.
  template <class T>
  void broadcast_object(T& value, int root = 0) {
    ddp::broadcast_object(static_cast<Derived&>(*this), value, root);
  }
};
}  // namespace detail

}  // namespace ddp
// ---- end <ddp/comm/object.hpp>
// ---- begin <ddp/comm/tcp/communicator.hpp>
/// \file ddp::tcp::communicator: the zero-dependency backend. Rendezvous through a key-value store on
/// rank 0, a full mesh of TCP connections authenticated by the job token, one progress thread, and
/// asynchronous collectives that check every frame against the call (see docs/tcp.md).

#include <climits>
#include <cstdio>

// ---- begin <ddp/comm/call.hpp>
/// \file What one operation is: the description every backend's checks, messages and cross-rank call check use.



namespace ddp::detail {

/// One operation as the collective front end saw it: "all_reduce(sum) of 1024 f32 in an MPI group of 4 (sequence 17)".
struct call_info {
  collective kind = collective::barrier;
  const char* name = "barrier";         ///< "all_reduce", ..., "send", "recv"
  std::optional<reduce_op> op{};        ///< the caller's operator (avg stays avg here)
  dtype type = dtype::u8;
  std::size_t count = 0;                ///< elements per rank: the same on every rank of a matching call
  int peer = -1;                        ///< root, or the other rank of a send/recv; -1 where none
  int tag = -1;                         ///< send/recv tag; -1 for collectives
  std::optional<std::uint64_t> sequence{};  ///< the group's count of operations before this one, where kept
  int group_size = 1;
  std::string_view group = "a group";   ///< "an MPI group", "an NCCL group", "a TCP group"
  int device = -1;                      ///< the CUDA device of the group, -1 for host backends
  raw_tensor average{};                 ///< avg the backend finishes: divide this buffer by group_size when done

  /// True for a recv (cancelled when dropped incomplete).
  [[nodiscard]] bool receive() const noexcept { return std::string_view(name) == "recv"; }
};

/// The call alone, without its group: "broadcast of 8 f32 rooted at rank 1", "recv of 4 f32 from rank 0 tag 7".
inline std::string describe_call(const call_info& c) {
  std::string s = c.name;
  if (c.op) s += "(" + std::string(to_string(*c.op)) + ")";
  if (c.kind != collective::barrier) s += " of " + std::to_string(c.count) + " " + std::string(to_string(c.type));
  if (c.kind == collective::send_recv)
    s += (c.receive() ? " from rank " : " to rank ") + std::to_string(c.peer) + " tag " + std::to_string(c.tag);
  else if (c.peer >= 0)
    s += " rooted at rank " + std::to_string(c.peer);
  return s;
}

/// The phrase naming an operation in messages, with its group, device and sequence number.
inline std::string describe(const call_info& c) {
  std::string s = describe_call(c) + " in " + std::string(c.group) + " of " + std::to_string(c.group_size);
  if (c.device >= 0) s += " on cuda:" + std::to_string(c.device);
  if (c.sequence) s += " (sequence " + std::to_string(*c.sequence) + ")";
  return s;
}

}  // namespace ddp::detail
// ---- end <ddp/comm/call.hpp>
// ---- begin <ddp/comm/front_end.hpp>
/// \file The collective front end every backend shares: the public collective methods of ddp::communicator with
/// the argument checks, the description of each operation, sequence numbers, statistics, avg and the opt-in
/// cross-rank call check (DDP_CHECK_COLLECTIVES=1), calling the backend's starts.
///
/// A backend `B` derives from collective_front<B>, befriends it and implements, for checked arguments:
///   start_all_reduce(c, buffer, op), start_reduce_scatter(c, in, out, op), start_all_gather(c, in, out),
///   start_broadcast(c, buffer), start_reduce(c, buffer, op), start_gather(c, in, out),
///   start_scatter(c, in, out), start_all_to_all(c, in, out), start_barrier(c), start_send(c, buffer),
///   start_recv(c, buffer)   (c: the call_info; roots, peers and tags are c.peer and c.tag), each returning work;
/// rank(), size(), max_tag(), flight() (the group's flight recorder, null when off), `static constexpr front_duties duties`, and front() (a front_state shared by the
/// copies of a group) where a duty needs it. A public device() puts "on cuda:N" into the messages.


// ---- begin <ddp/comm/call_check.hpp>
/// \file The opt-in cross-rank call check (DDP_CHECK_COLLECTIVES=1): before each collective every rank shares the
/// fields that must agree (operation, operator, dtype, count, root), so that ranks calling different collectives
/// raise ddp::mismatch_error naming both calls at once instead of a timeout much later.



namespace ddp::detail {

/// True when the environment asks for the cross-rank call check (DDP_CHECK_COLLECTIVES=1; 0 or unset: off).
inline bool call_check_requested() {
  return env_integer("DDP_CHECK_COLLECTIVES", 0, 1,
                     "1 to compare every collective's operation, dtype, count and root across the ranks before it "
                     "runs (on every rank), or 0 for no check")
             .value_or(0) == 1;
}

/// The fields of a collective that must agree on every rank, as the words one rank contributes to the check.
using call_fingerprint = std::array<std::int64_t, 4>;

/// Marks a word set as a fingerprint; anything else came from a rank running without the check.
inline constexpr std::int64_t call_fingerprint_mark = 0x4444504343484b31;  // "DDPCCHK1"

/// `c` as the words every rank compares.
inline call_fingerprint fingerprint(const call_info& c) noexcept {
  const auto op = c.op ? static_cast<std::int64_t>(*c.op) + 1 : 0;
  return {static_cast<std::int64_t>(c.kind) | op << 8 | static_cast<std::int64_t>(c.type) << 16,
          static_cast<std::int64_t>(c.count), c.peer, call_fingerprint_mark};
}

/// The call another rank described with `f` ("broadcast of 8 f32 rooted at rank 1"), or why it cannot be read.
inline std::string describe_fingerprint(std::span<const std::int64_t, 4> f) {
  const auto kind = static_cast<std::size_t>(f[0] & 0xff);
  const auto op = static_cast<std::size_t>((f[0] >> 8) & 0xff);
  const auto type = static_cast<std::size_t>((f[0] >> 16) & 0xff);
  if (f[3] != call_fingerprint_mark || kind >= collective_count || op > 5 || type > static_cast<std::size_t>(dtype::u8))
    return "no collective with the call check (it runs without DDP_CHECK_COLLECTIVES=1, or another ddp version)";
  call_info c;
  c.kind = static_cast<collective>(kind);
  c.name = to_string(c.kind).data();
  if (op != 0) c.op = static_cast<reduce_op>(op - 1);
  c.type = static_cast<dtype>(type);
  c.count = static_cast<std::size_t>(f[1]);
  c.peer = static_cast<int>(f[2]);
  return describe_call(c);
}

/// Throws ddp::mismatch_error on `rank` when a rank's fingerprint in `all` (size() of them, in rank order) differs
/// from the one of `mine`, naming this rank's call and the first differing rank's.
inline void compare_calls(const call_info& mine, std::span<const std::int64_t> all, int rank) {
  const call_fingerprint ours = fingerprint(mine);
  for (std::size_t r = 0; r * ours.size() < all.size(); ++r) {
    const std::span<const std::int64_t, 4> theirs(all.data() + r * ours.size(), ours.size());
    if (std::equal(theirs.begin(), theirs.end(), ours.begin())) continue;
    throw mismatch_error(describe(mine) + ": rank " + std::to_string(r) + " called " + describe_fingerprint(theirs) +
                             " where this rank called " + describe_call(mine) +
                             "; every rank of the group must call the same collectives in the same order with the "
                             "same counts, dtypes, operators and roots (found by DDP_CHECK_COLLECTIVES=1)",
                         rank);
  }
}

}  // namespace ddp::detail
// ---- end <ddp/comm/call_check.hpp>
// ---- begin <ddp/comm/checks.hpp>
/// \file The argument checks every backend makes before a collective, as messages: empty when the arguments
/// are fine, else what is wrong and the fix. Each backend prefixes the call and the rank and throws.



namespace ddp::detail {

/// Empty when `in` and `out` have one dtype, else what to fix.
inline std::string dtype_problem(const raw_tensor& in, const raw_tensor& out) {
  if (in.type == out.type) return {};
  return "input is " + std::string(to_string(in.type)) + " but output is " + std::string(to_string(out.type)) +
         "; pass buffers of one dtype";
}

/// Empty when `whole` holds `ranks` blocks of `block` elements, else what to fix.
inline std::string blocks_problem(std::size_t whole, std::size_t block, int ranks, const char* whole_name,
                                  const char* block_name) {
  if (whole == block * static_cast<std::size_t>(ranks)) return {};
  return std::string(whole_name) + " has " + std::to_string(whole) + " elements but must hold size()=" +
         std::to_string(ranks) + " times the " + std::to_string(block) + " elements of the " + block_name;
}

/// Empty when `r` is a rank of a group of `ranks`, else what to fix; `what` names the argument ("broadcast root").
inline std::string rank_problem(int r, int ranks, const char* what) {
  if (r >= 0 && r < ranks) return {};
  return std::string(what) + " " + std::to_string(r) + " is not a rank of this group (0.." +
         std::to_string(ranks - 1) + ")";
}

}  // namespace ddp::detail
// ---- end <ddp/comm/checks.hpp>
// ---- begin <ddp/comm/flight_recorder.hpp>
/// \file The flight recorder: each group keeps its last K collectives (call, sequence, state, times). When an
/// operation fails or times out, the rank writes what it knows to DDP_FLIGHT_RECORDER_DIR (ddp-launch sets
/// one per job and reads every rank's record when the job fails) and the timeout's message names the first
/// sequence this rank has not seen complete. DDP_FLIGHT_RECORDER=K sets the entries kept (default 1024, 0 off).

#include <unistd.h>

#include <filesystem>
#include <fstream>


namespace ddp::detail {

/// Where a recorded operation stands.
enum class flight_state : std::uint8_t { started, completed, failed };

/// "started", "completed", "failed".
constexpr std::string_view to_string(flight_state s) noexcept {
  return s == flight_state::started ? "started" : s == flight_state::completed ? "completed" : "failed";
}

/// One collective of a group, as the recorder keeps it.
struct flight_entry {
  using clock = std::chrono::steady_clock;
  std::uint64_t sequence = 0;           ///< the group's count of collectives before this one
  call_info call{};                     ///< what was called
  flight_state state = flight_state::started;
  clock::time_point started{};         ///< when it was started
  std::optional<clock::time_point> settled{};  ///< when this rank saw it complete or fail
};

/// The last K collectives of one group on this rank (thread-safe).
class flight_recorder {
 public:
  using clock = flight_entry::clock;

  /// Keeps `capacity` entries; `label` names the group in the record's file name (the same on every rank).
  flight_recorder(std::size_t capacity, std::string label) : ring_(capacity), label_(std::move(label)) {}

  /// Entries kept per group: DDP_FLIGHT_RECORDER (default 1024; 0 turns the recorder off).
  static std::size_t capacity_from_env() {
    return static_cast<std::size_t>(env_integer("DDP_FLIGHT_RECORDER", 0, 1 << 20, "the flight recorder's entries per group")
                                        .value_or(1024));
  }

  /// Records the start of `c` (collectives only); returns its sequence number.
  std::uint64_t start(const call_info& c) {
    std::lock_guard lock(mutex_);
    const std::uint64_t seq = next_++;
    ring_[seq % ring_.size()] = {seq, c, flight_state::started, clock::now(), std::nullopt};
    return seq;
  }
  /// Records `c`, which completed as it was started (an eager call): one lock and one clock read, where
  /// start() and settle() take two of each.
  void completed(const call_info& c) {
    std::lock_guard lock(mutex_);
    const std::uint64_t seq = next_++;
    const auto now = clock::now();
    ring_[seq % ring_.size()] = {seq, c, flight_state::completed, now, now};
  }
  /// This rank saw operation `seq` complete (ok) or fail.
  void settle(std::uint64_t seq, bool ok) {
    std::lock_guard lock(mutex_);
    auto& e = ring_[seq % ring_.size()];
    if (e.sequence != seq || e.state != flight_state::started) return;  // overwritten, or settled already
    e.state = ok ? flight_state::completed : flight_state::failed;
    e.settled = clock::now();
  }

  /// "sequence 42 (all_reduce(sum) of 1024 f32, started 5.0 s ago) is the first this rank has not seen
  /// complete; the last complete is 41"; empty when every recorded operation completed.
  [[nodiscard]] std::string first_incomplete() const {
    std::lock_guard lock(mutex_);
    const flight_entry* first = nullptr;
    for (const auto& e : ordered())
      if (e->state != flight_state::completed) {
        first = e;
        break;
      }
    if (first == nullptr) return {};
    const double ago = std::chrono::duration<double>(clock::now() - first->started).count();
    std::string s = "sequence " + std::to_string(first->sequence) + " (" + describe_call(first->call) + ", started " +
                    seconds(ago) + " ago) is the first this rank has not seen complete";
    return s;
  }

  /// Writes every entry to DDP_FLIGHT_RECORDER_DIR/flight.rank<R>.group<label>.txt, once (the first failure
  /// is the one worth keeping); returns the path, or empty when no directory is set or it was written before.
  std::string dump(int rank, int size, std::string_view reason) {
    const char* dir = std::getenv("DDP_FLIGHT_RECORDER_DIR");
    if (dir == nullptr || *dir == '\0') return {};
    std::string text;
    {
      std::lock_guard lock(mutex_);
      if (dumped_) return {};
      dumped_ = true;
      const auto now = clock::now();
      text = "# ddp flight recorder: rank " + std::to_string(rank) + " of " + std::to_string(size) + ", group " +
             label_ + ", reason: " + std::string(reason) + "\n# sequence\tstate\tstarted_s_ago\tsettled_s_ago\tcall\n";
      for (const auto* e : ordered()) {
        const double started = std::chrono::duration<double>(now - e->started).count();
        text += std::to_string(e->sequence) + "\t" + std::string(to_string(e->state)) + "\t" + seconds(started, false) +
                "\t" + (e->settled ? seconds(std::chrono::duration<double>(now - *e->settled).count(), false) : "-") +
                "\t" + describe_call(e->call) + "\n";
      }
    }
    const std::filesystem::path path =
        std::filesystem::path(dir) / ("flight.rank" + std::to_string(rank) + ".group" + label_ + ".txt");
    const auto temporary = path.string() + ".tmp." + std::to_string(::getpid());
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << text;
      if (!out) return {};
    }
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) {
      std::filesystem::remove(temporary, ec);
      return {};
    }
    return path.string();
  }

 private:
  /// The entries in sequence order (oldest kept first); the caller holds the mutex.
  [[nodiscard]] std::vector<const flight_entry*> ordered() const {
    std::vector<const flight_entry*> out;
    const std::uint64_t kept = std::min<std::uint64_t>(next_, ring_.size());
    for (std::uint64_t s = next_ - kept; s < next_; ++s) out.push_back(&ring_[s % ring_.size()]);
    return out;
  }
  static std::string seconds(double s, bool unit = true) {
    char buf[32];
    std::snprintf(buf, sizeof buf, unit ? "%.1f s" : "%.3f", s);
    return buf;
  }

  mutable std::mutex mutex_;
  std::vector<flight_entry> ring_;
  std::string label_;
  std::uint64_t next_ = 0;
  bool dumped_ = false;
};

/// A work_state that tells the flight recorder when its operation completes or fails.
class recorded_work final : public work_state {
 public:
  recorded_work(std::shared_ptr<work_state> inner, std::shared_ptr<flight_recorder> recorder, std::uint64_t seq,
                int size)
      : inner_(std::move(inner)), recorder_(std::move(recorder)), seq_(seq), size_(size) {}

  bool test() override { return observe([&] { return inner_->test(); }); }
  bool wait_until(clock::time_point deadline) override { return observe([&] { return inner_->wait_until(deadline); }); }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  [[nodiscard]] int rank() const override { return inner_->rank(); }
  [[nodiscard]] std::string describe() const override { return inner_->describe(); }
  [[nodiscard]] std::string waiting_for() const override { return inner_->waiting_for(); }
  std::string diagnosis() override {
    std::string s = recorder_->first_incomplete();
    const auto path = recorder_->dump(rank(), size_, "timeout in " + describe());
    if (!path.empty()) s += (s.empty() ? "" : "; ") + std::string("flight record in ") + path;
    return s.empty() ? s : "flight recorder: " + s;
  }

 private:
  template <class F>
  bool observe(F&& f) {
    try {
      const bool done = f();
      if (done) recorder_->settle(seq_, true);
      return done;
    } catch (const timeout_error& e) {
      // The engine's own deadline passed before wait()'s: the same diagnosis as a timeout seen by wait(), and the
      // operation stays started -- this rank waited for it, it did not see it fail.
      const std::string record = diagnosis();
      throw timeout_error(e.message() + (record.empty() ? std::string() : " (" + record + ")"), e.rank(),
                          e.native_code());
    } catch (const std::exception& e) {
      recorder_->settle(seq_, false);
      const auto path = recorder_->dump(rank(), size_, e.what());
      if (!path.empty()) std::fprintf(stderr, "ddp: rank %d wrote its flight record to %s\n", rank(), path.c_str());
      throw;
    }
  }

  std::shared_ptr<work_state> inner_;
  std::shared_ptr<flight_recorder> recorder_;
  std::uint64_t seq_;
  int size_;
};

/// A recorder for a new group (none when DDP_FLIGHT_RECORDER=0).
inline std::shared_ptr<flight_recorder> make_flight_recorder(std::string label) {
  const auto capacity = flight_recorder::capacity_from_env();
  return capacity == 0 ? nullptr : std::make_shared<flight_recorder>(capacity, std::move(label));
}

/// `w` (the start of collective `c` in a group of `size`), recorded in `recorder`.
inline work record(const std::shared_ptr<flight_recorder>& recorder, const call_info& c, int size, work w) {
  auto& state = work_access::state(w);
  if (!state) {
    recorder->completed(c);
    return w;
  }
  const std::uint64_t seq = recorder->start(c);
  return work(std::make_shared<recorded_work>(std::move(state), recorder, seq, size));
}

/// A label for a group of a backend without group identifiers: its rank in this process's creation order,
/// the same on every rank of an SPMD program.
inline std::string next_group_label() {
  static std::atomic<std::uint64_t> created{0};
  return "g" + std::to_string(created.fetch_add(1));
}

}  // namespace ddp::detail
// ---- end <ddp/comm/flight_recorder.hpp>

namespace ddp::detail {

/// What the front end does for a backend beyond the argument checks; a backend that does a duty itself says false.
struct front_duties {
  std::string_view group = "a group";  ///< how messages name the group: "an MPI group"
  bool sequence = true;                ///< number every operation (front_state::sequence)
  bool stats = true;                   ///< count calls and the algorithm-independent payload bytes (front_state::stats)
  bool average = true;                 ///< run avg as sum and have the start divide call_info::average when done
  bool call_check = true;              ///< exchange the call before each collective when front_state::call_check
};

/// The front end's state, shared by the copies of a group.
struct front_state {
  stats_counter stats;
  std::shared_ptr<flight_recorder> flight = make_flight_recorder(next_group_label());  ///< the group's last collectives
  std::atomic<std::uint64_t> sequence{0};
  bool call_check = call_check_requested();  ///< DDP_CHECK_COLLECTIVES=1 when the group was made
};

/// The public collectives of a ddp::communicator, for backend `Derived` (see the file comment).
template <class Derived>
class collective_front : public object_collectives<Derived> {
 public:
  /// Reduces `buffer` in place across the group.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::all_reduce, "all_reduce", op, b, -1);
    verify(c);
    const reduce_op run = average(c, op, b);
    return counted(c, share(b.bytes(), 2), self().start_all_reduce(c, b, run));
  }

  /// Reduces N·k input elements and leaves block rank() (k elements) in `output`.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::reduce_scatter, "reduce_scatter", op, out, -1);
    same_type(c, in, out);
    blocks(c, in.size, out.size, "input", "output");
    verify(c);
    const reduce_op run = average(c, op, out);
    return counted(c, share(in.bytes(), 1), self().start_reduce_scatter(c, in, out, run));
  }

  /// Gathers k elements from every rank into N·k elements, rank r's at block r.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::all_gather, "all_gather", std::nullopt, in, -1);
    same_type(c, in, out);
    blocks(c, out.size, in.size, "output", "input");
    verify(c);
    return counted(c, static_cast<std::uint64_t>(self().size() - 1) * in.bytes(), self().start_all_gather(c, in, out));
  }

  /// Copies root's `buffer` to every rank.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::broadcast, "broadcast", std::nullopt, b, root);
    check_rank(c, root, "root");
    verify(c);
    const std::uint64_t sent = self().rank() == root && self().size() > 1 ? b.bytes() : 0;
    return counted(c, sent, self().start_broadcast(c, b));
  }

  /// Reduces `buffer` onto root, in place there; other ranks' buffers are left as they were.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::reduce, "reduce", op, b, root);
    check_rank(c, root, "root");
    verify(c);
    const bool at_root = self().rank() == root;
    const reduce_op run = average(c, op, at_root ? b : raw_tensor{});
    return counted(c, at_root ? 0 : b.bytes(), self().start_reduce(c, b, run));
  }

  /// Gathers k elements from every rank into root's N·k-element `output` (unused on other ranks).
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open_rooted(collective::gather, "gather", in, out, root);
    return counted(c, self().rank() == root ? 0 : in.bytes(), self().start_gather(c, in, out));
  }

  /// Sends block r of root's N·k-element `input` (unused on other ranks) to rank r's k-element `output`.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open_rooted(collective::scatter, "scatter", in, out, root);
    return counted(c, self().rank() == root ? share(in.bytes(), 1) : 0, self().start_scatter(c, in, out));
  }

  /// Sends block i of the N·k-element `input` to rank i; block j of `output` comes from rank j.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    const raw_tensor in = as_raw(input), out = as_raw(output);
    call_info c = open(collective::all_to_all, "all_to_all", std::nullopt, in, -1);
    same_type(c, in, out);
    const auto n = static_cast<std::size_t>(self().size());
    if (in.size != out.size || in.size % n != 0)
      fail(c, "input has " + std::to_string(in.size) + " elements and output " + std::to_string(out.size) +
                  "; both must hold the same multiple of size()=" + std::to_string(n));
    verify(c);
    return counted(c, share(in.bytes(), 1), self().start_all_to_all(c, in, out));
  }

  /// Completes once every rank of the group has entered the barrier.
  work barrier() {
    call_info c = open(collective::barrier, "barrier", std::nullopt, raw_tensor{}, -1);
    verify(c);
    return counted(c, 0, self().start_barrier(c));
  }

  /// Sends `buffer` to rank `peer`, matched by the recv on `peer` with the same tag (0 ≤ tag ≤ max_tag()).
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::send_recv, "send", std::nullopt, b, peer, tag);
    check_peer(c);
    return counted(c, b.bytes(), self().start_send(c, b));
  }

  /// Receives into `buffer` what rank `peer` sends with `tag`.
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    const raw_tensor b = as_raw(buffer);
    call_info c = open(collective::send_recv, "recv", std::nullopt, b, peer, tag);
    check_peer(c);
    return counted(c, 0, self().start_recv(c, b));
  }

 protected:
  /// Throws ddp::error "<the call>: <what>" on this rank.
  [[noreturn]] void fail(const call_info& c, const std::string& what) const {
    throw error(describe(c) + ": " + what, self().rank());
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  call_info open(collective kind, const char* name, std::optional<reduce_op> op, const raw_tensor& t, int peer,
                 int tag = -1) {
    call_info c{kind, name, op, t.type, t.size, peer, tag, std::nullopt, self().size(), Derived::duties.group, -1, {}};
    if constexpr (Derived::duties.sequence)
      c.sequence = self().front().sequence.fetch_add(1, std::memory_order_relaxed);
    if constexpr (requires { self().device(); }) c.device = self().device();
    return c;
  }

  /// Opens gather or scatter: each rank's k elements (gather's input, scatter's output) travel between it and its
  /// block of root's N·k elements (the other buffer), which the root checks.
  call_info open_rooted(collective kind, const char* name, const raw_tensor& in, const raw_tensor& out, int root) {
    const bool to_root = kind == collective::gather;
    const raw_tensor& mine = to_root ? in : out;
    call_info c = open(kind, name, std::nullopt, mine, root);
    check_rank(c, root, "root");
    if (self().rank() == root) {
      same_type(c, in, out);
      blocks(c, (to_root ? out : in).size, mine.size, to_root ? "output" : "input", to_root ? "input" : "output");
    }
    verify(c);
    return c;
  }

  /// The opt-in cross-rank call check: every rank shares the call's fingerprint through the backend's own
  /// all_gather (not counted in the statistics but in comm_stats::call_checks) and compares.
  void verify(const call_info& c) {
    if constexpr (Derived::duties.call_check) {
      if (!self().front().call_check) return;
      const call_fingerprint mine = fingerprint(c);
      std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(self().size()));
      call_info exchange = c;
      exchange.kind = collective::all_gather;
      exchange.name = "all_gather of the call check before";
      exchange.op.reset();
      const raw_tensor in = as_raw(std::span<const std::int64_t>(mine)), out = as_raw(std::span<std::int64_t>(all));
      exchange.type = in.type;
      exchange.count = in.size;
      self().start_all_gather(exchange, in, out).wait();
      self().front().stats.add_call_check();
      compare_calls(c, all, self().rank());
    }
  }

  /// The operator to start: avg becomes sum when the front end averages for the backend, and `target` (the
  /// output this rank divides; empty where none) goes into the call.
  reduce_op average(call_info& c, reduce_op op, const raw_tensor& target) const noexcept {
    if constexpr (Derived::duties.average) {
      if (op != reduce_op::avg) return op;
      c.average = target;
      return reduce_op::sum;
    } else {
      return op;
    }
  }

  work counted(const call_info& c, std::uint64_t bytes_sent, work w) {
    if constexpr (Derived::duties.stats) {
      self().front().stats.add_call(c.kind);
      self().front().stats.add_bytes(c.kind, bytes_sent);
    }
    if (c.kind != collective::send_recv)
      if (const auto& recorder = self().flight()) return record(recorder, c, self().size(), std::move(w));
    return w;
  }

  /// (N-1)/N of `bytes`, times `factor`: what leaves a rank in a reduce-scatter (1) or all-reduce (2).
  [[nodiscard]] std::uint64_t share(std::size_t bytes, std::uint64_t factor) const noexcept {
    const auto n = static_cast<std::uint64_t>(self().size());
    return factor * static_cast<std::uint64_t>(bytes) * (n - 1) / n;
  }

  void same_type(const call_info& c, const raw_tensor& a, const raw_tensor& b) const {
    if (auto problem = dtype_problem(a, b); !problem.empty()) fail(c, problem);
  }

  /// `whole` must hold size() blocks of `block` elements.
  void blocks(const call_info& c, std::size_t whole, std::size_t block, const char* whole_name,
              const char* block_name) const {
    if (auto problem = blocks_problem(whole, block, self().size(), whole_name, block_name); !problem.empty())
      fail(c, problem);
  }

  void check_rank(const call_info& c, int r, const char* what) const {
    if (auto problem = rank_problem(r, self().size(), what); !problem.empty()) fail(c, problem);
  }

  void check_peer(const call_info& c) const {
    check_rank(c, c.peer, "peer");
    if (c.tag < 0 || c.tag > self().max_tag())
      fail(c, "tag " + std::to_string(c.tag) + " is outside 0.." + std::to_string(self().max_tag()) +
                  "; pass a tag in that range");
  }
};

}  // namespace ddp::detail
// ---- end <ddp/comm/front_end.hpp>
// ---- begin <ddp/comm/tcp/algorithms.hpp>
/// \file The collective algorithms of the TCP backend, run by the progress engine one call at a time.
/// Small payloads take latency-optimal direct exchanges (one round); large ones take bandwidth-optimal
/// pipelined rings (reduce-scatter then all-gather, forwarding each segment as soon as it is ready)
/// and chains (broadcast, reduce). Sends go out of the caller's buffers without copies.


// ---- begin <ddp/comm/tcp/channel.hpp>
/// \file What a collective's algorithm sees of the engine while it executes one call: group ranks, frames
/// to and from them, scratch memory. It speaks group ranks; the engine speaks world ranks. A step of a
/// hierarchical collective (hierarchical.hpp) runs over some of the group's members only.


// ---- begin <ddp/comm/tcp/call.hpp>
/// \file What the TCP engine executes: groups (the world or a split of it) and the calls queued on them,
/// and the frame header each call's frames carry.


// ---- begin <ddp/comm/tcp/protocol.hpp>
/// \file The wire protocol of the mesh, in one place: the handshake a connecting rank sends, and the frames
/// every message travels in (a fixed header, then a bounded payload). A receiver checks each header against
/// the call it is executing, so ranks that call different collectives fail with ddp::mismatch_error instead
/// of corrupting each other's buffers. The store's own messages are defined in store.hpp.



namespace ddp::tcp::detail {

// ---- the mesh handshake -----------------------------------------------------------------------------

inline constexpr std::uint32_t mesh_magic = 0x4d504444;  ///< "DDPM": first bytes on a mesh connection
inline constexpr std::uint32_t mesh_version = 1;         ///< bumped whenever the frames change incompatibly

/// First message on a mesh connection, from the connecting (higher) rank; answered by one byte, 1 if accepted.
struct mesh_hello {
  std::uint32_t magic = mesh_magic;
  std::uint32_t rank = 0;
  std::uint32_t size = 0;
  std::uint32_t version = mesh_version;
  std::uint64_t token = 0;  ///< hash of the job token
};
static_assert(sizeof(mesh_hello) == 24, "ddp: the mesh handshake must stay 24 bytes; it is the wire format.");

// ---- frames ----------------------------------------------------------------------------------------

inline constexpr std::uint32_t frame_magic = 0x46504444;  ///< "DDPF": first bytes of every frame

/// Control frames, numbered outside ddp::collective.
inline constexpr std::uint8_t op_abort = 200;  ///< the sender failed; payload: its message; flags: abort_kind
inline constexpr std::uint8_t op_bye = 201;    ///< the sender closed its communicator
inline constexpr std::uint8_t op_ack = 202;    ///< the sender has copied one of the receiver's remote frames
/// The sender has waited a while in the call this header describes (its op in `flags`), so a receiver in
/// another call at the same step raises mismatch_error instead of waiting for the timeout.
inline constexpr std::uint8_t op_waiting = 203;
/// Data, or room, waits for the receiver in a shared-memory ring (shm_rings.hpp): its engine sleeps in poll.
inline constexpr std::uint8_t op_ring = 204;

inline constexpr std::uint64_t max_abort_text = 4096;           ///< longest abort message carried
inline constexpr std::uint64_t max_frame_bytes = std::uint64_t{1} << 40;  ///< longer payloads mean a corrupt stream

/// Kinds of error an abort frame carries, so the receiver raises the same type.
enum class abort_kind : std::uint8_t { other, peer_lost, mismatch, timeout };

/// Flag of a collective frame whose payload is a remote_block: the receiver, on the same host, copies
/// the data straight out of the sender's memory (process_vm_readv) and answers with an op_ack frame.
inline constexpr std::uint8_t frame_remote = 1;

/// The header of every frame (40 bytes, host byte order: the mesh connects ranks of one architecture).
struct frame_header {
  std::uint32_t magic = frame_magic;
  std::uint8_t op = 0;        ///< ddp::collective, or a control op (op_abort, op_bye, op_ack, op_waiting, op_ring)
  std::uint8_t type = 0;      ///< ddp::dtype
  std::uint8_t reduce = 0;    ///< ddp::reduce_op (0 where none applies)
  std::uint8_t flags = 0;     ///< abort_kind (op_abort), frame_remote (collectives), the call's op (op_waiting)
  union {                     // one word, named by the frame's kind; -1 where none applies
    std::int32_t root = -1;   ///< broadcast, reduce, gather, scatter: the root's group rank
    std::int32_t tag;         ///< send/recv: the tag both sides matched on
    std::int32_t lost_rank;   ///< op_abort of kind peer_lost: the world rank that was lost
  };
  std::uint32_t group = 0;    ///< the group's identifier (split gives each subgroup its own)
  std::uint64_t seq = 0;      ///< the call's sequence number in its group (0 for send/recv, matched by tag)
  std::uint64_t count = 0;    ///< the call's element count
  std::uint64_t length = 0;   ///< payload bytes following this header
};
static_assert(sizeof(frame_header) == 40, "ddp: the frame header must stay 40 bytes; it is the wire format.");

/// An abort frame's header and its message (header.length bytes), ready to send.
struct abort_notice {
  frame_header header;
  std::string text;
};

/// Where a remote frame's data lies in the sender's address space.
struct remote_block {
  std::uint64_t address = 0;
  std::uint64_t bytes = 0;
};

/// True for ops whose description names a reduce operator.
constexpr bool has_reduce(std::uint8_t op) {
  return op == static_cast<std::uint8_t>(collective::all_reduce) ||
         op == static_cast<std::uint8_t>(collective::reduce_scatter) ||
         op == static_cast<std::uint8_t>(collective::reduce);
}

/// True for ops whose description names a root.
constexpr bool has_root(std::uint8_t op) {
  return op == static_cast<std::uint8_t>(collective::broadcast) || op == static_cast<std::uint8_t>(collective::reduce) ||
         op == static_cast<std::uint8_t>(collective::gather) || op == static_cast<std::uint8_t>(collective::scatter);
}

/// Why a header cannot start a well-formed frame, or nullptr: wrong magic, unknown op, or a payload length
/// its kind cannot have. The receiver checks this before it reads a payload byte.
inline const char* malformed(const frame_header& h) {
  if (h.magic != frame_magic) return "bytes that are not a ddp frame";
  if (h.op == op_abort) return h.length > max_abort_text ? "an abort notice longer than its limit" : nullptr;
  if (h.op == op_bye || h.op == op_ack || h.op == op_waiting || h.op == op_ring)
    return h.length != 0 ? "a control frame with a payload" : nullptr;
  if (h.op >= collective_count) return "a frame of unknown kind";
  if ((h.flags & frame_remote) != 0 && h.length != sizeof(remote_block)) return "a remote frame of the wrong length";
  return h.length > max_frame_bytes ? "a frame longer than the frame limit" : nullptr;
}

/// "all_reduce(sum) of 1024 f32 (seq 17)", "broadcast of 8 f32 from root 1 (seq 3)", "send of 4 i32 with tag 7 (seq 0)".
inline std::string describe(const frame_header& h) {
  if (h.op == op_abort) return "an abort notice";
  if (h.op == op_bye) return "a goodbye (it closed its communicator)";
  if (h.op == op_ack) return "an acknowledgement of a same-host copy";
  if (h.op == op_waiting) return "a notice that it waits";
  if (h.op == op_ring) return "a notice that a shared-memory ring waits";
  if (h.op >= collective_count) return "a frame of unknown kind " + std::to_string(h.op);
  const auto c = static_cast<collective>(h.op);
  std::string s = c == collective::send_recv ? "send" : std::string(to_string(c));
  if (has_reduce(h.op)) s += "(" + std::string(to_string(static_cast<reduce_op>(h.reduce))) + ")";
  if (c != collective::barrier)
    s += " of " + std::to_string(h.count) + " " + std::string(to_string(static_cast<dtype>(h.type)));
  if (has_root(h.op)) s += " from root " + std::to_string(h.root);
  if (c == collective::send_recv) s += " with tag " + std::to_string(h.tag);
  return s + " (seq " + std::to_string(h.seq) + ")";
}

/// True when `got` belongs to the call `want` describes (the payload length is checked separately).
inline bool same_call(const frame_header& want, const frame_header& got) {
  return got.op == want.op && got.type == want.type && got.reduce == want.reduce && got.root == want.root &&
         got.group == want.group && got.seq == want.seq && got.count == want.count;
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/protocol.hpp>
// ---- begin <ddp/comm/tcp/shm_group.hpp>
/// \file A group's shared-memory segment: per group rank, a phase counter (a futex word) and two regions,
/// each a call description and `shm_region_bytes` of data. A collective runs in phases: a rank fills its
/// region of the phase, posts the phase, waits until every rank posted it, then reads any rank's region of
/// the phase and may fill its region of the next one. Regions alternate, so a rank is never more than one
/// phase ahead of a reader and no region is overwritten while read. Every member maps it at split (or the
/// rendezvous) with O_CREAT, so none waits for another; the last to map it unlinks it.

#include <thread>

// ---- begin <ddp/comm/tcp/scratch.hpp>
/// \file Scratch memory the algorithms keep between calls: it only grows, uninitialized, so steady state
/// allocates and touches no new memory.


namespace ddp::tcp::detail {

/// One scratch buffer; growing discards its contents.
class scratch_buffer {
 public:
  /// The buffer, at least `bytes` long.
  char* get(std::size_t bytes) {
    if (size_ < bytes) {
      data_.reset();  // free first, so the peak is the new size, not both
      data_.reset(new char[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t size_ = 0;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/scratch.hpp>
// ---- begin <ddp/comm/tcp/shm_algo_choice.hpp>
/// \file Which algorithm a large shared-memory all_reduce, reduce_scatter or all_gather runs: single copies out
/// of the peers' buffers, or the pipeline through the group's segment. Neither wins everywhere. Measured on the
/// 2-core VM (all_reduce, N = 2, ddp-launch): on an idle host the pipeline takes half the time or less (16 MiB
/// 2.5 ms against 5.4; 64 MiB 10.3 against 19.7); with the cores busy each of its barriers (one per 512 KiB)
/// waits for a preempted peer, and it takes up to five times as long (16 MiB 64 ms against 13.9). So the
/// group's rank 0 times each such call after its first phase, keeps the latest timings of each algorithm per
/// collective and size class, takes the one whose median is less, and tries the other again after
/// probe_first calls, twice as many each time the trial confirms the choice. The call's first phase tells
/// every rank which algorithm rank 0 took. DDP_SHM_ALGO fixes the algorithm instead (config.hpp).


// ---- begin <ddp/comm/tcp/config.hpp>
/// \file ddp::tcp::config: everything a rank needs to join a job over TCP, and how from_env() reads it.



namespace ddp::tcp {

/// Which kind of store a process uses for copies into shared memory (DDP_SHM_STORES; shm_copy.hpp).
enum class shm_stores {
  automatic,  ///< timed: ordinary stores unless they cost several times what streaming ones do ("auto")
  ordinary,   ///< always ordinary stores: the peers read the lines from this core's cache ("ordinary")
  streaming,  ///< always streaming stores: the lines go to memory, no peer's copy is taken back ("streaming")
};

/// How a shared-memory all_reduce, reduce_scatter or all_gather of 4 MiB and more runs where every rank of the
/// host can read every other's memory (DDP_SHM_ALGO; shm_algo_choice.hpp). The group's rank 0 decides for all.
enum class shm_algo {
  automatic,    ///< timed: whichever of the two took less in the latest calls of the collective and size ("auto")
  single_copy,  ///< always single copies out of the peers' buffers: no barrier per piece ("single_copy")
  pipeline,     ///< always the pipeline through the segment, a barrier per piece ("pipeline")
};

/// Everything a rank needs to join a job over TCP.
struct config {
  int rank = 0;                                   ///< this process's rank, 0..size-1
  int size = 1;                                   ///< number of ranks
  std::string master_addr = "127.0.0.1";          ///< where rank 0 serves the rendezvous store
  std::uint16_t master_port = 29500;              ///< the store's port (0 only for a single rank)
  /// When set (init("file:///path")), the ranks find rank 0's store through this file on a filesystem they
  /// share instead of master_addr:master_port: rank 0 serves the store on a free port and writes its
  /// addresses there, and removes the file once every rank has joined.
  std::string store_file;
  std::string token;                              ///< job token; every rank must pass the same one
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};          ///< deadline of every operation
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(2)};  ///< deadline of the rendezvous
  std::string interface;  ///< interface name or address for the mesh; empty: the one that reaches rank 0
  int socket_buffer_bytes = 0;  ///< SO_SNDBUF/SO_RCVBUF of the mesh sockets; 0 keeps the kernel's autotuning
  /// Ranks on one host (same user) copy large collective frames straight out of each other's memory
  /// (process_vm_readv); false sends every byte through the sockets.
  bool same_host_copy = true;
  /// When every rank runs on one host (same user), collectives go through a shared-memory segment instead of
  /// the sockets; false on any rank keeps every rank on the sockets (DDP_SHM=0).
  bool shared_memory = true;
  /// The kind of store for copies into shared memory, for the whole process (the last communicator made sets it).
  shm_stores stores = shm_stores::automatic;
  /// How a shared-memory all_reduce, reduce_scatter or all_gather from 4 MiB runs; the group's rank 0's setting
  /// holds for every member.
  shm_algo algo = shm_algo::automatic;
  /// A connection to the store or a mesh port must send its handshake within this, or it is closed.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(10)};
  /// Connections still in their handshake that the store or a mesh port keeps at once (the oldest goes first).
  std::size_t max_pending_handshakes = 64;
};

/// `cfg` with the options the environment sets: DDP_TOKEN, DDP_TIMEOUT_MS, DDP_CONNECT_TIMEOUT_MS,
/// DDP_INTERFACE, DDP_SOCKET_BUFFER_BYTES, DDP_SAME_HOST_COPY, DDP_SHM, DDP_SHM_STORES,
/// DDP_SHM_ALGO, DDP_HANDSHAKE_TIMEOUT_MS, DDP_MAX_PENDING_HANDSHAKES (every init method reads them;
/// the rank and the store's address aside).
inline config options_from_env(config cfg = {}) {
  if (auto t = ddp::detail::env_string("DDP_TOKEN")) cfg.token = *t;
  constexpr long long max_ms = 1LL << 40;
  if (auto ms = ddp::detail::env_integer("DDP_TIMEOUT_MS", 1, max_ms, "the operation timeout in milliseconds"))
    cfg.timeout = std::chrono::milliseconds(*ms);
  if (auto ms = ddp::detail::env_integer("DDP_CONNECT_TIMEOUT_MS", 1, max_ms, "the rendezvous deadline in milliseconds"))
    cfg.connect_timeout = std::chrono::milliseconds(*ms);
  if (auto i = ddp::detail::env_string("DDP_INTERFACE")) cfg.interface = *i;
  if (auto b = ddp::detail::env_integer("DDP_SOCKET_BUFFER_BYTES", 0, 1LL << 30, "the mesh sockets' kernel buffer size in bytes (0: autotuning)"))
    cfg.socket_buffer_bytes = static_cast<int>(*b);
  if (auto c = ddp::detail::env_integer("DDP_SAME_HOST_COPY", 0, 1,
                                        "1 to copy large frames between ranks on one host directly, 0 to send "
                                        "them through the sockets"))
    cfg.same_host_copy = *c == 1;
  if (auto s = ddp::detail::env_integer("DDP_SHM", 0, 1,
                                        "1 to run the collectives of ranks on one host through shared memory, 0 to "
                                        "send them through the sockets"))
    cfg.shared_memory = *s == 1;
  constexpr std::pair<std::string_view, shm_stores> stores[] = {
      {"auto", shm_stores::automatic}, {"ordinary", shm_stores::ordinary}, {"streaming", shm_stores::streaming}};
  if (auto k = ddp::detail::env_choice("DDP_SHM_STORES", stores,
                                       "the kind of store copies into shared memory use (auto: chosen from timed "
                                       "copies)",
                                       cfg.rank))
    cfg.stores = *k;
  constexpr std::pair<std::string_view, shm_algo> algos[] = {
      {"auto", shm_algo::automatic}, {"single_copy", shm_algo::single_copy}, {"pipeline", shm_algo::pipeline}};
  if (auto a = ddp::detail::env_choice("DDP_SHM_ALGO", algos,
                                       "the algorithm shared-memory all_reduce, reduce_scatter and all_gather run "
                                       "from 4 MiB (auto: whichever took less in the latest calls)",
                                       cfg.rank))
    cfg.algo = *a;
  if (auto ms = ddp::detail::env_integer("DDP_HANDSHAKE_TIMEOUT_MS", 1, max_ms,
                                         "the time in milliseconds a new connection to the store or a mesh port "
                                         "gets to send its handshake"))
    cfg.handshake_timeout = std::chrono::milliseconds(*ms);
  if (auto n = ddp::detail::env_integer("DDP_MAX_PENDING_HANDSHAKES", 1, 1 << 16,
                                        "the number of connections still in their handshake that the store and "
                                        "each mesh port keep at once"))
    cfg.max_pending_handshakes = static_cast<std::size_t>(*n);
  return cfg;
}

/// The config of this process from the environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (or mpirun's
/// OMPI_COMM_WORLD_*) and the options options_from_env() reads.
inline config config_from_env() {
  const env_config env = read_env_config();
  config cfg;
  cfg.rank = env.rank;
  cfg.size = env.world_size;
  cfg.master_addr = env.master_addr;
  cfg.master_port = env.master_port;
  return options_from_env(std::move(cfg));
}

/// Refuses a job of more than one rank that does not say where rank 0's store listens (MASTER_PORT 0, no store file).
inline void require_store_address(const config& cfg) {
  if (cfg.size > 1 && cfg.master_port == 0 && cfg.store_file.empty())
    throw config_error("MASTER_PORT is 0: with more than one rank, every rank must know rank 0's store port; "
                       "set MASTER_PORT to a free port, or start the job with ddp-launch, which picks one",
                       cfg.rank);
}

}  // namespace ddp::tcp
// ---- end <ddp/comm/tcp/config.hpp>

namespace ddp::tcp::detail {

/// Collectives whose buffers, from this size, may be copied straight out of the peers' memory where it is
/// readable. Measured on the 2-core VM (all_reduce, N = 2, ddp-launch), single copies against the pipeline:
/// 1 MiB 118 us against 72 idle, 3.6 ms against 0.16 busy; 4 MiB 0.56 ms against 0.33 idle, 6.3 ms against
/// 12.2 busy.
inline constexpr std::size_t shm_single_copy_bytes = 4 << 20;

/// Chooses, per collective and size class, the algorithm a large call runs (on the group's rank 0), from the
/// timings record() gets. A group runs one call at a time, so it needs no lock.
class algo_choice {
 public:
  /// Size classes from shm_single_copy_bytes, each twice the one before, the last one open.
  static constexpr std::size_t classes = 8;
  /// Timings kept per algorithm and class; their median counts (the lower of two), so one preempted call does not
  /// swing the choice, nor keep an algorithm that was slow once from being chosen.
  static constexpr std::size_t kept = 3;
  /// Calls the chosen algorithm makes before the other is tried again, after a change of choice.
  static constexpr unsigned probe_first = 4;
  /// At most this many calls between trials of the other algorithm, however often it lost.
  static constexpr unsigned probe_most = 256;

  /// The algorithm the next `kind` call of `bytes` runs: each once, then the faster one, the other at a trial.
  [[nodiscard]] shm_algo choose(collective kind, std::size_t bytes) const {
    const size_class& k = table_[row(kind)][class_of(bytes)];
    if (k.algos[0].count == 0) return algo(0);
    if (k.algos[1].count == 0) return algo(1);
    return k.since_trial >= k.trial_after ? algo(1 - k.best) : algo(k.best);
  }

  /// Records that a `kind` call of `bytes` took `took` (after its first phase) with algorithm `a`.
  void record(collective kind, std::size_t bytes, shm_algo a, std::chrono::nanoseconds took) {
    size_class& k = table_[row(kind)][class_of(bytes)];
    const std::size_t i = a == shm_algo::pipeline ? 1 : 0;
    timings& t = k.algos[i];
    t.ns_per_kib[t.count++ % kept] = static_cast<std::uint64_t>(took.count()) * 1024 / std::max<std::size_t>(bytes, 1);
    if (k.algos[0].count == 0 || k.algos[1].count == 0) return;
    const std::size_t best = median(k.algos[1]) < median(k.algos[0]) ? 1 : 0;
    if (best != k.best) {  // the other algorithm is faster now
      k = size_class{k.algos, best};
    } else if (i == best) {
      ++k.since_trial;
    } else {  // a trial of the other algorithm confirmed the choice
      k.since_trial = 0;
      k.trial_after = std::min(2 * k.trial_after, probe_most);
    }
  }

 private:
  struct timings {
    std::array<std::uint64_t, kept> ns_per_kib{};
    std::size_t count = 0;
  };
  struct size_class {
    std::array<timings, 2> algos;  ///< single copies, the pipeline
    std::size_t best = 0;
    unsigned since_trial = 0;  ///< calls the best algorithm made since the other was last tried
    unsigned trial_after = probe_first;
  };

  /// all_reduce, reduce_scatter, all_gather (the collectives that may take single copies).
  static std::size_t row(collective kind) {
    return kind == collective::reduce_scatter ? 1 : kind == collective::all_gather ? 2 : 0;
  }
  static std::size_t class_of(std::size_t bytes) {
    const auto bits = static_cast<std::size_t>(std::bit_width(bytes / shm_single_copy_bytes));  // the first class: 1
    return std::min(classes - 1, bits == 0 ? 0 : bits - 1);
  }
  static shm_algo algo(std::size_t i) { return i == 0 ? shm_algo::single_copy : shm_algo::pipeline; }
  static std::uint64_t median(const timings& t) {
    std::array<std::uint64_t, kept> v = t.ns_per_kib;
    const std::size_t n = std::min(t.count, kept);
    std::sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
    return v[(n - 1) / 2];
  }

  std::array<std::array<size_class, classes>, 3> table_{};
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_algo_choice.hpp>
// ---- begin <ddp/comm/tcp/shm_segment.hpp>
/// \file POSIX shared-memory segments of the same-host transport: named per job
/// ("/ddp-<uid>-<pid namespace>-<creator pid>-<nonce>[-<group>]"), mapped by every rank of a group and unlinked
/// as soon as all of them have mapped it, so nothing is left behind on any later exit path. A segment whose job
/// died before every rank mapped it (its creator's pid is gone) is removed by the next job on the host that runs
/// in the same PID namespace (a container sharing /dev/shm but not the pids never judges another's segments).

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>

// ---- begin <ddp/comm/tcp/same_host.hpp>
/// \file The same-host copy protocol. Between ranks on one host (same user), a large collective frame
/// carries only the address of its data (a remote frame); the receiver copies the data straight out of the
/// sender's memory with process_vm_readv (one copy instead of the socket's two) and answers op_ack, and the
/// sender keeps the buffer unchanged until then. A sender that aborts first changes its live word, then
/// releases its buffers; the receiver reads that word after the data, in the same system call, so a copy
/// that overlapped the release is recognised and discarded (the kernel takes the address space's lock per
/// remote region, so the word is read after the data).

#include <sys/types.h>
#include <sys/uio.h>

#include <random>


namespace ddp::tcp::detail {

/// Collective frames of at least this many payload bytes travel as remote frames where the peer can read
/// this process; below it, the acknowledgement's round trip costs more than the socket's second copy.
inline constexpr std::size_t remote_min_bytes = 512 << 10;

/// Which machine and process-id space a process lives in: a process id names the same process for two ranks
/// only when both agree. Another machine has another boot id; a container or a simulated host in its own PID
/// namespace has another namespace, where a pid names some unrelated process.
struct host_identity {
  std::uint64_t boot = 0;      ///< a hash of /proc/sys/kernel/random/boot_id (0 where it cannot be read)
  std::uint64_t pid_ns = 0;    ///< the inode of /proc/self/ns/pid (0 where it cannot be read)
  std::uint64_t pid_ns_dev = 0;///< its device

  /// Both known and equal: the pids of one process mean the same process for the other.
  [[nodiscard]] bool shares_pids_with(const host_identity& o) const noexcept {
    return boot != 0 && pid_ns != 0 && boot == o.boot && pid_ns == o.pid_ns && pid_ns_dev == o.pid_ns_dev;
  }
};

/// This process's host identity.
inline host_identity this_host() {
  host_identity id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (in >> boot) {
    id.boot = 0xcbf29ce484222325ULL;  // FNV-1a
    for (const unsigned char c : boot) id.boot = (id.boot ^ c) * 0x100000001b3ULL;
  }
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) {
    id.pid_ns = static_cast<std::uint64_t>(ns.st_ino);
    id.pid_ns_dev = static_cast<std::uint64_t>(ns.st_dev);
  }
  return id;
}

/// What a rank knows about reaching one peer's memory directly (both on one host, same user).
struct peer_memory {
  ::pid_t pid = 0;                 ///< the peer's process id, as this rank sees it
  bool readable = false;           ///< this rank can copy from the peer's memory
  bool reads_us = false;           ///< the peer can copy from this rank's memory: send it remote frames
  std::uint64_t live_address = 0;  ///< where the peer keeps its live word
  std::uint64_t live_value = 0;    ///< the live word's value while the peer has not aborted
};

/// This process's live word, which peers on this host read after each copy from its memory: it changes once
/// when the engine aborts, before any buffer is released, so a copy that overlapped the release is recognised
/// and discarded.
class live_word {
 public:
  live_word() {
    std::random_device random;
    value_ = ((std::uint64_t{random()} << 32) ^ random()) | 1U;
    word_.store(value_);
  }
  /// The word itself (peers read it at its address).
  [[nodiscard]] const std::atomic<std::uint64_t>& word() const { return word_; }
  /// Changes the word, once, from either thread: after it, no copy out of this process's buffers counts.
  void end() {
    std::uint64_t alive = value_;
    word_.compare_exchange_strong(alive, ~value_);
  }

 private:
  std::atomic<std::uint64_t> word_{0};
  std::uint64_t value_ = 0;  ///< the word's value until the engine aborts
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
                "ddp: peers read the live word with process_vm_readv; it must be a plain lock-free word.");
};

/// How a copy out of a peer's memory ended.
enum class copy_result : std::uint8_t {
  copied,   ///< every byte, and the peer had not aborted when the copy ended
  aborted,  ///< the peer aborted (and may have released the buffer) before the copy ended: discard the bytes
  failed,   ///< the system call failed (errno in `code`): the peer died, or released the buffer
};

/// Copies `from` (in the peer's memory) to `dest`, then reads the peer's live word in the same call.
inline copy_result copy_from_peer(const peer_memory& peer, const remote_block& from, char* dest, int& code) {
  std::uint64_t live = 0;
  const std::size_t total = from.bytes + sizeof live;
  for (std::size_t done = 0; done < total;) {
    iovec local[2];
    iovec remote[2];
    unsigned long n = 0;
    if (done < from.bytes) {
      local[n] = {dest + done, from.bytes - done};
      remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(from.address + done)), from.bytes - done};
    }
    const std::size_t word_done = done > from.bytes ? done - from.bytes : 0;
    local[n] = {reinterpret_cast<char*>(&live) + word_done, sizeof live - word_done};
    remote[n++] = {reinterpret_cast<void*>(static_cast<std::uintptr_t>(peer.live_address + word_done)),
                   sizeof live - word_done};
    const ssize_t k = ::process_vm_readv(peer.pid, local, n, remote, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      code = k < 0 ? errno : EFAULT;  // 0 bytes: its buffer ended early
      return copy_result::failed;
    }
    done += static_cast<std::size_t>(k);
  }
  return live == peer.live_value ? copy_result::copied : copy_result::aborted;
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/same_host.hpp>
// ---- begin <ddp/comm/tcp/socket.hpp>
/// \file Thin POSIX socket layer of the TCP backend: owned descriptors, listening, connecting with
/// retries, blocking transfers with a deadline, address and interface lookup.

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>


namespace ddp::tcp::detail {

using clock = std::chrono::steady_clock;

/// "what: strerror(code)".
inline std::string errno_text(int code) { return std::string(std::strerror(code)); }

/// An owned file descriptor, closed on destruction.
class socket_fd {
 public:
  socket_fd() = default;
  explicit socket_fd(int fd) noexcept : fd_(fd) {}
  socket_fd(socket_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& o) noexcept {
    if (this != &o) { reset(); fd_ = std::exchange(o.fd_, -1); }
    return *this;
  }
  socket_fd(const socket_fd&) = delete;
  socket_fd& operator=(const socket_fd&) = delete;
  ~socket_fd() { reset(); }
  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

/// An IPv4 endpoint.
struct endpoint {
  std::string host;      ///< dotted address
  std::uint16_t port{};  ///< port
  [[nodiscard]] std::string str() const { return host + ":" + std::to_string(port); }
};

inline void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

/// TCP_NODELAY (frames are sent whole) and large kernel buffers for the data sockets.
inline void tune_data_socket(int fd, int buffer_bytes) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
  }
}

/// Resolves `host` (name or dotted address) to an IPv4 address; throws config_error naming `what`.
inline sockaddr_in resolve(const std::string& host, std::uint16_t port, int rank, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr)
    throw config_error("cannot resolve " + what + " '" + host + "' (" + ::gai_strerror(rc) +
                           "); set it to an IPv4 address or a host name this machine can resolve",
                       rank);
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  addr.sin_port = htons(port);
  return addr;
}

inline endpoint to_endpoint(const sockaddr_in& a) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
  return {text, ntohs(a.sin_port)};
}

/// The local address of a connected or bound socket.
inline endpoint local_endpoint(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return to_endpoint(a);
}

/// The remote address of a connected socket.
inline endpoint remote_endpoint(int fd) {
  sockaddr_in a{};
  socklen_t n = sizeof a;
  ::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &n);
  return to_endpoint(a);
}

/// The interface name that carries IPv4 address `host`, or "" when none does.
inline std::string interface_of(const std::string& host) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string name;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET &&
        to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host == host) {
      name = i->ifa_name;
      break;
    }
  ::freeifaddrs(list);
  return name;
}

/// The IPv4 address of `spec`: an interface name (eth0) or an address; throws config_error otherwise.
inline std::string interface_address(const std::string& spec, int rank) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    std::string address;
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
      if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET && spec == i->ifa_name) {
        address = to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host;
        break;
      }
    ::freeifaddrs(list);
    if (!address.empty()) return address;
  }
  return to_endpoint(resolve(spec, 0, rank, "interface (DDP_INTERFACE)")).host;
}

/// A listening socket bound to `host:port` (port 0: any free port).
inline socket_fd listen_on(const std::string& host, std::uint16_t port, int rank, const std::string& what) {
  socket_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw error("cannot create a socket for " + what + ": " + errno_text(errno), rank, errno);
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr = resolve(host, port, rank, what + " address");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd.get(), 128) != 0)
    throw config_error("cannot listen on " + host + ":" + std::to_string(port) + " for " + what + ": " +
                           errno_text(errno) + "; pick a free port (MASTER_PORT) and an address of this host",
                       rank, errno);
  set_nonblocking(fd.get());
  return fd;
}

/// Milliseconds left until `deadline`, at least 0, for poll().
inline int poll_ms(clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
  return left <= 0 ? 0 : (left > 1'000'000 ? 1'000'000 : static_cast<int>(left));
}

/// Connects non-blocking socket `fd` to `addr`, waiting until `deadline` at most (an address that drops
/// packets does not hold the caller for the kernel's minutes of SYN retries); 0, or the errno of the failure.
inline int connect_by(int fd, const sockaddr_in& addr, clock::time_point deadline) {
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{fd, POLLOUT, 0};
  int k = 0;
  while ((k = ::poll(&p, 1, poll_ms(deadline))) < 0 && errno == EINTR) {
  }
  if (k <= 0) return k == 0 ? ETIMEDOUT : errno;
  int code = 0;
  socklen_t len = sizeof code;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &code, &len);
  return code;
}

/// Connects to `host:port`, retrying with exponential backoff (10 ms .. 1 s) until `deadline`.
inline socket_fd connect_with_retry(const std::string& host, std::uint16_t port, clock::time_point deadline, int rank,
                                    const std::string& what, const std::string& fix) {
  const sockaddr_in addr = resolve(host, port, rank, what + " address");
  auto backoff = std::chrono::milliseconds(10);
  int last = 0;
  while (true) {
    socket_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) throw error("cannot create a socket: " + errno_text(errno), rank, errno);
    last = connect_by(fd.get(), addr, deadline);
    if (last == 0) return fd;
    if (clock::now() + backoff >= deadline)
      throw timeout_error("could not reach " + what + " at " + host + ":" + std::to_string(port) +
                              " before the connect deadline (last error: " + errno_text(last) + "); " + fix,
                          rank, last);
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

/// Why a blocking transfer stopped early.
enum class io_status { ok, closed, timed_out, failed };

/// Sends `n` bytes on non-blocking `fd`, waiting in poll up to `deadline`.
inline io_status send_all(int fd, const void* data, std::size_t n, clock::time_point deadline) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) { p += k; n -= static_cast<std::size_t>(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return io_status::closed;
    pollfd pfd{fd, POLLOUT, 0};
    if (::poll(&pfd, 1, poll_ms(deadline)) == 0) return io_status::timed_out;
  }
  return io_status::ok;
}

/// Receives exactly `n` bytes on non-blocking `fd`, waiting in poll up to `deadline`.
inline io_status recv_all(int fd, void* data, std::size_t n, clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) { p += k; n -= static_cast<std::size_t>(k); continue; }
    if (k == 0) return io_status::closed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return io_status::failed;
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, poll_ms(deadline)) == 0) return io_status::timed_out;
  }
  return io_status::ok;
}

/// 64-bit FNV-1a: the job token travels as this hash, never in clear.
inline std::uint64_t token_hash(const std::string& token) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char c : token) h = (h ^ c) * 0x100000001b3ULL;
  return h ^ 0x6464702d746370ULL;  // "ddp-tcp": an empty token still hashes to a non-trivial value
}

}  // namespace ddp::tcp::detail

namespace ddp::tcp::detail {
/// Writes "ddp [rank R]: tcp: text" to stderr in one write, so lines of concurrent ranks do not interleave.
inline void log_line(int rank, const std::string& text) {
  const std::string line = "ddp [rank " + std::to_string(rank) + "]: tcp: " + text + "\n";
  [[maybe_unused]] const auto n = ::write(2, line.data(), line.size());
}
}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/socket.hpp>

namespace ddp::tcp::detail {

/// The job's segment name prefix for this user in this PID namespace: "/ddp-<uid>-<pid namespace inode>-".
inline std::string shm_user_prefix() {
  static const std::string prefix =
      "/ddp-" + std::to_string(::getuid()) + "-" + std::to_string(this_host().pid_ns) + "-";
  return prefix;
}

/// Removes this user's segments whose creator process is gone (jobs killed before every rank mapped them).
inline void reap_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const std::string prefix = shm_user_prefix().substr(1);
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<::pid_t>(pid), 0) != 0 && errno == ESRCH) ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(dir);
}

/// A mapped shared-memory segment; unmapped on destruction.
class shm_mapping {
 public:
  shm_mapping() = default;
  shm_mapping(shm_mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      reset();
      base_ = std::exchange(o.base_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~shm_mapping() { reset(); }

  /// Opens (creating it where `create`; exclusively where `exclusive`) segment `name` of `bytes`, zero-filled
  /// when new, and maps it; throws ddp::error naming `rank` when the system refuses.
  static shm_mapping open(const std::string& name, std::size_t bytes, bool create, bool exclusive, int rank) {
    const int flags = O_RDWR | (create ? O_CREAT : 0) | (exclusive ? O_EXCL : 0);
    socket_fd fd(::shm_open(name.c_str(), flags, 0600));
    if (!fd.valid() || (create && ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0))
      throw error("cannot open the shared-memory segment " + name + ": " + errno_text(errno) +
                      "; check that /dev/shm is mounted with room, or set DDP_SHM=0 to use the sockets only",
                  rank, errno);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    if (p == MAP_FAILED)
      throw error("cannot map the shared-memory segment " + name + ": " + errno_text(errno) +
                      "; raise the memory limits, or set DDP_SHM=0 to use the sockets only",
                  rank, errno);
    shm_mapping m;
    m.base_ = static_cast<char*>(p);
    m.bytes_ = bytes;
    return m;
  }

  [[nodiscard]] char* data() const noexcept { return base_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  [[nodiscard]] bool valid() const noexcept { return base_ != nullptr; }
  void reset() noexcept {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = nullptr;
    bytes_ = 0;
  }

 private:
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Counts a mapping of segment `name` in its word `mapped`; the rank that completes the count of `ranks`
/// unlinks the name (every rank has the segment mapped by then, so none opens it afterwards).
inline void count_mapping(std::atomic<std::uint32_t>& mapped, const std::string& name, int ranks) {
  if (mapped.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(ranks)) ::shm_unlink(name.c_str());
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_segment.hpp>
// ---- begin <ddp/comm/tcp/shm_world.hpp>
/// \file The job's shared-memory segment of one host (the whole job's where every rank runs on one host): per
/// world rank, a robust mutex its engine thread holds for its lifetime (the kernel marks it when the process
/// dies, even by SIGKILL, so a survivor sees the death with one load) and the state it left in: running,
/// closed, or aborted with the error its peers then raise. The host's lowest rank (rank 0 on one host) creates
/// it at the rendezvous; it is unlinked once all the host's ranks mapped it.

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>

#include <ctime>


namespace ddp::tcp::detail {

/// A thread waiting on shared memory (a collective's barrier, a send or recv on the caller's thread) spins this
/// long, then yields its core between looks: the peer's threads or this rank's engine thread may need the core.
inline constexpr std::chrono::microseconds shm_yield_after{5};

/// Sleeps while the shared word `w` holds `seen`, at most `ns` nanoseconds (spurious returns are fine).
inline void futex_wait(std::atomic<std::uint32_t>& w, std::uint32_t seen, long ns) {
  const timespec t{ns / 1000000000L, ns % 1000000000L};
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAIT, seen, &t, nullptr, 0);
}
/// Wakes every process sleeping on the shared word `w`.
inline void futex_wake(std::atomic<std::uint32_t>& w) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&w), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

/// How a rank left the job, as its peers see it in the job segment (writing: its abort notice is being
/// written, and it still counts as running).
enum class shm_state : std::uint32_t { running = 0, closed = 1, aborted = 2, writing = 3 };

/// One rank's place in the job segment.
struct shm_rank_life {
  pthread_mutex_t alive;                   ///< robust, held by the rank's engine thread while it runs
  std::atomic<std::uint32_t> state{0};     ///< shm_state
  std::uint32_t kind = 0;                  ///< abort_kind of the error it aborted with
  std::int32_t lost_rank = -1;             ///< the world rank its peer_lost names
  std::uint32_t text_bytes = 0;
  char text[max_abort_text];               ///< the error's message (as long as the sockets carry)
};

/// The job segment's layout.
struct shm_world_layout {
  std::uint64_t magic = 0;  ///< written by rank 0 before it publishes the name
};

/// The job segment, mapped by this rank.
class shm_world {
 public:
  static constexpr std::uint64_t magic = 0x444450534d574c44ULL;  // "DDPSMWLD"

  /// Maps the segment `name` of a job of `size` ranks, `local` of them on this host, as world rank `rank` (the
  /// `creator` creates it and writes the magic; the others open it).
  shm_world(std::string name, int size, int rank, bool creator, int local)
      : name_(std::move(name)), size_(size), local_(local), rank_(rank) {
    map_ = shm_mapping::open(name_, bytes(size), creator, creator, rank);
    if (creator) layout().magic = magic;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&life(rank).alive, &a);
    pthread_mutexattr_destroy(&a);
  }
  shm_world(const shm_world&) = delete;

  /// The segment's name (subgroup segments are named after it).
  [[nodiscard]] const std::string& name() const { return name_; }
  /// The job's number of ranks.
  [[nodiscard]] int size() const { return size_; }
  /// The job's ranks on this host (size() where every rank is on this host).
  [[nodiscard]] int local_size() const { return local_; }
  /// True when rank 0 wrote the magic: the segment is the job's.
  [[nodiscard]] bool genuine() { return layout().magic == magic; }

  /// On the engine thread: holds this rank's robust mutex until release() or the process's death.
  void hold() { pthread_mutex_lock(&life(rank_).alive); }
  /// On the engine thread, when the communicator closes: says so to the peers and lets the mutex go.
  void release() {
    auto& me = life(rank_);
    std::uint32_t running = 0;
    me.state.compare_exchange_strong(running, static_cast<std::uint32_t>(shm_state::closed));
    pthread_mutex_unlock(&me.alive);
  }
  /// Publishes this rank's first error, so peers waiting on it raise the same error (later ones are dropped).
  void abort(const abort_notice& n) {
    auto& me = life(rank_);
    std::uint32_t running = 0;
    if (!me.state.compare_exchange_strong(running, static_cast<std::uint32_t>(shm_state::writing))) return;
    me.kind = n.header.flags;
    me.lost_rank = n.header.lost_rank;
    me.text_bytes = static_cast<std::uint32_t>(std::min(n.text.size(), sizeof me.text));
    std::memcpy(me.text, n.text.data(), me.text_bytes);
    me.state.store(static_cast<std::uint32_t>(shm_state::aborted), std::memory_order_release);
  }

  /// How world rank `r` left, or running while it runs; a process that died counts as closed.
  [[nodiscard]] shm_state state_of(int r) {
    auto& l = life(r);
    const auto s = static_cast<shm_state>(l.state.load(std::memory_order_acquire));
    if (s == shm_state::closed || s == shm_state::aborted) return s;
    // The robust futex protocol: the kernel sets FUTEX_OWNER_DIED in the word when the holder dies.
    const int word = std::atomic_ref<int>(l.alive.__data.__lock).load(std::memory_order_acquire);
    return (word & FUTEX_OWNER_DIED) != 0 ? shm_state::closed : shm_state::running;
  }
  /// The error rank `r` aborted with (state_of(r) == aborted).
  [[nodiscard]] const shm_rank_life& notice_of(int r) { return life(r); }

  /// What this rank may read of each world rank's memory (same_host.hpp), set once at the rendezvous.
  std::vector<peer_memory> memory;
  /// Every rank on this host can copy straight out of every other one's memory: collectives may use single copies.
  bool single_copy = false;
  /// This rank's DDP_SHM_ALGO, set once at the rendezvous: how a group it leads runs collectives from
  /// shm_single_copy_bytes where single_copy holds.
  shm_algo algo = shm_algo::automatic;

 private:
  static std::size_t bytes(int size) { return sizeof(shm_world_layout) + 64 + sizeof(shm_rank_life) * static_cast<std::size_t>(size); }
  shm_world_layout& layout() { return *reinterpret_cast<shm_world_layout*>(map_.data()); }
  shm_rank_life& life(int r) {
    return reinterpret_cast<shm_rank_life*>(map_.data() + sizeof(shm_world_layout) + 64)[r];
  }

  std::string name_;
  int size_;
  int local_;
  int rank_;
  shm_mapping map_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_world.hpp>

namespace ddp::tcp::detail {

/// Data bytes of one region: the most a rank publishes in one phase. Measured on the 2-core VM (N = 2), 1 MiB
/// regions beat 256 KiB ones (1 MiB all_reduce: 60 us against 126 us; 4 MiB: 0.26-0.45 ms against 0.58 ms)
/// and larger ones add nothing.
inline constexpr std::size_t shm_region_bytes = 1 << 20;

/// One group rank's counters, each on its own cache line.
struct shm_counters {
  alignas(64) std::atomic<std::uint32_t> posted{0};  ///< phases this rank has posted (its futex word)
  alignas(64) std::atomic<std::uint32_t> sleepers{0};  ///< ranks sleeping on `posted`: the poster wakes them
};

/// A region's head: the call the phase belongs to, compared by every reader.
struct alignas(64) shm_region_head {
  frame_header call;
};

/// The group's segment, mapped by this rank, and the group's phase count.
class shm_group {
 public:
  /// Maps (creating it if first) the segment of the group `id` of `members` (world ranks) in the job segment `world`;
  /// `ranks`, where given, are the members' ranks in the group the messages name (a hierarchical group's).
  shm_group(std::shared_ptr<shm_world> world, std::uint32_t id, std::vector<int> members, int me,
            std::vector<int> ranks = {})
      : world_(std::move(world)), members_(std::move(members)), ranks_(std::move(ranks)), me_(me) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", id);
    const std::string name = world_->name() + "-" + hex;
    const auto n = members_.size();
    map_ = shm_mapping::open(name, 64 + n * (sizeof(shm_counters) + 2 * region_stride()), true, false, members_[me_]);
    count_mapping(*reinterpret_cast<std::atomic<std::uint32_t>*>(map_.data()), name, static_cast<int>(n));
  }
  shm_group(const shm_group&) = delete;

  [[nodiscard]] shm_world& world() { return *world_; }
  [[nodiscard]] int me() const { return me_; }
  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }
  [[nodiscard]] int world_rank(int r) const { return members_[static_cast<std::size_t>(r)]; }
  /// Member `r`'s rank in the group the messages name.
  [[nodiscard]] int group_rank(int r) const { return ranks_.empty() ? r : ranks_[static_cast<std::size_t>(r)]; }

  /// Group rank `r`'s counters.
  shm_counters& counters(int r) { return reinterpret_cast<shm_counters*>(map_.data() + 64)[r]; }
  /// Group rank `r`'s region for phase `phase`: its head, then shm_region_bytes of data.
  shm_region_head& head(int r, std::uint32_t phase) {
    const std::size_t at = 64 + members_.size() * sizeof(shm_counters) +
                           (2 * static_cast<std::size_t>(r) + (phase & 1U)) * region_stride();
    return *reinterpret_cast<shm_region_head*>(map_.data() + at);
  }
  char* data(int r, std::uint32_t phase) { return reinterpret_cast<char*>(&head(r, phase)) + sizeof(shm_region_head); }

  /// True where the job has more ranks on this host than the host has cores: waits sleep at once instead of spinning.
  [[nodiscard]] bool oversubscribed() const { return oversubscribed_; }

  /// Phases this rank has completed (posted and seen every rank post); the engine's queue orders the calls.
  std::uint32_t phase = 0;

  /// True when every rank of the host can copy straight out of every other one's memory (the same answer on each).
  [[nodiscard]] bool reads_all() const { return world_->single_copy; }
  /// The members' buffer addresses of the executing single-copy call.
  std::vector<std::uint64_t> addresses;
  /// The algorithm this rank would run a `kind` call of `bytes` with where reads_all() (the group's rank 0 decides
  /// for all).
  [[nodiscard]] shm_algo algo(collective kind, std::size_t bytes) const {
    return world_->algo == shm_algo::automatic ? algos.choose(kind, bytes) : world_->algo;
  }
  /// Rank 0's timings of the large calls and the algorithm each collective and size class runs.
  algo_choice algos;
  /// A scratch buffer of at least `bytes`, kept for later calls: it only grows, uninitialized.
  char* scratch(std::size_t bytes) { return scratch_.get(bytes); }

 private:
  static constexpr std::size_t region_stride() { return sizeof(shm_region_head) + shm_region_bytes; }
  std::shared_ptr<shm_world> world_;
  std::vector<int> members_;
  std::vector<int> ranks_;
  int me_;
  shm_mapping map_;
  scratch_buffer scratch_;
  /// Read once: the count of cores costs a file read (glibc reads /sys), more than a small collective.
  bool oversubscribed_ = static_cast<unsigned>(world_->local_size()) > std::max(1U, std::thread::hardware_concurrency());
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_group.hpp>
// ---- begin <ddp/comm/tcp/shm_hosts.hpp>
/// \file Which ranks of a job share a host, and what a group spanning hosts makes of it. The rendezvous leaves
/// the job's shared memory as shm_hosts: this host's segment and each world rank's host. A group with every
/// member on this host runs over one segment of its own; a group spanning hosts with two members or more on
/// some host gets a host_plan: its members on this host (over their own segment) and one member per host
/// that speaks for it over the sockets (hierarchical.hpp runs the collectives).



namespace ddp::tcp::detail {

/// The job's shared memory as the rendezvous left it (absent where any rank cannot use it, or DDP_SHM=0).
struct shm_hosts {
  /// This host's segment (the job's only one where every rank is on this host); null where this rank is its
  /// host's only rank.
  std::shared_ptr<shm_world> segment;
  /// Per world rank, its host: the lowest world rank on the same host.
  std::vector<int> host_of;
};

/// A group spanning hosts, with two members or more on some host: its hosts in the order of their lowest group
/// rank, and this rank's host's members.
struct host_plan {
  std::vector<int> host_of;        ///< per group rank, the index of its host
  std::vector<int> leads;          ///< per host, its lowest group rank
  std::vector<int> lead_world;     ///< per host, its lowest group rank's world rank
  std::vector<int> by_host;        ///< the group ranks by host (in host order), ascending within each
  std::vector<int> host_start;     ///< where host j's ranks start in `by_host` (one more entry: the group's size)
  std::vector<int> local;          ///< the group ranks on this rank's host, ascending
  int me_local = 0;                ///< this rank's place in `local`
  std::shared_ptr<shm_group> shm;  ///< `local`'s segment; null where this rank is its host's only member
  std::uint32_t across = 0;        ///< the group id the frames of the steps across hosts carry

  /// The number of hosts the group spans.
  [[nodiscard]] int hosts() const { return static_cast<int>(leads.size()); }
  /// The number of group ranks on host `j`.
  [[nodiscard]] int ranks_on(int j) const {
    return host_start[static_cast<std::size_t>(j) + 1] - host_start[static_cast<std::size_t>(j)];
  }
  /// The index of this rank's host.
  [[nodiscard]] int host() const { return host_of[static_cast<std::size_t>(local.front())]; }
  /// The place in `local` of group rank `r`, which is on this host.
  [[nodiscard]] int local_index(int r) const {
    int i = 0;
    while (local[static_cast<std::size_t>(i)] != r) ++i;
    return i;
  }
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_hosts.hpp>

namespace ddp::tcp::detail {

/// After a call has waited this long without a byte moving, the engine tells the group what it waits in
/// (op_waiting) and publishes whom it waits for (over shared memory: only whom); a peer at the same step in another call then raises
/// mismatch_error at once.
inline constexpr std::chrono::milliseconds stall_notice_after{250};

/// A set of ranks sharing the mesh: the world, or a subgroup made by split().
struct group {
  std::vector<int> members;  ///< world rank of each group rank
  int me = 0;                ///< this process's group rank
  std::uint32_t id = 0;      ///< identifier carried in every frame
  std::chrono::milliseconds timeout{};
  std::uint64_t next_seq = 0;  ///< guarded by the engine's queue mutex
  std::uint64_t splits = 0;    ///< splits made from this group, for the children's ids
  ddp::detail::stats_counter stats;
  std::shared_ptr<ddp::detail::flight_recorder> flight;  ///< the group's last collectives (null when off)
  std::shared_ptr<shm_group> shm;  ///< the group's shared-memory segment when every member is on this host; else null
  std::shared_ptr<const shm_hosts> hosts;  ///< the job's shared memory, for the groups split() makes; null: none
  std::shared_ptr<host_plan> hier;  ///< where the group spans hosts with two members or more on one: its hierarchy

  [[nodiscard]] int size() const { return static_cast<int>(members.size()); }
};

/// Which side of a point-to-point transfer a call is; collectives are neither. Told explicitly, never
/// guessed from the buffers (an empty send has no data pointer).
enum class p2p : std::uint8_t { none, send, recv };

/// One queued call: what the engine executes, in submission order.
struct call {
  collective kind{};
  p2p side = p2p::none;
  dtype type = dtype::f32;
  reduce_op op = reduce_op::sum;
  int root = -1;            ///< root, or peer for send/recv
  std::int32_t tag = 0;     ///< send/recv tag
  std::uint64_t count = 0;  ///< the count frames carry
  const void* in = nullptr;
  void* out = nullptr;
  std::shared_ptr<group> grp;
  std::uint64_t seq = 0;
  std::shared_ptr<ddp::detail::completion> done;
  bool resumed = false;  ///< a shared-memory call the caller's thread started and handed to the engine
  /// Where not 0, the group its frames name instead of grp->id: a hierarchical call's step across hosts, whose
  /// frames (op, root) differ from the call's own, so no check takes them for another call at the same step.
  std::uint32_t wire_group = 0;

  /// True for a collective that runs over its group's shared-memory segment.
  [[nodiscard]] bool over_shm() const { return side == p2p::none && grp->shm != nullptr; }
};

/// The header every frame of `c` carries, with payload `length`.
inline frame_header header_of(const call& c, std::uint64_t length) {
  frame_header h;
  h.op = static_cast<std::uint8_t>(c.kind);
  h.type = static_cast<std::uint8_t>(c.type);
  h.reduce = has_reduce(h.op) ? static_cast<std::uint8_t>(c.op) : 0;
  if (has_root(h.op)) h.root = c.root;
  if (c.kind == collective::send_recv) h.tag = c.tag;
  h.group = c.wire_group != 0 ? c.wire_group : c.grp->id;
  h.seq = c.seq;
  h.count = c.count;
  h.length = length;
  return h;
}

/// One receive the current call waits for.
struct recv_part {
  int peer = 0;  ///< group rank
  void* dest = nullptr;
  std::size_t bytes = 0;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/call.hpp>
// ---- begin <ddp/comm/tcp/engine.hpp>
/// \file The progress engine: ONE thread per job owns the mesh sockets, runs the queued calls in order and
/// sleeps in poll() when idle. Per peer (peer.hpp), sends queue in a frame_writer drained by the same loop;
/// a frame_reader routes point-to-point frames to the mailbox (peer_io.hpp, which also moves them through
/// the shared-memory rings on one host) and holds a collective frame until its call expects it. Errors abort the call, reach the peers in an abort frame and poison the engine.
/// Calls arrive through a call_queue; collectives of groups on one host run over shared memory, on the
/// caller's thread when the engine is idle, else on the engine thread between sleeps that serve the sockets
/// (shm_run.hpp).

#include <sys/eventfd.h>


// ---- begin <ddp/comm/tcp/call_queue.hpp>
/// \file The calls submitted to the engine, in submission order, and who runs them. The engine thread takes
/// them one at a time; a shared-memory call (a collective of a group on one host, or a send or recv through
/// the rings) submitted while nothing runs or waits may run on the caller's thread instead (shm_run.hpp,
/// peer_io.hpp): a collective goes back to the front of the queue when its peers are late, a recv stays posted. One mutex
/// guards the queue and orders the submissions (callers take it to number their calls).

#include <deque>


namespace ddp::tcp::detail {

class call_queue {
 public:
  /// The mutex that orders submissions; callers take it to assign sequence numbers atomically with push_locked().
  std::mutex& mutex() { return mutex_; }
  /// With mutex() held: queues `c` behind the others.
  void push_locked(call c) { calls_.push_back(std::move(c)); }
  /// With mutex() held: true (and the queue claimed) when call `c` may run on the caller's thread now: a
  /// collective over shared memory, or a send or recv where the job has shared memory, with nothing running or
  /// waiting before it and the engine not failed.
  bool claim_locked(const call& c) {
    if (c.grp->shm == nullptr || busy_ || !calls_.empty() || failed_ || caller_failure_) return false;
    busy_ = true;
    return true;
  }
  /// Ends the caller's claim: `back` (a call handed off) goes to the front, `failure` (what a call on the
  /// caller's thread failed with) waits for the engine thread to tell the peers. True when the engine thread
  /// has work.
  bool release(std::optional<call> back, std::exception_ptr failure) {
    std::lock_guard lock(mutex_);
    if (back) calls_.push_front(std::move(*back));
    if (failure) caller_failure_ = std::move(failure);
    busy_ = false;
    return !calls_.empty() || caller_failure_;
  }

  // ---- the engine thread's side ----

  /// With mutex() held: the next call, claimed, where none runs.
  std::optional<call> take_locked() {
    if (calls_.empty() || busy_) return std::nullopt;
    std::optional<call> c(std::move(calls_.front()));
    calls_.pop_front();
    busy_ = true;
    return c;
  }
  /// The call take_locked() gave has completed.
  void finished() {
    std::lock_guard lock(mutex_);
    busy_ = false;
  }
  /// With mutex() held: what a call on the caller's thread failed with (once), or null.
  std::exception_ptr take_caller_failure_locked() { return std::exchange(caller_failure_, nullptr); }
  /// The engine aborted: later calls run (and fail) on the engine thread.
  void fail() {
    std::lock_guard lock(mutex_);
    failed_ = true;
  }
  /// Asks the engine thread to stop.
  void stop() {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  /// With mutex() held: true once stop() was called.
  [[nodiscard]] bool stopping_locked() const { return stop_; }
  /// True once stop() was called.
  [[nodiscard]] bool stopping() {
    std::lock_guard lock(mutex_);
    return stop_;
  }
  /// Removes and returns every call still queued.
  std::deque<call> drain() {
    std::lock_guard lock(mutex_);
    return std::exchange(calls_, {});
  }

 private:
  std::mutex mutex_;
  std::deque<call> calls_;
  bool busy_ = false;                  ///< a call runs, on the engine thread or the caller's
  bool failed_ = false;                ///< the engine aborted: later calls fail on the engine thread
  std::exception_ptr caller_failure_;  ///< a call on the caller's thread failed: the engine tells the peers
  bool stop_ = false;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/call_queue.hpp>
// ---- begin <ddp/comm/tcp/engine_errors.hpp>
/// \file The errors the TCP engine raises, the checks that find a mismatched step before a sleep, and the
/// abort notices that carry errors to the peers. Every message names this rank, the peer, the call and what
/// to do; the engine derives from this to build them.


// ---- begin <ddp/comm/tcp/frame_reader.hpp>
/// \file The receiving half of a peer stream: a state machine that cuts a byte stream into frames. It reads
/// a header, stops while its owner decides where the payload goes (a collective frame waits there for its
/// call), reads the payload straight into that place, and starts over. It never blocks and never allocates:
/// the bytes come from a read function (a non-blocking socket, or memory in tests and the fuzz target).
///
///   header --40 bytes, well formed--> holding --accept(dest)--> payload --length bytes--> header
///   header --a goodbye--> said_bye;   any --end of stream or read error--> closed
///   header --malformed header--> corrupt   (holding with a zero length: accept() goes straight to header)




namespace ddp::tcp::detail {

/// Where a peer stream's reader stands.
enum class read_state : std::uint8_t {
  header,    ///< reading a frame header (header_bytes() of 40 so far)
  holding,   ///< a whole, well-formed header is here; its payload waits for accept()
  payload,   ///< reading the accepted frame's payload into its destination
  said_bye,  ///< the peer said goodbye (op_bye): it closed its communicator; nothing more is read
  closed,    ///< end of stream or a read error: nothing more is read
  corrupt,   ///< a malformed header arrived (malformed() says why): the stream cannot be trusted
};

/// What one call of frame_reader::advance() ended with.
enum class read_event : std::uint8_t {
  blocked,  ///< no more bytes now (or the reader is holding a header): poll and come back
  header,   ///< a whole header: inspect header(), then accept() it or keep holding
  payload,  ///< the accepted frame's payload is complete (header() still describes it)
  ended,    ///< the stream ended: said_bye, closed or corrupt
};

class frame_reader {
 public:
  [[nodiscard]] read_state state() const { return state_; }
  /// The header being read, held or whose payload is being read.
  [[nodiscard]] const frame_header& header() const { return header_; }
  /// Bytes of the current header read so far (state header).
  [[nodiscard]] std::size_t header_bytes() const { return header_got_; }
  /// True when part of a frame has arrived and the rest has not: an end of stream now loses data.
  [[nodiscard]] bool mid_frame() const {
    if (ended()) return cut_;
    return (state_ == read_state::header && header_got_ > 0) || state_ == read_state::holding ||
           state_ == read_state::payload;
  }
  /// True once nothing more will be read.
  [[nodiscard]] bool ended() const {
    return state_ == read_state::said_bye || state_ == read_state::closed || state_ == read_state::corrupt;
  }
  /// The errno of the read that closed the stream (0: an orderly end of stream).
  [[nodiscard]] int error_code() const { return error_; }

  /// holding -> payload: the payload (header().length bytes) goes to `dest`. A zero-length frame completes
  /// at once (the next advance() reports its payload event).
  void accept(char* dest) {
    dest_ = dest;
    payload_got_ = 0;
    state_ = read_state::payload;
  }

  /// Marks the stream ended from outside (the owner read an abort notice itself, or gave up on the peer).
  void close() { state_ = read_state::closed; }

  /// Reads until an event: `read(buf, n)` returns bytes read (> 0), 0 at end of stream, or -1 with errno
  /// (EAGAIN: no bytes now). `moved` is set when any byte arrived.
  template <class Read>
  read_event advance(Read&& read, bool& moved) {
    while (true) {
      switch (state_) {
        case read_state::holding: return read_event::blocked;
        case read_state::said_bye:
        case read_state::closed:
        case read_state::corrupt: return read_event::ended;
        case read_state::header:
          if (!take(read, reinterpret_cast<char*>(&header_) + header_got_, sizeof(frame_header) - header_got_,
                    header_got_, moved))
            return ended() ? read_event::ended : read_event::blocked;
          if (header_got_ < sizeof(frame_header)) continue;
          header_got_ = 0;
          if (malformed(header_) != nullptr) {
            state_ = read_state::corrupt;
            return read_event::ended;
          }
          if (header_.op == op_bye) {
            state_ = read_state::said_bye;
            return read_event::ended;
          }
          state_ = read_state::holding;
          return read_event::header;
        case read_state::payload:
          if (payload_got_ == header_.length) {
            state_ = read_state::header;
            return read_event::payload;
          }
          if (!take(read, dest_ + payload_got_, static_cast<std::size_t>(header_.length - payload_got_), payload_got_,
                    moved))
            return ended() ? read_event::ended : read_event::blocked;
          continue;
      }
    }
  }

 private:
  /// One read of at most `want` bytes into `where`; false when none arrived (blocked or ended).
  template <class Read>
  bool take(Read& read, char* where, std::size_t want, auto& got, bool& moved) {
    while (true) {
      const ssize_t k = read(where, want);
      if (k > 0) {
        got += static_cast<std::size_t>(k);
        moved = true;
        return true;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
      error_ = k < 0 ? errno : 0;
      cut_ = state_ == read_state::payload || header_got_ > 0;
      state_ = read_state::closed;
      return false;
    }
  }

  read_state state_ = read_state::header;
  frame_header header_;
  std::size_t header_got_ = 0;
  char* dest_ = nullptr;
  std::uint64_t payload_got_ = 0;
  int error_ = 0;
  bool cut_ = false;  ///< the stream ended inside a frame
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/frame_reader.hpp>
// ---- begin <ddp/comm/tcp/matching.hpp>
/// \file Point-to-point matching, per peer: a recv waits for the first send with its group and tag, in
/// posting order; a send that arrives first is kept (a stray) until its recv comes. A recv that no send
/// matches before its deadline is withdrawn, so a late frame becomes a stray and never writes into the
/// abandoned buffer.



namespace ddp::tcp::detail {

/// A recv waiting for its send.
struct posted_recv {
  std::uint32_t group = 0;
  std::int32_t tag = 0;
  frame_header want;  ///< the header its send must carry (count and dtype)
  char* dest = nullptr;
  std::shared_ptr<ddp::detail::completion> done;
  clock::time_point deadline{};  ///< past it the recv fails and forgets its buffer
  std::chrono::milliseconds timeout{};
};

/// A send frame that arrived before its recv.
struct stray_frame {
  frame_header hdr;
  std::vector<char> data;
};

/// True when a send's frame `got` fits the recv `r` (same count and dtype).
inline bool fits(const posted_recv& r, const frame_header& got) {
  return got.type == r.want.type && got.count == r.want.count;
}

/// The recvs posted for one peer and the sends it made that no recv has taken yet.
class mailbox {
 public:
  /// Posts a recv behind the others.
  void post(posted_recv r) { recvs_.push_back(std::move(r)); }

  /// Removes and returns the oldest recv for the send `h` (same group and tag), if any.
  [[nodiscard]] std::optional<posted_recv> take_recv(const frame_header& h) {
    const auto it = std::find_if(recvs_.begin(), recvs_.end(),
                                 [&](const posted_recv& r) { return r.group == h.group && r.tag == h.tag; });
    if (it == recvs_.end()) return std::nullopt;
    std::optional<posted_recv> r(std::move(*it));
    recvs_.erase(it);
    return r;
  }

  /// Keeps a send no recv has taken yet.
  void keep(stray_frame s) { strays_.push_back(std::move(s)); }

  /// Removes and returns the oldest stray send of `group` with `tag`, if any.
  [[nodiscard]] std::optional<stray_frame> take_stray(std::uint32_t group, std::int32_t tag) {
    const auto it = std::find_if(strays_.begin(), strays_.end(),
                                 [&](const stray_frame& s) { return s.hdr.group == group && s.hdr.tag == tag; });
    if (it == strays_.end()) return std::nullopt;
    std::optional<stray_frame> s(std::move(*it));
    strays_.erase(it);
    return s;
  }

  /// True while recvs wait.
  [[nodiscard]] bool waiting() const { return !recvs_.empty(); }

  /// The earliest deadline of the recvs posted, or time_point::max().
  [[nodiscard]] clock::time_point next_deadline() const {
    auto first = clock::time_point::max();
    for (const auto& r : recvs_) first = std::min(first, r.deadline);
    return first;
  }

  /// Withdraws the recvs whose deadline has passed at `now`, failing each with `error(recv)`.
  template <class MakeError>
  void expire(clock::time_point now, MakeError error) {
    std::erase_if(recvs_, [&](const posted_recv& r) {
      if (r.deadline > now) return false;
      r.done->fail(error(r));
      return true;
    });
  }

  /// Fails every posted recv with `e` and forgets them.
  void fail_all(const std::exception_ptr& e) {
    for (auto& r : recvs_) r.done->fail(e);
    recvs_.clear();
  }

 private:
  std::deque<posted_recv> recvs_;
  std::deque<stray_frame> strays_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/matching.hpp>
// ---- begin <ddp/comm/tcp/messages.hpp>
/// \file The sentences the socket path (engine_errors.hpp) and the shared-memory path (shm_channel.hpp) share,
/// so a peer lost, a mismatch, a timeout or an abort notice reads the same whichever path raised it.



namespace ddp::tcp::detail {

/// How errors name a rank: its group rank, plus its world rank when the group is a subgroup.
inline std::string rank_label(std::size_t group_rank, int world_rank, bool subgroup) {
  return "rank " + std::to_string(group_rank) +
         (subgroup ? " (world rank " + std::to_string(world_rank) + ")" : std::string());
}

/// peer_lost on `rank`: `who` (world rank `peer`) was lost during `during`, `how` (e.g. "it closed its
/// communicator").
inline peer_lost lost_peer(const std::string& who, const std::string& during, const std::string& how, int rank,
                           int peer, int code = 0) {
  return peer_lost(who + " was lost during " + during + ": " + how +
                       ". Check that rank's log for the first error; the job cannot continue without it",
                   rank, peer, code);
}

/// mismatch_error on `rank`: `calls` names each rank's call ("rank 0 called ..., rank 1 sent ...").
inline mismatch_error different_calls(const std::string& calls, int rank) {
  return mismatch_error(calls + "; every rank must call the same collectives in the same order with the same "
                                "counts, dtypes, operators and roots",
                        rank);
}

/// timeout_error on `rank`: the call `what` did not complete within `timeout`, waiting for `waiting`.
inline timeout_error call_timeout(const std::string& what, std::chrono::milliseconds timeout,
                                  const std::string& waiting, int rank) {
  return timeout_error(what + " did not complete within " + std::to_string(timeout.count()) + " ms, waiting for " +
                           waiting +
                           ": a peer is stuck, dead or calling a different collective; check every rank's log, or "
                           "raise the timeout (config::timeout, DDP_TIMEOUT_MS)",
                       rank);
}

/// Raises on `rank` the error of the kind a peer's abort notice carries: `who` aborted `during` with `text`
/// (a peer_lost names `lost_rank`).
[[noreturn]] inline void raise_notice(abort_kind kind, const std::string& who, const std::string& during,
                                      const std::string& text, int rank, int lost_rank) {
  const std::string msg = who + " aborted " + during + ": " + text;
  switch (kind) {
    case abort_kind::peer_lost: throw peer_lost(msg, rank, lost_rank);
    case abort_kind::mismatch: throw mismatch_error(msg, rank);
    case abort_kind::timeout: throw timeout_error(msg, rank);
    case abort_kind::other: break;
  }
  throw error(msg, rank);
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/messages.hpp>
// ---- begin <ddp/comm/tcp/peer.hpp>
/// \file What the TCP engine keeps per peer: the two halves of its stream, its mailbox of point-to-point
/// transfers, what the executing call expects from it, the same-host copies in flight either way, and, on
/// one host with shared memory, its point-to-point rings (shm_rings.hpp).


// ---- begin <ddp/comm/tcp/frame_writer.hpp>
/// \file The sending half of a peer stream: a queue of frames written with sendmsg as the socket accepts
/// them, header and payload in one call, straight out of the caller's buffers (no copy). On abort the frame
/// already half written is completed, so the peer can still parse the abort notice behind it.




namespace ddp::tcp::detail {

/// One queued frame.
struct tx_item {
  frame_header hdr;
  const char* data = nullptr;
  std::size_t sent = 0;                           ///< bytes of header + payload already written
  std::shared_ptr<ddp::detail::completion> done;  ///< finished when written (point-to-point sends)
  remote_block where{};                           ///< a remote frame's payload
  [[nodiscard]] std::size_t total() const { return sizeof(frame_header) + hdr.length; }
  [[nodiscard]] const char* payload() const {
    return (hdr.flags & frame_remote) != 0 ? reinterpret_cast<const char*>(&where) : data;
  }
};

class frame_writer {
 public:
  /// True while frames wait to be written.
  [[nodiscard]] bool pending() const { return head_ < queue_.size(); }

  /// Queues a frame; `data` (hdr.length bytes) must stay valid until it is written.
  void push(tx_item item) { queue_.push_back(std::move(item)); }

  /// Writes what the socket `fd` accepts; true if bytes moved. Returns the errno of a failed write in
  /// `failure` (0 when none); finished frames complete their `done`.
  bool write_some(int fd, int& failure) {
    bool moved = false;
    failure = 0;
    while (pending()) {
      tx_item& t = queue_[head_];
      iovec iov[2];
      int n = 0;
      if (t.sent < sizeof(frame_header))
        iov[n++] = {reinterpret_cast<char*>(&t.hdr) + t.sent, sizeof(frame_header) - t.sent};
      const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
      if (t.hdr.length > payload_done)
        iov[n++] = {const_cast<char*>(t.payload()) + payload_done, t.hdr.length - payload_done};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n);
      const ssize_t k = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) failure = errno;
        break;
      }
      moved = moved || k > 0;
      t.sent += static_cast<std::size_t>(k);
      if (t.sent < t.total()) break;
      if (t.done) t.done->finish();
      t.done.reset();
      if (++head_ == queue_.size()) clear();
    }
    return moved;
  }

  /// On abort: completes the frame already half written (blocking until `limit`), fails the completions of
  /// every frame still queued with `e`, and empties the queue. False if the stream was left mid-frame.
  bool abandon(int fd, std::exception_ptr e, clock::time_point limit) {
    bool clean = true;
    if (pending() && queue_[head_].sent > 0) {
      const tx_item& t = queue_[head_];
      const std::size_t header_left = t.sent < sizeof(frame_header) ? sizeof(frame_header) - t.sent : 0;
      const std::size_t payload_done = t.sent > sizeof(frame_header) ? t.sent - sizeof(frame_header) : 0;
      clean = send_all(fd, reinterpret_cast<const char*>(&t.hdr) + (sizeof(frame_header) - header_left), header_left,
                       limit) == io_status::ok &&
              send_all(fd, t.payload() + payload_done, t.hdr.length - payload_done, limit) == io_status::ok;
    }
    for (std::size_t i = head_; i < queue_.size(); ++i)
      if (queue_[i].done) queue_[i].done->fail(e);
    clear();
    return clean;
  }

 private:
  void clear() {
    queue_.clear();
    head_ = 0;
  }
  std::vector<tx_item> queue_;
  std::size_t head_ = 0;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/frame_writer.hpp>
// ---- begin <ddp/comm/tcp/shm_rings.hpp>
/// \file Point-to-point between ranks of one host: per ordered pair of ranks a single-producer,
/// single-consumer byte ring in the job's segment `<job segment>-p2p`, carrying the same frames (header and
/// payload) a socket would. Only engine threads touch the rings: the sender's writes what fits and the
/// receiver's reads what is there, straight into the matched recv. No system call on the fast path; a rank's
/// engine that sleeps in poll says so in its bell word, and a peer that wrote to it (or freed room in a ring
/// the sleeper waits to write) rings it with an op_ring frame on the socket. Every rank maps the segment with
/// O_CREAT at the rendezvous; the last to map it unlinks it.



// ---- begin <ddp/comm/tcp/shm_copy.hpp>
/// \file Copying into shared memory that peers read (the collectives' regions, the point-to-point rings). A
/// rank rewrites its regions while the peers still hold the previous contents in their caches, and an
/// ordinary store must first take each such line back. How much that costs depends on how far apart the
/// cores sit, which on a virtual machine changes while a job runs. Measured on the 2-core VM (two processes
/// on two cores, 512 KiB copied into lines the other had read, then read by it): with the two cores close,
/// ordinary stores took 53 us and the reader 13 us, streaming stores 18 us and the reader some 50 us from
/// memory (f32 all_reduce of 1 MiB: 68 us against 158 us); with them far apart, ordinary stores took 210-230 us
/// and the reader 47 us, streaming stores 18 us and the reader 51 us (1 MiB: 458 us against 113 us). So every
/// process times its large copies and uses whichever kind of store costs less, both sides counted: ordinary
/// stores unless they take more than stream_penalty times as long as streaming ones. DDP_SHM_STORES fixes the
/// kind instead (config.hpp).

#include <emmintrin.h>



namespace ddp::tcp::detail {

/// Copies `n` bytes from `src` to `dst` (not overlapping) with streaming stores, which leave no line in this
/// core's cache and take none back from the peers'.
inline void stream_copy(void* dst, const void* src, std::size_t n) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const std::size_t head = std::min<std::size_t>(n, (16 - reinterpret_cast<std::uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  const std::size_t body = n / 64 * 64;
  for (std::size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + body, s + body, n - body);
  _mm_sfence();  // the streamed lines are visible before the phase (or the ring's count) is posted
}

/// Copies `n` bytes from `src` to `dst` (not overlapping) with streaming stores or with ordinary ones.
inline void copy_by(bool streaming, void* dst, const void* src, std::size_t n) {
  if (streaming) stream_copy(dst, src, n);
  else std::memcpy(dst, src, n);
}

/// Streaming stores win where ordinary ones take more than this many times as long: the reader then fetches
/// the streamed lines from memory, which costs it about as much again as the streaming stores cost the writer.
inline constexpr unsigned stream_penalty = 4;

/// Copies from this size are timed; smaller ones follow the latest choice (a few lines: nothing to measure).
inline constexpr std::size_t store_probe_bytes = 16 << 10;

/// Copies below this size always use ordinary stores: a few lines cost less than the store fence.
inline constexpr std::size_t stream_min_bytes = 4 << 10;

/// Which kind of store this process uses for copies into shared memory, chosen from its timed copies. Shared
/// by every thread of the process (the choice follows the cores, not the call); races only blur a sample.
class store_choice {
 public:
  /// Fixes the kind of store every later copy uses, or (automatic) lets the timed copies choose.
  void fix(shm_stores kind) { fixed_.store(kind, std::memory_order_relaxed); }

  /// Copies `n` bytes from `src` to `dst` (not overlapping) with the store kind that costs less now.
  void copy(void* dst, const void* src, std::size_t n) {
    if (n < stream_min_bytes) return static_cast<void>(std::memcpy(dst, src, n));
    const shm_stores fixed = fixed_.load(std::memory_order_relaxed);
    if (fixed != shm_stores::automatic)
      return copy_by(fixed == shm_stores::streaming, dst, src, n);
    const bool streaming = streaming_.load(std::memory_order_relaxed);
    if (n < store_probe_bytes) return copy_by(streaming, dst, src, n);
    // Every probe_every-th large copy tries the other kind, so a change of placement is seen.
    const bool probe = (copies_.fetch_add(1, std::memory_order_relaxed) % probe_every) == probe_every - 1;
    const bool stream = streaming != probe;
    const auto t0 = std::chrono::steady_clock::now();
    copy_by(stream, dst, src, n);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    record(stream ? stream_ : ordinary_, static_cast<std::uint64_t>(ns) * 1024 / n);
    const std::uint64_t o = best(ordinary_), s = best(stream_);
    if (o != 0 && s != 0) streaming_.store(o > stream_penalty * s, std::memory_order_relaxed);
  }

 private:
  static constexpr unsigned probe_every = 32;
  static constexpr unsigned kept = 4;  ///< samples kept per kind; the least counts (a preempted copy only inflates)
  /// The latest `kept` timings of one kind of store, in ns per KiB (0: none yet).
  struct samples {
    std::atomic<std::uint64_t> ns[kept]{};
    std::atomic<unsigned> next{0};
  };

  static void record(samples& s, std::uint64_t ns_per_kib) {
    s.ns[s.next.fetch_add(1, std::memory_order_relaxed) % kept].store(ns_per_kib, std::memory_order_relaxed);
  }
  static std::uint64_t best(const samples& s) {
    std::uint64_t least = 0;
    for (const auto& x : s.ns) {
      const std::uint64_t v = x.load(std::memory_order_relaxed);
      if (v != 0 && (least == 0 || v < least)) least = v;
    }
    return least;
  }

  std::atomic<shm_stores> fixed_{shm_stores::automatic};
  std::atomic<bool> streaming_{false};
  std::atomic<unsigned> copies_{probe_every - 1};  ///< the first large copy probes streaming stores
  samples ordinary_{};
  samples stream_{};
};

/// The process's store choice.
inline store_choice& shared_stores() {
  static store_choice choice;
  return choice;
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_copy.hpp>

namespace ddp::tcp::detail {

/// Data bytes of one ring: a larger frame passes in pieces as the receiver reads.
inline constexpr std::size_t ring_bytes = 1 << 20;

/// A ring's counters, each on its own cache line; the bytes in the ring are written - read.
struct ring_head {
  alignas(64) std::atomic<std::uint64_t> written{0};     ///< bytes the sender has put in, ever
  alignas(64) std::atomic<std::uint64_t> read{0};        ///< bytes the receiver has taken out, ever
  alignas(64) std::atomic<std::uint32_t> room_wanted{0};  ///< the sender found it full: ring it on reading
};

/// A rank's bell word: 1 while its engine sleeps in poll (a writer must ring it), on its own cache line.
struct ring_bell {
  alignas(64) std::atomic<std::uint32_t> asleep{0};
};

/// One direction between two ranks, seen from either end.
class shm_ring {
 public:
  shm_ring(ring_head* head, char* data) : head_(head), data_(data) {}

  /// Sender: copies what fits of `n` bytes at `src` in; returns how many.
  std::size_t write(const char* src, std::size_t n) {
    const std::uint64_t w = head_->written.load(std::memory_order_relaxed);
    const std::uint64_t r = head_->read.load(std::memory_order_seq_cst);
    const std::size_t k = std::min<std::size_t>(n, ring_bytes - static_cast<std::size_t>(w - r));
    const std::size_t at = static_cast<std::size_t>(w % ring_bytes), first = std::min(k, ring_bytes - at);
    shared_stores().copy(data_ + at, src, first);  // the receiver holds the ring's lines (shm_copy.hpp)
    shared_stores().copy(data_, src + first, k - first);
    head_->written.store(w + k, std::memory_order_seq_cst);
    return k;
  }
  /// Receiver: copies up to `n` bytes out to `dest`; returns how many, or -1 with errno EAGAIN when empty
  /// (frame_reader's read function).
  ssize_t read(char* dest, std::size_t n) {
    const std::uint64_t r = head_->read.load(std::memory_order_relaxed);
    const std::uint64_t w = head_->written.load(std::memory_order_seq_cst);
    const std::size_t k = std::min<std::size_t>(n, static_cast<std::size_t>(w - r));
    if (k == 0) {
      errno = EAGAIN;
      return -1;
    }
    const std::size_t at = static_cast<std::size_t>(r % ring_bytes), first = std::min(k, ring_bytes - at);
    std::memcpy(dest, data_ + at, first);
    std::memcpy(dest + first, data_, k - first);
    head_->read.store(r + k, std::memory_order_seq_cst);
    return static_cast<ssize_t>(k);
  }
  /// True when the receiver has bytes to read.
  [[nodiscard]] bool readable() const {
    return head_->written.load(std::memory_order_seq_cst) != head_->read.load(std::memory_order_seq_cst);
  }
  /// Sender, on a full ring: asks the receiver to ring it when it reads; true if room appeared meanwhile.
  bool want_room() {
    head_->room_wanted.store(1, std::memory_order_seq_cst);
    return head_->written.load(std::memory_order_relaxed) - head_->read.load(std::memory_order_seq_cst) < ring_bytes;
  }
  /// Receiver, after reading: true (once) when the sender waits for room and must be rung.
  bool room_wanted() {
    return head_->room_wanted.load(std::memory_order_seq_cst) != 0 && head_->room_wanted.exchange(0) != 0;
  }

 private:
  ring_head* head_;
  char* data_;
};

/// The job's rings, mapped by this rank.
class shm_rings {
 public:
  /// Maps (creating it if first) the rings of the job segment `job_name` of `size` ranks, as rank `me`.
  shm_rings(const std::string& job_name, int size, int me) : size_(static_cast<std::size_t>(size)) {
    const std::string name = job_name + "-p2p";
    map_ = shm_mapping::open(name, offset_of_ring(size_ * size_), true, false, me);
    count_mapping(*reinterpret_cast<std::atomic<std::uint32_t>*>(map_.data()), name, size);
  }
  shm_rings(const shm_rings&) = delete;

  /// The ring from world rank `from` to world rank `to`.
  [[nodiscard]] shm_ring ring(int from, int to) const {
    char* at = map_.data() + offset_of_ring(static_cast<std::size_t>(from) * size_ + static_cast<std::size_t>(to));
    return {reinterpret_cast<ring_head*>(at), at + sizeof(ring_head)};
  }
  /// World rank `r`'s bell.
  [[nodiscard]] ring_bell& bell(int r) const {
    return reinterpret_cast<ring_bell*>(map_.data() + 64)[static_cast<std::size_t>(r)];
  }

 private:
  /// Bytes before ring `i`: the mapping count, the bells, then the rings.
  [[nodiscard]] std::size_t offset_of_ring(std::size_t i) const {
    return 64 + size_ * sizeof(ring_bell) + i * (sizeof(ring_head) + ring_bytes);
  }
  std::size_t size_;
  shm_mapping map_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_rings.hpp>

namespace ddp::tcp::detail {

/// Where the payload being read from a peer goes.
enum class target : std::uint8_t {
  control,     ///< nowhere: a control frame (no payload)
  collective,  ///< the executing call's expected destination, or `remote` for a remote frame
  posted,      ///< the recv its send matched
  stray,       ///< a buffer of its own, until the recv is posted
};

/// Where the payload being read from one of a peer's streams goes.
struct payload_sink {
  target into = target::control;
  std::optional<posted_recv> matched;  ///< the recv of the send being read (target::posted)
  std::vector<char> stray_buf;         ///< the send being read ahead of its recv (target::stray)

  /// On abort: fails the recv being filled.
  void fail(const std::exception_ptr& e) {
    if (matched) matched->done->fail(e);
    matched.reset();
  }
};

/// A peer's point-to-point transfers through the shared-memory rings: sends queue here and go into `out`
/// as it has room; frames read out of `in` go to their recvs as from a socket.
struct ring_link {
  shm_ring in;   ///< from the peer
  shm_ring out;  ///< to the peer
  frame_reader reader;
  payload_sink sink;
  std::deque<tx_item> queue;  ///< sends not yet wholly in `out` (the first perhaps in part)

  /// A frame is half read or half written: the peer's end now loses data.
  [[nodiscard]] bool busy() const { return !queue.empty() || reader.mid_frame(); }
  /// On abort: fails the queued sends and the recv being filled.
  void fail(const std::exception_ptr& e) {
    for (auto& t : queue)
      if (t.done) t.done->fail(e);
    queue.clear();
    sink.fail(e);
  }
};

struct peer {
  socket_fd fd;
  frame_writer out;
  frame_reader in;
  peer_memory memory;
  mailbox mail;
  payload_sink sink;               ///< where the payload being read from the socket goes
  std::optional<ring_link> ring;   ///< point-to-point through shared memory (same host, DDP_SHM), else none
  bool expecting = false;  ///< the executing call waits for a frame from this peer: `expect`, into expect_dest
  frame_header expect;
  char* expect_dest = nullptr;
  remote_block remote{};                ///< the remote frame being received
  std::uint64_t unacked = 0;            ///< remote frames sent to it and not yet copied
  std::optional<frame_header> waiting;  ///< the call it last said it waits in (op_waiting)

  /// Its stream may be read now: a collective frame's header waits there until its call expects it.
  [[nodiscard]] bool readable() const {
    return fd.valid() && !in.ended() && (in.state() != read_state::holding || expecting);
  }
  /// Frames to it are still queued, or copies of remote frames it has not acknowledged.
  [[nodiscard]] bool sending() const { return out.pending() || unacked > 0; }
  /// The executing call cannot end before this peer does something.
  [[nodiscard]] bool awaited() const { return expecting || sending(); }
  /// The executing call expects the next collective frame from this peer to carry `h`, its payload for `dest`.
  void await(const frame_header& h, char* dest) {
    expecting = true;
    expect = h;
    expect_dest = dest;
  }

  /// On abort: forgets what the call expects and the copies it offered; fails every recv with `e`.
  void fail(const std::exception_ptr& e) {
    expecting = false;
    unacked = 0;
    mail.fail_all(e);
    sink.fail(e);
    if (ring) ring->fail(e);
  }

  /// On abort: fail(e), then, where the stream is open, completes the frame half written and sends `notice`
  /// behind it (until `limit`), so the peer can parse it.
  void abort(const std::exception_ptr& e, const abort_notice& notice, clock::time_point limit) {
    fail(e);
    if (!fd.valid()) return;
    const bool open = !in.ended();
    if (!out.abandon(fd.get(), e, open ? limit : clock::now()) || !open) return;
    if (send_all(fd.get(), &notice.header, sizeof notice.header, limit) == io_status::ok)
      send_all(fd.get(), notice.text.data(), notice.text.size(), limit);
  }

  /// On destruction: fails the queued frames with `gone`, says goodbye where asked and the stream is at a
  /// frame boundary, drains what the peer sent and closes.
  void close(const std::exception_ptr& gone, bool say_bye) {
    if (!fd.valid()) return;
    const auto limit = clock::now() + std::chrono::milliseconds(100);
    if (out.abandon(fd.get(), gone, limit) && say_bye) {
      frame_header bye;
      bye.op = op_bye;
      send_all(fd.get(), &bye, sizeof bye, limit);
    }
    char sink[4096];
    while (::recv(fd.get(), sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    fd.reset();
  }
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/peer.hpp>

namespace ddp::tcp::detail {

class engine_errors {
 protected:
  engine_errors(int rank, int size) : rank_(rank), size_(size) {}

  /// The rank label errors use: the group rank, plus the world rank inside a subgroup.
  [[nodiscard]] std::string label(int world_rank) const {
    if (current_ == nullptr) return "rank " + std::to_string(world_rank);
    const auto& m = current_->grp->members;
    for (std::size_t i = 0; i < m.size(); ++i)
      if (m[i] == world_rank) return rank_label(i, world_rank, m.size() != static_cast<std::size_t>(size_));
    return "world rank " + std::to_string(world_rank);
  }
  [[nodiscard]] std::string what_now() const {
    return current_ != nullptr ? describe(header_of(*current_, 0)) : std::string("a point-to-point transfer");
  }

  /// How a peer's stream ended, for peer_lost.
  [[nodiscard]] static std::string farewell(const frame_reader& in) {
    if (in.state() == read_state::said_bye) return "it closed its communicator";
    if (in.error_code() != 0) return "receiving from it failed (" + errno_text(in.error_code()) + ")";
    return "it closed the connection or died";
  }

  [[nodiscard]] peer_lost lost(int world_peer, int code, const std::string& how) const {
    return lost_peer(label(world_peer), what_now(), how, rank_, world_peer, code);
  }

  /// The mismatch_error naming this rank's call `want` and what the peer `got` sent (or waits in) instead.
  [[noreturn]] void throw_mismatch(int world_peer, const frame_header& want, const frame_header& got,
                                   const char* how = " sent ") const {
    // A frame of this rank's previous step: both calls of that step went through (each only sent).
    const bool earlier = got.group == finished_.group && got.seq == finished_.seq && got.group == want.group;
    throw different_calls(label(rank_) + " called " + describe(want) +
                              (earlier ? " after " + describe(finished_) : std::string()) + ", " + label(world_peer) +
                              how + describe(got) +
                              (same_call(want, got) ? " with a payload of " + std::to_string(got.length) +
                                                          " bytes where " + std::to_string(want.length) +
                                                          " were expected"
                                                    : std::string()),
                          rank_);
  }

  /// Raises mismatch_error where one of `peers` (by world rank) is at the executing call's step (group and
  /// sequence number) in another call: a frame of it waits unread, or it said it waits in that call. Runs
  /// before every sleep, so calls that only receive, or only send, on both sides fail at once instead of at
  /// the timeout.
  void check_same_step(const std::vector<peer>& peers) const {
    const frame_header mine = header_of(*current_, 0);
    const auto other = [&](const frame_header& h) { return h.group == mine.group && h.seq == mine.seq && !same_call(mine, h); };
    for (std::size_t r = 0; r < peers.size(); ++r) {
      const peer& p = peers[r];
      if (p.in.state() == read_state::holding && other(p.in.header())) throw_mismatch(static_cast<int>(r), mine, p.in.header());
      if (p.waiting && other(*p.waiting)) throw_mismatch(static_cast<int>(r), mine, *p.waiting, " waits in ");
    }
  }

  /// The ranks of `peers` the executing call waits for: "rank 1, rank 3".
  [[nodiscard]] std::string waiting_list(const std::vector<peer>& peers) const {
    std::string waiting;
    for (std::size_t r = 0; r < peers.size(); ++r)
      if (peers[r].awaited()) waiting += (waiting.empty() ? "" : ", ") + label(static_cast<int>(r));
    return waiting;
  }

  [[nodiscard]] mismatch_error p2p_mismatch(const posted_recv& r, const frame_header& got, int world_peer) const {
    return mismatch_error(label(rank_) + " called recv of " + std::to_string(r.want.count) + " " +
                              std::string(to_string(static_cast<dtype>(r.want.type))) + " with tag " +
                              std::to_string(r.tag) + ", " + label(world_peer) + " sent " + describe(got) +
                              "; a send and its recv must have the same count and dtype",
                          rank_);
  }

  [[nodiscard]] std::exception_ptr recv_expired(const posted_recv& x, int world_peer) const {
    return std::make_exception_ptr(timeout_error(
        "recv of " + std::to_string(x.want.count) + " " + std::string(to_string(static_cast<dtype>(x.want.type))) +
            " with tag " + std::to_string(x.tag) + " from " + label(world_peer) + " found no matching send within " +
            std::to_string(x.timeout.count()) + " ms; check that the peer sends with the same tag, or raise the timeout",
        rank_));
  }

  [[nodiscard]] error corrupt_stream(int world_peer, const char* why) const {
    return error(label(world_peer) + " sent " + why + (current_ != nullptr ? " during " + what_now() : std::string()) +
                     "; every rank must run the same ddp version, and nothing else may write to the mesh sockets",
                 rank_);
  }
  [[nodiscard]] error unreadable(int world_peer) const {
    return error(label(world_peer) + " sent the address of its data, but this rank cannot read that process's "
                                     "memory; every rank must run the same ddp version",
                 rank_);
  }
  [[nodiscard]] error abandoned_copy(int world_peer) const {
    return error(label(world_peer) + " aborted " + what_now() + " while this rank copied its data, and its abort "
                                     "notice did not arrive within 2 s; check that rank's log for the first error",
                 rank_);
  }
  [[nodiscard]] peer_lost cancelled() const {
    return peer_lost(what_now() + " was cancelled because its communicator was destroyed; wait() for every "
                                  "operation before the communicator goes out of scope",
                     rank_, rank_);
  }
  [[nodiscard]] std::exception_ptr destroyed() const {
    return std::make_exception_ptr(
        error("the communicator was destroyed before this operation ran; wait() for every operation before the "
              "communicator goes out of scope",
              rank_));
  }
  [[nodiscard]] timeout_error timed_out(const std::string& waiting) const {
    return call_timeout(what_now(), current_->grp->timeout, waiting.empty() ? std::string("nothing") : waiting, rank_);
  }

  /// The abort frame that tells the peers of `e`, with the error's kind so they raise the same type.
  [[nodiscard]] static abort_notice notice_of(const std::exception_ptr& e) {
    abort_notice n;
    n.header.op = op_abort;
    auto kind = abort_kind::other;
    try {
      std::rethrow_exception(e);
    } catch (const peer_lost& x) {
      kind = abort_kind::peer_lost;
      n.header.lost_rank = x.peer();
      n.text = x.what();
    } catch (const mismatch_error& x) {
      kind = abort_kind::mismatch;
      n.text = x.what();
    } catch (const timeout_error& x) {
      kind = abort_kind::timeout;
      n.text = x.what();
    } catch (const std::exception& x) {
      n.text = x.what();
    }
    n.text.resize(std::min<std::size_t>(n.text.size(), max_abort_text));
    n.header.flags = static_cast<std::uint8_t>(kind);
    n.header.length = n.text.size();
    return n;
  }

  /// Reads the abort frame `h` announced on `fd` and raises the error it carries.
  [[noreturn]] void raise_abort(int world_peer, const frame_header& h, int fd) const {
    std::string text(std::min<std::uint64_t>(h.length, max_abort_text), '\0');
    if (h.length > max_abort_text || recv_all(fd, text.data(), text.size(), clock::now() + std::chrono::seconds(2)) != io_status::ok)
      text = "(its message was lost)";
    raise_notice(static_cast<abort_kind>(h.flags), label(world_peer),
                 current_ != nullptr ? what_now() : std::string("while this rank ran no operation"), text, rank_,
                 h.lost_rank);
  }

  /// Looks behind the frame just received on `fd` for the peer's abort notice (2 s at most, skipping the
  /// frames it wrote before aborting) and raises it; returns if the stream ends or holds none.
  void raise_abort_behind(int world_peer, int fd) const {
    const auto limit = clock::now() + std::chrono::seconds(2);
    char sink[4096];
    frame_header h;
    while (recv_all(fd, &h, sizeof h, limit) == io_status::ok && malformed(h) == nullptr && h.op != op_bye) {
      if (h.op == op_abort) raise_abort(world_peer, h, fd);
      for (std::uint64_t left = h.length; left > 0;) {
        const auto k = static_cast<std::size_t>(std::min<std::uint64_t>(left, sizeof sink));
        if (recv_all(fd, sink, k, limit) != io_status::ok) return;
        left -= k;
      }
    }
  }

  int rank_;
  int size_;
  const call* current_ = nullptr;  ///< the call executing now, or nullptr
  frame_header finished_;          ///< the last collective this rank completed, named when a peer's frame of it arrives late
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/engine_errors.hpp>
// ---- begin <ddp/comm/tcp/peer_io.hpp>
/// \file The engine's peers and the transfers outside a collective's algorithm: frames posted on the
/// sockets, and point-to-point sends and recvs, over the sockets or, on one host with shared memory, the
/// rings (shm_rings.hpp), on the engine thread or, where the engine is idle, on the caller's. A send's frame, from either, goes to the recv it matches (mailbox, matching.hpp) or
/// aside until its recv comes, so both carry the same errors: a count or dtype mismatch, a recv's timeout,
/// peer_lost when the peer's socket ends. The engine (engine.hpp) derives from this; whoever holds its io mutex calls it.

#include <sched.h>



namespace ddp::tcp::detail {

class peer_io : protected engine_errors {
 protected:
  peer_io(int rank, int size) : engine_errors(rank, size), peers_(static_cast<std::size_t>(size)) {}

  peer& at(int world_rank) { return peers_[static_cast<std::size_t>(world_rank)]; }

  /// Point-to-point goes through `rings` from now on (mapped at the rendezvous; null: the sockets).
  void use_rings(std::unique_ptr<shm_rings> rings) {
    rings_ = std::move(rings);
    for (int r = 0; rings_ && r < size_; ++r)
      if (r != rank_) at(r).ring = ring_link{rings_->ring(r, rank_), rings_->ring(rank_, r), {}, {}, {}};
  }

  /// send: queue the frame (or deliver it locally); recv: take a stray frame or post the receive.
  void point_to_point(call& c) {
    const int world_peer = c.grp->members[static_cast<std::size_t>(c.root)];
    const frame_header h = header_of(c, c.count * size_of(c.type));
    peer& p = at(world_peer);
    if (c.side == p2p::send && world_peer != rank_) {
      c.grp->stats.add_bytes(c.kind, h.length);
      if (!p.ring) return post(world_peer, h, c.in, c.done);
      if (p.in.ended()) throw lost(world_peer, 0, farewell(p.in));
      p.ring->queue.push_back({h, static_cast<const char*>(c.in), 0, c.done});
      write_ring(world_peer);
      return;
    }
    if (c.side == p2p::send) {  // to itself
      const auto* in = static_cast<const char*>(c.in);
      if (auto r = p.mail.take_recv(h)) deliver(*r, h, in, rank_);
      else p.mail.keep({h, std::vector<char>(in, in + h.length)});
      return c.done->finish();
    }
    posted_recv want{h.group, c.tag, h, static_cast<char*>(c.out), c.done, clock::now() + c.grp->timeout, c.grp->timeout};
    if (auto s = p.mail.take_stray(h.group, c.tag)) return deliver(want, s->hdr, s->data.data(), world_peer);
    if (p.in.ended()) throw lost(world_peer, 0, farewell(p.in));
    p.mail.post(std::move(want));
  }

  /// On the caller's thread, with the engine's io mutex held and the queue claimed (engine.hpp): runs point-to-point
  /// call `c` through its peer's ring (false, untouched, where the peer has none: the engine thread runs it).
  /// Until the call completes it moves bytes through the ring itself, with its bell down (no peer rings this rank
  /// meanwhile), giving up after `patience` without a byte moving: the engine thread then goes on with it. It
  /// spins for `yield_after`, then yields the core between looks (on a loaded host the peer may need this core to
  /// send: measured on the 2-core VM, 4 KiB ping-pong took 125 us one way with a 100 us spin, 8 us yielding).
  /// `wake` says the engine thread must be woken: to heed a recv's deadline, or to finish a socket write.
  bool point_to_point_on_caller(call& c, std::chrono::nanoseconds patience, std::chrono::nanoseconds yield_after,
                                bool& wake) {
    const int world_peer = c.grp->members[static_cast<std::size_t>(c.root)];
    if (world_peer != rank_ && !at(world_peer).ring) return false;
    point_to_point(c);
    if (world_peer != rank_ && !c.done->test()) {
      auto& bell = rings_->bell(rank_).asleep;
      bell.store(0, std::memory_order_seq_cst);  // the engine sleeps in poll: this thread serves the ring for it
      const auto start = clock::now();
      auto until = start + patience;
      for (int i = 0; !c.done->test(); ++i) {
        if (c.side == p2p::send ? write_ring(world_peer) : read_ring(world_peer)) until = clock::now() + patience;
        if ((i & 15) != 15) {
          _mm_pause();
          continue;
        }
        const auto now = clock::now();
        if (now >= until) break;
        if (now - start >= yield_after) sched_yield();
      }
      // The bell stays down while the engine has nothing to read or write in a ring: the next call on this thread
      // reads what comes, and no peer wakes the sleeping engine for it. Else raise it, then look once more.
      if (ring_work()) {
        bell.store(1, std::memory_order_seq_cst);
        serve_rings();
      }
    }
    wake = !c.done->test() || std::any_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.out.pending(); });
    return true;
  }

  /// True while a recv is posted or a frame is half read or half written in a ring: the engine must hear of
  /// ring traffic.
  [[nodiscard]] bool ring_work() const {
    return std::any_of(peers_.begin(), peers_.end(),
                       [](const peer& p) { return p.mail.waiting() || (p.ring && p.ring->busy()); });
  }

  /// Raises mismatch_error, on the recv `r` (taken from its mailbox, so no abort reaches it) and in the
  /// engine, unless the send `got` from `world_peer` fits it.
  void check_fits(const posted_recv& r, const frame_header& got, int world_peer) const {
    if (fits(r, got)) return;
    const auto e = p2p_mismatch(r, got, world_peer);
    r.done->fail(std::make_exception_ptr(e));
    throw e;
  }

  /// Completes the recv `r` with the send `got` whose payload is `data`.
  void deliver(const posted_recv& r, const frame_header& got, const char* data, int world_peer) {
    check_fits(r, got, world_peer);
    if (got.length > 0) std::memcpy(r.dest, data, got.length);
    r.done->finish();
  }

  /// A send's header arrived on `in` (`world_peer`'s socket or ring): its payload goes straight into the recv
  /// it matches, else into a buffer of `s` until its recv comes.
  void route_send(int world_peer, payload_sink& s, frame_reader& in) {
    const frame_header& h = in.header();
    if (auto r = at(world_peer).mail.take_recv(h)) {
      check_fits(*r, h, world_peer);
      s.matched = std::move(r);
      s.into = target::posted;
      return in.accept(s.matched->dest);
    }
    s.stray_buf.resize(h.length);
    s.into = target::stray;
    in.accept(s.stray_buf.data());
  }

  /// The payload of send `h`, routed into `s` by route_send, has arrived.
  void finish_send(int world_peer, payload_sink& s, const frame_header& h) {
    auto& p = at(world_peer);
    if (s.into == target::posted) {
      s.matched->done->finish();
      s.matched.reset();
    } else {  // its recv may have been posted while the payload was arriving
      if (auto r = p.mail.take_recv(h)) deliver(*r, h, s.stray_buf.data(), world_peer);
      else p.mail.keep({h, std::move(s.stray_buf)});
      s.stray_buf = {};
    }
    s.into = target::control;
  }

  /// Fails the recvs no send matched within the timeout.
  void expire_recvs() {
    const auto now = clock::now();
    for (std::size_t r = 0; r < peers_.size(); ++r)
      peers_[r].mail.expire(now, [&](const posted_recv& x) { return recv_expired(x, static_cast<int>(r)); });
  }

  void post(int world_peer, const frame_header& h, const void* data, std::shared_ptr<ddp::detail::completion> done) {
    at(world_peer).out.push({h, static_cast<const char*>(data), 0, std::move(done)});
    write_some(world_peer);  // most small frames leave at once, before any poll
  }

  /// Writes what the peer's socket accepts; true if bytes moved.
  bool write_some(int world_peer) {
    auto& p = at(world_peer);
    int failure = 0;
    const bool moved = p.out.write_some(p.fd.get(), failure);
    if (failure == 0) return moved;
    if (current_ != nullptr && current_->side == p2p::none) check_same_step(peers_);  // a frame shows a mismatch: say so
    throw lost(world_peer, failure, "sending to it failed (" + errno_text(failure) + ")");
  }

  // ---- the rings ----

  /// Moves point-to-point frames through every ring, both ways; true if bytes moved.
  bool serve_rings() {
    bool moved = false;
    for (int r = 0; rings_ && !poisoned_ && r < size_; ++r) {
      if (!at(r).ring) continue;
      moved = write_ring(r) || moved;
      moved = read_ring(r) || moved;
    }
    return moved;
  }

  /// Before the engine sleeps `ms` in poll: raises this rank's bell, so writers ring it, and looks at the rings
  /// once more. Returns how long to sleep (0: bytes moved). It does not spin first: measured on the loaded
  /// 2-core VM (bench/comm ddp_bench_p2p), a 50 us spin took the core the peer's threads needed (4 KiB
  /// ping-pong: 105 us one way against 34 us without).
  int before_sleep(int ms) {
    if (!rings_ || poisoned_ || ms == 0) return ms;
    rings_->bell(rank_).asleep.store(1, std::memory_order_seq_cst);
    return serve_rings() ? 0 : ms;
  }
  /// After the sleep: writers need not ring this rank.
  void after_sleep() {
    if (rings_) rings_->bell(rank_).asleep.store(0, std::memory_order_seq_cst);
  }

  /// Writes what fits of the sends queued for `world_peer`'s ring, and rings it if it sleeps; true if bytes moved.
  bool write_ring(int world_peer) {
    auto& l = *at(world_peer).ring;
    bool moved = false;
    while (!l.queue.empty()) {
      tx_item& t = l.queue.front();
      const bool header = t.sent < sizeof t.hdr;
      const char* from = header ? reinterpret_cast<const char*>(&t.hdr) + t.sent : t.data + (t.sent - sizeof t.hdr);
      const std::size_t left = header ? sizeof t.hdr - t.sent : t.total() - t.sent;
      const std::size_t k = l.out.write(from, left);
      t.sent += k;
      moved = moved || k > 0;
      if (t.sent == t.total()) {
        if (t.done) t.done->finish();
        l.queue.pop_front();
      } else if (k < left && !l.out.want_room()) {
        break;  // full: the reader rings this rank when it makes room
      }
    }
    auto& bell = rings_->bell(world_peer).asleep;
    if (moved && bell.load(std::memory_order_seq_cst) != 0 && bell.exchange(0) != 0) ring(world_peer);
    return moved;
  }

  /// Reads the frames in `world_peer`'s ring into their recvs (or aside), and rings it if it waits for room;
  /// true if bytes moved.
  bool read_ring(int world_peer) {
    auto& l = *at(world_peer).ring;
    bool moved = false;
    const auto from_ring = [&l](char* buf, std::size_t n) { return l.in.read(buf, n); };
    while (true) {
      const read_event ev = l.reader.advance(from_ring, moved);
      if (ev == read_event::blocked) break;
      const frame_header& h = l.reader.header();
      if (ev == read_event::ended || h.op != static_cast<std::uint8_t>(collective::send_recv)) {
        const char* why = malformed(h);
        throw corrupt_stream(world_peer, why != nullptr ? why : "a frame other than a send through its ring");
      }
      if (ev == read_event::header) route_send(world_peer, l.sink, l.reader);
      else finish_send(world_peer, l.sink, h);
    }
    if (moved && l.in.room_wanted()) ring(world_peer);
    return moved;
  }

  /// Wakes `world_peer`'s engine from poll: data or room waits in a ring (unless its stream ended: it left).
  void ring(int world_peer) {
    if (at(world_peer).in.ended()) return;
    frame_header h;
    h.op = op_ring;
    post(world_peer, h, nullptr, nullptr);
  }

  std::vector<peer> peers_;
  std::exception_ptr poisoned_;        ///< what aborted the engine, or null
  std::unique_ptr<shm_rings> rings_;  ///< point-to-point through shared memory, or null
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/peer_io.hpp>
// ---- begin <ddp/comm/tcp/shm_run.hpp>
/// \file Running a collective over its group's shared-memory segment, on either thread. On the caller's
/// thread (the engine idle: no hop between threads) until its first barrier has spun shm_handoff_after
/// without its peers; then, or from the start where the engine is busy, on the engine thread, which sleeps
/// in 1 ms slices and serves its sockets between them.


// ---- begin <ddp/comm/tcp/shm_algorithms.hpp>
/// \file The collectives of the same-host transport, over a group's shared-memory segment (shm_channel):
/// every rank publishes pieces of its input in its region, then reads what it needs straight from the
/// others' regions. Reductions sum in rank order, so every rank gets the same bits. all_reduce of up to
/// shm_direct_bytes reduces the whole buffer on every rank after one barrier; larger ones are pipelined
/// (each phase: every rank publishes the others' slices of one piece, reduces its own slice of the piece
/// into its next region, and copies the others' reduced slices of the previous piece out). all_reduce,
/// reduce_scatter and all_gather from shm_single_copy_bytes, where every peer's memory is readable, start with a
/// phase that publishes each rank's buffer address and the algorithm rank 0 chose (shm_algo_choice.hpp): the
/// pipeline, or single copies straight out of the others' buffers (same_host.hpp) whatever the size. Both sum in
/// the same order. Single-copy all_reduce takes two more phases: reduce this rank's slice from the others'
/// buffers; copy the others' reduced slices out of their buffers. reduce_scatter and all_gather take one.


// ---- begin <ddp/comm/tcp/reduce.hpp>
/// \file Element-wise reduction kernels of the TCP backend: dst = a (op) b over n elements, for every
/// dtype; bf16/f16 widen to float for the arithmetic. Plain loops the compiler vectorizes.


// ---- begin <ddp/comm/average.hpp>
/// \file The host-side finish of reduce_op::avg: a sum divided by the group size, the same way on every backend
/// that averages on the host (integers truncate toward zero, bf16/f16 divide in float); and scaling by a factor.



namespace ddp::detail {

/// Multiplies every element of the host buffer `t` by `factor`: in the element type where `factor` is exact in
/// it (the product then rounds once, as it would through double), else in double, rounded to the element type
/// (bf16/f16 through float; integers truncate toward zero).
inline void scale(const raw_tensor& t, double factor) {
  visit_dtype(t.type, [&](auto zero) {
    using T = decltype(zero);
    auto* p = static_cast<T*>(t.data);
    if constexpr (std::is_floating_point_v<T>) {
      if (static_cast<double>(static_cast<T>(factor)) == factor) {
        const T exact = static_cast<T>(factor);
        for (std::size_t i = 0; i < t.size; ++i) p[i] *= exact;
        return;
      }
    }
    for (std::size_t i = 0; i < t.size; ++i)
      if constexpr (std::is_arithmetic_v<T>)
        p[i] = static_cast<T>(static_cast<double>(p[i]) * factor);
      else
        p[i] = T(static_cast<float>(static_cast<double>(static_cast<float>(p[i])) * factor));
  });
}

/// Divides every element of the host buffer `t` by `n`; nothing to do for n = 1.
inline void divide(const raw_tensor& t, int n) {
  if (n == 1) return;
  visit_dtype(t.type, [&](auto zero) {
    using T = decltype(zero);
    auto* p = static_cast<T*>(t.data);
    if constexpr (std::is_integral_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(n));
    } else if ((n & (n - 1)) == 0) {
      // A power of two's reciprocal is exact, so multiplying by it gives the quotient's bits at a fraction of
      // a division's cost.
      scale(t, 1.0 / n);
    } else if constexpr (std::is_floating_point_v<T>) {
      for (std::size_t i = 0; i < t.size; ++i) p[i] /= static_cast<T>(n);
    } else {
      for (std::size_t i = 0; i < t.size; ++i) p[i] = T(static_cast<float>(p[i]) / static_cast<float>(n));
    }
  });
}

}  // namespace ddp::detail
// ---- end <ddp/comm/average.hpp>

namespace ddp::tcp::detail {

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

/// The arithmetic type of T: float for bf16/f16, T otherwise.
template <class T>
using accumulate_t = std::conditional_t<is_half_v<T>, float, T>;

template <class T, class F>
void combine(T* dst, const T* a, const T* b, std::size_t n, F f) {
  if constexpr (is_half_v<T>) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = f(a[i], b[i]);
  }
}

/// dst[i] = a[i] (op) b[i]; dst may alias a (not b). avg sums here; finish_avg_bytes divides at the end.
template <class T>
void reduce_into(T* dst, const T* a, const T* b, std::size_t n, reduce_op op) {
  using A = accumulate_t<T>;
  switch (op) {
    case reduce_op::sum:
    case reduce_op::avg: return combine(dst, a, b, n, [](A x, A y) { return static_cast<A>(x + y); });
    case reduce_op::prod: return combine(dst, a, b, n, [](A x, A y) { return static_cast<A>(x * y); });
    case reduce_op::min: return combine(dst, a, b, n, [](A x, A y) { return y < x ? y : x; });
    case reduce_op::max: return combine(dst, a, b, n, [](A x, A y) { return x < y ? y : x; });
  }
}

/// Runtime-dtype dispatch of reduce_into over raw bytes.
inline void reduce_bytes(dtype t, void* dst, const void* a, const void* b, std::size_t n, reduce_op op) {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_into(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
  });
}

/// Finishes avg on n elements: their sum divided by `ranks` as every backend averaging on the host does.
inline void finish_avg_bytes(dtype t, void* data, std::size_t n, reduce_op op, int ranks) {
  if (op == reduce_op::avg) ddp::detail::divide(raw_tensor{data, n, t}, ranks);
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/reduce.hpp>
// ---- begin <ddp/comm/tcp/shm_channel.hpp>
/// \file What a shared-memory collective sees while it executes one call: its region to fill, the phase
/// barrier (post, then wait for every rank: spin briefly, yielding the core after a few microseconds, or from
/// the first look where ranks outnumber the cores, then sleep on the futex in bounded slices that check each
/// awaited rank's life, its abort notice and the deadline), and the regions to read after it. Every phase
/// compares each rank's call description with this rank's, so mismatched calls raise mismatch_error naming both
/// calls.




namespace ddp::tcp::detail {

/// Thrown by the caller's first phase barrier when the peers have not arrived within its spin: the engine
/// thread resumes the call, so the caller gets its work back at once.
struct shm_handoff {};

/// Spin this long at a barrier before sleeping on the futex (where the job has a core per rank).
inline constexpr std::chrono::microseconds shm_spin{50};

/// How a shared-memory call waits for its peers.
struct shm_waiting {
  /// How long a barrier spins before it sleeps.
  std::chrono::nanoseconds spin{shm_spin};
  /// A spinning barrier yields its core between looks after this long (its peers' threads may need the core).
  std::chrono::nanoseconds yield_after{shm_yield_after};
  /// The first barrier gives up (shm_handoff) after spinning this long; zero: never.
  std::chrono::nanoseconds handoff_after{0};
  /// The call was handed off: its first region is filled and posted already.
  bool resumed = false;
  /// How long one futex sleep lasts before the checks run again.
  std::chrono::milliseconds slice{20};
  /// Runs between sleeps (the engine thread serves its sockets); empty on the caller's thread.
  std::function<void()> between;
  /// Where wait() reads whom the call waits for while it sleeps.
  ddp::detail::stall_note* note = nullptr;
};

/// How long a thread waiting on group `g`'s shared memory (a barrier, a send or recv through a ring) spins before
/// it yields its core between looks: shm_yield_after, or not at all where ranks outnumber the cores, so a peer
/// waiting for this core runs at once. Measured on the 2-core VM at N = 4 (ddp_bench_collectives --ddp-only): a
/// 4 KiB all_reduce took 8 us so, 89 us where such barriers slept on the futex at once; 64 KiB 15 against 160 us,
/// 64 MiB 13.5 against 20 ms. With two ranks on one core: 6.5 us against 16 us yielding after shm_yield_after.
inline std::chrono::nanoseconds yield_after_among(const shm_group& g) {
  return g.oversubscribed() ? std::chrono::nanoseconds(0) : std::chrono::nanoseconds(shm_yield_after);
}

/// How a call among shared-memory group `g` waits.
inline shm_waiting waiting_among(const shm_group& g) {
  shm_waiting how;
  how.yield_after = yield_after_among(g);
  return how;
}

class shm_channel {
 public:
  shm_channel(shm_group& g, const call& c, clock::time_point deadline, shm_waiting how)
      : g_(g), c_(c), desc_(header_of(c, 0)), deadline_(deadline), how_(std::move(how)), skip_(how_.resumed) {}

  [[nodiscard]] const call& what() const { return c_; }
  [[nodiscard]] int rank() const { return g_.me(); }
  [[nodiscard]] int size() const { return g_.size(); }

  /// This rank's region of the coming phase (write it before sync()).
  char* fill() { return g_.data(g_.me(), g_.phase); }
  /// Copies `bytes` from `src` into this rank's coming region at `offset` (done already where resumed).
  void put(std::size_t offset, const void* src, std::size_t bytes) {
    if (skip_ || bytes == 0) return;
    shared_stores().copy(fill() + offset, src, bytes);
    c_.grp->stats.add_bytes(c_.kind, bytes);
  }
  /// Counts `bytes` this rank published for the others outside put().
  void count(std::size_t bytes) { c_.grp->stats.add_bytes(c_.kind, bytes); }
  /// Group rank `r`'s region of the phase just completed by sync().
  const char* at(int r) { return g_.data(r, g_.phase - 1); }

  /// Copies `bytes` at `address` in group rank `r`'s memory to `dest` (same_host.hpp); a failed copy, or one
  /// that overlapped the rank's abort, raises what ended the rank.
  void copy_from(int r, std::uint64_t address, std::size_t bytes, char* dest) {
    if (bytes == 0) return;
    int code = 0;
    const auto& peer = g_.world().memory[static_cast<std::size_t>(g_.world_rank(r))];
    const copy_result got = copy_from_peer(peer, remote_block{address, bytes}, dest, code);
    if (got == copy_result::copied) return;
    // It aborted or died while this rank copied: its notice or its death shows within the next seconds.
    for (const auto give_up = clock::now() + std::chrono::seconds(2); clock::now() < give_up;) {
      check(r);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    throw peer_lost(label(r) + " failed during " + describe(desc_) + " while this rank copied from its memory (" +
                        (got == copy_result::failed ? errno_text(code) : std::string("it aborted")) +
                        "), and no notice of why arrived within 2 s. Check that rank's log for the first error",
                    me_world(), g_.world_rank(r));
  }

  /// Posts the coming phase, waits until every rank has posted it, and checks that every rank runs this call.
  void sync() {
    const std::uint32_t target = g_.phase + 1;
    auto& mine = g_.counters(g_.me());
    if (!skip_) {
      g_.head(g_.me(), g_.phase).call = desc_;
      mine.posted.store(target, std::memory_order_seq_cst);
      if (mine.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(mine.posted);
    }
    const bool first = !synced_;
    synced_ = true;
    skip_ = false;
    for (int r = 0; r < g_.size(); ++r)
      if (r != g_.me()) await(r, target, first);
    for (int r = 0; r < g_.size(); ++r) {
      const frame_header& theirs = g_.head(r, g_.phase).call;
      if (r != g_.me() && !same_call(desc_, theirs))
        throw different_calls(label(g_.me()) + " called " + describe(desc_) + ", " + label(r) + " called " + describe(theirs),
                              me_world());
    }
    g_.phase = target;
  }

 private:
  static bool reached(const shm_counters& c, std::uint32_t target) {
    return static_cast<std::int32_t>(c.posted.load(std::memory_order_acquire) - target) >= 0;
  }

  /// Waits until group rank `r` posted phase `target`: spins (yielding the core after how_.yield_after), then
  /// hands the call off (the caller's first barrier) or sleeps.
  void await(int r, std::uint32_t target, bool first) {
    auto& theirs = g_.counters(r);
    const auto start = clock::now();
    const auto spin_until = start + (first && how_.handoff_after.count() > 0 ? how_.handoff_after : how_.spin);
    for (int i = 0; !reached(theirs, target); ++i) {
      _mm_pause();
      if ((i & 15) != 15) continue;
      const auto now = clock::now();
      if (now < spin_until) {
        if (now - start >= how_.yield_after) sched_yield();
        continue;
      }
      if (first && how_.handoff_after.count() > 0) throw shm_handoff{};
      return sleep_until(r, theirs, target);
    }
  }

  void sleep_until(int r, shm_counters& theirs, std::uint32_t target) {
    theirs.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const auto notice_at = clock::now() + stall_notice_after;  // whom it waits for is published only past this
    bool noticed = false;
    struct leave {
      shm_counters& c;
      ddp::detail::stall_note* note;
      ~leave() {
        c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (note != nullptr) note->set({});
      }
    } on_exit{theirs, how_.note};
    const long slice = std::chrono::duration_cast<std::chrono::nanoseconds>(how_.slice).count();
    while (true) {
      const std::uint32_t seen = theirs.posted.load(std::memory_order_seq_cst);
      if (static_cast<std::int32_t>(seen - target) >= 0) return;
      check(r);
      if (!noticed && how_.note != nullptr && clock::now() >= notice_at) {
        how_.note->set(label(r));
        noticed = true;
      }
      futex_wait(theirs.posted, seen, slice);
      if (how_.between) how_.between();
    }
  }

  /// Throws what keeps group rank `r` from posting: its abort, its death or exit, or the deadline.
  void check(int r) {
    const int w = g_.world_rank(r);
    switch (g_.world().state_of(w)) {
      case shm_state::running:
      case shm_state::writing: break;
      case shm_state::closed:
        throw lost_peer(label(r), describe(desc_), "it closed its communicator or died", me_world(), w);
      case shm_state::aborted: {
        const auto& n = g_.world().notice_of(w);
        raise_notice(static_cast<abort_kind>(n.kind), label(r), describe(desc_), std::string(n.text, n.text_bytes),
                     me_world(), n.lost_rank);
      }
    }
    if (clock::now() >= deadline_) throw call_timeout(describe(desc_), c_.grp->timeout, label(r), me_world());
  }

  [[nodiscard]] int me_world() const { return g_.world_rank(g_.me()); }
  /// "rank 1", plus the world rank inside a subgroup.
  [[nodiscard]] std::string label(int r) const {
    return rank_label(static_cast<std::size_t>(g_.group_rank(r)), g_.world_rank(r),
                      c_.grp->members.size() != static_cast<std::size_t>(g_.world().size()));
  }

  shm_group& g_;
  const call& c_;
  frame_header desc_;
  clock::time_point deadline_;
  shm_waiting how_;
  bool skip_;
  bool synced_ = false;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_channel.hpp>

namespace ddp::tcp::detail {

/// all_reduce payloads up to this size are reduced whole by every rank after a single barrier.
inline constexpr std::size_t shm_direct_bytes = 32 << 10;

/// dst = src(0) (op) src(1) (op) ... src(n-1), in rank order, over `elems` elements.
template <class Src>
void reduce_ranks(const call& c, char* dst, int n, std::size_t elems, Src src) {
  const std::size_t bytes = elems * size_of(c.type);
  if (n == 1) {
    std::memmove(dst, src(0), bytes);
    return;
  }
  reduce_bytes(c.type, dst, src(0), src(1), elems, c.op);
  for (int p = 2; p < n; ++p) reduce_bytes(c.type, dst, dst, src(p), elems, c.op);
}

/// Splits `count` elements into pieces of at most `piece` elements: f(first element, elements) per piece.
template <class F>
void for_pieces(std::size_t count, std::size_t piece, F f) {
  for (std::size_t first = 0; first < count; first += piece) f(first, std::min(piece, count - first));
}

/// Element offset of rank r's slice of `elems` elements split among n ranks.
inline std::size_t slice_first(std::size_t elems, int r, int n) {
  return static_cast<std::size_t>(r) * elems / static_cast<std::size_t>(n);
}

/// all_reduce by single copies out of the peers' buffers, whose addresses g.addresses holds (see the file comment).
inline void shm_all_reduce_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const std::vector<std::uint64_t>& where = g.addresses;
  const auto first = [&](int r) { return slice_first(c.count, r, n); };
  // This rank's slice, a piece at a time: the others' parts into scratch, then the sum in rank order.
  const std::size_t piece = shm_region_bytes / es;
  char* parts = g.scratch(static_cast<std::size_t>(n + 1) * piece * es);
  char* sum = parts + static_cast<std::size_t>(n) * piece * es;
  for_pieces(first(me + 1) - first(me), piece, [&](std::size_t off, std::size_t k) {
    const std::size_t at = (first(me) + off) * es;
    for (int r = 0; r < n; ++r)
      if (r != me) ch.copy_from(r, where[static_cast<std::size_t>(r)] + at, k * es, parts + r * piece * es);
    reduce_ranks(c, sum, n, k, [&](int r) { return r == me ? buf + at : parts + r * piece * es; });
    finish_avg_bytes(c.type, sum, k, c.op, n);
    std::memcpy(buf + at, sum, k * es);
  });
  ch.count(2 * (first(me + 1) - first(me)) * es * static_cast<std::size_t>(n - 1));  // as a ring would send
  ch.sync();  // every slice reduced in its owner's buffer
  for (int r = 0; r < n; ++r)
    if (r != me) ch.copy_from(r, where[static_cast<std::size_t>(r)] + first(r) * es, (first(r + 1) - first(r)) * es, buf + first(r) * es);
  ch.sync();  // nobody reads this rank's buffer any more
}

/// all_reduce pipelined through the segment (see the file comment).
inline void shm_all_reduce_pipeline(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const std::size_t half = shm_region_bytes / 2;
  const std::size_t piece = half / es;
  const std::size_t passes = (c.count + piece - 1) / piece;
  const auto elems = [&](std::size_t j) { return std::min(piece, c.count - j * piece); };
  const auto slice = [&](std::size_t j, int r) { return slice_first(elems(j), r, n); };
  for (std::size_t j = 0; j <= passes; ++j) {
    for (int r = 0; j < passes && r < n; ++r)  // every slice but this rank's own, which it reads in place
      if (r != me) ch.put(slice(j, r) * es, buf + (j * piece + slice(j, r)) * es, (slice(j, r + 1) - slice(j, r)) * es);
    ch.sync();
    if (j > 0) {  // the others' reduced slices of the previous piece
      const std::size_t k = elems(j - 1);
      for (int r = 0; r < n; ++r) {
        if (r == me) continue;
        const std::size_t a = slice_first(k, r, n), b = slice_first(k, r + 1, n);
        std::memcpy(buf + ((j - 1) * piece + a) * es, ch.at(r) + half, (b - a) * es);
      }
    }
    if (j < passes) {  // this rank's slice of this piece, into its next region and its buffer
      const std::size_t k = elems(j);
      const std::size_t a = slice_first(k, me, n), b = slice_first(k, me + 1, n);
      // Reduced in private memory, then copied into the buffer and the region (shm_copy.hpp: the peers hold
      // the region's lines, so it takes the stores that cost less).
      char* out = g.scratch((b - a) * es);
      const char* own = buf + (j * piece + a) * es;
      reduce_ranks(c, out, n, b - a, [&](int r) { return r == me ? own : ch.at(r) + a * es; });
      finish_avg_bytes(c.type, out, b - a, c.op, n);
      std::memcpy(buf + (j * piece + a) * es, out, (b - a) * es);
      shared_stores().copy(ch.fill() + half, out, (b - a) * es);
      ch.count((b - a) * es);
    }
  }
}

/// Runs a call of `bytes` by `pipeline`, or, from shm_single_copy_bytes where its buffers `allow` single copies
/// and every peer's memory is readable, by the algorithm the group's rank 0 chose (shm_algo_choice.hpp): a first
/// phase publishes this rank's buffer address `mine` and rank 0's choice, then every rank runs `single` (the
/// addresses in g.addresses) or `pipeline`. Rank 0 times the rest of the call for its next choices.
template <class Single, class Pipeline>
void shm_run_sized(shm_channel& ch, shm_group& g, const void* mine, bool allow, Single single, Pipeline pipeline) {
  const collective kind = ch.what().kind;
  const std::size_t bytes = ch.what().count * size_of(ch.what().type) *
                            (kind == collective::all_reduce ? 1 : static_cast<std::size_t>(ch.size()));
  if (bytes < shm_single_copy_bytes || !allow || !g.reads_all()) return pipeline();
  const std::uint64_t head[2] = {reinterpret_cast<std::uintptr_t>(mine), static_cast<std::uint64_t>(g.algo(kind, bytes))};
  ch.put(0, head, sizeof head);
  ch.sync();
  g.addresses.resize(static_cast<std::size_t>(ch.size()));
  for (int r = 0; r < ch.size(); ++r) std::memcpy(&g.addresses[static_cast<std::size_t>(r)], ch.at(r), sizeof head[0]);
  std::uint64_t chosen = 0;
  std::memcpy(&chosen, ch.at(0) + sizeof head[0], sizeof chosen);
  const shm_algo algo = chosen == static_cast<std::uint64_t>(shm_algo::pipeline) ? shm_algo::pipeline : shm_algo::single_copy;
  const auto start = clock::now();
  if (algo == shm_algo::pipeline) pipeline();
  else single();
  if (ch.rank() == 0) g.algos.record(kind, bytes, algo, clock::now() - start);
}

inline void shm_all_reduce(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t bytes = c.count * size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  if (bytes > shm_direct_bytes)
    return shm_run_sized(ch, g, buf, true, [&] { shm_all_reduce_single_copy(ch, g); },
                         [&] { shm_all_reduce_pipeline(ch, g); });
  ch.put(0, buf, bytes);
  ch.sync();
  reduce_ranks(c, buf, n, c.count, [&](int r) { return ch.at(r); });
  finish_avg_bytes(c.type, buf, c.count, c.op, n);
}

/// reduce_scatter through the segment: per piece, every rank publishes every block's piece, then reduces its own.
inline void shm_reduce_scatter_pipeline(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  // This rank's own block is read in place, unless the output overlaps the input (then from its region).
  const bool apart = out + block <= in || in + n * block <= out;
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me || !apart) ch.put(static_cast<std::size_t>(r) * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    const char* own = apart ? in + me * block + first * es : ch.at(me) + me * piece * es;
    reduce_ranks(c, out + first * es, n, k, [&](int r) { return r == me ? own : ch.at(r) + me * piece * es; });
  });
  finish_avg_bytes(c.type, out, c.count, c.op, n);
}

/// reduce_scatter by single copies: this rank's block of every peer's input (g.addresses), a piece at a time into
/// scratch, summed in rank order into the output (which does not overlap the input).
inline void shm_reduce_scatter_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / es;
  char* parts = g.scratch(static_cast<std::size_t>(n) * piece * es);
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me) ch.copy_from(r, g.addresses[static_cast<std::size_t>(r)] + me * block + first * es, k * es, parts + r * piece * es);
    reduce_ranks(c, out + first * es, n, k, [&](int r) { return r == me ? in + me * block + first * es : parts + r * piece * es; });
  });
  finish_avg_bytes(c.type, out, c.count, c.op, n);
  ch.count(block * static_cast<std::size_t>(n - 1));  // the blocks the others read, as the pipeline publishes them
  ch.sync();  // nobody reads this rank's input any more
}

inline void shm_reduce_scatter(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  const auto* in = static_cast<const char*>(c.in);
  const auto* out = static_cast<const char*>(c.out);
  const bool apart = out + block <= in || in + block * static_cast<std::size_t>(ch.size()) <= out;
  shm_run_sized(ch, g, in, apart, [&] { shm_reduce_scatter_single_copy(ch, g); }, [&] { shm_reduce_scatter_pipeline(ch); });
}

/// all_gather through the segment: per piece, every rank publishes its block's piece and copies the others'.
inline void shm_all_gather_pipeline(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), block = c.count * es;
  auto* out = static_cast<char*>(c.out);
  if (out + me * block != c.in) std::memmove(out + me * block, c.in, block);
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    ch.put(0, out + me * block + first * es, k * es);
    ch.sync();
    for (int r = 0; r < n; ++r)
      if (r != me) std::memcpy(out + r * block + first * es, ch.at(r), k * es);
  });
}

/// all_gather by single copies: every peer's input (g.addresses) straight into its block of the output (which
/// holds the input in this rank's block, or does not overlap it).
inline void shm_all_gather_single_copy(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t block = c.count * size_of(c.type);
  auto* out = static_cast<char*>(c.out);
  for (int r = 0; r < n; ++r)
    if (r != me) ch.copy_from(r, g.addresses[static_cast<std::size_t>(r)], block, out + r * block);
  if (out + me * block != c.in) std::memcpy(out + me * block, c.in, block);
  ch.count(block);  // this rank's block, which the others read, as the pipeline publishes it
  ch.sync();  // nobody reads this rank's input any more
}

inline void shm_all_gather(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  const auto* in = static_cast<const char*>(c.in);
  const auto* out = static_cast<const char*>(c.out);
  const bool fits = in == out + static_cast<std::size_t>(ch.rank()) * block || in + block <= out ||
                    out + block * static_cast<std::size_t>(ch.size()) <= in;
  shm_run_sized(ch, g, in, fits, [&] { shm_all_gather_single_copy(ch, g); }, [&] { shm_all_gather_pipeline(ch); });
}

inline void shm_broadcast(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    if (root) ch.put(0, buf + first * es, k * es);
    ch.sync();
    if (!root) std::memcpy(buf + first * es, ch.at(c.root), k * es);
  });
}

inline void shm_reduce(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type);
  auto* buf = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    ch.put(0, buf + first * es, k * es);
    ch.sync();
    if (root) reduce_ranks(c, buf + first * es, ch.size(), k, [&](int r) { return ch.at(r); });
  });
  if (root) finish_avg_bytes(c.type, buf, c.count, c.op, ch.size());
}

inline void shm_gather(shm_channel& ch) {
  const auto& c = ch.what();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  if (root) std::memmove(out + static_cast<std::size_t>(c.root) * block, in, block);
  for_pieces(c.count, shm_region_bytes / es, [&](std::size_t first, std::size_t k) {
    if (!root) ch.put(0, in + first * es, k * es);
    ch.sync();
    if (root)
      for (int r = 0; r < ch.size(); ++r)
        if (r != c.root) std::memcpy(out + r * block + first * es, ch.at(r), k * es);
  });
}

inline void shm_scatter(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t es = size_of(c.type), block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const bool root = ch.rank() == c.root;
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  for_pieces(c.count, piece, [&](std::size_t first, std::size_t k) {
    if (root)
      for (int r = 0; r < n; ++r)
        if (r != c.root) ch.put(r * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    if (!root) std::memcpy(out + first * es, ch.at(c.root) + ch.rank() * piece * es, k * es);
  });
  if (root) std::memmove(out, in + static_cast<std::size_t>(c.root) * block, block);
}

inline void shm_all_to_all(shm_channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size(), me = ch.rank();
  const std::size_t es = size_of(c.type), per = c.count / static_cast<std::size_t>(n), block = per * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  const std::size_t piece = shm_region_bytes / static_cast<std::size_t>(n) / es;
  for_pieces(per, piece, [&](std::size_t first, std::size_t k) {
    for (int r = 0; r < n; ++r)
      if (r != me) ch.put(r * piece * es, in + r * block + first * es, k * es);
    ch.sync();
    for (int r = 0; r < n; ++r)
      if (r != me) std::memcpy(out + r * block + first * es, ch.at(r) + me * piece * es, k * es);
  });
  if (in != out) std::memmove(out + me * block, in + me * block, block);
}

/// Runs the collective `ch` describes over group segment `g`. A call with no elements moves nothing, as on
/// the sockets.
inline void shm_execute(shm_channel& ch, shm_group& g) {
  const auto& c = ch.what();
  if (c.kind == collective::barrier) return ch.sync();
  if (c.count == 0) return;
  switch (c.kind) {
    case collective::all_reduce: return shm_all_reduce(ch, g);
    case collective::reduce_scatter: return shm_reduce_scatter(ch, g);
    case collective::all_gather: return shm_all_gather(ch, g);
    case collective::broadcast: return shm_broadcast(ch);
    case collective::reduce: return shm_reduce(ch);
    case collective::gather: return shm_gather(ch);
    case collective::scatter: return shm_scatter(ch);
    case collective::all_to_all: return shm_all_to_all(ch);
    case collective::barrier:
    case collective::send_recv: break;  // barrier above; the engine matches sends and recvs over the sockets
  }
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_algorithms.hpp>

namespace ddp::tcp::detail {

/// The caller's thread spins this long at a shared-memory call's first barrier, or moves a send or recv through
/// its ring this long without a byte moving, before handing the call to the engine thread. Where ranks outnumber
/// the cores too: measured with both ranks of `bench/comm` `ddp_bench_p2p` on one core, a 4 KiB send took 7 us
/// one way so, 23 us when the engine thread took it on after a microsecond; 4 MiB 0.22 against 0.33 ms.
inline constexpr std::chrono::microseconds shm_handoff_after{100};

/// Runs shared-memory call `c` on the caller's thread: true when it completed, false when its peers were not
/// there within shm_handoff_after (c.resumed is then set: the engine thread resumes it). Throws what failed.
inline bool run_shm_on_caller(call& c, ddp::detail::stall_note* note) {
  shm_waiting how = waiting_among(*c.grp->shm);
  how.handoff_after = shm_handoff_after;
  how.note = note;
  try {
    shm_channel ch(*c.grp->shm, c, clock::now() + c.grp->timeout, std::move(how));
    shm_execute(ch, *c.grp->shm);
    return true;
  } catch (const shm_handoff&) {
    c.resumed = true;
    return false;
  }
}

/// Runs (or resumes) shared-memory call `c` on the engine thread by `deadline`, calling `serve` between
/// sleeps (it serves the sockets, and throws to cancel the call).
inline void run_shm_on_engine(call& c, clock::time_point deadline, ddp::detail::stall_note* note,
                              std::function<void()> serve) {
  shm_waiting how = waiting_among(*c.grp->shm);
  how.resumed = c.resumed;
  how.slice = std::chrono::milliseconds(1);
  how.note = note;
  how.between = std::move(serve);
  // One slice past the deadline, as poll's rounding gives the sockets: wait(), whose timeout message carries the
  // flight recorder's view, gives up first.
  shm_channel ch(*c.grp->shm, c, deadline + how.slice, std::move(how));
  shm_execute(ch, *c.grp->shm);
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/shm_run.hpp>
// ---- begin <ddp/comm/tcp/store.hpp>
/// \file The rendezvous key-value store: rank 0 serves it at MASTER_ADDR:MASTER_PORT (driven by the
/// progress engine's poll loop, no thread of its own); every rank is a client (set/get/wait/add).
/// The protocol (store_book) runs without sockets, so it can be tested and fuzzed from memory; the server
/// reads at most what the next message needs, and nothing past the 16-byte handshake before it is checked.

#include <map>

// ---- begin <ddp/comm/tcp/accept.hpp>
/// \file Accepting connections that must open with a fixed-size handshake (rank 0's store, every rank's
/// mesh port) under limits a stranger cannot exceed: at most the handshake's bytes are read before it is
/// checked, each connection gets a handshake deadline, the handshakes in progress are capped (the oldest
/// goes first), all of them progress at once, and a process out of descriptors backs off instead of spinning.

#include <sys/timerfd.h>



namespace ddp::tcp::detail {

/// What a listener grants a connection that has not yet sent its whole handshake.
struct handshake_limits {
  std::chrono::milliseconds timeout{10000};  ///< the handshake must arrive within this (DDP_HANDSHAKE_TIMEOUT_MS)
  std::size_t max_pending = 64;              ///< handshakes in progress at once (DDP_MAX_PENDING_HANDSHAKES)
};

/// How long a listener out of descriptors leaves new connections in the kernel's queue before retrying.
inline constexpr std::chrono::milliseconds accept_backoff{100};

/// A connection whose handshake bytes have all arrived (not yet checked).
struct arrival {
  socket_fd fd;                     ///< the connection, non-blocking
  std::string from;                 ///< its remote "addr:port"
  std::vector<std::uint8_t> hello;  ///< exactly the handshake's size
};

/// A listening socket and its handshakes in progress; poll its descriptors from any loop (fill, on_events).
class handshake_acceptor {
 public:
  /// Accepts on `listener`; every connection must send `hello_bytes` first. `what` names the port in logs.
  handshake_acceptor(socket_fd listener, std::size_t hello_bytes, handshake_limits limits, int rank, std::string what)
      : listener_(std::move(listener)), hello_bytes_(hello_bytes), limits_(limits), rank_(rank),
        what_(std::move(what)) {
    timer_ = socket_fd(::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC));
    if (!timer_.valid())
      throw error("cannot create a timer for " + what_ + ": " + errno_text(errno) + "; raise the descriptor limit",
                  rank, errno);
  }

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return local_endpoint(listener_.get()).port; }
  /// How many descriptors fill() appends.
  [[nodiscard]] std::size_t descriptors() const { return 2 + pending_.size(); }

  /// Appends the descriptors to poll: the listener (ignored while backing off), the timer, the handshakes.
  void fill(std::vector<pollfd>& fds) const {
    fds.push_back({backing_off_ ? -1 : listener_.get(), POLLIN, 0});
    fds.push_back({timer_.get(), POLLIN, 0});
    for (const auto& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
  }

  /// Handles the poll results of the descriptors fill() appended at `base`; returns the completed handshakes.
  std::vector<arrival> on_events(const std::vector<pollfd>& fds, std::size_t base) {
    std::vector<arrival> done;
    if (fds[base + 1].revents & POLLIN) {
      std::uint64_t expirations = 0;
      [[maybe_unused]] const auto n = ::read(timer_.get(), &expirations, sizeof expirations);
    }
    const auto now = clock::now();
    for (std::size_t i = 0; i < pending_.size() && base + 2 + i < fds.size(); ++i)
      if (fds[base + 2 + i].revents != 0) read_hello(pending_[i], done);
    for (auto& p : pending_)
      if (p.fd.valid() && now >= p.deadline)
        refuse(p.fd, p.from, "no complete handshake within " + std::to_string(limits_.timeout.count()) +
                                 " ms (DDP_HANDSHAKE_TIMEOUT_MS)");
    std::erase_if(pending_, [](const pending& p) { return !p.fd.valid(); });
    if (backing_off_ && now >= retry_at_) backing_off_ = false;
    if (!backing_off_ && (fds[base].revents & POLLIN)) accept_some(now);
    arm_timer();
    return done;
  }

  /// Logs that the connection from `from` was refused because `why` (`who`: what it probably is, or the
  /// fix), and closes it: bytes already queued are discarded unread (up to 1 MiB, no copy), so a stranger that
  /// stopped sending sees an orderly close.
  void refuse(socket_fd& fd, const std::string& from, const std::string& why,
              const std::string& who = "a process outside this job, or a rank started with another DDP_TOKEN") const {
    log_line(rank_, "refused a connection to " + what_ + " from " + from + ": " + why + " (" + who + "); the job goes on");
    [[maybe_unused]] const auto n = ::recv(fd.get(), nullptr, 1 << 20, MSG_TRUNC | MSG_DONTWAIT);
    fd.reset();
  }

 private:
  struct pending {
    socket_fd fd;
    std::string from;
    std::vector<std::uint8_t> hello;
    clock::time_point deadline;
  };

  void read_hello(pending& p, std::vector<arrival>& done) {
    const std::size_t have = p.hello.size();
    p.hello.resize(hello_bytes_);
    const ssize_t k = ::recv(p.fd.get(), p.hello.data() + have, hello_bytes_ - have, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      p.hello.resize(have);
      return;
    }
    if (k <= 0) {
      if (have > 0) refuse(p.fd, p.from, "it closed after a partial handshake");
      p.fd.reset();
      return;
    }
    p.hello.resize(have + static_cast<std::size_t>(k));
    if (p.hello.size() < hello_bytes_) return;
    done.push_back({std::move(p.fd), std::move(p.from), std::move(p.hello)});
  }

  void accept_some(clock::time_point now) {
    for (int n = 0; n < 256; ++n) {  // a burst at a time, so the caller's other descriptors get their turn
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int code = errno;
        if (code == EINTR || code == ECONNABORTED || code == EPROTO) continue;
        if (code == EMFILE || code == ENFILE || code == ENOBUFS || code == ENOMEM) back_off(now, code);
        return;
      }
      starved_logged_ = false;
      if (pending_.size() >= limits_.max_pending) {
        if (!crowd_logged_)
          log_line(rank_, std::to_string(limits_.max_pending) + " connections to " + what_ +
                              " are in their handshake at once (DDP_MAX_PENDING_HANDSHAKES): closing the oldest "
                              "first; the job goes on (logged once)");
        crowd_logged_ = true;
        pending_.front().fd.reset();
        pending_.erase(pending_.begin());
      }
      socket_fd owned(fd);
      std::string from = remote_endpoint(fd).str();
      pending_.push_back({std::move(owned), std::move(from), {}, now + limits_.timeout});
    }
  }

  void back_off(clock::time_point now, int code) {
    if (!starved_logged_)
      log_line(rank_, "cannot accept a connection to " + what_ + ": " + errno_text(code) +
                          "; new connections wait in the kernel's queue and are retried every " +
                          std::to_string(accept_backoff.count()) +
                          " ms; raise the descriptor limit (ulimit -n) or close files this process keeps open");
    starved_logged_ = true;
    backing_off_ = true;
    retry_at_ = now + accept_backoff;
  }

  /// Wakes the poll loop at the first handshake deadline or at the end of a back-off; disarmed when none.
  void arm_timer() {
    clock::time_point next = clock::time_point::max();
    for (const auto& p : pending_) next = std::min(next, p.deadline);
    if (backing_off_) next = std::min(next, retry_at_);
    itimerspec spec{};
    if (next != clock::time_point::max()) {
      const auto ns = std::max<std::int64_t>(
          1, std::chrono::duration_cast<std::chrono::nanoseconds>(next.time_since_epoch()).count());
      spec.it_value.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
      spec.it_value.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    }
    ::timerfd_settime(timer_.get(), TFD_TIMER_ABSTIME, &spec, nullptr);
  }

  socket_fd listener_;
  socket_fd timer_;
  std::size_t hello_bytes_;
  handshake_limits limits_;
  int rank_;
  std::string what_;
  std::vector<pending> pending_;
  bool backing_off_ = false;
  clock::time_point retry_at_{};
  bool starved_logged_ = false;
  bool crowd_logged_ = false;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/accept.hpp>

namespace ddp::tcp::detail {

inline constexpr std::uint32_t store_magic = 0x53504444;  // "DDPS"
inline constexpr std::uint32_t max_store_key = 4096;
inline constexpr std::uint64_t max_store_value = 64ULL << 20;

/// First message on a store connection.
struct store_hello {
  std::uint32_t magic = store_magic;
  std::uint32_t version = 1;
  std::uint64_t token = 0;
};

enum class store_cmd : std::uint8_t { set = 1, get = 2, add = 3 };

/// Every request: the command, then `key_len` key bytes and `value_len` value bytes.
struct store_request {
  store_cmd cmd{};
  std::uint8_t pad[3]{};
  std::uint32_t key_len = 0;
  std::uint64_t value_len = 0;
};
static_assert(sizeof(store_hello) == 16 && sizeof(store_request) == 16);

/// One client of the store as the protocol sees it: bytes received and not yet parsed, answers not yet sent.
struct store_session {
  std::vector<std::uint8_t> in;   ///< received, not yet parsed: at most one message
  std::vector<std::uint8_t> out;  ///< answers not yet sent
  bool authed = false;            ///< its handshake carried this job's token
  bool parked = false;            ///< a get waits for `parked_key`
  std::string parked_key;         ///< the key a parked get waits for
  std::string refused;            ///< why the store closes it; empty while it behaves
};

/// The store's data and protocol, without sockets: sessions feed received bytes in and take answers out.
class store_book {
 public:
  /// A book for the job whose token hashes to `token`.
  explicit store_book(std::uint64_t token) : token_(token) {}

  /// Bytes `s` must receive before its next message is complete; 0 while it waits for a key or is refused.
  [[nodiscard]] static std::size_t wanted(const store_session& s) {
    if (!s.refused.empty() || s.parked) return 0;
    if (s.in.size() < sizeof(store_request)) return sizeof(store_request) - s.in.size();  // hello or header
    store_request r;
    std::memcpy(&r, s.in.data(), sizeof r);
    return sizeof r + r.key_len + r.value_len - s.in.size();  // the header was checked when it arrived
  }

  /// Appends `n` received bytes to `s` and answers its complete messages (and any parked get they satisfy).
  void feed(store_session& s, const std::uint8_t* data, std::size_t n) {
    if (!s.refused.empty()) return;
    s.in.insert(s.in.end(), data, data + n);
    parse(s);
  }

  /// Forgets `s`, which is closing: it no longer waits for a key.
  void close(store_session& s) {
    std::erase(parked_, &s);
    s.parked = false;
  }

  /// The number of keys stored.
  [[nodiscard]] std::size_t keys() const { return data_.size(); }

 private:
  /// What is wrong with request header `r`, or "" when it is well-formed.
  static std::string malformed(const store_request& r) {
    if (r.cmd < store_cmd::set || r.cmd > store_cmd::add)
      return "a request with unknown command " + std::to_string(static_cast<int>(r.cmd));
    if (r.key_len > max_store_key)
      return "a key of " + std::to_string(r.key_len) + " bytes (at most " + std::to_string(max_store_key) + ")";
    if (r.value_len > max_store_value)
      return "a value of " + std::to_string(r.value_len) + " bytes (at most " + std::to_string(max_store_value) + ")";
    if (r.cmd == store_cmd::add && r.value_len != 8)
      return "an add with a value of " + std::to_string(r.value_len) + " bytes (8 expected)";
    if (r.cmd == store_cmd::get && r.value_len != 0)
      return "a get with a value of " + std::to_string(r.value_len) + " bytes (none expected)";
    return {};
  }

  void parse(store_session& s) {
    std::size_t pos = 0;
    while (s.refused.empty() && !s.parked && s.in.size() - pos >= sizeof(store_request)) {
      if (!s.authed) {
        store_hello h;
        std::memcpy(&h, s.in.data() + pos, sizeof h);
        pos += sizeof h;
        if (h.magic != store_magic || h.version != 1) s.refused = "its first bytes are not a ddp handshake";
        else if (h.token != token_) s.refused = "wrong job token";
        s.authed = s.refused.empty();
        if (s.authed) s.out.push_back(1);
        continue;
      }
      store_request r;
      std::memcpy(&r, s.in.data() + pos, sizeof r);
      if (s.refused = malformed(r); !s.refused.empty()) break;
      const std::size_t total = sizeof r + r.key_len + r.value_len;
      if (s.in.size() - pos < total) break;
      std::string key(reinterpret_cast<const char*>(s.in.data() + pos + sizeof r), r.key_len);
      const std::uint8_t* value = s.in.data() + pos + sizeof r + r.key_len;
      if (r.cmd == store_cmd::set) {
        data_[key].assign(value, value + r.value_len);
        s.out.push_back(1);
      } else if (r.cmd == store_cmd::add) {
        add(s, key, value);
      } else if (!answer_get(s, key)) {
        s.parked = true;
        s.parked_key = key;
        parked_.push_back(&s);
      }
      pos += total;
      if (r.cmd != store_cmd::get) wake_parked(key);
    }
    s.in.erase(s.in.begin(), s.in.begin() + static_cast<std::ptrdiff_t>(pos));
  }

  void add(store_session& s, const std::string& key, const std::uint8_t* value) {
    std::uint64_t delta = 0, now = 0;
    std::memcpy(&delta, value, 8);
    auto& stored = data_[key];
    if (stored.size() == 8) std::memcpy(&now, stored.data(), 8);
    now += delta;  // unsigned: wraps like two's complement instead of overflowing a signed integer
    stored.resize(8);
    std::memcpy(stored.data(), &now, 8);
    append(s, &now, 8);
  }

  static void append(store_session& s, const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    s.out.insert(s.out.end(), b, b + n);
  }

  bool answer_get(store_session& s, const std::string& key) {
    const auto it = data_.find(key);
    if (it == data_.end()) return false;
    const std::uint64_t n = it->second.size();
    append(s, &n, 8);
    append(s, it->second.data(), it->second.size());
    return true;
  }

  void wake_parked(const std::string& key) {
    std::vector<store_session*> woken;
    std::erase_if(parked_, [&](store_session* other) {
      if (other->parked_key != key) return false;
      woken.push_back(other);
      return true;
    });
    for (store_session* other : woken) {
      answer_get(*other, key);
      other->parked = false;
      other->parked_key.clear();
      parse(*other);
    }
  }

  std::uint64_t token_;
  std::vector<store_session*> parked_;
  std::map<std::string, std::vector<std::uint8_t>> data_;
};

/// The server side; rank 0's progress engine polls its descriptors and calls on_events().
class store_server {
 public:
  /// Serves the store on `listener` for the job whose token hashes to `token`.
  store_server(socket_fd listener, std::uint64_t token, int rank, handshake_limits limits = {})
      : acceptor_(std::move(listener), sizeof(store_hello), limits, rank, "the store"), book_(token), rank_(rank) {}

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const { return acceptor_.port(); }

  /// Appends the descriptors to poll; `base` receives the index of the first one.
  void fill(std::vector<pollfd>& fds, std::size_t& base) const {
    base = fds.size();
    acceptor_.fill(fds);
    for (const auto& c : conns_) {
      short ev = c->s.out.empty() ? POLLRDHUP : POLLRDHUP | POLLOUT;
      if (store_book::wanted(c->s) > 0) ev = static_cast<short>(ev | POLLIN);
      fds.push_back({c->fd.get(), ev, 0});
    }
  }

  /// Handles the poll results of the descriptors fill() added at `base`.
  void on_events(const std::vector<pollfd>& fds, std::size_t base) {
    const std::size_t first = base + acceptor_.descriptors();
    for (std::size_t i = 0; i < conns_.size() && first + i < fds.size(); ++i) {
      const short ev = fds[first + i].revents;
      if (ev & POLLIN) read_from(*conns_[i]);
      else if (ev & (POLLERR | POLLHUP | POLLRDHUP)) conns_[i]->dead = true;  // gone while its get waits
    }
    for (auto& a : acceptor_.on_events(fds, base)) {
      auto c = std::make_unique<conn>(conn{std::move(a.fd), std::move(a.from), {}});
      book_.feed(c->s, a.hello.data(), a.hello.size());
      check(*c);
      conns_.push_back(std::move(c));
    }
    for (auto& c : conns_)
      if (!c->dead) flush(*c);  // also the answers a set or add gave to parked gets
    std::erase_if(conns_, [this](const std::unique_ptr<conn>& c) {
      if (c->dead) book_.close(c->s);
      return c->dead;
    });
  }

 private:
  struct conn {
    socket_fd fd;
    std::string from;
    store_session s;
    bool dead = false;
  };

  void read_from(conn& c) {
    std::uint8_t buf[65536];
    for (int reads = 0; reads < 64 && !c.dead; ++reads) {  // bounded, so one client cannot starve the loop
      const std::size_t want = std::min(store_book::wanted(c.s), sizeof buf);
      if (want == 0) return;
      const ssize_t k = ::recv(c.fd.get(), buf, want, MSG_DONTWAIT);
      if (k > 0) {
        book_.feed(c.s, buf, static_cast<std::size_t>(k));
        check(c);
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (k < 0 && errno == EINTR) continue;
      c.dead = true;
    }
  }

  /// Closes `c` with one log line when the protocol refused it.
  void check(conn& c) {
    if (c.s.refused.empty()) return;
    if (!c.s.authed) acceptor_.refuse(c.fd, c.from, c.s.refused);
    else
      log_line(rank_, "closed a store connection from " + c.from + " of this job: it sent " + c.s.refused +
                          "; every rank must run the same ddp version; the job goes on");
    c.dead = true;
  }

  static void flush(conn& c) {
    std::size_t sent = 0;
    while (sent < c.s.out.size()) {
      const ssize_t k = ::send(c.fd.get(), c.s.out.data() + sent, c.s.out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) { sent += static_cast<std::size_t>(k); continue; }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      c.dead = true;
      break;
    }
    c.s.out.erase(c.s.out.begin(), c.s.out.begin() + static_cast<std::ptrdiff_t>(sent));
  }

  handshake_acceptor acceptor_;
  store_book book_;
  int rank_;
  std::vector<std::unique_ptr<conn>> conns_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/store.hpp>

namespace ddp::tcp::detail {

class engine;
/// Runs one collective call's algorithm on the engine thread (ddp::tcp::detail::run_collective).
using executor = void (*)(engine&, call&);

class engine : peer_io {
 public:
  /// Starts the engine thread; `store` is rank 0's rendezvous server (served by the same poll loop).
  engine(int rank, int size, executor exec, std::optional<store_server> store)
      : peer_io(rank, size), exec_(exec), store_(std::move(store)) {
    wake_ = socket_fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!wake_.valid()) throw error("cannot create an eventfd for the progress engine: " + errno_text(errno), rank);
    thread_ = std::thread([this] { loop(); });
  }
  engine(const engine&) = delete;

  /// Fails the calls still queued, aborts the one in flight, says goodbye to the peers and joins the thread.
  ~engine() {
    queue_.stop();
    wake();
    thread_.join();
  }

  /// Hands the connected mesh sockets and what this rank may read of each peer's memory (both indexed by
  /// world rank; own entry empty) to the engine thread, with the job's shared-memory segment and point-to-point
  /// rings (null: none).
  void attach(std::vector<socket_fd> sockets, std::vector<peer_memory> memory, std::shared_ptr<shm_world> world,
              std::unique_ptr<shm_rings> rings) {
    std::unique_lock lock(queue_.mutex());
    pending_sockets_ = std::move(sockets);
    pending_memory_ = std::move(memory);
    pending_world_ = std::move(world);
    pending_rings_ = std::move(rings);
    has_pending_sockets_ = true;
    lock.unlock();
    wake();
  }

  /// The calls submitted, and who runs them.
  call_queue& queue() { return queue_; }
  /// Runs shared-memory call `c`, claimed with queue().claim_locked(), on the caller's thread; hands it to
  /// the engine thread if the peers are not there within shm_handoff_after.
  /// A point-to-point call runs through its peer's ring, with the engine's io mutex taken while the engine
  /// thread sleeps in poll (peer_io.hpp); a recv not there within shm_handoff_after stays posted for the engine.
  void run_on_caller(call c) {
    std::optional<call> back;
    std::exception_ptr failure;
    bool wake_engine = false;
    try {
      if (c.side != p2p::none) {
        std::lock_guard io(io_);
        if (!point_to_point_on_caller(c, shm_handoff_after, yield_after_among(*c.grp->shm), wake_engine))
          back = std::move(c);
      } else if (run_shm_on_caller(c, note_.get())) {
        c.done->finish();
      } else {
        back = std::move(c);
      }
    } catch (...) {
      failure = std::current_exception();
      live_.end();  // first: peers copying from this process's buffers must discard what they copy from now on
      c.grp->shm->world().abort(notice_of(failure));  // the peers must hear of it even if this process exits
      c.done->fail(failure);
    }
    if (queue_.release(std::move(back), std::move(failure)) || wake_engine) wake();
  }
  /// Wakes the engine thread from poll.
  void wake() {
    const std::uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) < 0) return;  // EAGAIN: the counter is full, a wake-up is pending
  }

  [[nodiscard]] int rank() const { return rank_; }
  /// This process's live word (same_host.hpp), which peers on this host read after each copy from it.
  [[nodiscard]] const live_word& live() const { return live_; }
  /// What the engine waits for while stalled; completions carry it into wait()'s timeout message.
  [[nodiscard]] std::shared_ptr<const ddp::detail::stall_note> note() const { return note_; }

  // ---- what a collective's algorithm uses (through ddp::tcp::detail::channel), on the engine thread ----

  /// Posts a collective frame: its data itself, or, where the peer can read this process, a remote frame
  /// with the data's address (`data` must then stay unchanged until the peer's op_ack).
  void send_collective(int world_peer, frame_header h, const void* data) {
    auto& p = at(world_peer);
    if (h.length < remote_min_bytes || !p.memory.reads_us) return post(world_peer, h, data, nullptr);
    const remote_block where{reinterpret_cast<std::uintptr_t>(data), h.length};
    h.flags = frame_remote;
    h.length = sizeof(remote_block);
    p.out.push({h, nullptr, 0, nullptr, where});
    ++p.unacked;
    write_some(world_peer);
  }
  /// The executing call expects its next frame from `world_peer` to carry `h`, its payload landing at `dest`.
  void expect(int world_peer, const frame_header& h, void* dest) { at(world_peer).await(h, static_cast<char*>(dest)); }
  /// Runs the poll loop until every expected frame has arrived.
  void receive_expected() {
    pump([&] { return std::none_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.expecting; }); });
  }
  /// Runs the poll loop until every queued frame is written and every remote frame acknowledged.
  void flush() {
    pump([&] { return std::none_of(peers_.begin(), peers_.end(), [](const peer& p) { return p.sending(); }); });
  }
  /// Between the sleeps of a hierarchical collective's shared-memory step: serves the sockets without blocking;
  /// throws to cancel the call.
  void serve_sockets() {
    idle_wait(0);
    if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
  }
  /// The executing call's deadline.
  [[nodiscard]] clock::time_point deadline() const { return deadline_; }
  /// Scratch buffer `which` (0 or 1) of at least `bytes`: it only grows, uninitialized, and growing discards
  /// its contents, so steady state allocates and touches no new memory.
  char* scratch(int which, std::size_t bytes) { return scratch_[which].get(bytes); }

 private:
  // ---- the thread -------------------------------------------------------------------------

  void loop() {
    const std::lock_guard io(io_lock_);  // released only while idle_wait() sleeps in poll
    while (true) {
      std::unique_lock lock(queue_.mutex());
      if (has_pending_sockets_) {
        for (std::size_t r = 0; r < pending_sockets_.size(); ++r) {
          peers_[r].fd = std::move(pending_sockets_[r]);
          peers_[r].memory = pending_memory_[r];
        }
        pending_sockets_.clear();
        pending_memory_.clear();
        has_pending_sockets_ = false;
        shm_world_ = std::move(pending_world_);
        use_rings(std::move(pending_rings_));
        if (shm_world_) {
          // From now until release() or death, peers see this rank alive. Taken outside the queue's lock and the
          // io mutex, which this thread also takes while holding it: one lock order.
          lock.unlock();
          io_lock_.unlock();
          shm_world_->hold();
          io_lock_.lock();
          continue;
        }
      }
      // A call on the caller's thread failed: tell the peers over the sockets too (also when stopping, or they
      // would see a clean close).
      if (const auto e = queue_.take_caller_failure_locked()) {
        lock.unlock();
        abort_peers(e);
        continue;
      }
      if (queue_.stopping_locked()) break;
      if (auto c = queue_.take_locked()) {
        lock.unlock();
        run(*c);
        queue_.finished();
        continue;
      }
      lock.unlock();
      try {
        idle_wait();
      } catch (...) {
        abort_peers(std::current_exception());
      }
    }
    shutdown();
  }

  /// Sleeps in poll until woken (at most `max_ms` unless negative), serving the store, reading
  /// point-to-point frames and draining sends.
  void idle_wait(int max_ms = -1) {
    serve_rings();
    const std::size_t peer_base = build_poll_set();
    auto first = clock::time_point::max();
    for (const auto& p : peers_) first = std::min(first, p.mail.next_deadline());
    int ms = first == clock::time_point::max() ? -1 : std::max(poll_ms(first), 1);
    if (max_ms >= 0) ms = ms < 0 ? max_ms : std::min(ms, max_ms);
    const int sleep_ms = before_sleep(ms);
    io_lock_.unlock();  // the caller's thread may run a send or recv meanwhile
    const int rc = ::poll(fds_.data(), fds_.size(), sleep_ms);
    io_lock_.lock();
    after_sleep();
    expire_recvs();
    if (rc <= 0) return;
    if (fds_[0].revents & POLLIN) drain_wake();
    if (store_) store_->on_events(fds_, store_base_);
    for (std::size_t r = 0; r < peers_.size(); ++r) {
      if (fds_[peer_base + r].revents == 0) continue;
      if (peers_[r].out.pending()) write_some(static_cast<int>(r));
      if (peers_[r].readable()) read_some(static_cast<int>(r));
    }
    serve_rings();  // an op_ring frame may have woken it
  }

  /// Fills fds_: the wake-up descriptor, the store's, then one entry per peer; returns the peers' base.
  std::size_t build_poll_set() {
    fds_.clear();
    fds_.push_back({wake_.get(), POLLIN, 0});
    if (store_) store_->fill(fds_, store_base_);
    const std::size_t base = fds_.size();
    for (const auto& p : peers_) {
      short ev = 0;
      if (!poisoned_ && p.out.pending()) ev |= POLLOUT;
      if (!poisoned_ && p.readable()) ev |= POLLIN;
      fds_.push_back({ev != 0 ? p.fd.get() : -1, ev, 0});
    }
    return base;
  }

  void drain_wake() {
    std::uint64_t n = 0;
    if (::read(wake_.get(), &n, sizeof n) < 0) return;  // EAGAIN: another wake-up drained it
  }

  void run(call& c) {
    if (poisoned_) return c.done->fail(poisoned_);
    current_ = &c;
    deadline_ = clock::now() + c.grp->timeout;
    try {
      if (c.over_shm()) {
        run_shm_on_engine(c, deadline_, note_.get(), [this] {
          idle_wait(0);
          if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
        });
        c.done->finish();
      } else if (c.side != p2p::none) {
        point_to_point(c);
      } else {
        exec_(*this, c);
        finished_ = header_of(c, 0);
        c.done->finish();
      }
    } catch (...) {
      const auto e = std::current_exception();
      abort_peers(e);  // first, so the peers hear of it even if this process exits once wait() throws
      c.done->fail(e);
    }
    current_ = nullptr;
    if (noted_) note_->set({});
    noted_ = false;
  }

  /// Reads what the peer has sent, frame by frame; true if bytes moved.
  bool read_some(int world_peer) {
    auto& p = at(world_peer);
    const int fd = p.fd.get();
    const auto from_socket = [fd](char* buf, std::size_t n) { return ::recv(fd, buf, n, MSG_DONTWAIT); };
    bool moved = false;
    while (p.readable()) {
      if (p.in.state() == read_state::holding) accept_collective(world_peer);
      const read_event ev = p.in.advance(from_socket, moved);
      if (ev == read_event::blocked) break;
      if (ev == read_event::ended) on_end(world_peer);
      else if (ev == read_event::header) dispatch(world_peer);
      else finish_payload(world_peer);
    }
    return moved;
  }

  /// The stream ended: fatal if anything is expected from the peer, else remembered for later calls.
  void on_end(int world_peer) {
    auto& p = at(world_peer);
    if (p.in.state() == read_state::corrupt) throw corrupt_stream(world_peer, malformed(p.in.header()));
    if (p.ring) read_ring(world_peer);  // what it sent through its ring before it left
    if (p.expecting || p.in.mid_frame() || p.mail.waiting() || p.unacked > 0 || (p.ring && p.ring->busy()))
      throw lost(world_peer, p.in.error_code(), farewell(p.in));
  }

  /// A whole header arrived: route the frame.
  void dispatch(int world_peer) {
    auto& p = at(world_peer);
    const frame_header& h = p.in.header();
    p.sink.into = target::control;
    switch (h.op) {
      case op_abort: p.in.close(); raise_abort(world_peer, h, p.fd.get());
      case op_waiting:
        p.waiting = h;
        p.waiting->op = h.flags;
        p.waiting->flags = 0;
        return p.in.accept(nullptr);
      case op_ring: return p.in.accept(nullptr);  // the rings are served after the sockets
      case op_ack:
        if (p.unacked == 0) throw corrupt_stream(world_peer, "an acknowledgement of a copy this rank never offered");
        --p.unacked;
        return p.in.accept(nullptr);
      default: break;
    }
    if (h.op == static_cast<std::uint8_t>(collective::send_recv)) route_send(world_peer, p.sink, p.in);
    // else a collective frame: held for its call
  }

  /// The executing call expects the held collective frame: check it, then receive its payload.
  void accept_collective(int world_peer) {
    auto& p = at(world_peer);
    const frame_header& got = p.in.header();
    const bool remote = (got.flags & frame_remote) != 0;
    if (!same_call(p.expect, got) || (!remote && got.length != p.expect.length)) throw_mismatch(world_peer, p.expect, got);
    p.sink.into = target::collective;
    p.in.accept(remote ? reinterpret_cast<char*>(&p.remote) : p.expect_dest);
  }

  void finish_payload(int world_peer) {
    auto& p = at(world_peer);
    switch (p.sink.into) {
      case target::control: break;
      case target::collective:
        if ((p.in.header().flags & frame_remote) != 0) copy_remote(world_peer);
        p.expecting = false;
        break;
      case target::posted:
      case target::stray: return finish_send(world_peer, p.sink, p.in.header());
    }
    p.sink.into = target::control;
  }

  /// Copies a remote frame's data out of the peer's memory into the expected destination, then acknowledges it.
  void copy_remote(int world_peer) {
    auto& p = at(world_peer);
    if (!p.memory.readable) throw unreadable(world_peer);
    if (p.remote.bytes != p.expect.length) {
      frame_header got = p.in.header();
      got.length = p.remote.bytes;
      throw_mismatch(world_peer, p.expect, got);
    }
    int code = 0;
    const copy_result result = copy_from_peer(p.memory, p.remote, p.expect_dest, code);
    if (result != copy_result::copied) {
      raise_abort_behind(world_peer, p.fd.get());  // it aborted and released the buffer: its notice says why
      if (result == copy_result::failed) throw lost(world_peer, code, "copying from its memory failed (" + errno_text(code) + ")");
      throw abandoned_copy(world_peer);
    }
    frame_header ack;
    ack.op = op_ack;
    post(world_peer, ack, nullptr, nullptr);
  }

  /// Runs the poll loop until `done()`; throws on peer loss, mismatch, timeout or destruction.
  template <class Done>
  void pump(Done done) {
    bool stall_noticed = false;
    while (true) {
      bool moved = true;
      while (moved && !done()) {
        moved = false;
        for (std::size_t r = 0; r < peers_.size(); ++r) {
          if (peers_[r].out.pending()) moved = write_some(static_cast<int>(r)) || moved;
          if (peers_[r].readable()) moved = read_some(static_cast<int>(r)) || moved;
        }
      }
      for (std::size_t r = 0; r < peers_.size(); ++r)
        if ((peers_[r].expecting || peers_[r].unacked > 0) && peers_[r].in.ended())
          throw lost(static_cast<int>(r), 0, farewell(peers_[r].in));
      if (done()) return;
      check_same_step(peers_);
      build_poll_set();
      const int until_deadline = poll_ms(deadline_);
      const bool may_stall = !stall_noticed && until_deadline > static_cast<int>(stall_notice_after.count());
      const int rc = ::poll(fds_.data(), fds_.size(), may_stall ? static_cast<int>(stall_notice_after.count()) : until_deadline);
      if (rc < 0 && errno != EINTR) throw error("poll failed: " + errno_text(errno), rank_, errno);
      if (fds_[0].revents & POLLIN) {
        drain_wake();
        if (queue_.stopping()) throw cancelled();  // to the peers, this rank is lost
      }
      if (store_) store_->on_events(fds_, store_base_);
      expire_recvs();
      if (rc == 0 && may_stall) {
        stall_noticed = true;
        notice_stall();
      }
      if (rc == 0 && clock::now() >= deadline_) throw timed_out(waiting_list(peers_));
    }
  }

  /// After a stall: tells every peer of the group which call this rank waits in, and publishes whom it waits for.
  void notice_stall() {
    frame_header h = header_of(*current_, 0);
    h.flags = h.op;
    h.op = op_waiting;
    for (const int member : current_->grp->members)
      if (member != rank_ && at(member).fd.valid() && !at(member).in.ended()) post(member, h, nullptr, nullptr);
    note_->set(waiting_list(peers_));
    noted_ = true;
  }

  // ---- failure and shutdown ----------------------------------------------------------------

  /// Changes the live word, completes frames already half written (so the streams stay parseable), drops
  /// the rest, sends every peer an abort frame carrying the error, and poisons the engine.
  void abort_peers(std::exception_ptr e) {
    live_.end();  // before any buffer is released: copies still running see it and discard
    poisoned_ = e;
    const abort_notice notice = notice_of(e);
    if (shm_world_) shm_world_->abort(notice);
    queue_.fail();
    const auto limit = clock::now() + std::chrono::seconds(1);
    for (auto& p : peers_) p.abort(e, notice, limit);
  }

  /// On destruction: fail what is queued, say goodbye where the stream is at a frame boundary, close.
  void shutdown() {
    const auto gone = destroyed();
    for (auto& c : queue_.drain()) c.done->fail(gone);
    for (auto& p : peers_) {
      if (p.ring) p.ring->fail(gone);
      p.close(gone, !poisoned_);
    }
    if (shm_world_) shm_world_->release();
  }

  executor exec_;
  std::optional<store_server> store_;
  std::size_t store_base_ = 0;
  socket_fd wake_;
  std::vector<pollfd> fds_;
  clock::time_point deadline_{};
  live_word live_;
  std::shared_ptr<ddp::detail::stall_note> note_ = std::make_shared<ddp::detail::stall_note>();
  bool noted_ = false;
  scratch_buffer scratch_[2];
  std::shared_ptr<shm_world> shm_world_;  ///< the job's segment (engine thread), null without shared memory

  /// Guards the peers, the rings and the mailboxes: held by the engine thread except while it sleeps in
  /// idle_wait()'s poll, and by the caller's thread running a send or recv (after claiming the queue).
  std::mutex io_;
  std::unique_lock<std::mutex> io_lock_{io_, std::defer_lock};  ///< the engine thread's hold on io_
  call_queue queue_;  ///< its mutex guards the attachment below too
  std::vector<socket_fd> pending_sockets_;
  std::vector<peer_memory> pending_memory_;
  std::shared_ptr<shm_world> pending_world_;
  std::unique_ptr<shm_rings> pending_rings_;
  bool has_pending_sockets_ = false;
  std::thread thread_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/engine.hpp>

namespace ddp::tcp::detail {

class channel {
 public:
  channel(engine& e, call& c) : channel(e, c, c.grp->members, c.grp->me) {}
  /// Over `members` (world ranks; this process is members[me]) instead of the call's whole group.
  channel(engine& e, call& c, const std::vector<int>& members, int me) : e_(e), c_(c), members_(members), me_(me) {}

  /// The call being executed.
  [[nodiscard]] const call& what() const { return c_; }
  /// This process's group rank.
  [[nodiscard]] int rank() const { return me_; }
  /// The group's size.
  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }

  /// Queues a frame of `bytes` payload to group rank `to`; `data` must stay valid and unchanged until
  /// flush() (a peer on this host may copy it straight from this process's memory until then).
  void send(int to, const void* data, std::size_t bytes) {
    c_.grp->stats.add_bytes(c_.kind, bytes);
    e_.send_collective(world(to), header_of(c_, bytes), data);
  }
  /// Receives the next frame from group rank `from` into `dest` (exactly `bytes`), sends progressing meanwhile.
  void recv(int from, void* dest, std::size_t bytes) {
    const recv_part one{from, dest, bytes};
    recv_all(std::span<const recv_part>(&one, 1));
  }
  /// Receives one frame from each listed peer (each at most once), in whatever order they arrive.
  void recv_all(std::span<const recv_part> parts) {
    for (const auto& part : parts) e_.expect(world(part.peer), header_of(c_, part.bytes), part.dest);
    e_.receive_expected();
  }
  /// Waits until every queued frame is written and every peer has copied the data of its remote frames.
  void flush() { e_.flush(); }
  /// A scratch buffer (two of them: 0 and 1) of at least `bytes`, held by the engine and reused by every
  /// later call: it only grows, uninitialized, so steady state allocates and touches no new memory.
  /// Growing discards the contents.
  char* scratch(int which, std::size_t bytes) { return e_.scratch(which, bytes); }

 private:
  [[nodiscard]] int world(int group_rank) const { return members_[static_cast<std::size_t>(group_rank)]; }
  engine& e_;
  call& c_;
  const std::vector<int>& members_;
  int me_;
};

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/channel.hpp>

namespace ddp::tcp::detail {

/// Below this many payload bytes per rank, collectives exchange directly in one round.
inline constexpr std::size_t direct_limit = 64 << 10;
/// Ring and chain frames carry at most this many bytes, so receiving, reducing and forwarding overlap.
inline constexpr std::size_t segment_bytes = 512 << 10;

inline int wrap(int a, int n) { return ((a % n) + n) % n; }

/// How `count` elements split into `parts` near-equal chunks (the first ones one element shorter).
struct chunking {
  std::size_t count;
  int parts;
  std::size_t elem;
  [[nodiscard]] std::size_t first(int c) const { return static_cast<std::size_t>(c) * count / static_cast<std::size_t>(parts); }
  [[nodiscard]] std::size_t offset(int c) const { return first(c) * elem; }
  [[nodiscard]] std::size_t bytes(int c) const { return (first(c + 1) - first(c)) * elem; }
};

/// Calls f(offset, length) for each segment of `bytes`.
template <class F>
void for_segments(std::size_t bytes, F f) {
  for (std::size_t off = 0; off < bytes; off += segment_bytes) f(off, std::min(segment_bytes, bytes - off));
}

/// Ring reduce-scatter: chunk c of the result is the reduction of every rank's chunk c of `in`;
/// intermediate chunks land in `acc` (may be `in`), this rank's final chunk in `mine`. With
/// `forward`, each finished segment of `mine` is averaged if needed and sent on as the first
/// all-gather step.
inline void ring_reduce_scatter(channel& ch, const char* in, char* acc, char* mine, const chunking& L, bool forward) {
  const int n = ch.size();
  const int r = ch.rank();
  const int left = wrap(r - 1, n);
  const int right = wrap(r + 1, n);
  const auto& c = ch.what();
  char* tmp = ch.scratch(0, segment_bytes);
  const int first = wrap(r - 1, n);
  for_segments(L.bytes(first), [&](std::size_t off, std::size_t len) { ch.send(right, in + L.offset(first) + off, len); });
  for (int s = 0; s < n - 1; ++s) {
    const int k = wrap(r - s - 2, n);
    const bool last = s == n - 2;
    char* dst = last ? mine : acc + L.offset(k);
    for_segments(L.bytes(k), [&](std::size_t off, std::size_t len) {
      ch.recv(left, tmp, len);
      reduce_bytes(c.type, dst + off, in + L.offset(k) + off, tmp, len / L.elem, c.op);
      if (last && forward) finish_avg_bytes(c.type, dst + off, len / L.elem, c.op, n);
      if (!last || forward) ch.send(right, dst + off, len);
    });
  }
}

/// Ring all-gather over `out` (this rank's chunk already in place and, unless `post_own` is false,
/// not yet sent): each segment received from the left is forwarded to the right at once.
inline void ring_all_gather(channel& ch, char* out, const chunking& L, bool post_own) {
  const int n = ch.size();
  const int r = ch.rank();
  const int left = wrap(r - 1, n);
  const int right = wrap(r + 1, n);
  if (post_own)
    for_segments(L.bytes(r), [&](std::size_t off, std::size_t len) { ch.send(right, out + L.offset(r) + off, len); });
  for (int s = 0; s < n - 1; ++s) {
    const int k = wrap(r - s - 1, n);
    for_segments(L.bytes(k), [&](std::size_t off, std::size_t len) {
      ch.recv(left, out + L.offset(k) + off, len);
      if (s < n - 2) ch.send(right, out + L.offset(k) + off, len);
    });
  }
  ch.flush();
}

/// Receives one block of `bytes` from every other rank into block p of `blocks` (stride `bytes`).
inline void recv_from_each(channel& ch, char* blocks, std::size_t stride, std::size_t bytes) {
  thread_local std::vector<recv_part> parts;
  parts.clear();
  for (int p = 0; p < ch.size(); ++p)
    if (p != ch.rank()) parts.push_back({p, blocks + static_cast<std::size_t>(p) * stride, bytes});
  ch.recv_all(parts);
}

/// dst = block 0 (op) block 1 (op) ... in rank order over `blocks` (stride `bytes`), after copying
/// `own_data` into block `own`: every rank computes the same bits.
inline void reduce_in_rank_order(channel& ch, char* dst, char* blocks, std::size_t bytes, int own,
                                 const char* own_data) {
  const auto& c = ch.what();
  const auto block = [&](int p) { return blocks + static_cast<std::size_t>(p) * bytes; };
  std::memcpy(block(own), own_data, bytes);
  const std::size_t n_elems = bytes / size_of(c.type);
  if (ch.size() == 1) {
    std::memcpy(dst, block(0), bytes);
  } else {
    reduce_bytes(c.type, dst, block(0), block(1), n_elems, c.op);
    for (int p = 2; p < ch.size(); ++p) reduce_bytes(c.type, dst, dst, block(p), n_elems, c.op);
  }
  finish_avg_bytes(c.type, dst, n_elems, c.op, ch.size());
}

inline void all_reduce(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t bytes = c.count * size_of(c.type);
  if (n == 1 || bytes == 0) return finish_avg_bytes(c.type, buf, c.count, c.op, n);
  if (bytes <= direct_limit) {
    char* blocks = ch.scratch(1, bytes * static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, buf, bytes);
    recv_from_each(ch, blocks, bytes, bytes);
    ch.flush();
    return reduce_in_rank_order(ch, buf, blocks, bytes, ch.rank(), buf);
  }
  const chunking L{c.count, n, size_of(c.type)};
  ring_reduce_scatter(ch, buf, buf, buf + L.offset(ch.rank()), L, true);
  ring_all_gather(ch, buf, L, false);
}

inline void reduce_scatter(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t es = size_of(c.type);
  const std::size_t block = c.count * es;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  if (block == 0) return;
  if (n == 1) {
    if (out != in) std::memmove(out, in, block);
    return;
  }
  if (block <= direct_limit) {
    char* received = ch.scratch(1, block * static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
    recv_from_each(ch, received, block, block);
    ch.flush();
    return reduce_in_rank_order(ch, out, received, block, ch.rank(), in + static_cast<std::size_t>(ch.rank()) * block);
  }
  const chunking L{c.count * static_cast<std::size_t>(n), n, es};
  ring_reduce_scatter(ch, in, ch.scratch(1, block * static_cast<std::size_t>(n)), out, L, false);
  ch.flush();
  finish_avg_bytes(c.type, out, c.count, c.op, n);
}

inline void all_gather(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  const std::size_t block = c.count * size_of(c.type);
  auto* out = static_cast<char*>(c.out);
  char* own = out + static_cast<std::size_t>(ch.rank()) * block;
  if (block > 0 && own != c.in) std::memmove(own, c.in, block);
  if (n == 1 || block == 0) return;
  if (block * static_cast<std::size_t>(n) <= direct_limit) {
    for (int p = 0; p < n; ++p)
      if (p != ch.rank()) ch.send(p, own, block);
    recv_from_each(ch, out, block, block);
    return ch.flush();
  }
  ring_all_gather(ch, out, chunking{c.count * static_cast<std::size_t>(n), n, size_of(c.type)}, true);
}

inline void broadcast(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t bytes = c.count * size_of(c.type);
  if (n == 1 || bytes == 0) return;
  if (bytes <= direct_limit) {
    if (ch.rank() == c.root) {
      for (int p = 0; p < n; ++p)
        if (p != c.root) ch.send(p, buf, bytes);
      return ch.flush();
    }
    return ch.recv(c.root, buf, bytes);
  }
  const int v = wrap(ch.rank() - c.root, n);  // position in the chain root -> root+1 -> ...
  const int prev = wrap(ch.rank() - 1, n);
  const int next = wrap(ch.rank() + 1, n);
  for_segments(bytes, [&](std::size_t off, std::size_t len) {
    if (v > 0) ch.recv(prev, buf + off, len);
    if (v < n - 1) ch.send(next, buf + off, len);
  });
  ch.flush();
}

inline void reduce(channel& ch) {
  const auto& c = ch.what();
  const int n = ch.size();
  auto* buf = static_cast<char*>(c.out);
  const std::size_t es = size_of(c.type);
  const std::size_t bytes = c.count * es;
  if (n == 1 || bytes == 0) {
    if (ch.rank() == c.root) finish_avg_bytes(c.type, buf, c.count, c.op, n);
    return;
  }
  if (bytes <= direct_limit) {
    if (ch.rank() != c.root) {
      ch.send(c.root, buf, bytes);
      return ch.flush();
    }
    char* received = ch.scratch(1, bytes * static_cast<std::size_t>(n));
    recv_from_each(ch, received, bytes, bytes);
    return reduce_in_rank_order(ch, buf, received, bytes, ch.rank(), buf);
  }
  // Chain towards the root: position n-1 starts, each rank adds its part and forwards, the root ends.
  const int v = wrap(ch.rank() - c.root, n);
  const int toward_root = wrap(ch.rank() - 1, n);
  const int from_tail = wrap(ch.rank() + 1, n);
  char* tmp = ch.scratch(0, segment_bytes);
  char* partial = v == 0 || v == n - 1 ? nullptr : ch.scratch(1, bytes);
  for_segments(bytes, [&](std::size_t off, std::size_t len) {
    if (v == n - 1) return ch.send(toward_root, buf + off, len);
    ch.recv(from_tail, tmp, len);
    char* dst = v == 0 ? buf + off : partial + off;
    reduce_bytes(c.type, dst, buf + off, tmp, len / es, c.op);
    if (v != 0) ch.send(toward_root, dst, len);
  });
  ch.flush();
  if (v == 0) finish_avg_bytes(c.type, buf, c.count, c.op, n);
}

inline void gather(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  if (block == 0) return;
  if (ch.rank() != c.root) {
    ch.send(c.root, c.in, block);
    return ch.flush();
  }
  auto* out = static_cast<char*>(c.out);
  std::memmove(out + static_cast<std::size_t>(c.root) * block, c.in, block);
  recv_from_each(ch, out, block, block);
}

inline void scatter(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count * size_of(c.type);
  if (block == 0) return;
  if (ch.rank() != c.root) return ch.recv(c.root, c.out, block);
  const auto* in = static_cast<const char*>(c.in);
  for (int p = 0; p < ch.size(); ++p)
    if (p != c.root) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
  std::memmove(c.out, in + static_cast<std::size_t>(c.root) * block, block);
  ch.flush();
}

inline void all_to_all(channel& ch) {
  const auto& c = ch.what();
  const std::size_t block = c.count / static_cast<std::size_t>(ch.size()) * size_of(c.type);
  if (block == 0) return;
  const auto* in = static_cast<const char*>(c.in);
  auto* out = static_cast<char*>(c.out);
  for (int p = 0; p < ch.size(); ++p)
    if (p != ch.rank()) ch.send(p, in + static_cast<std::size_t>(p) * block, block);
  recv_from_each(ch, out, block, block);
  const std::size_t mine = static_cast<std::size_t>(ch.rank()) * block;
  ch.flush();
  std::memmove(out + mine, in + mine, block);
}

/// Dissemination barrier: ceil(log2 N) rounds of empty frames.
inline void barrier(channel& ch) {
  const int n = ch.size();
  for (int d = 1; d < n; d *= 2) {
    ch.send(wrap(ch.rank() + d, n), nullptr, 0);
    ch.recv(wrap(ch.rank() - d, n), nullptr, 0);
  }
  ch.flush();
}

/// Runs the collective `ch` describes.
inline void execute(channel& ch) {
  switch (ch.what().kind) {
    case collective::all_reduce: return all_reduce(ch);
    case collective::reduce_scatter: return reduce_scatter(ch);
    case collective::all_gather: return all_gather(ch);
    case collective::broadcast: return broadcast(ch);
    case collective::reduce: return reduce(ch);
    case collective::gather: return gather(ch);
    case collective::scatter: return scatter(ch);
    case collective::all_to_all: return all_to_all(ch);
    case collective::barrier: return barrier(ch);
    case collective::send_recv: break;  // the engine matches sends and recvs itself
  }
}

/// The engine's executor: runs collective call `c` on the engine thread.
inline void run_collective(engine& e, call& c) {
  channel ch(e, c);
  execute(ch);
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/algorithms.hpp>
// ---- begin <ddp/comm/tcp/hierarchical.hpp>
/// \file Collectives of a group spanning hosts with two members or more on some host (shm_hosts.hpp): shared
/// memory inside each host, the sockets across them, so each host's bytes cross its link once. all_reduce:
/// the members of each host reduce into their lowest (shm_reduce, in group-rank order), these leads all-reduce
/// over the sockets (all_reduce: one member per host, in host order), and each lead broadcasts the result to
/// its host (shm_broadcast); avg divides once at the end, by the group's size. broadcast: the root sends to the
/// lead of every other host over the sockets (broadcast), and each of them, or the root on its own host,
/// broadcasts it inside its host. all_gather: gather into each lead, the leads exchange their hosts' blocks,
/// each lead broadcasts the whole result inside its host. reduce_scatter: reduce into each lead, each lead
/// sends every other lead the partial sums of that host's blocks and sums what it receives in host order, each
/// lead scatters its host's blocks. reduce, gather, scatter, all_to_all and barrier run over the sockets as in
/// a group without shared memory. Every step runs on the engine thread: the shared-memory steps serve the
/// sockets between their sleeps, and a death on either transport fails the call as it fails a flat one.



namespace ddp::tcp::detail {

/// A group identifier all members compute alike from three numbers (a split's: parent id, split number, color).
inline std::uint32_t mix_id(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  std::uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (const std::uint64_t v : {a, b, c}) {
    h = (h ^ v) * 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
  }
  return static_cast<std::uint32_t>(h) | 1U;  // 0 stays unused
}

/// Gives group `g` (its members, place and id set) its share of the job's shared memory `hosts`: one segment
/// for the whole group where every member is on this host; a host_plan where it spans hosts and some host
/// holds two members or more; else nothing (the sockets carry everything).
inline void use_shared_memory(group& g, std::shared_ptr<const shm_hosts> hosts) {
  g.hosts = std::move(hosts);
  if (!g.hosts || g.size() < 2) return;
  auto plan = std::make_shared<host_plan>();
  for (int r = 0; r < g.size(); ++r) {
    const int host = g.hosts->host_of[static_cast<std::size_t>(g.members[static_cast<std::size_t>(r)])];
    int k = 0;
    while (k < plan->hosts() && g.hosts->host_of[static_cast<std::size_t>(plan->lead_world[static_cast<std::size_t>(k)])] != host) ++k;
    if (k == plan->hosts()) {
      plan->leads.push_back(r);
      plan->lead_world.push_back(g.members[static_cast<std::size_t>(r)]);
    }
    plan->host_of.push_back(k);
  }
  if (plan->hosts() == 1) {  // every member on this host
    if (g.hosts->segment) g.shm = std::make_shared<shm_group>(g.hosts->segment, g.id, g.members, g.me);
    return;
  }
  if (plan->hosts() == g.size()) return;  // one member per host: nothing to share
  for (int j = 0; j < plan->hosts(); ++j) {
    plan->host_start.push_back(static_cast<int>(plan->by_host.size()));
    for (int r = 0; r < g.size(); ++r)
      if (plan->host_of[static_cast<std::size_t>(r)] == j) plan->by_host.push_back(r);
  }
  plan->host_start.push_back(g.size());
  const int mine = plan->host_of[static_cast<std::size_t>(g.me)];
  std::vector<int> world;
  for (int r = 0; r < g.size(); ++r) {
    if (plan->host_of[static_cast<std::size_t>(r)] != mine) continue;
    if (r == g.me) plan->me_local = static_cast<int>(plan->local.size());
    plan->local.push_back(r);
    world.push_back(g.members[static_cast<std::size_t>(r)]);
  }
  plan->across = mix_id(g.id, 0x61637273, 0);
  if (world.size() > 1)
    plan->shm = std::make_shared<shm_group>(g.hosts->segment, mix_id(g.id, 0x686f7374, static_cast<std::uint64_t>(world.front())),
                                            std::move(world), plan->me_local, plan->local);
  g.hier = std::move(plan);
}

/// Call `c` as its partial steps run it: avg sums (the whole call divides once, at the end).
inline call partial_step(const call& c) {
  call step = c;
  if (step.op == reduce_op::avg) step.op = reduce_op::sum;
  return step;
}

/// Runs shared-memory step `f(shm_channel&)` of `step` among this host's members of the group, on the engine
/// thread, serving the sockets between its sleeps.
template <class F>
void on_this_host(engine& e, const call& step, host_plan& p, F f) {
  shm_waiting how = waiting_among(*p.shm);
  how.slice = std::chrono::milliseconds(1);
  how.between = [&e] { e.serve_sockets(); };
  // One slice past the call's deadline, as run_shm_on_engine gives: wait() gives up first.
  shm_channel ch(*p.shm, step, e.deadline() + how.slice, std::move(how));
  f(ch);
}

/// Runs step `f(channel&)` of `step` over the sockets among `members`, one per host (world ranks, in host order).
template <class F>
void across_hosts(engine& e, const call& step, const host_plan& p, const std::vector<int>& members, F f) {
  call across = step;
  across.wire_group = p.across;
  channel ch(e, across, members, p.host());
  f(ch);
}

/// all_reduce: reduce into each host's lead, all_reduce among the leads, broadcast inside each host.
inline void hierarchical_all_reduce(engine& e, call& c, host_plan& p) {
  call step = partial_step(c);
  step.root = 0;  // the lead, in `local`
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_reduce(ch); });
  if (p.me_local == 0) across_hosts(e, step, p, p.lead_world, [](channel& ch) { all_reduce(ch); });
  step.op = c.op;  // no arithmetic: the description says avg, so a host's ranks calling avg and sum differ
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
  finish_avg_bytes(c.type, c.out, c.count, c.op, c.grp->size());
}

/// broadcast: from the root to the lead of every other host, then inside each host.
inline void hierarchical_broadcast(engine& e, call& c, host_plan& p) {
  const int root_host = p.host_of[static_cast<std::size_t>(c.root)];
  const int speaker = p.host() == root_host ? c.root : p.leads[static_cast<std::size_t>(p.host())];
  call step = c;
  if (c.grp->me == speaker) {
    std::vector<int> speakers = p.lead_world;
    speakers[static_cast<std::size_t>(root_host)] = c.grp->members[static_cast<std::size_t>(c.root)];
    step.root = root_host;
    across_hosts(e, step, p, speakers, [](channel& ch) { broadcast(ch); });
  }
  step.root = p.local_index(speaker);
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
}

/// all_gather: gather into each host's lead, the leads exchange their hosts' blocks over the sockets, each lead
/// broadcasts the whole result inside its host.
inline void hierarchical_all_gather(engine& e, call& c, host_plan& p) {
  const std::size_t block = c.count * size_of(c.type), n = static_cast<std::size_t>(c.grp->size());
  const bool lead = p.me_local == 0;
  char* bundles = lead ? e.scratch(1, n * block) : nullptr;  // every host's blocks, host after host
  const auto bundle = [&](int j) { return bundles + static_cast<std::size_t>(p.host_start[static_cast<std::size_t>(j)]) * block; };
  call step = c;
  step.root = 0;  // the lead, in `local`
  step.out = lead ? bundle(p.host()) : nullptr;
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_gather(ch); });
  else std::memmove(bundle(p.host()), c.in, block);
  auto* out = static_cast<char*>(c.out);
  if (lead) {
    across_hosts(e, step, p, p.lead_world, [&](channel& ch) {
      thread_local std::vector<recv_part> parts;
      parts.clear();
      for (int j = 0; j < p.hosts(); ++j) {
        if (j == p.host()) continue;
        ch.send(j, bundle(p.host()), static_cast<std::size_t>(p.local.size()) * block);
        parts.push_back({j, bundle(j), static_cast<std::size_t>(p.ranks_on(j)) * block});
      }
      ch.recv_all(parts);
      ch.flush();
    });
    for (std::size_t i = 0; i < n; ++i) std::memcpy(out + static_cast<std::size_t>(p.by_host[i]) * block, bundles + i * block, block);
  }
  step.count = c.count * n;
  step.out = out;
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_broadcast(ch); });
}

/// reduce_scatter: reduce the whole input into each host's lead, the leads send each other lead the partial
/// blocks of its host's ranks over the sockets and sum what they receive in host order, each lead scatters its
/// host's blocks inside it.
inline void hierarchical_reduce_scatter(engine& e, call& c, host_plan& p) {
  const std::size_t block = c.count * size_of(c.type), n = static_cast<std::size_t>(c.grp->size());
  const bool lead = p.me_local == 0;
  const std::size_t here = p.local.size();
  char* sum = lead ? e.scratch(0, n * block) : nullptr;  // this host's partial sums of every block
  // Per other host j, its partial sums of this host's blocks; then the results, in `local` order.
  char* parts_in = lead ? e.scratch(1, static_cast<std::size_t>(p.hosts()) * here * block) : nullptr;
  const auto part = [&](int j, std::size_t i) { return parts_in + (static_cast<std::size_t>(j) * here + i) * block; };
  call step = partial_step(c);
  step.root = 0;  // the lead, in `local`
  step.count = c.count * n;
  if (lead) std::memcpy(sum, c.in, n * block);
  // shm_reduce only reads the buffer of a rank other than the root: the input stays untouched.
  step.out = lead ? sum : const_cast<void*>(c.in);
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_reduce(ch); });
  step.count = c.count;
  if (lead) {
    across_hosts(e, step, p, p.lead_world, [&](channel& ch) {
      for (int j = 0; j < p.hosts(); ++j)
        for (int k = p.host_start[static_cast<std::size_t>(j)]; j != p.host() && k < p.host_start[static_cast<std::size_t>(j) + 1]; ++k)
          ch.send(j, sum + static_cast<std::size_t>(p.by_host[static_cast<std::size_t>(k)]) * block, block);
      thread_local std::vector<recv_part> parts;
      for (std::size_t i = 0; i < here; ++i) {  // one frame from each other lead per block of this host
        parts.clear();
        for (int j = 0; j < p.hosts(); ++j)
          if (j != p.host()) parts.push_back({j, part(j, i), block});
        ch.recv_all(parts);
      }
      ch.flush();
    });
    const int me = p.host();
    for (std::size_t i = 0; i < here; ++i) {
      const char* own = sum + static_cast<std::size_t>(p.local[i]) * block;
      reduce_ranks(step, part(me, i), p.hosts(), c.count, [&](int j) { return j == me ? own : part(j, i); });
    }
  }
  step.in = lead ? part(p.host(), 0) : nullptr;
  step.out = c.out;
  step.op = c.op;  // no arithmetic: the description says avg, so a host's ranks calling avg and sum differ
  if (p.shm) on_this_host(e, step, p, [](shm_channel& ch) { shm_scatter(ch); });
  else std::memcpy(c.out, part(p.host(), 0), block);
  finish_avg_bytes(c.type, c.out, c.count, c.op, c.grp->size());
}

/// The engine's executor: runs collective call `c` on the engine thread, hierarchically where its group has a
/// host_plan and the collective a hierarchical algorithm.
inline void run_group_collective(engine& e, call& c) {
  host_plan* p = c.grp->hier.get();
  if (p == nullptr || c.count == 0) return run_collective(e, c);
  switch (c.kind) {
    case collective::all_reduce: return hierarchical_all_reduce(e, c, *p);
    case collective::broadcast: return hierarchical_broadcast(e, c, *p);
    case collective::all_gather: return hierarchical_all_gather(e, c, *p);
    case collective::reduce_scatter: return hierarchical_reduce_scatter(e, c, *p);
    default: return run_collective(e, c);
  }
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/hierarchical.hpp>
// ---- begin <ddp/comm/tcp/init_method.hpp>
/// \file torch.distributed's init methods for ddp::tcp: "env://" (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
/// from the environment), "tcp://host:port" (rank 0's store there) and "file:///path" (rank 0's store found
/// through a file every rank shares); the token, timeouts and interface come from the environment as always.



namespace ddp::tcp {

/// The config of init method `url` for rank `rank` of `size` (torch.distributed.init_process_group's
/// init_method, rank and world_size): "env://" takes both from the environment unless given; "tcp://host:port"
/// and "file:///absolute/path" need them. Throws config_error naming the mistake and its fix.
inline config config_from_url(std::string_view url, int rank = -1, int size = -1) {
  const auto given = [&](std::string_view method) {
    if (rank < 0 || size < 1)
      throw config_error(std::string(method) + " needs this process's rank and the world size: pass them as "
                         "init(\"" + std::string(url) + "\", rank, world_size), as torch.distributed's "
                         "init_process_group(init_method=..., rank=..., world_size=...)",
                         rank);
    if (rank >= size)
      throw config_error("rank " + std::to_string(rank) + " is not below the world size " + std::to_string(size) +
                             "; ranks run from 0 to world_size-1",
                         rank);
    config cfg = options_from_env();
    cfg.rank = rank;
    cfg.size = size;
    return cfg;
  };
  if (url == "env://") {
    config cfg = config_from_env();
    if (rank >= 0) cfg.rank = rank;
    if (size >= 1) cfg.size = size;
    return cfg;
  }
  if (url.rfind("tcp://", 0) == 0) {
    const std::string_view where = url.substr(6);
    const auto colon = where.rfind(':');
    unsigned port = 0;
    const char* end = where.data() + where.size();
    if (colon == std::string_view::npos || colon == 0 ||
        std::from_chars(where.data() + colon + 1, end, port).ptr != end || port == 0 || port > 65535)
      throw config_error("init method '" + std::string(url) + "' is not tcp://host:port with a port in 1..65535; "
                         "name rank 0's host and a free port, e.g. tcp://10.0.0.1:29500",
                         rank);
    config cfg = given("tcp://");
    cfg.master_addr = std::string(where.substr(0, colon));
    cfg.master_port = static_cast<std::uint16_t>(port);
    return cfg;
  }
  if (url.rfind("file://", 0) == 0) {
    const std::string_view path = url.substr(7);
    if (path.empty() || path.front() != '/')
      throw config_error("init method '" + std::string(url) + "' needs an absolute path, file:///shared/dir/name "
                         "(three slashes), on a filesystem every rank shares",
                         rank);
    config cfg = given("file://");
    cfg.store_file = std::string(path);
    return cfg;
  }
  throw config_error("unknown init method '" + std::string(url) + "'; ddp::tcp takes env://, tcp://host:port or "
                     "file:///path (torch.distributed's spellings)",
                     rank);
}

}  // namespace ddp::tcp
// ---- end <ddp/comm/tcp/init_method.hpp>
// ---- begin <ddp/comm/tcp/rendezvous.hpp>
/// \file The rendezvous of a TCP job: every rank joins rank 0's store, claims its rank, publishes its mesh
/// address, connects to every lower rank and accepts every higher one (all handshakes at once, strangers
/// refused), learns which peers' memory it can read, and hands the mesh to its progress engine.



// ---- begin <ddp/comm/tcp/store_client.hpp>
/// \file A rank's blocking client of the rendezvous store (set/get/wait/add); every call ends by the
/// rendezvous deadline.



namespace ddp::tcp::detail {

/// A blocking client of the store; connecting and every call end by the deadline given at construction.
class store_client {
 public:
  /// Connects to `host:port` (retrying with backoff) and authenticates with `token`, all before `connected_by`;
  /// every later call ends by `deadline`.
  store_client(const std::string& host, std::uint16_t port, std::uint64_t token, int rank, clock::time_point deadline,
               clock::time_point connected_by)
      : rank_(rank), deadline_(connected_by), where_(host + ":" + std::to_string(port)) {
    fd_ = connect_with_retry(host, port, connected_by, rank, "the rendezvous store (rank 0)",
                             "start rank 0, and give every rank the same MASTER_ADDR and MASTER_PORT (rank 0's "
                             "address and a free port), or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)");
    const store_hello hello{store_magic, 1, token};
    check(send_all(fd_.get(), &hello, sizeof hello, deadline_), "handshake");
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline_), "handshake");
    deadline_ = deadline;
  }
  /// Connects to `host:port` (retrying with backoff) and authenticates with `token`, all before `deadline`.
  store_client(const std::string& host, std::uint16_t port, std::uint64_t token, int rank, clock::time_point deadline)
      : store_client(host, port, token, rank, deadline, deadline) {}

  /// Stores `value` under `key`.
  void set(const std::string& key, const std::vector<std::uint8_t>& value) {
    request(store_cmd::set, key, value.data(), value.size());
    std::uint8_t ok = 0;
    check(recv_all(fd_.get(), &ok, 1, deadline_), "set '" + key + "'");
  }
  /// The value under `key`, waiting until some rank sets it.
  std::vector<std::uint8_t> get(const std::string& key) {
    request(store_cmd::get, key, nullptr, 0);
    std::uint64_t n = 0;
    check(recv_all(fd_.get(), &n, 8, deadline_), "get '" + key + "'");
    if (n > max_store_value) throw error("the store sent a malformed reply to get '" + key + "'", rank_);
    std::vector<std::uint8_t> value(n);
    check(recv_all(fd_.get(), value.data(), n, deadline_), "get '" + key + "'");
    return value;
  }
  /// Waits until `key` is set.
  void wait(const std::string& key) { (void)get(key); }
  /// Adds `delta` to the integer under `key` (0 when unset; wraps around) and returns the new value.
  std::int64_t add(const std::string& key, std::int64_t delta) {
    request(store_cmd::add, key, &delta, 8);
    std::int64_t now = 0;
    check(recv_all(fd_.get(), &now, 8, deadline_), "add '" + key + "'");
    return now;
  }
  /// The local address of the connection: the interface that reaches rank 0.
  [[nodiscard]] std::string local_host() const { return local_endpoint(fd_.get()).host; }

 private:
  void request(store_cmd cmd, const std::string& key, const void* value, std::size_t n) {
    store_request r{cmd, {}, static_cast<std::uint32_t>(key.size()), n};
    check(send_all(fd_.get(), &r, sizeof r, deadline_), "request");
    check(send_all(fd_.get(), key.data(), key.size(), deadline_), "request");
    if (n > 0) check(send_all(fd_.get(), value, n, deadline_), "request");
  }

  void check(io_status s, const std::string& what) const {
    if (s == io_status::ok) return;
    if (s == io_status::timed_out)
      throw timeout_error("the rendezvous store at " + where_ + " did not answer " + what +
                              " before the connect deadline: some rank has not started or is stuck; check every "
                              "rank's log, or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
                          rank_);
    throw peer_lost("the rendezvous store at " + where_ + " closed the connection during " + what +
                        ": rank 0 exited, or refused this rank's job token (every rank needs the same DDP_TOKEN)",
                    rank_, 0);
  }

  socket_fd fd_;
  int rank_;
  clock::time_point deadline_;
  std::string where_;
};

/// Counts this rank in `key` once it is done with rank 0's store; rank 0 then waits, calling `check()` between
/// looks, until all `size` ranks have counted, so its store outlives every rank's last get, and raises
/// timeout_error(`late`) past `deadline`.
template <class Check>
void count_in(store_client& store, const std::string& key, int rank, int size, clock::time_point deadline,
              const std::string& late, Check check) {
  store.add(key, 1);
  while (rank == 0 && store.add(key, 0) < size) {
    check();
    if (clock::now() > deadline) throw timeout_error(late, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/store_client.hpp>
// ---- begin <ddp/comm/tcp/store_file.hpp>
/// \file The file:// rendezvous: rank 0 serves its store on a free port and publishes, in one file on a
/// filesystem every rank shares, "ddp-store 1 <token hash> <port> <address>..." (written to a claimed
/// temporary and renamed into place, so a reader never sees half a file and concurrent or killed writers leave
/// no debris); the other ranks read it, try its addresses in order, and authenticate with the token. A file a
/// crashed earlier job left behind is told apart: another job's token hash is ignored, and a dead address is
/// refused, so readers look again until rank 0 replaces the file. Rank 0 removes it once every rank joined.


#include <sstream>

// ---- begin <ddp/io/atomic_file.hpp>
/// \file Atomic replacement of a file or directory (checkpoints, the file:// rendezvous file), and removal of what
/// killed saves left behind.
///
/// A save to `target` works under the temporary name `<target>.tmp.<pid>.<random hex>` and holds, for its whole
/// life, an exclusive flock on the lock file `<that name>.lock`, created before the temporary and removed after it
/// (the temporary renamed into place, or removed). Before it starts, a save removes the stale temporaries of the
/// same target: entries `<target>.tmp.<id>` and `<target>.tmp.<id>.lock` (id: digits, optionally `.` and hex
/// digits) whose lock file is absent or can be locked — their saver is dead, since the kernel drops a process's
/// locks when it dies. Nothing depends on the pid in the name (pids are reused, and differ between hosts); a lock
/// file rather than the temporary itself is locked because a directory cannot be locked over NFS (which emulates
/// flock with POSIX locks on files), so files and directories take one path. A cleaner takes the lock, checks the
/// name still leads to the file it locked, and only then removes; a saver checks the same after taking its lock,
/// and picks another name when a cleaner removed its claim in between.

#include <set>
#include <system_error>

#include <sys/file.h>

// ---- begin <ddp/core/detail/hash.hpp>
/// \file 64-bit FNV-1a and hex digits: the hash behind checkpoint checksums, replica checks and temporaries' names.
/// FNV-1a detects every change of a single byte (each step, xor then multiplication by an odd prime, is a bijection
/// of the state).


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
// ---- end <ddp/core/detail/hash.hpp>

namespace ddp::detail {

/// Throws ddp::io_error "<kind> '<path>': <what> (<errno text>); <fix>".
[[noreturn]] inline void fail_on(std::string_view kind, const std::filesystem::path& path, const std::string& what,
                                 const std::string& fix, int err = 0) {
  throw io_error(std::string(kind) + " '" + path.string() + "': " + what +
                     (err != 0 ? std::string(" (") + std::strerror(err) + ")" : "") + "; " + fix,
                 -1, err);
}

/// The directory holding `path` ("." for a bare name).
inline std::filesystem::path parent_of(const std::filesystem::path& path) {
  return path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
}

/// Flushes a directory's entries to disk (what makes a rename in it survive a power loss). A file system that
/// cannot sync directories (fsync fails with EINVAL) is let through; any other failure throws ddp::io_error.
inline void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_on("directory", dir, "cannot be opened to flush its entries", "check its permissions", errno);
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) fail_on("directory", dir, "flushing its entries failed", "check the disk", err);
}

/// Whether the open file `fd` is the file `path` names now (same device and inode).
inline bool names_same_file(int fd, const std::filesystem::path& path) noexcept {
  struct stat a {}, b {};
  return ::fstat(fd, &a) == 0 && ::lstat(path.c_str(), &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/// Whether `id` is what follows "<target>.tmp." in a temporary's name: digits, optionally '.' and hex digits.
inline bool is_temp_id(std::string_view id) noexcept {
  const auto dot = id.find('.');
  const auto pid = id.substr(0, dot);
  const auto all_of = [](std::string_view s, std::string_view set) { return !s.empty() && s.find_first_not_of(set) == s.npos; };
  return all_of(pid, "0123456789") && (dot == id.npos || all_of(id.substr(dot + 1), "0123456789abcdef"));
}

/// Removes the temporaries of `target` left by dead saves (see the file comment); those of live saves stay. Best
/// effort: what cannot be removed is left for a later save.
inline void remove_stale_temps(const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  const fs::path dir = parent_of(target);
  const std::string prefix = target.filename().string() + ".tmp.";
  std::set<std::string> ids;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    std::string_view name = file;
    if (!name.starts_with(prefix)) continue;
    name.remove_prefix(prefix.size());
    if (name.ends_with(".lock")) name.remove_suffix(5);
    if (is_temp_id(name)) ids.emplace(name);
  }
  for (const auto& id : ids) {
    const fs::path temp = dir / (prefix + id), lock = dir / (prefix + id + ".lock");
    const int fd = ::open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) fs::remove_all(temp, ec);  // no lock file: an earlier ddp's temporary, or an orphan
      continue;
    }
    if (::flock(fd, LOCK_SH | LOCK_NB) == 0 && names_same_file(fd, lock)) {  // its saver is dead
      fs::remove_all(temp, ec);
      ::unlink(lock.c_str());
    }
    ::close(fd);
  }
}

/// A fresh temporary name beside `target`, claimed by an exclusive flock on its lock file for this object's life;
/// the destructor removes the lock file (after the owner renamed or removed the temporary).
class temp_claim {
 public:
  /// Claims a name; throws ddp::io_error when the lock file cannot be created.
  explicit temp_claim(const std::filesystem::path& target) {
    std::random_device entropy;
    for (int attempt = 0; attempt < 16; ++attempt) {
      const std::uint64_t tag = (std::uint64_t{entropy()} << 32) | entropy();
      temp_ = target.string() + ".tmp." + std::to_string(::getpid()) + "." + hex(tag);
      lock_ = temp_.string() + ".lock";
      fd_ = ::open(lock_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd_ < 0 && errno == EEXIST) continue;
      if (fd_ < 0)
        fail_on("checkpoint file", temp_, "cannot create the lock file of the temporary",
                "check that the directory exists and is writable", errno);
      int rc = 0;
      while ((rc = ::flock(fd_, LOCK_EX)) != 0 && errno == EINTR) {
      }
      if (rc == 0 && names_same_file(fd_, lock_)) return;
      ::close(fd_);  // a cleaner took the new lock file for a stale one and removed it: try another name
      fd_ = -1;
    }
    fail_on("checkpoint file", target, "no temporary name could be claimed in 16 attempts",
            "check that no other program removes files in its directory");
  }
  temp_claim(const temp_claim&) = delete;
  temp_claim& operator=(const temp_claim&) = delete;
  ~temp_claim() {
    ::unlink(lock_.c_str());
    ::close(fd_);
  }
  /// The claimed temporary name (not created by the claim).
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return temp_; }

 private:
  std::filesystem::path temp_, lock_;
  int fd_ = -1;
};

/// A file written through a claimed temporary beside `path` (stale temporaries of `path` are removed first):
/// commit() flushes it to disk, renames it over `path` and flushes the directory; destroyed uncommitted, it
/// removes the temporary.
class atomic_file {
 public:
  /// Creates the temporary; throws ddp::io_error when it cannot.
  explicit atomic_file(std::filesystem::path path)
      : path_((remove_stale_temps(path), std::move(path))), claim_(path_) {
    fd_ = ::open(claim_.path().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0)
      fail_on("checkpoint file", claim_.path(), "cannot create the temporary file",
              "check that the directory exists and is writable", errno);
  }
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(claim_.path().c_str());
  }
  /// Appends `data`, retrying short writes.
  void write(std::span<const std::byte> data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail_on("checkpoint file", claim_.path(), "writing failed", "check free disk space and permissions", errno);
      data = data.subspan(static_cast<std::size_t>(n));
    }
  }
  /// Overwrites bytes at `offset` (already written).
  void write_at(std::uint64_t offset, std::span<const std::byte> data) {
    if (::pwrite(fd_, data.data(), data.size(), static_cast<off_t>(offset)) != static_cast<ssize_t>(data.size()))
      fail_on("checkpoint file", claim_.path(), "writing failed", "check free disk space and permissions", errno);
  }
  /// Flushes the file, renames it over the path, flushes the directory.
  void commit() {
    if (::fsync(fd_) != 0) fail_on("checkpoint file", claim_.path(), "fsync failed", "check the disk", errno);
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) fail_on("checkpoint file", claim_.path(), "closing failed", "check the disk", errno);
    if (::rename(claim_.path().c_str(), path_.c_str()) != 0)
      fail_on("checkpoint file", path_, "renaming the temporary file over it failed",
              "check permissions of the directory", errno);
    committed_ = true;
    sync_directory(parent_of(path_));
  }

 private:
  std::filesystem::path path_;
  temp_claim claim_;  // released after the destructor's body removed an uncommitted temporary
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace ddp::detail
// ---- end <ddp/io/atomic_file.hpp>

namespace ddp::tcp::detail {

/// The first word of a store file.
inline constexpr std::string_view store_file_magic = "ddp-store";

/// The IPv4 addresses of this host other ranks may reach rank 0's store at: DDP_INTERFACE's alone when set,
/// else every interface's, loopback last.
inline std::vector<std::string> store_addresses(const config& cfg) {
  if (!cfg.interface.empty()) return {interface_address(cfg.interface, cfg.rank)};
  std::vector<std::string> found, loopback;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next)
      if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET) {
        const auto host = to_endpoint(*reinterpret_cast<sockaddr_in*>(i->ifa_addr)).host;
        (host.rfind("127.", 0) == 0 ? loopback : found).push_back(host);
      }
    ::freeifaddrs(list);
  }
  found.insert(found.end(), loopback.begin(), loopback.end());
  return found;
}

/// Rank 0: writes where its store listens (`port` on `addresses`) to cfg.store_file, replacing any old file.
inline void publish_store(const config& cfg, std::uint64_t token, std::uint16_t port,
                          const std::vector<std::string>& addresses) {
  std::ostringstream text;
  text << store_file_magic << " 1 " << std::hex << token << std::dec << ' ' << port;
  for (const auto& a : addresses) text << ' ' << a;
  text << '\n';
  const std::string bytes = text.str();
  try {
    ddp::detail::atomic_file file(cfg.store_file);
    file.write(std::as_bytes(std::span(bytes.data(), bytes.size())));
    file.commit();
  } catch (const io_error& e) {
    throw config_error("rank 0 cannot write the rendezvous file of file://" + cfg.store_file + ": " + e.message() +
                           "; pass a path in a writable directory every rank shares",
                       cfg.rank);
  }
}

/// What a store file says; nothing when it is missing, malformed, or another job's (another token).
struct store_file_entry {
  std::uint16_t port = 0;
  std::vector<std::string> addresses;
};

/// Reads cfg.store_file; `why` says what was wrong with it when the answer is nothing.
inline std::optional<store_file_entry> read_store_file(const config& cfg, std::uint64_t token, std::string& why) {
  std::ifstream in(cfg.store_file);
  if (!in) {
    why = "the file does not exist yet (rank 0 writes it when it starts)";
    return std::nullopt;
  }
  std::string magic;
  int version = 0;
  std::uint64_t theirs = 0;
  unsigned port = 0;
  if (!(in >> magic >> version >> std::hex >> theirs >> std::dec >> port) || magic != store_file_magic ||
      version != 1 || port == 0 || port > 65535) {
    why = "it is not a ddp store file";
    return std::nullopt;
  }
  if (theirs != token) {
    why = "it belongs to another job (another DDP_TOKEN), or to an earlier job that did not end cleanly";
    return std::nullopt;
  }
  store_file_entry e;
  e.port = static_cast<std::uint16_t>(port);
  for (std::string a; in >> a;) e.addresses.push_back(a);
  if (e.addresses.empty()) {
    why = "it lists no address";
    return std::nullopt;
  }
  return e;
}

/// Connects to the store cfg.store_file names, looking again until `deadline` while the file is missing,
/// another job's, or its addresses refuse (an earlier job's file, not yet replaced by this job's rank 0).
inline store_client find_store(const config& cfg, std::uint64_t token, clock::time_point deadline) {
  constexpr auto attempt = std::chrono::seconds(1);
  constexpr auto pause = std::chrono::milliseconds(50);
  std::string why;
  while (true) {
    if (const auto entry = read_store_file(cfg, token, why)) {
      for (const auto& host : entry->addresses) {
        try {
          return store_client(host, entry->port, token, cfg.rank, deadline, std::min(deadline, clock::now() + attempt));
        } catch (const error& e) {
          why = "no listed address answered; the last, " + host + ":" + std::to_string(entry->port) +
                ", said: " + e.message();
        }
      }
    }
    if (clock::now() + pause >= deadline)
      throw timeout_error("found no rendezvous store through file://" + cfg.store_file +
                              " before the connect deadline: " + why +
                              "; start rank 0 with the same path on a filesystem every rank shares and the same "
                              "DDP_TOKEN, or raise the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
                          cfg.rank);
    std::this_thread::sleep_for(pause);
  }
}

/// Rank 0, once every rank joined: removes the store file, so that a later job never reads this one's.
inline void retire_store_file(const config& cfg) {
  std::error_code ec;
  std::filesystem::remove(cfg.store_file, ec);
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/store_file.hpp>

namespace ddp::tcp::detail {

/// The handshake limits of `cfg`.
inline handshake_limits limits_of(const config& cfg) { return {cfg.handshake_timeout, cfg.max_pending_handshakes}; }

/// The error of two processes started with the same rank.
inline config_error joined_twice(const std::string& rank, int me) {
  return config_error("rank " + rank + " joined twice: two processes of this job were started with RANK=" + rank +
                          "; check RANK and WORLD_SIZE: every process needs its own RANK in 0..WORLD_SIZE-1",
                      me);
}

/// Claims rank `me` in the store; a second process with the same rank fails and tells the others.
inline void claim_rank(store_client& store, int me) {
  if (store.add("ddp/rank/" + std::to_string(me), 1) == 1) return;
  const std::string text = std::to_string(me);
  store.set("ddp/twin", std::vector<std::uint8_t>(text.begin(), text.end()));
  store.add("ddp/twins", 1);
  throw joined_twice(text, me);
}

/// Throws when some process claimed a rank already taken (claim_rank); the waits of the rendezvous call it.
inline void check_no_twin(store_client& store, int me) {
  if (store.add("ddp/twins", 0) == 0) return;
  const auto rank = store.get("ddp/twin");
  throw joined_twice(std::string(rank.begin(), rank.end()), me);
}

/// Accepts every higher rank on `acceptor`, all handshakes at once; strangers are refused and the job goes on.
inline void accept_peers(const config& cfg, store_client& store, std::uint64_t token, handshake_acceptor& acceptor,
                         const std::string& where, std::vector<socket_fd>& peers, clock::time_point deadline) {
  const int me = cfg.rank;
  constexpr auto twin_check_every = std::chrono::milliseconds(100);
  auto next_twin_check = clock::now();
  std::vector<pollfd> fds;
  for (int expected = cfg.size - 1 - me; expected > 0;) {
    if (clock::now() >= deadline)
      throw timeout_error("ranks above " + std::to_string(me) + " did not all connect to this rank's mesh port " +
                              where + " before the connect deadline; start every rank, or raise the connect "
                              "timeout (DDP_CONNECT_TIMEOUT_MS)",
                          me);
    if (clock::now() >= next_twin_check) {
      check_no_twin(store, me);
      next_twin_check = clock::now() + twin_check_every;
    }
    fds.clear();
    acceptor.fill(fds);
    ::poll(fds.data(), fds.size(), poll_ms(std::min(deadline, next_twin_check)));
    for (auto& a : acceptor.on_events(fds, 0)) {
      mesh_hello got{};
      std::memcpy(&got, a.hello.data(), sizeof got);
      std::string why;
      if (got.magic != mesh_magic || got.version != mesh_version) why = "its first bytes are not a ddp mesh handshake";
      else if (got.token != token) why = "wrong job token";
      else if (got.size != static_cast<std::uint32_t>(cfg.size)) why = "it belongs to a job of " + std::to_string(got.size) + " ranks";
      else if (got.rank <= static_cast<std::uint32_t>(me) || got.rank >= got.size)
        why = "it claims rank " + std::to_string(got.rank) + ", which is not an expected peer";
      else if (peers[got.rank].valid()) throw joined_twice(std::to_string(got.rank), me);
      if (!why.empty()) {
        acceptor.refuse(a.fd, a.from, why);
        continue;
      }
      const std::uint8_t ok = 1;
      if (send_all(a.fd.get(), &ok, 1, deadline) != io_status::ok) continue;
      peers[got.rank] = std::move(a.fd);
      --expected;
    }
  }
}

/// Builds the full mesh: connects to every lower rank, accepts every higher one; strangers are refused.
inline std::vector<socket_fd> build_mesh(const config& cfg, store_client& store, std::uint64_t token,
                                         const std::string& host, clock::time_point deadline) {
  const int me = cfg.rank;
  handshake_acceptor acceptor(listen_on(host, 0, me, "the mesh"), sizeof(mesh_hello), limits_of(cfg), me,
                              "the mesh port");
  const endpoint mine{host, acceptor.port()};
  const std::string text = mine.str();
  store.set("ddp/mesh/" + std::to_string(me), std::vector<std::uint8_t>(text.begin(), text.end()));

  std::vector<socket_fd> peers(static_cast<std::size_t>(cfg.size));
  const mesh_hello hello{mesh_magic, static_cast<std::uint32_t>(me), static_cast<std::uint32_t>(cfg.size), mesh_version,
                         token};
  for (int j = 0; j < me; ++j) {
    const auto bytes = store.get("ddp/mesh/" + std::to_string(j));
    const std::string where(bytes.begin(), bytes.end());
    const auto colon = where.rfind(':');
    const std::string peer_host = where.substr(0, colon);
    const auto peer_port = static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1)));
    socket_fd fd = connect_with_retry(peer_host, peer_port, deadline, me, "rank " + std::to_string(j),
                                      "check that the hosts can reach each other (firewall, DDP_INTERFACE)");
    std::uint8_t ok = 0;
    if (send_all(fd.get(), &hello, sizeof hello, deadline) != io_status::ok ||
        recv_all(fd.get(), &ok, 1, deadline) != io_status::ok || ok != 1) {
      check_no_twin(store, me);  // a twin of this rank is why rank j refused, if there is one
      throw peer_lost("rank " + std::to_string(j) + " at " + where +
                          " refused the mesh handshake: give every rank the same DDP_TOKEN and WORLD_SIZE",
                      me, j);
    }
    peers[static_cast<std::size_t>(j)] = std::move(fd);
  }
  accept_peers(cfg, store, token, acceptor, text, peers, deadline);
  for (auto& p : peers)
    if (p.valid()) tune_data_socket(p.get(), cfg.socket_buffer_bytes);
  return peers;
}
/// Finds the peers whose memory this rank can read and those that can read its own: every rank publishes
/// its host identity (boot id, PID namespace), its pid and the address and value of its engine's live word
/// (random until the engine aborts); a peer with the same identity that reads the word back with
/// process_vm_readv runs on this host as this user, and reads it again after every copy. A peer on another
/// machine or in another PID namespace (a container, a simulated host) is never probed: its pid would name
/// an unrelated process here. Ranks with same_host_copy off publish no address and read nobody. `hosts` gets
/// every rank's host identity.
inline std::vector<peer_memory> probe_memory(const config& cfg, store_client& store,
                                             const std::atomic<std::uint64_t>& live, std::vector<host_identity>& hosts) {
  struct probe {
    std::uint64_t pid = 0;
    std::uint64_t address = 0;
    std::uint64_t word = 0;
    host_identity host;
  };
  const auto n = static_cast<std::size_t>(cfg.size);
  const auto me = static_cast<std::size_t>(cfg.rank);
  const auto key = [](const char* what, std::size_t r) { return std::string("ddp/") + what + "/" + std::to_string(r); };
  const probe mine{static_cast<std::uint64_t>(::getpid()),
                   cfg.same_host_copy ? reinterpret_cast<std::uintptr_t>(&live) : 0, live.load(), this_host()};
  const auto* raw = reinterpret_cast<const std::uint8_t*>(&mine);
  store.set(key("memory", me), std::vector<std::uint8_t>(raw, raw + sizeof mine));
  std::vector<peer_memory> peers(n);
  std::vector<std::uint8_t> readable(n, 0);
  hosts.assign(n, mine.host);
  for (std::size_t j = 0; j < n; ++j) {
    if (j == me) continue;
    const auto bytes = store.get(key("memory", j));
    probe theirs;
    if (bytes.size() != sizeof theirs)
      throw error("rank " + std::to_string(j) + " published a malformed memory probe; every rank must run the same "
                  "ddp version",
                  cfg.rank);
    std::memcpy(&theirs, bytes.data(), sizeof theirs);
    hosts[j] = theirs.host;
    if (!cfg.same_host_copy || theirs.address == 0 || !mine.host.shares_pids_with(theirs.host)) continue;
    std::uint64_t seen = 0;
    iovec local{&seen, sizeof seen};
    iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(theirs.address)), sizeof seen};
    const auto pid = static_cast<::pid_t>(theirs.pid);
    if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(sizeof seen) || seen != theirs.word)
      continue;  // another host, another user, or a kernel that forbids it: the sockets carry everything
    peers[j] = {pid, true, false, theirs.address, theirs.word};
    readable[j] = 1;
  }
  store.set(key("memory_ok", me), readable);
  for (std::size_t j = 0; j < n; ++j)
    if (j != me) peers[j].reads_us = store.get(key("memory_ok", j)).at(me) == 1;
  return peers;
}

/// Per rank, its host: the lowest rank whose host identity is its own. Ranks whose identity cannot be read count
/// as one host: mapping its segment (map_shared_memory) then tells whether they share one, as on one host.
inline std::vector<int> hosts_of(const std::vector<host_identity>& hosts) {
  const auto same = [](const host_identity& a, const host_identity& b) {
    return a.boot == b.boot && a.pid_ns == b.pid_ns && a.pid_ns_dev == b.pid_ns_dev;
  };
  std::vector<int> host_of(hosts.size());
  for (std::size_t r = 0; r < hosts.size(); ++r) {
    std::size_t j = 0;
    while (j < r && !same(hosts[j], hosts[r])) ++j;
    host_of[r] = static_cast<int>(j);
  }
  return host_of;
}

/// True when every rank of `ranks` can copy straight out of every other one's memory (the rows probe_memory
/// published). One answer for every rank, so all of them choose the same algorithm for a collective; a probe that
/// succeeded one way only (ptrace rules, one rank with CAP_SYS_PTRACE) counts as none.
inline bool every_rank_reads_every_rank(store_client& store, const std::vector<int>& ranks) {
  for (const int j : ranks) {
    const auto row = store.get("ddp/memory_ok/" + std::to_string(j));
    for (const int k : ranks)
      if (k != j && (static_cast<std::size_t>(k) >= row.size() || row[static_cast<std::size_t>(k)] != 1)) return false;
  }
  return true;
}

/// Maps this host's shared-memory segment where every rank can: on each host with two ranks or more the lowest
/// (rank 0 where every rank is on one host) removes what killed jobs left, creates the segment and publishes its
/// name; the host's other ranks map it; every rank says whether it could (same host and user, DDP_SHM not 0) and
/// the creator unlinks the name once all have answered. Null where any rank cannot: the sockets carry everything.
inline std::shared_ptr<shm_hosts> map_shared_memory(const config& cfg, store_client& store, std::vector<int> host_of) {
  const int lead = host_of[static_cast<std::size_t>(cfg.rank)];
  const bool one_host = std::all_of(host_of.begin(), host_of.end(), [](int h) { return h == 0; });
  const int local = static_cast<int>(std::count(host_of.begin(), host_of.end(), lead));
  const std::string where = one_host ? "ddp/shm" : "ddp/shm/" + std::to_string(lead);
  std::shared_ptr<shm_world> world;
  std::string name;
  if (local > 1 && cfg.rank == lead) {
    if (cfg.shared_memory) {
      reap_stale_segments();
      std::random_device random;
      char nonce[24];
      std::snprintf(nonce, sizeof nonce, "%08x%08x", random(), random());
      name = shm_user_prefix() + std::to_string(::getpid()) + "-" + nonce;
      try {
        world = std::make_shared<shm_world>(name, cfg.size, cfg.rank, true, local);
      } catch (const error& e) {
        log_line(cfg.rank, std::string(e.what()) + "; the sockets carry everything");
      }
    }
    const std::string published = world ? name : std::string();
    store.set(where, std::vector<std::uint8_t>(published.begin(), published.end()));
  } else if (local > 1) {
    const auto bytes = store.get(where);
    name.assign(bytes.begin(), bytes.end());
    if (cfg.shared_memory && !name.empty()) {
      try {
        world = std::make_shared<shm_world>(name, cfg.size, cfg.rank, false, local);
        if (!world->genuine()) world.reset();
      } catch (const error&) {  // another host, or another user: the sockets carry everything
        world.reset();
      }
    }
  }
  const auto key = [](int r) { return "ddp/shm_ok/" + std::to_string(r); };
  store.set(key(cfg.rank), {static_cast<std::uint8_t>((local > 1 ? world != nullptr : cfg.shared_memory) ? 1 : 0)});
  bool all = true;
  for (int r = 0; r < cfg.size; ++r) all = store.get(key(r)).at(0) == 1 && all;
  if (cfg.rank == lead && !name.empty()) ::shm_unlink(name.c_str());
  if (!all) return nullptr;
  auto hosts = std::make_shared<shm_hosts>();
  hosts->segment = std::move(world);
  hosts->host_of = std::move(host_of);
  return hosts;
}

/// Joins the job `cfg` describes through rank 0's store (at master_addr:master_port, or named in cfg.store_file)
/// and hands the mesh to `eng`; all by `deadline`. Returns the job's shared memory (every host's segment, where
/// every rank can map its host's), else null.
inline std::shared_ptr<shm_hosts> join(const config& cfg, engine& eng, std::uint64_t token,
                                       clock::time_point deadline) {
  const bool by_file = !cfg.store_file.empty();
  store_client store = by_file ? find_store(cfg, token, deadline)
                               : store_client(cfg.master_addr, cfg.master_port, token, cfg.rank, deadline);
  claim_rank(store, cfg.rank);
  const std::string host = cfg.interface.empty() ? store.local_host() : interface_address(cfg.interface, cfg.rank);
  if (cfg.rank == 0) {
    const std::string name = interface_of(host);
    log_line(0, std::to_string(cfg.size) + " ranks; store " +
                    (by_file ? "found through file://" + cfg.store_file
                             : "at " + cfg.master_addr + ":" + std::to_string(cfg.master_port)) +
                    "; rank 0's mesh on " + host +
                    (name.empty() ? "" : " (" + name + ")") +
                    (cfg.interface.empty() ? ", the interface that reaches MASTER_ADDR (set DDP_INTERFACE to choose)"
                                           : ""));
  }
  auto sockets = build_mesh(cfg, store, token, host, deadline);
  std::vector<host_identity> identities;
  auto memory = probe_memory(cfg, store, eng.live().word(), identities);
  if (cfg.rank == 0) {
    const auto readable = std::count_if(memory.begin(), memory.end(), [](const auto& m) { return m.readable; });
    log_line(0, "rank 0 copies large frames straight from the memory of " + std::to_string(readable) + " of its " +
                    std::to_string(cfg.size - 1) +
                    " peers (same host and user; DDP_SAME_HOST_COPY=0 turns this off); the sockets carry the rest");
  }
  auto hosts = map_shared_memory(cfg, store, hosts_of(identities));
  shared_stores().fix(cfg.stores);
  const bool one_host = hosts && hosts->segment && hosts->segment->local_size() == cfg.size;
  if (hosts && hosts->segment) {
    std::vector<int> local;
    for (int r = 0; r < cfg.size; ++r)
      if (hosts->host_of[static_cast<std::size_t>(r)] == hosts->host_of[static_cast<std::size_t>(cfg.rank)]) local.push_back(r);
    hosts->segment->memory = memory;
    hosts->segment->single_copy = every_rank_reads_every_rank(store, local);
    hosts->segment->algo = cfg.algo;
  }
  if (cfg.rank == 0)
    log_line(0, one_host ? "collectives and sends run through shared memory: every rank is on this host (DDP_SHM=0 "
                           "turns this off)"
                : hosts  ? "collectives run through shared memory inside each host and the sockets across them "
                           "(hierarchical; DDP_SHM=0 turns this off); sends run through the sockets"
                         : "collectives and sends run through the sockets: not every rank can map shared memory with "
                           "the ranks of its host (another user, or DDP_SHM=0)");
  auto rings = one_host ? std::make_unique<shm_rings>(hosts->segment->name(), cfg.size, cfg.rank) : nullptr;
  eng.attach(std::move(sockets), std::move(memory), hosts ? hosts->segment : nullptr, std::move(rings));
  // Rank 0's store (served by its engine) must outlive every rank's last get: rank 0 waits for all.
  count_in(store, "ddp/joined", cfg.rank, cfg.size, deadline,
           "not every rank finished the rendezvous before the connect deadline; check every rank's log, or raise "
           "the connect timeout (DDP_CONNECT_TIMEOUT_MS)",
           [&] { check_no_twin(store, 0); });
  if (cfg.rank == 0 && by_file) retire_store_file(cfg);
  return hosts;
}

}  // namespace ddp::tcp::detail
// ---- end <ddp/comm/tcp/rendezvous.hpp>

namespace ddp::tcp {

namespace detail {

/// The group's name in flight record files: its identifier in hex, the same on every member.
inline std::string group_label(std::uint32_t id) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", id);
  return buf;
}

}  // namespace detail

/// A group of ranks connected over TCP; copies share the group, split() makes subgroups over the same mesh.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  /// Joins the job `cfg` describes: rendezvous at master_addr:master_port (or through cfg.store_file), then
  /// the full mesh.
  explicit communicator(const config& cfg) {
    if (cfg.size < 1 || cfg.rank < 0 || cfg.rank >= cfg.size)
      throw config_error("rank " + std::to_string(cfg.rank) + " of " + std::to_string(cfg.size) +
                             " is not a place in a job; ranks run from 0 to size-1",
                         cfg.rank);
    require_store_address(cfg);
    const std::uint64_t token = detail::token_hash(cfg.token);
    const auto deadline = detail::clock::now() + cfg.connect_timeout;
    std::optional<detail::store_server> server;
    if (cfg.rank == 0 && cfg.size > 1 && cfg.store_file.empty())
      server.emplace(detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), token, 0,
                     detail::limits_of(cfg));
    if (cfg.rank == 0 && cfg.size > 1 && !cfg.store_file.empty()) {
      const auto addresses = detail::store_addresses(cfg);
      auto listener = detail::listen_on(cfg.interface.empty() ? "0.0.0.0" : addresses.front(), 0, 0,
                                        "the rendezvous store");
      const auto port = detail::local_endpoint(listener.get()).port;
      server.emplace(std::move(listener), token, 0, detail::limits_of(cfg));
      detail::publish_store(cfg, token, port, addresses);
    }
    engine_ = std::make_shared<detail::engine>(cfg.rank, cfg.size, &detail::run_group_collective, std::move(server));
    group_ = std::make_shared<detail::group>();
    group_->me = cfg.rank;
    group_->id = detail::mix_id(0, 0, static_cast<std::uint64_t>(cfg.size));
    group_->timeout = cfg.timeout;
    group_->flight = ddp::detail::make_flight_recorder(detail::group_label(group_->id));
    group_->members.resize(static_cast<std::size_t>(cfg.size));
    for (int r = 0; r < cfg.size; ++r) group_->members[static_cast<std::size_t>(r)] = r;
    if (cfg.size == 1) return;
    detail::use_shared_memory(*group_, detail::join(cfg, *engine_, token, deadline));
  }

  /// Joins the job the environment describes (tcp::config_from_env() lists the variables).
  static communicator from_env() { return communicator(tcp::config_from_env()); }

  /// Joins the job of init method `url` as torch.distributed.init_process_group(init_method=url, rank=rank,
  /// world_size=size) does: "env://", "tcp://host:port" or "file:///shared/path" (tcp::config_from_url()).
  static communicator init(std::string_view url, int rank = -1, int size = -1) {
    return communicator(tcp::config_from_url(url, rank, size));
  }

  /// The config from_env() uses (tcp::config_from_env()).
  static config config_from_env() { return tcp::config_from_env(); }

  /// This process's rank in the group.
  [[nodiscard]] int rank() const { return group_->me; }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const { return group_->size(); }
  /// The deadline every operation of this group gets.
  [[nodiscard]] std::chrono::milliseconds timeout() const { return group_->timeout; }
  /// Payload bytes sent and calls made by this group, by operation.
  [[nodiscard]] comm_stats stats() const { return group_->stats.snapshot(); }

  /// Collective: ranks with the same `color` form a new group, ordered by (key, rank); uses the existing mesh.
  communicator split(int color, int key) {
    const std::array<std::int64_t, 2> mine{color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all)).wait();
    std::vector<int> ranks;
    for (int p = 0; p < size(); ++p)
      if (all[2 * static_cast<std::size_t>(p)] == color) ranks.push_back(p);
    std::stable_sort(ranks.begin(), ranks.end(),
                     [&](int a, int b) { return all[2 * static_cast<std::size_t>(a) + 1] < all[2 * static_cast<std::size_t>(b) + 1]; });
    auto child = std::make_shared<detail::group>();
    std::uint64_t nth = 0;
    {
      std::lock_guard lock(engine_->queue().mutex());
      nth = group_->splits++;
    }
    child->id = detail::mix_id(group_->id, nth, static_cast<std::uint64_t>(static_cast<std::uint32_t>(color)));
    child->timeout = group_->timeout;
    child->flight = ddp::detail::make_flight_recorder(detail::group_label(child->id));
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      child->members.push_back(group_->members[static_cast<std::size_t>(ranks[i])]);
      if (ranks[i] == rank()) child->me = static_cast<int>(i);
    }
    detail::use_shared_memory(*child, group_->hosts);
    return communicator(engine_, std::move(child));
  }

 private:
  communicator(std::shared_ptr<detail::engine> e, std::shared_ptr<detail::group> g)
      : engine_(std::move(e)), group_(std::move(g)) {}

  [[nodiscard]] int world_rank() const { return engine_->rank(); }

  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end checks the arguments; the engine numbers, counts and averages the operations and checks every
  /// frame's header (operation, dtype, count, root, sequence) against the call, so no call check is exchanged.
  static constexpr ddp::detail::front_duties duties{
      .group = "a TCP group", .sequence = false, .stats = false, .average = false, .call_check = false};
  [[nodiscard]] static constexpr int max_tag() noexcept { return INT_MAX; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->flight; }

  /// ddp::tcp moves host memory only.
  void host(const raw_tensor& t, const call& c) const {
    if (t.where.is_cuda())
      fail(c, "the buffer is on " + t.where.to_string() +
                  ": ddp::tcp moves host memory; copy it to the host first, or use ddp::nccl for device buffers");
  }

  work start_all_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    host(b, c);
    return submit(collective::all_reduce, b.type, op, -1, b.size, nullptr, b.data);
  }
  work start_reduce_scatter(const call& c, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    host(in, c);
    host(out, c);
    return submit(collective::reduce_scatter, out.type, op, -1, out.size, in.data, out.data);
  }
  work start_all_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    host(out, c);
    return submit(collective::all_gather, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work start_broadcast(const call& c, const raw_tensor& b) {
    host(b, c);
    return submit(collective::broadcast, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data);
  }
  work start_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    host(b, c);
    return submit(collective::reduce, b.type, op, c.peer, b.size, nullptr, b.data);
  }
  work start_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    if (rank() == c.peer) host(out, c);
    return submit(collective::gather, in.type, reduce_op::sum, c.peer, in.size, in.data, out.data);
  }
  work start_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(out, c);
    if (rank() == c.peer) host(in, c);
    return submit(collective::scatter, out.type, reduce_op::sum, c.peer, out.size, in.data, out.data);
  }
  work start_all_to_all(const call& c, const raw_tensor& in, const raw_tensor& out) {
    host(in, c);
    host(out, c);
    return submit(collective::all_to_all, in.type, reduce_op::sum, -1, in.size, in.data, out.data);
  }
  work start_barrier(const call&) { return submit(collective::barrier, dtype::u8, reduce_op::sum, -1, 0, nullptr, nullptr); }
  /// Completes once written to the socket.
  work start_send(const call& c, const raw_tensor& b) {
    host(b, c);
    return submit(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, b.data, nullptr, c.tag,
                 detail::p2p::send);
  }
  /// The send must have the same count and dtype.
  work start_recv(const call& c, const raw_tensor& b) {
    host(b, c);
    return submit(collective::send_recv, b.type, reduce_op::sum, c.peer, b.size, nullptr, b.data, c.tag,
                 detail::p2p::recv);
  }

  /// Submits the call to the engine (docs/tcp.md, "A call's life"): numbered and counted under the queue mutex,
  /// then run on this thread where call_queue::claim_locked allows it, else queued for the engine thread.
  work submit(collective kind, dtype type, reduce_op op, int root, std::size_t count, const void* in, void* out,
              int tag = 0, detail::p2p side = detail::p2p::none) {
    detail::call c;
    c.kind = kind;
    c.side = side;
    c.type = type;
    c.op = op;
    c.root = root;
    c.tag = tag;
    c.count = count;
    c.in = in;
    c.out = out;
    c.grp = group_;
    work w;
    {
      std::lock_guard lock(engine_->queue().mutex());
      if (kind != collective::send_recv) c.seq = group_->next_seq++;  // sends and recvs match by tag instead
      group_->stats.add_call(kind);
      std::string what = detail::describe(detail::header_of(c, 0));
      const bool sends = side == detail::p2p::send;
      if (side != detail::p2p::none)
        what = (sends ? "send of " : "recv of ") + std::to_string(count) + " " + std::string(to_string(type)) +
               " with tag " + std::to_string(tag) + (sends ? " to rank " : " from rank ") + std::to_string(root);
      c.done = std::make_shared<ddp::detail::completion>(world_rank(), group_->timeout, std::move(what), engine_->note());
      w = work(c.done);
      if (!engine_->queue().claim_locked(c)) {
        engine_->queue().push_locked(std::move(c));
        engine_->wake();
        return w;
      }
    }
    engine_->run_on_caller(std::move(c));  // shared memory with the engine idle: no hop between threads
    return w;
  }

  std::shared_ptr<detail::engine> engine_;
  std::shared_ptr<detail::group> group_;
};

static_assert(ddp::communicator<communicator>,
              "ddp::tcp::communicator must model ddp::communicator; add the missing member it names.");

}  // namespace ddp::tcp

namespace ddp {
/// backend::tcp selects ddp::tcp::communicator.
template <>
struct backend_traits<backend::tcp> {
  using communicator = tcp::communicator;
};
/// ddp::tcp::communicator deduces backend::tcp.
template <>
struct backend_of<tcp::communicator> {
  using type = backend::tcp;
};
}  // namespace ddp
// ---- end <ddp/comm/tcp/communicator.hpp>
// ---- begin <ddp/memory/devices.hpp>
/// \file The memory domain of each device of this process: the host's for the CPU; for a device, the domain its
/// owner registered (ddp::device_registration: the CUDA runtime's, a test's fake device). Whatever meets a
/// tensor on a device (data_parallel laying a leaf into an arena, a host backend staging a buffer) finds the
/// domain that can touch it here.


// ---- begin <ddp/memory/domain.hpp>
/// \file ddp::memory_domain: where a wrapper's memory lives and how element work runs on it. What data_parallel
/// allocates or touches element by element (arenas, the unit pool, the reduce staging, the owned blocks, master
/// weights, the optimizers' flat state, leaf copies, the comm hooks' conversions, join's rescale) goes through the
/// domain of the memory's device: the host domain (memory/host.hpp) for the CPU, a device domain for an
/// accelerator. A domain also orders its work: the host runs each operation before returning; a device domain
/// enqueues it on its stream, and orders it after a collective by enqueueing the wait (order_after) rather than
/// blocking the host.
///
/// An abstract class, not a concept: the arenas of one wrapper may live in several domains (a model split over
/// devices, or over the CPU and a device), known only at run time from the leaves' devices, and every operation is
/// a bulk one over a buffer, so one virtual call per operation costs nothing measurable.



namespace ddp {

class memory_domain;

/// Memory a domain allocated, zeroed when made and freed with the last handle.
class domain_buffer {
 public:
  domain_buffer() = default;
  /// `size` bytes at `data` of `domain`, freed by `owner`'s deleter.
  domain_buffer(std::shared_ptr<std::byte> owner, std::size_t size, memory_domain* domain) noexcept
      : data_(std::move(owner)), size_(size), domain_(domain) {}
  /// The first byte.
  [[nodiscard]] std::byte* data() const noexcept { return data_.get(); }
  /// Bytes.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The domain it lives in (null for an empty buffer).
  [[nodiscard]] memory_domain* domain() const noexcept { return domain_; }
  /// Elements [begin, begin + count) of `type`, viewed on the domain's device.
  [[nodiscard]] raw_tensor view(dtype type, std::size_t begin, std::size_t count) const noexcept;
  /// Zeroes bytes [begin, end), their whole pages handed back where the domain can (memory_domain::release).
  void release(std::size_t begin, std::size_t end) const;

 private:
  std::shared_ptr<std::byte> data_;
  std::size_t size_ = 0;
  memory_domain* domain_ = nullptr;
};

/// Where memory lives and how element work runs there (see the file comment).
class memory_domain {
 public:
  memory_domain() = default;
  memory_domain(const memory_domain&) = delete;
  memory_domain& operator=(const memory_domain&) = delete;
  virtual ~memory_domain() = default;

  /// The device its memory is on.
  [[nodiscard]] virtual device where() const noexcept = 0;
  /// `bytes` of zeroed memory of this domain.
  [[nodiscard]] virtual domain_buffer allocate(std::size_t bytes) = 0;
  /// Zeroes bytes [begin, end) of `b`; where the domain can, the whole pages inside take no memory until touched
  /// again (the host's madvise). A domain that cannot only zeroes: size buffers to what must be resident.
  virtual void release(const domain_buffer& b, std::size_t begin, std::size_t end) = 0;
  /// Every element of `t` becomes zero.
  virtual void zero(const raw_tensor& t) = 0;
  /// to = from, element for element (same dtype and size); one side may be host memory (staging, owning leaves).
  virtual void copy(const raw_tensor& from, const raw_tensor& to) = 0;
  /// into += from, element for element (same dtype and size).
  virtual void accumulate(const raw_tensor& from, const raw_tensor& into) = 0;
  /// to = from × factor converted to `to`'s dtype: the product in from's dtype (factor rounded to it), then the
  /// conversion (16-bit floats through float, rounding to nearest even); factor 1 converts alone.
  virtual void convert(const raw_tensor& from, const raw_tensor& to, double factor) = 0;
  /// to = from converted to `to`'s dtype.
  void convert(const raw_tensor& from, const raw_tensor& to) { convert(from, to, 1.0); }
  /// Every element of `t` times `factor` (rounded once, as ddp::detail::scale does on the host).
  virtual void scale(const raw_tensor& t, double factor) = 0;
  /// Every element of `t` becomes `value`.
  virtual void fill(const raw_tensor& t, double value) = 0;
  /// Work given to this domain later runs after `w` completes: the host waits for it now, a device enqueues the
  /// wait on its stream.
  virtual void order_after(work& w) = 0;
  /// Returns once every operation given to this domain has run (the optimizer's end of a step).
  virtual void synchronize() = 0;
};

inline raw_tensor domain_buffer::view(dtype type, std::size_t begin, std::size_t count) const noexcept {
  return {data_.get() + begin * size_of(type), count, type, domain_ ? domain_->where() : device::cpu()};
}
inline void domain_buffer::release(std::size_t begin, std::size_t end) const {
  if (domain_ && begin < end) domain_->release(*this, begin, end);
}

}  // namespace ddp
// ---- end <ddp/memory/domain.hpp>
// ---- begin <ddp/memory/host.hpp>
/// \file ddp::host_domain: the memory domain of the CPU. Page-aligned zeroed memory whose whole pages can go back
/// to the OS while the range stays mapped (madvise), and element work as loops on the calling thread, which
/// has run when the call returns (so order_after waits for the collective, and synchronize has nothing to do).

#include <new>



namespace ddp {

/// The CPU's memory domain (see the file comment).
class host_domain final : public memory_domain {
 public:
  static constexpr std::size_t page_bytes = 4096;  ///< allocations are aligned to, and released in, whole pages

  [[nodiscard]] device where() const noexcept override { return device::cpu(); }
  [[nodiscard]] domain_buffer allocate(std::size_t bytes) override {
    if (bytes == 0) return {};
    std::shared_ptr<std::byte> p(static_cast<std::byte*>(::operator new(round_up(bytes), std::align_val_t{page_bytes})),
                                 [](std::byte* q) { ::operator delete(q, std::align_val_t{page_bytes}); });
    std::fill_n(p.get(), bytes, std::byte{0});
    return {std::move(p), bytes, this};
  }
  void release(const domain_buffer& b, std::size_t begin, std::size_t end) override {
    std::byte* data = b.data();
    const std::size_t first_page = round_up(begin), last_page = end / page_bytes * page_bytes;
    if (first_page < last_page) {
      std::fill(data + begin, data + first_page, std::byte{0});
      std::fill(data + last_page, data + end, std::byte{0});
      if (::madvise(data + first_page, last_page - first_page, MADV_DONTNEED) == 0) return;
    }
    std::fill(data + begin, data + end, std::byte{0});
  }
  void zero(const raw_tensor& t) override {
    if (t.size) std::memset(t.data, 0, t.bytes());
  }
  void copy(const raw_tensor& from, const raw_tensor& to) override {
    same_shape(from, to, "copy");
    if (from.size && from.data != to.data) std::memcpy(to.data, from.data, from.bytes());
  }
  void accumulate(const raw_tensor& from, const raw_tensor& into) override {
    same_shape(from, into, "accumulate");
    visit_dtype(from.type, [&]<class T>(T) {
      const T* src = static_cast<const T*>(from.data);
      T* dst = static_cast<T*>(into.data);
      for (std::size_t i = 0; i < from.size; ++i) dst[i] = static_cast<T>(dst[i] + src[i]);
    });
  }
  using memory_domain::convert;
  void convert(const raw_tensor& from, const raw_tensor& to, double factor) override {
    if (from.size != to.size)
      throw error("host_domain::convert: " + std::to_string(from.size) + " elements into " + std::to_string(to.size) +
                  "; give both sides the same length");
    if (factor == 1.0) return detail::convert(from, to);
    visit_dtype(from.type, [&]<class F>(F) {
      visit_dtype(to.type, [&]<class T>(T) {
        if constexpr (std::is_floating_point_v<F>) {
          using wide = std::conditional_t<sizeof(F) == 2 || sizeof(T) == 2, float, double>;
          const F* src = static_cast<const F*>(from.data);
          T* dst = static_cast<T*>(to.data);
          const F f = static_cast<F>(factor);
          detail::for_each_blocked(from.size, [&](std::size_t i) {
            dst[i] = static_cast<T>(static_cast<wide>(static_cast<F>(src[i] * f)));
          });
        } else {
          throw error("host_domain::convert: a factor applies to f32 and f64 sources, not " +
                      std::string(to_string(from.type)));
        }
      });
    });
  }
  void scale(const raw_tensor& t, double factor) override { detail::scale(t, factor); }
  void fill(const raw_tensor& t, double value) override {
    visit_dtype(t.type, [&]<class T>(T) {
      T v{};
      if constexpr (std::is_arithmetic_v<T>)
        v = static_cast<T>(value);
      else
        v = T(static_cast<float>(value));  // bf16, f16: through float
      std::fill_n(static_cast<T*>(t.data), t.size, v);
    });
  }
  void order_after(work& w) override { w.wait(); }
  void synchronize() override {}

 private:
  static constexpr std::size_t round_up(std::size_t n) noexcept { return (n + page_bytes - 1) / page_bytes * page_bytes; }
  static void same_shape(const raw_tensor& a, const raw_tensor& b, const char* what) {
    if (a.type != b.type || a.size != b.size)
      throw error(std::string("host_domain::") + what + ": " + std::to_string(a.size) + " " +
                  std::string(to_string(a.type)) + " against " + std::to_string(b.size) + " " +
                  std::string(to_string(b.type)) + "; give both sides the same dtype and length");
  }
};

/// The process's host domain: every wrapper's CPU memory comes from it (it keeps no state but its identity).
inline host_domain& host_memory() {
  static host_domain domain;
  return domain;
}

}  // namespace ddp
// ---- end <ddp/memory/host.hpp>

namespace ddp {

namespace detail {
/// The registered device domains.
struct device_table {
  std::mutex mutex;
  std::vector<std::pair<device, memory_domain*>> entries;
};
inline device_table& device_domains() {
  static device_table table;
  return table;
}
}  // namespace detail

/// The memory domain of `d`: the host's for the CPU, else the one registered for `d`, else null.
inline memory_domain* domain_of(device d) {
  if (!d.is_cuda()) return &host_memory();
  auto& t = detail::device_domains();
  std::lock_guard lock(t.mutex);
  const auto it = std::find_if(t.entries.begin(), t.entries.end(), [&](const auto& e) { return e.first == d; });
  return it == t.entries.end() ? nullptr : it->second;
}

/// The memory domain of `d`, or a ddp::config_error naming the fix (`who` names the caller in the message).
inline memory_domain& require_domain_of(device d, const std::string& who) {
  if (memory_domain* m = domain_of(d)) return *m;
  throw config_error(who + ": memory on " + d.to_string() + " has no memory domain in this process; register "
                     "one (ddp::device_registration: the CUDA runtime's domain of ddp::cuda, or a test's fake "
                     "device) before handing ddp device memory, or keep the tensors on the CPU");
}

/// Registers `domain` as the memory domain of its device for the registration's lifetime; a device has one.
class [[nodiscard]] device_registration {
 public:
  /// Registers `domain` (which must outlive the registration) for `domain.where()`.
  explicit device_registration(memory_domain& domain) : device_(domain.where()) {
    if (!device_.is_cuda()) throw config_error("device_registration: the CPU's domain is the host's; register devices");
    auto& t = detail::device_domains();
    std::lock_guard lock(t.mutex);
    for (const auto& e : t.entries)
      if (e.first == device_)
        throw config_error("device_registration: " + device_.to_string() + " has a memory domain registered "
                           "already; one domain per device (drop the first registration before making another)");
    t.entries.emplace_back(device_, &domain);
  }
  device_registration(const device_registration&) = delete;
  device_registration& operator=(const device_registration&) = delete;
  ~device_registration() {
    auto& t = detail::device_domains();
    std::lock_guard lock(t.mutex);
    std::erase_if(t.entries, [&](const auto& e) { return e.first == device_; });
  }

 private:
  device device_;
};

}  // namespace ddp
// ---- end <ddp/memory/devices.hpp>
// ---- begin <ddp/memory/staged.hpp>
/// \file ddp::staged<Comm>: a communicator that moves device tensors through host memory, for backends that move
/// host memory only (ddp::tcp, an MPI without CUDA support). A collective whose tensors are all on the host (or a
/// backend that takes device memory itself, ddp::nccl) goes straight to the backend. Otherwise each device tensor
/// is copied into a host buffer by its device's memory domain (memory/devices.hpp), the copies are waited for (a
/// host backend must read them), the backend runs the collective on the host buffers, and once it completes the
/// outputs are copied back to the device and waited for, so the host buffers can go back to the staging pool.

#include <initializer_list>


namespace ddp {

/// Whether Comm's collectives take device memory themselves: a communicator says so with
/// `static constexpr bool takes_device_memory = true;` (ddp::nccl's does).
template <class Comm>
inline constexpr bool takes_device_memory = [] {
  if constexpr (requires { Comm::takes_device_memory; })
    return static_cast<bool>(Comm::takes_device_memory);
  else
    return false;
}();

namespace detail {

/// Host buffers for staging, reused: a collective takes the smallest idle one that fits and gives it back once
/// its outputs are home. Shared by the copies of a staged communicator.
class staging_pool {
 public:
  /// An idle host buffer of at least `bytes`, now busy.
  domain_buffer take(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    std::size_t best = idle_.size();
    for (std::size_t i = 0; i < idle_.size(); ++i)
      if (idle_[i].size() >= bytes && (best == idle_.size() || idle_[i].size() < idle_[best].size())) best = i;
    if (best == idle_.size()) return host_memory().allocate(bytes);
    domain_buffer b = std::move(idle_[best]);
    idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(best));
    return b;
  }
  /// Gives `b` back.
  void give(domain_buffer b) {
    std::lock_guard lock(mutex_);
    idle_.push_back(std::move(b));
  }

 private:
  std::mutex mutex_;
  std::vector<domain_buffer> idle_;
};

/// One device tensor of a collective and its host stand-in.
struct staged_tensor {
  raw_tensor device;        ///< the caller's tensor
  raw_tensor host;          ///< its stand-in, in `buffer`
  domain_buffer buffer;     ///< from the pool
  memory_domain* domain;    ///< the device's domain
  bool output;              ///< written by the collective: copied back once it completes
};

/// The work of a staged collective: the backend's, then the outputs copied home once it completes.
class staged_state final : public work_state {
 public:
  staged_state(work inner, std::vector<staged_tensor> tensors, std::shared_ptr<staging_pool> pool)
      : inner_(std::move(inner)), tensors_(std::move(tensors)), pool_(std::move(pool)) {}
  bool test() override {
    if (!inner_.done()) return false;
    bring_home();
    return true;
  }
  bool wait_until(clock::time_point deadline) override {
    auto& s = work_access::state(inner_);
    if (s && !s->wait_until(deadline)) return false;
    bring_home();
    return true;
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const override { return inner().timeout(); }
  [[nodiscard]] int rank() const override { return inner().rank(); }
  [[nodiscard]] std::string describe() const override { return inner().describe() + " (staged through the host)"; }
  [[nodiscard]] std::string waiting_for() const override { return inner().waiting_for(); }
  std::string diagnosis() override { return work_access::state(inner_) ? work_access::state(inner_)->diagnosis() : ""; }

 private:
  [[nodiscard]] const work_state& inner() const { return *work_access::state(const_cast<work&>(inner_)); }
  /// Once: the outputs copied back to their devices and waited for, the host buffers returned.
  void bring_home() {
    std::call_once(home_, [&] {
      for (auto& t : tensors_)
        if (t.output) t.domain->copy(t.host, t.device);
      for (auto& t : tensors_)
        if (t.output) t.domain->synchronize();
      for (auto& t : tensors_) pool_->give(std::move(t.buffer));
    });
  }
  work inner_;
  std::vector<staged_tensor> tensors_;
  std::shared_ptr<staging_pool> pool_;
  std::once_flag home_;
};

}  // namespace detail

/// A communicator over `Comm` whose collectives also take device tensors, staged through host memory (see the
/// file comment). Copies share the staging pool; split() stages the subgroup alike.
template <class Comm>
class staged {
  static_assert(communicator<Comm>, "ddp::staged<Comm>: Comm must model ddp::communicator; stage a backend's communicator.");
 public:
  /// Stages `comm`'s collectives.
  explicit staged(Comm comm) : comm_(std::move(comm)), pool_(std::make_shared<detail::staging_pool>()) {}

  /// The backend's communicator.
  [[nodiscard]] Comm& inner() noexcept { return comm_; }
  /// The backend's communicator.
  [[nodiscard]] const Comm& inner() const noexcept { return comm_; }
  /// This process's rank in the group.
  [[nodiscard]] int rank() const { return comm_.rank(); }
  /// Number of ranks.
  [[nodiscard]] int size() const { return comm_.size(); }
  /// The backend's traffic counts.
  [[nodiscard]] comm_stats stats() const { return comm_.stats(); }
  /// Collective: the backend's split, staged alike (sharing the staging pool).
  staged split(int color, int key) { return staged(comm_.split(color, key), pool_); }

  /// all_reduce, staged where `buffer` is on a device.
  template <tensor T>
  work all_reduce(T&& buffer, reduce_op op = reduce_op::sum) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.all_reduce(h[0], op); });
  }
  /// reduce_scatter, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work reduce_scatter(In&& input, Out&& output, reduce_op op = reduce_op::sum) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.reduce_scatter(h[0], h[1], op); });
  }
  /// all_gather, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work all_gather(In&& input, Out&& output) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.all_gather(h[0], h[1]); });
  }
  /// broadcast, staged where `buffer` is on a device.
  template <tensor T>
  work broadcast(T&& buffer, int root = 0) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.broadcast(h[0], root); });
  }
  /// reduce, staged where `buffer` is on a device.
  template <tensor T>
  work reduce(T&& buffer, reduce_op op = reduce_op::sum, int root = 0) {
    return run({{as_raw(buffer), true, true}}, [&](auto& h) { return comm_.reduce(h[0], op, root); });
  }
  /// gather, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work gather(In&& input, Out&& output, int root = 0) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.gather(h[0], h[1], root); });
  }
  /// scatter, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work scatter(In&& input, Out&& output, int root = 0) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.scatter(h[0], h[1], root); });
  }
  /// all_to_all, staged where a tensor is on a device.
  template <tensor In, tensor Out>
  work all_to_all(In&& input, Out&& output) {
    return run({{as_raw(input), true, false}, {as_raw(output), false, true}},
               [&](auto& h) { return comm_.all_to_all(h[0], h[1]); });
  }
  /// The backend's barrier.
  work barrier() { return comm_.barrier(); }
  /// send, staged where `buffer` is on a device.
  template <tensor T>
  work send(T&& buffer, int peer, int tag = 0) {
    return run({{as_raw(buffer), true, false}}, [&](auto& h) { return comm_.send(h[0], peer, tag); });
  }
  /// recv, staged where `buffer` is on a device.
  template <tensor T>
  work recv(T&& buffer, int peer, int tag = 0) {
    return run({{as_raw(buffer), false, true}}, [&](auto& h) { return comm_.recv(h[0], peer, tag); });
  }

 private:
  staged(Comm comm, std::shared_ptr<detail::staging_pool> pool) : comm_(std::move(comm)), pool_(std::move(pool)) {}

  struct argument {
    raw_tensor tensor;
    bool reads;   // the collective reads it: copied to the host first
    bool writes;  // the collective writes it: copied back once it completes
  };
  /// Runs `launch` on the arguments, or on host stand-ins of those on a device (see the file comment).
  template <class Launch>
  work run(std::initializer_list<argument> args, Launch&& launch) {
    std::vector<raw_tensor> use;
    std::vector<detail::staged_tensor> staged_tensors;
    for (const auto& a : args) {
      if (!a.tensor.where.is_cuda() || takes_device_memory<Comm> || a.tensor.size == 0) {
        use.push_back(a.tensor);
        continue;
      }
      memory_domain& d = require_domain_of(a.tensor.where, "ddp::staged");
      domain_buffer b = pool_->take(a.tensor.bytes());
      const raw_tensor host = b.view(a.tensor.type, 0, a.tensor.size);
      if (a.reads) d.copy(a.tensor, host);
      use.push_back(host);
      staged_tensors.push_back({a.tensor, host, std::move(b), &d, a.writes});
    }
    if (staged_tensors.empty()) return launch(use);
    for (auto& t : staged_tensors) t.domain->synchronize();  // the host backend reads the copies now
    work w = launch(use);
    return work(std::make_shared<detail::staged_state>(std::move(w), std::move(staged_tensors), pool_));
  }

  Comm comm_;
  std::shared_ptr<detail::staging_pool> pool_;
};

}  // namespace ddp
// ---- end <ddp/memory/staged.hpp>

// ---- begin <ddp/parallel/policies.hpp>
/// \file Compile-time policies of ddp::data_parallel: backend, sharding strategy, bucket size, comm hook, precision.
/// Policies may be given in any order; a missing category takes its default. The sharding policies carry
/// their run-time settings as members with defaults (ddp::full_shard{.reshard_after_forward = false}).


// ---- begin <ddp/parallel/comm_hooks.hpp>
/// \file Comm hooks: how a bucket's gradients are reduced. A hook is a policy type (any default-constructible
/// type with `using policy_category = ddp::comm_hook_policy;`) that models ddp::comm_hook: start(bucket)
/// starts the reduction of one bucket's gradients and returns its ddp::work; complete(bucket) runs once that
/// work is done and leaves the averaged gradients in the bucket. A hook may keep state (per bucket: the
/// bucket's index is stable across steps). plain_hook all-reduces with the average; bf16_compress_hook and
/// fp16_compress_hook divide by the world size, round into a reused half-precision buffer, all-reduce the sum
/// in that dtype and widen the result back (PyTorch's compression hooks).


// ---- begin <ddp/parallel/archetype.hpp>
/// \file ddp::detail::archetype_communicator: the least type that models ddp::communicator (declarations only,
/// never called), so the parallel room can check its concepts (comm_hook, sharding_strategy) with a static_assert
/// beside each type that models them, without naming a backend.


namespace ddp::detail {

/// Declares every operation of ddp::communicator over any tensor; used only in unevaluated concept checks.
struct archetype_communicator {
  [[nodiscard]] int rank() const;
  [[nodiscard]] int size() const;
  archetype_communicator split(int color, int key);
  template <class T> work all_reduce(T&& t, reduce_op op);
  template <class I, class O> work reduce_scatter(I&& in, O&& out, reduce_op op);
  template <class I, class O> work all_gather(I&& in, O&& out);
  template <class T> work broadcast(T&& t, int root);
  template <class T> work reduce(T&& t, reduce_op op, int root);
  template <class I, class O> work gather(I&& in, O&& out, int root);
  template <class I, class O> work scatter(I&& in, O&& out, int root);
  template <class I, class O> work all_to_all(I&& in, O&& out);
  work barrier();
  template <class T> work send(T&& t, int peer, int tag);
  template <class T> work recv(T&& t, int peer, int tag);
  [[nodiscard]] comm_stats stats() const;
};
static_assert(communicator<archetype_communicator>,
              "ddp: archetype_communicator must declare every operation ddp::communicator requires; add the missing one.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/archetype.hpp>

namespace ddp {

namespace detail {
struct hook_category {};
}  // namespace detail

/// The policy_category of a comm hook: `using policy_category = ddp::comm_hook_policy;`.
using comm_hook_policy = detail::hook_category;

/// One bucket as a comm hook sees it: its gradients (one dtype), the group reducing them and the memory domain they
/// live in (element work on them runs there).
template <class Comm>
struct bucket_gradients {
  raw_tensor grads;        ///< the bucket's gradients: reduce them in place, averaged over the group
  Comm& comm;              ///< the group (the world under replicate)
  std::size_t index;       ///< the bucket's place in start order, the same every step (for per-bucket state)
  memory_domain& memory;   ///< where `grads` live: allocate scratch and run element work there

  /// Number of ranks the gradients are averaged over.
  [[nodiscard]] int world_size() const { return comm.size(); }
  /// The gradients' element type.
  [[nodiscard]] dtype type() const noexcept { return grads.type; }
  /// The gradients as elements of type T (T must match type()).
  template <element T>
  [[nodiscard]] std::span<T> elements() const noexcept {
    return {static_cast<T*>(grads.data), grads.size};
  }
};

/// A comm hook over communicator Comm: start starts a bucket's reduction, complete finishes it.
template <class H, class Comm = detail::archetype_communicator>
concept comm_hook = std::default_initializable<H> && std::same_as<typename H::policy_category, comm_hook_policy> &&
                    requires(H& h, const bucket_gradients<Comm>& b) {
                      { h.start(b) } -> std::same_as<work>;
                      h.complete(b);
                    };

/// Gradients travel in their own dtype, averaged by the all-reduce.
struct plain_hook {
  using policy_category = comm_hook_policy;
  /// Starts the average of the bucket across the group.
  template <class Comm>
  work start(const bucket_gradients<Comm>& b) {
    return b.comm.all_reduce(b.grads, reduce_op::avg);
  }
  /// Nothing to undo once the reduction is done.
  template <class Comm>
  void complete(const bucket_gradients<Comm>& /*b*/) {}
};
static_assert(comm_hook<plain_hook>);

namespace detail {

/// Gradients of f32/f64 buckets travel as Half: pre-divided by the world size (multiplied by its reciprocal in
/// the gradients' own dtype, so sums of large values do not overflow float16), summed in Half, widened back. Other
/// dtypes travel as they are. One reused Half buffer per bucket in the gradients' domain, made on its first start.
template <class Half>
class compress_hook {
 public:
  using policy_category = comm_hook_policy;
  template <class Comm>
  work start(const bucket_gradients<Comm>& b) {
    if (!compressed(b.type())) return b.comm.all_reduce(b.grads, reduce_op::avg);
    const raw_tensor half = scratch(b);
    b.memory.convert(b.grads, half, 1.0 / b.world_size());
    return b.comm.all_reduce(half, reduce_op::sum);
  }
  template <class Comm>
  void complete(const bucket_gradients<Comm>& b) {
    if (compressed(b.type())) b.memory.convert(scratch(b), b.grads);
  }

 private:
  static bool compressed(dtype t) noexcept { return t == dtype::f32 || t == dtype::f64; }
  template <class Comm>
  raw_tensor scratch(const bucket_gradients<Comm>& b) {
    if (scratch_.size() <= b.index) scratch_.resize(b.index + 1);
    auto& s = scratch_[b.index];
    if (s.size() < b.grads.size * sizeof(Half) || s.domain() != &b.memory) s = b.memory.allocate(b.grads.size * sizeof(Half));
    return s.view(dtype_v<Half>, 0, b.grads.size);
  }
  std::vector<domain_buffer> scratch_;  // per bucket index, in the bucket's domain
};

}  // namespace detail

/// Gradients are cast to bfloat16 for the reduction and back (half the bytes).
struct bf16_compress_hook : detail::compress_hook<bfloat16> {};
static_assert(comm_hook<bf16_compress_hook>);
/// Gradients are scaled, cast to float16 for the reduction and back (half the bytes).
struct fp16_compress_hook : detail::compress_hook<float16> {};
static_assert(comm_hook<fp16_compress_hook>);

}  // namespace ddp
// ---- end <ddp/parallel/comm_hooks.hpp>
// ---- begin <ddp/parallel/mixed_precision.hpp>
/// \file The precision policies of ddp::data_parallel (PyTorch FSDP's `MixedPrecision(param_dtype, reduce_dtype)`).
/// The model's own element type is its compute dtype: a model written over ddp::bfloat16 computes in bf16.
/// ddp::mixed_precision<Param, Reduce> makes the wrapper keep f32 master weights of the Param-typed parameters
/// (sharded where the strategy shards them), reduce their gradients in Reduce and step the optimizer on the
/// masters, narrowing them into the model's parameters after each step (parallel/master_weights.hpp).



namespace ddp {

namespace detail {
struct precision_category {};
}  // namespace detail

/// Parameters, gradients and optimizer state in the model's own dtypes (the default): no master weights.
struct full_precision {
  using policy_category = detail::precision_category;
  static constexpr bool masters = false;  ///< no master weights are kept
};

/// Mixed precision: the model's parameters of type Param (bfloat16 or float16) are its compute copy; the wrapper
/// keeps f32 master weights of them (sharded with the owned blocks), reduces their gradients in Reduce (float, or
/// Param for half the bytes on the wire) into f32 master gradients, steps the optimizer (and its state) in f32,
/// then narrows the masters into the parameters; under full_shard the unshard all-gathers the Param copy.
/// Parameters already in f32 or f64 (such as norms kept wide) are stepped as they are. Checkpoints hold the masters.
template <class Param = bfloat16, class Reduce = float>
struct mixed_precision {
  static_assert(std::is_same_v<Param, bfloat16> || std::is_same_v<Param, float16>,
                "ddp::mixed_precision<Param, Reduce>: Param is the model's compute type, ddp::bfloat16 or "
                "ddp::float16; write the model over it (an f32 model needs no mixed_precision policy).");
  static_assert(std::is_same_v<Reduce, float> || std::is_same_v<Reduce, Param>,
                "ddp::mixed_precision<Param, Reduce>: gradients are reduced in float (exact sums of the compute "
                "dtype's gradients) or in Param itself (half the bytes); give one of those as Reduce.");
  using policy_category = detail::precision_category;
  using param_type = Param;    ///< the compute dtype (the model's parameters)
  using reduce_type = Reduce;  ///< the dtype gradients travel and are summed in
  static constexpr bool masters = true;  ///< f32 master weights are kept
};

}  // namespace ddp
// ---- end <ddp/parallel/mixed_precision.hpp>
// ---- begin <ddp/parallel/options.hpp>
/// \file ddp::data_parallel_options: the run-time settings of data_parallel.


// ---- begin <ddp/parallel/units.hpp>
/// \file Sharding units named by the user: data_parallel_options::units holds dotted name prefixes ("head") and
/// parts of the model (ddp::unit_of(model.encoder)) in any mix. A part is kept as the addresses of its
/// parameters; when data_parallel builds its layout it resolves the part, by those addresses, to the dotted
/// prefix its parameters share in the wrapped model, which then names the unit.

#include <unordered_map>


namespace ddp {

namespace detail {

/// The compiler's spelling of T ("ddp_test::linear"), for messages.
template <class T>
std::string type_name() {
  const std::string_view text = __PRETTY_FUNCTION__;  // "... type_name() [with T = X; ...]" or "[T = X]"
  const auto start = text.find("T = ") + 4;
  const auto end = text.find_first_of(";]", start);
  return std::string(text.substr(start, end - start));
}

}  // namespace detail

/// One entry of data_parallel_options::units: a dotted name prefix, or a part of the model (ddp::unit_of).
class unit_entry {
 public:
  /// The parameters whose dotted names start with `prefix` (the whole name or a leading run of its components).
  unit_entry(std::string prefix) : prefix_(std::move(prefix)) {}
  /// As above.
  unit_entry(const char* prefix) : prefix_(prefix) {}
  /// The parameters at `parameters` (what ddp::unit_of makes); `what` names the part in messages.
  unit_entry(std::vector<const void*> parameters, std::string what)
      : prefix_(std::move(what)), parameters_(std::move(parameters)), by_object_(true) {}

  /// True for a part of the model given by ddp::unit_of, false for a name prefix.
  [[nodiscard]] bool by_object() const noexcept { return by_object_; }
  /// The name prefix; for a part, how messages name it ("ddp::unit_of(encoder_type)").
  [[nodiscard]] const std::string& prefix() const noexcept { return prefix_; }
  /// A part's parameters, by address (ddp::leaf_key: the leaf, or the object it refers to).
  [[nodiscard]] std::span<const void* const> parameters() const noexcept { return parameters_; }

 private:
  std::string prefix_;
  std::vector<const void*> parameters_;
  bool by_object_ = false;
};

/// The parameters of `part` (a member of the model to wrap, such as model.encoder) as one sharding unit:
/// `opts.units = {ddp::unit_of(model.encoder), "head"};`. `part` must stay where it is until the wrapper is built.
template <class Part>
unit_entry unit_of(Part& part) {
  std::vector<const void*> parameters;
  visit_parameters(part, [&](std::string_view, auto& p) { parameters.push_back(leaf_key(p)); });
  return unit_entry(std::move(parameters), "ddp::unit_of(" + detail::type_name<Part>() + ")");
}

/// data_parallel_options::units: sharding units by dotted name prefix or by part of the model, in any mix.
class unit_list {
 public:
  unit_list() = default;
  /// `{ddp::unit_of(model.encoder), "head"}`.
  unit_list(std::initializer_list<unit_entry> entries) : entries_(entries) {}
  /// Name prefixes only.
  unit_list(const std::vector<std::string>& prefixes) : entries_(prefixes.begin(), prefixes.end()) {}
  /// Any entries.
  explicit unit_list(std::vector<unit_entry> entries) : entries_(std::move(entries)) {}

  /// Number of entries.
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }
  /// The entries, in the order given.
  [[nodiscard]] std::span<const unit_entry> entries() const noexcept { return entries_; }
  /// The prefixes the layout reads. data_parallel resolves every ddp::unit_of entry to a prefix before it builds
  /// the layout; an entry still unresolved is a ddp::config_error.
  explicit operator std::vector<std::string>() const {
    std::vector<std::string> out;
    for (const auto& e : entries_) {
      if (e.by_object())
        throw config_error("data_parallel: the unit " + e.prefix() + " was not resolved to the model's parameters; "
                           "give ddp::unit_of entries to ddp::data_parallel, which resolves them");
      out.push_back(e.prefix());
    }
    return out;
  }

 private:
  std::vector<unit_entry> entries_;
};

namespace detail {

/// `prefix` covers `name`: the whole name, or a leading run of its dotted components.
inline bool covers(std::string_view prefix, std::string_view name) noexcept {
  return name.starts_with(prefix) && (name.size() == prefix.size() || name[prefix.size()] == '.');
}

/// The longest run of leading dotted components that `a` and `b` share ("enc.l0.w", "enc.l1.w": "enc").
inline std::string_view common_prefix(std::string_view a, std::string_view b) noexcept {
  std::size_t end = 0;
  for (std::size_t i = 0; i <= a.size() && i <= b.size(); ++i) {
    const bool a_end = i == a.size() || a[i] == '.', b_end = i == b.size() || b[i] == '.';
    if (a_end && b_end) end = i;
    if (i == a.size() || i == b.size() || a[i] != b[i]) break;
  }
  return a.substr(0, end);
}

/// `units` with every ddp::unit_of entry replaced by the dotted prefix its parameters share in `model` (the
/// unit's name). Throws ddp::config_error naming the entry when it holds no parameter of the model (or some that
/// are not the model's), when its parameters share no prefix, or when that prefix covers other parameters too.
template <class Model>
unit_list resolve_units(Model& model, const unit_list& units, int rank) {
  bool any = false;
  for (const auto& e : units.entries()) any = any || e.by_object();
  if (!any) return units;
  std::vector<std::string> names;
  std::unordered_map<const void*, std::size_t> index;
  visit_parameters(model, [&](std::string_view name, auto& p) {
    index.emplace(leaf_key(p), names.size());
    names.emplace_back(name);
  });
  std::vector<unit_entry> out;
  for (std::size_t i = 0; i < units.size(); ++i) {
    const unit_entry& e = units.entries()[i];
    if (!e.by_object()) {
      out.push_back(e);
      continue;
    }
    const std::string entry = "data_parallel_options::units entry #" + std::to_string(i) + ", " + e.prefix() + ",";
    std::vector<char> held(names.size(), 0);
    std::size_t found = 0;
    for (const void* p : e.parameters())
      if (const auto it = index.find(p); it != index.end()) {
        held[it->second] = 1;
        ++found;
      }
    if (found == 0 || found != e.parameters().size())
      throw config_error(entry + (found == 0 ? " holds no parameter of the wrapped model" :
                                               " holds parameters that are not the wrapped model's") +
                             "; pass a part of the model being wrapped (such as ddp::unit_of(model.encoder)) or name "
                             "the unit by its dotted prefix",
                         rank);
    std::string_view prefix;
    std::size_t first = names.size();
    for (std::size_t k = 0; k < names.size(); ++k)
      if (held[k]) {
        prefix = first == names.size() ? std::string_view(names[k]) : common_prefix(prefix, names[k]);
        first = std::min(first, k);
      }
    if (prefix.empty())
      throw config_error(entry + " holds parameters ('" + names[first] + "', ...) that share no dotted name prefix, "
                             "so they cannot form one unit; give its parts as separate units",
                         rank);
    for (std::size_t k = 0; k < names.size(); ++k)
      if (!held[k] && covers(prefix, names[k]))
        throw config_error(entry + " holds the parameters under '" + std::string(prefix) + "' but not '" + names[k] +
                               "'; pass the part that holds all of them, or name the unit by its dotted prefix",
                           rank);
    out.emplace_back(std::string(prefix));
  }
  return unit_list(std::move(out));
}

}  // namespace detail

}  // namespace ddp
// ---- end <ddp/parallel/units.hpp>

namespace ddp {

/// Run-time settings of data_parallel (the sharding policies carry their own: ddp::full_shard{...}).
struct data_parallel_options {
  /// Parameters that never receive a gradient (frozen or unused branches): they need not report; their
  /// gradients are left as the user keeps them (zero after zero_grad()) and are averaged like the others.
  std::vector<std::string> unused_parameters{};
  /// true: finish_gradients() throws ddp::error naming parameters that did not report; false: their
  /// gradients are reduced as they stand.
  bool error_on_missing = true;
  /// Copy rank 0's parameter values to every rank at construction.
  bool broadcast_parameters = true;
  /// replicate: after the first synchronized step, plan the buckets again in the order its gradients became
  /// ready (rank 0's, broadcast once), so later steps start them as early as the backward allows (PyTorch DDP
  /// rebuilds its buckets so by default); false keeps the buckets planned in reverse visit order.
  bool rebuild_buckets = true;
  /// Run dp.verify_in_sync() (a collective) inside every verify_every-th step(), after the optimizer; 0: never.
  std::size_t verify_every = 0;
  /// Sharding units, by dotted name prefix ("encoder.layers.0", "head") or by part of the model
  /// (ddp::unit_of(model.encoder), resolved to the prefix its parameters share): a parameter belongs to the
  /// longest listed prefix it starts with (the whole name or a leading run of its components); parameters no
  /// entry covers are grouped by unit_depth. An entry that covers no parameter is a ddp::config_error.
  unit_list units{};
  /// Sharding units of the parameters `units` does not cover: the first unit_depth components of the dotted
  /// name (1: the model's top-level fields, "fc1"; 2: "encoder.layer0", ...). Must be at least 1.
  std::size_t unit_depth = 1;
};

}  // namespace ddp
// ---- end <ddp/parallel/options.hpp>

namespace ddp {

namespace detail {
struct sharding_category {};
struct bucket_category {};
}  // namespace detail

/// Every rank holds the whole model, gradients are all-reduced (PyTorch DDP); the default.
struct replicate {
  using policy_category = detail::sharding_category;
  /// Sum every gradient element in rank order on the host (parallel/ordered_reduction.hpp): training bitwise
  /// reproducible across runs, backends and bucket sizes at one world size; the all-reduces become all_gathers
  /// (N/2 times the bytes beyond N = 2). Not with a comm hook.
  bool deterministic = false;
};
/// Gradients and optimizer state are sharded, parameters kept whole (ZeRO-2, FSDP SHARD_GRAD_OP).
struct shard_grad_op {
  using policy_category = detail::sharding_category;
  /// Keep the pooled per-unit buffers (full gradients) resident between steps, so steady-state steps allocate
  /// nothing and fault in no page (true), or free them after every step, so that between steps a rank holds
  /// only its shards (false: the lowest memory, page faults each step).
  bool keep_unit_buffers = true;
  /// Sum every gradient element in rank order on the host, as replicate's (the reduce-scatters become
  /// all_to_alls of the same bytes); under hybrid the inner policy's knob also orders the sums across groups.
  bool deterministic = false;
};
/// Parameters, gradients and optimizer state are sharded (ZeRO-3, FSDP FULL_SHARD).
struct full_shard {
  using policy_category = detail::sharding_category;
  /// Free a unit's unsharded parameters when its last unshard scope closes (false keeps them until the step).
  bool reshard_after_forward = true;
  /// Keep the pooled per-unit buffers (unsharded values, full gradients) resident between steps (true), or
  /// free them after every step (false), as shard_grad_op's.
  bool keep_unit_buffers = true;
  /// Sum every gradient element in rank order on the host, as shard_grad_op's.
  bool deterministic = false;
};
/// Inner sharding inside groups of `group_size` ranks, replication across groups (HSDP).
template <class Inner = full_shard>
struct hybrid {
  static_assert(std::is_same_v<Inner, full_shard> || std::is_same_v<Inner, shard_grad_op>,
                "ddp::hybrid<Inner>: Inner must be ddp::full_shard or ddp::shard_grad_op.");
  using policy_category = detail::sharding_category;
  using inner_type = Inner;  ///< sharding inside a group
  /// Ranks per shard group; 0 takes LOCAL_WORLD_SIZE (or OMPI_COMM_WORLD_LOCAL_SIZE), else the world.
  int group_size = 0;
  /// The settings of the sharding inside a group (ddp::hybrid<>{.inner = {.reshard_after_forward = false}}).
  Inner inner{};
};

/// Gradient bucket capacity in bytes, and the (smaller) capacity of the first bucket, which starts soonest.
template <std::size_t Capacity, std::size_t First = (std::size_t{1} << 20)>
struct bucket_bytes {
  static_assert(Capacity > 0 && First > 0, "ddp::bucket_bytes: capacities must be positive byte counts.");
  using policy_category = detail::bucket_category;
  static constexpr std::size_t capacity = Capacity;  ///< bytes per bucket
  static constexpr std::size_t first = First;        ///< bytes of the first bucket
};

namespace detail {

template <class P>
concept policy = requires { typename P::policy_category; };

template <class P>
constexpr bool check_policy() {
  static_assert(policy<P>,
                "ddp::data_parallel: one of the policies is not a ddp policy; use a backend (ddp::backend::tcp, "
                "mpi, nccl), a sharding (ddp::replicate, shard_grad_op, full_shard, hybrid<...>), "
                "ddp::bucket_bytes<N>, a comm hook (ddp::plain_hook, bf16_compress_hook, fp16_compress_hook, or your "
                "own type with `using policy_category = ddp::comm_hook_policy;`) or ddp::mixed_precision<...>.");
  return true;
}

template <class Category, class P>
constexpr int in_category() {
  if constexpr (policy<P>)
    return std::is_same_v<typename P::policy_category, Category> ? 1 : 0;
  else
    return 0;
}

template <class Category, class Default, class... Ps>
struct pick {
  using type = Default;
};
template <class Category, class Default, class P, class... Ps>
struct pick<Category, Default, P, Ps...> {
  using type = std::conditional_t<in_category<Category, P>() == 1, P, typename pick<Category, Default, Ps...>::type>;
};

/// T is one of Ts.
template <class T, class... Ts>
concept one_of = (std::is_same_v<T, Ts> || ...);

/// The first of `args` of type T, else T{} (a wrapper's constructor arguments: policy values, options).
template <class T>
T value_of() {
  return T{};
}
template <class T, class A, class... Rest>
T value_of(const A& first, const Rest&... rest) {
  if constexpr (std::is_same_v<A, T>)
    return first;
  else
    return value_of<T>(rest...);
}

/// data_parallel_options, if among Args, comes last and once (checked by data_parallel's constructor).
template <class... Args>
constexpr bool options_last() {
  constexpr std::size_t n = sizeof...(Args);
  std::size_t count = 0, at = 0, i = 0;
  ((std::is_same_v<Args, data_parallel_options> ? (++count, at = i++) : i++), ...);
  return count == 0 || (count == 1 && at + 1 == n);
}

}  // namespace detail

/// The resolved policy set of data_parallel<Model, Ps...>.
template <class... Ps>
struct policies {
  static_assert((detail::check_policy<Ps>() && ...));
  static_assert((detail::in_category<detail::backend_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two backend policies were given; keep one of ddp::backend::tcp, mpi, nccl.");
  static_assert((detail::in_category<detail::sharding_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two sharding policies were given; keep one of ddp::replicate, shard_grad_op, "
                "full_shard, hybrid<...>.");
  static_assert((detail::in_category<detail::bucket_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two ddp::bucket_bytes policies were given; keep one.");
  static_assert((detail::in_category<detail::hook_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two comm hooks were given; keep one of ddp::plain_hook, bf16_compress_hook, "
                "fp16_compress_hook.");
  static_assert((detail::in_category<detail::precision_category, Ps>() + ... + 0) <= 1,
                "ddp::data_parallel: two precision policies were given; keep one ddp::mixed_precision<...>.");

  using backend = typename detail::pick<detail::backend_category, backend::tcp, Ps...>::type;        ///< transport
  using sharding = typename detail::pick<detail::sharding_category, replicate, Ps...>::type;         ///< strategy
  using buckets = typename detail::pick<detail::bucket_category, bucket_bytes<(25U << 20)>, Ps...>::type;  ///< sizes
  using hook = typename detail::pick<detail::hook_category, plain_hook, Ps...>::type;                ///< compression
  using precision = typename detail::pick<detail::precision_category, full_precision, Ps...>::type;  ///< masters
};

namespace detail {
/// T is one of the policy types data_parallel<Model, Ps...> resolves (a constructor argument may be a value of it).
template <class T, class... Ps>
concept policy_of = one_of<T, typename policies<Ps...>::backend, typename policies<Ps...>::sharding,
                           typename policies<Ps...>::buckets, typename policies<Ps...>::hook,
                           typename policies<Ps...>::precision>;
}  // namespace detail

}  // namespace ddp
// ---- end <ddp/parallel/policies.hpp>
// ---- begin <ddp/parallel/data_parallel.hpp>
/// \file ddp::data_parallel: wraps any model for data-parallel training (PyTorch DDP semantics).
/// Construction lays every leaf (ddp::parameter, ddp::trainable, an adapter's tensor: any storage_traits type) into
/// flat arenas (one per dtype), checks that all ranks hold the same model and broadcasts rank 0's values. In the
/// backward each finished gradient is reported (gradient_ready(p), or the leaf's framework's autograd); a bucket whose
/// parameters have all reported starts its reduction at once, in plan order, the same on every rank (under
/// replicate replanned once in the first step's ready order). finish_gradients() waits; step(opt) runs the optimizer.


// ---- begin <ddp/optim/flat.hpp>
/// \file Flat buffers: the contiguous spans of values and gradients optimizers step over, and the
/// optimizer state kept per flat buffer and exposed per parameter and state array (for checkpoints).



namespace ddp::optim {

/// The part of one parameter that lies in a flat buffer (the whole parameter unless the buffer is a shard).
struct flat_segment {
  std::string name;         ///< the parameter's dotted name ("fc1.weight")
  std::size_t offset = 0;   ///< first element inside the flat buffer
  std::size_t numel = 0;    ///< elements of the parameter inside the flat buffer
  std::size_t start = 0;    ///< index, within the parameter, of the segment's first element (0 unless sharded)
};

/// A contiguous span of parameter values and their gradients (same dtype, same length) with the
/// parameters laid in it. data_parallel hands one per arena (or per owned shard) to the optimizer.
struct flat_buffer {
  raw_tensor values;                   ///< the values the optimizer updates
  raw_tensor grads;                    ///< the gradients, already averaged across ranks
  std::vector<flat_segment> segments;  ///< the parameters in `values`, in order
  memory_domain* domain = nullptr;     ///< where values and gradients live (null: the host); its state goes there

  /// The domain of its memory: `domain`, else the host's.
  [[nodiscard]] memory_domain& memory() const noexcept { return domain ? *domain : host_memory(); }
};

/// An optimizer data_parallel can step: attach() allocates its state for a layout, step() updates values.
template <class O>
concept flat_optimizer = requires(O& o, std::span<const flat_buffer> buffers) {
  o.attach(buffers);
  o.step(buffers);
};

/// Specialize for an optimizer that holds its own tensors (a framework's, such as torch::optim) with
///   static void check(const Opt&, std::span<const flat_buffer> owned, int rank);
/// throwing ddp::config_error unless it steps tensors over the `owned` buffers: data_parallel calls it before each
/// step under the sharded policies, where only the owned blocks receive the averaged gradients.
template <class Opt>
struct optimizer_traits {};

namespace detail {

/// Optimizer state: per flat buffer, one state array per name ("momentum_buffer", "exp_avg", ...) of the buffer's
/// dtype and length, in the buffer's memory domain, zero when created; plus the number of steps taken.
class flat_state {
 public:
  /// `names` names the per-element state arrays (possibly none).
  explicit flat_state(std::vector<std::string_view> names) : array_names_(std::move(names)) {}

  /// Allocates zeroed state for `buffers` on first use; afterwards checks that the layout is the same.
  void attach(std::span<const flat_buffer> buffers) {
    if (layout_.empty() && state_.empty()) {
      for (const auto& b : buffers) {
        layout_.push_back(b);
        auto& arrays = state_.emplace_back();
        for (std::size_t s = 0; s < array_names_.size(); ++s) arrays.push_back(b.memory().allocate(b.values.bytes()));
      }
      return;
    }
    if (buffers.size() != layout_.size())
      throw config_error("optimizer: stepped over " + std::to_string(buffers.size()) + " flat buffers but its state "
                         "was made for " + std::to_string(layout_.size()) + "; use one optimizer per data_parallel");
    for (std::size_t i = 0; i < buffers.size(); ++i)
      if (buffers[i].values.size != layout_[i].values.size || buffers[i].values.type != layout_[i].values.type)
        throw config_error("optimizer: flat buffer " + std::to_string(i) + " has " +
                           std::to_string(buffers[i].values.size) + " " + std::string(to_string(buffers[i].values.type)) +
                           " elements but the state holds " + std::to_string(layout_[i].values.size) + " " +
                           std::string(to_string(layout_[i].values.type)) + "; use one optimizer per data_parallel");
  }

  /// Calls `f(name, view)` for every parameter and state array ("fc1.weight.exp_avg"); views are writable, so
  /// a checkpoint loader fills them. Empty until attach() or the first step. Under sharding a view holds
  /// only the owned piece of the parameter, and a parameter may come in several pieces: then give `f` a
  /// third parameter, `const flat_segment&`, whose `start` says where the piece lies in the parameter.
  template <class F>
  void for_each_state(F&& f) {
    for (std::size_t i = 0; i < layout_.size(); ++i)
      for (const auto& seg : layout_[i].segments)
        for (std::size_t s = 0; s < array_names_.size(); ++s) {
          const std::size_t width = size_of(layout_[i].values.type);
          const raw_tensor view{state_[i][s].data() + seg.offset * width, seg.numel, layout_[i].values.type,
                                layout_[i].values.where};
          if constexpr (std::is_invocable_v<F&, std::string, raw_tensor, const flat_segment&>)
            f(seg.name + "." + std::string(array_names_[s]), view, seg);
          else
            f(seg.name + "." + std::string(array_names_[s]), view);
        }
  }

  /// Steps taken so far (PyTorch's per-parameter "step", shared by all parameters here).
  [[nodiscard]] std::uint64_t step_count() const noexcept { return steps_; }
  /// Sets the step counter (checkpoint loading).
  void set_step_count(std::uint64_t steps) noexcept { steps_ = steps; }

 protected:
  /// Runs `kernel(values, grads, arrays)` with typed spans for every buffer, after attach().
  template <class Kernel>
  void for_each_buffer(std::span<const flat_buffer> buffers, std::string_view who, Kernel&& kernel) {
    attach(buffers);
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      const auto& b = buffers[i];
      if (b.values.where.is_cuda())
        throw config_error(std::string(who) + ": this optimizer steps host memory; the parameters are on " +
                           b.values.where.to_string() + ", use the CUDA optimizer kernels of <ddp/cuda/...>");
      if (b.grads.type != b.values.type || b.grads.size != b.values.size)
        throw config_error(std::string(who) + ": values and gradients of flat buffer " + std::to_string(i) +
                           " differ in dtype or length; pass matching spans");
      auto run = [&]<class T>(T*) {
        std::vector<std::span<T>> arrays;
        for (auto& s : state_[i]) arrays.emplace_back(reinterpret_cast<T*>(s.data()), b.values.size);
        kernel(std::span<T>(static_cast<T*>(b.values.data), b.values.size),
               std::span<const T>(static_cast<const T*>(b.grads.data), b.grads.size), std::span(arrays));
      };
      if (b.values.type == dtype::f32)
        run(static_cast<float*>(nullptr));
      else if (b.values.type == dtype::f64)
        run(static_cast<double*>(nullptr));
      else
        throw config_error(std::string(who) + ": parameters of dtype " + std::string(to_string(b.values.type)) +
                           " cannot be stepped; keep f32 or f64 parameters (master weights) and compress "
                           "gradients with a comm hook instead");
    }
  }

  std::uint64_t steps_ = 0;  ///< steps taken

 private:
  std::vector<std::string_view> array_names_;
  std::vector<flat_buffer> layout_;
  std::vector<std::vector<domain_buffer>> state_;  // [buffer][state array]
};

}  // namespace detail
}  // namespace ddp::optim
// ---- end <ddp/optim/flat.hpp>
// ---- begin <ddp/parallel/arena.hpp>
/// \file The flat arenas of data_parallel: every parameter of a model laid into one contiguous buffer of values
/// and one of gradients per dtype, in visit order, in a memory domain (memory/); each leaf is bound to its slice.


// ---- begin <ddp/parallel/leaf_binding.hpp>
/// \file leaf_binding: ties one leaf of the model (any type with ddp::storage_traits) to its place in the
/// flat arenas. An adopting leaf points at that place; an owning leaf keeps its memory and is copied at the
/// step's edges: its gradient in when reported, its values out whenever the arena's values changed.



namespace ddp::detail {

/// One leaf, type-erased: where it is bound and how to move its elements.
class leaf_binding {
 public:
  virtual ~leaf_binding() = default;
  /// True when the leaf computes on ddp's memory (no copies at the step's edges).
  [[nodiscard]] virtual bool adopts() const noexcept = 0;
  /// Copies the leaf's current values and gradient to `values`/`grads` (`bytes` each, memory of `domain`) and binds
  /// it there; later copies between the leaf's own memory and ddp's run on `domain`.
  virtual void bind(std::byte* values, std::byte* grads, std::size_t bytes, memory_domain& domain) = 0;
  /// Binds the leaf to other memory of the same size, copying nothing (the sharded strategies' pooled buffers).
  /// `present` false: `values` do not hold the leaf's values (a sharded unit), and a leaf type that can refuse
  /// use until the next rebind does (storage_traits<T>::vacate).
  virtual void rebind(std::byte* values, std::byte* grads, bool present) = 0;
  /// Gives the leaf its values back in memory of its own (the arena is going away).
  virtual void unbind() = 0;
  /// Owning leaves: copies the leaf's gradient to where it is bound (at report time).
  virtual void gradient_in() = 0;
  /// Owning leaves: copies the values where it is bound to the leaf (after they changed there).
  virtual void values_out() = 0;
  /// Owning leaves: zeroes the leaf's own gradient (zero_grad).
  virtual void zero_own_gradient() = 0;
  /// Watching leaves: calls `ready` whenever the leaf's gradient is final (kept while the returned handle lives).
  virtual std::shared_ptr<void> watch(std::function<void()> ready) = 0;
};

/// The binding of a leaf of type T, kept by pointer (a member of the model) or by value (a view leaf).
template <storage_leaf T>
class leaf_binding_of final : public leaf_binding {
  using traits = storage_traits<T>;
  static constexpr bool adopting = adopting_leaf<T>;

 public:
  explicit leaf_binding_of(T& leaf) requires(!leaf_is_view<T>) : leaf_(&leaf) {}
  explicit leaf_binding_of(const T& leaf) requires(leaf_is_view<T>) : copy_(leaf), leaf_(&*copy_) {}
  leaf_binding_of(const leaf_binding_of&) = delete;
  leaf_binding_of& operator=(const leaf_binding_of&) = delete;

  [[nodiscard]] bool adopts() const noexcept override { return adopting; }

  void bind(std::byte* values, std::byte* grads, std::size_t bytes, memory_domain& domain) override {
    home_values_ = static_cast<std::byte*>(traits::values(*leaf_));
    home_grads_ = static_cast<std::byte*>(traits::grads(*leaf_));
    bytes_ = bytes;
    domain_ = &domain;
    to_ddp(values, home_values_);
    to_ddp(grads, home_grads_);
    rebind(values, grads, true);
  }
  void rebind(std::byte* values, std::byte* grads, bool present) override {
    values_ = values;
    grads_ = grads;
    if constexpr (requires { traits::vacate(*leaf_, values, grads); }) {
      if (!present) {
        traits::vacate(*leaf_, values, grads);
        return;
      }
    }
    if constexpr (adopting) traits::adopt(*leaf_, values, grads);
  }
  void unbind() override {
    if constexpr (adopting) {
      if constexpr (requires { traits::release(*leaf_); }) {
        traits::release(*leaf_);
      } else {
        to_home(home_values_, values_);
        to_home(home_grads_, grads_);
        traits::adopt(*leaf_, home_values_, home_grads_);
      }
    }
  }
  void gradient_in() override {
    if constexpr (!adopting) to_ddp(grads_, home_grads_);
  }
  void values_out() override {
    if constexpr (!adopting) to_home(home_values_, values_);
  }
  void zero_own_gradient() override {
    if constexpr (!adopting) host_memory().zero(home(home_grads_));
  }
  std::shared_ptr<void> watch(std::function<void()> ready) override {
    if constexpr (watching_leaf<T>)
      return traits::watch(*leaf_, std::move(ready));
    else
      return nullptr;
  }

 private:
  /// The leaf's own bytes at `p` (host memory: the leaves ddp copies own theirs there).
  [[nodiscard]] raw_tensor home(const std::byte* p) const noexcept {
    return {const_cast<std::byte*>(p), bytes_, dtype::u8, device::cpu()};
  }
  /// ddp's bytes at `p`, in the bound domain.
  [[nodiscard]] raw_tensor ours(const std::byte* p) const noexcept {
    return {const_cast<std::byte*>(p), bytes_, dtype::u8, domain_->where()};
  }
  /// The leaf's bytes at `from` into ddp's at `to`.
  void to_ddp(std::byte* to, const std::byte* from) const {
    if (bytes_ && to != from) domain_->copy(home(from), ours(to));
  }
  /// ddp's bytes at `from` into the leaf's at `to`.
  void to_home(std::byte* to, const std::byte* from) const {
    if (bytes_ && to != from) domain_->copy(ours(from), home(to));
  }
  std::optional<T> copy_;            // view leaves: the leaf itself
  T* leaf_;                          // the leaf
  std::byte* home_values_ = nullptr;  // its own memory, as first found
  std::byte* home_grads_ = nullptr;
  std::byte* values_ = nullptr;       // where it is bound now
  std::byte* grads_ = nullptr;
  std::size_t bytes_ = 0;
  memory_domain* domain_ = &host_memory();  // where ddp's copy lives (bind sets it)
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/leaf_binding.hpp>

namespace ddp::detail {

/// One parameter of the wrapped model and where it lies.
struct param_slot {
  std::string name;                ///< dotted name
  std::vector<std::size_t> shape;  ///< shape
  dtype type = dtype::f32;         ///< element type
  std::size_t numel = 0;           ///< elements
  const void* key = nullptr;       ///< the address gradient_ready knows it by
  std::size_t arena = 0;           ///< index of its arena
  std::size_t offset = 0;          ///< first element inside the arena
  std::size_t unit = 0;            ///< index of its unit (by default the model's top-level field holding it)
  std::shared_ptr<leaf_binding> leaf;  ///< the model's leaf and how it is bound

  /// "fc1.weight f32[13, 7]": what ranks compare.
  [[nodiscard]] std::string describe() const {
    std::string s = name + " " + std::string(to_string(type)) + "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

/// One dtype's flat values and gradients, in one memory domain.
struct arena {
  dtype type = dtype::f32;          ///< element type
  dtype reduce_type = type;         ///< the dtype its gradients are reduced in (wider under ddp::mixed_precision)
  std::size_t numel = 0;            ///< elements
  memory_domain* domain = nullptr;  ///< where its memory lives and its element work runs
  domain_buffer values;             ///< parameter values, in visit order
  domain_buffer grads;              ///< gradients, same layout
  std::vector<std::size_t> params;  ///< slots laid here, in visit order

  /// Elements [begin, begin + count) of the values.
  [[nodiscard]] raw_tensor value_view(std::size_t begin, std::size_t count) const noexcept {
    return values.view(type, begin, count);
  }
  /// Elements [begin, begin + count) of the gradients.
  [[nodiscard]] raw_tensor grad_view(std::size_t begin, std::size_t count) const noexcept {
    return grads.view(type, begin, count);
  }
};

/// Names the sharding unit of each parameter by data_parallel_options::units and unit_depth, and checks
/// that every listed prefix covers a parameter.
class unit_rule {
 public:
  explicit unit_rule(const data_parallel_options& options)
      : prefixes_(options.units), depth_(options.unit_depth), used_(options.units.size(), 0) {
    if (depth_ == 0)
      throw config_error("data_parallel: unit_depth is 0; set data_parallel_options::unit_depth to 1 (the model's "
                         "top-level fields) or more");
  }
  /// The unit of the parameter `name`: the longest listed prefix it starts with, else its first components.
  std::string_view unit_of(std::string_view name) {
    std::size_t best = prefixes_.size();
    for (std::size_t i = 0; i < prefixes_.size(); ++i) {
      const std::string& p = prefixes_[i];
      const bool covers = name.starts_with(p) && (name.size() == p.size() || name[p.size()] == '.');
      if (covers && (best == prefixes_.size() || p.size() > prefixes_[best].size())) best = i;
    }
    if (best < prefixes_.size()) {
      used_[best] = 1;
      return name.substr(0, prefixes_[best].size());
    }
    std::size_t end = 0;
    for (std::size_t k = 0; k < depth_ && end != std::string_view::npos; ++k)
      end = name.find('.', k == 0 ? 0 : end + 1);
    return name.substr(0, end);
  }
  /// Throws ddp::config_error naming the first listed prefix that covered no parameter.
  void check_all_used() const {
    for (std::size_t i = 0; i < prefixes_.size(); ++i)
      if (!used_[i])
        throw config_error("data_parallel: the unit '" + prefixes_[i] + "' in data_parallel_options::units covers no "
                           "parameter; list dotted prefixes of the names visit_parameters gives (such as 'fc1' or "
                           "'encoder.layers.0')");
  }

 private:
  std::vector<std::string> prefixes_;
  std::size_t depth_;
  std::vector<char> used_;
};

/// The model's parameters laid into arenas. Binding happens at construction; the destructor gives every
/// parameter its values back, so the model stays usable after the wrapper is gone. With `pad` > 1 (the
/// sharded strategies) every unit starts at a multiple of `pad` elements inside its arena and every
/// arena's length is a multiple of `pad`; the gaps are zero and belong to no parameter. Units are
/// consecutive (in visit order) parameters of the same unit name, named as `options` says.
class parameter_layout {
 public:
  template <class Model>
  explicit parameter_layout(Model& model, std::size_t pad = 1, const data_parallel_options& options = {}) {
    unit_rule rule(options);
    visit_parameters(model, [&](std::string_view name, auto& p) {
      using P = std::remove_reference_t<decltype(p)>;
      using T = std::remove_cv_t<P>;
      static_assert(!std::is_const_v<P> || leaf_is_view<T>,
                    "ddp::data_parallel: the model's visitor hands out const parameters; wrap a mutable model "
                    "(data_parallel rebinds each parameter to its flat arena).");
      using traits = storage_traits<T>;
      if constexpr (requires { traits::device(p); })
        if (traits::device(p).is_cuda())
          throw config_error("data_parallel: parameter '" + std::string(name) + "' lives on " +
                             traits::device(p).to_string() +
                             "; this wrapper lays host parameters into host arenas, keep the model on the CPU");
      param_slot s;
      s.name = std::string(name);
      s.shape = traits::shape(p);
      s.type = traits::dtype(p);
      s.numel = 1;
      for (const auto d : s.shape) s.numel *= d;
      s.key = leaf_key(p);
      s.leaf = std::make_shared<leaf_binding_of<T>>(const_cast<T&>(p));
      adopting_ = adopting_ && s.leaf->adopts();
      const std::string_view unit = rule.unit_of(name);
      if (units_.empty() || units_.back() != unit) units_.emplace_back(unit);
      s.unit = units_.size() - 1;
      if (!index_.emplace(s.key, slots_.size()).second)
        throw config_error("data_parallel: parameter '" + s.name + "' is visited twice; a model must reach each "
                           "leaf once (shared parameters are not supported)");
      slots_.push_back(std::move(s));
    });
    rule.check_all_used();
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      auto& s = slots_[i];
      auto it = std::find_if(arenas_.begin(), arenas_.end(), [&](const arena& a) { return a.type == s.type; });
      if (it == arenas_.end()) {
        arenas_.emplace_back().type = s.type;
        arenas_.back().reduce_type = s.type;
        it = arenas_.end() - 1;
      }
      s.arena = static_cast<std::size_t>(it - arenas_.begin());
      const bool starts_unit = it->params.empty() || slots_[it->params.back()].unit != s.unit;
      if (starts_unit) it->numel = (it->numel + pad - 1) / pad * pad;
      s.offset = it->numel;
      it->numel += s.numel;
      it->params.push_back(i);
    }
    for (auto& a : arenas_) {
      a.numel = (a.numel + pad - 1) / pad * pad;
      a.domain = &host_memory();
      a.values = a.domain->allocate(a.numel * size_of(a.type));
      a.grads = a.domain->allocate(a.numel * size_of(a.type));
    }
    for (auto& s : slots_) {
      const std::size_t at = s.offset * size_of(s.type);
      s.leaf->bind(arenas_[s.arena].values.data() + at, arenas_[s.arena].grads.data() + at, s.numel * size_of(s.type),
                   *arenas_[s.arena].domain);
    }
  }
  parameter_layout(const parameter_layout&) = delete;
  parameter_layout& operator=(const parameter_layout&) = delete;
  ~parameter_layout() {
    for (auto& s : slots_) s.leaf->unbind();
  }

  /// True when every leaf computes on the arenas (none is copied at the step's edges).
  [[nodiscard]] bool adopting() const noexcept { return adopting_; }
  /// Owning leaves: copies their values out of the arenas (after the arenas' values changed).
  void values_out() const {
    if (!adopting_)
      for (const auto& s : slots_) s.leaf->values_out();
  }

  /// Every parameter, in visit order.
  [[nodiscard]] std::span<const param_slot> slots() const noexcept { return slots_; }
  /// The units' names (by default the model's top-level fields holding parameters), in visit order.
  [[nodiscard]] std::span<const std::string> units() const noexcept { return units_; }
  /// Every parameter's unit, in visit order.
  [[nodiscard]] std::vector<std::size_t> slot_units() const {
    std::vector<std::size_t> out;
    for (const auto& s : slots_) out.push_back(s.unit);
    return out;
  }
  /// Every arena (one per dtype, in order of first appearance).
  [[nodiscard]] std::span<const arena> arenas() const noexcept { return arenas_; }
  /// Every arena, writable (the strategies release and refill their pages).
  [[nodiscard]] std::span<arena> arenas() noexcept { return arenas_; }
  /// The slot of the leaf known by `address` (storage_traits' key: the leaf's own address by default), or -1.
  [[nodiscard]] std::ptrdiff_t find(const void* address) const noexcept {
    const auto it = index_.find(address);
    return it == index_.end() ? -1 : static_cast<std::ptrdiff_t>(it->second);
  }
  /// The slot named `name`, or -1.
  [[nodiscard]] std::ptrdiff_t find(std::string_view name) const noexcept {
    const auto it = std::find_if(slots_.begin(), slots_.end(), [&](const param_slot& s) { return s.name == name; });
    return it == slots_.end() ? -1 : it - slots_.begin();
  }

 private:
  std::vector<param_slot> slots_;
  std::vector<arena> arenas_;
  std::vector<std::string> units_;
  std::unordered_map<const void*, std::size_t> index_;
  bool adopting_ = true;
};

/// Per slot of `layout`, 1 where options' unused_parameters names it; throws config_error for an unknown name.
inline std::vector<char> unused_mask(const parameter_layout& layout, const std::vector<std::string>& names, int rank) {
  std::vector<char> unused(layout.slots().size(), 0);
  for (const auto& name : names) {
    const auto i = layout.find(std::string_view(name));
    if (i < 0)
      throw config_error("data_parallel: '" + name + "' is declared unused but the model has no such parameter; "
                         "use the dotted names visit_parameters gives (such as 'fc1.weight')", rank);
    unused[static_cast<std::size_t>(i)] = 1;
  }
  return unused;
}

/// Throws config_error unless every leaf of `layout` adopts ddp's memory, which full_shard needs to shard it.
inline void require_adopting(const parameter_layout& layout, int rank) {
  if (layout.adopting()) return;
  for (const auto& s : layout.slots())
    if (!s.leaf->adopts())
      throw config_error("data_parallel: parameter '" + s.name + "' is of a type that keeps its own memory "
                         "(an owning matrix or vector), so full_shard could not shard it; give the model leaves "
                         "that adopt ddp's memory (ddp::parameter, std::span, Eigen::Map, torch::Tensor) or use "
                         "ddp::shard_grad_op", rank);
}

}  // namespace ddp::detail
// ---- end <ddp/parallel/arena.hpp>
// ---- begin <ddp/parallel/backward_scopes.hpp>
/// \file ddp::detail::backward_scopes: the unshard scopes a framework's backward opens on units and that close by
/// themselves. Autograd runs a unit's part of the backward without the caller, so no RAII scope can wrap it: a
/// hook that runs when the backward reaches the unit opens one (data_parallel::unshard_guard::for_backward), and
/// it closes once every parameter of the unit has reported its gradient in that backward, or at the end of the
/// backward (finish_gradients) for a unit some of whose parameters received no gradient.


namespace ddp::detail {

/// Which units a backward holds open, and when each may close (a part of the step state, parallel/step_state.hpp).
class backward_scopes {
 public:
  /// `units` units; `slot_units[s]` is the unit of parameter s.
  backward_scopes(std::span<const std::size_t> slot_units, std::size_t units) : open_(units, 0), slots_(units) {
    for (std::size_t s = 0; s < slot_units.size(); ++s) slots_[slot_units[s]].push_back(s);
  }
  /// Of `units`, those not open yet, now open (a unit reached twice in one backward is opened once).
  std::vector<std::size_t> open(std::span<const std::size_t> units) {
    std::vector<std::size_t> opened;
    for (const std::size_t u : units)
      if (!open_[u]) {
        open_[u] = 1;
        opened.push_back(u);
      }
    return opened;
  }
  /// Parameter `slot` of `unit` reported: the unit, now closed, when a backward holds it open and every parameter
  /// of it has reported in this step (`reported`, per slot).
  std::optional<std::size_t> reported(std::size_t slot, std::size_t unit, std::span<const char> reported) {
    if (!open_[unit] || !reported[slot]) return std::nullopt;
    for (const std::size_t s : slots_[unit])
      if (!reported[s]) return std::nullopt;
    open_[unit] = 0;
    return unit;
  }
  /// Every unit still open, now closed (the backward is over).
  std::vector<std::size_t> close_all() {
    std::vector<std::size_t> closed;
    for (std::size_t u = 0; u < open_.size(); ++u)
      if (open_[u]) {
        open_[u] = 0;
        closed.push_back(u);
      }
    return closed;
  }

 private:
  std::vector<char> open_;                        // per unit: a backward holds it open
  std::vector<std::vector<std::size_t>> slots_;   // per unit: its parameters
};

}  // namespace ddp::detail

namespace ddp {

/// Opens a scope on its units for their part of the backward, which closes by itself once each of their
/// parameters has reported its gradient (or in finish_gradients(), for those that received none); a unit so
/// opened already in this backward stays as it is. For frameworks that run the backward themselves (autograd):
/// call it from a hook that runs when the backward reaches the units, as ddp::forward of the LibTorch adapter
/// does. Collective under full_shard (all-gathers the units and prefetches the next one in the backward's
/// direction); a no-op under replicate. Made by data_parallel's unshard_guard::for_backward().
template <class DP>
class backward_opener {
 public:
  /// Reopens `units` of `dp` when called.
  backward_opener(DP& dp, std::vector<std::size_t> units) : dp_(&dp), units_(std::move(units)) {}
  /// Opens the scope.
  void operator()() const { dp_->open_backward(units_); }

 private:
  DP* dp_;
  std::vector<std::size_t> units_;
};

}  // namespace ddp
// ---- end <ddp/parallel/backward_scopes.hpp>
// ---- begin <ddp/parallel/bucket_rebuild.hpp>
/// \file Buckets rebuilt in the order of the first step's gradients (PyTorch DDP rebuilds its buckets after the
/// first iteration). The first synchronized step records the order in which its gradients became ready
/// (step_state::report_order); rank 0's order is broadcast, so every rank plans the same buckets whatever order
/// its own backward ran in; and unless that order is the reverse visit order the planner already assumed, the
/// buckets are planned again in it (plan_in_ready_order), once, so that later steps start each bucket as soon as
/// the backward has produced its gradients. Under replicate (data_parallel_options::rebuild_buckets); the
/// sharded strategies keep buckets inside units and follow their unshard scopes, and keep the planned order.


// ---- begin <ddp/parallel/bucket_planner.hpp>
/// \file Gradient buckets: byte ranges of a gradient arena, planned in reverse visit order so the
/// buckets whose gradients the backward produces first are started first, and replanned in the order a
/// step's gradients became ready (parallel/bucket_rebuild.hpp).

#include <iterator>


namespace ddp::detail {

/// A zero-copy slice [begin, end) of one arena's gradients. Its boundaries may fall inside a parameter:
/// a parameter completes every bucket it overlaps.
struct bucket {
  std::size_t arena = 0;            ///< arena index
  std::size_t begin = 0;            ///< first element
  std::size_t end = 0;              ///< one past the last element
  std::vector<std::size_t> params;  ///< slots overlapping the range
  std::size_t last_slot = 0;        ///< the highest slot (latest in visit order) it holds; orders starts
  std::size_t unit = 0;             ///< the unit of `last_slot` (the only unit when planned unit-aligned)
};

/// Where a bucket may begin: anywhere in its arena (replicate), or never across the start of a unit (the
/// sharded strategies, so that unsharding a unit all-gathers whole buckets).
enum class bucket_cut : std::uint8_t { anywhere, within_units };

/// The buckets of a layout in start order, and for every slot the buckets it overlaps.
struct bucket_plan {
  std::vector<bucket> buckets;                        ///< start order: reverse visit order, or ready order once rebuilt
  std::vector<std::vector<std::size_t>> of_param;     ///< per slot, indices into `buckets`

  /// Fills `of_param` from `buckets` for a layout of `slots` parameters.
  void index(std::size_t slots) {
    of_param.assign(slots, {});
    for (std::size_t b = 0; b < buckets.size(); ++b)
      for (const std::size_t s : buckets[b].params) of_param[s].push_back(b);
  }
};

/// The bucket [begin, end) of arena `a`, holding every non-empty slot it overlaps.
inline bucket make_bucket(const parameter_layout& layout, std::size_t a, std::size_t begin, std::size_t end) {
  const auto slots = layout.slots();
  bucket b{.arena = a, .begin = begin, .end = end, .params = {}, .last_slot = 0, .unit = 0};
  for (const std::size_t s : layout.arenas()[a].params)
    if (slots[s].offset < end && slots[s].offset + slots[s].numel > begin && slots[s].numel > 0) b.params.push_back(s);
  b.last_slot = b.params.empty() ? 0 : b.params.back();
  b.unit = slots[b.last_slot].unit;
  return b;
}

/// Cuts each arena from its end into buckets of `first_bytes` (the first), then `capacity_bytes` each,
/// and orders all buckets by their latest parameter, last first. For the sharded strategies (on a layout
/// padded to `multiple`) bucket lengths are multiples of `multiple` elements so each splits into equal
/// shards, and with bucket_cut::within_units no bucket crosses the start of a unit.
inline bucket_plan plan_buckets(const parameter_layout& layout, std::size_t capacity_bytes, std::size_t first_bytes,
                                std::size_t multiple = 1, bucket_cut cut = bucket_cut::anywhere) {
  bucket_plan plan;
  const auto arenas = layout.arenas();
  const auto slots = layout.slots();
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    const std::size_t width = size_of(arenas[a].type);
    std::vector<std::size_t> unit_starts{0};
    if (cut == bucket_cut::within_units)
      for (std::size_t k = 1; k < arenas[a].params.size(); ++k)
        if (slots[arenas[a].params[k]].unit != slots[arenas[a].params[k - 1]].unit)
          unit_starts.push_back(slots[arenas[a].params[k]].offset);
    std::size_t end = arenas[a].numel;
    bool first = true;
    while (end > 0) {
      const std::size_t cap = std::max(multiple, (first ? first_bytes : capacity_bytes) / width / multiple * multiple);
      const std::size_t floor = *std::prev(std::lower_bound(unit_starts.begin(), unit_starts.end(), end));
      const std::size_t begin = std::max(end > cap ? end - cap : 0, floor);
      plan.buckets.push_back(make_bucket(layout, a, begin, end));
      end = begin;
      first = false;
    }
  }
  std::stable_sort(plan.buckets.begin(), plan.buckets.end(), [](const bucket& x, const bucket& y) {
    return std::tie(x.last_slot, x.end) > std::tie(y.last_slot, y.end);
  });
  plan.index(slots.size());
  return plan;
}

/// Buckets in the order of `ready` (every slot once, in the order their gradients became ready), for a layout
/// without padding (replicate). Each bucket is a contiguous range of its arena: from the next slot to become
/// ready, the longest run of the slots that follow it in `ready` whose union is contiguous and fits the
/// capacity (`first_bytes` for an arena's first bucket); a slot larger than the capacity alone is cut into
/// pieces, last elements first (after the first piece, of the full capacity). Buckets start in the order their
/// last slot became ready.
inline bucket_plan plan_in_ready_order(const parameter_layout& layout, std::span<const std::size_t> ready,
                                       std::size_t capacity_bytes, std::size_t first_bytes) {
  const auto arenas = layout.arenas();
  const auto slots = layout.slots();
  std::vector<std::size_t> place(slots.size());  // a slot's index among its arena's slots
  for (const auto& a : arenas)
    for (std::size_t k = 0; k < a.params.size(); ++k) place[a.params[k]] = k;
  std::vector<std::pair<std::size_t, bucket>> made;  // (when its last slot became ready, the bucket)
  for (std::size_t a = 0; a < arenas.size(); ++a) {
    std::vector<std::size_t> seq, when;  // arena a's non-empty slots in ready order, and their places in `ready`
    for (std::size_t i = 0; i < ready.size(); ++i)
      if (slots[ready[i]].arena == a && slots[ready[i]].numel > 0) {
        seq.push_back(ready[i]);
        when.push_back(i);
      }
    const std::size_t width = size_of(arenas[a].type);
    for (std::size_t i = 0; i < seq.size();) {
      const std::size_t cap = std::max<std::size_t>(1, (i == 0 ? first_bytes : capacity_bytes) / width);
      std::size_t lo = place[seq[i]], hi = lo, total = slots[seq[i]].numel, last = i, run_lo = lo, run_hi = hi;
      for (std::size_t j = i + 1; j < seq.size() && (total += slots[seq[j]].numel) <= cap; ++j) {
        lo = std::min(lo, place[seq[j]]);
        hi = std::max(hi, place[seq[j]]);
        if (hi - lo == j - i) std::tie(last, run_lo, run_hi) = std::tuple(j, lo, hi);
      }
      const auto& low = slots[arenas[a].params[run_lo]];
      const auto& high = slots[arenas[a].params[run_hi]];
      // One piece, unless a slot exceeds the capacity: then pieces of `cap`, further ones of the full capacity.
      for (std::size_t end = high.offset + high.numel, piece = cap; end > low.offset;) {
        const std::size_t begin = std::max(low.offset, end > piece ? end - piece : 0);
        made.emplace_back(when[last], make_bucket(layout, a, begin, end));
        end = begin;
        piece = std::max<std::size_t>(1, capacity_bytes / width);
      }
      i = last + 1;
    }
  }
  std::stable_sort(made.begin(), made.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  bucket_plan plan;
  for (auto& m : made) plan.buckets.push_back(std::move(m.second));
  plan.index(slots.size());
  return plan;
}

}  // namespace ddp::detail
// ---- end <ddp/parallel/bucket_planner.hpp>
// ---- begin <ddp/parallel/step_state.hpp>
/// \file ddp::detail::step_state: the one record of where a training step stands. Per bucket a phase
/// (waiting → started → [chained] → reduced), the parameters it still waits for and the handles of its
/// reduction; per unit the phase of its values (sharded → unsharding → unsharded → sharded again on reshard),
/// of its full-gradient storage (released → held → reported) and its open unshard scopes; per slot whether it
/// reported in this step, and the order of the reports; the step itself (idle → reporting → finished → idle);
/// and what lasts across calls: the join scope (join_state), the open no_sync spans and the units a
/// framework's backward holds open (backward_scopes). data_parallel owns it and the strategies move buckets and
/// units through it; a transition the phases do not allow raises ddp::error.


// ---- begin <ddp/parallel/join_state.hpp>
/// \file ddp::detail::join_state: where a data_parallel stands with respect to a join scope (parallel/join.hpp):
/// open or not, this rank still training or joined, whether this step was counted and by how many ranks, and
/// under full_shard the calls of the step in progress and of the last one taken, which a shadow step replays.
/// The step state (parallel/step_state.hpp) owns it.


// ---- begin <ddp/parallel/phases.hpp>
/// \file The phases a training step moves through: the step's, each bucket's, each unit's values and gradient
/// storage (parallel/step_state.hpp keeps them and checks every move).


namespace ddp::detail {

/// Where a synchronized backward stands.
enum class step_phase : std::uint8_t {
  idle,       ///< no gradient reported since the last step (or since zero_grad after finish_gradients)
  reporting,  ///< gradients are being reported and buckets started
  finished,   ///< finish_gradients() completed: every bucket is reduced, step() may run
};
/// Where one bucket's reduction stands in the step.
enum class bucket_phase : std::uint8_t {
  waiting,   ///< parameters still to report, or an earlier bucket still to start
  started,  ///< its all-reduce (replicate) or reduce-scatter (sharded) is in flight
  chained,   ///< hybrid: the reduce-scatter completed and the cross-group all-reduce is in flight
  reduced,   ///< its gradients are final for this step
};
/// Where a unit's parameter values stand (shard_grad_op and replicate keep every unit unsharded).
enum class unit_phase : std::uint8_t {
  sharded,     ///< only the owned blocks exist
  unsharding,  ///< all-gathers into its pooled buffer are in flight (an unshard scope or a prefetch)
  unsharded,   ///< the full values are present
};
/// Where a unit's full-gradient storage stands (the sharded strategies).
enum class grad_phase : std::uint8_t {
  released,  ///< no storage: its parameters' gradients point at zero pages
  held,      ///< a pooled buffer, zero or already reduced: nothing pending
  reported,  ///< gradients were reported into it and its buckets are not all reduced
};

/// The phase's name, for messages.
constexpr const char* to_string(step_phase p) noexcept {
  constexpr const char* names[] = {"idle", "reporting", "finished"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(bucket_phase p) noexcept {
  constexpr const char* names[] = {"waiting", "started", "chained", "reduced"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(unit_phase p) noexcept {
  constexpr const char* names[] = {"sharded", "unsharding", "unsharded"};
  return names[static_cast<int>(p)];
}
/// The phase's name, for messages.
constexpr const char* to_string(grad_phase p) noexcept {
  constexpr const char* names[] = {"released", "held", "reported"};
  return names[static_cast<int>(p)];
}

}  // namespace ddp::detail
// ---- end <ddp/parallel/phases.hpp>

namespace ddp::detail {

/// One call of a full_shard step that a shadowing rank replays: a scope opens or closes on units, or a slot
/// reports its gradient.
struct step_event {
  enum class kind : std::uint8_t { acquire, release, report };
  kind what = kind::report;  ///< the call
  std::size_t first = 0;     ///< acquire, release: where the scope's units start in the step_record's units
  std::size_t count = 0;     ///< acquire, release: how many units
  std::size_t slot = 0;      ///< report: the parameter
};

/// The calls of one full_shard step, in order; the units of all its scopes in one list, so that recording a
/// step allocates nothing once the record has held a step as long.
struct step_record {
  std::vector<step_event> events;   ///< the calls
  std::vector<std::size_t> units;   ///< every acquire's and release's units, one after another

  /// Event `e`'s units.
  [[nodiscard]] std::span<const std::size_t> units_of(const step_event& e) const noexcept {
    return std::span<const std::size_t>(units).subspan(e.first, e.count);
  }
  /// Forgets the calls, keeping the memory.
  void clear() noexcept {
    events.clear();
    units.clear();
  }
};

/// Where a data_parallel stands with respect to a join scope: open or not, this rank still training or
/// joined, whether this step was counted and by how many ranks; under full_shard (`trace`) the calls of the
/// step in progress and of the last one taken, which a shadow step replays.
class join_state {
 public:
  explicit join_state(bool trace) noexcept : trace_(trace) {}

  /// Whether this rank is shadowing the others' step (its missing reports are zeros, not an error).
  [[nodiscard]] bool shadowing() const noexcept { return shadowing_; }

  /// Throws the error of a scope that was left without finish(opt); `where` names the call.
  void check(const char* where, int rank) const {
    if (dropped_)
      throw error(std::string(where) + ": a join scope (dp.join()) ended without j.finish(opt) completing, so the "
                  "other ranks may be waiting for this rank's collectives; call j.finish(opt) after the rank's last "
                  "batch on every rank (also when leaving the loop early), and make a new wrapper to train on after "
                  "this error", rank);
  }
  /// A join scope opens (local): none may be open, and no step may be in progress.
  void open_scope(step_phase phase, int rank) {
    check("join", rank);
    if (open_) throw error("join: a join scope is already open on this wrapper; finish it first", rank);
    if (phase == step_phase::reporting || counted_)
      throw error("join: a step is in progress; open the join scope before the epoch's first batch", rank);
    open_ = true;
    active_ = true;
  }
  /// A sharded policy's no_sync span reduce-scatters each micro-batch, which a shadowing rank cannot mirror.
  void refuse_no_sync(int rank) const {
    if (open_)
      throw config_error("no_sync: inside a join scope, gradient accumulation is supported under ddp::replicate "
                         "only (the sharded policies reduce every micro-batch, which a rank that ran out of batches "
                         "cannot shadow); accumulate outside the join scope, or use replicate", rank);
  }

  /// The step's first collective on a rank still training inside a join scope: counts the active ranks.
  template <class Comm>
  void begin_step(Comm& comm) {
    if (!open_ || !active_ || counted_) return;
    active_ranks_ = count(comm, 1);
    counted_ = true;
  }
  /// The number of ranks whose contribution is `mine` (1: training, 0: joined), summed over `comm`. Blocking.
  template <class Comm>
  static int count(Comm& comm, int mine) {
    std::array<std::int32_t, 1> sum{mine};
    comm.all_reduce(std::span<std::int32_t>(sum), reduce_op::sum).wait();
    return sum[0];
  }
  /// The reduced gradients in `buffers`, averaged over `world` ranks, become the average over the active ones.
  void rescale(std::span<const optim::flat_buffer> buffers, int world) const {
    if (!counted_ || active_ranks_ == world || active_ranks_ <= 0) return;
    for (const auto& b : buffers) b.memory().scale(b.grads, static_cast<double>(world) / active_ranks_);
  }
  /// The step ended (the optimizer stepped): the next one is counted again; under full_shard the calls of the
  /// step this rank took inside a join scope become the ones a shadow step replays (kept across scopes).
  void end_step() noexcept {
    counted_ = false;
    if (shadowing_) {
      shadowing_ = false;
    } else if (trace_ && open_) {
      std::swap(replay_, recording_);
      recording_.clear();
    }
  }
  /// Notes a call of the step in progress (full_shard, while this rank trains inside a join scope): a scope on
  /// `units` opens or closes, or `slot` reports.
  void note(step_event::kind what, std::span<const std::size_t> units, std::size_t slot = 0) {
    if (!trace_ || !open_ || !active_) return;
    recording_.events.push_back({.what = what, .first = recording_.units.size(), .count = units.size(), .slot = slot});
    recording_.units.insert(recording_.units.end(), units.begin(), units.end());
  }

  /// This rank ran out of batches (finish begins); a step must not be in progress.
  void leave(step_phase phase, int rank) {
    check("join_scope::finish", rank);
    if (phase == step_phase::reporting || counted_)
      throw error("join_scope::finish: a step is in progress on this rank; call j.finish(opt) after the rank's last "
                  "dp.step(opt)", rank);
    active_ = false;
  }
  /// A shadow step of `active` ranks begins: returns the calls to replay (full_shard), else nothing.
  [[nodiscard]] const step_record& shadow(int active, int rank) {
    if (trace_ && replay_.events.empty())
      throw error("join_scope::finish: under full_shard a rank that ran out shadows the others' step by replaying "
                  "its own last step's unshard scopes and reports, and this rank has taken no step inside a join scope "
                  "yet; give every rank at least one batch in its first joined epoch, or use ddp::shard_grad_op", rank);
    active_ranks_ = active;
    counted_ = true;
    shadowing_ = true;
    return replay_;
  }
  /// Every rank finished: the scope closes.
  void close() noexcept { open_ = false; }
  /// The scope ended without finish(opt): the wrapper's next call throws.
  void drop() noexcept {
    open_ = false;
    dropped_ = true;
  }

 private:
  bool trace_;                         // full_shard: record the steps' calls for shadow steps
  bool open_ = false;                  // a join scope is open
  bool active_ = false;                // this rank still trains (has not called finish)
  bool counted_ = false;               // this step's active ranks are counted
  bool shadowing_ = false;             // this step is a shadow of the others'
  bool dropped_ = false;               // a scope ended without finish(opt)
  int active_ranks_ = 0;               // ranks training in this step
  step_record recording_;              // full_shard: the calls of the step in progress
  step_record replay_;                 // full_shard: the calls of the last step taken
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/join_state.hpp>

namespace ddp::detail {

/// One bucket in the step.
struct bucket_record {
  bucket_phase phase = bucket_phase::waiting;  ///< where its reduction stands
  std::size_t pending = 0;                     ///< parameters still to report in this step
  work reduction;                              ///< started: its all-reduce or reduce-scatter
  work average;                                ///< chained: hybrid's cross-group all-reduce
};
/// One unit in the step.
struct unit_record {
  unit_phase values = unit_phase::unsharded;     ///< its parameter values
  grad_phase grads = grad_phase::released;       ///< its full-gradient storage
  int scopes = 0;                                ///< open unshard scopes on it
  std::vector<work> all_gathers;                 ///< unsharding: its buckets' all-gathers
};

/// The gradient-accumulation spans (dp.no_sync()) open on a wrapper.
struct no_sync_spans {
  int open = 0;           ///< spans open now
  bool unclosed = false;  ///< a span of a policy that reduces every micro-batch ended without completing it
};

/// The state of the step: every phase of every bucket, unit and slot, and the legal moves between them.
class step_state {
 public:
  /// Buckets of `plan`, a parameter per entry of `slot_units` (its unit), `units` units starting in phase
  /// `values`; `join_replays`: a join shadow step replays the last step's scopes and reports (full_shard); `rank`
  /// for messages.
  step_state(const bucket_plan& plan, std::span<const std::size_t> slot_units, std::size_t units, unit_phase values,
             bool join_replays, int rank)
      : plan_(plan), buckets_(plan.buckets.size()), units_(units), reported_(slot_units.size(), 0),
        join_(join_replays), backward_(slot_units, units), rank_(rank) {
    for (auto& u : units_) u.values = values;
    index_units();
    order_.reserve(slot_units.size());
  }
  step_state(const step_state&) = delete;
  step_state& operator=(const step_state&) = delete;
  ~step_state() { settle(); }

  /// Waits for every operation still in flight and drops their handles and errors (for destructors, which
  /// report nothing); the phases stay as they are.
  void settle() noexcept {
    const auto quietly = [](work& w) {
      try { w.wait(); } catch (...) {}  // NOLINT: a destructor reports nothing
      w = work{};
    };
    for (auto& b : buckets_) {
      quietly(b.reduction);
      quietly(b.average);
    }
    for (auto& u : units_)
      for (auto& w : u.all_gathers) quietly(w);
  }

  // ---- the step ----
  /// Where the step stands.
  [[nodiscard]] step_phase phase() const noexcept { return phase_; }
  /// idle or finished → reporting: every bucket waits for its parameters again; `unused` slots count as reported.
  void begin(std::span<const char> unused) {
    expect_step(phase_ != step_phase::reporting, "begin a step", "idle or finished");
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      auto& r = buckets_[b];
      if (r.phase == bucket_phase::started || r.phase == bucket_phase::chained) bad_move(b, bucket_phase::waiting);
      r.phase = bucket_phase::waiting;
      r.pending = plan_.buckets[b].params.size();
    }
    std::fill(reported_.begin(), reported_.end(), 0);
    order_.clear();
    next_ = 0;
    phase_ = step_phase::reporting;
    for (std::size_t s = 0; s < unused.size(); ++s)
      if (unused[s]) report(s);
  }
  /// Notes slot `s`'s report; false when it already reported in this step.
  bool report(std::size_t s) {
    expect_step(phase_ == step_phase::reporting, "report a gradient", "reporting");
    if (reported_[s]) return false;
    reported_[s] = 1;
    order_.push_back(s);
    for (const std::size_t b : plan_.of_param[s]) --buckets_[b].pending;
    return true;
  }
  /// The slots that reported in this step, in the order they reported.
  [[nodiscard]] std::span<const std::size_t> report_order() const noexcept { return order_; }
  /// Whether slot `s` reported in this step.
  [[nodiscard]] bool reported(std::size_t s) const noexcept { return reported_[s] != 0; }
  /// The next bucket to start if all its parameters reported (buckets start strictly in plan order).
  [[nodiscard]] std::optional<std::size_t> next_ready() const noexcept {
    if (phase_ != step_phase::reporting || next_ == buckets_.size() || buckets_[next_].pending > 0) return std::nullopt;
    return next_;
  }
  /// Buckets started in this step (a prefix of the plan).
  [[nodiscard]] std::size_t started() const noexcept { return next_; }
  /// reporting → finished: every bucket must be reduced.
  void finish() {
    expect_step(phase_ == step_phase::reporting, "finish the gradients", "reporting");
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].phase != bucket_phase::reduced) bad_move(b, bucket_phase::reduced);
    phase_ = step_phase::finished;
  }
  /// The plan was rebuilt (parallel/bucket_rebuild.hpp) in a finished step: one reduced record per new bucket.
  void replan() {
    expect_step(phase_ == step_phase::finished, "rebuild the buckets", "finished");
    buckets_.clear();
    buckets_.resize(plan_.buckets.size());
    for (auto& r : buckets_) r.phase = bucket_phase::reduced;
    next_ = buckets_.size();
    index_units();
  }
  /// reporting → idle when the step is given up (a missing report) after its started buckets were reduced.
  void abandon() {
    for (std::size_t b = 0; b < next_; ++b)
      if (buckets_[b].phase != bucket_phase::reduced) bad_move(b, bucket_phase::waiting);
    phase_ = step_phase::idle;
  }
  /// finished → idle (the optimizer stepped, or the gradients were zeroed).
  void end() noexcept {
    if (phase_ == step_phase::finished) phase_ = step_phase::idle;
  }

  // ---- buckets ----
  /// Bucket `b`'s record.
  [[nodiscard]] const bucket_record& bucket(std::size_t b) const noexcept { return buckets_[b]; }
  /// waiting → started with its reduction `w`; `b` must be the next bucket in plan order.
  void start(std::size_t b, work w) {
    if (b != next_ || phase_ != step_phase::reporting) bad_move(b, bucket_phase::started);
    move_bucket(b, bucket_phase::started, bucket_phase::waiting);
    buckets_[b].reduction = std::move(w);
    ++next_;
  }
  /// started → chained: the reduce-scatter completed, the cross-group all-reduce `w` is in flight.
  void chain(std::size_t b, work w) {
    move_bucket(b, bucket_phase::chained, bucket_phase::started);
    buckets_[b].reduction = work{};
    buckets_[b].average = std::move(w);
  }
  /// Waits for bucket `b`'s reduction (started) or cross-group average (chained).
  void wait(std::size_t b) {
    auto& r = buckets_[b];
    (r.phase == bucket_phase::chained ? r.average : r.reduction).wait();
  }
  /// Whether bucket `b`'s reduce-scatter has completed, without blocking.
  [[nodiscard]] bool scattered(std::size_t b) {
    const auto p = buckets_[b].phase;
    return p == bucket_phase::chained || p == bucket_phase::reduced || (p == bucket_phase::started && buckets_[b].reduction.done());
  }
  /// started or chained → reduced, once waited for.
  void complete(std::size_t b) {
    const auto p = buckets_[b].phase;
    move_bucket(b, bucket_phase::reduced, p == bucket_phase::chained ? bucket_phase::chained : bucket_phase::started);
    buckets_[b].reduction = work{};
    buckets_[b].average = work{};
  }

  // ---- units ----
  /// Unit `u`'s record.
  [[nodiscard]] const unit_record& unit(std::size_t u) const noexcept { return units_[u]; }
  /// Number of units.
  [[nodiscard]] std::size_t units() const noexcept { return units_.size(); }
  /// Unit `u`'s buckets, in start order.
  [[nodiscard]] std::span<const std::size_t> unit_buckets(std::size_t u) const noexcept { return unit_buckets_[u]; }
  /// Whether every bucket of unit `u` is out of flight (reduced, or not started in this step).
  [[nodiscard]] bool unit_settled(std::size_t u) const noexcept {
    for (const std::size_t b : unit_buckets_[u])
      if (buckets_[b].phase == bucket_phase::started || buckets_[b].phase == bucket_phase::chained) return false;
    return true;
  }
  /// An unshard scope opens on unit `u`.
  void open_scope(std::size_t u) noexcept { ++units_[u].scopes; }
  /// An unshard scope on unit `u` closes; true when it was the last one.
  bool close_scope(std::size_t u) {
    if (units_[u].scopes == 0)
      fail("unit " + std::to_string(u) + " has no open unshard scope to close");
    return --units_[u].scopes == 0;
  }
  /// sharded → unsharding with its all-gathers `gathers` in flight.
  void unshard(std::size_t u, std::vector<work> all_gathers) {
    move_unit(u, unit_phase::unsharding, unit_phase::sharded);
    units_[u].all_gathers = std::move(all_gathers);
  }
  /// unsharding → unsharded, waiting for its all-gathers.
  void unsharded(std::size_t u) {
    move_unit(u, unit_phase::unsharded, unit_phase::unsharding);
    wait_all(units_[u].all_gathers);
    units_[u].all_gathers.clear();
  }
  /// unsharded → sharded: the full values are freed.
  void reshard(std::size_t u) { move_unit(u, unit_phase::sharded, unit_phase::unsharded); }
  /// Moves unit `u`'s gradient storage to `to` from `from` (one of the phases named), else raises.
  void move_grads(std::size_t u, grad_phase to, std::initializer_list<grad_phase> from) {
    const grad_phase now = units_[u].grads;
    if (std::find(from.begin(), from.end(), now) == from.end())
      fail("the gradient storage of unit " + std::to_string(u) + " cannot go from " + to_string(now) + " to " +
           to_string(to));
    units_[u].grads = to;
  }


  // ---- what lasts across calls ----
  /// The join scope's state (parallel/join_state.hpp).
  [[nodiscard]] join_state& join() noexcept { return join_; }
  /// The join scope's state.
  [[nodiscard]] const join_state& join() const noexcept { return join_; }
  /// The open no_sync spans.
  [[nodiscard]] no_sync_spans& no_sync() noexcept { return no_sync_; }
  /// The open no_sync spans.
  [[nodiscard]] const no_sync_spans& no_sync() const noexcept { return no_sync_; }
  /// Of `units`, those the running backward has not opened yet, now open (backward_scopes).
  std::vector<std::size_t> open_backward(std::span<const std::size_t> units) { return backward_.open(units); }
  /// Slot `s` of unit `u` reported: the unit, now closed, when the backward held it open and every parameter of
  /// it has reported in this step.
  std::optional<std::size_t> close_backward(std::size_t s, std::size_t u) { return backward_.reported(s, u, reported_); }
  /// Every unit the backward still holds open, now closed (the backward is over).
  std::vector<std::size_t> close_all_backward() { return backward_.close_all(); }
 private:
  void index_units() {
    unit_buckets_.assign(units_.size(), {});
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) unit_buckets_[plan_.buckets[b].unit].push_back(b);
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw error("data_parallel step state: " + what + "; the step's calls came in an order the wrapper does not "
                "support (report with the sequence of gradient_ready, unshard, no_sync, finish_gradients and step "
                "calls that led here)", rank_);
  }
  void expect_step(bool ok, const char* action, const char* expected) const {
    if (!ok)
      throw error(std::string("data_parallel: cannot ") + action + " while the step is " + to_string(phase_) +
                  " (it must be " + expected + "); call zero_grad(), the backward's gradient_ready(p), "
                  "finish_gradients() and step(opt) in this order", rank_);
  }
  /// Bucket `b` goes to `to`; it must be in `from`.
  void move_bucket(std::size_t b, bucket_phase to, bucket_phase from) {
    if (buckets_[b].phase != from) bad_move(b, to);
    buckets_[b].phase = to;
  }
  [[noreturn]] void bad_move(std::size_t b, bucket_phase to) const {
    std::string why;
    if (to == bucket_phase::started && phase_ != step_phase::reporting) why = " while the step is " + std::string(to_string(phase_));
    else if (to == bucket_phase::started && b != next_) why = " out of plan order (bucket " + std::to_string(next_) + " is next)";
    fail("bucket " + std::to_string(b) + " cannot go from " + to_string(buckets_[b].phase) + " to " + to_string(to) + why);
  }
  void move_unit(std::size_t u, unit_phase to, unit_phase from) {
    if (units_[u].values != from)
      fail("unit " + std::to_string(u) + " cannot go from " + to_string(units_[u].values) + " to " + to_string(to));
    units_[u].values = to;
  }

  const bucket_plan& plan_;
  std::vector<bucket_record> buckets_;
  std::vector<unit_record> units_;
  std::vector<std::vector<std::size_t>> unit_buckets_;
  std::vector<char> reported_;  // per slot
  std::vector<std::size_t> order_;  // the slots that reported in this step, in order
  std::size_t next_ = 0;        // the next bucket to start
  step_phase phase_ = step_phase::idle;
  join_state join_;             // the join scope
  no_sync_spans no_sync_;       // gradient-accumulation spans
  backward_scopes backward_;    // units a framework's backward holds open
  int rank_;
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/step_state.hpp>

namespace ddp::detail {

/// Whether `ready` lists every arena's non-empty slots in reverse visit order (the order plan_buckets assumes).
inline bool in_reverse_visit_order(const parameter_layout& layout, std::span<const std::size_t> ready) {
  const auto slots = layout.slots();
  std::vector<std::size_t> last(layout.arenas().size(), slots.size());  // per arena, the last slot seen
  for (const std::size_t s : ready) {
    if (slots[s].numel == 0) continue;
    if (last[slots[s].arena] < s) return false;
    last[slots[s].arena] = s;
  }
  return true;
}

/// The one rebuild of a wrapper's buckets, after its first synchronized step.
class bucket_rebuild {
 public:
  /// `enabled`: rebuild after the first step; false keeps the planned buckets for good.
  explicit bucket_rebuild(bool enabled) noexcept : pending_(enabled) {}

  /// Collective the first time (a broadcast of rank 0's order over `comm` when it has several ranks), called on
  /// every rank once its step is finished: replans `plan` in rank 0's ready order and moves `state` to it.
  template <class Comm>
  void after_step(Comm& comm, const parameter_layout& layout, bucket_plan& plan, step_state& state,
                  std::size_t capacity_bytes, std::size_t first_bytes) {
    if (!pending_) return;
    pending_ = false;
    const auto slots = layout.slots();
    std::vector<std::int64_t> agreed;  // this rank's order, then the slots that never reported (empty ones)
    agreed.reserve(slots.size());
    for (const std::size_t s : state.report_order()) agreed.push_back(static_cast<std::int64_t>(s));
    for (std::size_t s = 0; s < slots.size(); ++s)
      if (!state.reported(s)) agreed.push_back(static_cast<std::int64_t>(s));
    if (comm.size() > 1) comm.broadcast(std::span<std::int64_t>(agreed), 0).wait();
    const std::vector<std::size_t> ready(agreed.begin(), agreed.end());
    if (in_reverse_visit_order(layout, ready)) return;
    plan = plan_in_ready_order(layout, ready, capacity_bytes, first_bytes);
    state.replan();
  }

 private:
  bool pending_;  // the first step has not been taken yet
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/bucket_rebuild.hpp>
// ---- begin <ddp/parallel/full_shard.hpp>
/// \file The full_shard strategy (ZeRO-3, FSDP FULL_SHARD): parameters live as owned blocks only. When the
/// user opens an unshard scope on a unit (dp.unshard(model.fc2)), the unit's parameters are bound to a pooled
/// buffer (the smallest idle one that fits; see unit_pool) and all-gathered into it, and the next unit in
/// the direction of travel (forward or backward) is prefetched into another. "Next" follows the execution
/// order: the order in which the scopes of the first step first opened the units (as FSDP2 records its
/// forward order), the same on every rank that runs the same program, turning around where a unit at either
/// end of it is opened again (the backward after the forward); during the first step, and for units it did
/// not use, the order of the fields. When the last scope on a unit
/// closes, the buffer goes back to the pool (full_shard::reshard_after_forward) and the parameters point
/// at zero pages again. Gradients are pooled and reduce-scattered as in shard_grad_op.


// ---- begin <ddp/parallel/replica_check.hpp>
/// \file The checks that ranks hold the same model: at construction, the same parameter names, shapes and dtypes
/// (verify_same_model); and data_parallel::verify_in_sync: each rank hashes, per parameter, the values
/// it holds (FNV-1a over the bytes, so replicas must agree bit for bit) and says which ranks hold the same
/// values (its peer key); one all_gather of two words per rank compares the combined hashes of peers. On a
/// difference the per-parameter hashes are exchanged and every rank throws ddp::mismatch_error naming the
/// first differing parameter and the ranks that disagree.



namespace ddp::detail {

/// FNV-1a over the parameter descriptions: the cheap first check that ranks hold the same model.
inline std::uint64_t layout_hash(const std::vector<std::string>& descriptions) {
  std::uint64_t h = fnv1a_basis;
  for (const auto& d : descriptions) h = fnv1a("\n", fnv1a(d, h));
  return h;
}

/// Throws ddp::mismatch_error unless every rank's list equals rank 0's, naming the first differing entry on each rank.
template <class Comm>
void verify_same_model(Comm& comm, const std::vector<std::string>& mine) {
  const auto h = static_cast<std::int64_t>(layout_hash(mine));
  std::vector<std::int64_t> hashes(static_cast<std::size_t>(comm.size()));
  comm.all_gather(std::span<const std::int64_t>(&h, 1), std::span<std::int64_t>(hashes)).wait();
  if (std::all_of(hashes.begin(), hashes.end(), [&](std::int64_t x) { return x == hashes[0]; })) return;
  const auto all = all_gather_object(comm, mine);
  std::size_t first = SIZE_MAX;  // the earliest entry where some rank disagrees with rank 0
  for (const auto& other : all) {
    const auto diff = std::mismatch(all[0].begin(), all[0].end(), other.begin(), other.end());
    if (diff.first != all[0].end() || diff.second != other.end())
      first = std::min(first, static_cast<std::size_t>(diff.first - all[0].begin()));
  }
  std::string what = "the model differs across ranks at parameter #" + std::to_string(first) + ":";
  for (std::size_t r = 0; r < all.size(); ++r)
    what += " rank " + std::to_string(r) + " has " + (first < all[r].size() ? "'" + all[r][first] + "'" : "nothing") +
            (r + 1 < all.size() ? ";" : "");
  throw mismatch_error(what + ". Every rank must build the same model (names, shapes and dtypes)", comm.rank());
}

/// What one rank holds of the model, for the replica check.
struct replica_digest {
  std::int64_t peers = 0;              ///< ranks with the same key must hold the same values
  std::vector<std::uint64_t> hashes;   ///< per parameter, in visit order: FNV-1a of the values held
};

/// The digest of a rank holding every parameter's full values at its place in the arenas.
inline replica_digest digest_full(const parameter_layout& layout) {
  replica_digest d;
  for (const auto& slot : layout.slots()) {
    const std::size_t w = size_of(slot.type);
    d.hashes.push_back(fnv1a(std::span(layout.arenas()[slot.arena].values.data() + slot.offset * w, slot.numel * w)));
  }
  return d;
}

/// The digest of a rank holding only its owned blocks (full_shard): the pieces of each parameter in `owned`,
/// compared with the ranks of the same `peers` key (the same shard-group rank).
inline replica_digest digest_owned(const parameter_layout& layout, std::span<const optim::flat_buffer> owned,
                                   int peers) {
  replica_digest d;
  d.peers = peers;
  d.hashes.assign(layout.slots().size(), fnv1a_basis);
  std::unordered_map<std::string_view, std::size_t> slot_of;
  for (std::size_t s = 0; s < layout.slots().size(); ++s) slot_of.emplace(layout.slots()[s].name, s);
  for (const auto& b : owned) {
    const auto* values = static_cast<const std::byte*>(b.values.data);
    const std::size_t w = size_of(b.values.type);
    for (const auto& seg : b.segments) {
      auto& h = d.hashes[slot_of.at(seg.name)];
      h = fnv1a(std::span(values + seg.offset * w, seg.numel * w), h);
    }
  }
  return d;
}

/// "ranks 0, 2 hold one value; rank 1 holds another": the ranks of `members`, grouped by their hash of `slot`.
inline std::string describe_disagreement(const std::vector<std::vector<std::uint64_t>>& hashes,
                                         const std::vector<int>& members, std::size_t slot) {
  std::vector<std::uint64_t> seen;
  std::string out;
  for (const int r : members) {
    const std::uint64_t h = hashes[static_cast<std::size_t>(r)][slot];
    if (std::find(seen.begin(), seen.end(), h) != seen.end()) continue;
    seen.push_back(h);
    std::vector<int> same;
    for (const int q : members)
      if (hashes[static_cast<std::size_t>(q)][slot] == h) same.push_back(q);
    std::string ranks = same.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < same.size(); ++i) ranks += (i ? ", " : "") + std::to_string(same[i]);
    out += (out.empty() ? "" : "; ") + ranks + (same.size() == 1 ? " holds " : " hold ") +
           (seen.size() == 1 ? "one value" : "another");
  }
  return out;
}

/// Collective over `comm`: returns when every rank's hashes equal those of each rank with its peer key;
/// otherwise throws ddp::mismatch_error on every rank, naming (through `name_of(slot)`) the first parameter
/// where some peers differ, and those peers' ranks grouped by value.
template <class Comm, class NameOf>
void verify_replicas(Comm& comm, const replica_digest& mine, NameOf name_of) {
  std::uint64_t combined = fnv1a_basis;
  for (const std::uint64_t h : mine.hashes) combined = fnv1a(std::as_bytes(std::span(&h, 1)), combined);
  const std::int64_t word[2] = {mine.peers, static_cast<std::int64_t>(combined)};
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> words(2 * n);
  comm.all_gather(std::span<const std::int64_t>(word, 2), std::span<std::int64_t>(words)).wait();
  bool in_sync = true;
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t q = 0; q < r; ++q)
      if (words[2 * r] == words[2 * q] && words[2 * r + 1] != words[2 * q + 1]) in_sync = false;
  if (in_sync) return;

  const auto hashes = all_gather_object(comm, mine.hashes);
  for (std::size_t slot = 0; slot < mine.hashes.size(); ++slot)
    for (std::size_t r = 0; r < n; ++r) {
      std::vector<int> peers;  // the ranks with r's key
      bool differ = false;
      for (std::size_t q = 0; q < n; ++q)
        if (words[2 * q] == words[2 * r]) {
          peers.push_back(static_cast<int>(q));
          differ = differ || hashes[q][slot] != hashes[r][slot];
        }
      if (!differ) continue;
      throw mismatch_error("verify_in_sync: the replicas differ at parameter '" + std::string(name_of(slot)) + "': " +
                               describe_disagreement(hashes, peers, slot) +
                               ". A gradient was reported before it was final, or ranks stepped different "
                               "optimizers (or changed parameters on some ranks only); call dp.gradient_ready(p) "
                               "only after p's gradient is complete, and step the same optimizer with the same "
                               "settings on every rank",
                           comm.rank());
    }
}

}  // namespace ddp::detail
// ---- end <ddp/parallel/replica_check.hpp>
// ---- begin <ddp/parallel/sharded.hpp>
/// \file What the sharding strategies (shard_grad_op, full_shard, hybrid) share. Arenas are padded so that
/// every bucket holds a multiple of N elements (N = ranks in the shard group) and no bucket crosses a
/// unit; rank r owns block r of every bucket (contiguous, not aligned to parameters).
///
/// Gradients: a unit's full gradients exist only while an unshard scope holds the unit and until its buckets'
/// reduce-scatters have read them: the scope binds the unit's parameters to a zeroed buffer of a unit_pool,
/// which goes back to the pool afterwards (steady-state steps reuse the same buffers: nothing is allocated
/// and no page is faulted in). Outside, a parameter's gradient points at its place in the layout's gradient
/// arena, whose pages are released once at construction (zeros, not resident). Each bucket is
/// reduce-scattered (average) into the owned block: straight into the owned gradients after zero_grad(),
/// else into a receive buffer that is then added (accumulation, as under no_sync). hybrid averages each
/// block across the replica group too: that all-reduce is chained when the next bucket starts (after
/// waiting for the block's reduce-scatter), so it overlaps the rest of the backward. The point is the same on
/// every rank by construction: choosing it by polling completion would order the shard and replica groups'
/// collectives differently on different ranks, and a transport that runs a rank's collectives one at a time
/// (ddp::tcp's engine) then deadlocks across the overlapping groups. The phases of
/// buckets and units (waiting → started → chained → reduced; released → held → reported) are kept by
/// step_state.
///
/// Values: the optimizer steps the owned values against the owned gradients. shard_grad_op's owned values are
/// its blocks of the value arena, and after each step every bucket is all-gathered in place; full_shard keeps a
/// persistent copy of the owned blocks (its arena holds no values) and all-gathers units on demand into pooled
/// buffers.

#include <limits>

// ---- begin <ddp/parallel/accumulation.hpp>
/// \file How gradients accumulate over the micro-batches of a no_sync span: the trait each strategy names
/// (`using accumulation = ...`, parallel/strategy.hpp). data_parallel and ddp::no_sync_guard ask it instead of
/// branching on the policy: whether a report inside a span only accumulates, what opening, closing and dropping a
/// span do, and what becomes of an owning leaf's own gradient once it moved into ddp's memory.



namespace ddp::detail {

/// replicate (PyTorch DDP's no_sync): micro-batches add into the gradient arenas (and owning leaves' own
/// gradients) with no traffic; the next synchronized backward reduces their sum once.
struct local_accumulation {
  /// A report inside a span only accumulates: no bucket moves.
  static bool defers(const step_state& state) noexcept { return state.no_sync().open > 0; }
  /// A span may open inside a join scope: a rank that ran out shadows only the synchronized step.
  static void opening(step_state& /*state*/, int /*rank*/) noexcept {}
  /// close() has nothing to complete.
  template <class DP>
  static void closing(DP& /*dp*/) noexcept {}
  /// A span left without close() leaves nothing unfinished.
  static void dropped(step_state& /*state*/) noexcept {}
  /// An owning leaf keeps adding into its own gradient until the synchronized backward.
  static void moved_in(leaf_binding& /*leaf*/) noexcept {}
};

/// The sharded strategies: a unit's full gradients exist only inside its unshard scope, so each micro-batch is
/// reduce-scattered into the owned gradients during its own backward. close() completes that micro-batch; a span
/// left without close() makes the next call say so; a join scope refuses spans (a rank that ran out could not
/// mirror each micro-batch's reductions); an owning leaf's own gradient starts again from zero once moved in.
struct reduced_accumulation {
  /// Every report moves its buckets, inside a span too.
  static bool defers(const step_state& /*state*/) noexcept { return false; }
  /// Refused inside a join scope.
  static void opening(step_state& state, int rank) { state.join().refuse_no_sync(rank); }
  /// close() waits for the micro-batch's reduce-scatters (collective).
  template <class DP>
  static void closing(DP& dp) {
    dp.finish_gradients();
  }
  /// A span left without close() in the middle of a micro-batch is remembered, and named by the next call.
  static void dropped(step_state& state) noexcept {
    if (state.phase() == step_phase::reporting) state.no_sync().unclosed = true;
  }
  /// The micro-batch's gradient was reduced away: the leaf's own gradient restarts from zero.
  static void moved_in(leaf_binding& leaf) { leaf.zero_own_gradient(); }
};

/// What data_parallel asks of a strategy's accumulation trait A.
template <class A>
concept accumulation_mode = requires(step_state& state, const step_state& cstate, leaf_binding& leaf, int rank) {
  { A::defers(cstate) } -> std::same_as<bool>;
  A::opening(state, rank);
  A::dropped(state);
  A::moved_in(leaf);
};
static_assert(accumulation_mode<local_accumulation> && accumulation_mode<reduced_accumulation>,
              "ddp: an accumulation trait must give defers, opening, closing, dropped and moved_in.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/accumulation.hpp>
// ---- begin <ddp/parallel/master_weights.hpp>
/// \file The rooms of ddp::mixed_precision inside data_parallel. apply_precision gives every arena of the compute
/// dtype its reduce dtype before the strategy is built; a strategy widens each bucket's gradients into a
/// reduce_staging before its collective (replicate: the staging is where the averaged gradients stay; the sharded
/// strategies reduce-scatter it into owned gradients of the reduce dtype and release its pages once read);
/// master_weights keeps the f32 copy of the owned values the optimizer steps and narrows it into them afterwards.
///
/// A step under mixed_precision<bf16, f32>: the backward writes bf16 gradients; each bucket is widened to f32 and
/// reduced in f32 into the f32 owned gradients, which are the master gradients; the optimizer steps the f32
/// master values (its state is f32); the masters are narrowed into the bf16 owned values, which the strategy
/// then all-gathers as it does without mixed precision. Under mixed_precision<bf16, bf16> the reduction runs on the
/// bf16 gradients themselves and the reduced owned gradients are widened into f32 master gradients.



namespace ddp::detail {

/// Gives the arenas of Precision's compute dtype its reduce dtype; throws ddp::config_error when the model has no
/// parameter of the compute dtype or has parameters of another 16-bit dtype. Local.
template <class Precision>
void apply_precision(parameter_layout& layout, int rank) {
  if constexpr (Precision::masters) {
    const dtype compute = dtype_v<typename Precision::param_type>;
    const std::string name(to_string(compute));
    bool found = false;
    for (auto& a : layout.arenas()) {
      const auto& first = layout.slots()[a.params.front()];
      if (a.type == compute) {
        a.reduce_type = dtype_v<typename Precision::reduce_type>;
        found = true;
      } else if (size_of(a.type) == 2) {
        throw config_error("data_parallel: ddp::mixed_precision computes in " + name + " but parameter '" + first.name +
                           "' is " + std::string(to_string(a.type)) + "; keep one 16-bit compute dtype in the model "
                           "and name it as the policy's Param", rank);
      }
    }
    if (!found)
      throw config_error("data_parallel: ddp::mixed_precision computes in " + name + " but the model has no " + name +
                         " parameter" + (layout.slots().empty() ? std::string() : " (parameter '" +
                         layout.slots().front().name + "' is " + std::string(to_string(layout.slots().front().type)) +
                         ")") + "; ddp does not cast a model: its "
                         "element type is its compute dtype, so write the model over ddp::" +
                         (compute == dtype::bf16 ? "bfloat16" : "float16") + " (the wrapper keeps f32 masters), or "
                         "drop the mixed_precision policy to train in the model's own dtype", rank);
  }
}

/// Per arena whose reduce dtype differs from its dtype: room for its gradients in the reduce dtype, laid as the
/// arena (element i of the arena at element i of the staging). Pages are released once a collective read them.
class reduce_staging {
 public:
  explicit reduce_staging(const parameter_layout& layout) {
    for (const auto& a : layout.arenas()) {
      types_.push_back(a.reduce_type);
      store_.push_back(a.reduce_type == a.type ? domain_buffer{} : a.domain->allocate(a.numel * size_of(a.reduce_type)));
    }
  }
  /// Where the gradients `own` (elements [begin, begin + own.size) of arena `a`, in the arena's dtype, wherever
  /// they lie) are reduced: `own` itself when the arena reduces in its own dtype, else the staging's elements.
  [[nodiscard]] raw_tensor at(raw_tensor own, std::size_t a, std::size_t begin) const {
    if (store_[a].size() == 0) return own;
    return store_[a].view(types_[a], begin, own.size);
  }
  /// at(), with `own` widened into the staging first (a bucket about to be reduced).
  raw_tensor stage(raw_tensor own, std::size_t a, std::size_t begin) {
    const raw_tensor to = at(own, a, begin);
    if (to.data != own.data) store_[a].domain()->convert(own, to);
    return to;
  }
  /// Gives back the pages of the staging's elements [begin, begin + count) of arena `a` (their collective is done).
  void release(std::size_t a, std::size_t begin, std::size_t count) const {
    store_[a].release(begin * size_of(types_[a]), (begin + count) * size_of(types_[a]));
  }

 private:
  std::vector<dtype> types_;          // per arena: its reduce dtype
  std::vector<domain_buffer> store_;  // per arena, in its domain: empty where it reduces in its own dtype
};

/// The f32 master copy of the owned buffers of the compute dtype, which the optimizer steps: master values, and
/// master gradients (the owned gradients themselves where they are reduced in f32, else an f32 copy widened before
/// each step). Owned buffers of another dtype (f32, f64 parameters) are stepped as they are. Local.
class master_weights {
 public:
  /// Under mixed_precision (Precision::masters), makes the masters of `owned` (the strategy's buffers, whose values
  /// are final: after the broadcast); afterwards buffers() hands them out. Nothing under full_precision.
  template <class Precision>
  void attach(std::span<const optim::flat_buffer> owned) {
    if constexpr (Precision::masters) attach(owned, dtype_v<typename Precision::param_type>);
  }

 private:
  void attach(std::span<const optim::flat_buffer> owned, dtype compute) {
    for (const auto& b : owned) {
      optim::flat_buffer m = b;
      auto& values = values_.emplace_back();
      auto& grads = grads_.emplace_back();
      if (b.values.type == compute) {
        memory_domain& d = b.memory();
        values = d.allocate(b.values.size * sizeof(float));
        m.values = values.view(dtype::f32, 0, b.values.size);
        d.convert(b.values, m.values);
        if (b.grads.type != dtype::f32) {
          grads = d.allocate(b.grads.size * sizeof(float));
          m.grads = grads.view(dtype::f32, 0, b.grads.size);
        }
      }
      masters_.push_back(std::move(m));
    }
    on_ = true;
  }

 public:
  /// What the optimizer steps and checkpoints hold: the masters once attached, else `owned`.
  [[nodiscard]] std::span<const optim::flat_buffer> buffers(std::span<const optim::flat_buffer> owned) const noexcept {
    return on_ ? std::span<const optim::flat_buffer>(masters_) : owned;
  }
  /// Runs `optimizer()` on the masters: the reduced gradients of `owned` are widened into the master gradients
  /// first, and the master values narrowed into `owned`'s values afterwards.
  template <class F>
  void step(std::span<const optim::flat_buffer> owned, F&& optimizer) {
    for (std::size_t i = 0; on_ && i < masters_.size(); ++i)
      if (masters_[i].grads.data != owned[i].grads.data) owned[i].memory().convert(owned[i].grads, masters_[i].grads);
    optimizer();
    narrow(owned);
  }
  /// The master values narrowed into `owned`'s values (after a step, or after a checkpoint filled the masters).
  void narrow(std::span<const optim::flat_buffer> owned) const {
    for (std::size_t i = 0; on_ && i < masters_.size(); ++i)
      if (masters_[i].values.data != owned[i].values.data) owned[i].memory().convert(masters_[i].values, owned[i].values);
  }

 private:
  bool on_ = false;
  std::vector<domain_buffer> values_;         // per owned buffer: f32 master values (empty where stepped as it is)
  std::vector<domain_buffer> grads_;          // per owned buffer: f32 master gradients widened before each step
  std::vector<optim::flat_buffer> masters_;   // per owned buffer: what the optimizer steps
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/master_weights.hpp>
// ---- begin <ddp/parallel/ordered_reduction.hpp>
/// \file Deterministic reduction (the sharding policies' deterministic knob): every element is summed in rank order,
/// ((g0 + g1) + g2) + ..., by ddp on the host, whatever the backend, bucket size or algorithm. The collectives
/// only move bytes: an all_to_all for a reduce-scatter (the same bytes as a ring reduce-scatter) and an
/// all_gather for an all-reduce ((N-1)·S bytes per rank against a ring's 2·(N-1)/N·S: equal at N = 2, N/2
/// times more beyond); the sum then runs where the operation completes. A group of two needs none of it: each
/// element of its sum is one addition, whose bits IEEE 754 makes the same in either order (ordered_sum_needed).



namespace ddp::detail {

/// Whether a group of `n` ranks must sum in rank order itself: with n ≤ 2 every element of a sum is a single
/// addition, which commutes bit for bit, so any backend's all-reduce gives the rank-order bits at its own cost.
constexpr bool ordered_sum_needed(int n) noexcept { return n > 2; }

/// Scratch of one group's deterministic reductions, one buffer per key (a bucket), kept across steps.
class ordered_reduction {
 public:
  /// Starts all-gathering every rank's `part` into key's scratch (the all-reduce of `part`).
  template <class Comm>
  work all_gather_part(Comm& comm, std::size_t key, const raw_tensor& part) {
    return comm.all_gather(part, scratch(key, part, static_cast<std::size_t>(comm.size())));
  }
  /// Starts sending block j of `whole` to rank j, into key's scratch (the reduce-scatter of `whole`).
  template <class Comm>
  work exchange(Comm& comm, std::size_t key, const raw_tensor& whole) {
    return comm.all_to_all(whole, scratch(key, whole, 1));
  }
  /// Writes the average of the `n` blocks in key's scratch, summed in rank order, to `out` (one block): one pass,
  /// with the bits of the sum followed by detail::divide.
  void average_into(std::size_t key, const raw_tensor& out, int n) const {
    const std::byte* blocks = scratch_[key].data();
    visit_dtype(out.type, [&](auto zero) {
      using T = decltype(zero);
      const T* in = reinterpret_cast<const T*>(blocks);
      T* dst = static_cast<T*>(out.data);
      const std::size_t k = out.size, ranks = static_cast<std::size_t>(n);
      if constexpr (std::is_floating_point_v<T>) {
        const bool exact = (n & (n - 1)) == 0;  // as divide(): a power of two multiplies by its exact reciprocal
        const T inverse = T(1) / static_cast<T>(n), count = static_cast<T>(n);
        for (std::size_t i = 0; i < k; ++i) {
          T acc = in[i];
          for (std::size_t j = 1; j < ranks; ++j) acc = acc + in[j * k + i];
          dst[i] = exact ? acc * inverse : acc / count;
        }
      } else {
        for (std::size_t i = 0; i < k; ++i) {
          T acc = in[i];
          for (std::size_t j = 1; j < ranks; ++j) acc = static_cast<T>(acc + in[j * k + i]);
          dst[i] = acc;
        }
        divide(out, n);
      }
    });
  }

 private:
  raw_tensor scratch(std::size_t key, const raw_tensor& like, std::size_t times) {
    if (scratch_.size() <= key) scratch_.resize(key + 1);
    const std::size_t bytes = like.bytes() * times;
    if (scratch_[key].size() != bytes) scratch_[key] = host_memory().allocate(bytes);
    return scratch_[key].view(like.type, 0, like.size * times);
  }
  std::vector<domain_buffer> scratch_;  // host memory: the rank-order sum runs on the host
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/ordered_reduction.hpp>
// ---- begin <ddp/parallel/unit_pool.hpp>
/// \file ddp::detail::unit_pool: reused buffers (per arena, in its memory domain) that each hold one unit's values
/// or gradients at a time (full_shard's unsharded values, the sharded strategies' gradient buffers). A unit takes
/// the smallest idle buffer that fits it (the most recently returned among equals) and gives it back after use, so
/// steady-state steps reuse the same resident memory: no allocation, no page faults. trim() frees the buffers a
/// step did not need (after unsharding the whole model, say), or every idle buffer.



namespace ddp::detail {

/// Which idle buffers unit_pool::trim frees.
enum class pool_trim : std::uint8_t {
  untaken,   ///< those nobody took since the previous trim (steady state keeps what steps use)
  all_idle,  ///< every idle buffer (the lowest memory between steps)
};

/// A pool of per-unit buffers, each one byte range per arena.
class unit_pool {
 public:
  /// `widths`: bytes per element of each arena; `domains`: where each arena's parts live (none given: the host).
  explicit unit_pool(std::vector<std::size_t> widths, std::vector<memory_domain*> domains = {})
      : widths_(std::move(widths)), domains_(std::move(domains)) {
    domains_.resize(widths_.size(), &host_memory());
  }

  /// A buffer holding at least `elements[a]` elements for every arena a; its bytes are unspecified.
  std::size_t take(std::span<const std::size_t> elements) {
    std::size_t best = buffers_.size();
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      const auto& b = buffers_[i];
      if (b.busy || b.parts.empty() || !fits(b, elements)) continue;
      if (best == buffers_.size() || b.bytes < buffers_[best].bytes ||
          (b.bytes == buffers_[best].bytes && b.returned > buffers_[best].returned))
        best = i;
    }
    if (best == buffers_.size()) best = allocate(elements);
    auto& b = buffers_[best];
    b.busy = true;
    b.taken_since_trim = true;
    return best;
  }
  /// Returns buffer `id` to the pool.
  void give(std::size_t id) noexcept {
    buffers_[id].busy = false;
    buffers_[id].returned = ++clock_;
  }
  /// The bytes of buffer `id` for arena `a`.
  [[nodiscard]] std::byte* data(std::size_t id, std::size_t a) const noexcept { return buffers_[id].parts[a].data(); }
  /// Frees the idle buffers `which` names.
  void trim(pool_trim which) noexcept {
    for (auto& b : buffers_) {
      if (!b.busy && (which == pool_trim::all_idle || !b.taken_since_trim)) b = buffer{};
      b.taken_since_trim = false;
    }
  }
  /// Bytes the pool holds, busy or idle.
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& b : buffers_) n += b.bytes;
    return n;
  }

 private:
  struct buffer {
    std::vector<domain_buffer> parts;  // per arena; empty once freed
    std::size_t bytes = 0;             // sum of the parts
    bool busy = false;                 // taken and not given back
    bool taken_since_trim = false;     // taken since the last trim()
    std::uint64_t returned = 0;        // when given back (a counter)
  };
  [[nodiscard]] bool fits(const buffer& b, std::span<const std::size_t> elements) const noexcept {
    for (std::size_t a = 0; a < elements.size(); ++a)
      if (b.parts[a].size() < elements[a] * widths_[a]) return false;
    return true;
  }
  std::size_t allocate(std::span<const std::size_t> elements) {
    buffer fresh;
    for (std::size_t a = 0; a < elements.size(); ++a) {
      fresh.parts.push_back(domains_[a]->allocate(elements[a] * widths_[a]));
      fresh.bytes += elements[a] * widths_[a];
    }
    for (std::size_t i = 0; i < buffers_.size(); ++i)
      if (buffers_[i].parts.empty()) {
        buffers_[i] = std::move(fresh);
        return i;
      }
    buffers_.push_back(std::move(fresh));
    return buffers_.size() - 1;
  }

  std::vector<std::size_t> widths_;
  std::vector<memory_domain*> domains_;  // per arena
  std::vector<buffer> buffers_;
  std::uint64_t clock_ = 0;
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/unit_pool.hpp>

namespace ddp::detail {

/// The owned block of one bucket.
struct owned_block {
  std::size_t begin = 0;   ///< first element of the block in the full arena
  std::size_t length = 0;  ///< elements (bucket length / N)
  std::size_t shard = 0;   ///< first element of the block in the arena's shard buffers
};

/// Where a unit lies in one arena: elements [begin, end) (its buckets, padding included).
struct unit_extent {
  std::size_t begin = 0;  ///< first element
  std::size_t end = 0;    ///< one past the last
};

inline constexpr std::size_t no_buffer = std::numeric_limits<std::size_t>::max();

/// Where a sharded strategy keeps the values the optimizer steps.
enum class owned_value_home : std::uint8_t {
  value_arena,  ///< the rank's blocks of the value arena (shard_grad_op: the full parameters stay whole)
  own_copy,     ///< a persistent copy of the blocks (full_shard: the arena holds no values)
};

/// Bucket `b`'s sharded bookkeeping: its owned block and where its reduce-scatter writes.
struct shard_bucket {
  owned_block block;        ///< the owned block
  bool owned_zero = true;   ///< the owned gradients are zero (since zero_grad)
  bool direct = true;       ///< this step's reduce-scatter writes straight into the owned gradients
};
/// Unit `u`'s pooled buffers (unit_pool ids), or no_buffer.
struct unit_buffers {
  std::size_t values = no_buffer;  ///< full_shard: its unsharded values
  std::size_t grads = no_buffer;   ///< its full gradients
};

/// Reduce-scatter, sharded gradients and optimizer state, all-gather, and the units' pooled buffers: the
/// machinery of the sharded strategies. `shard` is the group parameters are sharded over; `replica`
/// (hybrid) the group the shards are replicated over; `policy` names the strategy in messages. The phases of
/// buckets and units live in the step_state it is given.
template <class Comm>
class sharded_core {
 public:
  using accumulation = reduced_accumulation;          ///< each micro-batch is reduce-scattered in its backward
  static constexpr detail::bucket_cut bucket_cut = detail::bucket_cut::within_units;  ///< a unit's buckets are its own
  static constexpr bool rebuilds_buckets = false;     ///< buckets stay inside units, in field order
  /// A framework's optimizer must hold the tensors over this rank's owned blocks (ddp::parameters(dp)), the only
  /// ones that receive the averaged gradients; optim::optimizer_traits<Opt>::check says so, where specialized.
  template <class Opt>
  static void check_optimizer(Opt& opt, std::span<const optim::flat_buffer> buffers, int rank) {
    if constexpr (requires { optim::optimizer_traits<Opt>::check(opt, buffers, rank); })
      optim::optimizer_traits<Opt>::check(opt, buffers, rank);
  }

  sharded_core(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard,
               std::optional<Comm> replica, const char* policy, bool keep_unit_buffers, bool deterministic,
               owned_value_home values)
      : layout_(layout), plan_(plan), state_(state), shard_(std::move(shard)), replica_(std::move(replica)),
        values_pool_(widths(layout), domains(layout)), grads_pool_(widths(layout), domains(layout)), policy_(policy),
        trim_(keep_unit_buffers ? pool_trim::untaken : pool_trim::all_idle), values_(values),
        deterministic_(deterministic) {
    const auto n = static_cast<std::size_t>(shard_.size()), r = static_cast<std::size_t>(shard_.rank());
    for (const auto& a : layout_.arenas()) {
      own_values_.push_back(values_ == owned_value_home::value_arena ? domain_buffer{}
                                                                      : a.domain->allocate(a.numel / n * size_of(a.type)));
      own_grads_.push_back(a.domain->allocate(a.numel / n * size_of(a.reduce_type)));
      received_.emplace_back();
    }
    for (const auto& b : plan_.buckets) {
      const std::size_t length = (b.end - b.begin) / n;
      buckets_.push_back({.block = {.begin = b.begin + r * length, .length = length, .shard = b.begin / n}});
    }
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      const auto& a = layout_.arenas()[plan_.buckets[b].arena];
      if (values_ == owned_value_home::own_copy)
        a.domain->copy(a.value_view(buckets_[b].block.begin, buckets_[b].block.length), owned_values(b));
      optimizer_.push_back(owned_buffer(b));
    }
    const std::size_t units = layout_.units().size();
    unit_slots_.resize(units);
    extents_.assign(units, std::vector<unit_extent>(layout_.arenas().size()));
    for (std::size_t s = 0; s < layout_.slots().size(); ++s) unit_slots_[layout_.slots()[s].unit].push_back(s);
    for (const auto& bk : plan_.buckets) {
      auto& e = extents_[bk.unit][bk.arena];
      e = e.end == e.begin ? unit_extent{bk.begin, bk.end} : unit_extent{std::min(e.begin, bk.begin), std::max(e.end, bk.end)};
    }
    pooled_.resize(units);
    for (auto& a : layout_.arenas()) a.grads.release(0, a.grads.size());  // released gradients: zero pages
  }
  sharded_core(const sharded_core&) = delete;
  sharded_core& operator=(const sharded_core&) = delete;
  /// Points every parameter back at the arenas, copying the values of unsharded units there, so the layout can
  /// hand the model its values (the owner settled the operations in flight first). Local: no collective.
  ~sharded_core() {
    arena_values_ = true;  // the model keeps what the arenas hold (zeros where unshard_model() did not run)
    for (std::size_t u = 0; u < pooled_.size(); ++u) {
      if (pooled_[u].values != no_buffer) {
        for (std::size_t a = 0; a < layout_.arenas().size(); ++a) {
          const auto& e = extents_[u][a];
          const auto& arena = layout_.arenas()[a];
          arena.domain->copy(unit_values(u, a), arena.value_view(e.begin, e.end - e.begin));
        }
      }
      pooled_[u] = unit_buffers{};
      bind_unit(u);
    }
  }

  /// A gradient may only be reported while its unit has gradient storage (inside an unshard scope): held or
  /// reported → reported.
  void on_report(std::size_t slot) {
    const auto& s = layout_.slots()[slot];
    if (state_.unit(s.unit).grads == grad_phase::released)
      throw error(std::string(policy_) + ": parameter '" + s.name + "' reported a gradient outside an unshard "
                      "scope of its unit '" + layout_.units()[s.unit] + "' (the sharded strategies give a unit its "
                      "gradient storage, and under full_shard its values, only while a scope holds it); wrap the "
                      "unit's forward and backward in auto g = dp.unshard(model." + layout_.units()[s.unit] + "), or, "
                      "where autograd runs the backward (LibTorch), run the unit's forward as ddp::forward(dp, "
                      "model." + layout_.units()[s.unit] + ", input), which reopens the unit for its backward",
                  shard_.rank());
    state_.move_grads(s.unit, grad_phase::reported, {grad_phase::held, grad_phase::reported});
  }

  /// Bucket `b` waiting → started: its reduce-scatter (average) starts. Under hybrid, every earlier bucket
  /// then chains its cross-group average, in plan order, once its reduce-scatter is done (waited for here:
  /// the order of collectives must not depend on timing, see the file comment).
  template <class Hook>
  void reduce(Hook& /*hook*/, std::size_t b) {
    static_assert(std::is_same_v<Hook, plain_hook>,
                  "ddp::data_parallel: the compression hooks and user comm hooks work with ddp::replicate only; "
                  "drop the hook or use replicate.");
    const std::size_t u = plan_.buckets[b].unit;
    if (state_.unit(u).grads == grad_phase::released) hold_gradients(u);  // no report reached it: zero gradients
    state_.move_grads(u, grad_phase::reported, {grad_phase::held, grad_phase::reported});  // read until reduced
    auto& sb = buckets_[b];
    sb.direct = sb.owned_zero;
    sb.owned_zero = false;
    if (b == 0) chained_ = 0;  // a new step
    const auto& bk = plan_.buckets[b];
    const raw_tensor in = staging_.stage(gradient_view(b), bk.arena, bk.begin);  // mixed precision: widened
    state_.start(b, deterministic_ ? scattered_.exchange(shard_, b, in)
                                    : shard_.reduce_scatter(in, output(b), reduce_op::avg));
    if (replica_)
      for (; chained_ < b; ++chained_) {
        state_.wait(chained_);
        chain(chained_);
      }
  }
  /// Waits for bucket `b` (under hybrid: its reduce-scatter, then its cross-group average, chained now if
  /// polling did not) → reduced; adds the receive buffer into the owned gradients unless the reduce-scatter
  /// wrote there directly. Once all of its unit's buckets are reduced the unit's gradient storage is zeroed
  /// (a scope still holds it) or released.
  template <class Hook>
  void reduced(Hook& /*hook*/, std::size_t b) {
    if (replica_)
      for (; chained_ <= b; ++chained_) {
        state_.wait(chained_);
        chain(chained_);
      }
    state_.wait(b);
    staging_.release(plan_.buckets[b].arena, plan_.buckets[b].begin, plan_.buckets[b].end - plan_.buckets[b].begin);
    if (deterministic_) (replica_ ? replicated_ : scattered_).average_into(b, output(b), (replica_ ? *replica_ : shard_).size());
    if (!buckets_[b].direct) layout_.arenas()[plan_.buckets[b].arena].domain->accumulate(received(b), owned_grads(b));
    state_.complete(b);
    const std::size_t u = plan_.buckets[b].unit;
    if (state_.unit_settled(u) && state_.unit(u).grads == grad_phase::reported) {
      if (state_.unit(u).scopes > 0) {  // a scope still holds the unit: its next backward starts from zero
        zero_gradients(u);
        state_.move_grads(u, grad_phase::held, {grad_phase::reported});
      } else {
        release_gradients(u);
      }
    }
  }
  /// Zeroes the owned gradients and the full gradients of the units holding storage.
  void zero_grad() noexcept {
    for (std::size_t a = 0; a < own_grads_.size(); ++a)
      layout_.arenas()[a].domain->zero(own_grads_[a].view(layout_.arenas()[a].reduce_type, 0,
                                                         own_grads_[a].size() / size_of(layout_.arenas()[a].reduce_type)));
    for (auto& sb : buckets_) sb.owned_zero = true;
    for (std::size_t u = 0; u < pooled_.size(); ++u)
      if (pooled_[u].grads != no_buffer) zero_gradients(u);
  }
  /// One flat buffer per bucket: the owned values and gradients with the parameter pieces in them.
  [[nodiscard]] const std::vector<optim::flat_buffer>& optimizer_buffers() const noexcept { return optimizer_; }
  /// The group parameters are sharded over.
  [[nodiscard]] const Comm& shard_group() const noexcept { return shard_; }
  /// hybrid: the group shards are replicated over.
  [[nodiscard]] const std::optional<Comm>& replica_group() const noexcept { return replica_; }

 protected:
  [[nodiscard]] const parameter_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] const bucket_plan& plan() const noexcept { return plan_; }
  [[nodiscard]] step_state& state() noexcept { return state_; }
  [[nodiscard]] const std::string& unit_name(std::size_t u) const noexcept { return layout_.units()[u]; }

  /// An unshard scope opens on unit `u`: it gets gradient storage (zeroed, unless it still holds gradients
  /// of this backward).
  void open_scope(std::size_t u) {
    state_.open_scope(u);
    if (state_.unit(u).grads == grad_phase::released) hold_gradients(u);
  }
  /// An unshard scope on unit `u` closes: with no scope left, its gradient storage is released now (nothing
  /// reported) or once its reduce-scatters have read it.
  void close_scope(std::size_t u) {
    if (state_.close_scope(u) && state_.unit(u).grads == grad_phase::held) release_gradients(u);
  }

  /// Unit `u`'s values live in a pooled buffer from now on (its contents are unspecified until unsharded).
  void take_values(std::size_t u) {
    if (pooled_[u].values != no_buffer) return;
    pooled_[u].values = values_pool_.take(sizes(u));
    bind_unit(u);
  }
  /// unsharding → unsharded: waits for unit `u`'s all-gathers; its parameters hold their values from now on.
  void unsharded(std::size_t u) {
    state_.unsharded(u);
    bind_unit(u);
  }
  /// Unit `u`'s values buffer goes back to the pool; its parameters point at their arena place.
  void give_values(std::size_t u) {
    if (pooled_[u].values == no_buffer) return;
    values_pool_.give(pooled_[u].values);
    pooled_[u].values = no_buffer;
    bind_unit(u);
  }
  /// Starts refilling bucket `b`'s full values (in the unit's pooled buffer, else in the arena) from every
  /// rank's owned block.
  work all_gather_bucket(std::size_t b) {
    return shard_.all_gather(owned_values(b), value_view(b));
  }
  /// Frees the pooled buffers the last step did not need (every idle one unless keep_unit_buffers).
  void trim_pools() noexcept {
    values_pool_.trim(trim_);
    grads_pool_.trim(trim_);
  }
  /// Releases the pages of every arena's values (full_shard keeps values only in pooled buffers and owned
  /// blocks) and vacates every parameter there.
  void release_arena_values() {
    for (auto& a : layout_.arenas()) a.values.release(0, a.values.size());
    for (std::size_t u = 0; u < pooled_.size(); ++u) bind_unit(u);
  }
  /// The arenas hold the parameters' full values from now on (full_shard's unshard_model): the parameters of
  /// units without a pooled buffer are bound there as values, no longer vacated.
  void arena_holds_values() {
    arena_values_ = true;
    for (std::size_t u = 0; u < pooled_.size(); ++u) bind_unit(u);
  }

 private:
  static std::vector<std::size_t> widths(const parameter_layout& layout) {
    std::vector<std::size_t> out;
    for (const auto& a : layout.arenas()) out.push_back(size_of(a.type));
    return out;
  }
  static std::vector<memory_domain*> domains(const parameter_layout& layout) {
    std::vector<memory_domain*> out;
    for (const auto& a : layout.arenas()) out.push_back(a.domain);
    return out;
  }
  [[nodiscard]] std::vector<std::size_t> sizes(std::size_t u) const {
    std::vector<std::size_t> out;
    for (const auto& e : extents_[u]) out.push_back(e.end - e.begin);
    return out;
  }
  /// Points unit `u`'s parameters at its pooled buffers, or at their arena places where it has none; under
  /// full_shard they are vacated (leaf_binding::rebind) until the unit is unsharded.
  void bind_unit(std::size_t u) {
    const bool present = arena_values_ || (pooled_[u].values != no_buffer && state_.unit(u).values == unit_phase::unsharded);
    for (const std::size_t s : unit_slots_[u]) {
      const auto& p = layout_.slots()[s];
      const auto& a = layout_.arenas()[p.arena];
      const std::size_t w = size_of(p.type), at = p.offset - extents_[u][p.arena].begin;
      std::byte* values = pooled_[u].values == no_buffer ? a.values.data() + p.offset * w
                                                         : values_pool_.data(pooled_[u].values, p.arena) + at * w;
      std::byte* grads = pooled_[u].grads == no_buffer ? a.grads.data() + p.offset * w
                                                       : grads_pool_.data(pooled_[u].grads, p.arena) + at * w;
      p.leaf->rebind(values, grads, present);
    }
  }
  /// released → held: a zeroed pooled buffer (after releasing the buffers whose reduce-scatters are done).
  void hold_gradients(std::size_t u) {
    release_read_gradients();
    state_.move_grads(u, grad_phase::held, {grad_phase::released});
    pooled_[u].grads = grads_pool_.take(sizes(u));
    zero_gradients(u);
    bind_unit(u);
  }
  /// held or reported → released: the buffer goes back to the pool.
  void release_gradients(std::size_t u) {
    state_.move_grads(u, grad_phase::released, {grad_phase::held, grad_phase::reported});
    grads_pool_.give(pooled_[u].grads);
    pooled_[u].grads = no_buffer;
    bind_unit(u);
  }
  /// Releases the gradient storage of units no scope holds whose reduce-scatters have all read it.
  void release_read_gradients() {
    for (std::size_t u = 0; u < pooled_.size(); ++u) {
      const auto& rec = state_.unit(u);
      if (rec.grads != grad_phase::reported || rec.scopes > 0) continue;
      const auto bs = state_.unit_buckets(u);
      if (std::all_of(bs.begin(), bs.end(), [&](std::size_t k) { return state_.scattered(k); })) release_gradients(u);
    }
  }
  void zero_gradients(std::size_t u) {
    for (std::size_t a = 0; a < layout_.arenas().size(); ++a) layout_.arenas()[a].domain->zero(unit_gradients(u, a));
  }
  /// Bucket `b` started → chained: its reduce-scatter is done, its cross-group average starts.
  void chain(std::size_t b) {
    if (deterministic_) {
      scattered_.average_into(b, output(b), shard_.size());
      state_.chain(b, replicated_.all_gather_part(*replica_, b, output(b)));
    } else {
      state_.chain(b, replica_->all_reduce(output(b), reduce_op::avg));
    }
  }

  [[nodiscard]] raw_tensor unit_gradients(std::size_t u, std::size_t a) const {
    const auto& e = extents_[u][a];
    const auto& arena = layout_.arenas()[a];
    return {grads_pool_.data(pooled_[u].grads, a), e.end - e.begin, arena.type, arena.domain->where()};
  }
  /// Unit `u`'s values in its pooled buffer, for arena `a`.
  [[nodiscard]] raw_tensor unit_values(std::size_t u, std::size_t a) const {
    const auto& e = extents_[u][a];
    const auto& arena = layout_.arenas()[a];
    return {values_pool_.data(pooled_[u].values, a), e.end - e.begin, arena.type, arena.domain->where()};
  }
  /// Bucket `b`'s full gradients inside its unit's gradient buffer.
  [[nodiscard]] raw_tensor gradient_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const std::size_t w = size_of(layout_.arenas()[bk.arena].type);
    return {grads_pool_.data(pooled_[bk.unit].grads, bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, layout_.arenas()[bk.arena].type, layout_.arenas()[bk.arena].domain->where()};
  }
  /// Bucket `b`'s full values: in its unit's pooled buffer when it has one, else in the arena.
  [[nodiscard]] raw_tensor value_view(std::size_t b) const {
    const auto& bk = plan_.buckets[b];
    const auto& a = layout_.arenas()[bk.arena];
    if (pooled_[bk.unit].values == no_buffer) return a.value_view(bk.begin, bk.end - bk.begin);
    const std::size_t w = size_of(a.type);
    return {values_pool_.data(pooled_[bk.unit].values, bk.arena) + (bk.begin - extents_[bk.unit][bk.arena].begin) * w,
            bk.end - bk.begin, a.type, a.domain->where()};
  }
  /// Bucket `b`'s owned block in `store`, of elements of `type` (an arena's dtype, or its reduce dtype).
  [[nodiscard]] raw_tensor shard_view(const std::vector<domain_buffer>& store, std::size_t b, dtype type) const {
    const auto& block = buckets_[b].block;
    return store[plan_.buckets[b].arena].view(type, block.shard, block.length);
  }
  /// Where bucket `b`'s reduce-scatter writes: the owned gradients when they are zero, else the receive buffer.
  [[nodiscard]] raw_tensor output(std::size_t b) { return buckets_[b].direct ? owned_grads(b) : received(b); }
  [[nodiscard]] raw_tensor received(std::size_t b) {
    const std::size_t a = plan_.buckets[b].arena;
    if (received_[a].size() == 0) received_[a] = layout_.arenas()[a].domain->allocate(own_grads_[a].size());  // 1st use
    return shard_view(received_, b, layout_.arenas()[a].reduce_type);
  }
  [[nodiscard]] raw_tensor owned_grads(std::size_t b) const {
    return shard_view(own_grads_, b, layout_.arenas()[plan_.buckets[b].arena].reduce_type);
  }
  /// Bucket `b`'s owned values: its block of the value arena (shard_grad_op, whose all-gather is then in place),
  /// else the persistent copy (full_shard, whose arena holds no values).
  [[nodiscard]] raw_tensor owned_values(std::size_t b) const {
    const auto& a = layout_.arenas()[plan_.buckets[b].arena];
    if (values_ == owned_value_home::own_copy) return shard_view(own_values_, b, a.type);
    return a.value_view(buckets_[b].block.begin, buckets_[b].block.length);
  }

  optim::flat_buffer owned_buffer(std::size_t b) const {
    optim::flat_buffer out{.values = owned_values(b), .grads = owned_grads(b), .segments = {},
                           .domain = layout_.arenas()[plan_.buckets[b].arena].domain};
    const std::size_t lo = buckets_[b].block.begin, hi = lo + buckets_[b].block.length;
    for (const std::size_t s : plan_.buckets[b].params) {
      const auto& p = layout_.slots()[s];
      const std::size_t from = std::max(lo, p.offset), to = std::min(hi, p.offset + p.numel);
      if (from < to) out.segments.push_back({.name = p.name, .offset = from - lo, .numel = to - from, .start = from - p.offset});
    }
    return out;
  }

  parameter_layout& layout_;
  const bucket_plan& plan_;
  step_state& state_;                                   // the phases of buckets and units
  Comm shard_;
  std::optional<Comm> replica_;
  std::vector<shard_bucket> buckets_;                   // per bucket
  std::vector<domain_buffer> own_values_;               // per arena: the owned blocks of every bucket, in bucket-begin order
  std::vector<domain_buffer> own_grads_;                // per arena: the accumulated owned gradients
  std::vector<domain_buffer> received_;                 // per arena: reduce-scatter outputs to add (made on first need)
  std::vector<optim::flat_buffer> optimizer_;           // per bucket, for the optimizer
  std::vector<std::vector<std::size_t>> unit_slots_;    // per unit: its parameters
  std::vector<std::vector<unit_extent>> extents_;       // per unit, per arena
  std::vector<unit_buffers> pooled_;                    // per unit: its pooled buffers
  unit_pool values_pool_;                               // full_shard's unsharded units
  unit_pool grads_pool_;                                // the units' full gradients
  std::size_t chained_ = 0;                             // hybrid: buckets chained in this step (a prefix)
  const char* policy_;                                  // the strategy's name, for messages
  pool_trim trim_;                                      // by the policy's keep_unit_buffers
  owned_value_home values_;                             // where the owned values live
  bool arena_values_ = values_ == owned_value_home::value_arena;  // the arenas hold the parameters' values
  bool deterministic_;                                  // sum in rank order (the policy's deterministic knob)
  ordered_reduction scattered_;                         // deterministic: each bucket's exchanged blocks
  ordered_reduction replicated_;                        // deterministic hybrid: each owned block from every group
  reduce_staging staging_{layout_};                     // mixed precision: buckets widened to the reduce dtype
};

}  // namespace ddp::detail
// ---- end <ddp/parallel/sharded.hpp>
// ---- begin <ddp/parallel/strategy.hpp>
/// \file The strategy a sharding policy selects: how a bucket is reduced, what the optimizer steps over, what
/// happens after the step and around a unit's use, and the traits data_parallel asks of it instead of branching
/// on the policy. Each sharding policy specializes strategy in its own header, and a static_assert beside it
/// checks that it models sharding_strategy. The step_state holds every phase; the strategy moves the buckets and
/// units through it.



namespace ddp::detail {

/// Specialized by <ddp/parallel/replicate.hpp> and the sharding headers.
template <class Sharding, class Comm>
struct strategy {
  static_assert(dependent_false<Sharding>,
                "ddp::data_parallel: this sharding policy has no strategy; use ddp::replicate, ddp::shard_grad_op, "
                "ddp::full_shard or ddp::hybrid<ddp::full_shard or ddp::shard_grad_op>.");
};

/// What data_parallel asks of a strategy S over communicator Comm, for the sharding policy value of type Policy.
/// Traits (what the wrapper does differently per policy; each is passed through, never branched on):
///   multiple(comm, policy)      arena padding and bucket granularity (the shard group's size), before construction
///   accumulation                how micro-batches accumulate under no_sync (parallel/accumulation.hpp)
///   initial_units               the unit phase the strategy starts in
///   bucket_cut                  where buckets may end (anywhere, or inside units)
///   rebuilds_buckets            the first step's ready order may replan the buckets (parallel/bucket_rebuild.hpp)
///   join_replays_scopes         a join shadow step replays the last step's scopes and reports
///   check_leaves(layout, rank)  refuses leaves the strategy cannot hold, before any collective
///   check_optimizer(opt, buffers, rank)   refuses a framework optimizer over the wrong tensors (a template)
/// Work:
///   S(layout, plan, state, comm, policy)      collective
///   reduce(hook, b): bucket b waiting → started (and, under hybrid, chains earlier buckets without waiting)
///   reduced(hook, b): waits for bucket b, → reduced, finishes its gradients
///   acquire(units) / release(units)           an unshard scope opens / closes on units
///   on_report(slot)                           checks (and notes) a gradient report
///   leaves_report_themselves()                the leaves' framework runs the backward (autograd): no scope wraps it
///   optimizer_buffers(), after_step(), zero_grad()
///   unshard_model()                           collective: the model's parameters hold the full values
///   digest()                                  verify_in_sync's hashes of the values this rank shares
///   shard_group(), replica_group()            the groups parameters are sharded and replicated over
template <class S, class Comm, class Policy>
concept sharding_strategy =
    std::constructible_from<S, parameter_layout&, const bucket_plan&, step_state&, Comm, const Policy&> &&
    accumulation_mode<typename S::accumulation> &&
    requires(S& s, const S& cs, const Comm& comm, const Policy& policy, plain_hook& hook, std::size_t i,
             std::span<const std::size_t> units, const parameter_layout& layout, int rank) {
      { S::multiple(comm, policy) } -> std::same_as<std::size_t>;
      { S::initial_units } -> std::convertible_to<unit_phase>;
      { S::bucket_cut } -> std::convertible_to<detail::bucket_cut>;
      { S::rebuilds_buckets } -> std::convertible_to<bool>;
      { S::join_replays_scopes } -> std::convertible_to<bool>;
      S::check_leaves(layout, rank);
      { s.reduce(hook, i) } -> std::same_as<void>;
      { s.reduced(hook, i) } -> std::same_as<void>;
      s.acquire(units);
      s.release(units);
      s.on_report(i);
      s.leaves_report_themselves();
      { cs.optimizer_buffers() } -> std::same_as<const std::vector<optim::flat_buffer>&>;
      s.after_step();
      s.zero_grad();
      s.unshard_model();
      { cs.digest() } -> std::same_as<replica_digest>;
      { cs.shard_group() } -> std::convertible_to<Comm>;
      { cs.replica_group() } -> std::convertible_to<std::optional<Comm>>;
    };

}  // namespace ddp::detail
// ---- end <ddp/parallel/strategy.hpp>

namespace ddp::detail {

template <class Comm>
struct strategy<full_shard, Comm> : sharded_core<Comm> {
  static constexpr unit_phase initial_units = unit_phase::sharded;
  /// A shadow step must issue the all-gathers of the units' scopes: it replays the last step's scopes and reports.
  static constexpr bool join_replays_scopes = true;
  static std::size_t multiple(const Comm& comm, const full_shard& /*policy*/) {
    return static_cast<std::size_t>(comm.size());
  }
  /// A rank keeps only its owned blocks, so every leaf must compute on ddp's memory (adopt it).
  static void check_leaves(const parameter_layout& layout, int rank) { require_adopting(layout, rank); }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm, const full_shard& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(comm), std::nullopt, "full_shard", policy.keep_unit_buffers,
                           policy.deterministic, owned_value_home::own_copy),
        reshard_(policy.reshard_after_forward) {
    this->release_arena_values();
  }
  /// hybrid: shards over `shard`, replicas over `replica`.
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard, Comm replica,
           const full_shard& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(shard), std::move(replica), "full_shard",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::own_copy),
        reshard_(policy.reshard_after_forward) {
    this->release_arena_values();
  }

  /// Unshards the units (all-gathering them, or waiting for a prefetch) and gives them gradient storage, then
  /// prefetches the next unit in the direction of travel. Collective over the shard group, in the same order
  /// on every rank. In the first step it records the order in which units are first opened.
  void acquire(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      if (this->state().unit(u).values == unit_phase::sharded) unshard(u);
      if (this->state().unit(u).values == unit_phase::unsharding) this->unsharded(u);
      this->open_scope(u);
      if (!recorded_ && position_[u] == unrecorded) {
        position_[u] = order_.size();
        order_.push_back(u);
      }
    }
    if (units.empty()) return;
    const std::size_t u = units.back();
    if (last_)
      if (const auto next = next_unit(*last_, u)) prefetch(*next);
    last_ = u;
  }
  /// Ends a use of the units; a unit no scope holds any more is resharded (when resharding after forward)
  /// and releases its gradient storage once its gradients are reduced.
  void release(std::span<const std::size_t> units) {
    for (const std::size_t u : units) {
      this->close_scope(u);
      if (this->state().unit(u).scopes == 0 && reshard_) reshard(u);
    }
  }
  /// The owned blocks changed: every unit no scope holds is resharded (the next scope unshards it again), a
  /// unit still held is unsharded again in place; then the pooled buffers this step did not need are freed.
  void after_step() {
    recorded_ = true;  // the execution order of the first step is known
    for (std::size_t u = 0; u < this->state().units(); ++u) {
      if (this->state().unit(u).values == unit_phase::unsharding) this->state().unsharded(u);
      if (this->state().unit(u).scopes == 0) {
        reshard(u);
      } else if (this->state().unit(u).values == unit_phase::unsharded) {  // a scope open across the step
        this->state().reshard(u);
        unshard(u);
        this->state().unsharded(u);
      }
    }
    this->trim_pools();
  }
  /// Collective: all-gathers every bucket into the value arena and points every parameter there, so the
  /// model's own parameters hold the full values (also once the wrapper is gone). No unshard scope may be open.
  void unshard_model() {
    for (std::size_t u = 0; u < this->state().units(); ++u) {
      if (this->state().unit(u).scopes > 0)
        throw error("unshard_model: unit '" + this->unit_name(u) + "' is inside an unshard scope; close every "
                    "dp.unshard(...) scope before unsharding the whole model", this->shard_group().rank());
      reshard(u);
    }
    std::vector<work> works;
    for (std::size_t b = 0; b < this->plan().buckets.size(); ++b) works.push_back(this->all_gather_bucket(b));
    wait_all(works);
    this->arena_holds_values();
  }
  /// The units' forwards open scopes and their backwards reopen them (backward_opener, ddp::forward of the
  /// LibTorch adapter): nothing to hold for the framework's backward.
  void leaves_report_themselves() noexcept {}
  /// A rank holds only its owned blocks: those are hashed and compared with the ranks owning the same blocks
  /// (the other groups under hybrid; without replicas every value has one owner and nothing is compared).
  [[nodiscard]] replica_digest digest() const {
    return digest_owned(this->layout(), this->optimizer_buffers(), this->shard_group().rank());
  }

 private:
  static constexpr std::size_t unrecorded = static_cast<std::size_t>(-1);

  /// The unit after `u` in the direction of travel from `last`: in the recorded execution order once the
  /// first step is over and both units are in it, else in field order; none at either end. In the recorded
  /// order a unit at either end opened again turns the travel around (the backward reopening the forward's
  /// last unit, as autograd's hooks do, prefetches the one before it; the next forward, the one after the first).
  [[nodiscard]] std::optional<std::size_t> next_unit(std::size_t last, std::size_t u) const {
    if (recorded_ && position_[u] != unrecorded && position_[last] != unrecorded) {
      const std::size_t at = position_[u], from = position_[last], end = order_.size() - 1;
      if (at > from || (at == from && at == 0 && end > 0))
        return at < end ? std::optional(order_[at + 1]) : std::nullopt;
      if (at < from || (at == from && at == end && end > 0)) return at > 0 ? std::optional(order_[at - 1]) : std::nullopt;
      return std::nullopt;
    }
    if (u == last) return std::nullopt;
    if (u > last) return u + 1 < position_.size() ? std::optional(u + 1) : std::nullopt;
    return u > 0 ? std::optional(u - 1) : std::nullopt;
  }
  /// sharded → unsharding: a pooled buffer and the all-gathers of the unit's buckets into it.
  void unshard(std::size_t u) {
    this->take_values(u);
    std::vector<work> all_gathers;
    for (const std::size_t b : this->state().unit_buckets(u)) all_gathers.push_back(this->all_gather_bucket(b));
    this->state().unshard(u, std::move(all_gathers));
  }
  void prefetch(std::size_t u) {
    if (this->state().unit(u).values == unit_phase::sharded) unshard(u);
  }
  /// → sharded: waits for all-gathers in flight, gives the values buffer back.
  void reshard(std::size_t u) {
    if (this->state().unit(u).values == unit_phase::unsharding) this->state().unsharded(u);
    if (this->state().unit(u).values == unit_phase::unsharded) {
      this->give_values(u);
      this->state().reshard(u);
    }
  }

  bool reshard_ = true;
  std::optional<std::size_t> last_;  // the unit unsharded last (direction of travel)
  std::vector<std::size_t> order_;   // units in the order the first step's scopes first opened them
  std::vector<std::size_t> position_ = std::vector<std::size_t>(this->state().units(), unrecorded);  // in order_
  bool recorded_ = false;            // the first step is over: order_ is the execution order
};
static_assert(sharding_strategy<strategy<full_shard, archetype_communicator>, archetype_communicator, full_shard>,
              "ddp: the full_shard strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/full_shard.hpp>
// ---- begin <ddp/parallel/hybrid.hpp>
/// \file The hybrid<Inner> strategy (HSDP): ranks split into groups of G consecutive ranks; Inner
/// (full_shard or shard_grad_op) shards inside each group, and each reduce-scattered block is then
/// averaged across the groups (over the ranks holding the same block), built on split(). That average is
/// chained when the next bucket starts (sharded_core::reduce), at the same point of the call sequence on
/// every rank; the last bucket's at the waiting point in finish_gradients.


// ---- begin <ddp/parallel/shard_grad_op.hpp>
/// \file The shard_grad_op strategy (ZeRO-2, FSDP SHARD_GRAD_OP): full parameters during forward and
/// backward, in the value arena; a unit's full gradients live in a pooled buffer while an unshard scope holds
/// it and until its buckets are reduce-scattered into the owned blocks; the optimizer steps the owned
/// blocks; the updated blocks are all-gathered back into the full parameters after the step.



namespace ddp::detail {

template <class Comm>
struct strategy<shard_grad_op, Comm> : sharded_core<Comm> {
  static constexpr unit_phase initial_units = unit_phase::unsharded;
  static constexpr bool join_replays_scopes = false;  ///< values stay whole: a shadow step needs no unshard scope
  static std::size_t multiple(const Comm& comm, const shard_grad_op& /*policy*/) {
    return static_cast<std::size_t>(comm.size());
  }
  /// Every leaf type can be held: the values stay whole in the arenas, copied at the step's edges if need be.
  static void check_leaves(const parameter_layout& /*layout*/, int /*rank*/) noexcept {}
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const shard_grad_op& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(comm), std::nullopt, "shard_grad_op",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::value_arena) {}
  /// hybrid: shards over `shard`, replicas over `replica`.
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm shard, Comm replica,
           const shard_grad_op& policy)
      : sharded_core<Comm>(layout, plan, state, std::move(shard), std::move(replica), "shard_grad_op",
                           policy.keep_unit_buffers, policy.deterministic, owned_value_home::value_arena) {}

  /// All-gathers every bucket's updated owned blocks back into the full parameters; frees the pooled
  /// gradient buffers this step did not need.
  void after_step() {
    std::vector<work> works;
    for (std::size_t b = 0; b < this->plan().buckets.size(); ++b) works.push_back(this->all_gather_bucket(b));
    wait_all(works);
    this->trim_pools();
  }
  /// The units get gradient storage while a scope holds them; parameters are always whole.
  void acquire(std::span<const std::size_t> units) {
    for (const std::size_t u : units) this->open_scope(u);
  }
  /// Ends a use of the units.
  void release(std::span<const std::size_t> units) {
    for (const std::size_t u : units) this->close_scope(u);
  }
  /// The leaves' framework runs the whole backward (autograd), so no scope can wrap a unit's part of it: every
  /// unit is held for the wrapper's lifetime (the full gradients stay allocated, as under replicate; the
  /// reduce-scatters and the sharded optimizer state are unchanged).
  void leaves_report_themselves() {
    for (std::size_t u = 0; u < this->state().units(); ++u) this->open_scope(u);
  }
  /// Parameters are whole in the value arena already.
  void unshard_model() {}
  /// Every rank holds the full values: all are hashed and compared.
  [[nodiscard]] replica_digest digest() const { return digest_full(this->layout()); }
};
static_assert(sharding_strategy<strategy<shard_grad_op, archetype_communicator>, archetype_communicator, shard_grad_op>,
              "ddp: the shard_grad_op strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/shard_grad_op.hpp>

namespace ddp::detail {

template <class Inner, class Comm>
struct strategy<hybrid<Inner>, Comm> : strategy<Inner, Comm> {
  /// G: policy.group_size, else LOCAL_WORLD_SIZE (OMPI_COMM_WORLD_LOCAL_SIZE), else the world.
  static std::size_t multiple(const Comm& comm, const hybrid<Inner>& policy) {
    const long long g = policy.group_size > 0
                            ? policy.group_size
                            : env_integer_either("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1 << 20,
                                                 "the number of processes on this host")
                                  .value_or(comm.size());
    if (g <= 0 || comm.size() % g != 0)
      throw config_error("hybrid: " + std::to_string(comm.size()) + " ranks do not split into groups of " +
                             std::to_string(g) + "; give ddp::hybrid<>{.group_size = G} (or set LOCAL_WORLD_SIZE) "
                             "with G a divisor of the world size",
                         comm.rank());
    return static_cast<std::size_t>(g);
  }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const hybrid<Inner>& policy)
      : strategy(layout, plan, state, groups(comm, static_cast<int>(multiple(comm, policy))), policy.inner) {}

 private:
  /// The shard group (G consecutive ranks) and the replica group (the ranks at the same place in every
  /// group), split in this order on every rank.
  static std::pair<Comm, Comm> groups(Comm& comm, int g) {
    Comm shard = comm.split(comm.rank() / g, comm.rank());
    Comm replica = comm.split(comm.rank() % g, comm.rank());
    return {std::move(shard), std::move(replica)};
  }
  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, std::pair<Comm, Comm> g,
           const Inner& inner)
      : strategy<Inner, Comm>(layout, plan, state, std::move(g.first), std::move(g.second), inner) {}
};
static_assert(sharding_strategy<strategy<hybrid<full_shard>, archetype_communicator>, archetype_communicator,
                                hybrid<full_shard>> &&
                  sharding_strategy<strategy<hybrid<shard_grad_op>, archetype_communicator>, archetype_communicator,
                                    hybrid<shard_grad_op>>,
              "ddp: the hybrid strategies must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/hybrid.hpp>
// ---- begin <ddp/parallel/join.hpp>
/// \file Uneven inputs (PyTorch's `Join`): ranks with different numbers of batches finish an epoch together.
///
/// `auto j = dp.join();` opens a join scope on every rank before the loop. Inside it each step's first
/// collective is a one-integer all-reduce that counts the ranks still training (data_parallel calls
/// join_state::begin_step at the step's first unshard scope or gradient report), and the step's reduced
/// gradients, averaged over all N ranks as always, are scaled by N / active (join_state::rescale): the mean over
/// the active ranks' batches, whatever the comm hook or the deterministic knob. A rank that runs out calls
/// `j.finish(opt)`: it counts 0 and, while some rank still counts 1, shadows that rank's step with zero
/// gradients: the same collectives in the same order (the reductions through the same hook, full_shard's
/// all-gathers by replaying this rank's last step's unshard scopes and reports), then its own optimizer step on
/// the reduced gradients, so parameters and optimizer state stay the same on every rank. It returns once every
/// rank has called finish (the count is 0). No collective runs in the scope's destructor: a scope left
/// without finish(opt) makes the wrapper's next call throw ddp::error saying so.


namespace ddp {

/// Scope returned by data_parallel::join() (PyTorch's `with model.join():`): open it on every rank before an
/// epoch whose ranks hold different numbers of batches, step as usual, and call finish(opt) after the rank's
/// last step. Its destructor issues no collective: a scope left without finish(opt) makes the wrapper's next
/// call throw ddp::error.
template <class DP>
class [[nodiscard]] join_scope {
 public:
  explicit join_scope(DP& dp) : dp_(&dp), rank_(dp.rank()) { dp.state_.join().open_scope(dp.state_.phase(), rank_); }
  join_scope(const join_scope&) = delete;
  join_scope& operator=(const join_scope&) = delete;
  ~join_scope() {
    if (dp_) dp_->state_.join().drop();
  }

  /// Collective: this rank has no batch left. While another rank still trains, shadows its step: zero
  /// gradients through the same collectives (full_shard: this rank's last step's unshard scopes and reports,
  /// replayed), then `dp.step(opt)` on the gradients reduced over the active ranks. Returns when every rank has
  /// called finish; afterwards the wrapper trains as outside a join scope.
  template <class Opt>
  void finish(Opt& opt) {
    if (!dp_) throw error("join_scope::finish: this scope is finished already; open a new one with dp.join()", rank_);
    DP& dp = *dp_;
    dp.state_.join().leave(dp.state_.phase(), rank_);
    while (const int active = detail::join_state::count(dp.comm_, 0)) {
      dp.zero_grad();
      const detail::step_record& replay = dp.state_.join().shadow(active, rank_);
      for (const auto& e : replay.events) {
        if (e.what == detail::step_event::kind::acquire) dp.strategy_->acquire(replay.units_of(e));
        else if (e.what == detail::step_event::kind::release) dp.strategy_->release(replay.units_of(e));
        else dp.report(e.slot);
      }
      dp.step(opt);
    }
    dp.state_.join().close();
    dp_ = nullptr;
  }

 private:
  DP* dp_;
  int rank_;
};

}  // namespace ddp
// ---- end <ddp/parallel/join.hpp>
// ---- begin <ddp/parallel/no_sync.hpp>
/// \file ddp::no_sync_guard: the scope of a gradient-accumulation span, what dp.no_sync() returns (PyTorch's
/// `with model.no_sync():`). It counts the open spans in the step state; the strategy's accumulation trait
/// (parallel/accumulation.hpp) says what closing and dropping a span mean for the policy.


namespace ddp {

/// Scope returned by no_sync(): while open, gradients accumulate without a step. Under replicate they
/// accumulate locally without communication; under the sharding strategies each micro-batch is
/// reduce-scattered into the sharded gradients, which close() (or dp.finish_gradients()) completes — call
/// it at the end of the span. The destructor issues no collective: it only ends the span.
template <class DataParallel>
class [[nodiscard]] no_sync_guard {
 public:
  /// Opens a span of `dp` (dp.no_sync() checks that one may open).
  explicit no_sync_guard(DataParallel& dp) : dp_(&dp) { ++dp_->state_.no_sync().open; }
  no_sync_guard(const no_sync_guard&) = delete;
  no_sync_guard& operator=(const no_sync_guard&) = delete;
  /// Ends the span; under the sharded strategies waits for this micro-batch's reduce-scatters (collective).
  void close() {
    if (!dp_) return;
    DataParallel& dp = *dp_;
    end_span();
    DataParallel::accumulation::closing(dp);
  }
  /// Ends the span if close() did not; under the sharded strategies an unfinished micro-batch is then
  /// reported by the next gradient_ready or no_sync (call close() or dp.finish_gradients()).
  ~no_sync_guard() {
    if (!dp_) return;
    DataParallel::accumulation::dropped(dp_->state_);
    end_span();
  }

 private:
  void end_span() noexcept {
    --dp_->state_.no_sync().open;
    dp_ = nullptr;
  }
  DataParallel* dp_;
};

}  // namespace ddp
// ---- end <ddp/parallel/no_sync.hpp>
// ---- begin <ddp/parallel/replicate.hpp>
/// \file The replicate strategy (PyTorch DDP): every rank keeps all parameters, gradients and optimizer
/// state; each bucket is all-reduced (through the comm hook) and the optimizer steps the whole arenas.



namespace ddp::detail {

/// Whole flat buffers: one per arena, every parameter a segment.
inline std::vector<optim::flat_buffer> whole_arenas(const parameter_layout& layout) {
  std::vector<optim::flat_buffer> out;
  for (const auto& a : layout.arenas()) {
    optim::flat_buffer b{.values = a.value_view(0, a.numel), .grads = a.grad_view(0, a.numel), .segments = {},
                         .domain = a.domain};
    for (const std::size_t s : a.params)
      b.segments.push_back({.name = layout.slots()[s].name, .offset = layout.slots()[s].offset,
                            .numel = layout.slots()[s].numel, .start = 0});
    out.push_back(std::move(b));
  }
  return out;
}

template <class Comm>
struct strategy<replicate, Comm> {
  using accumulation = local_accumulation;  ///< no_sync accumulates locally, with no traffic
  static constexpr unit_phase initial_units = unit_phase::unsharded;
  static constexpr detail::bucket_cut bucket_cut = detail::bucket_cut::anywhere;
  static constexpr bool rebuilds_buckets = true;      ///< in the first step's ready order, as PyTorch DDP does
  static constexpr bool join_replays_scopes = false;  ///< a shadow step reduces zeros; scopes do nothing here
  static std::size_t multiple(const Comm& /*comm*/, const replicate& /*policy*/) { return 1; }
  /// Every leaf type can be replicated.
  static void check_leaves(const parameter_layout& /*layout*/, int /*rank*/) noexcept {}
  /// A framework's optimizer may hold the model's own parameters: they are the whole arenas.
  template <class Opt>
  static void check_optimizer(Opt& /*opt*/, std::span<const optim::flat_buffer> /*buffers*/, int /*rank*/) noexcept {}

  strategy(parameter_layout& layout, const bucket_plan& plan, step_state& state, Comm comm,
           const replicate& policy)
      : layout_(layout), plan_(plan), state_(state), comm_(std::move(comm)), staging_(layout),
        buffers_(whole_arenas(layout)), deterministic_(policy.deterministic),
        in_rank_order_(deterministic_ && ordered_sum_needed(comm_.size())) {
    for (std::size_t a = 0; a < buffers_.size(); ++a) buffers_[a].grads = staging_.at(buffers_[a].grads, a, 0);
  }

  /// Bucket `b` waiting → started: its all-reduce starts through the hook (deterministic beyond two ranks: an
  /// all_gather; with two, the plain all-reduce's single addition per element is deterministic already).
  template <class Hook>
  void reduce(Hook& hook, std::size_t b) {
    if constexpr (!std::is_same_v<Hook, plain_hook>)
      if (deterministic_)
        throw config_error("data_parallel: deterministic reduction sums in rank order itself, so it cannot run "
                           "through a comm hook; drop the hook or the policy's deterministic knob",
                           comm_.rank());
    state_.start(b, in_rank_order_ ? ordered_.all_gather_part(comm_, b, gradients(b, true).grads)
                                    : hook.start(gradients(b, true)));
  }
  /// Waits for bucket `b`'s all-reduce; the hook (deterministic beyond two ranks: the rank-order sum) writes the
  /// averaged gradients back (in the reduce dtype: under mixed precision into the staging, where the optimizer
  /// finds them); → reduced.
  template <class Hook>
  void reduced(Hook& hook, std::size_t b) {
    state_.wait(b);
    if (in_rank_order_)
      ordered_.average_into(b, gradients(b).grads, comm_.size());
    else
      hook.complete(gradients(b));
    state_.complete(b);
  }
  /// What the optimizer steps over: the whole arenas.
  [[nodiscard]] const std::vector<optim::flat_buffer>& optimizer_buffers() const noexcept { return buffers_; }
  /// Nothing to all-gather after the step.
  void after_step() {}
  /// Zeroes the gradient arenas.
  void zero_grad() noexcept {
    for (const auto& a : layout_.arenas()) a.domain->zero(a.grad_view(0, a.numel));
  }
  /// Parameters and gradients are always whole: unshard scopes do nothing.
  void acquire(std::span<const std::size_t> /*units*/) {}
  void release(std::span<const std::size_t> /*units*/) {}
  /// Every gradient may be reported at any time.
  void on_report(std::size_t /*slot*/) const {}
  /// Gradients have their storage all the time: nothing to hold for a framework's backward.
  void leaves_report_themselves() noexcept {}
  /// The model holds its values already.
  void unshard_model() {}
  /// Every rank holds the full values: all are hashed and compared.
  [[nodiscard]] replica_digest digest() const { return digest_full(layout_); }
  /// Parameters are not sharded: the whole communicator.
  [[nodiscard]] const Comm& shard_group() const noexcept { return comm_; }
  /// No replica group beside it.
  [[nodiscard]] std::optional<Comm> replica_group() const { return std::nullopt; }

 private:
  /// Bucket `b`'s gradients in its arena's reduce dtype; `stage`: widened there from the arena first.
  [[nodiscard]] bucket_gradients<Comm> gradients(std::size_t b, bool stage = false) {
    const auto& bk = plan_.buckets[b];
    const raw_tensor own = layout_.arenas()[bk.arena].grad_view(bk.begin, bk.end - bk.begin);
    return {stage ? staging_.stage(own, bk.arena, bk.begin) : staging_.at(own, bk.arena, bk.begin), comm_, b,
            *layout_.arenas()[bk.arena].domain};
  }

  parameter_layout& layout_;
  const bucket_plan& plan_;
  step_state& state_;
  Comm comm_;
  reduce_staging staging_;  // mixed precision: the gradients in the reduce dtype, where the optimizer finds them
  std::vector<optim::flat_buffer> buffers_;
  bool deterministic_;
  bool in_rank_order_;         // deterministic with more than two ranks: all-gather, then sum in rank order
  ordered_reduction ordered_;  // deterministic: each bucket's all-gathered gradients
};

static_assert(sharding_strategy<strategy<replicate, archetype_communicator>, archetype_communicator, replicate>,
              "ddp: the replicate strategy must model sharding_strategy; add what the concept names.");

}  // namespace ddp::detail
// ---- end <ddp/parallel/replicate.hpp>

namespace ddp {

/// Data-parallel wrapper of `Model` with policies `Ps...` in any order (backend, sharding, bucket_bytes, comm hook,
/// precision; defaults: backend::tcp, replicate, bucket_bytes<25 MiB, 1 MiB>, plain_hook, full_precision).
template <class Model, class... Ps>
class data_parallel {
  using policy = policies<Ps...>;
  using strategy_type = detail::strategy<typename policy::sharding, backend_communicator_t<typename policy::backend>>;
  using accumulation = typename strategy_type::accumulation;  // what a no_sync span means for the policy

 public:
  using model_type = Model;                                                        ///< the wrapped model
  using communicator_type = backend_communicator_t<typename policy::backend>;     ///< the backend's communicator
  using sharding = typename policy::sharding;                                      ///< the sharding policy
  using hook_type = typename policy::hook;                                         ///< the comm hook
  using precision = typename policy::precision;  ///< full_precision, or mixed_precision<Param, Reduce> (f32 masters)
  static_assert(communicator<communicator_type>);
  static_assert(comm_hook<hook_type, communicator_type>,
                "ddp::data_parallel: the comm hook must model ddp::comm_hook: default-constructible, with "
                "work start(const ddp::bucket_gradients<Comm>&) and complete(const ddp::bucket_gradients<Comm>&).");
  static_assert(detail::sharding_strategy<strategy_type, communicator_type, sharding>,
                "ddp::data_parallel: the sharding strategy does not model sharding_strategy over this backend's "
                "communicator; give the strategy every member the concept in <ddp/parallel/strategy.hpp> names.");

  // The constructors take std::type_identity_t<Model>& so that the deduction guides below, not the
  // constructors, deduce the backend and the policies of `ddp::data_parallel dp{model, comm, ...};`.

  /// Wraps `model` (kept by reference; it must outlive the wrapper) for the ranks of `comm`. Collective.
  data_parallel(std::type_identity_t<Model>& model, communicator_type comm, data_parallel_options options = {})
      : data_parallel(values_given{}, model, std::move(comm), sharding{}, [] { return hook_type{}; },
                      std::move(options)) {}
  /// The same with policy values, in any order, each of one of this wrapper's policy types (the sharding
  /// policy's settings and the comm hook's state are taken from them), then optionally data_parallel_options.
  template <detail::policy P, class... Rest>
  data_parallel(std::type_identity_t<Model>& model, communicator_type comm, P first, Rest... rest)
      : data_parallel(values_given{}, model, std::move(comm), detail::value_of<sharding>(first, rest...),
                      [&] { return detail::value_of<hook_type>(first, rest...); },
                      detail::value_of<data_parallel_options>(rest...)) {
    static_assert((detail::policy_of<P, Ps...> && ... &&
                   (detail::policy_of<Rest, Ps...> || std::is_same_v<Rest, data_parallel_options>)),
                  "ddp::data_parallel: a constructor argument is neither one of this wrapper's policies nor "
                  "ddp::data_parallel_options; pass values of the policy types the wrapper names, or let "
                  "`ddp::data_parallel dp{model, comm, policies...};` deduce the wrapper from them.");
    static_assert(detail::options_last<Rest...>(),
                  "ddp::data_parallel: ddp::data_parallel_options must be the last constructor argument, given once; "
                  "move it after the policy values.");
  }
  data_parallel(const data_parallel&) = delete;
  data_parallel& operator=(const data_parallel&) = delete;
  /// Issues no collective: waits for the operations in flight (their errors are dropped) and hands every
  /// parameter its values back. Under full_shard those are the full values only where unshard_model() put
  /// them (or an unshard scope holds the unit); call dp.unshard_model() after the last step to keep the trained
  /// model.
  ~data_parallel() { state_.settle(); }

 private:
  struct values_given {};
  /// `make_hook()` makes the hook in place (a hook need not be movable unless a value of it is given).
  template <class MakeHook>
  data_parallel(values_given, std::type_identity_t<Model>& model, communicator_type comm, sharding sharding_policy,
                MakeHook make_hook, data_parallel_options options)
      : model_(model), comm_(std::move(comm)), options_(std::move(options)), sharding_(std::move(sharding_policy)),
        multiple_(strategy_type::multiple(comm_, sharding_)),
        layout_(model, multiple_, layout_options(model, options_, comm_.rank())),
        plan_(detail::plan_buckets(layout_, policy::buckets::capacity, policy::buckets::first, multiple_,
                                  strategy_type::bucket_cut)),
        hook_(make_hook()),
        state_(plan_, layout_.slot_units(), layout_.units().size(), strategy_type::initial_units,
               strategy_type::join_replays_scopes, comm_.rank()) {
    std::vector<std::string> descriptions;
    for (const auto& s : layout_.slots()) descriptions.push_back(s.describe());
    detail::verify_same_model(comm_, descriptions);
    detail::apply_precision<precision>(layout_, rank());  // mixed precision: dtypes checked (alike on every rank)
    unused_ = detail::unused_mask(layout_, options_.unused_parameters, rank());
    strategy_type::check_leaves(layout_, rank());
    if (options_.broadcast_parameters) {
      for (const auto& a : layout_.arenas()) comm_.broadcast(a.value_view(0, a.numel), 0).wait();
      detail::visit_buffers(model_, [&](std::string_view, raw_tensor b) { comm_.broadcast(b, 0).wait(); });
    }
    strategy_.emplace(layout_, plan_, state_, comm_, sharding_);
    masters_.attach<precision>(strategy_->optimizer_buffers());  // mixed precision: f32 masters of the owned values
    layout_.values_out();
    for (std::size_t s = 0; s < layout_.slots().size(); ++s)
      if (auto w = layout_.slots()[s].leaf->watch([this, s] { report(s); })) watches_.push_back(std::move(w));
    if (!watches_.empty()) strategy_->leaves_report_themselves();
  }

 public:

  /// Reports that `p`'s gradient for this backward is complete; starts every bucket that became ready.
  /// `p` is a leaf of the model, or the values object a ddp::trainable of the model refers to.
  template <class Leaf>
  void gradient_ready(const Leaf& p) {
    const auto i = layout_.find(leaf_key(p));
    if (i < 0)
      throw config_error("gradient_ready: the parameter at this address is not part of the wrapped model; report "
                         "the model's own parameters (dp.module().fc1.weight)", rank());
    report(static_cast<std::size_t>(i));
  }

  /// Waits for every bucket's reduction: afterwards all gradients are averaged across ranks. Throws
  /// ddp::error naming the parameters that did not report (unless declared unused or tolerated). After it,
  /// step(opt) steps these gradients; calling it again before the next backward does nothing.
  void finish_gradients() {
    state_.join().check("finish_gradients", rank());
    if (accumulation::defers(state_)) return;
    state_.no_sync().unclosed = false;
    if (const auto left = state_.close_all_backward(); !left.empty()) release_backward(left);
    if (state_.phase() == detail::step_phase::finished) return;
    if (state_.phase() == detail::step_phase::idle) begin_reporting();
    if (state_.started() < plan_.buckets.size()) {
      std::vector<std::string> missing;
      for (std::size_t s = 0; s < layout_.slots().size(); ++s)
        if (!state_.reported(s) && layout_.slots()[s].numel > 0) missing.push_back(layout_.slots()[s].name);
      if (options_.error_on_missing && !state_.join().shadowing()) {
        reduce_started();
        state_.abandon();
        std::string names;
        for (const auto& n : missing) names += (names.empty() ? "'" : ", '") + n + "'";
        throw error("finish_gradients: parameter(s) " + names + " did not report a gradient in this step; call "
                    "dp.gradient_ready(p) for each in the backward, or list them in "
                    "data_parallel_options::unused_parameters (or set error_on_missing = false)", rank());
      }
      for (std::size_t s = 0; s < layout_.slots().size(); ++s)
        if (!state_.reported(s)) {
          gradient_in(s);
          state_.report(s);
        }
      start_ready();
    }
    reduce_started();
    state_.join().rescale(strategy_->optimizer_buffers(), comm_.size());  // in a join scope: the mean over the active ranks
    state_.finish();
    rebuild_.after_step(comm_, layout_, plan_, state_, policy::buckets::capacity, policy::buckets::first);
  }

  /// Scope returned by no_sync() (parallel/no_sync.hpp): while open, gradients accumulate without a step.
  using no_sync_guard = ddp::no_sync_guard<data_parallel>;
  /// Starts a gradient-accumulation span (see no_sync_guard); the next synchronized backward reduces the
  /// accumulated gradients (the user's backward adds into the gradients, as PyTorch's does).
  no_sync_guard no_sync() {
    check_no_sync_closed("no_sync");
    accumulation::opening(state_, rank());
    if (state_.phase() == detail::step_phase::reporting && state_.no_sync().open == 0)
      throw error("no_sync: a synchronized backward is in progress (some gradients already reported); enter "
                  "no_sync before the backward starts", rank());
    return no_sync_guard(*this);
  }

  /// finish_gradients() (unless it ran already for this backward), then one optimizer step over the flat
  /// arenas (or the owned shards).
  template <optim::flat_optimizer Opt>
  void step(Opt& opt) {
    run_step([&] { opt.step(owned_buffers()); });
  }
  /// finish_gradients(), then `opt.step()` for an optimizer that holds its own tensors (torch::optim), then the
  /// policy's work after a step (shard_grad_op all-gathers the updated blocks). Under replicate it may hold
  /// the model's parameters; under the sharded policies it must hold the tensors over this rank's owned
  /// blocks (ddp::parameters(dp) of <ddp/adapters/libtorch.hpp>), since only those receive the averaged
  /// gradients (optim::optimizer_traits<Opt>::check, where specialized, says so before the step).
  template <class Opt>
    requires(!optim::flat_optimizer<Opt> && requires(Opt& o) { o.step(); })
  void step(Opt& opt) {
    strategy_type::check_optimizer(opt, owned_buffers(), rank());
    run_step([&] { opt.step(); });
  }
  /// Collective: checks that the ranks holding the same parameter values hold them bit for bit (a hash per
  /// parameter; one all_gather of two words per rank when they agree). Under replicate and shard_grad_op every
  /// rank holds the full values, and all are compared. Under full_shard a rank holds only its owned blocks,
  /// which are hashed and compared with the ranks owning the same blocks: the other groups under hybrid
  /// (without replicas there is nothing to compare, since every value has one owner). On a difference every
  /// rank throws ddp::mismatch_error naming the first differing parameter and the ranks that disagree.
  void verify_in_sync() {
    state_.join().check("verify_in_sync", rank());
    detail::verify_replicas(comm_, strategy_->digest(),
                            [&](std::size_t s) -> const std::string& { return layout_.slots()[s].name; });
  }
  /// Opens a join scope (PyTorch's `with model.join():`) for an epoch whose ranks hold different numbers of
  /// batches: open it on every rank, step as usual, call finish(opt) after the rank's last step (parallel/join.hpp).
  join_scope<data_parallel> join() { return join_scope<data_parallel>(*this); }
  /// Allocates the optimizer's state for this wrapper's layout without stepping (before loading a checkpoint).
  template <optim::flat_optimizer Opt>
  void attach(Opt& opt) {
    opt.attach(owned_buffers());
  }

  /// Sets every gradient to zero (finished gradients not yet stepped are dropped).
  void zero_grad() noexcept {
    strategy_->zero_grad();
    if (!layout_.adopting())
      for (const auto& s : layout_.slots()) s.leaf->zero_own_gradient();
    state_.end();
  }

  /// Collective under full_shard: all-gathers every unit into the model's own parameters, so they hold the
  /// full values, also after the wrapper is destroyed (FSDP's unshard of the whole model). Call it after the
  /// last step, outside every unshard scope; later steps do not update those values (call it again). Under
  /// replicate and shard_grad_op the parameters are whole already and it does nothing.
  void unshard_model() {
    state_.join().check("unshard_model", rank());
    strategy_->unshard_model();
  }
  /// RAII scope returned by unshard(): the units it names hold their full parameters while it lives; when the
  /// last scope on a unit closes, the unit is resharded (full_shard, unless it keeps the forward's units).
  class [[nodiscard]] unshard_guard {
   public:
    unshard_guard(data_parallel& dp, std::vector<std::size_t> units) : dp_(&dp), units_(std::move(units)) {
      dp_->state_.join().begin_step(dp_->comm_);
      dp_->state_.join().note(detail::step_event::kind::acquire, units_);
      dp_->strategy_->acquire(units_);
    }
    unshard_guard(const unshard_guard&) = delete;
    unshard_guard& operator=(const unshard_guard&) = delete;
    ~unshard_guard() {
      dp_->state_.join().note(detail::step_event::kind::release, units_);
      dp_->strategy_->release(units_);
    }
    /// What reopens this scope's units for their part of the backward (see ddp::backward_opener).
    [[nodiscard]] backward_opener<data_parallel> for_backward() const { return {*dp_, units_}; }

   private:
    data_parallel* dp_;
    std::vector<std::size_t> units_;
  };
  /// Opens a scope on the units (by default top-level fields) that `part` of the model holds; wrap each
  /// unit's forward and backward in one. Under full_shard it all-gathers the units and prefetches the next
  /// one; under full_shard and shard_grad_op it gives them gradient storage (report their gradients inside
  /// the scope). Under replicate it does nothing. Collective under full_shard.
  template <class Part>
  unshard_guard unshard(Part& part) {
    state_.join().check("unshard", rank());
    std::vector<std::size_t> units;
    visit_parameters(part, [&](std::string_view, auto& p) {
      const auto i = layout_.find(leaf_key(p));
      if (i < 0)
        throw config_error("unshard: this object holds parameters that are not the wrapped model's; pass a part "
                           "of dp.module() (such as dp.module().fc2)", rank());
      const std::size_t u = layout_.slots()[static_cast<std::size_t>(i)].unit;
      if (units.empty() || units.back() != u) units.push_back(u);
    });
    return unshard_guard(*this, std::move(units));
  }

  /// The wrapped model.
  [[nodiscard]] Model& module() noexcept { return model_; }
  /// The communicator of the group.
  [[nodiscard]] communicator_type& comm() noexcept { return comm_; }
  /// Number of ranks.
  [[nodiscard]] int world_size() const noexcept { return comm_.size(); }
  /// This process's rank.
  [[nodiscard]] int rank() const noexcept { return comm_.rank(); }
  /// Calls `f(name, leaf&)` for every leaf of the model, in visit order.
  template <class F>
  void for_each_parameter(F&& f) {
    visit_parameters(model_, f);
  }
  /// Every parameter (name, shape, dtype, unit) and where its full values lie in the arenas (checkpoints read it).
  [[nodiscard]] const detail::parameter_layout& layout() const noexcept { return layout_; }
  /// After the values changed outside a step (checkpoint loading calls it): mixed precision narrows the f32 masters
  /// into the owned values; owning leaves (copied at the step's edges) take the arenas' values.
  void values_changed() const { masters_.narrow(strategy_->optimizer_buffers()); layout_.values_out(); }
  /// The flat buffers the optimizer steps (mixed_precision: f32 masters): this rank's owned values and gradients
  /// (the whole arenas under replicate) with the parameter pieces in them; checkpoints read and fill them.
  [[nodiscard]] std::span<const optim::flat_buffer> owned_buffers() const noexcept {
    return masters_.buffers(strategy_->optimizer_buffers());
  }
  /// Number of gradient buckets (start units).
  [[nodiscard]] std::size_t bucket_count() const noexcept { return plan_.buckets.size(); }
  /// The gradient buckets in start order (rebuilt in the first step's ready order; bucket_rebuild.hpp).
  [[nodiscard]] const detail::bucket_plan& buckets() const noexcept { return plan_; }
  /// The comm hook this wrapper reduces buckets through (hooks may keep state).
  [[nodiscard]] hook_type& comm_hook() noexcept { return hook_; }
  /// The sharding policy's value: the settings the strategy uses.
  [[nodiscard]] const sharding& sharding_policy() const noexcept { return sharding_; }
  /// The sharding units' names, in visit order (data_parallel_options::units and unit_depth name them).
  [[nodiscard]] std::span<const std::string> units() const noexcept { return layout_.units(); }
  /// The group parameters are sharded over: comm() under replicate, shard_grad_op and full_shard; under
  /// hybrid the G ranks of this rank's shard group. Its stats() count the bytes moved inside the group.
  [[nodiscard]] communicator_type shard_group() const { return strategy_->shard_group(); }
  /// hybrid: the ranks holding the same shard in every group (their stats() count the bytes moved across
  /// groups); empty under the other policies.
  [[nodiscard]] std::optional<communicator_type> replica_group() const { return strategy_->replica_group(); }

 private:
  /// The options the layout reads: every ddp::unit_of entry of `options.units` resolved to its prefix.
  static data_parallel_options layout_options(Model& model, data_parallel_options options, int rank) {
    options.units = detail::resolve_units(model, options.units, rank);
    return options;
  }
  /// Opens backward scopes on those of `units` not open yet in this backward (backward_opener).
  void open_backward(std::span<const std::size_t> units) {
    if (const auto opened = state_.open_backward(units); !opened.empty()) {
      state_.join().note(detail::step_event::kind::acquire, opened);
      strategy_->acquire(opened);
    }
  }
  /// Closes the backward scopes of `units` (recorded for a join shadow step to replay).
  void release_backward(const std::vector<std::size_t>& units) {
    state_.join().note(detail::step_event::kind::release, units);
    strategy_->release(units);
  }
  /// The gradient of `slot` is final: starts every bucket that became ready.
  void report(std::size_t slot) {
    check_no_sync_closed("gradient_ready");
    strategy_->on_report(slot);
    state_.join().note(detail::step_event::kind::report, {}, slot);
    if (accumulation::defers(state_)) return;
    if (state_.phase() != detail::step_phase::reporting) begin_reporting();
    gradient_in(slot);
    if (!state_.report(slot))
      throw error("gradient_ready: parameter '" + layout_.slots()[slot].name + "' reported twice in one backward; "
                  "report each parameter once per step, after its gradient is final", rank());
    start_ready();
    if (const auto u = state_.close_backward(slot, layout_.slots()[slot].unit)) release_backward({*u});
  }
  /// A step around `run_optimizer`: gradients finished before it, the policy's after-step work after it.
  template <class F>
  void run_step(F&& run_optimizer) {
    state_.join().check("step", rank());
    if (state_.no_sync().open > 0)
      throw error("step: called inside no_sync(), where gradients are local and ranks would diverge; leave the "
                  "no_sync scope for the last micro-batch of the accumulation", rank());
    finish_gradients();
    masters_.step(strategy_->optimizer_buffers(), run_optimizer);  // mixed precision: on the f32 masters
    strategy_->after_step();
    layout_.values_out();
    state_.end();
    state_.join().end_step();
    ++steps_;
    if (options_.verify_every > 0 && steps_ % options_.verify_every == 0) verify_in_sync();
  }
  /// The step's first report: the declared-unused parameters count as reported.
  void begin_reporting() {
    state_.join().begin_step(comm_);  // in a join scope: the step's first collective counts the ranks still training
    state_.begin(unused_);
    if (!layout_.adopting())
      for (std::size_t s = 0; s < unused_.size(); ++s)
        if (unused_[s]) gradient_in(s);
  }
  /// Owning leaves: the gradient moves into ddp's memory (the accumulation trait says what becomes of the leaf's).
  void gradient_in(std::size_t slot) {
    auto& leaf = *layout_.slots()[slot].leaf;
    if (leaf.adopts()) return;
    leaf.gradient_in();
    accumulation::moved_in(leaf);
  }
  void start_ready() {
    while (const auto b = state_.next_ready()) strategy_->reduce(hook_, *b);
  }
  /// Waits for the started buckets in plan order; each becomes reduced.
  void reduce_started() {
    for (std::size_t b = 0; b < state_.started(); ++b)
      if (state_.bucket(b).phase != detail::bucket_phase::reduced) strategy_->reduced(hook_, b);
  }
  void check_no_sync_closed(const char* where) const {
    state_.join().check(where, rank());
    if (state_.no_sync().unclosed)
      throw error(std::string(where) + ": a no_sync() span of a sharded policy ended without close(), so its micro-batch's reduce-scatters were never completed; call guard.close() "
                  "at the end of the span (or dp.finish_gradients() now)", rank());
  }

  Model& model_;
  communicator_type comm_;
  data_parallel_options options_;
  sharding sharding_;                       // the sharding policy's value (its settings)
  std::size_t multiple_;                    // arena padding and bucket granularity (the shard group's size)
  detail::parameter_layout layout_;
  detail::bucket_plan plan_;
  hook_type hook_;
  detail::step_state state_;                // the step, its buckets and units, join, no_sync, backward scopes
  detail::bucket_rebuild rebuild_{options_.rebuild_buckets && strategy_type::rebuilds_buckets};  // after step 1
  std::optional<strategy_type> strategy_;   // made after the broadcast (the sharded ones copy owned values)
  detail::master_weights masters_;          // mixed precision: the f32 masters of the owned values
  std::vector<char> unused_;                // per slot: declared unused
  std::vector<std::shared_ptr<void>> watches_;  // leaves that report their own gradients (autograd hooks)
  std::size_t steps_ = 0;                   // optimizer steps taken (for options_.verify_every)
  friend class join_scope<data_parallel>;
  friend class backward_opener<data_parallel>;
  friend class ddp::no_sync_guard<data_parallel>;
};

/// `ddp::data_parallel dp{model, comm, policies...};` deduces the backend from the communicator's type
/// (ddp::backend_of) and the other policies from the values given, in any order.
template <class Model, class Comm, detail::policy... Ps>
data_parallel(Model&, Comm, Ps...) -> data_parallel<Model, backend_of_t<Comm>, Ps...>;
/// The same, with data_parallel_options last (at most one policy of each of the four other categories).
template <class Model, class Comm>
data_parallel(Model&, Comm, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>>;
template <class Model, class Comm, detail::policy P1>
data_parallel(Model&, Comm, P1, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>, P1>;
template <class Model, class Comm, detail::policy P1, detail::policy P2>
data_parallel(Model&, Comm, P1, P2, data_parallel_options) -> data_parallel<Model, backend_of_t<Comm>, P1, P2>;
template <class Model, class Comm, detail::policy P1, detail::policy P2, detail::policy P3>
data_parallel(Model&, Comm, P1, P2, P3, data_parallel_options)
    -> data_parallel<Model, backend_of_t<Comm>, P1, P2, P3>;
template <class Model, class Comm, detail::policy P1, detail::policy P2, detail::policy P3, detail::policy P4>
data_parallel(Model&, Comm, P1, P2, P3, P4, data_parallel_options)
    -> data_parallel<Model, backend_of_t<Comm>, P1, P2, P3, P4>;

}  // namespace ddp
// ---- end <ddp/parallel/data_parallel.hpp>

// ---- begin <ddp/optim/adamw.hpp>
/// \file ddp::optim::adamw: Adam with decoupled weight decay over flat buffers, with torch.optim.AdamW's
/// exact update.

#include <cmath>


namespace ddp::optim {

/// AdamW as torch.optim.AdamW (amsgrad off): p ·= 1 − lr·wd; m += (1 − β1)·(g − m);
/// v = β2·v + (1 − β2)·g²; p −= lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε).
/// State arrays: "exp_avg" and "exp_avg_sq"; the step counter is step_count().
class adamw : public detail::flat_state {
 public:
  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;            ///< learning rate
    double beta1 = 0.9;          ///< decay of the first moment
    double beta2 = 0.999;        ///< decay of the second moment
    double eps = 1e-8;           ///< added to the denominator
    double weight_decay = 1e-2;  ///< decoupled weight decay
  };

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit adamw(options o) : flat_state({"exp_avg", "exp_avg_sq"}), opt_(o) {
    if (o.lr < 0 || o.eps < 0 || o.weight_decay < 0 || o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1)
      throw config_error("optim::adamw: need lr, eps, weight_decay >= 0 and betas in [0, 1)");
  }

  /// The hyper-parameters (lr may be changed between steps, e.g. by a schedule).
  [[nodiscard]] options& settings() noexcept { return opt_; }

  /// One update of every flat buffer.
  void step(std::span<const flat_buffer> buffers) {
    const auto t = static_cast<double>(steps_ + 1);
    const double correction1 = 1 - std::pow(opt_.beta1, t);
    const double correction2_sqrt = std::sqrt(1 - std::pow(opt_.beta2, t));
    for_each_buffer(buffers, "optim::adamw", [&]<class T>(std::span<T> p, std::span<const T> g, auto arrays) {
      const T decay = static_cast<T>(1 - opt_.lr * opt_.weight_decay);
      const T b1 = static_cast<T>(opt_.beta1), b2 = static_cast<T>(opt_.beta2);
      const T step_size = static_cast<T>(opt_.lr / correction1);
      const T c2 = static_cast<T>(correction2_sqrt), eps = static_cast<T>(opt_.eps);
      std::span<T> m = arrays[0], v = arrays[1];
      for (std::size_t i = 0; i < p.size(); ++i) {
        p[i] *= decay;
        m[i] += (T{1} - b1) * (g[i] - m[i]);  // torch's lerp_ for weights below 0.5
        v[i] = b2 * v[i] + (T{1} - b2) * g[i] * g[i];
        p[i] -= step_size * m[i] / (std::sqrt(v[i]) / c2 + eps);
      }
    });
    ++steps_;
  }

 private:
  options opt_;
};

static_assert(flat_optimizer<adamw>);

}  // namespace ddp::optim
// ---- end <ddp/optim/adamw.hpp>
// ---- begin <ddp/optim/sgd.hpp>
/// \file ddp::optim::sgd: stochastic gradient descent with momentum, dampening, Nesterov and weight
/// decay over flat buffers, with torch.optim.SGD's exact update.



namespace ddp::optim {

/// SGD as torch.optim.SGD: g = grad + wd·p; with momentum, buf = g on the first step, else
/// buf = momentum·buf + (1 − dampening)·g, and g = g + momentum·buf (Nesterov) or buf; p −= lr·g.
/// State array: "momentum_buffer" (only when momentum ≠ 0).
class sgd : public detail::flat_state {
 public:
  /// Hyper-parameters, named as in PyTorch.
  struct options {
    double lr = 1e-3;            ///< learning rate
    double momentum = 0;         ///< momentum factor
    double dampening = 0;        ///< dampening of the momentum
    bool nesterov = false;       ///< Nesterov momentum (needs momentum > 0 and dampening 0)
    double weight_decay = 0;     ///< L2 penalty added to the gradient
  };

  /// Builds the optimizer; throws ddp::config_error for settings PyTorch also rejects.
  explicit sgd(options o) : flat_state(o.momentum != 0 ? std::vector<std::string_view>{"momentum_buffer"}
                                                         : std::vector<std::string_view>{}),
                            opt_(o) {
    if (o.lr < 0 || o.momentum < 0 || o.weight_decay < 0)
      throw config_error("optim::sgd: lr, momentum and weight_decay must be >= 0");
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
      throw config_error("optim::sgd: Nesterov momentum needs momentum > 0 and dampening 0");
  }

  /// The hyper-parameters (lr may be changed between steps, e.g. by a schedule).
  [[nodiscard]] options& settings() noexcept { return opt_; }

  /// One update of every flat buffer.
  void step(std::span<const flat_buffer> buffers) {
    const bool first = steps_ == 0;
    for_each_buffer(buffers, "optim::sgd", [&]<class T>(std::span<T> p, std::span<const T> g, auto arrays) {
      const T lr = static_cast<T>(opt_.lr), wd = static_cast<T>(opt_.weight_decay);
      const T mu = static_cast<T>(opt_.momentum), keep = static_cast<T>(1 - opt_.dampening);
      for (std::size_t i = 0; i < p.size(); ++i) {
        T d = g[i];
        if (opt_.weight_decay != 0) d += wd * p[i];
        if (opt_.momentum != 0) {
          T& buf = arrays[0][i];
          buf = first ? d : mu * buf + keep * d;
          d = opt_.nesterov ? d + mu * buf : buf;
        }
        p[i] -= lr * d;
      }
    });
    ++steps_;
  }

 private:
  options opt_;
};

static_assert(flat_optimizer<sgd>);

}  // namespace ddp::optim
// ---- end <ddp/optim/sgd.hpp>

// ---- begin <ddp/data/distributed_sampler.hpp>
/// \file ddp::distributed_sampler: which dataset indices each rank visits in an epoch, with PyTorch's
/// DistributedSampler semantics (seed + epoch shuffle, padding by repetition or drop_last, rank r takes
/// positions r, r+N, ...), plus an exact-once mode for evaluation (no padding: every sample on one rank).



namespace ddp {

namespace detail {

/// SplitMix64: a tiny, fully specified generator, so every rank and every standard library draws the same numbers.
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t operator()() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, bound) without modulo bias (rejection of the short top range).
  std::uint64_t below(std::uint64_t bound) noexcept {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % bound);
    std::uint64_t x = 0;
    do x = (*this)(); while (x >= limit);
    return x % bound;
  }

 private:
  std::uint64_t state_;
};

/// 0..n-1 in the order of a Fisher-Yates shuffle driven by splitmix64(seed).
inline std::vector<std::size_t> seeded_permutation(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  splitmix64 rng(seed);
  for (std::size_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return order;
}

}  // namespace detail

/// A rank's indices for one epoch, iterated as consecutive batches (std::span<const std::size_t>).
class index_batches {
 public:
  /// Iterator over the batches.
  class iterator {
   public:
    using value_type = std::span<const std::size_t>;    ///< one batch
    using difference_type = std::ptrdiff_t;              ///< distance in batches
    iterator() = default;
    iterator(const index_batches* owner, std::size_t batch) noexcept : owner_(owner), batch_(batch) {}
    value_type operator*() const noexcept { return (*owner_)[batch_]; }
    iterator& operator++() noexcept { ++batch_; return *this; }
    iterator operator++(int) noexcept { auto copy = *this; ++batch_; return copy; }
    bool operator==(const iterator& other) const noexcept { return batch_ == other.batch_; }

   private:
    const index_batches* owner_ = nullptr;
    std::size_t batch_ = 0;
  };

  /// Splits `indices` into batches of `batch_size`; the last one is shorter unless `drop_last_batch`.
  index_batches(std::vector<std::size_t> indices, std::size_t batch_size, bool drop_last_batch)
      : indices_(std::move(indices)), batch_(batch_size) {
    if (batch_size == 0) throw config_error("distributed_sampler::batches: the batch size must be at least 1");
    count_ = drop_last_batch ? indices_.size() / batch_ : (indices_.size() + batch_ - 1) / batch_;
  }
  /// Number of batches.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  /// Batch `b` (b < size()).
  [[nodiscard]] std::span<const std::size_t> operator[](std::size_t b) const noexcept {
    const std::size_t first = b * batch_;
    return std::span<const std::size_t>(indices_).subspan(first, std::min(batch_, indices_.size() - first));
  }
  /// First batch.
  [[nodiscard]] iterator begin() const noexcept { return {this, 0}; }
  /// Past the last batch.
  [[nodiscard]] iterator end() const noexcept { return {this, count_}; }
  /// All indices of the epoch for this rank, in order.
  [[nodiscard]] const std::vector<std::size_t>& indices() const noexcept { return indices_; }

 private:
  std::vector<std::size_t> indices_;
  std::size_t batch_;
  std::size_t count_ = 0;
};

/// How the sampler splits the dataset.
struct sampler_options {
  bool shuffle = true;        ///< permute by seed + epoch (PyTorch's shuffle=True)
  std::uint64_t seed = 0;     ///< base seed, the same on every rank
  bool drop_last = false;     ///< drop the tail so ranks get equal counts, instead of padding by repetition
  bool exact_once = false;    ///< evaluation: no padding, no dropping; every sample on exactly one rank
};

/// Which dataset indices each rank visits per epoch. Every rank computes the same permutation (seed + epoch,
/// own generator), so no communication is needed; the communicator only supplies rank and size.
class distributed_sampler {
 public:
  using options = sampler_options;  ///< how the sampler splits the dataset

  /// A sampler of `dataset_size` samples for rank `rank` of `world_size`.
  distributed_sampler(std::size_t dataset_size, int world_size, int rank, options o = {})
      : size_(dataset_size), world_(world_size), rank_(rank), opt_(o) {
    if (world_size < 1 || rank < 0 || rank >= world_size)
      throw config_error("distributed_sampler: rank " + std::to_string(rank) + " of world size " +
                         std::to_string(world_size) + " is out of range; pass comm.rank() and comm.size()");
    if (o.exact_once && o.drop_last)
      throw config_error("distributed_sampler: exact_once and drop_last exclude each other (exact_once keeps every "
                         "sample exactly once); set only one");
  }
  /// A sampler for the rank and size of `comm` (any ddp::communicator, or anything with rank() and size()).
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; { c.size() } -> std::convertible_to<int>; }
  distributed_sampler(std::size_t dataset_size, const Comm& comm, options o = {})
      : distributed_sampler(dataset_size, comm.size(), comm.rank(), o) {}

  /// Samples this rank visits per epoch: ceil(size/N) padded, floor(size/N) with drop_last (as PyTorch's
  /// num_samples); with exact_once, ceil or floor depending on the rank (the counts differ by at most one).
  [[nodiscard]] std::size_t num_samples() const noexcept {
    const auto n = static_cast<std::size_t>(world_), r = static_cast<std::size_t>(rank_);
    if (opt_.exact_once) return size_ / n + (r < size_ % n ? 1 : 0);
    return opt_.drop_last ? size_ / n : (size_ + n - 1) / n;
  }
  /// Samples all ranks visit together per epoch (PyTorch's total_size; the dataset size with exact_once).
  [[nodiscard]] std::size_t total_size() const noexcept {
    const auto n = static_cast<std::size_t>(world_);
    if (opt_.exact_once) return size_;
    return (opt_.drop_last ? size_ / n : (size_ + n - 1) / n) * n;
  }
  /// Dataset size.
  [[nodiscard]] std::size_t dataset_size() const noexcept { return size_; }

  /// This rank's indices in epoch `epoch` (the epoch reseeds the shuffle: pass it every epoch).
  [[nodiscard]] std::vector<std::size_t> indices(std::uint64_t epoch) const {
    std::vector<std::size_t> all;
    if (opt_.shuffle) {
      all = detail::seeded_permutation(size_, opt_.seed + epoch);
    } else {
      all.resize(size_);
      std::iota(all.begin(), all.end(), std::size_t{0});
    }
    const std::size_t total = total_size();
    if (total > size_ && size_ > 0) {  // pad by repeating from the start, as often as needed
      all.reserve(total);
      for (std::size_t i = 0; all.size() < total; ++i) all.push_back(all[i % size_]);
    }
    all.resize(std::min(all.size(), total));
    std::vector<std::size_t> mine;
    mine.reserve(num_samples());
    for (std::size_t i = static_cast<std::size_t>(rank_); i < all.size(); i += static_cast<std::size_t>(world_))
      mine.push_back(all[i]);
    return mine;
  }
  /// This rank's indices in epoch `epoch` as batches of `batch_size` (the last shorter unless `drop_last_batch`).
  [[nodiscard]] index_batches batches(std::uint64_t epoch, std::size_t batch_size, bool drop_last_batch = false) const {
    return {indices(epoch), batch_size, drop_last_batch};
  }

 private:
  std::size_t size_;
  int world_;
  int rank_;
  options opt_;
};

}  // namespace ddp
// ---- end <ddp/data/distributed_sampler.hpp>
// ---- begin <ddp/data/metrics.hpp>
/// \file Metric sums (loss, correct predictions, samples) reduced across ranks in one all_reduce.



namespace ddp {

/// Sums a rank accumulates over its batches; reduced() adds them over all ranks.
struct metric_sums {
  double loss_sum = 0;  ///< sum of per-sample losses
  double correct = 0;   ///< number of correct predictions
  double samples = 0;   ///< number of samples seen

  /// Adds one batch: `batch_loss_sum` summed over its `batch_samples` samples, `batch_correct` right.
  void add(double batch_loss_sum, double batch_correct, double batch_samples) noexcept {
    loss_sum += batch_loss_sum;
    correct += batch_correct;
    samples += batch_samples;
  }
  /// Mean loss per sample (0 when no sample was seen).
  [[nodiscard]] double mean_loss() const noexcept { return samples > 0 ? loss_sum / samples : 0.0; }
  /// Fraction of correct predictions (0 when no sample was seen).
  [[nodiscard]] double accuracy() const noexcept { return samples > 0 ? correct / samples : 0.0; }

  /// The sums over every rank of `comm` (one all_reduce of three f64). Collective; throws what the backend
  /// throws, such as ddp::timeout_error when a rank does not join.
  template <class Comm>
  [[nodiscard]] metric_sums reduced(Comm& comm) const {
    std::array<double, 3> v{loss_sum, correct, samples};
    comm.all_reduce(std::span<double>(v), reduce_op::sum).wait();
    return {v[0], v[1], v[2]};
  }
};

}  // namespace ddp
// ---- end <ddp/data/metrics.hpp>

#if defined(DDP_WITH_MPI)
// ---- begin <ddp/comm/mpi/communicator.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_MPI_COMMUNICATOR_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_MPI_COMMUNICATOR_HPP
/// \file ddp::mpi::communicator: the ddp::communicator over MPI (Open MPI). Collectives larger than
/// config::eager_bytes run asynchronously through MPI's non-blocking calls (MPI_Iallreduce,
/// MPI_Ireduce_scatter_block, ...); smaller ones run MPI's blocking call (MPI_Allreduce, ...), which Open MPI
/// completes faster, and return a completed ddp::work. Barrier, send and recv are always non-blocking.
///
/// Conventions:
/// - The collective front end (comm/front_end.hpp) checks the arguments, numbers and counts each operation and,
///   with DDP_CHECK_COLLECTIVES=1, compares each collective across the ranks first; this file only starts them.
/// - avg is an MPI sum followed by a division by size() on this rank once the operation completes;
///   integer dtypes use integer division (truncation toward zero), bf16/f16 divide in float.
/// - bf16 and f16 travel as user-defined 2-byte MPI datatypes; their sum/min/max/prod operators compute in
///   float and round each partial result back to the 2-byte type.
/// - stats() counts the payload bytes this rank must send in the algorithm-independent accounting (B is the
///   byte size of this rank's buffer argument, N = size()): all_reduce 2(N-1)/N·B, reduce_scatter (N-1)/N·B_in,
///   all_gather (N-1)·B_in, all_to_all (N-1)/N·B_in, broadcast B on the root, reduce and gather B on every
///   non-root, scatter (N-1)/N·B_in on the root, send B, recv and barrier 0.
/// - Device (CUDA) buffers go straight to MPI when it is CUDA-aware (MPIX_Query_cuda_support(), checked at run
///   time) for every operation except avg and bf16/f16 reductions, which compute on the host; otherwise a device
///   buffer raises ddp::error (host staging comes with the CUDA backend).

// ---- begin <ddp/comm/mpi/request.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_MPI_REQUEST_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_MPI_REQUEST_HPP
/// \file One in-flight operation of ddp::mpi::communicator: an MPI request polled with MPI_Test, finishing avg on
/// completion.

// ---- begin <ddp/comm/mpi/group.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_MPI_GROUP_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_MPI_GROUP_HPP
/// \file The MPI side of ddp::mpi::communicator: its settings, MPI's initialization, error handlers of borrowed
/// communicators, and the group state every copy of a communicator shares.

// ---- begin <ddp/comm/mpi/datatypes.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_MPI_DATATYPES_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_MPI_DATATYPES_HPP
/// \file MPI datatypes and reduction operators for ddp's dtypes and reduce_ops, including the user-defined
/// bf16/f16 types (2 contiguous bytes) and their sum/min/max/prod operators, which compute in float.

// ddp uses MPI's C API only: keep Open MPI's and MPICH's deprecated C++ bindings (libmpi_cxx) out.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <array>
#include <string>


namespace ddp::mpi::detail {

/// The message of MPI error `code`: "MPI_ERR_TRUNCATE: message truncated" style text from MPI_Error_string.
inline std::string error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(std::max(length, 0)));
}

/// Throws ddp::mpi_error "`what` failed: <MPI's text> (MPI error N); <hint>" when `code` is not MPI_SUCCESS.
inline void check(int code, const std::string& what, int rank) {
  if (code == MPI_SUCCESS) return;
  throw mpi_error(what + " failed: " + error_text(code) + " (MPI error " + std::to_string(code) +
                      "); check that every rank of the group makes the same calls in the same order with matching "
                      "counts, dtypes, roots and tags",
                  rank, code);
}

/// Process-wide MPI handles for the 2-byte float types: created once, after MPI_Init, released by MPI_Finalize.
struct half_handles {
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;        ///< 2 contiguous bytes holding a ddp::bfloat16
  MPI_Datatype f16 = MPI_DATATYPE_NULL;         ///< 2 contiguous bytes holding a ddp::float16
  std::array<MPI_Op, 4> ops{};                  ///< sum, min, max, prod over either type
};

inline const half_handles& half_types();

/// Combines `in` into `inout` element-wise as float, rounding each result back to T.
template <class T, class F>
void combine_as(const void* in, void* inout, int length, F f) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < length; ++i) b[i] = T(f(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

/// The MPI_User_function of reduce_op Op over bf16 or f16 (told apart by the datatype handle).
template <reduce_op Op>
void half_reduce(void* in, void* inout, int* length, MPI_Datatype* type) {
  const auto f = [](float a, float b) {
    if constexpr (Op == reduce_op::min) return std::min(a, b);
    else if constexpr (Op == reduce_op::max) return std::max(a, b);
    else if constexpr (Op == reduce_op::prod) return a * b;
    else return a + b;  // sum; avg is a sum scaled afterwards
  };
  if (*type == half_types().bf16) combine_as<bfloat16>(in, inout, *length, f);
  else combine_as<float16>(in, inout, *length, f);
}

inline const half_handles& half_types() {
  static const half_handles handles = [] {
    half_handles h;
    const auto make_type = [](MPI_Datatype& t) {
      check(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous for a 2-byte float type", -1);
      check(MPI_Type_commit(&t), "MPI_Type_commit for a 2-byte float type", -1);
    };
    make_type(h.bf16);
    make_type(h.f16);
    const std::array<MPI_User_function*, 4> functions{&half_reduce<reduce_op::sum>, &half_reduce<reduce_op::min>,
                                                      &half_reduce<reduce_op::max>, &half_reduce<reduce_op::prod>};
    for (std::size_t i = 0; i < functions.size(); ++i)
      check(MPI_Op_create(functions[i], /*commute=*/1, &h.ops[i]), "MPI_Op_create for a 2-byte float operator", -1);
    return h;
  }();
  return handles;
}

/// The MPI datatype of `t`.
inline MPI_Datatype datatype(dtype t) {
  switch (t) {
    case dtype::f64: return MPI_DOUBLE;
    case dtype::bf16: return half_types().bf16;
    case dtype::f16: return half_types().f16;
    case dtype::i32: return MPI_INT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::f32: break;
  }
  return MPI_FLOAT;
}

/// The MPI operator reducing `t` with `op` (avg reduces with the sum; the caller scales afterwards).
inline MPI_Op reduction(reduce_op op, dtype t) {
  const bool half = t == dtype::bf16 || t == dtype::f16;
  switch (op) {
    case reduce_op::min: return half ? half_types().ops[1] : MPI_MIN;
    case reduce_op::max: return half ? half_types().ops[2] : MPI_MAX;
    case reduce_op::prod: return half ? half_types().ops[3] : MPI_PROD;
    case reduce_op::sum: case reduce_op::avg: break;
  }
  return half ? half_types().ops[0] : MPI_SUM;
}

}  // namespace ddp::mpi::detail
#endif  // DDP_SINGLE_HEADER_DDP_COMM_MPI_DATATYPES_HPP
// ---- end <ddp/comm/mpi/datatypes.hpp>

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>


namespace ddp::mpi {

/// Settings of an MPI communicator, shared by the groups split from it.
///
/// MPI moves a non-blocking operation forward only inside MPI calls, so a wait polls MPI_Test: back to back for
/// `spin` (as MPI_Wait does, so short operations see MPI's own latency; Open MPI's progress loop yields the core
/// by itself on a host running more ranks than cores), then sleeping between polls, the sleeps growing from
/// 1 µs to `max_sleep`, so that a long operation neither burns a core nor stalls for long.
///
/// Open MPI's non-blocking collectives (libnbc) are slower than its blocking ones (coll/tuned) on small
/// buffers: a collective of at most `eager_bytes` (see communicator::eager) therefore runs MPI's blocking call
/// inside the ddp call and returns a completed work. Such a call cannot time out (a stuck peer blocks it) and
/// overlaps nothing; 0 makes every collective non-blocking.
struct config {
  /// How long wait() waits before it raises ddp::timeout_error.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// How long a wait polls back to back before it starts sleeping between polls.
  std::chrono::microseconds spin{std::chrono::milliseconds(5)};
  /// The longest sleep between two polls after that.
  std::chrono::microseconds max_sleep{50};
  /// Collectives on at most this many bytes run blocking and complete on start; must be equal on every rank.
  std::size_t eager_bytes{std::size_t{256} << 10};
};

namespace detail {

/// True once MPI_Finalize has run (handles must not be touched any more).
inline bool finalized() noexcept {
  int done = 0;
  MPI_Finalized(&done);
  return done != 0;
}

/// Initializes MPI once (MPI_THREAD_MULTIPLE) and finalizes it at exit if this library initialized it.
/// Before MPI_Init it selects libnbc's Rabenseifner all-reduce (reduce-scatter then all-gather) unless
/// OMPI_MCA_coll_libnbc_iallreduce_algorithm is set: Open MPI 4.1 otherwise runs in-place MPI_Iallreduce as a
/// binomial reduce + broadcast, up to twice as slow as blocking MPI_Allreduce on large buffers.
class runtime {
 public:
  /// Makes sure MPI is initialized; argc/argv may be null.
  static void ensure(int* argc, char*** argv) { static const runtime instance(argc, argv); }
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;
  ~runtime() {
    if (owned_ && !finalized()) MPI_Finalize();
  }

 private:
  runtime(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized != 0) return;  // the application owns MPI; it finalizes it too
    ::setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
    int provided = 0;
    check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread", -1);
    owned_ = true;
  }
  bool owned_ = false;
};

/// Keeps MPI_ERRORS_RETURN on a communicator ddp does not own while any wrapper of it lives, then restores the
/// handler it had before the first one; wrappers are counted, so the order they go away in does not matter.
class borrowed_error_handlers {
 public:
  static void acquire(MPI_Comm comm, int rank) {
    std::lock_guard lock(mutex());
    entry& e = entries()[comm];
    if (e.users == 0) {
      check(MPI_Comm_get_errhandler(comm, &e.previous), "MPI_Comm_get_errhandler", rank);
      check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    }
    ++e.users;
  }
  static void release(MPI_Comm comm) {
    std::lock_guard lock(mutex());
    const auto it = entries().find(comm);
    if (it == entries().end() || --it->second.users > 0) return;
    MPI_Comm_set_errhandler(comm, it->second.previous);
    MPI_Errhandler_free(&it->second.previous);
    entries().erase(it);
  }

 private:
  struct entry {
    int users = 0;
    MPI_Errhandler previous = MPI_ERRHANDLER_NULL;
  };
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<MPI_Comm, entry>& entries() {
    static std::map<MPI_Comm, entry> e;
    return e;
  }
};

/// The state every copy of a communicator shares: the MPI_Comm, its settings and the front end's state.
struct group {
  group(MPI_Comm c, bool own, config settings) : comm(c), owned(own), cfg(settings) {
    check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", -1);
    check(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank);
    void* value = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm, MPI_TAG_UB, &value, &found), "MPI_Comm_get_attr(MPI_TAG_UB)", rank);
    if (found != 0) max_tag = *static_cast<int*>(value);
    if (owned) check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", rank);
    else borrowed_error_handlers::acquire(comm, rank);
  }
  group(const group&) = delete;
  group& operator=(const group&) = delete;
  ~group() {
    if (finalized()) return;
    if (owned) MPI_Comm_free(&comm);
    else borrowed_error_handlers::release(comm);
  }

  MPI_Comm comm;
  bool owned;
  config cfg;
  int rank = 0;
  int size = 1;
  int max_tag = 32767;  // the MPI standard's guaranteed minimum of MPI_TAG_UB
  ddp::detail::front_state front;  ///< statistics, sequence numbers and the call check of the collective front end
};

}  // namespace detail
}  // namespace ddp::mpi
#endif  // DDP_SINGLE_HEADER_DDP_COMM_MPI_GROUP_HPP
// ---- end <ddp/comm/mpi/group.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>


namespace ddp::mpi::detail {

/// One operation from its call to its completion: what it is, and what must happen or stay alive until then.
struct operation {
  ddp::detail::call_info info;     ///< what it is; info.average is divided by the group size on completion
  std::vector<std::byte> scratch;  ///< a copy of an input that overlaps the output, alive until done
};

/// One in-flight MPI request; polled with MPI_Test.
class request_state final : public ddp::detail::work_state {
 public:
  request_state(std::shared_ptr<group> g, operation op) : group_(std::move(g)), op_(std::move(op)) {}
  request_state(const request_state&) = delete;
  request_state& operator=(const request_state&) = delete;

  /// Drops an incomplete operation: a recv is cancelled; anything else is waited for up to the timeout, since
  /// MPI cannot cancel collectives (past the timeout a send's request is freed and a collective's abandoned).
  ~request_state() override {
    if (done_ || request == MPI_REQUEST_NULL || finalized()) return;
    if (op_.info.receive()) {
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
      return;
    }
    try {
      if (wait_until(clock::now() + group_->cfg.timeout)) return;
    } catch (const std::exception&) {  // a destructor reports nothing; the error was the caller's to wait for
      return;
    }
    if (op_.info.kind == collective::send_recv) MPI_Request_free(&request);
  }

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    if (test()) return true;  // the common case for short operations, before any clock reading
    const auto start = clock::now();
    std::chrono::microseconds pause{0};
    for (unsigned polls = 1;; ++polls) {
      if (test()) return true;
      if (pause.count() == 0 && polls % 64 != 0) continue;  // while spinning, read the clock every 64 polls
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) continue;
      pause = std::clamp(pause * 2, std::chrono::microseconds(1), group_->cfg.max_sleep);
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return ddp::detail::describe(op_.info); }

  MPI_Request request = MPI_REQUEST_NULL;  ///< the MPI request to poll

 private:
  /// One MPI_Test; finishes avg on completion. The caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    int flag = 0;
    const int code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      done_ = true;
      try {
        check(code, describe(), group_->rank);
      } catch (const mpi_error&) {
        error_ = std::current_exception();
      }
      std::rethrow_exception(error_);
    }
    if (flag == 0) return false;
    if (op_.info.average.size != 0) ddp::detail::divide(op_.info.average, op_.info.group_size);
    op_.scratch = {};
    done_ = true;
    return true;
  }

  std::shared_ptr<group> group_;
  operation op_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace ddp::mpi::detail
#endif  // DDP_SINGLE_HEADER_DDP_COMM_MPI_REQUEST_HPP
// ---- end <ddp/comm/mpi/request.hpp>

#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>


namespace ddp::mpi {

/// A group of MPI processes modelling ddp::communicator. Copies share the group; the last copy frees an
/// MPI_Comm this library created (split); an MPI_Comm it was given returns errors while any communicator wraps it,
/// and gets its own error handler back after the last one.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  using backend_tag = ddp::backend::mpi;  ///< the backend tag data_parallel deduces from this communicator
  /// MPI_COMM_WORLD, initializing MPI (MPI_THREAD_MULTIPLE) on first use and finalizing it at exit.
  static communicator world(int& argc, char**& argv, config settings = {}) {
    detail::runtime::ensure(&argc, &argv);
    return communicator(MPI_COMM_WORLD, settings);
  }
  /// MPI_COMM_WORLD, initializing MPI without the program's arguments.
  static communicator world(config settings = {}) {
    detail::runtime::ensure(nullptr, nullptr);
    return communicator(MPI_COMM_WORLD, settings);
  }
  /// Wraps an existing communicator without taking ownership: MPI must be initialized and `comm` must outlive
  /// every copy. Its error handler is MPI_ERRORS_RETURN while a copy lives, then restored.
  explicit communicator(MPI_Comm comm, config settings = {})
      : group_(std::make_shared<detail::group>(comm, false, settings)) {}

  /// This process's rank in the group.
  [[nodiscard]] int rank() const noexcept { return group_->rank; }
  /// Number of processes in the group.
  [[nodiscard]] int size() const noexcept { return group_->size; }
  /// The underlying MPI communicator.
  [[nodiscard]] MPI_Comm native_handle() const noexcept { return group_->comm; }
  /// The settings this group runs with.
  [[nodiscard]] const config& settings() const noexcept { return group_->cfg; }
  /// Bytes sent and operations started so far (see the file comment for the byte accounting).
  [[nodiscard]] comm_stats stats() const noexcept { return group_->front.stats.snapshot(); }

  /// True when the MPI library reports CUDA support at run time (MPIX_Query_cuda_support).
  [[nodiscard]] static bool cuda_aware() noexcept {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
    return MPIX_Query_cuda_support() == 1;
#else
    return false;
#endif
  }

  /// Collective: ranks with the same color (≥ 0) form a new group, ordered by key, then by rank here.
  [[nodiscard]] communicator split(int color, int key) const {
    if (color < 0)
      throw error("split: color " + std::to_string(color) + " is negative; pass a color >= 0 on every rank",
                  rank());
    MPI_Comm out = MPI_COMM_NULL;
    detail::check(MPI_Comm_split(group_->comm, color, key, &out),
                  "split(color " + std::to_string(color) + ", key " + std::to_string(key) + ")", rank());
    return communicator(std::make_shared<detail::group>(out, true, group_->cfg));
  }

  /// True when a collective on `bytes` runs MPI's blocking call and completes on start (config::eager_bytes).
  /// `bytes` is the buffer of all_reduce, broadcast and reduce, and the N·k-element side of reduce_scatter,
  /// all_gather, gather, scatter and all_to_all: the same on every rank, so every rank makes the same choice.
  [[nodiscard]] bool eager(std::size_t bytes) const noexcept { return bytes <= group_->cfg.eager_bytes; }

  /// The largest tag send and recv accept (MPI_TAG_UB of this MPI).
  [[nodiscard]] int max_tag() const noexcept { return group_->max_tag; }

 private:
  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end does every duty for MPI: sequence, statistics, avg (divided here on completion), call check.
  static constexpr ddp::detail::front_duties duties{.group = "an MPI group"};

  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  [[nodiscard]] ddp::detail::front_state& front() const noexcept { return group_->front; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->front.flight; }

  work start_all_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Allreduce, MPI_Iallreduce, MPI_IN_PLACE, b.data, n, detail::datatype(b.type),
                  detail::reduction(op, b.type), group_->comm);
  }

  work start_reduce_scatter(const call& c, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, out.size);
    return start(std::move(o), in.bytes(), MPI_Reduce_scatter_block, MPI_Ireduce_scatter_block, src, out.data, n,
                  detail::datatype(out.type), detail::reduction(op, out.type), group_->comm);
  }

  work start_all_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), out.bytes(), MPI_Allgather, MPI_Iallgather, src, n, t, out.data, n, t, group_->comm);
  }

  work start_broadcast(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Bcast, MPI_Ibcast, b.data, n, detail::datatype(b.type), c.peer, group_->comm);
  }

  work start_reduce(const call& c, const raw_tensor& b, reduce_op op) {
    device_check(c, b);
    const bool at_root = rank() == c.peer;
    const int n = count_of(c, b.size);
    return start({c, {}}, b.bytes(), MPI_Reduce, MPI_Ireduce, at_root ? MPI_IN_PLACE : b.data,
                  at_root ? b.data : nullptr, n, detail::datatype(b.type), detail::reduction(op, b.type), c.peer,
                  group_->comm);
  }

  work start_gather(const call& c, const raw_tensor& in, const raw_tensor& out) {
    const bool at_root = rank() == c.peer;
    device_check(c, in);
    detail::operation o{c, {}};
    const void* src = in.data;
    if (at_root) {
      device_check(c, out);
      src = unaliased(o, in, out);
    }
    const int n = count_of(c, in.size);
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), group_bytes(in), MPI_Gather, MPI_Igather, src, n, t, at_root ? out.data : nullptr, n,
                  t, c.peer, group_->comm);
  }

  work start_scatter(const call& c, const raw_tensor& in, const raw_tensor& out) {
    const bool at_root = rank() == c.peer;
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = nullptr;
    if (at_root) {
      device_check(c, in);
      src = unaliased(o, in, out);
    }
    const int n = count_of(c, out.size);
    const MPI_Datatype t = detail::datatype(out.type);
    return start(std::move(o), group_bytes(out), MPI_Scatter, MPI_Iscatter, src, n, t, out.data, n, t, c.peer,
                  group_->comm);
  }

  work start_all_to_all(const call& c, const raw_tensor& in, const raw_tensor& out) {
    device_check(c, in);
    device_check(c, out);
    detail::operation o{c, {}};
    const void* src = unaliased(o, in, out);
    const int n = count_of(c, in.size / static_cast<std::size_t>(size()));
    const MPI_Datatype t = detail::datatype(in.type);
    return start(std::move(o), in.bytes(), MPI_Alltoall, MPI_Ialltoall, src, n, t, out.data, n, t, group_->comm);
  }

  /// Always non-blocking, so it can time out.
  work start_barrier(const call& c) { return post({c, {}}, MPI_Ibarrier, group_->comm); }

  work start_send(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return post({c, {}}, MPI_Isend, b.data, n, detail::datatype(b.type), c.peer, c.tag, group_->comm);
  }

  /// A bigger message than `b` is an error (MPI_ERR_TRUNCATE).
  work start_recv(const call& c, const raw_tensor& b) {
    device_check(c, b);
    const int n = count_of(c, b.size);
    return post({c, {}}, MPI_Irecv, b.data, n, detail::datatype(b.type), c.peer, c.tag, group_->comm);
  }

  /// Runs a collective on `bytes` (see eager()): eagerly as `blocking(args...)`, returning a completed work that
  /// carries its error if it failed, or as `nonblocking(args..., &request)` through post().
  template <class Blocking, class Nonblocking, class... Args>
  work start(detail::operation&& o, std::size_t bytes, Blocking blocking, Nonblocking nonblocking,
              const Args&... args) {
    if (!eager(bytes)) return post(std::move(o), nonblocking, args...);
    if (const int code = blocking(args...); code != MPI_SUCCESS) return failed(o.info, code);
    if (o.info.average.size != 0) ddp::detail::divide(o.info.average, size());
    return work();
  }

  /// Posts the non-blocking MPI call `nonblocking(args..., &request)` and wraps the request into a work.
  template <class Nonblocking, class... Args>
  work post(detail::operation&& o, Nonblocking nonblocking, const Args&... args) {
    auto s = std::make_shared<detail::request_state>(group_, std::move(o));
    if (const int code = nonblocking(args..., &s->request); code != MPI_SUCCESS)
      detail::check(code, s->describe(), rank());
    return work(std::move(s));
  }

  /// A completed work that raises the ddp::mpi_error of an eager call that returned `code`.
  [[nodiscard]] work failed(const call& info, int code) const {
    const std::string what = ddp::detail::describe(info);
    auto state = std::make_shared<ddp::detail::completion>(rank(), group_->cfg.timeout, what);
    try {
      detail::check(code, what, rank());
    } catch (const mpi_error&) {
      state->fail(std::current_exception());
    }
    return work(std::move(state));
  }

  /// N times the bytes of the k-element `block`: the size of a gather or scatter, known on every rank.
  [[nodiscard]] std::size_t group_bytes(const raw_tensor& block) const noexcept {
    return block.bytes() * static_cast<std::size_t>(size());
  }

  int count_of(const call& c, std::size_t n) const {
    if (n > static_cast<std::size_t>(INT_MAX))
      fail(c, "MPI counts elements in an int; split the buffer into pieces of at most " + std::to_string(INT_MAX) +
                  " elements");
    return static_cast<int>(n);
  }

  /// Device memory needs a CUDA-aware MPI, and avg and bf16/f16 reductions compute on the host.
  void device_check(const call& c, const raw_tensor& b) const {
    if (!b.where.is_cuda()) return;
    if (!cuda_aware())
      fail(c, "the buffer is on " + b.where.to_string() +
                  " but this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0); use a CUDA-aware Open MPI, "
                  "copy the buffer to host memory, or use ddp::nccl for device buffers");
    if (c.op && (*c.op == reduce_op::avg || b.type == dtype::bf16 || b.type == dtype::f16))
      fail(c, "avg and bf16/f16 reductions are computed on the host and the buffer is on " + b.where.to_string() +
                  "; reduce with sum in f32/f64 and scale on the device, or use ddp::nccl");
  }

  /// The input pointer to hand MPI: `in` itself, or a copy kept in the operation when it overlaps `out`.
  const void* unaliased(detail::operation& o, const raw_tensor& in, const raw_tensor& out) const {
    const auto* a = static_cast<const std::byte*>(in.data);
    const auto* b = static_cast<const std::byte*>(out.data);
    if (in.bytes() == 0 || out.bytes() == 0 || a + in.bytes() <= b || b + out.bytes() <= a) return in.data;
    if (in.where.is_cuda())
      fail(o.info, "input and output overlap in device memory; pass separate buffers");
    o.scratch.assign(a, a + in.bytes());
    return o.scratch.data();
  }

  std::shared_ptr<detail::group> group_;
};

}  // namespace ddp::mpi

/// backend::mpi selects ddp::mpi::communicator (checked against the ddp::communicator concept there).
template <>
struct ddp::backend_traits<ddp::backend::mpi> : ddp::detail::backend_binding<ddp::mpi::communicator> {};
#endif  // DDP_SINGLE_HEADER_DDP_COMM_MPI_COMMUNICATOR_HPP
// ---- end <ddp/comm/mpi/communicator.hpp>
#endif

#if defined(DDP_WITH_NCCL)
// ---- begin <ddp/comm/nccl/from_env.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_NCCL_FROM_ENV_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_NCCL_FROM_ENV_HPP
/// \file ddp::nccl::communicator::from_env(): the ncclUniqueId travels from rank 0 through ddp::tcp's rendezvous
/// store alone (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; DDP_TOKEN and DDP_CONNECT_TIMEOUT_MS as for ddp::tcp):
/// rank 0 serves the store on a thread of its own while the id is exchanged; no mesh and no progress engine.

#include <poll.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// ---- begin <ddp/comm/nccl/communicator.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_NCCL_COMMUNICATOR_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_NCCL_COMMUNICATOR_HPP
/// \file ddp::nccl::communicator: the ddp::communicator over NCCL, for buffers in CUDA device memory.
///
/// - Start-up: the ncclUniqueId travels from rank 0 through any other communicator (ddp::tcp, ddp::mpi) given to
///   the constructor, or through ddp::tcp's rendezvous store with from_env() (<ddp/comm/nccl/from_env.hpp>). The NCCL
///   communicator is non-blocking, so
///   initialization, split and every enqueue are bounded by config::timeout.
/// - Streams: every operation runs on the communicator's own stream, ordered after the work queued so far on
///   config::compute_stream (default: the legacy default stream) through an event. ddp::work is backed by an
///   event recorded after the operation: done() is cudaEventQuery plus ncclCommGetAsyncError; wait() polls them.
///   An operation older than the timeout aborts the communicator (ncclCommAbort) and raises ddp::timeout_error;
///   an asynchronous NCCL error aborts it and raises ddp::nccl_error. An aborted communicator refuses new work.
/// - Buffers: device buffers (raw_tensor with device::cuda(N), device_buffer) must live on the communicator's
///   device and go to NCCL as they are. Host buffers (std::span, std::vector) are staged through pinned memory and
///   a stream-ordered device scratch, copied back when the work completes; this serves small host-side traffic
///   such as all_gather_object, not gradients.
/// - Reductions: bf16 and f16 natively; avg is ncclAvg (integers: the sum divided with truncation).
/// - gather, scatter and all_to_all are grouped ncclSend/ncclRecv. send and recv are queued and started together
///   as one NCCL group when a send/recv work of this communicator is waited for or polled, so a rank may post its
///   recvs before its sends. Within one such group the messages between two ranks are matched by tag, then in
///   posting order: sender and receiver must post matching messages between the same two waits.
/// - The collective front end (comm/front_end.hpp) checks the arguments, numbers and counts each operation (bytes
///   as ddp::mpi counts them: algorithm-independent, all_reduce 2(N-1)/N·B, ...) and, with DDP_CHECK_COLLECTIVES=1,
///   compares each collective across the ranks first; this file only starts them.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin <ddp/comm/nccl/error.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_NCCL_ERROR_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_NCCL_ERROR_HPP
/// \file NCCL error checking and the dtype/operator mapping of the NCCL backend.

#include <nccl.h>

#include <string>
#include <string_view>


namespace ddp::nccl::detail {

/// What to do about `code`, as a sentence fragment appended to the message.
inline std::string_view advice(ncclResult_t code) noexcept {
  switch (code) {
    case ncclSystemError:
    case ncclRemoteError:
      return "a peer died or the network failed; check every rank's log, and rerun with NCCL_DEBUG=INFO to see which "
             "connection broke";
    case ncclInvalidUsage:
      return "NCCL was used wrongly: ranks sharing one GPU need distinct NCCL_HOSTID values (see docs/gpu.md), every "
             "rank must call the same collectives in the same order, and buffers must live on the communicator's "
             "device; NCCL_DEBUG=WARN prints the detail";
    case ncclUnhandledCudaError:
      return "a CUDA call inside NCCL failed; check the device with nvidia-smi and rerun with NCCL_DEBUG=WARN";
    default:
      return "rerun with NCCL_DEBUG=WARN for NCCL's own explanation";
  }
}

/// Throws ddp::nccl_error (native_code() = the ncclResult_t) naming `what`, NCCL's text and the fix.
[[noreturn]] inline void fail(ncclResult_t code, std::string_view what, int rank, ncclComm_t comm = nullptr) {
  std::string text = std::string(what) + " failed: " + ncclGetErrorString(code);
  if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') text += " (" + std::string(last) + ")";
  throw nccl_error(text + "; " + std::string(advice(code)), rank, static_cast<int>(code));
}

/// The NCCL type of `t`; every ddp dtype has one.
constexpr ncclDataType_t datatype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
  }
  return ncclUint8;
}

/// The NCCL operator of `op`; avg is NCCL's own (ncclAvg: a pre-multiplied sum for floating types, a sum divided
/// by the group size with truncation for integers).
constexpr ncclRedOp_t reduction(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::prod: return ncclProd;
  }
  return ncclSum;
}

}  // namespace ddp::nccl::detail
#endif  // DDP_SINGLE_HEADER_DDP_COMM_NCCL_ERROR_HPP
// ---- end <ddp/comm/nccl/error.hpp>
// ---- begin <ddp/comm/nccl/group.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_NCCL_GROUP_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_NCCL_GROUP_HPP
/// \file The NCCL side of ddp::nccl::communicator: its settings, the records and staging of an operation, and the
/// group state every copy of a communicator shares (the ncclComm_t, its stream, abort on timeout or error).

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

// ---- begin <ddp/cuda/buffer.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_CUDA_BUFFER_HPP
#define DDP_SINGLE_HEADER_DDP_CUDA_BUFFER_HPP
/// \file Owned memory for device code: device_buffer (cudaMalloc) and pinned_buffer (page-locked host memory
/// for fast, asynchronous host<->device staging). Both are ddp::tensors, so they go straight into collectives.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

// ---- begin <ddp/cuda/error.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_CUDA_ERROR_HPP
#define DDP_SINGLE_HEADER_DDP_CUDA_ERROR_HPP
/// \file CUDA runtime error checking: every failed call becomes a ddp::cuda_error.

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>


namespace ddp::cuda {

namespace detail {
/// What to do about `code`, as a sentence fragment appended to the message.
inline std::string_view advice(cudaError_t code) noexcept {
  switch (code) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return "this process sees no usable CUDA device; run GPU code (ctest -L gpu) on a machine with a GPU and a "
             "driver at least as new as the CUDA runtime, and check CUDA_VISIBLE_DEVICES";
    case cudaErrorInvalidDevice:
      return "the device ordinal is not below cudaGetDeviceCount(); pick a device this process can see";
    case cudaErrorMemoryAllocation:
      return "the device is out of memory; free buffers, lower the batch size or the bucket size";
    default:
      return "check the call's arguments; rerun with CUDA_LAUNCH_BLOCKING=1 under compute-sanitizer to find the "
             "failing kernel";
  }
}
}  // namespace detail

/// Throws ddp::cuda_error (native_code() = the cudaError_t) naming `what` and the fix when `code` is not cudaSuccess.
inline void check(cudaError_t code, std::string_view what, int rank = -1) {
  if (code == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  throw cuda_error(std::string(what) + " failed with " + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                       "); " + std::string(detail::advice(code)),
                   rank, static_cast<int>(code));
}

/// Throws ddp::cuda_error when the last kernel start failed (call right after a <<<...>>> start).
inline void check_kernel(std::string_view kernel, int rank = -1) {
  check(cudaGetLastError(), std::string("start of kernel ") + std::string(kernel), rank);
}

}  // namespace ddp::cuda
#endif  // DDP_SINGLE_HEADER_DDP_CUDA_ERROR_HPP
// ---- end <ddp/cuda/error.hpp>
// ---- begin <ddp/cuda/runtime.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_CUDA_RUNTIME_HPP
#define DDP_SINGLE_HEADER_DDP_CUDA_RUNTIME_HPP
/// \file CUDA runtime handles as RAII types: the current-device guard, streams and events.

#include <cuda_runtime_api.h>

#include <string>
#include <utility>


namespace ddp::cuda {

/// The calling thread's current CUDA device.
inline int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

/// Number of CUDA devices this process can see; throws ddp::cuda_error when there is no usable device.
inline int device_count() {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  return count;
}

/// Makes `device` current for one scope and restores the previous device after.
class device_guard {
 public:
  /// Switches to `device` (a no-op when it is already current).
  explicit device_guard(int device) : previous_(current_device()) {
    if (device != previous_) check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() { (void)cudaSetDevice(previous_); }

 private:
  int previous_;
};

/// An owned CUDA stream on one device; move-only.
class stream {
 public:
  /// Creates a stream on `device` (default: the current one); non-blocking w.r.t. the legacy default stream.
  explicit stream(int device = current_device(), unsigned flags = cudaStreamNonBlocking, int priority = 0)
      : device_(device) {
    const device_guard on(device);
    check(cudaStreamCreateWithPriority(&handle_, flags, priority), "cudaStreamCreateWithPriority");
  }
  stream(stream&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), device_(other.device_) {}
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  /// The raw handle.
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_; }
  /// The device the stream belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// Blocks the host until all work queued on the stream is done.
  void synchronize() const { check(cudaStreamSynchronize(handle_), "cudaStreamSynchronize"); }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaStreamDestroy(handle_);
    handle_ = nullptr;
  }
  cudaStream_t handle_ = nullptr;
  int device_ = 0;
};

/// An owned CUDA event; move-only. Timing is off unless asked for (it makes record and query slower).
class event {
 public:
  /// Creates an event on the current device.
  explicit event(unsigned flags = cudaEventDisableTiming) {
    check(cudaEventCreateWithFlags(&handle_, flags), "cudaEventCreateWithFlags");
  }
  event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  /// The raw handle.
  [[nodiscard]] cudaEvent_t get() const noexcept { return handle_; }
  /// Captures the work queued on `s` so far.
  void record(cudaStream_t s) { check(cudaEventRecord(handle_, s), "cudaEventRecord"); }
  /// Makes `s` wait (on the device) for the captured work.
  void make_wait(cudaStream_t s) const { check(cudaStreamWaitEvent(s, handle_, 0), "cudaStreamWaitEvent"); }
  /// True once the captured work is done; throws ddp::cuda_error if it failed.
  [[nodiscard]] bool query() const {
    const cudaError_t code = cudaEventQuery(handle_);
    if (code == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    check(code, "cudaEventQuery");
    return true;
  }
  /// Blocks the host until the captured work is done.
  void synchronize() const { check(cudaEventSynchronize(handle_), "cudaEventSynchronize"); }
  /// Milliseconds between two recorded events created with timing (flags = cudaEventDefault).
  [[nodiscard]] static float elapsed_ms(const event& start, const event& stop) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start.handle_, stop.handle_), "cudaEventElapsedTime");
    return ms;
  }

 private:
  void reset() noexcept {
    if (handle_ != nullptr) (void)cudaEventDestroy(handle_);
    handle_ = nullptr;
  }
  cudaEvent_t handle_ = nullptr;
};

}  // namespace ddp::cuda
#endif  // DDP_SINGLE_HEADER_DDP_CUDA_RUNTIME_HPP
// ---- end <ddp/cuda/runtime.hpp>

namespace ddp::cuda {

/// `count` elements of T in the memory of one CUDA device; move-only, contents uninitialized.
template <element T>
class device_buffer {
 public:
  /// An empty buffer.
  device_buffer() = default;
  /// Allocates `count` elements on `device` (default: the current device).
  explicit device_buffer(std::size_t count, int device = current_device()) : size_(count), device_(device) {
    if (count == 0) return;
    const device_guard on(device);
    void* p = nullptr;
    check(cudaMalloc(&p, count * sizeof(T)),
          "cudaMalloc of " + std::to_string(count * sizeof(T)) + " bytes on cuda:" + std::to_string(device));
    data_ = static_cast<T*>(p);
  }
  /// Allocates on `device` and copies `host` into it (synchronously).
  explicit device_buffer(std::span<const T> host, int device = current_device()) : device_buffer(host.size(), device) {
    upload(host);
  }
  device_buffer(device_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), device_(other.device_) {}
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      device_ = other.device_;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  /// First element (a device pointer).
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The CUDA ordinal the memory lives on.
  [[nodiscard]] int device_index() const noexcept { return device_; }
  /// A span over the device memory (for the kernels' host API; never dereference it on the host).
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, size_}; }
  /// An untyped view tagged with device::cuda(device_index()).
  [[nodiscard]] raw_tensor raw() const noexcept { return {data_, size_, dtype_v<T>, device::cuda(device_)}; }

  /// Copies `host` (exactly size() elements) into the buffer; blocks until done.
  void upload(std::span<const T> host) {
    same_size(host.size(), "upload");
    check(cudaMemcpy(data_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "cudaMemcpy host to device");
  }
  /// Copies the buffer into `host` (exactly size() elements) after the device is idle; blocks until done.
  void download(std::span<T> host) const {
    same_size(host.size(), "download");
    check(cudaMemcpy(host.data(), data_, host.size_bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }
  /// The contents as a host vector (synchronous).
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size_);
    download(out);
    return out;
  }

 private:
  void same_size(std::size_t n, const char* what) const {
    if (n != size_)
      throw error(std::string("device_buffer::") + what + ": the host span has " + std::to_string(n) +
                  " elements but the buffer " + std::to_string(size_) + "; pass a span of the buffer's size");
  }
  void reset() noexcept {
    if (data_ != nullptr) {
      const int previous = [] { int d = 0; (void)cudaGetDevice(&d); return d; }();
      (void)cudaSetDevice(device_);
      (void)cudaFree(data_);
      (void)cudaSetDevice(previous);
    }
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  int device_ = 0;
};

/// `count` elements of T in page-locked host memory (cudaMallocHost); move-only, contents uninitialized.
/// Copies between it and a device run asynchronously on a stream and at full PCIe/NVLink speed.
template <element T>
class pinned_buffer {
 public:
  /// An empty buffer.
  pinned_buffer() = default;
  /// Allocates `count` page-locked elements.
  explicit pinned_buffer(std::size_t count) : size_(count) {
    if (count == 0) return;
    void* p = nullptr;
    check(cudaMallocHost(&p, count * sizeof(T)), "cudaMallocHost of " + std::to_string(count * sizeof(T)) + " bytes");
    data_ = static_cast<T*>(p);
  }
  pinned_buffer(pinned_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;
  ~pinned_buffer() { reset(); }

  /// First element (a host pointer).
  [[nodiscard]] T* data() const noexcept { return data_; }
  /// Number of elements.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// A span over the host memory.
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, size_}; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace ddp::cuda

namespace ddp {

/// A device_buffer is a tensor on device::cuda(device_index()).
template <element T>
struct tensor_traits<cuda::device_buffer<T>> {
  static T* data(const cuda::device_buffer<T>& t) noexcept { return t.data(); }
  static std::size_t size(const cuda::device_buffer<T>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const cuda::device_buffer<T>&) noexcept { return dtype_v<T>; }
  static ddp::device device(const cuda::device_buffer<T>& t) noexcept { return device::cuda(t.device_index()); }
};

/// A pinned_buffer is a host tensor.
template <element T>
struct tensor_traits<cuda::pinned_buffer<T>> {
  static T* data(const cuda::pinned_buffer<T>& t) noexcept { return t.data(); }
  static std::size_t size(const cuda::pinned_buffer<T>& t) noexcept { return t.size(); }
  static constexpr ddp::dtype dtype(const cuda::pinned_buffer<T>&) noexcept { return dtype_v<T>; }
  static constexpr ddp::device device(const cuda::pinned_buffer<T>&) noexcept { return device::cpu(); }
};

static_assert(tensor<cuda::device_buffer<float>> && tensor<cuda::pinned_buffer<bfloat16>>,
              "ddp::cuda buffers must model ddp::tensor; fix their tensor_traits.");

}  // namespace ddp
#endif  // DDP_SINGLE_HEADER_DDP_CUDA_BUFFER_HPP
// ---- end <ddp/cuda/buffer.hpp>

namespace ddp::nccl {

/// Settings of an NCCL communicator, shared by the groups split from it.
struct config {
  /// How long initialization, an enqueue or an operation may take before the communicator is aborted.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// The CUDA device of this rank; -1 takes the current device (from_env(): LOCAL_RANK modulo the device count).
  int device = -1;
  /// The stream whose queued work each operation waits for (nullptr: the legacy default stream).
  cudaStream_t compute_stream = nullptr;
  /// How long a wait polls back to back (yielding the core) before it starts sleeping.
  std::chrono::microseconds spin{std::chrono::milliseconds(2)};
  /// The longest sleep between two polls once spinning is over.
  std::chrono::microseconds max_sleep{100};
};

namespace detail {

using clock = std::chrono::steady_clock;

/// A host buffer argument on its way through pinned memory and a device scratch.
struct staging {
  std::size_t index = 0;                      ///< which argument
  raw_tensor host;                            ///< the caller's host buffer
  cuda::pinned_buffer<std::uint8_t> pinned;   ///< page-locked copy
  bool copy_in = false;                       ///< an input: copied to the device before the operation
  bool copy_back = false;                     ///< an output: copied to `host` on completion
};

/// What an operation leaves behind until it completes: its argument pointers, staging and completion event.
struct record {
  explicit record(std::size_t arguments) : pointers(arguments, nullptr) {}
  std::vector<void*> pointers;   ///< the device pointer of each argument once started
  std::vector<staging> staged;   ///< the host arguments
  cuda::event done;              ///< recorded on the communicator's stream after the operation
  std::atomic<bool> started{false};
};

/// One argument of an operation: a buffer, read and/or written by it.
struct argument {
  raw_tensor buffer;
  bool read = false;
  bool written = false;
};

/// Polls `comm` until a non-blocking call that returned `r` has taken effect; on an error or past `timeout` the
/// communicator is aborted (`aborted` set) and ddp::nccl_error or ddp::timeout_error is thrown.
inline void await_ready(ncclComm_t comm, ncclResult_t r, std::string_view what, int rank,
                        std::chrono::milliseconds timeout, bool& aborted) {
  if (r == ncclSuccess) return;
  if (r != ncclInProgress) fail(r, what, rank, comm);
  const auto deadline = clock::now() + timeout;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t q = ncclCommGetAsyncError(comm, &state); q != ncclSuccess) fail(q, "ncclCommGetAsyncError", rank, comm);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      ncclCommAbort(comm);
      aborted = true;
      fail(state, std::string(what) + " (the communicator has been aborted)", rank, nullptr);
    }
    if (clock::now() >= deadline) {
      ncclCommAbort(comm);
      aborted = true;
      throw timeout_error(std::string(what) + " did not take effect within " + std::to_string(timeout.count()) +
                              " ms, so the NCCL communicator was aborted: a rank is missing, dead or stuck; check "
                              "every rank's log, or raise config::timeout",
                          rank);
    }
    std::this_thread::yield();
  }
}

/// A queued send or recv, started with the others at the next flush.
struct p2p_entry {
  bool send = false;
  int peer = 0;
  int tag = 0;
  raw_tensor buffer;
  std::shared_ptr<record> rec;
  cuda::event ready;  ///< the compute stream's work at posting time
  std::string what;
};

/// The state every copy of a communicator shares: the ncclComm_t, its stream, settings, front-end state, p2p queue.
class group {
 public:
  /// Joins the communicator `id` as `rank` of `size` (collective over the ranks holding `id`).
  group(const ncclUniqueId& id, int rank, int size, config settings)
      : cfg(settings), rank(rank), size(size), device(resolve(settings.device)), stream_(make_stream(device)),
        ready(make_event(device)) {
    const cuda::device_guard on(device);
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &c);
    if (r != ncclSuccess && r != ncclInProgress) fail(r, "ncclCommInitRankConfig", rank, nullptr);
    settle(r, "ncclCommInitRankConfig(rank " + std::to_string(rank) + " of " + std::to_string(size) + ")");
  }

  /// Adopts `c`, split from a parent on `parent_device` and ready (the caller awaited it).
  group(ncclComm_t c, config settings, int parent_device, int parent_rank)
      : cfg(settings), rank(parent_rank), device(parent_device), stream_(make_stream(device)), comm(c),
        ready(make_event(device)) {
    const cuda::device_guard on(device);
    call(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    call(ncclCommCount(comm, &size), "ncclCommCount");
  }

  group(const group&) = delete;
  group& operator=(const group&) = delete;

  /// Flushes and destroys the communicator; one that cannot finalize within the timeout is aborted.
  ~group() {
    std::lock_guard lock(mutex);
    if (comm == nullptr || aborted) return;
    try {
      const cuda::device_guard on(device);
      settle(ncclCommFinalize(comm), "ncclCommFinalize");
      ncclCommDestroy(comm);
    } catch (const std::exception&) {  // a destructor reports nothing; abort frees what finalize could not
      if (!aborted) ncclCommAbort(comm);
    }
  }

  /// The stream operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_.get(); }

  /// Throws for an NCCL call that failed outright (ncclInProgress included: the caller settles those).
  void call(ncclResult_t r, std::string_view what) const {
    if (r != ncclSuccess && r != ncclInProgress) fail(r, what, rank, comm);
  }

  /// Waits (up to the timeout) until a non-blocking call that returned `r` has taken effect. Caller holds `mutex`.
  void settle(ncclResult_t r, std::string_view what) { await_ready(comm, r, what, rank, cfg.timeout, aborted); }

  /// ncclCommAbort once; later operations are refused. Caller holds `mutex`.
  void abort_locked() noexcept {
    if (aborted || comm == nullptr) return;
    ncclCommAbort(comm);
    aborted = true;
  }

  /// Throws when the communicator was aborted. Caller holds `mutex`.
  void alive_locked(std::string_view what) const {
    if (aborted)
      throw nccl_error(std::string(what) + ": this NCCL communicator was aborted after an earlier timeout or error; "
                           "create a new communicator (on every rank) to go on",
                       rank);
  }

  /// An asynchronous NCCL error (aborting the communicator), or nullptr. Takes `mutex`.
  std::exception_ptr health(const std::string& what) {
    std::lock_guard lock(mutex);
    if (aborted) {
      try {
        alive_locked(what);
      } catch (const nccl_error&) {
        return std::current_exception();
      }
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    const ncclResult_t bad = q != ncclSuccess ? q : state;
    if (bad == ncclSuccess || bad == ncclInProgress) return nullptr;
    abort_locked();
    try {
      fail(bad, what + " (the communicator has been aborted)", rank, nullptr);
    } catch (const nccl_error&) {
      return std::current_exception();
    }
  }

  config cfg;
  int rank = 0;
  int size = 1;
  int device = 0;

 private:
  static int resolve(int wanted) { return wanted >= 0 ? wanted : cuda::current_device(); }
  static cuda::stream make_stream(int device) {
    int least = 0, greatest = 0;  // communication gets the highest priority, so it overlaps compute promptly
    cuda::check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    return cuda::stream(device, cudaStreamNonBlocking, greatest);
  }
  static cuda::event make_event(int device) {
    const cuda::device_guard on(device);
    return cuda::event();
  }
  cuda::stream stream_;

 public:
  ncclComm_t comm = nullptr;
  std::mutex mutex;                     ///< serializes NCCL calls, the queue and abort
  bool aborted = false;
  cuda::event ready;                    ///< the compute stream's work before a collective (reused)
  std::vector<p2p_entry> queue;         ///< sends and recvs waiting for the next flush
  std::optional<cuda::device_buffer<std::int32_t>> barrier_word;
  ddp::detail::front_state front;       ///< statistics, sequence numbers and the call check of the front end
};

}  // namespace detail
}  // namespace ddp::nccl
#endif  // DDP_SINGLE_HEADER_DDP_COMM_NCCL_GROUP_HPP
// ---- end <ddp/comm/nccl/group.hpp>
// ---- begin <ddp/comm/nccl/operation.hpp>
#ifndef DDP_SINGLE_HEADER_DDP_COMM_NCCL_OPERATION_HPP
#define DDP_SINGLE_HEADER_DDP_COMM_NCCL_OPERATION_HPP
/// \file One operation of ddp::nccl::communicator after its start: staging host buffers in and out, the queued
/// send/recv started as one NCCL group, and the work state polled until the completion event fires.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>


namespace ddp::nccl::detail {

/// Copies each staged host argument into a device scratch (stream-ordered) and fills `rec.pointers`.
inline void stage_in(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = nullptr;
    cuda::check(cudaMallocAsync(&scratch, bytes, g.stream()), "cudaMallocAsync of a staging buffer", g.rank);
    rec.pointers[s.index] = scratch;
    if (s.copy_in)
      cuda::check(cudaMemcpyAsync(scratch, s.pinned.data(), bytes, cudaMemcpyHostToDevice, g.stream()),
                  "cudaMemcpyAsync of a host buffer to its staging buffer", g.rank);
  }
}

/// Copies staged outputs back to pinned memory, frees the scratch and records completion.
inline void stage_out(group& g, record& rec) {
  for (auto& s : rec.staged) {
    const std::size_t bytes = s.host.bytes();
    if (bytes == 0) continue;
    void* scratch = rec.pointers[s.index];
    if (s.copy_back)
      cuda::check(cudaMemcpyAsync(s.pinned.data(), scratch, bytes, cudaMemcpyDeviceToHost, g.stream()),
                  "cudaMemcpyAsync of a staging buffer to the host", g.rank);
    cuda::check(cudaFreeAsync(scratch, g.stream()), "cudaFreeAsync of a staging buffer", g.rank);
  }
  rec.done.record(g.stream());
  rec.started.store(true, std::memory_order_release);
}

/// Starts every queued send/recv as one NCCL group, tags ascending (stable). Caller holds g.mutex.
inline void flush_locked(group& g) {
  if (g.queue.empty()) return;
  std::vector<p2p_entry> entries = std::move(g.queue);
  g.queue.clear();
  std::stable_sort(entries.begin(), entries.end(), [](const p2p_entry& a, const p2p_entry& b) { return a.tag < b.tag; });
  g.alive_locked(entries.front().what);
  const cuda::device_guard on(g.device);
  for (auto& e : entries) {
    e.ready.make_wait(g.stream());
    stage_in(g, *e.rec);
  }
  g.call(ncclGroupStart(), "ncclGroupStart");
  ncclResult_t first_error = ncclSuccess;
  std::string failed;
  for (auto& e : entries) {
    void* p = e.rec->pointers[0];
    const auto type = datatype(e.buffer.type);
    const ncclResult_t r = e.send ? ncclSend(p, e.buffer.size, type, e.peer, g.comm, g.stream())
                                  : ncclRecv(p, e.buffer.size, type, e.peer, g.comm, g.stream());
    if (r != ncclSuccess && r != ncclInProgress && first_error == ncclSuccess) {
      first_error = r;
      failed = e.what;
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (first_error != ncclSuccess) fail(first_error, failed, g.rank, g.comm);
  g.settle(end, "the NCCL group of " + std::to_string(entries.size()) + " queued send/recv (first: " +
                    entries.front().what + ")");
  for (auto& e : entries) stage_out(g, *e.rec);
}

/// One operation's completion: its event, its host copy-back, the communicator's health and the timeout.
class op_state final : public ddp::detail::work_state {
 public:
  op_state(std::shared_ptr<group> g, ddp::detail::call_info info, std::shared_ptr<record> rec)
      : group_(std::move(g)), info_(info), rec_(std::move(rec)), started_(clock::now()) {}

  bool test() override {
    std::lock_guard lock(mutex_);
    return poll();
  }

  bool wait_until(clock::time_point deadline) override {
    const auto start = clock::now();
    std::chrono::microseconds pause{1};
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (poll()) return true;
      }
      const auto now = clock::now();
      if (now >= deadline) return false;
      if (now - start < group_->cfg.spin) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::min<clock::duration>(pause, deadline - now));
      pause = std::min(pause * 2, group_->cfg.max_sleep);
    }
  }

  [[nodiscard]] std::chrono::milliseconds timeout() const override { return group_->cfg.timeout; }
  [[nodiscard]] int rank() const override { return group_->rank; }
  [[nodiscard]] std::string describe() const override { return ddp::detail::describe(info_); }

 private:
  /// One look at the operation; the caller holds mutex_.
  bool poll() {
    if (error_) std::rethrow_exception(error_);
    if (done_) return true;
    try {
      if (!rec_->started.load(std::memory_order_acquire)) {
        std::lock_guard lock(group_->mutex);
        flush_locked(*group_);
      }
      if (rec_->done.query()) {
        for (auto& s : rec_->staged)
          if (s.copy_back && s.host.bytes() != 0) std::memcpy(s.host.data, s.pinned.data(), s.host.bytes());
        rec_.reset();
        done_ = true;
        return true;
      }
      if (auto e = group_->health(describe())) std::rethrow_exception(e);
      if (clock::now() - started_ >= group_->cfg.timeout) {
        {
          std::lock_guard lock(group_->mutex);
          group_->abort_locked();
        }
        throw timeout_error(describe() + " did not complete within " + std::to_string(group_->cfg.timeout.count()) +
                                " ms, so the NCCL communicator was aborted: a peer is stuck, dead or calling a "
                                "different collective; check every rank's log, or raise config::timeout",
                            group_->rank);
      }
    } catch (const error&) {
      error_ = std::current_exception();
      throw;
    }
    return false;
  }

  std::shared_ptr<group> group_;
  ddp::detail::call_info info_;
  std::shared_ptr<record> rec_;
  clock::time_point started_;
  std::mutex mutex_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace ddp::nccl::detail
#endif  // DDP_SINGLE_HEADER_DDP_COMM_NCCL_OPERATION_HPP
// ---- end <ddp/comm/nccl/operation.hpp>

namespace ddp::nccl {

namespace detail {
/// from_env()'s way in: defined by <ddp/comm/nccl/from_env.hpp>, so only its users include ddp::tcp's store.
struct env_rendezvous;

/// A new ncclUniqueId: rank 0 makes it, the other ranks join with it.
inline ncclUniqueId new_unique_id() {
  ncclUniqueId id{};
  if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) fail(r, "ncclGetUniqueId", 0);
  return id;
}
}  // namespace detail

/// A group of CUDA devices (one per rank) modelling ddp::communicator over NCCL. Copies share the group; the last
/// copy finalizes and destroys the NCCL communicator.
class communicator : public ddp::detail::collective_front<communicator> {
 public:
  using backend_tag = ddp::backend::nccl;  ///< the backend tag data_parallel deduces from this communicator
  /// Collectives take device memory themselves: ddp::staged passes device tensors straight through.
  static constexpr bool takes_device_memory = true;
  /// Collective over `bootstrap`'s ranks: rank 0 creates the ncclUniqueId, `bootstrap` broadcasts it, and each rank
  /// joins with its bootstrap rank on config::device. `bootstrap` may be dropped afterwards.
  template <class Bootstrap>
    requires(!std::same_as<std::remove_cvref_t<Bootstrap>, communicator>) && ddp::communicator<std::remove_cvref_t<Bootstrap>>
  explicit communicator(Bootstrap& bootstrap, config settings = {})
      : communicator(broadcast_id(bootstrap), bootstrap.rank(), bootstrap.size(), settings) {}

  /// Collective over `size` ranks that hold the same `id` (rank 0's ncclGetUniqueId, carried by the caller's own
  /// means): joins as `rank` on config::device (ncclCommInitRankConfig).
  communicator(const ncclUniqueId& id, int rank, int size, config settings = {})
      : group_(std::make_shared<detail::group>(id, rank, size, settings)) {}

  /// Joins the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun and
  /// ddp-launch set them): the id travels through ddp::tcp's rendezvous store alone (no mesh, no engine); the device
  /// is config::device, else LOCAL_RANK modulo the number of visible devices. Defined in
  /// <ddp/comm/nccl/from_env.hpp>, which brings the store's client and server along.
  template <class Rendezvous = detail::env_rendezvous>
  static communicator from_env(config settings = {}) {
    static_assert(requires { sizeof(Rendezvous); },
                  "ddp::nccl::communicator::from_env joins through ddp::tcp's rendezvous store: include "
                  "<ddp/comm/nccl/from_env.hpp> (or <ddp/ddp.hpp>), or pass a bootstrap communicator to the "
                  "constructor.");
    return Rendezvous::join(settings);
  }

  /// This rank in the group.
  [[nodiscard]] int rank() const noexcept { return group_->rank; }
  /// Number of ranks in the group.
  [[nodiscard]] int size() const noexcept { return group_->size; }
  /// The CUDA device this rank's buffers must live on.
  [[nodiscard]] int device() const noexcept { return group_->device; }
  /// The NCCL communicator.
  [[nodiscard]] ncclComm_t native_handle() const noexcept { return group_->comm; }
  /// The stream operations run on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return group_->stream(); }
  /// The settings this group runs with.
  [[nodiscard]] const config& settings() const noexcept { return group_->cfg; }
  /// Bytes sent and operations started so far.
  [[nodiscard]] comm_stats stats() const noexcept { return group_->front.stats.snapshot(); }

  /// Orders later operations (of every copy of this group) after the work queued on `s`.
  void set_compute_stream(cudaStream_t s) {
    std::lock_guard lock(group_->mutex);
    group_->cfg.compute_stream = s;
  }

  /// Collective: ranks with the same color (≥ 0) form a new group (ncclCommSplit), ordered by key, then by rank.
  [[nodiscard]] communicator split(int color, int key) const {
    if (color < 0)
      throw error("split: color " + std::to_string(color) + " is negative; pass a color >= 0 on every rank", rank());
    const std::string what = "ncclCommSplit(color " + std::to_string(color) + ", key " + std::to_string(key) + ")";
    std::lock_guard lock(group_->mutex);
    group_->alive_locked(what);
    const cuda::device_guard on(group_->device);
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = 0;
    ncclComm_t out = nullptr;
    const ncclResult_t r = ncclCommSplit(group_->comm, color, key, &out, &c);
    group_->call(r, what);
    group_->settle(ncclInProgress, what);  // the parent finishes its part, then the new communicator its own
    if (out == nullptr)
      throw nccl_error(what + " returned no communicator; call split the same number of times on every rank", rank());
    bool child_aborted = false;
    detail::await_ready(out, ncclInProgress, what, rank(), group_->cfg.timeout, child_aborted);
    return communicator(std::make_shared<detail::group>(out, group_->cfg, group_->device, group_->rank));
  }

 private:
  friend class ddp::detail::collective_front<communicator>;
  using call = ddp::detail::call_info;

  /// The front end numbers, counts and checks calls for NCCL; avg is NCCL's own (ncclAvg).
  static constexpr ddp::detail::front_duties duties{.group = "an NCCL group", .average = false};

  explicit communicator(std::shared_ptr<detail::group> g) : group_(std::move(g)) {}

  [[nodiscard]] ddp::detail::front_state& front() const noexcept { return group_->front; }
  [[nodiscard]] const std::shared_ptr<ddp::detail::flight_recorder>& flight() const noexcept { return group_->front.flight; }
  [[nodiscard]] static constexpr int max_tag() noexcept { return INT_MAX; }

  work start_all_reduce(const call& info, const raw_tensor& b, reduce_op op) {
    return start(info, {{b, true, true}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), group_->comm,
                           group_->stream());
    });
  }

  work start_reduce_scatter(const call& info, const raw_tensor& in, const raw_tensor& out, reduce_op op) {
    in_place_only(info, in, out, out, static_cast<std::size_t>(rank()) * out.bytes());
    return start(info, {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return ncclReduceScatter(p[0], p[1], out.size, detail::datatype(out.type), detail::reduction(op), group_->comm,
                               group_->stream());
    });
  }

  work start_all_gather(const call& info, const raw_tensor& in, const raw_tensor& out) {
    in_place_only(info, out, in, in, static_cast<std::size_t>(rank()) * in.bytes());
    return start(info, {{in, true, false}, {out, false, true}},
                  [&](const std::vector<void*>& p) {
                    return ncclAllGather(p[0], p[1], in.size, detail::datatype(in.type), group_->comm,
                                         group_->stream());
                  });
  }

  work start_broadcast(const call& info, const raw_tensor& b) {
    const int root = info.peer;
    const bool at_root = rank() == root;
    return start(info, {{b, at_root, !at_root}},
                  [&](const std::vector<void*>& p) {
                    return ncclBroadcast(p[0], p[0], b.size, detail::datatype(b.type), root, group_->comm,
                                         group_->stream());
                  });
  }

  work start_reduce(const call& info, const raw_tensor& b, reduce_op op) {
    const int root = info.peer;
    const bool at_root = rank() == root;
    return start(info, {{b, true, at_root}}, [&](const std::vector<void*>& p) {
      return ncclReduce(p[0], p[0], b.size, detail::datatype(b.type), detail::reduction(op), root, group_->comm,
                        group_->stream());
    });
  }

  work start_gather(const call& info, const raw_tensor& in, const raw_tensor& out) {
    return rooted_blocks(info, in, out, true);
  }

  work start_scatter(const call& info, const raw_tensor& in, const raw_tensor& out) {
    return rooted_blocks(info, out, in, false);
  }

  /// gather (`to_root`: each rank's `mine` into its block of the root's `whole`) or scatter (each rank's block of
  /// the root's `whole` into its `mine`): a send or receive per rank, grouped at the root with its own.
  work rooted_blocks(const call& info, const raw_tensor& mine, const raw_tensor& whole, bool to_root) {
    const int root = info.peer;
    const auto type = detail::datatype(mine.type);
    const auto transfer = [&](bool send, void* p, int peer) {
      return send ? ncclSend(p, mine.size, type, peer, group_->comm, group_->stream())
                  : ncclRecv(p, mine.size, type, peer, group_->comm, group_->stream());
    };
    const detail::argument own{mine, to_root, !to_root};
    if (rank() != root)
      return start(info, {own}, [&](const std::vector<void*>& p) { return transfer(to_root, p[0], root); });
    disjoint(info, mine, whole);
    return start(info, {own, {whole, !to_root, to_root}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        for (int r = 0; r < size(); ++r)
          if (const ncclResult_t e = transfer(!to_root, block(p[1], whole, r, mine.size), r);
              e != ncclSuccess && e != ncclInProgress)
            return e;
        return transfer(to_root, p[0], root);
      });
    });
  }

  work start_all_to_all(const call& info, const raw_tensor& in, const raw_tensor& out) {
    disjoint(info, in, out);
    const std::size_t k = in.size / static_cast<std::size_t>(size());
    return start(info, {{in, true, false}, {out, false, true}}, [&](const std::vector<void*>& p) {
      return grouped([&] {
        const auto type = detail::datatype(in.type);
        for (int r = 0; r < size(); ++r) {
          if (const ncclResult_t e = ncclSend(block(p[0], in, r, k), k, type, r, group_->comm, group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
          if (const ncclResult_t e = ncclRecv(block(p[1], out, r, k), k, type, r, group_->comm, group_->stream());
              e != ncclSuccess && e != ncclInProgress)
            return e;
        }
        return ncclSuccess;
      });
    });
  }

  /// The barrier is an all_reduce of one device word.
  work start_barrier(const call& info) {
    {
      std::lock_guard lock(group_->mutex);
      if (!group_->barrier_word) group_->barrier_word.emplace(1, group_->device);
    }
    const raw_tensor word = group_->barrier_word->raw();
    return start(info, {{word, false, false}}, [&](const std::vector<void*>& p) {
      return ncclAllReduce(p[0], p[0], 1, ncclInt32, ncclSum, group_->comm, group_->stream());
    });
  }

  /// Queues `b` for rank c.peer; started with the other queued send/recv when one of them is waited for.
  work start_send(const call& info, const raw_tensor& b) { return post_p2p(info, true, b); }

  /// Queues a receive of what rank c.peer sends with c.tag; the sizes must match the send's.
  work start_recv(const call& info, const raw_tensor& b) { return post_p2p(info, false, b); }


  /// Runs `calls` between ncclGroupStart and ncclGroupEnd; the first failure wins.
  template <class Calls>
  static ncclResult_t grouped(Calls&& calls) {
    if (const ncclResult_t s = ncclGroupStart(); s != ncclSuccess) return s;
    const ncclResult_t body = calls();
    const ncclResult_t end = ncclGroupEnd();
    return body != ncclSuccess && body != ncclInProgress ? body : end;
  }

  /// Element `block·k` of the device pointer `base` holding `t`'s dtype.
  static void* block(void* base, const raw_tensor& t, int index, std::size_t k) {
    return static_cast<std::byte*>(base) + static_cast<std::size_t>(index) * k * size_of(t.type);
  }

  /// Prepares the arguments, orders the operation after the compute stream, issues `body` and records completion.
  template <class Body>
  work start(const call& info, std::initializer_list<detail::argument> args, Body&& body) {
    auto rec = prepare(info, args);
    detail::group& g = *group_;
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(ddp::detail::describe(info));
      const cuda::device_guard on(g.device);
      g.ready.record(g.cfg.compute_stream);
      g.ready.make_wait(g.stream());
      detail::stage_in(g, *rec);
      g.settle(body(rec->pointers), ddp::detail::describe(info));
      detail::stage_out(g, *rec);
    }
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  /// The record of an operation: device arguments checked and passed through, host arguments copied to pinned memory.
  std::shared_ptr<detail::record> prepare(const call& info, std::initializer_list<detail::argument> args) {
    const cuda::device_guard on(group_->device);  // the completion event belongs to the communicator's device
    auto rec = std::make_shared<detail::record>(args.size());
    std::size_t index = 0;
    for (const auto& a : args) {
      if (a.buffer.where.is_cuda()) {
        if (a.buffer.where.index != group_->device)
          fail(info, "a buffer is on " + a.buffer.where.to_string() + " but this communicator works on cuda:" +
                         std::to_string(group_->device) + "; allocate it there or create the communicator with "
                         "config::device = " + std::to_string(a.buffer.where.index));
        rec->pointers[index] = a.buffer.data;
      } else if (a.read || a.written) {
        detail::staging s{index, a.buffer, cuda::pinned_buffer<std::uint8_t>(a.buffer.bytes()), a.read, a.written};
        if (a.read && a.buffer.bytes() != 0) std::memcpy(s.pinned.data(), a.buffer.data, a.buffer.bytes());
        rec->staged.push_back(std::move(s));
      }
      ++index;
    }
    return rec;
  }

  work post_p2p(const call& info, bool is_send, const raw_tensor& b) {
    auto rec = prepare(info, {{b, is_send, !is_send}});
    detail::group& g = *group_;
    const std::string what = ddp::detail::describe(info);
    {
      std::lock_guard lock(g.mutex);
      g.alive_locked(what);
      const cuda::device_guard on(g.device);
      cuda::event ready;
      ready.record(g.cfg.compute_stream);
      g.queue.push_back({is_send, info.peer, info.tag, b, rec, std::move(ready), what});
    }
    return work(std::make_shared<detail::op_state>(group_, info, std::move(rec)));
  }

  static bool overlap(const raw_tensor& a, const raw_tensor& b) noexcept {
    if (!a.where.is_cuda() || !b.where.is_cuda() || a.bytes() == 0 || b.bytes() == 0) return false;
    const auto* x = static_cast<const std::byte*>(a.data);
    const auto* y = static_cast<const std::byte*>(b.data);
    return x < y + b.bytes() && y < x + a.bytes();
  }

  void disjoint(const call& info, const raw_tensor& in, const raw_tensor& out) const {
    if (overlap(in, out)) fail(info, "input and output overlap in device memory; pass separate buffers");
  }

  /// Device buffers `whole` and `part` may overlap only as NCCL's in-place form: `part` at byte `offset` of `whole`.
  void in_place_only(const call& info, const raw_tensor& whole, const raw_tensor& part,
                     const raw_tensor& block_of, std::size_t offset) const {
    if (!overlap(whole, part)) return;
    if (static_cast<const std::byte*>(part.data) == static_cast<const std::byte*>(whole.data) + offset) return;
    fail(info, "input and output overlap in device memory other than in place (the " +
                   std::to_string(block_of.size) + "-element block of rank " + std::to_string(rank()) +
                   " inside the whole buffer); pass separate buffers or that exact block");
  }

  /// Rank 0's new ncclUniqueId, broadcast over `bootstrap`.
  template <class Bootstrap>
  static ncclUniqueId broadcast_id(Bootstrap& bootstrap) {
    ncclUniqueId id = bootstrap.rank() == 0 ? detail::new_unique_id() : ncclUniqueId{};
    std::array<std::uint8_t, sizeof(ncclUniqueId)> bytes{};
    std::memcpy(bytes.data(), &id, sizeof id);
    bootstrap.broadcast(std::span<std::uint8_t>(bytes), 0).wait();
    std::memcpy(&id, bytes.data(), sizeof id);
    return id;
  }

  std::shared_ptr<detail::group> group_;
};

}  // namespace ddp::nccl

/// backend::nccl selects ddp::nccl::communicator (checked against the ddp::communicator concept there).
template <>
struct ddp::backend_traits<ddp::backend::nccl> : ddp::detail::backend_binding<ddp::nccl::communicator> {};
#endif  // DDP_SINGLE_HEADER_DDP_COMM_NCCL_COMMUNICATOR_HPP
// ---- end <ddp/comm/nccl/communicator.hpp>

namespace ddp::nccl::detail {

/// Rank 0's rendezvous store, served by a thread of its own until destroyed.
class served_store {
 public:
  /// Serves `server` at once.
  explicit served_store(tcp::detail::store_server server) : server_(std::move(server)), thread_([this] { serve(); }) {}
  served_store(const served_store&) = delete;
  served_store& operator=(const served_store&) = delete;
  ~served_store() {
    stop_ = true;
    thread_.join();
  }
  /// Throws what stopped the serving thread, if anything did.
  void check() const {
    if (stopped_) std::rethrow_exception(failure_);
  }

 private:
  void serve() noexcept {
    try {
      std::vector<pollfd> fds;
      while (!stop_) {
        fds.clear();
        std::size_t base = 0;
        server_.fill(fds, base);
        ::poll(fds.data(), fds.size(), 10);
        server_.on_events(fds, base);
      }
    } catch (...) {
      failure_ = std::current_exception();
      stopped_ = true;
    }
  }

  tcp::detail::store_server server_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> stopped_{false};
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once the members it serves exist
};

/// Joins the job the environment describes, on config::device or else LOCAL_RANK modulo the visible devices.
struct env_rendezvous {
  static communicator join(config settings) {
    if (settings.device < 0) settings.device = read_env_config().local_rank % cuda::device_count();
    const tcp::config cfg = tcp::config_from_env();
    if (cfg.size == 1) return communicator(new_unique_id(), 0, 1, settings);
    tcp::require_store_address(cfg);
    return communicator(exchange_id(cfg), cfg.rank, cfg.size, settings);
  }

  /// Rank 0's new id, set in its store; every other rank gets it; rank 0 serves until every rank has it.
  static ncclUniqueId exchange_id(const tcp::config& cfg) {
    const std::uint64_t token = tcp::detail::token_hash(cfg.token);
    const auto deadline = tcp::detail::clock::now() + cfg.connect_timeout;
    std::optional<served_store> served;
    if (cfg.rank == 0)
      served.emplace(tcp::detail::store_server(
          tcp::detail::listen_on(cfg.master_addr, cfg.master_port, 0, "the rendezvous store"), token, 0,
          {cfg.handshake_timeout, cfg.max_pending_handshakes}));
    tcp::detail::store_client store(cfg.master_addr, cfg.master_port, token, cfg.rank, deadline);
    ncclUniqueId id{};
    if (cfg.rank == 0) {
      id = new_unique_id();
      const auto* raw = reinterpret_cast<const std::uint8_t*>(&id);
      store.set("ddp/nccl/id", std::vector<std::uint8_t>(raw, raw + sizeof id));
    } else {
      const auto bytes = store.get("ddp/nccl/id");
      if (bytes.size() != sizeof id)
        throw error("rank 0 published a malformed ncclUniqueId; every rank must run the same ddp version", cfg.rank);
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    tcp::detail::count_in(store, "ddp/nccl/joined", cfg.rank, cfg.size, deadline,
                          "not every rank fetched the ncclUniqueId from rank 0's store before the connect deadline; "
                          "start every rank with the same MASTER_ADDR and MASTER_PORT, or raise the connect timeout "
                          "(DDP_CONNECT_TIMEOUT_MS)",
                          [&] { served->check(); });
    return id;
  }
};

}  // namespace ddp::nccl::detail
#endif  // DDP_SINGLE_HEADER_DDP_COMM_NCCL_FROM_ENV_HPP
// ---- end <ddp/comm/nccl/from_env.hpp>
#endif
// ---- end <ddp/ddp.hpp>
// ---- begin <ddp/checkpoint.hpp>
/// \file Checkpoints: full (ddp::save / ddp::load, one safetensors file PyTorch reads) and sharded
/// (ddp::save_sharded / ddp::load_sharded, a part per rank plus a manifest), and the safetensors
/// reader and writer underneath. Needs nlohmann_json, which the ddp::ddp target links.

// ---- begin <ddp/checkpoint/checkpoint.hpp>
/// \file ddp::save / ddp::load: the full training state of a data_parallel model under any sharding policy
/// (parameters under their visited names, no `module.` prefix; optimizer state as "optim.<name>.<state>"; the
/// step count in the metadata as "optim.step") in one safetensors file that PyTorch reads. Rank 0 writes
/// atomically; the other ranks stream it the ranges they hold, one range at a time, so no rank ever holds the
/// whole model unsharded. On loading rank 0 reads and verifies the file, then sends every rank the ranges it
/// holds (a broadcast where every rank holds the whole tensor). ddp::save_sharded / ddp::load_sharded
/// (<ddp/checkpoint/sharded.hpp>, included here) write a part per rank instead.


// ---- begin <ddp/checkpoint/safetensors.hpp>
/// \file Reading and writing the safetensors format (what PyTorch's safetensors package reads): an 8-byte
/// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range, then the
/// data. ddp adds `__metadata__` entries "ddp.format" ("2") and "ddp.checksum": the checksum of the whole file
/// (<ddp/checkpoint/checksum.hpp>: length, header and data, the checksum's own digits counted as '0'), verified on
/// reading; files of format "1" carry a checksum of the data section only, still verified. Writes are atomic
/// (<ddp/io/atomic_file.hpp>): a claimed temporary is written, flushed, renamed over `path`, and the
/// directory is flushed; stale temporaries of killed saves to `path` are removed first.



#include <nlohmann/json.hpp>

// ---- begin <ddp/checkpoint/checksum.hpp>
/// \file The checksum of ddp's checkpoint files: 64-bit FNV-1a (hex, 16 digits), taken over every byte of a file
/// including the text that records it. A "sealed" text holds its own checksum: the 16 digits after a marker such as
/// `"ddp.checksum":"` count as sixteen '0' when the checksum is taken, so a writer puts '0's there, hashes the
/// bytes as written and then writes the digits in their place. FNV-1a detects every change of a single byte (each
/// step, xor then multiplication by an odd prime, is a bijection of the state), so any flipped bit is caught.



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
// ---- end <ddp/checkpoint/checksum.hpp>

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
// ---- end <ddp/checkpoint/safetensors.hpp>
// ---- begin <ddp/checkpoint/sharded.hpp>
/// \file ddp::save_sharded / ddp::load_sharded: the training state as a directory with one safetensors part per
/// rank (the ranges of the tensors that rank holds, each under "<tensor>[<first>:<end>]" with flattened element
/// offsets) and a `manifest.json` by rank 0 (world size, every tensor's dtype and shape, which part holds which
/// ranges, each part's checksum, the metadata, and its own checksum). The directory is written under a temporary
/// name that rank 0 claims (<ddp/io/atomic_file.hpp>) and moved into place when complete. Loading reads, on each rank, the ranges overlapping what it holds, so a checkpoint saved
/// at one world size (or policy) loads at another. The directory must be visible to every rank.




// ---- begin <ddp/checkpoint/state.hpp>
/// \file The training state of a data_parallel model as checkpoints see it, whatever the sharding policy: the
/// tensors (parameters under their visited names, optimizer state as "optim.<parameter>.<state>"), the pieces of
/// them this rank holds in memory, and which rank holds which element ranges. Shared by ddp::save / ddp::load
/// (one file) and ddp::save_sharded / ddp::load_sharded (a part per rank plus a manifest).

#include <variant>


namespace ddp {

/// Free-form string metadata stored beside the tensors (such as {"epoch", "3"}).
using checkpoint_metadata = std::map<std::string, std::string>;

namespace detail {

/// A contiguous range of elements of a state tensor held by one rank.
struct held_range {
  int rank = 0;           ///< the rank holding it
  std::size_t start = 0;  ///< first element within the tensor (flattened, row-major)
  std::size_t numel = 0;  ///< elements
};

/// A range of a state tensor in this rank's memory (writable: loading fills it).
struct state_piece {
  std::size_t tensor = 0;  ///< index into training_state::tensors
  std::size_t start = 0;   ///< first element within the tensor
  std::size_t numel = 0;   ///< elements
  std::byte* data = nullptr;
};

/// What a rank tells the others about one of its pieces.
struct piece_description {
  std::string name;
  dtype type = dtype::f32;
  std::uint64_t start = 0;
  std::uint64_t numel = 0;
};

/// The training state of one data_parallel (and optimizer), the same tensors and places on every rank.
struct training_state {
  std::vector<safetensors::tensor_header> tensors;  ///< parameters in visit order, then optimizer state
  std::size_t parameters = 0;                       ///< the first `parameters` tensors are the model's
  std::vector<state_piece> mine;                    ///< this rank's pieces
  std::vector<std::vector<held_range>> holders;     ///< per tensor: every rank's pieces, by rank
  std::vector<std::vector<held_range>> cover;       ///< per tensor: ascending ranges, each from the lowest rank holding it

  /// This rank's memory for elements [start, start + numel) of `tensor`, which one of its pieces must hold.
  [[nodiscard]] std::byte* at(std::size_t tensor, std::size_t start, std::size_t numel) const {
    for (const auto& p : mine)
      if (p.tensor == tensor && p.start <= start && start + numel <= p.start + p.numel)
        return p.data + (start - p.start) * size_of(tensors[tensor].type);
    throw error("checkpoint: this rank holds no piece with elements [" + std::to_string(start) + ", " +
                std::to_string(start + numel) + ") of '" + tensors[tensor].name +
                "'; this is a bug in ddp's checkpoint code, please report it");
  }
};

inline std::string describe(dtype t, const std::vector<std::size_t>& shape) {
  std::string s = std::string(to_string(t)) + " [";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// The lowest rank holding each element of a tensor of `numel` elements, as ascending merged ranges.
inline std::vector<held_range> lowest_holders(const std::vector<held_range>& holders, std::size_t numel,
                                              const std::string& name) {
  std::vector<std::size_t> points{0, numel};
  for (const auto& h : holders) points.insert(points.end(), {h.start, h.start + h.numel});
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  std::vector<held_range> out;
  std::size_t last_piece = holders.size();
  for (std::size_t i = 0; i + 1 < points.size() && points[i + 1] <= numel; ++i) {
    const std::size_t a = points[i], b = points[i + 1];
    std::size_t best = holders.size();  // the piece of the lowest rank holding [a, b)
    for (std::size_t h = 0; h < holders.size(); ++h)
      if (holders[h].start <= a && b <= holders[h].start + holders[h].numel &&
          (best == holders.size() || holders[h].rank < holders[best].rank))
        best = h;
    if (best == holders.size())
      throw error("checkpoint: no rank holds elements [" + std::to_string(a) + ", " + std::to_string(b) + ") of '" +
                  name + "'; this is a bug in ddp's checkpoint code, please report it");
    // Ranges merge only within one piece: a rank's adjacent pieces (from two buffers) are not adjacent in memory.
    if (!out.empty() && last_piece == best && out.back().start + out.back().numel == a)
      out.back().numel += b - a;
    else
      out.push_back({holders[best].rank, a, b - a});
    last_piece = best;
  }
  return out;
}

/// Collects the training state of `dp` (and `opt`'s, unless Opt is void; its state is allocated first) and
/// tells every rank where every piece lives. Collective.
template <class DP, class Opt>
training_state collect_state(DP& dp, Opt* opt) {
  training_state st;
  std::map<std::string, std::size_t> index;
  for (const auto& p : dp.layout().slots()) {
    index[p.name] = st.tensors.size();
    st.tensors.push_back({p.name, p.type, p.shape});
  }
  st.parameters = st.tensors.size();

  std::vector<piece_description> described;
  std::vector<std::byte*> data;
  for (const auto& b : dp.owned_buffers())
    for (const auto& seg : b.segments) {
      described.push_back({seg.name, b.values.type, seg.start, seg.numel});
      data.push_back(static_cast<std::byte*>(b.values.data) + seg.offset * size_of(b.values.type));
    }
  if constexpr (!std::is_void_v<Opt>) {
    dp.attach(*opt);
    opt->for_each_state([&](const std::string& name, raw_tensor view, const optim::flat_segment& seg) {
      described.push_back({"optim." + name, view.type, seg.start, view.size});
      data.push_back(static_cast<std::byte*>(view.data));
    });
  }
  const auto everyone = all_gather_object(dp.comm(), described);
  for (const auto& rank_pieces : everyone)  // a parameter's dtype is its pieces' (mixed precision: the f32 masters)
    for (const auto& d : rank_pieces)
      if (const auto it = index.find(d.name); it != index.end()) st.tensors[it->second].type = d.type;

  // Optimizer state tensors: the union of every rank's names, ordered by parameter, then state array.
  std::map<std::pair<std::size_t, std::string>, safetensors::tensor_header> state;
  std::map<std::string, std::size_t> extent;  // elements of each state tensor: the end of its last piece
  for (const auto& rank_pieces : everyone)
    for (const auto& d : rank_pieces) {
      if (!d.name.starts_with("optim.")) continue;
      extent[d.name] = std::max<std::size_t>(extent[d.name], d.start + d.numel);
      const std::string state_name = d.name.substr(6);
      const auto dot = state_name.rfind('.');  // "<parameter>.<state>": the state takes the parameter's shape
      const auto it = dot == std::string::npos ? index.end() : index.find(state_name.substr(0, dot));
      state[{it == index.end() ? st.parameters : it->second, d.name}] = {d.name, d.type, {}};
    }
  for (auto& [key, header] : state) {
    const std::size_t numel = extent[header.name];
    const bool like_parameter = key.first < st.parameters && safetensors::detail::numel_of(st.tensors[key.first].shape) == numel;
    header.shape = like_parameter ? st.tensors[key.first].shape : std::vector<std::size_t>{numel};
    index[header.name] = st.tensors.size();
    st.tensors.push_back(std::move(header));
  }

  st.holders.resize(st.tensors.size());
  for (std::size_t r = 0; r < everyone.size(); ++r)
    for (const auto& d : everyone[r]) st.holders[index.at(d.name)].push_back({static_cast<int>(r), d.start, d.numel});
  for (std::size_t i = 0; i < described.size(); ++i)
    st.mine.push_back({index.at(described[i].name), described[i].start, described[i].numel, data[i]});
  for (std::size_t t = 0; t < st.tensors.size(); ++t)
    st.cover.push_back(lowest_holders(st.holders[t], safetensors::detail::numel_of(st.tensors[t].shape), st.tensors[t].name));
  return st;
}

/// Compares the tensors a checkpoint holds (`found`, from `source`) with the expected ones; returns "" when
/// they agree, else what differs and how to fix it. Optimizer entries are ignored when `ignore_optimizer`.
template <class Found>
std::string compare_state(const std::string& source, const Found& found,
                          std::span<const safetensors::tensor_header> expected, bool ignore_optimizer) {
  std::string missing, extra, mismatched;
  std::size_t n_missing = 0, n_extra = 0, n_mismatched = 0;
  std::map<std::string_view, const safetensors::tensor_header*> in_file, in_model;
  for (const auto& e : found) in_file[e.name] = &e;
  for (const auto& t : expected) {
    in_model[t.name] = &t;
    const auto it = in_file.find(t.name);
    if (it == in_file.end()) {
      if (n_missing++ == 0) missing = "'" + t.name + "' (" + describe(t.type, t.shape) + ")";
    } else if (it->second->type != t.type || it->second->shape != t.shape) {
      if (n_mismatched++ == 0)
        mismatched = "'" + t.name + "' is " + describe(it->second->type, it->second->shape) + " in the file but " +
                     describe(t.type, t.shape) + " in the model";
    }
  }
  for (const auto& e : found)
    if (!in_model.contains(e.name) && !(ignore_optimizer && e.name.starts_with("optim.")))
      if (n_extra++ == 0) extra = "'" + e.name + "'";
  if (n_missing + n_extra + n_mismatched == 0) return {};
  std::string what = "checkpoint '" + source + "' does not match the model and optimizer:";
  if (n_missing) what += " " + std::to_string(n_missing) + " tensor(s) missing from the file, first " + missing + ";";
  if (n_extra) what += " " + std::to_string(n_extra) + " tensor(s) in the file that the model lacks, first " + extra + ";";
  if (n_mismatched) what += " " + std::to_string(n_mismatched) + " with another dtype or shape, first " + mismatched + ";";
  return what + " load it into the model (and optimizer type) that saved it";
}

/// Runs steps while none has failed and keeps the first ddp::error one threw (later steps are skipped), so that
/// a rank keeps taking part in the collectives of a save or load after its own work failed.
struct first_failure {
  std::exception_ptr failure;  ///< the first error thrown, or null
  /// Runs `f` unless a previous step failed; catches what it throws.
  template <class F>
  void run(F&& f) {
    if (failure) return;
    try {
      f();
    } catch (const error&) {
      failure = std::current_exception();
    }
  }
  /// "" or "rank <rank>: <message of the first error>".
  [[nodiscard]] std::string message(int rank) const {
    if (!failure) return {};
    try {
      std::rethrow_exception(failure);
    } catch (const error& e) {
      return "rank " + std::to_string(rank) + ": " + e.message();
    }
  }
};

/// Makes every rank throw what `failure` holds on rank 0 (same type family, same text), or return when it is
/// empty. Collective: it is also the barrier where the other ranks wait for rank 0.
template <class Comm>
void share_rank0_outcome(Comm& comm, const std::exception_ptr& failure) {
  std::vector<std::string> outcome;  // {kind, message}: empty when rank 0 succeeded
  if (comm.rank() == 0 && failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const mismatch_error& e) {
      outcome = {"mismatch", e.message()};
    } catch (const io_error& e) {
      outcome = {"io", e.message()};
    } catch (const error& e) {
      outcome = {"error", e.message()};
    }
  }
  broadcast_object(comm, outcome, 0);
  if (outcome.empty()) return;
  const std::string text = comm.rank() == 0 ? outcome[1] : outcome[1] + " (reported by rank 0)";
  if (outcome[0] == "mismatch") throw mismatch_error(text, comm.rank());
  if (outcome[0] == "io") throw io_error(text, comm.rank());
  throw error(text, comm.rank());
}

/// Runs `f` on rank 0 and makes every rank throw what it threw (a ddp::error), or return.
template <class Comm, class F>
void on_rank0_then_share(Comm& comm, F&& f) {
  first_failure rank0;
  if (comm.rank() == 0) rank0.run(f);
  share_rank0_outcome(comm, rank0.failure);
}

/// Every rank passes what went wrong on it ("" for nothing, else first_failure::message); when any rank
/// failed, every rank throws ddp::io_error with the first failed rank's message. Collective.
template <class Comm>
void agree_on_failure(Comm& comm, const std::string& mine) {
  const auto all = all_gather_object(comm, mine);
  const auto first = std::find_if(all.begin(), all.end(), [](const std::string& s) { return !s.empty(); });
  if (first == all.end()) return;
  const auto failed = std::count_if(all.begin(), all.end(), [](const std::string& s) { return !s.empty(); });
  throw io_error(*first + (failed > 1 ? " (and " + std::to_string(failed - 1) + " more rank(s) failed)" : ""),
                 comm.rank());
}

/// Sets `opt`'s step count from the "optim.step" metadata of the checkpoint at `source` (nothing when Opt is
/// void); throws ddp::mismatch_error when the checkpoint has none. Every rank sees the same metadata.
template <class Opt>
void restore_step_count(const std::filesystem::path& source, const checkpoint_metadata& meta, Opt* opt, int rank) {
  if constexpr (!std::is_void_v<Opt>) {
    const auto it = meta.find("optim.step");
    if (it == meta.end())
      throw mismatch_error("checkpoint '" + source.string() + "' has no optim.step metadata (it was saved without "
                           "an optimizer); load it without the optimizer argument to take only the parameters",
                           rank);
    std::uint64_t step = 0;
    const auto* end = it->second.data() + it->second.size();
    const auto [stop, ec] = std::from_chars(it->second.data(), end, step);
    if (ec != std::errc{} || stop != end)
      throw io_error("checkpoint '" + source.string() + "' has optim.step '" + it->second + "', which is not a step "
                     "count; save it again (or resume from an older checkpoint)",
                     rank);
    opt->set_step_count(step);
  }
}

/// After the owned pieces of the parameters changed, makes the full parameters every rank sees agree with
/// them: unit by unit, inside an unshard scope (full_shard), the lowest rank holding each piece broadcasts it
/// into the parameter's place in the arenas (mixed precision: the f32 master pieces, narrowed there). Under
/// replicate the pieces are the parameters (or their masters). Owning leaves then take the new values. Collective.
template <class DP>
void refresh_parameters(DP& dp, const training_state& st) {
  if constexpr (!std::is_same_v<typename DP::sharding, replicate>) {
    const auto slots = dp.layout().slots();
    std::vector<std::vector<std::pair<std::size_t, std::byte*>>> members;  // per unit: (tensor, full values)
    for (std::size_t t = 0; t < slots.size(); ++t) {
      const auto& p = slots[t];
      if (members.size() <= p.unit) members.resize(p.unit + 1);
      members[p.unit].emplace_back(t, dp.layout().arenas()[p.arena].values.data() + p.offset * size_of(p.type));
    }
    for (std::size_t u = 0; u < members.size(); ++u) {
      typename DP::unshard_guard scope(dp, {u});
      for (const auto& [tensor, full] : members[u]) {
        const dtype type = st.tensors[tensor].type, home = slots[tensor].type;  // they differ under mixed precision
        const std::size_t width = size_of(type);
        std::vector<std::byte> wide;  // mixed precision: a master piece on its way to the compute-dtype parameter
        for (const auto& c : st.cover[tensor]) {
          if (type != home) wide.resize(c.numel * width);
          std::byte* dst = type == home ? full + c.start * width : wide.data();
          if (c.rank == dp.rank()) std::memmove(dst, st.at(tensor, c.start, c.numel), c.numel * width);  // may be dst
          dp.comm().broadcast(raw_tensor{dst, c.numel, type, device::cpu()}, c.rank).wait();
          if (type != home)
            convert(raw_tensor{dst, c.numel, type, device::cpu()},
                    raw_tensor{full + c.start * size_of(home), c.numel, home, device::cpu()});
        }
      }
    }
  }
  dp.values_changed();
}

}  // namespace detail
}  // namespace ddp
// ---- end <ddp/checkpoint/state.hpp>

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
    const auto problem = compare_state(manifest_path.string(), m.tensors, st.tensors, std::is_void_v<Opt>);
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
  refresh_parameters(dp, st);
  restore_step_count(manifest_path, m.metadata, opt, me);
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
    meta["optim.step"] = std::to_string(opt.step_count());
    meta["ddp.world_size"] = std::to_string(n);
    const nlohmann::json manifest = {{"format", detail::sharded_format}, {"world_size", n}, {"metadata", meta},
                                     {"tensors", std::move(tensors)}, {"parts", std::move(parts)},
                                     {"manifest_checksum", detail::unsealed_digits}};
    std::string text = manifest.dump(1);
    const auto seal = detail::find_seal(text, detail::manifest_marker);
    text.replace(seal, detail::unsealed_digits.size(), detail::hex(detail::fnv1a(text)));
    try {
      detail::atomic_file file(fs::path(tmp) / "manifest.json");
      file.write(std::as_bytes(std::span(text)));
      file.commit();
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
// ---- end <ddp/checkpoint/sharded.hpp>

namespace ddp {

namespace detail {

template <class DP, class Opt>
void save_full(const std::filesystem::path& path, DP& dp, Opt* opt, const checkpoint_metadata& metadata) {
  const auto st = collect_state(dp, opt);
  auto& comm = dp.comm();
  const int me = comm.rank();
  std::optional<safetensors::writer> out;
  first_failure rank0;  // rank 0 keeps receiving after a failed write, so no sender is left waiting
  if (me == 0)
    rank0.run([&] {
      auto meta = metadata;
      if constexpr (!std::is_void_v<Opt>) meta["optim.step"] = std::to_string(opt->step_count());
      meta["ddp.world_size"] = std::to_string(dp.world_size());
      out.emplace(path, st.tensors, meta);
    });
  std::vector<std::byte> buffer;
  for (std::size_t t = 0; t < st.tensors.size(); ++t) {
    const dtype type = st.tensors[t].type;
    for (const auto& c : st.cover[t]) {
      const std::size_t bytes = c.numel * size_of(type);
      if (me == 0 && c.rank == 0) {
        rank0.run([&] { out->append({st.at(t, c.start, c.numel), bytes}); });
      } else if (me == 0) {
        buffer.resize(bytes);
        comm.recv(raw_tensor{buffer.data(), c.numel, type, device::cpu()}, c.rank).wait();
        rank0.run([&] { out->append({buffer.data(), bytes}); });
      } else if (c.rank == me) {
        comm.send(raw_tensor{st.at(t, c.start, c.numel), c.numel, type, device::cpu()}, 0).wait();
      }
    }
  }
  if (me == 0) rank0.run([&] { out->commit(); });
  share_rank0_outcome(comm, rank0.failure);
}

template <class DP, class Opt>
checkpoint_metadata load_full(const std::filesystem::path& path, DP& dp, Opt* opt) {
  const auto st = collect_state(dp, opt);
  auto& comm = dp.comm();
  const int me = comm.rank();
  std::optional<safetensors::reader> in;
  std::vector<std::string> meta_flat;  // key, value, key, value, ...
  on_rank0_then_share(comm, [&] {
    in.emplace(safetensors::reader::open(path));
    in->verify_checksum();  // first: a damaged header is an io_error, never taken for another model
    const auto problem = compare_state(path.string(), in->entries(), st.tensors, std::is_void_v<Opt>);
    if (!problem.empty()) throw mismatch_error(problem, 0);
    for (const auto& [k, v] : in->metadata()) meta_flat.insert(meta_flat.end(), {k, v});
  });
  first_failure rank0;  // rank 0 keeps sending after a failed read, so no receiver is left waiting
  std::vector<std::byte> buffer;
  for (std::size_t t = 0; t < st.tensors.size(); ++t) {
    const dtype type = st.tensors[t].type;
    const std::size_t numel = safetensors::detail::numel_of(st.tensors[t].shape), width = size_of(type);
    const auto* entry = me == 0 ? in->find(st.tensors[t].name) : nullptr;
    const auto& holders = st.holders[t];
    const bool everywhere = holders.size() == static_cast<std::size_t>(comm.size()) &&
                            std::all_of(holders.begin(), holders.end(), [&](const held_range& h) { return h.numel == numel; });
    if (everywhere && numel > 0) {
      std::byte* mine = st.at(t, 0, numel);
      if (me == 0) rank0.run([&] { in->read(*entry, 0, {mine, numel * width}); });
      comm.broadcast(raw_tensor{mine, numel, type, device::cpu()}, 0).wait();
      continue;
    }
    for (const auto& h : holders) {
      if (me == 0 && h.rank == 0) {
        rank0.run([&] { in->read(*entry, h.start * width, {st.at(t, h.start, h.numel), h.numel * width}); });
      } else if (me == 0) {
        buffer.resize(h.numel * width);
        rank0.run([&] { in->read(*entry, h.start * width, buffer); });
        comm.send(raw_tensor{buffer.data(), h.numel, type, device::cpu()}, h.rank).wait();
      } else if (h.rank == me) {
        comm.recv(raw_tensor{st.at(t, h.start, h.numel), h.numel, type, device::cpu()}, 0).wait();
      }
    }
  }
  share_rank0_outcome(comm, rank0.failure);
  refresh_parameters(dp, st);
  broadcast_object(comm, meta_flat, 0);
  checkpoint_metadata meta;
  for (std::size_t i = 0; i + 1 < meta_flat.size(); i += 2) meta[meta_flat[i]] = meta_flat[i + 1];
  restore_step_count(path, meta, opt, me);
  return meta;
}

}  // namespace detail

/// Saves the parameters of `dp` and the state of `opt` to `path` (one safetensors file, any sharding policy):
/// rank 0 writes to a temporary file and renames it, the other ranks stream it the ranges they hold.
/// `metadata` is stored too. Collective: every rank calls it; a failure is thrown on every rank.
template <class DP, class Opt>
  requires(!std::is_same_v<std::remove_cv_t<Opt>, checkpoint_metadata>)
void save(const std::filesystem::path& path, DP& dp, Opt& opt, const checkpoint_metadata& metadata = {}) {
  detail::save_full(path, dp, &opt, metadata);
}

/// Saves only the parameters of `dp` (an optimizer that ddp does not step, such as a torch::optim one, keeps its
/// own state): the file load(path, dp) and PyTorch read. Collective.
template <class DP>
void save(const std::filesystem::path& path, DP& dp, const checkpoint_metadata& metadata = {}) {
  detail::save_full(path, dp, static_cast<void*>(nullptr), metadata);
}

/// Loads what save() wrote (at any world size, under any policy) into `dp`'s parameters and `opt`'s state (and
/// step count) on every rank; rank 0 reads and verifies names, shapes, dtypes and the checksum, then sends each
/// rank its ranges. Throws ddp::io_error for an unreadable file and ddp::mismatch_error naming the first
/// missing, extra and differing tensor, on every rank. Returns the metadata. Collective.
template <class DP, class Opt>
checkpoint_metadata load(const std::filesystem::path& path, DP& dp, Opt& opt) {
  return detail::load_full(path, dp, &opt);
}

/// Loads only the parameters (optimizer entries in the file are ignored), e.g. for evaluation. Collective.
template <class DP>
checkpoint_metadata load(const std::filesystem::path& path, DP& dp) {
  return detail::load_full(path, dp, static_cast<void*>(nullptr));
}

}  // namespace ddp
// ---- end <ddp/checkpoint/checkpoint.hpp>
// ---- end <ddp/checkpoint.hpp>
// ---- begin <ddp/log.hpp>
/// \file Output of a training job: ddp::logger (rank 0 speaks for the job) and ddp::progress_bar
/// (step, loss, samples/s and ETA, drawn by rank 0).

// ---- begin <ddp/log/logger.hpp>
/// \file Rank-0-only logging: `ddp::logger log{comm}; log.info("epoch ", e, " loss ", loss);` prints on rank 0
/// and is silent elsewhere, unless DDP_LOG_ALL_RANKS=1, where every rank prints with a "[rank r]" prefix.
/// Arguments are streamed with operator<<; each message is written as one line in one call, so lines of
/// different ranks sharing a terminal do not interleave mid-line.


namespace ddp {

/// A logger that knows its rank: info() on rank 0 only (or on every rank with DDP_LOG_ALL_RANKS=1), warn() always.
class logger {
 public:
  /// A logger for `rank`; `out` receives info lines (stdout by default), warnings go to stderr.
  explicit logger(int rank, std::FILE* out = stdout) : rank_(rank), out_(out) {
    const char* all = std::getenv("DDP_LOG_ALL_RANKS");  // NOLINT(concurrency-mt-unsafe): read once
    all_ranks_ = all != nullptr && std::string_view(all) == "1";
  }
  /// A logger for the rank of `comm` (any ddp::communicator, or anything with rank()).
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; }
  explicit logger(const Comm& comm, std::FILE* out = stdout) : logger(comm.rank(), out) {}

  /// True when info() prints on this rank.
  [[nodiscard]] bool enabled() const noexcept { return rank_ == 0 || all_ranks_; }
  /// This logger's rank.
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// Prints the streamed `args` as one line, on rank 0 only (every rank with DDP_LOG_ALL_RANKS=1).
  template <class... Args>
  void info(Args&&... args) const {
    if (enabled()) write(out_, compose(std::forward<Args>(args)...));
  }
  /// Prints the streamed `args` as one line on stderr, on every rank, prefixed with the rank.
  template <class... Args>
  void warn(Args&&... args) const {
    write(stderr, "[rank " + std::to_string(rank_) + "] warning: " + compose_raw(std::forward<Args>(args)...));
  }

 private:
  template <class... Args>
  static std::string compose_raw(Args&&... args) {
    std::ostringstream s;
    (s << ... << std::forward<Args>(args));
    return s.str();
  }
  template <class... Args>
  std::string compose(Args&&... args) const {
    return (all_ranks_ ? "[rank " + std::to_string(rank_) + "] " : std::string()) + compose_raw(std::forward<Args>(args)...);
  }
  static void write(std::FILE* to, std::string line) {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), to);
    std::fflush(to);
  }

  int rank_;
  std::FILE* out_;
  bool all_ranks_ = false;
};

}  // namespace ddp
// ---- end <ddp/log/logger.hpp>
// ---- begin <ddp/log/progress_bar.hpp>
/// \file A progress bar for training loops, drawn by rank 0 only: step/total, loss, samples/s and ETA.
/// On a terminal it redraws one line with '\r'; otherwise (logs, pipes) it prints a plain line every
/// tenth of the way and at the end, so log files stay readable.



namespace ddp {

/// Progress of one loop of `total` steps (an epoch), shown on rank 0 and silent on the others.
class progress_bar {
 public:
  using clock = std::chrono::steady_clock;  ///< time source

  /// A bar titled `label` for `total` steps, drawn when `rank` is 0, on `out` (stderr by default).
  progress_bar(int rank, std::size_t total, std::string label, std::FILE* out = stderr)
      : enabled_(rank == 0), tty_(enabled_ && ::isatty(::fileno(out)) == 1), total_(total), label_(std::move(label)),
        out_(out), start_(clock::now()), last_draw_(start_) {}
  /// A bar for the rank of `comm`.
  template <class Comm>
    requires requires(const Comm& c) { { c.rank() } -> std::convertible_to<int>; }
  progress_bar(const Comm& comm, std::size_t total, std::string label, std::FILE* out = stderr)
      : progress_bar(comm.rank(), total, std::move(label), out) {}
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;
  /// Ends the line on a terminal if finish() was not called.
  ~progress_bar() { if (tty_ && !finished_ && step_ > 0) std::fputc('\n', out_); }

  /// One more step done, which processed `samples` samples (all ranks together, or this rank's: say so in the
  /// label) with loss `loss` (shown as a running mean over the loop).
  void step(double loss, std::size_t samples) {
    ++step_;
    samples_ += samples;
    loss_sum_ += loss;
    if (!enabled_) return;
    const auto now = clock::now();
    if (tty_) {
      if (now - last_draw_ >= std::chrono::milliseconds(100) || step_ == total_) draw(now, '\r');
    } else if (total_ > 0 && (step_ * 10 / total_ != (step_ - 1) * 10 / total_) && step_ != total_) {
      draw(now, '\n');
    }
  }
  /// Draws the final state and ends the line.
  void finish() {
    if (!enabled_ || finished_) return;
    finished_ = true;
    draw(clock::now(), tty_ ? '\r' : '\n');
    if (tty_) std::fputc('\n', out_);
    std::fflush(out_);
  }

  /// Steps done so far.
  [[nodiscard]] std::size_t steps() const noexcept { return step_; }
  /// Mean of the losses passed to step().
  [[nodiscard]] double mean_loss() const noexcept { return step_ ? loss_sum_ / static_cast<double>(step_) : 0.0; }
  /// The line as drawn now ("label 120/469 [=====>    ] loss 0.4321 | 12345 samples/s | ETA 0:12").
  [[nodiscard]] std::string line() const { return render(clock::now()); }

 private:
  static std::string clock_text(double seconds) {
    const auto s = static_cast<long long>(seconds + 0.5);
    char buf[32];
    if (s >= 3600)
      std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
    else
      std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
    return buf;
  }
  std::string render(clock::time_point now) const {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    constexpr std::size_t width = 24;
    const std::size_t filled = total_ ? std::min(width, step_ * width / total_) : width;
    std::string bar(filled, '=');
    if (filled < width) bar += '>' + std::string(width - filled - 1, ' ');
    const double rate = elapsed > 0 ? static_cast<double>(samples_) / elapsed : 0.0;
    const double eta = step_ > 0 && total_ > step_ ? elapsed / static_cast<double>(step_) * static_cast<double>(total_ - step_) : 0.0;
    char buf[160];
    std::snprintf(buf, sizeof buf, " %zu/%zu [%s] loss %.4f | %.0f samples/s | %s %s", step_, total_, bar.c_str(),
                  mean_loss(), rate, step_ >= total_ ? "took" : "ETA", clock_text(step_ >= total_ ? elapsed : eta).c_str());
    return label_ + buf;
  }
  void draw(clock::time_point now, char end) {
    last_draw_ = now;
    std::string text = render(now);
    if (end == '\r') {
      text = '\r' + text + "\x1b[K";  // clear what a longer previous line left
    } else {
      text += '\n';
    }
    std::fwrite(text.data(), 1, text.size(), out_);
    std::fflush(out_);
  }

  bool enabled_;
  bool tty_;
  std::size_t total_;
  std::string label_;
  std::FILE* out_;
  clock::time_point start_;
  clock::time_point last_draw_;
  std::size_t step_ = 0;
  std::size_t samples_ = 0;
  double loss_sum_ = 0;
  bool finished_ = false;
};

}  // namespace ddp
// ---- end <ddp/log/progress_bar.hpp>
// ---- end <ddp/log.hpp>
// ---- begin <ddp/launch.hpp>
/// \file The launcher API (CMake target ddp::launch): ddp::launch::spawn runs a function in N forked
/// ranks with torchrun's environment, ddp::launch::spawn_program N copies of a program (what the
/// ddp-launch program does).

// ---- begin <ddp/launch/spawn.hpp>
/// \file Local launcher (like torch.multiprocessing.spawn and torchrun --standalone): forks N ranks on
/// this host with torchrun's environment set, forwards or captures their output line by line, stops
/// the others when one fails, and reports how every rank ended.

#include <sys/wait.h>

#include <csignal>
#include <iostream>

// ---- begin <ddp/launch/binding.hpp>
/// \file Rank binding for the local launcher: which CPUs each rank may run on (like mpirun's --bind-to).
///
/// The machine's topology is read from /sys (hardware threads grouped into physical cores, cores into
/// NUMA nodes), limited to the CPUs the launcher itself may use (its affinity: taskset, cgroups, a batch
/// system's allocation). `core` gives each rank a contiguous block of whole physical cores (hyperthreads
/// stay with their core) when there are at least as many cores as ranks, and binds nothing otherwise, since
/// pinning oversubscribed ranks only makes them wait on each other; `numa` gives each rank the CPUs of one
/// NUMA node (ranks spread over the nodes in blocks, several ranks sharing a node when there are more ranks
/// than nodes).




namespace ddp::launch {

/// How ranks are bound to CPUs.
enum class bind_mode {
  none,  ///< every rank may run anywhere the launcher may
  core,  ///< each rank gets its own whole physical cores (the default when ranks <= cores)
  numa,  ///< each rank gets the CPUs of one NUMA node
};

/// One hardware thread (logical CPU) and where it sits.
struct cpu_place {
  int cpu = 0;   ///< the logical CPU number
  int core = 0;  ///< its physical core (hardware threads of one core share it), unique across packages
  int node = 0;  ///< its NUMA node
};

/// The CPUs ranks may be bound to.
using topology = std::vector<cpu_place>;

/// The CPUs of each rank (empty: not bound) and one line telling what was chosen.
struct binding_plan {
  std::vector<std::vector<int>> cpus;  ///< per rank, ascending
  std::string summary;                 ///< e.g. "bound to cores: rank 0 on CPUs 0-1, rank 1 on CPUs 2-3"
};

namespace detail {

/// "0-3,8,10-11": Linux's CPU list format.
inline std::vector<int> parse_cpu_list(std::string_view text) {
  std::vector<int> out;
  std::stringstream in{std::string(text)};
  std::string part;
  while (std::getline(in, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == ' ' || c == '\n'; }), part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    const int lo = std::stoi(part.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  return out;
}

/// The inverse of parse_cpu_list for an ascending list.
inline std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) {
      out += '-';
      out += std::to_string(cpus[j]);
    }
    i = j + 1;
  }
  return out;
}

inline std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

/// Blocks of `items` for `n` ranks: rank r gets items [r*k/n, (r+1)*k/n) — sizes differ by at most one.
template <class T>
std::vector<std::vector<T>> split_in_blocks(const std::vector<T>& items, int n) {
  std::vector<std::vector<T>> out(static_cast<std::size_t>(n));
  const std::size_t k = items.size(), ranks = static_cast<std::size_t>(n);
  for (std::size_t r = 0; r < ranks; ++r)
    out[r].assign(items.begin() + static_cast<long>(r * k / ranks), items.begin() + static_cast<long>((r + 1) * k / ranks));
  return out;
}

}  // namespace detail

/// The CPUs this process may run on, with their cores and NUMA nodes read from /sys.
inline topology read_topology() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  std::vector<int> node_of(CPU_SETSIZE, 0);
  for (int node = 0; node < 4096; ++node) {
    const std::string list = detail::read_line("/sys/devices/system/node/node" + std::to_string(node) + "/cpulist");
    if (list.empty()) {
      if (node > 0 && detail::read_line("/sys/devices/system/node/node" + std::to_string(node + 1) + "/cpulist").empty())
        break;  // node numbers may have holes; two missing in a row end the scan
      continue;
    }
    for (const int c : detail::parse_cpu_list(list))
      if (c >= 0 && c < CPU_SETSIZE) node_of[static_cast<std::size_t>(c)] = node;
  }
  topology t;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &allowed)) continue;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
    // The first hardware thread of the core names it: unique across packages, unlike core_id.
    const auto siblings = detail::parse_cpu_list(detail::read_line(base + "thread_siblings_list"));
    t.push_back({c, siblings.empty() ? c : siblings.front(), node_of[static_cast<std::size_t>(c)]});
  }
  return t;
}

/// Which CPUs each of `n` ranks gets under `mode` on `machine`.
inline binding_plan plan_binding(bind_mode mode, int n, const topology& machine) {
  if (n < 1) throw config_error("plan_binding needs at least one rank, got n = " + std::to_string(n));
  binding_plan plan;
  plan.cpus.resize(static_cast<std::size_t>(n));
  std::vector<int> groups;  // cores (core) or nodes (numa), in the order of their first CPU
  for (const auto& p : machine) {
    const int g = mode == bind_mode::numa ? p.node : p.core;
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  const char* what = mode == bind_mode::numa ? "NUMA nodes" : "cores";
  if (mode == bind_mode::none) {
    plan.summary = "not binding ranks (--bind none)";
    return plan;
  }
  const std::size_t can_take = mode == bind_mode::numa ? machine.size() : groups.size();
  if (machine.empty() || static_cast<std::size_t>(n) > can_take) {
    plan.summary = "not binding ranks: " + std::to_string(n) + " ranks on " + std::to_string(can_take) + " " +
                   (mode == bind_mode::numa ? "CPUs" : what) + " would share them (oversubscribed)";
    return plan;
  }
  // numa: every rank gets a whole node (ranks in blocks over the nodes); core: a block of whole cores.
  const auto blocks = mode == bind_mode::numa ? std::vector<std::vector<int>>{} : detail::split_in_blocks(groups, n);
  plan.summary = std::string("bound to ") + what + ":";
  for (int r = 0; r < n; ++r) {
    const auto rank = static_cast<std::size_t>(r);
    std::set<int> mine;
    if (mode == bind_mode::numa)
      mine.insert(groups[rank * groups.size() / static_cast<std::size_t>(n)]);
    else
      mine.insert(blocks[rank].begin(), blocks[rank].end());
    for (const auto& p : machine)
      if (mine.count(mode == bind_mode::numa ? p.node : p.core)) plan.cpus[rank].push_back(p.cpu);
    std::sort(plan.cpus[rank].begin(), plan.cpus[rank].end());
    plan.summary += r ? ", rank " : " rank ";
    plan.summary += std::to_string(r);
    plan.summary += " on CPUs ";
    plan.summary += detail::format_cpu_list(plan.cpus[rank]);
  }
  return plan;
}

/// Binds the calling process to `cpus` (nothing when empty); false when the kernel refused.
inline bool bind_to(const std::vector<int>& cpus) noexcept {
  if (cpus.empty()) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (const int c : cpus)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return ::sched_setaffinity(0, sizeof set, &set) == 0;
}

}  // namespace ddp::launch
// ---- end <ddp/launch/binding.hpp>
// ---- begin <ddp/launch/exit_order.hpp>
/// \file The launcher's errors and the order in which its ranks' exits began, for blaming the rank
/// that failed first rather than a peer that failed because it died.

#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/signalfd.h>



namespace ddp::launch {

/// A system call of the launcher itself failed (fork, pipe, socket); native_code() is errno.
class launch_error : public ddp::error {
 public:
  using error::error;
};

namespace detail {

[[noreturn]] inline void throw_errno(const std::string& what) {
  const int code = errno;
  throw launch_error("the launcher could not " + what + ": " + std::strerror(code) +
                         "; check the process and file-descriptor limits (ulimit -u, ulimit -n)",
                     -1, code);
}

/// Which ranks' exits have begun, in the kernel's order. Each rank holds the write end of a pipe of its
/// own (its "sentinel") at the highest descriptor it may open: a process's descriptors are released
/// from the highest down when it exits, so the sentinel closes before the rank's sockets do, and thus
/// before any peer can see it die. The launcher's epoll instance reports the sentinels' hang-ups in
/// the order they happened, however late it looks. SIGCHLD is blocked in the calling thread and read
/// from a signalfd in the same epoll set, so the launcher also wakes as soon as a rank can be reaped.
class exit_order {
 public:
  explicit exit_order(int n) : began_(static_cast<std::size_t>(n), 0), sentinels_(static_cast<std::size_t>(n), -1) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (const int code = ::pthread_sigmask(SIG_BLOCK, &chld, &saved_); code != 0) {
      errno = code;
      throw_errno("block SIGCHLD to watch the ranks' exits");
    }
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    signals_ = ::signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = signals_key;
    if (epoll_ < 0 || signals_ < 0 || ::epoll_ctl(epoll_, EPOLL_CTL_ADD, signals_, &ev) != 0) {
      const int code = errno;
      release();
      errno = code;
      throw_errno("open an epoll instance and a signalfd to watch the ranks' exits");
    }
  }
  exit_order(const exit_order&) = delete;
  exit_order& operator=(const exit_order&) = delete;
  ~exit_order() { release(); }

  /// Readable when a rank's exit began or a rank can be reaped.
  [[nodiscard]] int fd() const noexcept { return epoll_; }

  /// A new sentinel pipe for `rank`: the launcher watches its read end; returns the write end (close-on-exec,
  /// for the child to place with place_sentinel and for the parent to close after the fork), or -1 on error.
  int open_sentinel(int rank) {
    int p[2] = {-1, -1};
    if (::pipe2(p, O_CLOEXEC) != 0) return -1;
    epoll_event ev{};
    ev.events = EPOLLIN;  // a hang-up is always reported
    ev.data.u64 = static_cast<std::uint64_t>(rank);
    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, p[0], &ev) != 0) {
      const int code = errno;
      ::close(p[0]);
      ::close(p[1]);
      errno = code;
      return -1;
    }
    sentinels_[static_cast<std::size_t>(rank)] = p[0];
    return p[1];
  }

  /// In the child: moves the sentinel to the highest descriptor the rank may open (at most 65535), kept
  /// across exec; the launcher's own descriptors of this class are closed.
  void place_sentinel(int write_end) const noexcept {
    rlimit lim{};
    const rlim_t cap = 65536;
    const rlim_t top = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 ? std::min(lim.rlim_cur, cap) : 1024;
    const int high = static_cast<int>(top) - 1;
    if (high > write_end && ::dup2(write_end, high) == high) ::close(write_end);
    ::close(epoll_);
    ::close(signals_);
    for (int fd : sentinels_)
      if (fd >= 0) ::close(fd);
  }

  /// Takes the events that are ready: every sentinel that hung up gets the next number, in the order the
  /// kernel queued them; pending SIGCHLDs are consumed (they only wake the launcher).
  void update() {
    epoll_event events[64];
    for (int got = 64; got == 64;) {
      got = ::epoll_wait(epoll_, events, 64, 0);
      for (int k = 0; k < got; ++k) {
        if (events[k].data.u64 == signals_key) {
          signalfd_siginfo si{};
          while (::read(signals_, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
          }
          continue;
        }
        const auto r = static_cast<std::size_t>(events[k].data.u64);
        if ((events[k].events & (EPOLLHUP | EPOLLERR)) == 0) continue;  // bytes written to a sentinel: ignored
        ::epoll_ctl(epoll_, EPOLL_CTL_DEL, sentinels_[r], nullptr);
        ::close(sentinels_[r]);
        sentinels_[r] = -1;
        if (began_[r] == 0) began_[r] = ++count_;
      }
    }
  }

  /// Rank r was reaped: an exit whose sentinel never hung up (a child of the rank still holds it)
  /// is numbered now.
  void reaped(int r) {
    if (began_[static_cast<std::size_t>(r)] == 0) began_[static_cast<std::size_t>(r)] = ++count_;
  }

  /// The position of rank r's exit among those begun so far (1 first), 0 while it has not begun.
  [[nodiscard]] std::uint64_t began(int r) const noexcept { return began_[static_cast<std::size_t>(r)]; }

 private:
  static constexpr std::uint64_t signals_key = ~std::uint64_t{0};

  void release() noexcept {
    for (int& fd : sentinels_)
      if (fd >= 0) ::close(std::exchange(fd, -1));
    if (signals_ >= 0) ::close(signals_);
    if (epoll_ >= 0) ::close(epoll_);
    ::pthread_sigmask(SIG_SETMASK, &saved_, nullptr);
  }

  std::vector<std::uint64_t> began_;
  std::vector<int> sentinels_;
  std::uint64_t count_ = 0;
  int epoll_ = -1;
  int signals_ = -1;
  sigset_t saved_{};
};

}  // namespace detail
}  // namespace ddp::launch
// ---- end <ddp/launch/exit_order.hpp>
// ---- begin <ddp/launch/job_identity.hpp>
/// \file The job's rendezvous port and token when the caller of spawn gives none: a port free right now and 128
/// random bits.




namespace ddp::launch::detail {

/// The range the kernel draws ports from for connect() and bind(0) (ip_local_port_range), or Linux's default.
inline std::pair<int, int> ephemeral_ports() {
  int lo = 0;
  int hi = 0;
  if (std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range"); in >> lo >> hi && lo <= hi) return {lo, hi};
  return {32768, 60999};
}

/// Binds a TCP socket to `port` on every interface (0: the kernel picks one) and closes it: the port it got, or
/// 0 where the port is taken (a listener, a connection, a TIME_WAIT).
inline std::uint16_t probe_port(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw_errno("open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(port);
  socklen_t len = sizeof a;
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int code = errno;
  ::close(fd);
  errno = code;
  return bound ? ntohs(a.sin_port) : 0;
}

/// A TCP port free on every interface right now, drawn at random from 20000..65535 outside the ephemeral range:
/// no connection or bind(0) of another process on the host can take it before the job binds it.
inline std::uint16_t free_port() {
  const auto [lo, hi] = ephemeral_ports();
  constexpr int first = 20000;
  constexpr int last = 65535;
  const int below = std::max(0, std::min(lo, last + 1) - first);  // first..lo-1
  const int above_first = std::max(hi + 1, first);
  const int above = std::max(0, last + 1 - above_first);  // above_first..last
  if (below + above > 0) {
    std::random_device entropy;
    std::uniform_int_distribution<int> pick(0, below + above - 1);
    for (int attempt = 0; attempt < 64; ++attempt) {
      const int i = pick(entropy);
      const auto port = static_cast<std::uint16_t>(i < below ? first + i : above_first + (i - below));
      if (probe_port(port) == port) return port;
    }
  }
  // Every port outside the ephemeral range is taken (or there is none): let the kernel choose one inside it.
  const std::uint16_t port = probe_port(0);
  if (port == 0) throw_errno("bind a socket to port 0 to find a free port");
  return port;
}

/// 128 random bits as 32 hex digits.
inline std::string random_token() {
  std::random_device rd;
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t w = rd();
    for (int b = 28; b >= 0; b -= 4) s += digits[(w >> b) & 0xFU];
  }
  return s;
}

}  // namespace ddp::launch::detail
// ---- end <ddp/launch/job_identity.hpp>

namespace ddp::launch {

/// A rank of a spawned job failed; rank() is the rank that failed first, native_code() its exit status
/// as a shell reports it (the exit code, or 128 + signal).
class job_failed : public ddp::error {
 public:
  using error::error;
};

/// What happens to the ranks' stdout and stderr.
enum class output_mode {
  forward,  ///< every line goes to the launcher's own stdout/stderr, prefixed with "[rank R] "
  capture,  ///< stdout and stderr of each rank are kept, in order, in rank_status::output
};

/// Extra environment variables of one rank, as name/value pairs (applied after the launcher's own).
using env_list = std::vector<std::pair<std::string, std::string>>;

struct spawn_result;

/// How to start a job; every field has a working default.
struct spawn_options {
  std::uint16_t port = 0;                      ///< MASTER_PORT; 0 picks a free port
  std::string master_addr = "127.0.0.1";       ///< MASTER_ADDR
  std::string token;                           ///< DDP_TOKEN; empty: the launcher's own, else 128 random bits
  std::chrono::milliseconds timeout{0};        ///< whole-job limit; 0 means none
  std::chrono::milliseconds grace{3000};       ///< SIGTERM to SIGKILL delay when stopping ranks
  output_mode output = output_mode::forward;   ///< forward with prefixes, or capture
  bool stop_on_failure = true;                 ///< stop the other ranks once one fails (after `settle`)
  /// After a rank failed, how long the others may run on before they are stopped: time to see the failure
  /// themselves (peer_lost within 0.1 s) and write their flight records.
  std::chrono::milliseconds settle{0};
  std::function<env_list(int rank)> extra_env; ///< per-rank additions or overrides of the environment
  std::vector<std::vector<int>> cpus;          ///< per rank, the CPUs it is bound to (none or empty: not bound)
  /// When set and it becomes non-zero (a signal handler writes the signal number), every rank is
  /// stopped and the job reports that signal; ddp-launch uses it to pass on SIGINT/SIGTERM.
  const volatile std::sig_atomic_t* interrupt = nullptr;
  int first_rank = 0;   ///< RANK of local rank 0: node_rank × nproc_per_node on a job of several nodes
  int world_size = 0;   ///< WORLD_SIZE; 0: the number of local ranks (a job on one node)
  int node_rank = 0;    ///< GROUP_RANK, torchrun's node rank
  int nodes = 1;        ///< GROUP_WORLD_SIZE, the number of nodes
  int restart_count = 0;  ///< DDP_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT): restarts so far
  /// Called every tick while ranks run, with the job's state so far; returning true stops every rank (a
  /// rank failed on another node) and the job reports stopped_by_watch.
  std::function<bool(const spawn_result&)> watch;
};

/// How one rank ended.
struct rank_status {
  int rank = 0;                     ///< the rank
  int exit_code = -1;               ///< its exit code, -1 when a signal ended it
  int signal = 0;                   ///< the signal that ended it, 0 when it exited
  bool stopped_by_launcher = false; ///< the launcher signalled it (another rank failed, timeout, interrupt)
  bool unknown_status = false;      ///< it ended but its status could not be read (SIGCHLD set to SIG_IGN)
  std::chrono::system_clock::time_point ended{};  ///< when the launcher reaped it (wall clock)
  std::string output;               ///< its stdout and stderr (output_mode::capture only)

  /// Exited with status 0.
  [[nodiscard]] bool ok() const noexcept { return exit_code == 0; }
  /// The status as a shell reports it: the exit code, or 128 + signal.
  [[nodiscard]] int shell_status() const noexcept { return signal != 0 ? 128 + signal : exit_code; }
  /// "exit code 3", "signal 9 (Killed)".
  [[nodiscard]] std::string describe() const {
    if (unknown_status)
      return "an unknown status (waitpid failed with ECHILD; do not set SIGCHLD to SIG_IGN while spawning)";
    if (signal == 0) return "exit code " + std::to_string(exit_code);
    return "signal " + std::to_string(signal) + " (" + ::strsignal(signal) + ")";
  }
};

/// The outcome of a job: every rank's status and which one failed first.
struct spawn_result {
  std::vector<rank_status> ranks;  ///< indexed by rank
  int first_failed = -1;           ///< the rank that failed first, -1 when none did
  bool timed_out = false;          ///< the whole-job timeout expired and the launcher stopped the ranks
  int interrupted_by = 0;          ///< the signal that interrupted the launcher (spawn_options::interrupt), 0 if none
  bool stopped_by_watch = false;   ///< spawn_options::watch asked to stop the ranks (a failure on another node)
  int first_rank = 0;              ///< RANK of local rank 0 (spawn_options::first_rank)
  std::uint16_t port = 0;          ///< the MASTER_PORT the ranks got
  std::string token;               ///< the DDP_TOKEN the ranks got

  /// Every rank exited with status 0.
  [[nodiscard]] bool ok() const noexcept {
    return first_failed < 0 && !timed_out && interrupted_by == 0 && !stopped_by_watch &&
           std::all_of(ranks.begin(), ranks.end(), [](const rank_status& r) { return r.ok(); });
  }
  /// The job's status as a program should exit with: 0; the first failing rank's shell status;
  /// 124 after the timeout (as timeout(1)); 128 + signal after an interrupt; 1 when stopped by the watch.
  [[nodiscard]] int exit_status() const noexcept {
    if (first_failed >= 0) return ranks[static_cast<std::size_t>(first_failed)].shell_status();
    if (timed_out) return 124;
    if (interrupted_by != 0) return 128 + interrupted_by;
    if (stopped_by_watch) return 1;
    return 0;
  }
  /// "rank G" of local rank `local`, with its local rank when ranks of other nodes come before it.
  [[nodiscard]] std::string name_of(int local) const {
    const std::string global = "rank " + std::to_string(first_rank + local);
    return first_rank == 0 ? global : global + " (local rank " + std::to_string(local) + ")";
  }
  /// One paragraph for humans: what failed first and how every other rank ended.
  [[nodiscard]] std::string describe() const {
    std::string s;
    if (first_failed >= 0)
      s = name_of(first_failed) + " failed first with " +
          ranks[static_cast<std::size_t>(first_failed)].describe();
    else if (timed_out)
      s = "the job did not finish within its timeout and was stopped";
    else if (interrupted_by != 0)
      s = "the launcher was interrupted by signal " + std::to_string(interrupted_by) + " and stopped the job";
    else if (stopped_by_watch)
      s = "the launcher stopped its ranks after a failure elsewhere";
    else
      s = "all " + std::to_string(ranks.size()) + " ranks exited with status 0";
    if (ok()) return s;
    for (const auto& r : ranks) {
      if (r.rank == first_failed) continue;
      s += "; " + name_of(r.rank) + ": " + r.describe();
      if (r.stopped_by_launcher) s += " (stopped by the launcher)";
    }
    return s;
  }
  /// Throws ddp::launch::job_failed with describe() unless ok().
  void throw_if_failed() const {
    if (ok()) return;
    throw job_failed(describe() + "; see the ranks' output above for the cause", first_failed, exit_status());
  }
};

namespace detail {

/// write(2) all of `data`, retrying on EINTR and short writes; errors are dropped (the reader went away).
inline void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t k = ::write(fd, data.data(), data.size());
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return;
    data.remove_prefix(static_cast<std::size_t>(k));
  }
}

/// One pipe from a rank: where its bytes go and the unfinished line.
struct stream {
  int rank = 0;
  int fd = -1;         ///< read end, -1 once closed
  int target = -1;     ///< forward: the launcher's fd (1 or 2); capture: -1
  std::string pending; ///< forward: bytes after the last newline
  int global = 0;      ///< the rank's RANK, in its lines' prefix
};

/// Hands `n` bytes read from `s` on: whole lines prefixed to the target, or appended to the capture.
inline void deliver(stream& s, const char* data, std::size_t n, std::vector<rank_status>& ranks) {
  if (s.target < 0) {
    ranks[static_cast<std::size_t>(s.rank)].output.append(data, n);
    return;
  }
  s.pending.append(data, n);
  const std::string prefix = "[rank " + std::to_string(s.global) + "] ";
  std::string out;
  std::size_t start = 0;
  for (std::size_t nl = s.pending.find('\n'); nl != std::string::npos; nl = s.pending.find('\n', start)) {
    out += prefix;
    out.append(s.pending, start, nl + 1 - start);
    start = nl + 1;
  }
  s.pending.erase(0, start);
  write_all(s.target, out);
}

/// The rank closed the stream: a last line without a newline still goes out, with one.
inline void finish(stream& s) {
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
  if (s.target >= 0 && !s.pending.empty()) {
    write_all(s.target, "[rank " + std::to_string(s.global) + "] " + s.pending + "\n");
    s.pending.clear();
  }
}

/// Reads what is available on every open stream, waiting at most `wait_ms` for the first byte or
/// for `wake_fd` (when >= 0) to become readable; the caller reads `wake_fd` itself.
inline void pump(std::vector<stream>& streams, int wait_ms, std::vector<rank_status>& ranks, int wake_fd = -1) {
  std::vector<pollfd> fds;
  std::vector<std::size_t> which;
  if (wake_fd >= 0) fds.push_back({wake_fd, POLLIN, 0});
  const std::size_t first_stream = fds.size();
  for (std::size_t i = 0; i < streams.size(); ++i)
    if (streams[i].fd >= 0) {
      fds.push_back({streams[i].fd, POLLIN, 0});
      which.push_back(i);
    }
  if (::poll(fds.data(), fds.size(), wait_ms) <= 0) return;  // timeout, or EINTR: the caller looks again
  char buf[16384];
  for (std::size_t k = first_stream; k < fds.size(); ++k) {
    if (fds[k].revents == 0) continue;
    stream& s = streams[which[k - first_stream]];
    const ssize_t got = ::read(s.fd, buf, sizeof buf);
    if (got > 0)
      deliver(s, buf, static_cast<std::size_t>(got), ranks);
    else if (got == 0 || errno != EINTR)
      finish(s);
  }
}

/// The child's side after fork: environment, output pipes, body, exit status.
[[noreturn]] inline void run_child(int rank, int n, const spawn_options& o, const std::string& port,
                                   const std::string& token, int out_fd, int err_fd, const exit_order& exits,
                                   int sentinel, const std::vector<stream>& parent_ends,
                                   const std::function<void(int)>& body) {
  for (const auto& s : parent_ends)
    if (s.fd >= 0) ::close(s.fd);
  exits.place_sentinel(sentinel);
  // The parent's handlers (a test framework's, ddp-launch's) must not run in the rank: the launcher
  // stops ranks with SIGTERM and reports crashes by their signal. Every signal is blocked from the fork until here.
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  if (out_fd != STDOUT_FILENO && out_fd != STDERR_FILENO) ::close(out_fd);
  if (err_fd != out_fd && err_fd != STDOUT_FILENO && err_fd != STDERR_FILENO) ::close(err_fd);
  if (static_cast<std::size_t>(rank) < o.cpus.size() && !bind_to(o.cpus[static_cast<std::size_t>(rank)]))
    std::cerr << "rank " << o.first_rank + rank << " could not be bound to its CPUs (" << std::strerror(errno)
              << "); it runs unbound\n";
  const auto set = [](const char* name, int value) { ::setenv(name, std::to_string(value).c_str(), 1); };
  set("RANK", o.first_rank + rank);
  set("WORLD_SIZE", o.world_size > 0 ? o.world_size : n);
  set("LOCAL_RANK", rank);
  set("LOCAL_WORLD_SIZE", n);
  set("GROUP_RANK", o.node_rank);
  set("GROUP_WORLD_SIZE", o.nodes);
  set("DDP_RESTART_COUNT", o.restart_count);
  set("TORCHELASTIC_RESTART_COUNT", o.restart_count);
  ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", port.c_str(), 1);
  ::setenv("DDP_TOKEN", token.c_str(), 1);
  int code = 0;
  try {
    if (o.extra_env)
      for (const auto& [name, value] : o.extra_env(rank)) ::setenv(name.c_str(), value.c_str(), 1);
    body(rank);
  } catch (const std::exception& e) {
    std::cerr << "rank " << o.first_rank + rank << " failed with an exception: " << e.what() << '\n';
    code = 1;
  } catch (...) {
    std::cerr << "rank " << o.first_rank + rank
              << " failed with an exception that is not a std::exception (a test framework's failed assertion, "
                 "reported above, or a thrown non-std type)\n";
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);  // no atexit handlers: they belong to the parent's copy of the program
}

/// Records how `pid` ended in `r` from a waitpid status.
inline void record(rank_status& r, int status) {
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
}

}  // namespace detail

/// Forks `n` ranks that each run body(local rank) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, DDP_TOKEN and DDP_RESTART_COUNT set (as torchrun
/// does; RANK is options.first_rank + local rank); a rank exits 0 when body returns and 1 when it throws
/// (what() goes to its stderr). Ranks start with no blocked signals and the default action for
/// termination and crash signals (the caller's handlers do not run in them). Waits for all of them
/// and returns how each ended; when one fails the others get SIGTERM (SIGKILL after options.grace),
/// and so do all after options.timeout. The rank blamed is the failed one whose exit began first in
/// the kernel's order (see detail::exit_order; SIGCHLD is blocked in the calling thread while spawn
/// runs), never a peer that failed because it had died.
/// Throws ddp::config_error for bad arguments and ddp::launch::launch_error when fork or pipe fails.
inline spawn_result spawn(int n, const std::function<void(int rank)>& body, const spawn_options& options = {}) {
  using clock = std::chrono::steady_clock;
  if (n < 1) throw ddp::config_error("spawn needs at least one rank, got n = " + std::to_string(n));
  if (!body) throw ddp::config_error("spawn got an empty body; pass a callable taking the rank");
  if (options.first_rank < 0 || (options.world_size > 0 && options.first_rank + n > options.world_size))
    throw ddp::config_error("ranks " + std::to_string(options.first_rank) + ".." +
                            std::to_string(options.first_rank + n - 1) + " do not fit in a world of " +
                            std::to_string(options.world_size) + "; check the node rank and the ranks per node");
  spawn_result result;
  result.first_rank = options.first_rank;
  result.port = options.port != 0 ? options.port : detail::free_port();
  if (!options.token.empty()) {
    result.token = options.token;
  } else if (const char* inherited = std::getenv("DDP_TOKEN"); inherited != nullptr && *inherited != '\0') {
    result.token = inherited;
  } else {
    result.token = detail::random_token();
  }
  const std::string port = std::to_string(result.port);
  result.ranks.resize(static_cast<std::size_t>(n));
  std::vector<pid_t> pids(static_cast<std::size_t>(n), -1);
  std::vector<detail::stream> streams;
  const bool forward = options.output == output_mode::forward;
  detail::exit_order exits(n);  // before the first fork, so that no exit goes unseen

  // Stops every rank still running: SIGTERM now, SIGKILL once the grace period is over.
  std::optional<clock::time_point> kill_at;
  const auto stop_all = [&] {
    if (kill_at) return;
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0) {
        ::kill(pids[r], SIGTERM);
        result.ranks[r].stopped_by_launcher = exits.began(static_cast<int>(r)) == 0;  // not already ending
      }
    kill_at = clock::now() + options.grace;
  };

  // A pipe or fork failed while starting rank r: kill the ranks already started, reap them, throw.
  const auto abandon = [&](const std::string& what, std::initializer_list<int> fds) {
    const int code = errno;
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
    for (pid_t p : pids)
      if (p > 0) ::kill(p, SIGKILL);
    for (auto& s : streams) detail::finish(s);
    for (pid_t p : pids)
      if (p > 0) ::waitpid(p, nullptr, 0);
    errno = code;
    detail::throw_errno(what);
  };

  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);  // the children must not inherit (and repeat) buffered output
  for (int r = 0; r < n; ++r) {
    result.ranks[static_cast<std::size_t>(r)].rank = r;
    int out[2] = {-1, -1};
    int err[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0 || (forward && ::pipe2(err, O_CLOEXEC) != 0))
      abandon("create a pipe for rank " + std::to_string(r), {out[0], out[1]});
    if (!forward) err[1] = out[1];
    const int sentinel = exits.open_sentinel(r);
    if (sentinel < 0)
      abandon("create a pipe for rank " + std::to_string(r), {out[0], out[1], err[0], forward ? err[1] : -1});
    // Every signal stays blocked until the child has put the default handlers back (run_child): a SIGTERM that
    // stops a rank right after the fork must not run the parent's handler in it.
    sigset_t all, before;
    sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &before);
    const pid_t pid = ::fork();
    if (pid != 0) ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    if (pid < 0)
      abandon("fork rank " + std::to_string(r), {out[0], out[1], err[0], forward ? err[1] : -1, sentinel});
    if (pid == 0) {
      if (err[0] >= 0) ::close(err[0]);
      ::close(out[0]);
      detail::run_child(r, n, options, port, result.token, out[1], err[1], exits, sentinel, streams, body);
    }
    pids[static_cast<std::size_t>(r)] = pid;
    ::close(sentinel);
    ::close(out[1]);
    streams.push_back({r, out[0], forward ? STDOUT_FILENO : -1, {}, options.first_rank + r});
    if (forward) {
      ::close(err[1]);
      streams.push_back({r, err[0], STDERR_FILENO, {}, options.first_rank + r});
    }
  }

  const auto deadline = options.timeout.count() > 0 ? clock::now() + options.timeout : clock::time_point::max();
  int running = n;
  // Reaps rank r if it has exited.
  const auto reap = [&](std::size_t r) {
    int status = 0;
    const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
    if (got == 0 || (got < 0 && errno != ECHILD)) return;
    pids[r] = -1;
    --running;
    exits.update();  // its sentinel hung up before it could be reaped: number it, and any earlier, first
    exits.reaped(static_cast<int>(r));
    if (got < 0)
      result.ranks[r].unknown_status = true;  // ECHILD: SIGCHLD is ignored, the kernel reaped it
    else
      detail::record(result.ranks[r], status);
    result.ranks[r].ended = std::chrono::system_clock::now();
  };
  // The job's failure is the reaped failed rank whose exit began first, named once every rank whose
  // exit began before it has been reaped too (it may have failed as well), or a second after.
  std::optional<clock::time_point> blame_by;
  std::optional<clock::time_point> stop_at;  // when the ranks still running after a failure are stopped
  const auto blame = [&](clock::time_point now) {
    if (result.first_failed >= 0 || result.timed_out || result.interrupted_by != 0 || result.stopped_by_watch) return;
    int first = -1;
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<std::size_t>(r)] < 0 && !result.ranks[static_cast<std::size_t>(r)].ok() &&
          (first < 0 || exits.began(r) < exits.began(first)))
        first = r;
    if (first < 0) return;
    if (!blame_by) blame_by = now + std::chrono::seconds(1);
    for (int r = 0; r < n; ++r)
      if (pids[static_cast<std::size_t>(r)] > 0 && exits.began(r) != 0 && exits.began(r) < exits.began(first) &&
          now < *blame_by)
        return;
    result.first_failed = first;
  };
  constexpr int tick_ms = 20;  // how often deadlines, interrupts and exits without a SIGCHLD are looked at
  while (running > 0) {
    detail::pump(streams, tick_ms, result.ranks, exits.fd());
    if (options.interrupt != nullptr && *options.interrupt != 0 && result.interrupted_by == 0) {
      result.interrupted_by = static_cast<int>(*options.interrupt);  // before reaping: ^C also hit the ranks
      stop_all();
    }
    exits.update();  // first: every rank reaped below has its exit numbered
    for (std::size_t r = 0; r < pids.size(); ++r)
      if (pids[r] > 0) reap(r);
    blame(clock::now());
    if (options.watch && !result.stopped_by_watch && options.watch(result)) {
      result.stopped_by_watch = result.first_failed < 0;  // a failure here already names its own rank
      stop_all();
    }
    const auto now = clock::now();
    if (result.first_failed >= 0 && options.stop_on_failure) {
      if (!stop_at) stop_at = now + options.settle;
      if (now >= *stop_at) stop_all();
    }
    if (now >= deadline && running > 0 && !result.timed_out && !kill_at) {
      result.timed_out = true;
      stop_all();
    }
    if (kill_at && now >= *kill_at)
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
  }
  // Everyone has exited: take what is left in the pipes (a grandchild holding a pipe open gets 200 ms).
  const auto drain_until = clock::now() + std::chrono::milliseconds(200);
  while (std::any_of(streams.begin(), streams.end(), [](const detail::stream& s) { return s.fd >= 0; }) &&
         clock::now() < drain_until)
    detail::pump(streams, tick_ms, result.ranks);
  for (auto& s : streams) detail::finish(s);
  return result;
}

/// Spawns `n` copies of the program argv[0] (looked up in PATH) with arguments argv[1..], each with
/// the ranks' environment; a program that cannot be started exits 127 with the reason on its stderr.
inline spawn_result spawn_program(int n, const std::vector<std::string>& argv, const spawn_options& options = {}) {
  if (argv.empty() || argv.front().empty())
    throw ddp::config_error("spawn_program needs a program to run; pass its name and arguments");
  return spawn(
      n,
      [&argv](int) {
        std::vector<char*> args;
        args.reserve(argv.size() + 1);
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        ::execvp(args[0], args.data());
        const int code = errno;
        const std::string msg = "cannot run '" + argv.front() + "': " + std::strerror(code) +
                                "; check the program's name, PATH and permissions\n";
        detail::write_all(STDERR_FILENO, msg);
        ::_exit(127);
      },
      options);
}

}  // namespace ddp::launch
// ---- end <ddp/launch/spawn.hpp>
// ---- end <ddp/launch.hpp>

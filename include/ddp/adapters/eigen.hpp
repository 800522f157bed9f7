#pragma once
/// \file The Eigen adapter: ddp::tensor_traits for dense Eigen matrices and arrays (owning: ddp copies them at
/// the step's edges) and for Eigen::Map of them (adopting: ddp re-points the map at its arenas, zero copies),
/// so a model of Eigen members trains with `f("fc1.weight", ddp::trainable(W, dW))`.
///
/// Needs Eigen 3.4 (link Eigen3::Eigen); not part of <ddp/ddp.hpp> or the single header.
///
/// Layout rule: a leaf's shape (in checkpoints, and what ranks compare) is its memory order read row-major.
///   - a compile-time vector (Eigen::VectorXf, Eigen::RowVectorXf): [size]
///   - a RowMajor rows×cols matrix: [rows, cols]
///   - a ColMajor rows×cols matrix (Eigen's default): [cols, rows], its transpose
/// So a linear layer's weight loads into torch.nn.Linear ([out, in]) as it is when it is stored RowMajor
/// out×in (y = x·Wᵀ + b), or ColMajor in×out (y = x·W + b); a ColMajor out×in weight is written as [in, out]
/// and needs a `.T` on the PyTorch side.
///
/// Element types: float (f32), double (f64), Eigen::bfloat16 (bf16), Eigen::half (f16); ddp's optimizers step
/// f32 and f64 only, so keep f32 master weights for a bf16 or f16 model. Only contiguous types are leaves: a
/// Block, a Map with a stride, an aligned Map or a Map of const elements stops the build with a sentence naming
/// the fix. Do not resize a matrix while ddp wraps it.

#include <cstddef>
#include <new>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include <ddp/core/detail/dependent_false.hpp>
#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/tensor_traits.hpp>

namespace ddp {

namespace detail {

template <class S>
struct eigen_scalar {
  static_assert(dependent_false<S>,
                "ddp::tensor_traits<Eigen::...>: ddp trains Eigen matrices of float, double, Eigen::bfloat16 or "
                "Eigen::half; cast the model's matrices to one of them (m.cast<float>()).");
};
template <> struct eigen_scalar<float> { static constexpr ddp::dtype value = dtype::f32; };
template <> struct eigen_scalar<double> { static constexpr ddp::dtype value = dtype::f64; };
template <> struct eigen_scalar<Eigen::bfloat16> { static constexpr ddp::dtype value = dtype::bf16; };
template <> struct eigen_scalar<Eigen::half> { static constexpr ddp::dtype value = dtype::f16; };
static_assert(sizeof(Eigen::bfloat16) == sizeof(bfloat16) && sizeof(Eigen::half) == sizeof(float16),
              "ddp: Eigen's 16-bit floats must have ddp's sizes; use Eigen 3.4.");

/// What a dense contiguous Eigen object `T` (matrix, array or map of one) tells ddp.
template <class T>
struct eigen_dense_traits {
  using scalar = typename T::Scalar;
  static scalar* data(T& t) noexcept { return t.data(); }
  static const scalar* data(const T& t) noexcept { return t.data(); }
  static std::size_t size(const T& t) noexcept { return static_cast<std::size_t>(t.size()); }
  static constexpr ddp::dtype dtype(const T&) noexcept { return eigen_scalar<scalar>::value; }
  static constexpr ddp::device device(const T&) noexcept { return device::cpu(); }
  /// The memory order read row-major: [size] for vectors, [rows, cols] RowMajor, [cols, rows] ColMajor.
  static std::vector<std::size_t> shape(const T& t) {
    const auto rows = static_cast<std::size_t>(t.rows()), cols = static_cast<std::size_t>(t.cols());
    if constexpr (T::IsVectorAtCompileTime)
      return {rows * cols};
    else if constexpr (T::IsRowMajor)
      return {rows, cols};
    else
      return {cols, rows};
  }
};

}  // namespace detail

/// A dense Eigen matrix owns its memory: ddp copies its gradient in at report and its values out after each step.
template <class S, int R, int C, int O, int MR, int MC>
struct tensor_traits<Eigen::Matrix<S, R, C, O, MR, MC>> : detail::eigen_dense_traits<Eigen::Matrix<S, R, C, O, MR, MC>> {};

/// A dense Eigen array, as a matrix.
template <class S, int R, int C, int O, int MR, int MC>
struct tensor_traits<Eigen::Array<S, R, C, O, MR, MC>> : detail::eigen_dense_traits<Eigen::Array<S, R, C, O, MR, MC>> {};

/// An Eigen::Map of a dense matrix or array adopts ddp's memory: ddp re-points it (placement new, Eigen's way to
/// change a map's pointer) at its arenas, and back at the original memory, with the trained values, afterwards.
template <class Plain, int MapOptions, class Stride>
struct tensor_traits<Eigen::Map<Plain, MapOptions, Stride>> : detail::eigen_dense_traits<Eigen::Map<Plain, MapOptions, Stride>> {
  static_assert(!std::is_const_v<Plain>,
                "ddp::tensor_traits<Eigen::Map<const ...>>: ddp writes a trained map's values; map mutable memory "
                "(Eigen::Map<Eigen::MatrixXf>, not Eigen::Map<const Eigen::MatrixXf>).");
  static_assert(Stride::InnerStrideAtCompileTime == 0 && Stride::OuterStrideAtCompileTime == 0,
                "ddp::tensor_traits<Eigen::Map<..., Stride>>: a strided map is not contiguous, and ddp lays each leaf "
                "as one contiguous range; map the whole storage without a stride (Eigen::Map<Eigen::MatrixXf>(p, "
                "rows, cols)) or copy the strided data into a matrix of its own.");
  static_assert(MapOptions == Eigen::Unaligned,
                "ddp::tensor_traits<Eigen::Map<..., Eigen::Aligned...>>: ddp lays leaves back to back in its arenas "
                "and cannot promise their alignment; declare the map Eigen::Unaligned (the default).");
  using map = Eigen::Map<Plain, MapOptions, Stride>;
  /// Points the map at `p` (same rows and columns), copying nothing.
  static void adopt(map& t, void* p) noexcept {
    const auto rows = t.rows(), cols = t.cols();
    ::new (static_cast<void*>(&t)) map(static_cast<typename Plain::Scalar*>(p), rows, cols);
  }
};

/// An Eigen::Block is not a leaf: it stops the build with the fix.
template <class Xpr, int R, int C, bool InnerPanel>
struct tensor_traits<Eigen::Block<Xpr, R, C, InnerPanel>> {
  static_assert(detail::dependent_false<Xpr>,
                "ddp::tensor_traits<Eigen::Block<...>>: a block of a matrix is not a tensor ddp can lay out (it may "
                "be strided and it does not own its memory); train the whole matrix, or keep the part in a matrix or "
                "an Eigen::Map of contiguous memory of its own.");
};

}  // namespace ddp

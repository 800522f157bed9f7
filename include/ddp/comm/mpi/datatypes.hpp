#pragma once
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

#include <ddp/comm/reduce_op.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>

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

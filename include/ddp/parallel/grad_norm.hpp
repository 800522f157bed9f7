#pragma once
/// \file The norm of the averaged gradients and clipping by it (PyTorch's clip_grad_norm_), under every policy: each
/// rank takes the partial norm of the gradients its optimizer steps (the whole arenas under replicate, the owned
/// blocks under the sharded policies: padding excluded; under mixed precision the f32 master gradients), in f64
/// and in segment order; where those are pieces of the model (the norm group: the shard group, under hybrid the
/// ranks of one group) the partials travel in one all_gather of one f64 per rank and are combined in rank order,
/// so the norm has the same bits on every rank, in every run and over every backend.

#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <ddp/comm/object.hpp>
#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host_copy.hpp>
#include <ddp/optim/flat.hpp>

namespace ddp {

/// norm_type of the maximum norm (PyTorch's `float('inf')`).
inline constexpr double inf_norm = std::numeric_limits<double>::infinity();

/// How the gradient norm is taken and what a non-finite one does (PyTorch's clip_grad_norm_ arguments).
struct grad_norm_options {
  double norm_type = 2.0;           ///< p of the p-norm over all gradients (> 0), or ddp::inf_norm
  bool error_if_nonfinite = false;  ///< a NaN or infinite norm throws ddp::error naming the first parameter holding one
};

/// Gradient clipping inside every step (data_parallel_options::clip), so that a join scope's shadow steps clip alike.
struct grad_clip {
  double max_norm = 0;       ///< clip to this total norm; 0: no clipping
  grad_norm_options norm{};  ///< the norm's type and non-finite check
};

namespace detail {

/// Σ|g|^p (or max|g| for the inf norm) over the parameter pieces of `owned`'s gradients, in f64.
inline double partial_norm(std::span<const optim::flat_buffer> owned, double p) {
  double acc = 0;
  domain_buffer scratch;
  for (const auto& b : owned) {
    const raw_tensor g = readable_on_host(b.grads, scratch);
    visit_dtype(g.type, [&]<class T>(T) {
      const T* x = static_cast<const T*>(g.data);
      for (const auto& seg : b.segments)
        for (std::size_t i = seg.offset; i < seg.offset + seg.numel; ++i) {
          const double v = std::abs(static_cast<double>(x[i]));
          if (p == inf_norm)
            acc = (v > acc || std::isnan(v)) ? v : acc;
          else
            acc += p == 2 ? v * v : p == 1 ? v : std::pow(v, p);
        }
    });
  }
  return acc;
}

/// The first parameter piece of `owned` holding a NaN or an infinity, or "".
inline std::string first_nonfinite(std::span<const optim::flat_buffer> owned) {
  domain_buffer scratch;
  for (const auto& b : owned) {
    const raw_tensor g = readable_on_host(b.grads, scratch);
    std::string found;
    visit_dtype(g.type, [&]<class T>(T) {
      const T* x = static_cast<const T*>(g.data);
      for (const auto& seg : b.segments)
        for (std::size_t i = seg.offset; i < seg.offset + seg.numel && found.empty(); ++i)
          if (!std::isfinite(static_cast<double>(x[i]))) found = seg.name;
    });
    if (!found.empty()) return found;
  }
  return {};
}

/// The total norm of the gradients whose pieces `owned` holds on the ranks of `group` (none: `owned` holds them all).
/// Collective over `group`. Throws ddp::config_error for a norm_type that is not positive, and with
/// error_if_nonfinite ddp::error on every rank naming the first parameter holding a non-finite gradient.
template <class Comm>
double grad_norm(std::span<const optim::flat_buffer> owned, std::optional<Comm> group,
                 const grad_norm_options& o, int rank) {
  if (!(o.norm_type > 0))
    throw config_error("grad_norm: norm_type is " + std::to_string(o.norm_type) + "; give p > 0 (2 for the L2 norm) "
                       "or ddp::inf_norm for the largest magnitude", rank);
  const double p = o.norm_type;
  double combined = partial_norm(owned, p);
  if (group) {
    std::vector<double> partials(static_cast<std::size_t>(group->size()));
    group->all_gather(std::span<const double>(&combined, 1), std::span<double>(partials)).wait();
    combined = 0;
    for (const double x : partials)  // rank order: the same bits everywhere
      combined = p == inf_norm ? ((x > combined || std::isnan(x)) ? x : combined) : combined + x;
  }
  const double total = p == inf_norm ? combined : p == 2 ? std::sqrt(combined) : p == 1 ? combined : std::pow(combined, 1 / p);
  if (o.error_if_nonfinite && !std::isfinite(total)) {
    std::string where = first_nonfinite(owned);
    if (group) {
      const auto all = all_gather_object(*group, where);
      where.clear();
      for (const auto& w : all)
        if (where.empty()) where = w;
    }
    throw error("clip_grad_norm: the total norm of order " + std::to_string(p) + " of the gradients is non-finite (" +
                std::to_string(total) + ")" + (where.empty() ? std::string() : ", first at parameter '" + where + "'") +
                "; lower the learning rate, check the loss for NaN or infinity, or set error_if_nonfinite = false "
                "(the clip then scales by a NaN coefficient, as PyTorch's does)", rank);
  }
  return total;
}

/// Scales the gradients of `owned` by max_norm / (total + 1e-6) when that is below 1 (PyTorch's coefficient).
inline void clip_to(std::span<const optim::flat_buffer> owned, double max_norm, double total) {
  const double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1 || std::isnan(coefficient))
    for (const auto& b : owned) b.memory().scale(b.grads, coefficient);
}

}  // namespace detail
}  // namespace ddp

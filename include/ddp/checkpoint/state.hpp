#pragma once
/// \file The training state of a data_parallel model as checkpoints see it, whatever the sharding policy: the
/// tensors (parameters under their visited names, then the model state — frozen parameters and buffers — under
/// theirs, held whole by every rank; optimizer state as "optim.<parameter>.<state>"), the pieces of
/// them this rank holds in memory, and which rank holds which element ranges. Shared by ddp::save / ddp::load
/// (one file) and ddp::save_sharded / ddp::load_sharded (a part per rank plus a manifest).

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ddp/checkpoint/safetensors.hpp>
#include <ddp/comm/object.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/parameter.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host_copy.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/parallel/policies.hpp>

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

/// A piece of device memory and its copy in host memory, which a checkpoint reads and fills.
struct device_mirror {
  raw_tensor device;   ///< the memory on its device
  domain_buffer host;  ///< its copy on the host
};

/// The training state of one data_parallel (and optimizer), the same tensors and places on every rank.
struct training_state {
  std::vector<safetensors::tensor_header> tensors;  ///< parameters in visit order, model state, optimizer state
  std::size_t parameters = 0;                       ///< the first `parameters` tensors are the trained parameters
  std::vector<state_piece> mine;                    ///< this rank's pieces
  std::vector<std::vector<held_range>> holders;     ///< per tensor: every rank's pieces, by rank
  std::vector<std::vector<held_range>> cover;       ///< per tensor: ascending ranges, each from the lowest rank holding it
  std::vector<device_mirror> mirrors;               ///< pieces on a device: `mine` points at their host copies

  /// Where host code reads and writes `t`: `t` itself in host memory, else a host copy (readable_on_host),
  /// written back by to_devices().
  std::byte* host_side(const raw_tensor& t) {
    if (!t.where.is_cuda() || t.size == 0) return static_cast<std::byte*>(t.data);
    auto& m = mirrors.emplace_back(device_mirror{t, {}});
    return static_cast<std::byte*>(readable_on_host(t, m.host).data);
  }
  /// After loading: the host copies of device pieces go back to their devices (waited for).
  void to_devices() const {
    for (const auto& m : mirrors) {
      memory_domain& d = require_domain_of(m.device.where, "checkpoint");
      d.copy(m.host.view(m.device.type, 0, m.device.size), m.device);
      d.synchronize();
    }
  }

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
  for (const auto& s : dp.model_state()) {  // every rank holds the whole tensor; the lowest rank's is written
    index[s.name] = st.tensors.size();
    st.tensors.push_back({s.name, s.view.tensor.type, s.view.shape});
    described.push_back({s.name, s.view.tensor.type, 0, s.view.tensor.size});
    data.push_back(st.host_side(s.view.tensor));
  }
  for (const auto& b : dp.owned_buffers()) {
    std::byte* values = st.host_side(b.values);
    for (const auto& seg : b.segments) {
      described.push_back({seg.name, b.values.type, seg.start, seg.numel});
      data.push_back(values + seg.offset * size_of(b.values.type));
    }
  }
  if constexpr (!std::is_void_v<Opt>) {
    dp.attach(*opt);
    opt->for_each_state([&](const std::string& name, raw_tensor view, const optim::flat_segment& seg) {
      described.push_back({"optim." + name, view.type, seg.start, view.size});
      data.push_back(st.host_side(view));
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

/// Records in `meta` what a checkpoint keeps of `opt` beside its state: the step count ("optim.step") and, for an
/// optimizer with parameter groups or a schedule (ddp::optim's), its recorded_settings ("optim.groups", "optim.schedule").
template <class Opt>
void record_optimizer(checkpoint_metadata& meta, const Opt& opt) {
  meta["optim.step"] = std::to_string(opt.step_count());
  if constexpr (requires { opt.recorded_settings(); })
    for (const auto& [key, value] : opt.recorded_settings()) meta[key] = value;
}

/// "" when `opt` (none when Opt is void) has the parameter groups and schedule that the checkpoint at `source`
/// records in `meta`, else what differs and how to fix it.
template <class Opt>
std::string compare_settings(const std::string& source, const checkpoint_metadata& meta, const Opt* opt) {
  if constexpr (requires { opt->setting_differences(meta); }) {
    const std::string differences = opt->setting_differences(meta);
    if (!differences.empty())
      return "checkpoint '" + source + "' was saved by an optimizer with other settings: " + differences +
             "; load it into an optimizer with the parameter groups and schedule that saved it, or load only the "
             "parameters (ddp::load(path, dp)) and start the new optimizer afresh";
  }
  return {};
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

/// Under loss scaling, the scale and its growth tracker into `meta` ("ddp.loss_scale", exact, and
/// "ddp.loss_scale_growth"), so a resumed run goes on with them.
template <class DP>
void note_loss_scale(const DP& dp, checkpoint_metadata& meta) {
  if (!dp.scales_loss()) return;
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, dp.loss_scale()).ptr;  // shortest exact form
  meta["ddp.loss_scale"] = std::string(text, end);
  meta["ddp.loss_scale_growth"] = std::to_string(dp.loss_scale_growth_tracker());
}

/// Under loss scaling, takes the scale and growth tracker `meta` holds (a checkpoint saved without scaling leaves
/// the initial scale); a malformed value is an io_error naming `source`.
template <class DP>
void restore_loss_scale(const std::filesystem::path& source, const checkpoint_metadata& meta, DP& dp) {
  const auto scale = meta.find("ddp.loss_scale"), growth = meta.find("ddp.loss_scale_growth");
  if (!dp.scales_loss() || scale == meta.end() || growth == meta.end()) return;
  double s = 0;
  std::uint64_t g = 0;
  const auto [p1, e1] = std::from_chars(scale->second.data(), scale->second.data() + scale->second.size(), s);
  const auto [p2, e2] = std::from_chars(growth->second.data(), growth->second.data() + growth->second.size(), g);
  if (e1 != std::errc{} || e2 != std::errc{} || p1 != scale->second.data() + scale->second.size() ||
      p2 != growth->second.data() + growth->second.size() || !(s > 0))
    throw io_error("checkpoint '" + source.string() + "' has loss scale '" + scale->second + "' and growth '" +
                   growth->second + "', which are not a positive scale and a count; save it again (or resume from an "
                   "older one)", dp.rank());
  dp.restore_loss_scale(s, g);
}

/// After the owned pieces of the parameters changed, makes the full parameters every rank sees agree with
/// them: unit by unit, inside an unshard scope (full_shard), the lowest rank holding each piece broadcasts it
/// into the parameter's place in the arenas (mixed precision: the f32 master pieces, narrowed there). Under
/// replicate the pieces are the parameters (or their masters). Owning leaves then take the new values. Collective.
template <class DP>
void refresh_parameters(DP& dp, const training_state& st) {
  if constexpr (!std::is_same_v<typename DP::sharding, replicate>) {
    const auto slots = dp.layout().slots();
    std::vector<std::vector<std::size_t>> members;  // per unit: its tensors (parameters)
    for (std::size_t t = 0; t < slots.size(); ++t) {
      if (members.size() <= slots[t].unit) members.resize(slots[t].unit + 1);
      members[slots[t].unit].push_back(t);
    }
    std::vector<std::byte> staged;  // a parameter of a device arena, assembled on the host
    for (std::size_t u = 0; u < members.size(); ++u) {
      typename DP::unshard_guard scope(dp, {u});
      for (const std::size_t tensor : members[u]) {
        const auto& p = slots[tensor];
        const auto& arena = dp.layout().arenas()[p.arena];
        if (arena.values.size() == 0) continue;  // full_shard on a device: no full-size arena (the owned blocks are loaded)
        const raw_tensor place = arena.value_view(p.offset, p.numel);
        const bool on_device = place.where.is_cuda();
        if (on_device) staged.resize(place.bytes());
        std::byte* full = on_device ? staged.data() : static_cast<std::byte*>(place.data);
        const dtype type = st.tensors[tensor].type, home = p.type;  // they differ under mixed precision
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
        if (on_device) {
          arena.domain->copy(raw_tensor{full, p.numel, home, device::cpu()}, place);
          arena.domain->synchronize();  // `staged` is the next parameter's
        }
      }
    }
  }
  dp.values_changed();
}

}  // namespace detail
}  // namespace ddp

#pragma once
/// \file The flat arenas of data_parallel: every parameter of a model laid into one contiguous buffer of values
/// and one of gradients per dtype and device, in visit order, in that device's memory domain (memory/); each leaf
/// is bound to its slice. A model split over devices (DDP with model parallelism) gets an arena per device.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <ddp/core/device.hpp>
#include <ddp/core/dtype.hpp>
#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/tensor_traits.hpp>
#include <ddp/core/visit.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/parallel/leaf_binding.hpp>
#include <ddp/parallel/options.hpp>

namespace ddp::detail {

/// One parameter of the wrapped model and where it lies.
struct param_slot {
  std::string name;                ///< dotted name
  std::vector<std::size_t> shape;  ///< shape
  dtype type = dtype::f32;         ///< element type
  std::size_t numel = 0;           ///< elements
  device where = device::cpu();    ///< the device its values live on
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

/// One dtype's flat values and gradients on one device, in that device's memory domain.
struct arena {
  dtype type = dtype::f32;          ///< element type
  device where = device::cpu();     ///< the device its memory is on
  dtype reduce_type = type;         ///< the dtype its gradients are reduced in (wider under ddp::mixed_precision)
  std::size_t numel = 0;            ///< elements
  memory_domain* domain = nullptr;  ///< where its memory lives and its element work runs
  domain_buffer values;             ///< parameter values, in visit order
  domain_buffer grads;              ///< gradients, same layout
  std::vector<std::size_t> params;  ///< slots laid here, in visit order

  /// Gives up the contents of `b` (its values or its gradients): where the domain can, its pages go back and the
  /// range stays usable (zeros); elsewhere (a device's memory) the buffer is freed.
  void give_up(domain_buffer& b) const {
    if (domain->releases_pages())
      b.release(0, b.size());
    else
      b = domain_buffer{};
  }
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
      param_slot s;
      s.name = std::string(name);
      s.shape = traits::shape(p);
      s.type = traits::dtype(p);
      s.numel = 1;
      for (const auto d : s.shape) s.numel *= d;
      if constexpr (requires { traits::device(p); }) s.where = traits::device(p);
      s.key = leaf_key(p);
      s.leaf = std::make_shared<leaf_binding_of<T>>(const_cast<T&>(p), s.name);
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
    check_not_empty();
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      auto& s = slots_[i];
      auto it = std::find_if(arenas_.begin(), arenas_.end(),
                             [&](const arena& a) { return a.type == s.type && a.where == s.where; });
      if (it == arenas_.end()) {
        auto& a = arenas_.emplace_back();
        a.type = a.reduce_type = s.type;
        a.where = s.where;
        a.domain = &require_domain_of(s.where, "data_parallel (parameter '" + s.name + "')");
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
  /// Owning leaves: the arenas' gradients into the leaves' own, and after `update` (a framework's optimizer over the
  /// leaves) the leaves' values into the arenas.
  template <class F>
  void update_leaves(F&& update) const {
    if (!adopting_)
      for (const auto& s : slots_) s.leaf->gradient_out();
    update();
    if (!adopting_)
      for (const auto& s : slots_) s.leaf->values_in();
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
  /// Every arena (one per dtype and device, in order of first appearance).
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
  /// Throws ddp::config_error when the model holds no element to train: nothing would be averaged, and ranks would
  /// train apart while every check passed.
  void check_not_empty() const {
    for (const auto& s : slots_)
      if (s.numel > 0) return;
    throw config_error("data_parallel: the model has no element to train (" + std::to_string(slots_.size()) +
                       " parameter(s), all empty): a framework that allocates its parameters lazily (dlib allocates "
                       "at the first forward) must run one forward before the wrapper is built; otherwise check that "
                       "visit_parameters reaches the model's parameters");
  }
  std::vector<param_slot> slots_;
  std::vector<arena> arenas_;
  std::vector<std::string> units_;
  std::unordered_map<const void*, std::size_t> index_;
  bool adopting_ = true;
};

/// Every parameter's name, in visit order: what each flat buffer for the optimizer carries (parameter groups).
inline std::shared_ptr<const std::vector<std::string>> parameter_names(const parameter_layout& layout) {
  auto names = std::make_shared<std::vector<std::string>>();
  for (const auto& s : layout.slots()) names->push_back(s.name);
  return names;
}

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

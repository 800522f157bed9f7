#pragma once
/// \file Sharding units named by the user: data_parallel_options::units holds dotted name prefixes ("head") and
/// parts of the model (ddp::unit_of(model.encoder)) in any mix. A part is kept as the addresses of its
/// parameters; when data_parallel builds its layout it resolves the part, by those addresses, to the dotted
/// prefix its parameters share in the wrapped model, which then names the unit.

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/core/storage_traits.hpp>
#include <ddp/core/visit.hpp>

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

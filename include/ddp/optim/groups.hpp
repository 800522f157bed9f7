#pragma once
/// \file Parameter groups of ddp's optimizers: which parameters a group takes (glob patterns over dotted names, or a
/// predicate), and the plan that lays the groups over flat buffers segment by segment, so a group follows a
/// parameter's name wherever its pieces lie (a shard holds the pieces of the parameters its rank owns).

#include <fnmatch.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <iostream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ddp/core/error.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/optim/flat.hpp>
#include <ddp/optim/schedule.hpp>

namespace ddp::optim {

/// True when the glob `pattern` matches all of `name` (POSIX fnmatch without flags: `*` matches any run of
/// characters, dots too, `?` one, `[...]` a set).
inline bool glob_match(std::string_view pattern, std::string_view name) {
  return ::fnmatch(std::string(pattern).c_str(), std::string(name).c_str(), 0) == 0;
}

/// Which parameters a group takes: those whose dotted name matches one of the glob patterns ("*.bias",
/// "*norm*", "fc1.*"), or for which the predicate is true.
class name_match {
 public:
  /// Matches nothing (a group needs patterns or a predicate).
  name_match() = default;
  /// The glob patterns (glob_match).
  name_match(std::initializer_list<std::string> patterns) : patterns_(patterns) {}  // NOLINT(google-explicit-constructor)
  /// The glob patterns (glob_match).
  name_match(std::vector<std::string> patterns) : patterns_(std::move(patterns)) {}  // NOLINT(google-explicit-constructor)
  /// A predicate on the dotted name; `what` stands for it in messages and checkpoints.
  template <class F>
    requires std::is_invocable_r_v<bool, const F&, std::string_view>
  name_match(F predicate, std::string what = "predicate")  // NOLINT(google-explicit-constructor)
      : predicate_(std::move(predicate)), what_(std::move(what)) {}

  /// True when it takes the parameter `name`.
  [[nodiscard]] bool operator()(std::string_view name) const {
    for (const auto& p : patterns_)
      if (glob_match(p, name)) return true;
    return predicate_ && predicate_(name);
  }
  /// False when it can take nothing.
  [[nodiscard]] bool empty() const noexcept { return patterns_.empty() && !predicate_; }
  /// The patterns ("*.bias|*norm*") or the predicate's text.
  [[nodiscard]] std::string describe() const {
    std::string s;
    for (const auto& p : patterns_) s += (s.empty() ? "" : "|") + p;
    return predicate_ ? s + (s.empty() ? "" : "|") + what_ : s;
  }

 private:
  std::vector<std::string> patterns_;
  std::function<bool(std::string_view)> predicate_;
  std::string what_;
};

namespace detail {

/// A run of a flat buffer's elements that one group's settings step: group 0 is the default (the options
/// themselves), group g the optimizer's groups[g − 1].
struct group_run {
  std::size_t offset = 0;  ///< first element in the buffer
  std::size_t numel = 0;   ///< elements
  std::size_t group = 0;   ///< 0: default, else 1 + the index of the group
};

/// Group `g` (counted from 1) of `groups` for messages: "group 2 ('no_decay')".
template <class Group>
std::string group_label(const std::vector<Group>& groups, std::size_t g) {
  return "group " + std::to_string(g) + (groups[g - 1].name.empty() ? "" : " ('" + groups[g - 1].name + "')");
}

/// Per buffer, the runs of elements each group steps, covering the whole buffer (padding between or after the
/// segments goes with the run before it, or the first one). Every group must take at least one parameter of the
/// model (`buffers[i].parameters`, else the segments' names) and no parameter may be taken by two groups: else a
/// ddp::config_error naming them. Parameters no group takes are the default group's.
template <class Group>
std::vector<std::vector<group_run>> plan_groups(std::span<const flat_buffer> buffers, const std::vector<Group>& groups,
                                                std::string_view who) {
  const auto fail = [&](const std::string& what) { throw config_error(std::string(who) + ": " + what); };
  std::set<std::string> names;
  for (const auto& b : buffers) {
    if (b.parameters)
      names.insert(b.parameters->begin(), b.parameters->end());
    else
      for (const auto& s : b.segments) names.insert(s.name);
  }
  std::set<std::string> seen_names;
  for (std::size_t g = 1; g <= groups.size(); ++g) {
    const auto& group = groups[g - 1];
    if (group.match.empty()) fail(group_label(groups, g) + " has no patterns and no predicate; give .match");
    if (!group.name.empty() && !seen_names.insert(group.name).second)
      fail("two groups are named '" + group.name + "'; give each group its own name");
    bool any = false;
    for (const auto& n : names) any = any || group.match(n);
    if (!any)
      fail(group_label(groups, g) + " ('" + group.match.describe() + "') matches no parameter of the model; "
           "check the pattern against the dotted names visit_parameters gives (such as 'fc1.bias')");
  }
  const auto group_of = [&](const std::string& name) {
    std::size_t found = 0;
    for (std::size_t g = 1; g <= groups.size(); ++g)
      if (groups[g - 1].match(name)) {
        if (found)
          fail("parameter '" + name + "' is in " + group_label(groups, found) + " and " + group_label(groups, g) +
               "; narrow the patterns so that each parameter is in one group (the others take the default settings)");
        found = g;
      }
    return found;
  };
  for (const auto& n : names) group_of(n);  // the same error on every rank, whichever pieces it holds

  std::vector<std::vector<group_run>> plan;
  for (const auto& b : buffers) {
    auto& runs = plan.emplace_back();
    std::vector<const flat_segment*> in_order;
    for (const auto& s : b.segments) in_order.push_back(&s);
    std::sort(in_order.begin(), in_order.end(),
              [](const flat_segment* x, const flat_segment* y) { return x->offset < y->offset; });
    for (const flat_segment* seg : in_order) {
      const flat_segment& s = *seg;
      const std::size_t g = group_of(s.name);
      if (runs.empty() || runs.back().group != g)
        runs.push_back({runs.empty() ? 0 : s.offset, 0, g});
      runs.back().numel = s.offset + s.numel - runs.back().offset;
    }
    if (runs.empty()) runs.push_back({0, 0, 0});
    for (std::size_t r = 0; r + 1 < runs.size(); ++r) runs[r].numel = runs[r + 1].offset - runs[r].offset;
    runs.back().numel = b.values.size - runs.back().offset;
  }
  return plan;
}

/// Optimizer state with parameter groups and a schedule, for the optimizer Opt deriving from it (CRTP, a friend): Opt
/// has `static constexpr const char* who`, `settings() const` (its options, with `.lr`, `.lr_schedule` and `.groups`,
/// each group with `.name`, `.match` and `.lr_scale`), `static std::string describe(const group&)` (the knobs a
/// group sets), `static options with(const options&, const group&)` (the options as a group sets them) and
/// `static void check(const options&, const std::string& where)` (throws config_error for settings PyTorch rejects).
template <class Opt>
class grouped_state : public flat_state {
 public:
  using flat_state::flat_state;

  /// Allocates state and lays the groups over `buffers` on first use (a group matching nothing, or a parameter
  /// in two groups, is a ddp::config_error); afterwards checks that the layout is the same.
  void attach(std::span<const flat_buffer> buffers) {
    flat_state::attach(buffers);
    if (plan_.size() != buffers.size()) plan_ = plan_groups(buffers, self().settings().groups, Opt::who);
  }

  /// What checkpoints record and compare on load: "optim.groups" (each group's name, match and knobs) and
  /// "optim.schedule" (the schedule's kind and settings), each only when not the default (no groups; constant).
  [[nodiscard]] std::map<std::string, std::string> recorded_settings() const {
    std::map<std::string, std::string> out;
    const auto& o = self().settings();
    std::string groups;
    for (std::size_t g = 1; g <= o.groups.size(); ++g)
      groups += (g > 1 ? "; " : "") + group_label(o.groups, g) + ": " + o.groups[g - 1].match.describe() +
                ", lr_scale=" + exact(o.groups[g - 1].lr_scale) + Opt::describe(o.groups[g - 1]);
    if (!groups.empty()) out["optim.groups"] = groups;
    if (!std::holds_alternative<schedules::constant>(o.lr_schedule.get())) out["optim.schedule"] = o.lr_schedule.describe();
    return out;
  }

  /// "" when `saved` (a checkpoint's metadata) records the groups and schedule this optimizer has, else each
  /// difference ("optim.schedule is 'cosine(...)' in the checkpoint but 'constant' here").
  [[nodiscard]] std::string setting_differences(const std::map<std::string, std::string>& saved) const {
    const auto mine = recorded_settings();
    std::string out;
    for (const auto& [key, none] : {std::pair<std::string, std::string>{"optim.groups", "no groups"},
                                    std::pair<std::string, std::string>{"optim.schedule", "constant"}}) {
      const auto a = saved.find(key);
      const auto b = mine.find(key);
      const std::string then = a == saved.end() ? none : a->second, now = b == mine.end() ? none : b->second;
      if (then != now) out += (out.empty() ? "" : "; ") + key + " is '" + then + "' in the checkpoint but '" + now + "' here";
    }
    return out;
  }

 protected:
  /// Throws ddp::config_error for options, or a group's settings, that PyTorch also rejects.
  void check_settings() const {
    const auto& o = self().settings();
    Opt::check(o, "");
    for (std::size_t g = 1; g <= o.groups.size(); ++g) {
      if (o.groups[g - 1].lr_scale < 0)
        throw config_error(std::string(Opt::who) + ": " + group_label(o.groups, g) + " needs lr_scale >= 0");
      Opt::check(Opt::with(o, o.groups[g - 1]), " in " + group_label(o.groups, g));
    }
  }

  /// The settings of group `g` (0: the default) at this step, its lr the schedule's value from the options' lr
  /// times the group's lr_scale.
  [[nodiscard]] auto group_settings(std::size_t g) const {
    const auto& o = self().settings();
    auto mine = g == 0 ? Opt::with(o, {}) : Opt::with(o, o.groups[g - 1]);
    mine.lr = o.lr_schedule.lr(g == 0 ? o.lr : o.lr * o.groups[g - 1].lr_scale, steps_);
    return mine;
  }

  /// One step: `update(g, domain, values, grads, arrays)` for every run of elements of group g, then the step
  /// count. Warns once (std::clog) when the step is past the schedule's last one: the lr stays at its last value.
  template <class Update>
  void step_runs(std::span<const flat_buffer> buffers, Update&& update) {
    const auto& sched = self().settings().lr_schedule;
    if (const auto end = sched.last_step(); end && steps_ > *end && !warned_) {
      warned_ = true;
      std::clog << Opt::who << ": step " << steps_ + 1 << " is past the lr schedule " << sched.describe()
                << ", which ends after step " << *end << "; the lr stays at its last value from here on\n";
    }
    attach(buffers);
    for_each_buffer(buffers, Opt::who,
                    [&](std::size_t i, const flat_buffer& b, memory_domain& on, std::span<const raw_tensor> arrays) {
                      for (const group_run& r : plan_[i]) {
                        std::vector<raw_tensor> parts;
                        for (const auto& a : arrays) parts.push_back(part(a, r.offset, r.numel));
                        update(r.group, on, part(b.values, r.offset, r.numel), part(b.grads, r.offset, r.numel),
                               std::span<const raw_tensor>(parts));
                      }
                    });
    ++steps_;
  }

 private:
  [[nodiscard]] const Opt& self() const noexcept { return static_cast<const Opt&>(*this); }

  std::vector<std::vector<group_run>> plan_;  // per buffer
  bool warned_ = false;
};

}  // namespace detail
}  // namespace ddp::optim

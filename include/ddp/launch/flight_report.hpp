#pragma once
/// \file Reading the ranks' flight records after a failed job: where the ranks' collectives diverged (the first
/// sequence at which two ranks called different operations) or stalled (the first sequence some rank did not
/// complete, and which ranks never reached it), and which ranks left no record (killed, or hung outside ddp).

#include <algorithm>
#include <exception>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace ddp::launch {

/// One rank's record of one group, as read from its flight record file.
struct flight_record {
  int rank = 0;                                  ///< the rank in the group
  int size = 0;                                  ///< the group's size
  std::string group;                             ///< the group's label
  std::string reason;                            ///< why the rank wrote it
  std::map<std::uint64_t, std::string> calls;    ///< sequence → the call
  std::map<std::uint64_t, std::string> states;   ///< sequence → started, completed or failed
};

namespace detail {

/// Parses one file written by ddp::detail::flight_recorder::dump; nothing when it is not one.
inline std::optional<flight_record> read_flight_record(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  const std::string head = "# ddp flight recorder: rank ";
  if (line.rfind(head, 0) != 0) return std::nullopt;
  flight_record r;  // "# ddp flight recorder: rank R of N, group LABEL, reason: ..."
  const auto of = line.find(" of ", head.size()), group = line.find(", group ", head.size()),
             reason = line.find(", reason: ", head.size());
  if (of == std::string::npos || group == std::string::npos || reason == std::string::npos) return std::nullopt;
  try {
    r.rank = std::stoi(line.substr(head.size(), of - head.size()));
    r.size = std::stoi(line.substr(of + 4, group - of - 4));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  r.group = line.substr(group + 8, reason - group - 8);
  r.reason = line.substr(reason + 10);
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string seq, state, started, settled, call;
    if (!std::getline(fields, seq, '\t') || !std::getline(fields, state, '\t') || !std::getline(fields, started, '\t') ||
        !std::getline(fields, settled, '\t') || !std::getline(fields, call))
      continue;
    std::uint64_t s = 0;
    try {
      s = std::stoull(seq);
    } catch (const std::exception&) {
      continue;
    }
    r.calls[s] = call;
    r.states[s] = state;
  }
  return r;
}

}  // namespace detail

/// Every flight record file in `dir` (files named flight.rank<R>.group<label>.txt) written at or after `since`.
inline std::vector<flight_record> read_flight_records(const std::filesystem::path& dir,
                                                      std::filesystem::file_time_type since = std::filesystem::file_time_type::min()) {
  std::vector<flight_record> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("flight.rank", 0) != 0 || entry.path().extension() != ".txt") continue;
    if (std::error_code t; entry.last_write_time(t) < since || t) continue;
    if (auto r = detail::read_flight_record(entry.path())) out.push_back(std::move(*r));
  }
  std::sort(out.begin(), out.end(), [](const flight_record& a, const flight_record& b) {
    return a.group != b.group ? a.group < b.group : a.rank < b.rank;
  });
  return out;
}

/// One sentence per group: where its ranks diverged or stalled; empty when there are no records.
inline std::string analyze_flight_records(const std::vector<flight_record>& records) {
  std::map<std::string, std::vector<const flight_record*>> groups;
  for (const auto& r : records) groups[r.group].push_back(&r);
  std::string out;
  for (const auto& [label, ranks] : groups) {
    std::string s = "group " + label + " (" + std::to_string(ranks.front()->size) + " ranks): ";
    std::set<std::uint64_t> sequences;
    for (const auto* r : ranks)
      for (const auto& [seq, call] : r->calls) sequences.insert(seq);
    std::optional<std::uint64_t> diverged;
    for (const auto seq : sequences) {
      std::set<std::string> seen;
      for (const auto* r : ranks)
        if (const auto it = r->calls.find(seq); it != r->calls.end()) seen.insert(it->second);
      if (seen.size() > 1) {
        diverged = seq;
        break;
      }
    }
    if (diverged) {
      s += "the ranks diverged at sequence " + std::to_string(*diverged) + ":";
      for (const auto* r : ranks)
        if (const auto it = r->calls.find(*diverged); it != r->calls.end())
          s += " rank " + std::to_string(r->rank) + " called " + it->second + ";";
      s.back() = '.';
    } else {
      std::optional<std::uint64_t> stalled;
      for (const auto seq : sequences) {
        for (const auto* r : ranks)
          if (const auto it = r->states.find(seq); it == r->states.end() || it->second != "completed") stalled = seq;
        if (stalled) break;
      }
      if (stalled) {
        std::string call;
        std::vector<std::string> waiting, failed, never;
        for (const auto* r : ranks) {
          const auto it = r->states.find(*stalled);
          const std::string who = "rank " + std::to_string(r->rank);
          if (it == r->states.end()) {
            if (!r->calls.empty() && r->calls.rbegin()->first < *stalled)
              never.push_back(who + " (its last was sequence " + std::to_string(r->calls.rbegin()->first) + ")");
            continue;
          }
          call = r->calls.at(*stalled);
          if (it->second == "started") waiting.push_back(who);
          if (it->second == "failed") failed.push_back(who);
        }
        const auto join = [](const std::vector<std::string>& v) {
          std::string j;
          for (const auto& x : v) j += (j.empty() ? "" : ", ") + x;
          return j;
        };
        s += "sequence " + std::to_string(*stalled) + " (" + call + ") is the first not complete everywhere:";
        if (!waiting.empty()) s += " " + join(waiting) + " started it and waited;";
        if (!failed.empty()) s += " " + join(failed) + " saw it fail;";
        if (!never.empty()) s += " " + join(never) + " never called it;";
        s.back() = '.';
      } else {
        s += "every recorded collective completed on the ranks that wrote a record.";
      }
    }
    std::vector<int> missing;
    for (int r = 0; r < ranks.front()->size; ++r)
      if (std::none_of(ranks.begin(), ranks.end(), [&](const flight_record* x) { return x->rank == r; }))
        missing.push_back(r);
    if (!missing.empty()) {
      s += " No record from rank";
      s += missing.size() > 1 ? "s" : "";
      for (std::size_t i = 0; i < missing.size(); ++i) s += (i ? ", " : " ") + std::to_string(missing[i]);
      s += " (killed, or stuck outside ddp's collectives).";
    }
    out += (out.empty() ? "" : "\n") + s;
  }
  return out;
}

}  // namespace ddp::launch

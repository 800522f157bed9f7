#pragma once
// What the C++ benches share for their numbers: a comma list from the command line, and the median of timings.

#include <algorithm>
#include <charconv>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <ddp/core/error.hpp>

namespace bench {

/// "1,2,4" as {1, 2, 4}; a config_error naming `flag` for anything else.
template <class T>
std::vector<T> comma_list(std::string_view text, std::string_view flag) {
  std::vector<T> out;
  while (true) {
    const std::size_t comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    T value{};
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (ec != std::errc{} || end != item.data() + item.size())
      throw ddp::config_error(std::string(flag) + " takes numbers separated by commas, not '" + std::string(item) + "'");
    out.push_back(value);
    if (comma == std::string_view::npos) return out;
    text.remove_prefix(comma + 1);
  }
}

/// The median of `v` (the mean of the two middle values when there is an even number).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace bench

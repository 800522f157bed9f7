#pragma once
// Text checks the tests share.

#include <string>

namespace ddp::testing {

/// Whether `s` holds `part`.
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace ddp::testing

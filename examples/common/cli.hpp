#pragma once
/// \file The examples' command-line loop: each example names its own flags and usage text; the loop gives a flag
/// its value (or says it needs one), prints the usage for --help and rejects an unknown argument with it.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <ddp/core/error.hpp>

namespace example {

/// Walks argv[1..]: on_flag(flag, value) handles a flag it knows and returns true, calling value() for the argument
/// after it (a config_error with `usage` when there is none); --help and -h print `usage` and exit 0; any other
/// argument throws a config_error with `usage`.
template <class F>
void parse_flags(int argc, char** argv, const char* usage, F&& on_flag) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw ddp::config_error(std::string(a) + " needs a value\n" + usage);
      return argv[++i];
    };
    if (on_flag(a, value)) continue;
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    }
    throw ddp::config_error("unknown argument '" + std::string(a) + "'\n" + usage);
  }
}

}  // namespace example

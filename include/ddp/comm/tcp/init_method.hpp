#pragma once
/// \file torch.distributed's init methods for ddp::tcp: "env://" (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
/// from the environment), "tcp://host:port" (rank 0's store there) and "file:///path" (rank 0's store found
/// through a file every rank shares); the token, timeouts and interface come from the environment as always.

#include <charconv>
#include <string>
#include <string_view>

#include <ddp/comm/tcp/config.hpp>
#include <ddp/core/error.hpp>

namespace ddp::tcp {

/// The config of init method `url` for rank `rank` of `size` (torch.distributed.init_process_group's
/// init_method, rank and world_size): "env://" takes both from the environment unless given; "tcp://host:port"
/// and "file:///absolute/path" need them; "file://" also a job token (DDP_TOKEN), unless DDP_ALLOW_NO_TOKEN=1.
/// Throws config_error naming the mistake and its fix.
inline config config_from_url(std::string_view url, int rank = -1, int size = -1) {
  const auto given = [&](std::string_view method) {
    if (rank < 0 || size < 1)
      throw config_error(std::string(method) + " needs this process's rank and the world size: pass them as "
                         "init(\"" + std::string(url) + "\", rank, world_size), as torch.distributed's "
                         "init_process_group(init_method=..., rank=..., world_size=...)",
                         rank);
    if (rank >= size)
      throw config_error("rank " + std::to_string(rank) + " is not below the world size " + std::to_string(size) +
                             "; ranks run from 0 to world_size-1",
                         rank);
    config cfg = options_from_env();
    cfg.rank = rank;
    cfg.size = size;
    return cfg;
  };
  if (url == "env://") {
    config cfg = config_from_env();
    if (rank >= 0) cfg.rank = rank;
    if (size >= 1) cfg.size = size;
    return cfg;
  }
  if (url.rfind("tcp://", 0) == 0) {
    const std::string_view where = url.substr(6);
    const auto colon = where.rfind(':');
    unsigned port = 0;
    const char* end = where.data() + where.size();
    if (colon == std::string_view::npos || colon == 0 ||
        std::from_chars(where.data() + colon + 1, end, port).ptr != end || port == 0 || port > 65535)
      throw config_error("init method '" + std::string(url) + "' is not tcp://host:port with a port in 1..65535; "
                         "name rank 0's host and a free port, e.g. tcp://10.0.0.1:29500",
                         rank);
    config cfg = given("tcp://");
    cfg.master_addr = std::string(where.substr(0, colon));
    cfg.master_port = static_cast<std::uint16_t>(port);
    return cfg;
  }
  if (url.rfind("file://", 0) == 0) {
    const std::string_view path = url.substr(7);
    if (path.empty() || path.front() != '/')
      throw config_error("init method '" + std::string(url) + "' needs an absolute path, file:///shared/dir/name "
                         "(three slashes), on a filesystem every rank shares",
                         rank);
    config cfg = given("file://");
    cfg.store_file = std::string(path);
    if (cfg.token.empty() && ddp::detail::env_string("DDP_ALLOW_NO_TOKEN").value_or("") != "1")
      throw config_error("init method '" + std::string(url) + "' without a job token: two jobs that use this path "
                         "at once would join each other's ranks; export the same DDP_TOKEN (e.g. 32 random hex "
                         "digits) on every rank (ddp-launch does), or DDP_ALLOW_NO_TOKEN=1 where one job at a time "
                         "uses the path",
                         rank);
    return cfg;
  }
  throw config_error("unknown init method '" + std::string(url) + "'; ddp::tcp takes env://, tcp://host:port or "
                     "file:///path (torch.distributed's spellings)",
                     rank);
}

}  // namespace ddp::tcp

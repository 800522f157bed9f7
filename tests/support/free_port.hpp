#pragma once
// A TCP port nobody listens on right now, for tests that must know a port before the job starts (strangers
// on the store, the NCCL bootstrap): the launcher's own probe, so the tests and ddp-launch choose alike.

#include <ddp/launch/job_identity.hpp>

namespace ddp::testing {

using ddp::launch::detail::free_port;

}  // namespace ddp::testing

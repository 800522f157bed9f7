#pragma once
/// \file Device memory where host code can read it: what checks and checkpoints hash or write out of a device
/// arena goes through a host copy made by the device's domain and waited for.

#include <cstddef>

#include <ddp/core/tensor_traits.hpp>
#include <ddp/memory/devices.hpp>
#include <ddp/memory/domain.hpp>
#include <ddp/memory/host.hpp>

namespace ddp {

/// `t` itself where it is host memory; else its elements copied to the host into `scratch` (grown as needed) by
/// its device's domain, which is waited for.
inline raw_tensor readable_on_host(const raw_tensor& t, domain_buffer& scratch) {
  if (!t.where.is_cuda() || t.size == 0) return t;
  memory_domain& d = require_domain_of(t.where, "reading device memory on the host");
  if (scratch.size() < t.bytes()) scratch = host_memory().allocate(t.bytes());
  const raw_tensor host = scratch.view(t.type, 0, t.size);
  d.copy(t, host);
  d.synchronize();
  return host;
}

}  // namespace ddp

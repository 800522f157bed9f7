#pragma once
/// \file dependent_false: a false that depends on a template argument, for static_asserts in templates.

namespace ddp::detail {
template <class>
inline constexpr bool dependent_false = false;
}  // namespace ddp::detail

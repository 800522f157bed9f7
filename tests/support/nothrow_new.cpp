// The nothrow operator new of every test executable, as the standard defines its default: it calls
// the (possibly replaced) plain operator new. Sanitizers provide their own nothrow new instead, so in
// an executable that replaces only the plain pair (tests/tcp counts buffer allocations that way),
// Catch2's `new (std::nothrow)` test invokers came from the sanitizer's allocator and went back
// through the replaced delete: AddressSanitizer aborted with an alloc-dealloc mismatch at exit, the
// test discovery run included, and ctest found no tests. Weak, so that a test's own definition wins.

#include <new>

[[gnu::weak]] void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(bytes);
  } catch (...) {
    return nullptr;
  }
}

[[gnu::weak]] void operator delete(void* p, const std::nothrow_t&) noexcept { ::operator delete(p); }

#pragma once
/// \file Scratch memory the algorithms keep between calls: it only grows, uninitialized, so steady state
/// allocates and touches no new memory.

#include <cstddef>
#include <memory>

namespace ddp::tcp::detail {

/// One scratch buffer; growing discards its contents.
class scratch_buffer {
 public:
  /// The buffer, at least `bytes` long.
  char* get(std::size_t bytes) {
    if (size_ < bytes) {
      data_.reset();  // free first, so the peak is the new size, not both
      data_.reset(new char[bytes]);
      size_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<char[]> data_;
  std::size_t size_ = 0;
};

}  // namespace ddp::tcp::detail

// Expected to fail: a strided Eigen::Map is not contiguous; the adapter's sentence names the fix.
#include <ddp/adapters/eigen.hpp>
#include <ddp/core/trainable.hpp>

int main() {
  float values[12] = {}, grads[12] = {};
  using strided = Eigen::Map<Eigen::MatrixXf, Eigen::Unaligned, Eigen::OuterStride<>>;
  strided w(values, 2, 3, Eigen::OuterStride<>(4)), dw(grads, 2, 3, Eigen::OuterStride<>(4));
  ddp::trainable leaf(w, dw);
}

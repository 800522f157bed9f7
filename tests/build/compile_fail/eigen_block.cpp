// Expected to fail: a block of an Eigen matrix is not a leaf; the adapter's sentence names the fix.
#include <ddp/adapters/eigen.hpp>
#include <ddp/core/trainable.hpp>

int main() {
  Eigen::MatrixXf w(4, 4), dw(4, 4);
  auto part = w.topRows(2);
  auto grad = dw.topRows(2);
  ddp::trainable leaf(part, grad);
}

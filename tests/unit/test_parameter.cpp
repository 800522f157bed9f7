#include <catch2/catch.hpp>

#include <vector>

#include <ddp/core/parameter.hpp>

TEST_CASE("parameter owns zeroed storage of its shape", "[parameter]") {
  ddp::parameter<float> p({2, 3});
  CHECK(p.numel() == 6);
  CHECK(p.shape() == std::vector<std::size_t>{2, 3});
  CHECK_FALSE(p.bound());
  for (float v : p.value()) CHECK(v == 0.0F);
  CHECK_THROWS_AS(ddp::parameter<float>({2}, {1.0F}), ddp::config_error);
}

TEST_CASE("bind moves storage into an arena and copies keep their own", "[parameter]") {
  ddp::parameter<float> p({3}, {1.0F, 2.0F, 3.0F});
  std::vector<float> values(5, -1.0F);
  std::vector<float> grads(5, -1.0F);
  p.bind(values.data() + 1, grads.data() + 1);
  CHECK(p.bound());
  CHECK(values == std::vector<float>{-1, 1, 2, 3, -1});
  p.grad()[2] = 7.0F;
  CHECK(grads[3] == 7.0F);

  ddp::parameter<float> copy = p;
  CHECK_FALSE(copy.bound());
  copy.value()[0] = 42.0F;
  CHECK(values[1] == 1.0F);

  ddp::parameter<float> moved = std::move(p);
  CHECK(moved.value().data() == values.data() + 1);
  moved.unbind();
  CHECK_FALSE(moved.bound());
  values[1] = 99.0F;
  CHECK(moved.value()[0] == 1.0F);
  CHECK(moved.grad()[2] == 7.0F);
}

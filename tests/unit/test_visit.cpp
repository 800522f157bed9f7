#include <catch2/catch.hpp>

#include <array>
#include <string>
#include <vector>

#include <ddp/core/trainable.hpp>
#include <ddp/core/visit.hpp>

namespace {

struct linear {
  ddp::parameter<float> weight{{3, 2}};
  ddp::parameter<float> bias{{3}};
};
struct block {
  linear attn;
  int heads = 4;  // not a parameter: skipped
  linear mlp;
};
struct with_member {
  ddp::parameter<double> scale{{1}};
  linear proj;
  template <class F>
  void visit_parameters(F&& f) {
    f("gain", scale);
    f("proj", proj);
  }
};
}  // namespace

namespace user {
struct adl_layer {
  ddp::parameter<float> kernel{{2, 2}};
};
template <class F>
void visit_parameters(adl_layer& layer, F&& f) {
  f("w", layer.kernel);
}
}  // namespace user

namespace {
struct model {
  linear fc1;
  std::array<block, 2> blocks;
  std::vector<linear> heads;
  with_member custom;
  user::adl_layer conv;
  float learning_rate = 0.1F;
};

std::vector<std::string> names_of(auto& m) {
  std::vector<std::string> names;
  ddp::visit_parameters(m, [&](std::string_view name, auto&) { names.emplace_back(name); });
  return names;
}
}  // namespace

TEST_CASE("visit_parameters names nested aggregates, arrays, vectors, member and ADL visitors", "[visit]") {
  model m;
  m.heads.resize(2);
  const std::vector<std::string> expected{
      "fc1.weight",          "fc1.bias",           "blocks.0.attn.weight", "blocks.0.attn.bias",
      "blocks.0.mlp.weight", "blocks.0.mlp.bias",  "blocks.1.attn.weight", "blocks.1.attn.bias",
      "blocks.1.mlp.weight", "blocks.1.mlp.bias",  "heads.0.weight",       "heads.0.bias",
      "heads.1.weight",      "heads.1.bias",       "custom.gain",          "custom.proj.weight",
      "custom.proj.bias",    "conv.w"};
  CHECK(names_of(m) == expected);
  CHECK(names_of(m) == names_of(m));  // stable
  const model& view = m;
  CHECK(names_of(view) == expected);
}

TEST_CASE("visit_parameters hands out the model's own parameters", "[visit]") {
  model m;
  std::size_t elements = 0;
  ddp::visit_parameters(m, [&](std::string_view name, auto& p) {
    elements += p.numel();
    if (name == "fc1.bias") p.value()[0] = 5.0F;
  });
  CHECK(m.fc1.bias.value()[0] == 5.0F);
  CHECK(elements == 9 * (1 + 4) + 1 + 9 + 4);
}

TEST_CASE("a type with a member visitor is visited directly", "[visit]") {
  with_member w;
  CHECK(names_of(w) == std::vector<std::string>{"gain", "proj.weight", "proj.bias"});
  user::adl_layer a;
  CHECK(names_of(a) == std::vector<std::string>{"w"});
}

TEST_CASE("parameter_visitable tells models from other types", "[visit]") {
  STATIC_REQUIRE(ddp::parameter_visitable<model>);
  STATIC_REQUIRE(ddp::parameter_visitable<std::vector<linear>>);
  STATIC_REQUIRE_FALSE(ddp::parameter_visitable<int>);
  STATIC_REQUIRE_FALSE(ddp::parameter_visitable<std::array<float, 3>>);
}

namespace {
/// Leaves of other types: values and gradients in vectors and spans, handed out as ddp::trainable.
struct foreign_layer {
  std::vector<float> w = std::vector<float>(6), dw = std::vector<float>(6);
  std::vector<float> memory = std::vector<float>(4);
  std::span<float> b{memory.data(), 2}, db{memory.data() + 2, 2};
  template <class F>
  void visit_parameters(F&& f) {
    f("weight", ddp::trainable(w, dw, {3, 2}));
    f("bias", ddp::trainable(b, db));
  }
};
}  // namespace

TEST_CASE("ddp::trainable leaves: shapes, dtypes, the key gradient_ready uses, and size checks", "[visit]") {
  foreign_layer layer;
  std::vector<std::string> names;
  std::vector<std::vector<std::size_t>> shapes;
  std::vector<const void*> keys;
  ddp::visit_parameters(layer, [&](std::string_view name, const auto& leaf) {
    using traits = ddp::storage_traits<std::remove_cvref_t<decltype(leaf)>>;
    names.emplace_back(name);
    shapes.push_back(traits::shape(leaf));
    CHECK(traits::dtype(leaf) == ddp::dtype::f32);
    keys.push_back(ddp::leaf_key(leaf));
  });
  CHECK(names == std::vector<std::string>{"weight", "bias"});
  CHECK(shapes == std::vector<std::vector<std::size_t>>{{3, 2}, {2}});
  CHECK(keys == std::vector<const void*>{&layer.w, &layer.b});
  STATIC_REQUIRE(ddp::adopting_leaf<ddp::trainable<std::span<float>>>);
  STATIC_REQUIRE_FALSE(ddp::adopting_leaf<ddp::trainable<std::vector<float>>>);
  std::vector<float> five(5);
  CHECK_THROWS_AS(ddp::trainable(layer.w, five), ddp::config_error);
  CHECK_THROWS_WITH(ddp::trainable(layer.w, layer.dw, {4, 2}), Catch::Contains("disagree"));
}

#include <catch2/catch.hpp>

#include <array>
#include <cstdlib>
#include <optional>
#include <string>

#include <ddp/comm/env.hpp>

namespace {
/// Sets environment variables for one scope and restores them after.
class scoped_env {
 public:
  scoped_env() {
    for (const char* name : names) {
      const char* v = std::getenv(name);
      saved_[index(name)] = v ? std::optional<std::string>(v) : std::nullopt;
      ::unsetenv(name);
    }
  }
  ~scoped_env() {
    for (const char* name : names) {
      if (const auto& v = saved_[index(name)]) ::setenv(name, v->c_str(), 1);
      else ::unsetenv(name);
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
  void set(const char* name, const char* value) { ::setenv(name, value, 1); }

 private:
  static constexpr std::array<const char*, 10> names{
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
  static std::size_t index(const char* name) {
    for (std::size_t i = 0; i < names.size(); ++i)
      if (std::string_view(names[i]) == name) return i;
    return 0;
  }
  std::array<std::optional<std::string>, names.size()> saved_;
};
}  // namespace

TEST_CASE("env config reads torchrun's variables", "[env]") {
  scoped_env env;
  env.set("RANK", "2");
  env.set("WORLD_SIZE", "4");
  env.set("MASTER_PORT", "1234");
  const auto c = ddp::read_env_config();
  CHECK(c.rank == 2);
  CHECK(c.world_size == 4);
  CHECK(c.local_world_size == 4);
  CHECK(c.master_port == 1234);
  CHECK(c.master_addr == "127.0.0.1");
}

TEST_CASE("env config falls back to Open MPI's variables", "[env]") {
  scoped_env env;
  env.set("OMPI_COMM_WORLD_RANK", "1");
  env.set("OMPI_COMM_WORLD_SIZE", "3");
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "3");
  const auto c = ddp::read_env_config();
  CHECK(c.rank == 1);
  CHECK(c.world_size == 3);
  CHECK(c.local_rank == 1);
}

TEST_CASE("wrong env vars are config errors that name the variable and the fix", "[env]") {
  scoped_env env;
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("RANK is not set") && Catch::Contains("ddp-launch"));
  env.set("WORLD_SIZE", "2");
  env.set("RANK", "two");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("RANK='two'"));
  env.set("RANK", "2");
  CHECK_THROWS_AS(ddp::read_env_config(), ddp::config_error);
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("not below WORLD_SIZE=2"));
  env.set("RANK", "0");
  env.set("MASTER_PORT", "70000");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("MASTER_PORT='70000'"));
}

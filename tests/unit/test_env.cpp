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
  static constexpr std::array<const char*, 18> names{
      "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_TASKS_PER_NODE",
      "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_JOB_NODELIST"};
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

TEST_CASE("env config reads srun's variables: the step's first node is rank 0's host, the job id its port", "[env]") {
  scoped_env env;
  env.set("SLURM_PROCID", "5");
  env.set("SLURM_NTASKS", "7");
  env.set("SLURM_LOCALID", "1");
  env.set("SLURM_NODEID", "2");
  env.set("SLURM_STEP_TASKS_PER_NODE", "2(x2),3");
  env.set("SLURM_STEP_NODELIST", "gpu[07-09],login1");
  env.set("SLURM_JOB_NODELIST", "gpu[01-09],login1");
  env.set("SLURM_JOB_ID", "4242421");
  const auto c = ddp::read_env_config();
  CHECK(c.rank == 5);
  CHECK(c.world_size == 7);
  CHECK(c.local_rank == 1);
  CHECK(c.local_world_size == 3);
  CHECK(c.master_addr == "gpu07");
  CHECK(c.master_port == 20000 + 4242421 % 20000);
  env.set("MASTER_ADDR", "head");
  env.set("MASTER_PORT", "1234");
  const auto given = ddp::read_env_config();
  CHECK(given.master_addr == "head");
  CHECK(given.master_port == 1234);
}

TEST_CASE("Slurm's variables yield to torchrun's and Open MPI's, and describe no process without SLURM_PROCID", "[env]") {
  scoped_env env;
  env.set("SLURM_NTASKS", "8");  // a salloc or sbatch shell: the allocation, not this process
  env.set("SLURM_STEP_NODELIST", "gpu[1-2]");
  env.set("SLURM_JOB_ID", "17");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("RANK is not set") && Catch::Contains("srun"));
  env.set("RANK", "1");
  env.set("WORLD_SIZE", "2");
  env.set("SLURM_PROCID", "3");  // ddp-launch or torchrun inside an srun task: theirs count
  const auto c = ddp::read_env_config();
  CHECK(c.rank == 1);
  CHECK(c.world_size == 2);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port == 29500);
}

TEST_CASE("a partial or wrong set of srun's variables is a config_error naming the variable", "[env]") {
  scoped_env env;
  env.set("SLURM_PROCID", "1");
  CHECK_THROWS_AS(ddp::read_env_config(), ddp::config_error);
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("SLURM_NTASKS is not"));
  env.set("SLURM_NTASKS", "4");
  env.set("SLURM_STEP_TASKS_PER_NODE", "2(x2)");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("SLURM_NODEID is not"));
  env.set("SLURM_NODEID", "2");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("SLURM_STEP_TASKS_PER_NODE='2(x2)' has no entry for "
                                                            "SLURM_NODEID=2"));
  env.set("SLURM_NODEID", "0");
  env.set("SLURM_STEP_TASKS_PER_NODE", "2[x2]");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("SLURM_STEP_TASKS_PER_NODE='2[x2]'"));
  env.set("SLURM_STEP_TASKS_PER_NODE", "2(x2)");
  env.set("SLURM_PROCID", "four");
  CHECK_THROWS_WITH(ddp::read_env_config(), Catch::Contains("SLURM_PROCID"));
  env.set("SLURM_PROCID", "1");
  CHECK(ddp::read_env_config().local_world_size == 2);
}

TEST_CASE("Slurm host lists and tasks-per-node lists", "[env]") {
  using ddp::detail::first_slurm_host;
  using ddp::detail::slurm_tasks_on;
  CHECK(first_slurm_host("node1") == "node1");
  CHECK(first_slurm_host("node[01-04,07],gpu1") == "node01");
  CHECK(first_slurm_host("node[7,1-3]") == "node7");
  CHECK(first_slurm_host("rack[1-2]-n[001-004]") == "rack1-n001");
  CHECK(first_slurm_host("login1,node[1-2]") == "login1");
  CHECK(slurm_tasks_on("4", 0) == 4);
  CHECK(slurm_tasks_on("4(x2),3", 1) == 4);
  CHECK(slurm_tasks_on("4(x2),3", 2) == 3);
  CHECK_FALSE(slurm_tasks_on("4(x2),3", 3).has_value());
  CHECK_FALSE(slurm_tasks_on("4(y2)", 0).has_value());
  CHECK_FALSE(slurm_tasks_on("", 0).has_value());
}

// The flight recorder: a group's ring of collectives, the reading of the ranks' records, and ddp-launch
// naming where a failed job's ranks diverged or stalled.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ddp/comm/flight_recorder.hpp>
#include <ddp/launch/flight_report.hpp>
#include <ddp/launch/spawn.hpp>

namespace dl = ddp::launch;
using namespace std::chrono_literals;

namespace {

ddp::detail::call_info all_reduce_of(std::size_t n) {
  ddp::detail::call_info c;
  c.kind = ddp::collective::all_reduce;
  c.name = "all_reduce";
  c.op = ddp::reduce_op::sum;
  c.type = ddp::dtype::f32;
  c.count = n;
  return c;
}

/// A fresh directory under the system's temporary directory, removed at the end of the scope.
struct temporary_dir {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("ddp-flight-test." + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  temporary_dir() { std::filesystem::create_directories(path); }
  ~temporary_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

dl::rank_status launch_flight_rank(const std::string& mode, int n, dl::env_list env = {}) {
  dl::spawn_options o;
  o.output = dl::output_mode::capture;
  o.timeout = 40s;
  env.emplace_back("DDP_TIMEOUT_MS", "1500");
  o.extra_env = [env](int) { return env; };
  return dl::spawn_program(1, {DDP_LAUNCH_EXE, "-n", std::to_string(n), DDP_FLIGHT_RANK_EXE, mode}, o).ranks[0];
}

}  // namespace

TEST_CASE("flight recorder: keeps the last K collectives, names the first incomplete one, dumps once", "[launch][flight]") {
  temporary_dir dir;
  ::setenv("DDP_FLIGHT_RECORDER_DIR", dir.path.c_str(), 1);
  ddp::detail::flight_recorder rec(4, "0000abcd");
  for (int i = 0; i < 6; ++i) rec.settle(rec.start(all_reduce_of(8)), true);
  CHECK(rec.first_incomplete().empty());
  const auto stuck = rec.start(all_reduce_of(16));
  rec.settle(stuck + 5, true);  // not a sequence it holds: ignored
  CHECK_THAT(rec.first_incomplete(), Catch::StartsWith("sequence 6 (all_reduce(sum) of 16 f32, started"));
  const auto path = rec.dump(3, 4, "a test");
  ::unsetenv("DDP_FLIGHT_RECORDER_DIR");
  REQUIRE(path == (dir.path / "flight.rank3.group0000abcd.txt").string());
  CHECK(rec.dump(3, 4, "again").empty());
  const auto records = dl::read_flight_records(dir.path);
  REQUIRE(records.size() == 1);
  CHECK(records[0].rank == 3);
  CHECK(records[0].size == 4);
  CHECK(records[0].group == "0000abcd");
  CHECK(records[0].reason == "a test");
  CHECK(records[0].calls.size() == 4);  // sequences 3..6: the ring keeps 4
  CHECK(records[0].calls.begin()->first == 3);
  CHECK(records[0].states.at(6) == "started");
}

TEST_CASE("flight records: divergence, a stall, a rank that never called, a missing rank", "[launch][flight]") {
  const auto record = [](int rank, std::map<std::uint64_t, std::string> calls, std::map<std::uint64_t, std::string> states) {
    return dl::flight_record{rank, 3, "g0", "test", std::move(calls), std::move(states)};
  };
  const std::string ar = "all_reduce(sum) of 4 f32", bc = "broadcast of 4 f32 rooted at rank 0";
  const auto diverged = dl::analyze_flight_records({record(0, {{0, ar}, {1, ar}}, {{0, "completed"}, {1, "failed"}}),
                                                    record(1, {{0, ar}, {1, bc}}, {{0, "completed"}, {1, "failed"}}),
                                                    record(2, {{0, ar}, {1, ar}}, {{0, "completed"}, {1, "failed"}})});
  CHECK(diverged == "group g0 (3 ranks): the ranks diverged at sequence 1: rank 0 called " + ar + "; rank 1 called " + bc +
                        "; rank 2 called " + ar + ".");
  const auto stalled = dl::analyze_flight_records({record(0, {{0, ar}, {1, ar}}, {{0, "completed"}, {1, "started"}}),
                                                   record(1, {{0, ar}}, {{0, "completed"}})});
  CHECK(stalled == "group g0 (3 ranks): sequence 1 (" + ar + ") is the first not complete everywhere: rank 0 started it "
                   "and waited; rank 1 (its last was sequence 0) never called it. No record from rank 2 (killed, or "
                   "stuck outside ddp's collectives).");
}

TEST_CASE("ddp-launch: a failed job's flight records name where the ranks diverged or stalled", "[launch][ddp-launch][flight]") {
  const auto diverged = launch_flight_rank("diverge", 2);
  INFO(diverged.output);
  CHECK(diverged.exit_code != 0);
  CHECK_THAT(diverged.output, Catch::Contains("ddp-launch: flight recorder: group ") &&
                                  Catch::Contains("the ranks diverged at sequence 5: rank 0 called all_reduce(sum) of "
                                                  "1024 f32; rank 1 called broadcast of 1024 f32 rooted at rank 0."));
  const auto stalled = launch_flight_rank("stall", 2);
  INFO(stalled.output);
  CHECK(stalled.exit_code != 0);
  CHECK_THAT(stalled.output,
             Catch::Contains("(flight recorder: sequence 5 (all_reduce(sum) of 1024 f32, started ") &&
                 Catch::Contains("sequence 5 (all_reduce(sum) of 1024 f32) is the first not complete everywhere: rank 0 "
                                 "started it and waited. No record from rank 1"));
  // The records a failed job wrote are kept, and their place is named.
  const auto at = stalled.output.find("ddp-launch: the ranks' flight records are in ");
  REQUIRE(at != std::string::npos);
  const auto start = at + std::string("ddp-launch: the ranks' flight records are in ").size();
  const std::filesystem::path kept = stalled.output.substr(start, stalled.output.find('\n', start) - start);
  const auto records = dl::read_flight_records(kept);
  REQUIRE(records.size() == 1);  // rank 1 was stopped by the launcher before it could write one
  CHECK(records[0].rank == 0);
  CHECK(records[0].states.at(5) == "started");
  std::filesystem::remove_all(kept);

  const auto off = launch_flight_rank("diverge", 2, {{"DDP_FLIGHT_RECORDER", "0"}});
  INFO(off.output);
  CHECK(off.exit_code != 0);
  CHECK_THAT(off.output, !Catch::Contains("flight recorder"));
}

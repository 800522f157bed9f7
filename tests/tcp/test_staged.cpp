// ddp::tcp takes device tensors (the fake device, tests/support/fake_device.hpp): staged through host memory by the
// collective front end (comm/staging.hpp), in real processes, they give what the same collectives give over host
// buffers; the copy back is ordered on the device's stream, so work queued there right after the call sees the
// result without a host wait; host tensors go straight to the backend; a device without a registered memory
// domain is named in the error.

#include <catch2/catch.hpp>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/comm/communicator.hpp>
#include <ddp/comm/tcp/communicator.hpp>
#include <ddp/memory/devices.hpp>

#include "support/fake_device.hpp"
#include "support/run_ranks.hpp"
#include "tcp/helpers.hpp"

using namespace std::chrono_literals;
using ddp::testing::require_all_ok;
using ddp::testing::run_ranks;
using ddp::testing::tcp::expect_at;
using ddp::testing::tcp::job;

namespace {

/// A device tensor of f32 on `dev` holding `values` (the copy waited for: `values` dies with the constructor).
struct on_device {
  ddp::domain_buffer memory;
  ddp::raw_tensor t;
  on_device(ddp::testing::fake_device& dev, std::vector<float> values)
      : memory(dev.allocate(values.size() * sizeof(float))), t(memory.view(ddp::dtype::f32, 0, values.size())) {
    dev.copy(ddp::raw_tensor::of(std::span<float>(values)), t);
    dev.synchronize();
  }
};

float staged_value(int rank, std::size_t i) { return static_cast<float>(rank + 1) * 0.5F + static_cast<float>(i % 11); }

}  // namespace

TEST_CASE("staging: collectives over device tensors give what host buffers give, in real processes",
          "[tcp][staged][fast]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  require_all_ok(run_ranks(
      n,
      [](int rank) {
        ddp::testing::fake_device dev(0);
        const ddp::device_registration registered(dev);
        ddp::tcp::communicator comm = ddp::tcp::communicator::from_env();
        const int size = comm.size();
        const std::size_t k = 1000;  // per rank
        std::vector<float> mine(k * static_cast<std::size_t>(size));
        for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = staged_value(rank, i);
        // all_reduce(avg) in place on the device against the same on the host
        on_device a(dev, mine);
        std::vector<float> host = mine;
        comm.all_reduce(a.t, ddp::reduce_op::avg).wait();
        comm.all_reduce(std::span<float>(host), ddp::reduce_op::avg).wait();
        const auto got = dev.read<float>(a.t);
        for (std::size_t i = 0; i < got.size(); ++i) expect_at(got[i] == host[i], "all_reduce", i);
        // the result reaches the device's stream before work queued there after the call, with no host wait
        on_device queued(dev, mine);
        ddp::work pending = comm.all_reduce(queued.t, ddp::reduce_op::avg);
        dev.scale(queued.t, 2.0);
        const auto doubled = dev.read<float>(queued.t);
        pending.wait();
        for (std::size_t i = 0; i < doubled.size(); ++i) expect_at(doubled[i] == 2.0F * host[i], "queued scale", i);
        // reduce_scatter: device in, device out
        on_device in(dev, mine), out(dev, std::vector<float>(k, -1.0F));
        std::vector<float> host_out(k);
        comm.reduce_scatter(in.t, out.t, ddp::reduce_op::sum).wait();
        comm.reduce_scatter(std::span<const float>(mine), std::span<float>(host_out), ddp::reduce_op::sum).wait();
        const auto scattered = dev.read<float>(out.t);
        for (std::size_t i = 0; i < k; ++i) expect_at(scattered[i] == host_out[i], "reduce_scatter", i);
        // all_gather: host in, device out
        on_device gathered(dev, std::vector<float>(mine.size(), 0.0F));
        comm.all_gather(std::span<const float>(mine.data(), k), gathered.t).wait();
        const auto all = dev.read<float>(gathered.t);
        for (std::size_t i = 0; i < all.size(); ++i)
          expect_at(all[i] == staged_value(static_cast<int>(i / k), i % k), "all_gather", i);
        // broadcast from the last rank, and all_to_all, both on the device
        on_device b(dev, mine), x(dev, mine), y(dev, std::vector<float>(mine.size(), 0.0F));
        comm.broadcast(b.t, size - 1).wait();
        const auto bc = dev.read<float>(b.t);
        for (std::size_t i = 0; i < bc.size(); ++i) expect_at(bc[i] == staged_value(size - 1, i), "broadcast", i);
        comm.all_to_all(x.t, y.t).wait();
        const auto swapped = dev.read<float>(y.t);
        for (std::size_t i = 0; i < swapped.size(); ++i) {
          const int from = static_cast<int>(i / k);
          expect_at(swapped[i] == staged_value(from, static_cast<std::size_t>(rank) * k + i % k), "all_to_all", i);
        }
        // send/recv around a ring, device to device; done() polls the staged work as well as wait()
        on_device s(dev, mine), r(dev, std::vector<float>(mine.size(), 0.0F));
        ddp::work sent = comm.send(s.t, (rank + 1) % size, 3);
        ddp::work received = comm.recv(r.t, (rank + size - 1) % size, 3);
        while (!received.done()) std::this_thread::sleep_for(1ms);
        sent.wait();
        const auto ring = dev.read<float>(r.t);
        for (std::size_t i = 0; i < ring.size(); ++i)
          expect_at(ring[i] == staged_value((rank + size - 1) % size, i), "recv", i);
        // host tensors go straight to the backend: one all_reduce more, nothing staged beside it
        const auto before = comm.stats().count(ddp::collective::all_reduce);
        comm.all_reduce(std::span<float>(host)).wait();
        ddp::testing::tcp::expect(comm.stats().count(ddp::collective::all_reduce) == before + 1, "one backend call");
      },
      job(60s)));
}

TEST_CASE("staging: a device tensor without a registered memory domain is a config_error naming the registration",
          "[tcp][staged][fast]") {
  require_all_ok(run_ranks(
      1,
      [](int) {
        ddp::testing::fake_device dev(1);  // not registered
        ddp::tcp::communicator comm = ddp::tcp::communicator::from_env();
        const ddp::domain_buffer b = dev.allocate(16);
        try {
          comm.all_reduce(b.view(ddp::dtype::f32, 0, 4)).wait();
        } catch (const ddp::config_error& e) {
          ddp::testing::tcp::expect(std::string(e.what()).find("cuda:1 has no memory domain") != std::string::npos &&
                                        std::string(e.what()).find("device_registration") != std::string::npos,
                                    std::string("the message names the fix: ") + e.what());
          return;
        }
        ddp::testing::tcp::expect(false, "no error for an unregistered device");
      },
      job(30s)));
}

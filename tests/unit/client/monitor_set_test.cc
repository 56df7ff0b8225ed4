#include "gradwatch/monitor_set.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "tests/unit/client/fake_daemon.h"

using gradwatch::client::MonitorOptions;
using gradwatch::client::MonitorSet;
using gradwatch::client::SplitAddresses;
using gradwatch::testing::FakeIngest;
using gradwatch::testing::FakeServer;
using namespace std::chrono_literals;
namespace v1 = gradwatch::v1;

namespace {

MonitorOptions SetOptions() {
  MonitorOptions o;
  o.hello.set_run_id("replicated");
  o.hello.set_world_size(1);
  o.initial_backoff = 20ms;
  o.max_backoff = 200ms;
  o.close_grace = 200ms;
  return o;
}

v1::StepStats Step(uint64_t n) {
  v1::StepStats s;
  s.set_step(n);
  s.set_loss(2.0);
  return s;
}

}  // namespace

TEST_CASE("addresses split on commas, empty entries dropped", "[client]") {
  CHECK(SplitAddresses("a:1,b:2") == std::vector<std::string>{"a:1", "b:2"});
  CHECK(SplitAddresses("a:1") == std::vector<std::string>{"a:1"});
  CHECK(SplitAddresses(",a:1,,b:2,") == std::vector<std::string>{"a:1", "b:2"});
  CHECK(SplitAddresses("").empty());
}

TEST_CASE("a monitor set sends every step and event to each daemon, and a dead one holds up nothing", "[client]") {
  FakeIngest first, second;
  FakeServer a({&first});
  FakeServer b({&second});
  std::vector<uint64_t> steps;
  for (uint64_t n = 1; n <= 20; ++n) steps.push_back(n);
  {
    MonitorSet set({a.address(), b.address()}, SetOptions());
    REQUIRE(set.size() == 2);
    set.Start();
    for (uint64_t n : steps) CHECK(set.Log(Step(n)));
    CHECK(set.Event(10, "routing switch"));
    CHECK(set.Flush(gradwatch::testing::Scaled(10s)));
    for (size_t i = 0; i < set.size(); ++i) {
      INFO(set.address(i));
      CHECK(set.Stats(i).acked_through_step == 20);
    }
    CHECK(set.Finish(gradwatch::testing::Scaled(10s)));
  }
  CHECK(first.Steps() == steps);
  CHECK(second.Steps() == steps);

  // The second daemon is gone: the first still gets everything; the set says not every daemon has it.
  b.Shutdown();
  FakeIngest third;
  FakeServer c({&third});
  MonitorSet set({c.address(), b.address()}, SetOptions());
  set.Start();
  for (uint64_t n : steps) CHECK(set.Log(Step(n)));
  const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(10s);
  while (set.Stats(0).acked_through_step != 20 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(set.Stats(0).acked_through_step == 20);
  CHECK_FALSE(set.Flush(500ms));
  CHECK_FALSE(set.Stats(1).has_acked);
  CHECK_FALSE(set.Finish(500ms));
  CHECK(third.Steps() == steps);
}

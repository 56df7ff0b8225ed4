// The registry's memory: max_runs counts runs held, ended runs leave after their retention (or
// earlier when room is needed), and the alerting side is told.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "server/runs/registry.h"
#include "tests/unit/runs/recording_listener.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;
using gradwatch::runs::testing::RecordingListener;
using gradwatch::runs::testing::RecordingSink;

namespace {

RunMeta Hello(const std::string& id) {
  RunMeta m;
  m.run_id = id;
  m.params = {{.name = "w", .numel = 10, .kind = ParamKind::kMlp}};
  return m;
}

struct Fixture {
  FakeClock clock;
  DaemonStats stats;
  RecordingListener hook;
  RecordingSink sink;
  std::unique_ptr<RunRegistry> registry;
  explicit Fixture(size_t max_runs) {
    RunOptions options;
    options.end_after = 10s;
    options.retention = 60s;
    options.listener = &hook;
    registry = std::make_unique<RunRegistry>(options, max_runs, &stats, &clock);
  }
  std::shared_ptr<Run> Attach(const std::string& id, IngestError* error = nullptr) {
    AttachInfo info;
    IngestError ignored;
    return registry->Attach(Hello(id), 0, &sink, &info, error ? error : &ignored);
  }
  // Finishes the run and closes its stream.
  void End(const std::string& id) {
    auto run = registry->Find(id);
    REQUIRE(run);
    run->Finish(0, EndReason::kFinished, "", 0, &sink);
    run->Detach(0, &sink);
  }
};

}  // namespace

TEST_CASE("max_runs counts runs held: a full registry drops the run that ended first", "[runs]") {
  Fixture f(2);
  REQUIRE(f.Attach("a"));
  REQUIRE(f.Attach("b"));
  IngestError error;
  CHECK_FALSE(f.Attach("c", &error));  // both active
  CHECK(error.reason == IngestErrorReason::kLimitExceeded);

  f.End("b");
  f.clock.Advance(1s);
  f.End("a");
  REQUIRE(f.Attach("c"));  // room made: b ended first
  CHECK(f.hook.left == std::vector<std::string>{"b"});
  CHECK(f.registry->Find("b") == nullptr);
  CHECK(f.registry->Find("a") != nullptr);
  CHECK(f.registry->run_count() == 2);
  CHECK(f.stats.runs_evicted.load() == 1);
}

TEST_CASE("an ended run stays for its retention, then leaves memory", "[runs]") {
  Fixture f(8);
  REQUIRE(f.Attach("done"));
  REQUIRE(f.Attach("live"));
  f.End("done");
  f.clock.Advance(59s);
  f.registry->Tick();
  CHECK(f.registry->Find("done") != nullptr);  // still queryable
  f.clock.Advance(2s);
  f.registry->Tick();
  CHECK(f.registry->Find("done") == nullptr);
  CHECK(f.hook.left == std::vector<std::string>{"done"});
  CHECK(f.registry->Find("live") != nullptr);  // an open stream: never ends, never leaves

  // Ended by inactivity: end_after, then the retention.
  f.registry->Find("live")->Detach(0, &f.sink);
  f.clock.Advance(11s);
  f.registry->Tick();
  REQUIRE(f.registry->Find("live"));
  CHECK(f.registry->Find("live")->Info().ended);
  f.clock.Advance(61s);
  f.registry->Tick();
  CHECK(f.registry->run_count() == 0);
  CHECK(f.hook.left == std::vector<std::string>{"done", "live"});
}

TEST_CASE("a run id that left memory comes back as a run again", "[runs]") {
  Fixture f(1);
  REQUIRE(f.Attach("again"));
  f.End("again");
  f.clock.Advance(61s);
  f.registry->Tick();
  REQUIRE(f.registry->run_count() == 0);
  auto back = f.Attach("again");  // no journal here: it starts afresh
  REQUIRE(back);
  CHECK_FALSE(back->Info().ended);
  CHECK(f.registry->Find("again") == back);
}

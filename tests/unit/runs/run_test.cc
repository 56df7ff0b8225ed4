#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "server/core/byte_chunks.h"
#include "server/runs/run.h"
#include "server/runs/run_restore.h"
#include "tests/unit/runs/recording_listener.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;
using gradwatch::runs::testing::RecordingListener;
using gradwatch::runs::testing::RecordingSink;

namespace {

RunMeta Meta(uint32_t world_size = 1) {
  RunMeta m;
  m.run_id = "r1";
  m.world_size = world_size;
  m.params = {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
              {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1}};
  return m;
}

RankStep Step(uint64_t step, double grad0, double grad1, uint64_t seq = 0) {
  RankStep r;
  r.step = step;
  r.seq = seq;
  r.params.push_back({.index = 0, .norms = {NormContribution::FromNorm(grad0), {}, {}}});
  r.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(grad1), {}, {}}});
  return r;
}

std::optional<double> Latest(const Run& run, const std::string& key) {
  for (const auto& l : run.Summary().latest) {
    if (l.key == key) return l.value;
  }
  return std::nullopt;
}

struct Fixture {
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  std::unique_ptr<Run> run;
  RecordingSink sink;
  explicit Fixture(uint32_t world_size = 1) {
    options.assembly_timeout = 10s;
    options.end_after = 60s;
    run = std::make_unique<Run>(Meta(world_size), options, nullptr, &stats, &clock, true);
  }
  void Attach(uint32_t rank, StreamSink* s) {
    AttachInfo info;
    REQUIRE_FALSE(run->Attach(Meta(run->Info().world_size), rank, s, &info).has_value());
  }
};

}  // namespace

TEST_CASE("a step's norms are stored and the total is derived when not sent", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  REQUIRE_FALSE(f.run->AddStep(0, Step(100, 3.0, 4.0), &f.sink));
  CHECK(Latest(*f.run, "grad/norm/final_norm.weight") == Approx(3.0));
  CHECK(Latest(*f.run, "grad/norm/lm_head.weight") == Approx(4.0));
  CHECK(Latest(*f.run, "grad/norm/total") == Approx(5.0));
  CHECK(f.run->Info().last_step == 100);
}

TEST_CASE("two ranks' squared partial sums merge into one norm", "[runs]") {
  Fixture f(2);
  RecordingSink sink1;
  f.Attach(0, &f.sink);
  f.Attach(1, &sink1);
  RankStep r0, r1;
  r0.step = r1.step = 10;
  r0.params.push_back({.index = 1, .norms = {NormContribution::FromSqSum(9.0), {}, {}}});
  r1.params.push_back({.index = 1, .norms = {NormContribution::FromSqSum(16.0), {}, {}}});
  REQUIRE_FALSE(f.run->AddStep(0, r0, &f.sink));
  CHECK_FALSE(Latest(*f.run, "grad/norm/lm_head.weight").has_value());
  REQUIRE_FALSE(f.run->AddStep(1, r1, &sink1));
  CHECK(Latest(*f.run, "grad/norm/lm_head.weight") == Approx(5.0));
  CHECK(f.run->Info().partial_steps == 0);
}

TEST_CASE("steps are validated against the catalog and the rank's history", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  REQUIRE_FALSE(f.run->AddStep(0, Step(10, 1.0, 1.0, 1), &f.sink));

  RankStep unknown = Step(11, 1.0, 1.0);
  unknown.params.push_back({.index = 9, .norms = {NormContribution::FromNorm(1.0), {}, {}}});
  auto err = f.run->AddStep(0, unknown, &f.sink);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kUnknownParam);

  RankStep twice = Step(11, 1.0, 1.0);
  twice.params.push_back(twice.params[0]);
  err = f.run->AddStep(0, twice, &f.sink);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kInvalidMessage);

  err = f.run->AddStep(0, Step(9, 1.0, 1.0), &f.sink);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kStepRegression);

  err = f.run->AddStep(0, Step(10, 1.0, 2.0), &f.sink);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kStepConflict);

  // The stream goes on: a good step after the errors is stored.
  REQUIRE_FALSE(f.run->AddStep(0, Step(11, 1.0, 1.0), &f.sink));
  CHECK(f.run->Info().last_step == 11);
  CHECK(f.run->Info().step_count == 2);
}

TEST_CASE("an identical repeat is idempotent and acked once durable", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  REQUIRE_FALSE(f.run->AddStep(0, Step(10, 1.0, 1.0, 1), &f.sink));
  f.run->OnDurable({"r1", 0, 10, 1});
  REQUIRE(f.sink.acks.size() == 1);
  CHECK(f.sink.acks[0].first == 10);
  REQUIRE_FALSE(f.run->AddStep(0, Step(10, 1.0, 1.0, 2), &f.sink));
  REQUIRE(f.sink.acks.size() == 2);
  CHECK(f.sink.acks[1] == std::pair<uint64_t, uint64_t>{10, 2});
  CHECK(f.run->Info().step_count == 1);
}

TEST_CASE("durable progress never moves backwards", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  f.run->AddStep(0, Step(10, 1.0, 1.0), &f.sink);
  f.run->AddStep(0, Step(20, 1.0, 1.0), &f.sink);
  f.run->OnDurable({"r1", 0, 20, 2});
  f.run->OnDurable({"r1", 0, 10, 1});
  REQUIRE(f.sink.acks.size() == 1);
  AttachInfo info;
  RecordingSink again;
  REQUIRE_FALSE(f.run->Attach(Meta(), 0, &again, &info));
  CHECK(info.last_durable_step == 20);
  CHECK(info.last_received_step == 20);
}

TEST_CASE("a hello cannot change the world size or rewrite the catalog, but may extend it", "[runs]") {
  Fixture f;
  AttachInfo info;
  RunMeta other = Meta(2);
  auto err = f.run->Attach(other, 0, &f.sink, &info);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kWorldSizeChanged);

  RunMeta renamed = Meta();
  renamed.params[1].name = "output.weight";
  err = f.run->Attach(renamed, 0, &f.sink, &info);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kCatalogMismatch);

  RunMeta extended = Meta();
  extended.params.push_back({.name = "embed.weight", .kind = ParamKind::kEmbedding});
  REQUIRE_FALSE(f.run->Attach(extended, 0, &f.sink, &info));
  RankStep r;
  r.step = 1;
  r.params.push_back({.index = 2, .norms = {{}, NormContribution::FromNorm(7.0), {}}});
  REQUIRE_FALSE(f.run->AddStep(0, r, &f.sink));
  CHECK(Latest(*f.run, "params/norm/embed.weight") == Approx(7.0));
  CHECK(f.run->Summary().params.size() == 3);
}

TEST_CASE("NaN and Inf are stored and counted, not rejected", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  REQUIRE_FALSE(f.run->AddStep(0, Step(5, std::nan(""), std::numeric_limits<double>::infinity()), &f.sink));
  const RunInfo info = f.run->Info();
  CHECK(info.nonfinite_count >= 2);
  CHECK(info.last_nonfinite_step == 5);
  auto v = Latest(*f.run, "grad/norm/final_norm.weight");
  REQUIRE(v);
  CHECK(std::isnan(*v));
}

TEST_CASE("a second stream for the same rank supersedes the first", "[runs]") {
  Fixture f;
  RecordingSink newer;
  f.Attach(0, &f.sink);
  f.Attach(0, &newer);
  CHECK(f.sink.superseded);
  CHECK(f.run->Info().open_streams == 1);
  f.run->Detach(0, &f.sink);  // the old stream's late detach changes nothing
  CHECK(f.run->Info().open_streams == 1);
  f.run->AddStep(0, Step(1, 1.0, 1.0), &newer);
  f.run->OnDurable({"r1", 0, 1, 0});
  CHECK(newer.acks.size() == 1);
  CHECK(f.sink.acks.empty());
}

TEST_CASE("a rank that reports a step completed by timeout is told it is late", "[runs]") {
  Fixture f(2);
  RecordingSink sink1;
  f.Attach(0, &f.sink);
  f.Attach(1, &sink1);
  f.run->AddStep(0, Step(3, 1.0, 1.0), &f.sink);
  f.clock.Advance(11s);
  f.run->Tick();
  CHECK(f.run->Info().partial_steps == 1);
  auto err = f.run->AddStep(1, Step(3, 1.0, 1.0), &sink1);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kLateForStep);
  REQUIRE_FALSE(f.run->AddStep(1, Step(4, 1.0, 1.0), &sink1));
}

TEST_CASE("a rank far ahead is held, not allowed to complete steps without a rank that may still report them",
          "[runs]") {
  Fixture f(3);
  f.options.max_pending_steps = 4;
  f.run = std::make_unique<Run>(Meta(3), f.options, nullptr, &f.stats, &f.clock, true);
  RecordingSink sink1, sink2;
  f.Attach(0, &f.sink);
  f.Attach(1, &sink1);
  f.Attach(2, &sink2);
  bool held = false;
  // Ranks 0 and 1 fill the 4 pending slots; rank 2 (reconnecting late) has reported nothing.
  for (uint64_t s = 1; s <= 4; ++s) {
    REQUIRE_FALSE(f.run->AddStep(0, Step(s, 1.0, 1.0), &f.sink, &held));
    REQUIRE_FALSE(held);
    REQUIRE_FALSE(f.run->AddStep(1, Step(s, 1.0, 1.0), &sink1, &held));
    REQUIRE_FALSE(held);
  }
  // A fifth step would complete step 1 without rank 2: held, and nothing changes.
  REQUIRE_FALSE(f.run->AddStep(0, Step(5, 1.0, 1.0), &f.sink, &held));
  CHECK(held);
  CHECK(f.run->Info().step_count == 0);
  // Rank 2 catches up: step 1 completes whole, which frees a slot, and the held report is taken.
  REQUIRE_FALSE(f.run->AddStep(2, Step(1, 1.0, 1.0), &sink2, &held));
  CHECK_FALSE(held);
  held = false;
  REQUIRE_FALSE(f.run->AddStep(0, Step(5, 1.0, 1.0), &f.sink, &held));
  CHECK_FALSE(held);
  CHECK(f.run->Info().step_count == 1);
  CHECK(f.run->Info().partial_steps == 0);
  for (uint64_t s = 2; s <= 5; ++s) {
    REQUIRE_FALSE(f.run->AddStep(2, Step(s, 1.0, 1.0), &sink2, &held));
    CHECK_FALSE(held);
  }
  REQUIRE_FALSE(f.run->AddStep(1, Step(5, 1.0, 1.0), &sink1, &held));
  CHECK(f.run->Info().step_count == 5);
  CHECK(f.run->Info().partial_steps == 0);
}

TEST_CASE("a rank that skipped the oldest pending step, or a caller that cannot hold, completes it as partial",
          "[runs]") {
  Fixture f(2);
  f.options.max_pending_steps = 2;
  f.run = std::make_unique<Run>(Meta(2), f.options, nullptr, &f.stats, &f.clock, true);
  RecordingSink sink1;
  f.Attach(0, &f.sink);
  f.Attach(1, &sink1);
  bool held = false;
  REQUIRE_FALSE(f.run->AddStep(0, Step(1, 1.0, 1.0), &f.sink, &held));
  REQUIRE_FALSE(f.run->AddStep(0, Step(2, 1.0, 1.0), &f.sink, &held));
  REQUIRE_FALSE(f.run->AddStep(0, Step(3, 1.0, 1.0), &f.sink, &held));
  CHECK(held);  // rank 1 may still report step 1
  held = false;
  // Rank 1 reports step 2 first: it skipped step 1 and never will send it.
  REQUIRE_FALSE(f.run->AddStep(1, Step(2, 1.0, 1.0), &sink1, &held));
  CHECK_FALSE(held);
  CHECK(f.run->Info().partial_steps == 1);  // step 1, completed without rank 1
  CHECK(f.run->Info().step_count == 2);
  // Without a way to hold (nullptr), the oldest completes as partial as before.
  REQUIRE_FALSE(f.run->AddStep(0, Step(3, 1.0, 1.0), &f.sink));
  REQUIRE_FALSE(f.run->AddStep(0, Step(4, 1.0, 1.0), &f.sink));
  REQUIRE_FALSE(f.run->AddStep(0, Step(5, 1.0, 1.0), &f.sink));
  CHECK(f.run->Info().partial_steps == 2);
}

TEST_CASE("a run with no stream and no step for end_after ends, and a hello revives it", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  f.run->AddStep(0, Step(1, 1.0, 1.0), &f.sink);
  f.clock.Advance(120s);
  f.run->Tick();
  CHECK_FALSE(f.run->Info().ended);  // a stream is still open
  f.run->Detach(0, &f.sink);
  f.clock.Advance(59s);
  f.run->Tick();
  CHECK_FALSE(f.run->Info().ended);
  f.clock.Advance(2s);
  f.run->Tick();
  CHECK(f.run->Info().ended);
  CHECK(f.run->MetricsSnapshot().info.ended);
  f.Attach(0, &f.sink);
  CHECK_FALSE(f.run->Info().ended);
}

TEST_CASE("a Goodbye ends the run cleanly at once, for every rank, and is answered", "[runs]") {
  Fixture f(2);
  RecordingListener hook;
  f.options.listener = &hook;
  f.run = std::make_unique<Run>(Meta(2), f.options, nullptr, &f.stats, &f.clock, true);
  RecordingSink rank1;
  f.Attach(0, &f.sink);
  f.Attach(1, &rank1);
  f.run->Finish(0, EndReason::kFinished, "reached max_steps", 7, &f.sink);
  const RunInfo info = f.run->Info();
  CHECK(info.ended);  // though rank 1 is still connected
  CHECK(info.end.reason == EndReason::kFinished);
  CHECK(info.end.message == "reached max_steps");
  CHECK(info.end.ended_at == f.clock.UnixSeconds());
  CHECK(f.sink.finished == std::vector<uint64_t>{7});  // no journal: durable at once
  CHECK(rank1.finished.empty());
  CHECK(hook.Log("r1") == std::vector<std::string>{"end clean"});
  CHECK(hook.Undelivered() == 0);
  CHECK(f.run->Activity().ended_cleanly);

  // Rank 1 says Goodbye too: answered, the end is not reported twice.
  f.run->Finish(1, EndReason::kFinished, "", 3, &rank1);
  CHECK(rank1.finished == std::vector<uint64_t>{3});
  CHECK(hook.Log("r1").size() == 1);

  // A later Hello reopens it.
  f.run->Detach(0, &f.sink);
  f.Attach(0, &f.sink);
  CHECK_FALSE(f.run->Info().ended);
  CHECK_FALSE(f.run->Activity().ended_cleanly);
}

TEST_CASE("a run whose streams vanish ends by inactivity, not cleanly, and its activity says how long", "[runs]") {
  Fixture f;
  RecordingListener hook;
  f.options.listener = &hook;
  f.run = std::make_unique<Run>(Meta(), f.options, nullptr, &f.stats, &f.clock, true);
  f.Attach(0, &f.sink);
  f.run->AddStep(0, Step(1, 1.0, 1.0), &f.sink);
  f.clock.Advance(30s);
  f.run->Detach(0, &f.sink);
  f.clock.Advance(45s);
  RunActivity activity = f.run->Activity();
  CHECK(activity.open_streams == 0);
  CHECK(activity.seconds_since_activity == Approx(45));  // since the stream closed
  CHECK(activity.seconds_since_last_step == Approx(75));
  CHECK(activity.last_step == 1);
  CHECK_FALSE(activity.ended);
  f.clock.Advance(20s);
  f.run->Tick();
  CHECK(hook.Log("r1") == std::vector<std::string>{"step 1", "end unclean"});
  CHECK(hook.Undelivered() == 0);
  CHECK(f.run->Info().end.reason == EndReason::kInactive);
  activity = f.run->Activity();
  CHECK(activity.ended);
  CHECK_FALSE(activity.ended_cleanly);
}

TEST_CASE("a run restored with a RunDied page stays silent since its last sign of life", "[runs]") {
  Fixture f;
  f.clock.Advance(10000s);
  f.run = std::make_unique<Run>(Meta(), f.options, nullptr, &f.stats, &f.clock, false);  // as restored
  RunRestore(*f.run).Ended({});  // active when the daemon stopped: a fresh grace period
  CHECK(f.run->Activity().seconds_since_activity == Approx(0));
  RunRestore(*f.run).SilentSince(f.clock.UnixSeconds() - 900);  // its page fired for 900 s of silence
  CHECK(f.run->Activity().seconds_since_activity == Approx(900));
  RunRestore(*f.run).SilentSince(f.clock.UnixSeconds() - 100);  // never moves the last sign of life later
  CHECK(f.run->Activity().seconds_since_activity == Approx(900));
  f.Attach(0, &f.sink);  // it came back
  RunRestore(*f.run).SilentSince(f.clock.UnixSeconds() - 5000);
  CHECK(f.run->Activity().seconds_since_activity == Approx(0));
}

TEST_CASE("extra keys become series and events are kept in step order", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  RankStep r = Step(1, 1.0, 1.0);
  r.extra = {{"train/accuracy", 0.5}};
  r.loss = 2.0;
  f.run->AddStep(0, r, &f.sink);
  CHECK(Latest(*f.run, "train/accuracy") == Approx(0.5));
  CHECK(Latest(*f.run, "train/loss") == Approx(2.0));
  f.run->AddEvent({.step = 50, .text = "b", .source = "trainer"});
  f.run->AddEvent({.step = 10, .text = "a", .source = "annotate"});
  const auto events = f.run->Summary().events;
  REQUIRE(events.size() == 2);
  CHECK(events[0].text == "a");
  CHECK(events[1].text == "b");
}

TEST_CASE("series queries return the stored points", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  for (uint64_t s = 1; s <= 10; ++s) f.run->AddStep(0, Step(s, static_cast<double>(s), 1.0), &f.sink);
  auto pts = f.run->QuerySeries("grad/norm/final_norm.weight", 3, 5, 0);
  REQUIRE(pts);
  REQUIRE(pts->size() == 3);
  CHECK((*pts)[0].step == 3);
  CHECK((*pts)[2].last == Approx(5.0));
  CHECK_FALSE(f.run->QuerySeries("no/such/key", 0, 100, 0).has_value());
}

TEST_CASE("a finite norm too large to square in a double stays finite", "[runs]") {
  Fixture f(2);
  RecordingSink second;
  f.Attach(0, &f.sink);
  f.Attach(1, &second);
  // Two ranks' shares of 1e160 each: √(2·1e320) overflows a double's square, not the norm.
  REQUIRE_FALSE(f.run->AddStep(0, Step(100, 1e160, 1.0), &f.sink));
  REQUIRE_FALSE(f.run->AddStep(1, Step(100, 1e160, 1.0), &second));
  const auto norm = Latest(*f.run, "grad/norm/final_norm.weight");
  REQUIRE(norm);
  CHECK(*norm == Approx(std::sqrt(2.0) * 1e160));
  CHECK(std::isfinite(*Latest(*f.run, "grad/norm/total")));
  CHECK(f.run->Info().nonfinite_count == 0);
  // The shares are computed in the same scaled way: final_norm carries it all.
  const RunAnalysis analysis = f.run->Summary().analysis;
  bool found = false;
  for (const auto& s : analysis.shares) {
    if (s.name == "final_norm.weight") {
      found = true;
      CHECK(s.share == Approx(1.0));
    }
  }
  CHECK(found);
}

TEST_CASE("restored events are ordered by step whatever order the journal recorded them in", "[runs]") {
  FakeClock clock;
  RunOptions options;
  Run run(Meta(), options, nullptr, nullptr, &clock, false);
  RunRestore(run).Event({500, "third", "trainer", 3});
  RunRestore(run).Event({100, "first", "annotation", 1});
  RunRestore(run).Event({300, "second", "annotation", 2});
  RunRestore(run).Event({300, "second, later", "annotation", 4});
  RunRestore(run).Finish();
  const auto events = run.Summary().events;
  REQUIRE(events.size() == 4);
  CHECK(events[0].text == "first");
  CHECK(events[1].text == "second");
  CHECK(events[2].text == "second, later");
  CHECK(events[3].text == "third");
}

TEST_CASE("a step's points reach every reader at once, read after each step or only at the end", "[runs]") {
  // Run::AppendLocked sets a step's points aside and appends them a slice of the series at a
  // time; any read applies them first. Two runs fed the same steps, one read after every step and
  // one only at the end, must show the same points and save the same snapshot.
  constexpr size_t kParams = 40;
  RunMeta meta = Meta();
  meta.params.clear();
  for (size_t i = 0; i < kParams; ++i) meta.params.push_back({.name = "p" + std::to_string(i), .numel = 100});
  FakeClock clock;
  RunOptions options;
  options.assembly_timeout = 10s;
  options.end_after = 60s;
  DaemonStats stats;
  RecordingSink sink_read, sink_unread;
  Run read_often(meta, options, nullptr, &stats, &clock, true);
  Run read_at_end(meta, options, nullptr, &stats, &clock, true);
  AttachInfo info;
  REQUIRE_FALSE(read_often.Attach(meta, 0, &sink_read, &info).has_value());
  REQUIRE_FALSE(read_at_end.Attach(meta, 0, &sink_unread, &info).has_value());
  const auto value = [](uint64_t step, size_t param) { return 1.0 + 0.01 * static_cast<double>(step * 7 + param); };
  constexpr uint64_t kSteps = 37;  // not a multiple of the slices
  for (uint64_t s = 1; s <= kSteps; ++s) {
    RankStep r;
    r.step = s;
    // Every third step skips a parameter, so slices do not hold the same series at every step.
    for (size_t i = 0; i < kParams; ++i) {
      if (s % 3 == 0 && i == s % kParams) continue;
      r.params.push_back(
          {.index = static_cast<uint32_t>(i), .norms = {NormContribution::FromNorm(value(s, i)), {}, {}}});
    }
    REQUIRE_FALSE(read_often.AddStep(0, r, &sink_read));
    REQUIRE_FALSE(read_at_end.AddStep(0, r, &sink_unread));
    // Every series holds this step's point as soon as the step is added.
    const size_t i = s % kParams;
    const auto pts = read_often.QuerySeries("grad/norm/p" + std::to_string(i), s, s, 0);
    REQUIRE(pts);
    if (s % 3 == 0) {
      CHECK(pts->empty());
    } else {
      REQUIRE(pts->size() == 1);
      CHECK(pts->front().last == Approx(value(s, i)));
    }
    CHECK(Latest(read_often, "grad/norm/total").has_value());
  }
  for (size_t i = 0; i < kParams; ++i) {
    const std::string key = "grad/norm/p" + std::to_string(i);
    const auto a = read_often.QuerySeries(key, 0, kSteps, 0);
    const auto b = read_at_end.QuerySeries(key, 0, kSteps, 0);
    REQUIRE(a);
    REQUIRE(b);
    REQUIRE(a->size() == b->size());
    CHECK(a->size() + kSteps / 3 >= kSteps);
    for (size_t k = 0; k < a->size(); ++k) {
      CHECK((*a)[k].step == (*b)[k].step);
      CHECK((*a)[k].last == (*b)[k].last);
      CHECK((*a)[k].last == Approx(value((*a)[k].step, i)));
    }
  }
  ByteChunks often, at_end;
  REQUIRE(read_often.SaveSnapshot(often, std::nullopt).has_value());
  REQUIRE(read_at_end.SaveSnapshot(at_end, std::nullopt).has_value());
  CHECK(often.ToString() == at_end.ToString());
}

TEST_CASE("a snapshot taken between slices holds every step's points", "[runs]") {
  Fixture f;
  f.Attach(0, &f.sink);
  for (uint64_t s = 1; s <= 11; ++s) f.run->AddStep(0, Step(s, static_cast<double>(s), 1.0), &f.sink);
  ByteChunks saved;
  REQUIRE(f.run->SaveSnapshot(saved, std::nullopt).has_value());
  Fixture g;
  g.Attach(0, &g.sink);
  for (uint64_t s = 1; s <= 11; ++s) g.run->AddStep(0, Step(s, static_cast<double>(s), 1.0), &g.sink);
  auto pts = g.run->QuerySeries("grad/norm/final_norm.weight", 0, 100, 0);  // applies every point
  REQUIRE(pts);
  REQUIRE(pts->size() == 11);
  ByteChunks read_first;
  REQUIRE(g.run->SaveSnapshot(read_first, std::nullopt).has_value());
  CHECK(saved.ToString() == read_first.ToString());
}

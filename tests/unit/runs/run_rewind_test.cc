#include <unistd.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/runs/registry.h"
#include "server/runs/run.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/runs/recording_listener.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;
using gradwatch::runs::testing::RecordingListener;
using gradwatch::runs::testing::RecordingSink;
using gradwatch::testing::TempDir;

namespace {

namespace fs = std::filesystem;

// The rewinds of `run_id` the listener was told of.
size_t Rewinds(const RecordingListener& listener, const std::string& run_id) {
  size_t n = 0;
  for (const std::string& what : listener.Log(run_id)) n += what.rfind("rewind ", 0) == 0;
  return n;
}

RunMeta Meta(const std::string& run_id, uint32_t world_size = 1, std::optional<uint64_t> resume = std::nullopt) {
  RunMeta m;
  m.run_id = run_id;
  m.world_size = world_size;
  m.params = {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
              {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1}};
  m.resume_from_step = resume;
  return m;
}

// One rank's report: the lm_head grad norm (the total follows it) and the final norm's gain.
RankStep Step(uint64_t step, double lm_head_grad, double final_norm = 80.0) {
  RankStep r;
  r.step = step;
  r.params.push_back(
      {.index = 0, .norms = {NormContribution::FromNorm(0.01), NormContribution::FromNorm(final_norm), {}}});
  r.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(lm_head_grad), {}, {}}});
  return r;
}

// The old branch rises slowly; the new one, resumed at step 20,000 from the old one's level, rises
// faster: after a resume the values differ, but there is no jump between the branches.
double OldBranch(uint64_t s) {
  return 0.3 + 2e-5 * static_cast<double>(s) + 0.01 * std::sin(0.37 * static_cast<double>(s));
}
double NewBranch(uint64_t s, uint64_t resume = 20000) {
  return 0.3 + 2e-5 * static_cast<double>(resume) + 5e-5 * (static_cast<double>(s) - static_cast<double>(resume)) +
         0.01 * std::cos(0.41 * static_cast<double>(s));
}

std::vector<store::Point> Points(const Run& run, const std::string& key) {
  auto points = run.QuerySeries(key, 0, UINT64_MAX, 0);
  REQUIRE(points);
  return *points;
}

std::unique_ptr<store::Journal> OpenJournal(const std::string& path, store::Journal::CommitCallback cb = nullptr) {
  auto journal = store::Journal::Open({.path = path}, std::move(cb));
  INFO(journal.status().ToString());
  REQUIRE(journal.ok());
  return std::move(journal).value();
}

struct Fixture {
  TempDir dir;
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  RecordingListener hook;
  std::unique_ptr<store::Journal> journal = OpenJournal(dir.db());
  Fixture() {
    options.assembly_timeout = 10s;
    options.listener = &hook;
  }
  std::unique_ptr<Run> NewRun(const std::string& run_id, uint32_t world_size = 1) {
    return std::make_unique<Run>(Meta(run_id, world_size), options, journal.get(), &stats, &clock, true);
  }
};

void Attach(Run& run, uint32_t rank, StreamSink* sink, std::optional<uint64_t> resume = std::nullopt,
            uint32_t world_size = 0, AttachInfo* info_out = nullptr) {
  AttachInfo info;
  const uint32_t world = world_size ? world_size : run.Info().world_size;
  const auto err = run.Attach(Meta(run.id(), world, resume), rank, sink, &info);
  INFO((err ? err->message : ""));
  REQUIRE_FALSE(err.has_value());
  if (info_out) *info_out = info;
}

void CheckFitsEqual(const analytics::LinearFit& a, const analytics::LinearFit& b) {
  CHECK(a.samples == b.samples);
  CHECK(a.first_step == b.first_step);
  CHECK(a.last_step == b.last_step);
  CHECK(a.slope_per_step == Approx(b.slope_per_step).epsilon(1e-9));
  CHECK(a.value_at_last_step == Approx(b.value_at_last_step).epsilon(1e-9));
}

constexpr uint64_t kResumeStepForRace = 20000;

}  // namespace

TEST_CASE("a resume replaces the abandoned branch in the series, events, progress and alerts", "[runs][rewind]") {
  Fixture f;
  auto run = f.NewRun("r1");
  RecordingSink sink;
  Attach(*run, 0, &sink);
  for (uint64_t s = 0; s <= 300; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, OldBranch(s)), &sink));
  REQUIRE_FALSE(run->AddEvent({100, "warmup done", "trainer", 0}));
  REQUIRE_FALSE(run->AddEvent({250, "switched routing", "trainer", 0}));

  RecordingSink resumed;
  AttachInfo info;
  Attach(*run, 0, &resumed, 200, 1, &info);
  CHECK(sink.superseded);
  CHECK(info.has_received_step);
  CHECK(info.last_received_step == 199);  // the resumed rank sends from 200 on
  // The listener heard the steps, then the rewind, before the new branch; all delivered.
  const std::vector<std::string> log = f.hook.Log("r1");
  REQUIRE(log.size() == 32);
  CHECK(log[30] == "step 300");
  CHECK(log[31] == "rewind 200");
  CHECK(f.hook.Undelivered() == 0);

  for (const auto& p : Points(*run, "grad/norm/lm_head.weight")) CHECK(p.last_step < 200);
  CHECK(run->Info().last_step == 190);
  CHECK(run->Info().step_count == 20);
  const auto events = run->Summary().events;
  REQUIRE(events.size() == 2);
  CHECK(events[0].text == "warmup done");
  CHECK(events[1].step == 200);
  CHECK(events[1].text == "resumed from the checkpoint at step 200");
  CHECK(events[1].source == "daemon");

  // The new branch goes in where the old one was.
  for (uint64_t s = 200; s <= 400; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, NewBranch(s, 200)), &resumed));
  const auto points = Points(*run, "grad/norm/lm_head.weight");
  REQUIRE(points.size() == 41);
  for (const auto& p : points) CHECK(p.mean == Approx(p.step < 200 ? OldBranch(p.step) : NewBranch(p.step, 200)));
  CHECK(run->Info().step_count == 41);
  CHECK(run->Info().first_step == 0);

  // Without a resume, the rank's history still rules: older steps regress, a changed repeat conflicts.
  auto err = run->AddStep(0, Step(300, 9.0), &resumed);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kStepRegression);
  err = run->AddStep(0, Step(400, 9.0), &resumed);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kStepConflict);
  RecordingSink plain;
  AttachInfo plain_info;
  Attach(*run, 0, &plain, std::nullopt, 1, &plain_info);
  CHECK(plain_info.last_received_step == 400);
}

TEST_CASE("analytics after a rewind equal those of the straight history", "[runs][rewind]") {
  Fixture f;
  constexpr uint64_t kResume = 20000;
  auto rewound = f.NewRun("rewound");
  auto straight = f.NewRun("straight");
  RecordingSink a, b;
  Attach(*rewound, 0, &a);
  Attach(*straight, 0, &b);
  // The straight run knows the resume event from the start, as the rebuilt analytics do.
  REQUIRE_FALSE(straight->AddEvent({kResume, "resumed from the checkpoint at step 20000", "daemon", 0}));
  for (uint64_t s = 0; s <= 30000; s += 10) {
    REQUIRE_FALSE(rewound->AddStep(0, Step(s, OldBranch(s), 80.0 + 1e-3 * s), &a));
    if (s < kResume) REQUIRE_FALSE(straight->AddStep(0, Step(s, OldBranch(s), 80.0 + 1e-3 * s), &b));
  }
  RecordingSink resumed;
  Attach(*rewound, 0, &resumed, kResume);
  // The new branch ends where the old one did, so every window straddles the resume step.
  for (uint64_t s = kResume; s <= 30000; s += 10) {
    REQUIRE_FALSE(rewound->AddStep(0, Step(s, NewBranch(s), 75.0 + 3e-3 * s), &resumed));
    REQUIRE_FALSE(straight->AddStep(0, Step(s, NewBranch(s), 75.0 + 3e-3 * s), &b));
  }

  const RunAnalysis x = rewound->Summary().analysis;
  const RunAnalysis y = straight->Summary().analysis;
  REQUIRE(x.slopes.size() == y.slopes.size());
  REQUIRE_FALSE(x.slopes.empty());
  for (size_t i = 0; i < x.slopes.size(); ++i) {
    INFO(x.slopes[i].key << " over " << x.slopes[i].window_steps);
    CHECK(x.slopes[i].key == y.slopes[i].key);
    CheckFitsEqual(x.slopes[i].fit, y.slopes[i].fit);
  }
  // The forecasts differ on purpose: the rewound run's fits only the new branch (the next test).
  REQUIRE(x.forecasts.size() == y.forecasts.size());
  REQUIRE_FALSE(x.forecasts.empty());
  for (size_t i = 0; i < x.forecasts.size(); ++i) {
    CHECK(x.forecasts[i].fit_span_steps < 10000);
    CHECK(x.forecasts[i].fit_samples < 1001);
    CHECK(y.forecasts[i].fit_span_steps > 10000);
  }
  REQUIRE(x.slope_changes.size() == y.slope_changes.size());
  REQUIRE_FALSE(x.slope_changes.empty());  // the resume event's window
  for (size_t i = 0; i < x.slope_changes.size(); ++i) {
    CHECK(x.slope_changes[i].change.event_step == y.slope_changes[i].change.event_step);
    CHECK(x.slope_changes[i].after_samples == y.slope_changes[i].after_samples);
    CHECK(x.slope_changes[i].change.ratio == Approx(y.slope_changes[i].change.ratio).epsilon(1e-9));
  }
  REQUIRE(x.change_points.size() == y.change_points.size());
  for (size_t i = 0; i < x.change_points.size(); ++i) {
    CHECK(x.change_points[i].change == y.change_points[i].change);
  }
  REQUIRE(x.growth_without_decay.size() == y.growth_without_decay.size());
  for (size_t i = 0; i < x.growth_without_decay.size(); ++i) {
    CHECK(x.growth_without_decay[i].slope_per_kstep == Approx(y.growth_without_decay[i].slope_per_kstep).epsilon(1e-9));
  }
  CHECK(rewound->Info().step_count == straight->Info().step_count);
  CHECK(rewound->Info().first_step == straight->Info().first_step);
  CHECK(rewound->Info().last_step == straight->Info().last_step);
}

TEST_CASE("after a resume a forecast fits the new branch alone: the jump a resume brings is not extrapolated",
          "[runs][rewind]") {
  Fixture f;
  constexpr uint64_t kResume = 10000;
  auto run = f.NewRun("jump");
  RecordingSink sink;
  Attach(*run, 0, &sink);
  const auto flat = [](uint64_t s, double level) { return level + 0.01 * std::sin(0.37 * static_cast<double>(s)); };
  for (uint64_t s = 0; s <= 12000; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, flat(s, 1.0)), &sink));
  RecordingSink resumed;
  Attach(*run, 0, &resumed, kResume);
  // The resumed job's grad norm sits at 3, flat, where it was 1 before the checkpoint.
  for (uint64_t s = kResume; s <= kResume + 1000; s += 10) {
    REQUIRE_FALSE(run->AddStep(0, Step(s, flat(s, 3.0)), &resumed));
  }
  const RunAnalysis a = run->Summary().analysis;
  REQUIRE(a.forecasts.size() == 1);
  const ForecastInfo& fc = a.forecasts[0];
  INFO("slope " << fc.slope_per_kstep << " samples " << fc.fit_samples << " span " << fc.fit_span_steps);
  CHECK(fc.key == "grad/norm/total");
  // A fit across the jump (the 20,000-step window holds 1,000 reports at 1 and 100 at 3) rises;
  // the new branch alone is flat.
  CHECK(std::abs(fc.slope_per_kstep) < 0.05);
  CHECK(fc.current_value == Approx(3.0).margin(0.05));
  CHECK(fc.fit_samples <= 101);
  CHECK(fc.fit_samples >= 90);
  CHECK(fc.fit_span_steps <= 1000);
  CHECK((!fc.reachable || fc.steps_to_threshold > 1e5));
}

TEST_CASE("steps completed while the analytics are rebuilt are analysed after them, in order", "[runs][rewind]") {
  // Rank 1 resumes and reports (steps complete as partial by timeout) while rank 0's Hello may
  // still be rebuilding the analytics: the outcome must not depend on who came first.
  Fixture f;
  f.options.assembly_timeout = 1s;
  auto rewound = f.NewRun("concurrent", 2);
  auto straight = f.NewRun("reference", 2);
  RecordingSink a0, a1, b0, b1;
  Attach(*rewound, 0, &a0);
  Attach(*rewound, 1, &a1);
  Attach(*straight, 0, &b0);
  Attach(*straight, 1, &b1);
  REQUIRE_FALSE(straight->AddEvent({kResumeStepForRace, "resumed from the checkpoint at step 20000", "daemon", 0}));
  for (uint64_t s = 0; s <= 30000; s += 10) {
    for (uint32_t r = 0; r < 2; ++r) {
      REQUIRE_FALSE(rewound->AddStep(r, Step(s, OldBranch(s)), r ? &a1 : &a0));
      if (s < kResumeStepForRace) REQUIRE_FALSE(straight->AddStep(r, Step(s, OldBranch(s)), r ? &b1 : &b0));
    }
  }
  // Rank 1's reports of the new branch, each completed alone by the assembly timeout. No Catch2
  // macro runs on the threads: failures are counted and checked after the join.
  auto report_rank1 = [&f](Run& run, StreamSink* sink) {
    int failures = 0;
    for (uint64_t s = kResumeStepForRace; s <= 25000; s += 10) {
      if (run.AddStep(1, Step(s, NewBranch(s)), sink)) ++failures;
      f.clock.Advance(2s);
      run.Tick();
    }
    return failures;
  };
  RecordingSink r0, r1;
  std::optional<IngestError> error0, error1;
  int failures1 = 0;
  std::thread rank0([&] {
    AttachInfo info;
    error0 = rewound->Attach(Meta("concurrent", 2, kResumeStepForRace), 0, &r0, &info);
  });
  std::thread rank1([&] {
    AttachInfo info;
    error1 = rewound->Attach(Meta("concurrent", 2, kResumeStepForRace), 1, &r1, &info);
    if (!error1) failures1 = report_rank1(*rewound, &r1);
  });
  rank0.join();
  rank1.join();
  CHECK_FALSE(error0.has_value());
  CHECK_FALSE(error1.has_value());
  CHECK(failures1 == 0);
  CHECK(report_rank1(*straight, &b1) == 0);
  CHECK(Rewinds(f.hook, "concurrent") == 1);

  const RunAnalysis x = rewound->Summary().analysis;
  const RunAnalysis y = straight->Summary().analysis;
  REQUIRE(x.slopes.size() == y.slopes.size());
  for (size_t i = 0; i < x.slopes.size(); ++i) {
    INFO(x.slopes[i].key << " over " << x.slopes[i].window_steps);
    CheckFitsEqual(x.slopes[i].fit, y.slopes[i].fit);
  }
  REQUIRE(x.slope_changes.size() == y.slope_changes.size());
  for (size_t i = 0; i < x.slope_changes.size(); ++i) {
    CHECK(x.slope_changes[i].after_samples == y.slope_changes[i].after_samples);
  }
  CHECK(rewound->Info().step_count == straight->Info().step_count);
  CHECK(rewound->Info().partial_steps == straight->Info().partial_steps);
}

TEST_CASE("the other ranks of a resume do not rewind again but a new resume from the same step does",
          "[runs][rewind]") {
  Fixture f;
  auto run = f.NewRun("r2", 2);
  RecordingSink s0, s1;
  Attach(*run, 0, &s0);
  Attach(*run, 1, &s1);
  for (uint64_t s = 0; s <= 300; s += 10) {
    REQUIRE_FALSE(run->AddStep(0, Step(s, 1.0), &s0));
    REQUIRE_FALSE(run->AddStep(1, Step(s, 1.0), &s1));
  }
  RecordingSink r0, r1;
  Attach(*run, 0, &r0, 200);
  REQUIRE_FALSE(run->AddStep(0, Step(200, 2.0), &r0));
  REQUIRE_FALSE(run->AddStep(0, Step(210, 2.0), &r0));
  AttachInfo info;
  Attach(*run, 1, &r1, 200, 2, &info);  // same resume point: idempotent
  CHECK(info.last_received_step == 199);
  REQUIRE_FALSE(run->AddStep(1, Step(200, 2.0), &r1));  // completes step 200 of the new branch
  CHECK(Rewinds(f.hook, "r2") == 1);
  CHECK(run->Info().last_step == 200);
  CHECK(Points(*run, "grad/norm/lm_head.weight").back().mean == Approx(std::sqrt(8.0)));

  // Rank 0 crashes again and resumes from the same checkpoint: it had reported 210, so this rewinds.
  RecordingSink again;
  Attach(*run, 0, &again, 200);
  CHECK(Rewinds(f.hook, "r2") == 2);
  CHECK(run->Info().last_step == 190);
}

TEST_CASE("a resume may change the world size but a plain hello may not", "[runs][rewind]") {
  Fixture f;
  auto run = f.NewRun("r3", 2);
  RecordingSink s0, s1;
  Attach(*run, 0, &s0);
  Attach(*run, 1, &s1);
  for (uint64_t s = 0; s <= 100; s += 10) {
    REQUIRE_FALSE(run->AddStep(0, Step(s, 1.0), &s0));
    REQUIRE_FALSE(run->AddStep(1, Step(s, 1.0), &s1));
  }
  REQUIRE_FALSE(run->AddStep(0, Step(110, 1.0), &s0));  // pending, abandoned by the resume

  AttachInfo info;
  auto err = run->Attach(Meta("r3", 3), 0, &s0, &info);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kWorldSizeChanged);

  RecordingSink r0;
  Attach(*run, 0, &r0, 110, 1);
  CHECK(s1.superseded);  // rank 1 is not in the new world
  CHECK(run->Info().world_size == 1);
  CHECK(run->Info().open_streams == 1);
  err = run->AddStep(1, Step(110, 1.0), &s1);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kSuperseded);
  REQUIRE_FALSE(run->AddStep(0, Step(110, 3.0), &r0));  // one rank completes a step now
  CHECK(run->Info().last_step == 110);
  CHECK(Points(*run, "grad/norm/lm_head.weight").back().mean == Approx(3.0));
  CHECK(run->Info().partial_steps == 0);

  // Another rank of that resume must agree on the new size.
  RecordingSink other;
  err = run->Attach(Meta("r3", 2, 110), 1, &other, &info);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kWorldSizeChanged);
}

TEST_CASE("durable progress of the abandoned branch arriving after the rewind is not acked", "[runs][rewind]") {
  Fixture f;
  auto run = f.NewRun("r4");
  RecordingSink sink;
  Attach(*run, 0, &sink);
  for (uint64_t s = 0; s <= 300; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, 1.0), &sink));
  RecordingSink resumed;
  Attach(*run, 0, &resumed, 200);
  run->OnDurable({"r4", 0, 300, 31, 0});  // committed before the rewind, reported after it
  CHECK(resumed.acks.empty());
  run->OnDurable({"r4", 0, 200, 32, 1});
  REQUIRE(resumed.acks.size() == 1);
  CHECK(resumed.acks[0].first == 200);
}

TEST_CASE("after a restart the journal yields the new branch, the resume event and rewound progress",
          "[runs][rewind]") {
  TempDir dir;
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  {
    RunRegistry registry(options, 16, &stats, &clock);
    auto journal = OpenJournal(dir.db(), [&registry](const store::CommitReport& r) { registry.OnCommit(r); });
    registry.set_journal(journal.get());
    RecordingSink sink, resumed;
    AttachInfo info;
    IngestError error;
    auto run = registry.Attach(Meta("r5"), 0, &sink, &info, &error);
    REQUIRE(run);
    for (uint64_t s = 0; s <= 300; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, OldBranch(s)), &sink));
    REQUIRE(journal->Flush().ok());
    REQUIRE(registry.Attach(Meta("r5", 1, 200), 0, &resumed, &info, &error));
    for (uint64_t s = 200; s <= 250; s += 10) REQUIRE_FALSE(run->AddStep(0, Step(s, NewBranch(s, 200)), &resumed));
    REQUIRE(journal->Flush().ok());
    journal->Stop();
  }
  RunRegistry registry(options, 16, &stats, &clock);
  auto journal = OpenJournal(dir.db());
  registry.set_journal(journal.get());
  REQUIRE(registry.Load().ok());
  auto run = registry.Find("r5");
  REQUIRE(run);
  const auto points = Points(*run, "grad/norm/lm_head.weight");
  REQUIRE(points.size() == 26);
  for (const auto& p : points) CHECK(p.mean == Approx(p.step < 200 ? OldBranch(p.step) : NewBranch(p.step, 200)));
  const auto events = run->Summary().events;
  REQUIRE(events.size() == 1);
  CHECK(events[0].text == "resumed from the checkpoint at step 200");
  RecordingSink reconnected;
  AttachInfo info;
  IngestError error;
  REQUIRE(registry.Attach(Meta("r5"), 0, &reconnected, &info, &error));
  CHECK(info.last_received_step == 250);
  CHECK(info.last_durable_step == 250);
}

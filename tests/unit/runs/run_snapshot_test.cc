// Runs restored from a snapshot and the journal's steps after it hold exactly what runs rebuilt
// from the whole journal hold: counters, every point, every analytics figure, bit for bit. A
// snapshot that no longer fits (the run rewound past it, the listener needs the steps, the bytes
// are cut short) is not used, and the run is rebuilt from the journal as if there were none.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "server/runs/registry.h"
#include "server/store/journal.h"
#include "server/store/snapshots.h"
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

constexpr const char* kRun = "snap";

RunMeta Hello(std::optional<uint64_t> resume = std::nullopt) {
  RunMeta m;
  m.run_id = kRun;
  m.params = {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
              {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1},
              {.name = "layers.0.mlp.weight", .numel = 5000, .kind = ParamKind::kMlp, .weight_decay = 0.1}};
  m.resume_from_step = resume;
  return m;
}

double Noise(uint64_t s, uint64_t salt) { return std::sin(0.731 * static_cast<double>(s) + 1.3 * salt); }

RankStep Step(uint64_t s) {
  const double x = static_cast<double>(s);
  const double total = 0.3 + 1e-4 * x + 0.05 * Noise(s, 1) + (s % 397 == 0 ? 2.0 : 0.0);
  RankStep r;
  r.step = s;
  r.wall_time = 1.7e9 + 0.5 * x;
  r.loss = 2.0 + 1.0 / (1.0 + x / 500.0);
  r.params.push_back({.index = 0,
                      .norms = {NormContribution::FromNorm(0.2 * total),
                                NormContribution::FromNorm(78.4 + 1e-3 * x + (s > 3000 ? 2e-3 * (x - 3000) : 0.0) +
                                                           0.02 * Noise(s, 2)),
                                {}}});
  r.params.push_back(
      {.index = 1, .norms = {NormContribution::FromNorm(0.7 * total), NormContribution::FromNorm(300), {}}});
  r.params.push_back(
      {.index = 2,
       .norms = {NormContribution::FromNorm(0.1 * total + 0.01 * Noise(s, 3)), NormContribution::FromNorm(120), {}}});
  if (s % 1013 == 0) r.params[2].norms[0] = NormContribution::FromNorm(std::nan(""));
  return r;
}

std::string Hex(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

std::string Fit(const analytics::LinearFit& f) {
  return std::to_string(f.samples) + "/" + std::to_string(f.first_step) + "-" + std::to_string(f.last_step) + " " +
         Hex(f.slope_per_step) + " " + Hex(f.value_at_last_step) + " " + Hex(f.slope_stderr_per_step) + " " +
         Hex(f.residual_stddev);
}

// Everything a run shows, with every double in hex: equal strings are equal bits.
std::string Dump(const Run& run) {
  std::string out;
  const RunSummary s = run.Summary();
  const RunInfo& i = s.info;
  out += "info " + std::to_string(i.step_count) + " " + std::to_string(i.first_step) + " " +
         std::to_string(i.last_step) + " " + Hex(i.last_wall_time) + " " + Hex(i.steps_per_second) + " " +
         std::to_string(i.partial_steps) + " " + std::to_string(i.nonfinite_count) + " " +
         std::to_string(i.last_nonfinite_step) + "\n";
  for (const LatestSample& l : s.latest)
    out += "latest " + l.key + " " + std::to_string(l.step) + " " + Hex(l.value) + "\n";
  for (const EventRecord& e : s.events) out += "event " + std::to_string(e.step) + " " + e.text + "\n";
  const RunAnalysis& a = s.analysis;
  for (const auto& x : a.slopes)
    out += "slope " + x.key + " " + std::to_string(x.window_steps) + " " + Fit(x.fit) + "\n";
  for (const auto& x : a.slope_changes) {
    out += "change " + x.key + " " + x.event_text + " " + Fit(x.change.before) + " | " + Fit(x.change.after) + " " +
           Hex(x.change.ratio) + " " + Hex(x.change.before_stderr_per_kstep) + " " +
           Hex(x.change.after_stderr_per_kstep) + " " + std::to_string(x.change.after_window_full) + "\n";
  }
  for (const auto& x : a.change_points) {
    out += "point " + x.key + " " + std::to_string(x.change.step) + " " + Hex(x.change.slope_before_per_kstep) + " " +
           Hex(x.change.slope_after_per_kstep) + " " + Hex(x.change.z_score) + " " +
           std::to_string(x.change.detected_at_step) + " " + std::to_string(x.change.settled) + "\n";
  }
  for (const auto& x : a.forecasts) {
    out += "forecast " + x.key + " " + std::to_string(x.reachable) + " " + Hex(x.steps_to_threshold) + " " +
           Hex(x.slope_per_kstep) + "\n";
  }
  for (const auto& x : a.shares) out += "share " + x.name + " " + Hex(x.share) + " " + Hex(x.slope_per_kstep) + "\n";
  for (const auto& x : a.amplifications) out += "amp " + x.param + " " + Hex(x.amplification) + "\n";
  for (const auto& x : a.growth_without_decay) {
    out += "growth " + x.param + " " + Hex(x.growth_factor) + " " + Hex(x.slope_per_kstep) + "\n";
  }
  for (const LatestSample& l : s.latest) {
    const auto points = run.QuerySeries(l.key, 0, UINT64_MAX, 0);
    for (const store::Point& p : points.value()) {
      out += "point " + l.key + " " + std::to_string(p.step) + "-" + std::to_string(p.last_step) + " " +
             std::to_string(p.count) + " " + Hex(p.mean) + " " + Hex(p.min) + " " + Hex(p.max) + " " + Hex(p.last) +
             "\n";
    }
  }
  return out;
}

// A daemon's worth of run state on one data directory: journal, snapshots, registry.
struct Daemon {
  FakeClock* clock;
  DaemonStats stats;
  RecordingListener hook;
  RecordingSink sink;
  std::unique_ptr<store::Journal> journal;
  std::unique_ptr<store::SnapshotStore> snapshots;
  std::unique_ptr<RunRegistry> registry;

  Daemon(const TempDir& dir, FakeClock* c, bool use_snapshots) : clock(c) {
    RunOptions options;
    options.assembly_timeout = 10s;
    options.listener = &hook;
    options.analytics.windows = {500, 2000};
    options.analytics.forecast_window_steps = 2000;
    options.analytics.event_window_steps = 1000;
    options.analytics.change_points.window_steps = 600;
    options.series = {.recent_points = 512, .history_buckets = 64};
    options.param_series = {.recent_points = 64, .history_buckets = 16};
    auto opened = store::Journal::Open({.path = dir.db(), .block_steps = 16}, [this](const store::CommitReport& r) {
      if (registry) registry->OnCommit(r);
    });
    REQUIRE(opened.ok());
    journal = std::move(opened).value();
    registry = std::make_unique<RunRegistry>(options, 16, &stats, clock);
    registry->set_journal(journal.get());
    if (use_snapshots) {
      snapshots =
          std::make_unique<store::SnapshotStore>((dir.path() / "snapshots").string(), Run::SnapshotFingerprint());
      registry->set_snapshots(snapshots.get());
    }
    REQUIRE(registry->Load().ok());
  }
  ~Daemon() { journal->Stop(); }

  std::shared_ptr<Run> Attach(std::optional<uint64_t> resume = std::nullopt) {
    AttachInfo info;
    IngestError error;
    auto run = registry->Attach(Hello(resume), 0, &sink, &info, &error);
    INFO(error.message);
    REQUIRE(run);
    return run;
  }
  void Feed(uint64_t from, uint64_t to) {
    auto run = Attach();
    for (uint64_t s = from; s <= to; ++s) REQUIRE_FALSE(run->AddStep(0, Step(s), &sink));
    REQUIRE(journal->Flush().ok());
    run->Detach(0, &sink);
  }
  std::string Dump() const {
    auto run = registry->Find(kRun);
    REQUIRE(run);
    return ::Dump(*run);
  }
};

}  // namespace

TEST_CASE("a run restored from its snapshot and the journal's tail equals one rebuilt from the whole journal",
          "[runs][snapshot]") {
  TempDir dir;
  FakeClock clock;
  std::string live;
  {
    Daemon d(dir, &clock, true);
    d.Feed(0, 2999);
    REQUIRE(d.registry->Find(kRun)->AddEvent({3000, "routing switch", "trainer", 1.7e9}) == std::nullopt);
    d.Feed(3000, 4999);
    const auto report = d.registry->SaveSnapshots();
    CHECK(report.written == 1);
    CHECK(report.bytes > 0);
    CHECK(d.registry->SaveSnapshots().unchanged == 1);  // nothing new: not written again
    // The tail: steps and an event after the snapshot.
    d.Feed(5000, 6499);
    REQUIRE(d.registry->Find(kRun)->AddEvent({6000, "lr warmup restarted", "trainer", 1.7e9}) == std::nullopt);
    d.Feed(6500, 6999);
    REQUIRE(d.journal->Flush().ok());
    live = d.Dump();
  }
  std::string from_snapshot;
  {
    Daemon d(dir, &clock, true);
    CHECK(d.stats.runs_restored_from_snapshot == 1);
    from_snapshot = d.Dump();
    // It goes on like the live run would have.
    d.Feed(7000, 7999);
    from_snapshot += d.Dump();
  }
  Daemon replayed(dir, &clock, false);
  CHECK(replayed.stats.runs_restored_from_snapshot == 0);
  CHECK(from_snapshot.substr(0, live.size()) == live);
  CHECK(from_snapshot.find("change params/norm/final_norm.weight routing switch") != std::string::npos);
  // The whole journal replayed, the last 1,000 steps included.
  CHECK(replayed.Dump() == from_snapshot.substr(live.size()));
}

TEST_CASE("a snapshot the run rewound past is not used, and one taken after the rewind is", "[runs][snapshot]") {
  TempDir dir;
  FakeClock clock;
  {
    Daemon d(dir, &clock, true);
    d.Feed(0, 3999);
    REQUIRE(d.registry->SaveSnapshots().written == 1);
    auto run = d.Attach(/*resume=*/3000);
    for (uint64_t s = 3000; s <= 3499; ++s) REQUIRE_FALSE(run->AddStep(0, Step(s + 7), &d.sink));
    REQUIRE(d.journal->Flush().ok());
    run->Detach(0, &d.sink);
  }
  std::string rebuilt;
  {
    Daemon d(dir, &clock, true);
    CHECK(d.stats.runs_restored_from_snapshot == 0);
    rebuilt = d.Dump();
    REQUIRE(d.registry->SaveSnapshots().written == 1);  // on the new branch
  }
  {
    Daemon d(dir, &clock, true);
    CHECK(d.stats.runs_restored_from_snapshot == 1);
    CHECK(d.Dump() == rebuilt);
  }
  Daemon replayed(dir, &clock, false);
  CHECK(replayed.Dump() == rebuilt);
}

TEST_CASE("a snapshot cut short or with bytes changed leaves the run to the journal, whole and unharmed",
          "[runs][snapshot]") {
  TempDir dir;
  FakeClock clock;
  {
    Daemon d(dir, &clock, true);
    d.Feed(0, 2499);
    REQUIRE(d.registry->SaveSnapshots().written == 1);
  }
  const std::string expected = Daemon(dir, &clock, false).Dump();
  const store::SnapshotStore store((dir.path() / "snapshots").string(), Run::SnapshotFingerprint());
  const std::string payload = store.Read(kRun).value();
  std::mt19937 rng(11);
  // Cut at a sample of lengths, and bytes changed at random (a damaged snapshot behind a good CRC:
  // the run's own checks must catch what they can, and never crash on the rest).
  std::vector<std::string> damaged;
  for (size_t n = 0; n < payload.size(); n += 1 + payload.size() / 23) damaged.push_back(payload.substr(0, n));
  for (int i = 0; i < 8; ++i) {
    std::string bad = payload;
    bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
    damaged.push_back(bad);
  }
  size_t refused = 0;
  for (const std::string& bytes : damaged) {
    REQUIRE(store.Write(kRun, bytes).ok());
    Daemon d(dir, &clock, true);
    if (d.stats.runs_restored_from_snapshot == 0) {
      ++refused;
      CHECK(d.Dump() == expected);
    }
  }
  CHECK(refused >= damaged.size() - 8);  // every truncation
}

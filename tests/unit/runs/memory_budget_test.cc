// Bounded memory from any input: the budget refuses a catalog before anything of it is allocated
// or journaled, a run's memory grows with what it reports, and a journaled run the daemon cannot
// hold is skipped at start instead of failing every start.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "server/runs/memory_budget.h"
#include "server/runs/registry.h"
#include "server/runs/run_analytics.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using gradwatch::runs::testing::RecordingSink;
using gradwatch::testing::TempDir;
namespace fs = std::filesystem;

namespace {

RunMeta Hello(const std::string& id, size_t params) {
  RunMeta m;
  m.run_id = id;
  m.world_size = 1;
  m.params.reserve(params);
  for (size_t i = 0; i < params; ++i) {
    m.params.push_back({.name = "layers." + std::to_string(i) + ".weight", .numel = 4096, .kind = ParamKind::kMlp});
  }
  return m;
}

RankStep Step(uint64_t step, uint32_t param) {
  RankStep r;
  r.step = step;
  r.params.push_back({.index = param, .norms = {NormContribution::FromNorm(1.0 + 1e-3 * step), {}, {}}});
  return r;
}

}  // namespace

TEST_CASE("the budget charges only within its limit", "[runs]") {
  MemoryBudget budget(1000);
  CHECK(budget.TryCharge(600));
  CHECK_FALSE(budget.TryCharge(401));
  CHECK(budget.used() == 600);
  CHECK(budget.TryCharge(400));
  CHECK_FALSE(budget.TryCharge(1));
  budget.Release(1000);
  CHECK(budget.used() == 0);
  CHECK_FALSE(budget.TryCharge(1001));
  MemoryBudget unlimited(0);
  CHECK(unlimited.TryCharge(uint64_t{1} << 62));
  CHECK(MemoryBudget::DefaultLimitBytes() > 0);
}

TEST_CASE("a catalog's charge grows with its entries and their names", "[runs]") {
  const RunMeta small = Hello("r", 10);
  const RunMeta large = Hello("r", 1000);
  CHECK(MemoryBudget::CatalogBytes(small.params) > 10 * 1000);
  CHECK(MemoryBudget::CatalogBytes(large.params) ==
        Approx(100.0 * MemoryBudget::CatalogBytes(small.params)).epsilon(0.05));
  CHECK(MemoryBudget::CatalogBytes(large.params, 990) < MemoryBudget::CatalogBytes(small.params) * 1.01);
}

TEST_CASE("a run's memory grows with what it reports, not with its catalog", "[runs]") {
  FakeClock clock;
  RunOptions options;
  MemoryBudget budget(0);
  options.budget = &budget;
  const RunMeta meta = Hello("big", 65536);
  REQUIRE(budget.TryCharge(MemoryBudget::CatalogBytes(meta.params)));
  Run run(meta, options, nullptr, nullptr, &clock, true);
  run.AdoptCharge(MemoryBudget::CatalogBytes(meta.params));
  // Series hold no buffers until they report: the full-size series of the old code held about
  // 290 KB each, 57 GB for this catalog.
  const size_t empty = run.MemoryBytes();
  CHECK(empty < 65536 * 3 * 256);
  RecordingSink sink;
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info));
  for (uint64_t s = 1; s <= 100; ++s) REQUIRE_FALSE(run.AddStep(0, Step(s, 7), &sink));
  run.Tick();
  const size_t reported = run.MemoryBytes();
  CHECK(reported > empty);
  // Two series report (the parameter and the derived total), 100 points each at most: 2 × 128
  // points of 56 bytes, plus the history they have not started.
  CHECK(reported - empty < 2 * 128 * sizeof(store::Point) + 1024);
  // Their analytics trackers are charged at full size when they first report (about 19 KB each
  // with 40-byte slope buckets).
  const uint64_t analytics = run.ChargedBytes() - MemoryBudget::CatalogBytes(meta.params) - (reported - empty);
  CHECK(analytics > 2 * 16 * 1024);
  CHECK(analytics < 2 * 100 * 1024);
  CHECK(budget.used() == run.ChargedBytes());
}

TEST_CASE("a hello beyond the memory budget is refused and nothing of it is journaled", "[runs]") {
  TempDir dir;
  FakeClock clock;
  DaemonStats stats;
  RecordingSink sink;
  auto journal = store::Journal::Open({.path = dir.db()}, nullptr);
  REQUIRE(journal.ok());
  const RunMeta small = Hello("small", 10);
  const RunMeta big = Hello("big", 65536);
  MemoryBudget budget(MemoryBudget::CatalogBytes(small.params) * 3);
  RunOptions options;
  options.budget = &budget;
  {
    RunRegistry registry(options, 8, &stats, &clock);
    registry.set_journal(journal->get());
    AttachInfo info;
    IngestError error;
    REQUIRE(registry.Attach(small, 0, &sink, &info, &error));
    const uint64_t used = budget.used();
    CHECK(registry.Attach(big, 0, &sink, &info, &error) == nullptr);
    CHECK(error.reason == IngestErrorReason::kLimitExceeded);
    CHECK_THAT(error.message, Catch::Contains("limits.memory_budget_bytes"));
    CHECK(registry.Find("big") == nullptr);
    CHECK(budget.used() == used);

    // Extending a held run's catalog is charged too, before it is journaled.
    RunMeta grown = Hello("small", 65536);
    CHECK(registry.Attach(grown, 0, &sink, &info, &error) == nullptr);
    CHECK(error.reason == IngestErrorReason::kLimitExceeded);
    CHECK(registry.Find("small")->Summary().params.size() == 10);
    REQUIRE((*journal)->Flush().ok());
  }
  CHECK(budget.used() == 0);  // the runs released their charges

  RunRegistry restarted(options, 8, &stats, &clock);
  restarted.set_journal(journal->get());
  REQUIRE(restarted.Load().ok());
  CHECK(restarted.run_count() == 1);
  CHECK(restarted.Find("big") == nullptr);
  REQUIRE(restarted.Find("small"));
  CHECK(restarted.Find("small")->Summary().params.size() == 10);
}

TEST_CASE("a journaled run beyond the budget is skipped at start, counted, and the rest restored", "[runs]") {
  TempDir dir;
  FakeClock clock;
  RecordingSink sink;
  auto journal = store::Journal::Open({.path = dir.db()}, nullptr);
  REQUIRE(journal.ok());
  const RunMeta small = Hello("small", 10);
  const RunMeta big = Hello("big", 2000);
  {
    DaemonStats stats;
    RunOptions options;  // no budget when they were created
    RunRegistry registry(options, 8, &stats, &clock);
    registry.set_journal(journal->get());
    AttachInfo info;
    IngestError error;
    REQUIRE(registry.Attach(big, 0, &sink, &info, &error));
    REQUIRE(registry.Attach(small, 0, &sink, &info, &error));
    REQUIRE((*journal)->Flush().ok());
  }
  DaemonStats stats;
  MemoryBudget budget(MemoryBudget::CatalogBytes(big.params) / 2);
  RunOptions options;
  options.budget = &budget;
  RunRegistry restarted(options, 8, &stats, &clock);
  restarted.set_journal(journal->get());
  REQUIRE(restarted.Load().ok());
  CHECK(restarted.Find("big") == nullptr);
  CHECK(restarted.Find("small") != nullptr);
  CHECK(stats.runs_not_restored.load() == 1);

  // Its trainer coming back is refused, not crashed.
  AttachInfo info;
  IngestError error;
  CHECK(restarted.Attach(big, 0, &sink, &info, &error) == nullptr);
  CHECK(error.reason == IngestErrorReason::kLimitExceeded);
}

TEST_CASE("series stop growing when the budget is spent, and keep every step", "[runs]") {
  FakeClock clock;
  RunOptions options;
  const RunMeta meta = Hello("tight", 8);
  const uint64_t catalog = MemoryBudget::CatalogBytes(meta.params);
  // Room for the catalog and a few KB of series: far less than 9 full series (~2.6 MB).
  MemoryBudget budget(catalog + 16 * 1024);
  options.budget = &budget;
  REQUIRE(budget.TryCharge(catalog));
  Run run(meta, options, nullptr, nullptr, &clock, true);
  run.AdoptCharge(catalog);
  RecordingSink sink;
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info));
  for (uint64_t s = 1; s <= 20000; ++s) {
    RankStep r;
    r.step = s;
    for (uint32_t p = 0; p < 8; ++p) {
      r.params.push_back({.index = p, .norms = {NormContribution::FromNorm(1.0 + 1e-4 * s), {}, {}}});
    }
    REQUIRE_FALSE(run.AddStep(0, r, &sink));
  }
  // The first buffers of each series are always allowed; nothing grows past the budget.
  CHECK(budget.used() <= budget.limit() + 9 * store::Series::FloorBytes());
  CHECK(run.Info().step_count == 20000);
  const auto points = run.QuerySeries("grad/norm/layers.3.weight", 0, UINT64_MAX, 0);
  REQUIRE(points);
  uint64_t count = 0;
  for (const auto& p : *points) count += p.count;
  CHECK(count == 20000);
  CHECK(points->back().last_step == 20000);
}

namespace {

std::vector<ParamInfo> NormGainCatalog() {
  return {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain}};
}

CompletedStep AnalyticsStep(uint64_t step) {
  CompletedStep s;
  s.step = step;
  s.values = {{0, 0.3 + 1e-5 * static_cast<double>(step)}, {1, 2.0}, {2, 78.4 + 1e-3 * static_cast<double>(step)}};
  return s;
}

RunAnalytics MakeAnalytics(MemoryBudget* budget, DaemonStats* stats) {
  RunAnalytics a({}, {budget, stats, "r"});
  a.SetCatalog(NormGainCatalog());
  a.AddSeries(0, "grad/norm/total");
  a.AddSeries(1, "train/loss");
  a.AddSeries(2, "params/norm/final_norm.weight");
  return a;
}

}  // namespace

TEST_CASE("analytics are charged when a series first reports and released with them", "[runs]") {
  MemoryBudget budget(0);
  uint64_t full = 0;
  {
    RunAnalytics a = MakeAnalytics(&budget, nullptr);
    CHECK(budget.used() == 0);  // nothing reported yet
    a.OnStep(AnalyticsStep(1));
    full = budget.used();
    CHECK(a.charged_bytes() == full);
    // Three key series (total grad norm, loss, a norm gain without decay): about 38 KB each.
    CHECK(full > 3 * 30 * 1024);
    CHECK(full < 3 * 120 * 1024);
    for (uint64_t s = 2; s <= 30000; ++s) a.OnStep(AnalyticsStep(s));
    CHECK(budget.used() == full);  // charged at full size once: their growth costs nothing more
    CHECK_FALSE(a.Analysis().slopes.empty());
  }
  CHECK(budget.used() == 0);  // released when the analytics go (run dropped, or rewound)
}

TEST_CASE("a series whose analytics do not fit gets none, counted, and its run goes on", "[runs]") {
  uint64_t one = 0;
  {
    MemoryBudget unlimited(0);
    RunAnalytics a({}, {&unlimited, nullptr, "r"});
    a.AddSeries(0, "grad/norm/total");
    a.OnStep(AnalyticsStep(1));
    one = unlimited.used();
  }
  // Room for the first series' trackers, not for the others'.
  MemoryBudget budget(one + 1024);
  DaemonStats stats;
  RunAnalytics a = MakeAnalytics(&budget, &stats);
  for (uint64_t s = 1; s <= 3000; ++s) a.OnStep(AnalyticsStep(s));
  CHECK(a.refused_series() == 2);
  CHECK(stats.analytics_refused_series.load() == 2);
  CHECK(budget.used() == one);
  const RunAnalysis r = a.Analysis();
  for (const auto& sl : r.slopes) CHECK(sl.key == "grad/norm/total");
  CHECK_FALSE(r.slopes.empty());
  CHECK(r.forecasts.size() == 1);         // the total grad norm's, which fitted
  CHECK(r.growth_without_decay.empty());  // the norm series has no trackers
}

TEST_CASE("a resume that changes the world's size is charged or released, and the events it drops are released",
          "[runs]") {
  TempDir dir;
  FakeClock clock;
  DaemonStats stats;
  RecordingSink sink;
  auto journal = store::Journal::Open({.path = dir.db()}, nullptr);
  REQUIRE(journal.ok());
  RunOptions options;
  MemoryBudget budget(64u << 20);
  options.budget = &budget;
  RunRegistry registry(options, 8, &stats, &clock);
  registry.set_journal(journal->get());
  RunMeta hello = Hello("elastic", 4);
  hello.world_size = 4;
  AttachInfo info;
  IngestError error;
  auto run = registry.Attach(hello, 0, &sink, &info, &error);
  REQUIRE(run);
  for (uint64_t s = 1; s <= 100; ++s) {
    EventRecord e{s, std::string(1000, 'x') + std::to_string(s), "trainer", 1.7e9};
    REQUIRE_FALSE(run->AddEvent(std::move(e)));
  }
  const uint64_t with_events = budget.used();

  // Resumed at step 51 on 4,096 ranks: 50 events of about 1 KB dropped, 4,092 ranks more charged.
  RunMeta wider = hello;
  wider.world_size = 4096;
  wider.resume_from_step = 51;
  REQUIRE(registry.Attach(wider, 0, &sink, &info, &error));
  const uint64_t ranks_more =
      MemoryBudget::RankBytes(4096, options.max_pending_steps) - MemoryBudget::RankBytes(4, options.max_pending_steps);
  // An event costs its record and its strings; the resume adds one of its own.
  auto event_bytes = [](const std::string& text, const std::string& source) {
    return sizeof(EventRecord) + text.size() + source.size();
  };
  uint64_t dropped = 0;
  for (uint64_t s = 51; s <= 100; ++s) dropped += event_bytes(std::string(1000, 'x') + std::to_string(s), "trainer");
  const uint64_t resumed = budget.used();
  CHECK(resumed ==
        with_events + ranks_more - dropped + event_bytes("resumed from the checkpoint at step 51", "daemon"));

  // A world beyond the budget is refused and changes nothing.
  RunMeta huge = hello;
  huge.world_size = 1u << 20;
  huge.resume_from_step = 40;
  CHECK(registry.Attach(huge, 0, &sink, &info, &error) == nullptr);
  CHECK(error.reason == IngestErrorReason::kLimitExceeded);
  CHECK_THAT(error.message, Catch::Contains("limits.memory_budget_bytes"));
  CHECK(run->Info().world_size == 4096);
  CHECK(budget.used() == resumed);

  // Back to 2 ranks at step 31: the ranks and 20 more events are released.
  RunMeta narrower = hello;
  narrower.world_size = 2;
  narrower.resume_from_step = 31;
  REQUIRE(registry.Attach(narrower, 0, &sink, &info, &error));
  const uint64_t ranks_less =
      MemoryBudget::RankBytes(4096, options.max_pending_steps) - MemoryBudget::RankBytes(2, options.max_pending_steps);
  uint64_t dropped_again = event_bytes("resumed from the checkpoint at step 51", "daemon");
  for (uint64_t s = 31; s <= 50; ++s) {
    dropped_again += event_bytes(std::string(1000, 'x') + std::to_string(s), "trainer");
  }
  CHECK(budget.used() ==
        resumed - ranks_less - dropped_again + event_bytes("resumed from the checkpoint at step 31", "daemon"));
}

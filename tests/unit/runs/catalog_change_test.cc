// A run's catalog changes over its life: CatalogUpdate and a resuming Hello change entries from a
// step on, as events of the run that a rewind undoes and a restart reads back.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "server/runs/catalog_change.h"
#include "server/runs/registry.h"
#include "server/runs/run.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;
using Catch::Contains;
using gradwatch::runs::testing::RecordingSink;
using gradwatch::testing::TempDir;

namespace {

std::vector<ParamInfo> Catalog() {
  return {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
          {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1}};
}

RunMeta Meta(std::optional<uint64_t> resume = std::nullopt, std::vector<ParamInfo> params = Catalog()) {
  RunMeta m;
  m.run_id = "cat";
  m.params = std::move(params);
  m.resume_from_step = resume;
  return m;
}

RankStep Step(uint64_t step) {
  RankStep r;
  r.step = step;
  r.params.push_back({.index = 0, .norms = {NormContribution::FromNorm(0.01), NormContribution::FromNorm(80), {}}});
  r.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(1.0), {}, {}}});
  return r;
}

double WeightDecayOf(const Run& run, const std::string& name) {
  for (const ParamInfo& p : run.Summary().params) {
    if (p.name == name) return p.weight_decay;
  }
  FAIL("no parameter " << name);
  return -1;
}

size_t CatalogEvents(const Run& run) {
  size_t n = 0;
  for (const EventRecord& e : run.Summary().events) n += e.source == "catalog";
  return n;
}

const std::vector<ParamChange> kDecayFinalNorm = {{.name = "final_norm.weight", .weight_decay = 0.1}};

// A run without a journal, attached on `sink`, with steps 1..last.
struct Fixture {
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  Run run{Meta(), options, nullptr, &stats, &clock, true};
  RecordingSink sink;
  AttachInfo info;
  explicit Fixture(uint64_t last) {
    REQUIRE_FALSE(run.Attach(Meta(), 0, &sink, &info));
    for (uint64_t s = 1; s <= last; ++s) REQUIRE_FALSE(run.AddStep(0, Step(s), &sink));
  }
};

}  // namespace

TEST_CASE("a catalog change is checked, described and carried as data that reads back", "[runs][catalog]") {
  const std::vector<ParamInfo> catalog = Catalog();
  CHECK_FALSE(CheckCatalogChange(kDecayFinalNorm, catalog));
  CHECK_THAT(*CheckCatalogChange({{.name = "nope", .weight_decay = 0.1}}, catalog), Contains("'nope' is not in"));
  CHECK_THAT(*CheckCatalogChange({{.name = "final_norm.weight", .weight_decay = -1}}, catalog),
             Contains("finite and ≥ 0"));
  CHECK_THAT(*CheckCatalogChange({{.name = "final_norm.weight"}}, catalog), Contains("no field to change"));
  CHECK_THAT(*CheckCatalogChange({kDecayFinalNorm[0], kDecayFinalNorm[0]}, catalog), Contains("named twice"));
  CHECK(*CheckCatalogChange({}, catalog) == "the change names no parameter");

  const std::vector<ParamChange> change = {{.name = "final_norm.weight", .weight_decay = 0.05, .role = "final_norm"},
                                           {.name = "lm_head.weight", .kind = ParamKind::kOther, .group = "head"}};
  CHECK(DescribeCatalogChange(change, catalog) ==
        "catalog change: final_norm.weight weight decay 0 → 0.05, role \"\" → final_norm; lm_head.weight kind output "
        "→ other, group \"\" → head");
  auto parsed = ParseCatalogChangeData(CatalogChangeData(change));
  REQUIRE(parsed.ok());
  CHECK(*parsed == change);
  CHECK_FALSE(ParseCatalogChangeData("{").ok());
  CHECK_FALSE(ParseCatalogChangeData(R"([{"name": "x", "kind": "teapot"}])").ok());

  std::vector<ParamInfo> changed = catalog;
  const std::vector<ParamChange> undo = ApplyCatalogChange(change, changed);
  CHECK(changed[0].weight_decay == 0.05);
  CHECK(changed[1].kind == ParamKind::kOther);
  CHECK(CatalogDiff(catalog, changed) == change);
  ApplyCatalogChange(undo, changed);
  CHECK(changed == catalog);
}

TEST_CASE("a catalog update applies from its step on, once, as an event of the run", "[runs][catalog]") {
  Fixture f(10);
  Run& run = f.run;
  RecordingSink& sink = f.sink;

  // From step 12: not before that step completes.
  REQUIRE_FALSE(run.AddCatalogChange(12, kDecayFinalNorm, 0, 7, &sink));
  CHECK(sink.event_acks.size() == 1);  // no journal: acked at once
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0);
  REQUIRE(CatalogEvents(run) == 1);
  CHECK(run.Summary().events.back().text == "catalog change: final_norm.weight weight decay 0 → 0.1");
  REQUIRE_FALSE(run.AddStep(0, Step(11), &sink));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0);
  REQUIRE_FALSE(run.AddStep(0, Step(12), &sink));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0.1);

  // A resend is acked again and recorded once.
  REQUIRE_FALSE(run.AddCatalogChange(12, kDecayFinalNorm, 0, 8, &sink));
  CHECK(sink.event_acks.size() == 2);
  CHECK(CatalogEvents(run) == 1);

  // From a step already completed: at once.
  REQUIRE_FALSE(run.AddCatalogChange(5, {{.name = "lm_head.weight", .weight_decay = 0.2}}, 0, 9, &sink));
  CHECK(WeightDecayOf(run, "lm_head.weight") == 0.2);

  // A change the catalog cannot take is refused whole.
  const auto err = run.AddCatalogChange(
      13, {{.name = "final_norm.weight", .weight_decay = 0.3}, {.name = "nope", .weight_decay = 0.3}}, 0, 10, &sink);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kInvalidMessage);
  CHECK_THAT(err->message, Contains("'nope' is not in the run's catalog") && Contains("nothing of it is applied"));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0.1);
}

TEST_CASE("a rewind before a catalog change undoes it and a resuming hello's catalog applies from its resume step",
          "[runs][catalog]") {
  Fixture f(30);
  Run& run = f.run;
  RecordingSink& sink = f.sink;
  AttachInfo& info = f.info;
  REQUIRE_FALSE(run.AddCatalogChange(20, kDecayFinalNorm, 0, 1, &sink));
  REQUIRE(WeightDecayOf(run, "final_norm.weight") == 0.1);

  // The job resumes from its step-15 checkpoint with the catalog it had then: the change is gone.
  RecordingSink resumed;
  REQUIRE_FALSE(run.Attach(Meta(15), 0, &resumed, &info));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0);
  CHECK(CatalogEvents(run) == 0);

  // It resumes again from step 25, now with weight decay on the final norm in its own catalog.
  for (uint64_t s = 15; s <= 30; ++s) REQUIRE_FALSE(run.AddStep(0, Step(s), &resumed));
  std::vector<ParamInfo> remedied = Catalog();
  remedied[0].weight_decay = 0.05;
  RecordingSink again;
  REQUIRE_FALSE(run.Attach(Meta(25, remedied), 0, &again, &info));
  REQUIRE(CatalogEvents(run) == 1);
  CHECK(run.Summary().events.back().step == 25);
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0);  // from step 25, which the new branch has not reached
  REQUIRE_FALSE(run.AddStep(0, Step(25), &again));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0.05);

  // A plain hello (a reconnect) with another catalog changes nothing.
  RecordingSink reconnect;
  REQUIRE_FALSE(run.Attach(Meta(std::nullopt, Catalog()), 0, &reconnect, &info));
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0.05);
  // A different numel is another parameter: refused as before.
  std::vector<ParamInfo> other = Catalog();
  other[0].numel = 1;
  const auto err = run.Attach(Meta(std::nullopt, other), 0, &reconnect, &info);
  REQUIRE(err);
  CHECK(err->reason == IngestErrorReason::kCatalogMismatch);
}

TEST_CASE("catalog changes are journaled and read back at a restart, an abandoned one not", "[runs][catalog]") {
  TempDir dir;
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  {
    auto journal = store::Journal::Open({.path = dir.db()}, nullptr);
    REQUIRE(journal.ok());
    RunRegistry registry(options, 16, &stats, &clock);
    registry.set_journal(journal->get());
    REQUIRE(registry.Load().ok());
    RecordingSink sink;
    AttachInfo info;
    IngestError error;
    auto run = registry.Attach(Meta(), 0, &sink, &info, &error);
    REQUIRE(run);
    for (uint64_t s = 1; s <= 40; ++s) REQUIRE_FALSE(run->AddStep(0, Step(s), &sink));
    REQUIRE_FALSE(run->AddCatalogChange(10, {{.name = "lm_head.weight", .group = "head"}}, 0, 1, &sink));
    REQUIRE_FALSE(run->AddCatalogChange(30, kDecayFinalNorm, 0, 2, &sink));
    REQUIRE(WeightDecayOf(*run, "final_norm.weight") == 0.1);
    // The change at step 30 is abandoned by a resume from step 20, whose hello holds the catalog
    // as it was then.
    std::vector<ParamInfo> at_20 = Catalog();
    at_20[1].group = "head";
    RecordingSink resumed;
    auto again = registry.Attach(Meta(20, at_20), 0, &resumed, &info, &error);
    REQUIRE(again);
    for (uint64_t s = 20; s <= 35; ++s) REQUIRE_FALSE(again->AddStep(0, Step(s), &resumed));
    REQUIRE((*journal)->Flush().ok());
    CHECK(WeightDecayOf(*again, "final_norm.weight") == 0);
    again->Detach(0, &resumed);
  }
  auto journal = store::Journal::Open({.path = dir.db()}, nullptr);
  REQUIRE(journal.ok());
  RunRegistry registry(options, 16, &stats, &clock);
  registry.set_journal(journal->get());
  REQUIRE(registry.Load().ok());
  auto run = registry.Find("cat");
  REQUIRE(run);
  const RunSummary s = run->Summary();
  CHECK(s.params[0].weight_decay == 0);
  CHECK(s.params[1].group == "head");
  REQUIRE(CatalogEvents(*run) == 1);
  CHECK(s.events[0].text == "catalog change: lm_head.weight group \"\" → head");
}

TEST_CASE("a remediation check outlives a rewind after its change and goes with a rewind before it",
          "[runs][catalog]") {
  Fixture f(0);
  Run& run = f.run;
  RecordingSink& sink = f.sink;
  AttachInfo& info = f.info;
  // final_norm.weight grows 0.05 a step without decay, at learning rate 1e-3.
  const auto growing = [](uint64_t s) {
    RankStep r = Step(s);
    r.params[0].norms[1] = NormContribution::FromNorm(80 + 0.05 * static_cast<double>(s));
    r.learning_rate = 1e-3;
    return r;
  };
  for (uint64_t s = 1; s <= 300; ++s) REQUIRE_FALSE(run.AddStep(0, growing(s), &sink));
  REQUIRE_FALSE(run.AddCatalogChange(301, kDecayFinalNorm, 0, 1, &sink));
  for (uint64_t s = 301; s <= 400; ++s) REQUIRE_FALSE(run.AddStep(0, growing(s), &sink));
  REQUIRE(run.Summary().analysis.remediations.size() == 1);
  CHECK(run.Summary().analysis.remediations[0].step == 301);

  // Resumed from step 350: the change at 301 stands, and so does its check.
  RecordingSink resumed;
  REQUIRE_FALSE(run.Attach(Meta(350), 0, &resumed, &info));
  for (uint64_t s = 350; s <= 360; ++s) REQUIRE_FALSE(run.AddStep(0, growing(s), &resumed));
  REQUIRE(run.Summary().analysis.remediations.size() == 1);
  CHECK(run.Summary().analysis.remediations[0].step == 301);
  CHECK(run.Summary().analysis.remediations[0].norm_at_step == Approx(95));

  // Resumed from step 250: the change is undone, its check gone.
  RecordingSink earlier;
  REQUIRE_FALSE(run.Attach(Meta(250), 0, &earlier, &info));
  CHECK(run.Summary().analysis.remediations.empty());
  CHECK(WeightDecayOf(run, "final_norm.weight") == 0);
}

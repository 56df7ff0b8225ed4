#include <sqlite3.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "alerts/alert.h"
#include "server/core/types.h"
#include "server/store/alert_store.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"

using namespace gradwatch;
using namespace gradwatch::store;
using gradwatch::testing::TempDir;

namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed with everything in it at the end.
// Collects what Load hands out, in order.
struct Recorder : JournalVisitor {
  struct Run {
    RunMeta meta;
    double ended_at;
    RunEnd end;
  };
  struct Series {
    std::string run_id;
    SeriesId id;
    std::string key;
  };
  struct Step {
    std::string run_id;
    CompletedStep step;
  };
  struct Event {
    std::string run_id;
    EventRecord event;
  };
  std::vector<Run> runs;
  std::vector<Series> series;
  std::vector<RankProgress> progress;
  std::vector<Step> steps;
  std::vector<Event> events;
  std::vector<std::string> order;  // "run:a", "series:a", "progress:a", "step:a", "event:a"

  bool OnRun(const RunMeta& meta, const RunEnd& end) override {
    runs.push_back({meta, end.ended_at, end});
    order.push_back("run:" + meta.run_id);
    return skip.count(meta.run_id) == 0;
  }
  std::set<std::string> skip;  // runs OnRun declines
  void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) override {
    series.push_back({run_id, id, key});
    order.push_back("series:" + run_id);
  }
  void OnRankProgress(const RankProgress& p) override {
    progress.push_back(p);
    order.push_back("progress:" + p.run_id);
  }
  void OnStep(const std::string& run_id, const CompletedStep& step) override {
    steps.push_back({run_id, step});
    order.push_back("step:" + run_id);
  }
  void OnEvent(const std::string& run_id, const EventRecord& event) override {
    events.push_back({run_id, event});
    order.push_back("event:" + run_id);
  }
  std::vector<std::pair<std::string, uint64_t>> rewinds;
  void OnRewind(const std::string& run_id, uint64_t from_step) override {
    rewinds.emplace_back(run_id, from_step);
    order.push_back("rewind:" + run_id);
  }
  std::vector<std::pair<std::string, Status>> failed;
  void OnRunFailed(const std::string& run_id, const Status& why) override {
    failed.emplace_back(run_id, why);
    order.push_back("failed:" + run_id);
  }
};

std::unique_ptr<Journal> OpenOrFail(const JournalOptions& options, Journal::CommitCallback on_commit = nullptr) {
  auto journal = Journal::Open(options, std::move(on_commit));
  INFO(journal.status().ToString());
  REQUIRE(journal.ok());
  return std::move(journal).value();
}

Recorder LoadFrom(const std::string& path) {
  auto journal = OpenOrFail({.path = path});
  Recorder recorder;
  const Status s = journal->Load(recorder);
  INFO(s.ToString());
  REQUIRE(s.ok());
  return recorder;
}

StepJournalRecord MakeStep(const std::string& run_id, uint64_t step, std::vector<SeriesValue> values,
                           std::vector<RankProgress> progress = {}) {
  StepJournalRecord r;
  r.run_id = run_id;
  r.step.step = step;
  r.step.wall_time = 1.7e9 + static_cast<double>(step);
  r.step.ranks_reported = 2;
  r.step.values = std::move(values);
  r.progress = std::move(progress);
  return r;
}

uint64_t Bits(double v) { return std::bit_cast<uint64_t>(v); }

// A second connection, as another process would see the database.
class RawDb {
 public:
  explicit RawDb(const std::string& path, bool create = false) {
    REQUIRE(sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | (create ? SQLITE_OPEN_CREATE : 0), nullptr) ==
            SQLITE_OK);
    sqlite3_busy_timeout(db_, 5000);
  }
  ~RawDb() { sqlite3_close(db_); }
  void Exec(const std::string& sql) {
    char* err = nullptr;
    const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
    INFO((err ? err : ""));
    sqlite3_free(err);
    REQUIRE(rc == SQLITE_OK);
  }
  // The first column of the first row as text; empty without a row.
  std::string Query(const std::string& sql) {
    sqlite3_stmt* stmt = nullptr;
    REQUIRE(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK);
    std::string out;
    if (sqlite3_step(stmt) == SQLITE_ROW) {
      const auto* text = sqlite3_column_text(stmt, 0);
      if (text) out = reinterpret_cast<const char*>(text);
    }
    sqlite3_finalize(stmt);
    return out;
  }

 private:
  sqlite3* db_ = nullptr;
};

// Counts stored steps on a connection of its own; -1 on error. Free of Catch2 macros, which
// must not run on the journal's thread.
int64_t CountStepsOutside(const std::string& path) {
  sqlite3* db = nullptr;
  sqlite3_stmt* stmt = nullptr;
  int64_t count = -1;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK &&
      sqlite3_prepare_v2(db, "SELECT count(*) FROM steps", -1, &stmt, nullptr) == SQLITE_OK &&
      sqlite3_step(stmt) == SQLITE_ROW) {
    count = sqlite3_column_int64(stmt, 0);
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return count;
}

}  // namespace

TEST_CASE("journal round-trips runs, catalogs, series, steps, events and progress through reopen", "[store]") {
  TempDir dir;
  const double kNaN = std::numeric_limits<double>::quiet_NaN();
  const double kPayloadNaN = std::bit_cast<double>(uint64_t{0x7ff8dead'beef0001});
  const double kInf = std::numeric_limits<double>::infinity();

  RunMeta moe;
  moe.run_id = "moe-6144";
  moe.world_size = 64;
  moe.labels = {{"team", "pretrain"}, {"cluster", "a3"}};
  moe.config.hidden_size = 6144;
  moe.config.z_loss_coef = 1e-4;
  moe.config.optimizer = "adamw";
  moe.config.weight_decay = 0.1;
  moe.config.extra = {{"routing", "dropless"}};
  moe.created_at = 1'700'000'000.5;

  RunMeta small;
  small.run_id = "small";
  small.config.optimizer = "sgd";
  small.created_at = 1'700'000'100.0;

  std::vector<ParamInfo> params(2);
  params[0].name = "final_norm.weight";
  params[0].numel = 6144;
  params[0].kind = ParamKind::kNormGain;
  params[0].init_norm = std::sqrt(6144.0);
  params[0].role = "final_norm";
  params[1].name = "lm_head.weight";
  params[1].numel = 788'000'000;
  params[1].kind = ParamKind::kOutput;
  params[1].weight_decay = 0.1;
  params[1].group = "head";

  {
    auto journal = OpenOrFail({.path = dir.db()});
    // Enqueued out of creation order: Load orders runs by created_at.
    REQUIRE(journal->Enqueue(RunRecord{small}));
    REQUIRE(journal->Enqueue(RunRecord{moe}));
    REQUIRE(journal->Enqueue(ParamsRecord{"moe-6144", 0, {params[0]}}));
    REQUIRE(journal->Enqueue(ParamsRecord{"moe-6144", 1, {params[1]}}));
    REQUIRE(journal->Enqueue(SeriesRecord{"moe-6144", 0, "grad/norm/total"}));
    REQUIRE(journal->Enqueue(SeriesRecord{"moe-6144", 1, "params/norm/final_norm.weight"}));
    REQUIRE(journal->Enqueue(SeriesRecord{"small", 0, "train/loss"}));
    REQUIRE(journal->Enqueue(MakeStep("moe-6144", 81716, {{0, 0.59}, {1, 360.25}},
                                      {{"moe-6144", 0, 81716, 900}, {"moe-6144", 1, 81716, 901}})));
    StepJournalRecord odd = MakeStep("moe-6144", 81717, {{0, kNaN}, {1, kInf}, {2, -kInf}, {3, kPayloadNaN}});
    odd.step.partial = true;
    odd.step.client_dropped_steps = 3;
    REQUIRE(journal->Enqueue(odd));
    REQUIRE(journal->Enqueue(MakeStep("small", 1, {})));
    REQUIRE(journal->Enqueue(EventJournalRecord{"moe-6144", {81716, "dropless EP on", "trainer", 1.7e9}}));
    REQUIRE(journal->Enqueue(EventJournalRecord{"small", {1, "note", "annotate", 1.8e9}}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"small", 1'700'000'200.0}));
    REQUIRE(journal->Flush().ok());
    journal->Stop();
  }

  const Recorder got = LoadFrom(dir.db());

  CHECK(got.order == std::vector<std::string>{"run:moe-6144", "series:moe-6144", "series:moe-6144", "progress:moe-6144",
                                              "progress:moe-6144", "event:moe-6144", "step:moe-6144", "step:moe-6144",
                                              "run:small", "series:small", "event:small", "step:small"});

  REQUIRE(got.runs.size() == 2);
  const RunMeta& loaded = got.runs[0].meta;
  CHECK(loaded.run_id == moe.run_id);
  CHECK(loaded.world_size == 64);
  CHECK(loaded.labels == moe.labels);
  CHECK(loaded.config == moe.config);
  CHECK(loaded.created_at == moe.created_at);
  CHECK(loaded.params == params);
  CHECK(got.runs[0].ended_at == 0);
  CHECK(got.runs[0].meta.params[0].init_norm.has_value());
  CHECK_FALSE(got.runs[0].meta.params[1].init_norm.has_value());
  CHECK(got.runs[1].meta.run_id == "small");
  CHECK_FALSE(got.runs[1].meta.config.z_loss_coef.has_value());
  CHECK_FALSE(got.runs[1].meta.config.weight_decay.has_value());
  CHECK(got.runs[1].meta.params.empty());
  CHECK(got.runs[1].ended_at == 1'700'000'200.0);

  REQUIRE(got.series.size() == 3);
  CHECK(got.series[1].id == 1);
  CHECK(got.series[1].key == "params/norm/final_norm.weight");

  REQUIRE(got.progress.size() == 2);
  CHECK(got.progress[1].rank == 1);
  CHECK(got.progress[1].step == 81716);
  CHECK(got.progress[1].seq == 901);

  REQUIRE(got.steps.size() == 3);
  const CompletedStep& first = got.steps[0].step;
  CHECK(first.step == 81716);
  CHECK(first.wall_time == 1.7e9 + 81716);
  CHECK_FALSE(first.partial);
  CHECK(first.ranks_reported == 2);
  REQUIRE(first.values.size() == 2);
  CHECK(first.values[1].id == 1);
  CHECK(first.values[1].value == 360.25);

  const CompletedStep& second = got.steps[1].step;
  CHECK(second.partial);
  CHECK(second.client_dropped_steps == 3);
  REQUIRE(second.values.size() == 4);
  CHECK(Bits(second.values[0].value) == Bits(kNaN));
  CHECK(Bits(second.values[1].value) == Bits(kInf));
  CHECK(Bits(second.values[2].value) == Bits(-kInf));
  CHECK(Bits(second.values[3].value) == Bits(kPayloadNaN));
  CHECK(second.values[3].id == 3);
  CHECK(got.steps[2].step.values.empty());

  REQUIRE(got.events.size() == 2);
  CHECK(got.events[0].event.text == "dropless EP on");
  CHECK(got.events[0].event.step == 81716);
  CHECK(got.events[0].event.source == "trainer");
  CHECK(got.events[1].event.recorded_at == 1.8e9);
}

TEST_CASE("ending a run with ended_at 0 marks it active again", "[store]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "r";
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"r", 5.0}));
    REQUIRE(journal->Flush().ok());
    Recorder ended;
    REQUIRE(journal->Load(ended).ok());
    REQUIRE(ended.runs.size() == 1);
    CHECK(ended.runs[0].ended_at == 5.0);
    REQUIRE(journal->Enqueue(RunEndedRecord{"r", 0}));
    REQUIRE(journal->Flush().ok());
  }
  const Recorder got = LoadFrom(dir.db());
  REQUIRE(got.runs.size() == 1);
  CHECK(got.runs[0].ended_at == 0);
}

TEST_CASE("how a run ended survives, and only a Goodbye's end is reported as a clean end", "[store]") {
  TempDir dir;
  std::mutex mu;
  std::vector<std::string> clean;
  {
    auto journal = OpenOrFail({.path = dir.db()}, [&](const CommitReport& report) {
      std::lock_guard<std::mutex> lock(mu);
      clean.insert(clean.end(), report.clean_ends.begin(), report.clean_ends.end());
    });
    for (const char* id : {"done", "stopped", "dead", "back"}) {
      RunMeta meta;
      meta.run_id = id;
      REQUIRE(journal->Enqueue(RunRecord{meta}));
    }
    REQUIRE(journal->Enqueue(RunEndedRecord{"done", 10.0, EndReason::kFinished, "reached max_steps"}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"stopped", 11.0, EndReason::kStopped, "cancelled"}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"dead", 12.0}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"back", 13.0, EndReason::kFinished, "first stage"}));
    REQUIRE(journal->Enqueue(RunEndedRecord{"back", 0, EndReason::kNone, {}}));
    REQUIRE(journal->Flush().ok());
  }
  CHECK(clean == std::vector<std::string>{"done", "stopped", "back"});
  const Recorder got = LoadFrom(dir.db());
  std::map<std::string, RunEnd> ends;
  for (const auto& r : got.runs) ends[r.meta.run_id] = r.end;
  CHECK(ends["done"] == RunEnd{10.0, EndReason::kFinished, "reached max_steps"});
  CHECK(ends["stopped"] == RunEnd{11.0, EndReason::kStopped, "cancelled"});
  CHECK(ends["dead"] == RunEnd{12.0, EndReason::kInactive, ""});
  CHECK(ends["back"] == RunEnd{});
}

TEST_CASE("a version 1 journal is migrated: its ended runs ended by inactivity", "[store]") {
  TempDir dir;
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(dir.db().c_str(), &db) == SQLITE_OK);
    const char* v1 =
        "CREATE TABLE runs(run_id TEXT PRIMARY KEY, world_size INTEGER NOT NULL, labels_json TEXT NOT NULL, "
        "config_json TEXT NOT NULL, created_at REAL NOT NULL, ended_at REAL);"
        "CREATE TABLE params(run_id TEXT NOT NULL, idx INTEGER NOT NULL, name TEXT NOT NULL, numel INTEGER NOT "
        "NULL, kind INTEGER NOT NULL, weight_decay REAL NOT NULL, init_norm REAL, role TEXT NOT NULL, grp TEXT NOT "
        "NULL, PRIMARY KEY(run_id, idx));"
        "CREATE TABLE series(run_id TEXT NOT NULL, id INTEGER NOT NULL, key TEXT NOT NULL, PRIMARY KEY(run_id, id));"
        "CREATE TABLE steps(run_id TEXT NOT NULL, step INTEGER NOT NULL, wall_time REAL NOT NULL, partial INTEGER "
        "NOT NULL, ranks_reported INTEGER NOT NULL, client_dropped INTEGER NOT NULL, vals BLOB NOT NULL, PRIMARY "
        "KEY(run_id, step)) WITHOUT ROWID;"
        "CREATE TABLE rank_progress(run_id TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL, seq "
        "INTEGER NOT NULL, PRIMARY KEY(run_id, rank));"
        "CREATE TABLE events(id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, step INTEGER NOT NULL, text TEXT NOT "
        "NULL, source TEXT NOT NULL, recorded_at REAL NOT NULL);"
        "INSERT INTO runs VALUES('old', 1, '{}', '{}', 1.0, 5.0);"
        "INSERT INTO runs VALUES('live', 1, '{}', '{}', 2.0, NULL);"
        "PRAGMA user_version = 1;";
    REQUIRE(sqlite3_exec(db, v1, nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  const Recorder got = LoadFrom(dir.db());
  REQUIRE(got.runs.size() == 2);
  CHECK(got.runs[0].end == RunEnd{5.0, EndReason::kInactive, ""});
  CHECK(got.runs[1].end == RunEnd{});
  RawDb raw(dir.db());
  CHECK(raw.Query("PRAGMA user_version") == "5");
}

TEST_CASE("progress is reported after commit, merged to one entry per run and rank", "[store]") {
  TempDir dir;
  std::mutex mu;
  std::vector<CommitReport> reports;
  std::vector<int64_t> visible_in_callback;
  // A long window holds the records together until Flush cuts it short.
  JournalOptions options{.path = dir.db(), .max_delay = std::chrono::seconds(5)};
  auto journal = OpenOrFail(options, [&](const CommitReport& report) {
    // What another connection sees at callback time is what the commit made durable.
    const int64_t visible = CountStepsOutside(dir.db());
    std::lock_guard<std::mutex> lock(mu);
    visible_in_callback.push_back(visible);
    reports.push_back(report);
  });

  REQUIRE(journal->Enqueue(MakeStep("a", 1, {{0, 1.0}}, {{"a", 0, 1, 10}, {"a", 1, 1, 11}})));
  REQUIRE(journal->Enqueue(MakeStep("a", 2, {{0, 2.0}}, {{"a", 0, 2, 20}, {"a", 1, 2, 21}})));
  REQUIRE(journal->Enqueue(MakeStep("a", 3, {{0, 3.0}}, {{"a", 0, 3, 30}})));
  REQUIRE(journal->Enqueue(MakeStep("b", 7, {{0, 3.0}}, {{"b", 0, 7, 70}})));
  {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(reports.empty());  // nothing is durable before its commit
  }
  REQUIRE(journal->Flush().ok());

  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(reports.size() == 1);
  CHECK(visible_in_callback[0] == 4);
  CHECK(reports[0].records == 4);
  CHECK(reports[0].duration.count() >= 0);
  const auto& p = reports[0].progress;
  REQUIRE(p.size() == 3);
  CHECK((p[0].run_id == "a" && p[0].rank == 0 && p[0].step == 3 && p[0].seq == 30));
  CHECK((p[1].run_id == "a" && p[1].rank == 1 && p[1].step == 2 && p[1].seq == 21));
  CHECK((p[2].run_id == "b" && p[2].rank == 0 && p[2].step == 7 && p[2].seq == 70));
}

TEST_CASE("stored rank progress never moves backwards", "[store]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "a";
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(MakeStep("a", 10, {}, {{"a", 0, 10, 100}})));
    REQUIRE(journal->Flush().ok());
    // An older step re-completed later (a late rank) must not rewind rank 0's progress.
    REQUIRE(journal->Enqueue(MakeStep("a", 5, {}, {{"a", 0, 5, 50}, {"a", 1, 5, 51}})));
    REQUIRE(journal->Flush().ok());
  }
  const Recorder got = LoadFrom(dir.db());
  REQUIRE(got.progress.size() == 2);
  CHECK(got.progress[0].rank == 0);
  CHECK(got.progress[0].step == 10);
  CHECK(got.progress[0].seq == 100);
  CHECK(got.progress[1].rank == 1);
  CHECK(got.progress[1].step == 5);
  CHECK(got.progress[1].seq == 51);
}

TEST_CASE("group commit puts many records in few transactions", "[store]") {
  TempDir dir;
  std::atomic<size_t> reported{0};
  auto journal = OpenOrFail({.path = dir.db()}, [&](const CommitReport& report) { reported += report.records; });
  constexpr uint64_t kSteps = 10'000;
  for (uint64_t s = 0; s < kSteps; ++s) {
    REQUIRE(journal->Enqueue(MakeStep("run", s, {{0, static_cast<double>(s)}}, {{"run", 0, s, s}})));
  }
  REQUIRE(journal->Flush().ok());
  CHECK(journal->stats().queue_depth == 0);
  CHECK(reported == kSteps);
  CHECK(journal->stats().commits >= 1);
  CHECK(journal->stats().commits < kSteps / 10);
  CHECK(journal->stats().failed_commits == 0);
  journal->Stop();

  RawDb raw(dir.db());
  // Every step is in a row of its own or sealed in a block.
  CHECK(raw.Query("SELECT (SELECT count(*) FROM steps) + (SELECT coalesce(sum(steps), 0) FROM step_blocks)") ==
        std::to_string(kSteps));
  CHECK(raw.Query("SELECT step FROM rank_progress WHERE run_id = 'run' AND rank = 0") == "9999");
}

TEST_CASE("enqueue after stop is refused and flush still returns", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()});
  REQUIRE(journal->Enqueue(MakeStep("a", 1, {{0, 1.0}})));
  journal->Stop();
  journal->Stop();  // idempotent
  CHECK_FALSE(journal->Enqueue(MakeStep("a", 2, {{0, 2.0}})));
  CHECK(journal->Flush().ok());
  Recorder recorder;
  CHECK(journal->Load(recorder).code() == StatusCode::kFailedPrecondition);
  // Stop committed what was queued before it.
  RawDb raw(dir.db());
  CHECK(raw.Query("SELECT count(*) FROM steps") == "1");
}

TEST_CASE("enqueue beyond queue_max is refused", "[store]") {
  TempDir dir;
  // The long window keeps the queued records waiting, so the queue fills.
  auto journal = OpenOrFail({.path = dir.db(), .max_delay = std::chrono::seconds(5), .queue_max = 2});
  CHECK(journal->Enqueue(MakeStep("a", 1, {})));
  CHECK(journal->Enqueue(MakeStep("a", 2, {})));
  CHECK_FALSE(journal->Enqueue(MakeStep("a", 3, {})));
  REQUIRE(journal->Flush().ok());
  CHECK(journal->Enqueue(MakeStep("a", 3, {})));
}

TEST_CASE("a re-completed step replaces the stored one", "[store]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "a";
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(MakeStep("a", 5, {{0, 1.0}})));
    REQUIRE(journal->Flush().ok());
    StepJournalRecord again = MakeStep("a", 5, {{0, 2.0}, {1, 3.0}});
    again.step.ranks_reported = 4;
    REQUIRE(journal->Enqueue(again));
    REQUIRE(journal->Flush().ok());
  }
  const Recorder got = LoadFrom(dir.db());
  REQUIRE(got.steps.size() == 1);
  CHECK(got.steps[0].step.ranks_reported == 4);
  REQUIRE(got.steps[0].step.values.size() == 2);
  CHECK(got.steps[0].step.values[0].value == 2.0);
}

TEST_CASE("opening a journal in a missing directory fails with a clear message", "[store]") {
  TempDir dir;
  const std::string path = (dir.path() / "no" / "such" / "dir" / "journal.db").string();
  auto journal = Journal::Open({.path = path}, nullptr);
  REQUIRE_FALSE(journal.ok());
  CHECK(journal.status().code() == StatusCode::kIoError);
  CHECK_THAT(journal.status().message(), Catch::Contains(path));
  CHECK_THAT(journal.status().message(), Catch::Contains("does not exist"));
}

TEST_CASE("the journal runs in WAL mode", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()});
  REQUIRE(journal->Enqueue(MakeStep("a", 1, {})));
  REQUIRE(journal->Flush().ok());
  CHECK(fs::exists(dir.db() + "-wal"));
  RawDb raw(dir.db());
  CHECK(raw.Query("PRAGMA journal_mode") == "wal");
  CHECK(raw.Query("PRAGMA user_version") == "5");
}

TEST_CASE("a failed commit is retried with its records, acked only once it succeeds", "[store]") {
  TempDir dir;
  std::mutex mu;
  std::vector<RankProgress> acked;
  uint64_t committed_through = 0;
  auto journal = OpenOrFail({.path = dir.db()}, [&](const CommitReport& report) {
    std::lock_guard<std::mutex> lock(mu);
    acked.insert(acked.end(), report.progress.begin(), report.progress.end());
    committed_through = report.committed_through;
  });
  {
    // Fault injection from outside: step 13 cannot be written.
    RawDb raw(dir.db());
    raw.Exec(
        "CREATE TRIGGER fail_13 BEFORE INSERT ON steps WHEN NEW.step = 13 "
        "BEGIN SELECT RAISE(ABORT, 'injected fault'); END");
  }
  REQUIRE(journal->Enqueue(MakeStep("a", 13, {{0, 1.0}}, {{"a", 0, 13, 130}})) == 1);
  const Status failed = journal->Flush();
  CHECK_FALSE(failed.ok());
  CHECK_THAT(failed.message(), Catch::Contains("injected fault"));
  CHECK(journal->stats().failed_commits >= 1);
  CHECK(journal->stats().commits == 0);
  CHECK_FALSE(journal->healthy());
  CHECK_FALSE(journal->accepting());
  CHECK(journal->stats().storage_faults == 1);

  // A later record waits behind the failing one: nothing is acked, not even step 14.
  REQUIRE(journal->Enqueue(MakeStep("a", 14, {{0, 1.0}}, {{"a", 0, 14, 140}})) == 2);
  CHECK_FALSE(journal->Flush().ok());
  {
    std::lock_guard<std::mutex> lock(mu);
    CHECK(acked.empty());
  }

  // The fault clears: the held records are committed, in order, and acked.
  RawDb(dir.db()).Exec("DROP TRIGGER fail_13");
  for (int i = 0; i < 200 && journal->last_committed() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the back-off is at most 2 s
  }
  CHECK(journal->Flush().ok());
  CHECK(journal->healthy());
  CHECK(journal->last_committed() == 2);
  CHECK(journal->stats().dropped_records == 0);
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE_FALSE(acked.empty());
  CHECK(acked.back().step == 14);
  CHECK(committed_through == 2);
}

TEST_CASE("records still failing at Stop are counted as dropped, never acked", "[store]") {
  TempDir dir;
  std::atomic<int> commits{0};
  auto journal = OpenOrFail({.path = dir.db()}, [&](const CommitReport&) { ++commits; });
  RawDb(dir.db()).Exec(
      "CREATE TRIGGER fail_all BEFORE INSERT ON steps BEGIN SELECT RAISE(ABORT, 'injected fault'); END");
  REQUIRE(journal->Enqueue(MakeStep("a", 1, {{0, 1.0}}, {{"a", 0, 1, 10}})));
  CHECK_FALSE(journal->Flush().ok());
  journal->Stop();
  CHECK(journal->stats().dropped_records == 1);
  CHECK(commits == 0);
}

TEST_CASE("a damaged step row is reported by run and step and skipped, and the rest of its run is read",
          "[store][damage]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()});
  for (const char* id : {"bad-run", "good-run"}) {
    RunMeta meta;
    meta.run_id = id;
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(MakeStep(id, 41, {{0, 1.0}})));
    REQUIRE(journal->Enqueue(MakeStep(id, 42, {{0, 2.0}})));
  }
  REQUIRE(journal->Flush().ok());
  SECTION("a value changed in place: the checksum sees it") {
    RawDb raw(dir.db());
    // 2.0 as a float64 is 0x4000000000000000: 0x4000000000000001 is the next value up.
    raw.Exec("UPDATE steps SET vals = x'000000000100000000000040' WHERE run_id = 'bad-run' AND step = 42");
  }
  SECTION("a blob that is not whole entries") {
    RawDb raw(dir.db());
    raw.Exec("UPDATE steps SET vals = x'0102030405', crc = NULL WHERE run_id = 'bad-run' AND step = 42");
  }
  Recorder recorder;
  REQUIRE(journal->Load(recorder).ok());
  CHECK(recorder.failed.empty());
  CHECK(journal->IsHeld("bad-run"));
  std::vector<std::pair<std::string, uint64_t>> read;
  for (const auto& s : recorder.steps) read.emplace_back(s.run_id, s.step.step);
  CHECK(read == std::vector<std::pair<std::string, uint64_t>>{{"bad-run", 41}, {"good-run", 41}, {"good-run", 42}});
  CHECK(journal->damage().rows() == 1);
  CHECK(journal->damage().blocks() == 0);
  CHECK(journal->damage().steps() == 1);
  const std::vector<DamagedSteps> found = journal->damage().Found();
  REQUIRE(found.size() == 1);
  CHECK(found[0].run_id == "bad-run");
  CHECK(found[0].first_step == 42);
  CHECK(found[0].last_step == 42);
  CHECK_FALSE(found[0].block);
  // Read again (a run coming back): counted once.
  REQUIRE(journal->LoadRunSteps("bad-run", 100, [](const CompletedStep&) {}).ok());
  CHECK(journal->damage().rows() == 1);
}

TEST_CASE("a run with corrupt JSON is handed to OnRunFailed before OnRun", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()});
  RunMeta meta;
  meta.run_id = "json-run";
  REQUIRE(journal->Enqueue(RunRecord{meta}));
  REQUIRE(journal->Flush().ok());
  {
    RawDb raw(dir.db());
    raw.Exec("UPDATE runs SET config_json = '{\"hidden_size\": ' WHERE run_id = 'json-run'");
  }
  Recorder recorder;
  REQUIRE(journal->Load(recorder).ok());
  CHECK(recorder.runs.empty());
  REQUIRE(recorder.failed.size() == 1);
  CHECK_THAT(recorder.failed[0].second.message(), Catch::Contains("json-run"));
}

TEST_CASE("a journal that is not a database is moved aside and a fresh one opens", "[store][recovery]") {
  TempDir dir;
  const std::string garbage(10000, 'g');
  {
    std::FILE* f = std::fopen(dir.db().c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fwrite(garbage.data(), 1, garbage.size(), f);
    std::fclose(f);
  }
  auto journal = OpenOrFail({.path = dir.db()});
  const RecoveryReport& r = journal->recovery();
  CHECK(r.damaged);
  CHECK(r.moved_aside);
  CHECK(r.salvaged_runs == 0);
  REQUIRE(r.moved_files.size() == 1);
  CHECK_THAT(r.moved_files[0], Catch::StartsWith(dir.db() + ".damaged-"));
  CHECK(fs::file_size(r.moved_files[0]) == garbage.size());  // kept as it was
  RunMeta meta;
  meta.run_id = "after";
  REQUIRE(journal->Enqueue(RunRecord{meta}));
  REQUIRE(journal->Flush().ok());
  journal->Stop();
  const Recorder recorder = LoadFrom(dir.db());
  REQUIRE(recorder.runs.size() == 1);
  CHECK(recorder.runs[0].meta.run_id == "after");
}

TEST_CASE("a damaged page: the runs that read cleanly are salvaged whole, the others reported lost",
          "[store][recovery]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    for (const char* id : {"a-damaged", "b-intact"}) {
      RunMeta meta;
      meta.run_id = id;
      REQUIRE(journal->Enqueue(RunRecord{meta}));
      REQUIRE(journal->Enqueue(SeriesRecord{id, 0, "train/loss"}));
      for (uint64_t s = 1; s <= 3000; ++s) REQUIRE(journal->Enqueue(MakeStep(id, s, {{0, 1.0}}, {{id, 0, s, s}})));
      REQUIRE(journal->Enqueue(EventJournalRecord{id, EventRecord{100, "an event", "user", 1.7e9}}));
    }
    REQUIRE(journal->Flush().ok());
    RawDb raw(dir.db());
    raw.Exec("CREATE TABLE outbox(id INTEGER PRIMARY KEY, payload TEXT)");
    raw.Exec("INSERT INTO outbox(payload) VALUES('kept')");
  }
  // The steps table's leaves in key order: run a-damaged's come first. Overwrite the second one.
  int64_t page = 0, page_size = 0;
  {
    RawDb raw(dir.db());
    page =
        std::stoll(raw.Query("SELECT pageno FROM dbstat WHERE name = 'steps' AND pagetype = 'leaf' "
                             "ORDER BY path LIMIT 1 OFFSET 1"));
    page_size = std::stoll(raw.Query("PRAGMA page_size"));
  }
  REQUIRE(!fs::exists(dir.db() + "-wal"));  // a clean close checkpointed everything
  {
    std::FILE* f = std::fopen(dir.db().c_str(), "r+b");
    REQUIRE(f != nullptr);
    std::fseek(f, static_cast<long>((page - 1) * page_size), SEEK_SET);
    const std::string junk(static_cast<size_t>(page_size), '\x5a');
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  auto journal = OpenOrFail({.path = dir.db()});
  const RecoveryReport& r = journal->recovery();
  INFO(r.detail);
  CHECK(r.damaged);
  CHECK(r.moved_aside);
  CHECK(r.salvaged_runs == 1);
  CHECK(r.lost_runs == 1);
  CHECK(r.lost_run_ids == std::vector<std::string>{"a-damaged"});
  CHECK(r.lost_tables.empty());
  Recorder recorder;
  REQUIRE(journal->Load(recorder).ok());
  REQUIRE(recorder.runs.size() == 1);
  CHECK(recorder.runs[0].meta.run_id == "b-intact");
  CHECK(recorder.steps.size() == 3000);
  CHECK(recorder.events.size() == 1);
  REQUIRE(recorder.progress.size() == 1);
  CHECK(recorder.progress[0].step == 3000);
  journal->Stop();
  RawDb raw(dir.db());
  CHECK(raw.Query("SELECT payload FROM outbox") == "kept");  // other tables come along
  // A clean start afterwards finds nothing wrong.
  auto again = OpenOrFail({.path = dir.db()});
  CHECK(again->recovery().ok());
  CHECK_FALSE(again->recovery().moved_aside);
}

TEST_CASE("a journal beyond quick_check_max_bytes opens without quick_check, its damage found when read",
          "[store][recovery]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    for (const char* id : {"a-damaged", "b-intact"}) {
      RunMeta meta;
      meta.run_id = id;
      REQUIRE(journal->Enqueue(RunRecord{meta}));
      for (uint64_t s = 1; s <= 3000; ++s) REQUIRE(journal->Enqueue(MakeStep(id, s, {{0, 1.0}}, {{id, 0, s, s}})));
    }
    REQUIRE(journal->Flush().ok());
  }
  int64_t page = 0, page_size = 0;
  {
    RawDb raw(dir.db());
    page =
        std::stoll(raw.Query("SELECT pageno FROM dbstat WHERE name = 'steps' AND pagetype = 'leaf' "
                             "ORDER BY path LIMIT 1 OFFSET 1"));
    page_size = std::stoll(raw.Query("PRAGMA page_size"));
  }
  {
    std::FILE* f = std::fopen(dir.db().c_str(), "r+b");
    REQUIRE(f != nullptr);
    std::fseek(f, static_cast<long>((page - 1) * page_size), SEEK_SET);
    const std::string junk(static_cast<size_t>(page_size), '\x5a');
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  // As a journal of many gigabytes would: the clean stop left nothing for WAL recovery to drop.
  auto journal = OpenOrFail({.path = dir.db(), .quick_check_max_bytes = 0});
  CHECK(journal->recovery().ok());
  CHECK_FALSE(journal->recovery().moved_aside);
  Recorder recorder;
  REQUIRE(journal->Load(recorder).ok());
  REQUIRE(recorder.failed.size() == 1);
  CHECK(recorder.failed[0].first == "a-damaged");
  CHECK(std::count_if(recorder.steps.begin(), recorder.steps.end(),
                      [](const Recorder::Step& s) { return s.run_id == "b-intact"; }) == 3000);
}

TEST_CASE("journal files deleted under an open journal are rebuilt from its connection, nothing committed lost",
          "[store][recovery]") {
  TempDir dir;
  const fs::path data = dir.path() / "data";
  fs::create_directories(data);
  const std::string db = (data / "journal.db").string();
  const bool whole_dir = GENERATE(false, true);
  std::atomic<uint64_t> durable{0};
  auto journal = OpenOrFail({.path = db}, [&](const CommitReport& report) {
    for (const RankProgress& p : report.progress) durable = std::max<uint64_t>(durable, p.step);
  });
  RunMeta meta;
  meta.run_id = "run";
  REQUIRE(journal->Enqueue(RunRecord{meta}));
  for (uint64_t s = 1; s <= 100; ++s) REQUIRE(journal->Enqueue(MakeStep("run", s, {{0, 1.0}}, {{"run", 0, s, s}})));
  REQUIRE(journal->Flush().ok());
  if (whole_dir) {
    fs::remove_all(data);
  } else {
    for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(db + suffix);
  }
  for (uint64_t s = 101; s <= 200; ++s) REQUIRE(journal->Enqueue(MakeStep("run", s, {{0, 1.0}}, {{"run", 0, s, s}})));
  REQUIRE(journal->Flush().ok());
  CHECK(durable == 200);
  CHECK(journal->stats().files_lost == 1);
  CHECK(journal->stats().rebuilds == 1);
  CHECK(journal->healthy());
  CHECK(fs::exists(db));
  // The idle check notices a loss without any record to commit.
  for (const char* suffix : {"", "-wal", "-shm"}) fs::remove(db + suffix);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (journal->stats().rebuilds < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(journal->stats().rebuilds == 2);
  journal->Stop();
  const Recorder recorder = LoadFrom(db);
  CHECK(recorder.steps.size() == 200);
  REQUIRE(recorder.progress.size() == 1);
  CHECK(recorder.progress[0].step == 200);
}

TEST_CASE("a journal file replaced under an open journal is moved aside, not written to", "[store][recovery]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()});
  RunMeta meta;
  meta.run_id = "run";
  REQUIRE(journal->Enqueue(RunRecord{meta}));
  REQUIRE(journal->Flush().ok());
  const std::string foreign = dir.db() + ".foreign";
  {
    std::FILE* f = std::fopen(foreign.c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fputs("someone else's file", f);
    std::fclose(f);
  }
  fs::rename(foreign, dir.db());
  REQUIRE(journal->Enqueue(MakeStep("run", 1, {{0, 1.0}})));
  REQUIRE(journal->Flush().ok());
  CHECK(journal->stats().rebuilds == 1);
  size_t detached = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("journal.db.detached-", 0) == 0 && name.find("-wal") == std::string::npos &&
        name.find("-shm") == std::string::npos) {
      ++detached;
      CHECK(fs::file_size(entry.path()) == std::string("someone else's file").size());
    }
  }
  CHECK(detached == 1);
  journal->Stop();
  const Recorder recorder = LoadFrom(dir.db());
  CHECK(recorder.runs.size() == 1);
  CHECK(recorder.steps.size() == 1);
}

TEST_CASE("committed step records are handed back for reuse with their buffers", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db()}, nullptr);
  CHECK(journal->AcquireStepRecord().step.values.capacity() == 0);  // nothing committed yet
  std::vector<SeriesValue> values;
  for (SeriesId id = 0; id < 64; ++id) values.push_back({id, 1.0});
  REQUIRE(journal->Enqueue(MakeStep("run", 1, values, {{"run", 0, 1, 1}})));
  REQUIRE(journal->Flush().ok());
  const StepJournalRecord reused = journal->AcquireStepRecord();
  CHECK(reused.step.values.capacity() >= 64);
  CHECK(reused.progress.capacity() >= 1);
}

TEST_CASE("a rewind moves the abandoned branch aside and Load returns only the new one, across reopen",
          "[store][rewind]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "a";
    meta.world_size = 2;
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    RunMeta other;
    other.run_id = "b";
    REQUIRE(journal->Enqueue(RunRecord{other}));
    for (uint64_t s = 0; s <= 300; s += 100) {
      REQUIRE(journal->Enqueue(
          MakeStep("a", s, {{0, 1.0 + static_cast<double>(s)}}, {{"a", 0, s, s + 1}, {"a", 1, s, s + 2}})));
    }
    REQUIRE(journal->Enqueue(MakeStep("b", 250, {{0, 7.0}}, {{"b", 0, 250, 9}})));
    REQUIRE(journal->Enqueue(EventJournalRecord{"a", {100, "lr warmup done", "trainer", 1.0}}));
    REQUIRE(journal->Enqueue(EventJournalRecord{"a", {250, "switched routing", "trainer", 2.0}}));
    // Crashed at 300, resumed from the checkpoint at 200 with one rank: 200 and 300 are abandoned.
    REQUIRE(journal->Enqueue(RewindRecord{"a", 200, 1, 3.0}));
    REQUIRE(journal->Enqueue(EventJournalRecord{"a", {200, "resumed from the checkpoint at step 200", "daemon", 3.0}}));
    REQUIRE(journal->Enqueue(MakeStep("a", 200, {{0, -200.0}}, {{"a", 0, 200, 50}})));
    REQUIRE(journal->Flush().ok());

    std::vector<uint64_t> kept;
    REQUIRE(journal->LoadRunSteps("a", 250, [&](const CompletedStep& s) { kept.push_back(s.step); }).ok());
    CHECK(kept == std::vector<uint64_t>{0, 100, 200});
  }
  const Recorder got = LoadFrom(dir.db());
  std::vector<std::pair<uint64_t, double>> steps_a;
  for (const auto& s : got.steps) {
    if (s.run_id == "a") steps_a.emplace_back(s.step.step, s.step.values.at(0).value);
  }
  CHECK(steps_a == std::vector<std::pair<uint64_t, double>>{{0, 1.0}, {100, 101.0}, {200, -200.0}});
  std::vector<std::string> events_a;
  for (const auto& e : got.events) {
    if (e.run_id == "a") events_a.push_back(e.event.text);
  }
  CHECK(events_a == std::vector<std::string>{"lr warmup done", "resumed from the checkpoint at step 200"});
  REQUIRE(got.rewinds.size() == 1);
  CHECK(got.rewinds[0] == std::pair<std::string, uint64_t>{"a", 200});
  // Rank 1 left the world; rank 0 was cut back to 199, then moved on to the new branch's 200.
  std::vector<std::pair<uint32_t, uint64_t>> progress_a;
  for (const auto& p : got.progress) {
    if (p.run_id == "a") progress_a.emplace_back(p.rank, p.step);
  }
  CHECK(progress_a == std::vector<std::pair<uint32_t, uint64_t>>{{0, 200}});
  REQUIRE(got.runs.size() == 2);
  CHECK(got.runs[0].meta.world_size == 1);
  // The other run is untouched.
  CHECK(std::count_if(got.steps.begin(), got.steps.end(), [](const auto& s) { return s.run_id == "b"; }) == 1);

  // The abandoned branch is kept aside, marked with its branch number.
  RawDb raw(dir.db());
  CHECK(raw.Query("SELECT group_concat(step) FROM (SELECT step FROM abandoned_steps WHERE run_id = 'a' "
                  "AND branch = 0 ORDER BY step)") == "200,300");
  CHECK(raw.Query("SELECT text FROM abandoned_events WHERE run_id = 'a' AND branch = 0") == "switched routing");
}

TEST_CASE("a second rewind abandons a second branch and a rewind to 0 keeps no progress", "[store][rewind]") {
  TempDir dir;
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "a";
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(MakeStep("a", 10, {{0, 1.0}}, {{"a", 0, 10, 1}})));
    REQUIRE(journal->Enqueue(RewindRecord{"a", 5, 1, 1.0}));
    REQUIRE(journal->Enqueue(MakeStep("a", 6, {{0, 2.0}}, {{"a", 0, 6, 2}})));
    REQUIRE(journal->Enqueue(RewindRecord{"a", 0, 1, 2.0}));
    REQUIRE(journal->Flush().ok());
  }
  const Recorder got = LoadFrom(dir.db());
  CHECK(got.steps.empty());
  CHECK(got.progress.empty());
  REQUIRE(got.rewinds.size() == 1);
  CHECK(got.rewinds[0].second == 0);
  RawDb raw(dir.db());
  CHECK(raw.Query("SELECT group_concat(branch || ':' || step) FROM abandoned_steps") == "0:10,1:6");
}

TEST_CASE("progress of the branch a batch rewound is superseded by the new branch's", "[store][rewind]") {
  TempDir dir;
  std::mutex mu;
  std::vector<RankProgress> progress;
  JournalOptions options{.path = dir.db(), .max_delay = std::chrono::seconds(5)};
  auto journal = OpenOrFail(options, [&](const CommitReport& report) {
    std::lock_guard<std::mutex> lock(mu);
    progress = report.progress;
  });
  RankProgress old_branch{"a", 0, 300, 30, 0};
  RankProgress new_branch{"a", 0, 200, 31, 1};
  StepJournalRecord before = MakeStep("a", 300, {}, {old_branch});
  StepJournalRecord after = MakeStep("a", 200, {}, {new_branch});
  REQUIRE(journal->Enqueue(std::move(before)));
  REQUIRE(journal->Enqueue(RewindRecord{"a", 200, 1, 1.0}));
  REQUIRE(journal->Enqueue(std::move(after)));
  REQUIRE(journal->Flush().ok());
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(progress.size() == 1);
  CHECK(progress[0].step == 200);
  CHECK(progress[0].branch == 1);
}

TEST_CASE("a version-1 journal gains the rewind tables when opened", "[store][rewind]") {
  TempDir dir;
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open_v2(dir.db().c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr) == SQLITE_OK);
    // The version-1 schema, as released.
    const char* v1 = R"sql(
CREATE TABLE IF NOT EXISTS runs(
  run_id TEXT PRIMARY KEY,
  world_size INTEGER NOT NULL,
  labels_json TEXT NOT NULL,
  config_json TEXT NOT NULL,
  created_at REAL NOT NULL,
  ended_at REAL);
CREATE TABLE IF NOT EXISTS params(
  run_id TEXT NOT NULL,
  idx INTEGER NOT NULL,
  name TEXT NOT NULL,
  numel INTEGER NOT NULL,
  kind INTEGER NOT NULL,
  weight_decay REAL NOT NULL,
  init_norm REAL,
  role TEXT NOT NULL,
  grp TEXT NOT NULL,
  PRIMARY KEY(run_id, idx));
CREATE TABLE IF NOT EXISTS series(
  run_id TEXT NOT NULL,
  id INTEGER NOT NULL,
  key TEXT NOT NULL,
  PRIMARY KEY(run_id, id));
CREATE TABLE IF NOT EXISTS steps(
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  partial INTEGER NOT NULL,
  ranks_reported INTEGER NOT NULL,
  client_dropped INTEGER NOT NULL,
  vals BLOB NOT NULL,
  PRIMARY KEY(run_id, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_progress(
  run_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  step INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  PRIMARY KEY(run_id, rank));
CREATE TABLE IF NOT EXISTS events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  text TEXT NOT NULL,
  source TEXT NOT NULL,
  recorded_at REAL NOT NULL);
PRAGMA user_version = 1;
)sql";
    const int rc = sqlite3_exec(db, v1, nullptr, nullptr, nullptr);
    sqlite3_close(db);
    REQUIRE(rc == SQLITE_OK);
  }
  {
    auto journal = OpenOrFail({.path = dir.db()});
    RunMeta meta;
    meta.run_id = "a";
    REQUIRE(journal->Enqueue(RunRecord{meta}));
    REQUIRE(journal->Enqueue(MakeStep("a", 10, {{0, 1.0}})));
    REQUIRE(journal->Enqueue(RewindRecord{"a", 5, 1, 1.0}));
    REQUIRE(journal->Flush().ok());
  }
  CHECK(LoadFrom(dir.db()).steps.empty());
  RawDb raw(dir.db());
  CHECK(raw.Query("PRAGMA user_version") == "5");
  CHECK(raw.Query("SELECT count(*) FROM abandoned_steps") == "1");
}

TEST_CASE(
    "a version-2 journal and alert store written before the SQLite helper open, "
    "gaining only the step blocks and the alert history",
    "[store][migration]") {
  TempDir dir;
  // The schema as the journal and the alert store of 44f6238 created it (user_version 2), with a
  // row in every table.
  const char* v2 = R"sql(
PRAGMA journal_mode=WAL;
CREATE TABLE IF NOT EXISTS runs(
  run_id TEXT PRIMARY KEY,
  world_size INTEGER NOT NULL,
  labels_json TEXT NOT NULL,
  config_json TEXT NOT NULL,
  created_at REAL NOT NULL,
  ended_at REAL,
  end_reason INTEGER NOT NULL DEFAULT 0,
  end_message TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS params(
  run_id TEXT NOT NULL,
  idx INTEGER NOT NULL,
  name TEXT NOT NULL,
  numel INTEGER NOT NULL,
  kind INTEGER NOT NULL,
  weight_decay REAL NOT NULL,
  init_norm REAL,
  role TEXT NOT NULL,
  grp TEXT NOT NULL,
  PRIMARY KEY(run_id, idx));
CREATE TABLE IF NOT EXISTS series(
  run_id TEXT NOT NULL,
  id INTEGER NOT NULL,
  key TEXT NOT NULL,
  PRIMARY KEY(run_id, id));
CREATE TABLE IF NOT EXISTS steps(
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  partial INTEGER NOT NULL,
  ranks_reported INTEGER NOT NULL,
  client_dropped INTEGER NOT NULL,
  vals BLOB NOT NULL,
  PRIMARY KEY(run_id, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_progress(
  run_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  step INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  PRIMARY KEY(run_id, rank));
CREATE TABLE IF NOT EXISTS events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  text TEXT NOT NULL,
  source TEXT NOT NULL,
  recorded_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, step);
PRAGMA user_version = 2;
CREATE TABLE IF NOT EXISTS rewinds(
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  from_step INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  rewound_at REAL NOT NULL,
  PRIMARY KEY(run_id, branch));
CREATE TABLE IF NOT EXISTS abandoned_steps(
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  step INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  partial INTEGER NOT NULL,
  ranks_reported INTEGER NOT NULL,
  client_dropped INTEGER NOT NULL,
  vals BLOB NOT NULL,
  PRIMARY KEY(run_id, branch, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS abandoned_events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  step INTEGER NOT NULL,
  text TEXT NOT NULL,
  source TEXT NOT NULL,
  recorded_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, receiver TEXT NOT NULL, fingerprint TEXT NOT NULL, state INTEGER NOT NULL, payload TEXT NOT NULL, created_at REAL NOT NULL, attempts INTEGER NOT NULL, next_attempt_at REAL NOT NULL, delivery INTEGER NOT NULL DEFAULT 0, error TEXT);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (receiver, delivery, id);
CREATE TABLE IF NOT EXISTS alert_instances (fingerprint TEXT PRIMARY KEY, run TEXT NOT NULL, rule TEXT NOT NULL, alert TEXT NOT NULL, held_since_step INTEGER NOT NULL, clearing INTEGER NOT NULL, clearing_since_step INTEGER NOT NULL, notified INTEGER NOT NULL, ack TEXT);
CREATE TABLE IF NOT EXISTS silences (id TEXT PRIMARY KEY, matchers TEXT NOT NULL, starts_at REAL NOT NULL, ends_at REAL NOT NULL, comment TEXT NOT NULL, created_by TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS alert_levels (fingerprint TEXT PRIMARY KEY, run TEXT NOT NULL, rule TEXT NOT NULL, reports BLOB NOT NULL, report_count INTEGER NOT NULL, since_mark INTEGER NOT NULL, all_since_mark INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS alert_progress (run TEXT PRIMARY KEY, evaluated_step INTEGER NOT NULL);
INSERT INTO runs VALUES('r', 2, '{"team":"lm"}', '{"hidden_size":6144,"optimizer":"adamw","extra":{},"z_loss_coef":0.0001}', 1.7e9, 1.7e9 + 50, 2, 'reached max_steps');
INSERT INTO params VALUES('r', 0, 'final_norm.weight', 6144, 1, 0.0, 78.4, 'final_norm', 'norms');
INSERT INTO params VALUES('r', 1, 'lm_head.weight', 788000000, 0, 0.1, NULL, 'lm_head', 'head');
INSERT INTO series VALUES('r', 0, 'grad/norm/total');
INSERT INTO series VALUES('r', 1, 'param/norm/final_norm.weight');
-- values: series 0 = 0.5 and series 1 = -2.0, as (uint32, float64) little-endian pairs
INSERT INTO steps VALUES('r', 1, 1.7e9 + 1, 0, 2, 0, X'00000000000000000000E03F0100000000000000000000C0');
INSERT INTO steps VALUES('r', 2, 1.7e9 + 2, 1, 1, 3, X'00000000000000000000F03F');
INSERT INTO rank_progress VALUES('r', 0, 2, 20);
INSERT INTO rank_progress VALUES('r', 1, 1, 11);
INSERT INTO events(run_id, step, text, source, recorded_at) VALUES('r', 2, 'lr decay', 'trainer', 1.7e9 + 2);
INSERT INTO rewinds VALUES('r', 0, 3, 2, 1.7e9 + 4);
INSERT INTO abandoned_steps VALUES('r', 0, 3, 1.7e9 + 3, 0, 2, 0, X'00000000000000000000F03F');
INSERT INTO abandoned_events(run_id, branch, step, text, source, recorded_at) VALUES('r', 0, 3, 'old', 'trainer', 1.7e9 + 3);
INSERT INTO outbox(receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at) VALUES('am', '00000000000000ab', 1, '{}', 1.7e9, 0, 1.7e9);
INSERT INTO silences VALUES('s1', '{"run":"r"}', 1.7e9, 1.7e9 + 3600, 'maintenance', 'alice');
INSERT INTO alert_progress VALUES('r', 2);
)sql";
  {
    RawDb raw(dir.db(), /*create=*/true);
    raw.Exec(v2);
  }
  // Everything but version 3's step_blocks table (and its key's index) and the alert store's
  // alert_history (the alert store only ever adds tables).
  auto schema_text = [&] {
    RawDb raw(dir.db());
    return raw.Query(
        "SELECT group_concat(type || ' ' || name || ' ' || ifnull(sql, ''), char(10)) FROM "
        "(SELECT * FROM sqlite_master WHERE tbl_name NOT IN ('step_blocks', 'alert_history') "
        "ORDER BY name)");
  };
  const std::string schema_before = schema_text();
  REQUIRE_FALSE(schema_before.empty());

  const Recorder got = LoadFrom(dir.db());
  CHECK(got.failed.empty());
  REQUIRE(got.runs.size() == 1);
  const RunMeta& meta = got.runs[0].meta;
  CHECK(meta.run_id == "r");
  CHECK(meta.world_size == 2);
  CHECK(meta.labels == std::map<std::string, std::string>{{"team", "lm"}});
  CHECK(meta.config.hidden_size == 6144);
  CHECK(meta.config.optimizer == "adamw");
  CHECK(meta.config.z_loss_coef == 0.0001);
  CHECK(meta.created_at == 1.7e9);
  CHECK(got.runs[0].end == RunEnd{1.7e9 + 50, EndReason::kFinished, "reached max_steps"});
  REQUIRE(meta.params.size() == 2);
  CHECK(meta.params[0].name == "final_norm.weight");
  CHECK(meta.params[0].numel == 6144);
  CHECK(meta.params[0].init_norm == 78.4);
  CHECK(meta.params[0].group == "norms");
  CHECK(meta.params[1].numel == 788000000);
  CHECK(meta.params[1].weight_decay == 0.1);
  CHECK_FALSE(meta.params[1].init_norm.has_value());
  REQUIRE(got.series.size() == 2);
  CHECK(got.series[1].key == "param/norm/final_norm.weight");
  REQUIRE(got.steps.size() == 2);
  CHECK(got.steps[0].step.step == 1);
  CHECK(got.steps[0].step.wall_time == 1.7e9 + 1);
  REQUIRE(got.steps[0].step.values.size() == 2);
  CHECK(got.steps[0].step.values[0].id == 0);
  CHECK(got.steps[0].step.values[0].value == 0.5);
  CHECK(got.steps[0].step.values[1].id == 1);
  CHECK(got.steps[0].step.values[1].value == -2.0);
  CHECK(got.steps[1].step.partial);
  CHECK(got.steps[1].step.ranks_reported == 1);
  CHECK(got.steps[1].step.client_dropped_steps == 3);
  REQUIRE(got.steps[1].step.values.size() == 1);
  CHECK(got.steps[1].step.values[0].value == 1.0);
  REQUIRE(got.progress.size() == 2);
  CHECK(got.progress[0].step == 2);
  CHECK(got.progress[0].seq == 20);
  CHECK(got.progress[1].rank == 1);
  REQUIRE(got.events.size() == 1);
  CHECK(got.events[0].event.text == "lr decay");
  CHECK(got.rewinds == std::vector<std::pair<std::string, uint64_t>>{{"r", 3}});

  {
    auto store = AlertStore::Open(dir.db());
    INFO(store.status().ToString());
    REQUIRE(store.ok());
    auto pending = (*store)->Pending("am", 10, 1.7e9 + 1);
    REQUIRE(pending.ok());
    REQUIRE(pending->size() == 1);
    CHECK(pending.value()[0].fingerprint == "00000000000000ab");
    auto state = (*store)->LoadState();
    REQUIRE(state.ok());
    REQUIRE(state->silences.size() == 1);
    CHECK(state->silences[0].comment == "maintenance");
    CHECK(state->silences[0].matchers == alerts::EqualityMatchers({{"run", "r"}}).value());
    CHECK(state->evaluated == std::map<std::string, uint64_t>{{"r", 2}});
  }

  // Opened, read and written to (a new step) with no change to the schema but the step blocks of
  // version 3, the data column of events of version 4 and the alert history.
  {
    auto journal = OpenOrFail({.path = dir.db()});
    REQUIRE(journal->Enqueue(MakeStep("r", 3, {{0, 2.0}})));
    REQUIRE(journal->Flush().ok());
  }
  RawDb raw(dir.db());
  CHECK(raw.Query("PRAGMA user_version") == "5");
  CHECK(raw.Query("SELECT count(*) FROM steps") == "3");
  std::string schema_after = schema_before;
  for (const std::string table : {"abandoned_events", "events"}) {
    const size_t at = schema_after.find("table " + table + " CREATE TABLE");
    REQUIRE(at != std::string::npos);
    const std::string last = "recorded_at REAL NOT NULL)";
    const size_t end = schema_after.find(last, at);
    REQUIRE(end != std::string::npos);
    schema_after.replace(end, last.size(), "recorded_at REAL NOT NULL, data TEXT NOT NULL DEFAULT '')");
  }
  // Version 5: the step rows' checksums.
  for (size_t at = 0; (at = schema_after.find("vals BLOB NOT NULL,", at)) != std::string::npos;) {
    schema_after.replace(at, 19, "vals BLOB NOT NULL, crc INTEGER,");
    at += 19;
  }
  CHECK(schema_text() == schema_after);
  CHECK(raw.Query("SELECT count(*) FROM step_blocks") == "0");
  CHECK(raw.Query("SELECT count(*) FROM alert_history") == "0");
}

namespace {

// Journals run `id`: its catalog, series, `steps` steps with progress, an event, and its end.
void JournalRun(Journal& journal, const std::string& id, uint64_t steps, double ended_at) {
  RunMeta meta;
  meta.run_id = id;
  meta.created_at = 1.0;
  REQUIRE(journal.Enqueue(RunRecord{meta}));
  ParamInfo p;
  p.name = "w";
  REQUIRE(journal.Enqueue(ParamsRecord{id, 0, {p}}));
  REQUIRE(journal.Enqueue(SeriesRecord{id, 0, "grad/norm/total"}));
  for (uint64_t s = 1; s <= steps; ++s) REQUIRE(journal.Enqueue(MakeStep(id, s, {{0, 0.5}}, {{id, 0, s, s}})));
  REQUIRE(journal.Enqueue(EventJournalRecord{id, {1, "started", "trainer", 1.0}}));
  if (ended_at > 0) REQUIRE(journal.Enqueue(RunEndedRecord{id, ended_at, EndReason::kFinished, "done"}));
}

int64_t RowsOf(RawDb& raw, const std::string& id) {
  int64_t n = 0;
  for (const char* table : {"runs", "params", "series", "steps", "rank_progress", "events"}) {
    n += std::stoll(raw.Query(std::string("SELECT count(*) FROM ") + table + " WHERE run_id = '" + id + "'"));
  }
  return n;
}

bool WaitPrunedRuns(const Journal& journal, uint64_t n) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (journal.stats().pruned_runs < n) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

}  // namespace

TEST_CASE("pruning deletes every row of ended runs not held, in bounded batches, and only those", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db(), .prune_batch_rows = 7});
  JournalRun(*journal, "old", 50, 100.0);
  JournalRun(*journal, "old-but-held", 50, 100.0);
  JournalRun(*journal, "recent", 5, 1000.0);
  JournalRun(*journal, "active", 5, 0);
  REQUIRE(journal->Flush().ok());
  // The daemon holds two of them in memory.
  Recorder held;
  held.skip = {"old", "recent"};
  REQUIRE(journal->Load(held).ok());
  CHECK(journal->IsHeld("old-but-held"));
  CHECK_FALSE(journal->IsHeld("old"));

  RawDb raw(dir.db());
  const int64_t old_rows = RowsOf(raw, "old");
  CHECK(old_rows == 1 + 1 + 1 + 50 + 1 + 1);
  journal->SetPruneCutoff(500.0);
  REQUIRE(WaitPrunedRuns(*journal, 1));
  CHECK(RowsOf(raw, "old") == 0);
  CHECK(journal->stats().pruned_rows == static_cast<uint64_t>(old_rows));
  CHECK(RowsOf(raw, "old-but-held") == old_rows);
  CHECK(RowsOf(raw, "recent") == 1 + 1 + 1 + 5 + 1 + 1);
  CHECK(RowsOf(raw, "active") == 1 + 1 + 1 + 5 + 1 + 1);

  // Not held: listed as archived, with its steps.
  auto listed = journal->ListReleased();
  REQUIRE(listed.ok());
  REQUIRE(listed->size() == 1);
  CHECK(listed->at(0).meta.run_id == "recent");
  CHECK(listed->at(0).step_count == 5);
  CHECK(listed->at(0).last_step == 5);
  CHECK(listed->at(0).end == RunEnd{1000.0, EndReason::kFinished, "done"});

  // A run that comes back is read again and held: no longer archived, never pruned.
  Recorder back;
  REQUIRE(journal->LoadRun("recent", back).ok());
  REQUIRE(back.runs.size() == 1);
  CHECK(back.steps.size() == 5);
  CHECK(back.events.size() == 1);
  CHECK(back.progress.size() == 1);
  CHECK(journal->ListReleased()->empty());
  Recorder none;
  CHECK(journal->LoadRun("never-seen", none).code() == StatusCode::kNotFound);

  // Released once it leaves memory again: its turn comes.
  journal->Release("old-but-held");
  journal->SetPruneCutoff(500.0);
  REQUIRE(WaitPrunedRuns(*journal, 2));
  CHECK(RowsOf(raw, "old-but-held") == 0);
  CHECK(RowsOf(raw, "recent") > 0);
  CHECK(journal->DiskBytes() > 0);
}

TEST_CASE("under churn of pruned runs the database file stops growing", "[store]") {
  TempDir dir;
  auto journal = OpenOrFail({.path = dir.db(), .prune_batch_rows = 500});
  // Pages in the database (the WAL's committed pages included), free ones too.
  auto pages = [&] { return std::stoll(RawDb(dir.db()).Query("PRAGMA page_count")); };
  int64_t pages_after_warmup = 0;
  for (int round = 0; round < 40; ++round) {
    const std::string id = "run-" + std::to_string(round);
    JournalRun(*journal, id, 200, 10.0 + round);
    REQUIRE(journal->Flush().ok());
    journal->SetPruneCutoff(11.0 + round);  // every run ended so far may go
    REQUIRE(WaitPrunedRuns(*journal, static_cast<uint64_t>(round) + 1));
    if (round == 9) pages_after_warmup = pages();
  }
  INFO("after 10 runs " << pages_after_warmup << " pages, after 40 " << pages());
  CHECK(pages() <= pages_after_warmup + 2);
  CHECK(journal->stats().pruned_runs == 40);
}

TEST_CASE("the journal's writer thread is named gw-journal while the journal is open", "[store]") {
  TempDir dir;
  auto names = [] {
    std::multiset<std::string> out;
    for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
      std::ifstream in(task.path() / "comm");
      std::string name;
      std::getline(in, name);
      out.insert(name);
    }
    return out;
  };
  REQUIRE(names().count("gw-journal") == 0);
  {
    auto journal = OpenOrFail({.path = dir.db()});
    // The thread names itself when it starts: waited for, with a generous limit.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (names().count("gw-journal") == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    CHECK(names().count("gw-journal") == 1);
  }
  CHECK(names().count("gw-journal") == 0);
}

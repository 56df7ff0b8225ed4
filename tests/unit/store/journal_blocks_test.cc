// The journal's compressed blocks of steps: sealing, reading back merged with the rows not yet
// sealed, rewinds into sealed blocks, pruning, and the bytes a sample costs on disk.
#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/core/types.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"

using namespace gradwatch;
using namespace gradwatch::store;
using gradwatch::testing::TempDir;

namespace {

struct Collector : JournalVisitor {
  std::vector<std::pair<std::string, CompletedStep>> steps;
  std::vector<std::pair<std::string, uint64_t>> rewinds;
  std::vector<std::string> failed;
  bool OnRun(const RunMeta&, const RunEnd&) override { return true; }
  void OnSeries(const std::string&, SeriesId, const std::string&) override {}
  void OnRankProgress(const RankProgress&) override {}
  void OnStep(const std::string& run_id, const CompletedStep& step) override { steps.emplace_back(run_id, step); }
  void OnEvent(const std::string&, const EventRecord&) override {}
  void OnRewind(const std::string& run_id, uint64_t from_step) override { rewinds.emplace_back(run_id, from_step); }
  void OnRunFailed(const std::string& run_id, const Status&) override { failed.push_back(run_id); }
  uint64_t OnStepsBegin(const std::string& run_id, uint64_t branch) override {
    branches.emplace_back(run_id, branch);
    return from_step;
  }
  std::vector<std::pair<std::string, uint64_t>> branches;
  uint64_t from_step = 0;  // what OnStepsBegin answers
};

std::unique_ptr<Journal> Open(const JournalOptions& options) {
  auto journal = Journal::Open(options, nullptr);
  INFO(journal.status().ToString());
  REQUIRE(journal.ok());
  return std::move(journal).value();
}

// One value as each kind of producer writes it, differing per series and step.
double ValueOf(uint32_t id, uint64_t step, uint64_t salt) {
  const double x = 1.0 + 0.01 * static_cast<double>((step * 7919 + id * 104729 + salt) % 1000);
  switch (id % 4) {
    case 0: return static_cast<double>(static_cast<float>(x));  // a float32 norm
    case 1: {
      char text[32];
      std::snprintf(text, sizeof text, "%.6g", x / 3.0);  // decimal text
      return std::strtod(text, nullptr);
    }
    case 2: return std::sqrt(x) / 7.0;  // an arbitrary double
    default: return step % 5 == 0 ? std::nan("") : -0.0;
  }
}

CompletedStep MakeStep(uint64_t step, uint32_t series, uint64_t salt = 0) {
  CompletedStep s;
  s.step = step;
  s.wall_time = 1.7e9 + 0.5 * static_cast<double>(step);
  s.ranks_reported = 4;
  s.partial = step % 11 == 0;
  for (uint32_t id = 0; id < series; ++id) s.values.push_back({id, ValueOf(id, step, salt)});
  return s;
}

void Write(store::Journal& journal, const std::string& run_id, const CompletedStep& step) {
  StepJournalRecord r;
  r.run_id = run_id;
  r.step = step;
  r.progress = {{run_id, 0, step.step, step.step}};
  REQUIRE(journal.Enqueue(std::move(r)));
}

void JournalRunRecord(store::Journal& journal, const std::string& run_id) {
  RunMeta meta;
  meta.run_id = run_id;
  meta.created_at = 1.0;
  REQUIRE(journal.Enqueue(RunRecord{meta}));
}

bool SameSteps(const CompletedStep& a, const CompletedStep& b) {
  if (a.step != b.step || std::bit_cast<uint64_t>(a.wall_time) != std::bit_cast<uint64_t>(b.wall_time) ||
      a.partial != b.partial || a.ranks_reported != b.ranks_reported || a.values.size() != b.values.size()) {
    return false;
  }
  for (size_t i = 0; i < a.values.size(); ++i) {
    if (a.values[i].id != b.values[i].id ||
        std::bit_cast<uint64_t>(a.values[i].value) != std::bit_cast<uint64_t>(b.values[i].value)) {
      return false;
    }
  }
  return true;
}

std::string Query(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  std::string out;
  if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr) == SQLITE_OK && sqlite3_step(stmt) == SQLITE_ROW &&
      sqlite3_column_text(stmt, 0) != nullptr) {
    out = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return out;
}

// Polls until `done` or 20 s.
template <typename Fn>
bool WaitFor(Fn done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Writes steps first..last of run "r", `series` values each, appending them to `expected`; a
// flush (a commit, then the seals due) every `flush_every` steps, none when 0.
void WriteSteps(store::Journal& journal, uint64_t first, uint64_t last, uint32_t series,
                std::vector<CompletedStep>& expected, uint64_t flush_every = 0) {
  for (uint64_t s = first; s <= last; ++s) {
    expected.push_back(MakeStep(s, series));
    Write(journal, "r", expected.back());
    if (flush_every != 0 && s % flush_every == 0) REQUIRE(journal.Flush().ok());
  }
}

// Opens the journal at `path` and requires Load to hand back exactly `expected`, in order;
// returns the journal, loaded.
std::unique_ptr<Journal> RequireLoads(const std::string& path, const std::vector<CompletedStep>& expected) {
  auto journal = Open({.path = path, .block_steps = 8});
  Collector got;
  REQUIRE(journal->Load(got).ok());
  CHECK(got.failed.empty());
  REQUIRE(got.steps.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    INFO("step " << expected[i].step);
    CHECK(SameSteps(got.steps[i].second, expected[i]));
  }
  return journal;
}

}  // namespace

TEST_CASE("sealed blocks read back bit for bit, merged with the rows not yet sealed and a late rewrite",
          "[store][blocks]") {
  TempDir dir;
  std::vector<CompletedStep> expected;
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    JournalRunRecord(*journal, "r");
    WriteSteps(*journal, 1, 100, 6, expected, /*flush_every=*/10);  // several commits: sealing between them
    REQUIRE(journal->Flush().ok());
    // Step 5 completes again after its block was sealed: its row is the later write and wins.
    expected[4] = MakeStep(5, 6, /*salt=*/1);
    Write(*journal, "r", expected[4]);
    REQUIRE(journal->Flush().ok());
    // Below a bound, as a rewind's rebuild reads them.
    std::vector<CompletedStep> below;
    REQUIRE(journal->LoadRunSteps("r", 50, [&](const CompletedStep& s) { below.push_back(s); }).ok());
    REQUIRE(below.size() == 49);
    for (size_t i = 0; i < below.size(); ++i) CHECK(SameSteps(below[i], expected[i]));
  }
  const int64_t blocks = std::stoll(Query(dir.db(), "SELECT count(*) FROM step_blocks WHERE run_id = 'r'"));
  const int64_t rows = std::stoll(Query(dir.db(), "SELECT count(*) FROM steps WHERE run_id = 'r'"));
  CHECK(blocks >= 11);
  CHECK(rows < 8 + 1);  // the unsealed tail, and step 5's rewrite
  CHECK(Query(dir.db(), "SELECT count(*) FROM steps WHERE run_id = 'r' AND step = 5") == "1");

  const auto journal = RequireLoads(dir.db(), expected);
  const auto released = journal->ListReleased();
  REQUIRE(released.ok());
  CHECK(released->empty());  // held by Load
}

TEST_CASE("a rewind into sealed blocks keeps the steps before it and abandons the rest, then goes on",
          "[store][blocks][rewind]") {
  TempDir dir;
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    JournalRunRecord(*journal, "r");
    for (uint64_t s = 1; s <= 40; ++s) Write(*journal, "r", MakeStep(s, 3));
    REQUIRE(journal->Flush().ok());
    REQUIRE(journal->Enqueue(RewindRecord{"r", 13, 1, 1.7e9 + 100}));
    for (uint64_t s = 13; s <= 30; ++s) Write(*journal, "r", MakeStep(s, 3, /*salt=*/2));
    REQUIRE(journal->Flush().ok());
  }
  CHECK(Query(dir.db(),
              "SELECT group_concat(step) FROM (SELECT step FROM abandoned_steps WHERE run_id = 'r' "
              "AND branch = 0 ORDER BY step)") ==
        "13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40");
  auto journal = Open({.path = dir.db(), .block_steps = 8});
  Collector got;
  REQUIRE(journal->Load(got).ok());
  REQUIRE(got.steps.size() == 30);
  for (uint64_t s = 1; s <= 30; ++s) {
    INFO("step " << s);
    CHECK(SameSteps(got.steps[s - 1].second, MakeStep(s, 3, s < 13 ? 0 : 2)));
  }
  REQUIRE(got.rewinds.size() == 1);
  CHECK(got.rewinds[0].second == 13);
}

TEST_CASE("a visitor restored through a step is handed only the steps after it, and the run's branch",
          "[store][blocks][snapshot]") {
  TempDir dir;
  std::vector<CompletedStep> expected;
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    JournalRunRecord(*journal, "r");
    for (uint64_t s = 1; s <= 60; ++s) {
      expected.push_back(MakeStep(s, 4));
      Write(*journal, "r", expected.back());
      if (s % 7 == 0) REQUIRE(journal->Flush().ok());
    }
    REQUIRE(journal->Flush().ok());
  }
  for (const uint64_t from : {0, 1, 8, 9, 16, 17, 23, 56, 57, 60, 61, 1000}) {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    Collector got;
    got.from_step = from;
    REQUIRE(journal->Load(got).ok());
    INFO("from step " << from);
    REQUIRE(got.branches.size() == 1);
    CHECK(got.branches[0].second == 0);
    const uint64_t first = std::max<uint64_t>(from, 1);
    REQUIRE(got.steps.size() == (first <= 60 ? 60 - first + 1 : 0));
    for (size_t i = 0; i < got.steps.size(); ++i) CHECK(SameSteps(got.steps[i].second, expected[first - 1 + i]));
  }
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    REQUIRE(journal->Enqueue(RewindRecord{"r", 30, 1, 1.7e9 + 100}));
    REQUIRE(journal->Enqueue(RewindRecord{"r", 20, 1, 1.7e9 + 200}));
    REQUIRE(journal->Flush().ok());
  }
  auto journal = Open({.path = dir.db(), .block_steps = 8});
  Collector got;
  got.from_step = 10;
  REQUIRE(journal->Load(got).ok());
  REQUIRE(got.branches.size() == 1);
  CHECK(got.branches[0].second == 2);  // two rewinds: the third branch
  REQUIRE(got.steps.size() == 10);     // 10..19
  CHECK(got.steps.front().second.step == 10);
  CHECK(got.steps.back().second.step == 19);
}

TEST_CASE("pruning deletes an ended run's blocks, and abandoned branches once their rewind is past retention",
          "[store][blocks]") {
  TempDir dir;
  auto journal = Open({.path = dir.db(), .prune_batch_rows = 100, .block_steps = 8});
  for (const char* run : {"ended", "live"}) {
    JournalRunRecord(*journal, run);
    for (uint64_t s = 1; s <= 200; ++s) {
      Write(*journal, run, MakeStep(s, 2));
      if (s % 8 == 0) REQUIRE(journal->Flush().ok());  // a few blocks are sealed after each commit
    }
  }
  REQUIRE(journal->Enqueue(RunEndedRecord{"ended", 1000.0, EndReason::kFinished, ""}));
  REQUIRE(journal->Enqueue(RewindRecord{"live", 150, 1, 1500.0}));
  REQUIRE(journal->Flush().ok());
  REQUIRE(std::stoll(Query(dir.db(), "SELECT count(*) FROM step_blocks WHERE run_id = 'ended'")) >= 20);
  REQUIRE(Query(dir.db(), "SELECT count(*) FROM abandoned_steps WHERE run_id = 'live'") == "51");

  // The branch abandoned at 1500 is kept while the cutoff is before it.
  journal->SetPruneCutoff(1200.0);
  REQUIRE(WaitFor([&] { return journal->stats().pruned_runs == 1; }));
  CHECK(Query(dir.db(), "SELECT count(*) FROM step_blocks WHERE run_id = 'ended'") == "0");
  CHECK(Query(dir.db(), "SELECT count(*) FROM steps WHERE run_id = 'ended'") == "0");
  CHECK(Query(dir.db(), "SELECT count(*) FROM abandoned_steps WHERE run_id = 'live'") == "51");

  journal->SetPruneCutoff(2000.0);
  REQUIRE(WaitFor([&] { return Query(dir.db(), "SELECT count(*) FROM abandoned_steps") == "0"; }));
  // The live run's current branch is untouched.
  journal->Stop();
  auto reopened = Open({.path = dir.db(), .block_steps = 8});
  Collector got;
  REQUIRE(reopened->Load(got).ok());
  REQUIRE(got.steps.size() == 149);
  CHECK(SameSteps(got.steps.back().second, MakeStep(149, 2)));
}

TEST_CASE("a cutoff moved while a pruning pass runs is used by the next pass, not lost", "[store][blocks]") {
  // Each round abandons a step and moves the cutoff past its rewind at once, while the journal's
  // thread may be finishing the pass of the round before: every abandoned branch must still go.
  TempDir dir;
  auto journal = Open({.path = dir.db(), .prune_batch_rows = 100, .block_steps = 8});
  JournalRunRecord(*journal, "live");
  for (uint64_t s = 1; s <= 5; ++s) Write(*journal, "live", MakeStep(s, 2));
  REQUIRE(journal->Flush().ok());
  for (int round = 1; round <= 100; ++round) {
    INFO("round " << round);
    const double first = 1000.0 + 10.0 * round;
    for (const double at : {first, first + 5.0}) {
      Write(*journal, "live", MakeStep(6, 2, static_cast<uint64_t>(at)));
      REQUIRE(journal->Enqueue(RewindRecord{"live", 6, 1, at}));
    }
    REQUIRE(journal->Flush().ok());
    REQUIRE(Query(dir.db(), "SELECT count(*) FROM abandoned_steps") == "2");
    journal->SetPruneCutoff(first + 1.0);
    REQUIRE(WaitFor([&] { return Query(dir.db(), "SELECT count(*) FROM abandoned_steps") == "1"; }));
    journal->SetPruneCutoff(first + 6.0);  // as the pass that found nothing more to prune may be running
    REQUIRE(WaitFor([&] { return Query(dir.db(), "SELECT count(*) FROM abandoned_steps") == "0"; }));
  }
}

TEST_CASE("a journal of float32 norms takes under 3 bytes a sample on disk", "[store][blocks]") {
  TempDir dir;
  constexpr uint32_t kSeries = 2001;
  constexpr uint64_t kSteps = 640;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> noise(0.0, 0.01);
  {
    auto journal = Open({.path = dir.db()});
    JournalRunRecord(*journal, "r");
    for (uint64_t s = 1; s <= kSteps; ++s) {
      CompletedStep step;
      step.step = s;
      step.wall_time = 1.7e9 + 0.8 * static_cast<double>(s);
      step.ranks_reported = 1;
      for (uint32_t id = 0; id < kSeries; ++id) {
        const double norm = (1.0 + 0.01 * id) * (1.0 + 1e-4 * static_cast<double>(s)) * (1.0 + noise(rng));
        step.values.push_back({id, static_cast<double>(static_cast<float>(norm))});
      }
      Write(*journal, "r", step);
      if (s % 16 == 0) REQUIRE(journal->Flush().ok());
    }
    REQUIRE(journal->Flush().ok());
  }
  // Pages in use: the file also keeps the free pages the unsealed rows left (reused by the next
  // rows, so a constant, not a share of the history).
  const double used = std::stod(Query(dir.db(),
                                      "SELECT (SELECT page_count FROM pragma_page_count) - "
                                      "(SELECT freelist_count FROM pragma_freelist_count)")) *
                      std::stod(Query(dir.db(), "PRAGMA page_size"));
  const double per_sample = used / static_cast<double>(kSeries * kSteps);
  CAPTURE(per_sample);
  CHECK(per_sample < 3.0);
}

TEST_CASE("a version-2 journal's step rows are read as they are and sealed as the run goes on",
          "[store][blocks][migration]") {
  TempDir dir;
  std::vector<CompletedStep> expected;
  {
    // Rows only, then the version-3 table and the version-4 and -5 columns dropped: the journal as
    // version 2 left it.
    auto journal = Open({.path = dir.db(), .block_steps = 4096});
    JournalRunRecord(*journal, "r");
    WriteSteps(*journal, 1, 30, 4, expected);
    REQUIRE(journal->Flush().ok());
  }
  {
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open_v2(dir.db().c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "DROP TABLE step_blocks; ALTER TABLE events DROP COLUMN data; "
                         "ALTER TABLE abandoned_events DROP COLUMN data; ALTER TABLE steps DROP COLUMN crc; "
                         "ALTER TABLE abandoned_steps DROP COLUMN crc; PRAGMA user_version = 2",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  REQUIRE(Query(dir.db(), "SELECT count(*) FROM steps") == "30");
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    CHECK(Query(dir.db(), "PRAGMA user_version") == "5");
    Collector old_rows;
    REQUIRE(journal->Load(old_rows).ok());
    REQUIRE(old_rows.steps.size() == 30);
    WriteSteps(*journal, 31, 60, 4, expected, /*flush_every=*/1);
  }
  // The old rows went into blocks with the new ones.
  CHECK(std::stoll(Query(dir.db(), "SELECT count(*) FROM steps")) < 8);
  CHECK(Query(dir.db(), "SELECT min(first_step) FROM step_blocks") == "1");
  RequireLoads(dir.db(), expected);
}

TEST_CASE("a new journal has 16 KiB pages, and one made with 4 KiB pages keeps them and reads and seals as before",
          "[store][blocks]") {
  TempDir dir;
  std::vector<CompletedStep> expected;
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    JournalRunRecord(*journal, "r");
    WriteSteps(*journal, 1, 20, 300, expected);  // 3.6 KB rows
    REQUIRE(journal->Flush().ok());
  }
  CHECK(Query(dir.db(), "PRAGMA page_size") == "16384");
  {
    // The journal as an earlier version made it: SQLite's default 4 KiB pages.
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open_v2(dir.db().c_str(), &db, SQLITE_OPEN_READWRITE, nullptr) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db, "PRAGMA journal_mode=DELETE; PRAGMA page_size=4096; VACUUM; PRAGMA journal_mode=WAL",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  REQUIRE(Query(dir.db(), "PRAGMA page_size") == "4096");
  {
    auto journal = Open({.path = dir.db(), .block_steps = 8});
    Collector before;
    REQUIRE(journal->Load(before).ok());
    REQUIRE(before.steps.size() == expected.size());
    WriteSteps(*journal, 21, 40, 300, expected, /*flush_every=*/1);
  }
  CHECK(Query(dir.db(), "PRAGMA page_size") == "4096");
  CHECK(std::stoll(Query(dir.db(), "SELECT count(*) FROM steps")) < 8);  // sealed as before
  RequireLoads(dir.db(), expected);
}

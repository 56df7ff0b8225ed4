// Durable acks at the run: events sent by a trainer are acked on their stream only once the
// journal committed them, an event sent again (after a reconnect or a daemon restart) is stored
// once, and while the journal cannot commit a rank's reports are refused as retryable.
#include <sqlite3.h>
#include <catch2/catch.hpp>

#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "server/runs/run.h"
#include "server/store/journal.h"
#include "tests/support/temp_dir.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using gradwatch::runs::testing::RecordingSink;
using gradwatch::testing::TempDir;

TEST_CASE("an event is acked once committed and a resend is stored once", "[runs]") {
  TempDir dir;
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  Run* run_for_commits = nullptr;
  store::JournalOptions journal_options;
  journal_options.path = dir.db();
  // No commit starts on its own: only Flush cuts the group window short.
  journal_options.max_delay = std::chrono::hours(1);
  auto journal = store::Journal::Open(journal_options, [&](const store::CommitReport& report) {
    if (run_for_commits != nullptr) run_for_commits->OnCommitted(report.committed_through);
  });
  REQUIRE(journal.ok());
  RunMeta meta;
  meta.run_id = "r1";
  Run run(meta, options, journal.value().get(), &stats, &clock, true);
  run_for_commits = &run;
  RecordingSink sink;
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info).has_value());

  REQUIRE_FALSE(run.AddEvent({10, "switched routing", "trainer", 0}, 0, 7, &sink).has_value());
  CHECK(sink.event_acks.empty());  // queued, not committed
  REQUIRE(journal.value()->Flush().ok());
  CHECK(sink.event_acks == std::vector<std::pair<uint64_t, uint64_t>>{{7, 10}});

  // The client did not see the ack (its stream broke) and sends the event again.
  REQUIRE_FALSE(run.AddEvent({10, "switched routing", "trainer", 0}, 0, 12, &sink).has_value());
  REQUIRE(journal.value()->Flush().ok());
  CHECK(sink.event_acks == std::vector<std::pair<uint64_t, uint64_t>>{{7, 10}, {12, 10}});
  // Another text at the same step is another event.
  REQUIRE_FALSE(run.AddEvent({10, "lr decay", "trainer", 0}, 0, 13, &sink).has_value());
  REQUIRE(journal.value()->Flush().ok());
  const RunSummary summary = run.Summary();
  REQUIRE(summary.events.size() == 2);
  CHECK(summary.events[0].text == "switched routing");
  CHECK(summary.events[1].text == "lr decay");

  // A stream that detached before the commit gets no ack (its pointer may be reused).
  REQUIRE_FALSE(run.AddEvent({20, "data mix changed", "trainer", 0}, 0, 14, &sink).has_value());
  run.Detach(0, &sink);
  REQUIRE(journal.value()->Flush().ok());
  CHECK(sink.event_acks.size() == 3);
  run_for_commits = nullptr;
  journal.value()->Stop();
}

TEST_CASE("while the journal cannot commit, a rank's steps are refused until its next Hello", "[runs]") {
  TempDir dir;
  FakeClock clock;
  RunOptions options;
  DaemonStats stats;
  store::JournalOptions journal_options;
  journal_options.path = dir.db();
  auto journal = store::Journal::Open(journal_options, nullptr);
  REQUIRE(journal.ok());
  RunMeta meta;
  meta.run_id = "r1";
  Run run(meta, options, journal.value().get(), &stats, &clock, true);
  RecordingSink sink;
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info).has_value());
  RankStep step;
  step.step = 1;
  REQUIRE_FALSE(run.AddStep(0, step, &sink).has_value());
  REQUIRE(journal.value()->Flush().ok());

  // Fault injection from outside the daemon: no step can be written any more.
  sqlite3* raw = nullptr;
  REQUIRE(sqlite3_open(journal_options.path.c_str(), &raw) == SQLITE_OK);
  sqlite3_busy_timeout(raw, 5000);
  REQUIRE(sqlite3_exec(raw, "CREATE TRIGGER fail BEFORE INSERT ON steps BEGIN SELECT RAISE(ABORT, 'full'); END",
                       nullptr, nullptr, nullptr) == SQLITE_OK);
  step.step = 2;
  REQUIRE_FALSE(run.AddStep(0, step, &sink).has_value());  // taken before the fault shows
  CHECK_FALSE(journal.value()->Flush().ok());
  step.step = 3;
  const auto refused = run.AddStep(0, step, &sink);
  REQUIRE(refused.has_value());
  CHECK(refused->reason == IngestErrorReason::kStorageUnavailable);
  CHECK(run.Info().last_step == 2);  // nothing of step 3 was taken
  CHECK(run.AddEvent({3, "x", "trainer", 0}, 0, 9, &sink)->reason == IngestErrorReason::kStorageUnavailable);

  // The fault clears: step 2 is committed; the rank is still refused until it says Hello again,
  // so that nothing after its refused step 3 is taken before step 3 itself.
  REQUIRE(sqlite3_exec(raw, "DROP TRIGGER fail", nullptr, nullptr, nullptr) == SQLITE_OK);
  sqlite3_close(raw);
  for (int i = 0; i < 200 && !journal.value()->healthy(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the back-off is at most 2 s
  }
  REQUIRE(journal.value()->healthy());
  step.step = 4;
  CHECK(run.AddStep(0, step, &sink).has_value());
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info).has_value());
  CHECK(info.last_received_step == 2);
  step.step = 3;
  CHECK_FALSE(run.AddStep(0, step, &sink).has_value());
  journal.value()->Stop();
}

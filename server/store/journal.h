// The durable journal: runs, catalogs, series keys, completed steps and events in SQLite (WAL
// mode), written by one thread with group commit. Callers enqueue without blocking on I/O; after
// each commit the journal reports the durable progress so that acks can go out.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"

struct sqlite3;

namespace gradwatch::store {

struct JournalOptions {
  // SQLite database file; its directory must exist.
  std::string path;
  // Most records in one transaction.
  size_t batch_max = 4096;
  // Records wait at most this long for companions before a commit starts (group commit window).
  std::chrono::milliseconds max_delay{20};
  // Most records waiting; Enqueue returns false beyond it (the caller reports the loss).
  size_t queue_max = 1 << 20;
};

// Journal record types. A run's records are committed in the order they were enqueued.
struct RunRecord {
  RunMeta meta;  // params are written by ParamsRecord, not here
};
struct ParamsRecord {
  std::string run_id;
  uint32_t first_index = 0;  // index of params[0] in the catalog
  std::vector<ParamInfo> params;
};
struct SeriesRecord {
  std::string run_id;
  SeriesId id = 0;
  std::string key;
};
// Durable progress of one rank: all its steps ≤ step are committed.
struct RankProgress {
  std::string run_id;
  uint32_t rank = 0;
  uint64_t step = 0;
  uint64_t seq = 0;  // highest TrainerMessage.seq covered
};
struct StepJournalRecord {
  std::string run_id;
  CompletedStep step;
  std::vector<RankProgress> progress;  // ranks whose reports this step covered
};
struct EventJournalRecord {
  std::string run_id;
  EventRecord event;
};
struct RunEndedRecord {
  std::string run_id;
  double ended_at = 0;  // seconds since the Unix epoch; 0 marks the run active again
  EndReason reason = EndReason::kInactive;  // ignored when ended_at is 0
  std::string message;                      // the Goodbye's message
};

using JournalRecord = std::variant<RunRecord, ParamsRecord, SeriesRecord, StepJournalRecord,
                                   EventJournalRecord, RunEndedRecord>;

struct CommitReport {
  size_t records = 0;
  std::chrono::duration<double> duration{};  // of the transaction, BEGIN to COMMIT
  std::vector<RankProgress> progress;        // durable progress made by this commit
  std::vector<std::string> clean_ends;       // runs whose Goodbye (finished, stopped) it made durable
};

// Receives everything the journal holds, in order: all runs (each followed by its params,
// series, rank progress), then events (so that analytics know them before the steps they
// concern), then steps ordered by run and step.
class JournalVisitor {
 public:
  virtual ~JournalVisitor() = default;
  virtual void OnRun(const RunMeta& meta, const RunEnd& end) = 0;  // meta.params filled
  virtual void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) = 0;
  virtual void OnRankProgress(const RankProgress& progress) = 0;
  virtual void OnStep(const std::string& run_id, const CompletedStep& step) = 0;
  virtual void OnEvent(const std::string& run_id, const EventRecord& event) = 0;
};

// Thread-safe. The commit callback runs on the journal's thread after each commit; it must not
// block for long and must not call back into the journal's Flush or Stop.
class Journal {
 public:
  using CommitCallback = std::function<void(const CommitReport&)>;

  // Opens (creating if needed) the database, sets WAL mode and the schema, starts the thread.
  static StatusOr<std::unique_ptr<Journal>> Open(const JournalOptions& options, CommitCallback on_commit);
  ~Journal();  // Stop()s

  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Reads everything back (call before enqueueing, typically at start-up). Serialised with
  // commits, so it sees a consistent committed state. A corrupt row (bad value blob, bad JSON)
  // stops the load with Status::Internal naming the run and step. Parameter indexes missing from
  // a catalog (their ParamsRecord was lost) are filled with default ParamInfo so that later
  // indexes keep their position. Returns FailedPrecondition after Stop().
  Status Load(JournalVisitor& visitor);

  // Queues a record for the next commit. Never blocks on I/O. Returns false if the queue is full
  // or the journal is stopped (the record is not kept).
  bool Enqueue(JournalRecord record);

  // Blocks until everything enqueued before the call is committed (or failed). Returns the
  // status of the last commit, except that a commit failing during the wait is returned even if
  // a later one succeeded, so a lost record is never reported as durable.
  Status Flush();

  // Commits what is queued, stops the thread, closes the database. Idempotent.
  void Stop();

  // A step record for Enqueue whose buffers come from already committed records, so that the
  // ingest path does not allocate once warm. Fields hold stale values: overwrite all of them.
  StepJournalRecord AcquireStepRecord();

  // Records waiting for a commit (not counting the batch being committed).
  size_t queue_depth() const;
  // Successful commits, and failed (rolled back) commits, since open.
  uint64_t commit_count() const;
  uint64_t failed_commit_count() const;

 private:
  struct Statements;  // prepared once at open, reused by every commit

  Journal(JournalOptions options, CommitCallback on_commit, sqlite3* db,
          std::unique_ptr<Statements> statements);
  void Run();
  Status Commit(std::vector<JournalRecord>& batch, CommitReport& report);
  Status Apply(const JournalRecord& record);  // caller holds db_mu_ inside a transaction

  const JournalOptions options_;
  const CommitCallback on_commit_;

  // Serialises use of the connection between the writer thread, Load and Stop.
  std::mutex db_mu_;
  sqlite3* db_;                             // guarded by db_mu_; null once stopped
  std::unique_ptr<Statements> statements_;  // guarded by db_mu_

  mutable std::mutex mu_;
  std::condition_variable cv_;          // wakes the writer thread
  std::condition_variable flushed_cv_;  // wakes Flush() waiters
  std::vector<JournalRecord> queue_;    // guarded by mu_; swapped with the writer's batch
  std::vector<StepJournalRecord> free_steps_;  // guarded by mu_: committed records for reuse
  uint64_t enqueued_ = 0;               // guarded by mu_
  uint64_t committed_ = 0;              // guarded by mu_: records committed or failed
  Status last_status_;                  // guarded by mu_
  Status last_failure_;                 // guarded by mu_: the most recent failed commit
  bool stopping_ = false;               // guarded by mu_
  size_t flush_waiters_ = 0;            // guarded by mu_: a waiter cuts the group window short
  uint64_t commits_ = 0;                // guarded by mu_
  uint64_t failed_commits_ = 0;         // guarded by mu_

  std::mutex stop_mu_;  // makes concurrent Stop() calls join and close once
  std::thread thread_;
};

}  // namespace gradwatch::store

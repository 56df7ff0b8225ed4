// The durable journal: runs, catalogs, series keys, completed steps and events in SQLite (WAL
// mode), written by one thread with group commit. Steps are committed one row each and then
// sealed, block_steps at a time, into compressed column blocks (step_block.h): about 2-3 bytes a
// value instead of 12. A rewind (a run resumed from a checkpoint)
// moves the run's steps and events from the resume step on into abandoned_steps /
// abandoned_events, numbered by the branch they belonged to (0 for the run's first), so the
// abandoned branch stays inspectable but is never mixed with the new one nor returned by Load. Callers enqueue without
// blocking on I/O; after each commit the journal reports the durable progress so that acks can go out.
// Its code is in rooms (journal_internal.h names them), with the StepSealer and the RunPruner.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/core/types.h"
#include "server/store/journal_check.h"
#include "server/store/sqlite.h"

namespace gradwatch::store {

namespace journal_internal {
struct Statements;
class StepSealer;
class RunPruner;
}  // namespace journal_internal

class StepBlockEncoder;

struct JournalOptions {
  // SQLite database file; its directory must exist.
  std::string path;
  // Most records in one transaction.
  size_t batch_max = 4096;
  // Records wait at most this long for companions before a commit starts (group commit window).
  std::chrono::milliseconds max_delay{20};
  // Most records waiting; Enqueue returns false beyond it (the caller reports the loss).
  size_t queue_max = 1 << 20;
  // Most rows one pruning transaction deletes; commits wait at most for one such batch. A block of
  // steps counts as block_steps rows.
  size_t prune_batch_rows = 2000;
  // Steps per compressed block (see step_block.h). A step is committed (and acked) as a row of its
  // own; once a run has block_steps such rows above its last block, the writer seals them into one
  // block in a transaction after the commit (not synced by itself: the next commit's fsync covers
  // it; lost, the rows are simply still there).
  size_t block_steps = 128;
  // PRAGMA quick_check reads the whole file (1.4 s per 320 MB here): it runs at open only while the
  // database is at most this large, or when the WAL's recovery dropped something (a damaged tail,
  // a WAL missing after an unclean stop). Larger journals find damage when their rows are read.
  uint64_t quick_check_max_bytes = uint64_t{256} << 20;
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
  // In memory only: the run's rewinds in this process's life when the step completed. Progress
  // from an older branch is stale once the run rewound (see Run::OnDurable).
  uint64_t branch = 0;
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
  double ended_at = 0;                      // seconds since the Unix epoch; 0 marks the run active again
  EndReason reason = EndReason::kInactive;  // ignored when ended_at is 0
  std::string message;                      // the Goodbye's message
};

// The run resumed from a checkpoint at from_step: its steps and events at or after from_step
// become the abandoned branch, rank progress drops to from_step − 1 (none when from_step is 0)
// and to ranks below world_size, and the run's world size becomes world_size.
struct RewindRecord {
  std::string run_id;
  uint64_t from_step = 0;
  uint32_t world_size = 1;
  double rewound_at = 0;  // seconds since the Unix epoch
};

using JournalRecord = std::variant<RunRecord, ParamsRecord, SeriesRecord, StepJournalRecord, EventJournalRecord,
                                   RunEndedRecord, RewindRecord>;

struct CommitReport {
  size_t records = 0;
  std::chrono::duration<double> duration{};  // of the transaction, BEGIN to COMMIT
  std::vector<RankProgress> progress;        // durable progress made by this commit
  std::vector<std::string> clean_ends;       // runs whose Goodbye (finished, stopped) it made durable
  uint64_t committed_through = 0;            // every record numbered ≤ this is committed
};

// What opening the journal found about its own state (start-up recovery). SQLite recovers the
// WAL by itself, silently: committed transactions are kept, anything after the last commit frame
// that checks out is dropped. This makes what it dropped visible.
struct RecoveryReport {
  // The shared-memory index of an unclean stop is there but its WAL is not: the WAL was deleted
  // while the daemon was stopped, and every transaction since the last checkpoint is lost.
  bool wal_missing = false;
  // WAL frames after the last good transaction, not recovered (a transaction that never
  // committed, or a damaged tail); the journal goes on from the last good transaction.
  uint64_t discarded_frames = 0;
  // Some of the discarded frames belong to the current WAL but fail their checksum: the tail was
  // damaged, not merely unfinished.
  bool corrupt_tail = false;
  // The database is damaged: PRAGMA quick_check (see quick_check_max_bytes) found problems, or SQLite
  // called the file corrupt or not a database while opening it or setting up the schema.
  bool damaged = false;
  // A damaged journal is never opened for writing: its files were renamed to moved_files (the
  // database first; never deleted), what could be read was copied into a fresh journal, and the
  // daemon goes on with that. Runs are copied whole or not at all: salvaged_runs were, lost_runs
  // (their ids in lost_run_ids) could not be read cleanly; lost_tables are other tables (the
  // alert store's) that could not be copied. Clients resend what they did not see acked.
  bool moved_aside = false;
  std::vector<std::string> moved_files;
  uint64_t salvaged_runs = 0;
  uint64_t lost_runs = 0;
  std::vector<std::string> lost_run_ids;
  std::vector<std::string> lost_tables;
  std::string detail;  // what was found, for the log
  bool ok() const { return !wal_missing && discarded_frames == 0 && !damaged; }
};

// What Journal::Repair found in a journal and did with it.
struct RepairReport {
  std::string journal;                    // its path
  std::string sqlite_problem;             // what SQLite said (open, quick_check), empty when it read the file
  std::vector<DamagedSteps> damaged;      // blocks and rows whose checksum failed: left out
  uint64_t damaged_steps = 0;             // steps they held
  uint64_t runs_copied = 0;               // runs in the repaired journal
  std::vector<std::string> lost_run_ids;  // runs that could not be read
  std::vector<std::string> lost_tables;   // other tables (the alert store's) that could not be read
  bool replaced = false;                  // the repaired copy took the journal's place
  std::vector<std::string> moved_files;   // where the old files went then (kept, never deleted)
  bool sound() const {
    return sqlite_problem.empty() && damaged.empty() && lost_run_ids.empty() && lost_tables.empty();
  }
};

// Receives runs from the journal, one after the other in creation order: each run, then (unless
// OnRun declines it) its series, rank progress and latest rewind, its events (so that analytics
// know them before the steps they concern), then (OnStepsBegin) its steps in step order: the
// current branch only.
class JournalVisitor {
 public:
  virtual ~JournalVisitor() = default;
  // meta.params filled. Returns whether to read the run's rows (false: skip the run).
  virtual bool OnRun(const RunMeta& meta, const RunEnd& end) = 0;
  virtual void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) = 0;
  virtual void OnRankProgress(const RankProgress& progress) = 0;
  virtual void OnStep(const std::string& run_id, const CompletedStep& step) = 0;
  virtual void OnEvent(const std::string& run_id, const EventRecord& event) = 0;
  // The run's latest rewind (after its rank progress, only for a run that rewound): steps and
  // events of abandoned branches are not visited.
  virtual void OnRewind(const std::string& run_id, uint64_t from_step) = 0;
  // Just before the run's steps: `branch` is its current branch (the number of its rewinds).
  // Returns the first step to visit: steps below it are skipped (a visitor that restored the run
  // from a snapshot through a step wants only the steps after it); 0 visits them all.
  virtual uint64_t OnStepsBegin(const std::string& run_id, uint64_t branch) {
    (void)run_id;
    (void)branch;
    return 0;
  }
  // A run the visitor kept could not be read to the end (a corrupt row: bad value blob, bad JSON,
  // a damaged page): forget what was handed out for it. Load goes on with the next run.
  virtual void OnRunFailed(const std::string& run_id, const Status& why) = 0;
};

// A run that the journal holds but the daemon no longer holds in memory (an archived run).
struct StoredRun {
  RunMeta meta;  // params not filled
  RunEnd end;
  uint64_t step_count = 0;
  uint64_t first_step = 0, last_step = 0;  // valid when step_count > 0
  double last_wall_time = 0;
};

// Thread-safe. The commit callback runs on the journal's thread after each commit; it must not
// block for long and must not call back into the journal's Flush or Stop.
//
// Retention: the journal knows which runs the daemon holds in memory ("held": those Load kept,
// those LoadRun read, until Release). SetPruneCutoff lets the journal's own thread delete the rows
// of ended runs that are not held and ended before the cutoff (steps, events, series, params,
// progress, then the run), in transactions of at most prune_batch_rows rows taken between group
// commits, so ingest waits for at most one batch. Freed pages are reused by later writes (no
// VACUUM), so under steady churn the file stops growing; the WAL is truncated to 64 MiB after
// checkpoints.
//
// Files that vanish or are replaced while the journal runs (the data directory deleted, the
// database or its WAL deleted or swapped): SQLite would go on writing to the unlinked files, and
// those commits would be acked and lost at the next start. The journal checks before and after
// every commit, and every second when idle, that the files at its path are the ones it has open.
// When they are not, it is a storage fault (healthy() false, nothing acked) until the journal is
// rebuilt: the directory is created again if needed, whatever now sits at the journal's paths is
// renamed to `<path>.detached-<UTC time>` (never deleted), and the open connection — which still
// reads the unlinked files — is copied with SQLite's online backup into a new file that is then
// renamed into place and used from then on. So every record committed before (runs, catalogs,
// steps, events, progress, and the alert store's tables) is kept, and a commit made to the lost
// files is acked only once the rebuilt file holds it. Lost if the process ends before the rebuild.
// What a journal has done since open (Journal::stats), for /metrics and tests.
struct JournalStats {
  size_t queue_depth = 0;       // records waiting for a commit (not the batch being committed)
  uint64_t commits = 0;         // successful commits
  uint64_t failed_commits = 0;  // failed (rolled back) commit attempts
  uint64_t storage_faults = 0;  // times it went from healthy to failing
  // Records given up: still failing to commit when Stop() ran (never acked, so resent by their
  // ranks to the next daemon).
  uint64_t dropped_records = 0;
  // Times its files were found vanished or replaced while it ran, and times it rebuilt them from
  // its open connection (see Journal's storage faults).
  uint64_t files_lost = 0;
  uint64_t rebuilds = 0;
  uint64_t pruned_runs = 0;  // ended runs deleted (SetPruneCutoff)
  uint64_t pruned_rows = 0;  // their rows
};

class Journal {
 public:
  using CommitCallback = std::function<void(const CommitReport&)>;

  // Opens (creating if needed) the database, sets WAL mode and the schema, starts the thread. A
  // damaged database (see RecoveryReport::moved_aside) is moved aside and salvaged into a fresh
  // one rather than refused, so a damaged journal never stops the daemon from starting.
  static StatusOr<std::unique_ptr<Journal>> Open(const JournalOptions& options, CommitCallback on_commit);
  ~Journal();  // Stop()s

  // `gradwatchd --repair`: checks the journal at `path` (not open elsewhere: the caller holds the
  // data directory's lock) with quick_check and every step checksum. When it finds damage and
  // !dry_run, copies every run that can be read into a fresh journal, leaving out the damaged
  // blocks and rows (and runs SQLite cannot read), renames the old files aside
  // (`<path>.before-repair-<time>`) and puts the copy in their place. A sound journal is left as it
  // is. Error only when the repair could not be made (the old files are then untouched).
  static Status Repair(const std::string& path, bool dry_run, RepairReport& report);

  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Reads everything back (call before enqueueing, typically at start-up); the runs the visitor
  // keeps become held. Serialised with commits, so it sees a consistent committed state. A run
  // that cannot be read to the end (a corrupt row: bad value blob, bad JSON, a damaged page) is
  // handed to OnRunFailed, logged, not held, and Load goes on with the next run: one bad run never
  // keeps the daemon from starting. Rows of a run missing from the runs table are not read.
  // Parameter indexes missing from a catalog (their ParamsRecord was lost) are filled with
  // default ParamInfo so that later indexes keep their position. Returns an error only when the
  // list of runs cannot be read (the runs read before it are kept), FailedPrecondition after Stop().
  Status Load(JournalVisitor& visitor) EXCLUDES(db_mu_, held_mu_, mu_);

  // Calls on_step with every step of the run's current branch below before_step, in step order,
  // as committed now (Flush first to include what is queued). Serialised with commits; O(steps
  // read). For rebuilding a run's analytics after a rewind; never call it on the ingest hot path.
  Status LoadRunSteps(const std::string& run_id, uint64_t before_step,
                      const std::function<void(const CompletedStep&)>& on_step) EXCLUDES(db_mu_);
  // Reads one run back (a run that left memory and came back) as committed: a record still queued
  // for it (possible only when it left memory a moment ago) is not seen, and lands after. The run
  // becomes held, found or not; NotFound when the journal does not have it (never had, or pruned: a
  // run half pruned is finished off first). Blocks for the read.
  Status LoadRun(const std::string& run_id, JournalVisitor& visitor) EXCLUDES(db_mu_, held_mu_, mu_);
  // The daemon dropped the run from memory: its rows may be pruned once it ended before the cutoff.
  void Release(const std::string& run_id) EXCLUDES(held_mu_);
  bool IsHeld(const std::string& run_id) const EXCLUDES(held_mu_);
  // The runs in the journal that are not held, by id, with their step counts (for `runs --all`).
  StatusOr<std::vector<StoredRun>> ListReleased() EXCLUDES(db_mu_, held_mu_);
  // Runs that ended before `ended_before` (seconds since the Unix epoch) and are not held may be
  // pruned; call periodically (the cutoff only moves forward). Returns at once.
  void SetPruneCutoff(double ended_before) EXCLUDES(mu_);
  // Bytes of the database, its WAL and shared-memory files.
  uint64_t DiskBytes() const;

  // Queues a record for the next commit. Never blocks on I/O. Returns the record's number (1 for
  // the first record since open, then increasing by one), or 0 if the queue is full or the
  // journal is stopped (the record is not kept). Records are committed in number order, so
  // CommitReport::committed_through covers every record numbered at or below it.
  uint64_t Enqueue(JournalRecord record) EXCLUDES(mu_);
  // The number of the last record enqueued (0 before the first), and of the last one committed
  // (every record numbered at or below it is).
  uint64_t last_enqueued() const EXCLUDES(mu_);
  uint64_t last_committed() const EXCLUDES(mu_);

  // Blocks until everything enqueued before the call is committed, or until a commit attempt
  // fails during the wait (its records are kept and retried). Returns the status of the last
  // commit, except that a failure during the wait is returned even if a later attempt succeeded,
  // so a record is never reported as durable before it is.
  Status Flush() EXCLUDES(mu_);

  // Commits what is queued, stops the thread, closes the database. Idempotent.
  void Stop() EXCLUDES(stop_mu_, db_mu_, mu_);

  // A step record for Enqueue whose buffers come from already committed records, so that the
  // ingest path does not allocate once warm. Fields hold stale values: overwrite all of them.
  StepJournalRecord AcquireStepRecord() EXCLUDES(mu_);

  // What the journal has done since open (see JournalStats).
  JournalStats stats() const EXCLUDES(mu_);

  // What opening the journal found; logged at Open (an error when !ok()).
  const RecoveryReport& recovery() const { return recovery_; }
  // Step blocks and rows found damaged (their checksums, journal_check.h) since open: by the scrub
  // at open (when quick_check runs, see quick_check_max_bytes), and whenever steps are read.
  const DamageLog& damage() const { return damage_; }

  // Storage faults. A commit that fails (full disk, read-only, immutable or vanished files, I/O
  // errors) is rolled back and tried again with the same records, after a back-off doubling from
  // 50 ms to 2 s, until it succeeds; records enqueued meanwhile wait behind it (up to queue_max).
  // No progress is reported for them until then, so nothing is acked that is not committed.
  // healthy() is false from the first failed attempt to the next successful commit: callers
  // should refuse new data meanwhile (a retryable error) rather than let the queue grow.
  bool healthy() const { return healthy_.load(std::memory_order_relaxed); }
  // Whether new data should be taken: healthy, and the queue below three quarters of queue_max,
  // so that records of data already taken always find room (Enqueue never drops them).
  bool accepting() const EXCLUDES(mu_);

 private:
  struct Reader;  // the queries of Load and LoadRun
  // An open connection with its statements, and the identity of the files it opened.
  struct Connection;

  Journal(JournalOptions options, CommitCallback on_commit, Connection connection);
  // Opens the database at `path` for the journal; `*damaged` tells a failure caused by the file's
  // contents (corruption, not a database) from one of the storage. `check` runs quick_check.
  static Status OpenConnection(const std::string& path, bool check, RecoveryReport& recovery, bool* damaged,
                               Connection& out);
  // Renames the damaged files aside, opens a fresh database and copies into it what can be read.
  static Status MoveAsideAndSalvage(const std::string& path, RecoveryReport& recovery, Connection& out);

  void Run() EXCLUDES(db_mu_, mu_);
  Status Commit(std::vector<JournalRecord>& batch, CommitReport& report) EXCLUDES(db_mu_);
  Status Apply(const JournalRecord& record) REQUIRES(db_mu_);       // inside a transaction
  Status ApplyRewind(const RewindRecord& record) REQUIRES(db_mu_);  // likewise
  // Seals the runs due a block, after a commit (its own transaction).
  void SealDue() EXCLUDES(db_mu_);
  // Fails when the database or its WAL is gone or replaced since it was opened.
  Status CheckFilesLocked() REQUIRES(db_mu_);
  // CheckFilesLocked, and when the files are lost, rebuilds them (see the class comment).
  Status EnsureFilesLocked() REQUIRES(db_mu_);
  Status RebuildLocked(const std::string& why) REQUIRES(db_mu_);
  // One pruning transaction of at most max_rows rows.
  Status PruneBatchLocked(size_t max_rows) REQUIRES(db_mu_) EXCLUDES(held_mu_, mu_);
  // One batch from the writer thread; mu_ is released during the batch.
  void PruneOnce() REQUIRES(mu_) EXCLUDES(db_mu_);
  // The writer thread's file check while no record waits.
  void CheckFilesWhileIdle() REQUIRES(mu_) EXCLUDES(db_mu_);
  // Fault bookkeeping of the writer thread: a failed attempt (commit or file check) holding
  // `held` records, and the first success after failures.
  void NoteFailureLocked(const Status& status, size_t held) REQUIRES(mu_);
  void NoteSuccessLocked() REQUIRES(mu_);

  // Lock order: stop_mu_, then db_mu_, then held_mu_, then mu_ (a function holding one may take
  // those after it, never those before).
  Mutex stop_mu_;  // makes concurrent Stop() calls join and close once
  std::thread thread_ GUARDED_BY(stop_mu_);

  const JournalOptions options_;
  const CommitCallback on_commit_;
  RecoveryReport recovery_;  // set once by Open before the writer thread starts; read-only after

  // Serialises use of the connection between the writer thread, Load and Stop.
  Mutex db_mu_ ACQUIRED_AFTER(stop_mu_);
  sqlite::Database db_ GUARDED_BY(db_mu_);  // closed once stopped
  std::unique_ptr<journal_internal::Statements> statements_ GUARDED_BY(db_mu_);
  std::unique_ptr<journal_internal::StepSealer> sealer_ GUARDED_BY(db_mu_);
  std::unique_ptr<journal_internal::RunPruner> pruner_ GUARDED_BY(db_mu_);
  uint64_t db_dev_ GUARDED_BY(db_mu_) = 0, db_ino_ GUARDED_BY(db_mu_) = 0;    // the database file open
  uint64_t wal_dev_ GUARDED_BY(db_mu_) = 0, wal_ino_ GUARDED_BY(db_mu_) = 0;  // its WAL
  // The last transaction committed to files that were lost meanwhile: the batch is retried by
  // rebuilding, not by applying it again.
  bool committed_to_lost_files_ GUARDED_BY(db_mu_) = false;
  bool files_lost_reported_ GUARDED_BY(db_mu_) = false;  // logged once per loss

  mutable Mutex held_mu_ ACQUIRED_AFTER(db_mu_);
  std::set<std::string> held_ GUARDED_BY(held_mu_);
  std::atomic<uint64_t> pruned_runs_{0};
  std::atomic<uint64_t> pruned_rows_{0};

  mutable Mutex mu_ ACQUIRED_AFTER(held_mu_);
  CondVar cv_;                                                 // wakes the writer thread
  CondVar flushed_cv_;                                         // wakes Flush() waiters
  std::vector<JournalRecord> queue_ GUARDED_BY(mu_);           // swapped with the writer's batch
  std::vector<StepJournalRecord> free_steps_ GUARDED_BY(mu_);  // committed records for reuse
  uint64_t enqueued_ GUARDED_BY(mu_) = 0;
  uint64_t committed_ GUARDED_BY(mu_) = 0;  // records committed, or given up at Stop
  Status last_status_ GUARDED_BY(mu_);
  Status last_failure_ GUARDED_BY(mu_);  // the most recent failed commit
  bool stopping_ GUARDED_BY(mu_) = false;
  size_t flush_waiters_ GUARDED_BY(mu_) = 0;  // a waiter cuts the group window short
  uint64_t commits_ GUARDED_BY(mu_) = 0;
  uint64_t failed_commits_ GUARDED_BY(mu_) = 0;
  double prune_cutoff_ GUARDED_BY(mu_) = 0;
  bool prune_due_ GUARDED_BY(mu_) = false;  // SetPruneCutoff asked, not yet done
  std::chrono::steady_clock::time_point fault_started_ GUARDED_BY(mu_);
  std::chrono::milliseconds retry_delay_ GUARDED_BY(mu_){0};

  DamageLog damage_;

  std::atomic<bool> healthy_{true};  // written under mu_ by the writer thread
  std::atomic<uint64_t> storage_faults_{0};
  std::atomic<uint64_t> dropped_records_{0};
  std::atomic<uint64_t> files_lost_{0};
  std::atomic<uint64_t> rebuilds_{0};
};

}  // namespace gradwatch::store

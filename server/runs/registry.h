// All runs the daemon holds in memory, by id. Creates runs on their first Hello, restores them
// from the journal at start-up (and a run that left memory when it comes back), routes journal
// progress to the runs, drives timeouts, and drops ended runs from memory after their retention.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "server/core/clock.h"
#include "server/core/status.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/run.h"
#include "server/store/journal.h"
#include "server/store/snapshots.h"

namespace gradwatch::runs {

// Thread-safe. Runs are shared_ptrs so a stream keeps its run alive while it works on it.
//
// Memory: at most `max_runs` runs are held, active or ended. An ended run with no open stream
// stays held (queryable, on /metrics' run counts) for options.retention after it ended, then is
// dropped from memory: the journal keeps it (an "archived" run) until pruned. When a Hello needs
// room and every slot is taken, the run that ended first (and has no open stream) is dropped early;
// only when every held run is active is the Hello refused with LIMIT_EXCEEDED.
//
// Memory budget (options.budget): a Hello creating a run whose catalog does not fit is refused with
// LIMIT_EXCEEDED before the run is allocated or journaled. At Load (and when a run comes back), a
// journaled run that does not fit, or whose rebuild runs out of memory, is skipped with an error
// logged and counted (DaemonStats::runs_not_restored): it stays in the journal, and the daemon
// starts without it instead of failing at every start.
//
// A run id that comes back after it left memory is restored from the journal (its catalog,
// history, events and durable progress, as at start-up) and goes on; if the journal no longer has
// it (pruned), it starts afresh as a new run.
class RunRegistry {
 public:
  RunRegistry(const RunOptions& options, size_t max_runs, DaemonStats* stats, const Clock* clock);

  // The journal to write to; set once, before Load and before any stream.
  void set_journal(store::Journal* journal) { journal_ = journal; }

  // Where runs' snapshots are kept (null: none, every restart replays the whole journal); set
  // once, before Load and before any stream.
  void set_snapshots(const store::SnapshotStore* snapshots) { snapshots_ = snapshots; }

  // Rebuilds the runs from the journal: the active ones and those that ended less than
  // options.retention ago; older ones stay archived in the journal. A run with a snapshot that is
  // true to the journal (Run::RestoreSnapshot) is restored from it and the journal's steps after
  // it; the others from all their journaled steps. Snapshots of runs not restored are deleted.
  Status Load();

  struct SnapshotReport {
    size_t written = 0;    // runs whose snapshot was written
    size_t unchanged = 0;  // runs with no step since their last snapshot
    size_t failed = 0;
    size_t deferred = 0;  // runs whose `settle` did not confirm in time: taken at the next pass
    uint64_t bytes = 0;
    double max_lock_seconds = 0;  // the longest a run's lock was held to copy its state
  };
  // Writes a snapshot of every run held that completed a step since its last one. The journal is
  // flushed between copying a run's state and writing it, so a snapshot never covers a step the
  // journal could lose; `settle(run_id, step)`, when given, must then confirm that the listener's
  // own saved state covers the snapshot's last step (Alerting::SaveEvaluatedThrough), or the run
  // is left for the next pass. Blocks (I/O): call it from a thread of its own, not concurrently
  // with itself. Failures are logged and counted; the journal is then simply replayed further.
  SnapshotReport SaveSnapshots(const std::function<bool(const std::string&, uint64_t)>& settle = nullptr);

  // Handles a Hello: finds, restores or creates the run, validates, attaches the sink. On error
  // returns nullptr and fills *error. Restoring a run reads the journal (once, on this thread).
  std::shared_ptr<Run> Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info,
                              IngestError* error);

  std::shared_ptr<Run> Find(const std::string& run_id) const;
  // Every run held, ordered by id.
  std::vector<std::shared_ptr<Run>> All() const;
  // The runs the journal holds that are not in memory (empty without a journal).
  StatusOr<std::vector<store::StoredRun>> Archived() const;

  // Assembly timeouts, run ending, and dropping runs past their retention; call periodically.
  void Tick();
  // Journal commit callback: routes durable progress and committed events to the runs (and so to
  // their streams). O(runs held) per commit.
  void OnCommit(const store::CommitReport& report);

  size_t run_count() const;
  // The last step of the run's latest snapshot, written or restored from (nullopt: none yet); a
  // restart replays only the journal's steps after it.
  std::optional<uint64_t> SnapshotStep(const std::string& run_id) const;
  // The (series, threshold) pairs every run forecasts from now on, held runs included (a reload
  // of the rules moved a forecast rule's threshold): Run::SetForecasts.
  void SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts);

  // The budget runs are charged to (null: unlimited).
  const MemoryBudget* budget() const { return options_.budget; }

 private:
  class Loader;

  std::shared_ptr<Run> AttachOnce(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info,
                                  IngestError* error);

  // Makes room for one more run, dropping the held run that ended first if every slot is taken.
  // False when every held run is active. Caller holds admit_mu_.
  bool MakeRoom();
  // Drops these runs from memory (already removed from runs_): the journal may prune them, their
  // alerts are told.
  void Forget(const std::vector<std::string>& run_ids);

  // SetForecasts' list for a run created or restored now; nullopt: options_.analytics.forecasts.
  std::optional<std::vector<std::pair<std::string, double>>> Forecasts() const;

  const RunOptions options_;
  const size_t max_runs_;
  DaemonStats* const stats_;
  const Clock* const clock_;
  store::Journal* journal_ = nullptr;
  const store::SnapshotStore* snapshots_ = nullptr;

  // The latest snapshot of each run held, which SaveSnapshots skips while it is current.
  mutable std::mutex snapshot_mu_;  // after mu_ and the runs' mutexes in lock order; never held across I/O
  std::unordered_map<std::string, Run::SnapshotMark> snapshot_marks_;  // guarded by snapshot_mu_
  // The size of each run's latest snapshot, to size the next one's buffer; guarded by snapshot_mu_.
  std::unordered_map<std::string, size_t> snapshot_bytes_;

  std::mutex admit_mu_;  // serialises restoring and creating runs (not the ingest of held ones)
  // Lock order: admit_mu_, then mu_, then a run's mutex.
  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Run>> runs_;  // guarded by mu_

  // After admit_mu_ in lock order, before mu_; held only to copy the list.
  mutable std::mutex forecasts_mu_;
  std::optional<std::vector<std::pair<std::string, double>>> forecasts_;  // guarded by forecasts_mu_
};

}  // namespace gradwatch::runs

// All runs the daemon knows, by id. Creates runs on their first Hello, restores them from the
// journal at start-up, routes journal progress to the runs, and drives timeouts.
#pragma once

#include <memory>
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

namespace gradwatch::runs {

// Thread-safe. Runs are shared_ptrs so a stream keeps its run alive while it works on it.
class RunRegistry : private store::JournalVisitor {
 public:
  RunRegistry(const RunOptions& options, size_t max_runs, DaemonStats* stats, const Clock* clock);

  // The journal to write to; set once, before Load and before any stream.
  void set_journal(store::Journal* journal) { journal_ = journal; }

  // Rebuilds every run from the journal.
  Status Load();

  // Handles a Hello: finds or creates the run, validates, attaches the sink. On error returns
  // nullptr and fills *error.
  std::shared_ptr<Run> Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info,
                              IngestError* error);

  std::shared_ptr<Run> Find(const std::string& run_id) const;
  // Every run, ordered by id.
  std::vector<std::shared_ptr<Run>> All() const;

  // Assembly timeouts and run ending; call periodically.
  void Tick();
  // Journal commit callback: routes durable progress to the runs (and so to their streams).
  void OnCommit(const store::CommitReport& report);

  size_t run_count() const;

 private:
  void OnRun(const RunMeta& meta, const RunEnd& end) override;
  void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) override;
  void OnRankProgress(const store::RankProgress& progress) override;
  void OnStep(const std::string& run_id, const CompletedStep& step) override;
  void OnEvent(const std::string& run_id, const EventRecord& event) override;

  const RunOptions options_;
  const size_t max_runs_;
  DaemonStats* const stats_;
  const Clock* const clock_;
  store::Journal* journal_ = nullptr;

  mutable std::shared_mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Run>> runs_;  // guarded by mu_
};

}  // namespace gradwatch::runs

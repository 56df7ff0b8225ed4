// RunRestore: a run read back from the journal and its snapshot, at start-up or when it returns
// to memory (RunRegistry's journal visitor). The journal hands each run's records in order: its
// series, rank progress, rewind, branch and events, then (when one is kept) its snapshot, then the
// steps after it, its end; Finish maps the run's fixed and catalog series once all is read. The
// one way into a Run for what was not received live; each call takes the run's lock.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/state_io.h"
#include "server/core/thread_annotations.h"
#include "server/core/types.h"
#include "server/runs/run.h"
#include "server/store/journal.h"

namespace gradwatch::runs {

class RunRestore {
 public:
  explicit RunRestore(Run& run) : run_(run) {}

  void Series(SeriesId id, const std::string& key);
  void Progress(const store::RankProgress& progress);
  // Adds a journaled step (in step order), published to the listener as restored.
  void Step(const CompletedStep& step);
  void Event(const EventRecord& event);
  // The run's latest rewind was to from_step (so a Hello resuming from it again is idempotent).
  void Rewind(uint64_t from_step);
  // How the run ended (not at all when !end.ended()). An ended run's last sign of life is dated
  // from it, so a dead run keeps paging across a daemon restart; an active one starts a fresh
  // grace period, as if its streams had just closed.
  void Ended(const RunEnd& end);
  // A RunDied page restored from before a restart says the run was last alive at `unix_seconds`:
  // an active run with no stream yet is treated as silent since then (not given a fresh grace
  // period), so the page neither resolves nor pages again. Ignored once a stream is open.
  void SilentSince(double unix_seconds);
  // The run's current branch in the journal (JournalVisitor::OnStepsBegin): the number of its
  // rewinds. Snapshots are taken on a branch and only restored on it.
  void Branch(uint64_t branch);
  // After the run's series, progress, rewind and events and before its steps: reads `payload` (a
  // snapshot Run::SaveSnapshot wrote) and, when it is true to the journal (taken on the current
  // branch, of series the journal holds under the same ids) and the listener can take the run up
  // from it (RunChannel::AcceptsRestoreThrough), installs its series, counters and analytics,
  // then adds the journaled events it did not know. Returns the step it covers through: the
  // journal's steps after it are to be restored (Step). Otherwise the run is left as it was (its
  // series and analytics, replaced while the snapshot is read so that a large run is never held
  // twice, are made again with no step), nullopt is returned and *why says why (every step is
  // then restored from the journal).
  std::optional<Run::SnapshotMark> Snapshot(std::string_view payload, std::string* why);
  // After the journal is loaded: maps the fixed and catalog series to their restored ids,
  // creating (and journaling) any that are missing.
  void Finish();

 private:
  // Analytics with no step: the catalog, the series whose `tracked` entry is set and, when
  // with_events, the run's events.
  std::unique_ptr<RunAnalytics> FreshAnalytics(const std::vector<bool>& tracked, bool with_events) REQUIRES(run_.mu_);
  // Snapshot's body after the counters: reads `count` series and the analytics from `in` into the
  // run, replacing its unstepped ones, and charges their bytes (*bytes). False with *why when the
  // snapshot is refused; the run is then partly replaced.
  bool LoadSnapshotState(StateReader& in, uint64_t count, const std::vector<bool>& had_data, uint64_t* bytes,
                         std::string* why) REQUIRES(run_.mu_);

  Run& run_;
};

}  // namespace gradwatch::runs

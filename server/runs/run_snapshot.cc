// Run: its snapshot (server/store/snapshots.h), written under its lock: the counters, every
// series' points and the analytics. RunRestore reads it back.
#include "server/runs/run_internal.h"

namespace gradwatch::runs {

uint64_t Run::SnapshotFingerprint() {
  // The sizes of what snapshots hold as bytes: a build that changes one of them does not read the
  // snapshots of another (state_io.h). Field order changes within the same sizes are covered by
  // run_internal::kSnapshotTag, bumped with them.
  uint64_t h = run_internal::kSnapshotTag;
  for (const uint64_t size :
       {sizeof(store::Point), sizeof(analytics::RegressionSums), sizeof(analytics::PackedSums),
        sizeof(analytics::LinearFit), sizeof(analytics::ChangePoint), sizeof(analytics::FilteredPoint),
        sizeof(analytics::GrowthWithoutDecay), sizeof(EventRecord), sizeof(double)}) {
    h = (h ^ size) * 1099511628211ull;
  }
  return h;
}

std::optional<Run::SnapshotMark> Run::SaveSnapshot(ByteChunks& out, std::optional<SnapshotMark> last) const {
  out.Clear();
  StateWriter w(out);
  return WriteSnapshot(w, last);
}

std::optional<size_t> Run::SnapshotBytes(std::optional<SnapshotMark> last) const {
  StateWriter w = StateWriter::Counting();
  if (!WriteSnapshot(w, last)) return std::nullopt;
  return w.size();
}

std::optional<Run::SnapshotMark> Run::WriteSnapshot(StateWriter& w, std::optional<SnapshotMark> last) const {
  MutexLock lock(&mu_);
  if (rebuilding_ || step_count_ == 0) return std::nullopt;
  const SnapshotMark mark{journal_branch_, last_step_};
  if (last == mark) return std::nullopt;
  ApplyPointsLocked();
  w.Put(run_internal::kSnapshotTag);
  w.Put(journal_branch_);
  w.Put(last_step_);
  w.Put(step_count_);
  w.Put<uint8_t>(has_first_step_ ? 1 : 0);
  w.Put(first_step_);
  w.Put(last_wall_time_);
  w.Put(partial_steps_);
  w.Put(nonfinite_count_);
  w.Put(last_nonfinite_step_);
  w.Put(client_dropped_steps_);
  w.Put<uint64_t>(speed_count_);
  for (const auto& [time, step] : speed_ring_) {
    w.Put(time);
    w.Put(step);
  }
  w.Put<uint64_t>(series_.size());
  for (const SeriesEntry& e : series_) {
    w.PutString(e.key);
    w.Put<uint8_t>(e.data ? 1 : 0);
    if (e.data) e.data->SaveState(w);
  }
  analytics_->SaveState(w);
  return mark;
}

}  // namespace gradwatch::runs

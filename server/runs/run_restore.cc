// Run: restore from the journal (series, progress, steps, events, ends, rewinds) and from a
// snapshot (its state written and read back), and the end of a restore.
#include "server/runs/run_internal.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "server/runs/catalog_change.h"

namespace gradwatch::runs {

namespace {

// Leads a run's snapshot payload: catches a payload of another kind before anything is read.
constexpr uint64_t kSnapshotTag = 0x344e5552'50414e53ull;  // "SNAPRUN4"

}  // namespace

void Run::FinishRestore() {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < run_internal::kScalarKeys.size(); ++i) {
    scalar_series_[i] = SeriesForKeyLocked(std::string(run_internal::kScalarKeys[i]), true);
  }
  param_series_.clear();
  for (const ParamInfo& p : meta_.params) {
    std::array<SeriesId, kNormFields> ids{};
    for (int f = 0; f < kNormFields; ++f) {
      ids[f] = SeriesForKeyLocked(run_internal::FieldKey(static_cast<NormField>(f), p.name), true);
    }
    param_series_.push_back(ids);
  }
  assembler_.SetParamCount(meta_.params.size());
  // Changes due at steps a snapshot covered (no step of theirs was replayed).
  if (has_first_step_) ApplyDueCatalogChangesLocked(last_step_, /*live=*/false);
}

void Run::RestoreSeries(SeriesId id, const std::string& key) {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  if (id >= series_.size()) series_.resize(id + 1);
  AddSeriesLocked(id, key);
  // The set hashes series_[id].key: the id leaves it before its key changes, and a key restored
  // under a second id maps to the later one, as the journal's records say.
  for (const std::string_view k : {std::string_view(series_[id].key), std::string_view(key)}) {
    if (auto it = series_by_key_.find(k); it != series_by_key_.end() && (*it == id || k == key)) {
      series_by_key_.erase(it);
    }
  }
  series_[id] = {key, std::make_unique<store::Series>(SeriesOptionsLocked(id, key))};
  series_by_key_.insert(id);
}

void Run::RestoreProgress(const store::RankProgress& progress) {
  MutexLock lock(&mu_);
  if (progress.rank >= ranks_.size()) return;
  RankState& rs = ranks_[progress.rank];
  rs.has_durable = rs.has_received = true;
  rs.durable_step = rs.last_received = progress.step;
  rs.durable_seq = progress.seq;
  rs.has_last_report = false;
}

void Run::RestoreStep(const CompletedStep& step) {
  run_internal::DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  AppendLocked(step);
  assembler_.RestoreLastCompleted(step.step);
  AnalyzeLocked(step, /*restored=*/true);
}

void Run::RestoreEvent(const EventRecord& event) {
  MutexLock lock(&mu_);
  // The journal hands events out in the order they were recorded; an annotation may have been
  // made for an earlier step than the events before it. events_ stays ordered by step (stable).
  events_.insert(std::upper_bound(events_.begin(), events_.end(), event.step,
                                  [](uint64_t s, const EventRecord& e) { return s < e.step; }),
                 event);
  analytics_->OnEvent(event);
  if (event.source != kCatalogEventSource) return;
  auto change = ParseCatalogChangeData(event.data);
  if (!change.ok()) {
    spdlog::error("run {}: the catalog change journaled at step {} cannot be read ({}); the catalog goes without it",
                  id_, event.step, change.status().message());
    return;
  }
  if (auto why = CheckCatalogChange(*change, meta_.params)) {
    spdlog::error("run {}: the catalog change journaled at step {} does not fit the catalog ({}); skipped", id_,
                  event.step, *why);
    return;
  }
  catalog_pending_.insert(std::upper_bound(catalog_pending_.begin(), catalog_pending_.end(), event.step,
                                           [](uint64_t s, const CatalogChangeEntry& e) { return s < e.step; }),
                          CatalogChangeEntry{event.step, std::move(change).value(), {}});
}

void Run::RestoreSilentSince(double unix_seconds) {
  MutexLock lock(&mu_);
  if (open_streams_ > 0 || end_.ended()) return;
  const double ago = std::max(0.0, clock_->UnixSeconds() - unix_seconds);
  last_activity_ = std::min(last_activity_, clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                                std::chrono::duration<double>(ago)));
}

void Run::RestoreEnded(const RunEnd& end) {
  MutexLock lock(&mu_);
  end_ = end;
  end_durable_ = end.clean();
  if (!end.ended()) return;  // an active run gets a fresh grace period to reconnect
  // Its last sign of life: an inactive run ended end_after after it; a Goodbye was it.
  const double ago = std::max(0.0, clock_->UnixSeconds() - end.ended_at);
  last_activity_ =
      clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(ago));
  if (!end.clean()) last_activity_ -= options_.end_after;
}

void Run::SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts) {
  MutexLock lock(&mu_);
  forecasts_ = forecasts;
  analytics_->SetForecasts(forecasts);
}

void Run::RestoreRewind(uint64_t from_step) {
  MutexLock lock(&mu_);
  last_resume_step_ = from_step;
  analytics_->SetBranchStart(from_step);
}

uint64_t Run::SnapshotFingerprint() {
  // The sizes of what snapshots hold as bytes: a build that changes one of them does not read the
  // snapshots of another (state_io.h). Field order changes within the same sizes are covered by
  // kSnapshotTag, bumped with them.
  uint64_t h = kSnapshotTag;
  for (const uint64_t size :
       {sizeof(store::Point), sizeof(analytics::RegressionSums), sizeof(analytics::PackedSums),
        sizeof(analytics::LinearFit), sizeof(analytics::ChangePoint), sizeof(analytics::FilteredPoint),
        sizeof(analytics::GrowthWithoutDecay), sizeof(EventRecord), sizeof(double)}) {
    h = (h ^ size) * 1099511628211ull;
  }
  return h;
}

void Run::RestoreBranch(uint64_t branch) {
  MutexLock lock(&mu_);
  journal_branch_ = branch;
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
  w.Put(kSnapshotTag);
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

std::unique_ptr<RunAnalytics> Run::FreshAnalyticsLocked(const std::vector<bool>& tracked, bool with_events) {
  auto analytics = std::make_unique<RunAnalytics>(options_.analytics, AnalyticsCharging{options_.budget, stats_, id_});
  analytics->SetCatalog(meta_.params);
  analytics->SetDefaultWeightDecay(meta_.config.weight_decay);
  std::string ignored;  // said at the run's creation
  analytics->SetSchedule(run_internal::ScheduleOf(meta_.config, &ignored));
  for (size_t id = 0; id < tracked.size(); ++id) {
    if (tracked[id]) analytics->AddSeries(static_cast<SeriesId>(id), series_[id].key);
  }
  if (with_events) {
    for (const EventRecord& e : events_) analytics->OnEvent(e);
  }
  analytics->SetForecasts(forecasts_);
  analytics->SetBranchStart(last_resume_step_.value_or(0));
  return analytics;
}

bool Run::LoadSnapshotStateLocked(StateReader& in, uint64_t count, const std::vector<bool>& had_data, uint64_t* bytes,
                                  std::string* why) {
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return false;
  };
  std::string key;
  for (uint64_t id = 0; id < count; ++id) {
    bool has_data = false;
    if (!in.GetString(key) || !in.GetBool(has_data)) return fail(in.why());
    if (key != series_[id].key) return fail("series " + std::to_string(id) + " is not the journal's");
    if (!has_data) continue;
    series_[id].data.reset();
    series_[id].data = std::make_unique<store::Series>(SeriesOptionsLocked(static_cast<SeriesId>(id), key));
    if (!series_[id].data->LoadState(in)) return fail("series '" + key + "': " + in.why());
    *bytes += series_[id].data->MemoryBytes();
  }
  analytics_.reset();
  analytics_ = FreshAnalyticsLocked(had_data, /*with_events=*/false);
  if (!analytics_->LoadState(in)) return fail(std::string("analytics: ") + in.why());
  if (!in.at_end()) return fail("bytes are left after its end");
  if (options_.budget != nullptr && !options_.budget->TryCharge(*bytes)) {
    return fail("its series need " + std::to_string(*bytes) + " bytes, beyond the memory budget");
  }
  return true;
}

std::optional<Run::SnapshotMark> Run::RestoreSnapshot(std::string_view payload, std::string* why) {
  MutexLock lock(&mu_);
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return std::nullopt;
  };
  if (step_count_ != 0 || rebuilding_) return fail("the run already holds steps");
  StateReader in(payload);
  uint64_t tag = 0, branch = 0, last_step = 0;
  if (!in.Get(tag) || tag != kSnapshotTag) return fail("not a snapshot of a run");
  if (!in.Get(branch) || !in.Get(last_step)) return fail("truncated");
  if (branch != journal_branch_) {
    return fail("it was taken on branch " + std::to_string(branch) + " and the run rewound since (branch " +
                std::to_string(journal_branch_) + ")");
  }
  if (channel_ && !channel_->AcceptsRestoreThrough(last_step)) {
    return fail(
        "a listener has not seen the steps it covers (the alerting's saved state, or a remote-write "
        "receiver, is behind it), so they are published again");
  }
  uint64_t step_count = 0, first_step = 0, partial = 0, nonfinite = 0, last_nonfinite = 0, dropped = 0;
  uint64_t speed_count = 0;
  bool has_first = false;
  double last_wall_time = 0;
  std::array<std::pair<double, uint64_t>, kSpeedWindow> speed{};
  if (!in.Get(step_count) || !in.GetBool(has_first) || !in.Get(first_step) || !in.Get(last_wall_time) ||
      !in.Get(partial) || !in.Get(nonfinite) || !in.Get(last_nonfinite) || !in.Get(dropped) || !in.Get(speed_count)) {
    return fail("truncated");
  }
  for (auto& [time, step] : speed) {
    if (!in.Get(time) || !in.Get(step)) return fail("truncated");
  }
  uint64_t count = 0;
  if (!in.GetCount(count, 9, series_.size())) {
    return fail(in.failed() && std::string_view(in.why()) == "a count is beyond its bound"
                    ? "it holds series the journal does not"
                    : std::string(in.why()));
  }
  // Nothing is stepped yet: the run's series and analytics are replaced as the snapshot is read,
  // so that a large run is never held twice, and made again as they were if it is refused.
  ApplyPointsLocked();
  std::vector<bool> had_data(series_.size());
  for (size_t id = 0; id < series_.size(); ++id) had_data[id] = series_[id].data != nullptr;
  uint64_t bytes = 0;
  std::string reason;
  if (!LoadSnapshotStateLocked(in, count, had_data, &bytes, &reason)) {
    for (size_t id = 0; id < series_.size(); ++id) {
      series_[id].data =
          had_data[id]
              ? std::make_unique<store::Series>(SeriesOptionsLocked(static_cast<SeriesId>(id), series_[id].key))
              : nullptr;
    }
    analytics_ = FreshAnalyticsLocked(had_data, /*with_events=*/true);
    return fail(std::move(reason));
  }
  charged_bytes_ += bytes;
  for (const EventRecord& e : events_) analytics_->OnEvent(e);  // those after the snapshot
  last_step_ = last_step;
  step_count_ = step_count;
  has_first_step_ = has_first;
  first_step_ = first_step;
  last_wall_time_ = last_wall_time;
  partial_steps_ = partial;
  nonfinite_count_ = nonfinite;
  last_nonfinite_step_ = last_nonfinite;
  client_dropped_steps_ = dropped;
  speed_ring_ = speed;
  speed_count_ = speed_count;
  assembler_.RestoreLastCompleted(last_step);
  return SnapshotMark{branch, last_step};
}

}  // namespace gradwatch::runs

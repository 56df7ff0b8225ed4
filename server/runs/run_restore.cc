#include "server/runs/run_restore.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "server/runs/catalog_change.h"
#include "server/runs/run_internal.h"

namespace gradwatch::runs {

void RunRestore::Finish() {
  MutexLock lock(&run_.mu_);
  for (size_t i = 0; i < run_internal::kScalarKeys.size(); ++i) {
    run_.scalar_series_[i] = run_.SeriesForKeyLocked(std::string(run_internal::kScalarKeys[i]), true);
  }
  run_.param_series_.clear();
  for (const ParamInfo& p : run_.meta_.params) {
    std::array<SeriesId, kNormFields> ids{};
    for (int f = 0; f < kNormFields; ++f) {
      ids[f] = run_.SeriesForKeyLocked(run_internal::FieldKey(static_cast<NormField>(f), p.name), true);
    }
    run_.param_series_.push_back(ids);
  }
  run_.assembler_.SetParamCount(run_.meta_.params.size());
  // Changes due at steps a snapshot covered (no step of theirs was replayed).
  if (run_.has_first_step_) run_.ApplyDueCatalogChangesLocked(run_.last_step_, /*live=*/false);
}

void RunRestore::Series(SeriesId id, const std::string& key) {
  MutexLock lock(&run_.mu_);
  run_.ApplyPointsLocked();
  if (id >= run_.series_.size()) run_.series_.resize(id + 1);
  run_.AddSeriesLocked(id, key);
  // The set hashes run_.series_[id].key: the id leaves it before its key changes, and a key restored
  // under a second id maps to the later one, as the journal's records say.
  for (const std::string_view k : {std::string_view(run_.series_[id].key), std::string_view(key)}) {
    if (auto it = run_.series_by_key_.find(k); it != run_.series_by_key_.end() && (*it == id || k == key)) {
      run_.series_by_key_.erase(it);
    }
  }
  run_.series_[id] = {key, std::make_unique<store::Series>(run_.SeriesOptionsLocked(id, key))};
  run_.series_by_key_.insert(id);
}

void RunRestore::Progress(const store::RankProgress& progress) {
  MutexLock lock(&run_.mu_);
  if (progress.rank >= run_.ranks_.size()) return;
  Run::RankState& rs = run_.ranks_[progress.rank];
  rs.has_durable = rs.has_received = true;
  rs.durable_step = rs.last_received = progress.step;
  rs.durable_seq = progress.seq;
  rs.has_last_report = false;
}

void RunRestore::Step(const CompletedStep& step) {
  run_internal::DeliverOnExit deliver(run_.channel_);
  MutexLock lock(&run_.mu_);
  run_.AppendLocked(step);
  run_.assembler_.RestoreLastCompleted(step.step);
  run_.AnalyzeLocked(step, /*restored=*/true);
}

void RunRestore::Event(const EventRecord& event) {
  MutexLock lock(&run_.mu_);
  // The journal hands events out in the order they were recorded; an annotation may have been
  // made for an earlier step than the events before it. run_.events_ stays ordered by step (stable).
  run_.events_.insert(std::upper_bound(run_.events_.begin(), run_.events_.end(), event.step,
                                       [](uint64_t s, const EventRecord& e) { return s < e.step; }),
                      event);
  run_.analytics_->OnEvent(event);
  if (event.source != kCatalogEventSource) return;
  auto change = ParseCatalogChangeData(event.data);
  if (!change.ok()) {
    spdlog::error("run {}: the catalog change journaled at step {} cannot be read ({}); the catalog goes without it",
                  run_.id_, event.step, change.status().message());
    return;
  }
  if (auto why = CheckCatalogChange(*change, run_.meta_.params)) {
    spdlog::error("run {}: the catalog change journaled at step {} does not fit the catalog ({}); skipped", run_.id_,
                  event.step, *why);
    return;
  }
  run_.catalog_pending_.insert(
      std::upper_bound(run_.catalog_pending_.begin(), run_.catalog_pending_.end(), event.step,
                       [](uint64_t s, const Run::CatalogChangeEntry& e) { return s < e.step; }),
      Run::CatalogChangeEntry{event.step, std::move(change).value(), {}});
}

void RunRestore::SilentSince(double unix_seconds) {
  MutexLock lock(&run_.mu_);
  if (run_.open_streams_ > 0 || run_.end_.ended()) return;
  const double ago = std::max(0.0, run_.clock_->UnixSeconds() - unix_seconds);
  run_.last_activity_ = std::min(
      run_.last_activity_,
      run_.clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(ago)));
}

void RunRestore::Ended(const RunEnd& end) {
  MutexLock lock(&run_.mu_);
  run_.end_ = end;
  run_.end_durable_ = end.clean();
  if (!end.ended()) return;  // an active run gets a fresh grace period to reconnect
  // Its last sign of life: an inactive run ended end_after after it; a Goodbye was it.
  const double ago = std::max(0.0, run_.clock_->UnixSeconds() - end.ended_at);
  run_.last_activity_ =
      run_.clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(ago));
  if (!end.clean()) run_.last_activity_ -= run_.options_.end_after;
}

void RunRestore::Rewind(uint64_t from_step) {
  MutexLock lock(&run_.mu_);
  run_.last_resume_step_ = from_step;
  run_.analytics_->SetBranchStart(from_step);
}

void RunRestore::Branch(uint64_t branch) {
  MutexLock lock(&run_.mu_);
  run_.journal_branch_ = branch;
}

std::unique_ptr<RunAnalytics> RunRestore::FreshAnalytics(const std::vector<bool>& tracked, bool with_events) {
  auto analytics = std::make_unique<RunAnalytics>(run_.options_.analytics,
                                                  AnalyticsCharging{run_.options_.budget, run_.stats_, run_.id_});
  analytics->SetCatalog(run_.meta_.params);
  analytics->SetDefaultWeightDecay(run_.meta_.config.weight_decay);
  std::string ignored;  // said at the run's creation
  analytics->SetSchedule(run_internal::ScheduleOf(run_.meta_.config, &ignored));
  for (size_t id = 0; id < tracked.size(); ++id) {
    if (tracked[id]) analytics->AddSeries(static_cast<SeriesId>(id), run_.series_[id].key);
  }
  if (with_events) {
    for (const EventRecord& e : run_.events_) analytics->OnEvent(e);
  }
  analytics->SetForecasts(run_.forecasts_);
  analytics->SetBranchStart(run_.last_resume_step_.value_or(0));
  return analytics;
}

bool RunRestore::LoadSnapshotState(StateReader& in, uint64_t count, const std::vector<bool>& had_data, uint64_t* bytes,
                                   std::string* why) {
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return false;
  };
  std::string key;
  for (uint64_t id = 0; id < count; ++id) {
    bool has_data = false;
    if (!in.GetString(key) || !in.GetBool(has_data)) return fail(in.why());
    if (key != run_.series_[id].key) return fail("series " + std::to_string(id) + " is not the journal's");
    if (!has_data) continue;
    run_.series_[id].data.reset();
    run_.series_[id].data = std::make_unique<store::Series>(run_.SeriesOptionsLocked(static_cast<SeriesId>(id), key));
    if (!run_.series_[id].data->LoadState(in)) return fail("series '" + key + "': " + in.why());
    *bytes += run_.series_[id].data->MemoryBytes();
  }
  run_.analytics_.reset();
  run_.analytics_ = FreshAnalytics(had_data, /*with_events=*/false);
  if (!run_.analytics_->LoadState(in)) return fail(std::string("analytics: ") + in.why());
  if (!in.at_end()) return fail("bytes are left after its end");
  if (run_.options_.budget != nullptr && !run_.options_.budget->TryCharge(*bytes)) {
    return fail("its series need " + std::to_string(*bytes) + " bytes, beyond the memory budget");
  }
  return true;
}

std::optional<Run::SnapshotMark> RunRestore::Snapshot(std::string_view payload, std::string* why) {
  MutexLock lock(&run_.mu_);
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return std::nullopt;
  };
  if (run_.step_count_ != 0 || run_.rebuilding_) return fail("the run already holds steps");
  StateReader in(payload);
  uint64_t tag = 0, branch = 0, last_step = 0;
  if (!in.Get(tag) || tag != run_internal::kSnapshotTag) return fail("not a snapshot of a run");
  if (!in.Get(branch) || !in.Get(last_step)) return fail("truncated");
  if (branch != run_.journal_branch_) {
    return fail("it was taken on branch " + std::to_string(branch) + " and the run rewound since (branch " +
                std::to_string(run_.journal_branch_) + ")");
  }
  if (run_.channel_ && !run_.channel_->AcceptsRestoreThrough(last_step)) {
    return fail(
        "a listener has not seen the steps it covers (the alerting's saved state, or a remote-write "
        "receiver, is behind it), so they are published again");
  }
  uint64_t step_count = 0, first_step = 0, partial = 0, nonfinite = 0, last_nonfinite = 0, dropped = 0;
  uint64_t speed_count = 0;
  bool has_first = false;
  double last_wall_time = 0;
  std::array<std::pair<double, uint64_t>, Run::kSpeedWindow> speed{};
  if (!in.Get(step_count) || !in.GetBool(has_first) || !in.Get(first_step) || !in.Get(last_wall_time) ||
      !in.Get(partial) || !in.Get(nonfinite) || !in.Get(last_nonfinite) || !in.Get(dropped) || !in.Get(speed_count)) {
    return fail("truncated");
  }
  for (auto& [time, step] : speed) {
    if (!in.Get(time) || !in.Get(step)) return fail("truncated");
  }
  uint64_t count = 0;
  if (!in.GetCount(count, 9, run_.series_.size())) {
    return fail(in.failed() && std::string_view(in.why()) == "a count is beyond its bound"
                    ? "it holds series the journal does not"
                    : std::string(in.why()));
  }
  // Nothing is stepped yet: the run's series and analytics are replaced as the snapshot is read,
  // so that a large run is never held twice, and made again as they were if it is refused.
  run_.ApplyPointsLocked();
  std::vector<bool> had_data(run_.series_.size());
  for (size_t id = 0; id < run_.series_.size(); ++id) had_data[id] = run_.series_[id].data != nullptr;
  uint64_t bytes = 0;
  std::string reason;
  if (!LoadSnapshotState(in, count, had_data, &bytes, &reason)) {
    for (size_t id = 0; id < run_.series_.size(); ++id) {
      run_.series_[id].data = had_data[id] ? std::make_unique<store::Series>(run_.SeriesOptionsLocked(
                                                 static_cast<SeriesId>(id), run_.series_[id].key))
                                           : nullptr;
    }
    run_.analytics_ = FreshAnalytics(had_data, /*with_events=*/true);
    return fail(std::move(reason));
  }
  run_.charged_bytes_ += bytes;
  for (const EventRecord& e : run_.events_) run_.analytics_->OnEvent(e);  // those after the snapshot
  run_.last_step_ = last_step;
  run_.step_count_ = step_count;
  run_.has_first_step_ = has_first;
  run_.first_step_ = first_step;
  run_.last_wall_time_ = last_wall_time;
  run_.partial_steps_ = partial;
  run_.nonfinite_count_ = nonfinite;
  run_.last_nonfinite_step_ = last_nonfinite;
  run_.client_dropped_steps_ = dropped;
  run_.speed_ring_ = speed;
  run_.speed_count_ = speed_count;
  run_.assembler_.RestoreLastCompleted(last_step);
  return Run::SnapshotMark{branch, last_step};
}

}  // namespace gradwatch::runs

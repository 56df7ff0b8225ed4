// Run: rewinds (a run resumed from a checkpoint) and the rebuild of its analytics after one.
#include "server/runs/run_internal.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace gradwatch::runs {

bool Run::RewindsLocked(uint64_t from_step, uint32_t rank) const {
  if (last_resume_step_ != from_step) return true;
  // The same resume point again: another rank of the same resume, unless this rank has already
  // reported on the new branch (then it crashed and resumed from the same checkpoint again).
  return rank < ranks_.size() && ranks_[rank].has_received && ranks_[rank].last_received >= from_step;
}

RewindJob Run::RewindLocked(uint64_t from_step, uint32_t world_size) {
  const double now = clock_->UnixSeconds();
  spdlog::info(
      "run {}: resumed from the checkpoint at step {} (world size {} → {}); the branch from there on "
      "is abandoned",
      id_, from_step, meta_.world_size, world_size);
  // Pending steps below the resume point complete as they are (nobody will report them again).
  assembler_.Rewind(from_step, world_size, [this](const PendingStep& p) {
    mu_.AssertHeld();  // called back synchronously, under this function's lock
    CompleteLocked(p);
  });

  ApplyPointsLocked();
  std::optional<uint64_t> last_kept;
  for (SeriesEntry& e : series_) {
    if (!e.data) continue;
    e.data->TruncateFrom(from_step);
    if (const auto p = e.data->Latest()) last_kept = std::max(last_kept.value_or(0), p->last_step);
  }
  const auto dropped = std::lower_bound(events_.begin(), events_.end(), from_step,
                                        [](const EventRecord& e, uint64_t s) { return e.step < s; });
  uint64_t dropped_bytes = 0;
  for (auto e = dropped; e != events_.end(); ++e) dropped_bytes += run_internal::EventBytes(*e);
  ReleaseLocked(dropped_bytes);
  events_.erase(dropped, events_.end());
  UndoCatalogChangesFromLocked(from_step);

  // Ranks beyond an elastic job's new size belong to the old world.
  for (size_t r = world_size; r < ranks_.size(); ++r) {
    if (ranks_[r].sink != nullptr) {
      ranks_[r].sink->Supersede();
      --open_streams_;
    }
  }
  ranks_.resize(world_size);
  meta_.world_size = world_size;
  for (RankState& rs : ranks_) {
    if (rs.has_received && rs.last_received >= from_step) {
      rs.has_received = from_step > 0;
      rs.last_received = from_step > 0 ? from_step - 1 : 0;
      rs.has_last_report = false;
    }
    if (rs.has_durable && rs.durable_step >= from_step) {
      rs.has_durable = from_step > 0;
      rs.durable_step = from_step > 0 ? from_step - 1 : 0;
    }
  }

  // Counts restart; the rebuild adds those of the kept steps.
  step_count_ = partial_steps_ = nonfinite_count_ = client_dropped_steps_ = 0;
  has_first_step_ = false;
  last_step_ = last_kept.value_or(0);
  if (last_nonfinite_step_ >= from_step) last_nonfinite_step_ = 0;
  std::array<std::pair<double, uint64_t>, kSpeedWindow> kept_speed{};
  size_t kept = 0;
  for (size_t i = speed_count_ > kSpeedWindow ? speed_count_ - kSpeedWindow : 0; i < speed_count_; ++i) {
    const auto& entry = speed_ring_[i % kSpeedWindow];
    if (entry.second < from_step) kept_speed[kept++] = entry;
  }
  speed_ring_ = kept_speed;
  speed_count_ = kept;

  JournalLocked(store::RewindRecord{id_, from_step, world_size, now});
  if (channel_) channel_->OnRewind(from_step, now);
  RewindJob job;
  EventRecord resumed{from_step, "resumed from the checkpoint at step " + std::to_string(from_step), "daemon", now};
  ChargeEventLocked(resumed);
  events_.push_back(resumed);
  JournalLocked(store::EventJournalRecord{id_, std::move(resumed)});
  last_activity_ = clock_->Now();

  last_resume_step_ = from_step;
  ++branch_;
  ++journal_branch_;
  rebuilding_ = true;
  deferred_.clear();
  job.from_step = from_step;
  job.branch = branch_;
  job.params = meta_.params;
  for (size_t id = 0; id < series_.size(); ++id) {
    if (series_[id].data) job.series.emplace_back(static_cast<SeriesId>(id), series_[id].key);
  }
  job.events = events_;
  job.remediations = analytics_->RemediationsBefore(from_step);
  std::string ignored;  // said at the run's creation
  job.schedule = run_internal::ScheduleOf(meta_.config, &ignored);
  // Until the rebuild is installed, the analytics hold only the kept events.
  analytics_ = std::make_unique<RunAnalytics>(options_.analytics, AnalyticsCharging{options_.budget, stats_, id_});
  analytics_->SetCatalog(job.params);
  analytics_->SetDefaultWeightDecay(meta_.config.weight_decay);
  analytics_->SetSchedule(job.schedule);
  for (const auto& [id, key] : job.series) analytics_->AddSeries(id, key);
  for (const EventRecord& e : job.events) analytics_->OnEvent(e);
  analytics_->SetForecasts(forecasts_);
  analytics_->SetBranchStart(from_step);
  analytics_->AdoptRemediations(job.remediations);
  job.forecasts = forecasts_;
  job.default_weight_decay = meta_.config.weight_decay;
  return job;
}

void Run::RebuildAnalytics(RewindJob job) {
  const uint64_t branch = job.branch, from_step = job.from_step;
  RebuiltAnalytics rebuilt = RebuildAfterRewind(id_, std::move(job), options_.analytics,
                                                AnalyticsCharging{options_.budget, stats_, id_}, journal_);
  const StepTotals& kept = rebuilt.kept;

  run_internal::DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  if (branch_ != branch) return;  // a newer rewind rebuilds for itself
  analytics_ = std::move(rebuilt.analytics);
  rebuilding_ = false;
  step_count_ += kept.count;
  partial_steps_ += kept.partial;
  nonfinite_count_ += kept.nonfinite;
  client_dropped_steps_ += kept.client_dropped;
  last_nonfinite_step_ = std::max(last_nonfinite_step_, kept.last_nonfinite_step);
  if (kept.has_first) {
    first_step_ = kept.first_step;
    has_first_step_ = true;
  }
  for (const CompletedStep& step : deferred_) {
    // A late step below the resume point may have been committed in time to be read back.
    if (!kept.has_first || step.step > kept.last_step) AnalyzeLocked(step, /*restored=*/false);
  }
  spdlog::info("run {}: analytics rebuilt from {} kept steps below step {}, then {} that arrived meanwhile", id_,
               kept.count, from_step, deferred_.size());
  deferred_.clear();
}

}  // namespace gradwatch::runs

// Run: what readers see (activity, info, metrics, summary, series queries, memory), each a
// consistent copy taken under the run's lock.
#include "server/runs/run_internal.h"

#include <algorithm>

namespace gradwatch::runs {

RunActivity Run::Activity() const {
  MutexLock lock(&mu_);
  return ActivityLocked();
}

RunActivity Run::ActivityLocked() const {
  RunActivity a;
  a.last_step = last_step_;
  a.last_wall_time = last_wall_time_;
  a.ended = end_.ended();
  a.ended_cleanly = end_.clean();
  a.open_streams = a.ended ? 0 : open_streams_;
  const SteadyTime now = clock_->Now();
  a.seconds_since_last_step = std::chrono::duration<double>(now - last_step_seen_).count();
  a.seconds_since_activity = std::chrono::duration<double>(now - last_activity_).count();
  return a;
}

RunInfo Run::InfoLocked() const {
  RunInfo info;
  info.run_id = id_;
  info.ended = end_.ended();
  info.end = end_;
  info.world_size = meta_.world_size;
  info.labels = meta_.labels;
  info.step_count = step_count_;
  info.first_step = first_step_;
  info.last_step = last_step_;
  info.last_wall_time = last_wall_time_;
  info.open_streams = open_streams_;
  info.partial_steps = partial_steps_;
  info.nonfinite_count = nonfinite_count_;
  info.last_nonfinite_step = last_nonfinite_step_;
  info.client_dropped_steps = client_dropped_steps_;
  if (speed_count_ >= 2) {
    const size_t n = std::min(speed_count_, kSpeedWindow);
    const auto& newest = speed_ring_[(speed_count_ - 1) % kSpeedWindow];
    const auto& oldest = speed_ring_[(speed_count_ - n) % kSpeedWindow];
    const double dt = newest.first - oldest.first;
    if (dt > 0) info.steps_per_second = static_cast<double>(newest.second - oldest.second) / dt;
  }
  return info;
}

double Run::IdleEndedAt() const {
  MutexLock lock(&mu_);
  return end_.ended() && open_streams_ == 0 ? end_.ended_at : 0;
}

RunInfo Run::Info() const {
  MutexLock lock(&mu_);
  return InfoLocked();
}

RunMetricsSnapshot Run::MetricsSnapshot() const {
  RunMetricsSnapshot s;
  MetricsSnapshot(s);
  return s;
}

void Run::MetricsSnapshot(RunMetricsSnapshot& out) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  out.info = InfoLocked();
  auto latest = [this](SeriesId id) -> std::optional<double> {
    mu_.AssertHeld();  // called only below, under this function's lock
    if (id == kNoSeries || id >= series_.size() || !series_[id].data) return std::nullopt;
    auto p = series_[id].data->Latest();
    if (!p) return std::nullopt;
    return p->last;
  };
  if (out.info.ended) {
    out.total_grad_norm = out.loss = out.z_loss = out.learning_rate = std::nullopt;
    out.params.clear();
    RunAnalysis& a = out.analysis;  // cleared, its buffers kept
    a.slopes.clear();
    a.slope_changes.clear();
    a.change_points.clear();
    a.forecasts.clear();
    a.shares.clear();
    a.amplifications.clear();
    a.growth_without_decay.clear();
    return;
  }
  out.total_grad_norm = latest(scalar_series_[run_internal::kTotalGrad]);
  out.loss = latest(scalar_series_[run_internal::kLoss]);
  out.z_loss = latest(scalar_series_[run_internal::kZLoss]);
  out.learning_rate = latest(scalar_series_[run_internal::kLearningRate]);
  out.params.resize(std::min(meta_.params.size(), param_series_.size()));
  for (size_t i = 0; i < out.params.size(); ++i) {
    RunMetricsSnapshot::Param& p = out.params[i];
    p.name = meta_.params[i].name;
    p.group = meta_.params[i].EffectiveGroup();
    p.kind = meta_.params[i].kind;
    p.weight_decay = meta_.params[i].weight_decay;
    for (int f = 0; f < kNormFields; ++f) p.norms[f] = latest(param_series_[i][f]);
  }
  analytics_->Analysis(out.analysis);
}

RunSummary Run::Summary(size_t max_events) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  RunSummary s;
  s.info = InfoLocked();
  s.config = meta_.config;
  s.params = meta_.params;
  for (const SeriesEntry& e : series_) {
    if (!e.data) continue;
    if (auto p = e.data->Latest()) s.latest.push_back({e.key, p->last_step, p->last});
  }
  s.event_count = events_.size();
  s.events.assign(events_.end() - static_cast<std::ptrdiff_t>(std::min(max_events, events_.size())), events_.end());
  s.analysis = analytics_->Analysis();
  return s;
}

std::optional<std::vector<store::Point>> Run::QuerySeries(const std::string& key, uint64_t from_step, uint64_t to_step,
                                                          size_t max_points) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  auto it = series_by_key_.find(std::string_view(key));
  if (it == series_by_key_.end() || !series_[*it].data) return std::nullopt;
  return series_[*it].data->Query(from_step, to_step, max_points);
}

size_t Run::MemoryBytes() const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  size_t bytes = sizeof(*this);
  for (const SetAsideSlice& pending : unapplied_.slices) bytes += pending.values.capacity() * sizeof(SetAsideValue);
  for (const SeriesEntry& e : series_) {
    if (e.data) bytes += e.data->MemoryBytes() + e.key.capacity();
  }
  return bytes;
}

}  // namespace gradwatch::runs

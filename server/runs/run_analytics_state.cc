// RunAnalytics' state in a run's snapshot (SaveState, LoadState): every tracker written and read
// back in the order of the catalog.
#include "server/runs/run_analytics.h"

namespace gradwatch::runs {

namespace {

// A tracker held or not: a flag, then its state.
template <typename T>
void PutTracker(StateWriter& out, const T* tracker) {
  out.Put<uint8_t>(tracker != nullptr ? 1 : 0);
  if (tracker != nullptr) tracker->SaveState(out);
}

// Reads a tracker written by PutTracker into `tracker`, which must be held exactly when it was.
template <typename T>
bool GetTracker(StateReader& in, T* tracker) {
  bool held = false;
  if (!in.GetBool(held)) return false;
  if (held != (tracker != nullptr)) return in.Fail("a tracker is held where the analytics hold none, or the reverse");
  return !held || tracker->LoadState(in);
}

}  // namespace

void RunAnalytics::SaveState(StateWriter& out) const {
  ApplyAllSetAside();
  out.Put<uint64_t>(events_.size());
  for (const EventRecord& e : events_) {
    out.Put(e.step);
    out.PutString(e.text);
    out.PutString(e.source);
    out.Put(e.recorded_at);
  }
  out.Put<uint64_t>(series_.size());
  for (const Tracked& t : series_) {
    out.PutString(t.key);
    out.Put<uint8_t>(t.added ? 1 : 0);
    out.Put<uint8_t>(t.refused ? 1 : 0);
    out.Put<uint8_t>(t.has_value ? 1 : 0);
    out.Put(t.last_value);
    out.Put<uint8_t>(t.slopes ? 1 : 0);
    if (!t.slopes) continue;
    t.slopes->SaveState(out);
    PutTracker(out, t.detector.get());
    PutTracker(out, t.spike_filter.get());
    PutTracker(out, t.robust.get());
    out.Put<uint64_t>(t.events.size());
    for (const auto& [text, slope] : t.events) {
      out.PutString(text);
      slope.SaveState(out);
    }
  }
  out.Put<uint64_t>(param_state_.size());
  for (const ParamState& ps : param_state_) {
    ps.share_trend->SaveState(out);
    out.Put(ps.share);
    out.Put<uint8_t>(ps.has_share ? 1 : 0);
    out.Put(ps.norm_value);
    out.Put<uint8_t>(ps.has_norm_value ? 1 : 0);
  }
  out.Put<uint64_t>(groups_.size());
  for (const GroupState& g : groups_) {
    out.PutString(g.name);
    g.share_trend->SaveState(out);
    out.Put(g.share);
    out.Put<uint8_t>(g.has_share ? 1 : 0);
  }
  out.Put(branch_start_);
  out.Put<uint64_t>(branch_sums_.size());
  for (size_t k = 0; k < branch_sums_.size(); ++k) {
    out.PutString(forecasts_[k].first);
    out.Put<uint8_t>(branch_sums_[k] ? 1 : 0);
    if (branch_sums_[k]) branch_sums_[k]->SaveState(out);
  }
  out.Put(last_step_);
  out.Put<uint64_t>(remediations_.size());
  for (const Remediation& r : remediations_) {
    out.Put<uint64_t>(r.param);
    out.Put(r.step);
    out.Put(r.weight_decay);
    out.Put(r.previous_weight_decay);
    out.Put(r.norm);
    out.Put(r.learning_rate);
    out.Put(r.dynamics.radial);
    out.Put(r.dynamics.orthogonal);
    out.Put<uint8_t>(r.dynamics.orthogonal_known ? 1 : 0);
    out.Put<uint8_t>(r.dynamics.radial_known ? 1 : 0);
    out.Put(r.advanced_to);
    out.Put(r.projected);
    out.Put(r.unchanged);
  }
}

bool RunAnalytics::LoadState(StateReader& in) {
  if (!events_.empty() || !key_ids_.empty()) return in.Fail("analytics already hold events or trackers");
  uint64_t count = 0;
  if (!in.GetCount(count, 32, options_.max_events)) return false;
  for (uint64_t i = 0; i < count; ++i) {
    EventRecord e;
    if (!in.Get(e.step) || !in.GetString(e.text) || !in.GetString(e.source) || !in.Get(e.recorded_at)) return false;
    OnEvent(e);
  }
  if (events_.size() != count) return in.Fail("the events are not those the analytics keep");

  if (!in.GetCount(count, 13, series_.size())) return false;
  std::string key;
  for (uint64_t id = 0; id < count; ++id) {
    Tracked& t = series_[id];
    bool added = false, refused = false, has_value = false, tracked = false;
    if (!in.GetString(key) || !in.GetBool(added) || !in.GetBool(refused) || !in.GetBool(has_value) ||
        !in.Get(t.last_value) || !in.GetBool(tracked)) {
      return false;
    }
    if (key != t.key || added != t.added) return in.Fail("a series is not the one the analytics hold under its id");
    t.has_value = has_value;
    if (refused) {
      t.refused = true;
      ++refused_series_;
      if (charging_.stats != nullptr) {
        charging_.stats->analytics_refused_series.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (!tracked) continue;
    if (refused || !Materialize(t)) return in.Fail("a series' trackers do not fit in the memory budget");
    if (!t.slopes->LoadState(in) || !GetTracker(in, t.detector.get()) || !GetTracker(in, t.spike_filter.get()) ||
        !GetTracker(in, t.robust.get())) {
      return false;
    }
    uint64_t events = 0;
    if (!in.GetCount(events, 8, t.events.size())) return false;
    if (events != t.events.size()) return in.Fail("a series' event slopes are not the run's events");
    for (auto& [text, slope] : t.events) {
      if (!in.GetString(key)) return false;
      if (key != text) return in.Fail("a series' event slopes are not the run's events");
      if (!slope.LoadState(in)) return false;
    }
  }

  if (!in.GetCount(count, 1, param_state_.size())) return false;
  for (uint64_t i = 0; i < count; ++i) {
    ParamState& ps = param_state_[i];
    if (!ps.share_trend->LoadState(in) || !in.Get(ps.share) || !in.GetBool(ps.has_share) || !in.Get(ps.norm_value) ||
        !in.GetBool(ps.has_norm_value)) {
      return false;
    }
  }
  if (!in.GetCount(count, 1, groups_.size())) return false;
  for (uint64_t g = 0; g < count; ++g) {
    GroupState& gs = groups_[g];
    if (!in.GetString(key)) return false;
    if (key != gs.name) return in.Fail("a parameter group is not the one the analytics hold");
    if (!gs.share_trend->LoadState(in) || !in.Get(gs.share) || !in.GetBool(gs.has_share)) return false;
  }
  if (!in.Get(branch_start_) || !in.GetCount(count, 2, 1024)) return false;
  // By series: the forecasts in force may have changed (a reload of the rules) since the save.
  for (uint64_t i = 0; i < count; ++i) {
    bool held = false;
    analytics::RegressionSums sums;
    if (!in.GetString(key) || !in.GetBool(held) || (held && !sums.LoadState(in))) return false;
    if (!held) continue;
    for (size_t k = 0; k < forecasts_.size(); ++k) {
      if (forecasts_[k].first == key) branch_sums_[k] = sums;
    }
  }
  // The remediation checks: a projection made at a change is not made again from later data.
  if (!in.Get(last_step_) || !in.GetCount(count, 8 * 11 + 2, params_.size())) return false;
  remediations_.resize(count);
  for (Remediation& r : remediations_) {
    uint64_t param = 0;
    if (!in.Get(param) || !in.Get(r.step) || !in.Get(r.weight_decay) || !in.Get(r.previous_weight_decay) ||
        !in.Get(r.norm) || !in.Get(r.learning_rate) || !in.Get(r.dynamics.radial) || !in.Get(r.dynamics.orthogonal) ||
        !in.GetBool(r.dynamics.orthogonal_known) || !in.GetBool(r.dynamics.radial_known) || !in.Get(r.advanced_to) ||
        !in.Get(r.projected) || !in.Get(r.unchanged)) {
      return false;
    }
    if (param >= params_.size()) return in.Fail("a remediation check names a parameter the catalog lacks");
    r.param = static_cast<size_t>(param);
  }
  return true;
}

}  // namespace gradwatch::runs

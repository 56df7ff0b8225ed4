#include "server/runs/run_analytics.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>

#include <spdlog/spdlog.h>

#include "server/analytics/attribution.h"
#include "server/analytics/forecast.h"
#include "server/core/prefetch.h"
#include "server/runs/analysis_slots.h"

namespace gradwatch::runs {

using analysis_slots::NextSlot;

namespace {

std::vector<uint64_t> WindowsWith(std::vector<uint64_t> windows, uint64_t extra) {
  if (std::find(windows.begin(), windows.end(), extra) == windows.end()) windows.push_back(extra);
  std::sort(windows.begin(), windows.end());
  return windows;
}

bool StartsWith(const std::string& s, std::string_view prefix) {
  return s.size() > prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

RunAnalytics::RunAnalytics(const AnalyticsOptions& options, AnalyticsCharging charging)
    : options_([&] {
        AnalyticsOptions o = options;
        o.windows = WindowsWith(o.windows, o.forecast_window_steps);
        return o;
      }()),
      instance_([] {
        static std::atomic<uint64_t> next{1};
        return next.fetch_add(1, std::memory_order_relaxed);
      }()),
      charging_(std::move(charging)),
      charge_(charging_.budget),
      forecast_window_index_(static_cast<size_t>(
          std::find(options_.windows.begin(), options_.windows.end(), options_.forecast_window_steps) -
          options_.windows.begin())),
      forecasts_(options_.forecasts),
      forecast_ids_(forecasts_.size(), kNoSeries),
      branch_sums_(forecasts_.size()) {}

void RunAnalytics::SetCatalog(const std::vector<ParamInfo>& params) {
  for (size_t i = params_.size(); i < params.size(); ++i) {
    const ParamInfo& p = params[i];
    param_by_name_[p.name] = static_cast<int>(i);
    ParamState state;
    const std::string group(p.EffectiveGroup());
    auto g = std::find_if(groups_.begin(), groups_.end(), [&](const GroupState& s) { return s.name == group; });
    if (g == groups_.end()) {
      groups_.push_back(
          {group, std::make_unique<analytics::WindowedSlope>(options_.forecast_window_steps, options_.max_buckets)});
      g = groups_.end() - 1;
    }
    state.group = static_cast<int>(g - groups_.begin());
    state.init_norm = analytics::InitNorm(p);
    state.share_trend = std::make_unique<analytics::WindowedSlope>(options_.forecast_window_steps, ShareBucketsFor(p));
    param_state_.push_back(std::move(state));
    params_.push_back(p);
    group_of_param_.push_back(static_cast<uint32_t>(param_state_.back().group));
  }
  grad_scratch_.assign(params_.size(), kNaN);
  param_share_scratch_.assign(params_.size(), 0.0);
  group_share_scratch_.assign(groups_.size(), 0.0);
  // Series added before their parameter was known (restore order) are classified again.
  for (Tracked& t : series_) {
    if (t.role == Role::kExtra) ClassifyLocked(t);
  }
}

void RunAnalytics::UpdateCatalog(const std::vector<ParamInfo>& params, std::optional<uint64_t> from_step) {
  const size_t n = std::min(params.size(), params_.size());
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = params[i];
    if (p.name != params_[i].name) continue;
    if (from_step && p.weight_decay > params_[i].weight_decay) {
      // The projection this remediation is held to, from the dynamics before it.
      const double lr = LearningRateOf(i);
      if (const auto dynamics = DynamicsOf(i, lr)) {
        std::erase_if(remediations_, [&](const Remediation& r) { return r.param == i; });
        const double norm = param_state_[i].norm_value;
        remediations_.push_back(
            {i, *from_step, p.weight_decay, params_[i].weight_decay, norm, lr, *dynamics, *from_step, norm, norm});
      }
    }
    const std::string group(p.EffectiveGroup());
    if (group != params_[i].EffectiveGroup()) {
      auto g = std::find_if(groups_.begin(), groups_.end(), [&](const GroupState& s) { return s.name == group; });
      if (g == groups_.end()) {
        groups_.push_back(
            {group, std::make_unique<analytics::WindowedSlope>(options_.forecast_window_steps, options_.max_buckets)});
        g = groups_.end() - 1;
      }
      param_state_[i].group = static_cast<int>(g - groups_.begin());
      group_of_param_[i] = static_cast<uint32_t>(param_state_[i].group);
    }
    params_[i].kind = p.kind;
    params_[i].weight_decay = p.weight_decay;
    params_[i].role = p.role;
    params_[i].group = p.group;
  }
  group_share_scratch_.assign(groups_.size(), 0.0);
}

void RunAnalytics::ClassifyLocked(Tracked& t) const {
  t.role = Role::kExtra;
  t.param = -1;
  if (t.key == keys::kTotalGradNorm) {
    t.role = Role::kTotalGrad;
  } else if (t.key == keys::kLoss || t.key == keys::kZLoss || t.key == keys::kLearningRate || t.key == keys::kTokens) {
    t.role = Role::kScalar;
  } else {
    struct Prefix {
      std::string_view prefix;
      Role role;
    };
    static constexpr Prefix kPrefixes[] = {{keys::kGradNormPrefix, Role::kParamGrad},
                                           {keys::kParamNormPrefix, Role::kParamNorm},
                                           {keys::kUpdateNormPrefix, Role::kParamUpdate},
                                           {keys::kRadialUpdatePrefix, Role::kParamRadial},
                                           {keys::kParamLearningRatePrefix, Role::kParamLearningRate}};
    for (const Prefix& p : kPrefixes) {
      if (!StartsWith(t.key, p.prefix)) continue;
      auto it = param_by_name_.find(t.key.substr(p.prefix.size()));
      if (it != param_by_name_.end()) {
        t.role = p.role;
        t.param = it->second;
      }
      break;
    }
  }
  t.key_series = IsKeySeries(t.role, t.param);
}

bool RunAnalytics::IsKeySeries(Role role, int param) const {
  // Change points and event slopes are tracked where the incident lives: the total grad norm,
  // the loss, the norms of parameters without weight decay, and the output layer's gradient.
  switch (role) {
    case Role::kTotalGrad: return true;
    case Role::kScalar: return false;
    case Role::kParamNorm: return param >= 0 && params_[param].weight_decay == 0.0;
    case Role::kParamGrad: return param >= 0 && params_[param].kind == ParamKind::kOutput;
    case Role::kParamUpdate:
    case Role::kParamRadial:
    case Role::kParamLearningRate:
    case Role::kExtra: return false;
  }
  return false;
}

size_t RunAnalytics::ShareBucketsFor(const ParamInfo& p) const {
  return p.kind == ParamKind::kOutput ? options_.max_buckets : options_.param_max_buckets;
}

size_t RunAnalytics::BucketsFor(const Tracked& t) const {
  if (t.param < 0 || t.key_series) return options_.max_buckets;
  return ShareBucketsFor(params_[t.param]);
}

void RunAnalytics::AddSeries(SeriesId id, const std::string& key) {
  if (id >= series_.size()) series_.resize(id + 1);
  Tracked& t = series_[id];
  t.key = key;
  t.added = true;
  ClassifyLocked(t);
  if (key == keys::kLoss) t.key_series = true;
  if (t.role == Role::kTotalGrad) total_grad_ = id;
  for (size_t f = 0; f < forecasts_.size(); ++f) {
    if (forecasts_[f].first == key && (forecast_ids_[f] == kNoSeries || id < forecast_ids_[f])) {
      forecast_ids_[f] = id;
    }
  }
  if (t.param >= 0 && t.role == Role::kParamGrad) param_state_[t.param].grad = id;
  if (t.param >= 0 && t.role == Role::kParamNorm) param_state_[t.param].norm = id;
  if (t.param >= 0 && t.role == Role::kParamUpdate) param_state_[t.param].update = id;
  if (t.param >= 0 && t.role == Role::kParamRadial) param_state_[t.param].radial = id;
  if (t.param >= 0 && t.role == Role::kParamLearningRate) param_state_[t.param].learning_rate = id;
  if (key == keys::kLearningRate) learning_rate_ = id;
}

bool RunAnalytics::Materialize(Tracked& t) {
  // The trackers' rings start empty and grow with the steps they hold: charged at full size,
  // before anything of them is allocated.
  analytics::SlopeTracker slopes(options_.windows, BucketsFor(t));
  uint64_t bytes = slopes.CapacityBytes();
  std::unique_ptr<analytics::SlopeTracker> robust;
  if (t.key_series || IsForecastKey(t.key)) {
    // The longest window lets an event registered after its step find its before-window (as on
    // the raw tracker); a forecast needs its own window.
    std::vector<uint64_t> windows = {std::max(options_.windows.back(), options_.event_window_steps)};
    if (IsForecastKey(t.key)) windows = WindowsWith(windows, options_.forecast_window_steps);
    robust = std::make_unique<analytics::SlopeTracker>(windows, options_.max_buckets);
    bytes += robust->CapacityBytes() + sizeof(analytics::SpikeFilter) +
             analytics::SpikeFilter().width() * (sizeof(analytics::FilteredPoint) + sizeof(double));
  }
  if (t.key_series) {
    bytes += analytics::SlopeChangeDetector::MemoryBytesFor(options_.change_points) +
             options_.max_events * (sizeof(t.events[0]) + 32);
  }
  // A parameter's share trend fills once its gradient norm reports.
  if (t.role == Role::kParamGrad && t.param >= 0) bytes += param_state_[t.param].share_trend->CapacityBytes();
  if (!charge_.TryAdd(bytes)) {
    t.refused = true;
    ++refused_series_;
    if (charging_.stats != nullptr) {
      charging_.stats->analytics_refused_series.fetch_add(1, std::memory_order_relaxed);
    }
    if (refused_series_ == 1) {
      spdlog::warn(
          "run {}: series {} gets no analytics (slopes, slope changes, forecasts): its trackers need "
          "about {} bytes, beyond the memory budget ({} of {} bytes in use); its points are still "
          "stored. Further series of this run refused for memory are only counted "
          "(gradwatch_analytics_refused_series_total)",
          charging_.run_id, t.key, bytes, charging_.budget != nullptr ? charging_.budget->used() : 0,
          charging_.budget != nullptr ? charging_.budget->limit() : 0);
    }
    return false;
  }
  t.slopes.emplace(std::move(slopes));
  const SeriesId id = static_cast<SeriesId>(&t - series_.data());
  t.sets_aside = !robust && !t.key_series && t.param >= 0;
  if (t.role == Role::kParamGrad && t.param >= 0 && param_state_[t.param].grad == id) {
    param_state_[t.param].grad_tracked = true;
  }
  if (robust) {
    t.spike_filter = std::make_unique<analytics::SpikeFilter>();
    t.robust = std::move(robust);
  }
  if (t.key_series) {
    key_ids_.insert(std::lower_bound(key_ids_.begin(), key_ids_.end(), id), id);
    t.detector = std::make_unique<analytics::SlopeChangeDetector>(options_.change_points);
    t.events.reserve(events_.size());
    for (const EventRecord& e : events_) {
      t.events.emplace_back(
          e.text, analytics::EventSlope(e.step, options_.event_window_steps, options_.event_min_after_samples));
    }
  }
  return true;
}

void RunAnalytics::OnEvent(const EventRecord& event) {
  // Kept ordered by (step, text), the max_events latest by step: the same set and order whatever
  // the order the events arrive in.
  auto before = [](const EventRecord& a, const EventRecord& b) {
    return a.step != b.step ? a.step < b.step : a.text < b.text;
  };
  const auto pos = std::lower_bound(events_.begin(), events_.end(), event, before);
  if (pos != events_.end() && pos->step == event.step && pos->text == event.text) return;  // held
  if (events_.size() >= options_.max_events && pos == events_.begin()) return;             // older than those kept
  const auto index = pos - events_.begin();
  events_.insert(pos, event);
  const bool evict = events_.size() > options_.max_events;
  if (evict) events_.erase(events_.begin());
  for (Tracked& t : series_) {
    if (!t.key_series || !t.robust) continue;
    analytics::EventSlope slope(event.step, options_.event_window_steps, options_.event_min_after_samples);
    slope.Seed(t.robust->longest());
    t.events.emplace(t.events.begin() + index, event.text, std::move(slope));
    if (evict) t.events.erase(t.events.begin());
  }
}

void RunAnalytics::SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts) {
  if (forecasts == forecasts_) return;
  std::vector<SeriesId> ids(forecasts.size(), kNoSeries);
  std::vector<std::optional<analytics::RegressionSums>> sums(forecasts.size());
  for (size_t k = 0; k < forecasts.size(); ++k) {
    // A series already forecast keeps its series and its branch's samples (they do not depend on
    // the threshold).
    for (size_t old = 0; old < forecasts_.size(); ++old) {
      if (forecasts_[old].first != forecasts[k].first) continue;
      ids[k] = forecast_ids_[old];
      sums[k] = branch_sums_[old];
      break;
    }
    if (ids[k] != kNoSeries) continue;
    for (size_t id = 0; id < series_.size(); ++id) {
      if (series_[id].added && series_[id].key == forecasts[k].first) {
        ids[k] = static_cast<SeriesId>(id);
        break;
      }
    }
  }
  forecasts_ = forecasts;
  forecast_ids_ = std::move(ids);
  branch_sums_ = std::move(sums);
}

void RunAnalytics::SetBranchStart(uint64_t step) {
  if (step == branch_start_) return;
  branch_start_ = step;
  for (auto& sums : branch_sums_) sums.reset();
}

void RunAnalytics::OnStep(const CompletedStep& step) {
  last_step_ = std::max(last_step_, step.step);
  const uint32_t slot = set_aside_.Begin(step.step);
  const bool set_aside = charge_.bytes() >= options_.set_aside_min_bytes;
  set_aside_shares_.Begin(step.step);
  if (!params_.empty()) std::fill(grad_scratch_.begin(), grad_scratch_.end(), kNaN);
  std::optional<double> total;
  bool any_grad = false;
  // A large run's trackers outgrow the caches: the entries kPrefetchAhead values on, and the
  // windows of those whose samples are added at once, are fetched while this one's samples are
  // added, so that their misses overlap (as Run::ApplySliceLocked does for the points).
  constexpr size_t kPrefetchAhead = 4;
  const std::vector<SeriesValue>& values = step.values;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i + 2 * kPrefetchAhead < values.size() && values[i + 2 * kPrefetchAhead].id < series_.size()) {
      PrefetchRead(&series_[values[i + 2 * kPrefetchAhead].id]);
    }
    if (i + kPrefetchAhead < values.size() && values[i + kPrefetchAhead].id < series_.size()) {
      const Tracked& next = series_[values[i + kPrefetchAhead].id];
      if (next.slopes && (!set_aside || !next.sets_aside || next.read_each_step)) next.slopes->Prefetch();
    }
    const SeriesValue& sv = values[i];
    if (sv.id >= series_.size()) continue;
    Tracked& t = series_[sv.id];
    if (!t.added) continue;
    t.last_value = sv.value;
    t.has_value = true;
    if (t.param >= 0) {
      if (t.role == Role::kParamNorm) {
        param_state_[t.param].norm_value = sv.value;
        param_state_[t.param].has_norm_value = true;
      } else if (t.role == Role::kParamGrad) {
        grad_scratch_[t.param] = sv.value;
        any_grad = true;
      }
    } else if (t.role == Role::kTotalGrad && std::isfinite(sv.value)) {
      total = sv.value;
    }
    if (!t.slopes && (t.refused || !Materialize(t))) continue;
    if (!std::isfinite(sv.value)) continue;  // a NaN is a signal for alerts, not a slope sample
    if (set_aside && t.sets_aside && !t.read_each_step) {
      set_aside_.Add(sv.id, slot, sv.value);
      continue;
    }
    t.slopes->AddSample(step.step, sv.value);
    if (t.detector) t.detector->AddSample(step.step, sv.value);
    if (!t.spike_filter) continue;
    if (const auto p = t.spike_filter->Add(step.step, sv.value)) {
      // The event slopes take the robust tracker's buckets as they close (event_slope.h); its
      // other windows, if any, are fed as the longest is.
      const analytics::WindowedSlope& longest = t.robust->longest();
      if (const std::optional<analytics::RegressionSums> closed = longest.ClosedBy(p->step, p->value)) {
        for (auto& [text, slope] : t.events) slope.AddClosedBucket(*closed);
      }
      t.robust->AddSample(p->step, p->value);
      if (branch_start_ != 0 && p->step >= branch_start_) {
        for (size_t k = 0; k < forecast_ids_.size(); ++k) {
          if (forecast_ids_[k] != sv.id) continue;
          if (!branch_sums_[k]) branch_sums_[k].emplace();
          branch_sums_[k]->Add(p->step, p->value);
        }
      }
    }
  }
  if (any_grad) UpdateShares(step.step, total, slot, set_aside);
  set_aside_shares_.End();
  ApplySetAside(set_aside_.End());
}

void RunAnalytics::UpdateShares(uint64_t step, std::optional<double> total, uint32_t slot, bool set_aside) {
  analytics::ComputeShares(grad_scratch_, group_of_param_, groups_.size(), total, param_share_scratch_,
                           group_share_scratch_);
  constexpr size_t kPrefetchAhead = 4;  // as in OnStep
  for (size_t i = 0; i < params_.size(); ++i) {
    if (i + kPrefetchAhead < params_.size() && (!set_aside || param_state_[i + kPrefetchAhead].share_read_each_step)) {
      param_state_[i + kPrefetchAhead].share_trend->Prefetch();
    }
    if (!std::isfinite(grad_scratch_[i]) || !std::isfinite(param_share_scratch_[i])) continue;
    ParamState& ps = param_state_[i];
    ps.share = param_share_scratch_[i];
    ps.has_share = true;
    // Its trend's memory is charged with its gradient series' trackers.
    if (!ps.grad_tracked) continue;
    if (!set_aside || ps.share_read_each_step) {
      ps.share_trend->AddSample(step, ps.share);
    } else {
      set_aside_shares_.Add(static_cast<uint32_t>(i), slot, ps.share);
    }
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!std::isfinite(group_share_scratch_[g])) continue;
    groups_[g].share = group_share_scratch_[g];
    groups_[g].has_share = true;
    groups_[g].share_trend->AddSample(step, groups_[g].share);
  }
}

void RunAnalytics::ApplySetAside(size_t slice) const {
  // Each tracker's entry, then its windows, are fetched a few trackers ahead, so that their misses
  // overlap.
  constexpr size_t kAhead = 2;
  set_aside_.Apply(
      slice, kAhead, 2,
      [&](uint32_t id, size_t stage) {
        if (stage == 2) {
          PrefetchRead(&series_[id]);
        } else {
          series_[id].slopes->Prefetch();
        }
      },
      [&](uint32_t id, uint64_t step, double value) { series_[id].slopes->AddSample(step, value); });
  set_aside_shares_.Apply(
      slice, kAhead, 1, [&](uint32_t i, size_t) { param_state_[i].share_trend->Prefetch(); },
      [&](uint32_t i, uint64_t step, double value) { param_state_[i].share_trend->AddSample(step, value); });
}

void RunAnalytics::ApplyAllSetAside() const {
  for (size_t slice = 0; slice < kSetAsideSlices; ++slice) ApplySetAside(slice);
}

bool RunAnalytics::IsForecastKey(const std::string& key) const {
  return std::any_of(forecasts_.begin(), forecasts_.end(), [&](const auto& f) { return f.first == key; });
}

const analytics::WindowedSlope* RunAnalytics::Window(const Tracked& t, uint64_t window_steps) const {
  const analytics::SlopeTracker& tracker = t.robust ? *t.robust : *t.slopes;
  for (const auto& w : tracker.windows()) {
    if (w.window_steps() == window_steps) return &w;
  }
  return nullptr;
}

void RunAnalytics::EventsForecastsShares(RunAnalysis& out, bool order_shares,
                                         const std::vector<uint8_t>* share_fits) const {
  size_t changes = 0, points = 0, forecasts = 0, shares = 0;
  for (SeriesId id : key_ids_) {
    const Tracked& t = series_[id];
    for (const auto& [text, slope] : t.events) {
      if (auto change = slope.Current(t.robust->longest())) {
        // Event slopes fit the spike filter's medians, and neighbouring medians share all but one
        // of their samples: the fit sees about one independent sample in `width`, so its least-
        // squares errors are scaled by √width to stay honest (they decide when a warning fires).
        const double correlated = std::sqrt(static_cast<double>(t.spike_filter->width()));
        change->before_stderr_per_kstep *= correlated;
        change->after_stderr_per_kstep *= correlated;
        SlopeChangeInfo& info = NextSlot(out.slope_changes, &changes);
        info.key = t.key;
        info.event_text = text;
        info.change = *change;
        info.after_samples = change->after.samples;
      }
    }
    if (t.detector) {
      for (const auto& c : t.detector->changes()) {
        ChangePointInfo& info = NextSlot(out.change_points, &points);
        info.key = t.key;
        info.change = c;
      }
    }
  }
  out.slope_changes.resize(changes);
  out.change_points.resize(points);
  for (size_t k = 0; k < forecasts_.size(); ++k) {
    const auto& [key, threshold] = forecasts_[k];
    const SeriesId id = forecast_ids_[k];
    if (id == kNoSeries || !series_[id].slopes) continue;
    const analytics::WindowedSlope* w = Window(series_[id], options_.forecast_window_steps);
    if (w == nullptr) continue;
    auto fit = w->Fit();
    if (branch_start_ != 0 && (!fit || fit->first_step < branch_start_)) {
      // The window still holds steps from before the resume: the fit is the new branch's alone.
      fit = branch_sums_[k] ? branch_sums_[k]->Fit() : std::nullopt;
    }
    if (!fit) continue;
    const analytics::Forecast f = analytics::StepsToThreshold(*fit, threshold);
    ForecastInfo& info = NextSlot(out.forecasts, &forecasts);
    info.key = key;
    info.threshold = threshold;
    info.window_steps = w->window_steps();
    info.reachable = f.reachable;
    info.steps_to_threshold = f.steps_to_threshold;
    info.at_step = f.at_step;
    info.current_value = f.current_value;
    info.slope_per_kstep = f.slope_per_kstep;
    info.fit_samples = fit->samples;
    info.fit_span_steps = fit->last_step - fit->first_step;
  }
  out.forecasts.resize(forecasts);
  // A source is this object's instance, then whether a group, then the index: the entry a
  // refill finds in a slot (the same one at every step in catalog order) keeps its name.
  auto add_share = [&](const std::string& name, bool is_group, size_t index, ParamKind kind, double share,
                       const analytics::WindowedSlope& trend, bool fit_slope) {
    ShareInfo& info = NextSlot(out.shares, &shares);
    const uint64_t source = instance_ << 33 | uint64_t{is_group} << 32 | index;
    if (info.source != source) {
      info.name = name;
      info.source = source;
    }
    info.is_group = is_group;
    info.kind = kind;
    info.share = share;
    info.earlier_share = kNaN;
    info.earlier_first_step = info.earlier_last_step = info.trend_samples = 0;
    if (!fit_slope) {
      info.slope_per_kstep = kNaN;
      return;
    }
    auto fit = trend.Fit();
    info.slope_per_kstep = fit ? fit->slope_per_kstep() : 0.0;
    if (!fit) return;
    info.trend_samples = fit->samples;
    // The oldest bucket: bucket k holds steps [k·bucket_steps, (k+1)·bucket_steps). A trend held
    // in one bucket has no earlier part.
    const uint64_t oldest_end = (fit->first_step / trend.bucket_steps() + 1) * trend.bucket_steps() - 1;
    if (oldest_end >= fit->last_step) return;
    const analytics::RegressionSums oldest = trend.SumsInRange(fit->first_step, oldest_end);
    if (oldest.empty()) return;
    info.earlier_share = oldest.mean();
    info.earlier_first_step = oldest.first_step();
    info.earlier_last_step = oldest.last_step();
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamState& ps = param_state_[i];
    if (!ps.has_share) continue;
    const bool fit_slope = share_fits == nullptr || (i < share_fits->size() && (*share_fits)[i] != 0);
    add_share(params_[i].name, false, i, params_[i].kind, ps.share, *ps.share_trend, fit_slope);
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    const GroupState& g = groups_[i];
    if (g.has_share) add_share(g.name, true, i, ParamKind::kUnspecified, g.share, *g.share_trend, true);
  }
  out.shares.resize(shares);
  if (!order_shares) return;
  // Largest first, ties in the order added (parameters by catalog index, then groups): what a
  // stable sort gives, but sorting (share, index) pairs and then swapping each entry into place
  // (its strings' buffers move, nothing is copied or allocated once warm).
  share_order_.resize(shares);
  for (size_t i = 0; i < shares; ++i) share_order_[i] = {out.shares[i].share, static_cast<uint32_t>(i)};
  std::sort(share_order_.begin(), share_order_.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  share_sorted_.resize(shares);
  for (size_t i = 0; i < shares; ++i) std::swap(share_sorted_[i], out.shares[share_order_[i].second]);
  out.shares.swap(share_sorted_);
}

void RunAnalytics::FillNormFits(size_t i, ParamAnalysis& out) const {
  out.norm_slope_per_kstep.reset();
  out.radial_per_step.reset();
  const ParamState& ps = param_state_[i];
  const analytics::SlopeTracker* slopes =
      ps.norm < series_.size() && series_[ps.norm].slopes ? &*series_[ps.norm].slopes : nullptr;
  if (slopes == nullptr) {
    out.growth.reset();
    return;
  }
  const analytics::WindowedSlope& longest = slopes->longest();
  const analytics::WindowedSlope& forecast = slopes->window(forecast_window_index_);
  const std::optional<analytics::LinearFit> forecast_fit = forecast.Fit();
  if (forecast_fit) out.norm_slope_per_kstep = forecast_fit->slope_per_kstep();
  if (const double radial = RadialOf(i); std::isfinite(radial)) out.radial_per_step = radial;
  // By default the same window: fitted once.
  const std::optional<analytics::LinearFit> longest_fit = &forecast == &longest ? forecast_fit : longest.Fit();
  std::optional<analytics::GrowthWithoutDecay> g;
  if (const auto& fit = longest_fit) {
    analytics::GrowthOptions growth_options;
    growth_options.min_growth = options_.min_growth;
    g = analytics::AssessGrowth(params_[i], static_cast<uint32_t>(i), fit->PredictAt(fit->first_step),
                                fit->value_at_last_step, fit->slope_per_kstep(), growth_options);
  }
  if (!g) {
    out.growth.reset();
    return;
  }
  // Field by field: an entry kept from the previous step keeps its name's buffer.
  GrowthInfo& growth = out.growth ? *out.growth : out.growth.emplace();
  growth.param = params_[i].name;
  growth.growth_factor = g->growth_factor;
  growth.slope_per_kstep = g->slope_per_kstep;
  // The steps the growth was measured over: the window (full to within two buckets: its oldest
  // bucket expires whole), or what a young window holds.
  const uint64_t held = longest_fit->last_step - longest_fit->first_step + 1;
  growth.window_steps = held + 2 * longest.bucket_steps() >= longest.window_steps() ? longest.window_steps() : held;
  growth.amplification = ps.init_norm ? analytics::Amplification(ps.norm_value, *ps.init_norm) : kNaN;
  growth.norm = ps.norm_value;
}

void RunAnalytics::FillParamEntry(size_t i, ParamAnalysis& out, bool fit_norm) const {
  const ParamState& ps = param_state_[i];
  out.norm.reset();
  out.init_norm.reset();
  out.amplification.reset();
  out.norm_slope_per_kstep.reset();
  out.radial_per_step.reset();
  if (ps.norm == kNoSeries || !ps.has_norm_value) {
    out.growth.reset();
    return;
  }
  out.norm = ps.norm_value;
  if (ps.init_norm && params_[i].kind == ParamKind::kNormGain) {
    out.init_norm = *ps.init_norm;
    out.amplification = analytics::Amplification(ps.norm_value, *ps.init_norm);
  }
  if (fit_norm) {
    FillNormFits(i, out);
  } else {
    out.growth.reset();
  }
}

void RunAnalytics::MarkReadEachStep(const StepFits& fits) const {
  // A tracker fitted here for the first time takes the samples set aside for it now, and every
  // later one at once: its slice is applied (the samples of its other series with it), which
  // happens once per tracker in a run's life, not at each step.
  for (uint32_t i : fitted_scratch_) {
    const SeriesId norm = param_state_[i].norm;
    if (norm >= series_.size() || series_[norm].read_each_step) continue;
    series_[norm].read_each_step = true;
    ApplySetAside(norm % kSetAsideSlices);
  }
  for (size_t i = 0; i < std::min(fits.share.size(), params_.size()); ++i) {
    if (fits.share[i] == 0 || param_state_[i].share_read_each_step) continue;
    param_state_[i].share_read_each_step = true;
    ApplySetAside(i % kSetAsideSlices);
  }
}

void RunAnalytics::StepAnalysis(RunAnalysis& out, std::vector<ParamAnalysis>& params, const StepFits& fits) const {
  out.slopes.clear();
  out.amplifications.clear();
  out.growth_without_decay.clear();
  EventsForecastsShares(out, /*order_shares=*/false, &fits.share);
  FillRemediations(out);
  params.resize(params_.size());
  // The norm trackers fitted are cold in a large run (a rule reading every norm gain's growth
  // fits 2,222 of them a step at 10,000 parameters): they are fetched in stages a few fitted
  // parameters ahead (their entries, then their windows' sums, then each window's oldest bucket),
  // so that the misses overlap, as OnStep does for the samples.
  std::vector<uint32_t>& fitted = fitted_scratch_;
  fitted.clear();
  for (size_t i = 0; i < std::min(fits.norm.size(), params_.size()); ++i) {
    if (fits.norm[i] != 0) fitted.push_back(static_cast<uint32_t>(i));
  }
  MarkReadEachStep(fits);
  constexpr size_t kAhead = 2;
  const auto norm_tracker = [&](size_t k) -> const analytics::SlopeTracker* {
    if (k >= fitted.size()) return nullptr;
    const SeriesId norm = param_state_[fitted[k]].norm;
    return norm < series_.size() && series_[norm].slopes ? &*series_[norm].slopes : nullptr;
  };
  size_t next_fitted = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const bool fit_norm = next_fitted < fitted.size() && fitted[next_fitted] == i;
    if (fit_norm) {
      const size_t k = next_fitted++;
      if (k + 3 * kAhead < fitted.size()) {
        const SeriesId norm = param_state_[fitted[k + 3 * kAhead]].norm;
        if (norm < series_.size()) PrefetchRead(&series_[norm].slopes);
      }
      // The forecast window is the longest one by default: fetched once then.
      if (const analytics::SlopeTracker* s = norm_tracker(k + 2 * kAhead)) {
        const analytics::WindowedSlope& forecast = s->window(forecast_window_index_);
        forecast.PrefetchFitSums();
        if (&s->longest() != &forecast) s->longest().PrefetchFitSums();
      }
      if (const analytics::SlopeTracker* s = norm_tracker(k + kAhead)) {
        const analytics::WindowedSlope& forecast = s->window(forecast_window_index_);
        forecast.PrefetchOldest();
        if (&s->longest() != &forecast) s->longest().PrefetchOldest();
      }
    }
    FillParamEntry(i, params[i], fit_norm);
  }
}

RunAnalysis RunAnalytics::Analysis() const {
  RunAnalysis out;
  Analysis(out);
  return out;
}

void RunAnalytics::Analysis(RunAnalysis& out) const {
  ApplyAllSetAside();
  size_t slopes = 0;
  for (const Tracked& t : series_) {
    if (!t.slopes) continue;
    for (const auto& w : t.slopes->windows()) {
      auto fit = w.Fit();
      if (!fit) continue;
      SeriesSlopeInfo& info = NextSlot(out.slopes, &slopes);
      info.key = t.key;
      info.window_steps = w.window_steps();
      info.fit = *fit;
    }
  }
  out.slopes.resize(slopes);
  EventsForecastsShares(out, /*order_shares=*/true, nullptr);
  size_t amplifications = 0, growth = 0;
  ParamAnalysis entry;
  for (size_t i = 0; i < params_.size(); ++i) {
    FillParamEntry(i, entry, /*fit_norm=*/true);
    if (entry.amplification) {
      AmplificationInfo& info = NextSlot(out.amplifications, &amplifications);
      info.param = params_[i].name;
      info.norm = *entry.norm;
      info.init_norm = *entry.init_norm;
      info.amplification = *entry.amplification;
    }
    if (entry.growth) NextSlot(out.growth_without_decay, &growth) = *entry.growth;  // keeps the slot's buffer
  }
  out.amplifications.resize(amplifications);
  out.growth_without_decay.resize(growth);
  FillProjections(out);
  FillRemediations(out);
}

}  // namespace gradwatch::runs

// RunAnalytics: the AdamW projections of the norms that get no weight decay and the remediation
// checks that hold a projection against what the run then does (RunAnalysis::projections,
// ::remediations).
#include <algorithm>
#include <cmath>
#include <limits>

#include "server/runs/analysis_slots.h"
#include "server/runs/run_analytics.h"

namespace gradwatch::runs {

namespace {

// A remediation works while its norm stays within this fraction of its projection.
constexpr double kRemediationTolerance = 0.25;

}  // namespace

using analysis_slots::NextSlot;

double RunAnalytics::LearningRate() const {
  if (learning_rate_ >= series_.size() || !series_[learning_rate_].has_value) return kNaN;
  return series_[learning_rate_].last_value;
}

double RunAnalytics::LearningRateOf(size_t i) const {
  const SeriesId own = param_state_[i].learning_rate;
  if (own < series_.size() && series_[own].has_value) return series_[own].last_value;
  return LearningRate();
}

std::optional<analytics::LinearFit> RunAnalytics::RecentFit(SeriesId id) const {
  if (id >= series_.size() || !series_[id].slopes) return std::nullopt;
  // The shortest window: the series as it is now, not as it was over a long window (a norm's
  // growth slows as it grows, and Adam's first steps move it differently).
  const analytics::WindowedSlope* shortest = nullptr;
  for (const analytics::WindowedSlope& w : series_[id].slopes->windows()) {
    if (shortest == nullptr || w.window_steps() < shortest->window_steps()) shortest = &w;
  }
  return shortest->Fit();
}

double RunAnalytics::RadialOf(size_t i) const {
  const std::optional<analytics::LinearFit> fit = RecentFit(param_state_[i].radial);
  return fit ? fit->value_at_last_step : kNaN;
}

std::optional<analytics::NormDynamics> RunAnalytics::DynamicsOf(size_t i, double lr) const {
  const ParamState& ps = param_state_[i];
  if (!ps.has_norm_value || !(lr > 0)) return std::nullopt;
  const std::optional<analytics::LinearFit> fit = RecentFit(ps.norm);
  if (!fit) return std::nullopt;
  const bool update_known = ps.update < series_.size() && series_[ps.update].has_value;
  return analytics::EstimateDynamics(ps.norm_value, fit->slope_per_step, lr, params_[i].weight_decay,
                                     update_known ? series_[ps.update].last_value : kNaN, RadialOf(i), &schedule_);
}

double RunAnalytics::ProjectedWeightDecay() const {
  if (default_weight_decay_ && *default_weight_decay_ > 0) return *default_weight_decay_;
  std::map<double, size_t> counts;
  for (const ParamInfo& p : params_) {
    if (p.weight_decay > 0 && std::isfinite(p.weight_decay)) ++counts[p.weight_decay];
  }
  double best = 0;
  size_t most = 0;
  for (const auto& [wd, count] : counts) {
    if (count > most) best = wd, most = count;
  }
  return best;
}

void RunAnalytics::FillProjections(RunAnalysis& out) const {
  out.projections.clear();
  const double wd = ProjectedWeightDecay();
  double output_share = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].kind == ParamKind::kOutput && param_state_[i].has_share) output_share += param_state_[i].share;
  }
  const double total =
      total_grad_ < series_.size() && series_[total_grad_].has_value ? series_[total_grad_].last_value : kNaN;
  for (const GrowthInfo& g : out.growth_without_decay) {
    const auto it = param_by_name_.find(g.param);
    if (it == param_by_name_.end() || !(wd > 0)) continue;
    const auto i = static_cast<size_t>(it->second);
    const double lr = LearningRateOf(i);
    const auto dynamics = DynamicsOf(i, lr);
    if (!dynamics) continue;
    const double norm = param_state_[i].norm_value;
    const analytics::NormProjection p =
        analytics::ProjectNorm(norm, *dynamics, lr, wd, options_.projection_steps, &schedule_, last_step_);
    ProjectionInfo& info = out.projections.emplace_back();
    info.param = g.param;
    info.weight_decay = wd;
    info.from_step = last_step_;
    info.to_step = last_step_ + options_.projection_steps;
    if (schedule_.total_steps && *schedule_.total_steps < info.to_step) {
      info.to_step = std::max(last_step_, *schedule_.total_steps);
    }
    info.schedule = schedule_.Describe();
    info.norm_now = norm;
    info.norm = p.norm_at_end;
    info.equilibrium_norm = p.equilibrium_norm;
    info.time_constant_steps = p.time_constant_steps;
    info.learning_rate = lr;
    info.radial = dynamics->radial;
    info.orthogonal = dynamics->orthogonal;
    info.orthogonal_known = dynamics->orthogonal_known;
    info.radial_known = dynamics->radial_known;
    info.total_grad_norm = kNaN;
    if (std::isfinite(total) && output_share > 0 && output_share <= 1 && norm > 0) {
      // If the output layer's gradient scales with the gain's norm (the incident's mechanism).
      const double k = p.norm_at_end / norm;
      info.total_grad_norm = total * std::sqrt(output_share * k * k + 1 - output_share);
    }
  }
}

std::vector<RunAnalytics::Remediation> RunAnalytics::RemediationsBefore(uint64_t step) const {
  std::vector<Remediation> kept;
  for (const Remediation& r : remediations_) {
    if (r.step >= step) continue;
    Remediation& k = kept.emplace_back(r);
    // Paths iterated past the rewind are iterated again along the new branch.
    if (k.advanced_to >= step) k.advanced_to = k.step, k.projected = k.unchanged = k.norm;
  }
  return kept;
}

void RunAnalytics::AdoptRemediations(std::vector<Remediation> kept) {
  std::erase_if(kept, [&](const Remediation& r) { return r.param >= params_.size(); });
  remediations_ = std::move(kept);
}

void RunAnalytics::FillRemediations(RunAnalysis& out) const {
  size_t used = 0;
  // The paths follow the rates reported (below), with the run's decay convention.
  analytics::LearningRateSchedule convention;
  convention.decay = schedule_.decay;
  for (Remediation& r : remediations_) {
    const ParamState& ps = param_state_[r.param];
    if (!ps.has_norm_value || last_step_ < r.step) continue;
    if (last_step_ < r.advanced_to) r.advanced_to = r.step, r.projected = r.unchanged = r.norm;
    const uint64_t more = last_step_ - r.advanced_to;
    // The paths follow the learning rate as it went (a schedule's decay is not the remedy's fault):
    // the steps since the last read at the rate reported now.
    const double lr_now = LearningRateOf(r.param);
    const double lr = lr_now > 0 && std::isfinite(lr_now) ? lr_now : r.learning_rate;
    r.projected = analytics::ProjectNorm(r.projected, r.dynamics, lr, r.weight_decay, more, &convention).norm_at_end;
    r.unchanged =
        analytics::ProjectNorm(r.unchanged, r.dynamics, lr, r.previous_weight_decay, more, &convention).norm_at_end;
    r.advanced_to = last_step_;
    // The equilibrium and time constant (no step iterated).
    analytics::NormProjection p =
        analytics::ProjectNorm(r.norm, r.dynamics, r.learning_rate, r.weight_decay, 0, &convention);
    p.norm_at_end = r.projected;
    RemediationInfo& info = NextSlot(out.remediations, &used);  // keeps the slot's buffers
    info.param = params_[r.param].name;
    info.step = r.step;
    info.weight_decay = r.weight_decay;
    info.previous_weight_decay = r.previous_weight_decay;
    info.norm_at_step = r.norm;
    info.at_step = last_step_;
    info.projected_norm = p.norm_at_end;
    info.actual_norm = ps.norm_value;
    info.time_constant_steps = p.time_constant_steps;
    // Where the norm would be without the change, to tell a decay that acts slowly from none.
    const double unchanged = r.unchanged;
    info.unchanged_norm = unchanged;
    const double elapsed = static_cast<double>(last_step_ - r.step);
    const double actual = ps.norm_value;
    if (elapsed < p.time_constant_steps / 2) {
      info.verdict = "too early";
    } else if (std::abs(actual - p.norm_at_end) <= kRemediationTolerance * p.norm_at_end) {
      info.verdict = "working";
    } else if (actual < p.norm_at_end) {
      info.verdict = "faster than projected";
    } else if (std::abs(actual - unchanged) < std::abs(actual - p.norm_at_end)) {
      info.verdict = "not working";
    } else {
      info.verdict = "slower than projected";
    }
  }
  out.remediations.resize(used);
}

}  // namespace gradwatch::runs

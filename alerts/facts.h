// RunFacts: what the rule engine knows about one run at one evaluation. The daemon fills it from
// the run's latest step and its analytics; the alerts library only reads it. Plain data: no
// locks, no references into the daemon, cheap to build in tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "server/analytics/projection.h"
#include "server/core/types.h"

namespace gradwatch::alerts {

// A series' value at the evaluated step, by key ("grad/norm/total", "params/norm/<param>").
// Unlike gradwatch::SeriesValue it is keyed by name: rules match keys, not catalog ids.
struct SeriesValue {
  std::string key;
  double value = 0;  // may be NaN or ±Inf: the non_finite rules look for exactly that
};

// When a series reaches `threshold` at its current pace (analytics::Forecast).
struct ForecastFact {
  std::string key;
  double threshold = 0;
  bool reachable = false;         // true when already at or above
  double steps_to_threshold = 0;  // 0 when already at or above; +inf when not reachable
  uint64_t at_step = 0;
  double current_value = 0;  // the fitted value at the fit's last step
  double slope_per_kstep = 0;
  // What the fit holds: its reports, and the steps from its first to its last. 0 (a fact built
  // by hand): not known, not judged.
  uint64_t fit_samples = 0;
  uint64_t fit_span_steps = 0;
};

// A series' slope before and after an event (analytics::SlopeChange).
struct SlopeChangeFact {
  std::string key;
  uint64_t event_step = 0;
  std::string event_text;
  double ratio = 0;  // after / before; ±inf when before was 0, NaN when unknown
  double before_per_kstep = 0;
  double after_per_kstep = 0;
  size_t after_samples = 0;
  // The slopes' standard errors per 1,000 steps; NaN while unknown. 0 (as in a fact built by
  // hand) means exact.
  double before_stderr_per_kstep = 0;
  double after_stderr_per_kstep = 0;
};

// A slope change found without an event (analytics::ChangePoint).
struct ChangePointFact {
  std::string key;
  uint64_t step = 0;  // estimated break step
  double ratio = 0;
  double before_per_kstep = 0;
  double after_per_kstep = 0;
  // The slope difference over its standard error; +inf or 0 (unknown, as in a fact built by
  // hand) for exact.
  double z_score = 0;
};

// A parameter's or a group's share of the squared total grad norm.
struct ShareFact {
  std::string name;  // parameter name, or group name when is_group
  bool is_group = false;
  double share = 0;  // a fraction, 0..1 (NaN when unknown)
  double slope_per_kstep = 0;
  ParamKind kind = ParamKind::kUnspecified;  // a parameter's catalog kind (not for groups)
  // The share at the start of its trend's window (the mean over steps [earlier_first_step,
  // earlier_last_step]; NaN when unknown) and the reports the trend holds.
  double earlier_share = std::numeric_limits<double>::quiet_NaN();
  uint64_t earlier_first_step = 0;
  uint64_t earlier_last_step = 0;
  uint64_t trend_samples = 0;
};

// One catalog parameter and what analytics says about it. Optional fields are unknown when empty.
struct ParamFact {
  ParamInfo info;
  std::optional<double> norm;         // params/norm/<name> at the evaluated step
  std::optional<double> grad_norm;    // grad/norm/<name> at the evaluated step
  std::optional<double> update_norm;  // updates/norm/<name> at the evaluated step (|Δw| of a step)
  // ⟨Δw, w⟩/|w| as it is now (updates/radial/<name>, fitted over the shortest window), when sent.
  std::optional<double> radial_per_step;
  std::optional<double> init_norm;      // catalog init_norm, else sqrt(numel) for a norm gain
  std::optional<double> amplification;  // norm / init_norm
  // Set when analytics reports growth without decay: norm now / norm at the window's start, and
  // the norm's slope per 1,000 steps over that window.
  std::optional<double> growth_factor;
  std::optional<double> growth_slope_per_kstep;
  std::optional<double> norm_slope_per_kstep;  // the norm's slope over the forecast window
};

// The run's training configuration, as far as it matters to recommendations.
struct ConfigFacts {
  std::optional<double> z_loss_coef;
  std::optional<double> weight_decay;    // the optimizer's default weight decay
  std::optional<uint64_t> warmup_steps;  // the learning-rate warm-up's length, when the trainer said
  std::optional<uint64_t> total_steps;   // the run's last step, when the trainer said
  // The learning-rate schedule the what-if follows (config lr_schedule, min_lr, warmup_steps,
  // total_steps); a constant shape holds the rate.
  analytics::LearningRateSchedule schedule;
};

// The learning rate (optim/learning_rate) as reported up to the evaluated step
// (LearningRateTracker, alerts/warmup.h, follows it step by step).
struct LearningRateFact {
  bool known = false;  // the run reports a learning rate
  double value = 0;    // its latest report
  double peak = 0;     // the largest report so far, at peak_step
  uint64_t peak_step = 0;
  // Still rising toward its peak: it rose, and has neither fallen below its peak nor stayed
  // there for kWarmupFlatReports reports.
  bool warming_up = false;
  // The latest jump after warm-up (a report more than kJumpFactor× or less than 1/kJumpFactor of
  // the one before it: a resume with another schedule, a change by hand); jump_step 0: none.
  uint64_t jump_step = 0;
  double jump_from = 0;
  double jump_to = 0;
};

// Whether the rules with severity page hold their pages at the evaluated step (a threshold
// rule's page becomes a warning while it holds: alerts/warmup.h), and why.
struct WarmupFact {
  bool holds_pages = false;
  // "the learning rate is still rising toward its peak (2.4e-4 at step 120)"; empty when not held.
  std::string reason;
};

// The run rewound (resumed from a checkpoint before its newest step) to from_step; 0: never.
struct RewindFact {
  uint64_t from_step = 0;
  uint64_t abandoned_through = 0;  // the newest step of the abandoned branch
};

// A remediation under check: a catalog change that raised `param`'s weight decay at `step`, and
// the norm the what-if made then projects for the evaluated step, against the actual one.
struct RemediationFact {
  std::string param;
  uint64_t step = 0;
  double weight_decay = 0;
  double previous_weight_decay = 0;
  double norm_at_step = 0;
  double projected_norm = 0;  // with the new weight decay
  double unchanged_norm = 0;  // with the previous one
  double actual_norm = 0;
  double time_constant_steps = 0;  // of the projected approach (+inf: none)
};

// A non-finite value seen at the evaluated step.
struct NonFiniteFact {
  std::string key;
  uint64_t step = 0;
};

struct RunFacts {
  std::string run_id;
  // The run's own labels (job, cluster, ...), copied onto every alert of the run. A rule's labels
  // and the alert's own (alertname, run, series, ...) win over them.
  LabelSet run_labels;
  uint64_t step = 0;     // the completed step being evaluated
  double wall_time = 0;  // the step's wall time, seconds since the Unix epoch; 0 when unknown
  double now = 0;        // seconds since the Unix epoch, when the facts were taken
  uint32_t open_streams = 0;
  double seconds_since_last_step = 0;  // for stalled rules
  // For run_died rules: seconds since the run last showed a sign of life (a hello, a stream
  // closing, a step or an event), and whether it ended with a Goodbye (then it never died).
  double seconds_since_activity = 0;
  bool ended_cleanly = false;

  std::vector<SeriesValue> latest;  // sorted by key (FindLatest binary-searches it)
  // Set by whoever fills `latest` (0: unknown): facts with the same non-zero id hold the same keys
  // in `latest`, in the same order, so that refilling them sets the values alone.
  uint64_t latest_layout = 0;
  std::vector<ForecastFact> forecasts;
  std::vector<SlopeChangeFact> slope_changes;
  std::vector<ChangePointFact> change_points;
  std::vector<ShareFact> shares;
  // Like latest_layout, for `shares`: facts with the same non-zero id hold the same names in the
  // same order.
  uint64_t shares_layout = 0;
  std::vector<ParamFact> params;
  // The run's catalog changes (RunMeta::catalog_changes) when `params`' info was copied: a feed
  // that refills these facts copies every entry's info again once it moved.
  uint64_t catalog_changes = 0;
  ConfigFacts config;
  std::vector<NonFiniteFact> nonfinite;
  LearningRateFact learning_rate;
  WarmupFact warmup;
  RewindFact rewind;  // the latest rewind
  std::vector<RemediationFact> remediations;
  // How far the what-if in a weight-decay recommendation projects (analytics.projection_steps).
  uint64_t projection_steps = 20000;
};

// The value of `key` in facts.latest (which must be sorted by key); nullptr when absent.
inline const SeriesValue* FindLatest(const RunFacts& facts, std::string_view key) {
  auto it = std::lower_bound(facts.latest.begin(), facts.latest.end(), key,
                             [](const SeriesValue& v, std::string_view k) { return v.key < k; });
  return it != facts.latest.end() && it->key == key ? &*it : nullptr;
}

// Sorts facts.latest by key, for callers that fill it in another order.
inline void SortLatest(RunFacts& facts) {
  std::sort(facts.latest.begin(), facts.latest.end(),
            [](const SeriesValue& a, const SeriesValue& b) { return a.key < b.key; });
}

}  // namespace gradwatch::alerts

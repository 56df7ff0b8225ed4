#include "alerts/evaluator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

namespace gradwatch::alerts {
namespace {

bool Upward(CompareOp op) { return op == CompareOp::kGe || op == CompareOp::kGt; }

// The measure that neither holds nor stays in the clear band: a failed precondition.
double Shut(CompareOp op) { return Upward(op) ? -INFINITY : INFINITY; }

LevelTest PlainLevel(CompareOp op, double bound, std::optional<double> clear_bound, double measure,
                     bool gate) {
  LevelTest t;
  t.op = op;
  t.bound = bound;
  t.clear_bound = clear_bound;
  t.hold_measure = t.clear_measure = gate ? measure : Shut(op);
  return t;
}

// The interval of a slope ratio after/before from the slopes' standard errors: the lowest and
// highest ratio within kEstimateZ errors of each slope, for a positive slope before. NaN when
// unknown (an error not yet known, or a before slope that is not clearly positive).
std::pair<double, double> RatioInterval(double before, double after, double before_se, double after_se) {
  const double z = kEstimateZ;
  if (!std::isfinite(before) || !std::isfinite(after) || !std::isfinite(before_se) || !std::isfinite(after_se)) {
    return {NAN, NAN};
  }
  const double low_den = before + z * before_se;
  const double high_den = before - z * before_se;
  if (!(low_den > 0)) return {NAN, NAN};
  const double low = (after - z * after_se) / low_den;
  const double high = high_den > 0 ? (after + z * after_se) / high_den : INFINITY;
  return {low, high};
}

bool IsGlob(std::string_view pattern) { return pattern.find_first_of("*?") != std::string_view::npos; }

bool MatchesAny(const std::vector<std::string>& patterns, std::string_view key) {
  for (const std::string& p : patterns) {
    if (GlobMatch(p, key)) return true;
  }
  return false;
}

// Calls fn(series) for every entry of facts.latest matching one of the patterns, once each.
template <typename Fn>
void ForEachLatest(const std::vector<std::string>& patterns, const RunFacts& facts, Fn fn) {
  bool any_glob = false;
  for (const std::string& p : patterns) any_glob = any_glob || IsGlob(p);
  if (!any_glob) {
    std::vector<std::string_view> seen;
    for (const std::string& p : patterns) {
      if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
      seen.push_back(p);
      if (const SeriesValue* v = FindLatest(facts, p)) fn(*v);
    }
    return;
  }
  for (const SeriesValue& v : facts.latest) {
    if (MatchesAny(patterns, v.key)) fn(v);
  }
}

Condition Make(const LabelSet& base, const RunFacts& facts, double value, bool active) {
  Condition c;
  c.labels = base;
  c.value = value;
  c.active = active;
  c.vars["value"] = FormatNumber(value);
  c.vars["step"] = FormatStep(facts.step);
  c.vars["run"] = facts.run_id;
  return c;
}

bool SameThreshold(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max({1.0, std::fabs(a), std::fabs(b)});
}

std::optional<double> InitNormOf(const ParamFact& p) {
  if (p.init_norm && *p.init_norm > 0) return p.init_norm;
  if (p.info.init_norm && *p.info.init_norm > 0) return p.info.init_norm;
  if (p.info.kind == ParamKind::kNormGain && p.info.numel > 0) {
    return std::sqrt(static_cast<double>(p.info.numel));
  }
  return std::nullopt;
}

std::optional<double> AmplificationOf(const ParamFact& p) {
  if (p.amplification && std::isfinite(*p.amplification)) return p.amplification;
  auto init = InitNormOf(p);
  if (p.norm && std::isfinite(*p.norm) && init) return *p.norm / *init;
  return std::nullopt;
}

void EvaluateThreshold(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                       std::vector<Condition>* out) {
  ForEachLatest(rule.series, facts, [&](const SeriesValue& v) {
    Condition c = Make(base, facts, v.value, Compare(v.value, rule.op, rule.value));
    c.level = PlainLevel(rule.op, rule.value, Upward(rule.op) ? rule.clear_below : rule.clear_above, v.value, true);
    c.labels["series"] = v.key;
    c.vars["series"] = v.key;
    c.vars["threshold"] = FormatNumber(rule.value);
    c.vars["op"] = std::string(CompareOpSymbol(rule.op));
    out->push_back(std::move(c));
  });
}

void EvaluateForecast(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                      std::vector<Condition>* out) {
  for (const ForecastFact& f : facts.forecasts) {
    if (!SameThreshold(f.threshold, rule.threshold) || !MatchesAny(rule.series, f.key)) continue;
    // A forecast is about the future: once the value is there, the threshold's own rule speaks.
    const bool active = f.reachable && f.current_value < rule.threshold && f.steps_to_threshold >= 0 &&
                        f.steps_to_threshold <= static_cast<double>(rule.within_steps);
    Condition c = Make(base, facts, f.current_value, active);
    // Judged on the steps to the threshold: the forecast itself is the value's fitted level.
    const bool gate = f.reachable && f.current_value < rule.threshold && f.steps_to_threshold >= 0;
    c.level = PlainLevel(CompareOp::kLe, static_cast<double>(rule.within_steps), std::nullopt,
                         f.steps_to_threshold, gate);
    c.level->shows_level = false;
    c.labels["series"] = f.key;
    c.vars["series"] = f.key;
    c.vars["threshold"] = FormatNumber(rule.threshold);
    c.vars["steps_to_threshold"] = FormatCount(f.steps_to_threshold);
    c.vars["at_step"] = f.reachable ? FormatStep(f.at_step) : "never";
    c.vars["within_steps"] = FormatStep(rule.within_steps);
    c.vars["slope"] = FormatNumber(f.slope_per_kstep);
    c.vars["current"] = FormatNumber(f.current_value);
    out->push_back(std::move(c));
  }
}

LevelTest EstimateLevel(const Rule& rule, double low, double high) {
  LevelTest t;
  t.op = CompareOp::kGe;
  t.bound = rule.min_ratio;
  t.clear_bound = rule.clear_below;
  t.hold_measure = low;
  t.clear_measure = high;
  t.shows_level = false;
  return t;
}

void EvaluateSlopeChange(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                         std::vector<Condition>* out) {
  auto fill = [&](Condition& c, const std::string& key, double ratio, double before, double after,
                  uint64_t step, const std::string& text) {
    c.labels["series"] = key;
    c.vars["series"] = key;
    c.vars["ratio"] = FormatNumber(ratio);
    c.vars["min_ratio"] = FormatNumber(rule.min_ratio);
    c.vars["slope_before"] = FormatNumber(before);
    c.vars["slope_after"] = FormatNumber(after);
    c.vars["event"] = text;
    c.vars["event_step"] = FormatStep(step);
    c.vars["at_step"] = FormatStep(step);
  };
  if (rule.at != SlopeChangeAt::kChangePoint) {
    std::map<std::pair<std::string, uint64_t>, const SlopeChangeFact*> events;  // last one wins
    for (const SlopeChangeFact& s : facts.slope_changes) {
      if (MatchesAny(rule.series, s.key)) events[{s.key, s.event_step}] = &s;
    }
    for (const auto& [key, s] : events) {
      const auto [low, high] =
          RatioInterval(s->before_per_kstep, s->after_per_kstep, s->before_stderr_per_kstep, s->after_stderr_per_kstep);
      Condition c = Make(base, facts, s->ratio, low >= rule.min_ratio);
      c.level = EstimateLevel(rule, low, high);
      fill(c, s->key, s->ratio, s->before_per_kstep, s->after_per_kstep, s->event_step, s->event_text);
      c.labels["trigger"] = "event";
      c.labels["event_step"] = std::to_string(s->event_step);
      out->push_back(std::move(c));
    }
  }
  if (rule.at != SlopeChangeAt::kEvent) {
    std::map<std::string, const ChangePointFact*> latest;  // the newest change per series
    for (const ChangePointFact& p : facts.change_points) {
      if (!MatchesAny(rule.series, p.key)) continue;
      auto& slot = latest[p.key];
      if (!slot || p.step >= slot->step) slot = &p;
    }
    for (const auto& [key, p] : latest) {
      // The detector gives the z-score of the slope difference: its standard error, carried to
      // the ratio with the slope before taken as known.
      const double diff = p->after_per_kstep - p->before_per_kstep;
      const double diff_se = p->z_score > 0 && std::isfinite(p->z_score) ? std::fabs(diff) / p->z_score : 0;
      double low = NAN, high = NAN;
      if (p->before_per_kstep > 0) {
        low = 1 + (diff - kEstimateZ * diff_se) / p->before_per_kstep;
        high = 1 + (diff + kEstimateZ * diff_se) / p->before_per_kstep;
      }
      Condition c = Make(base, facts, p->ratio, low >= rule.min_ratio);
      c.level = EstimateLevel(rule, low, high);
      fill(c, p->key, p->ratio, p->before_per_kstep, p->after_per_kstep, p->step, "");
      c.labels["trigger"] = "change_point";
      out->push_back(std::move(c));
    }
  }
}

void EvaluateShare(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                   std::vector<Condition>* out) {
  const bool watch_params = !rule.param.empty() || rule.param_kind.has_value();
  for (const ShareFact& s : facts.shares) {
    bool match = false;
    if (s.is_group) {
      match = !rule.group.empty() && GlobMatch(rule.group, s.name);
    } else if (watch_params) {
      match = rule.param.empty() || GlobMatch(rule.param, s.name);
      if (match && rule.param_kind) match = s.kind == *rule.param_kind;
    }
    if (!match) continue;
    Condition c = Make(base, facts, s.share, s.share >= rule.min_share);
    c.level = PlainLevel(CompareOp::kGe, rule.min_share, rule.clear_below, s.share, true);
    c.level->percent = true;
    c.labels[s.is_group ? "group" : "param"] = s.name;
    c.vars["param"] = s.name;
    c.vars["share"] = FormatPercent(s.share);
    c.vars["min_share"] = FormatPercent(rule.min_share);
    c.vars["slope"] = FormatNumber(s.slope_per_kstep);
    c.vars["value"] = FormatPercent(s.share);
    out->push_back(std::move(c));
  }
}

void EvaluateGrowth(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                    std::vector<Condition>* out) {
  for (const ParamFact& p : facts.params) {
    if (rule.param_kind && p.info.kind != *rule.param_kind) continue;
    if (!rule.param.empty() && !GlobMatch(rule.param, p.info.name)) continue;
    if (!(p.info.weight_decay <= rule.max_weight_decay)) continue;

    // NaN stands for unknown here.
    const double amplification = AmplificationOf(p).value_or(NAN);
    const double growth = p.growth_factor ? *p.growth_factor - 1 : NAN;
    const std::optional<double> slope =
        p.growth_factor && p.growth_slope_per_kstep ? p.growth_slope_per_kstep : p.norm_slope_per_kstep;
    const bool rising = (p.growth_factor && (!p.growth_slope_per_kstep || *p.growth_slope_per_kstep > 0)) ||
                        (p.norm_slope_per_kstep && *p.norm_slope_per_kstep > 0);
    bool active = rising;
    if (rule.min_amplification) active = active && amplification >= *rule.min_amplification;
    if (rule.min_growth) active = active && growth >= *rule.min_growth;

    const double value = rule.min_amplification ? amplification : growth;
    Condition c = Make(base, facts, value, active);
    // The measure is the value; the other criterion and the rise are preconditions.
    bool gate = rising;
    if (rule.min_amplification && rule.min_growth) gate = gate && growth >= *rule.min_growth;
    c.level = PlainLevel(CompareOp::kGe, rule.min_amplification ? *rule.min_amplification : rule.min_growth.value_or(0),
                         rule.clear_below, value, gate);
    c.labels["param"] = p.info.name;
    c.vars["param"] = p.info.name;
    c.vars["amplification"] = std::isfinite(amplification) ? FormatNumber(amplification) : "unknown";
    c.vars["growth"] = std::isfinite(growth) ? FormatPercent(growth) : "unknown";
    c.vars["norm"] = p.norm ? FormatNumber(*p.norm) : "unknown";
    const auto init = InitNormOf(p);
    c.vars["init_norm"] = init ? FormatNumber(*init) : "unknown";
    c.vars["slope"] = slope ? FormatNumber(*slope) : "unknown";
    c.vars["weight_decay"] = FormatNumber(p.info.weight_decay);
    c.vars["min_amplification"] = rule.min_amplification ? FormatNumber(*rule.min_amplification) : "";
    c.vars["min_growth"] = rule.min_growth ? FormatPercent(*rule.min_growth) : "";
    out->push_back(std::move(c));
  }
}

void EvaluateNonFinite(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                       const SeriesFilter* with_instance, std::vector<Condition>* out) {
  std::map<std::string_view, double> found;  // key → value; a listed non-finite wins
  ForEachLatest(rule.series, facts, [&](const SeriesValue& v) {
    if (std::isfinite(v.value) && with_instance != nullptr && !(*with_instance)(v.key)) return;
    found.emplace(v.key, v.value);
  });
  for (const NonFiniteFact& n : facts.nonfinite) {
    if (!MatchesAny(rule.series, n.key)) continue;
    auto [it, inserted] = found.emplace(n.key, NAN);
    if (!inserted && std::isfinite(it->second)) it->second = NAN;
  }
  for (const auto& [key, value] : found) {
    Condition c = Make(base, facts, value, !std::isfinite(value));
    c.labels["series"] = std::string(key);
    c.vars["series"] = std::string(key);
    out->push_back(std::move(c));
  }
}

void EvaluateStalled(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                     std::vector<Condition>* out) {
  const bool active = facts.open_streams > 0 && facts.seconds_since_last_step >= rule.stalled_seconds;
  Condition c = Make(base, facts, facts.seconds_since_last_step, active);
  c.vars["seconds"] = FormatCount(facts.seconds_since_last_step);
  c.vars["threshold"] = FormatCount(rule.stalled_seconds);
  c.vars["open_streams"] = std::to_string(facts.open_streams);
  out->push_back(std::move(c));
}

void EvaluateRunDied(const Rule& rule, const RunFacts& facts, const LabelSet& base,
                     std::vector<Condition>* out) {
  const double seconds = rule.stalled_seconds > 0 ? rule.stalled_seconds : kDefaultRunDiedSeconds;
  const bool active = !facts.ended_cleanly && facts.open_streams == 0 && facts.seconds_since_activity >= seconds;
  Condition c = Make(base, facts, facts.seconds_since_activity, active);
  c.vars["seconds"] = FormatCount(facts.seconds_since_activity);
  c.vars["threshold"] = FormatCount(seconds);
  out->push_back(std::move(c));
}

}  // namespace

bool LevelHolds(const LevelTest& test, double measure) { return Compare(measure, test.op, test.bound); }

bool LevelPastClear(const LevelTest& test, double measure) {
  if (std::isnan(measure)) return false;
  if (!test.clear_bound) return !Compare(measure, test.op, test.bound);
  return Upward(test.op) ? measure < *test.clear_bound : measure > *test.clear_bound;
}

LabelSet BaseLabels(const Rule& rule, const RunFacts& facts) {
  LabelSet labels = facts.run_labels;
  for (const auto& [k, v] : rule.labels) labels[k] = v;
  labels["alertname"] = rule.name;
  labels["run"] = facts.run_id;
  return labels;
}

std::vector<Condition> Evaluate(const Rule& rule, const RunFacts& facts, const SeriesFilter* with_instance) {
  std::vector<Condition> out;
  const LabelSet base = BaseLabels(rule, facts);
  switch (rule.kind) {
    case RuleKind::kThreshold: EvaluateThreshold(rule, facts, base, &out); break;
    case RuleKind::kForecast: EvaluateForecast(rule, facts, base, &out); break;
    case RuleKind::kSlopeChange: EvaluateSlopeChange(rule, facts, base, &out); break;
    case RuleKind::kShare: EvaluateShare(rule, facts, base, &out); break;
    case RuleKind::kGrowthWithoutDecay: EvaluateGrowth(rule, facts, base, &out); break;
    case RuleKind::kNonFinite: EvaluateNonFinite(rule, facts, base, with_instance, &out); break;
    case RuleKind::kStalled: EvaluateStalled(rule, facts, base, &out); break;
    case RuleKind::kRunDied: EvaluateRunDied(rule, facts, base, &out); break;
  }
  return out;
}

}  // namespace gradwatch::alerts

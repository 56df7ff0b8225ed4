#include "alerts/evaluator.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "alerts/recommendation.h"
#include "alerts/warmup.h"

namespace gradwatch::alerts {
namespace {

// The measure that neither holds nor stays in the clear band: a failed precondition.
double Shut(CompareOp op) { return IsUpward(op) ? -INFINITY : INFINITY; }

LevelTest PlainLevel(CompareOp op, double bound, std::optional<double> clear_bound, double measure, bool gate) {
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
    if (GlobMatches(p, key)) return true;
  }
  return false;
}

// Calls fn(series) for every entry of facts.latest that `wanted` takes and that matches one of the
// patterns, once each. `wanted` is asked first: it is cheaper than matching a run's every key.
template <typename Wanted, typename Fn>
void ForEachLatest(const std::vector<std::string>& patterns, const RunFacts& facts, Wanted wanted, Fn fn) {
  bool any_glob = false;
  for (const std::string& p : patterns) any_glob = any_glob || IsGlob(p);
  if (!any_glob) {
    for (size_t i = 0; i < patterns.size(); ++i) {
      if (std::find(patterns.begin(), patterns.begin() + static_cast<std::ptrdiff_t>(i), patterns[i]) !=
          patterns.begin() + static_cast<std::ptrdiff_t>(i)) {
        continue;  // listed twice
      }
      if (const SeriesValue* v = FindLatest(facts, patterns[i]); v != nullptr && wanted(*v)) fn(*v);
    }
    return;
  }
  for (const SeriesValue& v : facts.latest) {
    if (wanted(v) && MatchesAny(patterns, v.key)) fn(v);
  }
}

bool Always(const SeriesValue&) { return true; }

// A template variable's value: text, or a number to format (ConditionVars::As).
struct VarValue {
  using As = ConditionVars::As;
  As as = As::kText;
  std::string_view text;
  double number = 0;
  uint64_t integer = 0;  // kStep, kInteger
  // Implicit: a string is text.
  VarValue(std::string_view t) : text(t) {}
  VarValue(const std::string& t) : text(t) {}
  VarValue(const char* t) : text(t) {}
  VarValue(As a, double n, uint64_t i = 0) : as(a), number(n), integer(i) {}
};
VarValue Number(double v) { return {VarValue::As::kNumber, v}; }
VarValue Step(uint64_t s) { return {VarValue::As::kStep, 0, s}; }
VarValue Count(double v) { return {VarValue::As::kCount, v}; }
VarValue Percent(double v) { return {VarValue::As::kPercent, v}; }
VarValue Integer(uint64_t v) { return {VarValue::As::kInteger, 0, v}; }  // without separators

void SetVar(ConditionVars& vars, std::string_view key, const VarValue& value) {
  if (value.as == VarValue::As::kText) {
    vars.SetText(key, value.text);
  } else {
    vars.SetNumber(key, value.as, value.number, value.integer);
  }
}

// Sets what every condition has: value, step, run, and the rule's own hold and clear bounds (so
// that no text repeats a number the rule or an override sets).
Condition& Make(ConditionList& out, const Rule& rule, const LabelSet& base,
                std::initializer_list<std::pair<std::string_view, std::string_view>> own, const RunFacts& facts,
                double value, bool active) {
  Condition& c = out.Add(base, own, value, active);
  SetVar(c.vars, "value", Number(value));
  SetVar(c.vars, "step", Step(facts.step));
  SetVar(c.vars, "run", facts.run_id);
  SetVar(c.vars, "for_steps", Step(rule.for_steps));
  SetVar(c.vars, "resolve_for_steps", Step(rule.resolve_for_steps));
  const bool percent = rule.kind == RuleKind::kShare || rule.kind == RuleKind::kRemediation;
  if (rule.clear_below) SetVar(c.vars, "clear_below", percent ? Percent(*rule.clear_below) : Number(*rule.clear_below));
  if (rule.clear_above) SetVar(c.vars, "clear_above", percent ? Percent(*rule.clear_above) : Number(*rule.clear_above));
  return c;
}

bool IsPageRule(const Rule& rule) {
  auto it = rule.labels.find("severity");
  return it != rule.labels.end() && it->second == "page";
}

bool SameThreshold(double a, double b) {
  return std::fabs(a - b) <= 1e-9 * std::max({1.0, std::fabs(a), std::fabs(b)});
}

void EvaluateThreshold(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  const bool hold_pages = facts.warmup.holds_pages && IsPageRule(rule);
  ForEachLatest(rule.series, facts, Always, [&](const SeriesValue& v) {
    const bool active = Compare(v.value, rule.op, rule.value);
    // During warm-up a page is a warning of its own (warmup.h); a non-finite value pages at once.
    const bool held = hold_pages && std::isfinite(v.value);
    Condition& c =
        held ? Make(out, rule, base, {{"series", v.key}, {"severity", "warning"}, {kPageHeldLabel, kPageHeldValue}},
                    facts, v.value, active)
             : Make(out, rule, base, {{"series", v.key}}, facts, v.value, active);
    if (held) SetVar(c.vars, kPageHeldVariable, facts.warmup.reason);
    c.level = PlainLevel(rule.op, rule.value, IsUpward(rule.op) ? rule.clear_below : rule.clear_above, v.value, true);
    SetVar(c.vars, "series", v.key);
    SetVar(c.vars, "threshold", Number(rule.value));
    SetVar(c.vars, "op", CompareOpSymbol(rule.op));
  });
}

void EvaluateForecast(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  for (const ForecastFact& f : facts.forecasts) {
    if (!SameThreshold(f.threshold, rule.threshold) || !MatchesAny(rule.series, f.key)) continue;
    // A forecast is about the future: once the value is there, the threshold's own rule speaks.
    // Nor is it judged before its fit holds enough (kForecastMinReports).
    const bool enough = f.fit_samples == 0 || (f.fit_samples >= kForecastMinReports &&
                                               static_cast<double>(f.fit_span_steps) >=
                                                   kForecastMinSpanFraction * static_cast<double>(rule.within_steps));
    // A crossing after the run's last step (config.total_steps) is no crossing this run will see.
    const bool after_end = facts.config.total_steps && f.reachable && f.at_step > *facts.config.total_steps;
    const bool active = enough && f.reachable && !after_end && f.current_value < rule.threshold &&
                        f.steps_to_threshold >= 0 && f.steps_to_threshold <= static_cast<double>(rule.within_steps);
    Condition& c = Make(out, rule, base, {{"series", f.key}}, facts, f.current_value, active);
    // Judged on the steps to the threshold: the forecast itself is the value's fitted level.
    const bool gate =
        enough && f.reachable && !after_end && f.current_value < rule.threshold && f.steps_to_threshold >= 0;
    c.level =
        PlainLevel(CompareOp::kLe, static_cast<double>(rule.within_steps), std::nullopt, f.steps_to_threshold, gate);
    c.level->shows_level = false;
    SetVar(c.vars, "series", f.key);
    SetVar(c.vars, "threshold", Number(rule.threshold));
    SetVar(c.vars, "steps_to_threshold", Count(f.steps_to_threshold));
    SetVar(c.vars, "at_step", f.reachable ? Step(f.at_step) : VarValue("never"));
    SetVar(c.vars, "within_steps", Step(rule.within_steps));
    SetVar(c.vars, "slope", Number(f.slope_per_kstep));
    SetVar(c.vars, "current", Number(f.current_value));
    // Built in reused buffers: a forecast is evaluated at every step, rendered rarely.
    std::string& outlook = out.scratch_text;
    std::string& number = out.scratch_number;
    FormatNumberTo(number, rule.threshold);
    if (!enough) {
      outlook.assign("has too few reports for a forecast toward ").append(number);
      FormatStepTo(number, f.fit_span_steps);
      outlook.append(" (").append(number).append(" steps so far)");
    } else if (f.current_value >= rule.threshold) {
      outlook.assign("is at or above ").append(number);
    } else if (!f.reachable || !std::isfinite(f.steps_to_threshold) || f.steps_to_threshold < 0) {
      outlook.assign("is not rising toward ").append(number);
    } else {
      outlook.assign("reaches ").append(number).append(" in ~");
      FormatCountTo(number, f.steps_to_threshold);
      outlook.append(number).append(" steps (near step ");
      FormatStepTo(number, f.at_step);
      outlook.append(number);
      if (after_end) {
        FormatStepTo(number, *facts.config.total_steps);
        outlook.append(", after the run's last step ").append(number);
      } else if (facts.config.total_steps) {
        FormatStepTo(number, *facts.config.total_steps);
        outlook.append(", before the run's last step ").append(number);
      }
      outlook.append(")");
    }
    SetVar(c.vars, "outlook", outlook);
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

void EvaluateSlopeChange(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  auto fill = [&](Condition& c, const std::string& key, double ratio, double before, double after, uint64_t step,
                  const std::string& text) {
    SetVar(c.vars, "series", key);
    SetVar(c.vars, "ratio", Number(ratio));
    SetVar(c.vars, "min_ratio", Number(rule.min_ratio));
    SetVar(c.vars, "slope_before", Number(before));
    SetVar(c.vars, "slope_after", Number(after));
    SetVar(c.vars, "event", text);
    SetVar(c.vars, "event_step", Step(step));
    SetVar(c.vars, "at_step", Step(step));
  };
  // The matching facts sorted by series, step and fact order; the last of each series (and
  // step, when `per_step`) is kept: the last fact of an event, the newest change point.
  auto pick = [&](auto facts_of, auto step_of, bool per_step) {
    using Fact = typename decltype(facts_of)::value_type;
    const auto fact = [](const std::pair<const void*, size_t>& p) -> const Fact& {
      return *static_cast<const Fact*>(p.first);
    };
    out.picks.clear();
    for (size_t i = 0; i < facts_of.size(); ++i) {
      if (MatchesAny(rule.series, facts_of[i].key)) out.picks.emplace_back(&facts_of[i], i);
    }
    std::sort(out.picks.begin(), out.picks.end(), [&](const auto& a, const auto& b) {
      const Fact& x = fact(a);
      const Fact& y = fact(b);
      if (x.key != y.key) return x.key < y.key;
      if (step_of(x) != step_of(y)) return step_of(x) < step_of(y);
      return a.second < b.second;
    });
    size_t kept = 0;
    for (size_t i = 0; i < out.picks.size(); ++i) {
      if (i + 1 < out.picks.size()) {
        const Fact& x = fact(out.picks[i]);
        const Fact& y = fact(out.picks[i + 1]);
        if (x.key == y.key && (!per_step || step_of(x) == step_of(y))) continue;
      }
      out.picks[kept++] = out.picks[i];
    }
    out.picks.resize(kept);
  };
  if (rule.at != SlopeChangeAt::kChangePoint) {
    pick(
        std::span<const SlopeChangeFact>(facts.slope_changes), [](const SlopeChangeFact& f) { return f.event_step; },
        true);
    for (const auto& [ptr, index] : out.picks) {
      const SlopeChangeFact* s = static_cast<const SlopeChangeFact*>(ptr);
      const auto [low, high] =
          RatioInterval(s->before_per_kstep, s->after_per_kstep, s->before_stderr_per_kstep, s->after_stderr_per_kstep);
      char step_text[24];
      const auto end = std::to_chars(step_text, step_text + sizeof(step_text), s->event_step).ptr;
      Condition& c = Make(out, rule, base,
                          {{"series", s->key},
                           {"trigger", "event"},
                           {"event_step", std::string_view(step_text, static_cast<size_t>(end - step_text))}},
                          facts, s->ratio, low >= rule.min_ratio);
      c.level = EstimateLevel(rule, low, high);
      fill(c, s->key, s->ratio, s->before_per_kstep, s->after_per_kstep, s->event_step, s->event_text);
    }
  }
  if (rule.at != SlopeChangeAt::kEvent) {
    pick(
        std::span<const ChangePointFact>(facts.change_points), [](const ChangePointFact& f) { return f.step; }, false);
    for (const auto& [ptr, index] : out.picks) {
      const ChangePointFact* p = static_cast<const ChangePointFact*>(ptr);
      // The detector gives the z-score of the slope difference: its standard error, carried to
      // the ratio with the slope before taken as known.
      const double diff = p->after_per_kstep - p->before_per_kstep;
      const double diff_se = p->z_score > 0 && std::isfinite(p->z_score) ? std::fabs(diff) / p->z_score : 0;
      double low = NAN, high = NAN;
      if (p->before_per_kstep > 0) {
        low = 1 + (diff - kEstimateZ * diff_se) / p->before_per_kstep;
        high = 1 + (diff + kEstimateZ * diff_se) / p->before_per_kstep;
      }
      Condition& c = Make(out, rule, base, {{"series", p->key}, {"trigger", "change_point"}}, facts, p->ratio,
                          low >= rule.min_ratio);
      c.level = EstimateLevel(rule, low, high);
      static const std::string kNoEvent;
      fill(c, p->key, p->ratio, p->before_per_kstep, p->after_per_kstep, p->step, kNoEvent);
    }
  }
}

}  // namespace

bool GrowthRuleSelects(const Rule& rule, const ParamInfo& p) {
  if (rule.param_kind && p.kind != *rule.param_kind) return false;
  if (!rule.param.empty() && !GlobMatches(rule.param, p.name)) return false;
  return p.weight_decay <= rule.max_weight_decay;
}

bool ShareRuleSelectsParam(const Rule& rule, std::string_view name, ParamKind kind) {
  if (rule.param.empty() && !rule.param_kind) return false;  // a rule on groups only
  if (!rule.param.empty() && !GlobMatches(rule.param, name)) return false;
  return !rule.param_kind || kind == *rule.param_kind;
}

void RulesReadFits(const std::vector<Rule>& rules, bool recommendation, const std::vector<ParamInfo>& catalog,
                   size_t from, std::vector<uint8_t>& norm, std::vector<uint8_t>& share) {
  if (norm.size() < catalog.size()) norm.resize(catalog.size(), 0);
  if (share.size() < catalog.size()) share.resize(catalog.size(), 0);
  for (size_t i = from; i < catalog.size(); ++i) {
    const ParamInfo& p = catalog[i];
    if (recommendation && MayBeFinalNorm(p)) norm[i] = 1;
    for (const Rule& rule : rules) {
      if (rule.kind == RuleKind::kGrowthWithoutDecay && GrowthRuleSelects(rule, p)) norm[i] = 1;
      if (rule.kind == RuleKind::kShare && ShareRuleSelectsParam(rule, p.name, p.kind)) share[i] = 1;
    }
  }
}

namespace {

void EvaluateShare(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  for (const ShareFact& s : facts.shares) {
    const bool match = s.is_group ? !rule.group.empty() && GlobMatches(rule.group, s.name)
                                  : ShareRuleSelectsParam(rule, s.name, s.kind);
    if (!match) continue;
    Condition& c =
        Make(out, rule, base, {{s.is_group ? "group" : "param", s.name}}, facts, s.share, s.share >= rule.min_share);
    c.level = PlainLevel(CompareOp::kGe, rule.min_share, rule.clear_below, s.share, true);
    c.level->percent = true;
    SetVar(c.vars, "param", s.name);
    SetVar(c.vars, "share", Percent(s.share));
    SetVar(c.vars, "min_share", Percent(rule.min_share));
    SetVar(c.vars, "slope", Number(s.slope_per_kstep));
    SetVar(c.vars, "value", Percent(s.share));
  }
}

void EvaluateGrowth(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  for (const ParamFact& p : facts.params) {
    if (!GrowthRuleSelects(rule, p.info)) continue;

    // NaN stands for unknown here.
    const double amplification = AmplificationOf(p).value_or(NAN);
    const double growth = p.growth_factor ? *p.growth_factor - 1 : NAN;
    const std::optional<double> slope =
        p.growth_factor && p.growth_slope_per_kstep ? p.growth_slope_per_kstep : p.norm_slope_per_kstep;
    const bool rising = NormRising(p);
    bool active = rising;
    if (rule.min_amplification) active = active && amplification >= *rule.min_amplification;
    if (rule.min_growth) active = active && growth >= *rule.min_growth;

    const double value = rule.min_amplification ? amplification : growth;
    Condition& c = Make(out, rule, base, {{"param", p.info.name}}, facts, value, active);
    // The measure is the value; the other criterion and the rise are preconditions.
    bool gate = rising;
    if (rule.min_amplification && rule.min_growth) gate = gate && growth >= *rule.min_growth;
    c.level = PlainLevel(CompareOp::kGe, rule.min_amplification ? *rule.min_amplification : rule.min_growth.value_or(0),
                         rule.clear_below, value, gate);
    SetVar(c.vars, "param", p.info.name);
    SetVar(c.vars, "amplification", std::isfinite(amplification) ? Number(amplification) : VarValue("unknown"));
    SetVar(c.vars, "growth", std::isfinite(growth) ? Percent(growth) : VarValue("unknown"));
    SetVar(c.vars, "norm", p.norm ? Number(*p.norm) : VarValue("unknown"));
    const auto init = InitNormOf(p);
    SetVar(c.vars, "init_norm", init ? Number(*init) : VarValue("unknown"));
    SetVar(c.vars, "slope", slope ? Number(*slope) : VarValue("unknown"));
    SetVar(c.vars, "weight_decay", Number(p.info.weight_decay));
    SetVar(c.vars, "min_amplification", rule.min_amplification ? Number(*rule.min_amplification) : VarValue(""));
    SetVar(c.vars, "min_growth", rule.min_growth ? Percent(*rule.min_growth) : VarValue(""));
  }
}

// A count of iterations that met a non-finite value (a log's "number of nan iterations"): the
// non_finite rules read it as non-finite when above 0.
bool IsNonFiniteCount(std::string_view key) { return key == keys::kNanIterations || key == keys::kSkippedIterations; }

bool IsNonFiniteObservation(std::string_view key, double value) {
  return !std::isfinite(value) || (value > 0 && IsNonFiniteCount(key));
}

void EvaluateNonFinite(const Rule& rule, const RunFacts& facts, const LabelSet& base, const SeriesFilter* with_instance,
                       ConditionList& out) {
  // Key → value, by key; a listed non-finite value wins.
  out.found.clear();
  // A finite value is a condition only where it may resolve an instance: most keys of a large run
  // are skipped before any pattern is matched.
  const auto wanted = [&](const SeriesValue& v) {
    return IsNonFiniteObservation(v.key, v.value) || with_instance == nullptr || (*with_instance)(v.key);
  };
  ForEachLatest(rule.series, facts, wanted, [&](const SeriesValue& v) { out.found.emplace_back(v.key, v.value); });
  const auto by_key = [](const auto& a, const auto& b) { return a.first < b.first; };
  std::sort(out.found.begin(), out.found.end(), by_key);
  const size_t from_latest = out.found.size();
  for (const NonFiniteFact& n : facts.nonfinite) {
    if (!MatchesAny(rule.series, n.key)) continue;
    const auto end = out.found.begin() + static_cast<std::ptrdiff_t>(from_latest);
    auto it = std::lower_bound(out.found.begin(), end, std::pair<std::string_view, double>(n.key, 0), by_key);
    if (it != end && it->first == n.key) {
      it->second = NAN;
    } else if (std::find_if(end, out.found.end(), [&](const auto& f) { return f.first == n.key; }) == out.found.end()) {
      out.found.emplace_back(n.key, NAN);
    }
  }
  std::sort(out.found.begin(), out.found.end(), by_key);
  for (const auto& [key, value] : out.found) {
    Condition& c = Make(out, rule, base, {{"series", key}}, facts, value, IsNonFiniteObservation(key, value));
    SetVar(c.vars, "series", key);
  }
}

void EvaluateStalled(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  const bool active = facts.open_streams > 0 && facts.seconds_since_last_step >= rule.stalled_seconds;
  Condition& c = Make(out, rule, base, {}, facts, facts.seconds_since_last_step, active);
  SetVar(c.vars, "seconds", Count(facts.seconds_since_last_step));
  SetVar(c.vars, "threshold", Count(rule.stalled_seconds));
  SetVar(c.vars, "open_streams", Integer(facts.open_streams));
}

void EvaluateRunDied(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  const double seconds = rule.stalled_seconds > 0 ? rule.stalled_seconds : kDefaultRunDiedSeconds;
  const bool active = !facts.ended_cleanly && facts.open_streams == 0 && facts.seconds_since_activity >= seconds;
  Condition& c = Make(out, rule, base, {}, facts, facts.seconds_since_activity, active);
  SetVar(c.vars, "seconds", Count(facts.seconds_since_activity));
  SetVar(c.vars, "threshold", Count(seconds));
}

}  // namespace

bool LevelHolds(const LevelTest& test, double measure) { return Compare(measure, test.op, test.bound); }

bool LevelPastClear(const LevelTest& test, double measure) {
  if (std::isnan(measure)) return false;
  if (!test.clear_bound) return !Compare(measure, test.op, test.bound);
  return IsUpward(test.op) ? measure < *test.clear_bound : measure > *test.clear_bound;
}

LabelSet BaseLabels(const Rule& rule, const RunFacts& facts) {
  LabelSet labels = facts.run_labels;
  for (const auto& [k, v] : rule.labels) labels[k] = v;
  labels["alertname"] = rule.name;
  labels["run"] = facts.run_id;
  return labels;
}

Condition& ConditionList::Add(const LabelSet& base,
                              std::initializer_list<std::pair<std::string_view, std::string_view>> own, double value,
                              bool active) {
  const bool fresh = size_ == slots_.size();
  if (fresh) {
    slots_.emplace_back();
    slot_base_.push_back(0);
  }
  uint64_t& built_with = slot_base_[size_];
  Condition& c = slots_[size_++];
  // The slot's labels are kept when they are already base + own (the same instance as at its
  // last use): rebuilding them would free and allocate nodes.
  bool same = !fresh && c.labels.size() == base.size() + own.size();
  for (const auto& [name, v] : own) {
    if (!same) break;
    const std::string key(name);  // the instance's own label names are short: no allocation
    auto it = c.labels.find(key);
    same = it != c.labels.end() && it->second == v && !base.count(key);
  }
  // Built with the base UseBase holds, the slot has every base label: own labels are not base
  // labels (checked above), and the sizes add up.
  const bool base_held = base_version_ != 0 && built_with == base_version_;
  for (auto it = base.begin(); same && !base_held && it != base.end(); ++it) {
    auto mine = c.labels.find(it->first);
    same = mine != c.labels.end() && mine->second == it->second;
  }
  if (!same) {
    c.labels = base;
    for (const auto& [name, v] : own) c.labels[std::string(name)] = v;
    c.fingerprint = Fingerprint(c.labels);
  }
  built_with = base_version_;
  c.value = value;
  c.active = active;
  c.level.reset();
  c.vars.Clear();
  return c;
}

void ConditionList::UseBase(const LabelSet& base) {
  if (base_version_ != 0 && base == base_) return;
  base_ = base;
  ++base_version_;
}

ConditionVars::Entry& ConditionVars::Slot(std::string_view key) {
  // Each use of a slot sets the same keys in the same order: the next entry is the one.
  if (size_ < entries_.size() && entries_[size_].key == key) return entries_[size_++];
  for (size_t i = 0; i < size_; ++i) {
    if (entries_[i].key == key) return entries_[i];  // set again
  }
  size_t at = size_;
  while (at < entries_.size() && entries_[at].key != key) ++at;
  if (at == entries_.size()) entries_.emplace_back().key = key;
  std::swap(entries_[size_], entries_[at]);
  return entries_[size_++];
}

void ConditionVars::SetText(std::string_view key, std::string_view text) {
  Entry& e = Slot(key);
  e.as = As::kText;
  e.text.assign(text);
}

void ConditionVars::SetNumber(std::string_view key, As as, double number, uint64_t integer) {
  Entry& e = Slot(key);
  e.as = as;
  e.number = number;
  e.integer = integer;
}

void ConditionVars::FormatTo(const Entry& e, std::string& out) {
  switch (e.as) {
    case As::kText: out.assign(e.text); break;
    case As::kNumber: FormatNumberTo(out, e.number); break;
    case As::kStep: FormatStepTo(out, e.integer); break;
    case As::kCount: FormatCountTo(out, e.number); break;
    case As::kPercent: FormatPercentTo(out, e.number); break;
    case As::kInteger: {
      char buf[24];
      const auto end = std::to_chars(buf, buf + sizeof(buf), e.integer).ptr;
      out.assign(buf, static_cast<size_t>(end - buf));
      break;
    }
  }
}

TemplateVars ConditionVars::Format() const {
  TemplateVars out;
  for (size_t i = 0; i < size_; ++i) FormatTo(entries_[i], out[std::string(entries_[i].key)]);
  return out;
}

std::string ConditionVars::at(std::string_view key) const {
  for (size_t i = 0; i < size_; ++i) {
    if (entries_[i].key != key) continue;
    std::string out;
    FormatTo(entries_[i], out);
    return out;
  }
  throw std::out_of_range("no template variable '" + std::string(key) + "'");
}

namespace {

void EvaluateRemediation(const Rule& rule, const RunFacts& facts, const LabelSet& base, ConditionList& out) {
  for (const RemediationFact& r : facts.remediations) {
    if (!rule.param.empty() && !GlobMatches(rule.param, r.param)) continue;
    if (!(r.projected_norm > 0) || !std::isfinite(r.projected_norm) || facts.step < r.step) continue;
    const double departure = std::fabs(r.actual_norm - r.projected_norm) / r.projected_norm;  // NaN: unknown
    const uint64_t elapsed = facts.step - r.step;
    // Judged once the approach had time to show: never when it has no time constant (no decay).
    const bool judged = static_cast<double>(elapsed) >= rule.after_time_constants * r.time_constant_steps;
    char step_label[24];
    const auto [end, ec] = std::to_chars(step_label, step_label + sizeof(step_label), r.step);
    Condition& c = Make(out, rule, base,
                        {{"param", r.param}, {"remediation_step", std::string_view(step_label, end - step_label)}},
                        facts, departure, judged && departure > rule.max_departure);
    c.level = PlainLevel(CompareOp::kGt, rule.max_departure, rule.clear_below, departure, judged);
    c.level->percent = true;
    // Which path the norm follows: the projected one, or the one it had without the change.
    const bool unchanged_nearer =
        std::fabs(r.actual_norm - r.unchanged_norm) < std::fabs(r.actual_norm - r.projected_norm);
    std::string_view verdict = "working";
    std::string_view finding = "";
    if (!judged) {
      verdict = "too early";
    } else if (!(departure <= rule.max_departure)) {
      if (r.actual_norm < r.projected_norm) {
        verdict = "faster than projected";
        finding =
            "The norm falls faster than the what-if projected with the learning rate as it went: the update pushes "
            "the weight outward less than it did at the change (its radial part shrank).";
      } else if (unchanged_nearer) {
        verdict = "not working";
        finding =
            "The norm follows the path it had without the change: check that the optimizer applies the new weight "
            "decay to this parameter (its param group) and that the change reached the trainer that is running.";
      } else {
        verdict = "slower than projected";
        finding =
            "The norm falls slower than the what-if projected with the learning rate as it went: the update pushes "
            "the weight outward more than it did at the change (its radial part grew).";
      }
    }
    SetVar(c.vars, "param", r.param);
    SetVar(c.vars, "weight_decay", Number(r.weight_decay));
    SetVar(c.vars, "previous_weight_decay", Number(r.previous_weight_decay));
    SetVar(c.vars, "remediation_step", Step(r.step));
    SetVar(c.vars, "norm_at_step", Number(r.norm_at_step));
    SetVar(c.vars, "projected_norm", Number(r.projected_norm));
    SetVar(c.vars, "unchanged_norm", Number(r.unchanged_norm));
    SetVar(c.vars, "actual_norm", Number(r.actual_norm));
    SetVar(c.vars, "departure", Percent(departure));
    SetVar(c.vars, "value", Percent(departure));
    SetVar(c.vars, "max_departure", Percent(rule.max_departure));
    SetVar(c.vars, "time_constant_steps",
           std::isfinite(r.time_constant_steps) ? Count(r.time_constant_steps) : VarValue("unbounded"));
    SetVar(c.vars, "elapsed_steps", Step(elapsed));
    SetVar(c.vars, "verdict", verdict);
    SetVar(c.vars, "finding", finding);
  }
}

}  // namespace

void Evaluate(const Rule& rule, const RunFacts& facts, const LabelSet& base, const SeriesFilter* with_instance,
              ConditionList& out) {
  out.Clear();
  out.UseBase(base);
  switch (rule.kind) {
    case RuleKind::kThreshold: EvaluateThreshold(rule, facts, base, out); break;
    case RuleKind::kForecast: EvaluateForecast(rule, facts, base, out); break;
    case RuleKind::kSlopeChange: EvaluateSlopeChange(rule, facts, base, out); break;
    case RuleKind::kShare: EvaluateShare(rule, facts, base, out); break;
    case RuleKind::kGrowthWithoutDecay: EvaluateGrowth(rule, facts, base, out); break;
    case RuleKind::kNonFinite: EvaluateNonFinite(rule, facts, base, with_instance, out); break;
    case RuleKind::kStalled: EvaluateStalled(rule, facts, base, out); break;
    case RuleKind::kRunDied: EvaluateRunDied(rule, facts, base, out); break;
    case RuleKind::kRemediation: EvaluateRemediation(rule, facts, base, out); break;
  }
}

std::vector<Condition> Evaluate(const Rule& rule, const RunFacts& facts, const SeriesFilter* with_instance) {
  ConditionList list;
  Evaluate(rule, facts, BaseLabels(rule, facts), with_instance, list);
  return std::vector<Condition>(list.begin(), list.end());
}

}  // namespace gradwatch::alerts

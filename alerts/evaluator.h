// Evaluates one rule against one run's facts: which instances the rule has and whether each one's
// condition holds. Stateless and pure; `for_steps`, hysteresis and notifications belong to the
// state machine.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "alerts/facts.h"
#include "alerts/rules.h"
#include "alerts/templates.h"

namespace gradwatch::alerts {

// How the state machine judges a condition report after report (state_machine.h, "Noisy
// series"): a measure compared with a bound. Plain values (a series, a share, an amplification)
// are their own measure; an estimate with an error (a slope ratio) is judged by the end of its
// interval that is hardest to satisfy: the low end for the hold, the high end for the clearing.
// A precondition that fails (a forecast of a value already there, a norm no longer rising) sets
// both measures to the extreme that neither holds nor stays in the clear band.
// How many standard errors an estimate must clear its bound by (slope_change).
inline constexpr double kEstimateZ = 2.0;
// A forecast goes pending only once its fit holds this many reports spanning at least this
// fraction of the rule's within_steps (2,000 steps for the built-in 20,000): a line through a
// young run's first steps, or a resume's first reports, says little about the next 20,000.
inline constexpr uint64_t kForecastMinReports = 20;
inline constexpr double kForecastMinSpanFraction = 0.1;

struct LevelTest {
  CompareOp op = CompareOp::kGe;  // holds when hold_measure op bound
  double bound = 0;
  // Past the clear band when clear_measure is below it (op ≥, >) or above it (op ≤, <); without
  // one, past it when clear_measure does not hold.
  std::optional<double> clear_bound;
  double hold_measure = 0;
  double clear_measure = 0;
  // Condition::value is the measure itself, so templates show the level (the median of the
  // recent reports) as `value`, formatted as a percentage when `percent`.
  bool shows_level = true;
  bool percent = false;
};

// Whether `measure` holds / is past the clear band of `test`. NaN does neither.
bool LevelHolds(const LevelTest& test, double measure);
bool LevelPastClear(const LevelTest& test, double measure);

// A condition's template variables as the evaluator found them: text, or numbers that are
// formatted (and the map built) only when a template needs them. Most conditions are instances
// that do not hold, evaluated again at every step and never rendered.
class ConditionVars {
 public:
  enum class As : uint8_t { kText, kNumber, kStep, kCount, kPercent, kInteger };
  // Forgets what was set; the entries keep their buffers.
  void Clear() { size_ = 0; }
  // `key` is one of the evaluator's string literals, kept as a view.
  void SetText(std::string_view key, std::string_view text);
  // `number` formatted as `as` (kStep, kInteger: `integer`) when the variables are.
  void SetNumber(std::string_view key, As as, double number, uint64_t integer);
  // The variables formatted for templates.
  TemplateVars Format() const;
  // One variable formatted; throws std::out_of_range when it is not set.
  std::string at(std::string_view key) const;

 private:
  struct Entry {
    std::string_view key;
    As as = As::kText;
    std::string text;
    double number = 0;
    uint64_t integer = 0;
  };
  Entry& Slot(std::string_view key);
  static void FormatTo(const Entry& e, std::string& out);
  std::vector<Entry> entries_;  // keys unique; the first size_ are set
  size_t size_ = 0;
};

struct Condition {
  // alertname, run, the rule's labels (severity among them), the run's labels, and the
  // instance's own: `series` (threshold, forecast, slope_change, non_finite), `param` or `group`
  // (share, growth_without_decay), `event_step` and `trigger` (slope_change).
  LabelSet labels;
  uint64_t fingerprint = 0;  // Fingerprint(labels), set with them
  double value = 0;          // in the unit the rule compares: the series' value, a share, a ratio, ...
  ConditionVars vars;        // for templates (see TemplateVariablesFor); no "recommendation"
  bool active = false;
  // Set for every kind that holds (threshold, forecast, slope_change, share,
  // growth_without_decay); active == LevelHolds(*level, level->hold_measure). non_finite and
  // stalled act on each report alone.
  std::optional<LevelTest> level;
};

// One Condition per instance the rule matches in `facts` (per series matching the glob, per
// parameter passing the filters, per event, ...), active or not. An instance without data at
// this step is not returned. Per kind:
//  - threshold: every series in facts.latest matching `series`; active when value op threshold
//    (a NaN value is never active; +Inf ≥ 5 is).
//  - forecast: every forecast of a matching series at the rule's threshold; active when
//    reachable within `within_steps` (already at or above counts). value: the fitted current value.
//  - slope_change: every slope change at an event (at: event|any) and every change point
//    (at: change_point|any) of a matching series; active when the ratio is significantly at least
//    min_ratio: its low end, from the slopes' standard errors (kEstimateZ of them), reaches it.
//    value: the ratio.
//    Change points are one instance per series (their step is refined), events one per event step.
//  - share: every share passing the param/group/param_kind filters; active when ≥ min_share.
//  - growth_without_decay: every parameter passing the kind and name filters with weight decay
//    ≤ max_weight_decay; active when its norm is rising (growth reported, or a positive slope)
//    and its amplification ≥ min_amplification and/or growth ≥ min_growth. value: the
//    amplification when min_amplification is set, else the growth as a fraction.
//  - non_finite: every matching series in facts.latest and facts.nonfinite; active when NaN/±Inf.
//  - stalled: one per run; active when the run has open streams and seconds_since_last_step ≥
//    seconds. value: seconds_since_last_step.
//  - run_died: one per run; active when the run did not end cleanly, has no open stream and
//    seconds_since_activity ≥ seconds (kDefaultRunDiedSeconds when 0). value: seconds_since_activity.
//
// `with_instance`, when given, says which series of this rule and run have an alert instance: a
// non_finite rule then returns an inactive condition only for those (an inactive condition
// without an instance changes nothing), so a step costs nothing per finite series.
using SeriesFilter = std::function<bool(std::string_view series)>;
std::vector<Condition> Evaluate(const Rule& rule, const RunFacts& facts, const SeriesFilter* with_instance = nullptr);

// The conditions of one rule for one run, evaluated again at every step (AlertEngine keeps one
// per rule and run): their slots are reused, so label sets, template variables and strings keep
// their nodes and buffers, and a warm evaluation allocates nothing.
class ConditionList {
 public:
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const Condition& operator[](size_t i) const { return slots_[i]; }
  const Condition* begin() const { return slots_.data(); }
  const Condition* end() const { return slots_.data() + size_; }
  void Clear() { size_ = 0; }
  // The base labels of the Adds that follow (Evaluate calls it once per evaluation): compared
  // here with the previous evaluation's once, so that a slot built with equal ones checks only
  // its own labels in Add, not every base label again.
  void UseBase(const LabelSet& base);
  // The next slot: labels `base` plus `own` (name, value) pairs, value, active; `level` and the
  // template variables reset (their buffers kept: each kind sets the same ones in the same order).
  // `base` is the one UseBase was last given, if it was called.
  Condition& Add(const LabelSet& base, std::initializer_list<std::pair<std::string_view, std::string_view>> own,
                 double value, bool active);

  // Scratch of the evaluation, reused.
  std::vector<std::pair<const void*, size_t>> picks;
  std::vector<std::pair<std::string_view, double>> found;
  std::string scratch_text;
  std::string scratch_number;

 private:
  std::vector<Condition> slots_;
  // By slot: the base_version_ its labels were built with (0: checked label by label).
  std::vector<uint64_t> slot_base_;
  size_t size_ = 0;
  LabelSet base_;              // what UseBase was last given
  uint64_t base_version_ = 0;  // changes with base_; 0 before UseBase
};

// Evaluate into `out` (cleared first), with `base` = BaseLabels(rule, facts) computed by the caller.
void Evaluate(const Rule& rule, const RunFacts& facts, const LabelSet& base, const SeriesFilter* with_instance,
              ConditionList& out);

// Whether a growth_without_decay rule judges parameter p (its param_kind, param glob and
// max_weight_decay), and whether a share rule judges the share of parameter (name, kind): the
// selections Evaluate makes, for a reader that needs to know beforehand which parameters' fits a
// rule reads (RulesReadFits).
bool GrowthRuleSelects(const Rule& rule, const ParamInfo& p);
bool ShareRuleSelectsParam(const Rule& rule, std::string_view name, ParamKind kind);

// Marks in `norm` and `share` (by catalog index, grown to the catalog's size; marks already set
// are kept) the catalog entries from index `from` on whose per-parameter fits `rules` may read: a
// norm's slope and growth for growth_without_decay rules and, when `recommendation` (a rule's
// template shows it), for the parameters FindFinalNorm may pick; a share's slope for share rules.
void RulesReadFits(const std::vector<Rule>& rules, bool recommendation, const std::vector<ParamInfo>& catalog,
                   size_t from, std::vector<uint8_t>& norm, std::vector<uint8_t>& share);

// The labels every alert of `rule` in run `run_id` carries: run labels, the rule's labels,
// alertname and run (the last ones win).
LabelSet BaseLabels(const Rule& rule, const RunFacts& facts);

}  // namespace gradwatch::alerts

// Alert rules and their YAML files, in the shape of Prometheus rule files:
//
//   groups:
//     - name: gradwatch-contingency
//       rules:
//         - alert: GradNormContingency
//           kind: threshold
//           series: grad/norm/total
//           op: ">="            # quoted: a bare > starts a YAML block scalar
//           value: 5
//           for_steps: 10
//           clear_below: 4.5
//           labels: {severity: page}
//           annotations:
//             summary: "Total grad norm {{ value }} ≥ 5 at step {{ step }} in run {{ run }}"
//             recommendation: "{{ recommendation }}"
//
// Keys of every rule: alert (the name, unique across all files), kind, labels (severity is
// required; alertname and run are reserved), annotations (templates, see templates.h),
// for_steps, resolve_for_steps, and per kind:
//   threshold             series (key or glob, or a list), op (">=", ">", "<=", "<"; also ge, gt,
//                         le, lt), value, clear_below (with >=, >) or clear_above (with <=, <)
//   forecast              series, threshold, within_steps (holds while the value is still below)
//   slope_change          series, min_ratio, at (event | change_point | any; default event),
//                         clear_below
//   share                 one or more of param (name or glob, "*" any), group (name or glob),
//                         param_kind (norm_gain, output, ...); min_share (a fraction, 0.9 = 90%),
//                         clear_below
//   growth_without_decay  param_kind, param (glob), min_amplification and/or min_growth (a
//                         fraction: 0.05 = the norm grew 5% over the analytics window),
//                         max_weight_decay (default 0), clear_below
//   non_finite            series (default: every grad, param and update norm, train/loss and
//                         train/nan_iterations); a value that is NaN or ±Inf, or a count of
//                         iterations that met one (train/nan_iterations, train/skipped_iterations)
//                         above 0; fires at once, so no for_steps
//   stalled               seconds (a number, or "90s", "10m", "1h"); evaluated on a timer, so no
//                         for_steps or resolve_for_steps
//   run_died              seconds (optional: the daemon's runs.stalled_after_seconds when absent);
//                         a run with no open stream that said no Goodbye and showed no sign of life
//                         for that long. Evaluated on a timer; fires at once, resolves when the run
//                         comes back (a stream attaches, a step arrives), not when the run ends.
//   remediation           param (glob, optional), max_departure (a fraction: 0.25 = the norm is
//                         25% off), after_time_constants (default 0.5), clear_below: a catalog
//                         change that raised a parameter's weight decay, whose norm departs from
//                         the what-if made at the change by more than max_departure once
//                         after_time_constants of its time constants have passed.
//
// Loading never throws. Errors read "file:line: rule 'name': what is wrong", one per line, all of
// them at once.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "server/core/status.h"
#include "server/core/types.h"

namespace gradwatch::alerts {

enum class RuleKind : int {
  kThreshold = 0,
  kForecast,
  kSlopeChange,
  kShare,
  kGrowthWithoutDecay,
  kNonFinite,
  kStalled,
  kRunDied,
  kRemediation,
};
// Timer rules (stalled, run_died) are evaluated on the daemon's timer, not on steps.
bool IsTimerRule(RuleKind kind);
std::string_view RuleKindName(RuleKind kind);  // "threshold", "forecast", ...
std::optional<RuleKind> ParseRuleKind(std::string_view name);

enum class CompareOp : int { kGe = 0, kGt, kLe, kLt };
std::string_view CompareOpSymbol(CompareOp op);          // ">=", ">", "<=", "<"
bool Compare(double value, CompareOp op, double bound);  // false when value is NaN
// True for >= and >: the alert is for a value rising to its bound.
bool IsUpward(CompareOp op);
// A label name as Prometheus allows it: [a-zA-Z_][a-zA-Z0-9_]*.
bool IsLabelName(std::string_view name);

enum class SlopeChangeAt : int { kEvent = 0, kChangePoint, kAny };

// The series a non_finite rule watches when it names none.
const std::vector<std::string>& DefaultNonFiniteSeries();

struct Rule {
  std::string name;
  RuleKind kind = RuleKind::kThreshold;

  // threshold, forecast, slope_change, non_finite: series keys or globs (`*` any run of
  // characters, `?` one character).
  std::vector<std::string> series;

  // threshold
  CompareOp op = CompareOp::kGe;
  double value = 0;

  // forecast: the threshold must be one the daemon forecasts (analytics forecasts).
  double threshold = 0;
  uint64_t within_steps = 0;

  // slope_change
  double min_ratio = 0;
  SlopeChangeAt at = SlopeChangeAt::kEvent;

  // share, growth_without_decay: filters on the parameter (name glob, group glob, kind). An
  // empty glob matches nothing of its own sort; see rules.cc for how they combine.
  std::string param;
  std::string group;
  std::optional<ParamKind> param_kind;
  double min_share = 0;

  // growth_without_decay
  std::optional<double> min_amplification;
  std::optional<double> min_growth;
  double max_weight_decay = 0;

  // stalled, run_died (0 for run_died: the daemon's runs.stalled_after_seconds, else
  // kDefaultRunDiedSeconds)
  double stalled_seconds = 0;

  // remediation (and `param`)
  double max_departure = 0;
  double after_time_constants = 0.5;

  // Pending until the condition has held for this many steps (see state_machine.h).
  uint64_t for_steps = 0;
  // Hysteresis: a firing alert stays firing while its value has not crossed the clear bound
  // (below clear_below / above clear_above), and resolves only once the condition has stopped
  // holding for resolve_for_steps steps.
  std::optional<double> clear_below;
  std::optional<double> clear_above;
  uint64_t resolve_for_steps = 0;

  LabelSet labels;         // severity among them
  LabelSet annotations;    // templates
  std::string source;      // "file:line" of the rule (", overridden at file:line" when an override changed it)
  std::string definition;  // the rule as YAML, what an override (ApplyOverrides) is merged into
  bool operator==(const Rule&) const = default;
};

// A run_died rule without `seconds` outside the daemon waits this long (seconds).
inline constexpr double kDefaultRunDiedSeconds = 600;

// The template variables a rule of `kind` provides (besides labels.<name>).
const std::set<std::string>& TemplateVariablesFor(RuleKind kind);

// Parses a rules file. source_name is used in error messages ("alerts/rules/default.yaml").
StatusOr<std::vector<Rule>> LoadRules(const std::string& yaml_text, const std::string& source_name);
// Reads and parses one file; IoError when it cannot be read.
StatusOr<std::vector<Rule>> LoadRuleFile(const std::string& path);
// Several files in order, rule names unique across all of them.
StatusOr<std::vector<Rule>> LoadRuleFiles(const std::vector<std::string>& paths);
// For `gradwatch rules check`: OK, or every error in every file.
Status CheckRuleFiles(const std::vector<std::string>& paths);

// A team's change to a rule in force, by the rule's name: the daemon's `alerts.overrides`, so
// that tuning a built-in rule (the contingency at 3 rather than 5) needs no copy of it. Any rule
// key but `alert` and `kind` is replaced; `labels` and `annotations` are merged key by key.
struct RuleOverride {
  std::string rule;    // the name of the rule it changes
  std::string yaml;    // a YAML mapping of rule keys
  std::string source;  // "gradwatchd.yaml:40", for errors and Rule::source
  bool operator==(const RuleOverride&) const = default;
};

// Applies `overrides` in order to `rules` (the rules in force, of any origin). Each overridden
// rule is checked again as a whole, so an override can break nothing a rules file could not:
// InvalidArgument naming the override's source and the rule (an unknown rule name, with the
// closest one; a change of `alert` or `kind`; any error of the merged rule), `rules` unchanged.
Status ApplyOverrides(std::vector<Rule>& rules, const std::vector<RuleOverride>& overrides);

// The rules a daemon puts in force: the built-in ones (when default_rules), those of `files` (a
// rule named like a built-in one is refused), then `overrides` applied. The built-in
// GradNormForecast warns of the built-in page's crossing: it follows an override of
// GradNormContingency's threshold unless it is overridden itself.
StatusOr<std::vector<Rule>> LoadRulesInForce(bool default_rules, const std::vector<std::string>& files,
                                             const std::vector<RuleOverride>& overrides);

// What a daemon configuration's `alerts:` section says about rules, read from its YAML text (for
// `gradwatch rules check --config`, which must load rules as the daemon would, and the daemon's
// own configuration): default_rules, rule_files and overrides. Keys it does not read are not
// checked here (the daemon's configuration check does that).
struct AlertsSection {
  bool default_rules = true;
  std::vector<std::string> rule_files;
  std::vector<RuleOverride> overrides;
};
StatusOr<AlertsSection> ReadAlertsSection(const std::string& config_yaml, const std::string& source_name);

// The rules shipped in alerts/rules/default.yaml, compiled into the library, and their text.
inline constexpr std::string_view kDefaultRulesSource = "alerts/rules/default.yaml";
std::string_view DefaultRulesYaml();
StatusOr<std::vector<Rule>> LoadDefaultRules();

}  // namespace gradwatch::alerts

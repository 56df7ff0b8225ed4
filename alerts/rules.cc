#include "alerts/rules.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

#include "alerts/rule_parser.h"
#include "alerts/yaml_checks.h"
#include "server/core/file_text.h"
#include "server/core/suggest.h"

namespace gradwatch::alerts {

std::string_view RuleKindName(RuleKind kind) {
  switch (kind) {
    case RuleKind::kThreshold: return "threshold";
    case RuleKind::kForecast: return "forecast";
    case RuleKind::kSlopeChange: return "slope_change";
    case RuleKind::kShare: return "share";
    case RuleKind::kGrowthWithoutDecay: return "growth_without_decay";
    case RuleKind::kNonFinite: return "non_finite";
    case RuleKind::kStalled: return "stalled";
    case RuleKind::kRunDied: return "run_died";
    case RuleKind::kRemediation: return "remediation";
  }
  return "threshold";
}

bool IsTimerRule(RuleKind kind) { return kind == RuleKind::kStalled || kind == RuleKind::kRunDied; }

std::optional<RuleKind> ParseRuleKind(std::string_view name) {
  for (RuleKind k : {RuleKind::kThreshold, RuleKind::kForecast, RuleKind::kSlopeChange, RuleKind::kShare,
                     RuleKind::kGrowthWithoutDecay, RuleKind::kNonFinite, RuleKind::kStalled, RuleKind::kRunDied,
                     RuleKind::kRemediation}) {
    if (RuleKindName(k) == name) return k;
  }
  return std::nullopt;
}

std::string_view CompareOpSymbol(CompareOp op) {
  switch (op) {
    case CompareOp::kGe: return ">=";
    case CompareOp::kGt: return ">";
    case CompareOp::kLe: return "<=";
    case CompareOp::kLt: return "<";
  }
  return ">=";
}

bool Compare(double value, CompareOp op, double bound) {
  switch (op) {
    case CompareOp::kGe: return value >= bound;
    case CompareOp::kGt: return value > bound;
    case CompareOp::kLe: return value <= bound;
    case CompareOp::kLt: return value < bound;
  }
  return false;
}

bool IsUpward(CompareOp op) { return op == CompareOp::kGe || op == CompareOp::kGt; }

bool IsLabelName(std::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (!letter && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

const std::vector<std::string>& DefaultNonFiniteSeries() {
  static const std::vector<std::string> kSeries = {
      std::string(keys::kGradNormPrefix) + "*", std::string(keys::kParamNormPrefix) + "*",
      std::string(keys::kUpdateNormPrefix) + "*", std::string(keys::kLoss), std::string(keys::kNanIterations)};
  return kSeries;
}

const std::set<std::string>& TemplateVariablesFor(RuleKind kind) {
  static const std::map<RuleKind, std::set<std::string>> kVars = [] {
    const std::set<std::string> common = {"value",       "step",       "run",       "recommendation",
                                          "diagnosis",   "cause",      "for_steps", "resolve_for_steps",
                                          "clear_below", "clear_above"};
    const std::map<RuleKind, std::set<std::string>> own = {
        {RuleKind::kThreshold, {"series", "threshold", "op", "page_held"}},
        {RuleKind::kForecast,
         {"series", "threshold", "steps_to_threshold", "at_step", "within_steps", "slope", "current", "outlook"}},
        {RuleKind::kSlopeChange,
         {"series", "ratio", "min_ratio", "slope_before", "slope_after", "event", "event_step", "at_step"}},
        {RuleKind::kShare, {"param", "share", "min_share", "slope"}},
        {RuleKind::kGrowthWithoutDecay,
         {"param", "amplification", "growth", "norm", "init_norm", "slope", "weight_decay", "min_amplification",
          "min_growth"}},
        {RuleKind::kNonFinite, {"series"}},
        {RuleKind::kStalled, {"seconds", "threshold", "open_streams"}},
        {RuleKind::kRunDied, {"seconds", "threshold"}},
        {RuleKind::kRemediation,
         {"param", "weight_decay", "previous_weight_decay", "remediation_step", "norm_at_step", "projected_norm",
          "unchanged_norm", "actual_norm", "departure", "max_departure", "time_constant_steps", "elapsed_steps",
          "verdict", "finding"}},
    };
    std::map<RuleKind, std::set<std::string>> all;
    for (const auto& [k, names] : own) {
      all[k] = common;
      all[k].insert(names.begin(), names.end());
    }
    return all;
  }();
  return kVars.at(kind);
}

namespace {

using rule_parsing::Line;
using rule_parsing::ParseOrError;
using rule_parsing::Parser;
using rule_parsing::Shown;

std::string Join(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return Status::IoError(path + ": is a directory, not a rules file");
  if (!std::filesystem::exists(path, ec)) return Status::IoError(path + ": cannot read rules file: no such file");
  auto text = ReadRegularFile("rules file", path);  // a FIFO or a device is refused, not waited on
  if (!text.ok()) return Status::IoError(path + ": cannot read rules file (" + text.status().message() + ")");
  return text;
}

}  // namespace

StatusOr<std::vector<Rule>> LoadRules(const std::string& yaml_text, const std::string& source_name) {
  std::vector<std::string> errors;
  auto rules = ParseOrError(yaml_text, source_name, &errors);
  if (!errors.empty()) return Status::InvalidArgument(Join(errors));
  return rules;
}

StatusOr<std::vector<Rule>> LoadRuleFile(const std::string& path) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  return LoadRules(*text, path);
}

StatusOr<std::vector<Rule>> LoadRuleFiles(const std::vector<std::string>& paths) {
  std::vector<Rule> all;
  std::vector<std::string> errors;
  std::map<std::string, std::string> first_source;
  bool io_error = false;
  for (const std::string& path : paths) {
    auto text = ReadFile(path);
    if (!text.ok()) {
      errors.push_back(text.status().message());
      io_error = true;
      continue;
    }
    auto rules = ParseOrError(*text, path, &errors);
    if (!rules.ok()) continue;
    for (Rule& rule : *rules) {
      auto [it, inserted] = first_source.emplace(rule.name, rule.source);
      if (!inserted) {
        errors.push_back(rule.source + ": rule '" + rule.name + "': duplicate rule name (first defined at " +
                         it->second + ")");
        continue;
      }
      all.push_back(std::move(rule));
    }
  }
  if (!errors.empty()) {
    return io_error && errors.size() == 1 ? Status::IoError(errors.front()) : Status::InvalidArgument(Join(errors));
  }
  return all;
}

Status CheckRuleFiles(const std::vector<std::string>& paths) {
  auto rules = LoadRuleFiles(paths);
  return rules.ok() ? Status::Ok() : rules.status();
}

Status ApplyOverrides(std::vector<Rule>& rules, const std::vector<RuleOverride>& overrides) {
  std::vector<Rule> out = rules;
  for (const RuleOverride& o : overrides) {
    const std::string where = o.source + ": alerts.overrides." + o.rule + ": ";
    auto it = std::find_if(out.begin(), out.end(), [&](const Rule& r) { return r.name == o.rule; });
    if (it == out.end()) {
      std::vector<std::string> names;
      for (const Rule& r : out) names.push_back(r.name);
      const std::optional<std::string> closest = Closest(o.rule, names);
      return Status::InvalidArgument(where + "no rule of that name is in force" +
                                     (closest ? " (did you mean '" + *closest + "'?)" : ""));
    }
    YAML::Node change, merged;
    try {
      change = YAML::Load(o.yaml);
      merged = YAML::Load(it->definition);
    } catch (const YAML::Exception& e) {
      return Status::InvalidArgument(where + "invalid YAML: " + e.msg);
    }
    if (!change.IsMap()) return Status::InvalidArgument(where + "must be a mapping of rule keys, got " + Shown(change));
    // A hold bound changed alone takes its clear bound along in proportion (the contingency's 4.5
    // for 5 becomes 2.7 for 3), so that tuning one number needs one key.
    const Rule& old = *it;
    const auto hold = [&]() -> std::pair<const char*, double> {
      switch (old.kind) {
        case RuleKind::kThreshold: return {"value", old.value};
        case RuleKind::kShare: return {"min_share", old.min_share};
        case RuleKind::kGrowthWithoutDecay: return {"min_amplification", old.min_amplification.value_or(0)};
        case RuleKind::kSlopeChange: return {"min_ratio", old.min_ratio};
        case RuleKind::kRemediation: return {"max_departure", old.max_departure};
        default: return {nullptr, 0};
      }
    }();
    if (hold.first && hold.second != 0 && change[hold.first] && change[hold.first].IsScalar() &&
        !change["clear_below"] && !change["clear_above"]) {
      char* end = nullptr;
      const std::string text = change[hold.first].Scalar();
      const double now = std::strtod(text.c_str(), &end);
      if (end != text.c_str() && *end == '\0' && std::isfinite(now)) {
        if (old.clear_below) merged["clear_below"] = *old.clear_below * now / hold.second;
        if (old.clear_above) merged["clear_above"] = *old.clear_above * now / hold.second;
      }
    }
    for (const auto& kv : change) {
      const std::string key = kv.first.Scalar();
      if (key == "alert" || key == "kind") {
        return Status::InvalidArgument(where + "'" + key +
                                       "' cannot be overridden: write a rule of your own (alerts.rule_files)");
      }
      if ((key == "labels" || key == "annotations") && kv.second.IsMap() && merged[key] && merged[key].IsMap()) {
        for (const auto& entry : kv.second) merged[key][entry.first.Scalar()] = entry.second;
      } else {
        merged[key] = kv.second;
      }
    }
    Parser parser(o.source);
    YAML::Node root;
    root["groups"].push_back(YAML::Node());
    root["groups"][0]["name"] = "overrides";
    root["groups"][0]["rules"].push_back(merged);
    std::vector<Rule> parsed;
    try {
      parsed = parser.Parse(root);
    } catch (const std::exception& e) {
      return Status::InvalidArgument(where + e.what());
    }
    if (!parser.errors().empty() || parsed.size() != 1) {
      // The merged rule's lines are not the file's: say where the override is, and what is wrong.
      std::string what = parser.errors().empty() ? "invalid rule" : parser.errors().front();
      if (const size_t rule_at = what.find("rule '"); rule_at != std::string::npos) {
        const size_t colon = what.find("': ", rule_at);
        if (colon != std::string::npos) what = what.substr(colon + 3);
      }
      return Status::InvalidArgument(where + what);
    }
    Rule& rule = parsed.front();
    rule.source = it->source.substr(0, it->source.find(", overridden at")) + ", overridden at " + o.source;
    *it = std::move(rule);
  }
  rules = std::move(out);
  return Status::Ok();
}

StatusOr<std::vector<Rule>> LoadRulesInForce(bool default_rules, const std::vector<std::string>& files,
                                             const std::vector<RuleOverride>& overrides) {
  std::vector<Rule> rules;
  if (default_rules) {
    auto defaults = LoadDefaultRules();
    if (!defaults.ok()) return Status(defaults.status().code(), "built-in rules: " + defaults.status().message());
    rules = std::move(defaults).value();
  }
  if (!files.empty()) {
    auto loaded = LoadRuleFiles(files);
    if (!loaded.ok()) return loaded.status();
    std::set<std::string> names;
    for (const Rule& r : rules) names.insert(r.name);
    for (Rule& r : loaded.value()) {
      if (!names.insert(r.name).second) {
        return Status::InvalidArgument(
            r.source + ": rule '" + r.name +
            "' has the name of a built-in rule; rename it or set alerts.default_rules: false");
      }
      rules.push_back(std::move(r));
    }
  }
  if (Status s = ApplyOverrides(rules, overrides); !s.ok()) return s;
  const auto built_in = [&](const char* name, RuleKind kind) -> Rule* {
    for (Rule& r : rules) {
      if (r.name == name && r.kind == kind && r.source.rfind(kDefaultRulesSource, 0) == 0) return &r;
    }
    return nullptr;
  };
  Rule* page = built_in("GradNormContingency", RuleKind::kThreshold);
  Rule* forecast = built_in("GradNormForecast", RuleKind::kForecast);
  const bool forecast_overridden = std::any_of(overrides.begin(), overrides.end(),
                                               [](const RuleOverride& o) { return o.rule == "GradNormForecast"; });
  if (page && forecast && !forecast_overridden) forecast->threshold = page->value;
  return rules;
}

StatusOr<AlertsSection> ReadAlertsSection(const std::string& config_yaml, const std::string& source_name) {
  AlertsSection section;
  YAML::Node root;
  try {
    root = YAML::Load(config_yaml);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source_name + ":" + Line(e.mark) + ": invalid YAML: " + e.msg);
  }
  if (!root.IsMap() || !root["alerts"] || root["alerts"].IsNull()) return section;
  const YAML::Node alerts = root["alerts"];
  if (!alerts.IsMap())
    return Status::InvalidArgument(source_name + ":" + Line(alerts.Mark()) + ": alerts must be a mapping");
  try {
    if (const YAML::Node d = alerts["default_rules"]) section.default_rules = d.as<bool>();
    if (const YAML::Node files = alerts["rule_files"]; files && !files.IsNull()) {
      section.rule_files = files.as<std::vector<std::string>>();
    }
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source_name + ":" + Line(e.mark) + ": alerts: " + e.msg);
  }
  const YAML::Node overrides = alerts["overrides"];
  if (!overrides || overrides.IsNull()) return section;
  if (!overrides.IsMap()) {
    return Status::InvalidArgument(source_name + ":" + Line(overrides.Mark()) +
                                   ": alerts.overrides must be a mapping of rule names to rule keys");
  }
  for (const auto& kv : overrides) {
    const std::string where = source_name + ":" + Line(kv.first.Mark());
    if (!kv.first.IsScalar() || kv.first.Scalar().empty()) {
      return Status::InvalidArgument(where + ": alerts.overrides: a rule name is expected");
    }
    if (!kv.second.IsMap()) {
      return Status::InvalidArgument(where + ": alerts.overrides." + kv.first.Scalar() +
                                     ": must be a mapping of rule keys (value, clear_below, labels, ...), got " +
                                     Shown(kv.second));
    }
    YAML::Emitter emitter;
    emitter << kv.second;
    section.overrides.push_back({kv.first.Scalar(), emitter.c_str(), where});
  }
  return section;
}

StatusOr<std::vector<Rule>> LoadDefaultRules() {
  return LoadRules(std::string(DefaultRulesYaml()), std::string(kDefaultRulesSource));
}

}  // namespace gradwatch::alerts

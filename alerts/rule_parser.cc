#include "alerts/rule_parser.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <set>
#include <sstream>
#include <utility>

#include "alerts/templates.h"
#include "alerts/yaml_checks.h"
#include "server/core/suggest.h"

namespace gradwatch::alerts::rule_parsing {

namespace {

// Keys every rule may have, and those of each kind.
const std::set<std::string>& CommonKeys() {
  static const std::set<std::string> k = {
      "alert", "kind", "labels", "annotations", "for_steps", "resolve_for_steps", "clear_below", "clear_above"};
  return k;
}

const std::set<std::string>& KindKeys(RuleKind kind) {
  static const std::map<RuleKind, std::set<std::string>> k = {
      {RuleKind::kThreshold, {"series", "op", "value"}},
      {RuleKind::kForecast, {"series", "threshold", "within_steps"}},
      {RuleKind::kSlopeChange, {"series", "min_ratio", "at"}},
      {RuleKind::kShare, {"param", "group", "param_kind", "min_share"}},
      {RuleKind::kGrowthWithoutDecay, {"param", "param_kind", "min_amplification", "min_growth", "max_weight_decay"}},
      {RuleKind::kNonFinite, {"series"}},
      {RuleKind::kStalled, {"seconds"}},
      {RuleKind::kRunDied, {"seconds"}},
      {RuleKind::kRemediation, {"param", "max_departure", "after_time_constants"}},
  };
  return k.at(kind);
}

bool IsKnownKey(const std::string& key) {
  if (CommonKeys().count(key)) return true;
  for (int k = 0; k <= static_cast<int>(RuleKind::kRemediation); ++k) {
    if (KindKeys(static_cast<RuleKind>(k)).count(key)) return true;
  }
  return false;
}

std::string Quote(const std::string& s) { return "'" + s + "'"; }

}  // namespace

std::string Line(const YAML::Mark& mark) {
  return mark.is_null() || mark.line < 0 ? "?" : std::to_string(mark.line + 1);
}

std::string Shown(const YAML::Node& node) {
  if (node.IsScalar()) return Quote(node.Scalar());
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a map";
  return "nothing";
}

std::optional<std::string> Parser::String(const YAML::Node& node, const std::string& key) {
  if (!node.IsScalar() || node.Scalar().empty()) {
    Error(node.Mark(), key + " must be a non-empty string, got " + Shown(node));
    return std::nullopt;
  }
  return node.Scalar();
}

std::optional<double> Parser::Number(const YAML::Node& node, const std::string& key) {
  if (node.IsScalar()) {
    const std::string& s = node.Scalar();
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size() && errno == 0 && std::isfinite(v)) return v;
  }
  Error(node.Mark(), key + " must be a finite number, got " + Shown(node));
  return std::nullopt;
}

std::optional<uint64_t> Parser::Steps(const YAML::Node& node, const std::string& key) {
  if (node.IsScalar()) {
    const std::string& s = node.Scalar();
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size() && errno == 0 && v >= 0 && v < 9.2e18 && v == std::floor(v)) {
      return static_cast<uint64_t>(v);
    }
  }
  Error(node.Mark(), key + " must be a whole number of steps ≥ 0, got " + Shown(node));
  return std::nullopt;
}

std::optional<double> Parser::Seconds(const YAML::Node& node, const std::string& key) {
  if (node.IsScalar() && !node.Scalar().empty()) {
    std::string s = node.Scalar();
    double unit = 1;
    switch (s.back()) {
      case 's':
        unit = 1;
        s.pop_back();
        break;
      case 'm':
        unit = 60;
        s.pop_back();
        break;
      case 'h':
        unit = 3600;
        s.pop_back();
        break;
      case 'd':
        unit = 86400;
        s.pop_back();
        break;
      default: break;
    }
    char* end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size() && errno == 0 && std::isfinite(v) && v > 0) {
      return v * unit;
    }
  }
  Error(node.Mark(), key + " must be a positive duration (600, \"90s\", \"10m\", \"1h\"), got " + Shown(node));
  return std::nullopt;
}

std::optional<std::vector<std::string>> Parser::Patterns(const YAML::Node& node, const std::string& key) {
  std::vector<std::string> out;
  if (node.IsScalar() && !node.Scalar().empty()) {
    out.push_back(node.Scalar());
    return out;
  }
  if (node.IsSequence() && node.size() > 0) {
    for (const YAML::Node& item : node) {
      if (!item.IsScalar() || item.Scalar().empty()) {
        Error(item.Mark(), key + " entries must be non-empty strings, got " + Shown(item));
        return std::nullopt;
      }
      out.push_back(item.Scalar());
    }
    return out;
  }
  Error(node.Mark(), key + " must be a series key or glob, or a list of them, got " + Shown(node));
  return std::nullopt;
}

std::optional<LabelSet> Parser::StringMap(const YAML::Node& node, const std::string& key) {
  if (!node.IsMap()) {
    Error(node.Mark(), key + " must be a map of names to strings, got " + Shown(node));
    return std::nullopt;
  }
  LabelSet out;
  bool ok = true;
  for (const auto& kv : node) {
    const std::string name = kv.first.Scalar();
    if (!IsLabelName(name)) {
      Error(kv.first.Mark(), key + ": bad name " + Quote(name) + " (letters, digits and _)");
      ok = false;
      continue;
    }
    if (!kv.second.IsScalar()) {
      Error(kv.second.Mark(), key + "." + name + " must be a string, got " + Shown(kv.second));
      ok = false;
      continue;
    }
    if (!out.emplace(name, kv.second.Scalar()).second) {
      Error(kv.first.Mark(), key + ": duplicate name " + Quote(name));
      ok = false;
    }
  }
  if (!ok) return std::nullopt;
  return out;
}

std::vector<Rule> Parser::Parse(const YAML::Node& root) {
  std::vector<Rule> rules;
  if (!root || root.IsNull()) return rules;  // an empty file holds no rules
  if (!root.IsMap()) {
    Error(root.Mark(), "a rules file is a map with 'groups', got " + Shown(root));
    return rules;
  }
  YAML::Node groups;
  for (const auto& kv : root) {
    const std::string key = kv.first.Scalar();
    if (key == "groups") {
      groups = kv.second;
    } else {
      Error(kv.first.Mark(), "unknown top-level key " + Quote(key) + " (expected 'groups')");
    }
  }
  if (!groups) {
    Error(root.Mark(), "missing 'groups'");
    return rules;
  }
  if (groups.IsNull()) return rules;
  if (!groups.IsSequence()) {
    Error(groups.Mark(), "groups must be a list, got " + Shown(groups));
    return rules;
  }
  for (const YAML::Node& group : groups) ParseGroup(group, &rules);
  return rules;
}

void Parser::ParseGroup(const YAML::Node& group, std::vector<Rule>* rules) {
  context_.clear();
  if (!group.IsMap()) {
    Error(group.Mark(), "a group must be a map with 'name' and 'rules', got " + Shown(group));
    return;
  }
  const YAML::Node name = group["name"];
  const std::string group_name = name && name.IsScalar() ? name.Scalar() : "";
  context_ = "group " + Quote(group_name) + ": ";
  if (group_name.empty()) Error(group.Mark(), "missing 'name'");
  YAML::Node list;
  for (const auto& kv : group) {
    const std::string key = kv.first.Scalar();
    if (key == "rules") {
      list = kv.second;
    } else if (key != "name") {
      Error(kv.first.Mark(), "unknown key " + Quote(key) + " (a group has 'name' and 'rules')");
    }
  }
  if (!list) {
    Error(group.Mark(), "missing 'rules'");
  } else if (!list.IsNull() && !list.IsSequence()) {
    Error(list.Mark(), "rules must be a list, got " + Shown(list));
  } else if (list.IsSequence()) {
    for (const YAML::Node& node : list) {
      if (auto rule = ParseRule(node)) rules->push_back(std::move(*rule));
    }
  }
  context_.clear();
}

std::optional<Rule> Parser::ParseRule(const YAML::Node& node) {
  const size_t errors_before = errors_.size();
  if (!node.IsMap()) {
    context_.clear();
    Error(node.Mark(), "a rule must be a map, got " + Shown(node));
    return std::nullopt;
  }
  Rule rule;
  const YAML::Mark at = node.Mark();
  rule.source = source_ + ":" + Line(at);
  {
    YAML::Emitter emitter;
    emitter << node;
    rule.definition = emitter.c_str();
  }

  const YAML::Node alert = node["alert"];
  rule.name = alert && alert.IsScalar() ? alert.Scalar() : "";
  context_ = "rule " + Quote(rule.name) + ": ";
  if (!alert) {
    Error(at, "missing 'alert' (the rule's name)");
  } else if (rule.name.empty()) {
    Error(alert.Mark(), "alert must be a non-empty name, got " + Shown(alert));
  } else if (auto [it, inserted] = rule_lines_.emplace(rule.name, rule.source); !inserted) {
    Error(alert.Mark(), "duplicate rule name (first defined at " + it->second + ")");
  }

  const YAML::Node kind_node = node["kind"];
  std::optional<RuleKind> kind;
  if (!kind_node) {
    Error(at,
          "missing 'kind' (threshold, forecast, slope_change, share, growth_without_decay, "
          "non_finite, stalled, run_died or remediation)");
  } else if (!kind_node.IsScalar() || !(kind = ParseRuleKind(kind_node.Scalar()))) {
    Error(kind_node.Mark(), "unknown kind " + Shown(kind_node) +
                                " (threshold, forecast, slope_change, share, "
                                "growth_without_decay, non_finite, stalled, run_died or remediation)");
  }
  if (!kind) return std::nullopt;  // every other key depends on the kind
  rule.kind = *kind;
  const std::string kind_name(RuleKindName(rule.kind));

  // Which keys were given, and where.
  std::map<std::string, YAML::Node> given;
  for (const auto& kv : node) {
    const std::string key = kv.first.Scalar();
    if (!given.emplace(key, kv.second).second) {
      Error(kv.first.Mark(), "duplicate key " + Quote(key));
      continue;
    }
    if (!IsKnownKey(key)) {
      Error(kv.first.Mark(), "unknown key " + Quote(key));
    } else if (!CommonKeys().count(key) && !KindKeys(rule.kind).count(key)) {
      Error(kv.first.Mark(), "key " + Quote(key) + " does not apply to kind " + kind_name);
    }
  }
  auto has = [&](const std::string& key) { return given.count(key) > 0; };
  auto get = [&](const std::string& key) { return given.at(key); };
  auto require = [&](const std::string& key) {
    if (!has(key)) Error(at, "missing '" + key + "' (required by kind " + kind_name + ")");
    return has(key);
  };

  if (has("for_steps")) {
    if (rule.kind == RuleKind::kNonFinite || IsTimerRule(rule.kind)) {
      Error(get("for_steps").Mark(),
            "for_steps does not apply to kind " + kind_name +
                (rule.kind == RuleKind::kNonFinite ? ": it fires at once"
                                                   : ": use 'seconds' for how long a run may be silent"));
    } else if (auto v = Steps(get("for_steps"), "for_steps")) {
      rule.for_steps = *v;
    }
  }
  if (has("resolve_for_steps")) {
    if (IsTimerRule(rule.kind)) {
      Error(get("resolve_for_steps").Mark(),
            "resolve_for_steps does not apply to kind " + kind_name +
                (rule.kind == RuleKind::kStalled ? ": it resolves when a step arrives"
                                                 : ": it resolves when the run comes back"));
    } else if (auto v = Steps(get("resolve_for_steps"), "resolve_for_steps")) {
      rule.resolve_for_steps = *v;
    }
  }
  for (const char* clear : {"clear_below", "clear_above"}) {
    if (!has(clear)) continue;
    const bool below = std::string_view(clear) == "clear_below";
    bool applies = false;
    switch (rule.kind) {
      case RuleKind::kThreshold: applies = true; break;
      case RuleKind::kSlopeChange:
      case RuleKind::kShare:
      case RuleKind::kGrowthWithoutDecay:
      case RuleKind::kRemediation: applies = below; break;
      default: applies = false;
    }
    if (!applies) {
      Error(get(clear).Mark(), std::string(clear) + " does not apply to kind " + kind_name);
    } else if (auto v = Number(get(clear), clear)) {
      (below ? rule.clear_below : rule.clear_above) = *v;
    }
  }

  bool labels_ok = true;
  if (has("labels")) {
    auto labels = StringMap(get("labels"), "labels");
    labels_ok = labels.has_value();
    if (labels) rule.labels = std::move(*labels);
  }
  for (const char* reserved : {"alertname", "run"}) {
    if (rule.labels.count(reserved)) {
      Error(get("labels").Mark(), std::string("label '") + reserved + "' is reserved: gradwatch sets it");
    }
  }
  if (labels_ok && !rule.labels.count("severity")) {
    Error(has("labels") ? get("labels").Mark() : at, "missing label 'severity' (e.g. labels: {severity: page})");
  }
  if (has("annotations")) {
    if (auto annotations = StringMap(get("annotations"), "annotations")) {
      rule.annotations = std::move(*annotations);
      const YAML::Node map = get("annotations");
      for (const auto& kv : map) {
        const std::string name = kv.first.Scalar();
        Status s = CheckTemplate(kv.second.Scalar(), TemplateVariablesFor(rule.kind));
        if (!s.ok()) Error(kv.second.Mark(), "annotation " + Quote(name) + ": " + s.message());
      }
    }
  }

  switch (rule.kind) {
    case RuleKind::kThreshold: {
      if (require("series")) {
        if (auto v = Patterns(get("series"), "series")) rule.series = std::move(*v);
      }
      if (require("op")) {
        const YAML::Node op = get("op");
        static const std::map<std::string, CompareOp> kOps = {
            {">=", CompareOp::kGe}, {">", CompareOp::kGt},  {"<=", CompareOp::kLe}, {"<", CompareOp::kLt},
            {"ge", CompareOp::kGe}, {"gt", CompareOp::kGt}, {"le", CompareOp::kLe}, {"lt", CompareOp::kLt}};
        auto it = op.IsScalar() ? kOps.find(op.Scalar()) : kOps.end();
        if (it == kOps.end()) {
          Error(op.Mark(), "bad op " + Shown(op) + " (one of \">=\", \">\", \"<=\", \"<\", quoted)");
        } else {
          rule.op = it->second;
          const bool upward = rule.op == CompareOp::kGe || rule.op == CompareOp::kGt;
          if (upward && has("clear_above")) {
            Error(get("clear_above").Mark(), "clear_above does not fit op " + op.Scalar() + ": use clear_below");
          }
          if (!upward && has("clear_below")) {
            Error(get("clear_below").Mark(), "clear_below does not fit op " + op.Scalar() + ": use clear_above");
          }
        }
      }
      if (require("value")) {
        if (auto v = Number(get("value"), "value")) rule.value = *v;
      }
      if (rule.clear_below && has("value") && *rule.clear_below > rule.value) {
        Error(get("clear_below").Mark(),
              "clear_below " + FormatNumber(*rule.clear_below) + " must not exceed value " + FormatNumber(rule.value));
      }
      if (rule.clear_above && has("value") && *rule.clear_above < rule.value) {
        Error(get("clear_above").Mark(), "clear_above " + FormatNumber(*rule.clear_above) +
                                             " must not be below value " + FormatNumber(rule.value));
      }
      break;
    }
    case RuleKind::kForecast: {
      if (require("series")) {
        if (auto v = Patterns(get("series"), "series")) rule.series = std::move(*v);
      }
      if (require("threshold")) {
        if (auto v = Number(get("threshold"), "threshold")) rule.threshold = *v;
      }
      if (require("within_steps")) {
        if (auto v = Steps(get("within_steps"), "within_steps")) {
          if (*v == 0) Error(get("within_steps").Mark(), "within_steps must be > 0");
          rule.within_steps = *v;
        }
      }
      break;
    }
    case RuleKind::kSlopeChange: {
      if (require("series")) {
        if (auto v = Patterns(get("series"), "series")) rule.series = std::move(*v);
      }
      if (require("min_ratio")) {
        if (auto v = Number(get("min_ratio"), "min_ratio")) rule.min_ratio = *v;
      }
      if (has("at")) {
        const YAML::Node a = get("at");
        const std::string s = a.IsScalar() ? a.Scalar() : "";
        if (s == "event") {
          rule.at = SlopeChangeAt::kEvent;
        } else if (s == "change_point") {
          rule.at = SlopeChangeAt::kChangePoint;
        } else if (s == "any") {
          rule.at = SlopeChangeAt::kAny;
        } else {
          Error(a.Mark(), "bad at " + Shown(a) + " (event, change_point or any)");
        }
      }
      if (rule.clear_below && has("min_ratio") && *rule.clear_below > rule.min_ratio) {
        Error(get("clear_below").Mark(), "clear_below must not exceed min_ratio");
      }
      break;
    }
    case RuleKind::kShare:
    case RuleKind::kGrowthWithoutDecay: {
      if (has("param")) {
        if (auto v = String(get("param"), "param")) rule.param = *v;
      }
      if (has("group")) {
        if (auto v = String(get("group"), "group")) rule.group = *v;
      }
      if (has("param_kind")) {
        const YAML::Node k = get("param_kind");
        std::optional<ParamKind> pk;
        if (k.IsScalar() && !k.Scalar().empty()) pk = ParseParamKind(k.Scalar());
        if (!pk) {
          Error(k.Mark(),
                "unknown param_kind " + Shown(k) + " (norm_gain, output, embedding, router, attention, mlp, other)");
        }
        rule.param_kind = pk;
      }
      if (rule.kind == RuleKind::kShare) {
        if (!has("param") && !has("group") && !has("param_kind")) {
          Error(at,
                "missing 'param', 'group' or 'param_kind' (which shares to watch; \"*\" for any "
                "parameter)");
        }
        if (require("min_share")) {
          if (auto v = Number(get("min_share"), "min_share")) {
            if (*v <= 0 || *v > 1) {
              Error(get("min_share").Mark(), "min_share is a fraction in (0, 1]: 0.9 for 90%, got " + FormatNumber(*v));
            }
            rule.min_share = *v;
          }
        }
        if (rule.clear_below && has("min_share") && *rule.clear_below > rule.min_share) {
          Error(get("clear_below").Mark(), "clear_below must not exceed min_share");
        }
      } else {
        if (has("min_amplification")) {
          if (auto v = Number(get("min_amplification"), "min_amplification")) rule.min_amplification = *v;
        }
        if (has("min_growth")) {
          if (auto v = Number(get("min_growth"), "min_growth")) rule.min_growth = *v;
        }
        if (has("max_weight_decay")) {
          if (auto v = Number(get("max_weight_decay"), "max_weight_decay")) rule.max_weight_decay = *v;
        }
        if (!has("min_amplification") && !has("min_growth")) {
          Error(at, "missing 'min_amplification' or 'min_growth'");
        }
        const std::optional<double> bound = rule.min_amplification ? rule.min_amplification : rule.min_growth;
        if (rule.clear_below && bound && *rule.clear_below > *bound) {
          Error(get("clear_below").Mark(), rule.min_amplification ? "clear_below must not exceed min_amplification"
                                                                  : "clear_below must not exceed min_growth");
        }
      }
      break;
    }
    case RuleKind::kNonFinite: {
      if (has("series")) {
        if (auto v = Patterns(get("series"), "series")) rule.series = std::move(*v);
      } else {
        rule.series = DefaultNonFiniteSeries();
      }
      break;
    }
    case RuleKind::kStalled: {
      if (require("seconds")) {
        if (auto v = Seconds(get("seconds"), "seconds")) rule.stalled_seconds = *v;
      }
      break;
    }
    case RuleKind::kRunDied: {
      if (has("seconds")) {
        if (auto v = Seconds(get("seconds"), "seconds")) rule.stalled_seconds = *v;
      }
      break;
    }
    case RuleKind::kRemediation: {
      if (has("param")) {
        if (auto v = String(get("param"), "param")) rule.param = *v;
      }
      if (require("max_departure")) {
        if (auto v = Number(get("max_departure"), "max_departure")) {
          if (!(*v > 0) || !std::isfinite(*v)) {
            Error(get("max_departure").Mark(),
                  "max_departure is a fraction above 0: 0.25 for 25% off the projection, got " + FormatNumber(*v));
          }
          rule.max_departure = *v;
        }
      }
      if (has("after_time_constants")) {
        if (auto v = Number(get("after_time_constants"), "after_time_constants")) {
          if (!(*v >= 0) || !std::isfinite(*v)) {
            Error(get("after_time_constants").Mark(),
                  "after_time_constants must be finite and ≥ 0 (time constants of the projected approach), got " +
                      FormatNumber(*v));
          }
          rule.after_time_constants = *v;
        }
      }
      if (rule.clear_below && has("max_departure") && *rule.clear_below > rule.max_departure) {
        Error(get("clear_below").Mark(), "clear_below must not exceed max_departure");
      }
      break;
    }
  }

  context_.clear();
  if (errors_.size() != errors_before) return std::nullopt;
  return rule;
}

StatusOr<std::vector<Rule>> ParseOrError(const std::string& yaml_text, const std::string& source_name,
                                         std::vector<std::string>* errors) {
  if (Status s = CheckAliasExpansion(yaml_text, source_name); !s.ok()) {
    errors->push_back(s.message());
    return s;
  }
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    errors->push_back(source_name + ":" + Line(e.mark) + ": invalid YAML: " + e.msg);
    return Status::InvalidArgument(errors->back());
  }
  Parser parser(source_name);
  std::vector<Rule> rules;
  try {
    rules = parser.Parse(root);
  } catch (const std::exception& e) {  // yaml-cpp throws on some malformed node shapes
    errors->insert(errors->end(), parser.errors().begin(), parser.errors().end());
    errors->push_back(source_name + ": invalid rules file: " + e.what());
    return Status::InvalidArgument(errors->back());
  }
  if (!parser.errors().empty()) {
    errors->insert(errors->end(), parser.errors().begin(), parser.errors().end());
    return Status::InvalidArgument(parser.errors().front());
  }
  // The parser names a rule's own repeated keys; this catches them everywhere else (labels,
  // annotations, groups), where yaml-cpp would let the last one win.
  if (Status s = CheckNoDuplicateKeys(yaml_text, source_name); !s.ok()) {
    errors->push_back(s.message());
    return s;
  }
  return rules;
}

}  // namespace gradwatch::alerts::rule_parsing

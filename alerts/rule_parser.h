// The rule files' parser, shared by the loaders and the overrides (alerts/rules.cc): it reads a
// document of groups of rules into Rules and collects every error, each with its file and line.
// Internal to alerts/; rules.h is the interface.
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "alerts/rules.h"
#include "server/core/status.h"

namespace gradwatch::alerts::rule_parsing {

// A mark's line, 1-based ("?" when unknown).
std::string Line(const YAML::Mark& mark);
// A node as an error shows it: a scalar quoted, else its shape ("a list", "a map", "nothing").
std::string Shown(const YAML::Node& node);

class Parser {
 public:
  explicit Parser(std::string source) : source_(std::move(source)) {}

  std::vector<Rule> Parse(const YAML::Node& root);
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  void Error(const YAML::Mark& mark, const std::string& what) {
    errors_.push_back(source_ + ":" + Line(mark) + ": " + context_ + what);
  }

  void ParseGroup(const YAML::Node& group, std::vector<Rule>* rules);
  std::optional<Rule> ParseRule(const YAML::Node& node);

  // Field readers: report and return nullopt when the node is not of the right form.
  std::optional<std::string> String(const YAML::Node& node, const std::string& key);
  std::optional<double> Number(const YAML::Node& node, const std::string& key);
  std::optional<uint64_t> Steps(const YAML::Node& node, const std::string& key);
  std::optional<double> Seconds(const YAML::Node& node, const std::string& key);
  std::optional<std::vector<std::string>> Patterns(const YAML::Node& node, const std::string& key);
  std::optional<LabelSet> StringMap(const YAML::Node& node, const std::string& key);

  std::string source_;
  std::string context_;  // "rule 'name': " or "group 'name': " while inside one
  std::vector<std::string> errors_;
  std::map<std::string, std::string> rule_lines_;  // name → "file:line", for duplicates
};

// Parses `yaml_text` (a rule file named `source_name`): its rules, or the first error; every error
// is appended to `errors`.
StatusOr<std::vector<Rule>> ParseOrError(const std::string& yaml_text, const std::string& source_name,
                                         std::vector<std::string>* errors);

}  // namespace gradwatch::alerts::rule_parsing

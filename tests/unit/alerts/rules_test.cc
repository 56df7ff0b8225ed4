#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "alerts/rules.h"
#include "tests/support/temp_dir.h"

using namespace gradwatch::alerts;
using gradwatch::ParamKind;
using gradwatch::testing::TempDir;

namespace {

const Rule* Find(const std::vector<Rule>& rules, const std::string& name) {
  for (const Rule& r : rules) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

// A file holding one group whose rules start at line 4.
std::string OneGroup(const std::string& rules) { return "groups:\n  - name: g\n    rules:\n" + rules; }

std::filesystem::path DefaultRulesPath() {
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path().parent_path() /
         "alerts/rules/default.yaml";
}

}  // namespace

TEST_CASE("the default rules load: two pages (the contingency, a dead run) and seven warnings", "[alerts]") {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  REQUIRE(rules->size() == 9);

  const Rule* page = Find(*rules, "GradNormContingency");
  REQUIRE(page);
  CHECK(page->kind == RuleKind::kThreshold);
  CHECK(page->series == std::vector<std::string>{"grad/norm/total"});
  CHECK(page->op == CompareOp::kGe);
  CHECK(page->value == 5);
  CHECK(page->for_steps == 10);
  CHECK(page->clear_below == 4.5);
  CHECK(page->labels.at("severity") == "page");
  CHECK(page->annotations.at("recommendation") == "{{ recommendation }}");
  CHECK(page->annotations.at("summary") ==
        "Total grad norm {{ value }} ≥ {{ threshold }} at step {{ step }} in run {{ run }}");
  CHECK(page->source == "alerts/rules/default.yaml:15");

  const Rule* forecast = Find(*rules, "GradNormForecast");
  REQUIRE(forecast);
  CHECK(forecast->kind == RuleKind::kForecast);
  CHECK(forecast->threshold == 5);
  CHECK(forecast->within_steps == 20000);
  const Rule* growth = Find(*rules, "NormGainGrowingWithoutDecay");
  REQUIRE(growth);
  CHECK(growth->param_kind == ParamKind::kNormGain);
  CHECK(growth->min_amplification == 4);
  const Rule* share = Find(*rules, "LmHeadGradShareHigh");
  REQUIRE(share);
  CHECK(share->param_kind == ParamKind::kOutput);
  CHECK(share->min_share == Approx(0.9));
  const Rule* slope = Find(*rules, "GradNormSlopeChangeAtEvent");
  REQUIRE(slope);
  CHECK(slope->at == SlopeChangeAt::kEvent);
  CHECK(slope->min_ratio == 1.5);
  const Rule* nonfinite = Find(*rules, "NonFiniteValue");
  REQUIRE(nonfinite);
  CHECK(nonfinite->series == DefaultNonFiniteSeries());
  const Rule* stalled = Find(*rules, "RunStalled");
  REQUIRE(stalled);
  CHECK(stalled->stalled_seconds == 600);
  const Rule* died = Find(*rules, "RunDied");
  REQUIRE(died);
  CHECK(died->kind == RuleKind::kRunDied);
  CHECK(died->stalled_seconds == 0);  // the daemon's runs.stalled_after_seconds
  CHECK(died->labels.at("severity") == "page");
  const Rule* remediation = Find(*rules, "RemediationOffProjection");
  REQUIRE(remediation);
  CHECK(remediation->kind == RuleKind::kRemediation);
  CHECK(remediation->max_departure == 0.25);
  CHECK(remediation->after_time_constants == 0.5);
  CHECK(remediation->clear_below == 0.2);

  for (const Rule& r : *rules) {
    INFO(r.name);
    CHECK(r.labels.count("severity") == 1);
    CHECK(r.annotations.count("summary") == 1);
    CHECK(r.annotations.count("description") == 1);
    if (&r != page && &r != died) CHECK(r.labels.at("severity") == "warning");
  }
}

TEST_CASE("the compiled-in default rules are the file in the tree", "[alerts]") {
  std::ifstream in(DefaultRulesPath());
  REQUIRE(in);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(DefaultRulesYaml() == text.str());
  auto from_file = LoadRuleFile(DefaultRulesPath().string());
  REQUIRE(from_file.ok());
  CHECK(from_file->size() == 9);
}

TEST_CASE("every rule kind loads with its own fields", "[alerts]") {
  const std::string yaml = OneGroup(R"(      - alert: LowLoss
        kind: threshold
        series: [train/loss, "grad/norm/*"]
        op: lt
        value: 0.5
        clear_above: 0.6
        resolve_for_steps: 20
        labels: {severity: info, team: ml}
        annotations: {summary: "{{ series }} {{ op }} {{ threshold }}"}
      - alert: Trend
        kind: forecast
        series: grad/norm/total
        threshold: 5
        within_steps: 2e4
        labels: {severity: warning}
      - alert: Bend
        kind: slope_change
        series: grad/norm/total
        min_ratio: 2
        at: any
        labels: {severity: warning}
      - alert: RouterShare
        kind: share
        group: router
        min_share: 0.5
        labels: {severity: warning}
      - alert: Growth
        kind: growth_without_decay
        param: "*norm*"
        min_growth: 0.1
        max_weight_decay: 0.001
        labels: {severity: warning}
      - alert: Nan
        kind: non_finite
        series: train/loss
        labels: {severity: page}
      - alert: Hung
        kind: stalled
        seconds: 10m
        labels: {severity: warning}
)");
  auto rules = LoadRules(yaml, "all.yaml");
  INFO(rules.status().message());
  REQUIRE(rules.ok());
  REQUIRE(rules->size() == 7);
  const Rule& t = (*rules)[0];
  CHECK(t.series == std::vector<std::string>{"train/loss", "grad/norm/*"});
  CHECK(t.op == CompareOp::kLt);
  CHECK(t.clear_above == 0.6);
  CHECK(t.resolve_for_steps == 20);
  CHECK(t.labels == LabelSet{{"severity", "info"}, {"team", "ml"}});
  CHECK(t.source == "all.yaml:4");
  CHECK((*rules)[1].within_steps == 20000);
  CHECK((*rules)[2].at == SlopeChangeAt::kAny);
  CHECK((*rules)[3].group == "router");
  CHECK((*rules)[4].min_growth == 0.1);
  CHECK((*rules)[4].max_weight_decay == 0.001);
  CHECK((*rules)[5].series == std::vector<std::string>{"train/loss"});
  CHECK((*rules)[6].stalled_seconds == 600);
  CHECK((*rules)[6].source == "all.yaml:40");
}

TEST_CASE("an empty rules file holds no rules", "[alerts]") {
  auto rules = LoadRules("", "empty.yaml");
  REQUIRE(rules.ok());
  CHECK(rules->empty());
  rules = LoadRules("groups: []\n", "empty.yaml");
  REQUIRE(rules.ok());
  CHECK(rules->empty());
}

TEST_CASE("bad rule files are rejected with file:line and what is wrong", "[alerts]") {
  // Each snippet is a rule list starting at line 4 of bad.yaml.
  const std::string kHead = "      - alert: A\n";
  const std::string kThreshold = kHead +
                                 "        kind: threshold\n"
                                 "        series: grad/norm/total\n"
                                 "        op: \">=\"\n"
                                 "        value: 5\n";
  const std::string kSeverity = "        labels: {severity: page}\n";
  struct Case {
    std::string rules;
    std::string error;
  };
  const std::vector<Case> cases = {
      {kHead + "        kind: thresold\n" + kSeverity, "bad.yaml:5: rule 'A': unknown kind 'thresold'"},
      {kHead + kSeverity, "bad.yaml:4: rule 'A': missing 'kind'"},
      {kThreshold + kSeverity + "        vaule: 5\n", "bad.yaml:10: rule 'A': unknown key 'vaule'"},
      {kThreshold + kSeverity + "        min_share: 0.5\n",
       "bad.yaml:10: rule 'A': key 'min_share' does not apply to kind threshold"},
      {kHead + "        kind: threshold\n        series: grad/norm/total\n        op: \">=\"\n" + kSeverity,
       "bad.yaml:4: rule 'A': missing 'value' (required by kind threshold)"},
      {kHead +
           "        kind: threshold\n        series: grad/norm/total\n        op: \"=>\"\n"
           "        value: 5\n" +
           kSeverity,
       "bad.yaml:7: rule 'A': bad op '=>'"},
      {kThreshold + kSeverity + kThreshold + kSeverity,
       "bad.yaml:10: rule 'A': duplicate rule name (first defined at bad.yaml:4)"},
      {kThreshold + kSeverity + "        annotations:\n          summary: \"{{ value\"\n",
       "bad.yaml:11: rule 'A': annotation 'summary': unclosed '{{'"},
      {kThreshold + kSeverity + "        annotations:\n          summary: \"{{ vaule }}\"\n",
       "bad.yaml:11: rule 'A': annotation 'summary': unknown variable 'vaule'"},
      {kThreshold + kSeverity + "        annotations:\n          summary: \"{{ share }}\"\n",
       "bad.yaml:11: rule 'A': annotation 'summary': unknown variable 'share'"},
      {kThreshold, "bad.yaml:4: rule 'A': missing label 'severity'"},
      {kThreshold + "        labels: {severity: page, run: x}\n", "bad.yaml:9: rule 'A': label 'run' is reserved"},
      {kThreshold + "        labels: {severity: page, bad-name: x}\n",
       "bad.yaml:9: rule 'A': labels: bad name 'bad-name'"},
      {kThreshold + kSeverity + "        clear_below: 5.5\n",
       "bad.yaml:10: rule 'A': clear_below 5.5 must not exceed value 5"},
      {kThreshold + kSeverity + "        clear_above: 4\n",
       "bad.yaml:10: rule 'A': clear_above does not fit op >=: use clear_below"},
      {kHead +
           "        kind: threshold\n        series: grad/norm/total\n        op: \">=\"\n"
           "        value: five\n" +
           kSeverity,
       "bad.yaml:8: rule 'A': value must be a finite number, got 'five'"},
      {kThreshold + kSeverity + "        for_steps: -1\n",
       "bad.yaml:10: rule 'A': for_steps must be a whole number of steps ≥ 0, got '-1'"},
      {kThreshold + kSeverity + "        for_steps: 2.5\n",
       "bad.yaml:10: rule 'A': for_steps must be a whole number of steps ≥ 0, got '2.5'"},
      {kHead + "        kind: non_finite\n        for_steps: 3\n" + kSeverity,
       "bad.yaml:6: rule 'A': for_steps does not apply to kind non_finite: it fires at once"},
      {kHead + "        kind: stalled\n        seconds: ten minutes\n" + kSeverity,
       "bad.yaml:6: rule 'A': seconds must be a positive duration"},
      {kHead + "        kind: stalled\n        seconds: 60\n        resolve_for_steps: 3\n" + kSeverity,
       "bad.yaml:7: rule 'A': resolve_for_steps does not apply to kind stalled"},
      {kHead + "        kind: remediation\n" + kSeverity,
       "bad.yaml:4: rule 'A': missing 'max_departure' (required by kind remediation)"},
      {kHead + "        kind: remediation\n        max_departure: 25\n        clear_below: 30\n" + kSeverity,
       "bad.yaml:7: rule 'A': clear_below must not exceed max_departure"},
      {kHead + "        kind: remediation\n        max_departure: 0\n" + kSeverity,
       "bad.yaml:6: rule 'A': max_departure is a fraction above 0: 0.25 for 25% off the projection, got 0"},
      {kHead + "        kind: remediation\n        max_departure: 0.25\n        after_time_constants: -1\n" + kSeverity,
       "bad.yaml:7: rule 'A': after_time_constants must be finite and ≥ 0"},
      {kHead + "        kind: share\n        param_kind: output\n        min_share: 90\n" + kSeverity,
       "bad.yaml:7: rule 'A': min_share is a fraction in (0, 1]: 0.9 for 90%, got 90"},
      {kHead + "        kind: share\n        min_share: 0.9\n" + kSeverity,
       "bad.yaml:4: rule 'A': missing 'param', 'group' or 'param_kind'"},
      {kHead + "        kind: share\n        param_kind: head\n        min_share: 0.9\n" + kSeverity,
       "bad.yaml:6: rule 'A': unknown param_kind 'head'"},
      {kHead + "        kind: growth_without_decay\n        param_kind: norm_gain\n" + kSeverity,
       "bad.yaml:4: rule 'A': missing 'min_amplification' or 'min_growth'"},
      {kHead +
           "        kind: slope_change\n        series: grad/norm/total\n        min_ratio: 1.5\n"
           "        at: events\n" +
           kSeverity,
       "bad.yaml:8: rule 'A': bad at 'events' (event, change_point or any)"},
      {kHead +
           "        kind: forecast\n        series: grad/norm/total\n        threshold: 5\n"
           "        within_steps: 0\n" +
           kSeverity,
       "bad.yaml:8: rule 'A': within_steps must be > 0"},
      {kHead +
           "        kind: forecast\n        series: grad/norm/total\n        threshold: 5\n"
           "        within_steps: 100\n        clear_below: 3\n" +
           kSeverity,
       "bad.yaml:9: rule 'A': clear_below does not apply to kind forecast"},
      {"      - kind: threshold\n", "bad.yaml:4: rule '': missing 'alert'"},
      {"      - just a string\n", "bad.yaml:4: a rule must be a map, got 'just a string'"},
      {kThreshold + "        labels: {severity: page\n", "bad.yaml:10: invalid YAML"},
      // yaml-cpp keeps both entries of a repeated key; the last one would win without a word.
  };
  for (const Case& c : cases) {
    const std::string yaml = OneGroup(c.rules);
    INFO(yaml);
    auto rules = LoadRules(yaml, "bad.yaml");
    REQUIRE_FALSE(rules.ok());
    CHECK_THAT(rules.status().message(), Catch::StartsWith(c.error));
  }
}

TEST_CASE("bad file structure is rejected with file:line", "[alerts]") {
  struct Case {
    std::string yaml;
    std::string error;
  };
  const std::vector<Case> cases = {
      {"rules: []\n", "top.yaml:1: unknown top-level key 'rules' (expected 'groups')"},
      {"groups: {a: 1}\n", "top.yaml:1: groups must be a list, got a map"},
      {"groups:\n  - rules: []\n", "top.yaml:2: group '': missing 'name'"},
      {"groups:\n  - name: g\n    interval: 1m\n    rules: []\n", "top.yaml:3: group 'g': unknown key 'interval'"},
      {"- a\n- b\n", "top.yaml:1: a rules file is a map with 'groups', got a list"},
  };
  for (const Case& c : cases) {
    INFO(c.yaml);
    auto rules = LoadRules(c.yaml, "top.yaml");
    REQUIRE_FALSE(rules.ok());
    CHECK_THAT(rules.status().message(), Catch::StartsWith(c.error));
  }
}

TEST_CASE("every error of a rules file is reported, one per line", "[alerts]") {
  const std::string yaml = OneGroup(
      "      - alert: A\n        kind: thresold\n        labels: {severity: page}\n"
      "      - alert: B\n        kind: stalled\n        seconds: 0\n        labels: {severity: page}\n");
  auto rules = LoadRules(yaml, "two.yaml");
  REQUIRE_FALSE(rules.ok());
  CHECK_THAT(rules.status().message(),
             Catch::Contains("two.yaml:5: rule 'A': unknown kind 'thresold'") &&
                 Catch::Contains("\ntwo.yaml:9: rule 'B': seconds must be a positive duration"));
}

TEST_CASE("rule names are unique across files and unreadable files are errors", "[alerts]") {
  TempDir dir;
  const std::string rule = "      - alert: Same\n        kind: non_finite\n        labels: {severity: page}\n";
  const std::string a = dir.Write("a.yaml", OneGroup(rule));
  const std::string b = dir.Write("b.yaml", OneGroup(rule));

  CHECK(CheckRuleFiles({a}).ok());
  auto both = LoadRuleFiles({a, b});
  REQUIRE_FALSE(both.ok());
  CHECK(both.status().message() == b + ":4: rule 'Same': duplicate rule name (first defined at " + a + ":4)");

  const gradwatch::Status missing = CheckRuleFiles({a, dir.Write("c.yaml", "") + ".nope"});
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.code() == gradwatch::StatusCode::kIoError);
  CHECK_THAT(missing.message(), Catch::Contains("c.yaml.nope: cannot read rules file"));
}

TEST_CASE("globs match series, parameter and group names", "[alerts]") {
  struct Case {
    const char* pattern;
    const char* text;
    bool match;
  };
  const Case cases[] = {
      {"grad/norm/*", "grad/norm/total", true},
      {"grad/norm/*", "grad/norm/layers.0.mlp/w", true},
      {"grad/norm/*", "params/norm/x", false},
      {"grad/norm/total", "grad/norm/total", true},
      {"grad/norm/total", "grad/norm/totals", false},
      {"*", "", true},
      {"*norm*", "final_norm.weight", true},
      {"layers.?.norm", "layers.3.norm", true},
      {"layers.?.norm", "layers.12.norm", false},
      {"a*b*c", "aXbYbZc", true},
      {"a*b*c", "aXbYbZ", false},
      // The prefix shape's fast path, at its edges.
      {"grad/norm/*", "grad/norm/", true},
      {"grad/norm/*", "grad/norm", false},
      {"grad/norm/*", "grad/nor", false},
      {"*", "anything", true},
      {"a?*", "a", false},
      {"a?*", "ab", true},
      {"ab**", "ab", true},
      {"ab*?", "ab", false},
  };
  for (const Case& c : cases) {
    INFO(c.pattern << " ~ " << c.text);
    CHECK(gradwatch::GlobMatches(c.pattern, c.text) == c.match);
  }
}

TEST_CASE("a key given twice outside a rule is an error too, never last-one-wins", "[alerts]") {
  auto rules = LoadRules("groups:\n  - name: g\n    rules: []\ngroups:\n  - name: h\n    rules: []\n", "dup.yaml");
  REQUIRE_FALSE(rules.ok());
  CHECK(rules.status().message() == "dup.yaml:4: duplicate key 'groups' (first at line 1)");
  rules = LoadRules("groups:\n  - name: g\n    name: h\n    rules: []\n", "dup.yaml");
  REQUIRE_FALSE(rules.ok());
  CHECK_THAT(rules.status().message(), Catch::Contains("dup.yaml:3:"));
  CHECK_THAT(rules.status().message(), Catch::Contains("'name'"));
}

TEST_CASE("a key given twice in one rule is an error", "[alerts]") {
  auto rules = LoadRules(OneGroup("      - alert: A\n        kind: non_finite\n        labels: {severity: page}\n"
                                  "        kind: stalled\n"),
                         "dup.yaml");
  REQUIRE_FALSE(rules.ok());
  CHECK_THAT(rules.status().message(), Catch::Contains("dup.yaml:7: rule 'A': duplicate key 'kind'"));
}

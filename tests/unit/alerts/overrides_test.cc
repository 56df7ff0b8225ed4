#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "alerts/rules.h"

using namespace gradwatch::alerts;
using Catch::Contains;
using gradwatch::Status;

namespace {

std::vector<Rule> Defaults() {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  return *rules;
}

const Rule& Named(const std::vector<Rule>& rules, const std::string& name) {
  for (const Rule& r : rules) {
    if (r.name == name) return r;
  }
  FAIL("no rule " << name);
  return rules.front();
}

}  // namespace

TEST_CASE("an override replaces a rule's keys and merges its labels and annotations", "[alerts]") {
  std::vector<Rule> rules = Defaults();
  const Rule before = Named(rules, "GradNormContingency");
  const Status s = ApplyOverrides(
      rules, {{"GradNormContingency",
               "{value: 3, clear_below: 2.5, for_steps: 4, labels: {team: pretraining}, annotations: {runbook: "
               "\"https://wiki/gn\"}}",
               "gradwatchd.yaml:12"}});
  INFO(s.message());
  REQUIRE(s.ok());
  const Rule& after = Named(rules, "GradNormContingency");
  CHECK(after.value == 3);
  CHECK(after.clear_below == 2.5);
  CHECK(after.for_steps == 4);
  CHECK(after.labels.at("severity") == "page");  // kept
  CHECK(after.labels.at("team") == "pretraining");
  CHECK(after.annotations.at("summary") == before.annotations.at("summary"));  // kept: it has no literal
  CHECK(after.annotations.at("runbook") == "https://wiki/gn");
  CHECK(after.series == before.series);
  CHECK(after.source == "alerts/rules/default.yaml:15, overridden at gradwatchd.yaml:12");
  // The other rules are as they were.
  CHECK(Named(rules, "GradNormForecast") == Named(Defaults(), "GradNormForecast"));

  // A second override of the same rule applies over the first.
  REQUIRE(ApplyOverrides(rules, {{"GradNormContingency", "{for_steps: 20}", "b.yaml:1"}}).ok());
  CHECK(Named(rules, "GradNormContingency").value == 3);
  CHECK(Named(rules, "GradNormContingency").for_steps == 20);
  CHECK(Named(rules, "GradNormContingency").source == "alerts/rules/default.yaml:15, overridden at b.yaml:1");
}

TEST_CASE("a bad override names itself and changes nothing", "[alerts]") {
  struct Case {
    const char* rule;
    const char* yaml;
    const char* error;
  };
  const Case cases[] = {
      {"GradNormContingencyy", "{value: 3}",
       "cfg.yaml:7: alerts.overrides.GradNormContingencyy: no rule of that name is in force (did you mean "
       "'GradNormContingency'?)"},
      {"GradNormContingency", "{kind: forecast}",
       "cfg.yaml:7: alerts.overrides.GradNormContingency: 'kind' cannot be overridden"},
      {"GradNormContingency", "{alert: Other}", "'alert' cannot be overridden"},
      {"GradNormContingency", "{valeu: 3}", "cfg.yaml:7: alerts.overrides.GradNormContingency: unknown key 'valeu'"},
      {"GradNormContingency", "{op: '=='}", "cfg.yaml:7: alerts.overrides.GradNormContingency: "},
      {"LmHeadGradShareHigh", "{min_share: 90}", "min_share is a fraction in (0, 1]"},
      {"GradNormContingency", "{annotations: {summary: '{{ ratio }}'}}", "unknown variable 'ratio'"},
      {"GradNormContingency", "[1, 2]", "must be a mapping of rule keys"},
  };
  for (const Case& c : cases) {
    INFO(c.rule << " " << c.yaml);
    std::vector<Rule> rules = Defaults();
    const Status s = ApplyOverrides(rules, {{c.rule, c.yaml, "cfg.yaml:7"}});
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message(), Contains(c.error));
    CHECK(rules == Defaults());
  }
}

TEST_CASE("a configuration's alerts section is read with each override's line", "[alerts]") {
  const std::string yaml =
      "log: {level: info}\n"
      "alerts:\n"
      "  default_rules: true\n"
      "  rule_files: [/etc/gradwatch/extra.yaml]\n"
      "  overrides:\n"
      "    GradNormContingency:\n"
      "      value: 3\n"
      "    NormGainGrowingWithoutDecay: {min_amplification: 2, clear_below: 1.9}\n";
  auto section = ReadAlertsSection(yaml, "gw.yaml");
  REQUIRE(section.ok());
  CHECK(section->default_rules);
  CHECK(section->rule_files == std::vector<std::string>{"/etc/gradwatch/extra.yaml"});
  REQUIRE(section->overrides.size() == 2);
  CHECK(section->overrides[0].rule == "GradNormContingency");
  CHECK(section->overrides[0].source == "gw.yaml:6");
  CHECK(section->overrides[1].rule == "NormGainGrowingWithoutDecay");
  CHECK(section->overrides[1].source == "gw.yaml:8");
  std::vector<Rule> rules = Defaults();
  REQUIRE(ApplyOverrides(rules, section->overrides).ok());
  CHECK(Named(rules, "GradNormContingency").value == 3);
  CHECK(Named(rules, "NormGainGrowingWithoutDecay").min_amplification == 2);

  CHECK_THAT(ReadAlertsSection("alerts:\n  overrides: [a]\n", "x.yaml").status().message(),
             Contains("x.yaml:2: alerts.overrides must be a mapping of rule names to rule keys"));
  CHECK_THAT(ReadAlertsSection("alerts:\n  overrides:\n    A: 3\n", "x.yaml").status().message(),
             Contains("x.yaml:3: alerts.overrides.A: must be a mapping of rule keys"));
  CHECK(ReadAlertsSection("listen: 127.0.0.1:1\n", "x.yaml")->overrides.empty());
  // A bound the other keys no longer fit is refused as in a rules file.
  std::vector<Rule> defaults = Defaults();
  CHECK_THAT(ApplyOverrides(defaults,
                            {{"NormGainGrowingWithoutDecay", "{min_amplification: 2, clear_below: 2.5}", "x.yaml:4"}})
                 .message(),
             Contains("x.yaml:4: alerts.overrides.NormGainGrowingWithoutDecay: clear_below"));
}

TEST_CASE("a hold bound overridden alone takes its clear bound along in proportion", "[alerts]") {
  std::vector<Rule> rules = Defaults();
  REQUIRE(ApplyOverrides(rules, {{"GradNormContingency", "{value: 3}", "x.yaml:1"},
                                 {"LmHeadGradShareHigh", "{min_share: 0.6}", "x.yaml:2"}})
              .ok());
  CHECK(Named(rules, "GradNormContingency").clear_below == Approx(2.7));  // 4.5 / 5 × 3
  CHECK(Named(rules, "LmHeadGradShareHigh").clear_below == Approx(0.85 / 0.9 * 0.6));
}

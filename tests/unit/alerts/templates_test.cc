#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "alerts/templates.h"

using namespace gradwatch::alerts;

TEST_CASE("templates fill placeholders from variables and labels", "[alerts]") {
  const TemplateVars vars = {{"value", "5.12"}, {"step", "100,010"}, {"run", "moe"}};
  const LabelSet labels = {{"severity", "page"}};
  CHECK(RenderTemplate("Total grad norm {{ value }} ≥ 5 at step {{step}} in run {{  run }}", vars, labels) ==
        "Total grad norm 5.12 ≥ 5 at step 100,010 in run moe");
  CHECK(RenderTemplate("[{{ labels.severity }}] {{ value }}{{ value }}", vars, labels) == "[page] 5.125.12");
  CHECK(RenderTemplate("no placeholders }} here", vars, labels) == "no placeholders }} here");
}

TEST_CASE("a variable or label without a value renders empty", "[alerts]") {
  CHECK(RenderTemplate("a{{ recommendation }}b{{ labels.team }}c", {}, {}) == "abc");
}

TEST_CASE("template syntax errors are reported with their offset", "[alerts]") {
  struct Case {
    const char* text;
    const char* error;
  };
  const Case cases[] = {
      {"value {{ value", "unclosed '{{' at offset 6"},
      {"{{ }}", "empty placeholder at offset 0"},
      {"x {{ a b }}", "bad variable name 'a b' at offset 2"},
      {"{{ labels. }}", "bad variable name 'labels.'"},
      {"{{ value | humanize }}", "bad variable name 'value | humanize'"},
  };
  for (const Case& c : cases) {
    INFO(c.text);
    auto names = TemplateVariables(c.text);
    REQUIRE_FALSE(names.ok());
    CHECK_THAT(names.status().message(), Catch::Contains(c.error));
  }
}

TEST_CASE("unknown template variables are rejected, labels.x always allowed", "[alerts]") {
  const std::set<std::string> allowed = {"value", "step"};
  CHECK(CheckTemplate("{{ value }} at {{ step }} ({{ labels.anything }})", allowed).ok());
  const gradwatch::Status s = CheckTemplate("{{ value }} at {{ stpe }}", allowed);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("unknown variable 'stpe'") && Catch::Contains("step, value"));
}

TEST_CASE("template variables are listed in order", "[alerts]") {
  auto names = TemplateVariables("{{ a }} {{b}} {{ labels.c }} {{ a }}");
  REQUIRE(names.ok());
  CHECK(*names == std::vector<std::string>{"a", "b", "labels.c", "a"});
  CHECK(TemplateUses("x {{ recommendation }}", "recommendation"));
  CHECK_FALSE(TemplateUses("x {{ value }}", "recommendation"));
}

TEST_CASE("numbers are formatted for people", "[alerts]") {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    double value;
    const char* text;
  };
  const Case cases[] = {
      {4.619591, "4.62"},   {362.14, "362.1"}, {5, "5"},           {0.59123, "0.5912"},
      {78.38367, "78.38"},  {1e-4, "1e-4"},    {2.5e-7, "2.5e-7"}, {48213.4, "48,213"},
      {-3.14159, "-3.142"}, {0, "0"},          {0.001, "0.001"},   {1234.4, "1234"},
      {NAN, "NaN"},         {inf, "+Inf"},     {-inf, "-Inf"},     {2e15, "2e15"},
  };
  for (const Case& c : cases) {
    INFO(c.value);
    CHECK(FormatNumber(c.value) == c.text);
  }
}

TEST_CASE("steps, counts and shares are formatted with separators and percent", "[alerts]") {
  CHECK(FormatStep(81716) == "81,716");
  CHECK(FormatStep(999) == "999");
  CHECK(FormatStep(1234567) == "1,234,567");
  CHECK(FormatStep(0) == "0");
  CHECK(FormatCount(48213.6) == "48,214");
  CHECK(FormatCount(std::numeric_limits<double>::infinity()) == "∞");
  CHECK(FormatPercent(0.9394) == "93.9%");
  CHECK(FormatPercent(0.5) == "50%");
  CHECK(FormatPercent(0.0004) == "<0.1%");
  CHECK(FormatPercent(0) == "0%");
}

#include <catch2/catch.hpp>

#include <string>

#include "alerts/rules.h"
#include "alerts/yaml_checks.h"

using namespace gradwatch::alerts;

namespace {

// A "billion laughs": level 0 is a list of `width` scalars, every further level a list of `width`
// aliases of the one before; the last level expands to width^(levels) nodes.
std::string AliasBomb(int levels, int width) {
  std::string yaml = "l0: &l0 [";
  for (int i = 0; i < width; ++i) yaml += std::string(i ? ", " : "") + "x";
  yaml += "]\n";
  for (int level = 1; level < levels; ++level) {
    yaml += "l" + std::to_string(level) + ": &l" + std::to_string(level) + " [";
    for (int i = 0; i < width; ++i) yaml += std::string(i ? ", " : "") + "*l" + std::to_string(level - 1);
    yaml += "]\n";
  }
  return yaml;
}

}  // namespace

TEST_CASE("a document whose aliases expand past the bound is refused at the line that crosses it", "[alerts]") {
  const gradwatch::Status bomb = CheckAliasExpansion(AliasBomb(9, 9), "bomb.yaml");
  REQUIRE_FALSE(bomb.ok());
  // 9^7 = 4.8 million nodes: level 6 (line 7) is the first past a million.
  CHECK_THAT(bomb.message(), Catch::StartsWith("bomb.yaml:7: the document's aliases (*name) expand it past 1000000"));
  // The rule loader refuses it before building anything from it.
  auto rules = LoadRules(AliasBomb(9, 9), "bomb.yaml");
  REQUIRE_FALSE(rules.ok());
  CHECK_THAT(rules.status().message(), Catch::Contains("expand it past"));
}

TEST_CASE("aliases that expand modestly, and documents without them, pass", "[alerts]") {
  CHECK(CheckAliasExpansion(AliasBomb(4, 9), "ok.yaml").ok());  // 6,561 leaves
  CHECK(CheckAliasExpansion("labels: &l {team: ml}\na: *l\nb: *l\n", "ok.yaml").ok());
  CHECK(CheckAliasExpansion("groups: [{name: a, rules: []}]\n", "ok.yaml").ok());
  CHECK(CheckAliasExpansion("not: [valid\n", "bad.yaml").ok());  // the caller's parse reports it
}

// Test helper: one rule of the built-in alerts/rules/default.yaml, by name.
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "alerts/rules.h"

namespace gradwatch::alerts::testing {

inline Rule DefaultRule(const std::string& name) {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  for (const Rule& r : *rules) {
    if (r.name == name) return r;
  }
  FAIL("no default rule " << name);
  return {};
}

}  // namespace gradwatch::alerts::testing

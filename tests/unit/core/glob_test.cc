#include <catch2/catch.hpp>

#include "server/core/types.h"

namespace gradwatch {
namespace {

TEST_CASE("glob patterns (series keys, parameter names) match with '*' anywhere") {
  CHECK(GlobMatches("grad/norm/total", "grad/norm/total"));
  CHECK_FALSE(GlobMatches("grad/norm/total", "grad/norm/totals"));
  CHECK(GlobMatches("grad/norm/*", "grad/norm/layers.0.w1"));
  CHECK(GlobMatches("*final_norm*", "params/norm/final_norm.weight"));
  CHECK(GlobMatches("*", ""));
  CHECK(GlobMatches("a*b*c", "aXbYbZc"));
  CHECK_FALSE(GlobMatches("a*b*c", "aXbYbZ"));
  CHECK_FALSE(GlobMatches("", "x"));
}

}  // namespace
}  // namespace gradwatch

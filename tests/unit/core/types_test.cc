#include <catch2/catch.hpp>

#include <cmath>

#include "server/core/status.h"
#include "server/core/types.h"

using namespace gradwatch;

TEST_CASE("param kinds round-trip through their names and aliases", "[core]") {
  for (int k = 0; k <= 7; ++k) {
    auto kind = static_cast<ParamKind>(k);
    CHECK(ParseParamKind(ParamKindName(kind)) == kind);
  }
  CHECK(ParseParamKind("lm_head") == ParamKind::kOutput);
  CHECK(ParseParamKind("norm") == ParamKind::kNormGain);
  CHECK_FALSE(ParseParamKind("bogus").has_value());
}

TEST_CASE("a parameter's group defaults to its kind", "[core]") {
  ParamInfo p{.name = "final_norm.weight", .kind = ParamKind::kNormGain};
  CHECK(p.EffectiveGroup() == "norm_gain");
  p.group = "head";
  CHECK(p.EffectiveGroup() == "head");
}

TEST_CASE("rank steps compare by value, NaN equal to itself, seq ignored", "[core]") {
  RankStep a;
  a.step = 7;
  a.loss = std::nan("");
  a.params.push_back({.index = 1, .norms = {NormContribution::FromNorm(2.0), {}, {}}});
  a.seq = 1;
  RankStep b = a;
  b.seq = 2;
  CHECK(a.SameValues(b));
  b.params[0].norms[0] = NormContribution::FromNorm(2.5);
  CHECK_FALSE(a.SameValues(b));
  b = a;
  b.loss.reset();
  CHECK_FALSE(a.SameValues(b));
}

TEST_CASE("a norm and its square are the same contribution", "[core]") {
  CHECK(NormContribution::FromNorm(3.0) == NormContribution::FromSqSum(9.0));
}

TEST_CASE("StatusOr carries either a value or an error", "[core]") {
  StatusOr<int> good = 5;
  StatusOr<int> bad = Status::InvalidArgument("no");
  REQUIRE(good.ok());
  CHECK(*good == 5);
  CHECK_FALSE(bad.ok());
  CHECK(bad.status().ToString() == "invalid argument: no");
}

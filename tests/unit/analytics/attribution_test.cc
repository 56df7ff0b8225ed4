#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "server/analytics/attribution.h"
#include "server/core/types.h"

using gradwatch::ParamInfo;
using gradwatch::ParamKind;
using gradwatch::analytics::Amplification;
using gradwatch::analytics::AssessGrowth;
using gradwatch::analytics::ClassifyTrend;
using gradwatch::analytics::ComputeShares;
using gradwatch::analytics::DescribeShare;
using gradwatch::analytics::GrowthOptions;
using gradwatch::analytics::GrowthWithoutDecay;
using gradwatch::analytics::InitNorm;
using gradwatch::analytics::Trend;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

ParamInfo Param(const std::string& name, uint64_t numel, ParamKind kind) {
  ParamInfo param;
  param.name = name;
  param.numel = numel;
  param.kind = kind;
  return param;
}

// The incident's gain: 6144 entries initialised at ones, no weight decay.
ParamInfo FinalNorm() { return Param("final_norm.weight", 6144, ParamKind::kNormGain); }

}  // namespace

TEST_CASE("shares are squared grad norms over their squared sum: 3 and 4 give 36% and 64%", "[analytics]") {
  const std::vector<double> grads = {3.0, 4.0};
  const std::vector<uint32_t> groups = {0, 0};
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, groups, 1, std::nullopt, param_share, group_share);

  REQUIRE(param_share.size() == 2);
  CHECK(param_share[0] == Approx(0.36));
  CHECK(param_share[1] == Approx(0.64));
  REQUIRE(group_share.size() == 1);
  CHECK(group_share[0] == Approx(1.0));
}

TEST_CASE("a reported total above the parameters' own norm is the denominator", "[analytics]") {
  // Total 10 covers parameters not reported one by one: 9/100 and 16/100, 75% unattributed.
  const std::vector<double> grads = {3.0, 4.0};
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, {}, 0, 10.0, param_share, group_share);

  CHECK(param_share[0] == Approx(0.09));
  CHECK(param_share[1] == Approx(0.16));
  CHECK(group_share.empty());
}

TEST_CASE("an unusable reported total falls back to the parameters' sum", "[analytics]") {
  const std::vector<double> grads = {3.0, 4.0};
  std::vector<double> param_share;
  std::vector<double> group_share;
  for (double total : {0.0, -1.0, kNaN, std::numeric_limits<double>::infinity()}) {
    CAPTURE(total);
    ComputeShares(grads, {}, 0, total, param_share, group_share);
    CHECK(param_share[0] == Approx(0.36));
    CHECK(param_share[1] == Approx(0.64));
  }
}

TEST_CASE("group shares add their members' shares, and a group without members is NaN", "[analytics]") {
  // lm_head 0.9² = 0.81, two norms 0.3² = 0.09 each, an embedding 0.1² = 0.01: total² = 1.
  const std::vector<double> grads = {0.9, 0.3, 0.3, 0.1};
  const std::vector<uint32_t> groups = {0, 1, 1, 2};
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, groups, 4, std::nullopt, param_share, group_share);

  REQUIRE(group_share.size() == 4);
  CHECK(group_share[0] == Approx(0.81));
  CHECK(group_share[1] == Approx(0.18));
  CHECK(group_share[2] == Approx(0.01));
  CHECK(std::isnan(group_share[3]));
}

TEST_CASE("a NaN grad norm is skipped: NaN share, not in the total, not in its group", "[analytics]") {
  const std::vector<double> grads = {3.0, kNaN, 4.0, -1.0};
  const std::vector<uint32_t> groups = {0, 1, 0, 1};
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, groups, 2, std::nullopt, param_share, group_share);

  CHECK(param_share[0] == Approx(0.36));
  CHECK(std::isnan(param_share[1]));
  CHECK(param_share[2] == Approx(0.64));
  CHECK(std::isnan(param_share[3]));  // a negative norm is not a norm
  CHECK(group_share[0] == Approx(1.0));
  CHECK(std::isnan(group_share[1]));
}

TEST_CASE("parameters without a group entry or with an out-of-range group join no group", "[analytics]") {
  const std::vector<double> grads = {3.0, 4.0, 0.0};
  const std::vector<uint32_t> groups = {7};  // out of range; the others have no entry
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, groups, 1, std::nullopt, param_share, group_share);

  CHECK(param_share[0] == Approx(0.36));
  CHECK(param_share[1] == Approx(0.64));
  CHECK(param_share[2] == 0.0);
  CHECK(std::isnan(group_share[0]));
}

TEST_CASE("with no usable grad norm every share is NaN", "[analytics]") {
  const std::vector<uint32_t> groups = {0, 0};
  std::vector<double> param_share;
  std::vector<double> group_share;
  for (const std::vector<double>& grads : {std::vector<double>{kNaN, kNaN}, std::vector<double>{0.0, 0.0}}) {
    ComputeShares(grads, groups, 1, std::nullopt, param_share, group_share);
    REQUIRE(param_share.size() == 2);
    CHECK(std::isnan(param_share[0]));
    CHECK(std::isnan(param_share[1]));
    CHECK(std::isnan(group_share[0]));
  }
}

TEST_CASE("share outputs are reused: no reallocation once sized", "[analytics]") {
  const std::vector<double> grads = {3.0, 4.0, 12.0};
  const std::vector<uint32_t> groups = {0, 1, 1};
  std::vector<double> param_share;
  std::vector<double> group_share;
  ComputeShares(grads, groups, 2, std::nullopt, param_share, group_share);
  const double* param_data = param_share.data();
  const double* group_data = group_share.data();

  ComputeShares(grads, groups, 2, 13.0, param_share, group_share);
  CHECK(param_share.data() == param_data);
  CHECK(group_share.data() == group_data);
  CHECK(param_share[2] == Approx(144.0 / 169.0));
  CHECK(group_share[1] == Approx(160.0 / 169.0));
}

TEST_CASE("a share is described with its trend", "[analytics]") {
  struct Case {
    double share;
    double slope_per_kstep;
    std::string text;
  };
  const Case cases[] = {
      {0.95, 0.004, "95% and rising"},
      {0.032, -0.002, "3.2% and falling"},
      {0.40, 0.0002, "40% and steady"},
      {0.0004, 0.0, "<0.1% and steady"},
      {0.0, 0.0, "0.0% and steady"},
      {1.0, -0.01, "100% and falling"},
      {0.95, kNaN, "95%"},
      {kNaN, 0.004, "unknown"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.share, c.slope_per_kstep);
    CHECK(DescribeShare(c.share, c.slope_per_kstep) == c.text);
  }
  CHECK(DescribeShare(0.5, 0.004, 0.01) == "50% and steady");
}

TEST_CASE("a trend is steady below the threshold or when unknown", "[analytics]") {
  CHECK(ClassifyTrend(0.002) == Trend::kRising);
  CHECK(ClassifyTrend(-0.002) == Trend::kFalling);
  CHECK(ClassifyTrend(0.0009) == Trend::kSteady);
  CHECK(ClassifyTrend(kNaN) == Trend::kSteady);
  CHECK(ClassifyTrend(0.05, 0.1) == Trend::kSteady);
}

TEST_CASE(
    "a 6144-entry norm gain initialised at ones starts at norm 78.38, and at 362 it amplifies "
    "4.62x",
    "[analytics]") {
  const std::optional<double> init = InitNorm(FinalNorm());
  REQUIRE(init.has_value());
  CHECK(*init == Approx(std::sqrt(6144.0)));
  CHECK(*init == Approx(78.38).margin(0.005));
  CHECK(Amplification(362.0, *init) == Approx(4.62).margin(0.005));
}

TEST_CASE("the catalog's init_norm wins over sqrt(numel)", "[analytics]") {
  ParamInfo param = FinalNorm();
  param.init_norm = 39.2;
  CHECK(InitNorm(param) == Approx(39.2));
  CHECK(Amplification(362.0, *InitNorm(param)) == Approx(362.0 / 39.2));

  ParamInfo lm_head = Param("lm_head.weight", 788'000'000, ParamKind::kOutput);
  lm_head.init_norm = 12.5;
  CHECK(InitNorm(lm_head) == Approx(12.5));
}

TEST_CASE("without a usable catalog init_norm only norm gains have an initial norm", "[analytics]") {
  ParamInfo gain = FinalNorm();
  gain.init_norm = 0.0;  // not a norm to divide by: ignored
  CHECK(InitNorm(gain) == Approx(std::sqrt(6144.0)));

  ParamInfo lm_head = Param("lm_head.weight", 788'000'000, ParamKind::kOutput);
  CHECK_FALSE(InitNorm(lm_head).has_value());

  ParamInfo empty_gain = FinalNorm();
  empty_gain.numel = 0;
  CHECK_FALSE(InitNorm(empty_gain).has_value());
}

TEST_CASE("amplification needs a positive finite initial norm", "[analytics]") {
  CHECK(Amplification(10.0, 4.0) == Approx(2.5));
  CHECK(std::isnan(Amplification(10.0, 0.0)));
  CHECK(std::isnan(Amplification(10.0, -1.0)));
  CHECK(std::isnan(Amplification(10.0, kNaN)));
}

TEST_CASE(
    "a gain without weight decay whose norm rises is reported with factor, slope and "
    "amplification",
    "[analytics]") {
  // final_norm: 320 → 340 over a 20k-step window, rising 1.0 per 1k steps.
  const std::optional<GrowthWithoutDecay> growth = AssessGrowth(FinalNorm(), 5, 320.0, 340.0, 1.0);
  REQUIRE(growth.has_value());
  CHECK(growth->param_index == 5);
  CHECK(growth->growth_factor == Approx(340.0 / 320.0));
  CHECK(growth->slope_per_kstep == Approx(1.0));
  CHECK(growth->amplification == Approx(340.0 / std::sqrt(6144.0)));
}

TEST_CASE("a parameter with weight decay is not growth without decay", "[analytics]") {
  ParamInfo decayed = FinalNorm();
  decayed.weight_decay = 0.1;
  CHECK_FALSE(AssessGrowth(decayed, 0, 320.0, 340.0, 1.0).has_value());

  GrowthOptions lenient;
  lenient.max_weight_decay = 0.1;
  CHECK(AssessGrowth(decayed, 0, 320.0, 340.0, 1.0, lenient).has_value());
}

TEST_CASE("a falling, flat, or barely growing norm is not growth without decay", "[analytics]") {
  const ParamInfo gain = FinalNorm();
  CHECK_FALSE(AssessGrowth(gain, 0, 340.0, 320.0, -1.0).has_value());  // falling
  CHECK_FALSE(AssessGrowth(gain, 0, 320.0, 340.0, 0.0).has_value());   // grew, now flat
  CHECK_FALSE(AssessGrowth(gain, 0, 320.0, 340.0, -0.2).has_value());  // grew, now falling
  CHECK_FALSE(AssessGrowth(gain, 0, 320.0, 330.0, 0.5).has_value());   // +3.1% < 5%

  GrowthOptions sensitive;
  sensitive.min_growth = 0.02;
  CHECK(AssessGrowth(gain, 0, 320.0, 330.0, 0.5, sensitive).has_value());
}

TEST_CASE("growth is not assessed from unusable norms", "[analytics]") {
  const ParamInfo gain = FinalNorm();
  CHECK_FALSE(AssessGrowth(gain, 0, 0.0, 340.0, 1.0).has_value());
  CHECK_FALSE(AssessGrowth(gain, 0, kNaN, 340.0, 1.0).has_value());
  CHECK_FALSE(AssessGrowth(gain, 0, 320.0, kNaN, 1.0).has_value());
  CHECK_FALSE(AssessGrowth(gain, 0, 320.0, 340.0, kNaN).has_value());
}

TEST_CASE("growth of a parameter with no known initial norm has NaN amplification", "[analytics]") {
  const ParamInfo router = Param("router.weight", 6144 * 64, ParamKind::kRouter);
  const std::optional<GrowthWithoutDecay> growth = AssessGrowth(router, 2, 10.0, 12.0, 0.1);
  REQUIRE(growth.has_value());
  CHECK(growth->growth_factor == Approx(1.2));
  CHECK(std::isnan(growth->amplification));
}

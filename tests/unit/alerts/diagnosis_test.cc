#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "alerts/diagnosis.h"
#include "alerts/rules.h"
#include "alerts/templates.h"
#include "server/analytics/projection.h"
#include "tests/unit/alerts/param_fact.h"

using namespace gradwatch::alerts;
using Catch::Contains;
using gradwatch::ParamKind;
using gradwatch::alerts::testing::Param;

namespace {

// A run with a final norm (wd 0, init sqrt(6144) = 78.38), an lm_head, an MLP block and an
// attention block, at step 61,500, weight decay 0.1 elsewhere. The caller sets the norm, its slope
// and the shares.
RunFacts Run(double final_norm, double final_slope, double head_share, double mlp_share) {
  RunFacts f;
  f.run_id = "r";
  f.step = 61500;
  f.config.weight_decay = 0.1;
  ParamFact gain = Param("final_norm.weight", ParamKind::kNormGain, 0);
  gain.norm = final_norm;
  gain.norm_slope_per_kstep = final_slope;
  f.params = {gain, Param("lm_head.weight", ParamKind::kOutput, 0.1, 788'000'000),
              Param("layers.7.mlp.w2.weight", ParamKind::kMlp, 0.1, 1'000'000),
              Param("layers.7.attn.wq.weight", ParamKind::kAttention, 0.1, 1'000'000)};
  f.shares = {{"final_norm.weight", false, 0.0001, 0, ParamKind::kNormGain},
              {"lm_head.weight", false, head_share, 0.001, ParamKind::kOutput},
              {"layers.7.mlp.w2.weight", false, mlp_share, 0.032, ParamKind::kMlp},
              {"layers.7.attn.wq.weight", false, 1 - head_share - mlp_share - 0.0001, NAN, ParamKind::kAttention},
              {"output", true, head_share, 0}};
  return f;
}

}  // namespace

TEST_CASE("a grown norm gain without decay and a dominant output layer is the incident's cause", "[alerts]") {
  const RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK(d.cause == Cause::kNormGainInflatesOutput);
  CHECK(d.remedy.supported);
  CHECK(d.remedy.param == "final_norm.weight");
  CHECK(d.remedy.weight_decay == 0.1);
  CHECK_THAT(d.remedy.why, Contains("4.62× its init norm") && Contains("93.9%") && Contains("at least 90%"));
  CHECK_THAT(d.text, Contains("A norm gain without weight decay inflates the output layer"));
  CHECK_THAT(d.recommendation, Contains("Recommendation: enable weight decay on final_norm.weight (the run uses 0.1"));
  CHECK(d.top.at(0).name == "lm_head.weight");
  CHECK(d.output_share == Approx(0.939));
}

TEST_CASE("the recommendation projects what its weight decay does to the gain, the output share and the total",
          "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  // Without a learning rate no projection is made.
  CHECK_THAT(Diagnose(f, DiagnosisBounds{}).recommendation, !Contains("goes from"));
  f.learning_rate.known = true;
  f.learning_rate.value = 7.7e-4;
  f.params[0].update_norm = 0.004;
  f.latest = {{"grad/norm/total", 6.1}};
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  REQUIRE(d.cause == Cause::kNormGainInflatesOutput);
  // The same figures as the projection itself (analytics/projection.h, tested against AdamW).
  const gradwatch::analytics::NormDynamics dyn =
      gradwatch::analytics::EstimateDynamics(362.1, 2.5e-3, 7.7e-4, 0, 0.004, NAN);
  const gradwatch::analytics::NormProjection p = gradwatch::analytics::ProjectNorm(362.1, dyn, 7.7e-4, 0.1, 20000);
  INFO(d.recommendation);
  CHECK(p.norm_at_end < 362.1);
  CHECK_THAT(d.recommendation,
             Contains("With weight decay 0.1 from step 61,500 (learning rate 7.7e-4; final_norm.weight growing 2.5 per "
                      "1k steps without decay), final_norm.weight goes from 362.1 to ~" +
                      FormatNumber(p.norm_at_end) + " by step 81,500 (equilibrium ~" +
                      FormatNumber(p.equilibrium_norm) + ", time constant ~" + FormatCount(p.time_constant_steps) +
                      " steps), if the learning rate and its update's radial and rotational parts stay at their recent "
                      "values"));
  const double k = p.norm_at_end / 362.1;
  const double out_sq = 0.939 * k * k;
  CHECK_THAT(
      d.recommendation,
      Contains("its share of the squared grad norm goes from 93.9% to ~" + FormatPercent(out_sq / (out_sq + 0.061)) +
               " and the total grad norm from 6.1 to ~" + FormatNumber(6.1 * std::sqrt(out_sq + 0.061))));
}

TEST_CASE("the projection uses the gain's own learning rate and its reported radial update when the trainer sends them",
          "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  f.learning_rate.known = true;
  f.learning_rate.value = 7.7e-4;
  f.params[0].update_norm = 0.004;
  f.params[0].radial_per_step = 0.002;
  // Sorted by key, as the feed fills them.
  f.latest = {{"grad/norm/total", 6.1}, {"optim/learning_rate/final_norm.weight", 2e-3}};
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  REQUIRE(d.cause == Cause::kNormGainInflatesOutput);
  const gradwatch::analytics::NormDynamics dyn =
      gradwatch::analytics::EstimateDynamics(362.1, 2.5e-3, 2e-3, 0, 0.004, 0.002);
  CHECK(dyn.radial_known);
  const gradwatch::analytics::NormProjection p = gradwatch::analytics::ProjectNorm(362.1, dyn, 2e-3, 0.1, 20000);
  INFO(d.recommendation);
  CHECK_THAT(d.recommendation, Contains("With weight decay 0.1 from step 61,500 (its learning rate 0.002; ") &&
                                   Contains("goes from 362.1 to ~" + FormatNumber(p.norm_at_end) + " by step 81,500") &&
                                   Contains("its update's radial (reported: ⟨Δw, w⟩/|w| 0.002 a step) and rotational "
                                            "parts stay at their recent values"));
}

TEST_CASE("a spike an MLP block carries names the block and gives no weight-decay advice", "[alerts]") {
  // final_norm.weight flat at its init norm; the MLP block carries 81%, up from 28%.
  RunFacts f = Run(78.4, 0.0, 0.12, 0.81);
  f.shares[2].earlier_share = 0.28;
  f.shares[2].earlier_first_step = f.shares[2].earlier_last_step = 61200;
  f.shares[2].trend_samples = 300;
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK(d.cause == Cause::kNone);
  CHECK_FALSE(d.remedy.supported);
  CHECK_THAT(d.text, Contains("layers.7.mlp.w2.weight carries 81% of the squared grad norm, up from 28% at step "
                              "61,200; lm_head.weight 12%;"));
  CHECK_THAT(d.text, Contains("No norm gain is growing (final_norm.weight at 1× its init norm, not rising)"));
  CHECK_THAT(d.text, Contains("No cause found in the per-parameter norms."));
  CHECK_THAT(d.recommendation, Contains("No cause found in the per-parameter norms") &&
                                   Contains("no weight-decay change is indicated") &&
                                   Contains("layers.7.mlp.w2.weight (81% of the squared grad norm)"));
  CHECK_THAT(d.recommendation, !Contains("enable weight decay"));
  CHECK_THAT(d.text, !Contains("inflates"));
  CHECK_THAT(d.remedy.why, Contains("final_norm.weight has not grown significantly (1× its init norm, not rising)"));
}

TEST_CASE("a grown norm gain that already has weight decay (a remedy made) gets no advice to enable it", "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  f.params[0].info.weight_decay = 0.1;  // a catalog change gave it weight decay
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK(d.cause == Cause::kNone);
  CHECK_FALSE(d.remedy.supported);
  CHECK(d.remedy.why == "final_norm.weight already has weight decay 0.1");
  CHECK_THAT(d.text, Contains("final_norm.weight is at 4.62× its init norm with weight decay 0.1, still rising"));
  CHECK_THAT(d.recommendation, Contains("final_norm.weight already has weight decay 0.1: no further weight-decay "
                                        "change is indicated; follow its norm as the decay acts"));
  CHECK_THAT(d.recommendation, !Contains("enable weight decay"));
}

TEST_CASE("a share's movement is said from its trend's oldest reports, once the trend holds enough of them",
          "[alerts]") {
  RunFacts f = Run(78.4, 0.0, 0.12, 0.81);
  ShareFact& mlp = f.shares[2];
  mlp.earlier_share = 0.28;
  mlp.earlier_first_step = 60000;
  mlp.earlier_last_step = 61249;
  mlp.trend_samples = kShareTrendMinReports;
  ShareFact& head = f.shares[1];
  head.earlier_share = 0.5;
  head.earlier_first_step = 60000;
  head.earlier_last_step = 61249;
  head.trend_samples = kShareTrendMinReports;
  CHECK_THAT(Diagnose(f, DiagnosisBounds{}).text,
             Contains("layers.7.mlp.w2.weight carries 81% of the squared grad norm, up from 28% over steps "
                      "60,000–61,249; lm_head.weight 12%, down from 50% over steps 60,000–61,249;"));
  // Too few reports in the trend: no movement is claimed.
  mlp.trend_samples = head.trend_samples = kShareTrendMinReports - 1;
  std::string text = Diagnose(f, DiagnosisBounds{}).text;
  CHECK_THAT(text, Contains("layers.7.mlp.w2.weight carries 81% of the squared grad norm; lm_head.weight 12%;"));
  // A move of less than kShareMoveMin is no movement.
  mlp.trend_samples = head.trend_samples = 500;
  mlp.earlier_share = 0.78;
  head.earlier_share = NAN;
  text = Diagnose(f, DiagnosisBounds{}).text;
  CHECK_THAT(text, Contains("layers.7.mlp.w2.weight carries 81% of the squared grad norm; lm_head.weight 12%;"));
}

TEST_CASE("no cause is stated unless both halves of the evidence hold", "[alerts]") {
  struct Case {
    const char* what;
    double norm;
    double slope;
    double head_share;
    const char* text;
  };
  const Case cases[] = {
      {"grown gain, output layer not dominant", 362.1, 2.5, 0.4,
       "final_norm.weight (weight decay 0) has grown to 4.62× its init norm and is rising, but the output layer "
       "carries 40% of the squared grad norm, below 90%"},
      {"dominant output layer, gain not grown", 117.6, 0.5, 0.95, "No norm gain is growing (final_norm.weight at 1.5×"},
      {"grown gain no longer rising", 362.1, -0.5, 0.95, "No norm gain is growing (final_norm.weight at 4.62×"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const Diagnosis d = Diagnose(Run(c.norm, c.slope, c.head_share, 0.03), DiagnosisBounds{});
    CHECK(d.cause == Cause::kNone);
    CHECK_FALSE(d.remedy.supported);
    CHECK_THAT(d.text, Contains(c.text));
    CHECK_THAT(d.recommendation, !Contains("enable weight decay"));
  }
}

TEST_CASE("a gain with weight decay above the rule's bound is not a gain without decay", "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.95, 0.02);
  f.params[0].info.weight_decay = 0.1;
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK(d.cause == Cause::kNone);
  CHECK(d.gains.empty());
}

TEST_CASE("the diagnosis' bounds are the rules' own", "[alerts]") {
  auto rules = LoadRules(
      "groups:\n  - name: g\n    rules:\n"
      "      - alert: Growth\n        kind: growth_without_decay\n        param_kind: norm_gain\n"
      "        min_amplification: 3\n        max_weight_decay: 0.01\n        labels: {severity: warning}\n"
      "      - alert: Share\n        kind: share\n        param_kind: output\n        min_share: 0.35\n        labels: "
      "{severity: warning}\n",
      "test.yaml");
  REQUIRE(rules.ok());
  const DiagnosisBounds b = BoundsFromRules(*rules);
  CHECK(b.min_amplification == 3);
  CHECK(b.max_weight_decay == 0.01);
  CHECK(b.min_share == 0.35);
  // 40% of the squared grad norm is dominant for a team whose share rule says 35%.
  CHECK(Diagnose(Run(362.1, 2.5, 0.4, 0.03), b).cause == Cause::kNormGainInflatesOutput);
  CHECK(Diagnose(Run(362.1, 2.5, 0.4, 0.03), DiagnosisBounds{}).cause == Cause::kNone);

  const DiagnosisBounds none = BoundsFromRules({});
  CHECK(none.min_amplification == 4);
  CHECK(none.min_share == 0.9);
}

TEST_CASE("a run with only the total grad norm gets no cause and a line on per-parameter norms", "[alerts]") {
  RunFacts f;
  f.run_id = "megatron";
  f.step = 20;
  f.latest = {{"grad/norm/total", 47}};
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK(d.cause == Cause::kNoPerParameterNorms);
  CHECK_FALSE(d.remedy.supported);
  CHECK(d.remedy.param.empty());
  CHECK_THAT(d.text, Contains("reports only its total grad norm, so no cause can be named"));
  CHECK_THAT(d.recommendation, Contains("gradwatch.torch.Watch") && Contains("grad/norm/<param>"));
  CHECK_THAT(d.text + d.recommendation, !Contains("norm gain") && !Contains("lm_head"));

  f.warmup.holds_pages = true;
  f.warmup.reason = "the run is in its first 200 steps (step 20, alerts.min_steps_before_page)";
  CHECK_THAT(Diagnose(f, DiagnosisBounds{}).recommendation,
             Contains("The run is in its warm-up (the run is in its first 200 steps"));
}

TEST_CASE("the diagnosis names the learning rate, the latest event, a change point and a rewind", "[alerts]") {
  RunFacts f = Run(78.4, 0, 0.12, 0.81);
  f.learning_rate.known = true;
  f.learning_rate.value = 2.8e-4;
  f.learning_rate.peak = 3e-4;
  f.learning_rate.peak_step = 2000;
  f.learning_rate.jump_step = 61200;
  f.learning_rate.jump_from = 2.8e-4;
  f.learning_rate.jump_to = 1e-3;
  f.slope_changes = {{"grad/norm/total", 61200, "switched routing", 2.1, 0.005, 0.0105, 30},
                     {"grad/norm/total", 70000, "in the future", 1, 1, 1, 0}};
  f.change_points = {{"grad/norm/total", 61300, 3.0, 0.005, 0.015, 8}};
  f.rewind = {60000, 61000};
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  CHECK_THAT(d.text, Contains("The learning rate is 2.8e-4, past its peak of 3e-4 at step 2,000; it jumped from "
                              "2.8e-4 to 0.001 at step 61,200."));
  CHECK_THAT(d.text, Contains("The latest event is at step 61,200 (\"switched routing\"), since when the grad "
                              "norm's slope is ×2.1; the grad norm's slope changed ×3 near step 61,300"));
  CHECK_THAT(d.text, Contains("The run rewound to step 60,000 (the abandoned branch reached step 61,000)."));
  CHECK_THAT(d.text, !Contains("in the future"));

  f.learning_rate.warming_up = true;
  f.learning_rate.jump_step = 0;
  CHECK_THAT(Diagnose(f, DiagnosisBounds{}).text,
             Contains("The learning rate is 2.8e-4, still rising in its warm-up."));
}

TEST_CASE("cause names are the annotation's values", "[alerts]") {
  CHECK(CauseName(Cause::kNone) == "none");
  CHECK(CauseName(Cause::kNoPerParameterNorms) == "no_per_parameter_norms");
  CHECK(CauseName(Cause::kNormGainInflatesOutput) == "norm_gain_inflates_output");
}

TEST_CASE("the what-if projects as far as analytics.projection_steps says", "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  f.learning_rate.known = true;
  f.learning_rate.value = 7.7e-4;
  f.projection_steps = 5000;
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  const gradwatch::analytics::NormDynamics dyn =
      gradwatch::analytics::EstimateDynamics(362.1, 2.5e-3, 7.7e-4, 0, NAN, NAN);
  const gradwatch::analytics::NormProjection p = gradwatch::analytics::ProjectNorm(362.1, dyn, 7.7e-4, 0.1, 5000);
  INFO(d.recommendation);
  CHECK_THAT(d.recommendation, Contains("goes from 362.1 to ~" + FormatNumber(p.norm_at_end) + " by step 66,500"));
}

TEST_CASE("with the run's schedule and last step known, the what-if follows the schedule to the run's end",
          "[alerts]") {
  RunFacts f = Run(362.1, 2.5, 0.939, 0.03);
  f.learning_rate.known = true;
  f.learning_rate.value = 7.7e-4;
  std::string why;
  f.config.total_steps = 70000;
  f.config.schedule =
      gradwatch::analytics::LearningRateSchedule::FromConfig(std::nullopt, 70000, {{"lr_schedule", "cosine"}}, &why);
  REQUIRE(why.empty());
  const Diagnosis d = Diagnose(f, DiagnosisBounds{});
  const gradwatch::analytics::NormDynamics dyn =
      gradwatch::analytics::EstimateDynamics(362.1, 2.5e-3, 7.7e-4, 0, NAN, NAN);
  const gradwatch::analytics::NormProjection p =
      gradwatch::analytics::ProjectNorm(362.1, dyn, 7.7e-4, 0.1, 20000, &f.config.schedule, 61500);
  INFO(d.recommendation);
  CHECK_THAT(d.recommendation,
             Contains("With weight decay 0.1 from step 61,500 (learning rate 7.7e-4, following its cosine schedule to "
                      "0 at step 70,000; final_norm.weight growing 2.5 per 1k steps without decay), final_norm.weight "
                      "goes from 362.1 to ~" +
                      FormatNumber(p.norm_at_end) + " by step 70,000, the run's last") &&
                 Contains("if its update's radial part (no update norm is reported, so no rotation) stays at its "
                          "recent value and the learning rate follows its schedule"));
}

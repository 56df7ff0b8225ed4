#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "alerts/diagnosis.h"
#include "alerts/recommendation.h"
#include "tests/unit/alerts/param_fact.h"

using namespace gradwatch::alerts;
using gradwatch::ParamKind;
using gradwatch::alerts::testing::Param;

namespace {

// The incident at step ~100k: final_norm.weight (wd 0, init sqrt(6144) = 78.38) at 362.1 and
// rising 2.5 per 1k steps, ×2.5 since the routing switch; the lm_head carries 93.9% of the
// squared grad norm; z-loss 1e-4; weight decay 0.1 elsewhere.
RunFacts Incident() {
  RunFacts f;
  f.run_id = "moe-incident-demo";
  f.step = 100000;
  f.config.z_loss_coef = 1e-4;
  f.config.weight_decay = 0.1;

  ParamFact final_norm = Param("final_norm.weight", ParamKind::kNormGain, 0);
  final_norm.info.role = "final_norm";
  final_norm.norm = 362.1;
  final_norm.init_norm = std::sqrt(6144.0);
  final_norm.amplification = 362.1 / std::sqrt(6144.0);
  final_norm.norm_slope_per_kstep = 2.5;
  ParamFact layer_norm = Param("layers.0.attn_norm.weight", ParamKind::kNormGain, 0);
  layer_norm.norm = 120;  // more amplified than nothing, less than the final norm
  ParamFact head = Param("lm_head.weight", ParamKind::kOutput, 0.1, 788'000'000);
  ParamFact mlp = Param("layers.0.mlp.w1", ParamKind::kMlp, 0.1, 1'000'000);
  f.params = {layer_norm, final_norm, head, mlp};

  f.shares = {{"lm_head.weight", false, 0.939, 0.01, ParamKind::kOutput},
              {"output", true, 0.939, 0.01},
              {"final_norm.weight", false, 0.0004, 0}};
  f.slope_changes = {
      {"params/norm/final_norm.weight", 60000, "lr decay starts", 0.9, 1.1, 1.0, 50},
      {"params/norm/final_norm.weight", 81716, "switched to near-dropless EP routing", 2.5, 1.0, 2.5, 50},
      {"grad/norm/total", 81716, "switched to near-dropless EP routing", 2.0, 0.005, 0.01, 50}};
  return f;
}

}  // namespace

TEST_CASE("the contingency recommendation names the final norm, the evidence and the action", "[alerts]") {
  const std::string text = Diagnose(Incident(), DiagnosisBounds{}).recommendation;
  CHECK(text ==
        "final_norm.weight has weight decay 0; its norm is 362.1, 4.62× its init norm 78.38, rising 2.5 "
        "per 1k steps (×2.5 since step 81,716: switched to near-dropless EP routing). lm_head.weight "
        "carries 93.9% of the squared grad norm; z-loss coefficient 1e-4. Recommendation: enable weight "
        "decay on final_norm.weight (the run uses 0.1 for its decayed parameters).");
  CHECK_THAT(text, Catch::Contains("4.6"));
}

TEST_CASE("the final norm is found by role, then by name, then by amplification", "[alerts]") {
  struct Case {
    const char* name;
    bool is_final;
  };
  const Case cases[] = {
      {"ln_f.weight", true},
      {"transformer.ln_f.weight", true},
      {"backbone.norm_f.weight", true},
      {"model.norm.weight", true},
      {"module.model.norm.weight", true},
      {"model.decoder.final_layernorm.weight", true},
      {"norm.weight", true},
      {"final_norm.scale", true},
      {"layers.3.norm.weight", false},
      {"model.layers.0.input_layernorm.weight", false},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    RunFacts f;
    ParamFact decoy = Param("layers.9.post_norm.weight", ParamKind::kNormGain, 0);
    decoy.amplification = 2;  // the fallback would pick it
    f.params = {decoy, Param(c.name, ParamKind::kNormGain, 0)};
    const ParamFact* found = FindFinalNorm(f);
    REQUIRE(found);
    CHECK((found->info.name == c.name) == c.is_final);
  }

  RunFacts by_role;
  ParamFact gain = Param("blocks.final.g", ParamKind::kNormGain, 0);
  gain.info.role = "final_norm";
  by_role.params = {Param("ln_f.weight", ParamKind::kNormGain, 0), gain};
  CHECK(FindFinalNorm(by_role)->info.name == "blocks.final.g");

  RunFacts by_amplification;
  ParamFact a = Param("blocks.1.n", ParamKind::kNormGain, 0);
  a.norm = 100;
  ParamFact b = Param("blocks.2.n", ParamKind::kNormGain, 0);
  b.norm = 300;
  by_amplification.params = {a, b, Param("ln_f.weight", ParamKind::kMlp, 0)};  // wrong kind: no name match
  CHECK(FindFinalNorm(by_amplification)->info.name == "blocks.2.n");

  RunFacts none;
  none.params = {Param("lm_head.weight", ParamKind::kOutput, 0.1)};
  CHECK(FindFinalNorm(none) == nullptr);
}

TEST_CASE("the suggested weight decay comes from the config, else the catalog's most common", "[alerts]") {
  RunFacts f = Incident();
  CHECK(DecayedParamsWeightDecay(f) == 0.1);
  f.config.weight_decay.reset();
  f.params.push_back(Param("a", ParamKind::kMlp, 0.05));
  f.params.push_back(Param("b", ParamKind::kMlp, 0.05));
  CHECK(DecayedParamsWeightDecay(f) == 0.05);
  CHECK_THAT(Diagnose(f, DiagnosisBounds{}).recommendation,
             Catch::Contains("(the run uses 0.05 for its decayed parameters)"));
  f.params = {Param("final_norm.weight", ParamKind::kNormGain, 0)};
  CHECK(DecayedParamsWeightDecay(f) == 0);
}

TEST_CASE("missing facts are left out of a gain's sentence", "[alerts]") {
  RunFacts f;
  f.params = {Param("final_norm.weight", ParamKind::kNormGain, 0)};
  CHECK(GainSentence(f, f.params[0]) == "final_norm.weight has weight decay 0");

  f.params[0].norm = 156.8;  // amplification from sqrt(numel), no slope, no event
  CHECK(GainSentence(f, f.params[0]) ==
        "final_norm.weight has weight decay 0; its norm is 156.8, 2× its init norm 78.38");

  RunFacts no_output;
  no_output.params = {Param("layers.0.mlp.w1", ParamKind::kMlp, 0.1)};
  no_output.shares = {{"layers.0.mlp.w1", false, 0.5, 0, ParamKind::kMlp}};
  CHECK(OutputShareSentence(no_output).empty());
  no_output.shares.push_back({"lm_head.weight", false, 0.5, 0, ParamKind::kOutput});
  no_output.params.push_back(Param("lm_head.weight", ParamKind::kOutput, 0.1));
  CHECK(OutputShareSentence(no_output) == "lm_head.weight carries 50% of the squared grad norm");
}

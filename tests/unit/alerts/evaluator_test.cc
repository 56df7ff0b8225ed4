#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "alerts/diagnosis.h"
#include "alerts/evaluator.h"

using namespace gradwatch::alerts;
using gradwatch::ParamKind;

namespace {

Rule LoadOne(const std::string& body) {
  auto rules =
      LoadRules("groups:\n  - name: g\n    rules:\n      - alert: R\n" + body + "        labels: {severity: warning}\n",
                "test.yaml");
  INFO(rules.status().message());
  REQUIRE(rules.ok());
  REQUIRE(rules->size() == 1);
  return (*rules)[0];
}

// The default rule set's rule of this kind (the last one, when there are several).
Rule DefaultRule(RuleKind kind) {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  const Rule* rule = nullptr;
  for (const Rule& r : *rules) {
    if (r.kind == kind) rule = &r;
  }
  REQUIRE(rule);
  return *rule;
}

RunFacts Facts(std::vector<SeriesValue> latest) {
  RunFacts f;
  f.run_id = "r1";
  f.step = 1000;
  f.latest = std::move(latest);
  SortLatest(f);
  return f;
}

const Condition* ByLabel(const std::vector<Condition>& cs, const std::string& name, const std::string& value) {
  for (const Condition& c : cs) {
    auto it = c.labels.find(name);
    if (it != c.labels.end() && it->second == value) return &c;
  }
  return nullptr;
}

ParamFact Param(const std::string& name, ParamKind kind, double wd) {
  ParamFact p;
  p.info.name = name;
  p.info.kind = kind;
  p.info.weight_decay = wd;
  p.info.numel = 6144;
  return p;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("threshold: one condition per matching series, NaN never active", "[alerts]") {
  const Rule rule =
      LoadOne("        kind: threshold\n        series: \"grad/norm/*\"\n        op: \">=\"\n        value: 5\n");
  RunFacts facts = Facts({{"grad/norm/total", 5.0},
                          {"grad/norm/a", 4.99},
                          {"grad/norm/b", NAN},
                          {"grad/norm/c", kInf},
                          {"params/norm/a", 100}});
  facts.run_labels = {{"job", "pretrain"}, {"severity", "overridden"}};
  const auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 4);
  const Condition* total = ByLabel(cs, "series", "grad/norm/total");
  REQUIRE(total);
  CHECK(total->active);
  CHECK(total->value == 5.0);
  CHECK(total->labels == LabelSet{{"alertname", "R"},
                                  {"run", "r1"},
                                  {"severity", "warning"},
                                  {"job", "pretrain"},
                                  {"series", "grad/norm/total"}});
  CHECK(total->vars.at("value") == "5");
  CHECK(total->vars.at("step") == "1,000");
  CHECK(total->vars.at("threshold") == "5");
  CHECK_FALSE(ByLabel(cs, "series", "grad/norm/a")->active);
  CHECK_FALSE(ByLabel(cs, "series", "grad/norm/b")->active);
  CHECK(ByLabel(cs, "series", "grad/norm/c")->active);
}

TEST_CASE("threshold: a series without a value at this step has no condition", "[alerts]") {
  const Rule rule =
      LoadOne("        kind: threshold\n        series: grad/norm/total\n        op: \"<\"\n        value: 1\n");
  CHECK(Evaluate(rule, Facts({{"train/loss", 0.5}})).empty());
  const auto cs = Evaluate(rule, Facts({{"grad/norm/total", 0.5}}));
  REQUIRE(cs.size() == 1);
  CHECK(cs[0].active);
}

TEST_CASE("forecast: active when the threshold is reached within the horizon", "[alerts]") {
  const Rule rule = LoadOne(
      "        kind: forecast\n        series: grad/norm/total\n        threshold: 5\n        within_steps: 20000\n");
  RunFacts facts = Facts({});
  facts.forecasts = {
      {"grad/norm/total", 5.0, true, 18000, 118000, 0.59, 0.245},
      {"grad/norm/total", 10.0, true, 5000, 105000, 0.59, 0.245},  // another threshold: ignored
  };
  auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 1);
  CHECK(cs[0].active);
  CHECK(cs[0].value == 0.59);
  CHECK(cs[0].vars.at("steps_to_threshold") == "18,000");
  CHECK(cs[0].vars.at("at_step") == "118,000");

  facts.forecasts[0].steps_to_threshold = 48000;
  CHECK_FALSE(Evaluate(rule, facts)[0].active);
  facts.forecasts[0] = {"grad/norm/total", 5.0, false, kInf, 0, 0.59, -0.1};
  cs = Evaluate(rule, facts);
  CHECK_FALSE(cs[0].active);
  CHECK(cs[0].vars.at("at_step") == "never");
  CHECK(cs[0].vars.at("outlook") == "is not rising toward 5");
  // Reached: no longer a forecast (the threshold's own rule pages).
  facts.forecasts[0] = {"grad/norm/total", 5.0, true, 0, 100000, 5.2, 0.25};
  CHECK_FALSE(Evaluate(rule, facts)[0].active);
  CHECK(Evaluate(rule, facts)[0].vars.at("outlook") == "is at or above 5");
}

TEST_CASE("forecast: a young fit goes pending only once it holds enough reports over enough steps", "[alerts]") {
  const Rule rule = LoadOne(
      "        kind: forecast\n        series: grad/norm/total\n        threshold: 5\n        within_steps: 20000\n");
  RunFacts facts = Facts({});
  facts.forecasts = {{"grad/norm/total", 5.0, true, 2694, 2700, 1.2, 1.4}};
  struct Case {
    uint64_t samples;
    uint64_t span;
    bool active;
  };
  // The built-in horizon of 20,000 steps needs 20 reports over 2,000 steps.
  for (const Case c : {Case{6, 5, false}, Case{19, 5000, false}, Case{300, 1999, false}, Case{20, 2000, true},
                       Case{0, 0, true} /* unknown: a fact built by hand */}) {
    INFO(c.samples << " reports over " << c.span << " steps");
    facts.forecasts[0].fit_samples = c.samples;
    facts.forecasts[0].fit_span_steps = c.span;
    const auto cs = Evaluate(rule, facts);
    REQUIRE(cs.size() == 1);
    CHECK(cs[0].active == c.active);
    if (!c.active) {
      CHECK(cs[0].vars.at("outlook") ==
            "has too few reports for a forecast toward 5 (" + FormatStep(c.span) + " steps so far)");
    } else {
      CHECK(cs[0].vars.at("outlook") == "reaches 5 in ~2,694 steps (near step 2,700)");
    }
  }
}

TEST_CASE("forecast: a crossing after the run's last step (config.total_steps) is said and does not hold", "[alerts]") {
  const Rule rule = LoadOne(
      "        kind: forecast\n        series: grad/norm/total\n        threshold: 5\n        within_steps: 200000\n");
  RunFacts facts = Facts({});
  facts.forecasts = {{"grad/norm/total", 5.0, true, 146000, 528000, 4.1, 0.006}};
  facts.config.total_steps = 390251;
  auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 1);
  CHECK_FALSE(cs[0].active);
  CHECK(cs[0].vars.at("outlook") ==
        "reaches 5 in ~146,000 steps (near step 528,000, after the run's last step 390,251)");
  // Before the end: it holds, and says so.
  facts.config.total_steps = 600000;
  cs = Evaluate(rule, facts);
  CHECK(cs[0].active);
  CHECK(cs[0].vars.at("outlook") ==
        "reaches 5 in ~146,000 steps (near step 528,000, before the run's last step 600,000)");
}

TEST_CASE("slope_change: events and change points are separate instances", "[alerts]") {
  const Rule at_event =
      LoadOne("        kind: slope_change\n        series: grad/norm/total\n        min_ratio: 1.5\n");
  RunFacts facts = Facts({});
  facts.slope_changes = {{"grad/norm/total", 81716, "switched to near-dropless EP routing", 2.1, 0.005, 0.0105, 40},
                         {"grad/norm/total", 60000, "lr warmup ended", 1.1, 0.005, 0.0055, 40},
                         {"train/loss", 81716, "switched", 3.0, -1, -3, 40}};
  facts.change_points = {{"grad/norm/total", 81700, 2.0, 0.005, 0.01}};

  auto cs = Evaluate(at_event, facts);
  REQUIRE(cs.size() == 2);
  const Condition* routing = ByLabel(cs, "event_step", "81716");
  REQUIRE(routing);
  CHECK(routing->active);
  CHECK(routing->labels.at("trigger") == "event");
  CHECK(routing->vars.at("event") == "switched to near-dropless EP routing");
  CHECK(routing->vars.at("event_step") == "81,716");
  CHECK(routing->vars.at("ratio") == "2.1");
  CHECK_FALSE(ByLabel(cs, "event_step", "60000")->active);

  Rule at_any = at_event;
  at_any.at = SlopeChangeAt::kAny;
  cs = Evaluate(at_any, facts);
  REQUIRE(cs.size() == 3);
  const Condition* cp = ByLabel(cs, "trigger", "change_point");
  REQUIRE(cp);
  CHECK(cp->active);
  CHECK(cp->labels.count("event_step") == 0);  // refined change points stay one instance
}

TEST_CASE("share: parameters by kind, groups by name", "[alerts]") {
  const Rule by_kind = LoadOne("        kind: share\n        param_kind: output\n        min_share: 0.9\n");
  RunFacts facts = Facts({});
  facts.params = {Param("lm_head.weight", ParamKind::kOutput, 0.1),
                  Param("final_norm.weight", ParamKind::kNormGain, 0)};
  facts.shares = {{"lm_head.weight", false, 0.939, 0.01, ParamKind::kOutput},
                  {"final_norm.weight", false, 0.001, 0, ParamKind::kNormGain},
                  {"output", true, 0.939, 0.01}};
  auto cs = Evaluate(by_kind, facts);
  REQUIRE(cs.size() == 1);
  CHECK(cs[0].active);
  CHECK(cs[0].labels.at("param") == "lm_head.weight");
  CHECK(cs[0].vars.at("share") == "93.9%");
  CHECK(cs[0].vars.at("min_share") == "90%");

  const Rule by_group = LoadOne("        kind: share\n        group: output\n        min_share: 0.95\n");
  cs = Evaluate(by_group, facts);
  REQUIRE(cs.size() == 1);
  CHECK(cs[0].labels.at("group") == "output");
  CHECK_FALSE(cs[0].active);
}

TEST_CASE("growth_without_decay: rising norm gains without decay above the amplification", "[alerts]") {
  const Rule rule =
      LoadOne("        kind: growth_without_decay\n        param_kind: norm_gain\n        min_amplification: 4\n");
  RunFacts facts = Facts({});
  ParamFact final_norm = Param("final_norm.weight", ParamKind::kNormGain, 0);
  final_norm.norm = 362.1;  // init: sqrt(6144) = 78.38 → 4.62×
  final_norm.norm_slope_per_kstep = 2.5;
  ParamFact flat = Param("layers.0.norm.weight", ParamKind::kNormGain, 0);
  flat.norm = 400;
  flat.norm_slope_per_kstep = -0.1;  // amplified but not rising
  ParamFact decayed = Param("layers.1.norm.weight", ParamKind::kNormGain, 0.1);
  decayed.norm = 400;
  decayed.norm_slope_per_kstep = 1;
  ParamFact head = Param("lm_head.weight", ParamKind::kOutput, 0);
  facts.params = {final_norm, flat, decayed, head};

  auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 2);  // the decayed gain and the output layer are not instances
  const Condition* fn = ByLabel(cs, "param", "final_norm.weight");
  REQUIRE(fn);
  CHECK(fn->active);
  CHECK(fn->value == Approx(362.1 / std::sqrt(6144.0)));
  CHECK(fn->vars.at("amplification") == "4.62");
  CHECK(fn->vars.at("init_norm") == "78.38");
  CHECK(fn->vars.at("weight_decay") == "0");
  CHECK_FALSE(ByLabel(cs, "param", "layers.0.norm.weight")->active);

  const Rule by_growth = LoadOne("        kind: growth_without_decay\n        min_growth: 0.05\n");
  facts.params = {final_norm};
  facts.params[0].growth_factor = 1.04;
  CHECK_FALSE(Evaluate(by_growth, facts)[0].active);
  facts.params[0].growth_factor = 1.08;
  cs = Evaluate(by_growth, facts);
  CHECK(cs[0].active);
  CHECK(cs[0].value == Approx(0.08));
  CHECK(cs[0].vars.at("growth") == "8%");
}

TEST_CASE("a reused condition list formats its variables on demand and keeps each instance's fingerprint", "[alerts]") {
  const Rule rule =
      LoadOne("        kind: growth_without_decay\n        param_kind: norm_gain\n        min_amplification: 4\n");
  RunFacts facts = Facts({});
  ParamFact a = Param("layers.0.input_layernorm.weight", ParamKind::kNormGain, 0);
  a.norm = 362.1;
  a.norm_slope_per_kstep = 2.5;
  ParamFact b = Param("layers.0.post_attention_layernorm.weight", ParamKind::kNormGain, 0);
  b.norm = 100;
  facts.params = {a, b};
  const LabelSet base = BaseLabels(rule, facts);
  ConditionList list;
  Evaluate(rule, facts, base, nullptr, list);
  REQUIRE(list.size() == 2);
  CHECK(list[0].fingerprint == Fingerprint(list[0].labels));
  CHECK(list[1].fingerprint == Fingerprint(list[1].labels));
  CHECK(list[0].fingerprint != list[1].fingerprint);
  CHECK(list[0].vars.at("amplification") == "4.62");
  CHECK(list[0].vars.at("slope") == "2.5");
  CHECK(list[1].vars.at("slope") == "unknown");
  CHECK_THROWS_AS(list[0].vars.at("no_such_variable"), std::out_of_range);
  // Every variable the kind sets, and "value" once although it is set twice.
  const TemplateVars formatted = list[0].vars.Format();
  CHECK(formatted.at("param") == "layers.0.input_layernorm.weight");
  CHECK(formatted.at("run") == facts.run_id);
  CHECK(formatted.count("value") == 1);

  // The next step: the slots are reused in another order of parameters and with other values.
  facts.params = {b, a};
  facts.params[0].norm_slope_per_kstep = 1.25;
  facts.params[1].norm = 400;
  Evaluate(rule, facts, base, nullptr, list);
  REQUIRE(list.size() == 2);
  CHECK(list[0].labels.at("param") == "layers.0.post_attention_layernorm.weight");
  CHECK(list[0].fingerprint == Fingerprint(list[0].labels));
  CHECK(list[1].fingerprint == Fingerprint(list[1].labels));
  CHECK(list[0].vars.at("slope") == "1.25");
  CHECK(list[1].vars.at("norm") == "400");
  CHECK(list[1].vars.at("amplification") == "5.103");
  CHECK(list[1].vars.Format().size() == formatted.size());
}

TEST_CASE("non_finite: NaN or Inf in any norm or the loss", "[alerts]") {
  const Rule nonfinite = DefaultRule(RuleKind::kNonFinite);
  const Rule* rule = &nonfinite;
  RunFacts facts = Facts({{"grad/norm/total", 0.4},
                          {"params/norm/final_norm.weight", kInf},
                          {"train/loss", NAN},
                          {"optim/learning_rate", NAN}});  // not watched by default
  facts.nonfinite = {{"updates/norm/lm_head.weight", 1000}};
  auto cs = Evaluate(*rule, facts);
  REQUIRE(cs.size() == 4);
  CHECK_FALSE(ByLabel(cs, "series", "grad/norm/total")->active);
  CHECK(ByLabel(cs, "series", "params/norm/final_norm.weight")->active);
  CHECK(ByLabel(cs, "series", "train/loss")->active);
  CHECK(ByLabel(cs, "series", "train/loss")->vars.at("value") == "NaN");
  CHECK(ByLabel(cs, "series", "updates/norm/lm_head.weight")->active);
}

TEST_CASE("non_finite: a count of NaN iterations above 0 is non-finite, and skipped iterations when listed",
          "[alerts]") {
  const Rule nonfinite = DefaultRule(RuleKind::kNonFinite);
  const Rule* rule = &nonfinite;
  // A Megatron line with NaN iterations prints no loss: the count is all the rule gets.
  RunFacts facts = Facts({{"train/nan_iterations", 2}, {"train/skipped_iterations", 3}});
  auto cs = Evaluate(*rule, facts);
  REQUIRE(cs.size() == 1);  // skipped iterations are routine under fp16 loss scaling: not by default
  CHECK(cs[0].active);
  CHECK(cs[0].labels.at("series") == "train/nan_iterations");
  CHECK(cs[0].vars.at("value") == "2");
  facts = Facts({{"train/nan_iterations", 0}});
  cs = Evaluate(*rule, facts);
  REQUIRE(cs.size() == 1);
  CHECK_FALSE(cs[0].active);  // resolves the instance

  const Rule skipped = LoadOne("        kind: non_finite\n        series: [train/skipped_iterations]\n");
  CHECK(Evaluate(skipped, Facts({{"train/skipped_iterations", 1}}))[0].active);
  CHECK_FALSE(Evaluate(skipped, Facts({{"train/skipped_iterations", 0}}))[0].active);
  // Any other finite value stays finite, however large.
  const Rule other = LoadOne("        kind: non_finite\n        series: [train/loss_scale]\n");
  CHECK_FALSE(Evaluate(other, Facts({{"train/loss_scale", 65536}}))[0].active);
}

TEST_CASE("remediation: judged after half a time constant, active beyond max_departure, with its verdict", "[alerts]") {
  const Rule rule = DefaultRule(RuleKind::kRemediation);
  RunFacts facts = Facts({});
  RemediationFact r{.param = "final_norm.weight",
                    .step = 3001,
                    .weight_decay = 0.1,
                    .norm_at_step = 300,
                    .projected_norm = 100,
                    .unchanged_norm = 400,
                    .actual_norm = 390,
                    .time_constant_steps = 10000};
  facts.remediations = {r};
  // 4,999 steps after the change: under half a time constant, not judged however far off.
  facts.step = 8000;
  auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 1);
  CHECK_FALSE(cs[0].active);
  CHECK(cs[0].labels.at("param") == "final_norm.weight");
  CHECK(cs[0].labels.at("remediation_step") == "3001");
  CHECK(cs[0].vars.at("verdict") == "too early");
  CHECK(cs[0].vars.at("finding").empty());
  // From half a time constant on: 290% off, nearer the path without the change.
  facts.step = 8001;
  cs = Evaluate(rule, facts);
  CHECK(cs[0].active);
  CHECK(cs[0].vars.at("departure") == "290%");
  CHECK(cs[0].vars.at("max_departure") == "25%");
  CHECK(cs[0].vars.at("verdict") == "not working");
  CHECK_THAT(cs[0].vars.at("finding"), Catch::Contains("follows the path it had without the change"));
  CHECK(cs[0].vars.at("elapsed_steps") == "5,000");
  // Off, but nearer the projection than the old path: slower than projected.
  facts.remediations[0].actual_norm = 200;
  cs = Evaluate(rule, facts);
  CHECK(cs[0].active);
  CHECK(cs[0].vars.at("verdict") == "slower than projected");
  // Below it: faster.
  facts.remediations[0].actual_norm = 70;
  cs = Evaluate(rule, facts);
  CHECK(cs[0].active);
  CHECK(cs[0].vars.at("verdict") == "faster than projected");
  // Within 25%: working, not active; the level clears below 20%.
  facts.remediations[0].actual_norm = 118;
  cs = Evaluate(rule, facts);
  CHECK_FALSE(cs[0].active);
  CHECK(cs[0].vars.at("verdict") == "working");
  REQUIRE(cs[0].level);
  CHECK(cs[0].level->clear_bound == 0.2);
  // No decay, no time constant: never judged.
  facts.remediations[0].time_constant_steps = std::numeric_limits<double>::infinity();
  facts.remediations[0].actual_norm = 390;
  CHECK_FALSE(Evaluate(rule, facts)[0].active);
  // A param glob filters.
  const Rule other = LoadOne("        kind: remediation\n        param: \"layers.*\"\n        max_departure: 0.5\n");
  CHECK(Evaluate(other, facts).empty());
}

TEST_CASE("stalled: an open run silent for the limit", "[alerts]") {
  const Rule rule = LoadOne("        kind: stalled\n        seconds: 600\n");
  RunFacts facts = Facts({});
  facts.open_streams = 8;
  facts.seconds_since_last_step = 599;
  auto cs = Evaluate(rule, facts);
  REQUIRE(cs.size() == 1);
  CHECK_FALSE(cs[0].active);
  CHECK(cs[0].labels == LabelSet{{"alertname", "R"}, {"run", "r1"}, {"severity", "warning"}});
  facts.seconds_since_last_step = 600;
  CHECK(Evaluate(rule, facts)[0].active);
  facts.open_streams = 0;  // finished, not hung
  CHECK_FALSE(Evaluate(rule, facts)[0].active);
}

TEST_CASE("every default rule matches an incident-shaped run and renders its annotations", "[alerts]") {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  RunFacts facts = Facts({{"grad/norm/total", 5.2}, {"train/loss", NAN}});
  facts.run_id = "moe-incident-demo";
  facts.step = 100000;
  facts.open_streams = 8;
  facts.seconds_since_last_step = 900;
  facts.forecasts = {{"grad/norm/total", 5.0, true, 800, 100800, 4.8, 0.25}};
  facts.slope_changes = {{"grad/norm/total", 81716, "switched to near-dropless EP routing", 2.0, 0.005, 0.01, 40}};
  ParamFact final_norm = Param("final_norm.weight", ParamKind::kNormGain, 0);
  final_norm.norm = 362.1;
  final_norm.growth_factor = 1.1;
  final_norm.growth_slope_per_kstep = 2.5;
  facts.params = {final_norm, Param("lm_head.weight", ParamKind::kOutput, 0.1)};
  facts.shares = {{"lm_head.weight", false, 0.939, 0.01, ParamKind::kOutput}};

  // final_norm.weight got weight decay 0.1 at step 60,000 and did not come down.
  facts.remediations = {{.param = "final_norm.weight",
                         .step = 60000,
                         .weight_decay = 0.1,
                         .norm_at_step = 300,
                         .projected_norm = 110,
                         .unchanged_norm = 360,
                         .actual_norm = 362.1,
                         .time_constant_steps = 10000}};

  RunFacts gone = facts;  // the same run once its job vanished without a Goodbye
  gone.open_streams = 0;
  gone.seconds_since_activity = 900;

  for (const Rule& rule : *rules) {
    INFO(rule.name);
    const auto cs = Evaluate(rule, rule.kind == RuleKind::kRunDied ? gone : facts);
    REQUIRE(cs.size() >= 1);
    const Condition* active = nullptr;
    for (const Condition& c : cs) {
      if (c.active) active = &c;
    }
    REQUIRE(active);
    TemplateVars vars = active->vars.Format();
    vars["recommendation"] = "enable weight decay on final_norm.weight";
    vars["diagnosis"] = Diagnose(facts, DiagnosisBounds{}).text;
    for (const auto& [name, text] : rule.annotations) {
      const std::string rendered = RenderTemplate(text, vars, active->labels);
      INFO(name << ": " << rendered);
      CHECK_FALSE(rendered.empty());
      CHECK(rendered.find("{{") == std::string::npos);
      CHECK(rendered.find("unknown") == std::string::npos);
      CHECK(rendered.find("  ") == std::string::npos);  // no variable rendered empty mid-sentence
    }
  }
}

TEST_CASE("the fits the rules read: growth and share selections, the recommendation's norm gains", "[evaluator]") {
  std::vector<gradwatch::ParamInfo> catalog(5);
  catalog[0] = {.name = "layers.0.attn_norm.weight", .kind = ParamKind::kNormGain};
  catalog[1] = {.name = "layers.0.mlp.weight", .kind = ParamKind::kOther, .weight_decay = 0.1};
  catalog[2] = {.name = "lm_head.weight", .kind = ParamKind::kOutput, .weight_decay = 0.1};
  catalog[3] = {.name = "norm_out", .kind = ParamKind::kOther, .role = "final_norm"};
  catalog[4] = {.name = "layers.1.mlp.weight", .kind = ParamKind::kOther, .weight_decay = 0.1};
  const Rule growth = DefaultRule(RuleKind::kGrowthWithoutDecay);  // param_kind: norm_gain
  const Rule share = DefaultRule(RuleKind::kShare);                // param_kind: output
  std::vector<uint8_t> norm, share_fits;

  RulesReadFits({growth, share}, false, catalog, 0, norm, share_fits);
  CHECK(norm == std::vector<uint8_t>{1, 0, 0, 0, 0});
  CHECK(share_fits == std::vector<uint8_t>{0, 0, 1, 0, 0});
  CHECK(GrowthRuleSelects(growth, catalog[0]));
  CHECK_FALSE(GrowthRuleSelects(growth, catalog[1]));
  CHECK(ShareRuleSelectsParam(share, catalog[2].name, catalog[2].kind));

  // The recommendation reads the norm of whichever parameter FindFinalNorm may pick.
  RulesReadFits({growth, share}, true, catalog, 0, norm, share_fits);
  CHECK(norm == std::vector<uint8_t>{1, 0, 0, 1, 0});

  // Marks are only added; `from` skips entries already marked; a glob on any kind selects by name.
  const Rule any_mlp = LoadOne(
      "        kind: growth_without_decay\n        param: 'layers.*.mlp.weight'\n        min_growth: 0.05\n"
      "        max_weight_decay: 0.2\n");
  RulesReadFits({any_mlp}, false, catalog, 4, norm, share_fits);
  CHECK(norm == std::vector<uint8_t>{1, 0, 0, 1, 1});
  RulesReadFits({any_mlp}, false, catalog, 0, norm, share_fits);
  CHECK(norm == std::vector<uint8_t>{1, 1, 0, 1, 1});
  // max_weight_decay: a parameter with more decay than the rule allows is not judged.
  const Rule no_decay = LoadOne("        kind: growth_without_decay\n        param: '*'\n        min_growth: 0.05\n");
  std::vector<uint8_t> only;
  RulesReadFits({no_decay}, false, catalog, 0, only, share_fits);
  CHECK(only == std::vector<uint8_t>{1, 0, 0, 1, 0});
  // A share rule on groups alone reads no parameter's share slope.
  const Rule groups = LoadOne("        kind: share\n        group: '*'\n        min_share: 0.5\n");
  std::vector<uint8_t> shares;
  RulesReadFits({groups}, false, catalog, 0, only, shares);
  CHECK(shares == std::vector<uint8_t>(5, 0));
}

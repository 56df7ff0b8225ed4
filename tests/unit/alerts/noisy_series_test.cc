// The default rules on noisy series (state_machine.h, "Noisy series"): one page per crossing of
// a trend, none for lone spikes, reported every step and every 10 steps, with seeds of our own.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "alerts/state_machine.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch;
using namespace gradwatch::alerts;
using gradwatch::alerts::testing::DefaultRule;

namespace {

constexpr double kT0 = 1'790'000'000.0;

struct Outcome {
  std::vector<Transition> fired;     // notified firings
  std::vector<Transition> resolved;  // notified resolves
};

// Reports steps 0, every, 2·every, ... < end to a fresh engine holding `rule`. The value reported
// at a step is trend(step) × exp(N(0, sigma)), times spike(step); `put` writes it into the facts.
Outcome Drive(const Rule& rule, uint64_t end, uint64_t every, uint64_t seed,
              const std::function<double(uint64_t)>& trend, double sigma,
              const std::function<void(RunFacts&, double)>& put,
              const std::function<double(uint64_t)>& spike = nullptr) {
  AlertEngine engine({rule});
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, sigma);
  Outcome out;
  for (uint64_t step = 0; step < end; step += every) {
    double value = trend(step) * std::exp(noise(rng));
    if (spike) value *= spike(step);
    RunFacts f;
    f.run_id = "r1";
    f.step = step;
    f.now = kT0 + static_cast<double>(step);
    f.open_streams = 1;
    put(f, value);
    SortLatest(f);
    for (Transition& t : engine.EvaluateStep(f, f.now)) {
      if (t.to == AlertState::kFiring && t.notify)
        out.fired.push_back(std::move(t));
      else if (t.to == AlertState::kResolved && t.notify)
        out.resolved.push_back(std::move(t));
    }
  }
  return out;
}

void PutTotal(RunFacts& f, double v) { f.latest = {{"grad/norm/total", v}}; }

// Rises 4 → 6 over steps 0..10,000 (through 5 at 5,000), stays at 6 to 16,000, then falls to 4.
double RiseHoldFall(uint64_t step) {
  if (step < 10'000) return 4.0 + 2.0 * static_cast<double>(step) / 10'000.0;
  return step < 16'000 ? 6.0 : 4.0;
}

const uint64_t kSeeds[] = {11, 23, 37, 41, 59};

}  // namespace

TEST_CASE("a trend rising through 5 under 5% noise pages once, near 5, and resolves once after it falls", "[alerts]") {
  const Rule rule = DefaultRule("GradNormContingency");
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(rule, 20'000, every, seed, RiseHoldFall, 0.05, PutTotal);
      REQUIRE(o.fired.size() == 1);
      const double trend_at_fire = RiseHoldFall(o.fired[0].alert.step);
      CHECK(trend_at_fire >= 5.0 * 0.95);
      CHECK(trend_at_fire <= 5.0 * 1.05);
      CHECK(o.fired[0].alert.value >= 5.0);  // the level that fired it, not a lone report

      REQUIRE(o.resolved.size() == 1);
      const Transition& r = o.resolved[0];
      CHECK(r.alert.step >= 16'000);  // never while the trend stays above
      CHECK(r.alert.step <= 16'000 + 10 * every);
      CHECK(r.alert.value == Approx(4.0).epsilon(0.05));  // the level that resolved it
      CHECK(r.alert.annotations.at("summary") == "Total grad norm back to " + FormatNumber(r.alert.value) +
                                                     " (below 4.5) at step " + FormatStep(r.alert.step) + " in run r1");
    }
  }
}

TEST_CASE("lone x1.6 spikes from a level of 3.2 never page", "[alerts]") {
  const Rule rule = DefaultRule("GradNormContingency");
  auto spike = [](uint64_t step) { return step % 1'000 == 500 ? 1.6 : 1.0; };
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(
          rule, 30'000, every, seed, [](uint64_t) { return 3.2; }, 0.05, PutTotal, spike);
      CHECK(o.fired.empty());
    }
  }
}

TEST_CASE("a sustained jump from 2 to 6 pages within for_steps plus a few reports", "[alerts]") {
  const Rule rule = DefaultRule("GradNormContingency");
  auto jump = [](uint64_t step) { return step < 10'000 ? 2.0 : 6.0; };
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(rule, 12'000, every, seed, jump, 0.05, PutTotal);
      REQUIRE(o.fired.size() == 1);
      CHECK(o.fired[0].alert.step >= 10'000 + rule.for_steps);
      CHECK(o.fired[0].alert.step <= 10'000 + rule.for_steps + 5 * every);
    }
  }
}

TEST_CASE("on clean data the page keeps its exact timing", "[alerts]") {
  const Rule rule = DefaultRule("GradNormContingency");
  // A ramp below the threshold, then a step above it at s0 = 5,000.
  auto clean = [](uint64_t step) { return step < 5'000 ? 1.0 + 3.84 * static_cast<double>(step) / 5'000.0 : 5.5; };
  for (uint64_t every : {1u, 10u}) {
    INFO("every " << every);
    const Outcome o = Drive(rule, 6'000, every, 1, clean, 0.0, PutTotal);
    REQUIRE(o.fired.size() == 1);
    CHECK(o.fired[0].alert.step == 5'010);
    CHECK(o.fired[0].alert.value == 5.5);
  }
}

TEST_CASE("the forecast warning fires once as the forecast comes within its horizon, and resolves once", "[alerts]") {
  const Rule rule = DefaultRule("GradNormForecast");
  // The true distance to 5 shrinks one step per step and reaches the 20,000-step horizon at step
  // 40,000; the forecast scatters 5% around it. At 60,000 the trend flattens: 200,000 steps away.
  // The warning waits for for_steps and for the forecast's level to be significantly within the
  // horizon: with 5% scatter that is about 800 steps more.
  auto steps_to = [](uint64_t step) { return step < 60'000 ? 60'000.0 - static_cast<double>(step) : 200'000.0; };
  auto put = [](RunFacts& f, double steps) {
    f.forecasts = {{.key = "grad/norm/total",
                    .threshold = 5,
                    .reachable = true,
                    .steps_to_threshold = steps,
                    .at_step = f.step + static_cast<uint64_t>(steps),
                    .current_value = 4.0,
                    .slope_per_kstep = 0.01}};
  };
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(rule, 80'000, every, seed, steps_to, 0.05, put);
      REQUIRE(o.fired.size() == 1);
      const double true_steps = steps_to(o.fired[0].alert.step);
      CHECK(true_steps <= 20'000 * 1.05);
      CHECK(true_steps >= 20'000 * 0.9 - static_cast<double>(rule.for_steps));
      REQUIRE(o.resolved.size() == 1);
      CHECK(o.resolved[0].alert.step >= 60'000 + rule.resolve_for_steps);
    }
  }
}

TEST_CASE("the lm_head share warning does not flap on a noisy share", "[alerts]") {
  const Rule rule = DefaultRule("LmHeadGradShareHigh");
  // 0.85 → 0.95 over 20,000 steps (through 0.9 at 10,000), then down to 0.8 from 30,000.
  auto share = [](uint64_t step) {
    if (step < 20'000) return 0.85 + 0.1 * static_cast<double>(step) / 20'000.0;
    return step < 30'000 ? 0.95 : 0.80;
  };
  auto put = [](RunFacts& f, double s) {
    ParamFact p;
    p.info.name = "lm_head.weight";
    p.info.kind = ParamKind::kOutput;
    f.params = {p};
    f.shares = {{.name = "lm_head.weight", .is_group = false, .share = std::min(s, 1.0), .kind = ParamKind::kOutput}};
  };
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(rule, 35'000, every, seed, share, 0.03, put);
      REQUIRE(o.fired.size() == 1);
      const double at_fire = share(o.fired[0].alert.step);
      CHECK(at_fire >= 0.9 * 0.95);
      CHECK(at_fire <= 0.9 * 1.05);
      REQUIRE(o.resolved.size() == 1);
      CHECK(o.resolved[0].alert.step >= 30'000);
      CHECK(o.resolved[0].alert.annotations.at("summary").find(FormatPercent(o.resolved[0].alert.value)) !=
            std::string::npos);
    }
  }
}

TEST_CASE("the norm-gain growth warning does not flap on a noisy amplification", "[alerts]") {
  const Rule rule = DefaultRule("NormGainGrowingWithoutDecay");
  // Amplification 3.5 → 4.5 over 20,000 steps (through 4 at 10,000), then back to 3.5.
  auto amplification = [](uint64_t step) {
    if (step < 20'000) return 3.5 + static_cast<double>(step) / 20'000.0;
    return step < 30'000 ? 4.5 : 3.5;
  };
  auto put = [](RunFacts& f, double a) {
    ParamFact p;
    p.info.name = "final_norm.weight";
    p.info.kind = ParamKind::kNormGain;
    p.info.numel = 6144;
    p.init_norm = std::sqrt(6144.0);
    p.amplification = a;
    p.norm = a * std::sqrt(6144.0);
    p.norm_slope_per_kstep = 1.0;
    f.params = {p};
  };
  for (uint64_t every : {1u, 10u}) {
    for (uint64_t seed : kSeeds) {
      INFO("every " << every << " seed " << seed);
      const Outcome o = Drive(rule, 35'000, every, seed, amplification, 0.03, put);
      REQUIRE(o.fired.size() == 1);
      const double at_fire = amplification(o.fired[0].alert.step);
      CHECK(at_fire >= 4.0 * 0.95);
      CHECK(at_fire <= 4.0 * 1.05);
      REQUIRE(o.resolved.size() == 1);
      CHECK(o.resolved[0].alert.step >= 30'000);
    }
  }
}

TEST_CASE("a slope change fires only once its error bars clear min_ratio", "[alerts]") {
  const Rule rule = DefaultRule("GradNormSlopeChangeAtEvent");  // min_ratio 1.5
  AlertEngine engine({rule});
  RunFacts f;
  f.run_id = "r1";
  f.step = 20'011;
  f.now = kT0;
  // Eleven samples after the event: a huge ratio with a huge error.
  f.slope_changes = {{.key = "grad/norm/total",
                      .event_step = 20'000,
                      .event_text = "switch",
                      .ratio = 87.67,
                      .before_per_kstep = 0.01,
                      .after_per_kstep = 0.8767,
                      .after_samples = 11,
                      .before_stderr_per_kstep = 0.001,
                      .after_stderr_per_kstep = 0.9}};
  CHECK(engine.EvaluateStep(f, kT0).empty());
  // Later: ×3 ± a little. Fires, showing the estimate.
  f.step = 22'000;
  f.slope_changes[0].ratio = 3.1;
  f.slope_changes[0].after_per_kstep = 0.031;
  f.slope_changes[0].after_stderr_per_kstep = 0.004;
  auto ts = engine.EvaluateStep(f, kT0 + 1);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].alert.value == Approx(3.1));
  // An unknown error (fewer than 3 samples after the event) is no evidence at all.
  AlertEngine fresh({rule});
  f.slope_changes[0].after_stderr_per_kstep = NAN;
  CHECK(fresh.EvaluateStep(f, kT0).empty());
}

TEST_CASE("a change point fires only once its z-score puts the ratio above min_ratio", "[alerts]") {
  auto rules = LoadRules(
      "groups:\n  - name: g\n    rules:\n      - alert: Bend\n        kind: slope_change\n"
      "        series: grad/norm/total\n        at: change_point\n        min_ratio: 1.5\n"
      "        labels: {severity: warning}\n",
      "test.yaml");
  REQUIRE(rules.ok());
  AlertEngine engine(*rules);
  RunFacts f;
  f.run_id = "r1";
  f.step = 30'000;
  f.now = kT0;
  // A doubling whose slope difference is 1.5 standard errors: the ratio's low end is 0.33.
  f.change_points = {{.key = "grad/norm/total",
                      .step = 25'000,
                      .ratio = 2.0,
                      .before_per_kstep = 1.0,
                      .after_per_kstep = 2.0,
                      .z_score = 1.5}};
  CHECK(engine.EvaluateStep(f, kT0).empty());
  // Ten standard errors: the low end is 1.8.
  f.step = 31'000;
  f.change_points[0].z_score = 10;
  auto ts = engine.EvaluateStep(f, kT0 + 1);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].alert.value == Approx(2.0));
}

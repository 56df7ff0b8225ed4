#include <catch2/catch.hpp>

#include <cmath>

#include "server/runs/run_analytics.h"

using namespace gradwatch;
using namespace gradwatch::runs;

namespace {

std::vector<ParamInfo> Catalog() {
  return {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
          {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1},
          {.name = "mlp.weight", .numel = 1000, .kind = ParamKind::kMlp, .weight_decay = 0.1}};
}

// Series ids as a run would create them.
enum : SeriesId { kTotal, kFinalNormGrad, kFinalNormNorm, kLmHeadGrad, kLmHeadNorm, kMlpGrad, kTrainAcc };

RunAnalytics Make(const AnalyticsOptions& options = {}) {
  RunAnalytics a(options);
  a.SetCatalog(Catalog());
  a.AddSeries(kTotal, "grad/norm/total");
  a.AddSeries(kFinalNormGrad, "grad/norm/final_norm.weight");
  a.AddSeries(kFinalNormNorm, "params/norm/final_norm.weight");
  a.AddSeries(kLmHeadGrad, "grad/norm/lm_head.weight");
  a.AddSeries(kLmHeadNorm, "params/norm/lm_head.weight");
  a.AddSeries(kMlpGrad, "grad/norm/mlp.weight");
  a.AddSeries(kTrainAcc, "train/accuracy");
  return a;
}

CompletedStep Step(uint64_t step, double lm_head_grad, double mlp_grad, double final_norm) {
  CompletedStep s;
  s.step = step;
  s.values = {{kLmHeadGrad, lm_head_grad},
              {kMlpGrad, mlp_grad},
              {kTotal, std::hypot(lm_head_grad, mlp_grad)},
              {kFinalNormNorm, final_norm},
              {kLmHeadNorm, 500.0}};
  return s;
}

}  // namespace

TEST_CASE("shares of the squared grad norm are computed per parameter and per group", "[runs]") {
  RunAnalytics a = Make();
  for (uint64_t s = 1; s <= 100; ++s) a.OnStep(Step(s, 4.0, 3.0, 78.4));
  const RunAnalysis r = a.Analysis();
  REQUIRE_FALSE(r.shares.empty());
  CHECK(r.shares[0].share == Approx(0.64));  // 16 / 25
  bool mlp_group = false;
  for (const auto& s : r.shares) {
    if (s.is_group && s.name == "mlp") {
      mlp_group = true;
      CHECK(s.share == Approx(0.36));
    }
  }
  CHECK(mlp_group);
}

TEST_CASE("a norm gain without decay that rises is reported with its amplification", "[runs]") {
  RunAnalytics a = Make();
  const double init = std::sqrt(6144.0);
  for (uint64_t s = 0; s <= 20000; s += 10) a.OnStep(Step(s, 4.0, 3.0, init + 0.01 * s));
  const RunAnalysis r = a.Analysis();
  REQUIRE(r.amplifications.size() == 1);
  CHECK(r.amplifications[0].param == "final_norm.weight");
  CHECK(r.amplifications[0].amplification == Approx((init + 200.0) / init));
  REQUIRE(r.growth_without_decay.size() == 1);  // lm_head has weight decay, mlp has no norm series
  CHECK(r.growth_without_decay[0].param == "final_norm.weight");
  CHECK(r.growth_without_decay[0].slope_per_kstep == Approx(10.0));
}

TEST_CASE("slopes are reported for every series and window, and forecasts use the forecast window", "[runs]") {
  RunAnalytics a = Make();
  for (uint64_t s = 0; s <= 10000; ++s) {
    CompletedStep step = Step(s, 0.3 + 1e-5 * s, 0.0, 78.4);
    step.values.push_back({kTrainAcc, 0.5});
    a.OnStep(step);
  }
  const RunAnalysis r = a.Analysis();
  int total_windows = 0;
  for (const auto& sl : r.slopes) {
    if (sl.key == "grad/norm/total") {
      ++total_windows;
      CHECK(sl.fit.slope_per_kstep() == Approx(0.01));
    }
  }
  CHECK(total_windows == 3);
  REQUIRE(r.forecasts.size() == 1);
  CHECK(r.forecasts[0].reachable);
  CHECK(r.forecasts[0].window_steps == 20000);  // the default forecast_window_steps
  CHECK(r.forecasts[0].at_step == Approx(470000));
  CHECK(r.forecasts[0].steps_to_threshold == Approx((5.0 - 0.4) / 1e-5));
}

TEST_CASE("an event known before its steps (journal restore order) still gets its slope change", "[runs]") {
  RunAnalytics a = Make();
  a.OnEvent({.step = 5000, .text = "routing switch"});
  for (uint64_t s = 0; s <= 8000; ++s) {
    const double v = s < 5000 ? 0.3 + 1e-5 * s : 0.35 + 2e-5 * (s - 5000.0);
    a.OnStep(Step(s, v, 0.0, 78.4));
  }
  const RunAnalysis r = a.Analysis();
  bool found = false;
  for (const auto& c : r.slope_changes) {
    if (c.key != "grad/norm/total") continue;
    found = true;
    CHECK(c.event_text == "routing switch");
    CHECK(c.change.ratio == Approx(2.0).epsilon(1e-6));
  }
  CHECK(found);
}

TEST_CASE("one-step spikes in sparse reports do not bend the slope change at an event", "[runs]") {
  // A report every 50 steps; the slope doubles at the event; every 4,000 steps one report is ×1.5.
  RunAnalytics a = Make();
  a.OnEvent({.step = 81716, .text = "switched to near-dropless EP routing"});
  for (uint64_t s = 70000; s <= 90000; s += 50) {
    double v = s < 81716 ? 0.4 + 5e-6 * (s - 70000.0) : 0.4585 + 1e-5 * (s - 81716.0);
    if (s % 4000 == 0) v *= 1.5;
    a.OnStep(Step(s, v, 0.0, 78.4));
  }
  bool found = false;
  for (const auto& c : a.Analysis().slope_changes) {
    if (c.key != "grad/norm/total") continue;
    found = true;
    CHECK(c.change.ratio == Approx(2.0).epsilon(0.02));  // plain least squares on raw reports: ×1.67
  }
  CHECK(found);
}

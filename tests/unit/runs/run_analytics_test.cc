#include <catch2/catch.hpp>

#include <algorithm>

#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

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

// `prefix` goes before every parameter's name: another run's catalog of the same shape.
RunAnalytics Make(const AnalyticsOptions& options = {}, const std::string& prefix = "") {
  RunAnalytics a(options);
  std::vector<ParamInfo> catalog = Catalog();
  for (ParamInfo& p : catalog) p.name = prefix + p.name;
  a.SetCatalog(catalog);
  a.AddSeries(kTotal, "grad/norm/total");
  a.AddSeries(kFinalNormGrad, "grad/norm/" + prefix + "final_norm.weight");
  a.AddSeries(kFinalNormNorm, "params/norm/" + prefix + "final_norm.weight");
  a.AddSeries(kLmHeadGrad, "grad/norm/" + prefix + "lm_head.weight");
  a.AddSeries(kLmHeadNorm, "params/norm/" + prefix + "lm_head.weight");
  a.AddSeries(kMlpGrad, "grad/norm/" + prefix + "mlp.weight");
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

// Every figure of an analysis, exactly (hex floats), in its order.
std::string Exact(const RunAnalysis& r) {
  std::ostringstream out;
  out << std::hexfloat;
  for (const auto& s : r.slopes) {
    out << "slope " << s.key << " " << s.window_steps << " " << s.fit.samples << " " << s.fit.slope_per_step << "\n";
  }
  for (const auto& c : r.slope_changes) {
    out << "change " << c.key << " " << c.event_text << " " << c.change.event_step << " " << c.change.ratio << " "
        << c.change.before.samples << " " << c.change.after.samples << " " << c.change.before_stderr_per_kstep << " "
        << c.change.after_stderr_per_kstep << " " << c.after_samples << "\n";
  }
  for (const auto& c : r.change_points)
    out << "point " << c.key << " " << c.change.step << " " << c.change.ratio << "\n";
  for (const auto& f : r.forecasts) out << "forecast " << f.key << " " << f.steps_to_threshold << "\n";
  for (const auto& s : r.shares) out << "share " << s.name << " " << s.share << " " << s.slope_per_kstep << "\n";
  for (const auto& g : r.growth_without_decay) out << "growth " << g.param << " " << g.growth_factor << "\n";
  return out.str();
}

// The total grad norm of the order-independence tests: slope changes at 6,000 and 12,000, 3%
// deterministic noise and a spike every 997 steps.
double Noisy(uint64_t s) {
  double v = s < 6000 ? 0.3 + 1e-5 * s : s < 12000 ? 0.36 + 2e-5 * (s - 6000.0) : 0.48 + 5e-6 * (s - 12000.0);
  v *= 1.0 + 0.03 * std::sin(static_cast<double>(s) * 1.7);
  if (s % 997 == 0) v *= 1.5;
  return v;
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

TEST_CASE("an analysis refilled in place names its shares right across runs and reorderings", "[runs]") {
  // Two runs' analytics with the same catalog shape under other names, and opposite leaders: one
  // RunAnalysis refilled from each in turn (as /metrics refills one snapshot for every run), and
  // as the order of the shares flips. Every fill must read as a fresh one, names included.
  RunAnalytics a = Make();
  RunAnalytics b = Make({}, "other.");
  RunAnalysis refilled;
  RunAnalysis step_refilled;
  std::vector<ParamAnalysis> params;
  for (uint64_t s = 1; s <= 40; ++s) {
    // a's leader flips from lm_head to mlp at step 20; b's the other way.
    const bool flipped = s >= 20;
    a.OnStep(Step(s, flipped ? 1.0 : 4.0, flipped ? 4.0 : 1.0, 78.4));
    b.OnStep(Step(s, flipped ? 4.0 : 1.0, flipped ? 1.0 : 4.0, 78.4));
    INFO("step " << s);
    for (const RunAnalytics* x : {&a, &b}) {
      x->Analysis(refilled);
      CHECK(Exact(refilled) == Exact(x->Analysis()));
    }
    // The step path refills its own analysis (one run's) in catalog order.
    a.StepAnalysis(step_refilled, params, StepFits{});
    RunAnalysis fresh;
    std::vector<ParamAnalysis> fresh_params;
    a.StepAnalysis(fresh, fresh_params, StepFits{});
    CHECK(Exact(step_refilled) == Exact(fresh));
  }
  // The sources tell the entries apart: per entry within a run, and between the runs.
  const RunAnalysis ra = a.Analysis();
  const RunAnalysis rb = b.Analysis();
  for (const ShareInfo& x : ra.shares) {
    CHECK(x.source != 0);
    for (const ShareInfo& y : ra.shares)
      CHECK((x.source == y.source) == (x.name == y.name && x.is_group == y.is_group));
    for (const ShareInfo& y : rb.shares) CHECK(x.source != y.source);
  }
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
  CHECK(r.growth_without_decay[0].window_steps == 20000);

  // A young run's growth is over the steps it holds, not the window's 20,000.
  RunAnalytics young = Make();
  for (uint64_t s = 0; s <= 300; s += 10) young.OnStep(Step(s, 4.0, 3.0, init + 0.1 * s));
  const RunAnalysis y = young.Analysis();
  REQUIRE(y.growth_without_decay.size() == 1);
  CHECK(y.growth_without_decay[0].window_steps == 301);
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

TEST_CASE("forecasts changed mid-run (a reload of the rules) forecast the new thresholds from the same fit", "[runs]") {
  RunAnalytics a = Make();
  for (uint64_t s = 0; s <= 10000; ++s) a.OnStep(Step(s, 0.3 + 1e-5 * s, 0.0, 78.4));
  const uint64_t fitted = a.Analysis().forecasts.at(0).fit_samples;
  a.SetForecasts({{"grad/norm/total", 4.0}, {"grad/norm/lm_head.weight", 2.0}, {"no/such/series", 1.0}});
  RunAnalysis r = a.Analysis();
  REQUIRE(r.forecasts.size() == 2);  // a series the run does not have is not forecast
  CHECK(r.forecasts[0].key == "grad/norm/total");
  CHECK(r.forecasts[0].threshold == 4.0);
  CHECK(r.forecasts[0].steps_to_threshold == Approx((4.0 - 0.4) / 1e-5));
  CHECK(r.forecasts[0].fit_samples == fitted);  // the fit it had, not a fresh one
  CHECK(r.forecasts[1].key == "grad/norm/lm_head.weight");
  CHECK(r.forecasts[1].threshold == 2.0);
  // Back to the default: the same figures as a run that never changed.
  a.SetForecasts({{"grad/norm/total", 5.0}});
  r = a.Analysis();
  REQUIRE(r.forecasts.size() == 1);
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

TEST_CASE("the analysis is the same whenever and in whatever order the events arrive", "[runs]") {
  // Live, an event may arrive before its step, after it (a resend after a daemon restart, another
  // rank's timing), or, after a restart, from the journal before every step.
  AnalyticsOptions options;
  options.max_events = 3;  // four events: the three latest by step are kept, whatever the order
  const std::vector<EventRecord> events = {{.step = 3000, .text = "lr warmup over"},
                                           {.step = 6000, .text = "routing switch"},
                                           {.step = 12000, .text = "data mix changed"},
                                           {.step = 12000, .text = "batch size doubled"}};
  constexpr uint64_t kLast = 16000;
  auto analyse = [&](const std::vector<std::pair<uint64_t, size_t>>& arrivals) {
    RunAnalytics a = Make(options);
    for (uint64_t s = 0; s <= kLast; s += 2) {
      for (const auto& [at, e] : arrivals) {
        if (at == s) a.OnEvent(events[e]);
      }
      a.OnStep(Step(s, Noisy(s), 0.1, 78.4 + 1e-3 * s));
    }
    return Exact(a.Analysis());
  };
  const std::string before = analyse({{0, 0}, {0, 1}, {0, 2}, {0, 3}});
  CHECK(before.find("routing switch") != std::string::npos);
  CHECK(before.find("batch size doubled") != std::string::npos);
  CHECK(before.find("lr warmup over") == std::string::npos);  // the earliest of four is not kept
  // Reversed, each at its own step, late by up to 9,000 steps (the robust window still holds
  // what its before window needs), and at the last step.
  CHECK(analyse({{0, 3}, {0, 2}, {0, 1}, {0, 0}}) == before);
  CHECK(analyse({{3000, 0}, {6000, 1}, {12000, 2}, {12000, 3}}) == before);
  CHECK(analyse({{9000, 1}, {14000, 3}, {15000, 0}, {16000, 2}}) == before);
  CHECK(analyse({{kLast, 2}, {kLast, 0}, {kLast, 3}, {kLast, 1}}) == before);
}

TEST_CASE("analytics rebuilt as after a restart equal the live ones", "[runs]") {
  // Live: series added as the catalog comes, events between steps. Restart: the journal gives the
  // series, then every event, then every step.
  const EventRecord switched{.step = 6000, .text = "routing switch"};
  RunAnalytics live = Make();
  for (uint64_t s = 0; s <= 14000; s += 5) {
    if (s == 6500) live.OnEvent(switched);
    live.OnStep(Step(s, Noisy(s), 0.1, 78.4 + 1e-3 * s));
  }
  RunAnalytics restored = Make();
  restored.OnEvent(switched);
  for (uint64_t s = 0; s <= 14000; s += 5) restored.OnStep(Step(s, Noisy(s), 0.1, 78.4 + 1e-3 * s));
  const std::string exact = Exact(live.Analysis());
  CHECK(exact.find("change grad/norm/total routing switch") != std::string::npos);
  CHECK(Exact(restored.Analysis()) == exact);
}

TEST_CASE("the per-step analysis the alert rules read equals the full one, by parameter, in reused buffers", "[runs]") {
  RunAnalytics a = Make();
  a.OnEvent({.step = 6000, .text = "switched routing"});
  const double init = std::sqrt(6144.0);
  RunAnalysis step_analysis;
  std::vector<ParamAnalysis> params;
  for (uint64_t s = 0; s <= 20000; s += 10) {
    a.OnStep(Step(s, Noisy(s), 0.5 * Noisy(s), init + 0.01 * s));
    if (s % 2000 != 0) continue;
    // Filled again into the same buffers as a live run does at every step, every fit read.
    const StepFits all{.norm = std::vector<uint8_t>(Catalog().size(), 1),
                       .share = std::vector<uint8_t>(Catalog().size(), 1)};
    a.StepAnalysis(step_analysis, params, all);
    const RunAnalysis full = a.Analysis();
    RunAnalysis expected = full;
    expected.slopes.clear();
    expected.amplifications.clear();
    expected.growth_without_decay.clear();
    INFO("step " << s);
    // The same shares, in catalog order (parameters, then groups), where the full analysis puts
    // the largest first (ties in catalog order).
    bool groups_began = false;
    size_t next_param = 0;
    for (const auto& share : step_analysis.shares) {
      if (share.is_group) {
        groups_began = true;
        continue;
      }
      CHECK_FALSE(groups_began);
      while (next_param < Catalog().size() && Catalog()[next_param].name != share.name) ++next_param;
      CHECK(next_param < Catalog().size());
    }
    RunAnalysis ordered = step_analysis;
    std::stable_sort(ordered.shares.begin(), ordered.shares.end(),
                     [](const auto& x, const auto& y) { return x.share > y.share; });
    CHECK(Exact(ordered) == Exact(expected));
    REQUIRE(params.size() == Catalog().size());
    // Parameter 0 (final_norm.weight, a norm gain without decay): its amplification and growth.
    std::optional<AmplificationInfo> amplification;
    for (const auto& x : full.amplifications) {
      if (x.param == "final_norm.weight") amplification = x;
    }
    REQUIRE(amplification.has_value());
    CHECK(params[0].amplification == amplification->amplification);
    CHECK(params[0].init_norm == amplification->init_norm);
    CHECK(params[0].norm == amplification->norm);
    CHECK(params[0].growth.has_value() == !full.growth_without_decay.empty());
    if (params[0].growth) CHECK(params[0].growth->growth_factor == full.growth_without_decay[0].growth_factor);
    // The norm's slope over the forecast window, as the full slopes list it.
    for (const auto& sl : full.slopes) {
      if (sl.key == "params/norm/final_norm.weight" && sl.window_steps == AnalyticsOptions{}.forecast_window_steps) {
        CHECK(params[0].norm_slope_per_kstep == sl.fit.slope_per_kstep());
      }
    }
    // lm_head has weight decay and no norm gain: a norm, no amplification, no growth.
    CHECK(params[1].norm == 500.0);
    CHECK_FALSE(params[1].amplification.has_value());
    CHECK_FALSE(params[1].growth.has_value());
    // mlp has no norm series.
    CHECK_FALSE(params[2].norm.has_value());

    // Only final_norm's norm fits read: the others' norm slopes and growth, and every
    // parameter's share slope, are left out; values, amplifications and groups' slopes stay.
    RunAnalysis lean;
    std::vector<ParamAnalysis> lean_params;
    StepFits first_norm;
    first_norm.norm = {1};
    a.StepAnalysis(lean, lean_params, first_norm);
    REQUIRE(lean_params.size() == params.size());
    CHECK(lean_params[0].norm_slope_per_kstep == params[0].norm_slope_per_kstep);
    CHECK(lean_params[0].growth.has_value() == params[0].growth.has_value());
    if (params[0].growth) CHECK(lean_params[0].growth->growth_factor == params[0].growth->growth_factor);
    for (size_t i = 1; i < params.size(); ++i) {
      CHECK(lean_params[i].norm == params[i].norm);
      CHECK(lean_params[i].amplification == params[i].amplification);
      CHECK_FALSE(lean_params[i].norm_slope_per_kstep.has_value());
      CHECK_FALSE(lean_params[i].growth.has_value());
    }
    if (s > 0) CHECK(params[1].norm_slope_per_kstep.has_value());
    REQUIRE(lean.shares.size() == step_analysis.shares.size());
    bool any_group = false;
    for (size_t i = 0; i < lean.shares.size(); ++i) {
      CHECK(lean.shares[i].name == step_analysis.shares[i].name);
      CHECK(lean.shares[i].share == step_analysis.shares[i].share);
      if (lean.shares[i].is_group) {
        any_group = true;
        CHECK(lean.shares[i].slope_per_kstep == step_analysis.shares[i].slope_per_kstep);
      } else {
        CHECK(std::isnan(lean.shares[i].slope_per_kstep));
      }
    }
    CHECK(any_group);
  }
}

TEST_CASE("per-step norm fits of many parameters, some without a norm series, with the forecast window not the longest",
          "[runs]") {
  // 40 norm gains (their norms rise at different rates, so each fit differs), every third with
  // no norm series, and fits read for every other one: StepAnalysis fetches the trackers it fits
  // ahead, skipping those it does not, and must fit exactly what Analysis does.
  AnalyticsOptions options;
  options.forecast_window_steps = 2000;  // not among the default windows: added, and not the longest
  RunAnalytics a(options);
  constexpr size_t kParams = 40;
  std::vector<ParamInfo> catalog;
  for (size_t i = 0; i < kParams; ++i) {
    catalog.push_back(
        {.name = "layers." + std::to_string(i) + ".norm.weight", .numel = 4096, .kind = ParamKind::kNormGain});
  }
  a.SetCatalog(catalog);
  std::vector<SeriesId> norm_ids(kParams, kNoSeries);
  SeriesId next_id = 0;
  for (size_t i = 0; i < kParams; ++i) {
    if (i % 3 == 2) continue;
    norm_ids[i] = next_id++;
    a.AddSeries(norm_ids[i], "params/norm/" + catalog[i].name);
  }
  StepFits fits;
  fits.norm.assign(kParams, 0);
  for (size_t i = 0; i < kParams; i += 2) fits.norm[i] = 1;
  RunAnalysis step_analysis;
  std::vector<ParamAnalysis> params;
  size_t compared = 0;
  for (uint64_t s = 0; s <= 24000; s += 8) {
    CompletedStep step;
    step.step = s;
    for (size_t i = 0; i < kParams; ++i) {
      if (norm_ids[i] == kNoSeries) continue;
      // Rising at a rate of its own, half as fast from step 15,000 on.
      const double rate = 1e-6 * static_cast<double>(i + 1);
      const double x = static_cast<double>(std::min<uint64_t>(s, 15000)) +
                       0.5 * static_cast<double>(s - std::min<uint64_t>(s, 15000));
      step.values.push_back(
          {norm_ids[i], 64.0 * (1.0 + rate * x) * (1.0 + 1e-4 * std::sin(1.3 * static_cast<double>(s + i)))});
    }
    a.OnStep(step);
    if (s % 4000 != 0) continue;
    a.StepAnalysis(step_analysis, params, fits);
    const RunAnalysis full = a.Analysis();
    REQUIRE(params.size() == kParams);
    INFO("step " << s);
    for (size_t i = 0; i < kParams; ++i) {
      INFO("parameter " << i);
      if (norm_ids[i] == kNoSeries || fits.norm[i] == 0) {
        CHECK_FALSE(params[i].norm_slope_per_kstep.has_value());
        CHECK_FALSE(params[i].growth.has_value());
        continue;
      }
      std::optional<double> forecast_slope;
      for (const auto& sl : full.slopes) {
        if (sl.key == "params/norm/" + catalog[i].name && sl.window_steps == 2000) {
          forecast_slope = sl.fit.slope_per_kstep();
        }
      }
      CHECK(params[i].norm_slope_per_kstep == forecast_slope);
      const GrowthInfo* growth = nullptr;
      for (const auto& g : full.growth_without_decay) {
        if (g.param == catalog[i].name) growth = &g;
      }
      REQUIRE(params[i].growth.has_value() == (growth != nullptr));
      if (growth == nullptr) continue;
      CHECK(params[i].growth->window_steps == growth->window_steps);
      // What the young window holds (within a bucket of a full window, the window).
      CHECK((params[i].growth->window_steps == s + 1 || params[i].growth->window_steps == 20000));
      if (s < 18000) CHECK(params[i].growth->window_steps == s + 1);
      CHECK(params[i].growth->growth_factor == growth->growth_factor);
      CHECK(params[i].growth->slope_per_kstep == growth->slope_per_kstep);
      ++compared;
      // The rates halved at 15,000: the 2,000-step slope is well below the 20,000-step one.
      if (s == 24000) CHECK(*params[i].norm_slope_per_kstep < 0.8 * growth->slope_per_kstep);
    }
  }
  CHECK(compared > 40);
}

TEST_CASE("samples set aside reach every reader: analytics read at every step or only at the end are the same",
          "[runs]") {
  // Most parameter series' raw slopes and most share trends take their samples a slice at a time
  // (RunAnalytics::ApplySetAside). 40 parameters (norm gains without decay, whose norms are key
  // series, and weights with decay, whose norms are not), grad, norm and update norms; every third
  // step misses a parameter's gradient (so slices are applied step by step too). `every` is read
  // after each step; `end` only at the end; `fitted` is read as the alert rules do, with norm and
  // share fits switched on for some parameters half-way (their set-aside samples applied then).
  constexpr size_t kParams = 40;
  std::vector<ParamInfo> catalog;
  for (size_t i = 0; i < kParams; ++i) {
    const bool gain = i % 4 == 0;
    catalog.push_back({.name = "layers." + std::to_string(i) + (gain ? ".norm.weight" : ".mlp.weight"),
                       .numel = 4096,
                       .kind = gain ? ParamKind::kNormGain : ParamKind::kMlp,
                       .weight_decay = gain ? 0.0 : 0.1});
  }
  AnalyticsOptions options;
  options.windows = {200, 1000};
  options.forecast_window_steps = 1000;
  options.set_aside_min_bytes = 0;  // a small run's trackers are set aside too here
  auto make = [&] {
    auto a = std::make_unique<RunAnalytics>(options);
    a->SetCatalog(catalog);
    a->AddSeries(0, "grad/norm/total");
    for (size_t i = 0; i < kParams; ++i) {
      a->AddSeries(static_cast<SeriesId>(1 + 3 * i), "grad/norm/" + catalog[i].name);
      a->AddSeries(static_cast<SeriesId>(2 + 3 * i), "params/norm/" + catalog[i].name);
      a->AddSeries(static_cast<SeriesId>(3 + 3 * i), "update/norm/" + catalog[i].name);
    }
    return a;
  };
  auto every = make(), end = make(), fitted = make();
  StepFits none;
  StepFits some;
  some.norm.assign(kParams, 0);
  some.share.assign(kParams, 0);
  for (size_t i = 1; i < kParams; i += 3) some.norm[i] = 1;
  for (size_t i = 2; i < kParams; i += 5) some.share[i] = 1;
  RunAnalysis step_analysis;
  std::vector<ParamAnalysis> params;
  constexpr uint64_t kSteps = 1500;
  for (uint64_t s = 1; s <= kSteps; ++s) {
    CompletedStep step;
    step.step = s;
    double total_sq = 0;
    for (size_t i = 0; i < kParams; ++i) {
      const double x = static_cast<double>(s);
      const double grad = (0.1 + 0.01 * static_cast<double>(i)) * (1.0 + 1e-4 * x) *
                          (1.0 + 0.05 * std::sin(0.7 * x + static_cast<double>(i)));
      if (!(s % 3 == 0 && i == s % kParams)) {
        step.values.push_back({static_cast<SeriesId>(1 + 3 * i), grad});
        total_sq += grad * grad;
      }
      step.values.push_back({static_cast<SeriesId>(2 + 3 * i), 60.0 + 1e-3 * static_cast<double>(i + 1) * x});
      step.values.push_back({static_cast<SeriesId>(3 + 3 * i), 1e-3 * grad});
    }
    step.values.push_back({0, std::sqrt(total_sq)});
    every->OnStep(step);
    end->OnStep(step);
    fitted->OnStep(step);
    const RunAnalysis now = every->Analysis();
    fitted->StepAnalysis(step_analysis, params, s < kSteps / 2 ? none : some);
    if (s % 97 != 0 && s != kSteps) continue;
    INFO("step " << s);
    // What a rule reads at this step is what the full analysis, with every sample applied, says.
    REQUIRE(params.size() == kParams);
    for (size_t i = 0; i < kParams; ++i) {
      if (s < kSteps / 2 || some.norm[i] == 0) continue;
      std::optional<double> slope;
      for (const auto& sl : now.slopes) {
        if (sl.key == "params/norm/" + catalog[i].name && sl.window_steps == 1000) slope = sl.fit.slope_per_kstep();
      }
      CHECK(params[i].norm_slope_per_kstep == slope);
    }
    for (const auto& share : step_analysis.shares) {
      if (share.is_group || std::isnan(share.slope_per_kstep)) continue;
      bool found = false;
      for (const auto& full : now.shares) {
        if (full.name != share.name || full.is_group) continue;
        found = true;
        CHECK(full.slope_per_kstep == share.slope_per_kstep);
      }
      CHECK(found);
    }
  }
  const std::string expected = Exact(every->Analysis());
  CHECK(Exact(end->Analysis()) == expected);
  CHECK(Exact(fitted->Analysis()) == expected);
  std::string every_state, end_state, fitted_state;
  StateWriter every_out(every_state), end_out(end_state), fitted_out(fitted_state);
  every->SaveState(every_out);
  end->SaveState(end_out);
  fitted->SaveState(fitted_out);
  CHECK(end_state == every_state);
  CHECK(fitted_state == every_state);
  CHECK(every_state.size() > 10000);
}

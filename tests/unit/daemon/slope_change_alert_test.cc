// The slope-change warning on a run's real analytics: it fires only once the estimate is
// significant, and shows a value whose error bars hold the final one.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <random>
#include <vector>

#include "alerts/evaluator.h"
#include "server/daemon/alerting.h"
#include "server/runs/run.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch;
using namespace gradwatch::runs;

namespace {

RunMeta Meta() {
  RunMeta m;
  m.run_id = "r1";
  m.world_size = 1;
  return m;
}

}  // namespace

TEST_CASE("a x3 slope change reported every step warns once significant, near x3, not x87 at +11", "[daemon][alerts]") {
  constexpr uint64_t kEvent = 20'000;
  for (uint64_t seed : {3u, 17u, 29u}) {
    INFO("seed " << seed);
    FakeClock clock;
    DaemonStats stats;
    daemon::Alerting alerting({alerts::testing::DefaultRule("GradNormSlopeChangeAtEvent")});
    RunOptions options;
    options.listener = &alerting;
    Run run(Meta(), options, nullptr, &stats, &clock, true);
    // The first firing, and the estimate then: the alerting evaluates off the run's lock, so the
    // run can be asked for its analysis while the alert is handed over.
    std::optional<alerts::Alert> fired;
    std::optional<SlopeChangeInfo> estimate;
    alerting.SetTrainerSink([&](const alerts::Alert& alert) {
      if (alert.state != alerts::AlertState::kFiring || fired) return;
      fired = alert;
      for (const auto& s : run.Summary().analysis.slope_changes) {
        if (s.key == "grad/norm/total") estimate = s;
      }
    });
    AttachInfo info;
    REQUIRE_FALSE(run.Attach(Meta(), 0, nullptr, &info).has_value());

    // The incident's shape: 3% log-normal noise around a line whose slope triples at the event.
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> noise(0.0, 0.03);
    for (uint64_t step = 10'000; step <= kEvent + 8'000; ++step) {
      if (step == kEvent) REQUIRE_FALSE(run.AddEvent({kEvent, "switched routing", "trainer", 0}).has_value());
      const double trend = step < kEvent ? 0.3 + 1e-5 * static_cast<double>(step - 10'000)
                                         : 0.4 + 3e-5 * static_cast<double>(step - kEvent);
      RankStep r;
      r.step = step;
      r.total_grad = NormContribution::FromNorm(trend * std::exp(noise(rng)));
      REQUIRE_FALSE(run.AddStep(0, r, nullptr).has_value());
    }

    REQUIRE(fired.has_value());
    REQUIRE(estimate.has_value());
    CHECK(fired->step > kEvent + 11);
    CHECK(fired->value < 10);

    // The final estimate (a full after window) lies within the error bars shown when it fired.
    const auto analysis = run.Summary().analysis;
    std::optional<double> final_ratio;
    for (const auto& s : analysis.slope_changes) {
      if (s.key == "grad/norm/total") final_ratio = s.change.ratio;
    }
    REQUIRE(final_ratio.has_value());
    CHECK(*final_ratio == Approx(3.0).epsilon(0.15));
    const analytics::SlopeChange& e = estimate->change;
    const double before = e.before.slope_per_kstep(), after = e.after.slope_per_kstep();
    const double z = alerts::kEstimateZ;
    const double low = (after - z * e.after_stderr_per_kstep) / (before + z * e.before_stderr_per_kstep);
    const double high = (after + z * e.after_stderr_per_kstep) / (before - z * e.before_stderr_per_kstep);
    INFO("fired at step " << fired->step << " with x" << e.ratio << " [" << low << ", " << high << "]; final x"
                          << *final_ratio);
    CHECK(low >= 1.5);
    CHECK(low <= *final_ratio);
    CHECK(*final_ratio <= high);
  }
}

// The slope-change warning on a run's real analytics: it fires only once the estimate is
// significant, and shows a value whose error bars hold the final one.
#include <catch2/catch.hpp>

#include <cmath>
#include <optional>
#include <random>
#include <vector>

#include "alerts/evaluator.h"
#include "alerts/state_machine.h"
#include "server/runs/run.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch;
using namespace gradwatch::runs;

namespace {

// Evaluates the rule on every completed step and keeps the first firing with the estimate then.
class Hook final : public AlertHook {
 public:
  Hook() : engine_({alerts::testing::DefaultRule("GradNormSlopeChangeAtEvent")}) {}
  std::vector<alerts::Transition> OnStep(const alerts::RunFacts& facts) override {
    auto ts = engine_.EvaluateStep(facts, facts.now);
    for (const auto& t : ts) {
      if (t.to == alerts::AlertState::kFiring && !fired) {
        fired = t;
        for (const auto& s : facts.slope_changes) {
          if (s.key == "grad/norm/total") estimate = s;
        }
      }
    }
    return ts;
  }
  void OnRunEnded(const std::string&, bool, double) override {}
  void OnRunLeftMemory(const std::string&, double) override {}
  std::vector<alerts::Transition> OnRewind(const std::string&, uint64_t, double) override { return {}; }

  std::optional<alerts::Transition> fired;
  std::optional<alerts::SlopeChangeFact> estimate;

 private:
  alerts::AlertEngine engine_;
};

RunMeta Meta() {
  RunMeta m;
  m.run_id = "r1";
  m.world_size = 1;
  return m;
}

}  // namespace

TEST_CASE("a x3 slope change reported every step warns once significant, near x3, not x87 at +11", "[runs]") {
  constexpr uint64_t kEvent = 20'000;
  for (uint64_t seed : {3u, 17u, 29u}) {
    INFO("seed " << seed);
    FakeClock clock;
    DaemonStats stats;
    Hook hook;
    RunOptions options;
    options.alert_hook = &hook;
    Run run(Meta(), options, nullptr, &stats, &clock, true);
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

    REQUIRE(hook.fired.has_value());
    REQUIRE(hook.estimate.has_value());
    CHECK(hook.fired->alert.step > kEvent + 11);
    CHECK(hook.fired->alert.value < 10);

    // The final estimate (a full after window) lies within the error bars shown when it fired.
    const auto analysis = run.Summary().analysis;
    std::optional<double> final_ratio;
    for (const auto& s : analysis.slope_changes) {
      if (s.key == "grad/norm/total") final_ratio = s.change.ratio;
    }
    REQUIRE(final_ratio.has_value());
    CHECK(*final_ratio == Approx(3.0).epsilon(0.15));
    const auto& e = *hook.estimate;
    const double z = alerts::kEstimateZ;
    const double low = (e.after_per_kstep - z * e.after_stderr_per_kstep) / (e.before_per_kstep + z * e.before_stderr_per_kstep);
    const double high = (e.after_per_kstep + z * e.after_stderr_per_kstep) / (e.before_per_kstep - z * e.before_stderr_per_kstep);
    INFO("fired at step " << hook.fired->alert.step << " with x" << e.ratio << " [" << low << ", " << high
                          << "]; final x" << *final_ratio);
    CHECK(low >= 1.5);
    CHECK(low <= *final_ratio);
    CHECK(*final_ratio <= high);
  }
}

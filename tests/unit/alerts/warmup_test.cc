#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "alerts/warmup.h"

using namespace gradwatch::alerts;
using Catch::Contains;

namespace {

// Linear warm-up to 3e-4 over `warmup` steps, then a cosine decay to 0 at `total`.
double Schedule(uint64_t step, uint64_t warmup, uint64_t total) {
  if (step < warmup) return 3e-4 * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return 3e-4 * 0.5 * (1 + std::cos(M_PI * progress));
}

}  // namespace

TEST_CASE("the learning rate is warming up while it rises and not once it decays", "[alerts]") {
  LearningRateTracker lr;
  for (uint64_t s = 0; s < 2000; s += 10) {
    lr.Add(s, Schedule(s, 2000, 100000));
    if (s >= 10) CHECK(lr.fact().warming_up);
  }
  lr.Add(2000, Schedule(2000, 2000, 100000));  // the peak: one report at it
  lr.Add(2100, Schedule(2100, 2000, 100000));  // the decay
  CHECK_FALSE(lr.fact().warming_up);
  CHECK(lr.fact().peak == Approx(3e-4));
  CHECK(lr.fact().peak_step == 2000);
  // Never again, whatever the rate does later (a restart of the schedule is a jump).
  lr.Add(2200, 3e-4);
  CHECK_FALSE(lr.fact().warming_up);
}

TEST_CASE("a constant learning rate is no warm-up, and a flat peak ends one", "[alerts]") {
  LearningRateTracker constant;
  for (uint64_t s = 0; s < 10; ++s) constant.Add(s, 1e-4);
  CHECK_FALSE(constant.fact().warming_up);

  LearningRateTracker plateau;
  plateau.Add(0, 1e-4);
  plateau.Add(1, 2e-4);
  plateau.Add(2, 3e-4);
  CHECK(plateau.fact().warming_up);
  plateau.Add(3, 3e-4);  // a log's rounded rate may repeat once or twice while rising
  plateau.Add(4, 3e-4);
  CHECK(plateau.fact().warming_up);
  plateau.Add(5, 3e-4);
  CHECK_FALSE(plateau.fact().warming_up);
}

TEST_CASE("a learning rate that jumps after warm-up is noted with its step", "[alerts]") {
  LearningRateTracker lr;
  lr.Add(0, 1e-4);
  lr.Add(1, 3e-4);
  lr.Add(2, 2.9e-4);
  lr.Add(3, 2.8e-4);
  CHECK(lr.fact().jump_step == 0);
  lr.Add(4, 1e-3);
  CHECK(lr.fact().jump_step == 4);
  CHECK(lr.fact().jump_from == 2.8e-4);
  CHECK(lr.fact().jump_to == 1e-3);
  lr.Add(5, std::nan(""));  // ignored
  CHECK(lr.fact().value == 1e-3);

  lr.Rewind(4);  // the jump was on the abandoned branch
  CHECK(lr.fact().jump_step == 0);
}

TEST_CASE("a rewind into the warm-up judges it again from the new branch", "[alerts]") {
  LearningRateTracker lr;
  for (uint64_t s = 0; s <= 50; s += 10) lr.Add(s, 1e-5 * static_cast<double>(s + 1));
  lr.Add(60, 1e-5);  // fell: over
  CHECK_FALSE(lr.fact().warming_up);
  lr.Rewind(20);
  CHECK_FALSE(lr.fact().known);
  lr.Add(20, 2e-4);
  lr.Add(30, 3e-4);
  CHECK(lr.fact().warming_up);
}

TEST_CASE("pages are held by config.warmup_steps, a rising learning rate, and the first steps", "[alerts]") {
  LearningRateFact none;
  CHECK_THAT(JudgeWarmup(1500, none, 2000, 200).reason,
             Contains("the run is in its learning-rate warm-up (step 1,500 of 2,000, config.warmup_steps)"));
  CHECK_FALSE(JudgeWarmup(2000, none, 2000, 200).holds_pages);

  LearningRateFact rising;
  rising.known = true;
  rising.value = 1.2e-4;
  rising.warming_up = true;
  const WarmupFact w = JudgeWarmup(5000, rising, std::nullopt, 200);
  CHECK(w.holds_pages);
  CHECK(w.reason ==
        "the learning rate is still rising toward its peak (1.2e-4 at step 5,000): the run is in its "
        "warm-up");

  // Judged by steps alone: no learning rate, no warmup_steps.
  CHECK(JudgeWarmup(199, none, std::nullopt, 200).holds_pages);
  CHECK_THAT(JudgeWarmup(12, none, std::nullopt, 200).reason,
             Contains("the run is in its first 200 steps (step 12, alerts.min_steps_before_page)"));
  CHECK_FALSE(JudgeWarmup(200, none, std::nullopt, 200).holds_pages);
  CHECK_FALSE(JudgeWarmup(0, none, std::nullopt, 0).holds_pages);
  CHECK(JudgeWarmup(200, none, std::nullopt, 200).reason.empty());
}

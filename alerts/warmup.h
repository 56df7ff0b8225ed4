// Warm-up is not an incident. A run's first steps and its learning-rate warm-up routinely carry
// grad norms of tens (LLM pre-training: large gradients at init, decaying while the learning rate
// ramps up), so a threshold rule with severity page does not page then: its alert fires as a
// warning that says why (evaluator.h), and the page comes once the warm-up is over if the
// condition still holds. A non-finite value is never held.
//
// The warm-up is judged, at a step, by any of:
//  - config.warmup_steps, when the trainer sent it: steps numbered below it;
//  - the learning rate (optim/learning_rate), when the run reports it: still rising toward its
//    peak (LearningRateTracker);
//  - the run's first steps: steps numbered below min_steps_before_page
//    (alerts.min_steps_before_page, default kDefaultMinStepsBeforePage). By step number, not by
//    steps seen: a log tailed from iteration 50,000, or a job resumed from a checkpoint there, is
//    past its first steps.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "alerts/facts.h"

namespace gradwatch::alerts {

inline constexpr uint64_t kDefaultMinStepsBeforePage = 200;
// A held page's alert carries the label page_held="warmup" (with severity "warning"), so that it
// is an instance of its own and routes as a warning; its annotation page_held (and the template
// variable of that name) says why.
inline constexpr std::string_view kPageHeldLabel = "page_held";
inline constexpr std::string_view kPageHeldValue = "warmup";
inline constexpr std::string_view kPageHeldVariable = "page_held";
// A learning rate that stays at its peak for this many reports has ended its warm-up (a constant
// rate after a ramp; a log's rounded rates may repeat a value once or twice while rising).
inline constexpr int kWarmupFlatReports = 3;
// A learning rate that moves by more than this factor from one report to the next has jumped.
inline constexpr double kJumpFactor = 2.0;

// Follows a run's learning rate report by report (the daemon keeps one per run). Plain data;
// not thread-safe.
class LearningRateTracker {
 public:
  // The rate reported at `step`. Steps arrive in increasing order; a rewind calls Rewind first.
  // A non-finite rate is ignored.
  void Add(uint64_t step, double rate);
  // The run rewound to from_step: what was learnt from the abandoned steps ≥ from_step is
  // forgotten (a warm-up that ended there is judged again from the new branch's reports).
  void Rewind(uint64_t from_step);
  const LearningRateFact& fact() const { return fact_; }

 private:
  LearningRateFact fact_;
  uint64_t last_step_ = 0;
  uint64_t first_step_ = 0;
  bool rose_ = false;
  bool warmup_over_ = false;
  uint64_t warmup_over_step_ = 0;
  int flat_reports_ = 0;
};

// Whether pages are held at `step`, and why.
WarmupFact JudgeWarmup(uint64_t step, const LearningRateFact& rate, std::optional<uint64_t> warmup_steps,
                       uint64_t min_steps_before_page);

}  // namespace gradwatch::alerts

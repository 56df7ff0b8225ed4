#include "alerts/warmup.h"

#include <cmath>

#include "alerts/templates.h"

namespace gradwatch::alerts {

void LearningRateTracker::Add(uint64_t step, double rate) {
  if (!std::isfinite(rate)) return;
  LearningRateFact& f = fact_;
  if (!f.known) {
    f.known = true;
    f.value = f.peak = rate;
    f.peak_step = first_step_ = last_step_ = step;
    f.warming_up = false;  // one report says nothing yet
    return;
  }
  const double before = f.value;
  f.value = rate;
  last_step_ = step;
  if (!warmup_over_) {
    // Relative tolerance: a rate printed with 4 digits repeats; a rate below the peak by less
    // than this is the peak.
    const double tolerance = 1e-6 * std::fabs(f.peak);
    if (rate > f.peak + tolerance) {
      f.peak = rate;
      f.peak_step = step;
      rose_ = true;
      flat_reports_ = 0;
    } else if (rate < f.peak - tolerance || ++flat_reports_ >= kWarmupFlatReports) {
      warmup_over_ = true;
      warmup_over_step_ = step;
    }
    f.warming_up = rose_ && !warmup_over_;
    return;
  }
  f.warming_up = false;
  if (rate > f.peak) {
    f.peak = rate;
    f.peak_step = step;
  }
  if (before > 0 && rate > 0 && (rate > kJumpFactor * before || rate * kJumpFactor < before)) {
    f.jump_step = step;
    f.jump_from = before;
    f.jump_to = rate;
  }
}

void LearningRateTracker::Rewind(uint64_t from_step) {
  if (!fact_.known || from_step > last_step_) return;
  if (from_step <= first_step_ || from_step <= fact_.peak_step || (warmup_over_ && from_step <= warmup_over_step_)) {
    *this = LearningRateTracker();  // the new branch's reports judge the warm-up again
    return;
  }
  if (fact_.jump_step >= from_step) fact_.jump_step = 0, fact_.jump_from = fact_.jump_to = 0;
  last_step_ = from_step - 1;
}

WarmupFact JudgeWarmup(uint64_t step, const LearningRateFact& rate, std::optional<uint64_t> warmup_steps,
                       uint64_t min_steps_before_page) {
  WarmupFact w;
  if (warmup_steps && step < *warmup_steps) {
    w.holds_pages = true;
    w.reason = "the run is in its learning-rate warm-up (step " + FormatStep(step) + " of " +
               FormatStep(*warmup_steps) + ", config.warmup_steps)";
  } else if (rate.known && rate.warming_up) {
    w.holds_pages = true;
    w.reason = "the learning rate is still rising toward its peak (" + FormatNumber(rate.value) + " at step " +
               FormatStep(step) + "): the run is in its warm-up";
  } else if (step < min_steps_before_page) {
    w.holds_pages = true;
    w.reason = "the run is in its first " + FormatStep(min_steps_before_page) + " steps (step " + FormatStep(step) +
               ", alerts.min_steps_before_page)";
  }
  return w;
}

}  // namespace gradwatch::alerts

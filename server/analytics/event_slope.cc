#include "server/analytics/event_slope.h"

#include <cmath>
#include <limits>

namespace gradwatch::analytics {

double SlopeRatio(double after, double before) {
  if (std::isnan(after) || std::isnan(before)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (before == 0) {
    if (after == 0) {
      return std::numeric_limits<double>::quiet_NaN();
    }
    // Spelled out so that a before slope of −0.0 does not flip the sign.
    return after > 0 ? std::numeric_limits<double>::infinity()
                     : -std::numeric_limits<double>::infinity();
  }
  return after / before;
}

EventSlope::EventSlope(uint64_t event_step, uint64_t window_steps, size_t min_after_samples)
    : event_step_(event_step), window_steps_(window_steps), min_after_samples_(min_after_samples) {}

void EventSlope::Seed(const SlopeTracker& tracker) {
  if (seeded_ || seen_any_ || !tracker.has_samples()) {
    return;
  }
  seeded_ = true;
  seeded_through_ = tracker.last_step();
  seen_any_ = true;
  latest_step_ = tracker.last_step();
  if (event_step_ > 0) {
    const uint64_t before_from = event_step_ >= window_steps_ ? event_step_ - window_steps_ : 0;
    before_ = tracker.SumsInRange(before_from, event_step_ - 1);
  }
  const uint64_t after_to = window_steps_ <= std::numeric_limits<uint64_t>::max() - event_step_
                                ? event_step_ + window_steps_
                                : std::numeric_limits<uint64_t>::max();
  after_ = tracker.SumsInRange(event_step_, after_to);
}

void EventSlope::AddSample(uint64_t step, double value) {
  if (!std::isfinite(value) || (seeded_ && step <= seeded_through_) ||
      (seen_any_ && step < latest_step_)) {
    return;
  }
  seen_any_ = true;
  latest_step_ = step;
  if (step < event_step_) {
    if (event_step_ - step <= window_steps_) {
      before_.Add(step, value);
    }
  } else if (step - event_step_ <= window_steps_) {
    after_.Add(step, value);
  }
}

bool EventSlope::after_window_full() const {
  return seen_any_ && latest_step_ >= event_step_ && latest_step_ - event_step_ >= window_steps_;
}

std::optional<SlopeChange> EventSlope::Current() const {
  if (after_.count() < min_after_samples_) {
    return std::nullopt;
  }
  std::optional<LinearFit> before = before_.Fit();
  std::optional<LinearFit> after = after_.Fit();
  if (!before || !after) {
    return std::nullopt;
  }
  SlopeChange change;
  change.event_step = event_step_;
  change.before = *before;
  change.after = *after;
  change.ratio = SlopeRatio(after->slope_per_step, before->slope_per_step);
  change.difference_per_kstep = after->slope_per_kstep() - before->slope_per_kstep();
  change.before_stderr_per_kstep = before->slope_stderr_per_kstep();
  change.after_stderr_per_kstep = after->slope_stderr_per_kstep();
  change.after_window_full = after_window_full();
  return change;
}

}  // namespace gradwatch::analytics

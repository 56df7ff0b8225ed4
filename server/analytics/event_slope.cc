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
    return after > 0 ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
  }
  return after / before;
}

EventSlope::EventSlope(uint64_t event_step, uint64_t window_steps, size_t min_after_samples)
    : event_step_(event_step), window_steps_(window_steps), min_after_samples_(min_after_samples) {}

bool EventSlope::InBefore(const RegressionSums& bucket) const {
  if (bucket.empty() || event_step_ == 0) {
    return false;
  }
  const uint64_t from = event_step_ >= window_steps_ ? event_step_ - window_steps_ : 0;
  return bucket.first_step() >= from && bucket.last_step() < event_step_;
}

bool EventSlope::InAfter(const RegressionSums& bucket) const {
  const uint64_t to = window_steps_ <= std::numeric_limits<uint64_t>::max() - event_step_
                          ? event_step_ + window_steps_
                          : std::numeric_limits<uint64_t>::max();
  return !bucket.empty() && bucket.first_step() >= event_step_ && bucket.last_step() <= to;
}

void EventSlope::Seed(const WindowedSlope& window) {
  if (has_closed_) {
    return;
  }
  const RegressionSums* open = window.open_bucket();
  if (open == nullptr) {
    return;
  }
  // Every held bucket but the open one is closed; the newest of them ends before it.
  const uint64_t open_first = open->first_step();
  if (open_first == 0) {
    return;
  }
  has_closed_ = true;
  closed_through_ = open_first - 1;
  if (event_step_ > 0) {
    before_ = window.ClosedSumsInRange(event_step_ >= window_steps_ ? event_step_ - window_steps_ : 0, event_step_ - 1);
  }
  const uint64_t after_to = window_steps_ <= std::numeric_limits<uint64_t>::max() - event_step_
                                ? event_step_ + window_steps_
                                : std::numeric_limits<uint64_t>::max();
  after_ = window.ClosedSumsInRange(event_step_, after_to);
}

void EventSlope::AddClosedBucket(const RegressionSums& bucket) {
  if (bucket.empty() || (has_closed_ && bucket.first_step() <= closed_through_)) {
    return;
  }
  has_closed_ = true;
  closed_through_ = bucket.last_step();
  if (InBefore(bucket)) {
    before_.Merge(bucket);
  } else if (InAfter(bucket)) {
    after_.Merge(bucket);
  }
}

std::optional<SlopeChange> EventSlope::Current(const WindowedSlope& window) const {
  RegressionSums before = before_;
  RegressionSums after = after_;
  const RegressionSums* open = window.open_bucket();
  if (open != nullptr && !(has_closed_ && open->first_step() <= closed_through_)) {
    if (InBefore(*open)) {
      before.Merge(*open);
    } else if (InAfter(*open)) {
      after.Merge(*open);
    }
  }
  if (after.count() < min_after_samples_) {
    return std::nullopt;
  }
  std::optional<LinearFit> before_fit = before.Fit();
  std::optional<LinearFit> after_fit = after.Fit();
  if (!before_fit || !after_fit) {
    return std::nullopt;
  }
  SlopeChange change;
  change.event_step = event_step_;
  change.before = *before_fit;
  change.after = *after_fit;
  change.ratio = SlopeRatio(after_fit->slope_per_step, before_fit->slope_per_step);
  change.difference_per_kstep = after_fit->slope_per_kstep() - before_fit->slope_per_kstep();
  change.before_stderr_per_kstep = before_fit->slope_stderr_per_kstep();
  change.after_stderr_per_kstep = after_fit->slope_stderr_per_kstep();
  change.after_window_full =
      window.has_samples() && window.last_step() >= event_step_ && window.last_step() - event_step_ >= window_steps_;
  return change;
}

void EventSlope::SaveState(StateWriter& out) const {
  out.Put(event_step_);
  out.Put(window_steps_);
  out.Put<uint64_t>(min_after_samples_);
  before_.SaveState(out);
  after_.SaveState(out);
  out.Put<uint8_t>(has_closed_ ? 1 : 0);
  out.Put(closed_through_);
}

bool EventSlope::LoadState(StateReader& in) {
  uint64_t event_step = 0, window_steps = 0, min_after_samples = 0;
  if (!in.Get(event_step) || !in.Get(window_steps) || !in.Get(min_after_samples)) return false;
  if (event_step != event_step_ || window_steps != window_steps_ || min_after_samples != min_after_samples_) {
    return in.Fail("an event slope was saved for another event or window");
  }
  return before_.LoadState(in) && after_.LoadState(in) && in.GetBool(has_closed_) && in.Get(closed_through_);
}

}  // namespace gradwatch::analytics

// The slope of a series before and after an event (a routing switch, a learning-rate change):
// did the event bend the trajectory, and by how much?
//
// Pure maths: no I/O, no locks. Not thread-safe: the owner serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "server/analytics/regression.h"

namespace gradwatch::analytics {

struct SlopeChange {
  uint64_t event_step = 0;
  LinearFit before;  // over [event_step − window_steps, event_step)
  LinearFit after;   // over [event_step, event_step + window_steps], as far as it has filled
  // after.slope / before.slope. When the before slope is exactly 0 it is +inf or −inf (the sign of
  // the after slope), NaN when both are 0; NaN when either slope is NaN. A before slope that is
  // small against before_stderr_per_kstep makes the ratio meaningless: consumers should look at
  // difference_per_kstep then.
  double ratio = 0;
  double difference_per_kstep = 0;  // (after − before) slope, per 1,000 steps
  double before_stderr_per_kstep = 0;
  double after_stderr_per_kstep = 0;  // NaN while the after window holds fewer than 3 samples
  bool after_window_full = false;     // a sample at or past event_step + window_steps was seen
};

// after/before with the edge cases documented on SlopeChange::ratio.
double SlopeRatio(double after, double before);

// One event of one series. The before window is frozen once the series passes the event; the after
// window grows until it spans window_steps, and the published change is refined as it fills.
//
// Usage: construct at registration, call Seed with the series' tracker (the event may be
// registered after its step has passed, or before it comes), then AddSample for every sample the
// tracker receives afterwards.
class EventSlope {
 public:
  EventSlope(uint64_t event_step, uint64_t window_steps, size_t min_after_samples);

  // Takes what the tracker holds of both windows (its longest window, at its bucket granularity:
  // a bucket straddling a window edge is left out). Samples at steps up to the tracker's last step
  // are then considered seen: AddSample ignores them. Call at most once, before any AddSample.
  void Seed(const SlopeTracker& tracker);

  // Feeds one new sample: it joins the before window, the after window, or neither. Ignored:
  // non-finite values, steps up to the seeded tracker's last step, steps older than the newest.
  void AddSample(uint64_t step, double value);

  // Published once the after window holds ≥ min_after_samples samples (and both windows have
  // samples at 2 distinct steps).
  std::optional<SlopeChange> Current() const;

  uint64_t event_step() const { return event_step_; }
  uint64_t window_steps() const { return window_steps_; }
  size_t before_samples() const { return before_.count(); }
  size_t after_samples() const { return after_.count(); }
  bool after_window_full() const;

 private:
  uint64_t event_step_;
  uint64_t window_steps_;
  size_t min_after_samples_;
  RegressionSums before_;
  RegressionSums after_;
  bool seeded_ = false;
  uint64_t seeded_through_ = 0;  // the tracker's last step at Seed
  bool seen_any_ = false;
  uint64_t latest_step_ = 0;  // newest step seeded or fed
};

}  // namespace gradwatch::analytics

// The slope of a series before and after an event (a routing switch, a learning-rate change):
// did the event bend the trajectory, and by how much?
//
// Pure maths: no I/O, no locks. Not thread-safe: the owner serialises access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "server/analytics/regression.h"
#include "server/core/state_io.h"

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

// One event of one series, fitted at the bucket granularity of the series' tracker window (a
// WindowedSlope whose window spans the event's before window and more): the before window takes
// the buckets whose samples all lie in [event_step − window_steps, event_step), the after window
// those in [event_step, event_step + window_steps]; a bucket straddling an edge belongs to
// neither. So the change is a function of the series' samples alone, whenever the event is
// registered: before its step, while the after window fills, or after a restart (Seed takes what
// the window still holds; an event registered so late that the window no longer holds its
// before window's buckets gets only what is left).
//
// Usage: construct at registration and Seed with the window; before each sample the window
// takes, call AddClosedBucket with the window's open bucket when the sample starts a new one
// (WindowedSlope::ClosedBy says which); Current reads the open bucket from the window.
class EventSlope {
 public:
  EventSlope(uint64_t event_step, uint64_t window_steps, size_t min_after_samples);

  // Takes the window's closed buckets (all it holds but the newest, which may still grow).
  // Call at most once, before any AddClosedBucket.
  void Seed(const WindowedSlope& window);

  // A bucket of the window closed: it joins the before or the after window when all its samples
  // lie in it. Buckets must come in step order; one seeded already is ignored.
  void AddClosedBucket(const RegressionSums& bucket);

  // The change with the window's open bucket counted too; published once the after window holds
  // ≥ min_after_samples samples (and both windows have samples at 2 distinct steps).
  std::optional<SlopeChange> Current(const WindowedSlope& window) const;

  uint64_t event_step() const { return event_step_; }
  uint64_t window_steps() const { return window_steps_; }

  // Writes the state (everything but what the constructor's arguments fix, and those arguments for
  // LoadState to check) for LoadState.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this object, constructed with the same arguments as the one
  // saved. False (with in.Fail(...) called, the reader failed) when the bytes are damaged or were
  // written by an event constructed differently; the object is then left in an unspecified but
  // valid, destructible state: the caller discards it.
  bool LoadState(StateReader& in);

 private:
  bool InBefore(const RegressionSums& bucket) const;
  bool InAfter(const RegressionSums& bucket) const;

  uint64_t event_step_;
  uint64_t window_steps_;
  size_t min_after_samples_;
  RegressionSums before_;  // closed buckets only
  RegressionSums after_;
  bool has_closed_ = false;
  uint64_t closed_through_ = 0;  // the last step of the newest closed bucket taken
};

}  // namespace gradwatch::analytics

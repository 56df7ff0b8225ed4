// A sliding median over the last few samples of a series, for fits that one-step spikes must not
// bend. Plain least squares weighs a spike by its distance from the line: with a report every 50
// steps, one ×1.5 spike in a 5,000-step window can triple an event's slope ratio or bring a
// forecast 100,000 steps forward. The median of 5 never passes a run of one or two spikes, follows
// a straight line exactly (at the middle sample's step) and a level shift after 3 samples.
//
// Pure maths: no I/O, no locks. Not thread-safe: the owner serialises access.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "server/core/state_io.h"

namespace gradwatch::analytics {

struct FilteredPoint {
  uint64_t step = 0;
  double value = 0;
};

class SpikeFilter {
 public:
  // `width`: odd, ≥ 1 (1 passes every sample through).
  explicit SpikeFilter(uint32_t width = 5);

  // Adds a finite sample (steps increasing). Once `width` samples were seen, returns the median of
  // the last `width` at the step of the middle one (width/2 samples behind this one).
  std::optional<FilteredPoint> Add(uint64_t step, double value);

  uint32_t width() const { return width_; }

  // Writes the state (the samples in the ring and how many were seen, and the width for LoadState
  // to check) for LoadState. The median's scratch is not written: each Add overwrites it.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this object, constructed with the same width as the one saved.
  // False (with in.Fail(...) called, the reader failed) when the bytes are damaged or were written
  // by a filter of another width; the object is then left in an unspecified but valid,
  // destructible state: the caller discards it.
  bool LoadState(StateReader& in);

 private:
  uint32_t width_;
  std::vector<FilteredPoint> ring_;  // the last width_ samples
  uint64_t seen_ = 0;
  std::vector<double> scratch_;  // for the median, allocated once
};

}  // namespace gradwatch::analytics

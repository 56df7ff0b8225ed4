// The unit a series returns: one sample, or a downsampled bucket of consecutive samples.
#pragma once

#include <cstdint>

namespace gradwatch::store {

// A point covers the steps [step, last_step]; at full resolution step == last_step, count == 1.
struct Point {
  uint64_t step = 0;
  uint64_t last_step = 0;
  double mean = 0;  // mean of the finite samples; NaN when none was finite
  double min = 0;   // of the finite samples; NaN when none was finite
  double max = 0;
  uint32_t count = 0;      // samples covered
  uint32_t nonfinite = 0;  // of which NaN or ±Inf
  // The last sample's value (NaN/Inf kept as is); equals mean at full resolution.
  double last = 0;
};

// The point of one sample: count 1, mean = min = max = last = value when it is finite; a NaN or
// ±Inf sample has nonfinite 1 and mean, min and max a quiet NaN (last keeps the value's bits).
Point SamplePoint(uint64_t step, double value);

// Whether p is exactly (bit for bit) SamplePoint(p.step, p.last).
bool IsSamplePoint(const Point& p);

// Combines b (later) into a (earlier): a covers [a.step, b.last_step] afterwards; counts add,
// mean is weighted by finite counts, min/max ignore non-finite samples, last becomes b.last.
// A point with count 0 is treated as empty.
void MergeInto(Point& a, const Point& b);

}  // namespace gradwatch::store

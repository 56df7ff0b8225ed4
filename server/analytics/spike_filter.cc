#include "server/analytics/spike_filter.h"

#include <algorithm>

namespace gradwatch::analytics {

SpikeFilter::SpikeFilter(uint32_t width)
    : width_(width % 2 == 1 ? width : width + 1), ring_(width_), scratch_(width_) {}

std::optional<FilteredPoint> SpikeFilter::Add(uint64_t step, double value) {
  ring_[seen_ % width_] = {step, value};
  ++seen_;
  if (seen_ < width_) return std::nullopt;
  for (uint32_t i = 0; i < width_; ++i) scratch_[i] = ring_[i].value;
  const auto mid = scratch_.begin() + width_ / 2;
  std::nth_element(scratch_.begin(), mid, scratch_.end());
  // The oldest sample in the ring is at seen_ % width_; the middle one is width/2 after it.
  const FilteredPoint& middle = ring_[(seen_ + width_ / 2) % width_];
  return FilteredPoint{middle.step, *mid};
}

}  // namespace gradwatch::analytics

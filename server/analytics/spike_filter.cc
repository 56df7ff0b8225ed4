#include "server/analytics/spike_filter.h"

#include <algorithm>
#include <type_traits>

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

// The ring is written as it is in memory: a step and a value, no padding.
static_assert(std::is_trivially_copyable_v<FilteredPoint> && sizeof(FilteredPoint) == 2 * sizeof(uint64_t));

void SpikeFilter::SaveState(StateWriter& out) const {
  out.Put(width_);
  out.Put(seen_);
  // Whole, unused slots too: where the next sample goes depends on seen_ alone.
  out.PutVector(ring_);
}

bool SpikeFilter::LoadState(StateReader& in) {
  uint32_t width = 0;
  if (!in.Get(width)) return false;
  if (width != width_) return in.Fail("a spike filter was saved with another width");
  if (!in.Get(seen_)) return false;
  // Read in place, as PutVector wrote it: the ring keeps width_ slots.
  uint64_t size = 0;
  if (!in.Get(size)) return false;
  if (size != ring_.size()) return in.Fail("a spike filter's ring has another size");
  for (FilteredPoint& point : ring_) {
    if (!in.Get(point)) return false;
  }
  return true;
}

}  // namespace gradwatch::analytics

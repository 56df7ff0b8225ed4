// The one helper the fills of a RunAnalysis share (run_analytics.cc and
// run_analytics_projections.cc): entries kept from an earlier fill are overwritten in place.
#pragma once

#include <cstddef>
#include <vector>

namespace gradwatch::runs::analysis_slots {

// The next entry of `v` to overwrite, the (*used)th: assigning into an entry kept from an earlier
// fill reuses its strings' buffers. The caller trims `v` to *used at the end.
template <typename T>
T& NextSlot(std::vector<T>& v, size_t* used) {
  if (*used == v.size()) v.emplace_back();
  return v[(*used)++];
}

}  // namespace gradwatch::runs::analysis_slots

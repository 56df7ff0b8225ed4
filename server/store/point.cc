#include "server/store/point.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace gradwatch::store {

Point SamplePoint(uint64_t step, double value) {
  Point p;
  p.step = step;
  p.last_step = step;
  p.count = 1;
  p.last = value;
  if (std::isfinite(value)) {
    p.mean = p.min = p.max = value;
  } else {
    p.nonfinite = 1;
    p.mean = p.min = p.max = std::numeric_limits<double>::quiet_NaN();
  }
  return p;
}

bool IsSamplePoint(const Point& p) {
  if (p.count != 1 || p.step != p.last_step) return false;
  const Point s = SamplePoint(p.step, p.last);
  const auto same = [](double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); };
  return p.nonfinite == s.nonfinite && same(p.mean, s.mean) && same(p.min, s.min) && same(p.max, s.max);
}

void MergeInto(Point& a, const Point& b) {
  if (b.count == 0) return;
  if (a.count == 0) {
    a = b;
    return;
  }
  const uint64_t finite_a = a.count - a.nonfinite;
  const uint64_t finite_b = b.count - b.nonfinite;
  if (finite_a == 0) {
    a.mean = b.mean;
    a.min = b.min;
    a.max = b.max;
  } else if (finite_b != 0) {
    // Incremental form: stays within [min, max] and does not overflow for large magnitudes.
    a.mean += (b.mean - a.mean) * (static_cast<double>(finite_b) / static_cast<double>(finite_a + finite_b));
    a.min = std::min(a.min, b.min);
    a.max = std::max(a.max, b.max);
  }
  a.last_step = b.last_step;
  a.count += b.count;
  a.nonfinite += b.nonfinite;
  a.last = b.last;
}

}  // namespace gradwatch::store

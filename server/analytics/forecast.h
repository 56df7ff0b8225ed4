// When will a series reach a threshold at its current pace? ("total grad norm reaches 5.0 in
// ~48,000 steps, near step 148,000").
//
// Pure maths: no I/O.
#pragma once

#include <cstdint>
#include <string>

#include "server/analytics/regression.h"

namespace gradwatch::analytics {

struct Forecast {
  // Whether the threshold is reached at the current slope (true when already at or above it).
  bool reachable = false;
  // Steps after the fit's last step; 0 when already at or above; +inf when not reachable.
  double steps_to_threshold = 0;
  // The step at which it is reached (rounded to the nearest step, saturating at UINT64_MAX); the
  // fit's last step when already at or above; UINT64_MAX when not reachable.
  uint64_t at_step = 0;
  double current_value = 0;  // the fitted value at the fit's last step
  double slope_per_kstep = 0;
};

// From the fitted value at the fit's last step, at the fit's slope. A slope ≤ 0 (or NaN) never
// reaches a threshold above the current value: reachable = false, steps_to_threshold = +inf.
Forecast StepsToThreshold(const LinearFit& fit, double threshold);

// One line for humans, e.g. "reaches 5.0 in ~48,000 steps, near step 148,000" (both rounded to
// two significant digits of the step count), "already at or above 5.0 (now 5.3)", or
// "not rising: never at the current slope".
std::string DescribeForecast(const Forecast& forecast, double threshold);

}  // namespace gradwatch::analytics

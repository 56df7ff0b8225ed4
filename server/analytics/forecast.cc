#include "server/analytics/forecast.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace gradwatch::analytics {
namespace {

constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
// Step counts above this are written in scientific notation and get no "near step".
constexpr double kLargestGroupedSteps = 1e15;

// 148000 → "148,000".
std::string GroupThousands(uint64_t n) {
  std::string digits = std::to_string(n);
  std::string out;
  out.reserve(digits.size() + digits.size() / 3);
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) {
      out.push_back(',');
    }
    out.push_back(digits[i]);
  }
  return out;
}

// Shortest %g form up to 6 significant digits, with ".0" on whole numbers: 5 → "5.0", 0.75 → "0.75".
std::string FormatValue(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  std::string s = buf;
  if (std::isfinite(v) && s.find_first_of(".e") == std::string::npos) {
    s += ".0";
  }
  return s;
}

uint64_t RoundTo(uint64_t n, uint64_t granularity) {
  const uint64_t rounded = (n / granularity) * granularity;
  return n - rounded >= granularity / 2 + granularity % 2 && rounded <= kNever - granularity ? rounded + granularity
                                                                                             : rounded;
}

}  // namespace

Forecast StepsToThreshold(const LinearFit& fit, double threshold) {
  Forecast forecast;
  forecast.current_value = fit.value_at_last_step;
  forecast.slope_per_kstep = fit.slope_per_kstep();
  if (forecast.current_value >= threshold) {
    forecast.reachable = true;
    forecast.steps_to_threshold = 0;
    forecast.at_step = fit.last_step;
    return forecast;
  }
  const double steps = (threshold - forecast.current_value) / fit.slope_per_step;
  if (!(fit.slope_per_step > 0) || !std::isfinite(steps)) {
    forecast.reachable = false;
    forecast.steps_to_threshold = std::numeric_limits<double>::infinity();
    forecast.at_step = kNever;
    return forecast;
  }
  forecast.reachable = true;
  forecast.steps_to_threshold = steps;
  const double at = static_cast<double>(fit.last_step) + std::round(steps);
  // 2^64 is exactly representable; anything at or past it saturates.
  forecast.at_step = at >= 18446744073709551616.0 ? kNever : static_cast<uint64_t>(at);
  return forecast;
}

std::string DescribeForecast(const Forecast& forecast, double threshold) {
  if (!forecast.reachable) {
    return "not rising: never at the current slope";
  }
  const std::string target = FormatValue(threshold);
  if (forecast.steps_to_threshold <= 0) {
    return "already at or above " + target + " (now " + FormatValue(forecast.current_value) + ")";
  }
  if (forecast.steps_to_threshold >= kLargestGroupedSteps) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1e", forecast.steps_to_threshold);
    return "reaches " + target + " in ~" + buf + " steps";
  }
  const uint64_t steps = static_cast<uint64_t>(std::llround(forecast.steps_to_threshold));
  // Two significant digits: 47,962 → 48,000 and 523 → 520; the step is rounded alike.
  uint64_t granularity = 1;
  while (steps / granularity >= 100) {
    granularity *= 10;
  }
  return "reaches " + target + " in ~" + GroupThousands(RoundTo(steps, granularity)) + " steps, near step " +
         GroupThousands(RoundTo(forecast.at_step, granularity));
}

}  // namespace gradwatch::analytics

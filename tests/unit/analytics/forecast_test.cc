#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "server/analytics/forecast.h"
#include "server/analytics/regression.h"

using namespace gradwatch::analytics;
using Catch::Matchers::WithinRel;

namespace {

LinearFit FitAt(uint64_t last_step, double value, double slope_per_step) {
  LinearFit fit;
  fit.samples = 1000;
  fit.first_step = last_step - 999;
  fit.last_step = last_step;
  fit.slope_per_step = slope_per_step;
  fit.value_at_last_step = value;
  return fit;
}

}  // namespace

TEST_CASE("a rising series reaches the threshold at its current slope", "[analytics]") {
  // 0.59 at step 100,000 rising 1e-5 per step: 4.41 / 1e-5 = 441,000 steps to go.
  const Forecast forecast = StepsToThreshold(FitAt(100000, 0.59, 1e-5), 5.0);
  CHECK(forecast.reachable);
  CHECK_THAT(forecast.steps_to_threshold, WithinRel(441000.0, 1e-12));
  CHECK(forecast.at_step == 541000);
  CHECK(forecast.current_value == 0.59);
  CHECK_THAT(forecast.slope_per_kstep, WithinRel(1e-2, 1e-12));
  CHECK(DescribeForecast(forecast, 5.0) == "reaches 5.0 in ~440,000 steps, near step 540,000");
}

TEST_CASE("forecast descriptions round to two significant digits of the step count", "[analytics]") {
  // 2.0 / 4.17e-5 = 47,961.6 steps: "~48,000", near step 100,000 + 47,962 → "148,000".
  const Forecast forecast = StepsToThreshold(FitAt(100000, 3.0, 4.17e-5), 5.0);
  CHECK(forecast.at_step == 147962);
  CHECK(DescribeForecast(forecast, 5.0) == "reaches 5.0 in ~48,000 steps, near step 148,000");

  const Forecast soon = StepsToThreshold(FitAt(1000, 0.5, 0.25 / 523), 0.75);
  CHECK(DescribeForecast(soon, 0.75) == "reaches 0.75 in ~520 steps, near step 1,520");

  const Forecast next = StepsToThreshold(FitAt(41, 1.0, 0.5), 4.5);
  CHECK(next.at_step == 48);
  CHECK(DescribeForecast(next, 4.5) == "reaches 4.5 in ~7 steps, near step 48");
}

TEST_CASE("a flat or falling series never reaches a threshold above it", "[analytics]") {
  for (double slope : {0.0, -0.0, -1e-5, std::nan("")}) {
    const Forecast forecast = StepsToThreshold(FitAt(100000, 0.59, slope), 5.0);
    CHECK_FALSE(forecast.reachable);
    CHECK(forecast.steps_to_threshold == std::numeric_limits<double>::infinity());
    CHECK(forecast.at_step == std::numeric_limits<uint64_t>::max());
    CHECK(DescribeForecast(forecast, 5.0) == "not rising: never at the current slope");
  }
}

TEST_CASE("a series already at or above the threshold needs 0 steps", "[analytics]") {
  for (double slope : {1e-5, 0.0, -1e-5}) {
    const Forecast forecast = StepsToThreshold(FitAt(120000, 5.3, slope), 5.0);
    CHECK(forecast.reachable);
    CHECK(forecast.steps_to_threshold == 0.0);
    CHECK(forecast.at_step == 120000);
    CHECK(DescribeForecast(forecast, 5.0) == "already at or above 5.0 (now 5.3)");
  }
  CHECK(StepsToThreshold(FitAt(10, 5.0, -1.0), 5.0).steps_to_threshold == 0.0);
}

TEST_CASE("an absurdly distant forecast saturates instead of overflowing", "[analytics]") {
  const Forecast forecast = StepsToThreshold(FitAt(1000, 0.0, 1e-300), 5.0);
  CHECK(forecast.reachable);
  CHECK(forecast.at_step == std::numeric_limits<uint64_t>::max());
  CHECK(DescribeForecast(forecast, 5.0) == "reaches 5.0 in ~5.0e+300 steps");
}

TEST_CASE("a forecast from a windowed fit starts at the fitted value of the last step", "[analytics]") {
  WindowedSlope window(1000);
  for (uint64_t step = 58000; step <= 60000; step += 10) {
    window.AddSample(step, 0.28 + 5e-6 * static_cast<double>(step - 58000));
  }
  auto fit = window.Fit();
  REQUIRE(fit);
  const Forecast forecast = StepsToThreshold(*fit, 5.0);
  CHECK(forecast.reachable);
  CHECK_THAT(forecast.current_value, WithinRel(0.29, 1e-12));
  CHECK_THAT(forecast.steps_to_threshold, WithinRel(4.71 / 5e-6, 1e-9));
  CHECK(forecast.at_step == 60000 + 942000);
  CHECK(DescribeForecast(forecast, 5.0) == "reaches 5.0 in ~940,000 steps, near step 1,000,000");
}

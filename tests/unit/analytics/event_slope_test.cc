#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "server/analytics/event_slope.h"
#include "server/analytics/regression.h"

using namespace gradwatch::analytics;
using Catch::Matchers::WithinRel;

namespace {

// before_slope up to the event, after_slope from it on, continuous at the event.
double Piecewise(uint64_t step, uint64_t event, double base, double before_slope,
                 double after_slope) {
  if (step < event) {
    return base - before_slope * static_cast<double>(event - step);
  }
  return base + after_slope * static_cast<double>(step - event);
}

}  // namespace

TEST_CASE("an event's slope change is exact on a piecewise line and waits for min_after_samples",
          "[analytics]") {
  const uint64_t event = 50000;
  auto value = [&](uint64_t step) { return Piecewise(step, event, 340.0, 1e-3, 2.5e-3); };
  SlopeTracker tracker;
  for (uint64_t step = 0; step < event; ++step) {
    tracker.AddSample(step, value(step));
  }
  EventSlope slope(event, 5000, 100);
  slope.Seed(tracker);
  CHECK(slope.before_samples() == 5000);
  CHECK_FALSE(slope.Current());

  for (uint64_t step = event; step <= event + 6000; ++step) {
    tracker.AddSample(step, value(step));
    slope.AddSample(step, value(step));
    if (step == event + 98) {
      CHECK(slope.after_samples() == 99);
      CHECK_FALSE(slope.Current());
    }
    if (step == event + 99) {
      auto change = slope.Current();
      REQUIRE(change);
      CHECK(change->after.samples == 100);
      CHECK_THAT(change->ratio, WithinRel(2.5, 1e-10));
      CHECK_FALSE(change->after_window_full);
    }
  }
  auto change = slope.Current();
  REQUIRE(change);
  CHECK(change->event_step == event);
  CHECK(change->after_window_full);
  CHECK(change->before.first_step == event - 5000);
  CHECK(change->before.last_step == event - 1);
  CHECK(change->before.samples == 5000);
  CHECK(change->after.first_step == event);
  CHECK(change->after.last_step == event + 5000);  // [E, E + W]: the window stops growing
  CHECK(change->after.samples == 5001);
  CHECK_THAT(change->before.slope_per_kstep(), WithinRel(1.0, 1e-12));
  CHECK_THAT(change->after.slope_per_kstep(), WithinRel(2.5, 1e-12));
  CHECK_THAT(change->ratio, WithinRel(2.5, 1e-12));
  CHECK_THAT(change->difference_per_kstep, WithinRel(1.5, 1e-12));
  CHECK(change->before_stderr_per_kstep < 1e-9);
  CHECK(change->after_stderr_per_kstep < 1e-9);
}

TEST_CASE("an event registered after its step backfills both windows from the tracker",
          "[analytics]") {
  const uint64_t event = 50010;  // inside a 20-step bucket of the 20k window
  auto value = [&](uint64_t step) { return Piecewise(step, event, 100.0, 2e-3, 5e-3); };
  SlopeTracker tracker;
  REQUIRE(tracker.longest().bucket_steps() == 20);
  for (uint64_t step = 0; step <= event + 2000; ++step) {
    tracker.AddSample(step, value(step));
  }
  EventSlope slope(event, 5000, 500);
  slope.Seed(tracker);
  auto change = slope.Current();
  REQUIRE(change);
  // The bucket [50000, 50019] straddles the event and belongs to neither window.
  CHECK(change->before.first_step == 45020);
  CHECK(change->before.last_step == 49999);
  CHECK(change->after.first_step == 50020);
  CHECK(change->after.last_step == event + 2000);
  CHECK_THAT(change->ratio, WithinRel(2.5, 1e-10));

  // Samples the tracker already held are not counted twice; new ones extend the after window.
  const size_t seeded = slope.after_samples();
  slope.AddSample(event + 2000, value(event + 2000));
  CHECK(slope.after_samples() == seeded);
  slope.AddSample(event + 2001, value(event + 2001));
  CHECK(slope.after_samples() == seeded + 1);
  CHECK(slope.Current()->after.last_step == event + 2001);
}

TEST_CASE("the before window is frozen once the series passes the event", "[analytics]") {
  const uint64_t event = 8000;
  EventSlope slope(event, 1000, 10);
  slope.Seed(SlopeTracker());  // nothing held yet: registration well before the event
  for (uint64_t step = 0; step <= 9000; step += 10) {
    slope.AddSample(step, Piecewise(step, event, 10.0, 1e-3, -1e-3));
  }
  auto first = slope.Current();
  REQUIRE(first);
  CHECK(first->before.first_step == 7000);  // [E − W, E)
  CHECK(first->before.last_step == 7990);
  CHECK(first->before.samples == 100);
  for (uint64_t step = 9010; step < 12000; step += 10) {
    slope.AddSample(step, 1e6);  // wild values past the after window: ignored
  }
  auto later = slope.Current();
  REQUIRE(later);
  CHECK(later->before.samples == first->before.samples);
  CHECK(later->before.slope_per_step == first->before.slope_per_step);
  CHECK(later->after.last_step == 9000);
  CHECK_THAT(later->ratio, WithinRel(-1.0, 1e-12));
}

TEST_CASE("an event earlier than one window uses the steps from 0", "[analytics]") {
  EventSlope slope(300, 1000, 5);
  for (uint64_t step = 0; step < 400; ++step) {
    slope.AddSample(step, Piecewise(step, 300, 1.0, 1e-2, 3e-2));
  }
  auto change = slope.Current();
  REQUIRE(change);
  CHECK(change->before.first_step == 0);
  CHECK(change->before.samples == 300);
  CHECK_THAT(change->ratio, WithinRel(3.0, 1e-12));
}

TEST_CASE("the slope-change ratio is 2.0 within 0.2 at 3000 steps after the event under 3% noise",
          "[analytics]") {
  // Shaped like the incident: total grad norm 0.28 at step 58,000 rising 5e-6 per step, 1e-5 per
  // step after the routing switch at 81,716, with 3% lognormal noise.
  const uint64_t event = 81716;
  auto clean = [&](uint64_t step) {
    const double at_event = 0.28 + 5e-6 * static_cast<double>(event - 58000);
    return Piecewise(step, event, at_event, 5e-6, 1e-5);
  };
  for (uint64_t registered_at : {event, event + 1500}) {
    DYNAMIC_SECTION("registered at step " << registered_at) {
      std::mt19937_64 rng(20240917);
      std::normal_distribution<double> log_noise(0.0, 0.03);
      SlopeTracker tracker;
      EventSlope slope(event, 5000, 1000);
      bool seeded = false;
      for (uint64_t step = 58000; step <= event + 3000; ++step) {
        if (!seeded && step == registered_at) {
          slope.Seed(tracker);
          seeded = true;
        }
        const double v = clean(step) * std::exp(log_noise(rng));
        tracker.AddSample(step, v);
        if (seeded) {
          slope.AddSample(step, v);
        }
      }
      auto change = slope.Current();
      REQUIRE(change);
      CHECK(change->after.samples > 2900);
      CHECK(change->ratio == Approx(2.0).margin(0.2));
      CHECK(change->difference_per_kstep == Approx(5e-3).margin(1e-3));
      // Standard errors from the noise: σ ≈ 3% of ~0.4, over 5,000 and 3,000 steps.
      const double sigma = 0.03 * clean(event);
      const double before_theory = sigma / std::sqrt(5000.0 * (5000.0 * 5000.0 - 1) / 12) * 1e3;
      const double after_theory = sigma / std::sqrt(3000.0 * (3000.0 * 3000.0 - 1) / 12) * 1e3;
      CHECK_THAT(change->before_stderr_per_kstep, WithinRel(before_theory, 0.25));
      CHECK_THAT(change->after_stderr_per_kstep, WithinRel(after_theory, 0.25));
      CHECK_FALSE(change->after_window_full);
    }
  }
}

TEST_CASE("the ratio is infinite when the before slope is 0 and NaN when both are",
          "[analytics]") {
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(SlopeRatio(1e-3, 0.0) == inf);
  CHECK(SlopeRatio(1e-3, -0.0) == inf);
  CHECK(SlopeRatio(-1e-3, 0.0) == -inf);
  CHECK(std::isnan(SlopeRatio(0.0, 0.0)));
  CHECK(std::isnan(SlopeRatio(std::nan(""), 1.0)));
  CHECK(SlopeRatio(3.0, -1.5) == -2.0);

  EventSlope flat_then_rising(1000, 500, 10);
  for (uint64_t step = 0; step < 1200; ++step) {
    flat_then_rising.AddSample(step, step < 1000 ? 2.0 : 2.0 + 1e-3 * (step - 1000.0));
  }
  auto change = flat_then_rising.Current();
  REQUIRE(change);
  CHECK(change->before.slope_per_step == 0.0);
  CHECK(change->ratio == inf);
  CHECK_THAT(change->difference_per_kstep, WithinRel(1.0, 1e-12));
}

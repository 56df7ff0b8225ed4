#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "server/analytics/event_slope.h"
#include "server/analytics/regression.h"

using namespace gradwatch::analytics;
using Catch::Matchers::WithinRel;

namespace {

// before_slope up to the event, after_slope from it on, continuous at the event.
double Piecewise(uint64_t step, uint64_t event, double base, double before_slope, double after_slope) {
  if (step < event) {
    return base - before_slope * static_cast<double>(event - step);
  }
  return base + after_slope * static_cast<double>(step - event);
}

// Adds one sample to `window`, first handing the bucket it closes to `slopes` (as RunAnalytics
// feeds the event slopes of a series).
void Feed(WindowedSlope& window, const std::vector<EventSlope*>& slopes, uint64_t step, double value) {
  if (const std::optional<RegressionSums> closed = window.ClosedBy(step, value)) {
    for (EventSlope* slope : slopes) slope->AddClosedBucket(*closed);
  }
  window.AddSample(step, value);
}

void CheckSameFit(const LinearFit& a, const LinearFit& b) {
  CHECK(a.samples == b.samples);
  CHECK(a.first_step == b.first_step);
  CHECK(a.last_step == b.last_step);
  CHECK(a.slope_per_step == b.slope_per_step);
  CHECK(a.value_at_last_step == b.value_at_last_step);
}

}  // namespace

TEST_CASE("an event's slope change is exact on a piecewise line and waits for min_after_samples", "[analytics]") {
  const uint64_t event = 50000;
  auto value = [&](uint64_t step) { return Piecewise(step, event, 340.0, 1e-3, 2.5e-3); };
  WindowedSlope window(20000, 1000);
  REQUIRE(window.bucket_steps() == 20);
  for (uint64_t step = 0; step < event; ++step) window.AddSample(step, value(step));
  EventSlope slope(event, 5000, 100);
  slope.Seed(window);
  CHECK_FALSE(slope.Current(window));

  for (uint64_t step = event; step <= event + 6000; ++step) {
    Feed(window, {&slope}, step, value(step));
    if (step == event + 98) CHECK_FALSE(slope.Current(window));
    if (step == event + 99) {
      auto change = slope.Current(window);
      REQUIRE(change);
      CHECK(change->after.samples == 100);  // the open bucket counts while it lies in the window
      CHECK_THAT(change->ratio, WithinRel(2.5, 1e-10));
      CHECK_FALSE(change->after_window_full);
    }
  }
  auto change = slope.Current(window);
  REQUIRE(change);
  CHECK(change->event_step == event);
  CHECK(change->after_window_full);
  CHECK(change->before.first_step == event - 5000);
  CHECK(change->before.last_step == event - 1);
  CHECK(change->before.samples == 5000);
  CHECK(change->after.first_step == event);
  // [E, E + W] at bucket granularity: the bucket [55000, 55019] straddles the edge.
  CHECK(change->after.last_step == event + 4999);
  CHECK(change->after.samples == 5000);
  CHECK_THAT(change->before.slope_per_kstep(), WithinRel(1.0, 1e-12));
  CHECK_THAT(change->after.slope_per_kstep(), WithinRel(2.5, 1e-12));
  CHECK_THAT(change->ratio, WithinRel(2.5, 1e-12));
  CHECK_THAT(change->difference_per_kstep, WithinRel(1.5, 1e-12));
  CHECK(change->before_stderr_per_kstep < 1e-9);
  CHECK(change->after_stderr_per_kstep < 1e-9);
}

TEST_CASE("an event registered after its step backfills both windows from the tracker", "[analytics]") {
  const uint64_t event = 50010;  // inside a 20-step bucket of the 20k window
  auto value = [&](uint64_t step) { return Piecewise(step, event, 100.0, 2e-3, 5e-3); };
  WindowedSlope window(20000, 1000);
  for (uint64_t step = 0; step <= event + 2000; ++step) window.AddSample(step, value(step));
  EventSlope slope(event, 5000, 500);
  slope.Seed(window);
  auto change = slope.Current(window);
  REQUIRE(change);
  // The bucket [50000, 50019] straddles the event and belongs to neither window.
  CHECK(change->before.first_step == 45020);
  CHECK(change->before.last_step == 49999);
  CHECK(change->after.first_step == 50020);
  CHECK(change->after.last_step == event + 2000);
  CHECK_THAT(change->ratio, WithinRel(2.5, 1e-10));

  // The open bucket is counted once, however many samples join it.
  const size_t seeded = change->after.samples;
  Feed(window, {&slope}, event + 2001, value(event + 2001));
  CHECK(slope.Current(window)->after.samples == seeded + 1);
  CHECK(slope.Current(window)->after.last_step == event + 2001);
}

TEST_CASE("an event registered before, at or after its step gives the same change, bit for bit", "[analytics]") {
  // Shaped like the incident: total grad norm 0.28 at step 58,000 rising 5e-6 per step, 1e-5 per
  // step after the routing switch at 81,716, with 3% lognormal noise.
  const uint64_t event = 81716;
  auto clean = [&](uint64_t step) {
    const double at_event = 0.28 + 5e-6 * static_cast<double>(event - 58000);
    return Piecewise(step, event, at_event, 5e-6, 1e-5);
  };
  std::vector<std::optional<SlopeChange>> changes;
  for (uint64_t registered_at : {uint64_t{0}, event, event + 1500, event + 3000}) {
    std::mt19937_64 rng(20240917);
    std::normal_distribution<double> log_noise(0.0, 0.03);
    WindowedSlope window(20000, 128);
    std::optional<EventSlope> slope;
    std::vector<EventSlope*> slopes;
    for (uint64_t step = 58000; step <= event + 3000; ++step) {
      if (!slope && step >= registered_at) {
        slope.emplace(event, 5000, 1000);
        slope->Seed(window);
        slopes = {&*slope};
      }
      Feed(window, slopes, step, clean(step) * std::exp(log_noise(rng)));
    }
    if (!slope) {
      slope.emplace(event, 5000, 1000);
      slope->Seed(window);
    }
    changes.push_back(slope->Current(window));
  }
  REQUIRE(changes[0]);
  const SlopeChange& change = *changes[0];
  CHECK(change.after.samples > 2800);
  CHECK(change.ratio == Approx(2.0).margin(0.2));
  CHECK(change.difference_per_kstep == Approx(5e-3).margin(1e-3));
  // Standard errors from the noise: σ ≈ 3% of ~0.4, over 5,000 and 3,000 steps.
  const double sigma = 0.03 * clean(event);
  const double before_theory = sigma / std::sqrt(5000.0 * (5000.0 * 5000.0 - 1) / 12) * 1e3;
  const double after_theory = sigma / std::sqrt(3000.0 * (3000.0 * 3000.0 - 1) / 12) * 1e3;
  CHECK_THAT(change.before_stderr_per_kstep, WithinRel(before_theory, 0.25));
  CHECK_THAT(change.after_stderr_per_kstep, WithinRel(after_theory, 0.25));
  CHECK_FALSE(change.after_window_full);
  for (size_t i = 1; i < changes.size(); ++i) {
    INFO("registration " << i);
    REQUIRE(changes[i]);
    CheckSameFit(changes[i]->before, change.before);
    CheckSameFit(changes[i]->after, change.after);
    CHECK(changes[i]->ratio == change.ratio);
    CHECK(changes[i]->after_stderr_per_kstep == change.after_stderr_per_kstep);
  }
}

TEST_CASE("the before window is frozen once the series passes the event", "[analytics]") {
  const uint64_t event = 8000;
  WindowedSlope window(2000, 200);  // buckets of 10 steps
  EventSlope slope(event, 1000, 10);
  slope.Seed(window);  // nothing held yet: registration well before the event
  for (uint64_t step = 0; step <= 9000; step += 10) {
    Feed(window, {&slope}, step, Piecewise(step, event, 10.0, 1e-3, -1e-3));
  }
  auto first = slope.Current(window);
  REQUIRE(first);
  CHECK(first->before.first_step == 7000);  // [E − W, E)
  CHECK(first->before.last_step == 7990);
  CHECK(first->before.samples == 100);
  for (uint64_t step = 9010; step < 12000; step += 10) {
    Feed(window, {&slope}, step, 1e6);  // wild values past the after window: ignored
  }
  auto later = slope.Current(window);
  REQUIRE(later);
  CHECK(later->before.samples == first->before.samples);
  CHECK(later->before.slope_per_step == first->before.slope_per_step);
  CHECK(later->after.last_step == 9000);
  CHECK_THAT(later->ratio, WithinRel(-1.0, 1e-12));
}

TEST_CASE("an event earlier than one window uses the steps from 0", "[analytics]") {
  WindowedSlope window(1000, 1000);  // buckets of 1 step: exact edges
  EventSlope slope(300, 1000, 5);
  for (uint64_t step = 0; step < 400; ++step) Feed(window, {&slope}, step, Piecewise(step, 300, 1.0, 1e-2, 3e-2));
  auto change = slope.Current(window);
  REQUIRE(change);
  CHECK(change->before.first_step == 0);
  CHECK(change->before.samples == 300);
  CHECK_THAT(change->ratio, WithinRel(3.0, 1e-12));
}

TEST_CASE("the ratio is infinite when the before slope is 0 and NaN when both are", "[analytics]") {
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(SlopeRatio(1e-3, 0.0) == inf);
  CHECK(SlopeRatio(1e-3, -0.0) == inf);
  CHECK(SlopeRatio(-1e-3, 0.0) == -inf);
  CHECK(std::isnan(SlopeRatio(0.0, 0.0)));
  CHECK(std::isnan(SlopeRatio(std::nan(""), 1.0)));
  CHECK(SlopeRatio(3.0, -1.5) == -2.0);

  WindowedSlope window(1000, 1000);
  EventSlope flat_then_rising(1000, 500, 10);
  for (uint64_t step = 0; step < 1200; ++step) {
    Feed(window, {&flat_then_rising}, step, step < 1000 ? 2.0 : 2.0 + 1e-3 * (step - 1000.0));
  }
  auto change = flat_then_rising.Current(window);
  REQUIRE(change);
  CHECK(change->before.slope_per_step == 0.0);
  CHECK(change->ratio == inf);
  CHECK_THAT(change->difference_per_kstep, WithinRel(1.0, 1e-12));
}

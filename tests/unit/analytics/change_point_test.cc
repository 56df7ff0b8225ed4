#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "server/analytics/change_point.h"

using gradwatch::analytics::ChangePoint;
using gradwatch::analytics::ChangePointOptions;
using gradwatch::analytics::SlopeChangeDetector;

namespace {

// Tolerances below come from the detector's geometry and from 200 seeds of each scenario:
//  - a break is reported once its after-segment covers min_segment_steps (1,000) and it is no
//    longer the newest split allowed, plus 3 evaluations of 100 steps (persistence), plus the
//    time z needs to reach 5. Noise-free that is ~1,300 steps; over 200 seeds of 3% noise the
//    delay was 0.6k–1.5k steps for the piecewise line (slope 1e-4 → 2e-4 per step), 0.9k–2.2k
//    for the incident (5e-6 → 1e-5 per step: a weaker change against the same noise) and
//    0.7k–2.5k for the piecewise line reported every 10 steps;
//  - the break is estimated to a bucket (100 steps); the settled estimate was within ±200
//    steps of the true break for the piecewise line and within ±1,016 for the incident;
//  - the settled ratio was 1.83–2.16 for the piecewise line and 1.65–2.41 for the incident (a
//    3,000-step window each side, 3% noise).
constexpr uint64_t kPiecewiseBreak = 20000;
constexpr uint64_t kIncidentBreak = 81716;
constexpr double kNoise = 0.03;

using Curve = std::function<double(uint64_t)>;

// Slope 1e-4 per step, doubling at kPiecewiseBreak (value 3 there).
double Piecewise(uint64_t step) {
  if (step <= kPiecewiseBreak) return 1.0 + 1e-4 * static_cast<double>(step);
  return 3.0 + 2e-4 * static_cast<double>(step - kPiecewiseBreak);
}

// The incident's total grad norm: 0.28 at step 58,000 rising 5e-6 per step, 1e-5 per step after
// the switch at step 81,716 (0.59 at step 100k).
double IncidentGradNorm(uint64_t step) {
  const double at_break = 0.28 + 5e-6 * static_cast<double>(kIncidentBreak - 58000);
  if (step <= kIncidentBreak) return 0.28 + 5e-6 * (static_cast<double>(step) - 58000.0);
  return at_break + 1e-5 * static_cast<double>(step - kIncidentBreak);
}

struct Feed {
  uint64_t from = 0;
  uint64_t to = 0;
  uint64_t every = 1;
  double noise = 0;          // sigma of the lognormal multiplicative noise
  uint64_t spike_every = 0;  // a ×1.5 one-step spike on every multiple of this (0: none)
  uint64_t seed = 1;
};

// Feeds the curve and returns the changes AddSample reported, in order.
std::vector<ChangePoint> Run(SlopeChangeDetector& detector, const Curve& curve, const Feed& feed) {
  std::mt19937_64 rng(feed.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<ChangePoint> reported;
  for (uint64_t step = feed.from; step <= feed.to; step += feed.every) {
    double value = curve(step);
    if (feed.noise > 0) value *= std::exp(feed.noise * normal(rng));
    if (feed.spike_every != 0 && step != feed.from && step % feed.spike_every == 0) value *= 1.5;
    if (auto change = detector.AddSample(step, value)) reported.push_back(*change);
  }
  return reported;
}

int64_t Signed(uint64_t step) { return static_cast<int64_t>(step); }

}  // namespace

TEST_CASE("a noise-free doubling of the slope is reported once, at its break, with ratio 2", "[analytics]") {
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported = Run(detector, Piecewise, {.from = 0, .to = 40000});

  REQUIRE(reported.size() == 1);
  const ChangePoint& change = reported[0];
  CHECK(change.step == kPiecewiseBreak);
  CHECK(change.detected_at_step > kPiecewiseBreak);
  CHECK(change.detected_at_step - kPiecewiseBreak <= 1500);
  CHECK(change.slope_before_per_kstep == Approx(0.1));
  CHECK(change.slope_after_per_kstep == Approx(0.2));
  CHECK(change.ratio == Approx(2.0));
  CHECK(change.z_score >= 5.0);

  REQUIRE(detector.changes().size() == 1);
  CHECK(detector.changes()[0].settled);
  CHECK(detector.changes()[0].step == kPiecewiseBreak);
  CHECK(detector.changes()[0].ratio == Approx(2.0));
}

TEST_CASE("a break inside a bucket is placed at a neighbouring bucket boundary", "[analytics]") {
  constexpr uint64_t kBreak = 20037;
  auto curve = [](uint64_t step) {
    if (step <= kBreak) return 1.0 + 1e-4 * static_cast<double>(step);
    return 1.0 + 1e-4 * kBreak + 2e-4 * static_cast<double>(step - kBreak);
  };
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported = Run(detector, curve, {.from = 0, .to = 40000});

  REQUIRE(reported.size() == 1);
  REQUIRE(detector.changes().size() == 1);
  const ChangePoint& settled = detector.changes()[0];
  CHECK(std::abs(Signed(settled.step) - Signed(kBreak)) <= 100);
  CHECK(settled.ratio == Approx(2.0).margin(0.01));
}

TEST_CASE("with 3% lognormal noise the doubling is reported once, near its break, ratio about 2", "[analytics]") {
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported =
      Run(detector, Piecewise, {.from = 0, .to = 40000, .noise = kNoise, .seed = 7});

  REQUIRE(reported.size() == 1);
  const ChangePoint& first = reported[0];
  CHECK(first.detected_at_step > kPiecewiseBreak);
  CHECK(first.detected_at_step - kPiecewiseBreak <= 1500);
  CHECK(std::abs(Signed(first.step) - Signed(kPiecewiseBreak)) <= 1000);
  CHECK(first.ratio == Approx(2.0).margin(0.5));
  CHECK(first.z_score >= 5.0);

  REQUIRE(detector.changes().size() == 1);
  const ChangePoint& settled = detector.changes()[0];
  CHECK(settled.settled);
  CHECK(std::abs(Signed(settled.step) - Signed(kPiecewiseBreak)) <= 300);
  CHECK(settled.ratio == Approx(2.0).margin(0.2));
  CHECK(settled.slope_before_per_kstep == Approx(0.1).margin(0.01));
  CHECK(settled.slope_after_per_kstep == Approx(0.2).margin(0.02));
}

TEST_CASE("a slope that halves is reported with ratio about 0.5", "[analytics]") {
  auto curve = [](uint64_t step) {
    if (step <= kPiecewiseBreak) return 1.0 + 2e-4 * static_cast<double>(step);
    return 5.0 + 1e-4 * static_cast<double>(step - kPiecewiseBreak);
  };
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported = Run(detector, curve, {.from = 0, .to = 40000, .noise = kNoise, .seed = 3});

  REQUIRE(reported.size() == 1);
  REQUIRE(detector.changes().size() == 1);
  const ChangePoint& settled = detector.changes()[0];
  CHECK(std::abs(Signed(settled.step) - Signed(kPiecewiseBreak)) <= 1000);
  CHECK(settled.ratio == Approx(0.5).margin(0.1));
}

TEST_CASE("reporting every 10 steps still finds the doubling once", "[analytics]") {
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported =
      Run(detector, Piecewise, {.from = 0, .to = 40000, .every = 10, .noise = kNoise, .seed = 11});

  REQUIRE(reported.size() == 1);
  const ChangePoint& first = reported[0];
  CHECK(first.detected_at_step > kPiecewiseBreak);
  CHECK(first.detected_at_step - kPiecewiseBreak <= 2600);
  REQUIRE(detector.changes().size() == 1);
  const ChangePoint& settled = detector.changes()[0];
  CHECK(std::abs(Signed(settled.step) - Signed(kPiecewiseBreak)) <= 1000);
  CHECK(settled.ratio == Approx(2.0).margin(0.5));
}

TEST_CASE("a straight noisy line yields no change point", "[analytics]") {
  auto rising = [](uint64_t step) { return 1.0 + 1e-4 * static_cast<double>(step); };
  auto flat = [](uint64_t) { return 0.4; };
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    CAPTURE(seed);
    SlopeChangeDetector on_rising;
    CHECK(Run(on_rising, rising, {.from = 0, .to = 100000, .noise = kNoise, .seed = seed}).empty());
    CHECK(on_rising.changes().empty());
    SlopeChangeDetector on_flat;
    CHECK(Run(on_flat, flat, {.from = 0, .to = 100000, .noise = kNoise, .seed = seed}).empty());
  }
}

TEST_CASE("a x1.5 one-step spike every 3,000 steps on a straight noisy line is no change point", "[analytics]") {
  auto rising = [](uint64_t step) { return 0.28 + 5e-6 * static_cast<double>(step); };
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    CAPTURE(seed);
    SlopeChangeDetector every_step;
    CHECK(
        Run(every_step, rising, {.from = 0, .to = 100000, .noise = kNoise, .spike_every = 3000, .seed = seed}).empty());
    SlopeChangeDetector every_10_steps;
    CHECK(Run(every_10_steps, rising,
              {.from = 0, .to = 100000, .every = 10, .noise = kNoise, .spike_every = 3000, .seed = seed})
              .empty());
  }
}

TEST_CASE("a level shift without a slope change is no change point", "[analytics]") {
  // +30% at step 50,000 (about 10 noise sigmas) on a line rising 1e-5 per step.
  auto shifted = [](uint64_t step) {
    const double line = 1.0 + 1e-5 * static_cast<double>(step);
    return step >= 50000 ? 1.3 * line : line;
  };
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    CAPTURE(seed);
    SlopeChangeDetector detector;
    CHECK(Run(detector, shifted, {.from = 0, .to = 100000, .noise = kNoise, .seed = seed}).empty());
  }
}

TEST_CASE("the incident: one change near step 81,716 and none at the spikes", "[analytics]") {
  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported = Run(
      detector, IncidentGradNorm, {.from = 58000, .to = 100000, .noise = kNoise, .spike_every = 3000, .seed = 2024});

  REQUIRE(reported.size() == 1);
  const ChangePoint& first = reported[0];
  CHECK(first.detected_at_step > kIncidentBreak);
  CHECK(first.detected_at_step - kIncidentBreak <= 2500);
  CHECK(std::abs(Signed(first.step) - Signed(kIncidentBreak)) <= 1000);
  CHECK(first.slope_after_per_kstep > first.slope_before_per_kstep);

  REQUIRE(detector.changes().size() == 1);
  const ChangePoint& settled = detector.changes()[0];
  CHECK(settled.settled);
  CHECK(std::abs(Signed(settled.step) - Signed(kIncidentBreak)) <= 1000);
  CHECK(settled.slope_before_per_kstep == Approx(0.005).margin(0.001));
  CHECK(settled.slope_after_per_kstep == Approx(0.010).margin(0.001));
  CHECK(settled.ratio == Approx(2.0).margin(0.45));
}

TEST_CASE("x10 one-step spikes do not hide the incident's change: the median prefilter drops them", "[analytics]") {
  auto spiky = [](uint64_t step) { return IncidentGradNorm(step) * (step % 3000 == 0 ? 10.0 : 1.0); };
  const Feed feed{.from = 58000, .to = 100000, .noise = kNoise, .seed = 5};

  SlopeChangeDetector detector;
  const std::vector<ChangePoint> reported = Run(detector, spiky, feed);
  REQUIRE(reported.size() == 1);
  CHECK(std::abs(Signed(reported[0].step) - Signed(kIncidentBreak)) <= 1000);
  CHECK(reported[0].detected_at_step - kIncidentBreak <= 2500);

  // The spikes are strong enough to matter: unfiltered, their residuals swamp the change.
  ChangePointOptions unfiltered;
  unfiltered.prefilter_samples = 1;
  SlopeChangeDetector without_prefilter(unfiltered);
  CHECK(Run(without_prefilter, spiky, feed).empty());
}

TEST_CASE("non-finite values and steps that do not increase are ignored", "[analytics]") {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  SlopeChangeDetector clean;
  SlopeChangeDetector dirty;
  std::vector<ChangePoint> from_clean;
  std::vector<ChangePoint> from_dirty;
  int ignored_reported = 0;  // changes reported by samples that should have been ignored
  for (uint64_t step = 0; step <= 40000; ++step) {
    if (auto c = clean.AddSample(step, Piecewise(step))) from_clean.push_back(*c);
    if (step % 1000 == 500) {
      ignored_reported += dirty.AddSample(step, kNaN).has_value();
      continue;
    }
    if (step % 1000 == 700) {
      ignored_reported += dirty.AddSample(step, kInf).has_value();
      continue;
    }
    if (auto c = dirty.AddSample(step, Piecewise(step))) from_dirty.push_back(*c);
    if (step > 0) ignored_reported += dirty.AddSample(step - 1, 1e9).has_value();  // regression
    ignored_reported += dirty.AddSample(step, 1e9).has_value();                    // repeat
  }
  CHECK(ignored_reported == 0);
  REQUIRE(from_clean.size() == 1);
  REQUIRE(from_dirty.size() == 1);
  CHECK(from_dirty[0].step == kPiecewiseBreak);
  CHECK(from_dirty[0].ratio == Approx(2.0));
}

TEST_CASE("every break of a zigzag is reported once and only the newest max_changes are kept", "[analytics]") {
  // The slope alternates between 1e-4 and 3e-4 per step every 10,000 steps: breaks at 10k, 20k,
  // 30k and 40k.
  auto zigzag = [](uint64_t step) {
    double value = 1.0;
    for (uint64_t s = 0; s < step; s += 10000) {
      const uint64_t length = std::min<uint64_t>(10000, step - s);
      value += ((s / 10000) % 2 == 0 ? 1e-4 : 3e-4) * static_cast<double>(length);
    }
    return value;
  };
  ChangePointOptions options;
  options.max_changes = 2;
  SlopeChangeDetector detector(options);
  const std::vector<ChangePoint> reported = Run(detector, zigzag, {.from = 0, .to = 48000});

  REQUIRE(reported.size() == 4);
  for (size_t i = 0; i < reported.size(); ++i) {
    CAPTURE(i);
    CHECK(reported[i].step == 10000 * (i + 1));
    CHECK(reported[i].ratio == Approx(i % 2 == 0 ? 3.0 : 1.0 / 3.0));
  }
  REQUIRE(detector.changes().size() == 2);
  CHECK(detector.changes()[0].step == 30000);
  CHECK(detector.changes()[1].step == 40000);
}

TEST_CASE("options are bounded: an even prefilter block becomes odd, zero minimums are raised", "[analytics]") {
  ChangePointOptions options;
  options.prefilter_samples = 4;
  options.min_samples = 0;
  options.persistence = 0;
  options.max_changes = 0;
  options.min_segment_steps = 0;
  const SlopeChangeDetector detector(options);
  CHECK(detector.options().prefilter_samples == 5);
  CHECK(detector.options().min_samples == 3);
  CHECK(detector.options().persistence == 1);
  CHECK(detector.options().max_changes == 1);
  CHECK(detector.options().min_segment_steps == 1000);
}

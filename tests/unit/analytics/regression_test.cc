#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "server/analytics/regression.h"
#include "server/core/state_io.h"

using namespace gradwatch::analytics;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;
using gradwatch::StateReader;
using gradwatch::StateWriter;

namespace {

constexpr double kExact = 1e-12;

double Line(double intercept, double slope, uint64_t step) { return intercept + slope * static_cast<double>(step); }

// Least-squares fit by the two-pass (centred) formula in long double: the reference.
struct Reference {
  double slope;
  double value_at_last;
  double residual_stddev;
};
Reference TwoPassFit(const std::vector<uint64_t>& steps, const std::vector<double>& values) {
  const long double n = steps.size();
  long double mx = 0, my = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    mx += steps[i];
    my += values[i];
  }
  mx /= n;
  my /= n;
  long double sxx = 0, sxy = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    sxx += (steps[i] - mx) * (steps[i] - mx);
    sxy += (steps[i] - mx) * (values[i] - my);
  }
  const long double slope = sxy / sxx;
  long double ssr = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const long double residual = values[i] - (my + slope * (steps[i] - mx));
    ssr += residual * residual;
  }
  return {static_cast<double>(slope), static_cast<double>(my + slope * (steps.back() - mx)),
          static_cast<double>(std::sqrt(ssr / (n - 2)))};
}

// The samples (steps[i], values[i]) whose step lies in [fit.first_step, fit.last_step]: those a
// window's fit covers.
std::pair<std::vector<uint64_t>, std::vector<double>> Covered(const LinearFit& fit, const std::vector<uint64_t>& steps,
                                                              const std::vector<double>& values) {
  std::pair<std::vector<uint64_t>, std::vector<double>> out;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] >= fit.first_step && steps[i] <= fit.last_step) {
      out.first.push_back(steps[i]);
      out.second.push_back(values[i]);
    }
  }
  return out;
}

// Σ(x − x̄)² for the consecutive steps [first, last] with one sample each.
double ConsecutiveSxx(uint64_t first, uint64_t last) {
  const double n = static_cast<double>(last - first + 1);
  return n * (n * n - 1) / 12.0;
}

}  // namespace

TEST_CASE("regression sums fit an exact line exactly", "[analytics]") {
  RegressionSums sums;
  for (uint64_t step = 100000; step <= 100100; ++step) {
    REQUIRE(sums.Add(step, Line(3.0, 0.25, step)));
  }
  auto fit = sums.Fit();
  REQUIRE(fit);
  CHECK(fit->samples == 101);
  CHECK(fit->first_step == 100000);
  CHECK(fit->last_step == 100100);
  CHECK_THAT(fit->slope_per_step, WithinRel(0.25, kExact));
  CHECK_THAT(fit->slope_per_kstep(), WithinRel(250.0, kExact));
  CHECK_THAT(fit->value_at_last_step, WithinRel(Line(3.0, 0.25, 100100), kExact));
  CHECK_THAT(fit->PredictAt(100600), WithinRel(Line(3.0, 0.25, 100600), kExact));
  CHECK_THAT(fit->PredictAt(99000), WithinRel(Line(3.0, 0.25, 99000), kExact));
  CHECK_THAT(fit->residual_stddev, WithinAbs(0.0, 1e-9));
  CHECK_THAT(fit->slope_stderr_per_step, WithinAbs(0.0, 1e-12));
}

TEST_CASE("regression sums need two distinct steps to fit and three samples for a stderr", "[analytics]") {
  RegressionSums sums;
  CHECK_FALSE(sums.Fit());
  sums.Add(10, 1.0);
  CHECK_FALSE(sums.Fit());
  sums.Add(10, 2.0);
  CHECK_FALSE(sums.Fit());  // two samples, one step: no slope

  RegressionSums two;
  two.Add(10, 1.0);
  two.Add(12, 2.0);
  auto fit = two.Fit();
  REQUIRE(fit);
  CHECK_THAT(fit->slope_per_step, WithinRel(0.5, kExact));
  CHECK(std::isnan(fit->slope_stderr_per_step));
  CHECK(std::isnan(fit->residual_stddev));

  two.Add(14, 3.5);
  fit = two.Fit();
  REQUIRE(fit);
  CHECK(std::isfinite(fit->slope_stderr_per_step));
  CHECK(fit->slope_stderr_per_step > 0);
}

TEST_CASE("regression sums ignore non-finite values", "[analytics]") {
  RegressionSums sums;
  CHECK_FALSE(sums.Add(1, std::numeric_limits<double>::quiet_NaN()));
  CHECK_FALSE(sums.Add(2, std::numeric_limits<double>::infinity()));
  CHECK(sums.empty());
  sums.Add(3, 1.0);
  sums.Add(4, 2.0);
  CHECK_THAT(sums.Fit()->slope_per_step, WithinRel(1.0, kExact));
}

TEST_CASE("a constant series has slope exactly 0 and its value, as in Prometheus", "[analytics]") {
  RegressionSums sums;
  for (uint64_t step = 5; step < 50; step += 3) {
    sums.Add(step, 1234567.891);
  }
  auto fit = sums.Fit();
  REQUIRE(fit);
  CHECK(fit->slope_per_step == 0.0);
  CHECK(fit->value_at_last_step == 1234567.891);
}

TEST_CASE("merging and subtracting sums with different origins equals a direct fit", "[analytics]") {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> noise(0.0, 0.3);
  std::vector<uint64_t> steps;
  std::vector<double> values;
  RegressionSums first(1000, 5.0), second(5000, -7.0), all;
  for (uint64_t step = 1000; step < 9000; step += 7) {
    const double v = 1e3 + 0.01 * static_cast<double>(step) + noise(rng);
    steps.push_back(step);
    values.push_back(v);
    (step < 5000 ? first : second).Add(step, v);
    all.Add(step, v);
  }
  RegressionSums merged;
  merged.Merge(first);
  merged.Merge(second);
  auto direct = all.Fit();
  auto via_merge = merged.Fit();
  REQUIRE(direct);
  REQUIRE(via_merge);
  const Reference ref = TwoPassFit(steps, values);
  CHECK_THAT(via_merge->slope_per_step, WithinRel(ref.slope, kExact));
  CHECK_THAT(via_merge->value_at_last_step, WithinRel(ref.value_at_last, kExact));
  CHECK_THAT(via_merge->slope_stderr_per_step, WithinRel(direct->slope_stderr_per_step, 1e-9));
  CHECK(via_merge->first_step == 1000);
  CHECK(via_merge->last_step == steps.back());

  // Removing the first part leaves the second.
  merged.Subtract(first);
  merged.SetStepRange(second.first_step(), second.last_step());
  auto rest = merged.Fit();
  auto second_fit = second.Fit();
  REQUIRE(rest);
  CHECK(rest->samples == second.count());
  CHECK_THAT(rest->slope_per_step, WithinRel(second_fit->slope_per_step, 1e-10));
  CHECK_THAT(rest->value_at_last_step, WithinRel(second_fit->value_at_last_step, kExact));

  merged.Subtract(second);
  CHECK(merged.empty());
  CHECK_FALSE(merged.Fit());
}

TEST_CASE("packed sums keep a bucket's steps, count and fit in 40 bytes", "[analytics]") {
  STATIC_REQUIRE(sizeof(PackedSums) == 40);
  std::mt19937_64 rng(11);
  std::normal_distribution<double> noise(0.0, 0.3);
  std::vector<uint64_t> steps;
  std::vector<double> values;
  // A bucket far along the step axis with values near 1e6: its origins keep the terms small.
  RegressionSums bucket;
  for (uint64_t step = 7'000'000'000; step < 7'000'000'157; step += 3) {
    const double v = 1e6 + 0.25 * static_cast<double>(step - 7'000'000'000) + noise(rng);
    steps.push_back(step);
    values.push_back(v);
    bucket.Add(step, v);
  }
  const PackedSums packed(bucket);
  // Every third step: Σx and Σx² follow from the count and the span.
  CHECK(packed.evenly_spaced());
  CHECK(packed.count() == bucket.count());
  // The first step keeps its low 32 bits: read with any step from it to kMaxReach past it.
  for (const uint64_t reference : {steps.front(), steps.back(), steps.front() + PackedSums::kMaxReach}) {
    CHECK(packed.first_step(reference) == 7'000'000'000);
    CHECK(packed.last_step(reference) == steps.back());
  }
  const RegressionSums unpacked = packed.Unpack(steps.back());
  CHECK(unpacked.origin_step() == bucket.origin_step());
  // The first value's origin (not a packable one) is shifted to the packable one nearest it.
  REQUIRE_FALSE(PackedSums::IsPackableOrigin(bucket.value_origin()));
  CHECK(unpacked.value_origin() == PackedSums::PackableOrigin(bucket.value_origin()));
  CHECK(std::abs(unpacked.value_origin() - bucket.value_origin()) <= std::ldexp(bucket.value_origin(), -20));
  CHECK(unpacked.first_step() == bucket.first_step());
  CHECK(unpacked.last_step() == bucket.last_step());
  const Reference ref = TwoPassFit(steps, values);
  const auto fit = unpacked.Fit();
  REQUIRE(fit);
  CHECK_THAT(fit->slope_per_step, WithinRel(ref.slope, kExact));
  CHECK_THAT(fit->value_at_last_step, WithinRel(ref.value_at_last, kExact));
  CHECK_THAT(fit->slope_stderr_per_step, WithinRel(bucket.Fit()->slope_stderr_per_step, 1e-9));

  // Merged into sums with other origins and removed again, it leaves them empty.
  RegressionSums window(1000, 3.0);
  window.Merge(unpacked);
  CHECK(window.count() == bucket.count());
  window.Subtract(packed.Unpack(steps.back()));
  CHECK(window.empty());
}

namespace {

// What SaveState writes of `window`.
std::string SavedBytes(const WindowedSlope& window) {
  std::string bytes;
  StateWriter out(bytes);
  window.SaveState(out);
  return bytes;
}

// `fit` equals `expected`, bit for bit.
void RequireSameFit(const std::optional<LinearFit>& fit, const std::optional<LinearFit>& expected) {
  REQUIRE(fit.has_value() == expected.has_value());
  if (!fit) return;
  REQUIRE(fit->samples == expected->samples);
  REQUIRE(fit->first_step == expected->first_step);
  REQUIRE(fit->last_step == expected->last_step);
  REQUIRE(fit->slope_per_step == expected->slope_per_step);
  REQUIRE(fit->value_at_last_step == expected->value_at_last_step);
  REQUIRE(std::isnan(fit->slope_stderr_per_step) == std::isnan(expected->slope_stderr_per_step));
  if (!std::isnan(fit->slope_stderr_per_step)) REQUIRE(fit->slope_stderr_per_step == expected->slope_stderr_per_step);
}

}  // namespace

TEST_CASE("a packable value origin is the double's high 32 bits, kept whole for ±0 and ±Inf", "[analytics]") {
  for (const double v : {1.0, -2.5, 0.0, -0.0, std::numeric_limits<double>::infinity(), 65536.0}) {
    CHECK(PackedSums::IsPackableOrigin(v));
    CHECK(std::bit_cast<uint64_t>(PackedSums::PackableOrigin(v)) == std::bit_cast<uint64_t>(v));
  }
  for (const double v : {0.1, 1e-300, 4.9e-324, -1e300, 50.123456789, std::numeric_limits<double>::max()}) {
    const double origin = PackedSums::PackableOrigin(v);
    CHECK_FALSE(PackedSums::IsPackableOrigin(v));
    CHECK(PackedSums::IsPackableOrigin(origin));
    CHECK(std::signbit(origin) == std::signbit(v));
    CHECK(std::abs(origin) <= std::abs(v));
    // Relatively within 2^-20, or 2^-1042 for a subnormal value.
    CHECK(std::abs(v - origin) <= std::max(std::ldexp(std::abs(v), -20), std::ldexp(1.0, -1042)));
  }
  // A bucket whose origin is packable keeps its sums as they are, bit for bit.
  RegressionSums bucket(100, PackedSums::PackableOrigin(50.123456789));
  for (uint64_t step = 100; step < 108; ++step) bucket.Add(step, 50.123456789 + 0.001 * static_cast<double>(step));
  RequireSameFit(PackedSums(bucket).Unpack(107).Fit(), bucket.Fit());
}

TEST_CASE("an uneven bucket's step sums come back bit for bit from beside it, an even one's from its count",
          "[analytics]") {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(0.0, 0.3);
  // Steps as trainers report them: every step, every 10th, one step, one step twice, a gap, a
  // repeated step, and irregular steps.
  const std::vector<std::pair<std::vector<uint64_t>, bool>> buckets = {
      {{100, 101, 102, 103, 104, 105, 106, 107}, true},
      {{2000, 2010, 2020, 2030}, true},
      {{4'000'000'000'123}, true},
      {{77, 77}, true},
      {{100, 101, 102, 106, 107}, false},
      {{100, 101, 101, 102}, false},
      {{5, 6, 9, 15, 16, 40}, false},
  };
  for (const auto& [steps, even] : buckets) {
    RegressionSums bucket;
    for (const uint64_t step : steps) bucket.Add(step, 3.5 + 1e-3 * static_cast<double>(step % 1000) + noise(rng));
    const PackedSums packed(bucket);
    CHECK(packed.evenly_spaced() == even);
    const RegressionSums unpacked = packed.Unpack(bucket.first_step(), PackedSums::StepSumsOf(bucket));
    CHECK(unpacked.count() == bucket.count());
    CHECK(unpacked.first_step() == bucket.first_step());
    CHECK(unpacked.last_step() == bucket.last_step());
    RequireSameFit(unpacked.Fit(), PackedSums::Rounded(bucket).Fit());
    if (bucket.count() >= 2 && bucket.last_step() > bucket.first_step()) {
      const auto fit = unpacked.Fit();
      const auto exact = bucket.Fit();
      REQUIRE(fit);
      CHECK_THAT(fit->slope_per_step, WithinRel(exact->slope_per_step, 1e-12));
    }
    if (even) {
      // The step sums are not needed: whatever is handed in, the same sums come back.
      RequireSameFit(packed.Unpack(bucket.last_step(), {123.0, 456.0}).Fit(), unpacked.Fit());
    }
  }
}

TEST_CASE("a window with gaps and repeated steps keeps their step sums aside only while it holds them", "[analytics]") {
  std::mt19937_64 rng(17);
  std::normal_distribution<double> noise(0.0, 0.05);
  WindowedSlope window(1000, 64);  // 16-step buckets
  REQUIRE(window.bucket_steps() == 16);
  std::vector<uint64_t> steps;
  std::vector<double> values;
  auto feed = [&](uint64_t step) {
    const double v = Line(2.0, 4e-4, step) + noise(rng);
    REQUIRE(window.AddSample(step, v));
    steps.push_back(step);
    values.push_back(v);
  };
  // The fit over the window, against the two-pass reference over the samples it covers.
  auto check_fit = [&] {
    const auto fit = window.Fit();
    REQUIRE(fit);
    const auto [in_steps, in_values] = Covered(*fit, steps, values);
    REQUIRE(fit->samples == in_steps.size());
    const Reference ref = TwoPassFit(in_steps, in_values);
    REQUIRE_THAT(fit->slope_per_step, WithinRel(ref.slope, 1e-9));
    REQUIRE_THAT(fit->value_at_last_step, WithinRel(ref.value_at_last, 1e-12));
  };
  uint64_t step = 0;
  for (; step < 3000; ++step) feed(step);
  CHECK(window.uneven_buckets() == 0);
  check_fit();
  // A gap inside the bucket of steps [2992, 3008), then a step repeated in [3040, 3056), then
  // every 7th step (a 16-step bucket holds 2 or 3 such samples, evenly spaced).
  for (step = 3000; step < 3003; ++step) feed(step);
  for (step = 3005; step < 3040; ++step) feed(step);
  feed(3040);
  for (step = 3040; step < 3100; ++step) feed(step);
  CHECK(window.uneven_buckets() == 2);
  check_fit();
  for (step = 3100; step < 3700; step += 7) feed(step);
  check_fit();
  CHECK(window.uneven_buckets() >= 2);
  // Irregular steps, every bucket uneven.
  for (step = 3700; step < 3900; step += 1 + (step % 5)) feed(step);
  check_fit();
  const size_t uneven = window.uneven_buckets();
  CHECK(uneven > 2);

  // Saved and loaded, the window holds the same buckets and gives the same fits.
  const std::string bytes = SavedBytes(window);
  WindowedSlope loaded(1000, 64);
  StateReader in(bytes);
  REQUIRE(loaded.LoadState(in));
  CHECK(loaded.uneven_buckets() == uneven);
  RequireSameFit(loaded.Fit(), window.Fit());
  RequireSameFit(loaded.FitRange(3100, 3900), window.FitRange(3100, 3900));
  CHECK(SavedBytes(loaded) == bytes);

  // Every step again: once the window has moved past them, no uneven bucket is held.
  for (step = 3900; step < 6000; ++step) feed(step);
  CHECK(window.uneven_buckets() == 0);
  check_fit();
}

TEST_CASE("max_buckets is capped at 2^31 and a window at 2^32 steps", "[analytics]") {
  STATIC_REQUIRE(WindowedSlope::kMaxWindowSteps == uint64_t{1} << 32);
  const WindowedSlope huge(UINT64_MAX, 128);
  CHECK(huge.window_steps() == WindowedSlope::kMaxWindowSteps);
  CHECK(huge.bucket_steps() == WindowedSlope::kMaxWindowSteps / 128);
  const WindowedSlope one_bucket(UINT64_MAX, 1);
  CHECK(one_bucket.bucket_steps() == PackedSums::kMaxSpan + 1);
  const WindowedSlope most(UINT64_MAX, SIZE_MAX);
  CHECK(most.window_steps() == WindowedSlope::kMaxWindowSteps);
  CHECK(most.bucket_steps() == 2);
  CHECK(most.CapacityBytes() == sizeof(WindowedSlope) + WindowedSlope::kMaxBuckets * sizeof(PackedSums));
  const WindowedSlope usual(20000, 128);
  CHECK(usual.window_steps() == 20000);
  CHECK(usual.bucket_steps() == 157);
}

TEST_CASE("the windowed slope is exact for every sample when bucket_steps is 1", "[analytics]") {
  WindowedSlope window(500);
  REQUIRE(window.bucket_steps() == 1);
  for (uint64_t step = 0; step < 3000; ++step) {
    window.AddSample(step, Line(-2.0, 1.5e-3, step));
    if (step == 0) {
      CHECK_FALSE(window.Fit());
      continue;
    }
    auto fit = window.Fit();
    REQUIRE(fit);
    // The window (last − 500, last] holds exactly min(step + 1, 500) samples.
    REQUIRE(fit->samples == std::min<uint64_t>(step + 1, 500));
    REQUIRE(fit->first_step == (step >= 500 ? step - 499 : 0));
    REQUIRE(fit->last_step == step);
    REQUIRE_THAT(fit->slope_per_step, WithinRel(1.5e-3, kExact));
    REQUIRE_THAT(fit->value_at_last_step, WithinRel(Line(-2.0, 1.5e-3, step), kExact));
  }
}

TEST_CASE("the windowed slope fits exact lines exactly with bucket_steps above 1, edge by bucket", "[analytics]") {
  WindowedSlope window(20000, 1024);
  REQUIRE(window.bucket_steps() == 20);
  for (uint64_t step = 0; step < 70000; ++step) {
    window.AddSample(step, Line(78.4, 1.0e-3, step));
    if (step > 0 && step % 997 == 0) {
      auto fit = window.Fit();
      REQUIRE(fit);
      REQUIRE_THAT(fit->slope_per_kstep(), WithinRel(1.0, kExact));
      REQUIRE_THAT(fit->value_at_last_step, WithinRel(Line(78.4, 1.0e-3, step), kExact));
      // Never a sample from outside the window; at most bucket_steps − 1 oldest steps dropped.
      if (step >= 20000) {
        REQUIRE(fit->first_step > step - 20000);
        REQUIRE(fit->first_step <= step - 20000 + 20);
        REQUIRE(fit->samples == step - fit->first_step + 1);
      }
    }
  }
}

TEST_CASE("the windowed slope recovers a noisy slope within five theoretical standard errors", "[analytics]") {
  // y = 0.3 + 5e-6·step + N(0, σ²): the LS slope's stderr is σ / sqrt(Σ(x − x̄)²).
  const double sigma = 0.01;
  const double true_slope = 5e-6;
  for (uint64_t window_steps : {1000u, 20000u}) {
    DYNAMIC_SECTION("window " << window_steps) {
      std::mt19937_64 rng(42);
      std::normal_distribution<double> noise(0.0, sigma);
      WindowedSlope window(window_steps);
      double z_squares = 0;
      double stderr_ratio_min = 1e9, stderr_ratio_max = 0;
      int evaluations = 0;
      for (uint64_t step = 1; step <= 50 * window_steps; ++step) {
        window.AddSample(step, 0.3 + true_slope * static_cast<double>(step) + noise(rng));
        if (step % window_steps != 0) {
          continue;
        }
        auto fit = window.Fit();
        REQUIRE(fit);
        const double theory = sigma / std::sqrt(ConsecutiveSxx(fit->first_step, fit->last_step));
        const double z = (fit->slope_per_step - true_slope) / theory;
        REQUIRE(std::fabs(z) < 5.0);
        z_squares += z * z;
        stderr_ratio_min = std::min(stderr_ratio_min, fit->slope_stderr_per_step / theory);
        stderr_ratio_max = std::max(stderr_ratio_max, fit->slope_stderr_per_step / theory);
        CHECK_THAT(fit->residual_stddev, WithinRel(sigma, 0.2));
        ++evaluations;
      }
      // The reported stderr is within 20% of theory, and so is the observed scatter (50
      // non-overlapping windows: the RMS z-score's own spread is about 10%).
      CHECK(stderr_ratio_min > 0.8);
      CHECK(stderr_ratio_max < 1.2);
      const double rms_z = std::sqrt(z_squares / evaluations);
      CHECK(rms_z > 0.7);
      CHECK(rms_z < 1.3);
    }
  }
}

TEST_CASE("the windowed slope handles reporting every 10 steps", "[analytics]") {
  WindowedSlope window(1000);
  for (uint64_t step = 0; step <= 50000; step += 10) {
    window.AddSample(step, Line(0.28, 5e-6, step));
  }
  auto fit = window.Fit();
  REQUIRE(fit);
  // (49000, 50000] holds steps 49010, 49020, ..., 50000.
  CHECK(fit->samples == 100);
  CHECK(fit->first_step == 49010);
  CHECK(fit->last_step == 50000);
  CHECK_THAT(fit->slope_per_kstep(), WithinRel(5e-3, kExact));
}

TEST_CASE("the windowed slope handles gaps, and a gap longer than the window empties it", "[analytics]") {
  WindowedSlope window(1000);
  for (uint64_t step = 0; step < 2000; ++step) {
    if (step >= 1500 && step < 1800) {
      continue;  // 300 steps missing inside the window
    }
    window.AddSample(step, Line(1.0, 2e-3, step));
  }
  auto fit = window.Fit();
  REQUIRE(fit);
  CHECK(fit->samples == 1000 - 300);
  CHECK(fit->first_step == 1000);
  CHECK_THAT(fit->slope_per_step, WithinRel(2e-3, kExact));

  window.AddSample(5000, Line(1.0, 2e-3, 5000));  // everything before 4001 leaves
  CHECK(window.samples_in_window() == 1);
  CHECK_FALSE(window.Fit());
  window.AddSample(5010, Line(1.0, 2e-3, 5010));
  fit = window.Fit();
  REQUIRE(fit);
  CHECK(fit->samples == 2);
  CHECK_THAT(fit->slope_per_step, WithinRel(2e-3, kExact));
}

TEST_CASE("buckets keep their steps across 2^32 boundaries and gaps of more than 2^32 steps", "[analytics]") {
  // Buckets keep their first step's low 32 bits: steps that cross a multiple of 2^32, and a gap
  // far longer than 2^32 steps, must still expire and fit as the steps say.
  WindowedSlope window(1000, 16);  // 63-step buckets
  const uint64_t base = (uint64_t{5} << 32) - 700;
  for (uint64_t step = base; step < base + 1500; ++step) REQUIRE(window.AddSample(step, Line(4.0, 1e-3, step - base)));
  auto fit = window.Fit();
  REQUIRE(fit);
  CHECK(fit->last_step == base + 1499);
  CHECK(fit->first_step > base + 499);
  CHECK(fit->first_step <= base + 499 + window.bucket_steps());
  CHECK(fit->samples == fit->last_step - fit->first_step + 1);
  CHECK_THAT(fit->slope_per_step, WithinRel(1e-3, 1e-9));
  CHECK(window.SumsInRange(0, UINT64_MAX).first_step() == fit->first_step);

  // Three times 2^32 steps later (the same low 32 bits): everything before leaves.
  const uint64_t later = base + 1499 + (uint64_t{3} << 32);
  REQUIRE(window.AddSample(later, 9.0));
  CHECK(window.samples_in_window() == 1);
  CHECK_FALSE(window.Fit());
  REQUIRE(window.AddSample(later + 100, 9.5));
  fit = window.Fit();
  REQUIRE(fit);
  CHECK(fit->samples == 2);
  CHECK(fit->first_step == later);
  CHECK_THAT(fit->slope_per_step, WithinRel(0.005, kExact));

  // Saved and loaded, it reads the same steps, and saves the same bytes again.
  const std::string bytes = SavedBytes(window);
  WindowedSlope loaded(1000, 16);
  StateReader in(bytes);
  REQUIRE(loaded.LoadState(in));
  RequireSameFit(loaded.Fit(), window.Fit());
  CHECK(SavedBytes(loaded) == bytes);
}

TEST_CASE("the window forgets old samples: after a slope change the 1k window shows the new slope", "[analytics]") {
  SlopeTracker tracker;  // 1k, 5k, 20k
  REQUIRE(tracker.window_count() == 3);
  auto value = [](uint64_t step) {
    return step <= 10000 ? Line(50.0, 1e-3, step) : Line(50.0, 1e-3, 10000) + 3e-3 * static_cast<double>(step - 10000);
  };
  for (uint64_t step = 0; step <= 11000; ++step) {
    tracker.AddSample(step, value(step));
    if (step == 10500) {
      // Half the 1k window is past the change: strictly between the two slopes.
      const double mixed = tracker.window(0).Fit()->slope_per_kstep();
      CHECK(mixed > 1.0);
      CHECK(mixed < 3.0);
    }
  }
  // At step 11000 the 1k window (10000, 11000] lies entirely after the change.
  CHECK_THAT(tracker.window(0).Fit()->slope_per_kstep(), WithinRel(3.0, kExact));
  const double five_k = tracker.window(1).Fit()->slope_per_kstep();
  CHECK(five_k > 1.0);
  CHECK(five_k < 3.0);
  CHECK(tracker.window(2).Fit()->slope_per_kstep() < five_k);
}

TEST_CASE("the windowed slope ignores non-finite and out-of-order samples and counts them", "[analytics]") {
  WindowedSlope window(100);
  window.AddSample(10, 1.0);
  window.AddSample(20, 2.0);
  CHECK_FALSE(window.AddSample(21, std::numeric_limits<double>::quiet_NaN()));
  CHECK_FALSE(window.AddSample(22, -std::numeric_limits<double>::infinity()));
  CHECK_FALSE(window.AddSample(15, 100.0));
  CHECK(window.AddSample(20, 2.0));  // a repeated step is a sample like any other
  CHECK(window.ignored_non_finite() == 2);
  CHECK(window.ignored_out_of_order() == 1);
  CHECK(window.last_step() == 20);
  auto fit = window.Fit();
  REQUIRE(fit);
  CHECK(fit->samples == 3);
  CHECK_THAT(fit->slope_per_step, WithinRel(0.1, kExact));
}

TEST_CASE("periodic recompute keeps drift small over a million samples with large offsets", "[analytics]") {
  // Values near 1e6 with a slope of 1e-4 per step and small noise: a plain running sum would
  // accumulate the rounding of a million adds and subtracts.
  struct Case {
    uint64_t window_steps;
    size_t max_buckets;
  };
  for (Case c : {Case{1000, 1024}, Case{5000, 1024}, Case{20000, 64}}) {
    DYNAMIC_SECTION("window " << c.window_steps << ", max_buckets " << c.max_buckets) {
      std::mt19937_64 rng(3);
      std::normal_distribution<double> noise(0.0, 1e-3);
      WindowedSlope window(c.window_steps, c.max_buckets);
      const uint64_t first = 1'000'000'000;  // far along the step axis too
      const uint64_t last = first + 1'000'000;
      std::vector<uint64_t> steps;
      std::vector<double> values;
      for (uint64_t step = first; step < last; ++step) {
        const double v = 1e6 + 1e-4 * static_cast<double>(step - first) + noise(rng);
        window.AddSample(step, v);
        if (last - step <= c.window_steps) {
          steps.push_back(step);
          values.push_back(v);
        }
      }
      CHECK(window.recomputes() >= 10);
      auto fit = window.Fit();
      REQUIRE(fit);
      // The reference over exactly the samples the window holds (its edge is bucket-granular).
      const size_t skip = steps.size() - fit->samples;
      REQUIRE(skip < window.bucket_steps());
      steps.erase(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(skip));
      values.erase(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(skip));
      REQUIRE(fit->first_step == steps.front());
      const Reference ref = TwoPassFit(steps, values);
      // Measured: ≤ 3e-15 for the slope and ≤ 3e-10 for the residuals with the recompute; without
      // it the same sums drift to 6e-10 and 7e-7.
      CHECK_THAT(fit->slope_per_step, WithinRel(ref.slope, 1e-12));
      CHECK_THAT(fit->value_at_last_step, WithinRel(ref.value_at_last, 1e-14));
      CHECK_THAT(fit->residual_stddev, WithinRel(ref.residual_stddev, 1e-8));
    }
  }
}

TEST_CASE("FitRange uses only the held buckets that lie wholly inside the range", "[analytics]") {
  WindowedSlope exact(5000, 8192);  // bucket_steps 1
  WindowedSlope coarse(5000, 500);  // bucket_steps 10
  REQUIRE(coarse.bucket_steps() == 10);
  for (uint64_t step = 0; step < 6000; ++step) {
    const double v = step < 3000 ? Line(1.0, 1e-3, step) : Line(1.0, 1e-3, 3000) + 4e-3 * (step - 3000.0);
    exact.AddSample(step, v);
    coarse.AddSample(step, v);
  }
  auto before = exact.FitRange(2000, 2999);
  REQUIRE(before);
  CHECK(before->first_step == 2000);
  CHECK(before->last_step == 2999);
  CHECK(before->samples == 1000);
  CHECK_THAT(before->slope_per_step, WithinRel(1e-3, kExact));
  auto after = exact.FitRange(3000, 1'000'000);
  REQUIRE(after);
  CHECK(after->samples == 3000);
  CHECK_THAT(after->slope_per_step, WithinRel(4e-3, kExact));

  // Range edges inside a 10-step bucket: the straddling buckets are left out.
  auto coarse_before = coarse.FitRange(2005, 2994);
  REQUIRE(coarse_before);
  CHECK(coarse_before->first_step == 2010);
  CHECK(coarse_before->last_step == 2989);
  CHECK_THAT(coarse_before->slope_per_step, WithinRel(1e-3, kExact));

  // Steps the window no longer holds are not there.
  // At step 5999 the window (999, 5999] holds steps from 1000 on.
  CHECK_FALSE(exact.FitRange(0, 999));
  CHECK(exact.FitRange(0, 1500)->first_step == 1000);
}

TEST_CASE("the slope tracker feeds every window and delegates FitRange to the longest", "[analytics]") {
  SlopeTracker tracker({300, 2000, 700}, 1024);
  CHECK(tracker.longest().window_steps() == 2000);
  for (uint64_t step = 0; step < 5000; step += 2) {
    tracker.AddSample(step, Line(4.0, -2e-3, step));
  }
  CHECK(tracker.windows().size() == 3);
  CHECK(tracker.window(0).samples_in_window() == 150);
  CHECK(tracker.window(1).samples_in_window() == 1000);
  CHECK(tracker.window(2).samples_in_window() == 350);
  for (const WindowedSlope& window : tracker.windows()) {
    CHECK_THAT(window.Fit()->slope_per_kstep(), WithinRel(-2.0, kExact));
  }
  auto range = tracker.FitRange(3000, 3999);
  REQUIRE(range);
  CHECK(range->samples == 500);
  CHECK_FALSE(tracker.FitRange(0, 2000));  // left the longest window
  CHECK(SlopeTracker().windows().size() == 3);
  CHECK(SlopeTracker(std::vector<uint64_t>{}).window(2).window_steps() == 20000);
}

TEST_CASE("the windowed slope's ring grows as buckets arrive, wrapped or not, and keeps every fit", "[analytics]") {
  // window 40, 4 buckets of 10 steps: at most 5 buckets held. The ring starts empty, grows to 4,
  // and grows to 5 while wrapped (its oldest bucket is not at the front).
  WindowedSlope window(40, 4);
  REQUIRE(window.bucket_steps() == 10);
  std::vector<uint64_t> steps;
  std::vector<double> values;
  auto add = [&](uint64_t step, double value) {
    REQUIRE(window.AddSample(step, value));
    steps.push_back(step);
    values.push_back(value);
    const auto fit = window.Fit();
    if (!fit) return;
    const auto [in_steps, in_values] = Covered(*fit, steps, values);
    REQUIRE(fit->samples == in_steps.size());
    if (in_steps.size() < 3) return;
    const Reference ref = TwoPassFit(in_steps, in_values);
    REQUIRE_THAT(fit->slope_per_step, WithinRel(ref.slope, 1e-9) || WithinAbs(ref.slope, 1e-12));
  };
  for (uint64_t s : {0, 19, 20, 30, 45, 50}) add(s, 0.5 * static_cast<double>(s) + (s % 3 == 0 ? 1.0 : -1.0));
  CHECK(window.samples_in_window() == 5);  // steps 19..50: five buckets, the ring grew while wrapped
  uint64_t step = 50;
  for (int i = 0; i < 2000; ++i) {
    step += 1 + static_cast<uint64_t>((i * 7919) % 13);
    add(step, std::sin(0.01 * static_cast<double>(step)) * 100.0 + 0.001 * static_cast<double>(step));
  }
}

TEST_CASE("the windowed slope holds exactly the buckets whose oldest sample is in the window, through gaps",
          "[analytics]") {
  // A model of the window: samples grouped by bucket (step / bucket_steps); a bucket is held while
  // its oldest sample lies in (last − window, last]. Steps advance by 0 (a repeat) to beyond the
  // window, so the open bucket expires alone, the closed ones expire around it, and the ring grows,
  // wraps and empties.
  struct Case {
    uint64_t window_steps;
    size_t max_buckets;
  };
  for (Case c : {Case{100, 8}, Case{1000, 16}, Case{5000, 128}, Case{7, 3}}) {
    DYNAMIC_SECTION("window " << c.window_steps << ", max_buckets " << c.max_buckets) {
      WindowedSlope window(c.window_steps, c.max_buckets);
      std::mt19937_64 rng(11);
      std::vector<uint64_t> steps;
      std::vector<double> values;
      uint64_t step = 1'000'000;
      for (int i = 0; i < 4000; ++i) {
        const uint64_t r = rng() % 100;
        step += r < 3 ? 0 : r < 6 ? c.window_steps + rng() % (2 * c.window_steps) : 1 + rng() % 9;
        const double value = 3.0 + 1e-3 * static_cast<double>(step % 100000) + static_cast<double>(rng() % 1000) * 1e-4;
        const std::optional<RegressionSums> closes = window.ClosedBy(step, value);
        const RegressionSums* open = window.open_bucket();
        REQUIRE(window.AddSample(step, value));
        // ClosedBy names the open bucket exactly when the sample starts a new one.
        if (open != nullptr)
          REQUIRE(closes.has_value() ==
                  (window.open_bucket()->first_step() == step && window.open_bucket()->count() == 1));
        steps.push_back(step);
        values.push_back(value);

        // Samples are in step order, so a bucket's samples are consecutive, its oldest first.
        std::vector<uint64_t> in_steps;
        std::vector<double> in_values;
        uint64_t bucket_first = 0;
        for (size_t k = 0; k < steps.size(); ++k) {
          if (k == 0 || steps[k] / window.bucket_steps() != steps[k - 1] / window.bucket_steps()) {
            bucket_first = steps[k];
          }
          if (step - bucket_first < c.window_steps) {
            in_steps.push_back(steps[k]);
            in_values.push_back(values[k]);
          }
        }
        REQUIRE(window.samples_in_window() == in_steps.size());
        REQUIRE(window.SumsInRange(0, UINT64_MAX).count() == in_steps.size());
        REQUIRE(window.ClosedSumsInRange(0, UINT64_MAX).count() + window.open_bucket()->count() == in_steps.size());
        const auto fit = window.Fit();
        if (in_steps.front() == in_steps.back()) {
          REQUIRE_FALSE(fit);
        } else {
          REQUIRE(fit);
          REQUIRE(fit->first_step == in_steps.front());
          REQUIRE(fit->last_step == step);
          if (in_steps.size() >= 3) {
            const Reference ref = TwoPassFit(in_steps, in_values);
            REQUIRE_THAT(fit->slope_per_step, WithinRel(ref.slope, 1e-9) || WithinAbs(ref.slope, 1e-12));
            REQUIRE_THAT(fit->value_at_last_step, WithinRel(ref.value_at_last, 1e-12));
          }
        }
        // The model needs only the buckets whose oldest sample is within the last window.
        size_t stale = 0;
        while (stale < steps.size() && steps[stale] + c.window_steps < step) ++stale;
        while (stale > 0 && stale < steps.size() &&
               steps[stale] / window.bucket_steps() == steps[stale - 1] / window.bucket_steps()) {
          ++stale;
        }
        steps.erase(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(stale));
        values.erase(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(stale));
      }
    }
  }
}

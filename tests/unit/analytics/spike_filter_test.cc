#include <catch2/catch.hpp>

#include <vector>

#include "server/analytics/regression.h"
#include "server/analytics/spike_filter.h"

using namespace gradwatch::analytics;

TEST_CASE("the spike filter follows a line exactly, one sample pair behind", "[analytics]") {
  SpikeFilter f(5);
  std::vector<FilteredPoint> out;
  for (uint64_t s = 0; s < 10; ++s) {
    if (auto p = f.Add(100 + 10 * s, 1.0 + 0.5 * static_cast<double>(s))) out.push_back(*p);
  }
  REQUIRE(out.size() == 6);  // the first after 5 samples
  for (size_t i = 0; i < out.size(); ++i) {
    CHECK(out[i].step == 100 + 10 * (i + 2));  // the middle sample's step
    CHECK(out[i].value == 1.0 + 0.5 * static_cast<double>(i + 2));
  }
}

TEST_CASE("the spike filter removes one- and two-sample spikes and passes a level shift", "[analytics]") {
  SpikeFilter f(5);
  const std::vector<double> in = {1, 1, 1, 9, 1, 1, 1, 9, 9, 1, 1, 1, 5, 5, 5, 5, 5};
  std::vector<double> out;
  for (size_t i = 0; i < in.size(); ++i) {
    if (auto p = f.Add(i, in[i])) out.push_back(p->value);
  }
  // Middles at steps 2..14: the spikes at 3 and 7–8 never pass; the shift to 5 at 12 does, at 12.
  CHECK(out == std::vector<double>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 5, 5, 5});
}

TEST_CASE("a one-step spike near the end of a sparse window barely moves the filtered slope", "[analytics]") {
  // A report every 50 steps, slope 0.01 per 1k steps, one ×1.5 spike 100 steps before the end.
  WindowedSlope raw(5000, 128), filtered(5000, 128);
  SpikeFilter f(5);
  for (uint64_t s = 100'000; s <= 110'000; s += 50) {
    double v = 0.5 + 0.01 * static_cast<double>(s - 100'000) / 1000.0;
    if (s == 109'900) v *= 1.5;
    raw.AddSample(s, v);
    if (auto p = f.Add(s, v)) filtered.AddSample(p->step, p->value);
  }
  const double raw_slope = raw.Fit()->slope_per_kstep();
  const double filtered_slope = filtered.Fit()->slope_per_kstep();
  CHECK(raw_slope > 0.013);  // plain least squares: 34% too steep
  CHECK(filtered_slope == Approx(0.01).epsilon(1e-3));
}

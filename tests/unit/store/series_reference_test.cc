#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "server/store/series.h"
#include "tests/unit/store/reference_series.h"

using gradwatch::store::Point;
using gradwatch::store::Series;
using gradwatch::store::testing::ReferenceSeries;

namespace {

constexpr uint64_t kAllSteps = std::numeric_limits<uint64_t>::max();

uint64_t Bits(double v) { return std::bit_cast<uint64_t>(v); }

void CheckSame(const std::vector<Point>& got, const std::vector<Point>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("point " << i << " of " << got.size() << ", step " << want[i].step);
    REQUIRE(got[i].step == want[i].step);
    REQUIRE(got[i].last_step == want[i].last_step);
    REQUIRE(got[i].count == want[i].count);
    REQUIRE(got[i].nonfinite == want[i].nonfinite);
    REQUIRE(Bits(got[i].mean) == Bits(want[i].mean));
    REQUIRE(Bits(got[i].min) == Bits(want[i].min));
    REQUIRE(Bits(got[i].max) == Bits(want[i].max));
    REQUIRE(Bits(got[i].last) == Bits(want[i].last));
  }
}

std::vector<Point> InRange(const std::vector<Point>& all, uint64_t from, uint64_t to) {
  std::vector<Point> out;
  for (const Point& p : all) {
    if (p.last_step >= from && p.step <= to) out.push_back(p);
  }
  return out;
}

double RandomValue(std::mt19937_64& rng, uint64_t step) {
  switch (rng() % 8) {
    case 0: return std::numeric_limits<double>::quiet_NaN();
    case 1: return (rng() % 2 ? 1 : -1) * std::numeric_limits<double>::infinity();
    case 2: return -0.0;
    case 3: return std::numeric_limits<double>::denorm_min() * static_cast<double>(rng() % 1000);
    case 4: return 1.0;
    default: return std::sqrt(100.0 + 1e-4 * static_cast<double>(step)) + 1e-3 * static_cast<double>(rng() % 1000);
  }
}

}  // namespace

TEST_CASE("series holds exactly the points of the uncompressed series it replaced", "[store][codec]") {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937_64 rng(seed);
    const size_t recent = 2 + rng() % 300;
    const size_t history = 2 + rng() % 40;
    INFO("seed " << seed << ", recent " << recent << ", history " << history);
    Series series({.recent_points = recent, .history_buckets = history});
    ReferenceSeries reference(recent, history);
    uint64_t step = rng() % 100;
    for (int op = 0; op < 6000; ++op) {
      if (rng() % 400 == 0) {
        // A rewind, somewhere in what is held (or before it).
        const uint64_t from = step == 0 ? 0 : rng() % (step + 1);
        REQUIRE(series.TruncateFrom(from) == reference.TruncateFrom(from));
        const auto latest = reference.Latest();
        step = latest ? latest->last_step : from;
      } else {
        // Mostly strictly increasing steps, some repeats (refused by both).
        const uint64_t next = rng() % 50 == 0 ? step : step + 1 + (rng() % 10 == 0 ? rng() % 500 : 0);
        const double value = RandomValue(rng, next);
        REQUIRE(series.Append(next, value) == reference.Append(next, value));
        step = std::max(step, next);
      }
      REQUIRE(series.sample_count() == reference.sample_count());
      if (op % 211 == 0) {
        const std::vector<Point> all = reference.All();
        CheckSame(series.Query(0, kAllSteps), all);
        const uint64_t a = rng() % (step + 2);
        const uint64_t b = a + rng() % 400;
        CheckSame(series.Query(a, b), InRange(all, a, b));
        const auto got = series.Latest();
        const auto want = reference.Latest();
        REQUIRE(got.has_value() == want.has_value());
        if (want) CheckSame({*got}, {*want});
      }
    }
    CheckSame(series.Query(0, kAllSteps), reference.All());
  }
}

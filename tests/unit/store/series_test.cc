#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "server/store/series.h"

using gradwatch::store::MergeInto;
using gradwatch::store::Point;
using gradwatch::store::PointLog;
using gradwatch::store::Series;
using gradwatch::store::SeriesOptions;

namespace {

constexpr uint64_t kAllSteps = std::numeric_limits<uint64_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

uint64_t TotalCount(const std::vector<Point>& points) {
  uint64_t total = 0;
  for (const Point& p : points) total += p.count;
  return total;
}

// Sum of finite samples, recovered from the per-point means.
double FiniteSum(const std::vector<Point>& points) {
  double sum = 0;
  for (const Point& p : points) {
    if (p.count > p.nonfinite) sum += p.mean * (p.count - p.nonfinite);
  }
  return sum;
}

}  // namespace

TEST_CASE("recent samples are returned exactly, one point per step", "[store]") {
  Series series({.recent_points = 16, .history_buckets = 4});
  for (uint64_t i = 0; i < 10; ++i) REQUIRE(series.Append(100 + i * 5, 0.25 * i));

  const std::vector<Point> points = series.Query(0, kAllSteps);
  REQUIRE(points.size() == 10);
  for (uint64_t i = 0; i < 10; ++i) {
    const Point& p = points[i];
    CHECK(p.step == 100 + i * 5);
    CHECK(p.last_step == p.step);
    CHECK(p.count == 1);
    CHECK(p.nonfinite == 0);
    CHECK(p.mean == Approx(0.25 * i));
    CHECK(p.min == Approx(0.25 * i));
    CHECK(p.max == Approx(0.25 * i));
    CHECK(p.last == Approx(0.25 * i));
  }
  CHECK(series.sample_count() == 10);
}

TEST_CASE("Append rejects steps that do not strictly increase and keeps nothing", "[store]") {
  Series series({.recent_points = 4, .history_buckets = 2});
  REQUIRE(series.Append(0, 1.0));
  CHECK_FALSE(series.Append(0, 2.0));
  REQUIRE(series.Append(5, 3.0));
  CHECK_FALSE(series.Append(5, 4.0));
  CHECK_FALSE(series.Append(4, 5.0));

  CHECK(series.sample_count() == 2);
  const std::vector<Point> points = series.Query(0, kAllSteps);
  REQUIRE(points.size() == 2);
  CHECK(points[0].step == 0);
  CHECK(points[0].last == Approx(1.0));
  CHECK(points[1].step == 5);
  CHECK(points[1].last == Approx(3.0));
  CHECK(series.Latest()->last == Approx(3.0));
}

TEST_CASE("overflow into history preserves the total count, the sum and a spike's min and max", "[store]") {
  Series series({.recent_points = 8, .history_buckets = 4});
  double expected_sum = 0;
  for (uint64_t step = 1; step <= 100; ++step) {
    double value = 1.0;
    if (step == 17) value = 1000.0;
    if (step == 23) value = -50.0;
    expected_sum += value;
    REQUIRE(series.Append(step, value));
  }

  const std::vector<Point> points = series.Query(0, kAllSteps);
  REQUIRE(points.size() <= 8 + 4);
  CHECK(TotalCount(points) == 100);
  CHECK(FiniteSum(points) == Approx(expected_sum));

  bool spike_found = false;
  bool dip_found = false;
  for (const Point& p : points) {
    if (p.step <= 17 && 17 <= p.last_step) {
      CHECK(p.count > 1);  // the spike now lives in a downsampled bucket
      CHECK(p.max == Approx(1000.0));
      spike_found = true;
    }
    if (p.step <= 23 && 23 <= p.last_step) {
      CHECK(p.min == Approx(-50.0));
      dip_found = true;
    }
  }
  CHECK(spike_found);
  CHECK(dip_found);
}

TEST_CASE("pairwise compaction covers the whole step range with constant memory", "[store]") {
  const SeriesOptions options{.recent_points = 4, .history_buckets = 5};
  Series series(options);
  constexpr uint64_t kSamples = 1'000'000;
  constexpr uint64_t kFirstStep = 7;
  constexpr uint64_t kStride = 3;
  uint64_t accepted = 0;
  for (uint64_t i = 0; i < kSamples; ++i) {
    accepted += series.Append(kFirstStep + i * kStride, static_cast<double>(i % 100)) ? 1 : 0;
  }
  REQUIRE(accepted == kSamples);
  CHECK(series.MemoryBytes() <= Series::MaxMemoryBytes(options));
  CHECK(series.sample_count() == kSamples);

  const std::vector<Point> points = series.Query(0, kAllSteps);
  REQUIRE(points.size() <= 4 + 5);
  REQUIRE(points.size() > 4);  // history is in use
  CHECK(points.front().step == kFirstStep);
  CHECK(points.back().last_step == kFirstStep + (kSamples - 1) * kStride);
  for (size_t i = 1; i < points.size(); ++i) {
    // No gap and no overlap: each point starts at the step after the previous one ended.
    CHECK(points[i].step == points[i - 1].last_step + kStride);
  }
  CHECK(TotalCount(points) == kSamples);
  // Every wide bucket spans at least one full 0..99 cycle of values.
  for (const Point& p : points) {
    if (p.count < 200) continue;
    CHECK(p.min == Approx(0.0));
    CHECK(p.max == Approx(99.0));
    CHECK(p.mean == Approx(49.5).margin(1.0));
  }
}

TEST_CASE("NaN and Inf are counted as nonfinite and excluded from mean, min and max", "[store]") {
  SECTION("a single non-finite sample has no mean, min or max but keeps its raw value") {
    Series series({.recent_points = 4, .history_buckets = 2});
    REQUIRE(series.Append(1, std::nan("")));
    REQUIRE(series.Append(2, -kInf));
    const std::vector<Point> points = series.Query(0, kAllSteps);
    REQUIRE(points.size() == 2);
    CHECK(points[0].nonfinite == 1);
    CHECK(std::isnan(points[0].mean));
    CHECK(std::isnan(points[0].min));
    CHECK(std::isnan(points[0].max));
    CHECK(std::isnan(points[0].last));
    CHECK(points[1].last == -kInf);
    CHECK(std::isnan(points[1].mean));
  }

  SECTION("buckets in history merge only the finite samples") {
    Series series({.recent_points = 2, .history_buckets = 2});
    const std::vector<double> values = {1.0, std::nan(""), kInf, 3.0, -kInf, 5.0, 0, 0};
    for (size_t i = 0; i < values.size(); ++i) REQUIRE(series.Append(i + 1, values[i]));

    // The first six samples have left the recent ring; merge them into a single point.
    const std::vector<Point> merged = series.Query(1, 6, 1);
    REQUIRE(merged.size() == 1);
    CHECK(merged[0].step == 1);
    CHECK(merged[0].last_step == 6);
    CHECK(merged[0].count == 6);
    CHECK(merged[0].nonfinite == 3);
    CHECK(merged[0].mean == Approx(3.0));
    CHECK(merged[0].min == Approx(1.0));
    CHECK(merged[0].max == Approx(5.0));
    CHECK(merged[0].last == Approx(5.0));
  }

  SECTION("a bucket of only non-finite samples has NaN mean, min and max") {
    Series series({.recent_points = 2, .history_buckets = 2});
    for (uint64_t step = 1; step <= 4; ++step) REQUIRE(series.Append(step, std::nan("")));
    const std::vector<Point> points = series.Query(0, kAllSteps, 1);
    REQUIRE(points.size() == 1);
    CHECK(points[0].count == 4);
    CHECK(points[0].nonfinite == 4);
    CHECK(std::isnan(points[0].mean));
    CHECK(std::isnan(points[0].min));
    CHECK(std::isnan(points[0].max));
  }
}

TEST_CASE("Query returns only points overlapping the inclusive step range", "[store]") {
  Series series({.recent_points = 4, .history_buckets = 2});
  for (uint64_t step = 10; step <= 100; step += 10) REQUIRE(series.Append(step, 1.0));
  // Steps 10..60 left the ring and were compacted into buckets [10, 40] and [50, 60];
  // 70..100 are recent.

  const auto steps_of = [](const std::vector<Point>& points) {
    std::vector<uint64_t> steps;
    for (const Point& p : points) steps.push_back(p.step);
    return steps;
  };
  CHECK(steps_of(series.Query(70, 90)) == std::vector<uint64_t>{70, 80, 90});
  CHECK(steps_of(series.Query(90, 90)) == std::vector<uint64_t>{90});
  CHECK(series.Query(71, 79).empty());
  CHECK(series.Query(101, kAllSteps).empty());
  CHECK(series.Query(90, 70).empty());

  // A history bucket is returned whole when any part of it overlaps the range.
  const std::vector<Point> inside_bucket = series.Query(35, 35);
  REQUIRE(inside_bucket.size() == 1);
  CHECK(inside_bucket[0].step == 10);
  CHECK(inside_bucket[0].last_step == 40);
  CHECK(inside_bucket[0].count == 4);

  const std::vector<Point> across = series.Query(55, 75);
  REQUIRE(across.size() == 2);
  CHECK(across[0].step == 50);
  CHECK(across[0].last_step == 60);
  CHECK(across[1].step == 70);
  CHECK(across[1].count == 1);

  CHECK(TotalCount(series.Query(0, 65)) == 6);
}

TEST_CASE("Query with max_points downsamples evenly and keeps a spike's max", "[store]") {
  Series series({.recent_points = 1000, .history_buckets = 4});
  for (uint64_t step = 0; step < 1000; ++step) {
    REQUIRE(series.Append(step, step == 777 ? 1e6 : 1.0));
  }

  const std::vector<Point> points = series.Query(0, kAllSteps, 10);
  REQUIRE(points.size() == 10);
  for (size_t k = 0; k < points.size(); ++k) {
    CHECK(points[k].count == 100);
    CHECK(points[k].step == k * 100);
    CHECK(points[k].last_step == k * 100 + 99);
    CHECK(points[k].min == Approx(1.0));
    if (k == 7) {
      CHECK(points[k].max == Approx(1e6));
      CHECK(points[k].mean == Approx((99.0 + 1e6) / 100.0));
    } else {
      CHECK(points[k].max == Approx(1.0));
      CHECK(points[k].mean == Approx(1.0));
    }
  }

  CHECK(series.Query(0, kAllSteps, 3).size() == 3);
  CHECK(TotalCount(series.Query(0, kAllSteps, 3)) == 1000);
  // Fewer points than max_points come back unmerged.
  CHECK(series.Query(0, 4, 10).size() == 5);
}

TEST_CASE("Latest returns the newest sample, or nothing before the first", "[store]") {
  Series series({.recent_points = 2, .history_buckets = 2});
  CHECK_FALSE(series.Latest().has_value());

  for (uint64_t step = 1; step <= 50; ++step) REQUIRE(series.Append(step, step * 2.0));
  std::optional<Point> latest = series.Latest();
  REQUIRE(latest.has_value());
  CHECK(latest->step == 50);
  CHECK(latest->count == 1);
  CHECK(latest->last == Approx(100.0));

  CHECK_FALSE(series.Append(50, -1.0));
  CHECK(series.Latest()->last == Approx(100.0));
  REQUIRE(series.Append(51, kInf));
  CHECK(series.Latest()->last == kInf);
}

TEST_CASE("MergeInto weights the mean by finite counts and spans both points", "[store]") {
  Point a{.step = 1, .last_step = 4, .mean = 2.0, .min = 1.0, .max = 3.0, .count = 4, .nonfinite = 1, .last = 3.0};
  const Point b{
      .step = 5, .last_step = 5, .mean = 8.0, .min = 8.0, .max = 8.0, .count = 1, .nonfinite = 0, .last = 8.0};
  MergeInto(a, b);
  CHECK(a.step == 1);
  CHECK(a.last_step == 5);
  CHECK(a.count == 5);
  CHECK(a.nonfinite == 1);
  CHECK(a.mean == Approx((3 * 2.0 + 8.0) / 4));
  CHECK(a.min == Approx(1.0));
  CHECK(a.max == Approx(8.0));
  CHECK(a.last == Approx(8.0));

  Point empty;
  MergeInto(empty, b);
  CHECK(empty.step == 5);
  CHECK(empty.count == 1);
}

TEST_CASE("capacities below two are raised to two", "[store]") {
  Series series({.recent_points = 0, .history_buckets = 1});
  for (uint64_t step = 1; step <= 100; ++step) REQUIRE(series.Append(step, 1.0));
  const std::vector<Point> points = series.Query(0, kAllSteps);
  CHECK(points.size() <= 4);
  CHECK(TotalCount(points) == 100);
  CHECK(series.Latest()->step == 100);
}

TEST_CASE("a rewind drops recent points from its step on and later appends go on from there", "[store][rewind]") {
  Series series({.recent_points = 64, .history_buckets = 8});
  for (uint64_t s = 0; s <= 300; s += 10) REQUIRE(series.Append(s, 1.0 + s));
  CHECK(series.TruncateFrom(200) == 11);  // 200..300
  CHECK(series.sample_count() == 20);
  REQUIRE(series.Latest());
  CHECK(series.Latest()->step == 190);
  CHECK_FALSE(series.Append(190, 0.0));
  REQUIRE(series.Append(200, -5.0));
  const std::vector<Point> points = series.Query(150, kAllSteps);
  REQUIRE(points.size() == 6);
  CHECK(points.back().step == 200);
  CHECK(points.back().mean == -5.0);
  CHECK(points[4].step == 190);
  CHECK(points[4].mean == 191.0);
}

TEST_CASE("a rewind drops whole history buckets, the one straddling the step included", "[store][rewind]") {
  // 4 recent points; older samples go to buckets that end up holding 2 or 4 samples each.
  Series series({.recent_points = 4, .history_buckets = 4});
  for (uint64_t s = 0; s < 40; ++s) REQUIRE(series.Append(s, static_cast<double>(s)));
  const std::vector<Point> before = series.Query(0, kAllSteps);
  // Find a bucket that straddles a step: first < cut ≤ last.
  const Point* straddling = nullptr;
  for (const Point& p : before) {
    if (p.count > 1) straddling = &p;  // the newest multi-sample bucket
  }
  REQUIRE(straddling != nullptr);
  const uint64_t cut = straddling->step + 1;
  const uint64_t kept_before = straddling->step;  // steps below the bucket stay
  series.TruncateFrom(cut);

  const std::vector<Point> after = series.Query(0, kAllSteps);
  REQUIRE_FALSE(after.empty());
  for (const Point& p : after) {
    CHECK(p.last_step < cut);
    CHECK(p.max < static_cast<double>(cut));  // no value of a dropped step is left in any bucket
  }
  CHECK(after.back().last_step < kept_before);
  CHECK(TotalCount(after) == series.sample_count());
  REQUIRE(series.Latest());
  CHECK(series.Latest()->last_step == after.back().last_step);
  // The series goes on from the cut, at full resolution.
  REQUIRE(series.Append(cut, 1000.0));
  CHECK(series.Query(cut, cut).at(0).mean == 1000.0);
}

TEST_CASE("a rewind to a step before everything empties the series", "[store][rewind]") {
  Series series({.recent_points = 4, .history_buckets = 2});
  for (uint64_t s = 100; s < 120; ++s) REQUIRE(series.Append(s, 1.0));
  CHECK(series.TruncateFrom(0) == 20);
  CHECK(series.sample_count() == 0);
  CHECK_FALSE(series.Latest());
  CHECK(series.Query(0, kAllSteps).empty());
  REQUIRE(series.Append(5, 2.0));
  CHECK(series.Latest()->step == 5);
}

TEST_CASE("a series allocates nothing until it reports, then grows with its samples up to its bound", "[store]") {
  const SeriesOptions options{.recent_points = 64, .history_buckets = 16};
  Series series(options);
  const size_t empty = series.MemoryBytes();
  CHECK(empty == sizeof(Series));
  // The coding state (under 1 KB) and one chunk hold the first samples: small integers at
  // regular steps take a few bits each.
  REQUIRE(series.Append(1, 1.0));
  const size_t one_chunk = series.MemoryBytes();
  CHECK(one_chunk > empty + PointLog::kChunkBytes);
  CHECK(one_chunk <= empty + 1024 + PointLog::kChunkBytes);
  for (uint64_t s = 2; s <= 20; ++s) REQUIRE(series.Append(s, static_cast<double>(s)));
  CHECK(series.MemoryBytes() == one_chunk);
  // Past the ring's bound the history starts, small, then both stop at their bounds.
  size_t previous = 0;
  for (uint64_t s = 21; s <= 5000; ++s) {
    REQUIRE(series.Append(s, static_cast<double>(s)));
    CHECK(series.MemoryBytes() >= previous);
    previous = series.MemoryBytes();
  }
  CHECK(series.MemoryBytes() <= Series::MaxMemoryBytes(options));
  // Growth kept every sample in order: the newest 64 at full resolution, the rest in buckets.
  const std::vector<Point> points = series.Query(0, kAllSteps);
  CHECK(TotalCount(points) == 5000);
  REQUIRE(points.size() >= 64);
  for (size_t i = 0; i < 64; ++i) {
    const Point& p = points[points.size() - 64 + i];
    CHECK(p.step == 5000 - 63 + i);
    CHECK(p.mean == static_cast<double>(p.step));
  }
  CHECK(points.front().step == 1);
  CHECK(FiniteSum(points) == Approx(5000.0 * 5001.0 / 2.0));
}

TEST_CASE("a series emptied by a rewind before it wrapped grows again from where it was", "[store][rewind]") {
  Series series({.recent_points = 64, .history_buckets = 16});
  for (uint64_t s = 1; s <= 40; ++s) REQUIRE(series.Append(s, static_cast<double>(s)));
  CHECK(series.TruncateFrom(11) == 30);
  for (uint64_t s = 11; s <= 100; ++s) REQUIRE(series.Append(s, -static_cast<double>(s)));
  const std::vector<Point> points = series.Query(0, kAllSteps);
  CHECK(TotalCount(points) == 100);
  CHECK(points.back().step == 100);
  CHECK(points.back().mean == -100.0);
  CHECK(series.Latest()->last == -100.0);
}

TEST_CASE("a series refused growth keeps its first buffers and every sample, and grows later in order", "[store]") {
  const SeriesOptions options{.recent_points = 64, .history_buckets = 16};
  Series series(options);
  CHECK(series.NextGrowthBytes() >= PointLog::kChunkBytes);
  // Noisy values: 64 of them need more than one chunk.
  const auto value = [](uint64_t s) { return static_cast<double>(s) + 1.0 / static_cast<double>(s); };
  for (uint64_t s = 1; s <= 1000; ++s) REQUIRE(series.Append(s, value(s), /*may_grow=*/false));
  // The coding state, one chunk of recent points and one of history, whatever was refused.
  CHECK(series.MemoryBytes() <= sizeof(Series) + 1024 + 2 * (PointLog::kChunkBytes + 64));
  CHECK(series.recent_size() < 64);
  double sum = 0;
  for (uint64_t s = 1; s <= 1000; ++s) sum += value(s);
  std::vector<Point> points = series.Query(0, kAllSteps);
  CHECK(TotalCount(points) == 1000);
  CHECK(points.back().step == 1000);
  CHECK(FiniteSum(points) == Approx(sum));

  // Allowed again, the ring grows: the newest samples stay in order, all 64 at full resolution.
  for (uint64_t s = 1001; s <= 1100; ++s) REQUIRE(series.Append(s, value(s)));
  for (uint64_t s = 1001; s <= 1100; ++s) sum += value(s);
  points = series.Query(0, kAllSteps);
  CHECK(TotalCount(points) == 1100);
  for (size_t i = 1; i < points.size(); ++i) CHECK(points[i].step == points[i - 1].last_step + 1);
  CHECK(FiniteSum(points) == Approx(sum));
  CHECK(points.back().mean == value(1100));
  CHECK(series.recent_size() == 64);
}

TEST_CASE("what a series reserves before an append bounds what the append grows", "[store]") {
  // Noisy values: the chunks fill and the history compacts again and again over 20,000 samples.
  Series series({.recent_points = 64, .history_buckets = 16});
  uint64_t reserved_appends = 0;
  for (uint64_t s = 1; s <= 20000; ++s) {
    const double value = std::sin(static_cast<double>(s) * 0.7) * 1e3 + 1.0 / static_cast<double>(s);
    const size_t reserved = series.NextGrowthBytes();
    const size_t before = series.MemoryBytes();
    REQUIRE(series.Append(s, value));
    INFO("step " << s);
    CHECK(series.MemoryBytes() - before <= reserved);
    if (reserved > 0) ++reserved_appends;
  }
  CHECK(series.sample_count() == 20000);
  // Once its chunks are allocated a series reserves only when one may be needed (an owner with a
  // budget charges the reservation first): 20 of these 20,000 appends.
  CHECK(reserved_appends > 0);
  CHECK(reserved_appends < 100);
}

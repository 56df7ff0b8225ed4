#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <random>
#include <vector>

#include "server/store/point_log.h"

using gradwatch::store::IsSamplePoint;
using gradwatch::store::MergeInto;
using gradwatch::store::Point;
using gradwatch::store::PointLog;
using gradwatch::store::SamplePoint;

namespace {

uint64_t Bits(double v) { return std::bit_cast<uint64_t>(v); }

bool SameBits(const Point& a, const Point& b) {
  return a.step == b.step && a.last_step == b.last_step && a.count == b.count && a.nonfinite == b.nonfinite &&
         Bits(a.mean) == Bits(b.mean) && Bits(a.min) == Bits(b.min) && Bits(a.max) == Bits(b.max) &&
         Bits(a.last) == Bits(b.last);
}

std::vector<Point> Contents(const PointLog& log) {
  std::vector<Point> out;
  log.ForEach([&](const Point& p) { out.push_back(p); });
  return out;
}

void CheckSame(const PointLog& log, const std::deque<Point>& model) {
  REQUIRE(log.size() == model.size());
  const std::vector<Point> held = Contents(log);
  REQUIRE(held.size() == model.size());
  for (size_t i = 0; i < held.size(); ++i) {
    INFO("point " << i << " of " << held.size());
    REQUIRE(SameBits(held[i], model[i]));
  }
  if (!model.empty()) CHECK(SameBits(log.Back(), model.back()));
}

// Values that stress the XOR coding: NaNs with payloads and signs, infinities, zeros of both
// signs, denormals, extremes.
std::vector<double> SpecialValues() {
  return {0.0,
          -0.0,
          std::numeric_limits<double>::quiet_NaN(),
          -std::numeric_limits<double>::quiet_NaN(),
          std::bit_cast<double>(uint64_t{0x7ff0000000000001}),  // signalling NaN payload
          std::bit_cast<double>(uint64_t{0xfff8dead0000beef}),  // negative NaN with a payload
          std::numeric_limits<double>::infinity(),
          -std::numeric_limits<double>::infinity(),
          std::numeric_limits<double>::denorm_min(),
          -std::numeric_limits<double>::denorm_min(),
          std::bit_cast<double>(uint64_t{0x000fffffffffffff}),  // largest denormal
          std::numeric_limits<double>::min(),
          std::numeric_limits<double>::max(),
          std::numeric_limits<double>::lowest(),
          1.0,
          78.38367176906169,
          1e-300};
}

// A random point: a sample, or a bucket with independent fields.
Point RandomPoint(std::mt19937_64& rng, uint64_t step) {
  const std::vector<double> special = SpecialValues();
  auto value = [&]() -> double {
    switch (rng() % 4) {
      case 0: return special[rng() % special.size()];
      case 1: return std::bit_cast<double>(rng());  // any bit pattern
      case 2: return std::sqrt(100.0 + 1e-4 * static_cast<double>(step));
      default: return static_cast<double>(rng() % 5);
    }
  };
  if (rng() % 3 != 0) return SamplePoint(step, value());
  Point p;
  p.step = step;
  p.last_step = step + (rng() % 2 ? rng() % 8 : rng());
  p.count = static_cast<uint32_t>(rng());
  p.nonfinite = static_cast<uint32_t>(rng() % 3 ? 0 : rng());
  p.mean = value();
  p.min = value();
  p.max = value();
  p.last = value();
  return p;
}

// Steps that increase by a constant, by small jitter, by large jumps, or wrap around 2^64.
uint64_t NextStep(std::mt19937_64& rng, uint64_t step) {
  switch (rng() % 6) {
    case 0: return step + 1 + rng() % 3;
    case 1: return step + 1 + rng() % 3000;
    case 2: return step + (rng() >> (rng() % 64));
    case 3: return rng();
    default: return step + 1;
  }
}

}  // namespace

TEST_CASE("point log round-trips special values bit for bit, as samples and in buckets", "[store][codec]") {
  PointLog log;
  std::deque<Point> model;
  uint64_t step = 0;
  const std::vector<double> special = SpecialValues();
  for (double a : special) {
    for (double b : special) {
      ++step;
      const Point s = SamplePoint(step, a);
      REQUIRE(log.Append(s, true));
      model.push_back(s);
      Point bucket;
      bucket.step = ++step;
      bucket.last_step = step + 9;
      bucket.count = 10;
      bucket.nonfinite = std::isfinite(b) ? 0 : 1;
      bucket.mean = a;
      bucket.min = b;
      bucket.max = -a;
      bucket.last = b;
      step += 9;
      REQUIRE(log.Append(bucket, true));
      model.push_back(bucket);
    }
  }
  CheckSame(log, model);
  CHECK(log.chunks_allocated() > 1);
}

TEST_CASE("a sample point is recognised only when it is exactly SamplePoint's", "[store][codec]") {
  CHECK(IsSamplePoint(SamplePoint(5, 1.5)));
  CHECK(IsSamplePoint(SamplePoint(5, std::numeric_limits<double>::quiet_NaN())));
  CHECK(IsSamplePoint(SamplePoint(5, -0.0)));
  Point p = SamplePoint(5, 1.5);
  p.max = 2.0;
  CHECK_FALSE(IsSamplePoint(p));
  p = SamplePoint(5, 0.0);
  p.mean = -0.0;
  CHECK_FALSE(IsSamplePoint(p));
  p = SamplePoint(5, 1.0);
  p.last_step = 6;
  CHECK_FALSE(IsSamplePoint(p));
}

TEST_CASE("point log matches a deque under random appends, pops and truncations", "[store][codec]") {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    INFO("seed " << seed);
    std::mt19937_64 rng(seed);
    PointLog log;
    std::deque<Point> model;
    uint64_t step = rng() % 1000;
    for (int op = 0; op < 3000; ++op) {
      const uint64_t r = rng() % 100;
      if (r < 70 || model.empty()) {
        step = NextStep(rng, step);
        const Point p = RandomPoint(rng, step);
        REQUIRE(log.Append(p, true));
        model.push_back(p);
      } else if (r < 95) {
        REQUIRE(SameBits(log.PopFront(), model.front()));
        model.pop_front();
      } else if (r < 99) {
        const size_t keep = rng() % (model.size() + 1);
        log.Truncate(keep);
        model.resize(keep);
      } else {
        log.Clear();
        model.clear();
      }
      if (op % 97 == 0) CheckSame(log, model);
    }
    CheckSame(log, model);
  }
}

TEST_CASE("point log truncated at every position inside and at the edges of chunks goes on coding", "[store][codec]") {
  std::mt19937_64 rng(7);
  std::vector<Point> points;
  uint64_t step = 0;
  for (int i = 0; i < 200; ++i) {
    step = NextStep(rng, step);
    points.push_back(RandomPoint(rng, step));
  }
  for (size_t keep = 1; keep < points.size(); ++keep) {
    INFO("keep " << keep);
    PointLog log;
    for (const Point& p : points) REQUIRE(log.Append(p, true));
    log.Truncate(keep);
    std::deque<Point> model(points.begin(), points.begin() + static_cast<std::ptrdiff_t>(keep));
    CheckSame(log, model);
    // Appending after the cut codes against the kept point, over the bits of the dropped ones.
    for (size_t i = keep; i < points.size(); ++i) {
      const Point p = SamplePoint(points[keep - 1].step + (i - keep + 1), static_cast<double>(i) * 0.1);
      REQUIRE(log.Append(p, true));
      model.push_back(p);
    }
    CheckSame(log, model);
  }
}

TEST_CASE("point log reuses the chunks it empties and refuses a chunk it may not allocate", "[store][codec]") {
  PointLog log;
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> noise(0.9, 1.1);
  // A ring of 1,000 noisy samples: warm after the first lap, then no chunk is added.
  uint64_t step = 0;
  for (; step < 1000; ++step) REQUIRE(log.Append(SamplePoint(step, noise(rng)), true));
  for (; step < 3000; ++step) {
    log.PopFront();
    REQUIRE(log.Append(SamplePoint(step, noise(rng)), true));
  }
  // Compressed sizes vary with the values, so a later lap may need a chunk more than the first
  // ones; 17 more laps of 1,000 points add at most one.
  const size_t warm = log.chunks_allocated();
  for (; step < 20000; ++step) {
    log.PopFront();
    REQUIRE(log.Append(SamplePoint(step, noise(rng)), true));
  }
  CHECK(log.chunks_allocated() <= warm + 1);
  CHECK(log.size() == 1000);
  CHECK(log.MemoryBytes() <= PointLog::MaxMemoryBytes(1000, PointLog::kMaxSampleBits));

  // Full and refused: nothing appended until a chunk is emptied.
  const size_t chunks = log.chunks_allocated();
  while (log.NextGrowthBytes() == 0) REQUIRE(log.Append(SamplePoint(step++, noise(rng)), false));
  const size_t held = log.size();
  bool refused = false;
  for (int i = 0; i < 100 && !refused; ++i) {
    if (log.Append(SamplePoint(step, noise(rng)), false)) {
      ++step;
    } else {
      refused = true;
    }
  }
  REQUIRE(refused);
  CHECK(log.size() >= held);
  CHECK(log.chunks_allocated() == chunks);
  CHECK(log.Back().step == step - 1);
}

TEST_CASE("point log codes regular steps and slowly changing values in a few bits", "[store][codec]") {
  PointLog constant;
  PointLog drifting;
  for (uint64_t step = 1; step <= 4096; ++step) {
    REQUIRE(constant.Append(SamplePoint(step, 0.25), true));
    REQUIRE(drifting.Append(SamplePoint(step, std::sqrt(100.0 + 1e-4 * static_cast<double>(step))), true));
  }
  // 3 bits a sample (kind, step, value) against 56 bytes for an uncompressed Point.
  CHECK(constant.chunks_allocated() * PointLog::kChunkBytes <= 4096 * 3 / 8 + PointLog::kChunkBytes);
  // A smooth value changes about 30 low mantissa bits a step: under 7 bytes a sample.
  CHECK(drifting.chunks_allocated() * PointLog::kChunkBytes <= 4096 * 7);
}

TEST_CASE("point log narrows a value window that a chunk's first value or a jump left wide", "[store][codec]") {
  // Noisy norms change in all their low bits, so they fit in whatever window is open: the one a
  // chunk's first value (coded against zero) opens spans nearly 64 bits. Kept, it made every
  // noisy double of the chunk take about 60 bits; narrowed, fewer.
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> noise(0.0, 0.3);
  PointLog wobbling;
  PointLog lognormal;
  PointLog buckets;
  std::deque<Point> wobbling_model;
  std::deque<Point> lognormal_model;
  std::deque<Point> bucket_model;
  for (uint64_t step = 1; step <= 4096; ++step) {
    const Point p = SamplePoint(step, 50.0 * (1.0 + 0.01 * std::sin(0.37 * static_cast<double>(step))));
    REQUIRE(wobbling.Append(p, true));
    wobbling_model.push_back(p);
    const Point q = SamplePoint(step, 0.5 * noise(rng));
    REQUIRE(lognormal.Append(q, true));
    lognormal_model.push_back(q);
  }
  for (uint64_t k = 0; k < 1024; ++k) {
    Point b = SamplePoint(k * 32 + 1, 50.0 * noise(rng));
    for (uint64_t j = 1; j < 32; ++j) MergeInto(b, SamplePoint(b.step + j, 50.0 * noise(rng)));
    REQUIRE(buckets.Append(b, true));
    bucket_model.push_back(b);
  }
  CheckSame(wobbling, wobbling_model);
  CheckSame(lognormal, lognormal_model);
  CheckSame(buckets, bucket_model);
  // Bytes a sample (a bucket) with windows kept wide: 7.6 (8.0 for lognormal noise; a bucket 34).
  CHECK(wobbling.chunks_allocated() * PointLog::kChunkBytes <= 4096 * 7.1);
  CHECK(lognormal.chunks_allocated() * PointLog::kChunkBytes <= 4096 * 7.75);
  CHECK(buckets.chunks_allocated() * PointLog::kChunkBytes <= 1024 * 33);
}

// SaveState/LoadState of point logs and series (snapshots, server/core/state_io.h): a loaded object
// answers every later call exactly (bit for bit) as the one saved, a series with other options
// refuses the bytes, and truncated or damaged bytes fail or load without breaking anything later.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "server/core/state_io.h"
#include "server/store/point.h"
#include "server/store/point_log.h"
#include "server/store/series.h"
#include "tests/support/state_round_trip.h"

using gradwatch::StateReader;
using gradwatch::store::Point;
using gradwatch::store::PointLog;
using gradwatch::store::SamplePoint;
using gradwatch::store::Series;
using gradwatch::store::SeriesOptions;
using gradwatch::testing::Damage;
using gradwatch::testing::RequireLoads;
using gradwatch::testing::StateOf;

namespace {

bool Same(double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); }

bool Same(const Point& a, const Point& b) {
  return a.step == b.step && a.last_step == b.last_step && a.count == b.count && a.nonfinite == b.nonfinite &&
         Same(a.mean, b.mean) && Same(a.min, b.min) && Same(a.max, b.max) && Same(a.last, b.last);
}

bool Same(const std::vector<Point>& a, const std::vector<Point>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!Same(a[i], b[i])) return false;
  }
  return true;
}

bool Same(const std::optional<Point>& a, const std::optional<Point>& b) {
  return a.has_value() == b.has_value() && (!a || Same(*a, *b));
}

std::vector<Point> Contents(const PointLog& log) {
  std::vector<Point> out;
  log.ForEach([&](const Point& p) { out.push_back(p); });
  return out;
}

// A value as a training run reports it: a noisy walk, now and then a spike, NaN, ±Inf, or (for the
// codec) any bit pattern.
double NoisyValue(std::mt19937_64& rng, double& walk, bool any_bits) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  walk += 0.01 * (unit(rng) - 0.5);
  const double u = unit(rng);
  if (u < 0.003) return std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (u < 0.004) return (rng() & 1) ? kInf : -kInf;
  if (u < 0.01) return 3 * (4.0 + walk);
  if (any_bits && u < 0.02) return std::bit_cast<double>(rng());
  return 4.0 + walk + 0.05 * unit(rng);
}

// One operation on a point log, drawn in advance so that two logs get the same ones.
struct LogOp {
  enum Kind { kAppendSample, kAppend, kPopFront, kTruncate, kClear } kind;
  Point point;
  double fraction = 0;  // of the points kept by a truncation
};

std::vector<LogOp> RandomLogOps(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<LogOp> ops;
  ops.reserve(n);
  uint64_t step = 100;
  double walk = 0;
  for (size_t i = 0; i < n; ++i) {
    LogOp op{LogOp::kAppendSample, {}, 0};
    const uint64_t r = rng() % 1000;
    step += r % 10 == 0 ? 1 + rng() % 5000 : 1;
    if (r < 2) {
      op.kind = LogOp::kTruncate;
      op.fraction = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    } else if (r < 3) {
      op.kind = LogOp::kClear;
    } else if (r < 400) {
      op.kind = LogOp::kPopFront;
    } else if (r < 600) {
      // A downsampled bucket, or a sample through Append.
      op.kind = LogOp::kAppend;
      if (r % 2 == 0) {
        op.point = SamplePoint(step, NoisyValue(rng, walk, true));
      } else {
        op.point.step = step;
        op.point.last_step = step + rng() % 64;
        op.point.count = static_cast<uint32_t>(1 + rng() % 64);
        op.point.nonfinite = static_cast<uint32_t>(rng() % 4 == 0 ? 1 : 0);
        op.point.mean = NoisyValue(rng, walk, true);
        op.point.min = NoisyValue(rng, walk, false);
        op.point.max = NoisyValue(rng, walk, false);
        op.point.last = NoisyValue(rng, walk, true);
        step = op.point.last_step;
      }
    } else {
      op.point = SamplePoint(step, NoisyValue(rng, walk, true));
    }
    ops.push_back(op);
  }
  return ops;
}

// Applies op; what it returned (a point popped, or whether an append was taken) goes to `result`.
void Apply(PointLog& log, const LogOp& op, Point& result) {
  switch (op.kind) {
    case LogOp::kAppendSample: result.count = log.AppendSample(op.point.step, op.point.last, true) ? 1 : 0; break;
    case LogOp::kAppend: result.count = log.Append(op.point, true) ? 1 : 0; break;
    case LogOp::kPopFront: result = log.empty() ? Point{} : log.PopFront(); break;
    case LogOp::kTruncate: log.Truncate(static_cast<size_t>(op.fraction * static_cast<double>(log.size()))); break;
    case LogOp::kClear: log.Clear(); break;
  }
}

// Holds the points of the ops up to `until`, however they went.
PointLog LogAfter(const std::vector<LogOp>& ops, size_t until) {
  PointLog log;
  Point ignored;
  for (size_t i = 0; i < until; ++i) Apply(log, ops[i], ignored);
  return log;
}

bool SameLog(const PointLog& a, const PointLog& b, bool contents) {
  if (a.size() != b.size() || a.empty() != b.empty() || (!a.empty() && !Same(a.Back(), b.Back()))) return false;
  return !contents || Same(Contents(a), Contents(b));
}

// Ops that pop as they append, so that the log stays a few chunks long and its oldest chunk is read
// part way: the log a series keeps of its recent points.
std::vector<LogOp> SteadyLogOps(size_t n, uint64_t seed) {
  std::vector<LogOp> ops = RandomLogOps(n, seed);
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == LogOp::kPopFront && i % 2 == 0) ops[i].kind = LogOp::kAppendSample;
  }
  return ops;
}

}  // namespace

TEST_CASE("state: a point log loaded holds and codes the same points, bit for bit", "[state][store]") {
  for (const std::vector<LogOp>& ops : {RandomLogOps(60000, 1), SteadyLogOps(60000, 2)}) {
    for (size_t save_at : {size_t{0}, size_t{1}, size_t{5}, size_t{300}, size_t{5000}, size_t{30000}, size_t{59000}}) {
      INFO("saved after " << save_at << " ops");
      PointLog original = LogAfter(ops, save_at);
      const std::string bytes = StateOf(original);
      // Loaded over a log that holds points already: they are replaced.
      PointLog loaded = LogAfter(ops, 100);
      RequireLoads(loaded, bytes);
      REQUIRE(StateOf(loaded) == bytes);
      REQUIRE(SameLog(original, loaded, true));
      // No spare chunk is loaded.
      CHECK(loaded.MemoryBytes() <= original.MemoryBytes());
      CHECK(loaded.chunks_allocated() <= original.chunks_allocated());
      for (size_t i = save_at; i < ops.size(); ++i) {
        Point a, b;
        Apply(original, ops[i], a);
        Apply(loaded, ops[i], b);
        REQUIRE(Same(a, b));
        REQUIRE(SameLog(original, loaded, i % 1999 == 0));
        if (i % 4999 == 0) REQUIRE(StateOf(loaded) == StateOf(original));
      }
      REQUIRE(SameLog(original, loaded, true));
      REQUIRE(StateOf(loaded) == StateOf(original));
    }
    // A relay: the copy is replaced by a load of the original every 211 ops.
    PointLog original;
    auto loaded = std::make_unique<PointLog>();
    for (size_t i = 0; i < ops.size(); ++i) {
      if (i % 211 == 0) {
        const std::string bytes = StateOf(original);
        loaded = std::make_unique<PointLog>();
        RequireLoads(*loaded, bytes);
        REQUIRE(StateOf(*loaded) == bytes);
        REQUIRE(SameLog(original, *loaded, true));
      }
      Point a, b;
      Apply(original, ops[i], a);
      Apply(*loaded, ops[i], b);
      REQUIRE(Same(a, b));
      REQUIRE(SameLog(original, *loaded, false));
    }
  }
}

TEST_CASE("state: truncated or damaged point logs fail or load a log that works", "[state][store]") {
  const std::vector<LogOp> ops = SteadyLogOps(20000, 3);
  const auto exercise = [&](PointLog& log) {
    Contents(log);
    const size_t size = log.size();
    log.Truncate(size / 2 + 1);
    for (size_t i = 0; i < 3000; ++i) {
      Point ignored;
      Apply(log, ops[i], ignored);
    }
    Contents(log);
    while (!log.empty()) log.PopFront();
  };
  // A few chunks, the oldest read part way: every cut.
  PointLog small;
  for (size_t i = 0; i < 300; ++i) {
    small.AppendSample(1000 + i * (1 + i % 3), std::sin(0.01 * static_cast<double>(i)), true);
  }
  for (int i = 0; i < 40; ++i) small.PopFront();
  REQUIRE(small.chunks_allocated() >= 3);
  Damage<PointLog>(
      StateOf(small), [] { return PointLog(); }, exercise, 7, 2000);
  Damage<PointLog>(
      StateOf(LogAfter(ops, 15000)), [] { return PointLog(); }, exercise, 8);
  // An empty log, and one emptied (its stale coding state is not written).
  Damage<PointLog>(
      StateOf(PointLog()), [] { return PointLog(); }, exercise, 9, 0);
  PointLog emptied = LogAfter(ops, 500);
  emptied.Clear();
  CHECK(StateOf(emptied) == StateOf(PointLog()));
}

namespace {

// One operation on a series: an append (its step sometimes not past the newest: refused), or now
// and then a rewind (TruncateFrom) a few thousand steps back.
struct SeriesOp {
  bool rewind = false;
  uint64_t step = 0;
  double value = 0;
};

std::vector<SeriesOp> SeriesOps(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<SeriesOp> ops;
  ops.reserve(n);
  uint64_t step = 1000;
  double walk = 0;
  for (size_t i = 0; i < n; ++i) {
    SeriesOp op;
    const uint64_t r = rng() % 10000;
    if (r < 3) {
      op.rewind = true;
      op.step = step > 3000 ? step - rng() % 3000 : 0;
      step = op.step;
    } else {
      step += r % 50 == 0 ? 1 + rng() % 2000 : 1 + r % 3;
      op.step = r % 200 == 1 ? step - rng() % 4 : step;  // not past the newest: refused
      op.value = NoisyValue(rng, walk, false);
    }
    ops.push_back(op);
  }
  return ops;
}

// Applies op; returns what it returned (Append's bool, TruncateFrom's count).
uint64_t Apply(Series& series, const SeriesOp& op) {
  return op.rewind ? series.TruncateFrom(op.step) : (series.Append(op.step, op.value) ? 1 : 0);
}

bool SameSeries(const Series& a, const Series& b, bool queries) {
  if (!Same(a.Latest(), b.Latest()) || a.sample_count() != b.sample_count() || a.recent_size() != b.recent_size() ||
      a.history_size() != b.history_size()) {
    return false;
  }
  if (!queries) return true;
  const uint64_t last = a.Latest() ? a.Latest()->last_step : 0;
  const uint64_t mid = last / 2 + 500;
  return Same(a.Query(0, UINT64_MAX), b.Query(0, UINT64_MAX)) && Same(a.Query(mid, last), b.Query(mid, last)) &&
         Same(a.Query(0, UINT64_MAX, 50), b.Query(0, UINT64_MAX, 50)) &&
         Same(a.Query(mid, UINT64_MAX, 7), b.Query(mid, UINT64_MAX, 7));
}

}  // namespace

TEST_CASE("state: a series loaded answers as the one saved, bit for bit, through compactions and rewinds",
          "[state][store]") {
  const std::vector<SeriesOp> ops = SeriesOps(60000, 11);
  for (const SeriesOptions options :
       {SeriesOptions{256, 64}, SeriesOptions{}, SeriesOptions{2, 2}, SeriesOptions{1000, 3}}) {
    INFO("options " << options.recent_points << ", " << options.history_buckets);
    for (size_t save_at : {size_t{0}, size_t{3}, size_t{200}, size_t{3000}, size_t{20000}, size_t{45000}}) {
      INFO("saved after " << save_at << " ops");
      Series original(options);
      for (size_t i = 0; i < save_at; ++i) Apply(original, ops[i]);
      const std::string bytes = StateOf(original);
      Series loaded(options);
      RequireLoads(loaded, bytes);
      REQUIRE(StateOf(loaded) == bytes);
      REQUIRE(SameSeries(original, loaded, true));
      CHECK(loaded.MemoryBytes() <= original.MemoryBytes());
      for (size_t i = save_at; i < ops.size(); ++i) {
        REQUIRE(Apply(original, ops[i]) == Apply(loaded, ops[i]));
        REQUIRE(SameSeries(original, loaded, i % 2999 == 0));
        if (i % 4999 == 0) REQUIRE(StateOf(loaded) == StateOf(original));
      }
      REQUIRE(SameSeries(original, loaded, true));
      REQUIRE(StateOf(loaded) == StateOf(original));
    }
    // A relay: the copy is replaced by a load of the original every 997 ops.
    Series original(options);
    auto loaded = std::make_unique<Series>(options);
    for (size_t i = 0; i < ops.size(); ++i) {
      if (i % 997 == 0) {
        const std::string bytes = StateOf(original);
        loaded = std::make_unique<Series>(options);
        RequireLoads(*loaded, bytes);
        REQUIRE(StateOf(*loaded) == bytes);
      }
      REQUIRE(Apply(original, ops[i]) == Apply(*loaded, ops[i]));
      REQUIRE(SameSeries(original, *loaded, i % 997 == 500));
    }
    // The ops reached history compaction and rewinds.
    CHECK(original.history_size() > 1);
  }
}

TEST_CASE("state: a series refuses a state saved with other options, and damage fails or loads harmlessly",
          "[state][store]") {
  const std::vector<SeriesOp> ops = SeriesOps(20000, 12);
  Series series(SeriesOptions{64, 8});
  for (const SeriesOp& op : ops) Apply(series, op);
  const std::string bytes = StateOf(series);
  for (const SeriesOptions other : {SeriesOptions{65, 8}, SeriesOptions{64, 9}, SeriesOptions{}}) {
    Series copy(other);
    StateReader in(bytes);
    CHECK(!copy.LoadState(in));
    CHECK(in.failed());
  }
  // Options below the minimums are raised before they are written and compared.
  Series raised(SeriesOptions{1, 0});
  Series two(SeriesOptions{2, 2});
  RequireLoads(two, StateOf(raised));

  const auto exercise = [&](Series& s) {
    SameSeries(s, s, true);
    const uint64_t from = s.Latest() ? s.Latest()->last_step : 0;
    for (size_t i = 0; i < 3000; ++i) {
      if (!ops[i].rewind) s.Append(from + ops[i].step, ops[i].value);
    }
    SameSeries(s, s, true);
    s.TruncateFrom(from + ops[1500].step);
    SameSeries(s, s, true);
  };
  Damage<Series>(
      bytes,
      [] {
        return Series(SeriesOptions{64, 8});
      },
      exercise, 13, 2000);
  Series large;
  for (const SeriesOp& op : SeriesOps(60000, 14)) Apply(large, op);
  Damage<Series>(
      StateOf(large), [] { return Series(); }, exercise, 15);
  Damage<Series>(
      StateOf(Series()), [] { return Series(); }, exercise, 16, 0);
}

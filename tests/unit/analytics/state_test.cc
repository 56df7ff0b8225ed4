// SaveState/LoadState of the analytics classes (snapshots, server/core/state_io.h): a loaded object
// answers every later call exactly (bit for bit) as the one saved, an object constructed otherwise
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
#include <string_view>
#include <vector>

#include "server/analytics/change_point.h"
#include "server/analytics/event_slope.h"
#include "server/analytics/regression.h"
#include "server/analytics/spike_filter.h"
#include "server/core/state_io.h"
#include "tests/support/state_round_trip.h"

using namespace gradwatch::analytics;
using gradwatch::StateReader;
using gradwatch::StateWriter;
using gradwatch::testing::Damage;
using gradwatch::testing::RequireLoads;
using gradwatch::testing::StateOf;

namespace {

struct Sample {
  uint64_t step;
  double value;
};

// A noisy series as a training run reports it: a random walk on a trend whose slope changes every
// few thousand steps, ×3 spikes, a few NaN and ±Inf, steps irregular (gaps, a long one) when asked,
// and, when asked, an occasional repeated or older step (which the classes ignore or accept as
// their contracts say).
std::vector<Sample> NoisySeries(size_t n, uint64_t seed, bool irregular, bool disorder) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<Sample> out;
  out.reserve(n);
  uint64_t step = 1000;
  double level = 5.0;
  double slope = 2e-4;
  double walk = 0;
  for (size_t i = 0; i < n; ++i) {
    if (irregular) {
      step += unit(rng) < 0.001 ? 4000 : 1 + rng() % 9;
    } else {
      step += 1;
    }
    if (i % 7919 == 7918) slope *= unit(rng) < 0.5 ? 2.5 : -0.4;
    level += slope * (irregular ? 5 : 1);
    walk += 0.002 * noise(rng);
    double value = level + walk + 0.03 * noise(rng);
    const double u = unit(rng);
    if (u < 0.004) value *= 3;
    uint64_t sample_step = step;
    if (disorder && u > 0.995) sample_step = step - 1 - rng() % 3;  // repeated or older
    if (u > 0.9993) value = std::numeric_limits<double>::quiet_NaN();
    if (u > 0.9997)
      value = (rng() & 1) ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
    out.push_back({sample_step, value});
  }
  return out;
}

// Where the round trips save: before anything, early, within the first window, and after many
// expiries (recomputes, compactions).
const std::vector<size_t> kSavePoints = {0, 3, 700, 2500, 17000, 44000};

bool Same(double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); }

bool Same(const LinearFit& a, const LinearFit& b) {
  return a.samples == b.samples && a.first_step == b.first_step && a.last_step == b.last_step &&
         Same(a.slope_per_step, b.slope_per_step) && Same(a.value_at_last_step, b.value_at_last_step) &&
         Same(a.slope_stderr_per_step, b.slope_stderr_per_step) && Same(a.residual_stddev, b.residual_stddev);
}

bool Same(const RegressionSums& a, const RegressionSums& b) { return StateOf(a) == StateOf(b); }

bool Same(const RegressionSums* a, const RegressionSums* b) {
  return (a == nullptr) == (b == nullptr) && (a == nullptr || Same(*a, *b));
}

bool Same(const std::optional<RegressionSums>& a, const std::optional<RegressionSums>& b) {
  return a.has_value() == b.has_value() && (!a || Same(*a, *b));
}

bool Same(const ChangePoint& a, const ChangePoint& b) {
  return a.step == b.step && Same(a.slope_before_per_kstep, b.slope_before_per_kstep) &&
         Same(a.slope_after_per_kstep, b.slope_after_per_kstep) && Same(a.ratio, b.ratio) &&
         Same(a.z_score, b.z_score) && a.detected_at_step == b.detected_at_step && a.settled == b.settled;
}

bool Same(const std::vector<ChangePoint>& a, const std::vector<ChangePoint>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!Same(a[i], b[i])) return false;
  }
  return true;
}

bool Same(const SlopeChange& a, const SlopeChange& b) {
  return a.event_step == b.event_step && Same(a.before, b.before) && Same(a.after, b.after) && Same(a.ratio, b.ratio) &&
         Same(a.difference_per_kstep, b.difference_per_kstep) &&
         Same(a.before_stderr_per_kstep, b.before_stderr_per_kstep) &&
         Same(a.after_stderr_per_kstep, b.after_stderr_per_kstep) && a.after_window_full == b.after_window_full;
}

bool Same(const FilteredPoint& a, const FilteredPoint& b) { return a.step == b.step && Same(a.value, b.value); }

template <typename T>
bool Same(const std::optional<T>& a, const std::optional<T>& b) {
  return a.has_value() == b.has_value() && (!a || Same(*a, *b));
}

// Every query of a window, the ranges taken around its newest step.
bool SameWindow(const WindowedSlope& a, const WindowedSlope& b, bool ranges) {
  if (!Same(a.Fit(), b.Fit()) || a.samples_in_window() != b.samples_in_window() || a.has_samples() != b.has_samples() ||
      a.last_step() != b.last_step() || a.ignored_non_finite() != b.ignored_non_finite() ||
      a.ignored_out_of_order() != b.ignored_out_of_order() || a.recomputes() != b.recomputes() ||
      !Same(a.open_bucket(), b.open_bucket())) {
    return false;
  }
  if (!ranges) return true;
  const uint64_t last = a.last_step();
  const uint64_t w = a.window_steps();
  for (const auto& [from, to] : {std::pair<uint64_t, uint64_t>{0, UINT64_MAX},
                                 {last > w / 2 ? last - w / 2 : 0, last},
                                 {last > w ? last - w : 0, last > w / 3 ? last - w / 3 : 0}}) {
    if (!Same(a.FitRange(from, to), b.FitRange(from, to)) || !Same(a.SumsInRange(from, to), b.SumsInRange(from, to)) ||
        !Same(a.ClosedSumsInRange(from, to), b.ClosedSumsInRange(from, to))) {
      return false;
    }
  }
  return true;
}

// Saves `original` after feeding it samples[0, save_at) (feed(object, sample)), loads a copy made
// by `make`, then feeds both the rest with step(original, loaded, i, sample), which feeds both and
// requires the same answers from both, and requires the same state bytes now and then.
template <typename T, typename Make, typename Feed, typename Step>
void RoundTrip(const std::vector<Sample>& samples, Make make, Feed feed, Step step, size_t relay_every = 97) {
  for (size_t save_at : kSavePoints) {
    if (save_at > samples.size()) continue;
    INFO("saved after " << save_at << " samples");
    T original = make();
    for (size_t i = 0; i < save_at; ++i) feed(original, samples[i]);
    const std::string bytes = StateOf(original);
    T loaded = make();
    RequireLoads(loaded, bytes);
    // The loaded object writes the same bytes: all of its state came back.
    REQUIRE(StateOf(loaded) == bytes);
    for (size_t i = save_at; i < samples.size(); ++i) {
      step(original, loaded, i, samples[i]);
      if (i % 4999 == 0) REQUIRE(StateOf(loaded) == StateOf(original));
    }
    REQUIRE(StateOf(loaded) == StateOf(original));
  }
  // A relay: the copy is replaced by a load of the original every `relay_every` samples, so that
  // states in every phase (a streak, a block half full, a bucket about to close) make the trip.
  T original = make();
  auto loaded = std::make_unique<T>(make());
  for (size_t i = 0; i < samples.size(); ++i) {
    if (i % relay_every == 0) {
      const std::string bytes = StateOf(original);
      loaded = std::make_unique<T>(make());
      RequireLoads(*loaded, bytes);
      REQUIRE(StateOf(*loaded) == bytes);
    }
    step(original, *loaded, i, samples[i]);
  }
  REQUIRE(StateOf(*loaded) == StateOf(original));
}

}  // namespace

TEST_CASE("state: regression sums round-trip every field, and any bytes make valid sums", "[state][analytics]") {
  RegressionSums sums(100, 5.0);
  for (uint64_t step = 100; step < 200; ++step) sums.Add(step, 5.0 + 0.01 * static_cast<double>(step % 7));
  const std::string bytes = StateOf(sums);
  RegressionSums loaded;
  RequireLoads(loaded, bytes);
  CHECK(StateOf(loaded) == bytes);
  CHECK(Same(loaded.Fit(), sums.Fit()));
  // Only the flag byte can be invalid.
  std::string flag = bytes;
  flag[0] = 2;
  StateReader in(flag);
  CHECK(!loaded.LoadState(in));
  CHECK(in.failed());
}

TEST_CASE("state: a windowed slope loaded answers as the one saved, bit for bit", "[state][analytics]") {
  const std::vector<Sample> regular = NoisySeries(60000, 11, false, true);
  const std::vector<Sample> irregular = NoisySeries(40000, 12, true, true);
  struct Config {
    uint64_t window;
    size_t max_buckets;
  };
  // Exact (one step a bucket), bucketed, few buckets (many recomputes), and a window of one step.
  for (const Config config : {Config{1000, 1024}, Config{20000, 1024}, Config{5000, 16}, Config{1, 4}}) {
    for (const std::vector<Sample>* samples : {&regular, &irregular}) {
      INFO("window " << config.window << ", max_buckets " << config.max_buckets << ", irregular "
                     << (samples == &irregular));
      RoundTrip<WindowedSlope>(
          *samples, [&] { return WindowedSlope(config.window, config.max_buckets); },
          [](WindowedSlope& w, const Sample& s) { w.AddSample(s.step, s.value); },
          [](WindowedSlope& a, WindowedSlope& b, size_t i, const Sample& s) {
            REQUIRE(Same(a.ClosedBy(s.step, s.value), b.ClosedBy(s.step, s.value)));
            REQUIRE(a.AddSample(s.step, s.value) == b.AddSample(s.step, s.value));
            REQUIRE(SameWindow(a, b, i % 997 == 0));
          });
    }
  }
  // Few buckets: the sums were recomputed between the save points.
  WindowedSlope few(5000, 16);
  for (const Sample& s : regular) few.AddSample(s.step, s.value);
  CHECK(few.recomputes() > 5);
}

TEST_CASE("state: a slope tracker loaded answers as the one saved, in every window", "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(50000, 21, true, true);
  RoundTrip<SlopeTracker>(
      samples, [] { return SlopeTracker(); }, [](SlopeTracker& t, const Sample& s) { t.AddSample(s.step, s.value); },
      [](SlopeTracker& a, SlopeTracker& b, size_t i, const Sample& s) {
        REQUIRE(a.AddSample(s.step, s.value) == b.AddSample(s.step, s.value));
        const bool ranges = i % 1499 == 0;
        for (size_t w = 0; w < a.window_count(); ++w) REQUIRE(SameWindow(a.window(w), b.window(w), ranges));
        if (ranges) {
          const uint64_t last = a.last_step();
          REQUIRE(Same(a.FitRange(last > 15000 ? last - 15000 : 0, last),
                       b.FitRange(last > 15000 ? last - 15000 : 0, last)));
        }
      });
}

TEST_CASE("state: a windowed slope or tracker refuses a state saved with other windows or buckets",
          "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(5000, 31, false, false);
  WindowedSlope window(1000, 64);
  for (const Sample& s : samples) window.AddSample(s.step, s.value);
  const std::string bytes = StateOf(window);
  for (const auto& [steps, buckets] : {std::pair<uint64_t, size_t>{1001, 64}, {1000, 65}, {2000, 64}, {1000, 1024}}) {
    WindowedSlope other(steps, buckets);
    StateReader in(bytes);
    CHECK(!other.LoadState(in));
    CHECK(in.failed());
  }
  SlopeTracker tracker({1000, 5000}, 64);
  for (const Sample& s : samples) tracker.AddSample(s.step, s.value);
  const std::string tracker_bytes = StateOf(tracker);
  const std::vector<std::pair<std::vector<uint64_t>, size_t>> others_made = {
      {{1000, 5000}, 32}, {{5000, 1000}, 64}, {{1000, 5000, 20000}, 64}, {{1000}, 64}};
  for (const auto& [windows, max_buckets] : others_made) {
    SlopeTracker other(windows, max_buckets);
    StateReader in(tracker_bytes);
    CHECK(!other.LoadState(in));
    CHECK(in.failed());
  }
  SlopeTracker same({1000, 5000}, 64);
  RequireLoads(same, tracker_bytes);
}

TEST_CASE("state: truncated or damaged window and tracker states never break the object", "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(30000, 41, true, true);
  const auto exercise_window = [&](WindowedSlope& w) {
    SameWindow(w, w, true);
    const uint64_t from = w.has_samples() ? w.last_step() : 0;
    for (size_t i = 0; i < 3000; ++i) {
      const Sample& s = samples[i];
      w.AddSample(from + s.step, s.value);
      if (i % 500 == 0) SameWindow(w, w, true);
    }
  };
  {
    WindowedSlope small(50, 8);
    for (size_t i = 0; i < 2000; ++i) small.AddSample(samples[i].step, samples[i].value);
    Damage<WindowedSlope>(
        StateOf(small), [] { return WindowedSlope(50, 8); }, exercise_window, 1);
  }
  {
    WindowedSlope large(20000, 1024);
    for (const Sample& s : samples) large.AddSample(s.step, s.value);
    Damage<WindowedSlope>(
        StateOf(large), [] { return WindowedSlope(20000, 1024); }, exercise_window, 2);
  }
  {
    SlopeTracker tracker({300, 1000}, 32);
    for (const Sample& s : samples) tracker.AddSample(s.step, s.value);
    Damage<SlopeTracker>(
        StateOf(tracker),
        [] {
          return SlopeTracker({300, 1000}, 32);
        },
        [&](SlopeTracker& t) {
          const uint64_t from = t.has_samples() ? t.last_step() : 0;
          for (size_t i = 0; i < 3000; ++i) t.AddSample(from + samples[i].step, samples[i].value);
          t.FitRange(0, UINT64_MAX);
        },
        3);
  }
}

TEST_CASE("state: a slope change detector loaded reports the same changes, bit for bit", "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(60000, 51, false, true);
  ChangePointOptions options;
  options.window_steps = 2000;
  // Saves right after the first detection too, while the change is being refined.
  size_t first_detection = 0;
  {
    SlopeChangeDetector probe(options);
    for (size_t i = 0; i < samples.size() && first_detection == 0; ++i) {
      if (probe.AddSample(samples[i].step, samples[i].value)) first_detection = i + 1;
    }
    REQUIRE(first_detection > 0);
    REQUIRE(probe.changes().size() == 1);
    REQUIRE(!probe.changes().back().settled);
  }
  size_t detected = 0;
  const auto feed = [](SlopeChangeDetector& d, const Sample& s) { d.AddSample(s.step, s.value); };
  const auto check = [&](SlopeChangeDetector& a, SlopeChangeDetector& b, size_t i, const Sample& s) {
    const std::optional<ChangePoint> change = a.AddSample(s.step, s.value);
    REQUIRE(Same(change, b.AddSample(s.step, s.value)));
    detected += change ? 1 : 0;
    if (i % 997 == 0) REQUIRE(Same(a.changes(), b.changes()));
  };
  RoundTrip<SlopeChangeDetector>(
      samples, [&] { return SlopeChangeDetector(options); }, feed, check);
  // Saved while the first change is refined, then fed on.
  SlopeChangeDetector original(options);
  for (size_t i = 0; i < first_detection; ++i) original.AddSample(samples[i].step, samples[i].value);
  SlopeChangeDetector loaded(options);
  RequireLoads(loaded, StateOf(original));
  for (size_t i = first_detection; i < samples.size(); ++i) check(original, loaded, i, samples[i]);
  REQUIRE(Same(original.changes(), loaded.changes()));
  REQUIRE(StateOf(loaded) == StateOf(original));
  // The series bends often enough that the detector reports changes after every save point.
  CHECK(detected > 2 * kSavePoints.size());
}

TEST_CASE("state: a slope change detector refuses other options, and damage never breaks it", "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(30000, 61, false, false);
  ChangePointOptions options;
  options.window_steps = 1000;
  options.max_changes = 4;
  SlopeChangeDetector detector(options);
  for (const Sample& s : samples) detector.AddSample(s.step, s.value);
  REQUIRE(!detector.changes().empty());
  const std::string bytes = StateOf(detector);

  std::vector<ChangePointOptions> others(6, options);
  others[0].window_steps = 1001;
  others[1].buckets_per_window = 31;
  others[2].prefilter_samples = 3;
  others[3].z_threshold = 5.0000001;
  others[4].max_changes = 5;
  others[5].min_segment_steps = 100;
  for (const ChangePointOptions& other : others) {
    SlopeChangeDetector copy(other);
    StateReader in(bytes);
    CHECK(!copy.LoadState(in));
    CHECK(in.failed());
  }

  Damage<SlopeChangeDetector>(
      bytes, [&] { return SlopeChangeDetector(options); },
      [&](SlopeChangeDetector& d) {
        for (size_t i = 0; i < 6000; ++i) d.AddSample(samples.back().step + samples[i].step, samples[i].value);
        REQUIRE(d.changes().size() <= options.max_changes);
      },
      4);
}

TEST_CASE("state: event slopes loaded with their window give the same changes, bit for bit", "[state][analytics]") {
  const std::vector<Sample> samples = NoisySeries(60000, 71, true, true);
  // A window and its events, fed as RunAnalytics feeds them; the second event is registered (and
  // seeded) only once the series is well past its step.
  struct Tracked {
    WindowedSlope window{20000, 1024};
    std::vector<EventSlope> events;
    bool late_registered = false;

    bool fed(size_t e) const { return e != 1 || late_registered; }
    void Feed(const Sample& s, uint64_t register_at) {
      if (!late_registered && s.step >= register_at) {
        events[1].Seed(window);
        late_registered = true;
      }
      if (const std::optional<RegressionSums> closed = window.ClosedBy(s.step, s.value)) {
        for (size_t e = 0; e < events.size(); ++e) {
          if (fed(e)) events[e].AddClosedBucket(*closed);
        }
      }
      window.AddSample(s.step, s.value);
    }
    void SaveState(StateWriter& out) const {
      window.SaveState(out);
      for (const EventSlope& event : events) event.SaveState(out);
      out.Put<uint8_t>(late_registered ? 1 : 0);
    }
    bool LoadState(StateReader& in) {
      if (!window.LoadState(in)) return false;
      for (EventSlope& event : events) {
        if (!event.LoadState(in)) return false;
      }
      return in.GetBool(late_registered);
    }
  };
  const uint64_t first = samples.front().step;
  const uint64_t register_at = samples[20000].step;
  // Events registered before their step, one seeded late (its before window partly expired from
  // the window), and one whose after window fills only after the last save point.
  const auto make = [&] {
    Tracked t;
    t.events.emplace_back(first + 30000, 5000, 10);
    t.events.emplace_back(register_at - 12000, 8000, 50);
    t.events.emplace_back(first + 200000, 5000, 3);
    t.events.emplace_back(first + 3000, 2000, 2);
    return t;
  };
  RoundTrip<Tracked>(
      samples, make, [&](Tracked& t, const Sample& s) { t.Feed(s, register_at); },
      [&](Tracked& a, Tracked& b, size_t i, const Sample& s) {
        a.Feed(s, register_at);
        b.Feed(s, register_at);
        for (size_t e = 0; e < a.events.size(); ++e) {
          if (a.fed(e)) REQUIRE(Same(a.events[e].Current(a.window), b.events[e].Current(b.window)));
        }
        REQUIRE(SameWindow(a.window, b.window, i % 2999 == 0));
      });

  Tracked fed = make();
  for (const Sample& s : samples) fed.Feed(s, register_at);
  for (const EventSlope& event : fed.events) CHECK(event.Current(fed.window).has_value());

  // Another event or window refuses the bytes.
  const std::string bytes = StateOf(fed.events[0]);
  for (const EventSlope& other : {EventSlope(first + 30001, 5000, 10), EventSlope(first + 30000, 5001, 10),
                                  EventSlope(first + 30000, 5000, 11)}) {
    EventSlope copy = other;
    StateReader in(bytes);
    CHECK(!copy.LoadState(in));
    CHECK(in.failed());
  }
  Damage<EventSlope>(
      bytes, [&] { return EventSlope(first + 30000, 5000, 10); },
      [&](EventSlope& event) {
        Tracked t;
        for (size_t i = 0; i < 5000; ++i) {
          if (const std::optional<RegressionSums> closed = t.window.ClosedBy(samples[i].step, samples[i].value)) {
            event.AddClosedBucket(*closed);
          }
          t.window.AddSample(samples[i].step, samples[i].value);
          if (i % 250 == 0) event.Current(t.window);
        }
      },
      5);
}

TEST_CASE("state: a spike filter loaded filters as the one saved, bit for bit", "[state][analytics]") {
  std::vector<Sample> samples;
  for (const Sample& s : NoisySeries(40000, 81, true, false)) {
    if (std::isfinite(s.value)) samples.push_back(s);
  }
  for (uint32_t width : {1u, 5u, 7u}) {
    INFO("width " << width);
    RoundTrip<SpikeFilter>(
        samples, [&] { return SpikeFilter(width); }, [](SpikeFilter& f, const Sample& s) { f.Add(s.step, s.value); },
        [](SpikeFilter& a, SpikeFilter& b, size_t, const Sample& s) {
          REQUIRE(Same(a.Add(s.step, s.value), b.Add(s.step, s.value)));
        });
  }
  SpikeFilter filter(5);
  for (size_t i = 0; i < 3; ++i) filter.Add(samples[i].step, samples[i].value);
  const std::string bytes = StateOf(filter);
  for (uint32_t width : {1u, 3u, 7u}) {
    SpikeFilter other(width);
    StateReader in(bytes);
    CHECK(!other.LoadState(in));
    CHECK(in.failed());
  }
  Damage<SpikeFilter>(
      bytes, [] { return SpikeFilter(5); },
      [&](SpikeFilter& f) {
        for (size_t i = 0; i < 100; ++i) f.Add(samples[i].step, samples[i].value);
      },
      6);
}

TEST_CASE("state: a change detector whose newest bucket is past its last step is refused", "[state][analytics]") {
  // Loaded, such a detector would see open_bucket_ move back with the next sample, below a
  // baseline near 2^64: the split search's span would wrap around and overrun its scratch.
  const std::vector<Sample> samples = NoisySeries(8000, 91, false, false);
  ChangePointOptions options;
  options.window_steps = 1000;
  SlopeChangeDetector detector(options);
  for (const Sample& s : samples) detector.AddSample(s.step, s.value);
  const std::string bytes = StateOf(detector);
  // From the end: the changes, then last_step_ (8), have_step_ (1), refine_break_bucket_ (8),
  // refine_first_bucket_ (8), refining_ (1), streak_break_ (8), streak_ (4), baseline_bucket_ (8),
  // open_bucket_ (8).
  const size_t changes = 8 + detector.changes().size() * (6 * 8 + 1);
  const size_t baseline_at = bytes.size() - changes - (8 + 1 + 8 + 8 + 1 + 8 + 4) - 8;
  const size_t open_at = baseline_at - 8;
  std::string damaged = bytes;
  for (size_t i = 0; i < 8; ++i) {
    damaged[open_at + i] = static_cast<char>(0xff);
    damaged[baseline_at + i] = static_cast<char>(0xff);
  }
  SlopeChangeDetector loaded(options);
  StateReader in(damaged);
  CHECK(!loaded.LoadState(in));
  CHECK(in.failed());
  // The same offsets, values in range: loads.
  SlopeChangeDetector same(options);
  RequireLoads(same, bytes);
}

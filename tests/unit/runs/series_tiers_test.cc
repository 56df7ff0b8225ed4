// Which series keep full resolution: the run's scalars, the output layer's norms and the norm
// gains' parameter norms keep RunOptions::series; every other parameter series param_series.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "server/runs/run.h"
#include "tests/unit/runs/recording_sink.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using gradwatch::runs::testing::RecordingSink;

namespace {

// Points at full resolution (count 1) and in all, of one series.
struct Held {
  size_t full = 0;
  size_t points = 0;
  uint64_t samples = 0;
};

Held HeldOf(const Run& run, const std::string& key) {
  const auto points = run.QuerySeries(key, 0, UINT64_MAX, 0);
  REQUIRE(points);
  Held h;
  for (const store::Point& p : *points) {
    h.full += p.count == 1 ? 1 : 0;
    h.samples += p.count;
  }
  h.points = points->size();
  return h;
}

}  // namespace

TEST_CASE("key series keep the full series options and other parameter series the smaller ones", "[runs]") {
  FakeClock clock;
  RunOptions options;
  options.series = {.recent_points = 64, .history_buckets = 16};
  options.param_series = {.recent_points = 8, .history_buckets = 4};
  RunMeta meta;
  meta.run_id = "tiers";
  meta.world_size = 1;
  meta.params = {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain},
                 {.name = "lm_head.weight", .numel = 1000, .kind = ParamKind::kOutput, .weight_decay = 0.1},
                 {.name = "layers.0.mlp.weight", .numel = 1000, .kind = ParamKind::kMlp, .weight_decay = 0.1}};
  Run run(meta, options, nullptr, nullptr, &clock, true);
  RecordingSink sink;
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, &sink, &info));
  constexpr uint64_t kSteps = 500;
  for (uint64_t s = 1; s <= kSteps; ++s) {
    RankStep r;
    r.step = s;
    r.loss = 3.0 - 1e-3 * static_cast<double>(s);
    for (uint32_t p = 0; p < 3; ++p) {
      const double v = 1.0 + 1e-3 * static_cast<double>(s) + p;
      r.params.push_back({.index = p,
                          .norms = {NormContribution::FromNorm(v), NormContribution::FromNorm(10 * v),
                                    NormContribution::FromNorm(v / 100)}});
    }
    REQUIRE_FALSE(run.AddStep(0, r, &sink));
  }
  run.Tick();

  for (const std::string key :
       {"grad/norm/total", "train/loss", "params/norm/final_norm.weight", "grad/norm/lm_head.weight",
        "params/norm/lm_head.weight", "updates/norm/lm_head.weight"}) {
    INFO(key);
    const Held h = HeldOf(run, key);
    CHECK(h.samples == kSteps);
    CHECK(h.full >= 64);
    CHECK(h.points <= 64 + 16);
  }
  for (const std::string key :
       {"grad/norm/final_norm.weight", "updates/norm/final_norm.weight", "grad/norm/layers.0.mlp.weight",
        "params/norm/layers.0.mlp.weight", "updates/norm/layers.0.mlp.weight"}) {
    INFO(key);
    const Held h = HeldOf(run, key);
    CHECK(h.samples == kSteps);
    CHECK(h.full <= 8 + 1);
    CHECK(h.points <= 8 + 4);
  }
}

TEST_CASE("at the defaults key series keep 4,096 points and 1,024 buckets, other parameter series 128 and 32",
          "[runs]") {
  const RunOptions defaults;
  CHECK(defaults.series.recent_points == 4096);
  CHECK(defaults.series.history_buckets == 1024);
  CHECK(defaults.param_series.recent_points == 128);
  CHECK(defaults.param_series.history_buckets == 32);
  // What each tier holds once full, with full-precision norms noisy in every bit (docs/operations.md,
  // "What each series keeps"): the ordinary tier is most of a large run's series.
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> noise(0.0, 0.05);
  store::Series key(defaults.series), ordinary(defaults.param_series);
  for (uint64_t s = 1; s <= 25000; ++s) {
    const double v = 50.0 * noise(rng);
    REQUIRE(key.Append(s, v));
    REQUIRE(ordinary.Append(s, v));
  }
  CHECK(key.recent_size() == 4096);
  CHECK(key.history_size() <= 1024);
  CHECK(ordinary.recent_size() == 128);
  CHECK(ordinary.history_size() <= 32);
  CHECK(key.MemoryBytes() <= 66 * 1024);
  CHECK(ordinary.MemoryBytes() <= 3400);
}

// The step path allocates nothing once warm (issue 10): a rank's report through assembly, the
// series store, analytics and the alerting (the default rules) makes no heap allocation. This
// executable replaces the global operator new with a counting one, hence its own module.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "alerts/rules.h"
#include "server/daemon/alerting.h"
#include "server/runs/run.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<uint64_t> g_allocations{0};
}  // namespace

// The replacements pair malloc with free; GCC cannot tell that they replace the global ones.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size != 0 ? size : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { operator delete(p); }

using namespace gradwatch;
using namespace gradwatch::runs;

namespace {

RunMeta Meta(size_t params) {
  RunMeta m;
  m.run_id = "warm-run";
  m.labels = {{"cluster", "a"}, {"team", "pretraining"}};
  m.config.weight_decay = 0.1;
  for (size_t i = 0; i < params; ++i) {
    ParamInfo p;
    p.numel = 4096;
    if (i == 0) {
      p.name = "final_norm.weight", p.kind = ParamKind::kNormGain, p.weight_decay = 0;
    } else if (i == 1) {
      p.name = "lm_head.weight", p.kind = ParamKind::kOutput, p.weight_decay = 0.1;
    } else if (i % 10 == 2) {
      p.name = "layers." + std::to_string(i) + ".norm.weight", p.kind = ParamKind::kNormGain;
    } else {
      p.name = "layers." + std::to_string(i) + ".mlp.weight", p.kind = ParamKind::kMlp, p.weight_decay = 0.1;
    }
    m.params.push_back(p);
  }
  return m;
}

// A quiet, noisy report: no rule fires (a firing alert allocates its notification, once).
RankStep Report(uint64_t step, size_t params) {
  RankStep r;
  r.step = step;
  r.loss = 2.0 + 0.01 * std::sin(static_cast<double>(step));
  r.learning_rate = 3e-4;
  for (size_t i = 0; i < params; ++i) {
    const double wobble = 1.0 + 0.02 * std::sin(0.37 * static_cast<double>(step + i));
    r.params.push_back(
        {.index = static_cast<uint32_t>(i),
         .norms = {NormContribution::FromNorm(0.2 / std::sqrt(static_cast<double>(params)) * wobble),
                   NormContribution::FromNorm(50.0 * wobble), NormContribution::FromNorm(0.01 * wobble)}});
  }
  return r;
}

}  // namespace

TEST_CASE("a warm run's steps make no heap allocation, through analytics and the default rules", "[steppath]") {
  constexpr size_t kParams = 200;
  // Warm: past every series' recent points and history buckets (the full tier keeps 4,096 and
  // 1,024), so that no point log grows any more.
  constexpr uint64_t kWarm = 15000, kCounted = 500;
  FakeClock clock;
  DaemonStats stats;
  auto rules = alerts::LoadDefaultRules();
  REQUIRE(rules.ok());
  daemon::Alerting alerting(std::move(rules).value());
  RunOptions options;
  options.listener = &alerting;
  Run run(Meta(kParams), options, nullptr, &stats, &clock, true);
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(Meta(kParams), 0, nullptr, &info).has_value());
  REQUIRE_FALSE(run.AddEvent({1000, "switched routing", "trainer", 0}).has_value());

  std::vector<RankStep> reports;  // built beforehand: the trainer's side allocates, not ours
  for (uint64_t s = 1; s <= kWarm + kCounted; ++s) reports.push_back(Report(s, kParams));
  for (uint64_t s = 1; s <= kWarm; ++s) REQUIRE_FALSE(run.AddStep(0, reports[s - 1], nullptr).has_value());

  g_counting = true;
  for (uint64_t s = kWarm + 1; s <= kWarm + kCounted; ++s) run.AddStep(0, reports[s - 1], nullptr);
  g_counting = false;
  CHECK(g_allocations.load() == 0);
  CHECK(run.Info().step_count == kWarm + kCounted);
  CHECK(alerting.firing_transitions() == 0);
  CHECK(alerting.engine().EvaluatedThrough("warm-run") == kWarm + kCounted);
}

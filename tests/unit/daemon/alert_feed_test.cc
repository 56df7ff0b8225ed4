// The alerting's side of a run (AlertFeed, through daemon::Alerting): a run publishes its steps,
// the feed evaluates them off the run's lock, in order, with a bounded queue.
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "server/daemon/alert_feed.h"
#include "server/daemon/alerting.h"
#include "server/runs/run.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch;
using namespace gradwatch::runs;
using namespace std::chrono_literals;
using alerts::testing::DefaultRule;
using daemon::AlertFeed;

namespace {

RunMeta Meta(const std::string& run_id = "r1") {
  RunMeta m;
  m.run_id = run_id;
  m.params = {{.name = "final_norm.weight", .numel = 6144, .kind = ParamKind::kNormGain}};
  return m;
}

RankStep Total(uint64_t step, double total_grad_norm) {
  RankStep r;
  r.step = step;
  r.total_grad = NormContribution::FromNorm(total_grad_norm);
  return r;
}

// A step as a run publishes it, for driving a feed directly.
struct Publisher {
  RunMeta meta = Meta();
  std::vector<std::array<SeriesId, kNormFields>> param_series;
  RunAnalytics analytics{AnalyticsOptions{}};
  RunActivity activity;
  CompletedStep step;

  explicit Publisher(AlertFeed& feed) {
    feed.OnSeries(0, "grad/norm/total");
    analytics.AddSeries(0, "grad/norm/total");
  }
  void Publish(AlertFeed& feed, uint64_t n, double total, bool restored = false) {
    step.step = n;
    step.values = {{0, total}};
    analytics.OnStep(step);
    activity.last_step = n;
    activity.open_streams = 1;
    feed.OnStep(PublishedStep{.step = step,
                              .meta = meta,
                              .param_series = param_series,
                              .analytics = analytics,
                              .activity = activity,
                              .now = 1000.0 + static_cast<double>(n),
                              .restored = restored});
  }
};

// A feed of some rules, driven step by step as a run would, recording every transition.
struct FeedHarness {
  alerts::AlertEngine engine;
  std::vector<alerts::Transition> heard;
  RunMeta meta = Meta();
  RunAnalytics analytics{AnalyticsOptions{}};
  std::vector<std::array<SeriesId, kNormFields>> param_series;
  RunActivity activity;
  CompletedStep step;
  AlertFeed feed;

  explicit FeedHarness(std::vector<alerts::Rule> rules)
      : engine(std::move(rules)), feed(Meta(), std::nullopt, engine, [this](std::vector<alerts::Transition> ts, bool) {
          heard.insert(heard.end(), ts.begin(), ts.end());
        }) {}

  // The rules of one group whose rule list is `rules_yaml`.
  static std::vector<alerts::Rule> Load(const std::string& rules_yaml) {
    auto rules = alerts::LoadRules("groups:\n  - name: g\n    rules:\n" + rules_yaml, "test.yaml");
    REQUIRE(rules.ok());
    return std::move(rules).value();
  }
  // Each alert instance that started (left inactive): its step and its label `label`.
  std::vector<std::pair<uint64_t, std::string>> Started(const std::string& label) const {
    std::vector<std::pair<uint64_t, std::string>> out;
    for (const auto& t : heard) {
      if (t.from == alerts::AlertState::kInactive) out.emplace_back(t.alert.step, t.alert.labels.at(label));
    }
    return out;
  }
  void SetCatalog(std::vector<ParamInfo> params) {
    meta.params = std::move(params);
    analytics.SetCatalog(meta.params);
    param_series.resize(meta.params.size());
    for (auto& ids : param_series) ids.fill(kNoSeries);
  }
  void AddSeries(SeriesId id, const std::string& key) {
    feed.OnSeries(id, key);
    analytics.AddSeries(id, key);
  }
  void Publish(uint64_t n, std::vector<SeriesValue> values) {
    step.step = n;
    step.values = std::move(values);
    analytics.OnStep(step);
    activity.last_step = n;
    feed.OnStep(PublishedStep{.step = step,
                              .meta = meta,
                              .param_series = param_series,
                              .analytics = analytics,
                              .activity = activity,
                              .now = 1000.0 + static_cast<double>(n)});
    feed.Deliver();
  }
};

}  // namespace

TEST_CASE("a run's steps are evaluated after its lock is released, and alerts reach its trainers", "[daemon][alerts]") {
  FakeClock clock;
  DaemonStats stats;
  daemon::Alerting alerting({DefaultRule("GradNormContingency")});
  RunOptions options;
  options.listener = &alerting;
  Run run(Meta(), options, nullptr, &stats, &clock, true);
  std::vector<alerts::Alert> heard;
  alerting.SetTrainerSink([&](const alerts::Alert& alert) {
    // The run answers while the alert is handed over: its lock is not held.
    CHECK(run.Info().last_step == alert.step);
    heard.push_back(alert);
  });
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(Meta(), 0, nullptr, &info).has_value());
  for (uint64_t s = 1; s <= 30; ++s) REQUIRE_FALSE(run.AddStep(0, Total(s, 6.0), nullptr).has_value());
  REQUIRE(heard.size() == 1);
  CHECK(heard[0].name == "GradNormContingency");
  CHECK(heard[0].state == alerts::AlertState::kFiring);
  CHECK(heard[0].step == 11);  // the first report ≥ 5 at step 1, for_steps 10
  CHECK(alerting.engine().EvaluatedThrough("r1") == 30u);

  // The run ends with a Goodbye: the alert resolves, for the pagers, not the trainer's stream.
  run.Finish(0, EndReason::kFinished, "", 1, nullptr);
  CHECK(heard.size() == 1);
  CHECK(alerting.resolved_transitions() == 1);
}

TEST_CASE("a burst of steps completed under the run's lock is evaluated by the drainer while the run waits, in order",
          "[daemon][alerts]") {
  FakeClock clock;
  DaemonStats stats;
  daemon::Alerting alerting({DefaultRule("GradNormContingency")});
  RunOptions options;
  options.listener = &alerting;
  RunMeta meta = Meta();
  meta.world_size = 2;
  Run run(meta, options, nullptr, &stats, &clock, true);
  const std::thread::id ingest = std::this_thread::get_id();
  std::vector<alerts::Alert> heard;
  std::atomic<bool> heard_on_ingest{false};
  alerting.SetTrainerSink([&](const alerts::Alert& alert) {
    if (std::this_thread::get_id() == ingest) heard_on_ingest = true;
    heard.push_back(alert);
  });
  AttachInfo info;
  REQUIRE_FALSE(run.Attach(meta, 0, nullptr, &info).has_value());
  // Rank 1 never reports: 100 steps wait for it, then the assembly timeout completes them all
  // under one lock.
  for (uint64_t s = 1; s <= 100; ++s) REQUIRE_FALSE(run.AddStep(0, Total(s, 6.0), nullptr).has_value());
  CHECK_FALSE(alerting.engine().EvaluatedThrough("r1").has_value());
  clock.Advance(std::chrono::minutes(1));
  run.Tick();
  CHECK(run.Info().last_step == 100u);
  CHECK(alerting.engine().EvaluatedThrough("r1") == 100u);
  REQUIRE(heard.size() == 1);
  CHECK(heard[0].name == "GradNormContingency");
  CHECK(heard[0].step == 11);  // every step evaluated, in order: ≥ 5 from step 1, for 10 steps
  // Past the first few, the steps were evaluated on the drainer's thread, while the run waited:
  // the alert at step 11 among them.
  CHECK_FALSE(heard_on_ingest);
}

TEST_CASE("a burst published to a feed with a drainer waits for room and is evaluated off the publisher's thread",
          "[daemon][alerts]") {
  alerts::AlertEngine engine({DefaultRule("GradNormContingency")});
  daemon::FeedDrainer drainer;
  const std::thread::id publisher = std::this_thread::get_id();
  std::vector<uint64_t> firing_steps;
  std::atomic<bool> evaluated_by_publisher{false};
  auto feed = std::make_shared<AlertFeed>(
      Meta(), std::nullopt, engine,
      [&](std::vector<alerts::Transition> ts, bool) {
        if (std::this_thread::get_id() == publisher) evaluated_by_publisher = true;
        for (const auto& t : ts) {
          if (t.to == alerts::AlertState::kFiring) firing_steps.push_back(t.alert.step);
        }
      },
      nullptr, &drainer);
  Publisher pub(*feed);
  // 100 steps without a Deliver (as a run's lock held throughout): each past the queue's room
  // waits for the drainer, so at most kMaxQueued wait at the end, and one may be in evaluation.
  for (uint64_t s = 1; s <= 100; ++s) pub.Publish(*feed, s, s < 50 ? 1.0 : 6.0);
  const auto evaluated = engine.EvaluatedThrough("r1");
  REQUIRE(evaluated.has_value());
  CHECK(*evaluated >= 100 - AlertFeed::kMaxQueued - 1);
  CHECK_FALSE(evaluated_by_publisher);  // step 60 fired on the drainer's thread
  feed->Deliver();
  CHECK(engine.EvaluatedThrough("r1") == 100u);
  CHECK(firing_steps == std::vector<uint64_t>{60});

  // A stopped drainer takes no more: the publisher evaluates a full queue itself.
  drainer.Stop();
  for (uint64_t s = 101; s <= 120; ++s) pub.Publish(*feed, s, 6.0);
  CHECK(*engine.EvaluatedThrough("r1") >= 120 - AlertFeed::kMaxQueued);
}

TEST_CASE("a burst published to a feed alone is evaluated in order, never more than a few waiting",
          "[daemon][alerts]") {
  alerts::AlertEngine engine({DefaultRule("GradNormContingency")});
  std::vector<uint64_t> firing_steps;
  size_t batches = 0;
  AlertFeed feed(Meta(), std::nullopt, engine, [&](std::vector<alerts::Transition> ts, bool) {
    ++batches;
    for (const auto& t : ts) {
      if (t.to == alerts::AlertState::kFiring) firing_steps.push_back(t.alert.step);
    }
  });
  Publisher pub(feed);
  // 100 steps without a Deliver (as an assembly timeout completes them under the run's lock).
  for (uint64_t s = 1; s <= 100; ++s) pub.Publish(feed, s, s < 50 ? 1.0 : 6.0);
  const auto evaluated = engine.EvaluatedThrough("r1");
  REQUIRE(evaluated.has_value());
  CHECK(*evaluated >= 100 - AlertFeed::kMaxQueued);
  CHECK(*evaluated < 100);
  feed.Deliver();
  CHECK(engine.EvaluatedThrough("r1") == 100u);
  CHECK(firing_steps == std::vector<uint64_t>{60});  // every step seen, in order: ≥ 5 from 50, for 10 steps
  feed.Deliver();                                    // nothing left: a no-op
  CHECK(engine.EvaluatedThrough("r1") == 100u);
}

TEST_CASE("a restored run's feed evaluates the journaled steps after the engine's last, and no resend",
          "[daemon][alerts]") {
  alerts::AlertEngine engine({DefaultRule("GradNormContingency")});
  AlertFeed feed(Meta(), /*evaluated_through=*/50, engine, [](std::vector<alerts::Transition>, bool) {});
  Publisher pub(feed);
  for (uint64_t s = 40; s <= 60; ++s) pub.Publish(feed, s, 1.0, /*restored=*/true);
  feed.Deliver();
  CHECK(engine.EvaluatedThrough("r1") == 60u);  // 51..60 evaluated
  pub.Publish(feed, 55, 1.0);                   // a live resend of a step evaluated before
  feed.Deliver();
  CHECK(engine.EvaluatedThrough("r1") == 60u);
  pub.Publish(feed, 61, 1.0);
  feed.Deliver();
  CHECK(engine.EvaluatedThrough("r1") == 61u);

  // No evaluation kept for a run: its restored steps are not evaluated at all.
  alerts::AlertEngine fresh({DefaultRule("GradNormContingency")});
  AlertFeed none(Meta(), std::nullopt, fresh, [](std::vector<alerts::Transition>, bool) {});
  Publisher pub2(none);
  for (uint64_t s = 1; s <= 20; ++s) pub2.Publish(none, s, 6.0, /*restored=*/true);
  none.Deliver();
  CHECK_FALSE(fresh.EvaluatedThrough("r1").has_value());
}

TEST_CASE("timer rules see the run's activity through its feed", "[daemon][alerts]") {
  alerts::AlertEngine engine({DefaultRule("RunStalled")});
  std::vector<alerts::Transition> heard;
  AlertFeed feed(Meta(), std::nullopt, engine, [&](std::vector<alerts::Transition> ts, bool to_trainers) {
    CHECK(to_trainers);
    for (auto& t : ts) heard.push_back(std::move(t));
  });
  Publisher pub(feed);
  pub.Publish(feed, 7, 1.0);
  feed.Deliver();
  RunActivity activity;
  activity.last_step = 7;
  activity.open_streams = 1;
  activity.seconds_since_last_step = 30;
  feed.EvaluateTimer(activity, 2000);
  CHECK(heard.empty());
  activity.seconds_since_last_step = 4000;
  for (int i = 0; i < 3 && heard.empty(); ++i) feed.EvaluateTimer(activity, 2000 + i);
  REQUIRE_FALSE(heard.empty());
  CHECK(heard.back().alert.name == "RunStalled");
  CHECK(heard.back().alert.labels.at("run") == "r1");
  CHECK(heard.back().alert.step == 7);
}

TEST_CASE("the facts carry each value under its own series when a step's series change", "[daemon][alerts]") {
  FeedHarness h(FeedHarness::Load(
      "      - alert: High\n        kind: threshold\n        series: \"x/*\"\n        op: \">=\"\n        value: 5\n"
      "        labels: {severity: warning}\n"));
  h.AddSeries(0, "x/a");
  h.AddSeries(1, "x/b");
  // The same series every step: the facts objects the feed reuses keep their keys.
  for (uint64_t s = 1; s <= 6; ++s) h.Publish(s, {{0, 1.0}, {1, 1.0}});
  CHECK(h.heard.empty());
  // A new series sorts first: the next step's values take the same places in key order as the
  // last step's, under other keys.
  h.AddSeries(2, "x/0");
  h.Publish(7, {{2, 9.0}, {0, 1.0}});
  h.Publish(8, {{2, 9.0}, {0, 1.0}});
  // A step with all three, then one with another pair.
  h.Publish(9, {{2, 9.0}, {0, 1.0}, {1, 9.0}});
  h.Publish(10, {{0, 9.0}, {1, 1.0}});
  const std::vector<std::pair<uint64_t, std::string>> expected = {{7, "x/0"}, {9, "x/b"}, {10, "x/a"}};
  CHECK(h.Started("series") == expected);
}

TEST_CASE("the facts name each share right when the parameters with a share change", "[daemon][alerts]") {
  // Facts objects are reused from step to step and keep their shares' names while the shares stay
  // the same: when a parameter starts reporting, the entries shift and must take their new names.
  FeedHarness h(
      FeedHarness::Load("      - alert: Dominates\n        kind: share\n        param: \"*\"\n        min_share: 0.9\n"
                        "        labels: {severity: warning}\n"));
  h.SetCatalog({{.name = "a.weight", .numel = 1000, .kind = ParamKind::kMlp},
                {.name = "b.weight", .numel = 1000, .kind = ParamKind::kMlp}});
  const std::vector<std::string> keys = {"grad/norm/total", "grad/norm/a.weight", "grad/norm/b.weight"};
  for (SeriesId id = 0; id < keys.size(); ++id) h.AddSeries(id, keys[id]);
  h.param_series[0][static_cast<int>(NormField::kGrad)] = 1;
  h.param_series[1][static_cast<int>(NormField::kGrad)] = 2;
  const auto publish = [&](uint64_t n, std::optional<double> a, double b) {
    std::vector<SeriesValue> values = {{0, std::hypot(a.value_or(0.0), b)}, {2, b}};
    if (a) values.push_back({1, *a});
    h.Publish(n, std::move(values));
  };
  // b alone has a share (all of it), then a starts reporting ahead of it in the catalog and
  // carries almost all: the first entry is a's from then on.
  for (uint64_t s = 1; s <= 4; ++s) publish(s, std::nullopt, 1.0);
  for (uint64_t s = 5; s <= 8; ++s) publish(s, 10.0, 1.0);
  const std::vector<std::pair<uint64_t, std::string>> expected = {{1, "b.weight"}, {5, "a.weight"}};
  CHECK(h.Started("param") == expected);
}

TEST_CASE("the feed has the fits its rules read made, and more after a reload", "[daemon][alerts]") {
  // Two parameters without decay whose norms both grow; a growth rule on norm gains judges only
  // the first. A reload adds a rule on the MLP: from the next step its fits are made too.
  const auto growth_rule = [](const std::string& name, const std::string& selector) {
    return FeedHarness::Load("      - alert: " + name + "\n        kind: growth_without_decay\n        " + selector +
                             "\n        min_growth: 0.05\n        labels: {severity: warning}\n")[0];
  };
  const alerts::Rule gains = growth_rule("GainGrows", "param_kind: norm_gain");
  FeedHarness h({gains});
  std::vector<ParamInfo> catalog = h.meta.params;
  catalog.push_back({.name = "mlp.weight", .numel = 6144, .kind = ParamKind::kMlp});
  h.SetCatalog(catalog);
  const std::vector<std::string> keys = {"params/norm/final_norm.weight", "params/norm/mlp.weight"};
  for (SeriesId id = 0; id < keys.size(); ++id) h.AddSeries(id, keys[id]);
  h.param_series[0][static_cast<int>(NormField::kParam)] = 0;
  h.param_series[1][static_cast<int>(NormField::kParam)] = 1;
  std::vector<std::pair<std::string, std::string>> fired;  // alert, param
  const auto publish = [&](uint64_t n) {
    const double norm = 10.0 + 0.01 * static_cast<double>(n);
    h.Publish(n, {{0, norm}, {1, norm}});
    fired.clear();
    for (const auto& t : h.heard) {
      if (t.to == alerts::AlertState::kFiring) fired.emplace_back(t.alert.name, t.alert.labels.at("param"));
    }
  };
  uint64_t n = 0;
  while (n < 2000 && fired.empty()) publish(++n);
  REQUIRE(fired == std::vector<std::pair<std::string, std::string>>{{"GainGrows", "final_norm.weight"}});
  for (int i = 0; i < 100; ++i) publish(++n);
  CHECK(fired.size() == 1);  // the MLP is judged by no rule

  h.engine.ReplaceRules({gains, growth_rule("MlpGrows", "param: 'mlp.*'")}, 2000);
  for (int i = 0; i < 100 && fired.size() < 2; ++i) publish(++n);
  REQUIRE(fired.size() == 2);
  CHECK(fired[1] == std::pair<std::string, std::string>{"MlpGrows", "mlp.weight"});
}

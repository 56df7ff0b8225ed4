// The RunDied page: a run whose streams vanished without a Goodbye (rule kind run_died), against
// the RunStalled warning for a run still connected but silent.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "alerts/evaluator.h"
#include "alerts/state_machine.h"

using namespace gradwatch::alerts;

namespace {

constexpr double kT0 = 1.8e9;

Rule DefaultRule(const std::string& name) {
  auto rules = LoadDefaultRules();
  REQUIRE(rules.ok());
  for (Rule r : *rules) {
    if (r.name != name) continue;
    if (r.kind == RuleKind::kRunDied) r.stalled_seconds = 600;  // as the daemon fills it in
    return r;
  }
  FAIL("no default rule " << name);
  return {};
}

// A run at step 5,000: `streams` open, silent for `silent` seconds (no step, no stream change).
RunFacts Run(uint32_t streams, double silent, bool goodbye = false, const std::string& id = "r1") {
  RunFacts f;
  f.run_id = id;
  f.step = 5000;
  f.open_streams = streams;
  f.seconds_since_last_step = silent;
  f.seconds_since_activity = silent;
  f.ended_cleanly = goodbye;
  return f;
}

const Transition* Of(const std::vector<Transition>& ts, const std::string& alertname) {
  for (const Transition& t : ts) {
    if (t.alert.labels.at("alertname") == alertname) return &t;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("run_died rules parse with or without seconds, and refuse step holds", "[alerts]") {
  auto rules = LoadRules(
      "groups:\n  - name: g\n    rules:\n"
      "      - alert: A\n        kind: run_died\n        labels: {severity: page}\n"
      "      - alert: B\n        kind: run_died\n        seconds: 5m\n        labels: {severity: page}\n",
      "t.yaml");
  REQUIRE(rules.ok());
  CHECK((*rules)[0].kind == RuleKind::kRunDied);
  CHECK((*rules)[0].stalled_seconds == 0);
  CHECK((*rules)[1].stalled_seconds == 300);
  CHECK(IsTimerRule(RuleKind::kRunDied));
  CHECK(TemplateVariablesFor(RuleKind::kRunDied).count("seconds") == 1);

  auto bad = LoadRules(
      "groups:\n  - name: g\n    rules:\n"
      "      - alert: A\n        kind: run_died\n        for_steps: 3\n        labels: {severity: page}\n"
      "      - alert: B\n        kind: run_died\n        resolve_for_steps: 3\n        labels: {severity: page}\n",
      "t.yaml");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.status().message(), Catch::Contains("for_steps does not apply to kind run_died"));
  CHECK_THAT(bad.status().message(), Catch::Contains("resolve_for_steps does not apply to kind run_died"));
}

TEST_CASE("run_died holds for a run without streams nor Goodbye, silent for the limit", "[alerts]") {
  const Rule rule = DefaultRule("RunDied");
  struct Case {
    const char* what;
    RunFacts facts;
    bool active;
  };
  const std::vector<Case> cases = {
      {"gone for the limit", Run(0, 600), true},
      {"gone for less", Run(0, 599), false},
      {"still connected, silent for long", Run(2, 5000), false},
      {"said Goodbye", Run(0, 5000, true), false},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const auto cs = Evaluate(rule, c.facts);
    REQUIRE(cs.size() == 1);
    CHECK(cs[0].active == c.active);
    CHECK(cs[0].labels == LabelSet{{"alertname", "RunDied"}, {"run", "r1"}, {"severity", "page"}});
  }
  Rule own = rule;
  own.stalled_seconds = 0;  // outside the daemon: the library's default
  CHECK_FALSE(Evaluate(own, Run(0, kDefaultRunDiedSeconds - 1))[0].active);
  CHECK(Evaluate(own, Run(0, kDefaultRunDiedSeconds))[0].active);
}

TEST_CASE("RunStalled warns a connected silent run, RunDied pages only once its streams are gone", "[alerts]") {
  AlertEngine engine({DefaultRule("RunStalled"), DefaultRule("RunDied")});
  // Connected, no step for 10 minutes: the hung job warns, nothing pages.
  auto ts = engine.EvaluateTimer({Run(8, 601)}, kT0);
  REQUIRE(ts.size() == 1);
  CHECK(Of(ts, "RunStalled")->to == AlertState::kFiring);
  CHECK(Of(ts, "RunStalled")->alert.labels.at("severity") == "warning");
  CHECK(engine.EvaluateTimer({Run(8, 5000)}, kT0 + 4400).empty());

  // The streams drop without a Goodbye: the warning resolves, the page waits for the limit.
  ts = engine.EvaluateTimer({Run(0, 1)}, kT0 + 4401);
  REQUIRE(ts.size() == 1);
  CHECK(Of(ts, "RunStalled")->to == AlertState::kResolved);
  CHECK(engine.EvaluateTimer({Run(0, 599)}, kT0 + 4999).empty());
  ts = engine.EvaluateTimer({Run(0, 600)}, kT0 + 5000);
  REQUIRE(ts.size() == 1);
  const Transition* died = Of(ts, "RunDied");
  REQUIRE(died);
  CHECK(died->to == AlertState::kFiring);
  CHECK(died->notify);
  CHECK(died->alert.labels.at("severity") == "page");
  CHECK(died->alert.annotations.at("summary") ==
        "Run r1 is gone without a Goodbye: nothing for 600 s (last step 5,000)");
  // Steps never evaluate timer rules.
  CHECK(engine.EvaluateStep(Run(0, 700), kT0 + 5100).empty());
}

TEST_CASE("a RunDied page outlives the run's end and resolves when the run comes back", "[alerts]") {
  AlertEngine engine({DefaultRule("RunDied"), DefaultRule("RunStalled")});
  REQUIRE(engine.EvaluateTimer({Run(0, 600)}, kT0).size() == 1);

  // The run ends by inactivity: its other alerts would resolve, its death page does not.
  CHECK(engine.EndRun("r1", AlertEngine::RunEnding::kWithoutGoodbye, kT0 + 1).empty());
  CHECK(engine.EvaluateTimer({Run(0, 3600)}, kT0 + 3000).empty());
  REQUIRE(engine.Active("r1").size() == 1);

  // A stream attaches again: the page resolves, once, and is told to the receivers.
  auto ts = engine.EvaluateTimer({Run(1, 0)}, kT0 + 3001);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].notify);
  CHECK(engine.Active().empty());
}

TEST_CASE("a run that said Goodbye never pages as dead, and a Goodbye ends a page", "[alerts]") {
  AlertEngine engine({DefaultRule("RunDied")});
  CHECK(engine.EvaluateTimer({Run(0, 100000, /*goodbye=*/true)}, kT0).empty());

  REQUIRE(engine.EvaluateTimer({Run(0, 600, false, "r2")}, kT0).size() == 1);
  auto ts = engine.EndRun("r2", AlertEngine::RunEnding::kGoodbye, kT0 + 10);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(engine.Active().empty());
}

TEST_CASE("a RunDied page stays until acknowledged, also once the run left memory", "[alerts]") {
  AlertEngine engine({DefaultRule("RunDied")});
  REQUIRE(engine.EvaluateTimer({Run(0, 600, false, "a"), Run(0, 600, false, "b")}, kT0).size() == 2);
  const std::string fp_a = FingerprintHex(engine.Active("a")[0].labels);

  // Acknowledged: muted, still firing while the run is held.
  REQUIRE(engine.Ack(fp_a, "oncall", "job killed by the scheduler", kT0 + 1).ok());
  CHECK(engine.IsMuted(engine.Active("a")[0], kT0 + 2));
  CHECK(engine.EvaluateTimer({Run(0, 700, false, "a"), Run(0, 700, false, "b")}, kT0 + 100).empty());

  // Both leave memory: the acknowledged page resolves, the other keeps paging.
  auto ts = engine.EndRun("a", AlertEngine::RunEnding::kLeftMemory, kT0 + 200);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].alert.labels.at("run") == "a");
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(engine.EndRun("b", AlertEngine::RunEnding::kLeftMemory, kT0 + 200).empty());
  CHECK(engine.EvaluateTimer({}, kT0 + 300).empty());
  REQUIRE(engine.Active("b").size() == 1);

  // Acknowledged after it left memory: the next timer evaluation resolves it.
  REQUIRE(engine.Ack(FingerprintHex(engine.Active("b")[0].labels), "oncall", "", kT0 + 400).ok());
  ts = engine.EvaluateTimer({}, kT0 + 401);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(engine.Active().empty());
}

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "alerts/state_machine.h"

using namespace gradwatch::alerts;

namespace {

constexpr double kT0 = 1.8e9;  // the fake clock: step s is reported at kT0 + s seconds

// A plain threshold that holds 10 steps and resolves after 50 clear steps.
std::vector<Rule> Rules() {
  auto loaded = LoadRules(
      "groups:\n  - name: g\n    rules:\n"
      "      - alert: Plain\n        kind: threshold\n        series: grad/norm/total\n"
      "        op: \">=\"\n        value: 5\n        for_steps: 10\n        resolve_for_steps: 50\n"
      "        labels: {severity: page}\n",
      "test.yaml");
  INFO(loaded.status().message());
  REQUIRE(loaded.ok());
  return *loaded;
}

std::vector<Transition> Report(AlertEngine& engine, uint64_t step, double total, const std::string& run = "r1") {
  RunFacts f;
  f.run_id = run;
  f.step = step;
  f.now = kT0 + static_cast<double>(step);
  f.open_streams = 1;
  f.latest = {{"grad/norm/total", total}};
  return engine.EvaluateStep(f, f.now);
}

// Reports steps [from, to) every 10 steps; returns every transition.
std::vector<Transition> Run(AlertEngine& engine, uint64_t from, uint64_t to, double total,
                            const std::string& run = "r1") {
  std::vector<Transition> all;
  for (uint64_t s = from; s < to; s += 10) {
    auto t = Report(engine, s, total, run);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

AlertState StateOf(const AlertEngine& engine, const std::string& run) {
  const auto active = engine.Active(run);
  return active.empty() ? AlertState::kInactive : active[0].state;
}

}  // namespace

TEST_CASE("a rewind resolves an alert that fired on the abandoned branch, and only that run's", "[alerts][rewind]") {
  AlertEngine engine(Rules());
  Run(engine, 0, 100, 1.0);
  Run(engine, 100, 200, 6.0);  // s0 = 100, fires at 110
  Run(engine, 0, 100, 1.0, "r2");
  Run(engine, 100, 200, 6.0, "r2");
  REQUIRE(StateOf(engine, "r1") == AlertState::kFiring);

  const uint64_t resume = GENERATE(as<uint64_t>{}, 105, 110);
  const auto ts = engine.RewindRun("r1", resume, kT0 + 500);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kFiring);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].notify);  // its firing was notified, so its end is too
  CHECK(ts[0].alert.ends_at == kT0 + 500);
  CHECK(StateOf(engine, "r1") == AlertState::kInactive);
  CHECK(StateOf(engine, "r2") == AlertState::kFiring);

  // The new branch stays low: nothing more. Had it crossed again, a new incident would page.
  CHECK(Run(engine, resume, resume + 200, 1.0).empty());
}

TEST_CASE("a rewind keeps an alert that fired before the resume step", "[alerts][rewind]") {
  AlertEngine engine(Rules());
  Run(engine, 100, 300, 6.0);  // fires at 110
  CHECK(engine.RewindRun("r1", 111, kT0 + 500).empty());
  CHECK(StateOf(engine, "r1") == AlertState::kFiring);
  CHECK(Run(engine, 111, 300, 6.0).empty());  // no second page for the same incident
}

TEST_CASE("a rewind drops a pending alert whose condition began on the abandoned branch", "[alerts][rewind]") {
  AlertEngine engine(Rules());
  Run(engine, 0, 100, 1.0);
  Run(engine, 100, 110, 6.0);  // pending since 100
  REQUIRE(StateOf(engine, "r1") == AlertState::kPending);

  SECTION("resume at s0: inactive, silently") {
    const auto ts = engine.RewindRun("r1", 100, kT0 + 500);
    REQUIRE(ts.size() == 1);
    CHECK(ts[0].to == AlertState::kInactive);
    CHECK_FALSE(ts[0].notify);
    // The new branch crosses later: s0 is its own, so it fires 10 steps after it.
    auto again = Run(engine, 100, 150, 1.0);
    again = Run(engine, 150, 170, 6.0);
    REQUIRE_FALSE(again.empty());
    CHECK(again.back().to == AlertState::kFiring);
    CHECK(again.back().alert.step == 160);
  }
  SECTION("resume after s0: still pending, firing at s0 + 10 on the new branch") {
    CHECK(engine.RewindRun("r1", 101, kT0 + 500).empty());
    CHECK(StateOf(engine, "r1") == AlertState::kPending);
    const auto ts = Report(engine, 110, 6.0);
    REQUIRE(ts.size() == 1);
    CHECK(ts[0].to == AlertState::kFiring);
  }
}

TEST_CASE("a rewind forgets a resolve countdown that began on the abandoned branch", "[alerts][rewind]") {
  AlertEngine engine(Rules());
  Run(engine, 100, 200, 6.0);  // fires at 110
  Run(engine, 200, 240, 1.0);  // clearing since 200; resolves at 250 unless it holds again
  REQUIRE(StateOf(engine, "r1") == AlertState::kFiring);
  CHECK(engine.RewindRun("r1", 200, kT0 + 500).empty());
  // The new branch is clear from 220 on: the countdown starts there, not at 200.
  CHECK(Run(engine, 200, 220, 6.0).empty());
  CHECK(Run(engine, 220, 270, 1.0).empty());
  const auto ts = Report(engine, 270, 1.0);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].alert.step == 270);
}

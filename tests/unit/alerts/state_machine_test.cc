#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "alerts/state_machine.h"
#include "tests/unit/alerts/default_rule.h"

using namespace gradwatch::alerts;
using gradwatch::ParamKind;
using gradwatch::alerts::testing::DefaultRule;

namespace {

constexpr double kT0 = 1.8e9;  // the fake clock: step s is reported at kT0 + s seconds

std::vector<Rule> Load(const std::string& rules) {
  auto loaded = LoadRules("groups:\n  - name: g\n    rules:\n" + rules, "test.yaml");
  INFO(loaded.status().message());
  REQUIRE(loaded.ok());
  return *loaded;
}

// The contingency without its hysteresis, for contrast.
Rule PlainThreshold(uint64_t for_steps) {
  return Load(
      "      - alert: Plain\n        kind: threshold\n        series: grad/norm/total\n"
      "        op: \">=\"\n        value: 5\n        for_steps: " +
      std::to_string(for_steps) + "\n        labels: {severity: page}\n")[0];
}

RunFacts Step(uint64_t step, double total, const std::string& run = "r1") {
  RunFacts f;
  f.run_id = run;
  f.step = step;
  f.now = kT0 + static_cast<double>(step);
  f.open_streams = 1;
  f.latest = {{"grad/norm/total", total}};
  return f;
}

// Feeds the engine one report and returns its transitions.
struct Driver {
  AlertEngine& engine;
  std::vector<Transition> Report(uint64_t step, double total, const std::string& run = "r1") {
    return engine.EvaluateStep(Step(step, total, run), kT0 + static_cast<double>(step));
  }
  // Reports steps [from, to) every `every` steps with `total`; returns every transition.
  std::vector<Transition> Run(uint64_t from, uint64_t to, uint64_t every, double total) {
    std::vector<Transition> all;
    for (uint64_t s = from; s < to; s += every) {
      auto t = Report(s, total);
      all.insert(all.end(), t.begin(), t.end());
    }
    return all;
  }
};

bool AnyNotified(const std::vector<Transition>& ts) {
  for (const Transition& t : ts) {
    if (t.notify) return true;
  }
  return false;
}

// The step at which the first transition into `to` happened, if any.
std::optional<uint64_t> StepOf(const std::vector<Transition>& ts, AlertState to) {
  for (const Transition& t : ts) {
    if (t.to == to) return t.alert.step;
  }
  return std::nullopt;
}

std::string Fp(const Alert& a) { return FingerprintHex(a.labels); }

}  // namespace

TEST_CASE("a pending alert is never notified", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  auto ts = d.Report(100, 5.2);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kInactive);
  CHECK(ts[0].to == AlertState::kPending);
  CHECK_FALSE(ts[0].notify);
  REQUIRE(engine.Active("r1").size() == 1);
  CHECK(engine.Active("r1")[0].state == AlertState::kPending);  // visible, not sent

  CHECK(d.Run(101, 106, 1, 5.3).empty());  // still pending: s0 + 10 not reached
  // Its level (the median of the last 9 reports since s0) falls below 5 at the fifth report of
  // 4.0, the step it would have fired at: back to inactive, silently.
  CHECK(d.Run(106, 110, 1, 4.0).empty());
  ts = d.Report(110, 4.0);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kPending);
  CHECK(ts[0].to == AlertState::kInactive);
  CHECK_FALSE(ts[0].notify);
  CHECK(engine.Active().empty());
}

TEST_CASE("a lone dip neither cancels a pending alert nor restarts its count", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  CHECK(d.Run(100, 105, 1, 5.3).size() == 1);  // pending at 100
  CHECK(d.Report(105, 4.2).empty());           // one report below: still pending
  auto ts = d.Run(106, 111, 1, 5.3);
  REQUIRE(StepOf(ts, AlertState::kFiring) == 110u);  // s0 + 10, as without the dip
  CHECK(ts.back().alert.value == Approx(5.3));       // the level, not the last report
}

TEST_CASE("for_steps with a report every step fires at s0 + 10 exactly", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  CHECK(d.Run(90, 100, 1, 4.8).empty());
  auto ts = d.Run(100, 110, 1, 5.1);  // s0 = 100
  CHECK(StepOf(ts, AlertState::kPending) == 100u);
  CHECK_FALSE(StepOf(ts, AlertState::kFiring));
  CHECK_FALSE(AnyNotified(ts));

  ts = d.Report(110, 5.1);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kPending);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].notify);
  const Alert& a = ts[0].alert;
  CHECK(a.step == 110);
  CHECK(a.state == AlertState::kFiring);
  CHECK(a.value == 5.1);
  CHECK(a.starts_at == kT0 + 100);  // when the condition began, as Prometheus's activeAt
  CHECK(a.ends_at == 0);
  CHECK(a.labels ==
        LabelSet{
            {"alertname", "GradNormContingency"}, {"run", "r1"}, {"severity", "page"}, {"series", "grad/norm/total"}});
  CHECK(a.annotations.at("summary") == "Total grad norm 5.1 ≥ 5 at step 110 in run r1");
  CHECK(d.Run(111, 200, 1, 5.5).empty());  // firing: no more transitions while it holds
}

TEST_CASE("for_steps with a report every 10 steps fires at the first report at or after s0 + 10", "[alerts]") {
  SECTION("reports aligned with s0 + 10") {
    AlertEngine engine({DefaultRule("GradNormContingency")});
    Driver d{engine};
    auto ts = d.Run(0, 100, 10, 1.0);
    ts = d.Run(100, 300, 10, 5.2);                   // s0 = 100
    CHECK(StepOf(ts, AlertState::kFiring) == 110u);  // the same step as reporting every step
  }
  SECTION("reports not aligned with s0 + 10") {
    AlertEngine engine({DefaultRule("GradNormContingency")});
    Driver d{engine};
    d.Run(5, 105, 10, 1.0);
    auto ts = d.Run(105, 300, 10, 5.2);  // s0 = 105, reports at 115 ≥ 115
    CHECK(StepOf(ts, AlertState::kFiring) == 115u);
  }
  SECTION("sparser reports fire at the first one past the mark") {
    AlertEngine engine({DefaultRule("GradNormContingency")});
    Driver d{engine};
    auto ts = d.Run(98, 200, 7, 5.2);  // s0 = 98; 105 < 108 ≤ 112
    CHECK(StepOf(ts, AlertState::kPending) == 98u);
    CHECK(StepOf(ts, AlertState::kFiring) == 112u);
  }
}

TEST_CASE("for_steps 0 fires at once", "[alerts]") {
  AlertEngine engine({PlainThreshold(0)});
  auto ts = Driver{engine}.Report(100, 5);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kInactive);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].notify);
}

TEST_CASE("flapping around the threshold with clear_below does not re-fire", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  auto ts = d.Run(100, 111, 1, 5.1);
  REQUIRE(StepOf(ts, AlertState::kFiring) == 110u);

  const double flapping[] = {4.9, 5.05, 4.6, 5.2, 4.51, 4.99, 5.0, 4.7};
  uint64_t step = 111;
  for (double v : flapping) CHECK(d.Report(step++, v).empty());
  REQUIRE(engine.Active().size() == 1);
  CHECK(engine.Active()[0].state == AlertState::kFiring);
  CHECK(engine.Active()[0].value == Approx(4.99));  // the level: the median of the last 9 reports

  ts = d.Report(step, 4.4);  // below clear_below: resolves
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);

  // Without hysteresis the same stream resolves at the first dip and pages again.
  AlertEngine plain({PlainThreshold(0)});
  Driver p{plain};
  std::vector<Transition> all = p.Run(100, 111, 1, 5.1);
  step = 111;
  for (double v : flapping) {
    auto t = p.Report(step++, v);
    all.insert(all.end(), t.begin(), t.end());
  }
  int pages = 0;
  for (const Transition& t : all) pages += t.to == AlertState::kFiring && t.notify;
  CHECK(pages == 4);
}

TEST_CASE("a firing alert resolves once, sent with ends_at = now", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  d.Run(100, 111, 1, 5.1);
  auto ts = d.Report(150, 4.0);
  REQUIRE(ts.size() == 1);
  const Transition& t = ts[0];
  CHECK(t.from == AlertState::kFiring);
  CHECK(t.to == AlertState::kResolved);
  CHECK(t.notify);
  CHECK(t.alert.state == AlertState::kResolved);
  CHECK(t.alert.ends_at == kT0 + 150);
  CHECK(t.alert.starts_at == kT0 + 100);
  CHECK(t.alert.step == 150);
  CHECK(t.alert.annotations.count("summary") == 1);
  CHECK(engine.Active().empty());
  CHECK(d.Run(151, 300, 1, 4.0).empty());  // sent once, then nothing
}

TEST_CASE("resolve_for_steps keeps an alert firing until the condition stayed clear that long", "[alerts]") {
  AlertEngine engine(
      Load("      - alert: Slow\n        kind: threshold\n        series: grad/norm/total\n        op: \">=\"\n"
           "        value: 5\n        resolve_for_steps: 20\n        labels: {severity: page}\n"));
  Driver d{engine};
  REQUIRE(StepOf(d.Report(100, 6), AlertState::kFiring) == 100u);
  CHECK(d.Run(101, 115, 1, 4).empty());  // r0 = 101
  CHECK(d.Run(115, 120, 1, 6).empty());  // back above for 5 reports: the level holds, the clock stops
  CHECK(d.Run(120, 140, 1, 4).empty());  // r0 = 120, resolves at 140
  auto ts = d.Report(140, 4);
  CHECK(StepOf(ts, AlertState::kResolved) == 140u);

  // One report back above is a blip: the clock goes on.
  AlertEngine blip(
      Load("      - alert: Slow\n        kind: threshold\n        series: grad/norm/total\n        op: \">=\"\n"
           "        value: 5\n        resolve_for_steps: 20\n        labels: {severity: page}\n"));
  Driver b{blip};
  REQUIRE(StepOf(b.Report(100, 6), AlertState::kFiring) == 100u);
  CHECK(b.Run(101, 115, 1, 4).empty());
  CHECK(b.Report(115, 6).empty());
  CHECK(b.Run(116, 121, 1, 4).empty());
  CHECK(StepOf(b.Report(121, 4), AlertState::kResolved) == 121u);  // r0 + 20
}

TEST_CASE("a silence mutes notifications without hiding state", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  REQUIRE(engine
              .AddSilence({"s1", EqualityMatchers({{"alertname", "GradNormContingency"}, {"run", "r1"}}).value(), kT0,
                           kT0 + 200, "known: weight decay change scheduled", "alice"})
              .ok());
  CHECK(engine.Silences().size() == 1);

  auto ts = d.Run(100, 111, 1, 5.1);
  REQUIRE(StepOf(ts, AlertState::kFiring) == 110u);
  CHECK_FALSE(AnyNotified(ts));
  REQUIRE(engine.Active().size() == 1);
  const Alert firing = engine.Active()[0];
  CHECK(firing.state == AlertState::kFiring);
  CHECK(engine.IsMuted(firing, kT0 + 150));
  CHECK(engine.SilencesMuting(firing, kT0 + 150) == std::vector<std::string>{"s1"});
  CHECK(engine.SilencesMuting(firing, kT0 + 200).empty());  // ended

  // Another run is not silenced.
  CHECK(AnyNotified(d.engine.EvaluateStep(Step(100, 5.1, "r2"), kT0 + 100)) == false);  // pending
  ts = engine.EvaluateStep(Step(110, 5.1, "r2"), kT0 + 110);
  CHECK(AnyNotified(ts));

  // The silence ends while the alert still fires: it is notified then, once.
  CHECK(d.Report(199, 5.1).empty());
  ts = d.Report(200, 5.1);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kFiring);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].notify);
  CHECK(d.Report(201, 5.1).empty());
  ts = d.Report(202, 4.0);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].notify);  // its firing was sent, so its end is
}

TEST_CASE("an alert that fires and resolves under a silence is never sent", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  REQUIRE(engine.AddSilence({"s1", EqualityMatchers({{"severity", "page"}}).value(), kT0, kT0 + 1000, "", "bob"}).ok());
  auto ts = d.Run(100, 111, 1, 5.1);
  auto end = d.Report(120, 1.0);
  ts.insert(ts.end(), end.begin(), end.end());
  CHECK(StepOf(ts, AlertState::kResolved) == 120u);
  CHECK_FALSE(AnyNotified(ts));

  CHECK(engine.RemoveSilence("s1").ok());
  CHECK(engine.RemoveSilence("s1").code() == gradwatch::StatusCode::kNotFound);
  CHECK(engine.AddSilence({"s2", {}, kT0, kT0 + 1, "", ""}).code() == gradwatch::StatusCode::kInvalidArgument);
  CHECK(engine.AddSilence({"s3", EqualityMatchers({{"run", "r1"}}).value(), kT0, kT0, "", ""}).code() ==
        gradwatch::StatusCode::kInvalidArgument);
}

TEST_CASE("an acknowledged alert is not re-notified until it resolves", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver d{engine};
  d.Report(100, 5.1);
  const std::string fp = Fp(engine.Active()[0]);
  CHECK(engine.Ack(fp, "alice", "on it", kT0 + 105).code() == gradwatch::StatusCode::kFailedPrecondition);
  CHECK(engine.Ack("0123456789abcdef", "alice", "", kT0).code() == gradwatch::StatusCode::kNotFound);
  CHECK(engine.Ack("not hex", "alice", "", kT0).code() == gradwatch::StatusCode::kInvalidArgument);

  REQUIRE(AnyNotified(d.Run(101, 111, 1, 5.1)));
  const Alert firing = engine.Active()[0];
  CHECK_FALSE(engine.IsMuted(firing, kT0 + 111));
  REQUIRE(engine.Ack(fp, "alice", "enabling wd on final_norm", kT0 + 111).ok());
  CHECK(engine.IsMuted(firing, kT0 + 112));  // the notifier's resends stop
  REQUIRE(engine.AckOf(fp));
  CHECK(engine.AckOf(fp)->by == "alice");
  CHECK(engine.Active().size() == 1);  // still visible

  CHECK(d.Run(112, 150, 1, 5.3).empty());
  auto ts = d.Report(150, 4.0);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].notify);  // the end of the incident is sent
  CHECK_FALSE(engine.AckOf(fp));

  // The next incident of the same instance pages again.
  ts = d.Run(200, 211, 1, 5.2);
  REQUIRE(StepOf(ts, AlertState::kFiring) == 210u);
  CHECK(AnyNotified(ts));
  CHECK_FALSE(engine.IsMuted(engine.Active()[0], kT0 + 211));
}

TEST_CASE("reload keeps the states of alerts whose rule still exists", "[alerts]") {
  const Rule contingency = DefaultRule("GradNormContingency");
  const Rule other = PlainThreshold(0);
  AlertEngine engine({contingency, other});
  Driver d{engine};
  d.Run(100, 105, 1, 5.1);  // contingency pending since 100, Plain firing since 100
  REQUIRE(engine.Active().size() == 2);

  Rule edited = contingency;
  edited.annotations["description"] = "edited";
  auto ts = engine.ReplaceRules({edited}, kT0 + 105);
  REQUIRE(ts.size() == 1);  // the removed rule's firing alert ends, and is sent
  CHECK(ts[0].alert.name == "Plain");
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].alert.ends_at == kT0 + 105);
  CHECK(ts[0].notify);
  REQUIRE(engine.Rules().size() == 1);

  ts = d.Run(105, 111, 1, 5.1);
  CHECK(StepOf(ts, AlertState::kFiring) == 110u);  // s0 survived the reload
  CHECK(engine.Active()[0].annotations.at("description") == "edited");
}

TEST_CASE("non_finite fires at once and is sent", "[alerts]") {
  AlertEngine engine({DefaultRule("NonFiniteValue")});
  RunFacts f = Step(200, NAN);
  f.latest.push_back({"train/loss", 2.0});
  SortLatest(f);
  auto ts = engine.EvaluateStep(f, kT0 + 200);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].from == AlertState::kInactive);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].notify);
  CHECK(ts[0].alert.step == 200);
  CHECK(ts[0].alert.labels.at("series") == "grad/norm/total");
  CHECK(ts[0].alert.annotations.at("summary") == "grad/norm/total is NaN at step 200 in run r1");

  // Finite again: it resolves after resolve_for_steps (100) finite steps.
  Driver d{engine};
  CHECK(d.Run(201, 301, 1, 0.4).empty());
  CHECK(StepOf(d.Report(301, 0.4), AlertState::kResolved) == 301u);
}

TEST_CASE("stalled alerts come from the timer and resolve when steps resume", "[alerts]") {
  AlertEngine engine({DefaultRule("RunStalled"), DefaultRule("GradNormContingency")});
  RunFacts r = Step(5000, 0.4);
  r.open_streams = 8;
  r.seconds_since_last_step = 599;
  CHECK(engine.EvaluateTimer({r}, kT0 + 10000).empty());

  r.seconds_since_last_step = 601;
  CHECK(engine.EvaluateStep(r, kT0 + 10001).empty());  // steps do not evaluate stalled rules
  auto ts = engine.EvaluateTimer({r}, kT0 + 10002);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kFiring);
  CHECK(ts[0].notify);
  CHECK(ts[0].alert.labels.at("alertname") == "RunStalled");
  CHECK(ts[0].alert.annotations.at("summary") == "Run r1 sent no step for 601 s (last step 5,000)");
  CHECK(engine.EvaluateTimer({r}, kT0 + 10030).empty());

  r.step = 5001;
  r.seconds_since_last_step = 2;
  ts = engine.EvaluateTimer({r}, kT0 + 10060);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].alert.ends_at == kT0 + 10060);

  // A run that is gone from the daemon's list resolves too.
  r.seconds_since_last_step = 700;
  REQUIRE(engine.EvaluateTimer({r}, kT0 + 10800).size() == 1);
  ts = engine.EvaluateTimer({}, kT0 + 10900);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
}

TEST_CASE("instances are keyed by their labels: one alert per series and per run", "[alerts]") {
  AlertEngine engine(
      Load("      - alert: ParamGrad\n        kind: threshold\n        series: \"grad/norm/*\"\n        op: \">\"\n"
           "        value: 1\n        labels: {severity: warning}\n"));
  RunFacts f = Step(10, 0.5);
  f.latest = {{"grad/norm/a", 2}, {"grad/norm/b", 3}, {"grad/norm/total", 0.5}};
  auto ts = engine.EvaluateStep(f, kT0);
  CHECK(ts.size() == 2);
  f.run_id = "r2";
  ts = engine.EvaluateStep(f, kT0);
  CHECK(ts.size() == 2);
  CHECK(engine.Active().size() == 4);
  CHECK(engine.Active("r2").size() == 2);

  // A series that disappears counts as not holding: its alert resolves.
  f.run_id = "r1";
  f.step = 11;
  f.latest = {{"grad/norm/a", 2}};
  ts = engine.EvaluateStep(f, kT0 + 1);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].alert.labels.at("series") == "grad/norm/b");
  CHECK(ts[0].to == AlertState::kResolved);

  ts = engine.ForgetRun("r2", kT0 + 2);
  CHECK(ts.size() == 2);
  CHECK(engine.Active().size() == 1);
}

TEST_CASE("the contingency page carries the recommendation", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  std::vector<Transition> ts;
  for (uint64_t s = 100000; s <= 100010; ++s) {
    RunFacts f = Step(s, 5.01);
    f.run_id = "moe-incident-demo";
    f.config.z_loss_coef = 1e-4;
    f.config.weight_decay = 0.1;
    ParamFact gain;
    gain.info = {"final_norm.weight", 6144, ParamKind::kNormGain, 0.0, std::nullopt, "final_norm", ""};
    gain.norm = 362.1;
    gain.norm_slope_per_kstep = 2.5;  // still rising
    ParamFact head;
    head.info = {"lm_head.weight", 788'000'000, ParamKind::kOutput, 0.1, std::nullopt, "", ""};
    f.params = {gain, head};
    f.shares = {{"lm_head.weight", false, 0.939, 0.01, ParamKind::kOutput}};
    ts = engine.EvaluateStep(f, kT0 + static_cast<double>(s));
  }
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kFiring);
  const LabelSet& an = ts[0].alert.annotations;
  CHECK(an.at("summary") == "Total grad norm 5.01 ≥ 5 at step 100,010 in run moe-incident-demo");
  CHECK_THAT(an.at("recommendation"),
             Catch::StartsWith("final_norm.weight has weight decay 0; its norm is 362.1, 4.62× its init norm") &&
                 Catch::EndsWith("Recommendation: enable weight decay on final_norm.weight (the run uses 0.1 "
                                 "for its decayed parameters)."));
  CHECK_THAT(an.at("description"), !Catch::Contains("{{"));
}

namespace {

// Collects what the engine hands its change sink, folded as the daemon's writer folds it.
struct Recorder {
  StateChanges folded;
  std::vector<Transition> transitions;
  int calls = 0;
  bool recording = true;  // false: changes are lost, as those not yet written when the daemon crashes
  void Attach(AlertEngine& engine) {
    engine.SetChangeSink([this](StateChanges changes, const std::vector<Transition>& ts) {
      if (!recording) return;
      ++calls;
      folded.Merge(std::move(changes));
      transitions.insert(transitions.end(), ts.begin(), ts.end());
    });
  }
  // The state a restart would load: what is saved and not erased.
  SavedState Saved() const {
    SavedState saved;
    for (const auto& [fp, inst] : folded.instances) {
      if (inst) saved.instances.push_back(*inst);
    }
    for (const auto& [id, s] : folded.silences) {
      if (s) saved.silences.push_back(*s);
    }
    for (const auto& [fp, level] : folded.levels) {
      if (level) saved.levels[fp] = *level;
    }
    for (const auto& [run, step] : folded.evaluated) {
      if (step) saved.evaluated[run] = *step;
    }
    return saved;
  }
};

}  // namespace

TEST_CASE("every durable change reaches the sink, value-only updates only when progress is flushed",
          "[alerts][persistence]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Recorder rec;
  rec.Attach(engine);
  Driver d{engine};
  d.Report(100, 5.1);  // pending, s0 = 100
  REQUIRE(rec.folded.instances.size() == 1);
  const auto& [fp, first] = *rec.folded.instances.begin();
  REQUIRE(first);
  CHECK(first->alert.state == AlertState::kPending);
  CHECK(first->held_since_step == 100);
  CHECK(first->rule == "GradNormContingency");
  CHECK(first->run == "r1");

  const int calls = rec.calls;
  d.Run(101, 110, 1, 5.2);  // still pending: only the reports and the evaluated step changed
  CHECK(rec.calls == calls);
  engine.FlushProgress();
  CHECK(rec.calls == calls + 1);
  REQUIRE(rec.folded.levels.count(fp) == 1);
  REQUIRE(rec.folded.levels.at(fp));
  CHECK(rec.folded.levels.at(fp)->window.count == 10);
  CHECK(rec.folded.evaluated.at("r1") == 109u);

  d.Report(110, 5.3);  // fires
  REQUIRE(rec.folded.instances.at(fp));
  CHECK(rec.folded.instances.at(fp)->alert.state == AlertState::kFiring);
  CHECK(rec.folded.instances.at(fp)->notified);
  CHECK(rec.transitions.back().to == AlertState::kFiring);

  REQUIRE(engine.Ack(Fp(engine.Active()[0]), "alice", "on it", kT0 + 111).ok());
  REQUIRE(rec.folded.instances.at(fp)->ack);
  CHECK(rec.folded.instances.at(fp)->ack->by == "alice");

  REQUIRE(engine.AddSilence({"s1", EqualityMatchers({{"run", "r1"}}).value(), kT0, kT0 + 500, "", "bob"}).ok());
  REQUIRE(rec.folded.silences.at("s1"));
  REQUIRE(engine.RemoveSilence("s1").ok());
  CHECK_FALSE(rec.folded.silences.at("s1"));

  d.Report(150, 4.0);  // resolves: the instance is gone
  CHECK_FALSE(rec.folded.instances.at(fp));
  CHECK(rec.Saved().instances.empty());
}

TEST_CASE("a restored firing alert resolves, and is sent resolved, when the condition cleared",
          "[alerts][persistence]") {
  Recorder rec;
  std::string fp;
  {
    AlertEngine before({DefaultRule("GradNormContingency")});
    rec.Attach(before);
    Driver d{before};
    REQUIRE(StepOf(d.Run(100, 111, 1, 5.1), AlertState::kFiring) == 110u);
    fp = Fp(before.Active()[0]);
  }  // the daemon stops

  AlertEngine after({DefaultRule("GradNormContingency")});
  CHECK(after.Restore(rec.Saved(), kT0 + 120).empty());
  REQUIRE(after.Active().size() == 1);
  const Alert restored = after.Active()[0];
  CHECK(restored.state == AlertState::kFiring);
  CHECK(Fp(restored) == fp);
  CHECK(restored.starts_at == kT0 + 100);
  CHECK(restored.step == 110);

  Driver d{after};
  CHECK(d.Report(121, 5.2).empty());  // still firing: not paged again
  auto ts = d.Report(130, 4.0);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].notify);  // the receivers were told it fired, so they hear it ended
  CHECK(ts[0].alert.starts_at == kT0 + 100);
}

TEST_CASE("a restored pending alert keeps its s0", "[alerts][persistence]") {
  Recorder rec;
  {
    AlertEngine before({DefaultRule("GradNormContingency")});
    rec.Attach(before);
    Driver{before}.Run(100, 105, 1, 5.1);
  }
  AlertEngine after({DefaultRule("GradNormContingency")});
  after.Restore(rec.Saved(), kT0 + 106);
  Driver d{after};
  CHECK(d.Run(105, 110, 1, 5.1).empty());
  CHECK(StepOf(d.Report(110, 5.1), AlertState::kFiring) == 110u);  // s0 + 10, as without the restart
}

TEST_CASE("restore ends alerts of rules that are gone, keeps acks, drops ended silences", "[alerts][persistence]") {
  Recorder rec;
  std::string fp;
  {
    AlertEngine before({DefaultRule("GradNormContingency"), PlainThreshold(0)});
    rec.Attach(before);
    Driver d{before};
    d.Run(100, 111, 1, 5.1);
    for (const Alert& a : before.Active()) {
      if (a.name == "GradNormContingency") fp = Fp(a);
    }
    REQUIRE(before.Ack(fp, "alice", "", kT0 + 111).ok());
    REQUIRE(before.AddSilence({"short", EqualityMatchers({{"run", "r9"}}).value(), kT0, kT0 + 150, "", "bob"}).ok());
    REQUIRE(before.AddSilence({"long", EqualityMatchers({{"run", "r9"}}).value(), kT0, kT0 + 5000, "", "bob"}).ok());
  }
  AlertEngine after({DefaultRule("GradNormContingency")});
  Recorder rec2;
  rec2.Attach(after);
  auto ts = after.Restore(rec.Saved(), kT0 + 200);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].alert.name == "Plain");
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].notify);
  REQUIRE(after.AckOf(fp));
  CHECK(after.AckOf(fp)->by == "alice");
  REQUIRE(after.Silences().size() == 1);
  CHECK(after.Silences()[0].id == "long");
  // The restore's own changes are persisted too: the ended instance and silence are erased.
  CHECK(rec2.folded.silences.count("short") == 1);
  CHECK_FALSE(rec2.folded.silences.at("short"));
  CHECK(rec2.folded.instances.size() == 1);
  CHECK_FALSE(rec2.folded.instances.begin()->second);
}

namespace {

std::string Describe(const Transition& t) {
  std::ostringstream out;
  out << std::hexfloat << t.alert.name << " " << static_cast<int>(t.from) << "->" << static_cast<int>(t.to) << " at "
      << t.alert.step << " value " << t.alert.value << (t.notify ? " notified" : "");
  return out.str();
}

// A noisy total grad norm that rises through the contingency's threshold of 5 and falls back:
// its level trackers (median, noise) decide when the page fires and resolves.
double NoisyTotal(uint64_t s) {
  const double trend = s < 300 ? 3.0 + 0.01 * static_cast<double>(s) : 6.0 - 0.01 * static_cast<double>(s - 300);
  return trend * (1.0 + 0.05 * std::sin(1.3 * static_cast<double>(s)));
}

}  // namespace

TEST_CASE("an engine restored from any saved cut makes the transitions of an uninterrupted one",
          "[alerts][persistence]") {
  constexpr uint64_t kLast = 600;
  std::vector<std::string> expected;
  {
    AlertEngine whole({DefaultRule("GradNormContingency")});
    for (uint64_t s = 0; s <= kLast; ++s) {
      for (const Transition& t : Driver{whole}.Report(s, NoisyTotal(s))) expected.push_back(Describe(t));
    }
  }
  INFO("uninterrupted:\n"
       << [&] {
            std::string all;
            for (const auto& e : expected) all += e + "\n";
            return all;
          }());
  REQUIRE(std::count_if(expected.begin(), expected.end(),
                        [](const std::string& e) { return e.find("notified") != std::string::npos; }) == 2);

  for (uint64_t saved_through : {uint64_t{40}, uint64_t{201}, uint64_t{262}, uint64_t{331}, uint64_t{455}}) {
    DYNAMIC_SECTION("the store holds the changes through step " << saved_through) {
      Recorder rec;
      std::vector<std::string> got;
      {
        AlertEngine crashed({DefaultRule("GradNormContingency")});
        rec.Attach(crashed);
        Driver d{crashed};
        for (uint64_t s = 0; s <= saved_through; ++s) {
          for (const Transition& t : d.Report(s, NoisyTotal(s))) got.push_back(Describe(t));
        }
        // The writer fetches the progress now and then: at some cuts it just did, at others the
        // store holds the engine as of its last change.
        if (saved_through % 2 == 0) crashed.FlushProgress();
        // Evaluated, but the daemon died before these changes (and so their notifications) were
        // written: as if they never happened.
        rec.recording = false;
        for (uint64_t s = saved_through + 1; s <= saved_through + 25; ++s) d.Report(s, NoisyTotal(s));
      }
      AlertEngine restarted({DefaultRule("GradNormContingency")});
      CHECK(restarted.Restore(rec.Saved(), kT0 + 1000).empty());
      const std::optional<uint64_t> evaluated = restarted.EvaluatedThrough("r1");
      if (saved_through % 2 == 0) CHECK(evaluated == saved_through);
      // The steps after it, journaled or resent, are evaluated once each.
      for (uint64_t s = evaluated ? *evaluated + 1 : 0; s <= kLast; ++s) {
        for (const Transition& t : Driver{restarted}.Report(s, NoisyTotal(s))) got.push_back(Describe(t));
      }
      CHECK(got == expected);
    }
  }
}

TEST_CASE("a rewind makes the run's steps from the resume point evaluable again", "[alerts][persistence]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  Driver{engine}.Run(0, 500, 1, 1.0);
  REQUIRE(engine.EvaluatedThrough("r1") == 499u);
  engine.RewindRun("r1", 300, kT0 + 500);
  CHECK(engine.EvaluatedThrough("r1") == 299u);
  engine.RewindRun("r1", 0, kT0 + 501);
  CHECK_FALSE(engine.EvaluatedThrough("r1"));
  Driver{engine}.Run(0, 10, 1, 1.0);
  engine.EndRun("r1", AlertEngine::RunEnding::kLeftMemory, kT0 + 600);
  CHECK_FALSE(engine.EvaluatedThrough("r1"));
}

TEST_CASE("a warm-up spike pages nobody and a condition still holding after warm-up pages", "[alerts]") {
  AlertEngine engine({DefaultRule("GradNormContingency")});
  auto held_facts = [](uint64_t step, double total) {
    RunFacts f = Step(step, total);
    if (step < 200) {
      f.warmup.holds_pages = true;
      f.warmup.reason = "the run is in its first 200 steps (step " + std::to_string(step) + ")";
    }
    return f;
  };
  auto severity = [](const Transition& t) { return t.alert.labels.at("severity"); };

  SECTION("a spike that decays during warm-up") {
    std::vector<Transition> all;
    for (uint64_t s = 0; s < 600; ++s) {
      const double total = s < 150 ? 40 * std::exp(-0.04 * static_cast<double>(s)) + 0.3 : 0.3;
      for (Transition& t : engine.EvaluateStep(held_facts(s, total), kT0 + static_cast<double>(s))) all.push_back(t);
    }
    bool warned = false;
    for (const Transition& t : all) {
      INFO(t.alert.annotations.at("summary"));
      CHECK(severity(t) == "warning");
      if (t.to == AlertState::kFiring) {
        warned = true;
        CHECK(t.alert.labels.at("page_held") == "warmup");
        CHECK_THAT(t.alert.annotations.at("summary"), Catch::StartsWith("Not paged during warm-up: Total grad norm"));
        CHECK_THAT(t.alert.annotations.at("page_held"), Catch::Contains("first 200 steps"));
        CHECK_THAT(t.alert.annotations.at("description"), Catch::Contains("it pages if the condition still holds"));
      }
    }
    CHECK(warned);
    CHECK(engine.Active().empty());
  }

  SECTION("a level that holds past the warm-up") {
    std::optional<Transition> page;
    for (uint64_t s = 0; s < 400 && !page; ++s) {
      for (Transition& t : engine.EvaluateStep(held_facts(s, 8), kT0 + static_cast<double>(s))) {
        if (t.to == AlertState::kFiring && severity(t) == "page") page = t;
        if (t.to == AlertState::kResolved) {
          CHECK(severity(t) == "warning");
          CHECK_THAT(t.alert.annotations.at("summary"), Catch::Contains("held during warm-up over at step 200"));
        }
      }
    }
    REQUIRE(page);
    CHECK(page->notify);
    CHECK(page->alert.step == 210);  // for_steps (10) after the warm-up's end
    CHECK(page->alert.labels.count("page_held") == 0);
  }

  SECTION("a non-finite value pages at once") {
    auto t = engine.EvaluateStep(held_facts(5, INFINITY), kT0 + 5);
    REQUIRE(t.size() == 1);  // the page's own instance, pending for its for_steps
    CHECK(t[0].to == AlertState::kPending);
    CHECK(severity(t[0]) == "page");
    std::optional<Transition> page;
    for (uint64_t s = 6; s < 30 && !page; ++s) {
      for (Transition& x : engine.EvaluateStep(held_facts(s, INFINITY), kT0 + static_cast<double>(s))) {
        if (x.to == AlertState::kFiring) page = x;
      }
    }
    REQUIRE(page);
    CHECK(severity(*page) == "page");
  }
}

TEST_CASE("the contingency's texts carry the rule's own numbers", "[alerts]") {
  Rule rule = DefaultRule("GradNormContingency");
  rule.value = 3;
  rule.clear_below = 2.5;
  rule.for_steps = 4;
  AlertEngine engine({rule});
  std::optional<Transition> fired;
  for (uint64_t s = 1000; s < 1020 && !fired; ++s) {
    for (Transition& t : engine.EvaluateStep(Step(s, 3.2), kT0 + static_cast<double>(s))) {
      if (t.to == AlertState::kFiring) fired = t;
    }
  }
  REQUIRE(fired);
  const std::string& summary = fired->alert.annotations.at("summary");
  const std::string& description = fired->alert.annotations.at("description");
  CHECK(summary == "Total grad norm 3.2 ≥ 3 at step 1,004 in run r1");
  CHECK_THAT(description, Catch::Contains("at or above 3 for 4 steps") && Catch::Contains("falls below 2.5"));
  CHECK_THAT(summary + description, !Catch::Contains(" 5") && !Catch::Contains("4.5"));
  // A run reporting only its total: the diagnosis names no cause.
  CHECK(fired->alert.annotations.at("cause") == "no_per_parameter_norms");
  CHECK(fired->alert.annotations.at("remediation_supported") == "false");
  CHECK_THAT(description, Catch::Contains("reports only its total grad norm"));
}

TEST_CASE("a growth alert whose parameter got weight decay resolves saying so, not with a value never measured",
          "[alerts]") {
  AlertEngine engine(
      Load("      - alert: Growing\n        kind: growth_without_decay\n        param_kind: norm_gain\n"
           "        min_amplification: 1.5\n        labels: {severity: warning}\n        annotations:\n"
           "          resolved_summary: \"{{ param }} at {{ value }}x (below {{ clear_below }})\"\n"));
  const auto facts = [](uint64_t step, double weight_decay) {
    RunFacts f = Step(step, 1.0);
    ParamFact p;
    p.info = {.name = "final_norm.weight", .numel = 16, .kind = ParamKind::kNormGain, .weight_decay = weight_decay};
    p.norm = 8;
    p.init_norm = 4;
    p.growth_factor = 1.2;
    p.growth_slope_per_kstep = 1;
    f.params = {p};
    return f;
  };
  REQUIRE(StepOf(engine.EvaluateStep(facts(100, 0), kT0 + 100), AlertState::kFiring) == 100u);
  const auto ts = engine.EvaluateStep(facts(110, 0.1), kT0 + 110);
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].to == AlertState::kResolved);
  CHECK(ts[0].alert.annotations.at("summary") ==
        "Growing resolved at step 110 in run r1: final_norm.weight is no longer judged by this rule (its weight decay "
        "is now 0.1, above the rule's 0)");
}

TEST_CASE("a slope change that resolves speaks of its event and numbers, whether it cleared or vanished", "[alerts]") {
  // Found by a hostile pass: "slope change at step  now ×, below ×" (empty fields).
  for (const bool vanishes : {false, true}) {
    INFO((vanishes ? "the fact vanishes" : "the ratio falls"));
    AlertEngine engine({DefaultRule("GradNormSlopeChangeAtEvent")});
    const auto facts = [](uint64_t step, double ratio, bool with_fact) {
      RunFacts f = Step(step, 2.0);
      if (with_fact) {
        SlopeChangeFact s;
        s.key = "grad/norm/total";
        s.event_step = 1000;
        s.event_text = "switched routing";
        s.before_per_kstep = 0.1;
        s.after_per_kstep = 0.1 * ratio;
        s.ratio = ratio;
        s.after_samples = 500;
        f.slope_changes.push_back(s);
      }
      return f;
    };
    std::vector<Transition> all;
    for (uint64_t step = 1300; step < 1400; ++step) {
      for (Transition& t : engine.EvaluateStep(facts(step, 3.0, true), kT0 + static_cast<double>(step))) {
        all.push_back(std::move(t));
      }
    }
    REQUIRE(StepOf(all, AlertState::kFiring));
    std::optional<Transition> resolved;
    for (uint64_t step = 1400; step < 1600 && !resolved; ++step) {
      for (Transition& t : engine.EvaluateStep(facts(step, 1.0, !vanishes), kT0 + static_cast<double>(step))) {
        if (t.to == AlertState::kResolved) resolved = t;
      }
    }
    REQUIRE(resolved);
    const std::string summary = resolved->alert.annotations.at("summary");
    INFO(summary);
    CHECK(summary.find("  ") == std::string::npos);
    CHECK(summary.find("×,") == std::string::npos);
    CHECK(summary.find("step 1,000") != std::string::npos);
  }
}

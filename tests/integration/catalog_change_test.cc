// A run's catalog changes over its life, through the real gradwatchd and the real CLI: a history's
// `params` line and a resumed job's Hello change a parameter's weight decay from a step on, and the
// growth warning and the weight-decay advice follow.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using json = nlohmann::json;

namespace {

// The incident's shape, fast: final_norm.weight (no weight decay) grows ×(1 + step/100) from its
// init norm, lm_head carries 95% of the squared grad norm, and the total is 6 from step 300 on.
json Header(const std::string& run, double final_norm_wd) {
  return {
      {"run", run},
      {"config", {{"weight_decay", 0.1}}},
      {"params",
       json::array(
           {{{"name", "final_norm.weight"}, {"numel", 6144}, {"kind", "norm_gain"}, {"weight_decay", final_norm_wd}},
            {{"name", "lm_head.weight"}, {"numel", 6144 * 1024}, {"kind", "output"}, {"weight_decay", 0.1}},
            {{"name", "layers.0.mlp.weight"}, {"numel", 4096 * 6144}, {"kind", "mlp"}}})}};
}

json StepLine(uint64_t s) {
  const double total = s < 300 ? 1.0 : 6.0;
  return {{"_step", s},
          {"grad/norm/total", total},
          {"grad/norm/lm_head.weight", total * std::sqrt(0.95)},
          {"grad/norm/layers.0.mlp.weight", total * std::sqrt(0.05)},
          {"params/norm/final_norm.weight", std::sqrt(6144.0) * (1 + static_cast<double>(s) / 100)},
          {"optim/learning_rate", 3e-4}};
}

CommandResult Replay(const DaemonProcess& daemon, const std::string& path, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", path, "--max"};
  args.insert(args.end(), extra.begin(), extra.end());
  return RunCommand(args, std::nullopt, std::chrono::seconds(120));
}

std::optional<v1::Alert> Find(const DaemonProcess& daemon, const std::string& run, const std::string& name) {
  for (const v1::Alert& a : ListAlerts(daemon.grpc_target(), run)) {
    if (a.name() == name) return a;
  }
  return std::nullopt;
}

// The run as `gradwatch show --json` has it.
json Shown(const DaemonProcess& daemon, const std::string& run) {
  const CommandResult show = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "show", run});
  INFO(show.out << show.err);
  REQUIRE(show.exit_code == 0);
  return json::parse(show.out);
}

double WeightDecayShown(const json& shown, const std::string& param) {
  for (const json& p : shown["params"]) {
    if (p["name"] == param) return p.value("weight_decay", 0.0);
  }
  FAIL("no parameter " << param << " in " << shown["params"].dump());
  return -1;
}

// The growth warning fires and the page advises weight decay on the final norm, as of step 600.
void ExpectTheIncident(const DaemonProcess& daemon, const std::string& run) {
  REQUIRE(WaitUntil(
      [&] {
        const auto growth = Find(daemon, run, "NormGainGrowingWithoutDecay");
        const auto page = Find(daemon, run, "GradNormContingency");
        return growth && growth->state() == v1::ALERT_STATE_FIRING && page && page->state() == v1::ALERT_STATE_FIRING &&
               page->annotations().at("description").find("at step 600") != std::string::npos;
      },
      std::chrono::seconds(90)));
  const v1::Alert page = *Find(daemon, run, "GradNormContingency");
  INFO(page.annotations().at("recommendation"));
  CHECK(page.annotations().at("cause") == "norm_gain_inflates_output");
  CHECK(page.annotations().at("remediation_supported") == "true");
  CHECK(page.annotations().at("recommendation").find("enable weight decay on final_norm.weight") != std::string::npos);
}

// Steps 1..600 of the incident's shape for `run`, replayed; then as ExpectTheIncident.
void ReplayTheIncident(const DaemonProcess& daemon, const TempDir& dir, const std::string& run) {
  const std::string first = (dir.path() / (run + "-first.jsonl")).string();
  {
    std::ofstream out(first);
    out << Header(run, 0.0).dump() << "\n";
    for (uint64_t s = 1; s <= 600; ++s) out << StepLine(s).dump() << "\n";
  }
  const CommandResult r = Replay(daemon, first);
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  ExpectTheIncident(daemon, run);
}

// From the change on: the growth warning resolved, the page's advice no longer weight decay.
void ExpectRemedied(const DaemonProcess& daemon, const std::string& run, uint64_t last_step) {
  const std::string at_last = "at step " + std::to_string(last_step);
  REQUIRE(WaitUntil(
      [&] {
        const auto growth = Find(daemon, run, "NormGainGrowingWithoutDecay");
        const auto page = Find(daemon, run, "GradNormContingency");
        return !growth && page && page->annotations().at("description").find(at_last) != std::string::npos;
      },
      std::chrono::seconds(90)));
  const v1::Alert page = *Find(daemon, run, "GradNormContingency");
  const auto& an = page.annotations();
  INFO(an.at("description") << "\n" << an.at("recommendation"));
  CHECK(an.at("cause") == "none");
  CHECK(an.at("remediation_supported") == "false");
  CHECK(an.at("recommendation").find("enable weight decay") == std::string::npos);
  CHECK(an.at("description").find("final_norm.weight is at ") != std::string::npos);
  CHECK(an.at("description").find("× its init norm with weight decay 0.1, still rising") != std::string::npos);
  CHECK(an.at("recommendation")
            .find("final_norm.weight already has weight decay 0.1: no further weight-decay "
                  "change is indicated") != std::string::npos);
  CHECK(an.at("remediation_why") == "final_norm.weight already has weight decay 0.1");
}

}  // namespace

TEST_CASE("a history's params line changes the catalog from its step: the growth warning and the advice end",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-catalog-line");
  ReplayTheIncident(daemon, dir, "remedied");

  // The on-call engineer moves final_norm.weight into a param group with weight decay 0.1 at step
  // 601; the history says so in a line of its own, and the norm goes on (its decay shows later).
  const std::string second = (dir.path() / "second.jsonl").string();
  {
    std::ofstream out(second);
    out << Header("remedied", 0.0).dump() << "\n";
    out << json{{"_step", 601}, {"params", {{{"name", "final_norm.weight"}, {"weight_decay", 0.1}}}}}.dump() << "\n";
    for (uint64_t s = 601; s <= 700; ++s) out << StepLine(s).dump() << "\n";
  }
  const CommandResult r2 = Replay(daemon, second);
  INFO(r2.out << r2.err);
  REQUIRE(r2.exit_code == 0);
  CHECK(r2.out.find("catalog updates  1") != std::string::npos);
  ExpectRemedied(daemon, "remedied", 700);

  const json shown = Shown(daemon, "remedied");
  CHECK(WeightDecayShown(shown, "final_norm.weight") == 0.1);
  bool event = false;
  INFO(shown["events"].dump());
  for (const json& e : shown["events"]) {
    event = event || (e["source"] == "catalog" && e["step"] == 601 &&
                      e["text"] == "catalog change: final_norm.weight weight decay 0 → 0.1");
  }
  CHECK(event);
  // The exported catalog follows it.
  CHECK(ParseMetric(daemon.ScrapeMetrics(), "gradwatch_param_weight_decay",
                    {{"run", "remedied"}, {"param", "final_norm.weight"}, {"group", "norm_gain"}}) == 0.1);
  // And the check after the remediation starts from it.
  REQUIRE(shown["analysis"]["remediations"].size() == 1);
  const json check = shown["analysis"]["remediations"][0];

  // A params line the catalog cannot take is refused by the daemon, with the reason.
  const std::string bad = (dir.path() / "bad.jsonl").string();
  {
    std::ofstream out(bad);
    out << Header("remedied", 0.0).dump() << "\n";
    out << json{{"_step", 701}, {"params", {{{"name", "no_such.weight"}, {"weight_decay", 0.1}}}}}.dump() << "\n";
  }
  const CommandResult r3 = Replay(daemon, bad);
  INFO(r3.out << r3.err);
  CHECK(r3.exit_code != 0);
  CHECK((r3.out + r3.err).find("'no_such.weight' is not in the run's catalog") != std::string::npos);

  // The change survives a restart of the daemon, and so does its check.
  daemon.Restart();
  const json restarted = Shown(daemon, "remedied");
  CHECK(WeightDecayShown(restarted, "final_norm.weight") == 0.1);
  INFO(restarted["analysis"].dump());
  REQUIRE(restarted["analysis"]["remediations"].size() == 1);
  const json after = restarted["analysis"]["remediations"][0];
  CHECK(after["step"] == check["step"]);
  CHECK(after["norm_at_step"] == check["norm_at_step"]);
  CHECK(after["projected_norm"] == check["projected_norm"]);
}

TEST_CASE("a resumed job whose hello carries the new weight decay changes the catalog from its resume step",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-catalog-resume");
  ReplayTheIncident(daemon, dir, "resumed");

  // The job is restarted from its step-550 checkpoint with weight decay 0.1 on the final norm.
  const std::string second = (dir.path() / "second.jsonl").string();
  {
    std::ofstream out(second);
    out << Header("resumed", 0.1).dump() << "\n";
    for (uint64_t s = 550; s <= 700; ++s) out << StepLine(s).dump() << "\n";
  }
  const CommandResult r2 = Replay(daemon, second, {"--resume-from", "550"});
  INFO(r2.out << r2.err);
  REQUIRE(r2.exit_code == 0);
  ExpectRemedied(daemon, "resumed", 700);
  const json shown = Shown(daemon, "resumed");
  CHECK(WeightDecayShown(shown, "final_norm.weight") == 0.1);
}

namespace {

// A norm gain trained by AdamW (as tests/unit/analytics/projection_test.cc): its gradient pulls
// the norm outward, with a little noise. Steps are written to `out` every `every` steps from
// `from` to `to` with decay `wd` applied; with `radial`, each step's ⟨Δw, w⟩/|w| too (as
// gradwatch.torch.Watch(radial_updates=True) sends it).
class SimulatedGain {
 public:
  SimulatedGain() : w_(256), m_(256), v_(256) {
    std::normal_distribution<double> init(0.0, 1.0);
    for (double& x : w_) x = init(rng_);
  }
  double Norm() const {
    double s = 0;
    for (double x : w_) s += x * x;
    return std::sqrt(s);
  }
  void Run(std::ofstream& out, uint64_t from, uint64_t to, uint64_t every, double wd, bool radial = false) {
    for (uint64_t s = from; s <= to; ++s) {
      ++t_;
      const double n = Norm();
      double change2 = 0, along = 0;
      for (size_t i = 0; i < w_.size(); ++i) {
        const double g = -w_[i] / n + 0.05 * normal_(rng_);
        m_[i] = 0.9 * m_[i] + 0.1 * g;
        v_[i] = 0.999 * v_[i] + 0.001 * g * g;
        const double u = (m_[i] / (1 - std::pow(0.9, t_))) / (std::sqrt(v_[i] / (1 - std::pow(0.999, t_))) + 1e-8);
        const double next = (1 - kLr * wd) * w_[i] - kLr * u;
        change2 += (next - w_[i]) * (next - w_[i]);
        along += (next - w_[i]) * w_[i] / n;
        w_[i] = next;
      }
      if (s % every != 0) continue;
      json line = {{"_step", s},
                   {"grad/norm/total", 2.0},
                   {"grad/norm/lm_head.weight", 2.0 * std::sqrt(0.95)},
                   {"grad/norm/layers.0.mlp.weight", 2.0 * std::sqrt(0.05)},
                   {"params/norm/final_norm.weight", Norm()},
                   {"updates/norm/final_norm.weight", std::sqrt(change2)},
                   {"optim/learning_rate", kLr}};
      if (radial) line["updates/radial/final_norm.weight"] = along;
      out << line.dump() << "\n";
    }
  }
  static constexpr double kLr = 1e-3;

 private:
  std::vector<double> w_, m_, v_;
  std::mt19937 rng_{11};
  std::normal_distribution<double> normal_{0.0, 1.0};
  double t_ = 0;
};

json Projection(const json& shown, const std::string& param) {
  for (const json& p : shown["analysis"]["projections"]) {
    if (p["param"] == param) return p;
  }
  return json();
}

double Number(const json& v) { return v.is_string() ? std::stod(v.get<std::string>()) : v.get<double>(); }

}  // namespace

TEST_CASE("the what-if made before a remediation tracks an AdamW-trained norm, and the check says whether it works",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-what-if");
  // Without and with the trainer's radial updates (updates/radial/): with them, ρ is read, not
  // inferred from the norm's slope.
  for (const auto& [name, decays, radial] :
       {std::tuple{"remedy-works", true, false}, std::tuple{"remedy-ignored", false, false},
        std::tuple{"remedy-works-radial", true, true}}) {
    const std::string run = name;  // a structured binding: clang 14 cannot capture it in a lambda
    INFO(run);
    SimulatedGain gain;
    const std::string first = (dir.path() / (run + "-1.jsonl")).string();
    {
      std::ofstream out(first);
      out << Header(run, 0.0).dump() << "\n";
      gain.Run(out, 1, 3000, 1, 0.0, radial);
    }
    CommandResult r = Replay(daemon, first);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    // The projection of weight decay 0.1 (the run's default) from step 3,000 to 23,000.
    const json before = Projection(Shown(daemon, run), "final_norm.weight");
    INFO(before.dump());
    REQUIRE_FALSE(before.is_null());
    CHECK(Number(before["weight_decay"]) == 0.1);
    CHECK(Number(before["from_step"]) == 3000);
    CHECK(Number(before["to_step"]) == 23000);
    CHECK(before["orthogonal_known"] == true);
    CHECK(before.value("radial_known", false) == radial);
    CHECK(Number(before["time_constant_steps"]) == Approx(10000).epsilon(0.05));

    // The remedy from step 3,001, then 20,000 steps of AdamW: with the decay, or (the trainer did
    // not apply it) without.
    const std::string second = (dir.path() / (run + "-2.jsonl")).string();
    {
      std::ofstream out(second);
      out << Header(run, 0.0).dump() << "\n";
      out << json{{"_step", 3001}, {"params", {{{"name", "final_norm.weight"}, {"weight_decay", 0.1}}}}}.dump() << "\n";
      gain.Run(out, 3001, 23000, 10, decays ? 0.1 : 0.0, radial);
    }
    r = Replay(daemon, second);
    REQUIRE(r.exit_code == 0);
    const json shown = Shown(daemon, run);
    REQUIRE(shown["analysis"]["remediations"].size() == 1);
    const json check = shown["analysis"]["remediations"][0];
    INFO(check.dump());
    CHECK(check["param"] == "final_norm.weight");
    CHECK(Number(check["step"]) == 3001);
    CHECK(Number(check["at_step"]) == 23000);
    CHECK(Number(check["actual_norm"]) == Approx(gain.Norm()));
    if (decays) {
      // Made at step 3,000, the projection is within 10% of AdamW's norm 20,000 steps later.
      CHECK(Number(before["norm"]) == Approx(gain.Norm()).epsilon(0.10));
      CHECK(Number(check["projected_norm"]) == Approx(gain.Norm()).epsilon(0.10));
      CHECK(check["verdict"] == "working");
      CHECK_FALSE(Find(daemon, run, "RemediationOffProjection"));
    } else {
      CHECK(check["verdict"] == "not working");
      // The warning: the norm departs from the projection after half a time constant.
      REQUIRE(WaitUntil(
          [&] {
            const auto a = Find(daemon, run, "RemediationOffProjection");
            return a && a->state() == v1::ALERT_STATE_FIRING;
          },
          std::chrono::seconds(60)));
      const v1::Alert warning = *Find(daemon, run, "RemediationOffProjection");
      const auto& an = warning.annotations();
      INFO(an.at("summary") << "\n" << an.at("description") << "\n" << an.at("recommendation"));
      CHECK(warning.labels().at("param") == "final_norm.weight");
      CHECK(warning.labels().at("remediation_step") == "3001");
      CHECK(warning.labels().at("severity") == "warning");
      CHECK(an.at("summary").find("(not working)") != std::string::npos);
      CHECK(an.at("description").find("went from 0 to 0.1 at step 3,001") != std::string::npos);
      CHECK(an.at("recommendation").find("follows the path it had without the change") != std::string::npos);
      // Its step is past half a time constant (~10,000 steps) after the change.
      CHECK(warning.step() >= 3001 + 5000);
    }
    const CommandResult text = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "show", run});
    CHECK(text.out.find("remediation: final_norm.weight weight decay 0 → 0.1 at step 3,001: " +
                        check["verdict"].get<std::string>()) != std::string::npos);
    // `gradwatch report` tells it too.
    const auto report = dir.path() / (run + "-report");
    const CommandResult rep =
        RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "report", run, "-o", report.string()});
    REQUIRE(rep.exit_code == 0);
    std::ifstream md_file(report / "report.md");
    const std::string md((std::istreambuf_iterator<char>(md_file)), std::istreambuf_iterator<char>());
    CHECK(md.find("## Weight decay: what-if and remediations") != std::string::npos);
    CHECK(md.find("from step 3,001 (norm ") != std::string::npos);
    CHECK(md.find(" without the change: **" + check["verdict"].get<std::string>() + "**") != std::string::npos);
  }
}

TEST_CASE("the what-if projects as far as the daemon's analytics.projection_steps says", "[integration]") {
  DaemonOptions options;
  options.config_yaml = "log: {format: text, level: info}\nanalytics: {projection_steps: 10000}\n";
  DaemonProcess daemon(options);
  TempDir dir("gradwatch-what-if-steps");
  SimulatedGain gain;
  const std::string history = (dir.path() / "gain.jsonl").string();
  {
    std::ofstream out(history);
    out << Header("short-what-if", 0.0).dump() << "\n";
    gain.Run(out, 1, 3000, 1, 0.0);
  }
  const CommandResult r = Replay(daemon, history);
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json projection = Projection(Shown(daemon, "short-what-if"), "final_norm.weight");
  INFO(projection.dump());
  REQUIRE_FALSE(projection.is_null());
  CHECK(Number(projection["from_step"]) == 3000);
  CHECK(Number(projection["to_step"]) == 13000);
  const CommandResult text = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "show", "short-what-if"});
  CHECK(text.out.find("what-if: weight decay 0.1 on final_norm.weight from step 3,000:") != std::string::npos);
  CHECK(text.out.find("by step 13,000") != std::string::npos);
  CHECK(text.out.find("[learning rate held]") != std::string::npos);

  // A run whose config names its schedule and its last step: the what-if follows the one and stops
  // at the other.
  SimulatedGain scheduled;
  const std::string with_schedule = (dir.path() / "scheduled.jsonl").string();
  {
    std::ofstream out(with_schedule);
    json header = Header("scheduled-what-if", 0.0);
    header["config"]["total_steps"] = 8000;
    header["config"]["lr_schedule"] = "linear";
    header["config"]["min_lr"] = 1e-4;
    out << header.dump() << "\n";
    scheduled.Run(out, 1, 3000, 1, 0.0);
  }
  REQUIRE(Replay(daemon, with_schedule).exit_code == 0);
  const json to_end = Projection(Shown(daemon, "scheduled-what-if"), "final_norm.weight");
  INFO(to_end.dump());
  REQUIRE_FALSE(to_end.is_null());
  CHECK(Number(to_end["to_step"]) == 8000);
  CHECK(to_end["schedule"] == "following its linear schedule to 0.0001 at step 8,000");
}

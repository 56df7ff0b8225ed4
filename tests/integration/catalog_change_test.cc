// A run's catalog changes over its life, through the real gradwatchd and the real CLI: a history's
// `params` line and a resumed job's Hello change a parameter's weight decay from a step on, and the
// growth warning and the weight-decay advice follow.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <optional>
#include <string>
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
  const std::string first = (dir.path() / "first.jsonl").string();
  {
    std::ofstream out(first);
    out << Header("remedied", 0.0).dump() << "\n";
    for (uint64_t s = 1; s <= 600; ++s) out << StepLine(s).dump() << "\n";
  }
  const CommandResult r1 = Replay(daemon, first);
  INFO(r1.out << r1.err);
  REQUIRE(r1.exit_code == 0);
  ExpectTheIncident(daemon, "remedied");

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

  // The change survives a restart of the daemon.
  daemon.Restart();
  CHECK(WeightDecayShown(Shown(daemon, "remedied"), "final_norm.weight") == 0.1);
}

TEST_CASE("a resumed job whose hello carries the new weight decay changes the catalog from its resume step",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-catalog-resume");
  const std::string first = (dir.path() / "first.jsonl").string();
  {
    std::ofstream out(first);
    out << Header("resumed", 0.0).dump() << "\n";
    for (uint64_t s = 1; s <= 600; ++s) out << StepLine(s).dump() << "\n";
  }
  const CommandResult r1 = Replay(daemon, first);
  INFO(r1.out << r1.err);
  REQUIRE(r1.exit_code == 0);
  ExpectTheIncident(daemon, "resumed");

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

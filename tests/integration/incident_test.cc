// The incident of DESIGN.md replayed into the real gradwatchd: the analysis must explain it.
//
// The run comes from deploy/examples/make_incident_run.py reporting every step: total grad norm
// 0.28 at step 58,000 rising 5e-6 per step, 1.0e-5 per step after the routing switch at step
// 81,716, 3% lognormal noise and a one-step ×1.5 spike every few thousand steps; the lm_head
// carries 90–95% of the squared total; final_norm.weight (6144 entries, wd 0) rises 1.0 per 1k
// steps to 340 at the event and 2.5 per 1k after.
#include <catch2/catch.hpp>

#include <cmath>

#include "gradwatch/v1/gradwatch.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;

namespace {

constexpr uint64_t kEventStep = 81716;
constexpr const char* kRun = "moe-incident-demo";

std::string MakeRun(const TempDir& dir, uint64_t from, uint64_t to, const std::string& name) {
  const std::string path = (dir.path() / name).string();
  const CommandResult gen =
      RunCommand({"/usr/bin/python3", SourceDir() + "/deploy/examples/make_incident_run.py", "--out", path,
                  "--from-step", std::to_string(from), "--to-step", std::to_string(to), "--every", "1"},
                 std::nullopt, std::chrono::seconds(120));
  INFO(gen.err);
  REQUIRE(gen.exit_code == 0);
  return path;
}

void Replay(const DaemonProcess& daemon, const std::string& file) {
  const CommandResult r = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "--timeout", "60", "replay", file, "--max", "--json"},
      std::nullopt, std::chrono::seconds(300));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
}

v1::Analysis Analyse(const DaemonProcess& daemon) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(10)));
  v1::GetRunRequest req;
  req.set_run_id(kRun);
  v1::RunSummary summary;
  const grpc::Status s = stub->GetRun(&ctx, req, &summary);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return summary.analysis();
}

const v1::SlopeChangeAtEvent* ChangeAt(const v1::Analysis& a, const std::string& key) {
  for (const auto& c : a.slope_changes()) {
    if (c.key() == key && c.event_step() == kEventStep) return &c;
  }
  return nullptr;
}

}  // namespace

TEST_CASE(
    "the incident is explained: slope change at the event, shares, amplification, growth, no false "
    "change points",
    "[integration]") {
  TempDir dir("gradwatch-incident");
  DaemonProcess daemon;

  // Up to 3,000 steps after the routing switch.
  Replay(daemon, MakeRun(dir, 70000, kEventStep + 3000, "part1.jsonl"));
  {
    const v1::Analysis a = Analyse(daemon);
    const auto* total = ChangeAt(a, "grad/norm/total");
    REQUIRE(total != nullptr);
    CHECK(total->ratio() == Approx(2.0).margin(0.2));
    CHECK(total->before_per_kstep() == Approx(5e-3).epsilon(0.1));
    CHECK(total->after_per_kstep() == Approx(1e-2).epsilon(0.1));
    CHECK(total->event_text() == "switched to near-dropless EP routing");
    const auto* gain = ChangeAt(a, "params/norm/final_norm.weight");
    REQUIRE(gain != nullptr);
    CHECK(gain->ratio() == Approx(2.5).margin(0.25));
  }

  // On to where ||final_norm|| reaches about 362.
  Replay(daemon, MakeRun(dir, 70000, 90500, "part2.jsonl"));
  {
    const v1::Analysis a = Analyse(daemon);
    const v1::NormAmplification* amp = nullptr;
    for (const auto& x : a.amplifications()) {
      if (x.param() == "final_norm.weight") amp = &x;
    }
    REQUIRE(amp != nullptr);
    CHECK(amp->init_norm() == Approx(std::sqrt(6144.0)));
    CHECK(amp->norm() == Approx(362).margin(3));
    CHECK(amp->amplification() == Approx(4.6).margin(0.05));
  }

  // To the end of the run.
  Replay(daemon, MakeRun(dir, 70000, 100000, "part3.jsonl"));
  const v1::Analysis a = Analyse(daemon);

  double lm_head_share = 0;
  for (const auto& s : a.shares()) {
    if (!s.is_group() && s.name() == "lm_head.weight") lm_head_share = s.share();
  }
  CHECK(lm_head_share >= 0.90);
  REQUIRE(a.shares_size() > 0);
  CHECK(a.shares(0).name() == "lm_head.weight");

  const v1::GrowthWithoutDecay* growth = nullptr;
  for (const auto& g : a.growth_without_decay()) {
    if (g.param() == "final_norm.weight") growth = &g;
  }
  REQUIRE(growth != nullptr);
  CHECK(growth->growth_factor() > 1.0);
  CHECK(growth->slope_per_kstep() == Approx(2.5).epsilon(0.1));
  for (const auto& g : a.growth_without_decay()) CHECK(g.param() != "lm_head.weight");  // it has wd 0.1

  // The only change points are at the routing switch, none at the spikes.
  for (const auto& c : a.change_points()) {
    INFO(c.key() << " at step " << c.step());
    CHECK(std::llabs(static_cast<long long>(c.step()) - static_cast<long long>(kEventStep)) <= 3000);
  }

  bool forecast_found = false;
  for (const auto& f : a.forecasts()) {
    if (f.key() != "grad/norm/total") continue;
    forecast_found = true;
    CHECK(f.threshold() == 5.0);
    CHECK(f.reachable());
    CHECK(f.slope_per_kstep() == Approx(1e-2).epsilon(0.15));
    CHECK(f.at_step() == Approx(100000 + f.steps_to_threshold()).margin(1));
  }
  CHECK(forecast_found);

  const std::string metrics = daemon.ScrapeMetrics();
  CHECK(ParseMetric(metrics, "gradwatch_slope_change_ratio",
                    {{"run", kRun}, {"series", "grad/norm/total"}, {"event", "81716"}})
            .has_value());
  CHECK(ParseMetric(metrics, "gradwatch_grad_norm_share", {{"run", kRun}, {"param", "lm_head.weight"}}).value_or(0) >=
        0.9);
  CHECK(ParseMetric(metrics, "gradwatch_norm_amplification", {{"run", kRun}, {"param", "final_norm.weight"}})
            .has_value());
  CHECK(ParseMetric(metrics, "gradwatch_slope_per_kstep",
                    {{"run", kRun}, {"series", "grad/norm/total"}, {"window", "5000"}})
            .has_value());
  CHECK(ParseMetric(metrics, "gradwatch_steps_to_threshold",
                    {{"run", kRun}, {"series", "grad/norm/total"}, {"threshold", "5"}})
            .has_value());
  if (!PromtoolPath().empty()) {
    const CommandResult lint = RunCommand({PromtoolPath(), "check", "metrics"}, metrics);
    INFO(lint.out << lint.err);
    CHECK(lint.exit_code == 0);
  }

  // A healthy run with noise and one-step spikes, its total grad norm far below 5, pages nobody
  // (warnings such as the lm_head share may fire: they are true).
  for (const v1::Alert& alert : ListAlerts(daemon.grpc_target(), kRun)) {
    INFO(alert.name());
    CHECK(alert.labels().at("severity") != "page");
  }

  // Rebuilt from the journal after a restart, the analysis says the same. Restored events are
  // known before their steps, so their windows are exact; live ones are seeded from the tracker's
  // buckets (edges at window / max_buckets granularity): the two agree closely, not bit for bit.
  const v1::SlopeChangeAtEvent before_restart = *ChangeAt(a, "grad/norm/total");
  REQUIRE(daemon.Restart() == 0);
  {
    const v1::Analysis restored = Analyse(daemon);
    const auto* total = ChangeAt(restored, "grad/norm/total");
    REQUIRE(total != nullptr);
    CHECK(total->ratio() == Approx(before_restart.ratio()).epsilon(0.03));
    CHECK(total->ratio() == Approx(2.0).margin(0.2));
    CHECK(std::abs(static_cast<double>(total->after_samples()) - before_restart.after_samples()) <= 1.0);
    CHECK(restored.growth_without_decay_size() == a.growth_without_decay_size());
    CHECK(restored.change_points_size() == a.change_points_size());
  }

  // `gradwatch show` reads like a diagnosis.
  const CommandResult show = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "show", kRun});
  INFO(show.out << show.err);
  REQUIRE(show.exit_code == 0);
  CHECK(show.out.find("diagnosis") != std::string::npos);
  CHECK(show.out.find("reaches 5 in ~") != std::string::npos);
  CHECK(show.out.find("growing without weight decay: final_norm.weight") != std::string::npos);
  CHECK(show.out.find("largest shares of the squared grad norm: lm_head.weight") != std::string::npos);
  CHECK(show.out.find("at step 81,716 (switched to near-dropless EP routing): grad/norm/total slope ×") !=
        std::string::npos);
}

// The contingency rule end to end through the real gradwatchd: the page reaches the trainer's own
// stream at the right step, with the recommendation, and resolves when the norm falls back.
#include <catch2/catch.hpp>

#include <fstream>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;

namespace {

v1::Hello IncidentHello(const std::string& run) {
  v1::Hello h = MakeHello(run, 0, 1,
                          {{"final_norm.weight", v1::PARAM_KIND_NORM_GAIN}, {"lm_head.weight", v1::PARAM_KIND_OUTPUT}});
  h.mutable_params(0)->set_numel(6144);
  h.mutable_params(0)->set_role("final_norm");
  h.mutable_params(1)->set_weight_decay(0.1);
  h.mutable_config()->set_weight_decay(0.1);
  return h;
}

v1::StepStats Step(uint64_t step, double total) {
  v1::StepStats s;
  s.set_step(step);
  s.mutable_total_grad()->set_norm(total);
  auto* lm = s.add_params();
  lm->set_index(1);
  lm->mutable_grad()->set_norm(total * 0.95);
  auto* fn = s.add_params();
  fn->set_index(0);
  fn->mutable_param()->set_norm(362.0);
  return s;
}

bool IsContingency(const v1::DaemonMessage& m, v1::AlertState state) {
  return m.has_alert() && m.alert().name() == "GradNormContingency" && m.alert().state() == state;
}

std::vector<v1::Alert> ListAlerts(const DaemonProcess& daemon, const std::string& run) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListAlertsRequest req;
  req.set_run_id(run);
  v1::ListAlertsResponse resp;
  REQUIRE(stub->ListAlerts(&ctx, req, &resp).ok());
  return {resp.alerts().begin(), resp.alerts().end()};
}

// Streams steps `first`, `first + every`, ... ≤ last with total grad norm 5.5 on [high_from,
// high_to] and 1.0 elsewhere; returns the steps at which the page fired and resolved.
std::pair<uint64_t, uint64_t> Run(const DaemonProcess& daemon, const std::string& run, uint64_t every) {
  StreamClient stream(daemon.grpc_target());
  REQUIRE(stream.Hello(IncidentHello(run), 1));
  stream.WaitAccepted();
  uint64_t seq = 2;
  for (uint64_t s = every; s <= 200; s += every) {
    const double total = (s >= 50 && s <= 120) ? 5.5 : 1.0;
    REQUIRE(stream.Step(Step(s, total), seq++));
    if (s == 100) {
      stream.WaitAck(100);  // step 100 is processed (and evaluated) before it is acked
      bool firing = false;
      for (const auto& a : ListAlerts(daemon, run)) {
        firing = firing || (a.name() == "GradNormContingency" && a.state() == v1::ALERT_STATE_FIRING);
      }
      CHECK(firing);
    }
  }
  const v1::Alert fired =
      stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); }).alert();
  const v1::Alert resolved =
      stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_RESOLVED); }).alert();
  CHECK(fired.labels().at("severity") == "page");
  CHECK(fired.labels().at("run") == run);
  CHECK(fired.value() == Approx(5.5));
  CHECK(fired.annotations().at("summary").find("step") != std::string::npos);
  const std::string& rec = fired.annotations().at("recommendation");
  INFO(rec);
  CHECK(rec.find("enable weight decay on final_norm.weight") != std::string::npos);
  CHECK(rec.find("0.1") != std::string::npos);
  CHECK(rec.find("4.618× its init norm") != std::string::npos);  // 362 / sqrt(6144)
  CHECK(resolved.fingerprint() == fired.fingerprint());
  CHECK(resolved.ends_at() >= fired.starts_at());
  stream.Close();
  return {fired.step(), resolved.step()};
}

}  // namespace

TEST_CASE("the grad-norm contingency pages the trainer's stream at s0 + 10 and resolves", "[integration]") {
  DaemonProcess daemon;
  SECTION("reports every step: fires at step 60, resolves when the norm falls back") {
    const auto [fired, resolved] = Run(daemon, "every-step", 1);
    CHECK(fired == 60);
    CHECK(resolved == 121);
  }
  SECTION("reports every 10 steps: fires at the first report at or after s0 + 10") {
    const auto [fired, resolved] = Run(daemon, "every-10", 10);
    CHECK(fired == 60);
    CHECK(resolved == 130);
  }
}

TEST_CASE("gradwatch alerts lists a firing page with its recommendation; rules check validates files",
          "[integration]") {
  DaemonProcess daemon;
  StreamClient stream(daemon.grpc_target());
  REQUIRE(stream.Hello(IncidentHello("cli-run"), 1));
  stream.WaitAccepted();
  for (uint64_t s = 1; s <= 20; ++s) REQUIRE(stream.Step(Step(s, 6.0), s + 1));
  stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); });
  const CommandResult alerts =
      RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "alerts", "cli-run"});
  INFO(alerts.out << alerts.err);
  CHECK(alerts.exit_code == 0);
  CHECK(alerts.out.find("firing") != std::string::npos);
  CHECK(alerts.out.find("GradNormContingency") != std::string::npos);
  CHECK(alerts.out.find("enable weight decay on final_norm.weight") != std::string::npos);

  const CommandResult good =
      RunCommand({CliBinaryPath(), "rules", "check", SourceDir() + "/alerts/rules/default.yaml"});
  CHECK(good.exit_code == 0);
  TempDir dir("gradwatch-rules");
  const std::string bad = (dir.path() / "bad.yaml").string();
  {
    std::ofstream out(bad);
    out << "groups:\n  - name: g\n    rules:\n      - alert: X\n        kind: threshold\n        series: grad/norm/total\n"
           "        op: \">>\"\n        value: 5\n        labels: {severity: page}\n";
  }
  const CommandResult rejected = RunCommand({CliBinaryPath(), "rules", "check", bad});
  INFO(rejected.err);
  CHECK(rejected.exit_code == 1);
  CHECK(rejected.err.find("bad.yaml:7") != std::string::npos);
  stream.Close();
}

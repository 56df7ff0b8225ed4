// A job that crashed at step 30,000 and resumed from its step-20,000 checkpoint, against the real
// gradwatchd and `gradwatch replay`: the new branch replaces the old one, across a restart.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;

namespace {

constexpr uint64_t kCrashStep = 30000;
constexpr uint64_t kResumeStep = 20000;
constexpr uint64_t kNewEnd = 40000;
constexpr uint64_t kEvery = 10;

// The abandoned branch rises slowly, then (after its routing switch at 25,000) steeply through 5,
// which pages; the new one, from the checkpoint, rises faster than the old one did before 25,000
// and stays far below 5, so that every value tells which branch it came from.
double OldTotal(uint64_t s) {
  return s < 25000 ? 0.3 + 1e-5 * static_cast<double>(s) : 0.55 + 1e-3 * static_cast<double>(s - 25000);
}
double NewTotal(uint64_t s) { return 1.0 + 2e-5 * static_cast<double>(s - kResumeStep); }

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target(), "--timeout", "60"};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(240));
}

void WriteHistory(const std::string& path, const std::string& header, uint64_t from, uint64_t to,
                  double (*total)(uint64_t), const std::vector<std::pair<uint64_t, std::string>>& events) {
  std::ofstream out(path);
  out << header << "\n";
  for (uint64_t s = from; s <= to; s += kEvery) {
    out << R"({"_step": )" << s << R"(, "grad/norm/total": )" << json(total(s)).dump() << R"(, "train/loss": 2.0})"
        << "\n";
    for (const auto& [step, text] : events) {
      if (step == s) out << R"({"_step": )" << step << R"(, "event": )" << json(text).dump() << "}\n";
    }
  }
}

std::vector<v1::SeriesPoint> Series(const DaemonProcess& daemon, const std::string& key) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(30)));
  v1::GetSeriesRequest req;
  req.set_run_id("resumed-job");
  req.set_key(key);
  v1::GetSeriesResponse resp;
  const grpc::Status s = stub->GetSeries(&ctx, req, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return {resp.points().begin(), resp.points().end()};
}

std::vector<v1::Alert> ActiveAlerts(const DaemonProcess& daemon, const std::string& name) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(30)));
  v1::ListAlertsRequest req;
  req.set_run_id("resumed-job");
  v1::ListAlertsResponse resp;
  const grpc::Status s = stub->ListAlerts(&ctx, req, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  std::vector<v1::Alert> out;
  for (const auto& a : resp.alerts()) {
    if (a.name() == name) out.push_back(a);
  }
  return out;
}

v1::RunSummary Run(const DaemonProcess& daemon) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(30)));
  v1::GetRunRequest req;
  req.set_run_id("resumed-job");
  v1::RunSummary summary;
  const grpc::Status s = stub->GetRun(&ctx, req, &summary);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return summary;
}

// What the daemon must hold after the resume: the old branch below 20,000, the new one from there.
void CheckHoldsTheNewBranch(const DaemonProcess& daemon) {
  const auto points = Series(daemon, "grad/norm/total");
  REQUIRE(points.size() == (kNewEnd / kEvery) + 1);
  size_t mismatched = 0;
  for (const auto& p : points) {
    CHECK(p.count() == 1);
    const double want = p.step() < kResumeStep ? OldTotal(p.step()) : NewTotal(p.step());
    if (std::abs(p.value() - want) > 1e-9 * want) ++mismatched;
  }
  CHECK(mismatched == 0);
  CHECK(points.front().step() == 0);
  CHECK(points.back().step() == kNewEnd);

  const v1::RunSummary run = Run(daemon);
  CHECK(run.info().step_count() == (kNewEnd / kEvery) + 1);
  CHECK(run.info().last_step() == kNewEnd);
  std::vector<std::pair<uint64_t, std::string>> events;
  for (const auto& e : run.events()) events.emplace_back(e.step(), e.text());
  CHECK(events ==
        std::vector<std::pair<uint64_t, std::string>>{{10000, "lr warmup done"},
                                                      {kResumeStep, "resumed from the checkpoint at step 20000"},
                                                      {32000, "switched routing"}});
}

}  // namespace

TEST_CASE("a run resumed from a checkpoint replaces the abandoned branch everywhere, across a restart",
          "[integration][rewind]") {
  TempDir dir("gradwatch-rewind");
  DaemonOptions options;
  options.data_dir = dir.path() / "data";
  std::filesystem::create_directories(options.data_dir);
  DaemonProcess daemon(options);

  const std::string old_file = (dir.path() / "before-crash.jsonl").string();
  const std::string new_file = (dir.path() / "after-resume.jsonl").string();
  // The abandoned branch's event at 25,000 must go; the new branch's own at 32,000 stays.
  WriteHistory(old_file, R"({"run": "resumed-job"})", 0, kCrashStep, OldTotal,
               {{10000, "lr warmup done"}, {25000, "switched routing"}});
  WriteHistory(new_file, R"({"run": "resumed-job", "resume_from_step": 20000})", kResumeStep, kNewEnd, NewTotal,
               {{32000, "switched routing"}});

  const CommandResult first = Cli(daemon, {"replay", old_file, "--json"});
  INFO(first.out << first.err);
  REQUIRE(first.exit_code == 0);
  CHECK(json::parse(first.out)["last_acked_step"] == kCrashStep);
  const auto paged = ActiveAlerts(daemon, "GradNormContingency");
  REQUIRE(paged.size() == 1);
  CHECK(paged[0].state() == v1::ALERT_STATE_FIRING);
  CHECK(paged[0].step() > kResumeStep);

  const CommandResult resumed = Cli(daemon, {"replay", new_file, "--json"});
  INFO(resumed.out << resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json summary = json::parse(resumed.out);
  CHECK(summary["resumed_from_step"] == kResumeStep);
  CHECK(summary["steps_sent"] == (kNewEnd - kResumeStep) / kEvery + 1);
  CHECK(summary["already_held_steps"] == 0);
  CHECK(summary["daemon_errors"].empty());
  CHECK(summary["last_acked_step"] == kNewEnd);
  CHECK(summary["complete"] == true);

  CheckHoldsTheNewBranch(daemon);
  // The page came from the abandoned branch: the rewind resolved it and the new branch is clear.
  CHECK(ActiveAlerts(daemon, "GradNormContingency").empty());

  {
    // Without a resume, re-reporting steps with other values is still refused.
    StreamClient stream(daemon.grpc_target());
    v1::Hello hello;
    hello.set_run_id("resumed-job");
    hello.set_world_size(1);
    REQUIRE(stream.Hello(hello, 1));
    const v1::Accepted accepted = stream.WaitAccepted();
    CHECK(accepted.last_received_step() == kNewEnd);
    v1::StepStats changed;
    changed.set_step(kNewEnd);
    changed.mutable_total_grad()->set_norm(9.0);
    REQUIRE(stream.Step(changed, 2));
    CHECK(stream.WaitError(2).reason() == v1::ERROR_REASON_STEP_CONFLICT);
    changed.set_step(25000);
    REQUIRE(stream.Step(changed, 3));
    CHECK(stream.WaitError(3).reason() == v1::ERROR_REASON_STEP_REGRESSION);
    CHECK(stream.Close().ok());
  }
  CheckHoldsTheNewBranch(daemon);

  daemon.Restart();
  CheckHoldsTheNewBranch(daemon);
  CHECK(ActiveAlerts(daemon, "GradNormContingency").empty());
  {
    // A reconnecting trainer is told to go on after the new branch's last step.
    StreamClient stream(daemon.grpc_target());
    v1::Hello hello;
    hello.set_run_id("resumed-job");
    hello.set_world_size(1);
    REQUIRE(stream.Hello(hello, 1));
    const v1::Accepted accepted = stream.WaitAccepted();
    CHECK(accepted.has_durable_step());
    CHECK(accepted.last_durable_step() == kNewEnd);
    CHECK(accepted.last_received_step() == kNewEnd);
    CHECK(stream.Close().ok());
  }
}

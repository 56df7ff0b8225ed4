// A run's life through the real gradwatchd: a clean end said on the wire (Goodbye, from
// `gradwatch replay --finish`), a job that dies without one (the RunDied page), and a hung job that
// is still connected (the RunStalled warning).
#include <catch2/catch.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;

namespace {

using SteadyClock = std::chrono::steady_clock;

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
}

// Polls `done` every 100 ms until it holds or `limit` passes; returns its last answer.
bool WaitUntil(const std::function<bool()>& done, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = SteadyClock::now() + limit;
  while (!done()) {
    if (SteadyClock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
}

std::optional<v1::Alert> FindAlert(const DaemonProcess& daemon, const std::string& run, const std::string& name) {
  for (const v1::Alert& a : ListAlerts(daemon.grpc_target(), run)) {
    if (a.name() == name && a.state() == v1::ALERT_STATE_FIRING) return a;
  }
  return std::nullopt;
}

v1::Hello SmallHello(const std::string& run) {
  return MakeHello(run, 0, 1, {{"final_norm.weight", v1::PARAM_KIND_NORM_GAIN}});
}

v1::StepStats SmallStep(uint64_t step) {
  v1::StepStats s;
  s.set_step(step);
  s.mutable_total_grad()->set_norm(0.3);
  return s;
}

// Opens a stream for `run`, sends steps 1..steps, waits for their ack and returns the stream.
std::unique_ptr<StreamClient> Report(const DaemonProcess& daemon, const std::string& run, uint64_t steps) {
  auto stream = std::make_unique<StreamClient>(daemon.grpc_target());
  REQUIRE(stream->Hello(SmallHello(run), 1));
  stream->WaitAccepted();
  for (uint64_t s = 1; s <= steps; ++s) REQUIRE(stream->Step(SmallStep(s), 1 + s));
  if (steps > 0) stream->WaitAck(steps);
  return stream;
}

v1::RunInfo RunState(const DaemonProcess& daemon, const std::string& run) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetRunRequest req;
  req.set_run_id(run);
  v1::RunSummary summary;
  const grpc::Status s = stub->GetRun(&ctx, req, &summary);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return summary.info();
}

}  // namespace

TEST_CASE("replay --finish ends the run cleanly, and a run gone without a Goodbye pages RunDied", "[integration]") {
  DaemonOptions options;
  options.config_yaml = "runs: {end_after_seconds: 1, stalled_after_seconds: 2}\n";
  DaemonProcess daemon(options);
  TempDir dir("gradwatch-life");
  const std::string file = (dir.path() / "done.jsonl").string();
  {
    std::ofstream out(file);
    out << R"({"run": "done", "params": [{"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain"}]})"
        << "\n";
    for (int step = 1; step <= 20; ++step) out << R"({"_step": )" << step << R"(, "grad/norm/total": 0.3})" << "\n";
  }
  const CommandResult replay = Cli(daemon, {"replay", file, "--finish", "--json"});
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);
  const json summary = json::parse(replay.out);
  CHECK(summary["last_acked_step"] == 20);
  CHECK(summary["finished"] == true);
  const v1::RunInfo done = RunState(daemon, "done");
  CHECK(done.state() == v1::RUN_STATE_FINISHED);
  CHECK(done.end_reason() == v1::GOODBYE_REASON_FINISHED);
  CHECK(done.end_message() == "replayed " + file);
  CHECK(done.ended_at() > 0);
  const CommandResult runs = Cli(daemon, {"runs"});
  CHECK(runs.out.find("finished") != std::string::npos);

  // The same life without a Goodbye: the stream closes, nothing comes for 2 s: it pages.
  Report(daemon, "crashed", 20)->Close();
  REQUIRE(WaitUntil([&] { return FindAlert(daemon, "crashed", "RunDied").has_value(); }));
  const v1::Alert page = *FindAlert(daemon, "crashed", "RunDied");
  CHECK(page.labels().at("severity") == "page");
  CHECK(page.annotations().at("summary").find("gone without a Goodbye") != std::string::npos);
  // By now the finished run has been silent far longer, and never paged.
  CHECK_FALSE(FindAlert(daemon, "done", "RunDied"));

  // The run ends by inactivity; the page stays, through a restart too.
  REQUIRE(WaitUntil([&] { return RunState(daemon, "crashed").state() == v1::RUN_STATE_ENDED; }));
  CHECK(FindAlert(daemon, "crashed", "RunDied"));
  daemon.Restart();
  CHECK(FindAlert(daemon, "crashed", "RunDied"));
  CHECK(RunState(daemon, "done").state() == v1::RUN_STATE_FINISHED);

  // The job comes back: the page resolves.
  auto back = Report(daemon, "crashed", 0);
  REQUIRE(WaitUntil([&] { return !FindAlert(daemon, "crashed", "RunDied"); }));
  CHECK(RunState(daemon, "crashed").state() == v1::RUN_STATE_ACTIVE);
  back->Close();
}

TEST_CASE("a hung run that is still connected warns RunStalled and does not page RunDied", "[integration]") {
  TempDir rules_dir("gradwatch-life-rules");
  const std::string rules = (rules_dir.path() / "fast.yaml").string();
  std::ofstream(rules) << "groups:\n  - name: fast\n    rules:\n"
                          "      - alert: FastStalled\n        kind: stalled\n        seconds: 1\n"
                          "        labels: {severity: warning}\n        annotations: {summary: \"stalled\"}\n";
  DaemonOptions options;
  options.config_yaml = "runs: {stalled_after_seconds: 1}\nalerts: {rule_files: [" + rules + "]}\n";
  DaemonProcess daemon(options);
  auto hung = Report(daemon, "hung", 5);
  REQUIRE(WaitUntil([&] { return FindAlert(daemon, "hung", "FastStalled").has_value(); }));
  CHECK(hung->WaitFor([](const v1::DaemonMessage& m) {
               return m.has_alert() && m.alert().name() == "FastStalled" &&
                      m.alert().state() == v1::ALERT_STATE_FIRING;
             })
            .alert()
            .labels()
            .at("severity") == "warning");
  CHECK_FALSE(FindAlert(daemon, "hung", "RunDied"));
  // A step resolves the warning.
  REQUIRE(hung->Step(SmallStep(6), 10));
  REQUIRE(WaitUntil([&] { return !FindAlert(daemon, "hung", "FastStalled"); }));
  hung->Close();
}

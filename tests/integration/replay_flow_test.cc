// `gradwatch replay` against a slow, stopped, vanished daemon, and stopped by a signal: flow control
// instead of a deadline, and no step lost when the replay does stop (a second replay sends exactly
// the rest). Real gradwatchd and gradwatch binaries; 1,000 parameters per step.
#include <catch2/catch.hpp>

#include <csignal>
#include <fstream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "gradwatch/query_client.h"
#include "tests/integration/daemon_process.h"

using namespace gradwatch::testing;
using namespace std::chrono_literals;
using nlohmann::json;
namespace v1 = gradwatch::v1;

namespace {

constexpr int kParams = 1000;
constexpr uint64_t kSteps = 200;
constexpr const char* kRun = "wide-run";

// A W&B-style history of steps 1..kSteps of a model with kParams parameter tensors, each with its
// grad, param and update norm: 3,000 samples a step, about 100 KB a line.
void WriteWideHistory(const std::filesystem::path& file) {
  std::ofstream out(file);
  out << R"({"run": ")" << kRun << R"(", "config": {"weight_decay": 0.1}, "params": [)";
  for (int p = 0; p < kParams; ++p) {
    out << (p ? ", " : "") << R"({"name": "layers.)" << p / 8 << ".experts." << p % 8 << R"(.weight", "numel": 4096})";
  }
  out << "]}\n";
  for (uint64_t s = 1; s <= kSteps; ++s) {
    out << R"({"_step": )" << s << R"(, "_timestamp": )" << 1.7e9 + static_cast<double>(s) << R"(, "train/loss": )"
        << 2.0 - 1e-4 * static_cast<double>(s);
    for (int p = 0; p < kParams; ++p) {
      const std::string name = "layers." + std::to_string(p / 8) + ".experts." + std::to_string(p % 8) + ".weight";
      const double x = static_cast<double>((s * 31 + static_cast<uint64_t>(p) * 17) % 1000) / 1000.0;
      out << R"(, "grad/norm/)" << name << R"(": )" << 0.01 + 0.01 * x << R"(, "params/norm/)" << name << R"(": )"
          << 50.0 + x << R"(, "updates/norm/)" << name << R"(": )" << 1e-3 * x;
    }
    out << "}\n";
  }
}

std::vector<std::string> ReplayArgv(const DaemonProcess& daemon, const std::filesystem::path& file,
                                    double stall_timeout_s) {
  // --timeout 2: the old replay gave up 2 s (or a millisecond a step still outstanding) after it
  // had read the file; nothing in the new one depends on it but the wait for the stream.
  return {CliBinaryPath(),
          "--addr",
          daemon.grpc_target(),
          "--timeout",
          "2",
          "--json",
          "replay",
          file.string(),
          "--max",
          "--stall-timeout",
          std::to_string(stall_timeout_s * TimeScale())};
}

// The run as the daemon holds it; nullopt while it does not (or cannot answer).
std::optional<v1::RunInfo> RunInfo(const DaemonProcess& daemon) {
  gradwatch::client::QueryClient query(daemon.grpc_target(), Scaled(std::chrono::milliseconds(5000)));
  const auto r = query.GetRun(kRun);
  if (!r.ok()) return std::nullopt;
  return r.response.info();
}

// Waits until the daemon has completed a few of the run's steps: the replay is under way.
void WaitReplayUnderWay(const DaemonProcess& daemon) {
  REQUIRE(WaitUntil(
      [&] {
        const auto info = RunInfo(daemon);
        return info && info->step_count() >= 20;
      },
      60s));
}

json SummaryOf(const CommandResult& r) {
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.out.empty());
  return json::parse(r.out);
}

// The run holds every step 1..kSteps once, no gap.
void CheckWholeRun(const DaemonProcess& daemon) {
  const auto info = RunInfo(daemon);
  REQUIRE(info);
  CHECK(info->step_count() == kSteps);
  CHECK(info->first_step() == 1);
  CHECK(info->last_step() == kSteps);
}

// A second replay of the same file sends exactly what the daemon lacks and completes the run.
void ReplayTheRest(const DaemonProcess& daemon, const std::filesystem::path& file) {
  const CommandResult again = RunCommand(ReplayArgv(daemon, file, 60), std::nullopt, 300s);
  INFO(again.out << again.err);
  REQUIRE(again.exit_code == 0);
  const json summary = SummaryOf(again);
  CHECK(summary["complete"] == true);
  CHECK(summary["last_acked_step"] == kSteps);
  CHECK(summary["steps_sent"].get<uint64_t>() + summary["already_held_steps"].get<uint64_t>() == kSteps);
  CHECK(summary["daemon_errors"].empty());
  CheckWholeRun(daemon);
}

}  // namespace

TEST_CASE("a replay waits out a daemon stopped longer than the old deadline and every step is journaled",
          "[integration][replay]") {
  TempDir data("gradwatch-replay-sigstop");
  DaemonOptions options;
  options.data_dir = data.path() / "daemon";
  DaemonProcess daemon(options);
  const auto file = data.path() / "wide.jsonl";
  WriteWideHistory(file);

  BackgroundCommand replay(ReplayArgv(daemon, file, 60));
  WaitReplayUnderWay(daemon);
  daemon.Signal(SIGSTOP);
  // Without the daemon's acks the replay cannot have finished: the pause below is mid-replay.
  REQUIRE(replay.running());
  // The stimulus, not a wait for readiness: the daemon stays stopped longer than the old
  // replay's deadline (2 s after reading the file) allowed.
  constexpr auto kPause = 5s;
  std::this_thread::sleep_for(kPause);
  daemon.Signal(SIGCONT);

  const CommandResult r = replay.Wait(300s);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 0);
  const json summary = SummaryOf(r);
  CHECK(summary["complete"] == true);
  CHECK(summary["stopped"].is_null());
  CHECK(summary["steps_sent"] == kSteps);
  CHECK(summary["last_acked_step"] == kSteps);
  CHECK(summary["unacked_steps"] == 0);
  CHECK(summary["seconds"].get<double>() >= std::chrono::duration<double>(kPause).count());

  // Acked means journaled: a restarted daemon, which knows only its journal, holds them all.
  REQUIRE(daemon.Restart() == 0);
  CheckWholeRun(daemon);
}

TEST_CASE("a replay stopped by SIGINT or SIGTERM says which steps are kept and a second one completes the run",
          "[integration][replay]") {
  const int sig = GENERATE(SIGINT, SIGTERM);
  const std::string sig_name = sig == SIGINT ? "SIGINT" : "SIGTERM";
  CAPTURE(sig_name);
  DaemonProcess daemon;
  TempDir dir("gradwatch-replay-interrupt");
  const auto file = dir.path() / "wide.jsonl";
  WriteWideHistory(file);

  BackgroundCommand replay(ReplayArgv(daemon, file, 60));
  WaitReplayUnderWay(daemon);
  replay.Signal(sig);
  const CommandResult r = replay.Wait(120s);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  // It exits with its own code, after its report, rather than dying of the signal.
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("interrupted by " + sig_name));
  CHECK_THAT(r.err, Catch::Contains("Run the same command again"));
  const json summary = SummaryOf(r);
  CHECK(summary["complete"] == false);
  CHECK(summary["stopped"] == "interrupted");
  uint64_t kept = 0;
  if (!summary["last_acked_step"].is_null()) kept = summary["last_acked_step"].get<uint64_t>();
  CHECK(kept < kSteps);
  CHECK(summary["unacked_steps"] == kSteps - kept);
  CHECK(summary["first_unacked_step"] == kept + 1);
  CHECK(summary["last_unacked_step"] == kSteps);
  // What the replay reported as kept, the daemon holds.
  const auto info = RunInfo(daemon);
  REQUIRE(info);
  CHECK(info->step_count() >= kept);

  ReplayTheRest(daemon, file);
}

TEST_CASE("a replay whose daemon is gone gives up after --stall-timeout and one run again completes the run",
          "[integration][replay]") {
  TempDir data("gradwatch-replay-gone");
  DaemonOptions options;
  options.data_dir = data.path() / "daemon";
  options.listen = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
  DaemonProcess daemon(options);
  const auto file = data.path() / "wide.jsonl";
  WriteWideHistory(file);

  BackgroundCommand replay(ReplayArgv(daemon, file, 3));
  WaitReplayUnderWay(daemon);
  daemon.Signal(SIGKILL);
  daemon.Stop();
  const CommandResult r = replay.Wait(120s);
  INFO(r.out << r.err);
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.err, Catch::Contains("acknowledged nothing for"));
  const json summary = SummaryOf(r);
  CHECK(summary["stopped"] == "stalled");
  uint64_t kept = 0;
  if (!summary["last_acked_step"].is_null()) kept = summary["last_acked_step"].get<uint64_t>();
  CHECK(summary["unacked_steps"] == kSteps - kept);

  // Acked means kept, through a SIGKILL: the restarted daemon holds at least what was acked.
  daemon.Restart();
  const auto info = RunInfo(daemon);
  REQUIRE(info);
  CHECK(info->step_count() >= kept);
  ReplayTheRest(daemon, file);
}

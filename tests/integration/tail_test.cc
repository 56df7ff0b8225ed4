// `gradwatch tail` against the real gradwatchd: a log file followed as `tail -F` follows it, every
// trainer format read from a pipe, a job that resumes from a checkpoint, and the sidecar recipe.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"

using namespace gradwatch::testing;
using nlohmann::json;

namespace {

const std::filesystem::path kFixtures = std::filesystem::path(GRADWATCH_SOURCE_DIR) / "tests" / "fixtures" / "tail";

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

uint64_t AsStep(const json& v) { return v.is_string() ? std::stoull(v.get<std::string>()) : v.get<uint64_t>(); }

double AsValue(const json& v) {
  if (v.is_number()) return v.get<double>();
  const std::string s = v.get<std::string>();
  if (s == "NaN") return NAN;
  return s == "-Infinity" ? -INFINITY : INFINITY;
}

// step → value of a series; empty when the run or the series does not exist (yet).
std::map<uint64_t, double> Series(const DaemonProcess& daemon, const std::string& run, const std::string& key) {
  const CommandResult r = Cli(daemon, {"series", run, key, "--json"});
  std::map<uint64_t, double> out;
  if (r.exit_code != 0) return out;
  for (const json& p : json::parse(r.out)) out[AsStep(p["step"])] = AsValue(p["value"]);
  return out;
}

void Append(const std::filesystem::path& file, const std::string& text) {
  std::ofstream out(file, std::ios::app);
  out << text;
}

std::string MegatronLine(uint64_t step, const std::string& loss, const std::string& grad_norm, int nan_iterations) {
  // The format of Megatron-LM's training_log() (see tests/fixtures/tail/SOURCES.md), values of this test's own.
  char line[512];
  std::snprintf(line, sizeof line,
                " iteration %8llu/  250000 | consumed samples:       124928 | elapsed time per iteration (ms): "
                "86545.2 | learning rate: 9.150E-06 | global batch size:  1024 |%s loss scale: 1.0 | grad norm: %s "
                "| params norm: 312.500 | number of skipped iterations: %3d | number of nan iterations: %3d |\n",
                static_cast<unsigned long long>(step), loss.empty() ? "" : (" lm loss: " + loss + " |").c_str(),
                grad_norm.c_str(), nan_iterations, nan_iterations);
  return line;
}

}  // namespace

TEST_CASE("tail follows a log file that appears late, is rotated and truncated, and a job that resumes",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-tail");
  const std::filesystem::path log = dir.path() / "pretrain.log";
  BackgroundCommand tail({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "-v", "tail", log.string()});
  REQUIRE(WaitUntil([&] { return tail.Stderr().find("waiting for") != std::string::npos; }));

  // The first lines: real Megatron-LM output (steps 122..125), with a banner before them.
  std::string real;
  {
    std::istringstream lines(ReadFile(kFixtures / "megatron_lm.log"));
    std::string line;
    for (int i = 0; i < 4 && std::getline(lines, line); ++i) real += line + "\n";
  }
  Append(log, "using world size: 8, data-parallel size: 8\n" + real);
  REQUIRE(
      WaitUntil([&] { return Series(daemon, "pretrain", "grad/norm/total").size() == 4; }, std::chrono::seconds(60)));
  auto loss = Series(daemon, "pretrain", "train/loss");
  CHECK(loss.at(122) == Approx(2.504220));
  CHECK(Series(daemon, "pretrain", "optim/learning_rate").at(125) == Approx(9.375e-6));
  CHECK(Series(daemon, "pretrain", "grad/norm/total").at(125) == Approx(0.356));
  CHECK(Series(daemon, "pretrain", "train/skipped_iterations").at(123) == 0);

  // Rotated: the file is moved away and a new one of the same name is written, with colours and a
  // rank prefix as torchrun --tee adds them.
  std::filesystem::rename(log, dir.path() / "pretrain.log.1");
  Append(log, "[default0]: \x1b[32m" + MegatronLine(126, "2.470000E+00", "0.360", 0).substr(1));
  Append(log, "[rank0]:" + MegatronLine(127, "2.460000E+00", "0.370", 0));
  REQUIRE(
      WaitUntil([&] { return Series(daemon, "pretrain", "grad/norm/total").size() == 6; }, std::chrono::seconds(60)));
  CHECK(Series(daemon, "pretrain", "params/norm/total").at(127) == Approx(312.5));

  // Truncated in place (copytruncate): read again from its start. Two iterations went NaN: Megatron
  // prints no loss and a NaN grad norm, and the count reaches the non-finite rule.
  { std::ofstream truncate(log, std::ios::trunc); }
  Append(log, MegatronLine(128, "", "nan", 2));
  REQUIRE(WaitUntil([&] { return Series(daemon, "pretrain", "train/nan_iterations").count(128) == 1; },
                    std::chrono::seconds(60)));
  CHECK(Series(daemon, "pretrain", "train/nan_iterations").at(128) == 2);
  CHECK(std::isnan(Series(daemon, "pretrain", "grad/norm/total").at(128)));
  CHECK(Series(daemon, "pretrain", "train/loss").count(128) == 0);
  REQUIRE(WaitUntil(
      [&] {
        const std::string alerts = Cli(daemon, {"alerts", "pretrain", "--json"}).out;
        return alerts.find("train/nan_iterations") != std::string::npos;
      },
      std::chrono::seconds(60)));

  // The job crashed and resumed from its checkpoint at step 126: the daemon replaces 126 on.
  Append(log, MegatronLine(126, "2.400000E+00", "0.300", 0) + MegatronLine(127, "2.390000E+00", "0.290", 0));
  REQUIRE(WaitUntil(
      [&] {
        const auto grad = Series(daemon, "pretrain", "grad/norm/total");
        return grad.size() == 6 && grad.count(128) == 0 && grad.count(127) != 0 && std::abs(grad.at(127) - 0.29) < 1e-9;
      },
      std::chrono::seconds(60)));

  tail.Signal(SIGTERM);
  const CommandResult r = tail.Wait(std::chrono::seconds(60));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(r.out);
  CHECK(summary["format"] == "megatron");
  CHECK(summary["run"] == "pretrain");
  CHECK(summary["unparsed_lines"] == 1);
  CHECK(summary["first_unparsed"][0]["line"] == 1);
  CHECK(summary["rotations"] == 1);
  CHECK(summary["truncations"] == 1);
  CHECK(summary["resumes"] == 1);
  CHECK(summary["steps_sent"] == 9);
  CHECK(summary["complete"] == true);
  CHECK(summary["ended"] == "SIGTERM");
  CHECK(r.err.find("pretrain.log:1: not parsed: using world size") != std::string::npos);
  // The daemon's alert on the stream is shown where the job's output is watched.
  CHECK(r.err.find("alert NonFiniteValue FIRING at step 128") != std::string::npos);
}

TEST_CASE("tail reads every trainer's format from a pipe into the series of the JSONL keys", "[integration]") {
  DaemonProcess daemon;
  struct Case {
    std::string fixture, format;
    std::string key;  // a series its lines fill
  };
  const std::vector<Case> cases = {
      {"megatron_lm.log", "megatron", "grad/norm/total"},
      {"megatron_deepspeed.log", "megatron", "train/loss"},
      {"deepspeed.log", "deepspeed", "optim/learning_rate"},
      {"hf_trainer.log", "hf", "grad/norm/total"},
      {"torchtitan.log", "torchtitan", "train/loss"},
      {"nanogpt.log", "nanogpt", "train/loss"},
      {"llmc.log", "llmc", "grad/norm/total"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.fixture);
    const std::string run = "piped-" + c.format + "-" + std::filesystem::path(c.fixture).stem().string();
    const CommandResult r =
        RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-", "--run", run, "--finish"},
                   ReadFile(kFixtures / c.fixture), std::chrono::seconds(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const json summary = json::parse(r.out);
    CHECK(summary["format"] == c.format);
    CHECK(summary["complete"] == true);
    CHECK(summary["finished"] == true);
    CHECK(summary["daemon_errors"].empty());
    CHECK(summary["ended"] == "end of input");
    CHECK(summary["metric_lines"].get<uint64_t>() > 0);
    CHECK(summary["steps_sent"].get<uint64_t>() > 0);
    CHECK_FALSE(Series(daemon, run, c.key).empty());
  }

  // Output with no metric line of any format: said so, nothing sent, no run made.
  const CommandResult none = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "tail", "-", "--run", "no-metrics"},
      std::string("Loading checkpoint shards: 100%\nTraceback (most recent call last):\n"), std::chrono::seconds(60));
  CHECK(none.exit_code == 1);
  CHECK(none.err.find("no line of - was a metric line") != std::string::npos);
  CHECK(Cli(daemon, {"show", "no-metrics"}).exit_code == 1);

  // The Hugging Face Trainer prints no step: a progress bar on the same output gives it.
  const std::string hf =
      "{'loss': 2.0, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.1}\n"
      " 10%|█         | 20/200 [00:10<01:30,  2.00it/s]\n"
      "{'loss': 1.8, 'grad_norm': 1.25, 'learning_rate': 4e-05, 'epoch': 0.2}\n";
  const CommandResult r = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-", "--run",
                                      "hf-steps", "--step-interval", "10"},
                                     hf, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const auto grad = Series(daemon, "hf-steps", "grad/norm/total");
  REQUIRE(grad.size() == 2);
  CHECK(grad.at(10) == 1.5);   // the first dict: 1 × --step-interval
  CHECK(grad.at(20) == 1.25);  // the bar said 20
}

TEST_CASE("tail gives each step the time its line carries: a Megatron log read at once has the job's pace",
          "[integration]") {
  // Found by a new user: a followed log's steps had no time; /metrics said 61,145 steps/s for a
  // job doing one step every 12 s. Megatron-LM prints " [YYYY-MM-DD HH:MM:SS] iteration ...".
  DaemonProcess daemon;
  std::string log;
  constexpr double kStart = 1796601600.0;  // 2026-12-07 00:00:00 UTC
  for (uint64_t step = 1; step <= 40; ++step) {
    const std::time_t t = static_cast<std::time_t>(kStart) + static_cast<std::time_t>(12 * step);
    std::tm utc{};
    gmtime_r(&t, &utc);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, " [%Y-%m-%d %H:%M:%S]", &utc);
    log += stamp + MegatronLine(step, "2.5", "0.3", 0);
  }
  const CommandResult r = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-", "--run", "paced", "--log-tz", "UTC"},
      log, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  REQUIRE(json::parse(r.out)["steps_sent"] == 40);
  const double rate =
      ParseMetric(daemon.ScrapeMetrics(), "gradwatch_steps_per_second", {{"run", "paced"}}).value_or(-1);
  CHECK(rate == Approx(1.0 / 12).epsilon(0.01));
  const CommandResult runs = Cli(daemon, {"runs", "--json"});
  REQUIRE(runs.exit_code == 0);
  const json listed = json::parse(runs.out)["runs"];
  const auto paced = std::find_if(listed.begin(), listed.end(), [](const json& r) { return r["run_id"] == "paced"; });
  REQUIRE(paced != listed.end());
  CHECK((*paced)["last_wall_time"].get<double>() == kStart + 12 * 40);

  // A bad zone is a usage error.
  const CommandResult bad = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "tail", "-", "--run", "x", "--log-tz", "Europe/Paris"},
      std::string(), std::chrono::seconds(60));
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("is not local, UTC or an offset") != std::string::npos);
}

TEST_CASE("tail of JSONL grows the catalog as new parameters appear, and a daemon restart loses nothing",
          "[integration]") {
  DaemonProcess daemon;
  std::string lines;
  for (int step = 1; step <= 40; ++step) {
    lines += R"({"_step": )" + std::to_string(step) + R"(, "train/loss": 2.0, "grad/norm/total": 0.5)";
    lines += R"(, "params/norm/final_norm.weight": )" + std::to_string(10.0 + step);
    if (step > 20) lines += R"(, "grad/norm/lm_head.weight": 0.25)";
    lines += "}\n";
  }
  const CommandResult r = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-", "--run", "jsonl-tail", "--finish"},
      lines, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out)["steps_sent"] == 40);
  const json show = json::parse(Cli(daemon, {"show", "jsonl-tail", "--json"}).out);
  REQUIRE(show["params"].size() == 2);
  CHECK(show["params"][0]["name"] == "final_norm.weight");
  CHECK(show["params"][0]["kind"] == "norm_gain");
  CHECK(show["params"][1]["name"] == "lm_head.weight");
  CHECK(Series(daemon, "jsonl-tail", "params/norm/final_norm.weight").at(40) == 50.0);
  CHECK(Series(daemon, "jsonl-tail", "grad/norm/lm_head.weight").size() == 20);
}

TEST_CASE("tail of JSONL sends a params line as a catalog change from its step, and prints one it cannot send",
          "[integration]") {
  DaemonProcess daemon;
  std::string lines;
  for (int step = 1; step <= 30; ++step) {
    if (step == 21) {
      lines += R"({"_step": 21, "params": [{"name": "final_norm.weight", "weight_decay": 0.1}]})"
               "\n";
      lines += R"({"_step": 21, "params": [{"name": "final_norm.weight", "weight_decay": -1}]})"
               "\n";
    }
    lines += R"({"_step": )" + std::to_string(step) + R"(, "grad/norm/total": 0.5)";
    lines += R"(, "params/norm/final_norm.weight": )" + std::to_string(10.0 + step) + "}\n";
  }
  const CommandResult r = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-", "--run", "jsonl-params", "--finish"},
      lines, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(r.out);
  CHECK(summary["steps_sent"] == 30);
  CHECK(summary["catalog_changes"] == 1);
  CHECK(summary["catalog_changes_refused"] == 1);
  CHECK(r.err.find("-:22: params[0].weight_decay must be a number ≥ 0; this catalog change is not sent") !=
        std::string::npos);
  const json show = json::parse(Cli(daemon, {"show", "jsonl-params", "--json"}).out);
  REQUIRE(show["params"].size() == 1);
  CHECK(show["params"][0]["weight_decay"] == 0.1);
  bool event = false;
  for (const json& e : show["events"]) {
    if (e.value("source", "") == "catalog" && AsStep(e["step"]) == 21) event = true;
  }
  CHECK(event);
}

TEST_CASE("the sidecar recipe runs a trainer unchanged, streams its log and exits with its status", "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-sidecar");
  const std::filesystem::path trainer = dir.path() / "trainer.sh";
  {
    std::ofstream out(trainer);
    out << "#!/bin/sh\n"
        << "for i in 1 2 3 4 5; do echo \"iter $((i * 10)): loss 3.$i, time 220.50ms, mfu 1.69%\"; done\n"
        << "echo 'Traceback: CUDA error' >&2\n"
        << "exit 3\n";
  }
  std::filesystem::permissions(trainer, std::filesystem::perms::owner_all);
  const std::string script = std::string(GRADWATCH_SOURCE_DIR) + "/deploy/examples/gradwatch-sidecar.sh";
  const CommandResult r = RunCommand({"bash", script, "--run", "sidecar", "--gradwatch", CliBinaryPath(), "--addr",
                                      daemon.grpc_target(), "--", trainer.string()},
                                     std::nullopt, std::chrono::seconds(120));
  INFO(r.out << r.err);
  CHECK(r.exit_code == 3);                                      // the trainer's status
  CHECK(r.out.find("iter 50: loss 3.5") != std::string::npos);  // its output, unchanged
  CHECK(r.out.find("Traceback: CUDA error") != std::string::npos);
  const auto loss = Series(daemon, "sidecar", "train/loss");
  REQUIRE(loss.size() == 5);
  CHECK(loss.at(50) == Approx(3.5));
  const json show = json::parse(Cli(daemon, {"show", "sidecar", "--json"}).out);
  CHECK(show["info"]["state"] == "finished");  // the CLI's JSON writes enums in lower case
  CHECK(show.dump().find("RUN_STATE_") == std::string::npos);
}

TEST_CASE("tail --pid ends when the trainer's process exits and --finish records the run as finished",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-tail-pid");
  const std::filesystem::path log = dir.path() / "train.log";
  Append(log, "iter 10: loss 3.1459, time 220.50ms, mfu 1.69%\niter 20: loss 2.7319, time 221.44ms, mfu 1.69%\n");
  BackgroundCommand trainer({"sleep", "600"});
  BackgroundCommand tail({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", log.string(), "--pid",
                          std::to_string(trainer.pid()), "--finish"});
  REQUIRE(WaitUntil([&] { return Series(daemon, "train", "train/loss").size() == 2; }, std::chrono::seconds(60)));
  Append(log, "iter 30: loss 2.5000, time 221.00ms, mfu 1.69%\n");
  REQUIRE(WaitUntil([&] { return Series(daemon, "train", "train/loss").size() == 3; }, std::chrono::seconds(60)));
  CHECK(tail.running());  // a followed file has no end of its own
  trainer.Signal(SIGKILL);
  trainer.Wait(std::chrono::seconds(30));  // reaped: a zombie would still answer kill(pid, 0)
  const CommandResult r = tail.Wait(std::chrono::seconds(60));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(r.out);
  CHECK(summary["ended"] == "process " + std::to_string(trainer.pid()) + " exited");
  CHECK(summary["steps_sent"] == 3);
  CHECK(summary["finished"] == true);
  CHECK(Cli(daemon, {"show", "train", "--json"}).out.find("\"state\": \"finished\"") != std::string::npos);
}

TEST_CASE("tail of a file waits out a daemon restart: every line reaches the run, nothing dropped", "[integration]") {
  DaemonOptions options;
  options.listen = "127.0.0.1:" + std::to_string(FreeLoopbackPort());  // the tail reconnects to the same port
  DaemonProcess daemon(options);
  TempDir dir("gradwatch-tail-restart");
  const std::filesystem::path log = dir.path() / "job.log";
  std::string first, second;
  for (int step = 1; step <= 50; ++step) {
    (step <= 20 ? first : second) +=
        "step " + std::to_string(step) + "/50 | loss 3.0 (+nanz)| norm 1.5 (+nanz)| lr 3.00e-04 | 44.57 ms\n";
  }
  Append(log, first);
  BackgroundCommand tail({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", log.string()});
  REQUIRE(WaitUntil([&] { return Series(daemon, "job", "train/loss").size() == 20; }, std::chrono::seconds(60)));
  daemon.Signal(SIGKILL);
  daemon.Stop();
  Append(log, second);  // read while the daemon is away: held, sent once it is back
  daemon.Restart();
  REQUIRE(WaitUntil([&] { return Series(daemon, "job", "train/loss").size() == 50; }, std::chrono::seconds(120)));
  tail.Signal(SIGTERM);
  const CommandResult r = tail.Wait(std::chrono::seconds(60));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json summary = json::parse(r.out);
  CHECK(summary["steps_sent"] == 50);
  CHECK(summary["dropped_steps"] == 0);
  CHECK(summary["complete"] == true);
}

TEST_CASE("tail sends every line to each of several daemons, and one that is away holds up none of the others",
          "[integration][fleet]") {
  DaemonOptions fixed_port;
  fixed_port.listen = "127.0.0.1:" + std::to_string(FreeLoopbackPort());  // the tail reconnects to the same port
  DaemonProcess first;
  DaemonProcess second(fixed_port);
  const std::string both = first.grpc_target() + "," + second.grpc_target();

  SECTION("a pipe: both get every step and the end of the run") {
    std::string lines;
    for (int step = 1; step <= 40; ++step) {
      lines += R"({"_step": )" + std::to_string(step) + R"(, "train/loss": 2.0, "grad/norm/total": 0.5)";
      lines += R"(, "params/norm/final_norm.weight": )" + std::to_string(10.0 + step) + "}\n";
    }
    const CommandResult r =
        RunCommand({CliBinaryPath(), "--addr", both, "--json", "tail", "-", "--run", "replicated", "--finish"}, lines,
                   std::chrono::seconds(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const json summaries = json::parse(r.out);
    REQUIRE(summaries.size() == 2);
    CHECK(summaries[0]["daemon"] == first.grpc_target());
    CHECK(summaries[1]["daemon"] == second.grpc_target());
    for (const json& s : summaries) {
      CHECK(s["steps_sent"] == 40);
      CHECK(s["last_acked_step"] == 40);
      CHECK(s["complete"] == true);
      CHECK(s["finished"] == true);
    }
    for (const DaemonProcess* d : {&first, &second}) {
      CHECK(Series(*d, "replicated", "params/norm/final_norm.weight").at(40) == 50.0);
      CHECK(Cli(*d, {"show", "replicated", "--json"}).out.find("\"state\": \"finished\"") != std::string::npos);
    }
  }

  SECTION("a file: one daemon killed and restarted gets its steps once back; the other never waits") {
    TempDir dir("gradwatch-tail-replicas");
    const std::filesystem::path log = dir.path() / "job.log";
    const auto line = [](int step) {
      return "step " + std::to_string(step) + "/60 | loss 3.0 (+nanz)| norm 1.5 (+nanz)| lr 3.00e-04 | 44.57 ms\n";
    };
    for (int step = 1; step <= 20; ++step) Append(log, line(step));
    BackgroundCommand tail({CliBinaryPath(), "--addr", both, "--json", "tail", log.string()});
    for (const DaemonProcess* d : {&first, &second}) {
      REQUIRE(WaitUntil([&] { return Series(*d, "job", "train/loss").size() == 20; }, std::chrono::seconds(60)));
    }
    second.Signal(SIGKILL);
    second.Stop();
    for (int step = 21; step <= 60; ++step) Append(log, line(step));
    REQUIRE(WaitUntil([&] { return Series(first, "job", "train/loss").size() == 60; }, std::chrono::seconds(60)));
    second.Restart();
    REQUIRE(WaitUntil([&] { return Series(second, "job", "train/loss").size() == 60; }, std::chrono::seconds(120)));
    tail.Signal(SIGTERM);
    const CommandResult r = tail.Wait(std::chrono::seconds(60));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    for (const json& s : json::parse(r.out)) {
      CHECK(s["steps_sent"] == 60);
      CHECK(s["dropped_steps"] == 0);
      CHECK(s["complete"] == true);
    }
  }

  SECTION("a daemon that never answers: the others get everything and the tail is a partial success") {
    std::string lines;
    for (int step = 1; step <= 10; ++step)
      lines += R"({"_step": )" + std::to_string(step) +
               R"(, "train/loss": 2.0})"
               "\n";
    const std::string timeout = std::to_string(2 * TimeScale());
    const CommandResult r = RunCommand({CliBinaryPath(), "--addr", first.grpc_target() + ",127.0.0.1:1", "--timeout",
                                        timeout, "--json", "tail", "-", "--run", "half", "--stall-timeout", timeout},
                                       lines, std::chrono::seconds(120));
    INFO(r.out << r.err);
    CHECK(r.exit_code == 3);
    CHECK_THAT(r.err, Catch::Contains("the daemon at 127.0.0.1:1 is not reachable yet"));
    CHECK_THAT(r.err, Catch::Contains("the daemon at 127.0.0.1:1 did not acknowledge every step"));
    const json summaries = json::parse(r.out);
    REQUIRE(summaries.size() == 2);
    CHECK(summaries[0]["complete"] == true);
    CHECK(summaries[0]["steps_sent"] == 10);
    CHECK(summaries[1]["complete"] == false);
    CHECK(summaries[1]["last_acked_step"].is_null());
    CHECK(Series(first, "half", "train/loss").size() == 10);
  }
}

TEST_CASE("a tail off a terminal draws no progress, and its report leads with the summary line (on stderr with --json)",
          "[integration]") {
  DaemonProcess daemon;
  std::string log;
  for (int step = 1; step <= 50; ++step) log += "iter " + std::to_string(step) + ": loss 3.14, time 220ms\n";

  // stderr is a pipe here: no carriage returns, no erase-line sequences; the report's first line sums it up.
  const CommandResult text =
      RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "tail", "-", "--run", "tail-progress"}, log,
                 std::chrono::seconds(60));
  INFO(text.out << text.err);
  REQUIRE(text.exit_code == 0);
  CHECK(text.err.find('\r') == std::string::npos);
  CHECK(text.err.find("\033[K") == std::string::npos);
  CHECK(text.out.rfind("followed - as run tail-progress: 50 steps in ", 0) == 0);
  const std::string first_line = text.out.substr(0, text.out.find('\n'));
  const std::string ending = "steps/s), all acknowledged; end of input";
  REQUIRE(first_line.size() > ending.size());
  CHECK(first_line.compare(first_line.size() - ending.size(), ending.size(), ending) == 0);

  // --json (and --quiet, which changes nothing off a terminal): stdout is the JSON report, with the time and the
  // rate; the summary line is stderr's last.
  const CommandResult json_run = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "--json", "tail", "-",
                                             "--run", "tail-progress-json", "--quiet"},
                                            log, std::chrono::seconds(60));
  INFO(json_run.out << json_run.err);
  REQUIRE(json_run.exit_code == 0);
  const json summary = json::parse(json_run.out);
  CHECK(summary["steps_sent"] == 50);
  CHECK(summary["seconds"].get<double>() > 0);
  CHECK(summary["steps_per_second"].get<double>() > 0);
  CHECK(json_run.err.find('\r') == std::string::npos);
  const std::string last_line = "followed - as run tail-progress-json: 50 steps in ";
  const size_t at = json_run.err.rfind(last_line);
  REQUIRE(at != std::string::npos);
  CHECK(json_run.err.find('\n', at) == json_run.err.size() - 1);
  CHECK(json_run.err.find("all acknowledged; end of input\n", at) != std::string::npos);
}

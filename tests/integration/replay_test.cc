// `gradwatch replay` and the query subcommands against the real gradwatchd.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"

using namespace gradwatch::testing;
using nlohmann::json;

namespace {

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
}

}  // namespace

TEST_CASE("replay of a file with a broken line reports it with its line number and ingests the rest",
          "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-replay");
  const std::string file = (dir.path() / "history.jsonl").string();
  {
    std::ofstream out(file);
    out << R"({"run": "replayed", "config": {"hidden_size": 6144, "z_loss_coef": 1e-4, "weight_decay": 0.1},)"
        << R"( "params": [{"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain", "weight_decay": 0.0}]})"
        << "\n";
    for (int i = 1; i <= 10; ++i) {
      const int step = i * 10;
      if (i == 4) {
        out << R"({"_step": 40, "grad/norm/total": 0.3, )" << "\n";  // line 5: truncated JSON
        continue;
      }
      out << R"({"_step": )" << step << R"(, "_timestamp": )" << 1.7e9 + step
          << R"(, "grad/norm/total": )" << (i == 7 ? "NaN" : std::to_string(0.1 * i))
          << R"(, "grad/norm/lm_head.weight": )" << 0.09 * i
          << R"(, "params/norm/final_norm.weight": )" << 78.4 + i
          << R"(, "train/loss": 2.0, "train/accuracy": 0.5})" << "\n";
    }
    out << R"({"_step": 55, "event": "switched to near-dropless EP routing"})" << "\n";
  }

  const CommandResult replay = Cli(daemon, {"replay", file, "--max", "--json"});
  INFO(replay.out << replay.err);
  CHECK(replay.exit_code == 3);  // finished, but a line was skipped
  CHECK(replay.err.find("history.jsonl:5: invalid JSON") != std::string::npos);
  const json summary = json::parse(replay.out);
  CHECK(summary["run"] == "replayed");
  CHECK(summary["skipped_lines"] == 1);
  CHECK(summary["first_skipped"][0]["line"] == 5);
  CHECK(summary["steps_sent"] == 9);
  CHECK(summary["events"] == 1);
  CHECK(summary["last_acked_step"] == 100);

  const CommandResult show = Cli(daemon, {"show", "replayed", "--json"});
  INFO(show.out << show.err);
  REQUIRE(show.exit_code == 0);
  const json run = json::parse(show.out);
  CHECK(run["info"]["step_count"] == 9);
  CHECK(run["info"]["last_step"] == 100);
  CHECK(run["nonfinite_count"] == 1);
  CHECK(run["last_nonfinite_step"] == 70);
  REQUIRE(run["events"].size() == 1);
  CHECK(run["events"][0]["step"] == 55);
  // The catalog got the header's entry plus the one created from the keys, with its kind inferred.
  REQUIRE(run["params"].size() == 2);
  CHECK(run["params"][1]["name"] == "lm_head.weight");
  CHECK(run["params"][1]["kind"] == "output");

  const CommandResult series = Cli(daemon, {"series", "replayed", "grad/norm/total", "--json"});
  INFO(series.out << series.err);
  REQUIRE(series.exit_code == 0);
  const json points = json::parse(series.out);
  REQUIRE(points.is_array());
  CHECK(points.size() == 9);

  const CommandResult extra = Cli(daemon, {"series", "replayed", "train/accuracy", "--from", "50", "--to", "80"});
  CHECK(extra.exit_code == 0);

  const CommandResult missing = Cli(daemon, {"show", "no-such-run"});
  CHECK(missing.exit_code == 1);
  CHECK(missing.err.find("no-such-run") != std::string::npos);

  const CommandResult annotate = Cli(daemon, {"annotate", "replayed", "95", "checkpoint restored"});
  CHECK(annotate.exit_code == 0);
  const json after = json::parse(Cli(daemon, {"show", "replayed", "--json"}).out);
  CHECK(after["events"].size() == 2);

  const CommandResult runs = Cli(daemon, {"runs", "--json"});
  CHECK(runs.exit_code == 0);
  CHECK(runs.out.find("replayed") != std::string::npos);

  // Replaying the same file again resumes: nothing is sent twice, nothing is rejected.
  const CommandResult again = Cli(daemon, {"replay", file, "--json"});
  INFO(again.out << again.err);
  const json second = json::parse(again.out);
  CHECK(second["steps_sent"] == 0);
  CHECK(second["already_held_steps"] == 9);
  CHECK(second["daemon_errors"].empty());
}

TEST_CASE("the CLI exits 1 with a clear message when the daemon is unreachable", "[integration]") {
  const CommandResult r = RunCommand({CliBinaryPath(), "--addr", "127.0.0.1:1", "--timeout", "2", "runs"},
                                     std::nullopt, std::chrono::seconds(30));
  CHECK(r.exit_code == 1);
  CHECK_FALSE(r.err.empty());
}

TEST_CASE("a replay reads a pipe once: standard input, /dev/stdin and a FIFO send every step", "[integration]") {
  DaemonProcess daemon;
  std::string history;
  for (int step = 1; step <= 100; ++step) {
    history += R"({"_step": )" + std::to_string(step) + R"(, "train/loss": )" + std::to_string(3.0 - 0.01 * step) +
               R"(, "grad/norm/total": 0.5, "grad/norm/final_norm.weight": 0.1})" + "\n";
  }
  for (const std::string input : {"-", "/dev/stdin"}) {
    CAPTURE(input);
    const std::string run = input == "-" ? "piped-dash" : "piped-dev-stdin";
    const CommandResult r =
        RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", input, "--run", run, "--json"},
                   history, std::chrono::seconds(120));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const json summary = json::parse(r.out);
    CHECK(summary["steps_sent"] == 100);
    const CommandResult show = Cli(daemon, {"show", run, "--json"});
    REQUIRE(show.exit_code == 0);
    CHECK(json::parse(show.out)["info"]["step_count"] == 100);
  }

  // A FIFO written by another process: read once, then replayed from the copy.
  TempDir dir("gradwatch-replay-fifo");
  const std::string fifo = (dir.path() / "history.fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::thread writer([&] {
    std::ofstream out(fifo);
    out << history;
  });
  const CommandResult r = Cli(daemon, {"replay", fifo, "--run", "piped-fifo", "--json"});
  writer.join();
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(json::parse(r.out)["steps_sent"] == 100);
}

// `gradwatch replay` and the query subcommands against the real gradwatchd.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <pty.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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

// `steps` steps, their _timestamp `spacing` seconds apart.
std::string History(int steps, double spacing = 1) {
  std::string history;
  for (int step = 1; step <= steps; ++step) {
    history += R"({"_step": )" + std::to_string(step) + R"(, "_timestamp": )" + std::to_string(1.7e9 + step * spacing) +
               R"(, "train/loss": 2.5, "grad/norm/total": 0.5, "grad/norm/final_norm.weight": 0.1})" + "\n";
  }
  return history;
}

// Runs argv with its stderr on a pseudo-terminal (as a person at a terminal runs it) and stdout to /dev/null; returns
// its exit code and what it wrote to the terminal. The terminal is read until the command has closed it.
std::pair<int, std::string> RunWithTerminalStderr(const std::vector<std::string>& argv) {
  // Made before fork: the child only calls what is safe there. TERM is set: the tests may run under TERM=dumb,
  // where no line is drawn.
  std::vector<std::string> env = {"TERM=xterm"};
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string(*e).rfind("TERM=", 0) != 0) env.emplace_back(*e);
  }
  std::vector<char*> args, envp;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  int master = -1, slave = -1;
  if (::openpty(&master, &slave, nullptr, nullptr, nullptr) != 0) throw std::runtime_error("openpty failed");
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR);
    ::dup2(null, STDIN_FILENO);
    ::dup2(null, STDOUT_FILENO);
    ::dup2(slave, STDERR_FILENO);
    ::close(master);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(slave);
  std::string text;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(master, buffer, sizeof buffer);
    if (n > 0) {
      text.append(buffer, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EIO once the command has exited and its terminal is closed
    }
  }
  ::close(master);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
}

}  // namespace

TEST_CASE("replay of a file with a broken line reports it with its line number and ingests the rest", "[integration]") {
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
        out << R"({"_step": 40, "grad/norm/total": 0.3, )"
            << "\n";  // line 5: truncated JSON
        continue;
      }
      out << R"({"_step": )" << step << R"(, "_timestamp": )" << 1.7e9 + step << R"(, "grad/norm/total": )"
          << (i == 7 ? "NaN" : std::to_string(0.1 * i)) << R"(, "grad/norm/lm_head.weight": )" << 0.09 * i
          << R"(, "params/norm/final_norm.weight": )" << 78.4 + i << R"(, "train/loss": 2.0, "train/accuracy": 0.5})"
          << "\n";
    }
    out << R"({"_step": 55, "event": "switched to near-dropless EP routing"})"
        << "\n";
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
  const CommandResult r = RunCommand({CliBinaryPath(), "--addr", "127.0.0.1:1", "--timeout", "2", "runs"}, std::nullopt,
                                     std::chrono::seconds(30));
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
        RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", input, "--run", run, "--json"}, history,
                   std::chrono::seconds(120));
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

TEST_CASE("a replay off a terminal draws no progress, and its report leads with the summary line", "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-replay-progress");
  const std::string file = (dir.path() / "moe.jsonl").string();
  std::ofstream(file) << History(2000);
  const std::string summary_start = "replayed " + file + " as run ";
  const std::string summary_end = "steps/s), all acknowledged\n";

  // stderr is a pipe here, as in a CI log: no carriage returns, no erase-line sequences.
  const CommandResult text = Cli(daemon, {"replay", file, "--run", "progress-text"});
  INFO(text.out << text.err);
  REQUIRE(text.exit_code == 0);
  CHECK(text.err.find('\r') == std::string::npos);
  CHECK(text.err.find("\033[K") == std::string::npos);
  CHECK(text.err.empty());
  // The one summary line is the report's first line, on stdout with it.
  CHECK(text.out.rfind(summary_start + "progress-text: 2,000 steps in ", 0) == 0);
  const std::string first_line = text.out.substr(0, text.out.find('\n') + 1);
  CHECK(first_line.size() > summary_end.size());
  CHECK(first_line.compare(first_line.size() - summary_end.size(), summary_end.size(), summary_end) == 0);
  CHECK(text.out.find("last acked step  2000") != std::string::npos);

  // --json: stdout stays the JSON report alone; the summary line is stderr's only line.
  const CommandResult json_run = Cli(daemon, {"--json", "replay", file, "--run", "progress-json"});
  INFO(json_run.out << json_run.err);
  REQUIRE(json_run.exit_code == 0);
  const json summary = json::parse(json_run.out);
  CHECK(summary["steps_sent"] == 2000);
  CHECK(summary["complete"] == true);
  CHECK(summary["seconds"].get<double>() > 0);
  CHECK(json_run.err.rfind(summary_start + "progress-json: 2,000 steps in ", 0) == 0);
  CHECK(json_run.err.find('\n') == json_run.err.size() - 1);
  CHECK(json_run.err.find(summary_end) == json_run.err.size() - summary_end.size());

  // --quiet (-q) changes nothing off a terminal: the same report, the same line.
  for (const std::string quiet : {"--quiet", "-q"}) {
    CAPTURE(quiet);
    const std::string run = "progress-quiet" + quiet;
    const CommandResult q = Cli(daemon, {"--json", "replay", file, "--run", run, quiet});
    INFO(q.out << q.err);
    REQUIRE(q.exit_code == 0);
    CHECK(json::parse(q.out)["steps_sent"] == 2000);
    CHECK(q.err.rfind(summary_start + run + ": 2,000 steps in ", 0) == 0);
    CHECK(q.err.find('\r') == std::string::npos);
  }
}

TEST_CASE("a replay on a terminal rewrites one progress line in place, and --quiet draws none", "[integration]") {
  DaemonProcess daemon;
  TempDir dir("gradwatch-replay-tty");
  const std::string file = (dir.path() / "paced.jsonl").string();
  // 60 steps 25 ms apart, replayed in real time (--speed 1): 1.5 s, a few redraws at four a second.
  std::ofstream(file) << History(60, 0.025);
  const auto [code, terminal] = RunWithTerminalStderr(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", file, "--run", "progress-tty", "--speed", "1"});
  INFO(terminal);
  REQUIRE(code == 0);
  // Each drawing starts at the line's start and erases what a longer one left; the last erases the line for good.
  CHECK(terminal.find("\rreplay progress-tty: ") != std::string::npos);
  CHECK(terminal.find("/60 steps \u00b7 ") != std::string::npos);
  CHECK(terminal.find("steps/s \u00b7 ETA ") != std::string::npos);
  CHECK(terminal.find('%') != std::string::npos);
  CHECK(terminal.find('\n') == std::string::npos);  // one line, never a new one
  const std::string erase = "\r\033[K";
  REQUIRE(terminal.size() >= erase.size());
  CHECK(terminal.compare(terminal.size() - erase.size(), erase.size(), erase) == 0);

  const auto [quiet_code, quiet_terminal] =
      RunWithTerminalStderr({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", file, "--run",
                             "progress-tty-quiet", "--speed", "1", "--quiet"});
  CHECK(quiet_code == 0);
  CHECK(quiet_terminal.empty());
}

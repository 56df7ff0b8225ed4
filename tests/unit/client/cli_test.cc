#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "client/cli/app.h"
#include "client/cli/format.h"
#include "client/cli/replay.h"
#include "client/cli/values.h"
#include "server/core/suggest.h"
#include "tests/unit/client/fake_daemon.h"

using gradwatch::testing::FakeIngest;
using gradwatch::testing::FakeQuery;
using gradwatch::testing::FakeServer;
namespace v1 = gradwatch::v1;

namespace {

struct CliResult {
  int code;
  std::string out;
  std::string err;
};

CliResult RunCli(std::vector<std::string> args) {
  args.insert(args.begin(), "gradwatch");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = gradwatch::cli::Run(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

// A file under the system temp dir, removed at the end of the test.
class TempFile {
 public:
  explicit TempFile(const std::string& content) {
    path_ = std::filesystem::temp_directory_path() /
            ("gradwatch-cli-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++) + ".jsonl");
    std::ofstream(path_) << content;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  std::string path() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  std::filesystem::path path_;
};

v1::RunSummary SampleSummary() {
  v1::RunSummary s;
  v1::RunInfo* info = s.mutable_info();
  info->set_run_id("moe-6b");
  info->set_state(v1::RUN_STATE_ACTIVE);
  info->set_world_size(8);
  info->set_step_count(3);
  info->set_first_step(81714);
  info->set_last_step(81716);
  info->set_steps_per_second(1.5);
  (*info->mutable_labels())["job"] = "pretrain";
  s.mutable_config()->set_hidden_size(6144);
  s.mutable_config()->set_z_loss_coef(1e-4);
  auto add_param = [&](const std::string& name, v1::ParamKind kind, uint64_t numel, double wd) {
    auto* p = s.add_params();
    p->set_name(name);
    p->set_kind(kind);
    p->set_numel(numel);
    p->set_weight_decay(wd);
  };
  add_param("final_norm.weight", v1::PARAM_KIND_NORM_GAIN, 6144, 0);
  add_param("lm_head.weight", v1::PARAM_KIND_OUTPUT, 788'000'000, 0.1);
  add_param("blocks.0.attn.qkv", v1::PARAM_KIND_ATTENTION, 1000, 0.1);
  auto latest = [&](const std::string& key, double value) {
    auto* v = s.add_latest();
    v->set_key(key);
    v->set_step(81716);
    v->set_value(value);
  };
  latest("grad/norm/total", 0.59);
  latest("train/loss", 1.23);
  latest("grad/norm/lm_head.weight", 0.57);
  latest("grad/norm/final_norm.weight", 0.01);
  latest("params/norm/final_norm.weight", 360.5);
  latest("grad/norm/blocks.0.attn.qkv", std::nan(""));
  auto* e = s.add_events();
  e->set_step(81716);
  e->set_text("switched to near-dropless EP routing");
  e->set_source("trainer");
  s.set_nonfinite_count(1);
  s.set_last_nonfinite_step(81716);
  return s;
}

}  // namespace

TEST_CASE("replay sends the file's steps, events and catalog and exits 3 on a bad line", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  TempFile file(R"({"run": "hist-1", "config": {"weight_decay": 0.1}, "labels": {"job": "replay"}})"
                "\n"
                R"({"_step": 1, "_timestamp": 100.0, "grad/norm/total": 0.28,)"
                R"( "grad/norm/lm_head.weight": 0.27, "params/norm/final_norm.weight": 78.4,)"
                R"( "train/loss": 2.5})"
                "\n"
                R"({"_step": 2, "_timestamp": 101.0, "grad/norm/total": NaN,)"
                R"( "params/norm/final_norm.weight": Infinity})"
                "\n"
                R"({"_step": 2, "event": "switched routing"})"
                "\n"
                R"({"_step": "three"})"
                "\n"
                R"({"_step": 3, "_timestamp": 102.0, "grad/norm/total": 0.3})"
                "\n");
  const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path()});
  INFO(r.err);
  CHECK(r.code == 3);
  CHECK_THAT(r.err, Catch::Contains(":5: _step is not a number"));
  const auto summary = nlohmann::json::parse(r.out);
  CHECK(summary["run"] == "hist-1");
  CHECK(summary["lines"] == 6);
  CHECK(summary["steps_sent"] == 3);
  CHECK(summary["events"] == 1);
  CHECK(summary["skipped_lines"] == 1);
  CHECK(summary["first_skipped"][0]["line"] == 5);
  CHECK(summary["last_acked_step"] == 3);
  CHECK(summary["complete"] == true);

  const auto messages = ingest.Messages();
  REQUIRE(messages.size() == 5);
  const v1::Hello& hello = messages[0].hello();
  CHECK(hello.run_id() == "hist-1");
  CHECK(hello.labels().at("job") == "replay");
  REQUIRE(hello.params_size() == 2);
  CHECK(hello.params(0).name() == "lm_head.weight");
  CHECK(hello.params(0).kind() == v1::PARAM_KIND_OUTPUT);
  CHECK(hello.params(0).weight_decay() == Approx(0.1));
  CHECK(hello.params(1).name() == "final_norm.weight");
  CHECK(hello.params(1).weight_decay() == 0.0);
  CHECK(messages[1].step().loss() == Approx(2.5));
  CHECK(messages[1].step().wall_time() == Approx(100.0));
  CHECK(std::isnan(messages[2].step().total_grad().norm()));
  CHECK(std::isinf(messages[2].step().params(0).param().norm()));
  CHECK(messages[3].event().text() == "switched routing");
  CHECK(messages[4].step().step() == 3);
}

TEST_CASE("a clean replay exits 0 and daemon rejections make it exit 3", "[client]") {
  const std::string content = R"({"_step": 1, "grad/norm/total": 0.28})"
                              "\n"
                              R"({"_step": 2, "grad/norm/total": -1})"
                              "\n";
  TempFile file(content);
  {
    FakeIngest ingest;
    FakeServer server({&ingest});
    const CliResult r = RunCli({"--addr", server.address(), "replay", file.path(), "--run", "clean"});
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Catch::Contains("as run clean"));
  }
  {
    FakeIngest ingest;
    ingest.set_reject([](const v1::TrainerMessage& m) -> std::optional<v1::Error> {
      if (!m.has_step() || m.step().total_grad().norm() >= 0) return std::nullopt;
      v1::Error e;
      e.set_seq(m.seq());
      e.set_step(m.step().step());
      e.set_reason(v1::ERROR_REASON_NEGATIVE_NORM);
      e.set_message("grad/norm/total is negative");
      return e;
    });
    FakeServer server({&ingest});
    const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path()});
    CHECK(r.code == 3);
    CHECK_THAT(r.err, Catch::Contains(":2: daemon error at step 2 (NEGATIVE_NORM)"));
    const auto summary = nlohmann::json::parse(r.out);
    CHECK(summary["daemon_errors"]["ERROR_REASON_NEGATIVE_NORM"] == 1);
    CHECK(summary["complete"] == true);
  }
}

TEST_CASE("replay sends every step to each of several daemons, and a dead one makes it partial", "[client]") {
  TempFile file(R"({"_step": 1, "grad/norm/total": 0.28})"
                "\n"
                R"({"_step": 2, "grad/norm/total": 0.29})"
                "\n");
  FakeIngest first, second;
  FakeServer a({&first});
  FakeServer b({&second});
  CliResult r = RunCli({"--addr", a.address() + "," + b.address(), "--json", "replay", file.path(), "--run", "two"});
  INFO(r.err);
  CHECK(r.code == 0);
  const auto both = nlohmann::json::parse(r.out);
  REQUIRE(both.size() == 2);
  CHECK(both[0]["daemon"] == a.address());
  CHECK(both[1]["daemon"] == b.address());
  for (const auto& s : both) {
    CHECK(s["complete"] == true);
    CHECK(s["last_acked_step"] == 2);
  }

  // A daemon nobody listens for: the other still gets every step, and the replay is partial.
  r = RunCli({"--addr", a.address() + ",127.0.0.1:1", "--timeout", "5", "replay", file.path(), "--run", "half"});
  CHECK(r.code == 3);
  CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon at 127.0.0.1:1"));
  CHECK_THAT(r.out, Catch::Contains("daemon " + a.address()));

  r = RunCli({"--addr", a.address() + "," + b.address(), "runs"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("only replay and tail send to several"));
}

TEST_CASE("a replay run again sends only the steps the daemon has not received", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  std::string lines;
  for (int step = 1; step <= 3; ++step) {
    lines += R"({"_step": )" + std::to_string(step) +
             R"(, "train/loss": 1.5})"
             "\n";
  }
  TempFile first(lines);
  CliResult r = RunCli({"--addr", server.address(), "replay", first.path(), "--run", "again"});
  REQUIRE(r.code == 0);
  lines += R"({"_step": 4, "train/loss": 1.4})"
           "\n"
           R"({"_step": 5, "train/loss": 1.3})"
           "\n";
  TempFile second(lines);
  r = RunCli({"--addr", server.address(), "--json", "replay", second.path(), "--run", "again"});
  INFO(r.err);
  CHECK(r.code == 0);
  CHECK_THAT(r.err, Catch::Contains("through step 3"));
  const auto summary = nlohmann::json::parse(r.out);
  CHECK(summary["steps_sent"] == 2);
  CHECK(summary["already_held_steps"] == 3);
  CHECK(summary["last_acked_step"] == 5);
  CHECK(ingest.Steps() == std::vector<uint64_t>{1, 2, 3, 4, 5});
}

TEST_CASE("a resumed replay sends the steps from its checkpoint on even those the daemon held", "[client][rewind]") {
  // The daemon received through step 30; the history resumes from the checkpoint at 20, so the
  // daemon (here its fake) rewinds and answers that it holds through step 19.
  FakeIngest ingest(FakeIngest::Progress{true, 30, true, 30});
  FakeServer server({&ingest});
  std::string lines = R"({"run": "resumed", "resume_from_step": 20})"
                      "\n";
  for (int step = 10; step <= 40; step += 10) {
    lines += R"({"_step": )" + std::to_string(step) +
             R"(, "train/loss": 1.5})"
             "\n";
  }
  TempFile file(lines);
  SECTION("from the header") {
    const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path()});
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK_THAT(r.err, Catch::Contains("from the checkpoint at step 20"));
    const auto summary = nlohmann::json::parse(r.out);
    CHECK(summary["resumed_from_step"] == 20);
    CHECK(summary["steps_sent"] == 3);
    CHECK(summary["already_held_steps"] == 1);
    CHECK(ingest.Steps() == std::vector<uint64_t>{20, 30, 40});
    REQUIRE(ingest.Messages()[0].hello().has_resume_from_step());
    CHECK(ingest.Messages()[0].hello().resume_from_step() == 20);
  }
  SECTION("--resume-from overrides the header") {
    const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path(), "--resume-from", "30"});
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK(ingest.Steps() == std::vector<uint64_t>{30, 40});
    CHECK(ingest.Messages()[0].hello().resume_from_step() == 30);
  }
  SECTION("the text summary says so") {
    const CliResult r = RunCli({"--addr", server.address(), "replay", file.path()});
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Catch::Contains("resumed from") && Catch::Contains("the checkpoint at step 20"));
  }
}

TEST_CASE("replay paces by timestamps with --speed", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  TempFile file(R"({"_step": 1, "_timestamp": 10.0, "train/loss": 1})"
                "\n"
                R"({"_step": 2, "_timestamp": 11.0, "train/loss": 1})"
                "\n");
  const auto started = std::chrono::steady_clock::now();
  const CliResult r = RunCli({"--addr", server.address(), "replay", file.path(), "--speed", "4"});
  CHECK(r.code == 0);
  CHECK(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(240));
}

TEST_CASE("replay fails with 1 when the daemon is unreachable or the file is missing", "[client]") {
  int port = 0;
  {
    FakeIngest ingest;
    FakeServer server({&ingest});
    port = server.port();
  }
  TempFile file(R"({"_step": 1, "train/loss": 1})"
                "\n");
  CliResult r = RunCli({"--addr", "127.0.0.1:" + std::to_string(port), "--timeout", "0.5", "replay", file.path()});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon"));
  r = RunCli({"replay", "/nonexistent/history.jsonl"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("cannot open"));
}

TEST_CASE("an empty or unreadable file creates no run and fails", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  for (const std::string& text : {std::string(), std::string("\n\n"), std::string("garbage\nmore garbage\n"),
                                  std::string(R"({"run": "only-a-header"})") + "\n"}) {
    CAPTURE(text);
    TempFile file(text);
    const CliResult r = RunCli({"--addr", server.address(), "replay", file.path()});
    CHECK(r.code == 1);
    CHECK_THAT(r.err, Catch::Contains("holds no step to replay"));
  }
  CHECK(ingest.Messages().empty());  // no Hello: no run
}

TEST_CASE("a replay with a non-number built-in value reports the line and exits 3", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  TempFile file(R"({"_step": 1, "grad/norm/total": 0.3})"
                "\n"
                R"({"_step": 2, "grad/norm/total": "1.0"})"
                "\n"
                R"({"_step": 3, "grad/norm/total": null})"
                "\n"
                R"({"_step": 4, "grad/norm/total": 0.4})"
                "\n");
  const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path()});
  INFO(r.err);
  CHECK(r.code == 3);
  CHECK_THAT(r.err, Catch::Contains(R"(:2: "grad/norm/total": "1.0" is not a number)"));
  CHECK_THAT(r.err, Catch::Contains(R"(:3: "grad/norm/total": null is not a number)"));
  const auto summary = nlohmann::json::parse(r.out);
  CHECK(summary["skipped_lines"] == 2);
  CHECK(summary["steps_sent"] == 2);
}

TEST_CASE("usage errors exit 2 and help exits 0 with the exit codes", "[client]") {
  CHECK(RunCli({}).code == 2);
  CHECK(RunCli({"bogus"}).code == 2);
  CHECK(RunCli({"replay"}).code == 2);
  CHECK(RunCli({"replay", "f", "--speed", "2", "--max"}).code == 2);
  CHECK(RunCli({"replay", "f", "--rank", "3", "--world-size", "2"}).code == 2);
  CHECK(RunCli({"series", "run-only"}).code == 2);
  const CliResult help = RunCli({"--help"});
  CHECK(help.code == 0);
  CHECK_THAT(help.out, Catch::Contains("Exit codes"));
  CHECK_THAT(help.out, Catch::Contains("3  replay finished"));
  const CliResult replay_help = RunCli({"replay", "--help"});
  CHECK_THAT(replay_help.out, Catch::Contains("--stall-timeout"));
  CHECK_THAT(replay_help.out, Catch::Contains("no overall deadline"));
  CHECK(RunCli({"replay", "f", "--stall-timeout", "0"}).code == 2);
  for (const char* sub : {"replay", "runs", "show", "series", "annotate"}) {
    CAPTURE(sub);
    CHECK(RunCli({sub, "--help"}).code == 0);
  }
  // Every command's help shows the global options and the exit codes.
  for (const std::vector<std::string>& command : std::vector<std::vector<std::string>>{{"replay"},
                                                                                       {"tail"},
                                                                                       {"runs"},
                                                                                       {"show"},
                                                                                       {"series"},
                                                                                       {"annotate"},
                                                                                       {"alerts"},
                                                                                       {"rules", "check"},
                                                                                       {"rules", "reload"},
                                                                                       {"silence", "add"},
                                                                                       {"silence", "list"},
                                                                                       {"silence", "remove"},
                                                                                       {"plot"},
                                                                                       {"report"},
                                                                                       {"ack"},
                                                                                       {"completion"}}) {
    std::vector<std::string> args = command;
    args.push_back("--help");
    const CliResult r = RunCli(args);
    CAPTURE(args);
    CHECK(r.code == 0);
    CHECK_THAT(r.out, Catch::Contains("Global options") && Catch::Contains("--addr TEXT=") &&
                          Catch::Contains("--json") && Catch::Contains("--timeout DURATION=") &&
                          Catch::Contains("Exit codes:") && Catch::Contains("GRADWATCH_ADDR"));
    // An unknown flag is a usage error for every command, named in the message, and so is a bad
    // value of a global flag given after the command.
    static const std::map<std::string, std::vector<std::string>> kPositionals = {{"replay", {"f.jsonl"}},
                                                                                 {"tail", {"job.log"}},
                                                                                 {"show", {"r"}},
                                                                                 {"series", {"r", "k"}},
                                                                                 {"annotate", {"r", "1", "t"}},
                                                                                 {"check", {"f.yaml"}},
                                                                                 {"add", {"run=x"}},
                                                                                 {"remove", {"s1"}},
                                                                                 {"plot", {"r", "-o", "x.svg"}},
                                                                                 {"report", {"r", "-o", "x.md"}},
                                                                                 {"ack", {"0123456789abcdef"}},
                                                                                 {"completion", {"bash"}}};
    args.pop_back();
    if (auto it = kPositionals.find(command.back()); it != kPositionals.end()) {
      args.insert(args.end(), it->second.begin(), it->second.end());
    }
    args.push_back("--no-such-flag");
    const CliResult unknown = RunCli(args);
    CHECK(unknown.code == 2);
    CHECK_THAT(unknown.err, Catch::Contains("--no-such-flag"));
    args.back() = "--timeout";
    args.push_back("soon");
    const CliResult bad_value = RunCli(args);
    CHECK(bad_value.code == 2);
    CHECK_THAT(bad_value.err, Catch::Contains("'soon' is not a duration"));
  }
  // Values of the wrong type or out of range.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"series", "run", "key", "--from", "x"},
           {"series", "run", "key", "--max-points", "-1"},
           {"annotate", "run", "step-one", "text"},
           {"replay", "f", "--speed", "fast"},
           {"replay", "f", "--rank", "-1"},
           {"tail", "f", "--world-size", "0"},
           {"silence", "add", "run=x", "--duration", "0"},
           {"silence", "add", "run=~(x", "--duration", "1h"},
           {"completion", "fish"},
           {"silence"},
           {"rules"},
       }) {
    CAPTURE(args);
    CHECK(RunCli(args).code == 2);
  }
}

TEST_CASE("runs, show, series and annotate query the daemon", "[client]") {
  FakeQuery query;
  query.runs["moe-6b"] = SampleSummary();
  v1::GetSeriesResponse series;
  for (uint64_t s = 1; s <= 3; ++s) {
    auto* p = series.add_points();
    p->set_step(s);
    p->set_last_step(s);
    p->set_value(s == 2 ? std::nan("") : 0.25 * static_cast<double>(s));
    p->set_min(0.1);
    p->set_max(0.9);
    p->set_count(1);
  }
  query.series["grad/norm/total"] = series;
  FakeServer server({&query});
  const std::string addr = server.address();

  CliResult r = RunCli({"--addr", addr, "runs"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("moe-6b") && Catch::Contains("active") && Catch::Contains("81714..81716"));
  r = RunCli({"--addr", addr, "runs", "--json"});
  CHECK(r.code == 0);
  CHECK(nlohmann::json::parse(r.out)["runs"][0]["world_size"] == 8);
  // Enums as lower-case names without their prefix, as the human output writes them.
  CHECK(nlohmann::json::parse(r.out)["runs"][0]["state"] == "active");

  r = RunCli({"--addr", addr, "show", "moe-6b"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("hidden_size=6144") && Catch::Contains("lm_head.weight") &&
                        Catch::Contains("switched to near-dropless EP routing"));
  r = RunCli({"--addr", addr, "--json", "show", "moe-6b"});
  CHECK(r.code == 0);
  const auto shown = nlohmann::json::parse(r.out);
  CHECK(shown["info"]["last_step"] == 81716);
  CHECK(shown["overview"]["top_params"][0]["grad_norm"] == "NaN");
  CHECK(shown["overview"]["top_params"][1]["name"] == "lm_head.weight");
  CHECK(shown["params"][0]["kind"] == "norm_gain");
  CHECK(shown["info"]["state"] == "active");

  r = RunCli({"--addr", addr, "show", "nope"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("not found"));

  r = RunCli({"--addr", addr, "series", "moe-6b", "grad/norm/total", "--max-points", "10"});
  CHECK(r.code == 0);
  CHECK(r.out ==
        "STEP  VALUE  MIN  MAX  STEPS\n"
        "1     0.25   0.1  0.9  1\n"
        "2     NaN    0.1  0.9  1\n"
        "3     0.75   0.1  0.9  1\n");
  r = RunCli({"--addr", addr, "--json", "series", "moe-6b", "grad/norm/total"});
  CHECK(nlohmann::json::parse(r.out)[1]["value"] == "NaN");

  r = RunCli({"--addr", addr, "annotate", "moe-6b", "81716", "enabled", "wd", "on", "final_norm"});
  CHECK(r.code == 0);
  REQUIRE(query.annotations.size() == 1);
  CHECK(query.annotations[0].step() == 81716);
  CHECK(query.annotations[0].text() == "enabled wd on final_norm");
}

TEST_CASE("show ranks parameters by grad norm with non-finite values first", "[client]") {
  const auto overview = gradwatch::cli::BuildOverview(SampleSummary(), 2);
  REQUIRE(overview.top_params.size() == 2);
  CHECK(overview.top_params[0].name == "blocks.0.attn.qkv");
  CHECK(overview.top_params[1].name == "lm_head.weight");
  CHECK(overview.params_with_values == 3);
  REQUIRE(overview.key_series.size() == 2);
  CHECK(overview.key_series[0].key() == "grad/norm/total");
  CHECK(overview.key_series[1].key() == "train/loss");
}

TEST_CASE("proto JSON keeps integers as numbers and non-finite doubles as strings", "[client]") {
  v1::LatestValue v;
  v.set_key("k");
  v.set_step(18446744073709551615ull);
  v.set_value(-std::numeric_limits<double>::infinity());
  const auto j = gradwatch::cli::ProtoToJson(v);
  CHECK(j["step"] == 18446744073709551615ull);
  CHECK(j["value"] == "-Infinity");
  v1::RunConfig c;
  CHECK_FALSE(gradwatch::cli::ProtoToJson(c).contains("z_loss_coef"));
  c.set_z_loss_coef(0);
  CHECK(gradwatch::cli::ProtoToJson(c)["z_loss_coef"] == 0.0);
}

TEST_CASE("alerts show who acknowledged a page and which silences mute one", "[client]") {
  v1::ListAlertsResponse resp;
  v1::Alert* page = resp.add_alerts();
  page->set_name("GradNormContingency");
  page->set_state(v1::ALERT_STATE_FIRING);
  page->set_fingerprint("0123456789abcdef");
  (*page->mutable_labels())["run"] = "r1";
  page->mutable_ack()->set_by("alice");
  page->mutable_ack()->set_comment("enabling wd on final_norm");
  page->mutable_ack()->set_at(1.8e9);
  page->set_starts_at(1.8e9 - 300);
  v1::Alert* warning = resp.add_alerts();
  warning->set_name("LmHeadGradShareHigh");
  warning->set_state(v1::ALERT_STATE_FIRING);
  warning->set_fingerprint("fedcba9876543210");
  warning->add_silenced_by("s-1");
  warning->add_silenced_by("s-2");
  v1::Alert* plain = resp.add_alerts();
  plain->set_name("GradNormForecast");
  plain->set_state(v1::ALERT_STATE_PENDING);

  const std::string text = gradwatch::cli::FormatAlerts(resp, 1.8e9 + 3600);
  INFO(text);
  CHECK(text.find("firing (acked)") != std::string::npos);
  CHECK_THAT(text, Catch::Contains("SINCE") && Catch::Contains("1h 5m ago"));
  CHECK(text.find("firing (silenced)") != std::string::npos);
  CHECK_THAT(text,
             Catch::Contains("GradNormContingency 0123456789abcdef acknowledged by alice at " +
                             gradwatch::cli::FormatLocalTime(1.8e9, 1.8e9 + 3600) + ": enabling wd on final_norm"));
  CHECK_THAT(gradwatch::cli::FormatLocalTime(1.8e9, 1.8e9 + 3600), Catch::EndsWith(" (1h 0m ago)"));
  CHECK(text.find("LmHeadGradShareHigh fedcba9876543210 silenced by s-1, s-2") != std::string::npos);
  CHECK(text.find("pending (") == std::string::npos);
}

TEST_CASE("human output writes every number one way, --json at full precision", "[client]") {
  using gradwatch::cli::FormatValue;
  CHECK(FormatValue(5.123456789) == "5.123");
  CHECK(FormatValue(-5.123456789) == "-5.123");
  CHECK(FormatValue(5.0) == "5");
  CHECK(FormatValue(362.04) == "362");
  CHECK(FormatValue(0.012345678) == "0.01235");
  CHECK(FormatValue(0.0001) == "0.0001");
  CHECK(FormatValue(0.00001234567) == "1.235e-5");
  CHECK(FormatValue(1e-12) == "1e-12");
  CHECK(FormatValue(999.94) == "999.9");
  CHECK(FormatValue(9999.4) == "9,999");
  CHECK(FormatValue(12345.678) == "12,346");
  CHECK(FormatValue(-1234567.0) == "-1,234,567");
  CHECK(FormatValue(2.5e20) == "2.5e+20");
  CHECK(FormatValue(0) == "0");
  CHECK(FormatValue(std::nan("")) == "NaN");
  CHECK(FormatValue(-std::numeric_limits<double>::infinity()) == "-Infinity");
  CHECK(gradwatch::cli::GroupedStep(81716) == "81,716");
  CHECK(gradwatch::cli::FormatAge(1000, 1300) == "5m 0s ago");
  CHECK(gradwatch::cli::FormatAge(1300, 1000) == "in 5m 0s");
  CHECK(gradwatch::cli::FormatAge(0, 1000) == "-");

  v1::ListRunsResponse runs;
  v1::RunInfo* run = runs.add_runs();
  run->set_run_id("moe-6b");
  run->set_state(v1::RUN_STATE_ACTIVE);
  run->set_world_size(64);
  run->set_step_count(123456);
  run->set_first_step(1);
  run->set_last_step(123456);
  run->set_steps_per_second(2.3456789);
  run->set_last_wall_time(1.8e9 - 12);
  const std::string table = gradwatch::cli::FormatRunsTable(runs, 1.8e9);
  INFO(table);
  std::istringstream lines(table);
  std::string header, row;
  std::getline(lines, header);
  std::getline(lines, row);
  CHECK_THAT(header, Catch::StartsWith("RUN") && Catch::EndsWith("LAST STEP"));
  CHECK(row.find("123,456") == header.find("STEPS  "));
  CHECK(row.find("1..123456") == header.find("FIRST..LAST"));
  CHECK(row.find("2.346") == header.find("STEPS/S"));
  CHECK(row.find("12s ago") == header.find("LAST STEP"));

  // `show` the same way: local times with their age, values rounded.
  v1::RunSummary summary;
  *summary.mutable_info() = *run;
  summary.mutable_info()->set_ended_at(1.8e9 - 5);
  v1::LatestValue* total = summary.add_latest();
  total->set_key("grad/norm/total");
  total->set_value(5.123456789012345);
  total->set_step(123456);
  const std::string shown = gradwatch::cli::FormatRunSummary(summary, 1.8e9);
  INFO(shown);
  CHECK_THAT(shown, Catch::Contains("123,456 (1..123456), 2.346 steps/s"));
  CHECK_THAT(shown, Catch::Contains(" (12s ago)") && Catch::Contains("ended at") && Catch::Contains(" (5s ago)"));
  CHECK_THAT(shown, Catch::Contains("5.123") && !Catch::Contains("5.12345"));
  CHECK(gradwatch::cli::RunSummaryToJson(summary)["latest"][0]["value"] == 5.123456789012345);
}

TEST_CASE("alerts print a recommendation they share once", "[client]") {
  v1::ListAlertsResponse resp;
  for (const char* name : {"GradNormContingency", "LmHeadGradShareHigh"}) {
    v1::Alert* a = resp.add_alerts();
    a->set_name(name);
    a->set_state(v1::ALERT_STATE_FIRING);
    (*a->mutable_annotations())["recommendation"] = "enable weight decay on final_norm.weight";
  }
  v1::Alert* other = resp.add_alerts();
  other->set_name("NonFiniteValues");
  other->set_state(v1::ALERT_STATE_FIRING);
  (*other->mutable_annotations())["recommendation"] = "look at the last checkpoint";

  const std::string text = gradwatch::cli::FormatAlerts(resp, 0);
  INFO(text);
  const std::string shared = "GradNormContingency, LmHeadGradShareHigh: enable weight decay on final_norm.weight";
  CHECK(text.find(shared) != std::string::npos);
  CHECK(text.find("enable weight decay") == text.rfind("enable weight decay"));
  CHECK(text.find("NonFiniteValues: look at the last checkpoint") != std::string::npos);
}

TEST_CASE("a replay the daemon stops acknowledging gives up after --stall-timeout and names the steps not kept",
          "[client][flow]") {
  FakeIngest ingest;
  ingest.set_ack_limit(3);
  FakeServer server({&ingest});
  std::string lines;
  for (int step = 1; step <= 6; ++step)
    lines += R"({"_step": )" + std::to_string(step) +
             R"(, "train/loss": 1.5})"
             "\n";
  TempFile file(lines);
  const auto started = std::chrono::steady_clock::now();
  const CliResult r = RunCli({"--addr", server.address(), "--json", "replay", file.path(), "--stall-timeout", "0.3"});
  INFO(r.err);
  CHECK(r.code == 1);
  CHECK(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(300));
  CHECK_THAT(r.err, Catch::Contains("acknowledged nothing for 0.3 s (--stall-timeout)"));
  CHECK_THAT(r.err, Catch::Contains("steps through 3 are kept; 3 steps not acknowledged (4 to 6)"));
  CHECK_THAT(r.err, Catch::Contains("Run the same command again"));
  const auto summary = nlohmann::json::parse(r.out);
  CHECK(summary["complete"] == false);
  CHECK(summary["stopped"] == "stalled");
  CHECK(summary["last_acked_step"] == 3);
  CHECK(summary["unacked_steps"] == 3);
  CHECK(summary["first_unacked_step"] == 4);
  CHECK(summary["last_unacked_step"] == 6);
}

TEST_CASE("the steps not acknowledged are those after the last acked one, or all of them", "[client][flow]") {
  gradwatch::cli::ReplayPlan plan;
  plan.step_numbers = {10, 20, 30, 40};
  gradwatch::cli::ReplaySummary summary;
  gradwatch::cli::CountUnackedSteps(plan, summary);
  CHECK(summary.unacked_steps == 4);
  CHECK(summary.first_unacked_step == 10u);
  CHECK(summary.last_unacked_step == 40u);
  summary.has_acked = true;
  summary.last_acked_step = 20;
  gradwatch::cli::CountUnackedSteps(plan, summary);
  CHECK(summary.unacked_steps == 2);
  CHECK(summary.first_unacked_step == 30u);
  CHECK(summary.last_unacked_step == 40u);
  summary.last_acked_step = 40;
  gradwatch::cli::CountUnackedSteps(plan, summary);
  CHECK(summary.unacked_steps == 0);
  CHECK_FALSE(summary.first_unacked_step.has_value());
  const std::string table = gradwatch::cli::FormatReplaySummary(summary);
  CHECK_THAT(table, !Catch::Contains("not acked"));
  summary.last_acked_step = 25;
  summary.stopped = "interrupted";
  summary.stop_detail = "interrupted by SIGINT";
  gradwatch::cli::CountUnackedSteps(plan, summary);
  CHECK_THAT(gradwatch::cli::FormatReplaySummary(summary), Catch::Contains("2 (steps 30 to 40)"));
}

TEST_CASE("a run or series that does not exist is an error with a did-you-mean, never all-clear", "[client]") {
  FakeQuery query;
  v1::RunSummary summary = SampleSummary();
  summary.mutable_info()->set_run_id("moe-incident-demo");
  query.runs["moe-incident-demo"] = summary;
  FakeServer server({&query});
  const std::string addr = server.address();

  // A typo of a run in `alerts` must not read as "no alerts".
  CliResult r = RunCli({"--addr", addr, "alerts", "moe-incident-dmeo"});
  CHECK(r.code == 1);
  CHECK(r.out.empty());
  CHECK_THAT(r.err, Catch::Contains("alerts of run moe-incident-dmeo") &&
                        Catch::Contains("did you mean 'moe-incident-demo'?"));
  r = RunCli({"--addr", addr, "show", "moe-incident"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("did you mean 'moe-incident-demo'?"));
  r = RunCli({"--addr", addr, "show", "llama-70b"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("`gradwatch runs --all` lists the runs"));
  r = RunCli({"--addr", addr, "series", "moe-incident-demo", "grad/norm/totl"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("did you mean 'grad/norm/total'?"));
  r = RunCli({"--addr", addr, "series", "moe-incident-dem", "grad/norm/total"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("did you mean 'moe-incident-demo'?"));
}

TEST_CASE("unknown commands get suggestions, help describes any command, and --addr wants host:port", "[client]") {
  CliResult r = RunCli({"shwo", "x"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("gradwatch: unknown command 'shwo'") && Catch::Contains("did you mean 'show'?"));
  r = RunCli({"--addr", "127.0.0.1:1", "silence", "ad", "run=x"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err,
             Catch::Contains("gradwatch silence: unknown command 'ad'") && Catch::Contains("did you mean 'add'?"));
  r = RunCli({"rules", "chek", "f.yaml"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("did you mean 'check'?"));
  r = RunCli({"xyzzy"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("unknown command 'xyzzy'") && !Catch::Contains("did you mean"));

  r = RunCli({"help"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("Subcommands:") && Catch::Contains("Exit codes"));
  r = RunCli({"help", "silence", "add"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("Add a silence"));
  r = RunCli({"help", "sho"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("no command 'sho'") && Catch::Contains("did you mean 'show'?"));

  r = RunCli({"--addr", "http://gpu-node-3:7390/", "runs"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("takes host:port, not a URL: try --addr gpu-node-3:7390"));
  r = RunCli({"--version"});
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::StartsWith("gradwatch 0."));
}

TEST_CASE("an unreachable daemon is named with what to do", "[client]") {
  FakeQuery query;
  FakeServer server({&query});
  // A port nothing listens on: the server's, once it is gone.
  std::string addr = server.address();
  server.Shutdown();
  const CliResult r = RunCli({"--addr", addr, "--timeout", "5", "runs"});
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("cannot reach the daemon at " + addr) && Catch::Contains("is gradwatchd running?"));
}

TEST_CASE("did-you-mean picks the closest name within a few edits, prefixes included", "[client]") {
  using gradwatch::Closest;
  using gradwatch::EditDistance;
  CHECK(EditDistance("kitten", "sitting") == 3);
  CHECK(EditDistance("dmeo", "demo") == 1);  // a swap is one edit
  CHECK(EditDistance("", "abc") == 3);
  const std::vector<std::string> runs = {"moe-incident-demo", "moe-6b-2026-11-20", "llama-70b"};
  CHECK(Closest("moe-incident-dmeo", runs) == "moe-incident-demo");
  CHECK(Closest("moe-6b-2026-11-2", runs) == "moe-6b-2026-11-20");
  CHECK(Closest("llama", runs) == "llama-70b");  // a prefix
  CHECK(Closest("gpt-neox", runs) == std::nullopt);
  CHECK(Closest("llama-70b", runs) == std::nullopt);  // itself: nothing to suggest
  CHECK(Closest("ab", {"xy"}) == std::nullopt);
  CHECK(Closest("shwo", {"show", "series", "silence"}) == "show");
}

TEST_CASE("durations are written as Prometheus writes them, and bad values say what to write", "[client]") {
  using gradwatch::cli::ParseDuration;
  CHECK(ParseDuration("90") == 90.0);
  CHECK(ParseDuration("2.5") == 2.5);
  CHECK(ParseDuration("90s") == 90.0);
  CHECK(ParseDuration("15m") == 900.0);
  CHECK(ParseDuration("1h30m") == 5400.0);
  CHECK(ParseDuration("2d") == 172800.0);
  CHECK(ParseDuration("1w") == 604800.0);
  CHECK(ParseDuration("500ms") == 0.5);
  CHECK(ParseDuration("1h500ms") == 3600.5);
  CHECK(ParseDuration("") == std::nullopt);
  CHECK(ParseDuration("1x") == std::nullopt);
  CHECK(ParseDuration("m") == std::nullopt);
  CHECK(ParseDuration("30m1h") == std::nullopt);  // largest unit first, as Prometheus
  CHECK(ParseDuration("1h1h") == std::nullopt);
  CHECK(ParseDuration("1 h") == std::nullopt);

  CliResult r = RunCli({"--timeout", "0", "runs"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("--timeout: must be longer than 0, not '0'"));
  r = RunCli({"silence", "add", "run=x", "--duration", "1hour"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("'1hour' is not a duration: write 90s, 15m, 1h30m, 2d or a number of seconds"));
  CHECK_THAT(r.err, !Catch::Contains("179769"));
  r = RunCli({"replay", "f", "--speed", "-1"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("--speed: must be above 0, not '-1'"));
  r = RunCli({"series", "run", "grad/norm/total", "--from", "90000", "--to", "80000"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("--to: step 80000 is before --from 90000"));

  // A silence of 1h lasts 3,600 s.
  FakeQuery query;
  FakeServer server({&query});
  r = RunCli({"--addr", server.address(), "--timeout", "30s", "silence", "add", "run=x", "--duration", "1h"});
  INFO(r.err);
  REQUIRE(r.code == 0);
  REQUIRE(query.silences.size() == 1);
  CHECK(query.silences[0].ends_at() - query.silences[0].starts_at() == Approx(3600));
}

TEST_CASE("silence list is a table with local times and how far they are", "[client]") {
  using gradwatch::cli::FormatDuration;
  CHECK(FormatDuration(2 * 3600 + 13 * 60 + 30) == "2h 13m");  // whole units, as a countdown
  CHECK(FormatDuration(-(5 * 60 + 2)) == "5m 2s");
  CHECK(FormatDuration(3 * 86400 + 4 * 3600) == "3d 4h");
  CHECK(FormatDuration(0.4) == "0s");

  FakeQuery query;
  FakeServer server({&query});
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  v1::Silence s;
  s.set_id("s1");
  (*s.mutable_matchers())["run"] = "moe-6b";
  (*s.mutable_matchers())["alertname"] = "GradNormContingency";
  s.set_starts_at(now - 302);
  s.set_ends_at(now + 2 * 3600 + 13 * 60 + 50);
  s.set_created_by("alice");
  s.set_comment("enabling wd");
  query.silences.push_back(s);
  const CliResult r = RunCli({"--addr", server.address(), "silence", "list"});
  INFO(r.out << r.err);
  REQUIRE(r.code == 0);
  std::istringstream lines(r.out);
  std::string header, row;
  std::getline(lines, header);
  std::getline(lines, row);
  CHECK_THAT(header, Catch::StartsWith("ID") && Catch::Contains("MATCHERS") && Catch::Contains("ENDS") &&
                         Catch::Contains("COMMENT"));
  CHECK(row.find("alertname=GradNormContingency run=moe-6b") == header.find("MATCHERS"));  // aligned
  CHECK_THAT(row, Catch::Contains("(5m 2s ago)") || Catch::Contains("(5m 3s ago)"));
  CHECK_THAT(row, Catch::Contains("(in 2h 13m)") || Catch::Contains("(in 2h 14m)"));
  CHECK_THAT(row, Catch::Contains("alice") && Catch::Contains("enabling wd"));
  CHECK_THAT(r.out, !Catch::Contains(std::to_string(static_cast<long long>(now) / 1000)));  // no epoch seconds
}

TEST_CASE("rules check --config loads the rules a daemon would, its overrides applied", "[client]") {
  const auto dir = std::filesystem::temp_directory_path() / ("gradwatch-rules-config-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream((dir / name).string()) << text;
    return (dir / name).string();
  };
  const std::string extra =
      write("extra.yaml",
            "groups:\n  - name: x\n    rules:\n      - alert: LossHigh\n        kind: threshold\n"
            "        series: train/loss\n        op: \">=\"\n        value: 10\n        labels: {severity: warning}\n");
  const std::string good = write("good.yaml", "alerts:\n  rule_files: [" + extra +
                                                  "]\n  overrides:\n    GradNormContingency: {value: 3}\n"
                                                  "    LossHigh: {value: 8}\n");
  CliResult r = RunCli({"--json", "rules", "check", "--config", good});
  INFO(r.out << r.err);
  CHECK(r.code == 0);
  const auto shown = nlohmann::json::parse(r.out);
  CHECK(shown["ok"] == true);
  CHECK(shown["rules"].size() == 10);  // the 9 built-in ones and LossHigh

  const std::string bad = write("bad.yaml", "log: {level: info}\nalerts:\n  overrides:\n    LossHigh: {value: 8}\n");
  r = RunCli({"rules", "check", "--config", bad});  // LossHigh is not in force without its file
  CHECK(r.code == 1);
  CHECK_THAT(r.err, Catch::Contains("bad.yaml:4: alerts.overrides.LossHigh: no rule of that name is in force"));
  r = RunCli({"rules", "check", extra, "--config", bad});  // with it, it is
  CHECK(r.code == 0);

  r = RunCli({"rules", "check"});
  CHECK(r.code == 2);
  CHECK_THAT(r.err, Catch::Contains("give rule files, --config FILE, or both"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("show says what a young window holds", "[client]") {
  gradwatch::v1::RunSummary summary;
  auto* latest = summary.add_latest();
  latest->set_key("grad/norm/total");
  latest->set_value(0.8);
  auto* f = summary.mutable_analysis()->add_forecasts();
  f->set_key("grad/norm/total");
  f->set_threshold(5);
  f->set_current_value(0.8);
  f->set_slope_per_kstep(0.1);
  f->set_window_steps(20000);
  f->set_fit_samples(300);
  f->set_fit_span_steps(299);
  f->set_reachable(true);
  f->set_steps_to_threshold(42000);
  f->set_at_step(42300);
  CHECK_THAT(gradwatch::cli::FormatDiagnosis(summary),
             Catch::Contains("(over the last 300 steps; the 20,000-step window is not yet full)"));
  f->set_fit_samples(20000);
  f->set_fit_span_steps(19999);
  CHECK_THAT(gradwatch::cli::FormatDiagnosis(summary), Catch::Contains("(over the last 20,000-step window)"));
}

// The contingency rule end to end through the real gradwatchd: the page reaches the trainer's own
// stream, and a real Alertmanager from a `gradwatch replay`, at the right step, with the
// recommendation, and resolves when the norm falls back.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

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

// ||final_norm.weight||: 362 at step 0, still rising 0.2 a step (200 per 1k steps), 4.618× its init
// norm sqrt(6144) and more: a norm gain grown without weight decay, as in the incident.
double FinalNorm(uint64_t step) { return 362.0 + 0.2 * static_cast<double>(step); }

v1::StepStats Step(uint64_t step, double total) {
  v1::StepStats s;
  s.set_step(step);
  s.mutable_total_grad()->set_norm(total);
  auto* lm = s.add_params();
  lm->set_index(1);
  lm->mutable_grad()->set_norm(total * 0.95);
  auto* fn = s.add_params();
  fn->set_index(0);
  fn->mutable_param()->set_norm(FinalNorm(step));
  return s;
}

// A daemon whose pages are not held on these short runs' first steps (alerts/warmup.h).
DaemonOptions EarlyPages() {
  DaemonOptions options;
  options.config_yaml += "alerts: {min_steps_before_page: 0}\n";
  return options;
}

bool IsContingency(const v1::DaemonMessage& m, v1::AlertState state) {
  return m.has_alert() && m.alert().name() == "GradNormContingency" && m.alert().state() == state;
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
      stream.WaitAck(100);  // the steps before 100 were evaluated before this stream read step 100
      bool firing = false;
      for (const auto& a : ListAlerts(daemon.grpc_target(), run)) {
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
  CHECK(rec.find("× its init norm 78.38, rising 200 per 1k steps") != std::string::npos);
  CHECK(fired.annotations().at("remediation_param") == "final_norm.weight");
  CHECK(fired.annotations().at("remediation_weight_decay") == "0.1");
  CHECK(fired.annotations().at("remediation_supported") == "true");
  CHECK(fired.annotations().at("cause") == "norm_gain_inflates_output");
  CHECK(resolved.fingerprint() == fired.fingerprint());
  CHECK(resolved.ends_at() >= fired.starts_at());
  stream.Close();
  return {fired.step(), resolved.step()};
}

}  // namespace

TEST_CASE("the grad-norm contingency pages the trainer's stream at s0 + 10 and resolves", "[integration]") {
  DaemonProcess daemon(EarlyPages());
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

TEST_CASE("gradwatch alerts lists a firing page with its recommendation, and rules check validates files",
          "[integration]") {
  DaemonProcess daemon(EarlyPages());
  StreamClient stream(daemon.grpc_target());
  REQUIRE(stream.Hello(IncidentHello("cli-run"), 1));
  stream.WaitAccepted();
  for (uint64_t s = 1; s <= 20; ++s) REQUIRE(stream.Step(Step(s, 6.0), s + 1));
  stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); });
  const CommandResult alerts = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "alerts", "cli-run"});
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
    out << "groups:\n  - name: g\n    rules:\n      - alert: X\n        kind: threshold\n        series: "
           "grad/norm/total\n"
           "        op: \">>\"\n        value: 5\n        labels: {severity: page}\n";
  }
  const CommandResult rejected = RunCommand({CliBinaryPath(), "rules", "check", bad});
  INFO(rejected.err);
  CHECK(rejected.exit_code == 1);
  CHECK(rejected.err.find("bad.yaml:7") != std::string::npos);
  stream.Close();
}

namespace {

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// A real prometheus-alertmanager on loopback, with no gossip port and a receiver that drops.
class Alertmanager {
 public:
  Alertmanager() : dir_("gradwatch-am"), port_(FreePort()) {
    const std::string config = (dir_.path() / "am.yml").string();
    std::ofstream(config) << "route:\n  receiver: drop\n  group_wait: 1s\nreceivers:\n  - name: drop\n";
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string log = (dir_.path() / "am.log").string();
      ::freopen(log.c_str(), "w", stderr);
      ::freopen(log.c_str(), "a", stdout);
      const std::string listen = "--web.listen-address=127.0.0.1:" + std::to_string(port_);
      const std::string cfg = "--config.file=" + config;
      const std::string storage = "--storage.path=" + (dir_.path() / "data").string();
      ::execlp("prometheus-alertmanager", "prometheus-alertmanager", cfg.c_str(), storage.c_str(), listen.c_str(),
               "--cluster.listen-address=", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(20));
    while (std::chrono::steady_clock::now() < deadline) {
      try {
        if (HttpRequest("GET", "127.0.0.1", port_, "/-/ready").status == 200) return;
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    FAIL("alertmanager did not become ready");
  }
  ~Alertmanager() {
    ::kill(pid_, SIGTERM);
    ::waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  nlohmann::json Alerts(const std::string& query = "") const {
    return nlohmann::json::parse(HttpGet("127.0.0.1", port_, "/api/v2/alerts" + query));
  }

 private:
  TempDir dir_;
  int port_;
  pid_t pid_ = -1;
};

using nlohmann::json;

// The Alertmanager test's run: its total grad norm first reaches 5 at step kHighFrom (s0).
constexpr const char* kAmRun = "am-run";
constexpr uint64_t kHighFrom = 50;
constexpr uint64_t kHighTo = 70;
constexpr uint64_t kPageStep = kHighFrom + 10;  // for_steps: 10
constexpr uint64_t kResolveStep = kHighTo + 1;  // the first step below the clear level, 4.5
constexpr uint64_t kLastStep = 90;

// Rises from 1.0 to 4.84 over steps 1..s0-1 (below 5, but above the clear level at the end), is 5.5
// on [s0, kHighTo] and 1.0 after.
double AmTotalNorm(uint64_t step) {
  if (step < kHighFrom) return 1.0 + 0.08 * static_cast<double>(step - 1);
  return step <= kHighTo ? 5.5 : 1.0;
}

// Writes steps 1..last of the run in the JSONL `gradwatch replay` reads: a header with the
// catalog (final_norm.weight: a norm gain of 6144 entries without weight decay; lm_head.weight with
// the run's 0.1), then one line per step with the lm_head carrying 81% of the squared total grad
// norm (below the LmHeadGradShareHigh warning's 90%: the page is the only alert Alertmanager gets)
// and ||final_norm|| = 362, 4.618× its init norm sqrt(6144) but flat. The evidence rule needs both a
// gain still growing and a dominant output layer: this page states no cause and advises no weight
// decay.
std::string WriteAmReplay(const TempDir& dir, uint64_t last) {
  const std::string path = (dir.path() / ("to-step-" + std::to_string(last) + ".jsonl")).string();
  std::ofstream out(path);
  const json header = {
      {"run", kAmRun},
      {"labels", {{"job", "it"}}},
      {"config", {{"hidden_size", 6144}, {"z_loss_coef", 1e-4}, {"weight_decay", 0.1}}},
      {"params",
       json::array({{{"name", "final_norm.weight"},
                     {"numel", 6144},
                     {"kind", "norm_gain"},
                     {"weight_decay", 0.0},
                     {"role", "final_norm"}},
                    {{"name", "lm_head.weight"}, {"numel", 6144 * 1024}, {"kind", "output"}, {"weight_decay", 0.1}}})}};
  out << header.dump() << "\n";
  for (uint64_t s = 1; s <= last; ++s) {
    const double total = AmTotalNorm(s);
    const json line = {{"_step", s},
                       {"_timestamp", 1.7e9 + static_cast<double>(s)},
                       {"grad/norm/total", total},
                       {"grad/norm/lm_head.weight", 0.9 * total},
                       {"params/norm/final_norm.weight", 362.0},
                       {"train/loss", 2.0}};
    out << line.dump() << "\n";
  }
  out.close();
  REQUIRE(out);
  return path;
}

CommandResult Cli(const DaemonProcess& daemon, std::vector<std::string> args) {
  std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv, std::nullopt, std::chrono::seconds(60));
}

// `gradwatch replay FILE --max --json`, which must succeed; returns the command (its JSON summary
// on stdout, the alerts the daemon sent down the replay's stream on stderr).
CommandResult Replay(const DaemonProcess& daemon, const std::string& file) {
  const CommandResult r = Cli(daemon, {"--timeout", "30", "replay", file, "--max", "--json"});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  return r;
}

// The run's GradNormContingency as `gradwatch alerts RUN --json` lists it; null when not listed
// (neither pending nor firing).
json CliContingency(const DaemonProcess& daemon) {
  const CommandResult r = Cli(daemon, {"--json", "alerts", kAmRun});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json listed = json::parse(r.out);
  json found;
  for (const json& a : listed.at("alerts")) {
    if (a["name"] == "GradNormContingency") {
      CHECK(found.is_null());  // one instance per run
      found = a;
    }
  }
  return found;
}

// The run's GradNormContingency among Alertmanager's active alerts; null when absent.
json AmPage(const Alertmanager& am) {
  json found;
  for (const json& a : am.Alerts()) {
    if (a["labels"]["alertname"] == "GradNormContingency" && a["labels"]["run"] == kAmRun) found = a;
  }
  return found;
}

// Alerts Alertmanager has received with `status` ("firing" or "resolved"), from its own /metrics.
double AmReceived(const Alertmanager& am, const std::string& status) {
  double total = 0;
  for (const MetricSample& m : ParseExposition(HttpGet("127.0.0.1", am.port(), "/metrics"))) {
    if (m.name == "alertmanager_alerts_received_total" && m.labels.count("status") && m.labels.at("status") == status) {
      total += m.value;
    }
  }
  return total;
}

}  // namespace

// The end-to-end check: a replay (the real `gradwatch replay`) whose total grad norm first
// reaches 5 at step s0 = 50 pages a real Alertmanager exactly at step s0 + 10 = 60, with the
// recommendation, and the page resolves there when the norm falls back. The history is replayed in
// three growing files; each replay resumes after the steps the daemon already holds.
TEST_CASE("the contingency pages a real Alertmanager with the recommendation, and resolves", "[integration]") {
  if (::system("command -v prometheus-alertmanager > /dev/null 2>&1") != 0) {
    FAIL("prometheus-alertmanager is not installed (tests/run.sh installs deploy/packages-test.txt)");
  }
  Alertmanager am;
  // A firing alert is sent at once and re-sent every 30 s with endsAt = now + 120 s: within this
  // test only gradwatch's resolved notification can end it in Alertmanager, not expiry, and the
  // page Alertmanager holds is the one sent at the firing step (annotations are re-rendered later).
  DaemonOptions options;
  options.config_yaml =
      "alerts:\n  external_url: http://gradwatch.test:9390\n  min_steps_before_page: 0\n  receivers:\n"
      "    - {type: alertmanager, name: am, url: http://127.0.0.1:" +
      std::to_string(am.port()) + ", resend_interval_seconds: 30}\n";
  DaemonProcess daemon(options);
  TempDir dir("gradwatch-am-replay");
  const std::string firing_log = "alert GradNormContingency firing for run am-run at step ";
  const std::string page_summary = "Total grad norm 5.5 ≥ 5 at step " + std::to_string(kPageStep) + " in run am-run";

  // Steps 1..s0+9: the norm has been ≥ 5 for 9 steps; the alert is pending since s0, nobody paged.
  {
    const CommandResult r = Replay(daemon, WriteAmReplay(dir, kPageStep - 1));
    INFO(r.out << r.err);
    const json summary = json::parse(r.out);
    CHECK(summary["run"] == kAmRun);
    CHECK(summary["steps_sent"] == kPageStep - 1);
    CHECK(summary["last_acked_step"] == kPageStep - 1);  // acked only once evaluated
    CHECK(r.err.find("alert GradNormContingency FIRING") == std::string::npos);
    const json pending = CliContingency(daemon);
    INFO(pending.dump(2));
    REQUIRE_FALSE(pending.is_null());
    CHECK(pending["state"] == "pending");
    CHECK(pending["step"] == kHighFrom);
    CHECK(daemon.LogText().find(firing_log) == std::string::npos);
    CHECK(AmPage(am).is_null());
  }

  // On to step 70: the page fires at exactly s0 + 10 and reaches Alertmanager.
  {
    const CommandResult r = Replay(daemon, WriteAmReplay(dir, kHighTo));
    INFO(r.out << r.err);
    const json summary = json::parse(r.out);
    CHECK(summary["already_held_steps"] == kPageStep - 1);
    CHECK(summary["steps_sent"] == kHighTo - kPageStep + 1);
    CHECK(summary["last_acked_step"] == kHighTo);
    // The replay's own stream got the page, once.
    const std::string streamed = "alert GradNormContingency FIRING at step " + std::to_string(kPageStep) + ",";
    CHECK(r.err.find(streamed) != std::string::npos);
    CHECK(r.err.find("alert GradNormContingency FIRING") == r.err.rfind("alert GradNormContingency FIRING"));
  }
  {
    const std::string log = daemon.LogText();
    INFO(log);
    CHECK(log.find(firing_log + std::to_string(kPageStep) + ":") != std::string::npos);
    CHECK(log.find(firing_log) == log.rfind(firing_log));  // it fired once
  }
  const json firing = CliContingency(daemon);
  INFO(firing.dump(2));
  REQUIRE_FALSE(firing.is_null());
  CHECK(firing["state"] == "firing");
  CHECK(firing["step"] == kPageStep);
  CHECK(firing["value"].get<double>() == Approx(5.5));

  json page;
  const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(20));
  while (page.is_null() && std::chrono::steady_clock::now() < deadline) {
    page = AmPage(am);
    if (page.is_null()) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  REQUIRE_FALSE(page.is_null());
  INFO(page.dump(2));
  CHECK(page["labels"]["alertname"] == "GradNormContingency");
  CHECK(page["labels"]["run"] == kAmRun);
  CHECK(page["labels"]["severity"] == "page");
  CHECK(page["status"]["state"] == "active");
  CHECK(page["annotations"]["summary"] == page_summary);
  const std::string rec = page["annotations"]["recommendation"].get<std::string>();
  INFO(rec);
  CHECK(rec.find("No cause found in the per-parameter norms") != std::string::npos);
  CHECK(rec.find("lm_head.weight (81% of the squared grad norm)") != std::string::npos);
  CHECK(rec.find("enable weight decay") == std::string::npos);
  const std::string description = page["annotations"]["description"].get<std::string>();
  CHECK(description.find("final_norm.weight at 4.618× its init norm, not rising") != std::string::npos);
  CHECK(page["annotations"]["remediation_supported"] == "false");
  CHECK(page["annotations"]["cause"] == "none");
  CHECK(page["annotations"]["recommendation"] == firing["annotations"]["recommendation"]);
  CHECK(page["generatorURL"] == "http://gradwatch.test:9390/runs/am-run");
  CHECK(AmReceived(am, "resolved") == 0);

  // The norm falls back to 1.0 from step 71: the page resolves at once, in Alertmanager too.
  {
    const CommandResult r = Replay(daemon, WriteAmReplay(dir, kLastStep));
    INFO(r.out << r.err);
    const json summary = json::parse(r.out);
    CHECK(summary["already_held_steps"] == kHighTo);
    CHECK(summary["last_acked_step"] == kLastStep);
    CHECK(r.err.find("alert GradNormContingency RESOLVED at step " + std::to_string(kResolveStep) + ",") !=
          std::string::npos);
  }
  CHECK(daemon.LogText().find("alert GradNormContingency resolved for run am-run at step " +
                              std::to_string(kResolveStep) + "\n") != std::string::npos);
  CHECK(CliContingency(daemon).is_null());
  bool resolved = false;
  const auto resolve_deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(20));
  while (!resolved && std::chrono::steady_clock::now() < resolve_deadline) {
    resolved = AmPage(am).is_null() && AmReceived(am, "resolved") >= 1;
    if (!resolved) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  CHECK(resolved);
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("rules reload via the CLI and SIGHUP keeps the old rules when a file is invalid, and silences and acks",
          "[integration]") {
  TempDir rules_dir("gradwatch-rules-reload");
  const std::string rules = (rules_dir.path() / "extra.yaml").string();
  const std::string good_rules =
      "groups:\n  - name: extra\n    rules:\n      - alert: LossHigh\n        kind: threshold\n"
      "        series: train/loss\n        op: \">=\"\n        value: 10\n        labels: {severity: warning}\n"
      "        annotations: {summary: \"loss {{ value }}\"}\n";
  std::ofstream(rules) << good_rules;
  DaemonOptions options;
  options.config_yaml = "alerts:\n  rule_files: [" + rules + "]\n";
  DaemonProcess daemon(options);
  auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv);
  };

  const CommandResult reloaded = cli({"rules", "reload"});
  INFO(reloaded.out << reloaded.err);
  CHECK(reloaded.exit_code == 0);
  CHECK(reloaded.out.find("10 rule(s) in force") != std::string::npos);

  std::ofstream(rules) << "groups:\n  - name: extra\n    rules:\n      - alert: LossHigh\n        kind: nope\n";
  const CommandResult refused = cli({"rules", "reload"});
  INFO(refused.err);
  CHECK(refused.exit_code == 1);
  CHECK(refused.err.find("unchanged") != std::string::npos);
  CHECK(refused.err.find("extra.yaml:5") != std::string::npos);
  daemon.Signal(SIGHUP);
  const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(std::chrono::seconds(10));
  while (daemon.LogText().find("rule reload refused") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(daemon.LogText().find("rule reload refused") != std::string::npos);
  CHECK(daemon.running());
  std::ofstream(rules) << good_rules;
  CHECK(cli({"rules", "reload"}).out.find("10 rule(s) in force") != std::string::npos);

  // A page, then an ack by fingerprint; an unknown fingerprint is refused.
  StreamClient stream(daemon.grpc_target());
  REQUIRE(stream.Hello(IncidentHello("ack-run"), 1));
  stream.WaitAccepted();
  for (uint64_t s = 1; s <= 20; ++s) REQUIRE(stream.Step(Step(s, 6.0), s + 1));
  const v1::Alert page =
      stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); }).alert();
  const CommandResult listed = cli({"alerts", "ack-run"});
  CHECK(listed.out.find(page.fingerprint()) != std::string::npos);
  CHECK(cli({"ack", page.fingerprint(), "--by", "oncall", "--comment", "looking"}).exit_code == 0);
  const CommandResult acked = cli({"alerts", "ack-run"});
  INFO(acked.out);
  CHECK(acked.out.find("firing (acked)") != std::string::npos);
  CHECK(acked.out.find("GradNormContingency " + page.fingerprint() + " acknowledged by oncall at ") !=
        std::string::npos);
  CHECK(cli({"ack", "0123456789abcdef"}).exit_code == 1);

  const CommandResult added = cli({"silence", "add", "run=ack-run", "--duration", "600", "--comment", "maintenance"});
  INFO(added.out << added.err);
  REQUIRE(added.exit_code == 0);
  const std::string id = added.out.substr(std::string("silence ").size(), added.out.find(" added") - 8);
  CHECK(cli({"silence", "list"}).out.find("run=ack-run") != std::string::npos);
  CHECK(cli({"alerts", "ack-run"}).out.find("GradNormContingency " + page.fingerprint() + " silenced by " + id) !=
        std::string::npos);
  CHECK(cli({"silence", "remove", id}).exit_code == 0);
  CHECK(cli({"silence", "list"}).out.find("no silences") != std::string::npos);
  CHECK(cli({"silence", "add", "run=~("}).exit_code == 2);
  // The daemon's refusal reads as a sentence, not as a gRPC code.
  const CommandResult too_long = cli({"silence", "add", "run=ack-run", "--duration", "31536000"});
  INFO(too_long.err);
  CHECK(too_long.exit_code == 1);
  CHECK(too_long.err.find("gradwatch: the daemon refused ") != std::string::npos);
  CHECK(too_long.err.find("code 3") == std::string::npos);
  stream.Close();
}

TEST_CASE("silences take amtool's matchers (=, !=, =~, !~) and keep them across a restart", "[integration]") {
  TempDir data("gradwatch-silence-matchers");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  auto cli = [&](std::vector<std::string> args) { return Cli(daemon, std::move(args)); };
  // Three runs page.
  std::map<std::string, std::string> fingerprints;
  for (const std::string run : {"moe-a", "moe-b", "dense-c"}) {
    StreamClient stream(daemon.grpc_target());
    REQUIRE(stream.Hello(IncidentHello(run), 1));
    stream.WaitAccepted();
    for (uint64_t s = 1; s <= 20; ++s) REQUIRE(stream.Step(Step(s, 6.0), s + 1));
    fingerprints[run] =
        stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); })
            .alert()
            .fingerprint();
    stream.Close();
  }
  const auto silenced_by = [&](const std::string& run) {
    const CommandResult r = cli({"alerts", run});
    INFO(r.out << r.err);
    const std::string marker = "GradNormContingency " + fingerprints[run] + " silenced by ";
    const size_t at = r.out.find(marker);
    if (at == std::string::npos) return std::string();
    return r.out.substr(at + marker.size(), r.out.find_first_of(" \n", at + marker.size()) - at - marker.size());
  };
  const auto add = [&](std::vector<std::string> matchers) {
    matchers.insert(matchers.begin(), {"silence", "add"});
    matchers.insert(matchers.end(), {"--duration", "10m"});
    const CommandResult r = cli(matchers);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    return r.out.substr(std::string("silence ").size(), r.out.find(" added") - 8);
  };

  // A regular expression is anchored: "moe-.*" matches moe-a and moe-b, not dense-c.
  const std::string moe = add({"run=~moe-.*", "alertname!~Loss.*", "severity!=info"});
  CHECK(silenced_by("moe-a") == moe);
  CHECK(silenced_by("moe-b") == moe);
  CHECK(silenced_by("dense-c").empty());
  REQUIRE(cli({"silence", "remove", moe}).exit_code == 0);
  CHECK(silenced_by("moe-a").empty());

  // != and !~: everything but moe-a; a quoted value; a bare word is an alertname.
  const std::string others = add({"GradNormContingency", "run!=moe-a", "run!~\"dense-x|other\""});
  CHECK(silenced_by("moe-a").empty());
  CHECK(silenced_by("moe-b") == others);
  CHECK(silenced_by("dense-c") == others);
  const CommandResult listed = cli({"silence", "list"});
  INFO(listed.out);
  CHECK_THAT(listed.out, Catch::Contains("alertname=GradNormContingency run!=moe-a run!~\"dense-x|other\""));
  const CommandResult as_json = cli({"--json", "silence", "list"});
  const json matchers = json::parse(as_json.out)["silences"][0]["label_matchers"];
  INFO(as_json.out);
  REQUIRE(matchers.size() == 3);
  CHECK(matchers[2] == json({{"name", "run"}, {"type", "not_regex"}, {"value", "dense-x|other"}}));

  // Kept across a restart, with the same effect.
  REQUIRE(daemon.Restart() == 0);
  CHECK(silenced_by("moe-a").empty());
  CHECK(silenced_by("dense-c") == others);
  CHECK_THAT(cli({"silence", "list"}).out, Catch::Contains("run!~\"dense-x|other\""));

  // Mistakes are usage errors that say what is wrong.
  CommandResult bad = cli({"silence", "add", "run=~moe-(", "--duration", "1h"});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("not a regular expression (RE2 syntax): missing )"));
  bad = cli({"silence", "add", "run=~.*", "--duration", "1h"});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("it would mute every alert"));
  bad = cli({"silence", "add", "run!moe", "--duration", "1h"});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("'!' must be followed by = or ~"));
  bad = cli({"silence", "add", "9run=moe", "--duration", "1h"});
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.err, Catch::Contains("is not a label name"));

  // The daemon checks what any client sends, not only this CLI.
  auto stub = v1::Query::NewStub(grpc::CreateChannel(daemon.grpc_target(), grpc::InsecureChannelCredentials()));
  v1::AddSilenceRequest request;
  request.mutable_silence()->set_ends_at(4e9);
  v1::Matcher* m = request.mutable_silence()->add_label_matchers();
  m->set_name("run");
  m->set_type(v1::MATCH_TYPE_REGEX);
  m->set_value("(unclosed");
  v1::AddSilenceResponse response;
  grpc::ClientContext context;
  grpc::Status status = stub->AddSilence(&context, request, &response);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(status.error_message(), Catch::Contains("not a regular expression"));
  m->set_type(static_cast<v1::MatchType>(9));
  grpc::ClientContext context2;
  status = stub->AddSilence(&context2, request, &response);
  CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(status.error_message(), Catch::Contains("unknown match type 9"));
  CHECK(cli({"silence", "list"}).out.find("unclosed") == std::string::npos);
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("every stream of a run hears its alerts, a resumed one the page its rewind resolved, another run none",
          "[integration]") {
  DaemonProcess daemon;
  const auto hello = [](const std::string& run, uint32_t rank, uint32_t world) {
    return MakeHello(run, rank, world, {{"w", v1::PARAM_KIND_MLP}});
  };
  StreamClient rank0(daemon.grpc_target()), rank1(daemon.grpc_target()), quiet(daemon.grpc_target());
  REQUIRE(rank0.Hello(hello("two-ranks", 0, 2), 1));
  REQUIRE(rank1.Hello(hello("two-ranks", 1, 2), 1));
  REQUIRE(quiet.Hello(hello("quiet", 0, 1), 1));
  rank0.WaitAccepted();
  rank1.WaitAccepted();
  quiet.WaitAccepted();
  for (uint64_t s = 1; s <= 20; ++s) {
    v1::StepStats shard;
    shard.set_step(s);
    shard.mutable_total_grad()->set_norm(4.0);  // two ranks: a total of 4√2 ≈ 5.66
    REQUIRE(rank0.Step(shard, s + 1));
    REQUIRE(rank1.Step(shard, s + 1));
    v1::StepStats low;
    low.set_step(s);
    low.mutable_total_grad()->set_norm(1.0);
    REQUIRE(quiet.Step(low, s + 1));
  }
  const auto firing = [](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); };
  const v1::Alert heard0 = rank0.WaitFor(firing).alert();
  const v1::Alert heard1 = rank1.WaitFor(firing).alert();
  CHECK(heard0.step() == 11);
  CHECK(heard0.labels().at("run") == "two-ranks");
  CHECK(heard1.fingerprint() == heard0.fingerprint());
  quiet.WaitAck(20);
  for (const v1::DaemonMessage& m : quiet.Received()) CHECK_FALSE(m.has_alert());

  // Rank 0 crashes and resumes from step 5: the page came from the abandoned branch, and the
  // resumed stream hears it resolve, after its Accepted.
  rank0.Close();
  StreamClient resumed(daemon.grpc_target());
  v1::Hello resume = hello("two-ranks", 0, 2);
  resume.set_resume_from_step(5);
  REQUIRE(resumed.Hello(resume, 1));
  const v1::Alert resolved =
      resumed.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_RESOLVED); }).alert();
  CHECK(resolved.fingerprint() == heard0.fingerprint());
  const std::vector<v1::DaemonMessage> answers = resumed.Received();
  REQUIRE_FALSE(answers.empty());
  CHECK(answers.front().has_accepted());
  CHECK(ListAlerts(daemon.grpc_target(), "two-ranks").empty());
  for (const v1::DaemonMessage& m : quiet.Received()) CHECK_FALSE(m.has_alert());
}

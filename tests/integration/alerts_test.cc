// The contingency rule end to end through the real gradwatchd: the page reaches the trainer's own
// stream at the right step, with the recommendation, and resolves when the norm falls back.
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
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
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

}  // namespace

TEST_CASE("the contingency pages a real Alertmanager with the recommendation, and resolves", "[integration]") {
  if (::system("command -v prometheus-alertmanager > /dev/null 2>&1") != 0) {
    FAIL("prometheus-alertmanager is not installed (tests/run.sh installs deploy/packages-test.txt)");
  }
  Alertmanager am;
  DaemonOptions options;
  options.config_yaml = "alerts:\n  external_url: http://gradwatch.test:9390\n  receivers:\n"
                        "    - {type: alertmanager, name: am, url: http://127.0.0.1:" +
                        std::to_string(am.port()) + ", resend_interval_seconds: 1}\n";
  DaemonProcess daemon(options);
  StreamClient stream(daemon.grpc_target());
  REQUIRE(stream.Hello(IncidentHello("am-run"), 1));
  stream.WaitAccepted();
  uint64_t seq = 2;
  for (uint64_t s = 1; s <= 70; ++s) REQUIRE(stream.Step(Step(s, s >= 50 ? 5.5 : 1.0), seq++));
  CHECK(stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_FIRING); })
            .alert()
            .step() == 60);

  nlohmann::json page;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (page.is_null() && std::chrono::steady_clock::now() < deadline) {
    for (const auto& a : am.Alerts()) {
      if (a["labels"]["alertname"] == "GradNormContingency") page = a;
    }
    if (page.is_null()) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  REQUIRE_FALSE(page.is_null());
  INFO(page.dump(2));
  CHECK(page["labels"]["run"] == "am-run");
  CHECK(page["labels"]["severity"] == "page");
  CHECK(page["status"]["state"] == "active");
  CHECK(page["annotations"]["recommendation"].get<std::string>().find("enable weight decay on final_norm.weight") !=
        std::string::npos);
  CHECK(page["annotations"]["summary"].get<std::string>().find("60") != std::string::npos);
  CHECK(page["generatorURL"] == "http://gradwatch.test:9390/runs/am-run");

  // The norm falls back: the page resolves in Alertmanager.
  for (uint64_t s = 71; s <= 80; ++s) REQUIRE(stream.Step(Step(s, 1.0), seq++));
  stream.WaitFor([](const v1::DaemonMessage& m) { return IsContingency(m, v1::ALERT_STATE_RESOLVED); });
  bool resolved = false;
  const auto resolve_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!resolved && std::chrono::steady_clock::now() < resolve_deadline) {
    resolved = true;
    for (const auto& a : am.Alerts()) {
      if (a["labels"]["alertname"] == "GradNormContingency" && a["status"]["state"] == "active") resolved = false;
    }
    if (!resolved) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  CHECK(resolved);
  stream.Close();
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("rules reload via the CLI and SIGHUP keeps the old rules when a file is invalid; silences and acks",
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
  CHECK(reloaded.out.find("8 rule(s) in force") != std::string::npos);

  std::ofstream(rules) << "groups:\n  - name: extra\n    rules:\n      - alert: LossHigh\n        kind: nope\n";
  const CommandResult refused = cli({"rules", "reload"});
  INFO(refused.err);
  CHECK(refused.exit_code == 1);
  CHECK(refused.err.find("unchanged") != std::string::npos);
  CHECK(refused.err.find("extra.yaml:5") != std::string::npos);
  daemon.Signal(SIGHUP);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (daemon.LogText().find("rule reload refused") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  CHECK(daemon.LogText().find("rule reload refused") != std::string::npos);
  CHECK(daemon.running());
  std::ofstream(rules) << good_rules;
  CHECK(cli({"rules", "reload"}).out.find("8 rule(s) in force") != std::string::npos);

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
  CHECK(cli({"ack", "0123456789abcdef"}).exit_code == 1);

  const CommandResult added = cli({"silence", "add", "run=ack-run", "--duration", "600", "--comment", "maintenance"});
  INFO(added.out << added.err);
  REQUIRE(added.exit_code == 0);
  const std::string id = added.out.substr(std::string("silence ").size(), added.out.find(" added") - 8);
  CHECK(cli({"silence", "list"}).out.find("run=ack-run") != std::string::npos);
  CHECK(cli({"silence", "remove", id}).exit_code == 0);
  CHECK(cli({"silence", "list"}).out.find("no silences") != std::string::npos);
  CHECK(cli({"silence", "add", "nonsense"}).exit_code == 2);
  stream.Close();
}

// Alert states across daemon restarts, receiver outages and the end of runs, through the real
// gradwatchd: a page survives a crash and is sent resolved exactly once; a receiver that is down
// across a restart gets every state change exactly once and in order; a page resolves when its
// run ends and does not come back after a restart; silences survive a restart.
#include <catch2/catch.hpp>

#include <csignal>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"
#include "tests/unit/notify/test_receiver.h"

using namespace gradwatch;
using namespace gradwatch::testing;
using nlohmann::json;

namespace {

constexpr const char* kPage = "GradNormContingency";

DaemonOptions WithWebhook(const TempDir& data, const notify::testing::TestReceiver& receiver,
                          const std::string& more_yaml = "") {
  DaemonOptions options;
  options.data_dir = data.path();
  options.config_yaml = "log: {format: text, level: debug}\n" + more_yaml +
                        "alerts:\n  receivers:\n"
                        "    - {type: webhook, name: hook, url: " +
                        receiver.url("/hook") + "}\n";
  return options;
}

v1::StepStats Step(uint64_t step, double total) {
  v1::StepStats s;
  s.set_step(step);
  s.mutable_total_grad()->set_norm(total);
  return s;
}

// Sends steps [from, to] with the given total grad norm and waits until the last is acked (so
// every one of them was evaluated).
void Send(StreamClient& stream, uint64_t from, uint64_t to, double total, uint64_t* seq) {
  for (uint64_t s = from; s <= to; ++s) REQUIRE(stream.Step(Step(s, total), (*seq)++));
  stream.WaitAck(to);
}

void Hello(StreamClient& stream, const std::string& run, uint64_t* seq) {
  REQUIRE(stream.Hello(MakeHello(run, 0, 1, {}), (*seq)++));
  stream.WaitAccepted();
}

// One alert of a webhook body the receiver accepted.
struct Notice {
  std::string status;
  std::string alertname;
  std::string run;
  std::string fingerprint;
  bool operator==(const Notice&) const = default;
};

// Every alert of every webhook body delivered, in order.
std::vector<Notice> Delivered(const notify::testing::TestReceiver& receiver) {
  std::vector<Notice> out;
  for (const auto& r : receiver.Delivered()) {
    const json body = json::parse(r.body);
    for (const json& a : body.at("alerts")) {
      out.push_back({a.at("status").get<std::string>(), a.at("labels").at("alertname").get<std::string>(),
                     a.at("labels").at("run").get<std::string>(), a.at("fingerprint").get<std::string>()});
    }
  }
  return out;
}

// Waits until the daemon has marked `count` notifications to the webhook delivered. The receiver
// holds a request before the daemon has read its answer and marked the entry: an entry not yet
// marked when the daemon is killed or stopped is sent again after the restart (under the same
// Idempotency-Key, as promised), which a test of what a restart sends must not race with.
bool WaitForMarkedDelivered(const DaemonProcess& daemon, double count) {
  return WaitUntil([&] {
    return ParseMetric(daemon.ScrapeMetrics(), "gradwatch_notifications_sent_total", {{"receiver", "hook"}})
               .value_or(0) >= count;
  });
}

std::optional<v1::Alert> FindPage(const DaemonProcess& daemon, const std::string& run) {
  for (const v1::Alert& a : ListAlerts(daemon.grpc_target(), run)) {
    if (a.name() == kPage) return a;
  }
  return std::nullopt;
}

// gradwatch_alerts samples of the contingency page for `run`, by alertstate.
std::map<std::string, double> PageSamples(const std::string& exposition, const std::string& run) {
  std::map<std::string, double> out;
  for (const MetricSample& m : ParseExposition(exposition)) {
    if (m.name == "gradwatch_alerts" && m.labels.count("alertname") && m.labels.at("alertname") == kPage &&
        m.labels.count("run") && m.labels.at("run") == run) {
      out[m.labels.at("alertstate")] = m.value;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("a firing page survives a crash and is sent resolved exactly once", "[integration]") {
  notify::testing::TestReceiver receiver;
  TempDir data("gradwatch-persist");
  DaemonProcess daemon(WithWebhook(data, receiver));
  uint64_t seq = 1;
  {
    StreamClient stream(daemon.grpc_target());
    Hello(stream, "crash-run", &seq);
    Send(stream, 1, 49, 1.0, &seq);
    Send(stream, 50, 70, 5.5, &seq);
    const v1::Alert fired =
        stream.WaitFor([](const v1::DaemonMessage& m) { return m.has_alert() && m.alert().name() == kPage; }).alert();
    CHECK(fired.step() == 60);
    stream.Close();
  }
  // Once the page is delivered it is in the store: it was written with its notification.
  REQUIRE(receiver.WaitForDelivered(1, std::chrono::seconds(20)));
  REQUIRE(WaitForMarkedDelivered(daemon, 1));
  const std::optional<v1::Alert> before = FindPage(daemon, "crash-run");
  REQUIRE(before);

  daemon.Signal(SIGKILL);
  CHECK(daemon.Stop() == 128 + SIGKILL);
  daemon.Restart();
  INFO(daemon.LogText());
  CHECK(daemon.LogText().find("restored 1 firing") != std::string::npos);
  const std::optional<v1::Alert> after = FindPage(daemon, "crash-run");
  REQUIRE(after);
  CHECK(after->state() == v1::ALERT_STATE_FIRING);
  CHECK(after->fingerprint() == before->fingerprint());
  CHECK(after->step() == 60);
  CHECK(after->starts_at() == before->starts_at());
  const std::string restored_metrics = daemon.ScrapeMetrics();
  CHECK(PageSamples(restored_metrics, "crash-run") == std::map<std::string, double>{{"firing", 1.0}});
  if (!PromtoolPath().empty()) {  // the alerting families pass Prometheus's own linter
    const CommandResult lint = RunCommand({PromtoolPath(), "check", "metrics"}, restored_metrics);
    INFO(lint.out << lint.err);
    CHECK(lint.exit_code == 0);
    CHECK(lint.out.empty());
    CHECK(lint.err.empty());
  }

  // The trainer comes back and the norm has fallen back.
  StreamClient stream(daemon.grpc_target());
  Hello(stream, "crash-run", &seq);
  Send(stream, 71, 90, 1.0, &seq);
  const v1::Alert resolved = stream
                                 .WaitFor([](const v1::DaemonMessage& m) {
                                   return m.has_alert() && m.alert().state() == v1::ALERT_STATE_RESOLVED;
                                 })
                                 .alert();
  CHECK(resolved.fingerprint() == before->fingerprint());
  CHECK(resolved.step() == 71);
  CHECK_FALSE(FindPage(daemon, "crash-run"));
  REQUIRE(receiver.WaitForDelivered(2, std::chrono::seconds(20)));
  std::this_thread::sleep_for(std::chrono::seconds(2));  // nothing more may follow
  const std::vector<Notice> notices = Delivered(receiver);
  const std::vector<Notice> expected = {{"firing", kPage, "crash-run", before->fingerprint()},
                                        {"resolved", kPage, "crash-run", before->fingerprint()}};
  CHECK(notices == expected);
  const std::string metrics = daemon.ScrapeMetrics();
  CHECK(ParseMetric(metrics, "gradwatch_notifications_sent_total", {{"receiver", "hook"}}) == 1.0);  // this process
  CHECK(ParseMetric(metrics, "gradwatch_notification_queue_depth", {{"receiver", "hook"}}) == 0.0);
  CHECK(ParseMetric(metrics, "gradwatch_alert_transitions_total", {{"to", "resolved"}}) == 1.0);
  CHECK(ParseMetric(metrics, "gradwatch_alert_store_write_failures_total") == 0.0);
  CHECK(PageSamples(metrics, "crash-run").empty());
  stream.Close();
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("a receiver down across a restart gets every state change once and in order", "[integration]") {
  notify::testing::TestReceiver receiver;
  receiver.Down();
  TempDir data("gradwatch-persist-down");
  DaemonProcess daemon(WithWebhook(data, receiver));
  uint64_t seq = 1;
  {
    StreamClient stream(daemon.grpc_target());
    Hello(stream, "down-run", &seq);
    Send(stream, 1, 49, 1.0, &seq);
    Send(stream, 50, 60, 5.5, &seq);    // fires at 60
    Send(stream, 61, 70, 1.0, &seq);    // resolves at 61
    Send(stream, 100, 110, 6.0, &seq);  // the second incident fires at 110
    stream.Close();
  }
  REQUIRE(FindPage(daemon, "down-run"));
  // The failed attempts are counted (by this process: counters start again with the next).
  CHECK(WaitUntil(
      [&] {
        return ParseMetric(daemon.ScrapeMetrics(), "gradwatch_notification_retries_total", {{"receiver", "hook"}})
                   .value_or(0) >= 1.0;
      },
      std::chrono::seconds(30)));
  daemon.Restart();  // SIGTERM while the receiver is still down and the page firing
  REQUIRE(FindPage(daemon, "down-run"));
  {
    StreamClient stream(daemon.grpc_target());
    Hello(stream, "down-run", &seq);
    Send(stream, 111, 120, 1.0, &seq);  // resolves at 111: only the restored state knows it fired
    stream.Close();
  }
  CHECK_FALSE(FindPage(daemon, "down-run"));
  CHECK(receiver.Delivered().empty());

  receiver.Up();
  // Retries back off (0.5 s, doubling, persisted across the restart): allow for a few.
  REQUIRE(receiver.WaitForDelivered(4, std::chrono::seconds(45)));
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const std::vector<Notice> notices = Delivered(receiver);
  REQUIRE(notices.size() == 4);
  CHECK(notices[0].status == "firing");
  CHECK(notices[1].status == "resolved");
  CHECK(notices[2].status == "firing");
  CHECK(notices[3].status == "resolved");
  for (const Notice& n : notices) {
    CHECK(n.alertname == kPage);
    CHECK(n.run == "down-run");
    CHECK(n.fingerprint == notices[0].fingerprint);
  }
  const std::string metrics = daemon.ScrapeMetrics();
  CHECK(ParseMetric(metrics, "gradwatch_notifications_sent_total", {{"receiver", "hook"}}) == 4.0);
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("a page resolves when its run ends, and stays resolved after a restart", "[integration]") {
  notify::testing::TestReceiver receiver;
  TempDir data("gradwatch-persist-end");
  DaemonProcess daemon(WithWebhook(data, receiver, "runs: {end_after_seconds: 1}\n"));
  uint64_t seq = 1;
  {
    StreamClient stream(daemon.grpc_target());
    Hello(stream, "ending-run", &seq);
    Send(stream, 1, 20, 6.0, &seq);  // fires at 11
    REQUIRE(FindPage(daemon, "ending-run"));
    stream.Close();
  }
  // The job is gone: once the run ends its page resolves instead of staying open for ever.
  REQUIRE(receiver.WaitForDelivered(2, std::chrono::seconds(20)));
  REQUIRE(WaitForMarkedDelivered(daemon, 2));
  CHECK_FALSE(FindPage(daemon, "ending-run"));
  CHECK(daemon.LogText().find("run ending-run: ended") != std::string::npos);

  daemon.Restart();
  CHECK_FALSE(FindPage(daemon, "ending-run"));  // an ended run is not evaluated again
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const std::vector<Notice> notices = Delivered(receiver);
  REQUIRE(notices.size() == 2);
  CHECK(notices[0].status == "firing");
  CHECK(notices[1].status == "resolved");
  CHECK(daemon.Stop() == 0);
}

TEST_CASE("silences survive a restart, and ended ones do not", "[integration]") {
  TempDir data("gradwatch-persist-silence");
  DaemonOptions options;
  options.data_dir = data.path();
  DaemonProcess daemon(options);
  auto cli = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv);
  };
  const CommandResult kept = cli({"silence", "add", "run=maint-run", "--duration", "3600", "--comment", "kept"});
  INFO(kept.out << kept.err);
  REQUIRE(kept.exit_code == 0);
  REQUIRE(cli({"silence", "add", "run=short-run", "--duration", "1"}).exit_code == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  CHECK(daemon.Restart() == 0);

  const CommandResult listed = cli({"silence", "list"});
  INFO(listed.out << listed.err);
  CHECK(listed.exit_code == 0);
  CHECK(listed.out.find("run=maint-run") != std::string::npos);
  CHECK(listed.out.find("kept") != std::string::npos);
  CHECK(listed.out.find("run=short-run") == std::string::npos);
  CHECK(daemon.Stop() == 0);
}

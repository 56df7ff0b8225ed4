#include "gradwatch/monitor.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "tests/unit/client/fake_daemon.h"

using gradwatch::client::Monitor;
using gradwatch::client::MonitorOptions;
using gradwatch::testing::FakeIngest;
using gradwatch::testing::FakeServer;
using gradwatch::testing::Scaled;
using namespace std::chrono_literals;
namespace v1 = gradwatch::v1;

namespace {

MonitorOptions Options(const std::string& address) {
  MonitorOptions o;
  o.address = address;
  o.hello.set_run_id("unit-run");
  o.hello.set_world_size(1);
  auto* p = o.hello.add_params();
  p->set_name("final_norm.weight");
  p->set_kind(v1::PARAM_KIND_NORM_GAIN);
  o.initial_backoff = 20ms;
  o.max_backoff = 200ms;
  o.close_grace = 200ms;
  return o;
}

v1::StepStats Step(uint64_t n) {
  v1::StepStats s;
  s.set_step(n);
  s.set_loss(2.0);
  auto* p = s.add_params();
  p->set_index(0);
  p->mutable_param()->set_norm(78.4 + static_cast<double>(n));
  return s;
}

std::vector<uint64_t> Range(uint64_t first, uint64_t last) {
  std::vector<uint64_t> v;
  for (uint64_t n = first; n <= last; ++n) v.push_back(n);
  return v;
}

// A port nothing listens on: bind a server, note its port, shut it down.
int UnusedPort() {
  FakeIngest ingest;
  FakeServer server({&ingest});
  return server.port();
}

}  // namespace

TEST_CASE("monitor sends hello then steps in order and flush waits for durable acks", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  REQUIRE(server.ok());
  Monitor monitor(Options(server.address()));
  monitor.Start();
  for (uint64_t n = 1; n <= 100; ++n) REQUIRE(monitor.Log(Step(n)));
  REQUIRE(monitor.Flush(10s));

  const auto messages = ingest.Messages();
  REQUIRE(messages.size() == 101);
  REQUIRE(messages[0].has_hello());
  CHECK(messages[0].hello().run_id() == "unit-run");
  CHECK(messages[0].hello().client() == gradwatch::client::kClientName);
  CHECK(ingest.Steps() == Range(1, 100));
  for (size_t i = 1; i < messages.size(); ++i) CHECK(messages[i].seq() > messages[i - 1].seq());

  const auto stats = monitor.Stats();
  CHECK(stats.connected);
  CHECK(stats.has_acked);
  CHECK(stats.acked_through_step == 100);
  CHECK(stats.sent == 100);
  CHECK(stats.dropped == 0);
  CHECK(stats.queued == 0);
  CHECK(stats.unacked == 0);
  CHECK(stats.errors == 0);
  monitor.Stop();
  monitor.Stop();
}

TEST_CASE("Finish says Goodbye after every step is durable and returns when the daemon confirms", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  REQUIRE(server.ok());
  Monitor monitor(Options(server.address()));
  monitor.Start();
  for (uint64_t n = 1; n <= 5; ++n) REQUIRE(monitor.Log(Step(n)));
  CHECK(monitor.Finish(10s, v1::GOODBYE_REASON_FINISHED, "reached max_steps"));
  const auto messages = ingest.Messages();
  REQUIRE(messages.size() == 7);
  REQUIRE(messages.back().has_goodbye());
  CHECK(messages.back().goodbye().reason() == v1::GOODBYE_REASON_FINISHED);
  CHECK(messages.back().goodbye().message() == "reached max_steps");
  CHECK(messages.back().seq() > messages[5].seq());
  CHECK(monitor.Stats().finished);
  CHECK_FALSE(monitor.Finish(1s));  // stopped: nothing more to say
}

TEST_CASE("Finish sends no Goodbye while a step is not durable", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  REQUIRE(server.ok());
  ingest.set_ack_limit(3);  // steps 4 and 5 are never acknowledged
  Monitor monitor(Options(server.address()));
  monitor.Start();
  for (uint64_t n = 1; n <= 5; ++n) REQUIRE(monitor.Log(Step(n)));
  REQUIRE(ingest.WaitForMessages(6, 10s));
  CHECK_FALSE(monitor.Finish(300ms));
  for (const auto& m : ingest.Messages()) CHECK_FALSE(m.has_goodbye());
  CHECK_FALSE(monitor.Stats().finished);
}

TEST_CASE("monitor reconnects after the daemon restarts and resends what it did not receive", "[client]") {
  auto first = std::make_unique<FakeIngest>();
  first->set_ack_limit(50);
  auto server = std::make_unique<FakeServer>(std::vector<grpc::Service*>{first.get()});
  REQUIRE(server->ok());
  const int port = server->port();

  std::atomic<int> accepted_calls{0};
  MonitorOptions options = Options(server->address());
  options.on_accepted = [&](const v1::Accepted&) { ++accepted_calls; };
  Monitor monitor(options);
  monitor.Start();
  for (uint64_t n = 1; n <= 100; ++n) REQUIRE(monitor.Log(Step(n)));
  REQUIRE(first->WaitForMessages(101, 10s));
  CHECK_FALSE(monitor.Flush(200ms));
  auto stats = monitor.Stats();
  CHECK(stats.acked_through_step == 50);
  CHECK(stats.unacked == 50);

  server->Shutdown();
  // The restarted daemon had made 50 durable and still knows it received up to 70.
  FakeIngest second(FakeIngest::Progress{true, 50, true, 70});
  FakeServer restarted({&second}, port);
  REQUIRE(restarted.ok());
  // Logged while the daemon was away: queued, sent after the resend.
  REQUIRE(monitor.Log(Step(101)));
  REQUIRE(monitor.Flush(15s));

  const auto messages = second.Messages();
  REQUIRE_FALSE(messages.empty());
  CHECK(messages[0].has_hello());
  CHECK(second.Steps() == Range(71, 101));
  stats = monitor.Stats();
  CHECK(stats.reconnects >= 1);
  CHECK(accepted_calls >= 2);
  CHECK(stats.acked_through_step == 101);
  CHECK(stats.connected);
}

TEST_CASE("a resume is declared on the first accepted hello only, not on reconnects", "[client][rewind]") {
  auto first = std::make_unique<FakeIngest>();
  auto server = std::make_unique<FakeServer>(std::vector<grpc::Service*>{first.get()});
  REQUIRE(server->ok());
  const int port = server->port();
  MonitorOptions options = Options(server->address());
  options.hello.set_resume_from_step(20000);
  Monitor monitor(options);
  monitor.Start();
  REQUIRE(monitor.Log(Step(20000)));
  REQUIRE(monitor.Flush(10s));
  REQUIRE(first->Messages()[0].hello().has_resume_from_step());
  CHECK(first->Messages()[0].hello().resume_from_step() == 20000);

  server->Shutdown();
  FakeIngest second(FakeIngest::Progress{true, 20000, true, 20000});
  FakeServer restarted({&second}, port);
  REQUIRE(restarted.ok());
  REQUIRE(monitor.Log(Step(20001)));
  REQUIRE(monitor.Flush(15s));
  const auto messages = second.Messages();
  REQUIRE(messages[0].has_hello());
  CHECK_FALSE(messages[0].hello().has_resume_from_step());
  CHECK(second.Steps() == std::vector<uint64_t>{20001});
}

TEST_CASE("errors about a step release it so that flush does not hang", "[client]") {
  FakeIngest ingest;
  ingest.set_reject([](const v1::TrainerMessage& m) -> std::optional<v1::Error> {
    if (!m.has_step() || m.step().step() % 2 == 0) return std::nullopt;
    v1::Error e;
    e.set_seq(m.seq());
    e.set_step(m.step().step());
    e.set_reason(v1::ERROR_REASON_NEGATIVE_NORM);
    e.set_message("negative norm");
    return e;
  });
  FakeServer server({&ingest});
  std::atomic<int> on_error_calls{0};
  MonitorOptions options = Options(server.address());
  options.on_error = [&](const v1::Error& e) {
    CHECK(e.reason() == v1::ERROR_REASON_NEGATIVE_NORM);
    ++on_error_calls;
  };
  Monitor monitor(options);
  monitor.Start();
  // Odd steps are rejected, and the last one is odd: no ack ever covers it.
  for (uint64_t n = 1; n <= 9; ++n) monitor.Log(Step(n));
  REQUIRE(monitor.Flush(10s));
  const auto stats = monitor.Stats();
  CHECK(stats.errors == 5);
  CHECK(stats.errors_by_reason.at("ERROR_REASON_NEGATIVE_NORM") == 5);
  CHECK_THAT(stats.last_error, Catch::Contains("NEGATIVE_NORM"));
  CHECK(on_error_calls == 5);
  CHECK(stats.acked_through_step == 8);
}

TEST_CASE("a refused hello is reported and flush returns at once", "[client]") {
  FakeIngest ingest;
  ingest.set_reject([](const v1::TrainerMessage& m) -> std::optional<v1::Error> {
    if (!m.has_hello()) return std::nullopt;
    v1::Error e;
    e.set_seq(m.seq());
    e.set_reason(v1::ERROR_REASON_WORLD_SIZE_CHANGED);
    e.set_message("world size 1, run has 8");
    return e;
  });
  FakeServer server({&ingest});
  Monitor monitor(Options(server.address()));
  monitor.Start();
  monitor.Log(Step(1));
  CHECK_FALSE(monitor.WaitAccepted(5s));
  const auto started = std::chrono::steady_clock::now();
  CHECK_FALSE(monitor.Flush(10s));
  CHECK(std::chrono::steady_clock::now() - started < 2s);
  const auto stats = monitor.Stats();
  CHECK(stats.rejected);
  CHECK_FALSE(stats.connected);
  CHECK_THAT(stats.last_error, Catch::Contains("WORLD_SIZE_CHANGED"));
}

TEST_CASE("events travel in order with steps", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  Monitor monitor(Options(server.address()));
  monitor.Start();
  monitor.Log(Step(1));
  REQUIRE(monitor.Event(2, "switched to near-dropless EP routing"));
  monitor.Log(Step(2));
  REQUIRE(monitor.Flush(10s));
  const auto messages = ingest.Messages();
  REQUIRE(messages.size() == 4);
  CHECK(messages[1].has_step());
  REQUIRE(messages[2].has_event());
  CHECK(messages[2].event().text() == "switched to near-dropless EP routing");
  CHECK(messages[3].has_step());
  CHECK(monitor.Stats().events_sent == 1);
}

TEST_CASE("alerts reach the on_alert callback", "[client]") {
  FakeIngest ingest;
  v1::Alert alert;
  alert.set_name("GradNormContingency");
  alert.set_state(v1::ALERT_STATE_FIRING);
  ingest.set_alert_on_step(3, alert);
  FakeServer server({&ingest});
  std::mutex mu;
  std::vector<std::string> seen;
  MonitorOptions options = Options(server.address());
  options.on_alert = [&](const v1::Alert& a) {
    std::lock_guard lock(mu);
    seen.push_back(a.name());
  };
  Monitor monitor(options);
  monitor.Start();
  for (uint64_t n = 1; n <= 5; ++n) monitor.Log(Step(n));
  REQUIRE(monitor.Flush(10s));
  monitor.Stop();
  std::lock_guard lock(mu);
  CHECK(seen == std::vector<std::string>{"GradNormContingency"});
}

TEST_CASE("without a daemon, Log never blocks, drops past capacity and Stop is prompt", "[client]") {
  MonitorOptions options = Options("127.0.0.1:" + std::to_string(UnusedPort()));
  options.queue_capacity = 5;
  Monitor monitor(options);
  monitor.Start();
  int accepted = 0;
  const auto started = std::chrono::steady_clock::now();
  for (uint64_t n = 1; n <= 8; ++n) accepted += monitor.Log(Step(n)) ? 1 : 0;
  // Microseconds of work: the bound leaves room for a busy machine's scheduling, not for a wait.
  CHECK(std::chrono::steady_clock::now() - started < 500ms);
  CHECK(accepted == 5);
  CHECK_FALSE(monitor.LogBlocking(Step(9), 50ms));
  CHECK_FALSE(monitor.Flush(100ms));
  auto stats = monitor.Stats();
  CHECK(stats.dropped == 4);
  CHECK_FALSE(stats.connected);

  const auto stopping = std::chrono::steady_clock::now();
  monitor.Stop();
  CHECK(std::chrono::steady_clock::now() - stopping < 2s);
  CHECK_FALSE(monitor.Log(Step(10)));
  CHECK(monitor.Stats().dropped == 5);
}

TEST_CASE("LogBlocking waits for acks to make room", "[client]") {
  FakeIngest ingest;
  FakeServer server({&ingest});
  MonitorOptions options = Options(server.address());
  options.queue_capacity = 4;
  Monitor monitor(options);
  monitor.Start();
  for (uint64_t n = 1; n <= 200; ++n) REQUIRE(monitor.LogBlocking(Step(n), 10s));
  REQUIRE(monitor.Flush(10s));
  CHECK(ingest.Steps() == Range(1, 200));
  CHECK(monitor.Stats().dropped == 0);
}

TEST_CASE("the window bounds what is written while the daemon acknowledges nothing", "[client][flow]") {
  FakeIngest ingest;
  ingest.set_ack_limit(0);
  FakeServer server({&ingest});
  MonitorOptions options = Options(server.address());
  options.max_unacked_steps = 10;
  Monitor monitor(options);
  monitor.Start();
  for (uint64_t n = 1; n <= 100; ++n) REQUIRE(monitor.Log(Step(n)));
  REQUIRE(ingest.WaitForMessages(11, 10s));  // the Hello and a window of steps
  // Nothing is acknowledged: the flush gives up after the stall timeout, and all that time the
  // rest stayed in the Monitor instead of going to the daemon.
  CHECK_FALSE(monitor.FlushWhileProgressing(Scaled(300ms)));
  CHECK(ingest.Steps() == Range(1, 10));
  const auto stats = monitor.Stats();
  CHECK(stats.unacked == 10);
  CHECK(stats.queued == 90);
  CHECK_FALSE(stats.has_acked);
}

TEST_CASE("a slow daemon that keeps acknowledging is waited for far beyond the stall timeout", "[client][flow]") {
  // A second: a stall of the test's own threads as long as the stall timeout, which a busy machine
  // can cause, would fail it, so it leaves room for one of 900 ms.
  const auto stall_timeout = Scaled(1000ms);
  FakeIngest ingest;
  // One ack every twelfth of the stall timeout: the 30 steps take two and a half stall timeouts.
  ingest.set_ack_delay(stall_timeout / 12);
  FakeServer server({&ingest});
  MonitorOptions options = Options(server.address());
  options.max_unacked_steps = 4;
  options.queue_capacity = 8;
  Monitor monitor(options);
  monitor.Start();
  const auto started = std::chrono::steady_clock::now();
  for (uint64_t n = 1; n <= 30; ++n) REQUIRE(monitor.LogBlocking(Step(n), stall_timeout));
  REQUIRE(monitor.FlushWhileProgressing(stall_timeout));
  CHECK(std::chrono::steady_clock::now() - started >= 2 * stall_timeout);
  CHECK(ingest.Steps() == Range(1, 30));
  CHECK(monitor.Stats().acked_through_step == 30);
  CHECK(monitor.Stats().dropped == 0);
}

TEST_CASE("a daemon that stops acknowledging is given up on after the stall timeout", "[client][flow]") {
  FakeIngest ingest;
  ingest.set_ack_limit(5);
  FakeServer server({&ingest});
  MonitorOptions options = Options(server.address());
  options.queue_capacity = 8;
  Monitor monitor(options);
  monitor.Start();
  // Steps 1 to 5 are acknowledged and make room; 6 to 13 fill the buffer and never are.
  for (uint64_t n = 1; n <= 13; ++n) REQUIRE(monitor.LogBlocking(Step(n), 10s));
  const auto started = std::chrono::steady_clock::now();
  CHECK_FALSE(monitor.LogBlocking(Step(14), Scaled(300ms)));
  CHECK(std::chrono::steady_clock::now() - started >= Scaled(300ms));
  CHECK_FALSE(monitor.FlushWhileProgressing(Scaled(300ms)));
  const auto stats = monitor.Stats();
  CHECK(stats.acked_through_step == 5);
  CHECK(stats.dropped == 1);
}

TEST_CASE("Stop ends a wait on a stalled daemon at once", "[client][flow]") {
  FakeIngest ingest;
  ingest.set_ack_limit(0);
  FakeServer server({&ingest});
  Monitor monitor(Options(server.address()));
  monitor.Start();
  for (uint64_t n = 1; n <= 5; ++n) REQUIRE(monitor.Log(Step(n)));
  // As `gradwatch replay` does on SIGINT: another thread stops the Monitor while it waits.
  std::thread stopper([&] {
    ingest.WaitForMessages(6, 10s);
    monitor.Stop();
  });
  const auto started = std::chrono::steady_clock::now();
  CHECK_FALSE(monitor.FlushWhileProgressing(60s));
  CHECK(std::chrono::steady_clock::now() - started < 30s);
  stopper.join();
  CHECK(monitor.Stats().unacked + monitor.Stats().queued == 5);
}

namespace {

// Captures what the default spdlog logger says at warn and above while it lives.
class CapturedWarnings {
 public:
  CapturedWarnings() : previous_(spdlog::default_logger()) {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(text_);
    auto logger = std::make_shared<spdlog::logger>("captured", sink);
    logger->set_level(spdlog::level::warn);
    logger->set_pattern("%v");
    spdlog::set_default_logger(logger);
  }
  ~CapturedWarnings() { spdlog::set_default_logger(previous_); }
  std::string Text() {
    spdlog::default_logger()->flush();
    return text_.str();
  }
  size_t Count(const std::string& needle) {
    const std::string t = Text();
    size_t n = 0;
    for (size_t at = t.find(needle); at != std::string::npos; at = t.find(needle, at + 1)) ++n;
    return n;
  }

 private:
  std::ostringstream text_;
  std::shared_ptr<spdlog::logger> previous_;
};

bool Eventually(const std::function<bool()>& pred, std::chrono::milliseconds limit = 30s) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return pred();
}

}  // namespace

TEST_CASE("a daemon out of reach is warned of once per interval, a full queue and drops too, and the return said",
          "[client][warnings]") {
  CapturedWarnings warnings;
  const int port = UnusedPort();
  MonitorOptions o = Options("127.0.0.1:" + std::to_string(port));
  o.queue_capacity = 40;
  o.unreachable_warning_after = 200ms;
  o.warn_interval = 60s;
  Monitor monitor(o);
  monitor.Start();
  // A trainer logs a step every 20 ms; 200 ms after the first, the warning.
  uint64_t logged = 0;
  REQUIRE(Eventually([&] {
    if (logged < 30) monitor.Log(Step(++logged));
    return warnings.Count("cannot reach the daemon at 127.0.0.1:") == 1;
  }));
  CHECK(warnings.Text().find(" step(s) queued of 40, kept and sent once it answers") != std::string::npos);
  // Past half the queue, then past its end: one warning each, however many steps.
  while (logged < 70) monitor.Log(Step(++logged));
  CHECK(warnings.Count("20 of 40 steps of run unit-run wait for the daemon") == 1);
  CHECK(warnings.Count("steps of run unit-run wait for the daemon") == 1);
  CHECK(warnings.Count("dropped 1 step(s) of run unit-run: the queue of 40 is full") == 1);
  CHECK(monitor.Stats().dropped == 30);
  CHECK(warnings.Count("cannot reach the daemon") == 1);
  // Retries go on within the interval (the back-off is at most 200 ms here): still one warning.
  std::this_thread::sleep_for(500ms);
  CHECK(warnings.Count("cannot reach the daemon") == 1);

  // The daemon comes up on that port: the return is said, and the steps queued are sent.
  FakeIngest ingest;
  FakeServer server({&ingest}, port);
  REQUIRE(server.ok());
  REQUIRE(monitor.Flush(30s));
  CHECK(warnings.Count("reached the daemon at 127.0.0.1:" + std::to_string(port) + " again after") == 1);
  CHECK(ingest.Steps() == Range(1, 40));
  monitor.Stop();
}

TEST_CASE("a refused Hello is warned of with the daemon's reason, and a run that goes well says nothing",
          "[client][warnings]") {
  {
    CapturedWarnings warnings;
    FakeIngest ingest;
    ingest.set_reject([](const v1::TrainerMessage& m) -> std::optional<v1::Error> {
      if (!m.has_hello()) return std::nullopt;
      v1::Error e;
      e.set_seq(m.seq());
      e.set_reason(v1::ERROR_REASON_INVALID_HELLO);
      e.set_message("UNAUTHENTICATED: this stream needs a bearer token");
      return e;
    });
    FakeServer server({&ingest});
    REQUIRE(server.ok());
    MonitorOptions o = Options(server.address());
    o.warn_interval = 60s;
    Monitor monitor(o);
    monitor.Start();
    monitor.Log(Step(1));
    const bool refused = Eventually([&] { return warnings.Count("refused run unit-run rank 0") == 1; }, 5s);
    INFO(warnings.Text());
    REQUIRE(refused);
    CHECK(warnings.Text().find("UNAUTHENTICATED: this stream needs a bearer token") != std::string::npos);
    std::this_thread::sleep_for(500ms);  // retries within the interval say nothing more
    CHECK(warnings.Count("refused run unit-run") == 1);
    monitor.Stop();
  }
  CapturedWarnings warnings;
  FakeIngest ingest;
  FakeServer server({&ingest});
  REQUIRE(server.ok());
  Monitor monitor(Options(server.address()));
  monitor.Start();
  for (uint64_t n = 1; n <= 200; ++n) REQUIRE(monitor.Log(Step(n)));
  REQUIRE(monitor.Flush(10s));
  REQUIRE(monitor.Finish(10s));
  monitor.Stop();
  CHECK(warnings.Text().empty());
}

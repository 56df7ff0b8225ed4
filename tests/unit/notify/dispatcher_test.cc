#include "alerts/notify/dispatcher.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tests/unit/notify/test_receiver.h"

using gradwatch::alerts::Alert;
using gradwatch::alerts::AlertState;
using nlohmann::json;
namespace notify = gradwatch::notify;
using notify::testing::TestReceiver;
using namespace std::chrono_literals;

namespace {

// Back-off of 10, 20, 40, 40... ms without jitter.
notify::DispatcherOptions FastOptions() {
  notify::DispatcherOptions options;
  options.backoff.initial = 10ms;
  options.backoff.max = 40ms;
  options.backoff.jitter = 0;
  options.idle_poll = 50ms;
  return options;
}

notify::ReceiverConfig Config(std::string name, std::string url) {
  notify::ReceiverConfig config;
  config.name = std::move(name);
  config.url = std::move(url);
  config.http.timeout = 5s;
  return config;
}

std::unique_ptr<notify::Receiver> Webhook(std::string name, std::string url) {
  return std::make_unique<notify::WebhookReceiver>(notify::WebhookConfig{Config(std::move(name), std::move(url))});
}

template <typename... R>
std::vector<std::unique_ptr<notify::Receiver>> Receivers(R... receivers) {
  std::vector<std::unique_ptr<notify::Receiver>> out;
  (out.push_back(std::move(receivers)), ...);
  return out;
}

Alert MakeAlert(const std::string& run, AlertState state, double starts_at = 1000, double ends_at = 0) {
  Alert alert;
  alert.name = "GradNormContingency";
  alert.state = state;
  alert.labels = {{"alertname", "GradNormContingency"}, {"run", run}, {"severity", "page"}};
  alert.annotations = {{"summary", "grad norm of " + run}, {"recommendation", "enable weight decay on final_norm"}};
  alert.step = 100;
  alert.value = 5.5;
  alert.starts_at = starts_at;
  alert.ends_at = ends_at;
  return alert;
}

// Polls pred every 5 ms for at most timeout.
bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + gradwatch::testing::Scaled(timeout);
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// (run label, status) of each delivered webhook notification, in arrival order.
std::vector<std::pair<std::string, std::string>> DeliveredWebhooks(const TestReceiver& receiver) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& request : receiver.Delivered()) {
    const json body = json::parse(request.body);
    out.emplace_back(body.at("alerts")[0].at("labels").at("run"), body.at("status"));
  }
  return out;
}

// The firing/resolved sequence one run received.
std::vector<std::string> StatesOf(const std::vector<std::pair<std::string, std::string>>& all, const std::string& run) {
  std::vector<std::string> states;
  for (const auto& [r, status] : all) {
    if (r == run) states.push_back(status);
  }
  return states;
}

notify::ReceiverStats StatsOf(const notify::Dispatcher& dispatcher, size_t index = 0) {
  return dispatcher.Stats().at(index);
}

// Longer than the largest back-off in FastOptions: a duplicate or a retry would have happened.
constexpr auto kSettle = 150ms;

}  // namespace

TEST_CASE("back-off doubles from initial up to max and jitter only shortens it", "[notify]") {
  notify::BackoffOptions options;
  options.initial = 100ms;
  options.max = 1000ms;
  options.multiplier = 2;
  options.jitter = 0.5;
  const std::vector<std::pair<uint32_t, double>> cases = {{1, 0.1}, {2, 0.2}, {3, 0.4}, {4, 0.8}, {5, 1.0}, {40, 1.0}};
  for (const auto& [attempts, seconds] : cases) {
    INFO("attempts " << attempts);
    CHECK(notify::BackoffDelay(options, attempts, 0).count() == Approx(seconds));
    CHECK(notify::BackoffDelay(options, attempts, 0.999).count() == Approx(seconds * (1 - 0.5 * 0.999)));
  }
}

TEST_CASE("start refuses duplicate receiver names and bad URLs", "[notify]") {
  notify::MemoryOutbox outbox;
  notify::Dispatcher duplicate(
      outbox, Receivers(Webhook("a", "http://127.0.0.1:1/"), Webhook("a", "http://127.0.0.1:2/")), FastOptions());
  CHECK_FALSE(duplicate.Start().ok());
  notify::Dispatcher bad_url(outbox, Receivers(Webhook("a", "gopher://x/")), FastOptions());
  CHECK_FALSE(bad_url.Start().ok());
}

TEST_CASE("pending and inactive alerts are never notified", "[notify]") {
  notify::MemoryOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", "http://127.0.0.1:1/")), FastOptions());
  CHECK(dispatcher.Enqueue(MakeAlert("r1", AlertState::kPending)).ok());
  CHECK(dispatcher.Enqueue(MakeAlert("r1", AlertState::kInactive)).ok());
  CHECK(outbox.Snapshot().empty());
}

TEST_CASE("a receiver answering 503 three times then 200 gets the state change exactly once", "[notify]") {
  TestReceiver receiver;
  receiver.Script({503, 503, 503});
  notify::MemoryOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url("/hook"))), FastOptions());
  REQUIRE(dispatcher.Start().ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("r1", AlertState::kFiring)).ok());

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).sent == 1; }));
  std::this_thread::sleep_for(kSettle);
  REQUIRE(receiver.Requests().size() == 4);
  // Every attempt carries the entry's key: a receiver can tell a repeat from a new change.
  for (const auto& request : receiver.Requests()) {
    CHECK(request.headers.at("idempotency-key") == notify::IdempotencyKey(outbox.Snapshot()[0].entry.id));
  }
  CHECK(DeliveredWebhooks(receiver) == std::vector<std::pair<std::string, std::string>>{{"r1", "firing"}});
  const auto stats = StatsOf(dispatcher);
  CHECK(stats.receiver == "hook");
  CHECK(stats.sent == 1);
  CHECK(stats.retries == 3);
  CHECK(stats.failures == 0);
  CHECK(stats.queue_depth == 0);
  CHECK(stats.last_error.find("HTTP 503") == 0);
  const auto records = outbox.Snapshot();
  REQUIRE(records.size() == 1);
  CHECK(records[0].state == notify::MemoryOutbox::EntryState::kDelivered);
  CHECK(records[0].entry.attempts == 3);
}

TEST_CASE("a down receiver that comes back gets every state change once and in order", "[notify]") {
  TestReceiver receiver;
  receiver.Down();
  notify::MemoryOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url())), FastOptions());
  REQUIRE(dispatcher.Start().ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring, 1000)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kFiring, 1001)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kResolved, 1001, 1011)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring, 1020)).ok());

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).retries >= 3; }));
  CHECK(receiver.Requests().empty());
  CHECK(StatsOf(dispatcher).queue_depth == 5);
  CHECK(StatsOf(dispatcher).last_error.find("network") == 0);

  receiver.Up();
  REQUIRE(receiver.WaitForDelivered(5, 5s));
  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).sent == 5; }));
  std::this_thread::sleep_for(kSettle);
  const auto delivered = DeliveredWebhooks(receiver);
  CHECK(delivered.size() == 5);
  CHECK(StatesOf(delivered, "a") == std::vector<std::string>{"firing", "resolved", "firing"});
  CHECK(StatesOf(delivered, "b") == std::vector<std::string>{"firing", "resolved"});
  CHECK(StatsOf(dispatcher).queue_depth == 0);
  CHECK(StatsOf(dispatcher).failures == 0);
}

TEST_CASE("a 400 answer is not retried and does not hold back later changes", "[notify]") {
  TestReceiver receiver;
  receiver.Script({400});
  notify::MemoryOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url())), FastOptions());
  REQUIRE(dispatcher.Start().ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).sent == 1; }));
  std::this_thread::sleep_for(kSettle);
  CHECK(receiver.Requests().size() == 2);
  CHECK(DeliveredWebhooks(receiver) == std::vector<std::pair<std::string, std::string>>{{"a", "resolved"}});
  const auto stats = StatsOf(dispatcher);
  CHECK(stats.failures == 1);
  CHECK(stats.retries == 0);
  const auto records = outbox.Snapshot();
  REQUIRE(records.size() == 2);
  CHECK(records[0].state == notify::MemoryOutbox::EntryState::kFailed);
  CHECK(records[0].last_error.find("HTTP 400") == 0);
  CHECK(records[1].state == notify::MemoryOutbox::EntryState::kDelivered);
}

TEST_CASE("a 503 for one fingerprint does not hold back another fingerprint", "[notify]") {
  TestReceiver receiver;
  receiver.Script({503});
  notify::MemoryOutbox outbox;
  auto options = FastOptions();
  options.backoff.initial = 2000ms;  // "a" waits long; "b" must not wait with it
  options.backoff.max = 2000ms;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url())), options);
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kFiring)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());
  REQUIRE(dispatcher.Start().ok());

  REQUIRE(receiver.WaitForDelivered(1, 1500ms));
  std::this_thread::sleep_for(kSettle);
  // "a" resolved stays behind "a" firing, which waits for its retry.
  CHECK(DeliveredWebhooks(receiver) == std::vector<std::pair<std::string, std::string>>{{"b", "firing"}});
  CHECK(StatsOf(dispatcher).queue_depth == 2);
}

// A MemoryOutbox that counts the reads of its pending entries (each counted once it returned).
class CountingOutbox final : public notify::Outbox {
 public:
  notify::Result<std::vector<uint64_t>> Write(std::vector<notify::OutboxEntry> entries,
                                              const gradwatch::alerts::StateChanges& states) override {
    return inner.Write(std::move(entries), states);
  }
  notify::Result<gradwatch::alerts::SavedState> LoadState() override { return inner.LoadState(); }
  notify::Result<std::vector<notify::OutboxEntry>> Pending(std::string_view receiver, size_t limit,
                                                           double now) override {
    auto out = inner.Pending(receiver, limit, now);
    ++pending_reads;
    return out;
  }
  notify::Result<uint64_t> PendingCount(std::string_view receiver) override { return inner.PendingCount(receiver); }
  notify::Status MarkDelivered(uint64_t id) override { return inner.MarkDelivered(id); }
  notify::Status MarkFailed(uint64_t id, std::string_view error) override { return inner.MarkFailed(id, error); }
  notify::Status MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) override {
    return inner.MarkRetry(id, next_attempt_at, attempts, error);
  }

  notify::MemoryOutbox inner;
  std::atomic<int> pending_reads{0};
};

TEST_CASE("entries recorded while nothing waits are sent as handed over, without reading the outbox", "[notify]") {
  TestReceiver receiver;
  CountingOutbox outbox;
  auto options = FastOptions();
  options.idle_poll = 3600s;  // every pass below is one the entries woke
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url())), options);
  REQUIRE(dispatcher.Start().ok());
  // The first pass reads the outbox (it may hold entries from before a restart): empty.
  REQUIRE(WaitUntil([&] { return outbox.pending_reads >= 1; }));
  const int reads = outbox.pending_reads;
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring, 1000)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kFiring, 1001)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).sent == 3; }));
  std::this_thread::sleep_for(kSettle);
  CHECK(outbox.pending_reads == reads);
  const auto delivered = DeliveredWebhooks(receiver);
  CHECK(delivered.size() == 3);
  CHECK(StatesOf(delivered, "a") == std::vector<std::string>{"firing", "resolved"});
  CHECK(StatesOf(delivered, "b") == std::vector<std::string>{"firing"});
  // Each request carries its own entry's key, and every entry is marked delivered.
  const auto records = outbox.inner.Snapshot();
  REQUIRE(records.size() == 3);
  std::set<std::string> keys;
  for (const auto& request : receiver.Requests()) keys.insert(request.headers.at("idempotency-key"));
  for (const auto& record : records) {
    CHECK(record.state == notify::MemoryOutbox::EntryState::kDelivered);
    CHECK(keys.count(notify::IdempotencyKey(record.entry.id)) == 1);
  }
  CHECK(StatsOf(dispatcher).queue_depth == 0);
}

TEST_CASE("a handed-over entry that must be retried holds back its fingerprint's later entries", "[notify]") {
  TestReceiver receiver;
  receiver.Script({503});
  CountingOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("hook", receiver.url())), FastOptions());
  REQUIRE(dispatcher.Start().ok());
  REQUIRE(WaitUntil([&] { return outbox.pending_reads >= 1; }));
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring, 1000)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kFiring, 1001)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher).sent == 3; }));
  std::this_thread::sleep_for(kSettle);
  const auto delivered = DeliveredWebhooks(receiver);
  CHECK(delivered.size() == 3);
  CHECK(StatesOf(delivered, "a") == std::vector<std::string>{"firing", "resolved"});
  CHECK(StatesOf(delivered, "b") == std::vector<std::string>{"firing"});
  CHECK(receiver.Requests().size() == 4);  // the 503, then each entry once
  const auto stats = StatsOf(dispatcher);
  CHECK(stats.retries == 1);
  CHECK(stats.queue_depth == 0);
  for (const auto& record : outbox.inner.Snapshot()) {
    CHECK(record.state == notify::MemoryOutbox::EntryState::kDelivered);
  }
}

TEST_CASE("a slow receiver delays neither the caller nor another receiver", "[notify]") {
  TestReceiver slow;
  slow.SetDelay(2000ms);
  TestReceiver fast;
  notify::MemoryOutbox outbox;
  notify::Dispatcher dispatcher(outbox, Receivers(Webhook("slow", slow.url()), Webhook("fast", fast.url())),
                                FastOptions());
  REQUIRE(dispatcher.Start().ok());

  const auto start = std::chrono::steady_clock::now();
  REQUIRE(dispatcher.Enqueue(MakeAlert("a", AlertState::kFiring)).ok());
  REQUIRE(dispatcher.Enqueue(MakeAlert("b", AlertState::kFiring)).ok());
  // Far below the slow receiver's 2 s, with room for a busy machine's scheduling.
  CHECK(std::chrono::steady_clock::now() - start < 500ms);

  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher, 1).sent == 2; }, 1500ms));
  CHECK(std::chrono::steady_clock::now() - start < 1000ms);
  CHECK(fast.Delivered().size() == 2);
  CHECK(slow.Delivered().empty());
  CHECK(StatsOf(dispatcher, 0).sent == 0);

  // Stop aborts the request in flight; the slow receiver's entries stay for the next start.
  const auto stop_start = std::chrono::steady_clock::now();
  dispatcher.Stop();
  CHECK(std::chrono::steady_clock::now() - stop_start < 1000ms);
  CHECK(outbox.PendingCount("slow").value() == 2);
  CHECK(outbox.PendingCount("fast").value() == 0);
}

TEST_CASE("entries left in the outbox are delivered by the next dispatcher", "[notify]") {
  TestReceiver receiver;
  receiver.Down();
  notify::MemoryOutbox outbox;
  {
    notify::Dispatcher first(outbox, Receivers(Webhook("hook", receiver.url())), FastOptions());
    REQUIRE(first.Start().ok());
    REQUIRE(first.Enqueue(MakeAlert("a", AlertState::kFiring)).ok());
    REQUIRE(first.Enqueue(MakeAlert("b", AlertState::kFiring)).ok());
    REQUIRE(first.Enqueue(MakeAlert("a", AlertState::kResolved, 1000, 1010)).ok());
    REQUIRE(WaitUntil([&] { return StatsOf(first).retries >= 1; }));
  }
  CHECK(outbox.PendingCount("hook").value() == 3);
  CHECK(receiver.Requests().empty());

  receiver.Up();
  notify::Dispatcher second(outbox, Receivers(Webhook("hook", receiver.url())), FastOptions());
  REQUIRE(second.Start().ok());
  REQUIRE(WaitUntil([&] { return StatsOf(second).sent == 3; }));
  std::this_thread::sleep_for(kSettle);
  const auto delivered = DeliveredWebhooks(receiver);
  CHECK(delivered.size() == 3);
  CHECK(StatesOf(delivered, "a") == std::vector<std::string>{"firing", "resolved"});
  CHECK(StatesOf(delivered, "b") == std::vector<std::string>{"firing"});
  CHECK(outbox.PendingCount("hook").value() == 0);
}

TEST_CASE("alertmanager gets firing alerts again every resend interval, until resolved", "[notify]") {
  gradwatch::FakeClock clock;
  const double kStart = clock.UnixSeconds();
  TestReceiver alertmanager;
  TestReceiver webhook;
  notify::MemoryOutbox outbox;
  auto options = FastOptions();
  options.clock = &clock;
  notify::Dispatcher dispatcher(outbox,
                                Receivers(std::make_unique<notify::AlertmanagerReceiver>(
                                              notify::AlertmanagerConfig{Config("am", alertmanager.url()), 60}),
                                          Webhook("hook", webhook.url())),
                                options);
  REQUIRE(dispatcher.Start().ok());
  auto ends_at_of = [&](size_t request) {
    const auto delivered = alertmanager.Delivered();
    const json body = json::parse(delivered.at(request).body);
    return body[0].at("endsAt").get<std::string>();
  };

  const Alert firing = MakeAlert("r1", AlertState::kFiring, kStart - 10);
  REQUIRE(dispatcher.Enqueue(firing).ok());
  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher, 0).sent == 1; }));
  CHECK(alertmanager.Requests().at(0).target == "/api/v2/alerts");
  CHECK(ends_at_of(0) == notify::FormatRfc3339(kStart + 240));

  // Within the interval: nothing new.
  REQUIRE(dispatcher.Refresh({firing}, kStart + 30).ok());
  CHECK(outbox.Snapshot().size() == 2);  // the firing entry for each receiver

  // An interval after the last delivery: sent again with a fresh endsAt, to Alertmanager only.
  clock.Advance(61s);  // kStart + 61
  REQUIRE(dispatcher.Refresh({firing}, kStart + 61).ok());
  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher, 0).sent == 2; }));
  CHECK(ends_at_of(1) == notify::FormatRfc3339(kStart + 61 + 240));
  // Not again while the interval has not passed since that delivery.
  REQUIRE(dispatcher.Refresh({firing}, kStart + 100).ok());
  CHECK(outbox.Snapshot().size() == 3);

  // Resolved: sent once with its real end; a stale snapshot still listing it sends nothing.
  clock.Advance(69s);  // kStart + 130
  REQUIRE(dispatcher.Enqueue(MakeAlert("r1", AlertState::kResolved, kStart - 10, kStart + 125)).ok());
  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher, 0).sent == 3; }));
  CHECK(ends_at_of(2) == notify::FormatRfc3339(kStart + 125));
  clock.Advance(170s);  // kStart + 300
  REQUIRE(dispatcher.Refresh({firing}, kStart + 300).ok());
  CHECK(outbox.Snapshot().size() == 5);

  // A new firing instance of the same labels is refreshed again.
  REQUIRE(dispatcher.Refresh({MakeAlert("r1", AlertState::kFiring, kStart + 290)}, kStart + 300).ok());
  CHECK(outbox.Snapshot().size() == 6);
  REQUIRE(WaitUntil([&] { return StatsOf(dispatcher, 0).sent == 4; }));

  std::this_thread::sleep_for(kSettle);
  CHECK(webhook.Delivered().size() == 2);  // firing and resolved, never re-sent
  CHECK(alertmanager.Delivered().size() == 4);
}

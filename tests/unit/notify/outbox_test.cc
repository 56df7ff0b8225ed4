#include "alerts/notify/outbox.h"

#include <catch2/catch.hpp>

using gradwatch::alerts::AlertState;
namespace notify = gradwatch::notify;

namespace {

notify::OutboxEntry Entry(std::string receiver, std::string fingerprint) {
  notify::OutboxEntry entry;
  entry.receiver = std::move(receiver);
  entry.fingerprint = std::move(fingerprint);
  entry.state = AlertState::kFiring;
  entry.payload = "{}";
  entry.created_at = 10;
  entry.next_attempt_at = 10;
  return entry;
}

// A time after every entry's next attempt.
constexpr double kEverythingDue = 1e12;

}  // namespace

TEST_CASE("memory outbox gives increasing ids and pending entries oldest first", "[notify]") {
  notify::MemoryOutbox outbox;
  auto ids = outbox.Add({Entry("a", "f1"), Entry("b", "f1"), Entry("a", "f2")});
  REQUIRE(ids.ok());
  REQUIRE(ids->size() == 3);
  CHECK(ids.value()[0] < ids.value()[1]);
  CHECK(ids.value()[1] < ids.value()[2]);

  auto pending = outbox.Pending("a", 10, kEverythingDue);
  REQUIRE(pending.ok());
  REQUIRE(pending->size() == 2);
  CHECK(pending.value()[0].fingerprint == "f1");
  CHECK(pending.value()[1].fingerprint == "f2");
  CHECK(outbox.Pending("a", 1, kEverythingDue)->size() == 1);
  CHECK(outbox.PendingCount("a").value() == 2);
  CHECK(outbox.PendingCount("b").value() == 1);
}

TEST_CASE("memory outbox: delivered and failed entries leave, retried ones stay", "[notify]") {
  notify::MemoryOutbox outbox;
  auto ids = outbox.Add({Entry("a", "f1"), Entry("a", "f2"), Entry("a", "f3")}).value();
  REQUIRE(outbox.MarkDelivered(ids[0]).ok());
  REQUIRE(outbox.MarkFailed(ids[1], "HTTP 400").ok());
  REQUIRE(outbox.MarkRetry(ids[2], 99.5, 3, "HTTP 503").ok());
  auto pending = outbox.Pending("a", 10, kEverythingDue).value();
  REQUIRE(pending.size() == 1);
  CHECK(pending[0].id == ids[2]);
  CHECK(pending[0].attempts == 3);
  CHECK(pending[0].next_attempt_at == 99.5);

  const auto all = outbox.Snapshot();
  REQUIRE(all.size() == 3);
  CHECK(all[0].state == notify::MemoryOutbox::EntryState::kDelivered);
  CHECK(all[1].state == notify::MemoryOutbox::EntryState::kFailed);
  CHECK(all[1].last_error == "HTTP 400");
  CHECK(all[2].last_error == "HTTP 503");
  CHECK_FALSE(outbox.MarkDelivered(12345).ok());
}

TEST_CASE("memory outbox keeps the state changes written with the entries, latest wins", "[notify]") {
  namespace alerts = gradwatch::alerts;
  notify::MemoryOutbox outbox;
  alerts::InstanceState firing;
  firing.rule = "GradNormContingency";
  firing.run = "r1";
  firing.alert.state = AlertState::kFiring;
  firing.alert.labels = {{"alertname", "GradNormContingency"}, {"run", "r1"}};
  alerts::InstanceState other = firing;
  other.run = "r2";
  other.alert.labels["run"] = "r2";
  alerts::StateChanges first;
  first.instances[1] = firing;
  first.instances[2] = other;
  first.silences["s1"] = alerts::Silence{"s1", alerts::EqualityMatchers({{"run", "r1"}}).value(), 0, 100, "", "bob"};
  REQUIRE(outbox.Write({Entry("am", "f1")}, first).ok());
  alerts::StateChanges second;
  second.instances[2] = std::nullopt;
  second.silences["s1"] = std::nullopt;
  REQUIRE(outbox.Write({}, second).ok());

  const auto saved = outbox.LoadState();
  REQUIRE(saved.ok());
  REQUIRE(saved->instances.size() == 1);
  CHECK(saved->instances[0].run == "r1");
  CHECK(saved->silences.empty());
  CHECK(outbox.PendingCount("am").value() == 1);
}

TEST_CASE("memory outbox: entries in back-off never crowd out due ones", "[notify]") {
  notify::MemoryOutbox outbox;
  std::vector<notify::OutboxEntry> entries;
  for (int i = 0; i < 300; ++i) entries.push_back(Entry("a", "backoff" + std::to_string(i)));
  entries.push_back(Entry("a", "due"));
  const auto ids = outbox.Add(std::move(entries)).value();
  for (int i = 0; i < 300; ++i) REQUIRE(outbox.MarkRetry(ids[i], 500, 1, "HTTP 503").ok());

  // At t=100 only the last entry is due: it comes first, though 300 older entries wait.
  const auto pending = outbox.Pending("a", 256, 100).value();
  REQUIRE(pending.size() == 256);
  CHECK(pending[0].fingerprint == "due");
  CHECK(pending[1].id == ids[0]);  // then the waiting ones, oldest first, for the wake-up time
}

TEST_CASE("memory outbox: a fingerprint's later entries wait for its entry in back-off", "[notify]") {
  notify::MemoryOutbox outbox;
  const auto ids = outbox.Add({Entry("a", "f1"), Entry("a", "f1"), Entry("a", "f2")}).value();
  REQUIRE(outbox.MarkRetry(ids[0], 500, 1, "HTTP 503").ok());
  const auto pending = outbox.Pending("a", 10, 100).value();
  REQUIRE(pending.size() == 2);
  CHECK(pending[0].id == ids[2]);  // due
  CHECK(pending[1].id == ids[0]);  // not due; ids[1] is held behind it
  CHECK(outbox.Pending("a", 10, 600).value().size() == 3);
}

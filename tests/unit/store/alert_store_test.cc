#include <catch2/catch.hpp>

#include <filesystem>
#include <random>
#include <string>

#include <sqlite3.h>

#include "alerts/alert.h"
#include "server/store/alert_store.h"
#include "server/store/journal.h"

using namespace gradwatch;

namespace {

std::filesystem::path TempPath() {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / ("gradwatch-outbox-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

notify::OutboxEntry Entry(const std::string& receiver, const std::string& fingerprint, alerts::AlertState state) {
  notify::OutboxEntry e;
  e.receiver = receiver;
  e.fingerprint = fingerprint;
  e.state = state;
  e.payload = R"({"name":"GradNormContingency"})";
  e.created_at = 1.7e9;
  return e;
}

alerts::InstanceState Firing(const std::string& run, uint64_t step) {
  alerts::InstanceState inst;
  inst.rule = "GradNormContingency";
  inst.run = run;
  inst.alert.name = "GradNormContingency";
  inst.alert.state = alerts::AlertState::kFiring;
  inst.alert.labels = {{"alertname", "GradNormContingency"}, {"run", run}, {"severity", "page"}};
  inst.alert.annotations = {{"summary", "total grad norm 5.5 at step " + std::to_string(step)}};
  inst.alert.step = step;
  inst.alert.value = 5.5;
  inst.alert.starts_at = 1.7e9;
  inst.held_since_step = step - 10;
  inst.clearing = true;
  inst.clearing_since_step = step + 3;
  inst.notified = true;
  inst.ack = alerts::Acknowledgement{"alice", "enabling wd", 1.7e9 + 60};
  return inst;
}

}  // namespace

TEST_CASE("the SQLite outbox keeps pending entries in order across a reopen until delivered", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  {
    auto outbox = store::AlertStore::Open(path);
    REQUIRE(outbox.ok());
    auto ids =
        (*outbox)->Add({Entry("am", "f1", alerts::AlertState::kFiring), Entry("pd", "f1", alerts::AlertState::kFiring),
                        Entry("am", "f1", alerts::AlertState::kResolved)});
    REQUIRE(ids.ok());
    REQUIRE(ids->size() == 3);
    CHECK(ids.value()[0] < ids.value()[2]);
    REQUIRE((*outbox)->MarkRetry(ids.value()[0], 1.7e9 + 5, 1, "connection refused").ok());
    REQUIRE((*outbox)->MarkDelivered(ids.value()[1]).ok());
  }
  auto outbox = store::AlertStore::Open(path);  // a restart
  REQUIRE(outbox.ok());
  auto am = (*outbox)->Pending("am", 10, 1.7e9 + 10);
  REQUIRE(am.ok());
  REQUIRE(am->size() == 2);
  CHECK(am.value()[0].state == alerts::AlertState::kFiring);
  CHECK(am.value()[0].attempts == 1);
  CHECK(am.value()[0].next_attempt_at == Approx(1.7e9 + 5));
  CHECK(am.value()[1].state == alerts::AlertState::kResolved);
  CHECK(am.value()[1].payload == R"({"name":"GradNormContingency"})");
  CHECK((*outbox)->PendingCount("pd").value() == 0);
  REQUIRE((*outbox)->MarkFailed(am.value()[0].id, "400 bad request").ok());
  CHECK((*outbox)->PendingCount("am").value() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the outbox follows the journal rebuilt after its directory was deleted, and keeps what it had",
          "[store][recovery]") {
  const auto dir = TempPath();
  const auto data = dir / "data";
  std::filesystem::create_directories(data);
  const std::string path = (data / "journal.db").string();
  auto journal = store::Journal::Open({.path = path}, nullptr);
  REQUIRE(journal.ok());
  auto outbox = store::AlertStore::Open(path);
  REQUIRE(outbox.ok());
  REQUIRE((*outbox)->Add({Entry("am", "before", alerts::AlertState::kFiring)}).ok());
  std::filesystem::remove_all(data);
  // No journal file: the outbox refuses (its caller retries) rather than write to the lost one.
  CHECK_FALSE((*outbox)->Add({Entry("am", "lost", alerts::AlertState::kFiring)}).ok());
  RunMeta meta;
  meta.run_id = "run";
  REQUIRE((*journal)->Enqueue(store::RunRecord{meta}));
  REQUIRE((*journal)->Flush().ok());  // rebuilds the journal
  REQUIRE((*journal)->stats().rebuilds == 1);
  REQUIRE((*outbox)->Add({Entry("am", "after", alerts::AlertState::kFiring)}).ok());
  outbox->reset();
  (*journal)->Stop();

  auto reopened = store::AlertStore::Open(path);  // a restart
  REQUIRE(reopened.ok());
  auto pending = (*reopened)->Pending("am", 10, 1.7e9 + 10);
  REQUIRE(pending.ok());
  REQUIRE(pending->size() == 2);
  CHECK(pending.value()[0].fingerprint == "before");
  CHECK(pending.value()[1].fingerprint == "after");
  std::filesystem::remove_all(dir);
}

TEST_CASE("the outbox's commits never checkpoint the journal's WAL: the journal's next commit does", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  auto journal = store::Journal::Open({.path = path}, nullptr);
  REQUIRE(journal.ok());
  auto outbox = store::AlertStore::Open(path);
  REQUIRE(outbox.ok());
  const auto main_bytes = std::filesystem::file_size(path);
  // 500 commits of a 20 KB payload: about 1,500 WAL frames of 16 KiB, past SQLite's auto-checkpoint
  // (1,000 frames), which would have written them into the database file.
  for (int i = 0; i < 500; ++i) {
    notify::OutboxEntry e = Entry("am", "f" + std::to_string(i), alerts::AlertState::kFiring);
    e.payload = std::string(20000, 'x');
    REQUIRE((*outbox)->Add({e}).ok());
  }
  CHECK(std::filesystem::file_size(path + "-wal") > 1000 * 16384);
  CHECK(std::filesystem::file_size(path) == main_bytes);
  RunMeta meta;
  meta.run_id = "run";
  REQUIRE((*journal)->Enqueue(store::RunRecord{meta}));
  REQUIRE((*journal)->Flush().ok());
  CHECK(std::filesystem::file_size(path) > 500 * 20000);
  CHECK((*outbox)->PendingCount("am").value() == 500);
  outbox->reset();
  (*journal)->Stop();
  std::filesystem::remove_all(dir);
}

TEST_CASE("opening the outbox in a missing directory fails with a clear message", "[store]") {
  auto outbox = store::AlertStore::Open("/nonexistent-gradwatch-dir/journal.db");
  REQUIRE_FALSE(outbox.ok());
  CHECK(outbox.status().message().find("/nonexistent-gradwatch-dir/journal.db") != std::string::npos);
}

TEST_CASE("alert states and silences are written with the notifications and read back after a reopen", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  const alerts::InstanceState a = Firing("run-a", 60);
  const alerts::InstanceState b = Firing("run-b", 70);
  const uint64_t fa = alerts::Fingerprint(a.alert.labels), fb = alerts::Fingerprint(b.alert.labels);
  {
    auto store = store::AlertStore::Open(path);
    REQUIRE(store.ok());
    alerts::StateChanges first;
    first.instances[fa] = a;
    first.instances[fb] = b;
    first.silences["s1"] = alerts::Silence{
        "s1", alerts::EqualityMatchers({{"run", "run-a"}}).value(), 1.7e9, 1.7e9 + 600, "maintenance", "bob"};
    first.silences["s2"] =
        alerts::Silence{"s2", alerts::EqualityMatchers({{"run", "run-b"}}).value(), 1.7e9, 1.7e9 + 600, "", "bob"};
    auto ids =
        (*store)->Write({Entry("am", alerts::FingerprintHex(a.alert.labels), alerts::AlertState::kFiring)}, first);
    REQUIRE(ids.ok());
    CHECK(ids->size() == 1);
    alerts::StateChanges second;  // b resolved, s2 removed: no notification for these in this write
    second.instances[fb] = std::nullopt;
    second.silences["s2"] = std::nullopt;
    REQUIRE((*store)->Write({}, second).ok());
  }
  auto store = store::AlertStore::Open(path);
  REQUIRE(store.ok());
  auto saved = (*store)->LoadState();
  REQUIRE(saved.ok());
  REQUIRE(saved->instances.size() == 1);
  const alerts::InstanceState& got = saved->instances[0];
  CHECK(got.rule == a.rule);
  CHECK(got.run == "run-a");
  CHECK(got.alert.state == alerts::AlertState::kFiring);
  CHECK(got.alert.labels == a.alert.labels);
  CHECK(got.alert.annotations == a.alert.annotations);
  CHECK(got.alert.step == 60);
  CHECK(got.alert.starts_at == a.alert.starts_at);
  CHECK(got.held_since_step == 50);
  CHECK(got.clearing);
  CHECK(got.clearing_since_step == 63);
  CHECK(got.notified);
  REQUIRE(got.ack);
  CHECK(*got.ack == *a.ack);
  REQUIRE(saved->silences.size() == 1);
  CHECK(saved->silences[0] == alerts::Silence{"s1", alerts::EqualityMatchers({{"run", "run-a"}}).value(), 1.7e9,
                                              1.7e9 + 600, "maintenance", "bob"});
  CHECK((*store)->PendingCount("am").value() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a damaged alert row is skipped on load and the others are restored", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  {
    auto store = store::AlertStore::Open(path);
    REQUIRE(store.ok());
    alerts::StateChanges changes;
    const alerts::InstanceState a = Firing("run-a", 60), b = Firing("run-b", 70);
    changes.instances[alerts::Fingerprint(a.alert.labels)] = a;
    changes.instances[alerts::Fingerprint(b.alert.labels)] = b;
    REQUIRE((*store)->Write({}, changes).ok());
  }
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(path.c_str(), &db) == SQLITE_OK);
  REQUIRE(sqlite3_exec(db, "UPDATE alert_instances SET alert = '{not json' WHERE run = 'run-b'", nullptr, nullptr,
                       nullptr) == SQLITE_OK);
  sqlite3_close(db);
  auto store = store::AlertStore::Open(path);
  REQUIRE(store.ok());
  auto saved = (*store)->LoadState();
  REQUIRE(saved.ok());
  REQUIRE(saved->instances.size() == 1);
  CHECK(saved->instances[0].run == "run-a");
  std::filesystem::remove_all(dir);
}

TEST_CASE("pruning the outbox deletes old delivered and given-up entries, never pending ones", "[store]") {
  const auto dir = TempPath();
  auto store = store::AlertStore::Open((dir / "journal.db").string());
  REQUIRE(store.ok());
  std::vector<notify::OutboxEntry> entries;
  for (int i = 0; i < 6; ++i) {
    notify::OutboxEntry e = Entry("am", "fp" + std::to_string(i), alerts::AlertState::kFiring);
    e.created_at = 1000.0 + i;  // entries 0..2 old, 3..5 recent
    entries.push_back(e);
  }
  auto ids = (*store)->Write(entries, {});
  REQUIRE(ids.ok());
  REQUIRE((*store)->MarkDelivered(ids.value()[0]).ok());
  REQUIRE((*store)->MarkFailed(ids.value()[1], "410 Gone").ok());
  // ids[2] is old but still pending
  REQUIRE((*store)->MarkDelivered(ids.value()[3]).ok());  // recent

  auto pruned = (*store)->PruneDone(1003.0, 1);  // bounded: one row per call
  REQUIRE(pruned.ok());
  CHECK(pruned.value() == 1);
  pruned = (*store)->PruneDone(1003.0, 100);
  REQUIRE(pruned.ok());
  CHECK(pruned.value() == 1);
  CHECK((*store)->PruneDone(1003.0, 100).value() == 0);

  auto pending = (*store)->Pending("am", 100, 1e12);
  REQUIRE(pending.ok());
  REQUIRE(pending->size() == 3);  // 2, 4, 5 are still to deliver
  CHECK(pending->at(0).fingerprint == "fp2");
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open((dir / "journal.db").string().c_str(), &db) == SQLITE_OK);
  sqlite3_stmt* q = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, "SELECT count(*) FROM outbox", -1, &q, nullptr) == SQLITE_OK);
  REQUIRE(sqlite3_step(q) == SQLITE_ROW);
  CHECK(sqlite3_column_int(q, 0) == 4);  // 2 pruned; the recent delivered one stays
  sqlite3_finalize(q);
  sqlite3_close(db);
  std::filesystem::remove_all(dir);
}

TEST_CASE("alert store outbox: entries in back-off never crowd out due ones", "[store]") {
  const auto dir = TempPath();
  auto store = store::AlertStore::Open((dir / "journal.db").string());
  REQUIRE(store.ok());
  std::vector<notify::OutboxEntry> entries;
  for (int i = 0; i < 300; ++i)
    entries.push_back(Entry("am", "backoff" + std::to_string(i), alerts::AlertState::kFiring));
  entries.push_back(Entry("am", "held", alerts::AlertState::kFiring));
  entries.push_back(Entry("am", "held", alerts::AlertState::kResolved));
  entries.push_back(Entry("am", "due", alerts::AlertState::kFiring));
  const auto ids = (*store)->Add(std::move(entries)).value();
  for (int i = 0; i < 301; ++i) REQUIRE((*store)->MarkRetry(ids[i], 1.7e9 + 60, 1, "HTTP 503").ok());

  const auto pending = (*store)->Pending("am", 256, 1.7e9 + 1).value();
  REQUIRE(pending.size() == 256);
  CHECK(pending[0].fingerprint == "due");
  CHECK(pending[1].id == ids[0]);
  for (const auto& e : pending) CHECK(e.id != ids[301]);  // held behind its fingerprint's retry
  // Once due, everything comes back in id order.
  const auto later = (*store)->Pending("am", 1000, 1.7e9 + 61).value();
  REQUIRE(later.size() == 303);
  CHECK(later[300].id == ids[300]);
  CHECK(later[301].id == ids[301]);
  std::filesystem::remove_all(dir);
}

TEST_CASE("alert store saves an acknowledgement with invalid UTF-8 instead of throwing", "[store]") {
  const auto dir = TempPath();
  auto store = store::AlertStore::Open((dir / "journal.db").string());
  REQUIRE(store.ok());
  alerts::InstanceState inst = Firing("run-utf8", 100);
  inst.ack = alerts::Acknowledgement{"op\xff", "looked at it \xc3", 1.7e9};
  alerts::StateChanges changes;
  changes.instances[42] = inst;
  alerts::Silence silence;
  silence.id = "s1";
  silence.matchers = alerts::EqualityMatchers({{"run", "bad\xfe"}}).value();
  silence.starts_at = 1.7e9;
  silence.ends_at = 1.7e9 + 60;
  changes.silences["s1"] = silence;
  auto written = (*store)->Write({}, changes);
  REQUIRE(written.ok());
  const auto saved = (*store)->LoadState().value();
  REQUIRE(saved.instances.size() == 1);
  REQUIRE(saved.instances[0].ack.has_value());
  CHECK(saved.instances[0].ack->by == "op\xef\xbf\xbd");  // U+FFFD
  REQUIRE(saved.silences.size() == 1);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the alert history keeps every state change of a run in order, across a reopen, until pruned", "[store]") {
  const auto dir = TempPath();
  const std::string path = (dir / "journal.db").string();
  auto change = [](const std::string& run, alerts::AlertState from, alerts::AlertState to, uint64_t step, double at) {
    alerts::HistoryEntry e{Firing(run, step).alert, from, at};
    e.alert.state = to;
    return e;
  };
  {
    auto store = store::AlertStore::Open(path);
    REQUIRE(store.ok());
    alerts::StateChanges first;
    first.history.push_back(change("a", alerts::AlertState::kInactive, alerts::AlertState::kPending, 100, 1000));
    first.history.push_back(change("b", alerts::AlertState::kInactive, alerts::AlertState::kPending, 150, 1001));
    REQUIRE((*store)->Write({}, first).ok());
    alerts::StateChanges second;
    second.history.push_back(change("a", alerts::AlertState::kPending, alerts::AlertState::kFiring, 120, 1002));
    second.history.push_back(change("a", alerts::AlertState::kFiring, alerts::AlertState::kResolved, 300, 1003));
    second.history.push_back(change("b", alerts::AlertState::kPending, alerts::AlertState::kInactive, 160, 1004));
    // With a notification, in the same transaction.
    REQUIRE((*store)->Write({Entry("am", "fp", alerts::AlertState::kResolved)}, second).ok());
  }
  auto store = store::AlertStore::Open(path);
  REQUIRE(store.ok());
  const auto a = (*store)->History("a", 100);
  REQUIRE(a.ok());
  REQUIRE(a->size() == 3);
  CHECK(a->at(0).alert.state == alerts::AlertState::kPending);
  CHECK(a->at(0).from == alerts::AlertState::kInactive);
  CHECK(a->at(0).alert.step == 100);
  CHECK(a->at(1).alert.state == alerts::AlertState::kFiring);
  CHECK(a->at(1).from == alerts::AlertState::kPending);
  CHECK(a->at(2).alert.state == alerts::AlertState::kResolved);
  CHECK(a->at(2).alert.step == 300);
  CHECK(a->at(2).at == 1003);
  CHECK(a->at(2).alert.labels.at("run") == "a");
  CHECK(a->at(2).alert.annotations.count("summary") == 1);

  const auto b = (*store)->History("b", 100).value();
  REQUIRE(b.size() == 2);
  CHECK(b[1].alert.state == alerts::AlertState::kInactive);  // cleared before it fired

  // The latest `limit` entries, oldest first; every run's with an empty run.
  const auto last2 = (*store)->History("a", 2).value();
  REQUIRE(last2.size() == 2);
  CHECK(last2[0].alert.state == alerts::AlertState::kFiring);
  CHECK((*store)->History("", 100).value().size() == 5);
  CHECK((*store)->History("nobody", 100).value().empty());

  // Pruned by age, bounded per call.
  CHECK((*store)->PruneHistory(1002.5, 1).value() == 1);
  CHECK((*store)->PruneHistory(1002.5, 100).value() == 2);
  CHECK((*store)->PruneHistory(1002.5, 100).value() == 0);
  const auto left = (*store)->History("", 100).value();
  REQUIRE(left.size() == 2);
  CHECK(left[0].at == 1003);
  CHECK(left[1].at == 1004);
  std::filesystem::remove_all(dir);
}

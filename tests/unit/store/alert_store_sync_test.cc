// Which of the alert store's commits wait for the disk: counted by a SQLite VFS that wraps the
// default one and counts the fsyncs of every file it opens (xSync).
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include <sqlite3.h>

#include "alerts/alert.h"
#include "server/store/alert_store.h"

using namespace gradwatch;

namespace {

std::atomic<int> syncs{0};

// A file of the counting VFS: the default VFS's file right after this header.
struct CountingFile {
  sqlite3_file base;
  sqlite3_file* real() { return reinterpret_cast<sqlite3_file*>(this + 1); }
};

sqlite3_file* Real(sqlite3_file* f) { return reinterpret_cast<CountingFile*>(f)->real(); }

int Close(sqlite3_file* f) { return Real(f)->pMethods->xClose(Real(f)); }
int Read(sqlite3_file* f, void* buf, int n, sqlite3_int64 off) {
  return Real(f)->pMethods->xRead(Real(f), buf, n, off);
}
int Write(sqlite3_file* f, const void* buf, int n, sqlite3_int64 off) {
  return Real(f)->pMethods->xWrite(Real(f), buf, n, off);
}
int Truncate(sqlite3_file* f, sqlite3_int64 size) { return Real(f)->pMethods->xTruncate(Real(f), size); }
int Sync(sqlite3_file* f, int flags) {
  ++syncs;
  return Real(f)->pMethods->xSync(Real(f), flags);
}
int FileSize(sqlite3_file* f, sqlite3_int64* size) { return Real(f)->pMethods->xFileSize(Real(f), size); }
int Lock(sqlite3_file* f, int level) { return Real(f)->pMethods->xLock(Real(f), level); }
int Unlock(sqlite3_file* f, int level) { return Real(f)->pMethods->xUnlock(Real(f), level); }
int CheckReservedLock(sqlite3_file* f, int* out) { return Real(f)->pMethods->xCheckReservedLock(Real(f), out); }
int FileControl(sqlite3_file* f, int op, void* arg) { return Real(f)->pMethods->xFileControl(Real(f), op, arg); }
int SectorSize(sqlite3_file* f) { return Real(f)->pMethods->xSectorSize(Real(f)); }
int DeviceCharacteristics(sqlite3_file* f) { return Real(f)->pMethods->xDeviceCharacteristics(Real(f)); }
int ShmMap(sqlite3_file* f, int region, int size, int extend, void volatile** out) {
  return Real(f)->pMethods->xShmMap(Real(f), region, size, extend, out);
}
int ShmLock(sqlite3_file* f, int offset, int n, int flags) {
  return Real(f)->pMethods->xShmLock(Real(f), offset, n, flags);
}
void ShmBarrier(sqlite3_file* f) { Real(f)->pMethods->xShmBarrier(Real(f)); }
int ShmUnmap(sqlite3_file* f, int remove) { return Real(f)->pMethods->xShmUnmap(Real(f), remove); }
int Fetch(sqlite3_file* f, sqlite3_int64 off, int n, void** out) {
  return Real(f)->pMethods->xFetch(Real(f), off, n, out);
}
int Unfetch(sqlite3_file* f, sqlite3_int64 off, void* p) { return Real(f)->pMethods->xUnfetch(Real(f), off, p); }

const sqlite3_io_methods kMethods = {3,
                                     Close,
                                     Read,
                                     Write,
                                     Truncate,
                                     Sync,
                                     FileSize,
                                     Lock,
                                     Unlock,
                                     CheckReservedLock,
                                     FileControl,
                                     SectorSize,
                                     DeviceCharacteristics,
                                     ShmMap,
                                     ShmLock,
                                     ShmBarrier,
                                     ShmUnmap,
                                     Fetch,
                                     Unfetch};

sqlite3_vfs* default_vfs = nullptr;
sqlite3_vfs counting_vfs;

int Open(sqlite3_vfs*, sqlite3_filename name, sqlite3_file* f, int flags, int* out_flags) {
  auto* file = reinterpret_cast<CountingFile*>(f);
  file->base.pMethods = nullptr;
  const int rc = default_vfs->xOpen(default_vfs, name, file->real(), flags, out_flags);
  if (file->real()->pMethods != nullptr) file->base.pMethods = &kMethods;
  return rc;
}

// Makes the counting VFS the default for every connection opened afterwards (once per process).
void InstallCountingVfs() {
  if (default_vfs != nullptr) return;
  default_vfs = sqlite3_vfs_find(nullptr);
  REQUIRE(default_vfs != nullptr);
  REQUIRE(default_vfs->iVersion >= 3);
  std::memcpy(&counting_vfs, default_vfs, sizeof(counting_vfs));
  counting_vfs.zName = "gradwatch-counting";
  counting_vfs.szOsFile = static_cast<int>(sizeof(CountingFile)) + default_vfs->szOsFile;
  counting_vfs.xOpen = Open;
  REQUIRE(sqlite3_vfs_register(&counting_vfs, /*makeDflt=*/1) == SQLITE_OK);
}

std::filesystem::path TempPath() {
  std::random_device rd;
  auto dir = std::filesystem::temp_directory_path() / ("gradwatch-sync-" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  return dir;
}

notify::OutboxEntry Entry(const std::string& fingerprint) {
  notify::OutboxEntry e;
  e.receiver = "hook";
  e.fingerprint = fingerprint;
  e.state = alerts::AlertState::kFiring;
  e.payload = R"({"name":"GradNormContingency"})";
  e.created_at = 1.7e9;
  return e;
}

alerts::InstanceState Firing(const std::string& run) {
  alerts::InstanceState inst;
  inst.rule = "GradNormContingency";
  inst.run = run;
  inst.alert.name = "GradNormContingency";
  inst.alert.state = alerts::AlertState::kFiring;
  inst.alert.labels = {{"alertname", "GradNormContingency"}, {"run", run}};
  inst.alert.step = 100;
  inst.alert.value = 5.5;
  inst.notified = true;
  return inst;
}

}  // namespace

TEST_CASE("a page and the outbox's marks wait for no fsync, a silence or an acknowledgement is synced", "[store]") {
  InstallCountingVfs();
  const auto dir = TempPath();
  auto store = store::AlertStore::Open((dir / "journal.db").string());
  REQUIRE(store.ok());

  // What the engine makes from journaled steps: the page's entry, its instance, its history.
  alerts::StateChanges engine;
  const alerts::InstanceState firing = Firing("run-a");
  engine.instances[alerts::Fingerprint(firing.alert.labels)] = firing;
  engine.evaluated["run-a"] = 100;
  engine.history.push_back({firing.alert, alerts::AlertState::kPending, 1.7e9});
  syncs = 0;
  auto ids = (*store)->Write({Entry("f1")}, engine);
  REQUIRE(ids.ok());
  CHECK(syncs == 0);

  // The outbox's marks: a lost one sends its entry again under the same key.
  REQUIRE((*store)->MarkRetry(ids.value()[0], 1.7e9 + 1, 1, "connection refused").ok());
  REQUIRE((*store)->MarkDelivered(ids.value()[0]).ok());
  CHECK(syncs == 0);

  // What only a user gives: each commit is synced.
  alerts::StateChanges silence;
  silence.silences["s1"] =
      alerts::Silence{"s1", alerts::EqualityMatchers({{"run", "run-a"}}).value(), 1.7e9, 1.7e9 + 600, "", "alice"};
  REQUIRE((*store)->Write({}, silence).ok());
  CHECK(syncs >= 1);
  const int after_silence = syncs;
  alerts::StateChanges ack;
  alerts::InstanceState acked = firing;
  acked.ack = alerts::Acknowledgement{"alice", "enabling wd", 1.7e9 + 60};
  ack.instances[alerts::Fingerprint(acked.alert.labels)] = acked;
  REQUIRE((*store)->Write({}, ack).ok());
  CHECK(syncs > after_silence);

  // And the connection is back to commits without their own fsync.
  const int after_ack = syncs;
  alerts::StateChanges other;
  const alerts::InstanceState firing_b = Firing("run-b");
  other.instances[alerts::Fingerprint(firing_b.alert.labels)] = firing_b;
  REQUIRE((*store)->Write({Entry("f2")}, other).ok());
  CHECK(syncs == after_ack);

  // Everything is there after a reopen.
  store->reset();
  auto reopened = store::AlertStore::Open((dir / "journal.db").string());
  REQUIRE(reopened.ok());
  auto saved = (*reopened)->LoadState();
  REQUIRE(saved.ok());
  REQUIRE(saved->instances.size() == 2);
  for (const alerts::InstanceState& inst : saved->instances) CHECK(inst.ack.has_value() == (inst.run == "run-a"));
  CHECK(saved->silences.size() == 1);
  CHECK((*reopened)->PendingCount("hook").value() == 1);
  std::filesystem::remove_all(dir);
}

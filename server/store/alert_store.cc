#include "server/store/alert_store.h"

#include <sqlite3.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "alerts/notify/payloads.h"

namespace gradwatch::store {

namespace {

constexpr int kPending = 0, kDelivered = 1, kFailed = 2;

// A prepared statement finalized on scope exit.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Stmt() { sqlite3_finalize(stmt_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return stmt_; }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

notify::Status Error(sqlite3* db, const std::string& what) {
  return notify::NotifyError("outbox: " + what + ": " + sqlite3_errmsg(db));
}

void BindText(sqlite3_stmt* s, int i, std::string_view v) {
  sqlite3_bind_text(s, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
}

std::string ColumnText(sqlite3_stmt* s, int i) {
  const unsigned char* text = sqlite3_column_text(s, i);
  return text ? reinterpret_cast<const char*>(text) : "";
}

std::string Hex(uint64_t fingerprint) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, fingerprint >>= 4) out[static_cast<size_t>(i)] = kDigits[fingerprint & 0xf];
  return out;
}

// As the journal's: invalid UTF-8 is replaced (U+FFFD), never thrown on the writer thread.
std::string Dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

std::string AckToJson(const alerts::Acknowledgement& ack) {
  return Dump(nlohmann::json{{"by", ack.by}, {"comment", ack.comment}, {"at", ack.at}});
}

alerts::Acknowledgement AckFromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  return {j.at("by").get<std::string>(), j.at("comment").get<std::string>(), j.at("at").get<double>()};
}

}  // namespace

namespace {

// Opens the journal's file at `path` (creating it only when `create`) with the settings and the
// tables the alert store needs; null with *error on failure.
sqlite3* OpenDb(const std::string& path, bool create, std::string* error) {
  sqlite3* db = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | (create ? SQLITE_OPEN_CREATE : 0);
  if (sqlite3_open_v2(path.c_str(), &db, flags, nullptr) != SQLITE_OK) {
    *error = "cannot open " + path + ": " + (db ? sqlite3_errmsg(db) : "out of memory");
    sqlite3_close(db);
    return nullptr;
  }
  sqlite3_busy_timeout(db, 5000);
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
                          "CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                          "receiver TEXT NOT NULL, fingerprint TEXT NOT NULL, state INTEGER NOT NULL, "
                          "payload TEXT NOT NULL, created_at REAL NOT NULL, attempts INTEGER NOT NULL, "
                          "next_attempt_at REAL NOT NULL, delivery INTEGER NOT NULL DEFAULT 0, error TEXT)",
                          "CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (receiver, delivery, id)",
                          "CREATE TABLE IF NOT EXISTS alert_instances (fingerprint TEXT PRIMARY KEY, "
                          "run TEXT NOT NULL, rule TEXT NOT NULL, alert TEXT NOT NULL, "
                          "held_since_step INTEGER NOT NULL, clearing INTEGER NOT NULL, "
                          "clearing_since_step INTEGER NOT NULL, notified INTEGER NOT NULL, ack TEXT)",
                          "CREATE TABLE IF NOT EXISTS silences (id TEXT PRIMARY KEY, matchers TEXT NOT NULL, "
                          "starts_at REAL NOT NULL, ends_at REAL NOT NULL, comment TEXT NOT NULL, "
                          "created_by TEXT NOT NULL)"}) {
    char* err = nullptr;
    if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
      *error = std::string("outbox: ") + sql + ": " + (err ? err : sqlite3_errmsg(db));
      sqlite3_free(err);
      sqlite3_close(db);
      return nullptr;
    }
  }
  return db;
}

}  // namespace

StatusOr<std::unique_ptr<AlertStore>> AlertStore::Open(const std::string& path) {
  std::string error;
  sqlite3* db = OpenDb(path, true, &error);
  if (db == nullptr) return Status::IoError("outbox: " + error);
  std::unique_ptr<AlertStore> store(new AlertStore(path, db));
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) store->dev_ = st.st_dev, store->ino_ = st.st_ino;
  return store;
}

notify::Status AlertStore::FollowFileLocked() {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    return notify::NotifyError("outbox: the journal '" + path_ + "' vanished; waiting until it is rebuilt");
  }
  if (static_cast<uint64_t>(st.st_dev) == dev_ && static_cast<uint64_t>(st.st_ino) == ino_) {
    return notify::Status::Ok();
  }
  std::string error;
  sqlite3* fresh = OpenDb(path_, false, &error);
  if (fresh == nullptr) return notify::NotifyError("outbox: following the rebuilt journal: " + error);
  // The old files are gone or someone else's: close without the checkpoint that would delete the
  // WAL by name (the new file's).
  sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
  sqlite3_close(db_);
  db_ = fresh;
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  spdlog::warn("outbox: the journal '{}' was rebuilt; alert states and notifications go to the new file", path_);
  return notify::Status::Ok();
}

AlertStore::~AlertStore() {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_dev) != dev_ ||
      static_cast<uint64_t>(st.st_ino) != ino_) {
    // Not the file at the path any more: the checkpoint at close would delete that file's WAL.
    sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
  }
  sqlite3_close(db_);
}

notify::Status AlertStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string message = err ? err : "unknown error";
    sqlite3_free(err);
    return notify::NotifyError(std::string("outbox: ") + sql + ": " + message);
  }
  return notify::Status::Ok();
}

notify::Status AlertStore::ApplyLocked(const alerts::StateChanges& states) {
  if (states.empty()) return notify::Status::Ok();
  Stmt put(db_,
           "INSERT OR REPLACE INTO alert_instances (fingerprint, run, rule, alert, held_since_step, clearing, "
           "clearing_since_step, notified, ack) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)");
  Stmt drop(db_, "DELETE FROM alert_instances WHERE fingerprint = ?");
  Stmt put_silence(db_,
                   "INSERT OR REPLACE INTO silences (id, matchers, starts_at, ends_at, comment, created_by) "
                   "VALUES (?, ?, ?, ?, ?, ?)");
  Stmt drop_silence(db_, "DELETE FROM silences WHERE id = ?");
  if (!put.ok() || !drop.ok() || !put_silence.ok() || !drop_silence.ok()) {
    return Error(db_, "preparing alert state statements");
  }
  for (const auto& [fp, inst] : states.instances) {
    sqlite3_stmt* s = inst ? put.get() : drop.get();
    sqlite3_reset(s);
    BindText(s, 1, Hex(fp));
    if (inst) {
      BindText(s, 2, inst->run);
      BindText(s, 3, inst->rule);
      BindText(s, 4, notify::AlertToJson(inst->alert));
      sqlite3_bind_int64(s, 5, static_cast<sqlite3_int64>(inst->held_since_step));
      sqlite3_bind_int(s, 6, inst->clearing ? 1 : 0);
      sqlite3_bind_int64(s, 7, static_cast<sqlite3_int64>(inst->clearing_since_step));
      sqlite3_bind_int(s, 8, inst->notified ? 1 : 0);
      if (inst->ack) {
        BindText(s, 9, AckToJson(*inst->ack));
      } else {
        sqlite3_bind_null(s, 9);
      }
    }
    if (sqlite3_step(s) != SQLITE_DONE) return Error(db_, "saving alert " + Hex(fp));
  }
  for (const auto& [id, silence] : states.silences) {
    sqlite3_stmt* s = silence ? put_silence.get() : drop_silence.get();
    sqlite3_reset(s);
    BindText(s, 1, id);
    if (silence) {
      BindText(s, 2, Dump(nlohmann::json(silence->matchers)));
      sqlite3_bind_double(s, 3, silence->starts_at);
      sqlite3_bind_double(s, 4, silence->ends_at);
      BindText(s, 5, silence->comment);
      BindText(s, 6, silence->created_by);
    }
    if (sqlite3_step(s) != SQLITE_DONE) return Error(db_, "saving silence " + id);
  }
  return notify::Status::Ok();
}

notify::Result<alerts::SavedState> AlertStore::LoadState() {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  alerts::SavedState saved;
  Stmt q(db_,
         "SELECT fingerprint, run, rule, alert, held_since_step, clearing, clearing_since_step, notified, ack "
         "FROM alert_instances ORDER BY fingerprint");
  if (!q.ok()) return Error(db_, "preparing alert state query");
  int rc;
  while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
    sqlite3_stmt* s = q.get();
    const std::string fingerprint = ColumnText(s, 0);
    auto alert = notify::AlertFromJson(ColumnText(s, 3));
    if (!alert.ok()) {
      spdlog::error("alert store: alert {} cannot be read, it is not restored: {}", fingerprint,
                    alert.status().message());
      continue;
    }
    alerts::InstanceState inst;
    inst.run = ColumnText(s, 1);
    inst.rule = ColumnText(s, 2);
    inst.alert = std::move(alert).value();
    inst.held_since_step = static_cast<uint64_t>(sqlite3_column_int64(s, 4));
    inst.clearing = sqlite3_column_int(s, 5) != 0;
    inst.clearing_since_step = static_cast<uint64_t>(sqlite3_column_int64(s, 6));
    inst.notified = sqlite3_column_int(s, 7) != 0;
    if (sqlite3_column_type(s, 8) != SQLITE_NULL) {
      try {
        inst.ack = AckFromJson(ColumnText(s, 8));
      } catch (const nlohmann::json::exception& e) {
        spdlog::error("alert store: the acknowledgement of alert {} cannot be read, it is dropped: {}",
                      fingerprint, e.what());
      }
    }
    saved.instances.push_back(std::move(inst));
  }
  if (rc != SQLITE_DONE) return Error(db_, "reading alert states");

  Stmt qs(db_, "SELECT id, matchers, starts_at, ends_at, comment, created_by FROM silences ORDER BY id");
  if (!qs.ok()) return Error(db_, "preparing silence query");
  while ((rc = sqlite3_step(qs.get())) == SQLITE_ROW) {
    sqlite3_stmt* s = qs.get();
    alerts::Silence silence;
    silence.id = ColumnText(s, 0);
    try {
      silence.matchers = nlohmann::json::parse(ColumnText(s, 1)).get<alerts::LabelSet>();
    } catch (const nlohmann::json::exception& e) {
      spdlog::error("alert store: silence {} cannot be read, it is not restored: {}", silence.id, e.what());
      continue;
    }
    silence.starts_at = sqlite3_column_double(s, 2);
    silence.ends_at = sqlite3_column_double(s, 3);
    silence.comment = ColumnText(s, 4);
    silence.created_by = ColumnText(s, 5);
    saved.silences.push_back(std::move(silence));
  }
  if (rc != SQLITE_DONE) return Error(db_, "reading silences");
  return saved;
}

notify::Result<std::vector<uint64_t>> AlertStore::Write(std::vector<notify::OutboxEntry> entries,
                                                        const alerts::StateChanges& states) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  if (auto s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  std::vector<uint64_t> ids;
  Stmt insert(db_,
              "INSERT INTO outbox (receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at) "
              "VALUES (?, ?, ?, ?, ?, ?, ?)");
  if (!insert.ok()) {
    Exec("ROLLBACK");
    return Error(db_, "preparing insert");
  }
  for (const notify::OutboxEntry& e : entries) {
    sqlite3_stmt* s = insert.get();
    sqlite3_reset(s);
    BindText(s, 1, e.receiver);
    BindText(s, 2, e.fingerprint);
    sqlite3_bind_int(s, 3, static_cast<int>(e.state));
    BindText(s, 4, e.payload);
    sqlite3_bind_double(s, 5, e.created_at);
    sqlite3_bind_int64(s, 6, e.attempts);
    sqlite3_bind_double(s, 7, e.next_attempt_at);
    if (sqlite3_step(s) != SQLITE_DONE) {
      notify::Status err = Error(db_, "inserting an entry");
      Exec("ROLLBACK");
      return err;
    }
    ids.push_back(static_cast<uint64_t>(sqlite3_last_insert_rowid(db_)));
  }
  if (auto s = ApplyLocked(states); !s.ok()) {
    Exec("ROLLBACK");
    return s;
  }
  if (auto s = Exec("COMMIT"); !s.ok()) {
    Exec("ROLLBACK");
    return s;
  }
  return ids;
}

notify::Result<std::vector<notify::OutboxEntry>> AlertStore::Pending(std::string_view receiver, size_t limit,
                                                                     double now) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  // Due entries first; an entry waits (is left out) while an older one of its fingerprint is not due.
  Stmt q(db_,
         "SELECT id, receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at FROM outbox o "
         "WHERE receiver = ?1 AND delivery = 0 AND NOT EXISTS (SELECT 1 FROM outbox p WHERE p.receiver = ?1 "
         "AND p.delivery = 0 AND p.fingerprint = o.fingerprint AND p.id < o.id AND p.next_attempt_at > ?3) "
         "ORDER BY next_attempt_at > ?3, id LIMIT ?2");
  if (!q.ok()) return Error(db_, "preparing pending query");
  BindText(q.get(), 1, receiver);
  sqlite3_bind_int64(q.get(), 2, static_cast<sqlite3_int64>(limit));
  sqlite3_bind_double(q.get(), 3, now);
  std::vector<notify::OutboxEntry> out;
  int rc;
  while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
    notify::OutboxEntry e;
    sqlite3_stmt* s = q.get();
    e.id = static_cast<uint64_t>(sqlite3_column_int64(s, 0));
    e.receiver = ColumnText(s, 1);
    e.fingerprint = ColumnText(s, 2);
    e.state = static_cast<alerts::AlertState>(sqlite3_column_int(s, 3));
    e.payload = ColumnText(s, 4);
    e.created_at = sqlite3_column_double(s, 5);
    e.attempts = static_cast<uint32_t>(sqlite3_column_int64(s, 6));
    e.next_attempt_at = sqlite3_column_double(s, 7);
    out.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return Error(db_, "reading pending entries");
  return out;
}

notify::Result<uint64_t> AlertStore::PendingCount(std::string_view receiver) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  Stmt q(db_, "SELECT count(*) FROM outbox WHERE receiver = ? AND delivery = 0");
  if (!q.ok()) return Error(db_, "preparing count");
  BindText(q.get(), 1, receiver);
  if (sqlite3_step(q.get()) != SQLITE_ROW) return Error(db_, "counting pending entries");
  return static_cast<uint64_t>(sqlite3_column_int64(q.get(), 0));
}

notify::Status AlertStore::SetState(uint64_t id, int state, std::string_view error) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  Stmt u(db_, "UPDATE outbox SET delivery = ?, error = ? WHERE id = ?");
  if (!u.ok()) return Error(db_, "preparing update");
  sqlite3_bind_int(u.get(), 1, state);
  BindText(u.get(), 2, error);
  sqlite3_bind_int64(u.get(), 3, static_cast<sqlite3_int64>(id));
  if (sqlite3_step(u.get()) != SQLITE_DONE) return Error(db_, "updating entry " + std::to_string(id));
  return notify::Status::Ok();
}

notify::Result<uint64_t> AlertStore::PruneDone(double created_before, size_t max_rows) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  Stmt d(db_,
         "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE delivery IN (?, ?) AND created_at < ? "
         "ORDER BY id LIMIT ?)");
  if (!d.ok()) return Error(db_, "preparing prune");
  sqlite3_bind_int(d.get(), 1, kDelivered);
  sqlite3_bind_int(d.get(), 2, kFailed);
  sqlite3_bind_double(d.get(), 3, created_before);
  sqlite3_bind_int64(d.get(), 4, static_cast<sqlite3_int64>(std::min<size_t>(max_rows, INT64_MAX)));
  if (sqlite3_step(d.get()) != SQLITE_DONE) return Error(db_, "pruning delivered entries");
  return static_cast<uint64_t>(sqlite3_changes(db_));
}

notify::Status AlertStore::MarkDelivered(uint64_t id) { return SetState(id, kDelivered, ""); }

notify::Status AlertStore::MarkFailed(uint64_t id, std::string_view error) { return SetState(id, kFailed, error); }

notify::Status AlertStore::MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts,
                                       std::string_view error) {
  std::lock_guard lock(mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  Stmt u(db_, "UPDATE outbox SET attempts = ?, next_attempt_at = ?, error = ? WHERE id = ?");
  if (!u.ok()) return Error(db_, "preparing retry update");
  sqlite3_bind_int64(u.get(), 1, attempts);
  sqlite3_bind_double(u.get(), 2, next_attempt_at);
  BindText(u.get(), 3, error);
  sqlite3_bind_int64(u.get(), 4, static_cast<sqlite3_int64>(id));
  if (sqlite3_step(u.get()) != SQLITE_DONE) return Error(db_, "updating entry " + std::to_string(id));
  return notify::Status::Ok();
}

}  // namespace gradwatch::store

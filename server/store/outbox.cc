#include "server/store/outbox.h"

#include <sqlite3.h>

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

}  // namespace

StatusOr<std::unique_ptr<SqliteOutbox>> SqliteOutbox::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string message = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Status::IoError("outbox: cannot open " + path + ": " + message);
  }
  std::unique_ptr<SqliteOutbox> outbox(new SqliteOutbox(db));
  sqlite3_busy_timeout(db, 5000);
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
                          "CREATE TABLE IF NOT EXISTS outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                          "receiver TEXT NOT NULL, fingerprint TEXT NOT NULL, state INTEGER NOT NULL, "
                          "payload TEXT NOT NULL, created_at REAL NOT NULL, attempts INTEGER NOT NULL, "
                          "next_attempt_at REAL NOT NULL, delivery INTEGER NOT NULL DEFAULT 0, error TEXT)",
                          "CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (receiver, delivery, id)"}) {
    if (auto s = outbox->Exec(sql); !s.ok()) return Status::IoError(s.message());
  }
  return outbox;
}

SqliteOutbox::~SqliteOutbox() { sqlite3_close(db_); }

notify::Status SqliteOutbox::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string message = err ? err : "unknown error";
    sqlite3_free(err);
    return notify::NotifyError(std::string("outbox: ") + sql + ": " + message);
  }
  return notify::Status::Ok();
}

notify::Result<std::vector<uint64_t>> SqliteOutbox::Add(std::vector<notify::OutboxEntry> entries) {
  std::lock_guard lock(mu_);
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
  if (auto s = Exec("COMMIT"); !s.ok()) {
    Exec("ROLLBACK");
    return s;
  }
  return ids;
}

notify::Result<std::vector<notify::OutboxEntry>> SqliteOutbox::Pending(std::string_view receiver, size_t limit) {
  std::lock_guard lock(mu_);
  Stmt q(db_,
         "SELECT id, receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at FROM outbox "
         "WHERE receiver = ? AND delivery = 0 ORDER BY id LIMIT ?");
  if (!q.ok()) return Error(db_, "preparing pending query");
  BindText(q.get(), 1, receiver);
  sqlite3_bind_int64(q.get(), 2, static_cast<sqlite3_int64>(limit));
  std::vector<notify::OutboxEntry> out;
  int rc;
  while ((rc = sqlite3_step(q.get())) == SQLITE_ROW) {
    notify::OutboxEntry e;
    sqlite3_stmt* s = q.get();
    e.id = static_cast<uint64_t>(sqlite3_column_int64(s, 0));
    e.receiver = reinterpret_cast<const char*>(sqlite3_column_text(s, 1));
    e.fingerprint = reinterpret_cast<const char*>(sqlite3_column_text(s, 2));
    e.state = static_cast<alerts::AlertState>(sqlite3_column_int(s, 3));
    e.payload = reinterpret_cast<const char*>(sqlite3_column_text(s, 4));
    e.created_at = sqlite3_column_double(s, 5);
    e.attempts = static_cast<uint32_t>(sqlite3_column_int64(s, 6));
    e.next_attempt_at = sqlite3_column_double(s, 7);
    out.push_back(std::move(e));
  }
  if (rc != SQLITE_DONE) return Error(db_, "reading pending entries");
  return out;
}

notify::Result<uint64_t> SqliteOutbox::PendingCount(std::string_view receiver) {
  std::lock_guard lock(mu_);
  Stmt q(db_, "SELECT count(*) FROM outbox WHERE receiver = ? AND delivery = 0");
  if (!q.ok()) return Error(db_, "preparing count");
  BindText(q.get(), 1, receiver);
  if (sqlite3_step(q.get()) != SQLITE_ROW) return Error(db_, "counting pending entries");
  return static_cast<uint64_t>(sqlite3_column_int64(q.get(), 0));
}

notify::Status SqliteOutbox::SetState(uint64_t id, int state, std::string_view error) {
  std::lock_guard lock(mu_);
  Stmt u(db_, "UPDATE outbox SET delivery = ?, error = ? WHERE id = ?");
  if (!u.ok()) return Error(db_, "preparing update");
  sqlite3_bind_int(u.get(), 1, state);
  BindText(u.get(), 2, error);
  sqlite3_bind_int64(u.get(), 3, static_cast<sqlite3_int64>(id));
  if (sqlite3_step(u.get()) != SQLITE_DONE) return Error(db_, "updating entry " + std::to_string(id));
  return notify::Status::Ok();
}

notify::Status SqliteOutbox::MarkDelivered(uint64_t id) { return SetState(id, kDelivered, ""); }

notify::Status SqliteOutbox::MarkFailed(uint64_t id, std::string_view error) { return SetState(id, kFailed, error); }

notify::Status SqliteOutbox::MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts,
                                       std::string_view error) {
  std::lock_guard lock(mu_);
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

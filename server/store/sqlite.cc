#include "server/store/sqlite.h"

#include <sqlite3.h>

#include <algorithm>
#include <array>
#include <utility>

#include <spdlog/spdlog.h>

namespace gradwatch::store::sqlite {

namespace {

std::string Message(sqlite3* db) { return db != nullptr ? sqlite3_errmsg(db) : "out of memory"; }

}  // namespace

Database::Database(sqlite3* db, std::string path) : db_(db), path_(std::move(path)) {}

Database::Database(Database&& other) noexcept { *this = std::move(other); }

Database& Database::operator=(Database&& other) noexcept {
  std::swap(db_, other.db_);
  std::swap(path_, other.path_);
  std::swap(transaction_statements_, other.transaction_statements_);
  return *this;
}

Database::~Database() {
  if (Status s = Close(); !s.ok()) spdlog::error("sqlite: {}", s.message());
}

StatusOr<Database> Database::Open(const std::string& path, const OpenOptions& options) {
  sqlite3* raw = nullptr;
  const int flags = SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX | (options.create ? SQLITE_OPEN_CREATE : 0) |
                    (options.uri ? SQLITE_OPEN_URI : 0);
  const int rc = sqlite3_open_v2(path.c_str(), &raw, flags, nullptr);
  Database db(raw, path);  // closes a handle SQLite returned with its error
  if (rc != SQLITE_OK) return Status::IoError("cannot open '" + path + "': " + Message(raw));
  if (sqlite3_busy_timeout(raw, static_cast<int>(options.busy_timeout.count())) != SQLITE_OK) {
    return Status::IoError("setting the busy timeout of '" + path + "': " + Message(raw));
  }
  return db;
}

Status Database::Exec(const std::string& sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    std::string message = "'" + sql + "': " + (err != nullptr ? std::string(err) : Message(db_));
    sqlite3_free(err);
    return Status::IoError(std::move(message));
  }
  return Status::Ok();
}

StatusOr<Statement> Database::Prepare(const std::string& sql, bool persistent) {
  sqlite3_stmt* stmt = nullptr;
  const unsigned flags = persistent ? SQLITE_PREPARE_PERSISTENT : 0;
  if (sqlite3_prepare_v3(db_, sql.c_str(), static_cast<int>(sql.size()), flags, &stmt, nullptr) != SQLITE_OK) {
    sqlite3_finalize(stmt);
    return Status::IoError("preparing '" + sql + "': " + Message(db_));
  }
  return Statement(stmt);
}

Status Database::UseWal() {
  auto mode = Prepare("PRAGMA journal_mode=WAL");
  if (!mode.ok()) return mode.status();
  Query q(*mode);
  Status status;
  if (!q.Next(&status, "enabling WAL mode")) {
    return status.ok() ? Status::Internal("PRAGMA journal_mode returned no row") : status;
  }
  if (const std::string got = q.Text(0); got != "wal") {
    return Status::IoError("'" + path_ + "': cannot use WAL mode (got '" + got + "')");
  }
  return Status::Ok();
}

int64_t Database::changes() const { return sqlite3_changes64(db_); }

int64_t Database::last_insert_rowid() const { return sqlite3_last_insert_rowid(db_); }

Status Database::Error(std::string_view what) const { return Status::IoError(std::string(what) + ": " + Message(db_)); }

bool Database::last_error_is_damage() const {
  if (db_ == nullptr) return false;
  const int code = sqlite3_errcode(db_) & 0xff;
  return code == SQLITE_CORRUPT || code == SQLITE_NOTADB;
}

void Database::SkipCheckpointOnClose() {
  if (db_ != nullptr) sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
}

Status Database::Close() {
  transaction_statements_.reset();  // sqlite3_close refuses a connection with live statements
  if (db_ == nullptr) return Status::Ok();
  sqlite3* db = std::exchange(db_, nullptr);
  if (sqlite3_close(db) == SQLITE_OK) return Status::Ok();
  Status error = Status::IoError("closing '" + path_ + "': " + Message(db));
  sqlite3_close_v2(db);  // freed once its last statement is finalized
  return error;
}

StatusOr<Database::TransactionStatements*> Database::transaction_statements() {
  if (transaction_statements_ != nullptr) return transaction_statements_.get();
  auto statements = std::make_unique<TransactionStatements>();
  const std::pair<Statement*, const char*> all[] = {{&statements->begin, "BEGIN"},
                                                    {&statements->begin_immediate, "BEGIN IMMEDIATE"},
                                                    {&statements->commit, "COMMIT"},
                                                    {&statements->rollback, "ROLLBACK"}};
  for (const auto& [statement, sql] : all) {
    auto prepared = Prepare(sql, true);
    if (!prepared.ok()) return prepared.status();
    *statement = std::move(prepared).value();
  }
  transaction_statements_ = std::move(statements);
  return transaction_statements_.get();
}

Statement::Statement(Statement&& other) noexcept : stmt_(std::exchange(other.stmt_, nullptr)) {}

Statement& Statement::operator=(Statement&& other) noexcept {
  std::swap(stmt_, other.stmt_);
  return *this;
}

Statement::~Statement() { sqlite3_finalize(stmt_); }

Query::~Query() {
  if (stmt_ == nullptr) return;
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
}

void Query::Check(int rc, int index) {
  if (rc == SQLITE_OK || !bind_error_.empty()) return;
  bind_error_ = "binding parameter " + std::to_string(index) + " of '" + sqlite3_sql(stmt_) +
                "': " + Message(sqlite3_db_handle(stmt_));
}

void Query::Bind(int index, std::string_view text) {
  if (stmt_ == nullptr) return;
  Check(sqlite3_bind_text64(stmt_, index, text.data(), text.size(), SQLITE_STATIC, SQLITE_UTF8), index);
}

void Query::BindInt64(int index, int64_t value) {
  if (stmt_ == nullptr) return;
  Check(sqlite3_bind_int64(stmt_, index, value), index);
}

void Query::Bind(int index, double value) {
  if (stmt_ == nullptr) return;
  Check(sqlite3_bind_double(stmt_, index, value), index);
}

void Query::BindNull(int index) {
  if (stmt_ == nullptr) return;
  Check(sqlite3_bind_null(stmt_, index), index);
}

void Query::BindBlob(int index, std::string_view bytes) { BindBlob(index, bytes.data(), bytes.size()); }

void Query::BindBlob(int index, const void* data, size_t bytes) {
  if (stmt_ == nullptr) return;
  // A null pointer would bind NULL, not an empty blob.
  static constexpr char kEmpty = 0;
  Check(sqlite3_bind_blob64(stmt_, index, bytes == 0 ? &kEmpty : data, bytes, SQLITE_STATIC), index);
}

Status Query::StepError(std::string_view what) const {
  if (stmt_ == nullptr) return Status::Internal(std::string(what) + ": the statement was never prepared");
  if (!bind_error_.empty()) return Status::IoError(std::string(what) + ": " + bind_error_);
  return Status::IoError(std::string(what) + ": " + Message(sqlite3_db_handle(stmt_)));
}

Status Query::Run(std::string_view what) {
  if (stmt_ == nullptr || !bind_error_.empty()) return StepError(what);
  if (sqlite3_step(stmt_) != SQLITE_DONE) return StepError(what);
  return Status::Ok();
}

bool Query::Next(Status* status, std::string_view what) {
  if (stmt_ == nullptr || !bind_error_.empty()) {
    *status = StepError(what);
    return false;
  }
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc != SQLITE_DONE) *status = StepError(what);
  return false;
}

std::string Query::Text(int column) const {
  const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, column));
  return p != nullptr ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, column))) : std::string();
}

std::string_view Query::Blob(int column) const {
  const auto* p = static_cast<const char*>(sqlite3_column_blob(stmt_, column));
  return p != nullptr ? std::string_view(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, column)))
                      : std::string_view();
}

int64_t Query::Int(int column) const { return sqlite3_column_int64(stmt_, column); }

double Query::Real(int column) const { return sqlite3_column_double(stmt_, column); }

bool Query::IsNull(int column) const { return sqlite3_column_type(stmt_, column) == SQLITE_NULL; }

Transaction::~Transaction() {
  if (!open_) return;
  auto statements = db_.transaction_statements();
  Status s = statements.ok() ? Query((*statements)->rollback).Run(what_ + ": rollback") : statements.status();
  // A failed statement may already have rolled the transaction back; that is fine.
  if (!s.ok() && db_.is_open() && sqlite3_get_autocommit(db_.get()) == 0) {
    spdlog::error("{}: rollback failed: {}", what_, s.message());
  }
}

Status Transaction::Begin(Mode mode) {
  auto statements = db_.transaction_statements();
  if (!statements.ok()) return Status(statements.status().code(), what_ + ": " + statements.status().message());
  const Statement& begin = mode == Mode::kImmediate ? (*statements)->begin_immediate : (*statements)->begin;
  Status s = Query(begin).Run(what_ + ": begin transaction");
  open_ = s.ok();
  return s;
}

Status Transaction::Commit() {
  auto statements = db_.transaction_statements();
  if (!statements.ok()) return Status(statements.status().code(), what_ + ": " + statements.status().message());
  Status s = Query((*statements)->commit).Run(what_ + ": commit");
  if (s.ok()) open_ = false;
  return s;
}

StatusOr<int64_t> UserVersion(Database& db) {
  auto pragma = db.Prepare("PRAGMA user_version");
  if (!pragma.ok()) return pragma.status();
  Query q(*pragma);
  Status status;
  if (!q.Next(&status, "reading user_version")) {
    return status.ok() ? Status::Internal("PRAGMA user_version returned no row") : status;
  }
  return q.Int(0);
}

Status ApplySchema(Database& db, const Schema& schema) {
  const std::string label = schema.name + " '" + db.path() + "'";
  auto found = UserVersion(db);
  if (!found.ok()) return Status(found.status().code(), label + ": " + found.status().message());
  auto newer = [&](int64_t version) {
    return Status::FailedPrecondition(label + " has schema version " + std::to_string(version) +
                                      ", newer than the supported " + std::to_string(schema.version));
  };
  if (*found == schema.version) return Status::Ok();
  if (*found > schema.version) return newer(*found);
  Transaction txn(db, label);
  if (Status s = txn.Begin(Transaction::Mode::kImmediate); !s.ok()) return s;
  // Read again under the write lock: another connection may have set the schema up meanwhile.
  found = UserVersion(db);
  if (!found.ok()) return Status(found.status().code(), label + ": " + found.status().message());
  int64_t version = *found;
  if (version == schema.version) return txn.Commit();
  if (version > schema.version) return newer(version);
  if (version == 0) {
    for (const std::string& sql : schema.scripts) {
      if (Status s = db.Exec(sql); !s.ok()) return Status(s.code(), label + ": creating the schema: " + s.message());
    }
    version = schema.version;
  }
  while (version < schema.version) {
    const auto migration = std::find_if(schema.migrations.begin(), schema.migrations.end(),
                                        [&](const Migration& m) { return m.from_version == version; });
    if (migration == schema.migrations.end()) {
      return Status::FailedPrecondition(label + " has schema version " + std::to_string(version) +
                                        ", which cannot be migrated to " + std::to_string(schema.version));
    }
    for (const std::string& sql : migration->scripts) {
      if (Status s = db.Exec(sql); !s.ok()) {
        return Status(s.code(),
                      label + ": migrating from schema version " + std::to_string(version) + ": " + s.message());
      }
    }
    ++version;
  }
  if (Status s = db.Exec("PRAGMA user_version = " + std::to_string(schema.version)); !s.ok()) {
    return Status(s.code(), label + ": " + s.message());
  }
  return txn.Commit();
}

}  // namespace gradwatch::store::sqlite

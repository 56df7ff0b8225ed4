// The store's one SQLite wrapper, used by the journal and the alert store (each on a connection of
// its own to the same file): an owned connection, prepared statements with typed binding, a
// transaction that ends with its scope, and schema versions in PRAGMA user_version.
//
// Errors are Status values (IoError unless said otherwise), never exceptions. Their messages say
// what was being done (the caller's `what`, or the SQL) and end with SQLite's own message; a
// failure to prepare or to bind also quotes the SQL, since it is a mistake in the code. Nothing here
// logs, except where no caller is left to tell: a Transaction's failed rollback at scope exit, and a
// Database's failed close in its destructor.
//
// Not thread-safe: a Database, its Statements and its Transactions are used by one thread at a time
// (the callers' locks see to it: connections are opened with SQLITE_OPEN_NOMUTEX).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace gradwatch::store::sqlite {

class Database;

struct OpenOptions {
  bool create = true;  // create the file when it is missing
  bool uri = false;    // the path may be a "file:" URI (https://www.sqlite.org/uri.html)
  // How long a statement waits for another connection's lock before failing with SQLITE_BUSY.
  std::chrono::milliseconds busy_timeout{5000};
};

// A prepared statement, finalized on destruction. Move-only. Run it through a Query.
class Statement {
 public:
  Statement() = default;  // prepares nothing; Query refuses it
  Statement(Statement&& other) noexcept;
  Statement& operator=(Statement&& other) noexcept;  // swaps
  ~Statement();

  sqlite3_stmt* get() const { return stmt_; }

 private:
  friend class Database;
  explicit Statement(sqlite3_stmt* stmt) : stmt_(stmt) {}
  sqlite3_stmt* stmt_ = nullptr;
};

// An open connection; closed on destruction. Move-only.
class Database {
 public:
  Database() = default;  // not open
  // Error: "cannot open '<path>': <message>".
  [[nodiscard]] static StatusOr<Database> Open(const std::string& path, const OpenOptions& options = {});
  Database(Database&& other) noexcept;
  Database& operator=(Database&& other) noexcept;  // swaps: `other` closes what this held
  ~Database();

  bool is_open() const { return db_ != nullptr; }
  const std::string& path() const { return path_; }
  // The raw handle, for what this wrapper does not cover (the online backup API).
  sqlite3* get() const { return db_; }

  // Runs SQL that returns no rows we need (several statements allowed). Error: "'<sql>': <message>".
  [[nodiscard]] Status Exec(const std::string& sql);
  // Prepares one statement; `persistent` for statements kept and reused for the connection's life
  // (SQLITE_PREPARE_PERSISTENT). Error: "preparing '<sql>': <message>".
  [[nodiscard]] StatusOr<Statement> Prepare(const std::string& sql, bool persistent = false);
  // PRAGMA journal_mode=WAL, refused unless SQLite answers "wal" (some file systems cannot).
  [[nodiscard]] Status UseWal();

  // Rows changed by the last INSERT, UPDATE or DELETE; the rowid of the last INSERT.
  int64_t changes() const;
  int64_t last_insert_rowid() const;
  // "<what>: <SQLite's message for the last failure on this connection>", for the raw API.
  Status Error(std::string_view what) const;
  // The last failure on this connection was caused by the file's contents (SQLITE_CORRUPT,
  // SQLITE_NOTADB), not by the storage under it or by the SQL. Ask right after the failure.
  bool last_error_is_damage() const;

  // SQLite checkpoints the WAL into the database when the last connection to it closes, and then
  // deletes the WAL by name. When the files at path() are no longer (or never were sound) this
  // connection's, that would delete or rewrite someone else's: call this before closing them.
  void SkipCheckpointOnClose();
  // Closes. Every Statement prepared on it must be gone first; if SQLite still refuses, the error
  // is returned and the handle is freed once its last statement is. Idempotent.
  Status Close();

 private:
  friend class Transaction;
  // The statements of a Transaction, prepared at its first use on this connection.
  struct TransactionStatements {
    Statement begin, begin_immediate, commit, rollback;
  };

  Database(sqlite3* db, std::string path);
  StatusOr<TransactionStatements*> transaction_statements();

  sqlite3* db_ = nullptr;
  std::string path_;
  std::unique_ptr<TransactionStatements> transaction_statements_;
};

// One use of a Statement (one Query of a Statement at a time): bind its parameters, step it, read
// its columns. When the Query ends the statement is reset and its bindings cleared, so that no
// statement stays active across a COMMIT and nothing bound outlives the buffer it points into. The
// first failed bind is kept and reported by the next Run or Next, with the parameter, the SQL and
// SQLite's message, so a run of binds needs no check after each.
class Query {
 public:
  explicit Query(const Statement& statement) : stmt_(statement.get()) {}
  ~Query();
  Query(const Query&) = delete;
  Query& operator=(const Query&) = delete;

  // Parameters count from 1. Text and blobs are bound without a copy: they must stay alive and
  // unchanged until the Query ends; temporaries are refused at compile time.
  void Bind(int index, std::string_view text);
  void Bind(int index, const char* text) { Bind(index, std::string_view(text)); }
  void Bind(int index, std::string&& text) = delete;
  // Integers of any width and signedness, bools as 0 and 1; a uint64_t keeps its bits (read it
  // back with Unsigned).
  template <std::integral T>
  void Bind(int index, T value) {
    BindInt64(index, static_cast<int64_t>(value));
  }
  void Bind(int index, double value);
  void BindNull(int index);
  // NULL when empty.
  template <typename T>
  void Bind(int index, const std::optional<T>& value) {
    if (value) {
      Bind(index, *value);
    } else {
      BindNull(index);
    }
  }
  void BindBlob(int index, std::string_view bytes);
  void BindBlob(int index, std::string&& bytes) = delete;
  void BindBlob(int index, const void* data, size_t bytes);

  // Steps a statement that returns no rows. Error: "<what>: <message>" (with the SQL for a bind).
  [[nodiscard]] Status Run(std::string_view what);
  // Steps a query: true with a row to read; false at the end, and on failure, which then sets
  // *status (left alone otherwise), so that `while (q.Next(&s, what)) {...} if (!s.ok()) ...`.
  [[nodiscard]] bool Next(Status* status, std::string_view what);

  // Columns of the current row count from 0. Text and blobs of NULL are empty; a blob's view is
  // valid until the next Next or the end of the Query.
  std::string Text(int column) const;
  std::string_view Blob(int column) const;
  int64_t Int(int column) const;
  uint64_t Unsigned(int column) const { return static_cast<uint64_t>(Int(column)); }
  double Real(int column) const;
  bool IsNull(int column) const;

 private:
  void BindInt64(int index, int64_t value);
  void Check(int rc, int index);
  Status StepError(std::string_view what) const;

  sqlite3_stmt* stmt_;
  std::string bind_error_;  // the first failed bind, empty when none failed
};

// A transaction that ends with its scope: rolled back then unless Commit succeeded. A rollback
// that fails at scope exit is logged (unless a failed statement already rolled it back).
class Transaction {
 public:
  enum class Mode {
    kDeferred,   // BEGIN: reads see one snapshot; the write lock is taken at the first write
    kImmediate,  // BEGIN IMMEDIATE: takes the write lock now, so a busy database fails here
  };
  // `what` names the owner in messages: "<what>: begin transaction: <message>".
  Transaction(Database& db, std::string_view what) : db_(db), what_(what) {}
  ~Transaction();
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;

  [[nodiscard]] Status Begin(Mode mode);
  // Error: "<what>: commit: <message>"; the transaction is then still open, and rolled back at
  // scope exit.
  [[nodiscard]] Status Commit();

 private:
  Database& db_;
  std::string what_;
  bool open_ = false;
};

// Schema versions, kept in PRAGMA user_version. There is one user_version per file, so one owner
// of the file versions it (the journal); other tables in the same file (the alert store's) are
// created if missing and may only ever gain tables.
struct Migration {
  int from_version = 0;              // takes a database at this version to from_version + 1
  std::vector<std::string> scripts;  // run in order
};
struct Schema {
  std::string name;  // in messages: "<name> '<path>' has schema version ..."
  int version = 1;   // the current version, at least 1
  // Creates the current schema in a new database (user_version 0).
  std::vector<std::string> scripts;
  // One per older version still opened, any order; versions without one are refused.
  std::vector<Migration> migrations;
};

// Brings the database to schema.version: a new one gets schema.scripts, an older one its
// migrations in version order, all in one BEGIN IMMEDIATE transaction that also sets user_version,
// so a failure leaves the database as it was. FailedPrecondition for a version newer than
// schema.version or one no migration starts from. Does nothing (and writes nothing) when the
// database is already at schema.version.
[[nodiscard]] Status ApplySchema(Database& db, const Schema& schema);

// The database's PRAGMA user_version.
[[nodiscard]] StatusOr<int64_t> UserVersion(Database& db);

}  // namespace gradwatch::store::sqlite

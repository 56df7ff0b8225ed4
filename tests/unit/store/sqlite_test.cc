#include "server/store/sqlite.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"

using namespace gradwatch;
using namespace gradwatch::store;
using gradwatch::testing::TempDir;

namespace {

sqlite::Database OpenOrFail(const std::string& path) {
  auto db = sqlite::Database::Open(path);
  INFO(db.status().ToString());
  REQUIRE(db.ok());
  return std::move(db).value();
}

sqlite::Statement PrepareOrFail(sqlite::Database& db, const std::string& sql) {
  auto statement = db.Prepare(sql);
  INFO(statement.status().ToString());
  REQUIRE(statement.ok());
  return std::move(statement).value();
}

// The single value `sql` returns, as text ("" for none).
std::string Scalar(sqlite::Database& db, const std::string& sql) {
  sqlite::Statement statement = PrepareOrFail(db, sql);
  sqlite::Query q(statement);
  Status status;
  const std::string value = q.Next(&status, "scalar") ? q.Text(0) : "";
  INFO(status.ToString());
  REQUIRE(status.ok());
  return value;
}

std::vector<std::string> ColumnsOf(sqlite::Database& db, const std::string& table) {
  sqlite::Statement statement = PrepareOrFail(db, "PRAGMA table_info(" + table + ")");
  sqlite::Query q(statement);
  Status status;
  std::vector<std::string> out;
  while (q.Next(&status, "table_info")) out.push_back(q.Text(1));
  REQUIRE(status.ok());
  return out;
}

}  // namespace

TEST_CASE("sqlite: a failed bind is reported by the step with the parameter, the SQL and SQLite's message",
          "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  REQUIRE(db.Exec("CREATE TABLE t(a INTEGER, b TEXT)").ok());
  sqlite::Statement insert = PrepareOrFail(db, "INSERT INTO t(a, b) VALUES(?1, ?2)");
  {
    sqlite::Query q(insert);
    q.Bind(1, 7);
    q.Bind(5, "no such parameter");
    q.Bind(2, "fine");
    const Status s = q.Run("writing row 7");
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::StartsWith("writing row 7: binding parameter 5 of "
                                              "'INSERT INTO t(a, b) VALUES(?1, ?2)': "));
    CHECK_THAT(s.message(), Catch::Contains("out of range"));
  }
  // Nothing was written, and the statement is usable again once the Query ended.
  CHECK(Scalar(db, "SELECT count(*) FROM t") == "0");
  sqlite::Query q(insert);
  q.Bind(1, 8);
  q.Bind(2, "ok");
  CHECK(q.Run("writing row 8").ok());
}

TEST_CASE("sqlite: preparing and executing bad SQL quote the SQL and SQLite's message", "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  auto bad = db.Prepare("SELEC 1");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kIoError);
  CHECK_THAT(bad.status().message(), Catch::StartsWith("preparing 'SELEC 1': ") && Catch::Contains("syntax error"));
  const Status exec = db.Exec("DROP TABLE missing");
  REQUIRE_FALSE(exec.ok());
  CHECK_THAT(exec.message(), Catch::StartsWith("'DROP TABLE missing': ") && Catch::Contains("no such table"));
}

TEST_CASE("sqlite: a step that fails names what was done and SQLite's message", "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  REQUIRE(db.Exec("CREATE TABLE t(a INTEGER PRIMARY KEY)").ok());
  REQUIRE(db.Exec("INSERT INTO t VALUES(1)").ok());
  sqlite::Statement insert = PrepareOrFail(db, "INSERT INTO t VALUES(?1)");
  sqlite::Query q(insert);
  q.Bind(1, 1);
  const Status s = q.Run("writing a duplicate");
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::StartsWith("writing a duplicate: ") && Catch::Contains("UNIQUE constraint failed"));
}

TEST_CASE("sqlite: values keep their exact bits, empty optionals are NULL and an empty blob is not",
          "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  REQUIRE(db.Exec("CREATE TABLE t(id INTEGER PRIMARY KEY, u INTEGER, d REAL, o REAL, b BLOB, s TEXT)").ok());
  const uint64_t big = std::numeric_limits<uint64_t>::max() - 1;
  const std::string blob("\0\x01\xff\0", 4);
  const std::string text("with\0nul", 8);
  sqlite::Statement insert = PrepareOrFail(db, "INSERT INTO t VALUES(?1, ?2, ?3, ?4, ?5, ?6)");
  {
    sqlite::Query q(insert);
    q.Bind(1, 1);
    q.Bind(2, big);
    q.Bind(3, -0.1);
    q.Bind(4, std::optional<double>());
    q.BindBlob(5, blob);
    q.Bind(6, text);
    REQUIRE(q.Run("row 1").ok());
  }
  {
    sqlite::Query q(insert);
    q.Bind(1, 2);
    q.Bind(2, true);
    q.Bind(3, 0.0);
    q.Bind(4, std::optional<double>(2.5));
    q.BindBlob(5, std::string_view());
    q.BindNull(6);
    REQUIRE(q.Run("row 2").ok());
  }
  sqlite::Statement select = PrepareOrFail(db, "SELECT u, d, o, b, s, typeof(b), typeof(s) FROM t ORDER BY id");
  sqlite::Query q(select);
  Status status;
  REQUIRE(q.Next(&status, "row 1"));
  CHECK(q.Unsigned(0) == big);
  CHECK(q.Real(1) == -0.1);
  CHECK(q.IsNull(2));
  CHECK(q.Blob(3) == blob);
  CHECK(q.Text(4) == text);
  REQUIRE(q.Next(&status, "row 2"));
  CHECK(q.Int(0) == 1);
  CHECK(q.Real(2) == 2.5);
  CHECK(q.Blob(3).empty());
  CHECK(q.Text(5) == "blob");
  CHECK(q.Text(6) == "null");
  CHECK_FALSE(q.Next(&status, "end"));
  CHECK(status.ok());
}

TEST_CASE("sqlite: a transaction is rolled back at scope exit unless committed", "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  REQUIRE(db.UseWal().ok());
  REQUIRE(db.Exec("CREATE TABLE t(a INTEGER)").ok());
  sqlite::Database other = OpenOrFail(dir.db());
  {
    sqlite::Transaction txn(db, "test");
    REQUIRE(txn.Begin(sqlite::Transaction::Mode::kImmediate).ok());
    REQUIRE(db.Exec("INSERT INTO t VALUES(1)").ok());
    CHECK(Scalar(db, "SELECT count(*) FROM t") == "1");
    // Immediate: the write lock is held, so another connection cannot begin a write.
    auto busy = sqlite::Database::Open(dir.db(), {.busy_timeout = std::chrono::milliseconds(0)});
    REQUIRE(busy.ok());
    sqlite::Transaction blocked(*busy, "other");
    const Status s = blocked.Begin(sqlite::Transaction::Mode::kImmediate);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::StartsWith("other: begin transaction: ") && Catch::Contains("locked"));
  }
  CHECK(Scalar(db, "SELECT count(*) FROM t") == "0");
  CHECK(Scalar(other, "SELECT count(*) FROM t") == "0");
  {
    sqlite::Transaction txn(db, "test");
    REQUIRE(txn.Begin(sqlite::Transaction::Mode::kDeferred).ok());
    REQUIRE(db.Exec("INSERT INTO t VALUES(2)").ok());
    REQUIRE(txn.Commit().ok());
  }
  CHECK(Scalar(other, "SELECT group_concat(a) FROM t") == "2");
}

namespace {

// Version 1 had t(a); version 2 added b, filled from a; version 3 added c, filled from b (so the
// migrations must run in order).
sqlite::Schema TestSchema() {
  return {
      .name = "test db",
      .version = 3,
      .scripts = {"CREATE TABLE t(a INTEGER, b INTEGER, c INTEGER)"},
      .migrations = {{.from_version = 2, .scripts = {"ALTER TABLE t ADD COLUMN c INTEGER", "UPDATE t SET c = b * 10"}},
                     {.from_version = 1, .scripts = {"ALTER TABLE t ADD COLUMN b INTEGER", "UPDATE t SET b = a + 1"}}}};
}

}  // namespace

TEST_CASE("sqlite: a new database gets the current schema and version, an old one its migrations in order",
          "[store][sqlite]") {
  TempDir dir;
  {
    sqlite::Database fresh = OpenOrFail((dir.path() / "new.db").string());
    REQUIRE(sqlite::ApplySchema(fresh, TestSchema()).ok());
    CHECK(sqlite::UserVersion(fresh).value() == 3);
    CHECK(ColumnsOf(fresh, "t") == std::vector<std::string>{"a", "b", "c"});
  }
  sqlite::Database old = OpenOrFail(dir.db());
  REQUIRE(old.Exec("CREATE TABLE t(a INTEGER); INSERT INTO t VALUES(4); PRAGMA user_version = 1").ok());
  REQUIRE(sqlite::ApplySchema(old, TestSchema()).ok());
  CHECK(sqlite::UserVersion(old).value() == 3);
  CHECK(Scalar(old, "SELECT a || ',' || b || ',' || c FROM t") == "4,5,50");
  // At the current version nothing runs again.
  REQUIRE(sqlite::ApplySchema(old, TestSchema()).ok());
  CHECK(Scalar(old, "SELECT count(*) FROM t") == "1");
}

TEST_CASE("sqlite: a newer or unknown schema version is refused and a failed migration changes nothing",
          "[store][sqlite]") {
  TempDir dir;
  sqlite::Database db = OpenOrFail(dir.db());
  SECTION("newer") {
    REQUIRE(db.Exec("PRAGMA user_version = 7").ok());
    const Status s = sqlite::ApplySchema(db, TestSchema());
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK(s.message() == "test db '" + dir.db() + "' has schema version 7, newer than the supported 3");
  }
  SECTION("no migration from it") {
    sqlite::Schema schema = TestSchema();
    schema.migrations.pop_back();  // the one from version 1
    REQUIRE(db.Exec("CREATE TABLE t(a INTEGER); PRAGMA user_version = 1").ok());
    const Status s = sqlite::ApplySchema(db, schema);
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(s.message(), Catch::Contains("schema version 1, which cannot be migrated to 3"));
    CHECK(sqlite::UserVersion(db).value() == 1);
  }
  SECTION("a migration fails half way") {
    sqlite::Schema schema = TestSchema();
    schema.migrations[0].scripts.back() = "UPDATE t SET c = missing_column";
    REQUIRE(db.Exec("CREATE TABLE t(a INTEGER); INSERT INTO t VALUES(4); PRAGMA user_version = 1").ok());
    const Status s = sqlite::ApplySchema(db, schema);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::StartsWith("test db '" + dir.db() + "': migrating from schema version 2: ") &&
                                Catch::Contains("missing_column"));
    // The migration from version 1 that did succeed was rolled back with it.
    CHECK(sqlite::UserVersion(db).value() == 1);
    CHECK(ColumnsOf(db, "t") == std::vector<std::string>{"a"});
  }
}

TEST_CASE(
    "sqlite: a connection waiting for the write lock gets it when the holder commits, and gives up at its busy "
    "timeout",
    "[store][sqlite]") {
  TempDir dir;
  sqlite::Database holder = OpenOrFail(dir.db());
  REQUIRE(holder.UseWal().ok());
  REQUIRE(holder.Exec("CREATE TABLE t(a INTEGER)").ok());
  sqlite::Database waiter = OpenOrFail(dir.db());
  {
    sqlite::Transaction held(holder, "holder");
    REQUIRE(held.Begin(sqlite::Transaction::Mode::kImmediate).ok());
    REQUIRE(holder.Exec("INSERT INTO t VALUES(1)").ok());
    std::atomic<bool> committing{false};
    auto waited = std::async(std::launch::async, [&] {
      sqlite::Transaction txn(waiter, "waiter");
      Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate);
      const bool after_commit = committing.load();
      if (s.ok()) s = waiter.Exec("INSERT INTO t VALUES(2)");
      if (s.ok()) s = txn.Commit();
      return std::make_pair(s, after_commit);
    });
    // The waiter is blocked for as long as the lock is held, here at least 200 ms.
    CHECK(waited.wait_for(std::chrono::milliseconds(200)) == std::future_status::timeout);
    committing = true;
    REQUIRE(held.Commit().ok());
    const auto [status, after_commit] = waited.get();
    INFO(status.ToString());
    CHECK(status.ok());
    CHECK(after_commit);
  }
  CHECK(Scalar(holder, "SELECT group_concat(a) FROM t") == "1,2");

  // A lock never released within the timeout: the waiter fails with SQLite's own message, after it.
  auto impatient = sqlite::Database::Open(dir.db(), {.busy_timeout = std::chrono::milliseconds(150)});
  REQUIRE(impatient.ok());
  sqlite::Transaction held(holder, "holder");
  REQUIRE(held.Begin(sqlite::Transaction::Mode::kImmediate).ok());
  sqlite::Transaction blocked(*impatient, "impatient");
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = blocked.Begin(sqlite::Transaction::Mode::kImmediate);
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(150));
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::StartsWith("impatient: begin transaction: ") && Catch::Contains("locked"));
}

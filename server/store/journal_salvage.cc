// Salvage and repair of a damaged journal: copying what can still be read into a fresh one.
#include "server/store/journal_salvage.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "server/store/journal_check.h"
#include "server/store/sqlite.h"

namespace gradwatch::store {

namespace {

// The tables that hold runs' rows, each with a run_id column: copied run by run when salvaging.
constexpr std::array<const char*, 10> kRunTables = {
    "runs",    "params",          "series",           "steps",      "rank_progress", "events",
    "rewinds", "abandoned_steps", "abandoned_events", "step_blocks"};
std::string QuoteName(const std::string& name) {
  std::string out = "\"";
  for (char c : name) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// The column names of schema.table (empty when the table is missing or unreadable).
std::vector<std::string> Columns(sqlite::Database& db, const char* schema, const std::string& table) {
  std::vector<std::string> out;
  auto info = db.Prepare(std::string("PRAGMA ") + schema + ".table_info(" + QuoteName(table) + ")");
  if (!info.ok()) return out;
  sqlite::Query use(*info);
  Status s;
  while (use.Next(&s, "table_info")) out.push_back(use.Text(1));
  return out;
}

}  // namespace

std::string ReadOnlyUri(const std::string& path) {
  std::string uri = "file:";
  for (char c : path) {
    if (c == '%' || c == '?' || c == '#') {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
      uri += hex;
    } else {
      uri += c;
    }
  }
  return uri + "?mode=ro";
}

bool QuickCheck(sqlite::Database& db, std::string* detail) {
  auto check = db.Prepare("PRAGMA quick_check(5)");
  if (!check.ok()) {
    *detail += "quick_check cannot run: " + check.status().message() + ". ";
    return false;
  }
  sqlite::Query use(*check);
  Status s;
  bool ok = true;
  while (use.Next(&s, "journal: quick_check")) {
    const std::string line = use.Text(0);
    if (line != "ok") ok = false, *detail += "quick_check: " + line + ". ";
  }
  if (!s.ok()) ok = false, *detail += s.message() + ". ";
  return ok;
}

std::string AsideName(const std::string& path, const char* what) {
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &utc);
  const std::string base = path + "." + what + "-" + stamp;
  std::string name = base;
  std::error_code ec;
  for (int i = 2; std::filesystem::exists(name, ec) || std::filesystem::exists(name + "-wal", ec); ++i) {
    name = base + "-" + std::to_string(i);
  }
  return name;
}

// Renames the database at `path` and its -wal and -shm files (those that exist) to `to` with the
// same suffixes, the database first; appends the new names to *moved.
Status RenameFiles(const std::string& path, const std::string& to, std::vector<std::string>* moved) {
  for (const char* suffix : {"", "-wal", "-shm"}) {
    std::error_code ec;
    if (!std::filesystem::exists(path + suffix, ec)) continue;
    std::filesystem::rename(path + suffix, to + suffix, ec);
    if (ec) return Status::IoError("cannot rename " + path + suffix + " to " + to + suffix + ": " + ec.message());
    moved->push_back(to + suffix);
  }
  return Status::Ok();
}

// Copies into the fresh journal `db` what can be read from the damaged one at `damaged_path`,
// attached read-only: each run whole (its rows in every run table, one transaction per run) or not
// at all, then every other table (the alert store's) whole or not at all.
void Salvage(sqlite::Database& db, const std::string& damaged_path, RecoveryReport& report) {
  const std::string uri = ReadOnlyUri(damaged_path);
  {
    auto attach = db.Prepare("ATTACH DATABASE ?1 AS damaged");
    if (!attach.ok()) {
      report.detail += "cannot read the damaged file: " + attach.status().message() + ". ";
      return;
    }
    sqlite::Query use(*attach);
    use.Bind(1, uri);
    if (Status s = use.Run("attaching the damaged journal"); !s.ok()) {
      report.detail += "cannot read the damaged file: " + s.message() + ". ";
      return;
    }
  }
  std::vector<std::pair<std::string, std::string>> tables;  // name, CREATE statement
  Status listed;
  {
    auto q = db.Prepare(
        "SELECT name, sql FROM damaged.sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name");
    listed = q.status();
    if (listed.ok()) {
      sqlite::Query use(*q);
      while (use.Next(&listed, "reading the damaged schema")) tables.emplace_back(use.Text(0), use.Text(1));
    }
  }
  if (!listed.ok()) {
    report.detail += "its schema cannot be read (" + listed.message() + "): nothing could be salvaged. ";
    tables.clear();
  }
  auto has_table = [&](const std::string& name) {
    return std::any_of(tables.begin(), tables.end(), [&](const auto& t) { return t.first == name; });
  };
  // The runs, each copied with its rows from every run table in one transaction.
  std::vector<std::string> run_ids;
  if (has_table("runs")) {
    auto q = db.Prepare("SELECT run_id FROM damaged.runs");
    Status s = q.status();
    if (s.ok()) {
      sqlite::Query use(*q);
      while (use.Next(&s, "reading the damaged runs table")) run_ids.push_back(use.Text(0));
    }
    if (!s.ok()) {
      report.detail += "the runs table is damaged: only the " + std::to_string(run_ids.size()) +
                       " run(s) listed before the damage could be salvaged (" + s.message() + "). ";
    }
  }
  std::vector<sqlite::Statement> copies;
  for (const char* table : kRunTables) {
    if (!has_table(table)) continue;
    const std::vector<std::string> fresh = Columns(db, "main", table);
    const std::vector<std::string> old = Columns(db, "damaged", table);
    std::string cols;
    for (const std::string& c : fresh) {
      if (std::find(old.begin(), old.end(), c) == old.end()) continue;
      cols += (cols.empty() ? "" : ", ") + QuoteName(c);
    }
    if (cols.empty()) continue;
    const std::string sql = std::string("INSERT OR REPLACE INTO main.") + table + "(" + cols + ") SELECT " + cols +
                            " FROM damaged." + table + " WHERE run_id = ?1";
    if (auto copy = db.Prepare(sql); copy.ok()) copies.push_back(std::move(copy).value());
  }
  for (const std::string& id : run_ids) {
    sqlite::Transaction txn(db, "journal");
    Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate);
    for (size_t i = 0; s.ok() && i < copies.size(); ++i) {
      sqlite::Query use(copies[i]);
      use.Bind(1, id);
      s = use.Run("copying run '" + id + "'");
    }
    if (s.ok()) s = txn.Commit();
    if (s.ok()) {
      ++report.salvaged_runs;
    } else {
      ++report.lost_runs;
      report.lost_run_ids.push_back(id);
      spdlog::error("journal: run {} cannot be salvaged from the damaged journal: {}", id, s.message());
    }
  }
  // Every other table (the alert store's outbox, alert states and silences), whole or not at all.
  for (const auto& table : tables) {
    const std::string& name = table.first;
    const std::string& create = table.second;
    if (std::find_if(kRunTables.begin(), kRunTables.end(), [&](const char* t) { return name == t; }) !=
        kRunTables.end()) {
      continue;
    }
    sqlite::Transaction txn(db, "journal");
    Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate);
    if (s.ok()) s = db.Exec(create);
    if (s.ok()) {
      auto indexes = db.Prepare(
          "SELECT sql FROM damaged.sqlite_master WHERE type = 'index' AND tbl_name = ?1 AND sql IS NOT NULL");
      s = indexes.status();
      std::vector<std::string> creates;
      if (s.ok()) {
        sqlite::Query use(*indexes);
        use.Bind(1, name);
        while (use.Next(&s, "reading the damaged indexes")) creates.push_back(use.Text(0));
      }
      for (size_t i = 0; s.ok() && i < creates.size(); ++i) s = db.Exec(creates[i]);
    }
    if (s.ok()) s = db.Exec("INSERT INTO main." + QuoteName(name) + " SELECT * FROM damaged." + QuoteName(name));
    if (s.ok()) s = txn.Commit();
    if (!s.ok()) {
      report.lost_tables.push_back(name);
      spdlog::error("journal: table {} cannot be salvaged from the damaged journal: {}", name, s.message());
    }
  }
  if (Status s = db.Exec("DETACH DATABASE damaged"); !s.ok()) {
    spdlog::warn("journal: detaching the damaged journal: {}", s.message());
  }
}

}  // namespace gradwatch::store

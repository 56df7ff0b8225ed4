// Salvage and repair of a damaged journal: copying what can still be read into a fresh one.
#include "server/store/journal_salvage.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include <spdlog/spdlog.h>

#include "server/store/journal_check.h"
#include "server/store/page_recovery.h"
#include "server/store/sqlite.h"
#include "server/store/step_block.h"

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

// Binds a recovered value as SQLite stored it.
void BindRecovered(sqlite::Query& q, int index, const RecoveredValue& v) {
  switch (v.type) {
    case RecoveredValue::Type::kNull: q.BindNull(index); break;
    case RecoveredValue::Type::kInteger: q.Bind(index, v.integer); break;
    case RecoveredValue::Type::kReal: q.Bind(index, v.real); break;
    case RecoveredValue::Type::kText: q.Bind(index, std::string_view(v.bytes)); break;
    case RecoveredValue::Type::kBlob: q.BindBlob(index, std::string_view(v.bytes)); break;
  }
}

// Why a recovered row of `table` must not be kept (its checksum fails), empty when it may.
std::string RecoveredDamage(const std::string& table, const RecoveredRecord& r) {
  const auto& v = r.values;
  if (table == "steps" && v.size() >= 7) {
    const bool typed = v[0].type == RecoveredValue::Type::kText && v[1].type == RecoveredValue::Type::kInteger &&
                       v[6].type == RecoveredValue::Type::kBlob;
    if (!typed) return "unexpected column types";
    std::optional<int64_t> crc;
    if (v.size() >= 8 && v[7].type == RecoveredValue::Type::kInteger) crc = v[7].integer;
    const double wall_time = v[2].type == RecoveredValue::Type::kReal ? v[2].real : static_cast<double>(v[2].integer);
    return StepRowDamage(v[0].bytes, static_cast<uint64_t>(v[1].integer), wall_time, v[3].integer != 0,
                         static_cast<uint32_t>(v[4].integer), static_cast<uint64_t>(v[5].integer), v[6].bytes, crc);
  }
  if (table == "step_blocks" && v.size() >= 6) {
    if (v[5].type != RecoveredValue::Type::kBlob) return "unexpected column types";
    if (Status st = VerifyStepBlock(v[5].bytes); !st.ok()) return st.message();
  }
  return {};
}

// SQLite cannot read the damaged file at all (a journal cut short names root pages past its end):
// its records are read page by page (page_recovery.h) into the fresh journal's run tables, in one
// transaction. Step rows and blocks must pass their checksums. Rows of a run whose runs row was not
// recovered are left out and the run counted lost. A run whose recovered steps end below what its
// ranks were acked for has its progress lowered to them, so that its trainers resend the rest.
void SalvageFromPages(sqlite::Database& db, const std::string& damaged_path, RecoveryReport& report) {
  sqlite::Transaction txn(db, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) {
    report.detail += "salvage page by page: " + s.message() + ". ";
    return;
  }
  std::map<std::pair<std::string, size_t>, sqlite::Statement> inserts;  // (table, values) → INSERT
  std::map<std::string, std::vector<std::string>> columns;
  uint64_t kept = 0, refused = 0;
  // Inserts a record into main.<table> by column position; false when it does not fit.
  auto insert_record = [&](const std::string& table, const RecoveredRecord& record) {
    auto cols = columns.find(table);
    if (cols == columns.end()) cols = columns.emplace(table, Columns(db, "main", table)).first;
    const size_t n = record.values.size();
    if (n == 0 || n > cols->second.size()) return false;
    auto insert = inserts.find({table, n});
    if (insert == inserts.end()) {
      std::string names, params;
      for (size_t i = 0; i < n; ++i) {
        names += (i ? ", " : "") + QuoteName(cols->second[i]);
        params += (i ? ", ?" : "?") + std::to_string(i + 1);
      }
      auto prepared =
          db.Prepare("INSERT OR IGNORE INTO main." + QuoteName(table) + "(" + names + ") VALUES(" + params + ")");
      if (!prepared.ok()) return false;
      insert = inserts.emplace(std::make_pair(table, n), std::move(prepared).value()).first;
    }
    sqlite::Query use(insert->second);
    for (size_t i = 0; i < n; ++i) BindRecovered(use, static_cast<int>(i + 1), record.values[i]);
    return use.Run("salvage").ok();
  };
  // Other tables (the alert store's) are created from their recovered schema once it is read:
  // their records wait in memory, up to kMaxHeldBytes in all (beyond it, those tables are lost).
  constexpr size_t kMaxHeldBytes = size_t{64} << 20;
  std::map<std::string, std::vector<RecoveredRecord>> held;
  std::set<std::string> too_large;
  size_t held_bytes = 0;
  auto on_record = [&](const std::string& table, const RecoveredRecord& record) {
    if (std::find(kRunTables.begin(), kRunTables.end(), table) == kRunTables.end()) {
      if (too_large.count(table) != 0) return;
      for (const RecoveredValue& v : record.values) held_bytes += sizeof v + v.bytes.size();
      if (held_bytes > kMaxHeldBytes) {
        too_large.insert(table);
        held.erase(table);
        return;
      }
      held[table].push_back(record);
      return;
    }
    if (!RecoveredDamage(table, record).empty() || !insert_record(table, record)) {
      ++refused;
      return;
    }
    ++kept;
  };
  auto read = RecoverRecords(damaged_path, on_record);
  if (!read.ok()) {
    report.detail += "read page by page: " + read.status().message() + ". ";
    return;
  }
  report.detail += "read page by page: " + std::to_string(kept) + " row(s) recovered, " + std::to_string(refused) +
                   " refused (checksum or shape)";
  uint64_t unreadable = 0;
  for (const RecoveredTableReport& t : read->tables) {
    unreadable += t.unreadable_pages;
    if (std::find(kRunTables.begin(), kRunTables.end(), t.name) != kRunTables.end()) continue;
    // CREATE TABLE IF NOT EXISTS: the table's owner creates it so again when it opens.
    const std::string create = "CREATE TABLE IF NOT EXISTS " + QuoteName(t.name) + " ";
    const size_t body = t.sql.find('(');
    const bool created = too_large.count(t.name) == 0 && t.unreadable_pages == 0 && t.lost_records == 0 &&
                         body != std::string::npos && db.Exec(create + t.sql.substr(body)).ok();
    bool ok = created;
    columns.erase(t.name);
    for (const RecoveredRecord& r : held[t.name]) ok = ok && insert_record(t.name, r);
    if (!ok) {
      report.lost_tables.push_back(t.name);
      if (created) {
        if (Status d = db.Exec("DELETE FROM main." + QuoteName(t.name)); !d.ok()) {
          spdlog::warn("journal: salvage: {}", d.message());
        }
      }
    }
  }
  held.clear();
  report.detail += ", " + std::to_string(unreadable) + " page(s) unreadable. ";
  inserts.clear();
  auto ids = [&](const std::string& sql) {
    std::vector<std::string> out;
    if (auto q = db.Prepare(sql); q.ok()) {
      sqlite::Query use(*q);
      Status st;
      while (use.Next(&st, "salvage")) out.push_back(use.Text(0));
    }
    return out;
  };
  // Rows of runs whose runs row is gone cannot be served: those runs are lost.
  std::set<std::string> lost;
  for (const char* table : kRunTables) {
    if (std::string_view(table) == "runs") continue;
    const std::string where =
        std::string(" FROM main.") + table + " WHERE run_id NOT IN (SELECT run_id FROM main.runs)";
    for (std::string& id : ids("SELECT DISTINCT run_id" + where)) lost.insert(std::move(id));
    if (Status st = db.Exec("DELETE" + where); !st.ok()) spdlog::warn("journal: salvage: {}", st.message());
  }
  report.lost_run_ids.assign(lost.begin(), lost.end());
  report.lost_runs = lost.size();
  for (const std::string& id : ids("SELECT run_id FROM main.runs ORDER BY run_id")) {
    ++report.salvaged_runs;
    auto q = db.Prepare(
        "SELECT (SELECT count(*) FROM main.steps WHERE run_id = ?1) + "
        "(SELECT coalesce(sum(steps), 0) FROM main.step_blocks WHERE run_id = ?1), "
        "max((SELECT coalesce(max(step), -1) FROM main.steps WHERE run_id = ?1), "
        "(SELECT coalesce(max(last_step), -1) FROM main.step_blocks WHERE run_id = ?1)), "
        "(SELECT max(step) FROM main.rank_progress WHERE run_id = ?1)");
    if (!q.ok()) continue;
    int64_t steps = 0, last = -1;
    std::optional<int64_t> acked;
    {
      sqlite::Query use(*q);
      use.Bind(1, id);
      Status st;
      if (!use.Next(&st, "salvage")) continue;
      steps = use.Int(0);
      last = use.Int(1);
      if (!use.IsNull(2)) acked = use.Int(2);
    }
    if (acked && *acked > last) {
      auto lower = db.Prepare(last < 0 ? "DELETE FROM main.rank_progress WHERE run_id = ?1"
                                       : "UPDATE main.rank_progress SET step = ?2 WHERE run_id = ?1 AND step > ?2");
      if (lower.ok()) {
        sqlite::Query use(*lower);
        use.Bind(1, id);
        if (last >= 0) use.Bind(2, last);
        if (Status st = use.Run("salvage"); !st.ok()) spdlog::warn("journal: salvage: {}", st.message());
      }
    }
    spdlog::error("journal: run {} salvaged page by page: {} step(s) recovered{}{}", id, steps,
                  last >= 0 ? ", the last " + std::to_string(last) : std::string(),
                  acked && *acked > last ? "; its ranks were acked through step " + std::to_string(*acked) +
                                               ": they resend the steps after " + std::to_string(last) +
                                               "; steps missing below it are lost"
                                         : std::string());
  }
  if (Status s = txn.Commit(); !s.ok()) {
    report.detail += "salvage page by page: " + s.message() + ". ";
    report.salvaged_runs = 0;
  }
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
      report.detail += "SQLite cannot read the damaged file (" + s.message() + "): read page by page. ";
      SalvageFromPages(db, damaged_path, report);
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
    report.detail += "SQLite cannot read its schema (" + listed.message() + "): read page by page. ";
    if (Status d = db.Exec("DETACH DATABASE damaged"); !d.ok()) {
      spdlog::warn("journal: detaching the damaged journal: {}", d.message());
    }
    SalvageFromPages(db, damaged_path, report);
    return;
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

#include "server/store/journal.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace gradwatch::store {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// Version 2 adds how a run ended, events found by run, and the rewind tables (kRewindTables); a
// version-1 journal is migrated at open.
constexpr int kSchemaVersion = 2;
constexpr int kBusyTimeoutMs = 5000;
// Back-off between attempts at a commit that failed (full disk, read-only or vanished files).
constexpr std::chrono::milliseconds kFirstRetryDelay{50};
constexpr std::chrono::milliseconds kMaxRetryDelay{2000};
// One (uint32 series id, float64 value) pair in a step's value blob.
constexpr size_t kValueEntryBytes = 4 + 8;
// A larger catalog index can only come from corruption; refuse it rather than allocate for it.
constexpr int64_t kMaxParamIndex = 1 << 24;

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS runs(
  run_id TEXT PRIMARY KEY,
  world_size INTEGER NOT NULL,
  labels_json TEXT NOT NULL,
  config_json TEXT NOT NULL,
  created_at REAL NOT NULL,
  ended_at REAL,
  end_reason INTEGER NOT NULL DEFAULT 0,
  end_message TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS params(
  run_id TEXT NOT NULL,
  idx INTEGER NOT NULL,
  name TEXT NOT NULL,
  numel INTEGER NOT NULL,
  kind INTEGER NOT NULL,
  weight_decay REAL NOT NULL,
  init_norm REAL,
  role TEXT NOT NULL,
  grp TEXT NOT NULL,
  PRIMARY KEY(run_id, idx));
CREATE TABLE IF NOT EXISTS series(
  run_id TEXT NOT NULL,
  id INTEGER NOT NULL,
  key TEXT NOT NULL,
  PRIMARY KEY(run_id, id));
CREATE TABLE IF NOT EXISTS steps(
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  partial INTEGER NOT NULL,
  ranks_reported INTEGER NOT NULL,
  client_dropped INTEGER NOT NULL,
  vals BLOB NOT NULL,
  PRIMARY KEY(run_id, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_progress(
  run_id TEXT NOT NULL,
  rank INTEGER NOT NULL,
  step INTEGER NOT NULL,
  seq INTEGER NOT NULL,
  PRIMARY KEY(run_id, rank));
CREATE TABLE IF NOT EXISTS events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL,
  step INTEGER NOT NULL,
  text TEXT NOT NULL,
  source TEXT NOT NULL,
  recorded_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, step);
PRAGMA user_version = 2;
)sql";

// Version 1 → 2: how a run ended (a Goodbye or inactivity), and events found by run.
constexpr const char* kMigrateFrom1 = R"sql(
ALTER TABLE runs ADD COLUMN end_reason INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN end_message TEXT NOT NULL DEFAULT '';
UPDATE runs SET end_reason = 1 WHERE ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, step);
PRAGMA user_version = 2;
)sql";

// The rewind tables: the abandoned branches of runs resumed from a checkpoint. Part of version 2,
// created after kSchema or kMigrateFrom1.
constexpr const char* kRewindTables = R"sql(
CREATE TABLE IF NOT EXISTS rewinds(
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  from_step INTEGER NOT NULL,
  world_size INTEGER NOT NULL,
  rewound_at REAL NOT NULL,
  PRIMARY KEY(run_id, branch));
CREATE TABLE IF NOT EXISTS abandoned_steps(
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  step INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  partial INTEGER NOT NULL,
  ranks_reported INTEGER NOT NULL,
  client_dropped INTEGER NOT NULL,
  vals BLOB NOT NULL,
  PRIMARY KEY(run_id, branch, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS abandoned_events(
  id INTEGER PRIMARY KEY,
  run_id TEXT NOT NULL,
  branch INTEGER NOT NULL,
  step INTEGER NOT NULL,
  text TEXT NOT NULL,
  source TEXT NOT NULL,
  recorded_at REAL NOT NULL);
)sql";

Status SqliteError(sqlite3* db, std::string_view what) {
  return Status::IoError(std::string(what) + ": " + (db ? sqlite3_errmsg(db) : "out of memory"));
}

// Runs SQL that returns no rows we need.
Status Exec(sqlite3* db, const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string message = std::string("'") + sql + "': " + (err ? err : sqlite3_errmsg(db));
    sqlite3_free(err);
    return Status::IoError(std::move(message));
  }
  return Status::Ok();
}

// An owned prepared statement.
class Stmt {
 public:
  Stmt() = default;
  explicit Stmt(sqlite3_stmt* stmt) : stmt_(stmt) {}
  Stmt(Stmt&& o) noexcept : stmt_(std::exchange(o.stmt_, nullptr)) {}
  Stmt& operator=(Stmt&& o) noexcept {
    std::swap(stmt_, o.stmt_);
    return *this;
  }
  ~Stmt() { sqlite3_finalize(stmt_); }

  sqlite3_stmt* get() const { return stmt_; }

 private:
  sqlite3_stmt* stmt_ = nullptr;
};

Status Prepare(sqlite3* db, const char* sql, bool persistent, Stmt& out) {
  sqlite3_stmt* stmt = nullptr;
  const unsigned flags = persistent ? SQLITE_PREPARE_PERSISTENT : 0;
  if (sqlite3_prepare_v3(db, sql, -1, flags, &stmt, nullptr) != SQLITE_OK) {
    sqlite3_finalize(stmt);
    return SqliteError(db, std::string("preparing '") + sql + "'");
  }
  out = Stmt(stmt);
  return Status::Ok();
}

// Resets the statement when a use of it ends, so that no statement stays active across a
// COMMIT and bound text never outlives the record it points into.
class StmtUse {
 public:
  explicit StmtUse(const Stmt& stmt) : stmt_(stmt.get()) {}
  ~StmtUse() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  StmtUse(const StmtUse&) = delete;
  StmtUse& operator=(const StmtUse&) = delete;

  void Text(int i, const std::string& s) {
    Check(sqlite3_bind_text(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_STATIC));
  }
  void Int(int i, int64_t v) { Check(sqlite3_bind_int64(stmt_, i, v)); }
  void Unsigned(int i, uint64_t v) { Int(i, static_cast<int64_t>(v)); }  // bit-preserving
  void Real(int i, double v) { Check(sqlite3_bind_double(stmt_, i, v)); }
  void Null(int i) { Check(sqlite3_bind_null(stmt_, i)); }
  void Blob(int i, const std::string& b) {
    Check(sqlite3_bind_blob(stmt_, i, b.data(), static_cast<int>(b.size()), SQLITE_STATIC));
  }

  // Steps a statement that returns no rows.
  Status Done(std::string_view what) {
    if (bind_rc_ != SQLITE_OK) return Error(what);
    if (sqlite3_step(stmt_) != SQLITE_DONE) return Error(what);
    return Status::Ok();
  }
  // Steps a query: true with a row, false at the end; an error sets *status.
  bool Row(Status* status, std::string_view what) {
    if (bind_rc_ != SQLITE_OK) {
      *status = Error(what);
      return false;
    }
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc != SQLITE_DONE) *status = Error(what);
    return false;
  }

  std::string ColText(int i) const {
    const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, i));
    return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, i))) : std::string();
  }
  std::string_view ColBlob(int i) const {
    const auto* p = static_cast<const char*>(sqlite3_column_blob(stmt_, i));
    return p ? std::string_view(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, i)))
             : std::string_view();
  }
  int64_t ColInt(int i) const { return sqlite3_column_int64(stmt_, i); }
  uint64_t ColUnsigned(int i) const { return static_cast<uint64_t>(ColInt(i)); }
  double ColReal(int i) const { return sqlite3_column_double(stmt_, i); }
  bool ColNull(int i) const { return sqlite3_column_type(stmt_, i) == SQLITE_NULL; }

 private:
  void Check(int rc) {
    if (bind_rc_ == SQLITE_OK) bind_rc_ = rc;
  }
  Status Error(std::string_view what) const {
    return SqliteError(sqlite3_db_handle(stmt_), what);
  }

  sqlite3_stmt* stmt_;
  int bind_rc_ = SQLITE_OK;
};

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

// Bit copies, never arithmetic, so NaN payloads and infinities survive exactly.
void EncodeValues(const std::vector<SeriesValue>& values, std::string& out) {
  out.clear();
  out.reserve(values.size() * kValueEntryBytes);
  for (const SeriesValue& v : values) {
    PutLe(out, v.id, 4);
    PutLe(out, std::bit_cast<uint64_t>(v.value), 8);
  }
}

bool DecodeValues(std::string_view blob, std::vector<SeriesValue>& out) {
  if (blob.size() % kValueEntryBytes != 0) return false;
  out.clear();
  out.reserve(blob.size() / kValueEntryBytes);
  for (size_t off = 0; off < blob.size(); off += kValueEntryBytes) {
    const char* p = blob.data() + off;
    out.push_back({static_cast<SeriesId>(GetLe(p, 4)), std::bit_cast<double>(GetLe(p + 4, 8))});
  }
  return true;
}

// nlohmann-json throws; these adapters turn every failure into a value. Invalid UTF-8 is
// replaced rather than thrown on, so odd labels never cost a commit.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string LabelsJson(const std::map<std::string, std::string>& labels) {
  try {
    return Dump(json(labels));
  } catch (const std::exception& e) {
    spdlog::error("journal: encoding labels: {}", e.what());
    return "{}";
  }
}

std::string ConfigJson(const RunConfig& config) {
  try {
    json j = {{"hidden_size", config.hidden_size},
              {"optimizer", config.optimizer},
              {"extra", config.extra}};
    if (config.z_loss_coef) j["z_loss_coef"] = *config.z_loss_coef;
    if (config.weight_decay) j["weight_decay"] = *config.weight_decay;
    return Dump(j);
  } catch (const std::exception& e) {
    spdlog::error("journal: encoding run config: {}", e.what());
    return "{}";
  }
}

bool ParseStringMap(const json& j, std::map<std::string, std::string>& out) {
  if (!j.is_object()) return false;
  for (const auto& [k, v] : j.items()) {
    if (!v.is_string()) return false;
    out[k] = v.get<std::string>();
  }
  return true;
}

// A non-finite number is written as JSON null; it reads back as absent.
bool ParseOptionalDouble(const json& j, const char* key, std::optional<double>& out) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_number()) return false;
  out = it->get<double>();
  return true;
}

Status ParseLabels(const std::string& text, const std::string& run_id,
                   std::map<std::string, std::string>& out) {
  try {
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && ParseStringMap(j, out)) return Status::Ok();
  } catch (const std::exception&) {
  }
  return Status::Internal("journal: run '" + run_id + "': labels are not a JSON object of strings");
}

Status ParseConfig(const std::string& text, const std::string& run_id, RunConfig& out) {
  try {
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.is_object()) {
      bool ok = true;
      if (const auto it = j.find("hidden_size"); it != j.end()) {
        ok = ok && it->is_number_unsigned();
        if (ok) out.hidden_size = it->get<uint64_t>();
      }
      if (const auto it = j.find("optimizer"); it != j.end()) {
        ok = ok && it->is_string();
        if (ok) out.optimizer = it->get<std::string>();
      }
      if (const auto it = j.find("extra"); it != j.end()) {
        ok = ok && ParseStringMap(*it, out.extra);
      }
      ok = ok && ParseOptionalDouble(j, "z_loss_coef", out.z_loss_coef);
      ok = ok && ParseOptionalDouble(j, "weight_decay", out.weight_decay);
      if (ok) return Status::Ok();
    }
  } catch (const std::exception&) {
  }
  return Status::Internal("journal: run '" + run_id + "': config is not valid JSON of the expected shape");
}

// Merges progress into one entry per (run, rank) holding the highest step and seq.
void MergeProgress(const std::vector<RankProgress>& in,
                   std::map<std::pair<std::string, uint32_t>, RankProgress>& merged) {
  for (const RankProgress& p : in) {
    auto [it, inserted] = merged.try_emplace({p.run_id, p.rank}, p);
    if (!inserted && p.branch > it->second.branch) {
      it->second = p;  // the run rewound within the batch: older progress is stale
    } else if (!inserted && p.branch == it->second.branch) {
      it->second.step = std::max(it->second.step, p.step);
      it->second.seq = std::max(it->second.seq, p.seq);
    }
  }
}

// Ends a read or write transaction on scope exit unless it was committed.
class Transaction {
 public:
  Transaction(sqlite3* db, const Stmt& rollback) : db_(db), rollback_(rollback) {}
  ~Transaction() {
    if (!open_) return;
    StmtUse use(rollback_);
    // A failed statement may already have rolled the transaction back; that is fine.
    if (!use.Done("rollback").ok() && sqlite3_get_autocommit(db_) == 0) {
      spdlog::error("journal: rollback failed: {}", sqlite3_errmsg(db_));
    }
  }
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;

  Status Begin(const Stmt& begin) {
    StmtUse use(begin);
    Status s = use.Done("journal: begin transaction");
    open_ = s.ok();
    return s;
  }
  Status Commit(const Stmt& commit) {
    StmtUse use(commit);
    Status s = use.Done("journal: commit");
    if (s.ok()) open_ = false;
    return s;
  }

 private:
  sqlite3* db_;
  const Stmt& rollback_;
  bool open_ = false;
};

// Creates the schema on a new database and refuses one written by a newer version.
Status SetUpSchema(sqlite3* db, const std::string& path) {
  int64_t found = 0;
  {
    Stmt version;
    if (Status s = Prepare(db, "PRAGMA user_version", false, version); !s.ok()) return s;
    StmtUse use(version);
    Status s;
    if (!use.Row(&s, "journal: reading user_version")) {
      return s.ok() ? Status::Internal("journal: PRAGMA user_version returned no row") : s;
    }
    found = use.ColInt(0);
  }
  if (found > kSchemaVersion) {
    return Status::FailedPrecondition("journal '" + path + "' has schema version " +
                                      std::to_string(found) + ", newer than the supported " +
                                      std::to_string(kSchemaVersion));
  }
  if (found == kSchemaVersion) return Status::Ok();
  if (Status s = Exec(db, "BEGIN IMMEDIATE"); !s.ok()) return s;
  for (const char* sql : {found == 1 ? kMigrateFrom1 : kSchema, kRewindTables}) {
    if (Status s = Exec(db, sql); !s.ok()) {
      Exec(db, "ROLLBACK");
      return s;
    }
  }
  return Exec(db, "COMMIT");
}

// Big-endian 32-bit field of a WAL header or frame header.
uint32_t GetBe32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// SQLite's WAL checksum (https://www.sqlite.org/fileformat2.html#walformat): over 32-bit words
// in the byte order the header's magic names, continuing from (s0, s1).
void WalChecksum(const unsigned char* p, size_t bytes, bool big_endian, uint32_t& s0, uint32_t& s1) {
  auto word = [big_endian](const unsigned char* w) {
    return big_endian ? GetBe32(w)
                      : (uint32_t{w[3]} << 24) | (uint32_t{w[2]} << 16) | (uint32_t{w[1]} << 8) | uint32_t{w[0]};
  };
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    s0 += word(p + i) + s1;
    s1 += word(p + i + 4) + s0;
  }
}

// Reads the WAL as SQLite's recovery will, before SQLite opens it, to count what recovery drops:
// frames of the current WAL (matching salts) after the last valid commit frame.
void ScanWal(const std::string& wal_path, RecoveryReport& report) {
  FILE* f = std::fopen(wal_path.c_str(), "rb");
  if (f == nullptr) return;
  std::unique_ptr<FILE, int (*)(FILE*)> owned(f, std::fclose);
  unsigned char header[32];
  if (std::fread(header, 1, sizeof header, f) != sizeof header) return;
  const uint32_t magic = GetBe32(header);
  if ((magic & ~1u) != 0x377f0682u) return;  // not a WAL SQLite would recover from
  const bool big_endian = (magic & 1u) != 0;
  const uint32_t page_size = GetBe32(header + 8);
  if (page_size < 512 || page_size > 65536 || (page_size & (page_size - 1)) != 0) return;
  uint32_t s0 = 0, s1 = 0;
  WalChecksum(header, 24, big_endian, s0, s1);
  if (s0 != GetBe32(header + 24) || s1 != GetBe32(header + 28)) return;  // SQLite ignores the file
  std::vector<unsigned char> frame(24 + page_size);
  uint64_t valid = 0, committed = 0, after_commit = 0;
  bool broken = false;
  while (true) {
    const size_t got = std::fread(frame.data(), 1, frame.size(), f);
    if (got == 0) break;
    const bool same_salt = got >= 24 && std::memcmp(frame.data() + 8, header + 16, 8) == 0;
    if (!same_salt) break;  // a frame of an earlier WAL generation: stale, not lost
    if (got < frame.size()) {
      ++after_commit, report.corrupt_tail = true;  // torn frame
      break;
    }
    if (!broken) {
      uint32_t c0 = s0, c1 = s1;
      WalChecksum(frame.data(), 8, big_endian, c0, c1);
      WalChecksum(frame.data() + 24, page_size, big_endian, c0, c1);
      if (c0 == GetBe32(frame.data() + 16) && c1 == GetBe32(frame.data() + 20)) {
        s0 = c0, s1 = c1;
        ++valid;
        if (GetBe32(frame.data() + 4) != 0) committed = valid, after_commit = 0;
        else ++after_commit;
        continue;
      }
      broken = true;
      report.corrupt_tail = true;
    }
    ++after_commit;
  }
  report.discarded_frames = after_commit;
  if (after_commit > 0) {
    report.detail += std::to_string(after_commit) + " WAL frame(s) after the last good transaction (frame " +
                     std::to_string(committed) + ") are discarded" +
                     (report.corrupt_tail ? ": the tail is damaged (bad checksum or torn frame)"
                                          : ": a transaction that never committed") + ". ";
  }
}

// Runs PRAGMA quick_check; false (with the first problem in *detail) when the database is damaged.
bool QuickCheck(sqlite3* db, std::string* detail) {
  Stmt check;
  if (!Prepare(db, "PRAGMA quick_check(5)", false, check).ok()) {
    *detail += std::string("quick_check cannot run: ") + sqlite3_errmsg(db) + ". ";
    return false;
  }
  StmtUse use(check);
  Status s;
  bool ok = true;
  while (use.Row(&s, "journal: quick_check")) {
    const std::string line = use.ColText(0);
    if (line != "ok") ok = false, *detail += "quick_check: " + line + ". ";
  }
  if (!s.ok()) ok = false, *detail += s.message() + ". ";
  return ok;
}

}  // namespace

struct Journal::Statements {
  Stmt begin, commit, rollback;
  Stmt insert_run, insert_param, insert_series, insert_step, upsert_progress, insert_event,
      end_run;
  Stmt count_rewinds, insert_rewind, abandon_steps, delete_steps, abandon_events, delete_events,
      rewind_progress, drop_progress, set_world_size;
  Stmt prune_candidates, prune_steps, prune_events, prune_series, prune_params, prune_progress, prune_run,
      prune_rewinds, prune_abandoned_steps, prune_abandoned_events;
  std::string scratch;  // the value blob being written; reused to spare allocations

  Status PrepareAll(sqlite3* db) {
    const std::pair<Stmt*, const char*> all[] = {
        {&begin, "BEGIN IMMEDIATE"},
        {&commit, "COMMIT"},
        {&rollback, "ROLLBACK"},
        {&insert_run,
         "INSERT OR REPLACE INTO runs(run_id, world_size, labels_json, config_json, created_at, "
         "ended_at) VALUES(?1, ?2, ?3, ?4, ?5, NULL)"},
        {&insert_param,
         "INSERT OR REPLACE INTO params(run_id, idx, name, numel, kind, weight_decay, init_norm, "
         "role, grp) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"},
        // Replacing keeps a re-registered series from failing the whole batch.
        {&insert_series, "INSERT OR REPLACE INTO series(run_id, id, key) VALUES(?1, ?2, ?3)"},
        {&insert_step,
         "INSERT OR REPLACE INTO steps(run_id, step, wall_time, partial, ranks_reported, "
         "client_dropped, vals) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7)"},
        {&upsert_progress,
         "INSERT INTO rank_progress(run_id, rank, step, seq) VALUES(?1, ?2, ?3, ?4) "
         "ON CONFLICT(run_id, rank) DO UPDATE SET step = max(step, excluded.step), "
         "seq = max(seq, excluded.seq)"},
        {&insert_event,
         "INSERT INTO events(run_id, step, text, source, recorded_at) VALUES(?1, ?2, ?3, ?4, ?5)"},
        {&end_run,
         "UPDATE runs SET ended_at = ?2, end_reason = ?3, end_message = ?4 WHERE run_id = ?1"},
        {&prune_candidates,
         "SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < ?1 ORDER BY ended_at LIMIT 64"},
        {&prune_steps,
         "DELETE FROM steps WHERE run_id = ?1 AND step IN "
         "(SELECT step FROM steps WHERE run_id = ?1 ORDER BY step LIMIT ?2)"},
        {&prune_events,
         "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_series,
         "DELETE FROM series WHERE rowid IN (SELECT rowid FROM series WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_params,
         "DELETE FROM params WHERE rowid IN (SELECT rowid FROM params WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_progress,
         "DELETE FROM rank_progress WHERE rowid IN (SELECT rowid FROM rank_progress WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_rewinds,
         "DELETE FROM rewinds WHERE rowid IN (SELECT rowid FROM rewinds WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_abandoned_steps,
         "DELETE FROM abandoned_steps WHERE run_id = ?1 AND (branch, step) IN "
         "(SELECT branch, step FROM abandoned_steps WHERE run_id = ?1 ORDER BY branch, step LIMIT ?2)"},
        {&prune_abandoned_events,
         "DELETE FROM abandoned_events WHERE id IN (SELECT id FROM abandoned_events WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_run, "DELETE FROM runs WHERE run_id = ?1"},
        {&count_rewinds, "SELECT count(*) FROM rewinds WHERE run_id = ?1"},
        {&insert_rewind,
         "INSERT INTO rewinds(run_id, branch, from_step, world_size, rewound_at) "
         "VALUES(?1, ?2, ?3, ?4, ?5)"},
        {&abandon_steps,
         "INSERT OR REPLACE INTO abandoned_steps(run_id, branch, step, wall_time, partial, "
         "ranks_reported, client_dropped, vals) SELECT run_id, ?2, step, wall_time, partial, "
         "ranks_reported, client_dropped, vals FROM steps WHERE run_id = ?1 AND step >= ?3"},
        {&delete_steps, "DELETE FROM steps WHERE run_id = ?1 AND step >= ?2"},
        {&abandon_events,
         "INSERT INTO abandoned_events(run_id, branch, step, text, source, recorded_at) "
         "SELECT run_id, ?2, step, text, source, recorded_at FROM events "
         "WHERE run_id = ?1 AND step >= ?3 ORDER BY id"},
        {&delete_events, "DELETE FROM events WHERE run_id = ?1 AND step >= ?2"},
        {&rewind_progress, "UPDATE rank_progress SET step = ?2 - 1 WHERE run_id = ?1 AND step >= ?2"},
        {&drop_progress, "DELETE FROM rank_progress WHERE run_id = ?1 AND (rank >= ?2 OR step >= ?3)"},
        {&set_world_size, "UPDATE runs SET world_size = ?2 WHERE run_id = ?1"},
    };
    for (const auto& [stmt, sql] : all) {
      if (Status s = Prepare(db, sql, true, *stmt); !s.ok()) return s;
    }
    return Status::Ok();
  }
};

// An open connection with its statements, and the identity (device, inode) of the files it
// opened. Closes on destruction; one whose files must stay as they are (damaged, or lost) is
// closed without the checkpoint SQLite makes at close, which would also delete the WAL by name.
struct Journal::Connection {
  sqlite3* db = nullptr;
  std::unique_ptr<Statements> statements;
  uint64_t db_dev = 0, db_ino = 0, wal_dev = 0, wal_ino = 0;
  bool keep_files = true;  // until it opened cleanly

  Connection() = default;
  Connection(Connection&& o) noexcept { *this = std::move(o); }
  Connection& operator=(Connection&& o) noexcept {
    Close();
    db = std::exchange(o.db, nullptr);
    statements = std::move(o.statements);
    db_dev = o.db_dev, db_ino = o.db_ino, wal_dev = o.wal_dev, wal_ino = o.wal_ino;
    keep_files = o.keep_files;
    return *this;
  }
  ~Connection() { Close(); }

  void Close() {
    statements.reset();  // sqlite3_close refuses a connection with live statements
    if (db == nullptr) return;
    if (keep_files) sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
    sqlite3_close(db);
    db = nullptr;
  }
};

namespace {

// The tables that hold runs' rows, each with a run_id column: copied run by run when salvaging.
constexpr std::array<const char*, 9> kRunTables = {"runs",    "params",  "series",          "steps",
                                                   "rank_progress", "events", "rewinds", "abandoned_steps",
                                                   "abandoned_events"};
constexpr auto kIdleFileCheck = std::chrono::seconds(1);

// SQLite says the file's contents are the problem, not the storage under it.
bool IsDamage(sqlite3* db) {
  const int code = sqlite3_errcode(db) & 0xff;
  return code == SQLITE_CORRUPT || code == SQLITE_NOTADB;
}

bool FileId(const std::string& path, uint64_t& dev, uint64_t& ino) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  dev = st.st_dev;
  ino = st.st_ino;
  return true;
}

// `<path>.<what>-<UTC time>`, with a counter when that name is taken.
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

std::string QuoteName(const std::string& name) {
  std::string out = "\"";
  for (char c : name) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// The column names of schema.table (empty when the table is missing or unreadable).
std::vector<std::string> Columns(sqlite3* db, const char* schema, const std::string& table) {
  std::vector<std::string> out;
  Stmt info;
  const std::string sql = std::string("PRAGMA ") + schema + ".table_info(" + QuoteName(table) + ")";
  if (!Prepare(db, sql.c_str(), false, info).ok()) return out;
  StmtUse use(info);
  Status s;
  while (use.Row(&s, "table_info")) out.push_back(use.ColText(1));
  return out;
}

// Copies into the fresh journal `db` what can be read from the damaged one at `damaged_path`,
// attached read-only: each run whole (its rows in every run table, one transaction per run) or not
// at all, then every other table (the alert store's) whole or not at all.
void Salvage(sqlite3* db, const std::string& damaged_path, RecoveryReport& report) {
  std::string uri = "file:";
  for (char c : damaged_path) {
    if (c == '%' || c == '?' || c == '#') {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned char>(c));
      uri += hex;
    } else {
      uri += c;
    }
  }
  uri += "?mode=ro";
  {
    Stmt attach;
    if (Status s = Prepare(db, "ATTACH DATABASE ?1 AS damaged", false, attach); !s.ok()) {
      report.detail += "cannot read the damaged file: " + s.message() + ". ";
      return;
    }
    StmtUse use(attach);
    use.Text(1, uri);
    if (Status s = use.Done("attaching the damaged journal"); !s.ok()) {
      report.detail += "cannot read the damaged file: " + s.message() + ". ";
      return;
    }
  }
  std::vector<std::pair<std::string, std::string>> tables;  // name, CREATE statement
  Status listed;
  {
    Stmt q;
    listed = Prepare(db,
                     "SELECT name, sql FROM damaged.sqlite_master WHERE type = 'table' AND "
                     "name NOT LIKE 'sqlite_%' ORDER BY name",
                     false, q);
    if (listed.ok()) {
      StmtUse use(q);
      while (use.Row(&listed, "reading the damaged schema")) tables.emplace_back(use.ColText(0), use.ColText(1));
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
    Stmt q;
    Status s = Prepare(db, "SELECT run_id FROM damaged.runs", false, q);
    if (s.ok()) {
      StmtUse use(q);
      while (use.Row(&s, "reading the damaged runs table")) run_ids.push_back(use.ColText(0));
    }
    if (!s.ok()) {
      report.detail += "the runs table is damaged: only the " + std::to_string(run_ids.size()) +
                       " run(s) listed before the damage could be salvaged (" + s.message() + "). ";
    }
  }
  std::vector<Stmt> copies;
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
    Stmt copy;
    if (Prepare(db, sql.c_str(), false, copy).ok()) copies.push_back(std::move(copy));
  }
  for (const std::string& id : run_ids) {
    Status s = Exec(db, "BEGIN IMMEDIATE");
    for (size_t i = 0; s.ok() && i < copies.size(); ++i) {
      StmtUse use(copies[i]);
      use.Text(1, id);
      s = use.Done("copying run '" + id + "'");
    }
    if (s.ok()) s = Exec(db, "COMMIT");
    if (s.ok()) {
      ++report.salvaged_runs;
    } else {
      Exec(db, "ROLLBACK");
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
    Status s = Exec(db, "BEGIN IMMEDIATE");
    if (s.ok()) s = Exec(db, create.c_str());
    if (s.ok()) {
      Stmt indexes;
      s = Prepare(db, "SELECT sql FROM damaged.sqlite_master WHERE type = 'index' AND tbl_name = ?1 AND sql IS NOT NULL",
                  false, indexes);
      std::vector<std::string> creates;
      if (s.ok()) {
        StmtUse use(indexes);
        use.Text(1, name);
        while (use.Row(&s, "reading the damaged indexes")) creates.push_back(use.ColText(0));
      }
      for (size_t i = 0; s.ok() && i < creates.size(); ++i) s = Exec(db, creates[i].c_str());
    }
    if (s.ok()) {
      const std::string copy = "INSERT INTO main." + QuoteName(name) + " SELECT * FROM damaged." + QuoteName(name);
      s = Exec(db, copy.c_str());
    }
    if (s.ok()) s = Exec(db, "COMMIT");
    if (!s.ok()) {
      Exec(db, "ROLLBACK");
      report.lost_tables.push_back(name);
      spdlog::error("journal: table {} cannot be salvaged from the damaged journal: {}", name, s.message());
    }
  }
  if (Status s = Exec(db, "DETACH DATABASE damaged"); !s.ok()) {
    spdlog::warn("journal: detaching the damaged journal: {}", s.message());
  }
}

}  // namespace

Status Journal::OpenConnection(const std::string& path, bool check, RecoveryReport& recovery, bool* damaged,
                               Connection& out) {
  *damaged = false;
  Connection conn;
  const int rc = sqlite3_open_v2(path.c_str(), &conn.db,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX | SQLITE_OPEN_URI,
                                 nullptr);
  sqlite3* db = conn.db;
  auto failed = [&](Status s) {
    *damaged = db != nullptr && IsDamage(db);
    return s;
  };
  if (rc != SQLITE_OK) return failed(SqliteError(db, "cannot open journal '" + path + "'"));
  if (sqlite3_busy_timeout(db, kBusyTimeoutMs) != SQLITE_OK) {
    return failed(SqliteError(db, "journal: setting busy timeout"));
  }
  {
    Stmt mode;
    if (Status s = Prepare(db, "PRAGMA journal_mode=WAL", false, mode); !s.ok()) return failed(s);
    StmtUse use(mode);
    Status s;
    if (!use.Row(&s, "journal: enabling WAL mode")) {
      return failed(s.ok() ? Status::Internal("journal: PRAGMA journal_mode returned no row") : s);
    }
    if (const std::string got = use.ColText(0); got != "wal") {
      return Status::IoError("journal '" + path + "': cannot use WAL mode (got '" + got + "')");
    }
  }
  // WAL with FULL fsyncs the log at every commit: an acked step survives a power cut.
  if (Status s = Exec(db, "PRAGMA synchronous=FULL"); !s.ok()) return failed(s);
  // Pruning frees pages that later writes reuse; the WAL shrinks back to this after checkpoints.
  if (Status s = Exec(db, "PRAGMA journal_size_limit=67108864"); !s.ok()) return failed(s);
  if (check && !QuickCheck(db, &recovery.detail)) {
    *damaged = true;
    return Status::IoError("journal '" + path + "' is damaged (PRAGMA quick_check)");
  }
  if (Status s = SetUpSchema(db, path); !s.ok()) return failed(s);
  conn.statements = std::make_unique<Statements>();
  if (Status s = conn.statements->PrepareAll(db); !s.ok()) return failed(s);
  if (!FileId(path, conn.db_dev, conn.db_ino)) {
    return Status::IoError("journal '" + path + "': stat after open: " + std::strerror(errno));
  }
  FileId(path + "-wal", conn.wal_dev, conn.wal_ino);  // adopted at the first check if not there yet
  conn.keep_files = false;
  out = std::move(conn);
  return Status::Ok();
}

Status Journal::MoveAsideAndSalvage(const std::string& path, RecoveryReport& recovery, Connection& out) {
  const std::string aside = AsideName(path, "damaged");
  if (Status s = RenameFiles(path, aside, &recovery.moved_files); !s.ok()) return s;
  recovery.moved_aside = true;
  RecoveryReport fresh;
  bool damaged = false;
  if (Status s = OpenConnection(path, false, fresh, &damaged, out); !s.ok()) {
    return Status(s.code(), "opening a fresh journal after moving the damaged one aside: " + s.message());
  }
  Salvage(out.db, aside, recovery);
  return Status::Ok();
}

StatusOr<std::unique_ptr<Journal>> Journal::Open(const JournalOptions& options, CommitCallback on_commit) {
  // SQLite's own message for a missing directory is only "unable to open database file".
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options.path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    return Status::IoError("cannot open journal '" + options.path + "': directory '" +
                           dir.string() + "' does not exist");
  }

  // Before SQLite opens the files: its recovery rewrites the WAL index and forgets what it dropped.
  RecoveryReport recovery;
  const bool had_db = std::filesystem::exists(options.path, ec);
  if (had_db && std::filesystem::exists(options.path + "-shm", ec) &&
      !std::filesystem::exists(options.path + "-wal", ec)) {
    recovery.wal_missing = true;
    recovery.detail += "the WAL (" + options.path + "-wal) is missing after an unclean stop: transactions "
                       "since the last checkpoint are lost. ";
  }
  ScanWal(options.path + "-wal", recovery);

  Connection conn;
  bool damaged = false;
  if (Status s = OpenConnection(options.path, had_db, recovery, &damaged, conn); !s.ok()) {
    if (!damaged) {
      if (recovery.detail.empty()) return s;
      return Status(s.code(), s.message() + " (" + recovery.detail + ")");
    }
    // Refusing to start would only make a restart loop: keep the damaged files, start afresh.
    recovery.damaged = true;
    recovery.detail += s.message() + ". ";
    conn.Close();
    if (Status m = MoveAsideAndSalvage(options.path, recovery, conn); !m.ok()) {
      return Status(m.code(), m.message() + " (" + recovery.detail + ")");
    }
  }
  if (recovery.moved_aside) {
    std::string files, lost;
    for (const std::string& f : recovery.moved_files) files += (files.empty() ? "" : ", ") + f;
    for (size_t i = 0; i < recovery.lost_run_ids.size() && i < 20; ++i) {
      lost += (lost.empty() ? "" : ", ") + recovery.lost_run_ids[i];
    }
    if (recovery.lost_run_ids.size() > 20) lost += ", ...";
    std::string tables;
    for (const std::string& t : recovery.lost_tables) tables += (tables.empty() ? "" : ", ") + t;
    spdlog::error("journal '{}' is damaged: {}its files were moved aside to {} (kept for inspection) and a fresh "
                  "journal started; salvaged {} run(s), lost {} run(s){}{}; trainers resend what they did not "
                  "see acknowledged",
                  options.path, recovery.detail, files, recovery.salvaged_runs, recovery.lost_runs,
                  lost.empty() ? "" : " (" + lost + ")",
                  tables.empty() ? "" : "; tables not salvaged: " + tables);
  } else if (recovery.wal_missing || recovery.corrupt_tail || recovery.damaged) {
    spdlog::error("journal '{}': recovered with losses: {}", options.path, recovery.detail);
  } else if (!recovery.ok()) {
    spdlog::warn("journal '{}': {}", options.path, recovery.detail);
  }

  JournalOptions normalized = options;
  normalized.batch_max = std::max<size_t>(normalized.batch_max, 1);
  std::unique_ptr<Journal> journal(new Journal(std::move(normalized), std::move(on_commit), std::move(conn)));
  journal->recovery_ = std::move(recovery);
  MutexLock stop_lock(&journal->stop_mu_);
  try {
    journal->thread_ = std::thread(&Journal::Run, journal.get());
  } catch (const std::exception& e) {
    return Status::ResourceExhausted(std::string("journal: cannot start writer thread: ") + e.what());
  }
  return journal;
}

Journal::Journal(JournalOptions options, CommitCallback on_commit, Connection connection)
    : options_(std::move(options)), on_commit_(std::move(on_commit)) {
  MutexLock db_lock(&db_mu_);
  db_ = std::exchange(connection.db, nullptr);
  statements_ = std::move(connection.statements);
  db_dev_ = connection.db_dev, db_ino_ = connection.db_ino;
  wal_dev_ = connection.wal_dev, wal_ino_ = connection.wal_ino;
  MutexLock lock(&mu_);
  free_steps_.reserve(std::min<size_t>(2 * options_.batch_max, 8192));
}

Journal::~Journal() { Stop(); }

void Journal::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  MutexLock stop_lock(&stop_mu_);
  if (thread_.joinable()) thread_.join();
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return;
  statements_.reset();  // sqlite3_close refuses a connection with live statements
  // Files lost and not rebuilt: the checkpoint at close would delete the WAL at the path by name.
  if (!CheckFilesLocked().ok()) sqlite3_db_config(db_, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, nullptr);
  if (sqlite3_close(db_) != SQLITE_OK) {
    spdlog::error("journal '{}': close failed: {}", options_.path, sqlite3_errmsg(db_));
  }
  db_ = nullptr;
}

uint64_t Journal::Enqueue(JournalRecord record) {
  MutexLock lock(&mu_);
  if (stopping_ || queue_.size() >= options_.queue_max) return 0;
  queue_.push_back(std::move(record));
  ++enqueued_;
  // Waking the writer per record would cost a context switch each; it only needs to know that
  // work arrived or that a batch is full.
  if (queue_.size() == 1 || queue_.size() == options_.batch_max) cv_.Signal();
  return enqueued_;
}

bool Journal::accepting() const {
  if (!healthy()) return false;
  MutexLock lock(&mu_);
  return queue_.size() < options_.queue_max / 4 * 3;
}

uint64_t Journal::last_enqueued() const {
  MutexLock lock(&mu_);
  return enqueued_;
}

uint64_t Journal::last_committed() const {
  MutexLock lock(&mu_);
  return committed_;
}

Status Journal::Flush() {
  MutexLock lock(&mu_);
  const uint64_t target = enqueued_;
  const uint64_t failures_before = failed_commits_;
  ++flush_waiters_;
  cv_.Signal();
  while (committed_ < target && failed_commits_ == failures_before) flushed_cv_.Wait(&mu_);
  --flush_waiters_;
  return failed_commits_ != failures_before ? last_failure_ : last_status_;
}

StepJournalRecord Journal::AcquireStepRecord() {
  MutexLock lock(&mu_);
  if (free_steps_.empty()) return {};
  StepJournalRecord record = std::move(free_steps_.back());
  free_steps_.pop_back();
  return record;
}

size_t Journal::queue_depth() const {
  MutexLock lock(&mu_);
  return queue_.size();
}

uint64_t Journal::commit_count() const {
  MutexLock lock(&mu_);
  return commits_;
}

uint64_t Journal::failed_commit_count() const {
  MutexLock lock(&mu_);
  return failed_commits_;
}

void Journal::NoteFailureLocked(const Status& status, size_t held) {
  if (healthy_.exchange(false, std::memory_order_relaxed)) {
    storage_faults_.fetch_add(1, std::memory_order_relaxed);
    fault_started_ = Clock::now();
    retry_delay_ = kFirstRetryDelay;
    spdlog::error("journal '{}': storage fault, commits are retried and nothing more is acked until "
                  "one succeeds ({} records held): {}",
                  options_.path, held, status.ToString());
  }
}

void Journal::NoteSuccessLocked() {
  if (!healthy_.load(std::memory_order_relaxed)) {
    healthy_.store(true, std::memory_order_relaxed);
    spdlog::warn("journal '{}': storage recovered after {:.1f} s; commits and acks go on", options_.path,
                 std::chrono::duration<double>(Clock::now() - fault_started_).count());
  }
}

void Journal::Run() {
  std::vector<JournalRecord> batch;
  mu_.Lock();
  for (;;) {
    while (!stopping_ && queue_.empty() && !prune_due_) {
      // Idle: check now and then that the files are still there, so that a deleted data directory
      // is noticed (and rebuilt) before the next record arrives.
      if (!cv_.WaitUntil(&mu_, Clock::now() + kIdleFileCheck) && !stopping_ && queue_.empty()) {
        CheckFilesWhileIdle();
      }
    }
    if (queue_.empty()) {
      if (stopping_) break;  // stopping and drained
      PruneOnce();
      continue;
    }
    // Group commit: give companions a moment to arrive so one fsync covers many records.
    const auto deadline = Clock::now() + options_.max_delay;
    while (!stopping_ && flush_waiters_ == 0 && queue_.size() < options_.batch_max) {
      if (!cv_.WaitUntil(&mu_, deadline)) break;
    }
    batch.clear();
    if (queue_.size() <= options_.batch_max) {
      std::swap(batch, queue_);  // both buffers keep their capacity: no allocation when warm
    } else {
      const auto end = queue_.begin() + static_cast<std::ptrdiff_t>(options_.batch_max);
      batch.insert(batch.end(), std::make_move_iterator(queue_.begin()), std::make_move_iterator(end));
      queue_.erase(queue_.begin(), end);
    }
    // Every earlier batch is committed (or given up at shutdown): this one ends the numbering here.
    const uint64_t batch_through = committed_ + batch.size();
    mu_.Unlock();

    CommitReport report;
    Status status = Commit(batch, report);
    report.committed_through = batch_through;
    // A failed commit keeps its batch and tries again after a bounded back-off: nothing in it
    // was acked, and nothing queued behind it is committed first, so progress stays in order.
    while (!status.ok()) {
      mu_.Lock();
      ++failed_commits_;
      last_failure_ = status;
      flushed_cv_.SignalAll();
      const bool stop_now = stopping_;
      if (healthy_.load(std::memory_order_relaxed)) {
        NoteFailureLocked(status, batch.size() + queue_.size());
      } else {
        spdlog::warn("journal '{}': commit retry failed ({} records held): {}", options_.path,
                     batch.size() + queue_.size(), status.ToString());
      }
      if (stop_now) {
        // Shutting down with storage that still fails: these records were never acked, so
        // their ranks resend them to the next daemon.
        dropped_records_.fetch_add(batch.size(), std::memory_order_relaxed);
        spdlog::error("journal '{}': {} records not committed at shutdown; they were never acknowledged",
                      options_.path, batch.size());
        mu_.Unlock();
        break;
      }
      const auto retry_at = Clock::now() + retry_delay_;
      while (!stopping_ && cv_.WaitUntil(&mu_, retry_at)) {
      }
      retry_delay_ = std::min(retry_delay_ * 2, kMaxRetryDelay);
      mu_.Unlock();
      report = CommitReport{};
      status = Commit(batch, report);
      report.committed_through = batch_through;
    }
    if (status.ok()) {
      {
        MutexLock relock(&mu_);
        NoteSuccessLocked();
      }
      if (on_commit_) {
        try {
          on_commit_(report);
        } catch (const std::exception& e) {
          spdlog::error("journal: commit callback threw: {}", e.what());
        } catch (...) {
          spdlog::error("journal: commit callback threw");
        }
      }
    }

    mu_.Lock();
    if (status.ok()) ++commits_;
    last_status_ = std::move(status);
    committed_ += batch.size();
    for (JournalRecord& record : batch) {
      auto* step = std::get_if<StepJournalRecord>(&record);
      if (step != nullptr && free_steps_.size() < free_steps_.capacity()) {
        free_steps_.push_back(std::move(*step));
      }
    }
    flushed_cv_.SignalAll();
    // Pruning takes turns with commits, so a busy ingest neither starves it nor waits for more
    // than one batch.
    if (prune_due_ && !stopping_) PruneOnce();
  }
  mu_.Unlock();
}

void Journal::PruneOnce() {
  mu_.Unlock();
  Status pruned;
  {
    MutexLock db_lock(&db_mu_);
    pruned = db_ == nullptr ? Status::FailedPrecondition("journal is closed")
                            : PruneBatchLocked(options_.prune_batch_rows);
  }
  mu_.Lock();
  if (!pruned.ok()) {
    spdlog::error("journal '{}': pruning failed, retried at the next cutoff: {}", options_.path,
                  pruned.ToString());
    prune_due_ = false;
  }
}

void Journal::CheckFilesWhileIdle() {
  mu_.Unlock();
  Status status;
  {
    MutexLock db_lock(&db_mu_);
    if (db_ != nullptr) status = EnsureFilesLocked();
  }
  mu_.Lock();
  if (status.ok()) {
    NoteSuccessLocked();
  } else {
    NoteFailureLocked(status, queue_.size());
  }
}

Status Journal::CheckFilesLocked() {
  // SQLite goes on writing to files that were deleted or replaced under it, and those writes
  // would be acked and then lost: a commit only counts while the files are the ones it opened.
  uint64_t dev = 0, ino = 0;
  if (!FileId(options_.path, dev, ino)) {
    return Status::IoError("journal '" + options_.path + "' vanished: " + std::strerror(errno));
  }
  if (dev != db_dev_ || ino != db_ino_) {
    return Status::IoError("journal '" + options_.path + "' was replaced by another file");
  }
  const std::string wal = options_.path + "-wal";
  if (wal_ino_ == 0) {
    FileId(wal, wal_dev_, wal_ino_);  // SQLite creates the WAL at the first transaction
    return Status::Ok();
  }
  if (!FileId(wal, dev, ino)) {
    return Status::IoError("the WAL of journal '" + options_.path + "' vanished: " + std::strerror(errno));
  }
  if (dev != wal_dev_ || ino != wal_ino_) {
    return Status::IoError("the WAL of journal '" + options_.path + "' was replaced by another file");
  }
  return Status::Ok();
}

Status Journal::EnsureFilesLocked() {
  Status lost = CheckFilesLocked();
  if (lost.ok()) return lost;
  if (!files_lost_reported_) {
    files_lost_reported_ = true;
    files_lost_.fetch_add(1, std::memory_order_relaxed);
    spdlog::error("{}; nothing is acked until the journal is rebuilt from the open connection", lost.message());
  }
  if (Status s = RebuildLocked(lost.message()); !s.ok()) {
    return Status::IoError(lost.message() + "; rebuilding the journal failed, retried: " + s.message());
  }
  files_lost_reported_ = false;
  return Status::Ok();
}

Status Journal::RebuildLocked(const std::string& why) {
  const auto start = Clock::now();
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options_.path).parent_path();
  if (!dir.empty()) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IoError("cannot create '" + dir.string() + "': " + ec.message());
  }
  // Whatever sits at the journal's paths is not what it wrote to: keep it, out of the way.
  std::vector<std::string> moved;
  if (Status s = RenameFiles(options_.path, AsideName(options_.path, "detached"), &moved); !s.ok()) return s;
  const std::string temp = options_.path + ".rebuild";
  for (const char* suffix : {"", "-journal"}) std::filesystem::remove(temp + suffix, ec);
  {
    sqlite3* raw = nullptr;
    const int rc = sqlite3_open_v2(temp.c_str(), &raw, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                                   nullptr);
    std::unique_ptr<sqlite3, int (*)(sqlite3*)> dest(raw, sqlite3_close);
    if (rc != SQLITE_OK) return SqliteError(raw, "creating '" + temp + "'");
    // The open connection still reads the unlinked files: copy everything committed to them.
    sqlite3_backup* backup = sqlite3_backup_init(raw, "main", db_, "main");
    if (backup == nullptr) return SqliteError(raw, "copying the journal into '" + temp + "'");
    const int step = sqlite3_backup_step(backup, -1);
    sqlite3_backup_finish(backup);
    if (step != SQLITE_DONE) return SqliteError(raw, "copying the journal into '" + temp + "'");
    if (sqlite3_close(dest.release()) != SQLITE_OK) return Status::IoError("closing '" + temp + "'");
  }
  std::filesystem::rename(temp, options_.path, ec);
  if (ec) return Status::IoError("renaming '" + temp + "' to '" + options_.path + "': " + ec.message());
  if (const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); fd >= 0) {
    ::fsync(fd);  // the rename itself survives a power cut
    ::close(fd);
  }
  Connection fresh;
  RecoveryReport ignored;
  bool damaged = false;
  if (Status s = OpenConnection(options_.path, false, ignored, &damaged, fresh); !s.ok()) return s;
  Connection old;
  old.db = std::exchange(db_, fresh.db);
  old.statements = std::exchange(statements_, std::move(fresh.statements));
  old.keep_files = true;  // its files are gone or someone else's: no checkpoint, no WAL deletion
  fresh.db = nullptr;
  db_dev_ = fresh.db_dev, db_ino_ = fresh.db_ino, wal_dev_ = fresh.wal_dev, wal_ino_ = fresh.wal_ino;
  old.Close();
  rebuilds_.fetch_add(1, std::memory_order_relaxed);
  std::string aside;
  for (const std::string& f : moved) aside += (aside.empty() ? "" : ", ") + f;
  spdlog::error("journal '{}' rebuilt in {:.2f} s from the open connection after: {}; every committed record is "
                "kept{}",
                options_.path, std::chrono::duration<double>(Clock::now() - start).count(), why,
                aside.empty() ? "" : "; the files found at its paths were moved to " + aside);
  return Status::Ok();
}

Status Journal::Commit(std::vector<JournalRecord>& batch, CommitReport& report) {
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return Status::FailedPrecondition("journal is closed");
  if (Status s = EnsureFilesLocked(); !s.ok()) return s;
  const auto start = Clock::now();
  if (!committed_to_lost_files_) {
    Transaction txn(db_, statements_->rollback);
    if (Status s = txn.Begin(statements_->begin); !s.ok()) return s;
    for (const JournalRecord& record : batch) {
      if (Status s = Apply(record); !s.ok()) return s;
    }
    if (Status s = txn.Commit(statements_->commit); !s.ok()) return s;
    // Files lost during the transaction hold it: it counts once the rebuilt file does.
    if (!CheckFilesLocked().ok()) {
      committed_to_lost_files_ = true;
      if (Status s = EnsureFilesLocked(); !s.ok()) return s;
    }
  }
  committed_to_lost_files_ = false;
  std::map<std::pair<std::string, uint32_t>, RankProgress> progress;
  for (const JournalRecord& record : batch) {
    if (const auto* step = std::get_if<StepJournalRecord>(&record)) {
      MergeProgress(step->progress, progress);
    } else if (const auto* end = std::get_if<RunEndedRecord>(&record)) {
      const bool clean = end->ended_at != 0 &&
                         (end->reason == EndReason::kFinished || end->reason == EndReason::kStopped);
      if (clean) report.clean_ends.push_back(end->run_id);
    }
  }
  report.duration = Clock::now() - start;
  report.records = batch.size();
  report.progress.reserve(progress.size());
  for (auto& [key, p] : progress) report.progress.push_back(std::move(p));
  return Status::Ok();
}

Status Journal::Apply(const JournalRecord& record) {
  Statements& st = *statements_;
  return std::visit(
      [&](const auto& r) -> Status {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, RunRecord>) {
          StmtUse use(st.insert_run);
          const std::string labels = LabelsJson(r.meta.labels);
          const std::string config = ConfigJson(r.meta.config);
          use.Text(1, r.meta.run_id);
          use.Int(2, r.meta.world_size);
          use.Text(3, labels);
          use.Text(4, config);
          use.Real(5, r.meta.created_at);
          return use.Done("journal: writing run '" + r.meta.run_id + "'");
        } else if constexpr (std::is_same_v<T, ParamsRecord>) {
          for (size_t i = 0; i < r.params.size(); ++i) {
            const ParamInfo& p = r.params[i];
            StmtUse use(st.insert_param);
            use.Text(1, r.run_id);
            use.Int(2, int64_t{r.first_index} + static_cast<int64_t>(i));
            use.Text(3, p.name);
            use.Unsigned(4, p.numel);
            use.Int(5, static_cast<int>(p.kind));
            use.Real(6, p.weight_decay);
            if (p.init_norm) {
              use.Real(7, *p.init_norm);
            } else {
              use.Null(7);
            }
            use.Text(8, p.role);
            use.Text(9, p.group);
            if (Status s = use.Done("journal: writing parameter '" + p.name + "' of run '" +
                                    r.run_id + "'");
                !s.ok()) {
              return s;
            }
          }
          return Status::Ok();
        } else if constexpr (std::is_same_v<T, SeriesRecord>) {
          StmtUse use(st.insert_series);
          use.Text(1, r.run_id);
          use.Int(2, r.id);
          use.Text(3, r.key);
          return use.Done("journal: writing series '" + r.key + "' of run '" + r.run_id + "'");
        } else if constexpr (std::is_same_v<T, StepJournalRecord>) {
          {
            StmtUse use(st.insert_step);
            EncodeValues(r.step.values, st.scratch);
            use.Text(1, r.run_id);
            use.Unsigned(2, r.step.step);
            use.Real(3, r.step.wall_time);
            use.Int(4, r.step.partial ? 1 : 0);
            use.Int(5, r.step.ranks_reported);
            use.Unsigned(6, r.step.client_dropped_steps);
            use.Blob(7, st.scratch);
            if (Status s = use.Done("journal: writing step " + std::to_string(r.step.step) +
                                    " of run '" + r.run_id + "'");
                !s.ok()) {
              return s;
            }
          }
          for (const RankProgress& p : r.progress) {
            StmtUse use(st.upsert_progress);
            use.Text(1, p.run_id);
            use.Int(2, p.rank);
            use.Unsigned(3, p.step);
            use.Unsigned(4, p.seq);
            if (Status s = use.Done("journal: writing progress of rank " + std::to_string(p.rank) +
                                    " of run '" + p.run_id + "'");
                !s.ok()) {
              return s;
            }
          }
          return Status::Ok();
        } else if constexpr (std::is_same_v<T, EventJournalRecord>) {
          StmtUse use(st.insert_event);
          use.Text(1, r.run_id);
          use.Unsigned(2, r.event.step);
          use.Text(3, r.event.text);
          use.Text(4, r.event.source);
          use.Real(5, r.event.recorded_at);
          return use.Done("journal: writing event of run '" + r.run_id + "'");
        } else if constexpr (std::is_same_v<T, RewindRecord>) {
          db_mu_.AssertHeld();  // the analysis does not follow Apply's lock into this lambda
          return ApplyRewind(r);
        } else {
          static_assert(std::is_same_v<T, RunEndedRecord>);
          StmtUse use(st.end_run);
          use.Text(1, r.run_id);
          if (r.ended_at == 0) {
            use.Null(2);
            use.Int(3, static_cast<int>(EndReason::kNone));
          } else {
            use.Real(2, r.ended_at);
            use.Int(3, static_cast<int>(r.reason));
          }
          use.Text(4, r.message);
          return use.Done("journal: ending run '" + r.run_id + "'");
        }
      },
      record);
}

namespace {

// One row of `SELECT step, wall_time, partial, ranks_reported, client_dropped, vals FROM steps`.
Status ReadStepRow(StmtUse& row, const std::string& run_id, CompletedStep& step) {
  step.step = row.ColUnsigned(0);
  step.wall_time = row.ColReal(1);
  step.partial = row.ColInt(2) != 0;
  step.ranks_reported = static_cast<uint32_t>(row.ColInt(3));
  step.client_dropped_steps = row.ColUnsigned(4);
  const std::string_view blob = row.ColBlob(5);
  if (!DecodeValues(blob, step.values)) {
    return Status::Internal("journal: run '" + run_id + "' step " + std::to_string(step.step) +
                            ": value blob of " + std::to_string(blob.size()) + " bytes is not a whole number of " +
                            std::to_string(kValueEntryBytes) + "-byte entries");
  }
  return Status::Ok();
}

}  // namespace

Status Journal::ApplyRewind(const RewindRecord& r) {
  Statements& st = *statements_;
  const std::string what = "journal: rewinding run '" + r.run_id + "' to step " + std::to_string(r.from_step);
  int64_t branch = 0;  // the branch that ends here
  {
    StmtUse use(st.count_rewinds);
    use.Text(1, r.run_id);
    Status s;
    if (!use.Row(&s, what)) return s.ok() ? Status::Internal(what + ": count returned no row") : s;
    branch = use.ColInt(0);
  }
  {
    StmtUse use(st.insert_rewind);
    use.Text(1, r.run_id);
    use.Int(2, branch);
    use.Unsigned(3, r.from_step);
    use.Int(4, r.world_size);
    use.Real(5, r.rewound_at);
    if (Status s = use.Done(what); !s.ok()) return s;
  }
  for (Stmt* move : {&st.abandon_steps, &st.abandon_events}) {
    StmtUse use(*move);
    use.Text(1, r.run_id);
    use.Int(2, branch);
    use.Unsigned(3, r.from_step);
    if (Status s = use.Done(what); !s.ok()) return s;
  }
  for (Stmt* drop : {&st.delete_steps, &st.delete_events}) {
    StmtUse use(*drop);
    use.Text(1, r.run_id);
    use.Unsigned(2, r.from_step);
    if (Status s = use.Done(what); !s.ok()) return s;
  }
  if (r.from_step > 0) {
    StmtUse use(st.rewind_progress);
    use.Text(1, r.run_id);
    use.Unsigned(2, r.from_step);
    if (Status s = use.Done(what); !s.ok()) return s;
  }
  {
    // After the update only a rewind to step 0 leaves progress at or above from_step: none is kept.
    StmtUse use(st.drop_progress);
    use.Text(1, r.run_id);
    use.Int(2, r.world_size);
    use.Unsigned(3, r.from_step);
    if (Status s = use.Done(what); !s.ok()) return s;
  }
  StmtUse use(st.set_world_size);
  use.Text(1, r.run_id);
  use.Int(2, r.world_size);
  return use.Done(what);
}

Status Journal::LoadRunSteps(const std::string& run_id, uint64_t before_step,
                             const std::function<void(const CompletedStep&)>& on_step) {
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return Status::FailedPrecondition("journal is stopped");
  Stmt steps;
  if (Status s = Prepare(db_,
                         "SELECT step, wall_time, partial, ranks_reported, client_dropped, vals FROM steps "
                         "WHERE run_id = ?1 AND step < ?2 ORDER BY step",
                         false, steps);
      !s.ok()) {
    return s;
  }
  StmtUse rows(steps);
  rows.Text(1, run_id);
  rows.Unsigned(2, before_step);
  Status status;
  CompletedStep step;
  while (rows.Row(&status, "journal: reading steps of run '" + run_id + "'")) {
    if (Status s = ReadStepRow(rows, run_id, step); !s.ok()) return s;
    on_step(step);
  }
  return status;
}

// Reads one run's rows for Load and LoadRun, inside their read transaction.
struct Journal::Reader {
  Stmt begin, runs, one_run, params, series, progress, rewind, steps, events;

  Status Prepare(sqlite3* db) {
    const std::pair<Stmt*, const char*> all[] = {
        {&begin, "BEGIN"},
        {&runs,
         "SELECT run_id, world_size, labels_json, config_json, created_at, ended_at, end_reason, "
         "end_message FROM runs ORDER BY created_at, run_id"},
        {&one_run,
         "SELECT run_id, world_size, labels_json, config_json, created_at, ended_at, end_reason, "
         "end_message FROM runs WHERE run_id = ?1"},
        {&params,
         "SELECT idx, name, numel, kind, weight_decay, init_norm, role, grp FROM params "
         "WHERE run_id = ?1 ORDER BY idx"},
        {&series, "SELECT id, key FROM series WHERE run_id = ?1 ORDER BY id"},
        {&progress, "SELECT rank, step, seq FROM rank_progress WHERE run_id = ?1 ORDER BY rank"},
        {&rewind, "SELECT from_step FROM rewinds WHERE run_id = ?1 ORDER BY branch DESC LIMIT 1"},
        {&steps,
         "SELECT step, wall_time, partial, ranks_reported, client_dropped, vals FROM steps "
         "WHERE run_id = ?1 ORDER BY step"},
        {&events,
         "SELECT step, text, source, recorded_at FROM events WHERE run_id = ?1 ORDER BY id"},
    };
    for (const auto& [stmt, sql] : all) {
      if (Status s = gradwatch::store::Prepare(db, sql, false, *stmt); !s.ok()) return s;
    }
    return Status::Ok();
  }

  // Reads the run at the current row of `rows` and hands it, then (if the visitor keeps it) its
  // series, progress, latest rewind, events and steps, to `visitor`.
  Status Visit(StmtUse& rows, JournalVisitor& visitor, bool* kept) {
    RunMeta meta;
    meta.run_id = rows.ColText(0);
    meta.world_size = static_cast<uint32_t>(rows.ColInt(1));
    if (Status s = ParseLabels(rows.ColText(2), meta.run_id, meta.labels); !s.ok()) return s;
    if (Status s = ParseConfig(rows.ColText(3), meta.run_id, meta.config); !s.ok()) return s;
    meta.created_at = rows.ColReal(4);
    RunEnd end;
    if (!rows.ColNull(5)) {
      end.ended_at = rows.ColReal(5);
      const int64_t reason = rows.ColInt(6);
      end.reason = reason >= static_cast<int>(EndReason::kInactive) && reason <= static_cast<int>(EndReason::kStopped)
                       ? static_cast<EndReason>(reason)
                       : EndReason::kInactive;
      end.message = rows.ColText(7);
    }
    Status status;
    {
      StmtUse q(params);
      q.Text(1, meta.run_id);
      while (q.Row(&status, "journal: reading parameters of run '" + meta.run_id + "'")) {
        const int64_t idx = q.ColInt(0);
        if (idx < 0 || idx >= kMaxParamIndex) {
          return Status::Internal("journal: run '" + meta.run_id + "': parameter index " +
                                  std::to_string(idx) + " is out of range");
        }
        if (static_cast<size_t>(idx) > meta.params.size()) {
          spdlog::warn("journal: run '{}': parameters {}..{} are missing; keeping their slots",
                       meta.run_id, meta.params.size(), idx - 1);
        }
        meta.params.resize(std::max(meta.params.size(), static_cast<size_t>(idx) + 1));
        ParamInfo& p = meta.params[static_cast<size_t>(idx)];
        p.name = q.ColText(1);
        p.numel = q.ColUnsigned(2);
        p.kind = static_cast<ParamKind>(q.ColInt(3));
        p.weight_decay = q.ColReal(4);
        if (!q.ColNull(5)) p.init_norm = q.ColReal(5);
        p.role = q.ColText(6);
        p.group = q.ColText(7);
      }
      if (!status.ok()) return status;
    }
    *kept = visitor.OnRun(meta, end);
    if (!*kept) return Status::Ok();
    {
      StmtUse q(series);
      q.Text(1, meta.run_id);
      while (q.Row(&status, "journal: reading series of run '" + meta.run_id + "'")) {
        visitor.OnSeries(meta.run_id, static_cast<SeriesId>(q.ColInt(0)), q.ColText(1));
      }
      if (!status.ok()) return status;
    }
    {
      StmtUse q(progress);
      q.Text(1, meta.run_id);
      while (q.Row(&status, "journal: reading progress of run '" + meta.run_id + "'")) {
        visitor.OnRankProgress(RankProgress{meta.run_id, static_cast<uint32_t>(q.ColInt(0)),
                                            q.ColUnsigned(1), q.ColUnsigned(2)});
      }
      if (!status.ok()) return status;
    }
    {
      StmtUse q(rewind);
      q.Text(1, meta.run_id);
      if (q.Row(&status, "journal: reading rewinds of run '" + meta.run_id + "'")) {
        visitor.OnRewind(meta.run_id, q.ColUnsigned(0));
      }
      if (!status.ok()) return status;
    }
    {
      StmtUse q(events);
      q.Text(1, meta.run_id);
      while (q.Row(&status, "journal: reading events of run '" + meta.run_id + "'")) {
        EventRecord event;
        event.step = q.ColUnsigned(0);
        event.text = q.ColText(1);
        event.source = q.ColText(2);
        event.recorded_at = q.ColReal(3);
        visitor.OnEvent(meta.run_id, event);
      }
      if (!status.ok()) return status;
    }
    {
      StmtUse q(steps);
      q.Text(1, meta.run_id);
      CompletedStep step;
      while (q.Row(&status, "journal: reading steps of run '" + meta.run_id + "'")) {
        if (Status s = ReadStepRow(q, meta.run_id, step); !s.ok()) return s;
        visitor.OnStep(meta.run_id, step);
      }
      if (!status.ok()) return status;
    }
    return Status::Ok();
  }
};

Status Journal::Load(JournalVisitor& visitor) {
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return Status::FailedPrecondition("journal is stopped");
  Reader reader;
  if (Status s = reader.Prepare(db_); !s.ok()) return s;
  // One read transaction, so every table is read from the same snapshot.
  Transaction txn(db_, statements_->rollback);
  if (Status s = txn.Begin(reader.begin); !s.ok()) return s;
  Status status;
  StmtUse rows(reader.runs);
  while (rows.Row(&status, "journal: reading runs")) {
    bool kept = false;
    if (Status s = reader.Visit(rows, visitor, &kept); !s.ok()) {
      // One run that cannot be read must not keep the others (and the daemon) from starting.
      visitor.OnRunFailed(rows.ColText(0), s);
      continue;
    }
    if (kept) {
      MutexLock held_lock(&held_mu_);
      held_.insert(rows.ColText(0));
    }
  }
  return status;
}

Status Journal::LoadRun(const std::string& run_id, JournalVisitor& visitor) {
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return Status::FailedPrecondition("journal is stopped");
  {
    MutexLock held_lock(&held_mu_);
    held_.insert(run_id);
  }
  if (run_id == pruning_run_) {
    // Half pruned: finish the job, and the caller starts the run afresh.
    while (!pruning_run_.empty()) {
      if (Status s = PruneBatchLocked(std::numeric_limits<size_t>::max()); !s.ok()) return s;
    }
    return Status::NotFound("run '" + run_id + "' was pruned from the journal");
  }
  Reader reader;
  if (Status s = reader.Prepare(db_); !s.ok()) return s;
  Transaction txn(db_, statements_->rollback);
  if (Status s = txn.Begin(reader.begin); !s.ok()) return s;
  Status status;
  StmtUse rows(reader.one_run);
  rows.Text(1, run_id);
  if (!rows.Row(&status, "journal: reading run '" + run_id + "'")) {
    return status.ok() ? Status::NotFound("no run '" + run_id + "' in the journal") : status;
  }
  bool kept = false;
  return reader.Visit(rows, visitor, &kept);
}

void Journal::Release(const std::string& run_id) {
  MutexLock held_lock(&held_mu_);
  held_.erase(run_id);
}

bool Journal::IsHeld(const std::string& run_id) const {
  MutexLock held_lock(&held_mu_);
  return held_.count(run_id) != 0;
}

StatusOr<std::vector<StoredRun>> Journal::ListReleased() {
  MutexLock db_lock(&db_mu_);
  if (db_ == nullptr) return Status::FailedPrecondition("journal is stopped");
  Stmt runs, steps;
  if (Status s = gradwatch::store::Prepare(
          db_, "SELECT run_id, world_size, labels_json, created_at, ended_at, end_reason, end_message FROM runs "
               "ORDER BY run_id", false, runs);
      !s.ok()) {
    return s;
  }
  if (Status s = gradwatch::store::Prepare(
          db_, "SELECT count(*), min(step), max(step), max(wall_time) FROM steps WHERE run_id = ?1", false, steps);
      !s.ok()) {
    return s;
  }
  std::vector<StoredRun> out;
  Status status;
  StmtUse rows(runs);
  while (rows.Row(&status, "journal: listing runs")) {
    StoredRun r;
    r.meta.run_id = rows.ColText(0);
    if (IsHeld(r.meta.run_id) || r.meta.run_id == pruning_run_) continue;
    r.meta.world_size = static_cast<uint32_t>(rows.ColInt(1));
    if (!ParseLabels(rows.ColText(2), r.meta.run_id, r.meta.labels).ok()) r.meta.labels.clear();
    r.meta.created_at = rows.ColReal(3);
    if (!rows.ColNull(4)) {
      r.end.ended_at = rows.ColReal(4);
      const int64_t reason = rows.ColInt(5);
      r.end.reason = reason >= static_cast<int>(EndReason::kInactive) && reason <= static_cast<int>(EndReason::kStopped)
                         ? static_cast<EndReason>(reason)
                         : EndReason::kInactive;
      r.end.message = rows.ColText(6);
    }
    StmtUse q(steps);
    q.Text(1, r.meta.run_id);
    if (q.Row(&status, "journal: counting steps of run '" + r.meta.run_id + "'")) {
      r.step_count = q.ColUnsigned(0);
      r.first_step = q.ColUnsigned(1);
      r.last_step = q.ColUnsigned(2);
      r.last_wall_time = q.ColReal(3);
    }
    if (!status.ok()) return status;
    out.push_back(std::move(r));
  }
  if (!status.ok()) return status;
  return out;
}

void Journal::SetPruneCutoff(double ended_before) {
  {
    MutexLock lock(&mu_);
    prune_cutoff_ = std::max(prune_cutoff_, ended_before);
    prune_due_ = true;
  }
  cv_.Signal();
}

Status Journal::PruneBatchLocked(size_t max_rows) {
  double cutoff;
  {
    MutexLock lock(&mu_);
    cutoff = prune_cutoff_;
  }
  Statements& st = *statements_;
  Transaction txn(db_, st.rollback);
  if (Status s = txn.Begin(st.begin); !s.ok()) return s;
  if (pruning_run_.empty()) {
    Status status;
    StmtUse rows(st.prune_candidates);
    rows.Real(1, cutoff);
    while (rows.Row(&status, "journal: finding runs to prune")) {
      std::string id = rows.ColText(0);
      if (!IsHeld(id)) {
        pruning_run_ = std::move(id);
        break;
      }
    }
    if (!status.ok()) return status;
    if (pruning_run_.empty()) {
      MutexLock lock(&mu_);
      prune_due_ = false;  // until the cutoff moves
      return Status::Ok();
    }
  }
  // A run's rows go table by table, at most max_rows per transaction; its runs row goes last, so a
  // half pruned run stays listed (and is finished by LoadRun) rather than leaving orphans.
  uint64_t deleted = 0;
  for (Stmt* del : {&st.prune_steps, &st.prune_events, &st.prune_series, &st.prune_params, &st.prune_progress,
                    &st.prune_rewinds, &st.prune_abandoned_steps, &st.prune_abandoned_events}) {
    if (deleted >= max_rows) break;
    StmtUse use(*del);
    use.Text(1, pruning_run_);
    use.Int(2, static_cast<int64_t>(std::min<size_t>(max_rows - deleted, INT64_MAX)));
    if (Status s = use.Done("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    deleted += static_cast<uint64_t>(sqlite3_changes(db_));
  }
  bool run_done = false;
  if (deleted < max_rows) {
    StmtUse use(st.prune_run);
    use.Text(1, pruning_run_);
    if (Status s = use.Done("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    deleted += static_cast<uint64_t>(sqlite3_changes(db_));
    run_done = true;
  }
  if (Status s = txn.Commit(st.commit); !s.ok()) return s;
  pruned_rows_.fetch_add(deleted, std::memory_order_relaxed);
  if (run_done) {
    spdlog::info("journal: run {} pruned (ended before the retention cutoff)", pruning_run_);
    pruning_run_.clear();
    pruned_runs_.fetch_add(1, std::memory_order_relaxed);
  }
  return Status::Ok();
}

uint64_t Journal::DiskBytes() const {
  uint64_t total = 0;
  for (const std::string& file : {options_.path, options_.path + "-wal", options_.path + "-shm"}) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(file, ec);
    if (!ec) total += size;
  }
  return total;
}

}  // namespace gradwatch::store

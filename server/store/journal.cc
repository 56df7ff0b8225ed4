#include "server/store/journal.h"

#include "server/core/thread_name.h"
#include "server/store/journal_salvage.h"
#include "server/store/step_block.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
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
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>

namespace gradwatch::store {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// Version 2 adds how a run ended, events found by run, and the rewind tables (kRewindTables);
// version 3 the compressed blocks of steps (kStepBlocks); version 4 what a machine reads of an
// event (kEventData: a catalog change's new values). Older journals are migrated at open; their
// step rows stay readable as they are and are sealed into blocks as their runs go on.
constexpr int kSchemaVersion = 5;
// A block holds at most this many values, whatever block_steps says (the decoder's bound is 4×).
constexpr size_t kSealMaxValues = size_t{1} << 20;
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
)sql";

// Version 1 → 2: how a run ended (a Goodbye or inactivity), and events found by run.
constexpr const char* kMigrateFrom1 = R"sql(
ALTER TABLE runs ADD COLUMN end_reason INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN end_message TEXT NOT NULL DEFAULT '';
UPDATE runs SET end_reason = 1 WHERE ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, step);
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

// Version 3: a run's sealed steps, one row per block (a rowid table: blocks are large rows).
// wall_time is the block's last step's, for `runs --all`.
constexpr const char* kStepBlocks = R"sql(
CREATE TABLE IF NOT EXISTS step_blocks(
  run_id TEXT NOT NULL,
  first_step INTEGER NOT NULL,
  last_step INTEGER NOT NULL,
  steps INTEGER NOT NULL,
  wall_time REAL NOT NULL,
  data BLOB NOT NULL,
  PRIMARY KEY(run_id, first_step));
)sql";

// Version 4: an event's data (EventRecord::data), kept with it when a rewind abandons it.
constexpr const char* kEventData = R"sql(
ALTER TABLE events ADD COLUMN data TEXT NOT NULL DEFAULT '';
ALTER TABLE abandoned_events ADD COLUMN data TEXT NOT NULL DEFAULT '';
)sql";

// Version 5: a step row's checksum (StepRowChecksum, journal_check.h); NULL in rows written before.
constexpr const char* kRowChecksums = R"sql(
ALTER TABLE steps ADD COLUMN crc INTEGER;
ALTER TABLE abandoned_steps ADD COLUMN crc INTEGER;
)sql";

// The journal's schema (sqlite::ApplySchema sets user_version).
const sqlite::Schema& JournalSchema() {
  static const sqlite::Schema schema{.name = "journal",
                                     .version = kSchemaVersion,
                                     .scripts = {kSchema, kRewindTables, kStepBlocks, kEventData, kRowChecksums},
                                     .migrations = {{.from_version = 1, .scripts = {kMigrateFrom1, kRewindTables}},
                                                    {.from_version = 2, .scripts = {kStepBlocks}},
                                                    {.from_version = 3, .scripts = {kEventData}},
                                                    {.from_version = 4, .scripts = {kRowChecksums}}}};
  return schema;
}

void PutLe(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

// Bit copies, never arithmetic, so NaN payloads and infinities survive exactly.
void EncodeValues(const std::vector<SeriesValue>& values, std::string& out) {
  out.resize(values.size() * kValueEntryBytes);
  char* p = out.data();
  for (const SeriesValue& v : values) {
    PutLe(p, v.id, 4);
    PutLe(p + 4, std::bit_cast<uint64_t>(v.value), 8);
    p += kValueEntryBytes;
  }
}

bool DecodeValues(std::string_view blob, std::vector<SeriesValue>& out) {
  if (blob.size() % kValueEntryBytes != 0) return false;
  out.resize(blob.size() / kValueEntryBytes);
  const char* p = blob.data();
  for (SeriesValue& v : out) {
    v = {static_cast<SeriesId>(GetLe(p, 4)), std::bit_cast<double>(GetLe(p + 4, 8))};
    p += kValueEntryBytes;
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
    json j = {{"hidden_size", config.hidden_size}, {"optimizer", config.optimizer}, {"extra", config.extra}};
    if (config.z_loss_coef) j["z_loss_coef"] = *config.z_loss_coef;
    if (config.weight_decay) j["weight_decay"] = *config.weight_decay;
    if (config.warmup_steps) j["warmup_steps"] = *config.warmup_steps;
    if (config.total_steps) j["total_steps"] = *config.total_steps;
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

Status ParseLabels(const std::string& text, const std::string& run_id, std::map<std::string, std::string>& out) {
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
      for (const auto& [key, field] :
           {std::pair{"warmup_steps", &out.warmup_steps}, std::pair{"total_steps", &out.total_steps}}) {
        if (const auto it = j.find(key); it != j.end() && !it->is_null()) {
          ok = ok && it->is_number_unsigned();
          if (ok) *field = it->get<uint64_t>();
        }
      }
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
        if (GetBe32(frame.data() + 4) != 0)
          committed = valid, after_commit = 0;
        else
          ++after_commit;
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
                                          : ": a transaction that never committed") +
                     ". ";
  }
}

}  // namespace

struct Journal::Statements {
  sqlite::Statement insert_run, insert_param, insert_series, insert_step, upsert_progress, insert_event, end_run;
  sqlite::Statement count_rewinds, insert_rewind, abandon_steps, delete_steps, abandon_events, delete_events,
      rewind_progress, drop_progress, set_world_size;
  sqlite::Statement prune_candidates, prune_steps, prune_events, prune_series, prune_params, prune_progress, prune_run,
      prune_rewinds, prune_abandoned_steps, prune_abandoned_events, prune_blocks, prune_old_branch_steps,
      prune_old_branch_events;
  sqlite::Statement last_block, count_raw_after, raw_after, insert_block, delete_raw, blocks_from, delete_block,
      insert_abandoned_step;
  std::string scratch;  // the value blob being written; reused to spare allocations
  // A block being sealed, and the step row read into it: reused from block to block.
  StepBlockEncoder block;
  CompletedStep row;

  Status PrepareAll(sqlite::Database& db) {
    const std::pair<sqlite::Statement*, const char*> all[] = {
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
         "client_dropped, vals, crc) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"},
        {&upsert_progress,
         "INSERT INTO rank_progress(run_id, rank, step, seq) VALUES(?1, ?2, ?3, ?4) "
         "ON CONFLICT(run_id, rank) DO UPDATE SET step = max(step, excluded.step), "
         "seq = max(seq, excluded.seq)"},
        {&insert_event,
         "INSERT INTO events(run_id, step, text, source, recorded_at, data) VALUES(?1, ?2, ?3, ?4, ?5, ?6)"},
        {&end_run, "UPDATE runs SET ended_at = ?2, end_reason = ?3, end_message = ?4 WHERE run_id = ?1"},
        {&prune_candidates,
         "SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < ?1 ORDER BY ended_at LIMIT 64"},
        {&prune_steps,
         "DELETE FROM steps WHERE run_id = ?1 AND step IN "
         "(SELECT step FROM steps WHERE run_id = ?1 ORDER BY step LIMIT ?2)"},
        {&prune_events, "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_series, "DELETE FROM series WHERE rowid IN (SELECT rowid FROM series WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_params, "DELETE FROM params WHERE rowid IN (SELECT rowid FROM params WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_progress,
         "DELETE FROM rank_progress WHERE rowid IN (SELECT rowid FROM rank_progress WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_rewinds, "DELETE FROM rewinds WHERE rowid IN (SELECT rowid FROM rewinds WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_abandoned_steps,
         "DELETE FROM abandoned_steps WHERE run_id = ?1 AND (branch, step) IN "
         "(SELECT branch, step FROM abandoned_steps WHERE run_id = ?1 ORDER BY branch, step LIMIT ?2)"},
        {&prune_abandoned_events,
         "DELETE FROM abandoned_events WHERE id IN (SELECT id FROM abandoned_events WHERE run_id = ?1 LIMIT ?2)"},
        {&prune_run, "DELETE FROM runs WHERE run_id = ?1"},
        {&prune_blocks,
         "DELETE FROM step_blocks WHERE rowid IN (SELECT rowid FROM step_blocks WHERE run_id = ?1 LIMIT ?2)"},
        // Abandoned branches whose rewind is older than the cutoff, of any run.
        {&prune_old_branch_steps,
         "DELETE FROM abandoned_steps WHERE (run_id, branch, step) IN (SELECT a.run_id, a.branch, a.step FROM "
         "abandoned_steps a JOIN rewinds r ON r.run_id = a.run_id AND r.branch = a.branch "
         "WHERE r.rewound_at < ?1 LIMIT ?2)"},
        {&prune_old_branch_events,
         "DELETE FROM abandoned_events WHERE id IN (SELECT a.id FROM abandoned_events a JOIN rewinds r "
         "ON r.run_id = a.run_id AND r.branch = a.branch WHERE r.rewound_at < ?1 LIMIT ?2)"},
        {&last_block, "SELECT max(last_step) FROM step_blocks WHERE run_id = ?1"},
        {&count_raw_after, "SELECT count(*) FROM steps WHERE run_id = ?1 AND step > ?2"},
        {&raw_after,
         "SELECT step, wall_time, partial, ranks_reported, client_dropped, vals, crc FROM steps "
         "WHERE run_id = ?1 AND step > ?2 ORDER BY step LIMIT ?3"},
        {&insert_block,
         "INSERT OR REPLACE INTO step_blocks(run_id, first_step, last_step, steps, wall_time, data) "
         "VALUES(?1, ?2, ?3, ?4, ?5, ?6)"},
        {&delete_raw, "DELETE FROM steps WHERE run_id = ?1 AND step >= ?2 AND step <= ?3"},
        {&blocks_from,
         "SELECT first_step, data, last_step, steps FROM step_blocks WHERE run_id = ?1 AND last_step >= ?2 "
         "ORDER BY first_step"},
        {&delete_block, "DELETE FROM step_blocks WHERE run_id = ?1 AND first_step = ?2"},
        {&insert_abandoned_step,
         "INSERT OR REPLACE INTO abandoned_steps(run_id, branch, step, wall_time, partial, ranks_reported, "
         "client_dropped, vals, crc) VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"},
        {&count_rewinds, "SELECT count(*) FROM rewinds WHERE run_id = ?1"},
        {&insert_rewind,
         "INSERT INTO rewinds(run_id, branch, from_step, world_size, rewound_at) "
         "VALUES(?1, ?2, ?3, ?4, ?5)"},
        {&abandon_steps,
         "INSERT OR REPLACE INTO abandoned_steps(run_id, branch, step, wall_time, partial, "
         "ranks_reported, client_dropped, vals, crc) SELECT run_id, ?2, step, wall_time, partial, "
         "ranks_reported, client_dropped, vals, crc FROM steps WHERE run_id = ?1 AND step >= ?3"},
        {&delete_steps, "DELETE FROM steps WHERE run_id = ?1 AND step >= ?2"},
        {&abandon_events,
         "INSERT INTO abandoned_events(run_id, branch, step, text, source, recorded_at, data) "
         "SELECT run_id, ?2, step, text, source, recorded_at, data FROM events "
         "WHERE run_id = ?1 AND step >= ?3 ORDER BY id"},
        {&delete_events, "DELETE FROM events WHERE run_id = ?1 AND step >= ?2"},
        {&rewind_progress, "UPDATE rank_progress SET step = ?2 - 1 WHERE run_id = ?1 AND step >= ?2"},
        {&drop_progress, "DELETE FROM rank_progress WHERE run_id = ?1 AND (rank >= ?2 OR step >= ?3)"},
        {&set_world_size, "UPDATE runs SET world_size = ?2 WHERE run_id = ?1"},
    };
    for (const auto& [stmt, sql] : all) {
      auto prepared = db.Prepare(sql, true);
      if (!prepared.ok()) return prepared.status();
      *stmt = std::move(prepared).value();
    }
    return Status::Ok();
  }
};

// An open connection with its statements, and the identity (device, inode) of the files it
// opened. Closes on destruction; one whose files must stay as they are (damaged, or lost) is
// closed without the checkpoint SQLite makes at close, which would also delete the WAL by name.
struct Journal::Connection {
  sqlite::Database db;
  std::unique_ptr<Statements> statements;
  uint64_t db_dev = 0, db_ino = 0, wal_dev = 0, wal_ino = 0;
  bool keep_files = true;  // until it opened cleanly

  Connection() = default;
  Connection(Connection&& o) noexcept { *this = std::move(o); }
  Connection& operator=(Connection&& o) noexcept {
    Close();
    db = std::move(o.db);
    statements = std::move(o.statements);
    db_dev = o.db_dev, db_ino = o.db_ino, wal_dev = o.wal_dev, wal_ino = o.wal_ino;
    keep_files = o.keep_files;
    return *this;
  }
  ~Connection() { Close(); }

  void Close() {
    statements.reset();  // a connection with live statements cannot close
    if (keep_files) db.SkipCheckpointOnClose();
    db.Close();
  }
};

namespace {

constexpr auto kIdleFileCheck = std::chrono::seconds(1);

bool FileId(const std::string& path, uint64_t& dev, uint64_t& ino) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return false;
  dev = st.st_dev;
  ino = st.st_ino;
  return true;
}

}  // namespace

Status Journal::OpenConnection(const std::string& path, bool check, RecoveryReport& recovery, bool* damaged,
                               Connection& out) {
  *damaged = false;
  Connection conn;
  auto opened = sqlite::Database::Open(path, {.create = true, .uri = true});
  if (!opened.ok()) return Status(opened.status().code(), "journal: " + opened.status().message());
  conn.db = std::move(opened).value();
  sqlite::Database& db = conn.db;
  // Whether a failure was caused by the file's contents rather than the storage: asked at once.
  auto failed = [&](Status s) {
    *damaged = db.last_error_is_damage();
    return Status(s.code(), "journal: " + s.message());
  };
  // A new journal's pages are 16 KiB (SQLite's default is 4): a step row of 1,000 parameters
  // (24 KB) then takes two pages instead of seven, and a sealed block a quarter of the pages, so
  // that the writer makes a quarter of the page writes, WAL frames and syscalls (the writer's CPU
  // at 1 x 1 x 1,000: about a fifth less, docs/performance.md). It applies only before the file's
  // first page is written: an existing journal keeps its page size.
  if (Status s = db.Exec("PRAGMA page_size=16384"); !s.ok()) return failed(s);
  if (Status s = db.UseWal(); !s.ok()) return failed(s);
  // WAL with FULL fsyncs the log at every commit: an acked step survives a power cut.
  if (Status s = db.Exec("PRAGMA synchronous=FULL"); !s.ok()) return failed(s);
  // Pruning frees pages that later writes reuse; the WAL shrinks back to this after checkpoints.
  if (Status s = db.Exec("PRAGMA journal_size_limit=67108864"); !s.ok()) return failed(s);
  if (check && !QuickCheck(db, &recovery.detail)) {
    *damaged = true;
    return Status::IoError("journal '" + path + "' is damaged (PRAGMA quick_check)");
  }
  if (Status s = sqlite::ApplySchema(db, JournalSchema()); !s.ok()) {
    *damaged = db.last_error_is_damage();
    return s;  // names the journal already
  }
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

namespace {

void RemoveDatabaseFiles(const std::string& path) {
  std::error_code ec;
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix, ec);
}

}  // namespace

Status Journal::Repair(const std::string& path, bool dry_run, RepairReport& report) {
  report.journal = path;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return Status::NotFound("no journal at " + path);
  // The check, on a read-only connection.
  DamageLog found;
  {
    auto opened = sqlite::Database::Open(ReadOnlyUri(path), {.create = false, .uri = true});
    if (!opened.ok()) {
      report.sqlite_problem = opened.status().message();
    } else if (std::string detail; !QuickCheck(*opened, &detail)) {
      report.sqlite_problem = detail;
    } else if (Status s = ScrubSteps(*opened, "main", found); !s.ok()) {
      report.sqlite_problem = s.message();
    }
  }
  report.damaged = found.Found();
  report.damaged_steps = found.steps();
  if (dry_run || report.sound()) return Status::Ok();

  // The copy: every run SQLite reads, then the damaged blocks and rows taken out of it.
  const std::string fresh_path = path + ".repair-tmp";
  RemoveDatabaseFiles(fresh_path);
  {
    Connection fresh;
    RecoveryReport copied;
    bool damaged = false;
    if (Status s = OpenConnection(fresh_path, false, copied, &damaged, fresh); !s.ok()) {
      RemoveDatabaseFiles(fresh_path);
      return Status(s.code(), "creating the repaired journal " + fresh_path + ": " + s.message());
    }
    Salvage(fresh.db, path, copied);
    report.runs_copied = copied.salvaged_runs;
    report.lost_run_ids = copied.lost_run_ids;
    report.lost_tables = copied.lost_tables;
    if (!copied.detail.empty()) report.sqlite_problem += copied.detail;
    DamageLog copied_damage;
    Status s = ScrubSteps(fresh.db, "main", copied_damage);
    if (s.ok()) {
      report.damaged = copied_damage.Found();
      report.damaged_steps = copied_damage.steps();
      sqlite::Transaction txn(fresh.db, "repair");
      s = txn.Begin(sqlite::Transaction::Mode::kImmediate);
      auto drop_block = fresh.db.Prepare("DELETE FROM step_blocks WHERE run_id = ?1 AND first_step = ?2");
      auto drop_row = fresh.db.Prepare("DELETE FROM steps WHERE run_id = ?1 AND step = ?2");
      if (s.ok()) s = drop_block.status();
      if (s.ok()) s = drop_row.status();
      for (size_t i = 0; s.ok() && i < report.damaged.size(); ++i) {
        const DamagedSteps& d = report.damaged[i];
        sqlite::Query use(d.block ? *drop_block : *drop_row);
        use.Bind(1, d.run_id);
        use.Bind(2, d.first_step);
        s = use.Run("repair: leaving out damaged steps");
      }
      if (s.ok()) s = txn.Commit();
    }
    if (s.ok()) s = fresh.db.Exec("PRAGMA wal_checkpoint(TRUNCATE)");
    fresh.Close();
    if (!s.ok()) {
      RemoveDatabaseFiles(fresh_path);
      return Status(s.code(), "repair: " + s.message());
    }
  }
  if (Status s = RenameFiles(path, AsideName(path, "before-repair"), &report.moved_files); !s.ok()) {
    RemoveDatabaseFiles(fresh_path);
    return s;
  }
  std::filesystem::rename(fresh_path, path, ec);
  if (ec) return Status::IoError("repair: cannot rename " + fresh_path + " to " + path + ": " + ec.message());
  std::filesystem::remove(fresh_path + "-wal", ec);
  std::filesystem::remove(fresh_path + "-shm", ec);
  report.replaced = true;
  return Status::Ok();
}

StatusOr<std::unique_ptr<Journal>> Journal::Open(const JournalOptions& options, CommitCallback on_commit) {
  // SQLite's own message for a missing directory is only "unable to open database file".
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options.path).parent_path();
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    return Status::IoError("cannot open journal '" + options.path + "': directory '" + dir.string() +
                           "' does not exist");
  }

  // Before SQLite opens the files: its recovery rewrites the WAL index and forgets what it dropped.
  RecoveryReport recovery;
  const bool had_db = std::filesystem::exists(options.path, ec);
  if (had_db && std::filesystem::exists(options.path + "-shm", ec) &&
      !std::filesystem::exists(options.path + "-wal", ec)) {
    recovery.wal_missing = true;
    recovery.detail += "the WAL (" + options.path +
                       "-wal) is missing after an unclean stop: transactions "
                       "since the last checkpoint are lost. ";
  }
  ScanWal(options.path + "-wal", recovery);

  // quick_check reads every page: bounded to small journals and to starts whose WAL recovery lost
  // something; SQLite's WAL keeps a crash from tearing pages, so a larger journal after a clean
  // recovery starts without it (damage is then found when its rows are read).
  const bool check =
      had_db && (!recovery.ok() || std::filesystem::file_size(options.path, ec) <= options.quick_check_max_bytes);
  Connection conn;
  bool damaged = false;
  if (Status s = OpenConnection(options.path, check, recovery, &damaged, conn); !s.ok()) {
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
    spdlog::error(
        "journal '{}' is damaged: {}its files were moved aside to {} (kept for inspection) and a fresh "
        "journal started; salvaged {} run(s), lost {} run(s){}{}; trainers resend what they did not "
        "see acknowledged",
        options.path, recovery.detail, files, recovery.salvaged_runs, recovery.lost_runs,
        lost.empty() ? "" : " (" + lost + ")", tables.empty() ? "" : "; tables not salvaged: " + tables);
  } else if (recovery.wal_missing || recovery.corrupt_tail || recovery.damaged) {
    spdlog::error("journal '{}': recovered with losses: {}", options.path, recovery.detail);
  } else if (!recovery.ok()) {
    spdlog::warn("journal '{}': {}", options.path, recovery.detail);
  }

  JournalOptions normalized = options;
  normalized.batch_max = std::max<size_t>(normalized.batch_max, 1);
  std::unique_ptr<Journal> journal(new Journal(std::move(normalized), std::move(on_commit), std::move(conn)));
  journal->recovery_ = std::move(recovery);
  if (check || journal->recovery_.moved_aside) {
    // Contents quick_check cannot see: the checksums of every block and step row.
    MutexLock db_lock(&journal->db_mu_);
    if (Status s = ScrubSteps(journal->db_, "main", journal->damage_); !s.ok()) {
      spdlog::error("journal '{}': checking the steps' checksums stopped: {}", options.path, s.message());
    } else if (const DamageLog& d = journal->damage_; d.blocks() + d.rows() > 0) {
      spdlog::error(
          "journal '{}': {} block(s) and {} row(s) of steps are damaged ({} step(s), listed above); the rest of "
          "their runs is served. `gradwatchd --repair` copies what is sound into a fresh journal",
          options.path, d.blocks(), d.rows(), d.steps());
    }
  }
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
  db_ = std::move(connection.db);
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
  if (!db_.is_open()) return;
  statements_.reset();  // a connection with live statements cannot close
  // Files lost and not rebuilt: the checkpoint at close would delete the WAL at the path by name.
  if (!CheckFilesLocked().ok()) db_.SkipCheckpointOnClose();
  if (Status s = db_.Close(); !s.ok()) spdlog::error("journal '{}': close failed: {}", options_.path, s.message());
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
    spdlog::error(
        "journal '{}': storage fault, commits are retried and nothing more is acked until "
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
  NameThisThread("gw-journal");
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
        spdlog::error("journal '{}': {} records not committed at shutdown; they were never acknowledged", options_.path,
                      batch.size());
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
      SealDue();
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
    pruned =
        !db_.is_open() ? Status::FailedPrecondition("journal is closed") : PruneBatchLocked(options_.prune_batch_rows);
  }
  mu_.Lock();
  if (!pruned.ok()) {
    spdlog::error("journal '{}': pruning failed, retried at the next cutoff: {}", options_.path, pruned.ToString());
    prune_due_ = false;
  }
}

void Journal::CheckFilesWhileIdle() {
  mu_.Unlock();
  Status status;
  {
    MutexLock db_lock(&db_mu_);
    if (db_.is_open()) status = EnsureFilesLocked();
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
    auto dest = sqlite::Database::Open(temp);
    if (!dest.ok()) return dest.status();
    // The open connection still reads the unlinked files: copy everything committed to them.
    sqlite3_backup* backup = sqlite3_backup_init(dest->get(), "main", db_.get(), "main");
    if (backup == nullptr) return dest->Error("copying the journal into '" + temp + "'");
    const int step = sqlite3_backup_step(backup, -1);
    sqlite3_backup_finish(backup);
    if (step != SQLITE_DONE) return dest->Error("copying the journal into '" + temp + "'");
    if (Status s = dest->Close(); !s.ok()) return s;
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
  old.db = std::exchange(db_, std::move(fresh.db));
  old.statements = std::exchange(statements_, std::move(fresh.statements));
  old.keep_files = true;  // its files are gone or someone else's: no checkpoint, no WAL deletion
  db_dev_ = fresh.db_dev, db_ino_ = fresh.db_ino, wal_dev_ = fresh.wal_dev, wal_ino_ = fresh.wal_ino;
  old.Close();
  rebuilds_.fetch_add(1, std::memory_order_relaxed);
  std::string aside;
  for (const std::string& f : moved) aside += (aside.empty() ? "" : ", ") + f;
  spdlog::error(
      "journal '{}' rebuilt in {:.2f} s from the open connection after: {}; every committed record is "
      "kept{}",
      options_.path, std::chrono::duration<double>(Clock::now() - start).count(), why,
      aside.empty() ? "" : "; the files found at its paths were moved to " + aside);
  return Status::Ok();
}

Status Journal::Commit(std::vector<JournalRecord>& batch, CommitReport& report) {
  MutexLock db_lock(&db_mu_);
  if (!db_.is_open()) return Status::FailedPrecondition("journal is closed");
  if (Status s = EnsureFilesLocked(); !s.ok()) return s;
  const auto start = Clock::now();
  if (!committed_to_lost_files_) {
    sqlite::Transaction txn(db_, "journal");
    if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) return s;
    for (const JournalRecord& record : batch) {
      if (Status s = Apply(record); !s.ok()) return s;
    }
    if (Status s = txn.Commit(); !s.ok()) return s;
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
      const bool clean =
          end->ended_at != 0 && (end->reason == EndReason::kFinished || end->reason == EndReason::kStopped);
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
          const std::string labels = LabelsJson(r.meta.labels);
          const std::string config = ConfigJson(r.meta.config);
          sqlite::Query use(st.insert_run);  // after the text it binds, which must outlive it
          use.Bind(1, r.meta.run_id);
          use.Bind(2, r.meta.world_size);
          use.Bind(3, labels);
          use.Bind(4, config);
          use.Bind(5, r.meta.created_at);
          return use.Run("journal: writing run '" + r.meta.run_id + "'");
        } else if constexpr (std::is_same_v<T, ParamsRecord>) {
          for (size_t i = 0; i < r.params.size(); ++i) {
            const ParamInfo& p = r.params[i];
            sqlite::Query use(st.insert_param);
            use.Bind(1, r.run_id);
            use.Bind(2, int64_t{r.first_index} + static_cast<int64_t>(i));
            use.Bind(3, p.name);
            use.Bind(4, p.numel);
            use.Bind(5, static_cast<int>(p.kind));
            use.Bind(6, p.weight_decay);
            use.Bind(7, p.init_norm);
            use.Bind(8, p.role);
            use.Bind(9, p.group);
            if (Status s = use.Run("journal: writing parameter '" + p.name + "' of run '" + r.run_id + "'"); !s.ok()) {
              return s;
            }
          }
          return Status::Ok();
        } else if constexpr (std::is_same_v<T, SeriesRecord>) {
          sqlite::Query use(st.insert_series);
          use.Bind(1, r.run_id);
          use.Bind(2, r.id);
          use.Bind(3, r.key);
          return use.Run("journal: writing series '" + r.key + "' of run '" + r.run_id + "'");
        } else if constexpr (std::is_same_v<T, StepJournalRecord>) {
          {
            sqlite::Query use(st.insert_step);
            EncodeValues(r.step.values, st.scratch);
            use.Bind(1, r.run_id);
            use.Bind(2, r.step.step);
            use.Bind(3, r.step.wall_time);
            use.Bind(4, r.step.partial ? 1 : 0);
            use.Bind(5, r.step.ranks_reported);
            use.Bind(6, r.step.client_dropped_steps);
            use.BindBlob(7, st.scratch);
            use.Bind(8, StepRowChecksum(r.run_id, r.step.step, r.step.wall_time, r.step.partial, r.step.ranks_reported,
                                        r.step.client_dropped_steps, st.scratch));
            if (Status s =
                    use.Run("journal: writing step " + std::to_string(r.step.step) + " of run '" + r.run_id + "'");
                !s.ok()) {
              return s;
            }
          }
          db_mu_.AssertHeld();  // as below
          if (Status s = NoteStepLocked(r.run_id, r.step.step); !s.ok()) return s;
          for (const RankProgress& p : r.progress) {
            sqlite::Query use(st.upsert_progress);
            use.Bind(1, p.run_id);
            use.Bind(2, p.rank);
            use.Bind(3, p.step);
            use.Bind(4, p.seq);
            if (Status s = use.Run("journal: writing progress of rank " + std::to_string(p.rank) + " of run '" +
                                   p.run_id + "'");
                !s.ok()) {
              return s;
            }
          }
          return Status::Ok();
        } else if constexpr (std::is_same_v<T, EventJournalRecord>) {
          sqlite::Query use(st.insert_event);
          use.Bind(1, r.run_id);
          use.Bind(2, r.event.step);
          use.Bind(3, r.event.text);
          use.Bind(4, r.event.source);
          use.Bind(5, r.event.recorded_at);
          use.Bind(6, r.event.data);
          return use.Run("journal: writing event of run '" + r.run_id + "'");
        } else if constexpr (std::is_same_v<T, RewindRecord>) {
          db_mu_.AssertHeld();  // the analysis does not follow Apply's lock into this lambda
          return ApplyRewind(r);
        } else {
          static_assert(std::is_same_v<T, RunEndedRecord>);
          sqlite::Query use(st.end_run);
          use.Bind(1, r.run_id);
          if (r.ended_at == 0) {
            use.BindNull(2);
            use.Bind(3, static_cast<int>(EndReason::kNone));
          } else {
            use.Bind(2, r.ended_at);
            use.Bind(3, static_cast<int>(r.reason));
          }
          use.Bind(4, r.message);
          return use.Run("journal: ending run '" + r.run_id + "'");
        }
      },
      record);
}

namespace {

// One row of `SELECT step, wall_time, partial, ranks_reported, client_dropped, vals, crc FROM
// steps`. Returns why the row is damaged (StepRowDamage), empty when `step` holds it.
std::string ReadStepRow(sqlite::Query& row, const std::string& run_id, CompletedStep& step) {
  step.step = row.Unsigned(0);
  step.wall_time = row.Real(1);
  step.partial = row.Int(2) != 0;
  step.ranks_reported = static_cast<uint32_t>(row.Int(3));
  step.client_dropped_steps = row.Unsigned(4);
  const std::string_view blob = row.Blob(5);
  std::string why =
      StepRowDamage(run_id, step.step, step.wall_time, step.partial, step.ranks_reported, step.client_dropped_steps,
                    blob, row.IsNull(6) ? std::nullopt : std::optional<int64_t>(row.Int(6)));
  if (why.empty() && !DecodeValues(blob, step.values)) why = "its value blob cannot be read";
  return why;
}

DamagedSteps RowDamage(const std::string& run_id, uint64_t step, std::string why) {
  return {.run_id = run_id, .first_step = step, .last_step = step, .steps = 1, .why = std::move(why)};
}

int64_t StepBound(uint64_t step) {
  return static_cast<int64_t>(std::min<uint64_t>(step, static_cast<uint64_t>(std::numeric_limits<int64_t>::max())));
}

// The last step below `before_step`, for a `step <= ?` bound: the column is a signed 64-bit
// integer, so "below 2^64 - 1" must read as "at most 2^63 - 1", the largest step kept, not as a
// `step < 2^63 - 1` that would leave that step out. -1 (nothing) below 0.
int64_t LastStepBefore(uint64_t before_step) { return before_step == 0 ? -1 : StepBound(before_step - 1); }

// Hands on_step the run's steps below before_step in step order: its blocks (`blocks`: SELECT
// first_step, last_step, steps, data ... WHERE run_id = ?1 AND first_step <= ?2 ORDER BY
// first_step) merged with its step rows (`rows`: as ReadStepRow reads them, WHERE run_id = ?1 AND
// step <= ?2 ORDER BY step), ?2 being LastStepBefore(before_step). A step in both (a row rewritten
// after its block was sealed, which only a late out-of-order step does) is taken from its row, the
// later write. A damaged block or row is noted in `damage` and skipped: the rest is read.
Status VisitSteps(sqlite::Statement& blocks, sqlite::Statement& rows, const std::string& run_id, uint64_t from_step,
                  uint64_t before_step, DamageLog& damage, const std::function<void(const CompletedStep&)>& on_step) {
  const std::string what = "journal: reading steps of run '" + run_id + "'";
  sqlite::Query raw(rows);
  raw.Bind(1, run_id);
  raw.Bind(2, LastStepBefore(before_step));
  raw.Bind(3, StepBound(from_step));
  Status raw_status;
  CompletedStep row;
  bool have_row = false;
  auto next_row = [&] {
    while ((have_row = raw.Next(&raw_status, what))) {
      std::string why = ReadStepRow(raw, run_id, row);
      if (why.empty()) return;
      damage.Note(RowDamage(run_id, row.step, std::move(why)));
    }
  };
  next_row();
  sqlite::Query block(blocks);
  block.Bind(1, run_id);
  block.Bind(2, LastStepBefore(before_step));
  block.Bind(3, StepBound(from_step));
  Status block_status;
  std::vector<CompletedStep> decoded;
  while (block.Next(&block_status, what)) {
    if (Status s = DecodeStepBlock(block.Blob(3), decoded); !s.ok()) {
      damage.Note({.run_id = run_id,
                   .first_step = block.Unsigned(0),
                   .last_step = block.Unsigned(1),
                   .steps = block.Unsigned(2),
                   .block = true,
                   .why = s.message()});
      continue;
    }
    for (const CompletedStep& step : decoded) {
      if (step.step < from_step) continue;
      if (step.step >= before_step) break;
      while (have_row && row.step < step.step) {
        on_step(row);
        next_row();
      }
      if (have_row && row.step == step.step) continue;
      on_step(step);
    }
  }
  if (!block_status.ok()) return block_status;
  while (have_row) {
    on_step(row);
    next_row();
  }
  return raw_status;
}

}  // namespace

Status Journal::NoteStepLocked(const std::string& run_id, uint64_t step) {
  Statements& st = *statements_;
  auto [it, first] = seal_state_.try_emplace(run_id);
  SealState& state = it->second;
  const std::string what = "journal: counting the step rows of run '" + run_id + "'";
  if (first) {
    // The row just written is counted by the query.
    {
      sqlite::Query use(st.last_block);
      use.Bind(1, run_id);
      Status s;
      if (use.Next(&s, what) && !use.IsNull(0)) state.sealed = true, state.sealed_through = use.Unsigned(0);
      if (!s.ok()) return s;
    }
    sqlite::Query use(st.count_raw_after);
    use.Bind(1, run_id);
    use.Bind(2, state.sealed ? static_cast<int64_t>(state.sealed_through) : int64_t{-1});
    Status s;
    if (use.Next(&s, what)) state.raw_after = use.Unsigned(0);
    if (!s.ok()) return s;
  } else if (!state.sealed || step > state.sealed_through) {
    ++state.raw_after;
  }
  if (state.raw_after >= options_.block_steps && !state.due) {
    state.due = true;
    seal_due_.push_back(run_id);
  }
  return Status::Ok();
}

void Journal::SealDue() {
  MutexLock db_lock(&db_mu_);
  if (seal_due_.empty() || !db_.is_open() || !CheckFilesLocked().ok()) return;
  // Not synced by itself: the next commit's fsync of the WAL covers these frames too, and losing
  // them loses nothing (the step rows they replace are still there).
  if (Status s = db_.Exec("PRAGMA synchronous=NORMAL"); !s.ok()) {
    spdlog::warn("journal '{}': sealing blocks: {}", options_.path, s.message());
    return;
  }
  Status status;
  {
    sqlite::Transaction txn(db_, "journal");
    status = txn.Begin(sqlite::Transaction::Mode::kImmediate);
    // A run far behind (a migrated journal) is sealed a few blocks per commit, so that commits
    // wait for little.
    constexpr int kMaxBlocksPerRound = 2;
    int blocks = 0;
    std::vector<std::string> still_due;
    for (const std::string& run_id : seal_due_) {
      auto it = seal_state_.find(run_id);
      if (it == seal_state_.end()) continue;  // rewound or pruned meanwhile
      SealState& state = it->second;
      while (status.ok() && blocks < kMaxBlocksPerRound && state.raw_after >= options_.block_steps) {
        status = SealRunLocked(run_id);
        ++blocks;
      }
      state.due = status.ok() && state.raw_after >= options_.block_steps;
      if (state.due) still_due.push_back(run_id);
    }
    if (status.ok()) status = txn.Commit();
    seal_due_ = std::move(still_due);
  }
  if (!status.ok()) {
    // The rows stay as they are; the runs' counts are learnt again at their next step.
    spdlog::warn("journal '{}': sealing blocks failed, the step rows stay: {}", options_.path, status.ToString());
    seal_state_.clear();
    seal_due_.clear();
  }
  if (Status s = db_.Exec("PRAGMA synchronous=FULL"); !s.ok()) {
    spdlog::error("journal '{}': restoring synchronous=FULL: {}", options_.path, s.message());
  }
}

Status Journal::InsertBlockLocked(const std::string& run_id, StepBlockEncoder& block, const std::string& what) {
  Statements& st = *statements_;
  sqlite::Query use(st.insert_block);
  use.Bind(1, run_id);
  use.Bind(2, block.first_step());
  use.Bind(3, block.last_step());
  use.Bind(4, static_cast<int64_t>(block.steps()));
  use.Bind(5, block.last_wall_time());
  std::string& blob = st.scratch;
  blob.clear();
  block.Finish(blob);
  use.BindBlob(6, blob);
  return use.Run(what);
}

Status Journal::SealRunLocked(const std::string& run_id) {
  Statements& st = *statements_;
  SealState& state = seal_state_[run_id];
  const std::string what = "journal: sealing a block of run '" + run_id + "'";
  // The rows go into the block one by one: only the block's values are held, not the rows.
  StepBlockEncoder& block = st.block;
  block.Clear();
  uint64_t rows = 0, first_row = 0, last_row = 0;  // rows read, damaged ones included
  {
    sqlite::Query use(st.raw_after);
    use.Bind(1, run_id);
    use.Bind(2, state.sealed ? static_cast<int64_t>(state.sealed_through) : int64_t{-1});
    use.Bind(3, static_cast<int64_t>(options_.block_steps));
    Status s;
    bool full = false;  // by its values, before block_steps steps
    while (!full && use.Next(&s, what)) {
      std::string why = ReadStepRow(use, run_id, st.row);
      if (rows == 0) first_row = st.row.step;
      last_row = st.row.step;
      ++rows;
      if (!why.empty()) {
        // Lost either way: the block leaves it out, and its row goes with the others.
        damage_.Note(RowDamage(run_id, st.row.step, std::move(why) + " (left out of its block)"));
        continue;
      }
      if (block.empty()) {
        // Room for the block at the first row's size: it ends at block_steps rows, or at the row
        // that takes it to kSealMaxValues.
        const size_t row_values = st.row.values.size();
        const size_t by_steps = row_values * options_.block_steps;
        block.Reserve(options_.block_steps, std::min(by_steps, kSealMaxValues - 1 + row_values));
      }
      block.Add(st.row);
      full = block.values() >= kSealMaxValues;
    }
    if (!s.ok()) return s;
    if (!full && rows < options_.block_steps) {
      state.raw_after = rows;  // the count was high (a rolled-back commit)
      return Status::Ok();
    }
  }
  if (!block.empty()) {
    if (Status s = InsertBlockLocked(run_id, block, what); !s.ok()) return s;
  }
  {
    sqlite::Query use(st.delete_raw);
    use.Bind(1, run_id);
    use.Bind(2, first_row);
    use.Bind(3, last_row);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  const uint64_t last_step = last_row;
  const uint64_t steps = rows;
  state.sealed = true;
  state.sealed_through = last_step;
  state.raw_after -= std::min<uint64_t>(state.raw_after, steps);
  return Status::Ok();
}

Status Journal::SplitBlocksLocked(const std::string& run_id, uint64_t from_step, int64_t branch) {
  Statements& st = *statements_;
  seal_state_.erase(run_id);  // learnt again at the run's next step
  const std::string what = "journal: rewinding the blocks of run '" + run_id + "'";
  struct Block {
    uint64_t first_step, last_step, steps;
    std::string data;
  };
  std::vector<Block> blocks;
  {
    sqlite::Query use(st.blocks_from);
    use.Bind(1, run_id);
    use.Bind(2, StepBound(from_step));
    Status s;
    while (use.Next(&s, what)) {
      blocks.push_back({use.Unsigned(0), use.Unsigned(2), use.Unsigned(3), std::string(use.Blob(1))});
    }
    if (!s.ok()) return s;
  }
  std::vector<CompletedStep> decoded;
  StepBlockEncoder& kept = st.block;
  for (const Block& b : blocks) {
    {
      sqlite::Query use(st.delete_block);
      use.Bind(1, run_id);
      use.Bind(2, b.first_step);
      if (Status s = use.Run(what); !s.ok()) return s;
    }
    if (Status s = DecodeStepBlock(b.data, decoded); !s.ok()) {
      // Its steps are lost either way; refusing the rewind would stop every later commit.
      damage_.Note({.run_id = run_id,
                    .first_step = b.first_step,
                    .last_step = b.last_step,
                    .steps = b.steps,
                    .block = true,
                    .why = s.message() + " (dropped by a rewind to step " + std::to_string(from_step) + ")"});
      continue;
    }
    kept.Clear();
    for (const CompletedStep& step : decoded) {
      if (step.step < from_step) {
        kept.Add(step);
        continue;
      }
      EncodeValues(step.values, st.scratch);
      sqlite::Query use(st.insert_abandoned_step);
      use.Bind(1, run_id);
      use.Bind(2, branch);
      use.Bind(3, step.step);
      use.Bind(4, step.wall_time);
      use.Bind(5, step.partial ? 1 : 0);
      use.Bind(6, step.ranks_reported);
      use.Bind(7, step.client_dropped_steps);
      use.BindBlob(8, st.scratch);
      use.Bind(9, StepRowChecksum(run_id, step.step, step.wall_time, step.partial, step.ranks_reported,
                                  step.client_dropped_steps, st.scratch));
      if (Status s = use.Run(what); !s.ok()) return s;
    }
    if (kept.empty()) continue;
    if (Status s = InsertBlockLocked(run_id, kept, what); !s.ok()) return s;
  }
  return Status::Ok();
}

Status Journal::ApplyRewind(const RewindRecord& r) {
  Statements& st = *statements_;
  const std::string what = "journal: rewinding run '" + r.run_id + "' to step " + std::to_string(r.from_step);
  int64_t branch = 0;  // the branch that ends here
  {
    sqlite::Query use(st.count_rewinds);
    use.Bind(1, r.run_id);
    Status s;
    if (!use.Next(&s, what)) return s.ok() ? Status::Internal(what + ": count returned no row") : s;
    branch = use.Int(0);
  }
  {
    sqlite::Query use(st.insert_rewind);
    use.Bind(1, r.run_id);
    use.Bind(2, branch);
    use.Bind(3, r.from_step);
    use.Bind(4, r.world_size);
    use.Bind(5, r.rewound_at);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  if (Status s = SplitBlocksLocked(r.run_id, r.from_step, branch); !s.ok()) return s;
  for (sqlite::Statement* move : {&st.abandon_steps, &st.abandon_events}) {
    sqlite::Query use(*move);
    use.Bind(1, r.run_id);
    use.Bind(2, branch);
    use.Bind(3, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  for (sqlite::Statement* drop : {&st.delete_steps, &st.delete_events}) {
    sqlite::Query use(*drop);
    use.Bind(1, r.run_id);
    use.Bind(2, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  if (r.from_step > 0) {
    sqlite::Query use(st.rewind_progress);
    use.Bind(1, r.run_id);
    use.Bind(2, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  {
    // After the update only a rewind to step 0 leaves progress at or above from_step: none is kept.
    sqlite::Query use(st.drop_progress);
    use.Bind(1, r.run_id);
    use.Bind(2, r.world_size);
    use.Bind(3, r.from_step);
    if (Status s = use.Run(what); !s.ok()) return s;
  }
  sqlite::Query use(st.set_world_size);
  use.Bind(1, r.run_id);
  use.Bind(2, r.world_size);
  return use.Run(what);
}

// Reads one run's rows for Load and LoadRun, inside their read transaction.
struct Journal::Reader {
  sqlite::Statement runs, one_run, params, series, progress, rewind, blocks, steps, events;

  Status Prepare(sqlite::Database& db) {
    const std::pair<sqlite::Statement*, const char*> all[] = {
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
        {&rewind, "SELECT from_step, branch FROM rewinds WHERE run_id = ?1 ORDER BY branch DESC LIMIT 1"},
        {&blocks,
         // From the block holding ?3 on, found by a seek of the primary key (not a scan of the
         // run's blocks: a restart from a snapshot reads only the blocks after it).
         "SELECT first_step, last_step, steps, data FROM step_blocks WHERE run_id = ?1 AND first_step <= ?2 AND "
         "first_step >= "
         "COALESCE((SELECT MAX(first_step) FROM step_blocks WHERE run_id = ?1 AND first_step <= ?3), 0) "
         "AND last_step >= ?3 ORDER BY first_step"},
        {&steps,
         "SELECT step, wall_time, partial, ranks_reported, client_dropped, vals, crc FROM steps "
         "WHERE run_id = ?1 AND step <= ?2 AND step >= ?3 ORDER BY step"},
        {&events, "SELECT step, text, source, recorded_at, data FROM events WHERE run_id = ?1 ORDER BY id"},
    };
    for (const auto& [stmt, sql] : all) {
      auto prepared = db.Prepare(sql);
      if (!prepared.ok()) return prepared.status();
      *stmt = std::move(prepared).value();
    }
    return Status::Ok();
  }

  // Reads the run at the current row of `rows` and hands it, then (if the visitor keeps it) its
  // series, progress, latest rewind, events and steps, to `visitor`.
  Status Visit(sqlite::Query& rows, JournalVisitor& visitor, DamageLog& damage, bool* kept) {
    RunMeta meta;
    meta.run_id = rows.Text(0);
    meta.world_size = static_cast<uint32_t>(rows.Int(1));
    if (Status s = ParseLabels(rows.Text(2), meta.run_id, meta.labels); !s.ok()) return s;
    if (Status s = ParseConfig(rows.Text(3), meta.run_id, meta.config); !s.ok()) return s;
    meta.created_at = rows.Real(4);
    RunEnd end;
    if (!rows.IsNull(5)) {
      end.ended_at = rows.Real(5);
      const int64_t reason = rows.Int(6);
      end.reason = reason >= static_cast<int>(EndReason::kInactive) && reason <= static_cast<int>(EndReason::kStopped)
                       ? static_cast<EndReason>(reason)
                       : EndReason::kInactive;
      end.message = rows.Text(7);
    }
    Status status;
    {
      sqlite::Query q(params);
      q.Bind(1, meta.run_id);
      while (q.Next(&status, "journal: reading parameters of run '" + meta.run_id + "'")) {
        const int64_t idx = q.Int(0);
        if (idx < 0 || idx >= kMaxParamIndex) {
          return Status::Internal("journal: run '" + meta.run_id + "': parameter index " + std::to_string(idx) +
                                  " is out of range");
        }
        if (static_cast<size_t>(idx) > meta.params.size()) {
          spdlog::warn("journal: run '{}': parameters {}..{} are missing; keeping their slots", meta.run_id,
                       meta.params.size(), idx - 1);
        }
        meta.params.resize(std::max(meta.params.size(), static_cast<size_t>(idx) + 1));
        ParamInfo& p = meta.params[static_cast<size_t>(idx)];
        p.name = q.Text(1);
        p.numel = q.Unsigned(2);
        p.kind = static_cast<ParamKind>(q.Int(3));
        p.weight_decay = q.Real(4);
        if (!q.IsNull(5)) p.init_norm = q.Real(5);
        p.role = q.Text(6);
        p.group = q.Text(7);
      }
      if (!status.ok()) return status;
    }
    *kept = visitor.OnRun(meta, end);
    if (!*kept) return Status::Ok();
    {
      sqlite::Query q(series);
      q.Bind(1, meta.run_id);
      while (q.Next(&status, "journal: reading series of run '" + meta.run_id + "'")) {
        visitor.OnSeries(meta.run_id, static_cast<SeriesId>(q.Int(0)), q.Text(1));
      }
      if (!status.ok()) return status;
    }
    {
      sqlite::Query q(progress);
      q.Bind(1, meta.run_id);
      while (q.Next(&status, "journal: reading progress of run '" + meta.run_id + "'")) {
        visitor.OnRankProgress(
            RankProgress{meta.run_id, static_cast<uint32_t>(q.Int(0)), q.Unsigned(1), q.Unsigned(2)});
      }
      if (!status.ok()) return status;
    }
    uint64_t branch = 0;  // the current branch: the number of rewinds
    {
      sqlite::Query q(rewind);
      q.Bind(1, meta.run_id);
      if (q.Next(&status, "journal: reading rewinds of run '" + meta.run_id + "'")) {
        visitor.OnRewind(meta.run_id, q.Unsigned(0));
        branch = q.Unsigned(1) + 1;
      }
      if (!status.ok()) return status;
    }
    {
      sqlite::Query q(events);
      q.Bind(1, meta.run_id);
      while (q.Next(&status, "journal: reading events of run '" + meta.run_id + "'")) {
        EventRecord event;
        event.step = q.Unsigned(0);
        event.text = q.Text(1);
        event.source = q.Text(2);
        event.recorded_at = q.Real(3);
        event.data = q.Text(4);
        visitor.OnEvent(meta.run_id, event);
      }
      if (!status.ok()) return status;
    }
    const uint64_t from_step = visitor.OnStepsBegin(meta.run_id, branch);
    return VisitSteps(blocks, steps, meta.run_id, from_step, std::numeric_limits<uint64_t>::max(), damage,
                      [&](const CompletedStep& step) { visitor.OnStep(meta.run_id, step); });
  }
};

Status Journal::LoadRunSteps(const std::string& run_id, uint64_t before_step,
                             const std::function<void(const CompletedStep&)>& on_step) {
  MutexLock db_lock(&db_mu_);
  if (!db_.is_open()) return Status::FailedPrecondition("journal is stopped");
  Reader reader;
  if (Status s = reader.Prepare(db_); !s.ok()) return s;
  sqlite::Transaction txn(db_, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kDeferred); !s.ok()) return s;
  return VisitSteps(reader.blocks, reader.steps, run_id, 0, before_step, damage_, on_step);
}

Status Journal::Load(JournalVisitor& visitor) {
  MutexLock db_lock(&db_mu_);
  if (!db_.is_open()) return Status::FailedPrecondition("journal is stopped");
  Reader reader;
  if (Status s = reader.Prepare(db_); !s.ok()) return s;
  // One read transaction, so every table is read from the same snapshot.
  sqlite::Transaction txn(db_, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kDeferred); !s.ok()) return s;
  Status status;
  sqlite::Query rows(reader.runs);
  while (rows.Next(&status, "journal: reading runs")) {
    bool kept = false;
    if (Status s = reader.Visit(rows, visitor, damage_, &kept); !s.ok()) {
      // One run that cannot be read must not keep the others (and the daemon) from starting.
      visitor.OnRunFailed(rows.Text(0), s);
      continue;
    }
    if (kept) {
      MutexLock held_lock(&held_mu_);
      held_.insert(rows.Text(0));
    }
  }
  return status;
}

Status Journal::LoadRun(const std::string& run_id, JournalVisitor& visitor) {
  MutexLock db_lock(&db_mu_);
  if (!db_.is_open()) return Status::FailedPrecondition("journal is stopped");
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
  sqlite::Transaction txn(db_, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kDeferred); !s.ok()) return s;
  Status status;
  sqlite::Query rows(reader.one_run);
  rows.Bind(1, run_id);
  if (!rows.Next(&status, "journal: reading run '" + run_id + "'")) {
    return status.ok() ? Status::NotFound("no run '" + run_id + "' in the journal") : status;
  }
  bool kept = false;
  return reader.Visit(rows, visitor, damage_, &kept);
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
  if (!db_.is_open()) return Status::FailedPrecondition("journal is stopped");
  auto runs = db_.Prepare(
      "SELECT run_id, world_size, labels_json, created_at, ended_at, end_reason, end_message FROM runs "
      "ORDER BY run_id");
  if (!runs.ok()) return runs.status();
  auto steps = db_.Prepare(
      "SELECT sum(n), min(lo), max(hi), max(wt) FROM ("
      "SELECT count(*) AS n, min(step) AS lo, max(step) AS hi, max(wall_time) AS wt FROM steps WHERE run_id = ?1 "
      "UNION ALL SELECT sum(steps), min(first_step), max(last_step), max(wall_time) FROM step_blocks "
      "WHERE run_id = ?1)");
  if (!steps.ok()) return steps.status();
  std::vector<StoredRun> out;
  Status status;
  sqlite::Query rows(*runs);
  while (rows.Next(&status, "journal: listing runs")) {
    StoredRun r;
    r.meta.run_id = rows.Text(0);
    if (IsHeld(r.meta.run_id) || r.meta.run_id == pruning_run_) continue;
    r.meta.world_size = static_cast<uint32_t>(rows.Int(1));
    if (!ParseLabels(rows.Text(2), r.meta.run_id, r.meta.labels).ok()) r.meta.labels.clear();
    r.meta.created_at = rows.Real(3);
    if (!rows.IsNull(4)) {
      r.end.ended_at = rows.Real(4);
      const int64_t reason = rows.Int(5);
      r.end.reason = reason >= static_cast<int>(EndReason::kInactive) && reason <= static_cast<int>(EndReason::kStopped)
                         ? static_cast<EndReason>(reason)
                         : EndReason::kInactive;
      r.end.message = rows.Text(6);
    }
    sqlite::Query q(*steps);
    q.Bind(1, r.meta.run_id);
    if (q.Next(&status, "journal: counting steps of run '" + r.meta.run_id + "'")) {
      r.step_count = q.Unsigned(0);
      r.first_step = q.Unsigned(1);
      r.last_step = q.Unsigned(2);
      r.last_wall_time = q.Real(3);
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
  sqlite::Transaction txn(db_, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) return s;
  if (pruning_run_.empty()) {
    // Abandoned branches (of any run) rewound before the cutoff go first.
    uint64_t deleted = 0;
    for (sqlite::Statement* del : {&st.prune_old_branch_steps, &st.prune_old_branch_events}) {
      sqlite::Query use(*del);
      use.Bind(1, cutoff);
      use.Bind(2, static_cast<int64_t>(std::min<size_t>(max_rows - deleted, INT64_MAX)));
      if (Status s = use.Run("journal: pruning abandoned branches"); !s.ok()) return s;
      deleted += static_cast<uint64_t>(db_.changes());
      if (deleted >= max_rows) break;
    }
    if (deleted > 0) {
      if (Status s = txn.Commit(); !s.ok()) return s;
      pruned_rows_.fetch_add(deleted, std::memory_order_relaxed);
      return Status::Ok();  // prune_due_ stays: the next round goes on
    }
    Status status;
    sqlite::Query rows(st.prune_candidates);
    rows.Bind(1, cutoff);
    while (rows.Next(&status, "journal: finding runs to prune")) {
      std::string id = rows.Text(0);
      if (!IsHeld(id)) {
        pruning_run_ = std::move(id);
        break;
      }
    }
    if (!status.ok()) return status;
    if (pruning_run_.empty()) {
      MutexLock lock(&mu_);
      // Done until the cutoff moves; if it moved while this pass ran, the next pass uses it.
      if (prune_cutoff_ == cutoff) prune_due_ = false;
      return Status::Ok();
    }
  }
  // A run's rows go table by table, at most max_rows per transaction; its runs row goes last, so a
  // half pruned run stays listed (and is finished by LoadRun) rather than leaving orphans.
  uint64_t deleted = 0;
  {
    // A block counts as block_steps rows; at least one goes per transaction.
    const size_t block_rows = std::max<size_t>(options_.block_steps, 1);
    sqlite::Query use(st.prune_blocks);
    use.Bind(1, pruning_run_);
    const auto limit = static_cast<int64_t>(std::max<size_t>(std::min<size_t>(max_rows / block_rows, INT64_MAX), 1));
    use.Bind(2, limit);
    if (Status s = use.Run("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    const auto changes = static_cast<uint64_t>(db_.changes());
    deleted += changes * block_rows;
    // Blocks may remain: the run's other rows wait for the next transaction.
    if (changes == static_cast<uint64_t>(limit)) deleted = std::max<uint64_t>(deleted, max_rows);
  }
  for (sqlite::Statement* del :
       {&st.prune_steps, &st.prune_events, &st.prune_series, &st.prune_params, &st.prune_progress, &st.prune_rewinds,
        &st.prune_abandoned_steps, &st.prune_abandoned_events}) {
    if (deleted >= max_rows) break;
    sqlite::Query use(*del);
    use.Bind(1, pruning_run_);
    use.Bind(2, static_cast<int64_t>(std::min<size_t>(max_rows - deleted, INT64_MAX)));
    if (Status s = use.Run("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    deleted += static_cast<uint64_t>(db_.changes());
  }
  bool run_done = false;
  if (deleted < max_rows) {
    sqlite::Query use(st.prune_run);
    use.Bind(1, pruning_run_);
    if (Status s = use.Run("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    deleted += static_cast<uint64_t>(db_.changes());
    run_done = true;
  }
  if (Status s = txn.Commit(); !s.ok()) return s;
  pruned_rows_.fetch_add(deleted, std::memory_order_relaxed);
  if (run_done) {
    spdlog::info("journal: run {} pruned (ended before the retention cutoff)", pruning_run_);
    seal_state_.erase(pruning_run_);
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

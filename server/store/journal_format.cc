#include <bit>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include <spdlog/spdlog.h>

#include "server/store/journal_internal.h"

namespace gradwatch::store {

namespace {

using json = nlohmann::json;

// Version 2 adds how a run ended, events found by run, and the rewind tables (kRewindTables);
// version 3 the compressed blocks of steps (kStepBlocks); version 4 what a machine reads of an
// event (kEventData: a catalog change's new values). Older journals are migrated at open; their
// step rows stay readable as they are and are sealed into blocks as their runs go on.
constexpr int kSchemaVersion = 5;
// One (uint32 series id, float64 value) pair in a step's value blob.
constexpr size_t kValueEntryBytes = 4 + 8;

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

void PutLe(char* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

// nlohmann-json throws; these adapters turn every failure into a value. Invalid UTF-8 is
// replaced rather than thrown on, so odd labels never cost a commit.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

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
}  // namespace

namespace journal_internal {

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
int64_t LastStepBefore(uint64_t before_step) { return before_step == 0 ? -1 : StepBound(before_step - 1); }

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

}  // namespace journal_internal

Status journal_internal::Statements::PrepareAll(sqlite::Database& db) {
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

}  // namespace gradwatch::store

#include "server/store/alert_store.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "alerts/notify/payloads.h"

namespace gradwatch::store {

namespace {

// outbox.delivery: 0 while pending, then one of these.
constexpr int kDelivered = 1, kFailed = 2;

// The alert store's errors are the notifier's (recoverable: retried by the callers) and say
// "outbox:" first.
notify::Status OutboxError(const Status& s) { return notify::NotifyError("outbox: " + s.message()); }

std::string Hex(uint64_t fingerprint) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, fingerprint >>= 4) out[static_cast<size_t>(i)] = kDigits[fingerprint & 0xf];
  return out;
}

// As the journal's: invalid UTF-8 is replaced (U+FFFD), never thrown on the writer thread.
std::string Dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

std::optional<uint64_t> ParseHex(std::string_view hex) {
  if (hex.empty() || hex.size() > 16) return std::nullopt;
  uint64_t v = 0;
  for (char c : hex) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return std::nullopt;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  return v;
}

constexpr size_t kReportDoubles = 3 * alerts::ReportWindow::kCapacity;

std::vector<double> ReportsBlob(const alerts::ReportWindow::Raw& raw) {
  std::vector<double> out;
  out.reserve(kReportDoubles);
  out.insert(out.end(), raw.value.begin(), raw.value.end());
  out.insert(out.end(), raw.hold.begin(), raw.hold.end());
  out.insert(out.end(), raw.clear.begin(), raw.clear.end());
  return out;
}

bool ReportsFromBlob(const void* blob, size_t bytes, alerts::ReportWindow::Raw* raw) {
  if (bytes != kReportDoubles * sizeof(double)) return false;
  const auto* d = static_cast<const unsigned char*>(blob);
  constexpr size_t kColumn = alerts::ReportWindow::kCapacity * sizeof(double);
  std::memcpy(raw->value.data(), d, kColumn);
  std::memcpy(raw->hold.data(), d + kColumn, kColumn);
  std::memcpy(raw->clear.data(), d + 2 * kColumn, kColumn);
  return true;
}

std::string AckToJson(const alerts::Acknowledgement& ack) {
  return Dump(nlohmann::json{{"by", ack.by}, {"comment", ack.comment}, {"at", ack.at}});
}

// A silence's matchers: [{"name": "run", "op": "=~", "value": "moe-.*"}, ...].
nlohmann::json MatchersJson(const std::vector<alerts::Matcher>& matchers) {
  nlohmann::json out = nlohmann::json::array();
  for (const alerts::Matcher& m : matchers) {
    out.push_back({{"name", m.name()}, {"op", std::string(alerts::MatchOperator(m.type()))}, {"value", m.value()}});
  }
  return out;
}

// Also reads what versions before regular-expression matchers wrote: {"label": "value", ...}.
StatusOr<std::vector<alerts::Matcher>> ParseMatchers(const std::string& text) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.is_object()) return alerts::EqualityMatchers(j.get<alerts::LabelSet>());
    if (!j.is_array()) return Status::InvalidArgument("matchers are neither a list nor an object");
    std::vector<alerts::Matcher> out;
    for (const nlohmann::json& m : j) {
      const std::string op = m.at("op").get<std::string>();
      std::optional<alerts::MatchType> type;
      for (auto t : {alerts::MatchType::kEqual, alerts::MatchType::kNotEqual, alerts::MatchType::kRegex,
                     alerts::MatchType::kNotRegex}) {
        if (alerts::MatchOperator(t) == op) type = t;
      }
      if (!type) return Status::InvalidArgument("unknown matcher operator '" + op + "'");
      auto matcher = alerts::Matcher::Make(m.at("name").get<std::string>(), *type, m.at("value").get<std::string>());
      if (!matcher.ok()) return matcher.status();
      out.push_back(std::move(*matcher));
    }
    return out;
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(e.what());
  }
}

alerts::Acknowledgement AckFromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  return {j.at("by").get<std::string>(), j.at("comment").get<std::string>(), j.at("at").get<double>()};
}

}  // namespace

namespace {

// The alert store's tables in the journal's file. The journal owns the file's schema version
// (PRAGMA user_version), so these are created when missing and may only ever be added to.
constexpr const char* kTables[] = {
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
    "created_by TEXT NOT NULL)",
    // reports: the ReportWindow's value, hold and clear columns, as raw doubles
    // (exact, NaN and infinities included), then nothing else.
    "CREATE TABLE IF NOT EXISTS alert_levels (fingerprint TEXT PRIMARY KEY, run TEXT NOT NULL, "
    "rule TEXT NOT NULL, reports BLOB NOT NULL, report_count INTEGER NOT NULL, "
    "since_mark INTEGER NOT NULL, all_since_mark INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS alert_progress (run TEXT PRIMARY KEY, evaluated_step INTEGER NOT NULL)",
    // The alert history: every state change (alerts::HistoryEntry), the alert as JSON with its new
    // state; from_state is an alerts::AlertState.
    "CREATE TABLE IF NOT EXISTS alert_history (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT NOT NULL, "
    "fingerprint TEXT NOT NULL, from_state INTEGER NOT NULL, at REAL NOT NULL, alert TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS alert_history_run ON alert_history (run, id)"};

// Opens the journal's file at `path` (creating it only when `create`) with the settings and the
// tables the alert store needs.
//
// Its commits do not fsync by themselves (synchronous=NORMAL, with the WAL): an alert's page waits
// for no disk flush before it is sent. The file's WAL is the journal's, whose next commit fsyncs
// it, these frames included, and what a power cut could take first is made again: a delivery's
// mark is lost and the entry sent again under the same Idempotency-Key; the engine's changes are
// made again when the restarted engine evaluates the journal's steps after the last step it had
// saved (alerts::AlertEngine::Restore). What only a user can give again, a silence or an
// acknowledgement, is committed with its own fsync (Write).
StatusOr<sqlite::Database> OpenDb(const std::string& path, bool create) {
  auto db = sqlite::Database::Open(path, {.create = create});
  if (!db.ok()) return db.status();
  if (Status s = db->UseWal(); !s.ok()) return s;
  if (Status s = db->Exec("PRAGMA synchronous=NORMAL"); !s.ok()) return s;
  // Nor do they checkpoint the WAL: SQLite's auto-checkpoint runs in the commit that takes the WAL
  // past 1,000 frames, whichever connection makes it, and writes and fsyncs up to 1,000 pages (16 MB
  // of the journal's) before that commit returns. Made by an alert's commit, it held the page back
  // by about 20 ms (`gradwatch_bench --only alerts` with the journal's commits made cheap: webhook
  // p99 21-27 ms, 4.9-8.1 without). The journal's connection, whose commits fsync anyway, makes
  // them all; the WAL the alerts add between two of its commits is a few frames an alert.
  if (Status s = db->Exec("PRAGMA wal_autocheckpoint=0"); !s.ok()) return s;
  for (const char* sql : kTables) {
    if (Status s = db->Exec(sql); !s.ok()) return s;
  }
  return db;
}

// Whether the changes hold something a user gave (a silence, an acknowledgement), which no
// re-evaluation of the journal makes again.
bool HoldsUserChanges(const alerts::StateChanges& states) {
  return !states.silences.empty() || std::any_of(states.instances.begin(), states.instances.end(),
                                                 [](const auto& entry) { return entry.second && entry.second->ack; });
}

bool SameFile(const struct stat& st, uint64_t dev, uint64_t ino) {
  return static_cast<uint64_t>(st.st_dev) == dev && static_cast<uint64_t>(st.st_ino) == ino;
}

}  // namespace

StatusOr<std::unique_ptr<AlertStore>> AlertStore::Open(const std::string& path) {
  auto db = OpenDb(path, true);
  if (!db.ok()) return Status::IoError("outbox: " + db.status().message());
  return std::unique_ptr<AlertStore>(new AlertStore(path, std::move(db).value()));
}

AlertStore::AlertStore(std::string path, sqlite::Database db) : path_(std::move(path)) {
  MutexLock lock(&mu_);
  ReplaceDbLocked(std::move(db));
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0) dev_ = st.st_dev, ino_ = st.st_ino;
}

notify::Status AlertStore::FollowFileLocked() {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    return notify::NotifyError("outbox: the journal '" + path_ + "' vanished; waiting until it is rebuilt");
  }
  if (SameFile(st, dev_, ino_)) return notify::Status::Ok();
  auto fresh = OpenDb(path_, false);
  if (!fresh.ok()) return notify::NotifyError("outbox: following the rebuilt journal: " + fresh.status().message());
  // The old files are gone or someone else's: close without the checkpoint that would delete the
  // WAL by name (the new file's).
  db_.SkipCheckpointOnClose();
  ReplaceDbLocked(std::move(fresh).value());
  dev_ = st.st_dev;
  ino_ = st.st_ino;
  spdlog::warn("outbox: the journal '{}' was rebuilt; alert states and notifications go to the new file", path_);
  return notify::Status::Ok();
}

AlertStore::~AlertStore() {
  MutexLock lock(&mu_);
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0 || !SameFile(st, dev_, ino_)) {
    // Not the file at the path any more: the checkpoint at close would delete that file's WAL.
    db_.SkipCheckpointOnClose();
  }
  statements_.clear();
  if (Status s = db_.Close(); !s.ok()) spdlog::error("outbox: {}", s.message());
}

void AlertStore::ReplaceDbLocked(sqlite::Database db) {
  statements_.clear();
  db_ = std::move(db);  // the old connection closes with `db`
}

StatusOr<sqlite::Statement*> AlertStore::StatementLocked(std::string_view sql) {
  if (auto it = statements_.find(sql); it != statements_.end()) return &it->second;
  auto prepared = db_.Prepare(std::string(sql), /*persistent=*/true);
  if (!prepared.ok()) return prepared.status();
  return &statements_.emplace(sql, std::move(prepared).value()).first->second;
}

notify::Status AlertStore::ApplyLocked(const alerts::StateChanges& states) {
  if (states.empty()) return notify::Status::Ok();
  sqlite::Statement *put, *drop, *put_silence, *drop_silence, *put_level, *drop_level, *put_progress, *drop_progress,
      *put_history;
  const std::pair<sqlite::Statement**, const char*> all[] = {
      {&put,
       "INSERT OR REPLACE INTO alert_instances (fingerprint, run, rule, alert, held_since_step, clearing, "
       "clearing_since_step, notified, ack) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"},
      {&drop, "DELETE FROM alert_instances WHERE fingerprint = ?"},
      {&put_silence,
       "INSERT OR REPLACE INTO silences (id, matchers, starts_at, ends_at, comment, created_by) "
       "VALUES (?, ?, ?, ?, ?, ?)"},
      {&drop_silence, "DELETE FROM silences WHERE id = ?"},
      {&put_level,
       "INSERT OR REPLACE INTO alert_levels (fingerprint, run, rule, reports, report_count, since_mark, "
       "all_since_mark) VALUES (?, ?, ?, ?, ?, ?, ?)"},
      {&drop_level, "DELETE FROM alert_levels WHERE fingerprint = ?"},
      {&put_progress, "INSERT OR REPLACE INTO alert_progress (run, evaluated_step) VALUES (?, ?)"},
      {&drop_progress, "DELETE FROM alert_progress WHERE run = ?"},
      {&put_history, "INSERT INTO alert_history (run, fingerprint, from_state, at, alert) VALUES (?, ?, ?, ?, ?)"},
  };
  for (const auto& [statement, sql] : all) {
    auto prepared = StatementLocked(sql);
    if (!prepared.ok()) return OutboxError(prepared.status());
    *statement = prepared.value();
  }
  for (const auto& [fp, inst] : states.instances) {
    // Bound text is not copied: it is declared before the Query that reads it.
    const std::string fingerprint = Hex(fp);
    const std::string alert = inst ? notify::AlertToJson(inst->alert) : "";
    const std::string ack = inst && inst->ack ? AckToJson(*inst->ack) : "";
    sqlite::Query q(inst ? *put : *drop);
    q.Bind(1, fingerprint);
    if (inst) {
      q.Bind(2, inst->run);
      q.Bind(3, inst->rule);
      q.Bind(4, alert);
      q.Bind(5, inst->held_since_step);
      q.Bind(6, inst->clearing);
      q.Bind(7, inst->clearing_since_step);
      q.Bind(8, inst->notified);
      if (inst->ack) {
        q.Bind(9, ack);
      } else {
        q.BindNull(9);
      }
    }
    if (Status s = q.Run("saving alert " + fingerprint); !s.ok()) return OutboxError(s);
  }
  for (const auto& [id, silence] : states.silences) {
    const std::string matchers = silence ? Dump(MatchersJson(silence->matchers)) : "";
    sqlite::Query q(silence ? *put_silence : *drop_silence);
    q.Bind(1, id);
    if (silence) {
      q.Bind(2, matchers);
      q.Bind(3, silence->starts_at);
      q.Bind(4, silence->ends_at);
      q.Bind(5, silence->comment);
      q.Bind(6, silence->created_by);
    }
    if (Status s = q.Run("saving silence " + id); !s.ok()) return OutboxError(s);
  }
  for (const auto& [fp, level] : states.levels) {
    const std::string fingerprint = Hex(fp);
    const std::vector<double> reports = level ? ReportsBlob(level->window) : std::vector<double>();
    sqlite::Query q(level ? *put_level : *drop_level);
    q.Bind(1, fingerprint);
    if (level) {
      q.Bind(2, level->run);
      q.Bind(3, level->rule);
      q.BindBlob(4, reports.data(), reports.size() * sizeof(double));
      q.Bind(5, level->window.count);
      q.Bind(6, level->since_mark);
      q.Bind(7, level->all_since_mark);
    }
    if (Status s = q.Run("saving the reports of alert " + fingerprint); !s.ok()) return OutboxError(s);
  }
  for (const auto& [run, step] : states.evaluated) {
    sqlite::Query q(step ? *put_progress : *drop_progress);
    q.Bind(1, run);
    if (step) q.Bind(2, *step);
    if (Status s = q.Run("saving the evaluated step of run " + run); !s.ok()) return OutboxError(s);
  }
  for (const alerts::HistoryEntry& e : states.history) {
    auto label = e.alert.labels.find("run");
    const std::string run = label == e.alert.labels.end() ? "" : label->second;
    const std::string fingerprint = alerts::FingerprintHex(e.alert.labels);
    const std::string alert = notify::AlertToJson(e.alert);
    sqlite::Query q(*put_history);
    q.Bind(1, run);
    q.Bind(2, fingerprint);
    q.Bind(3, static_cast<int>(e.from));
    q.Bind(4, e.at);
    q.Bind(5, alert);
    if (Status s = q.Run("saving the history of alert " + fingerprint); !s.ok()) return OutboxError(s);
  }
  return notify::Status::Ok();
}

notify::Result<std::vector<alerts::HistoryEntry>> AlertStore::History(std::string_view run, size_t limit) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto select = StatementLocked(
      "SELECT from_state, at, alert FROM (SELECT id, from_state, at, alert FROM alert_history "
      "WHERE ifnull(?1, '') = '' OR run = ?1 ORDER BY id DESC LIMIT ?2) ORDER BY id");
  if (!select.ok()) return OutboxError(select.status());
  sqlite::Query q(**select);
  q.Bind(1, run);
  q.Bind(2, static_cast<int64_t>(std::min<size_t>(limit, INT64_MAX)));
  std::vector<alerts::HistoryEntry> out;
  Status status;
  while (q.Next(&status, "reading the alert history")) {
    auto alert = notify::AlertFromJson(q.Text(2));
    if (!alert.ok()) {
      spdlog::error("alert store: an entry of the alert history cannot be read, it is skipped: {}",
                    alert.status().message());
      continue;
    }
    const int from = q.Int(0);
    out.push_back({std::move(alert).value(),
                   from >= 0 && from <= static_cast<int>(alerts::AlertState::kResolved)
                       ? static_cast<alerts::AlertState>(from)
                       : alerts::AlertState::kInactive,
                   q.Real(1)});
  }
  if (!status.ok()) return OutboxError(status);
  return out;
}

notify::Result<uint64_t> AlertStore::PruneHistory(double before, size_t max_rows) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto prune = StatementLocked(
      "DELETE FROM alert_history WHERE id IN (SELECT id FROM alert_history WHERE at < ? ORDER BY id LIMIT ?)");
  if (!prune.ok()) return OutboxError(prune.status());
  sqlite::Query q(**prune);
  q.Bind(1, before);
  q.Bind(2, static_cast<int64_t>(std::min<size_t>(max_rows, INT64_MAX)));
  if (Status s = q.Run("pruning the alert history"); !s.ok()) return OutboxError(s);
  return static_cast<uint64_t>(db_.changes());
}

notify::Result<alerts::SavedState> AlertStore::LoadState() {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  alerts::SavedState saved;
  Status status;
  auto instances = db_.Prepare(
      "SELECT fingerprint, run, rule, alert, held_since_step, clearing, clearing_since_step, notified, ack "
      "FROM alert_instances ORDER BY fingerprint");
  if (!instances.ok()) return OutboxError(instances.status());
  for (sqlite::Query q(*instances); q.Next(&status, "reading alert states");) {
    const std::string fingerprint = q.Text(0);
    auto alert = notify::AlertFromJson(q.Text(3));
    if (!alert.ok()) {
      spdlog::error("alert store: alert {} cannot be read, it is not restored: {}", fingerprint,
                    alert.status().message());
      continue;
    }
    alerts::InstanceState inst;
    inst.run = q.Text(1);
    inst.rule = q.Text(2);
    inst.alert = std::move(alert).value();
    inst.held_since_step = q.Unsigned(4);
    inst.clearing = q.Int(5) != 0;
    inst.clearing_since_step = q.Unsigned(6);
    inst.notified = q.Int(7) != 0;
    if (!q.IsNull(8)) {
      try {
        inst.ack = AckFromJson(q.Text(8));
      } catch (const nlohmann::json::exception& e) {
        spdlog::error("alert store: the acknowledgement of alert {} cannot be read, it is dropped: {}", fingerprint,
                      e.what());
      }
    }
    saved.instances.push_back(std::move(inst));
  }
  if (!status.ok()) return OutboxError(status);

  auto silences = db_.Prepare("SELECT id, matchers, starts_at, ends_at, comment, created_by FROM silences ORDER BY id");
  if (!silences.ok()) return OutboxError(silences.status());
  for (sqlite::Query q(*silences); q.Next(&status, "reading silences");) {
    alerts::Silence silence;
    silence.id = q.Text(0);
    auto matchers = ParseMatchers(q.Text(1));
    if (!matchers.ok()) {
      spdlog::error("alert store: silence {} cannot be read, it is not restored: {}", silence.id,
                    matchers.status().message());
      continue;
    }
    silence.matchers = std::move(*matchers);
    silence.starts_at = q.Real(2);
    silence.ends_at = q.Real(3);
    silence.comment = q.Text(4);
    silence.created_by = q.Text(5);
    saved.silences.push_back(std::move(silence));
  }
  if (!status.ok()) return OutboxError(status);

  auto levels = db_.Prepare(
      "SELECT fingerprint, run, rule, reports, report_count, since_mark, all_since_mark FROM alert_levels "
      "ORDER BY fingerprint");
  if (!levels.ok()) return OutboxError(levels.status());
  for (sqlite::Query q(*levels); q.Next(&status, "reading alert levels");) {
    const std::string fingerprint = q.Text(0);
    const std::optional<uint64_t> fp = ParseHex(fingerprint);
    alerts::LevelState level;
    level.run = q.Text(1);
    level.rule = q.Text(2);
    const std::string_view blob = q.Blob(3);
    if (!fp || q.IsNull(3) || !ReportsFromBlob(blob.data(), blob.size(), &level.window)) {
      spdlog::error("alert store: the reports of alert {} cannot be read; its level starts afresh", fingerprint);
      continue;
    }
    level.window.count = q.Unsigned(4);
    level.since_mark = q.Unsigned(5);
    level.all_since_mark = q.Int(6) != 0;
    saved.levels[*fp] = std::move(level);
  }
  if (!status.ok()) return OutboxError(status);

  auto progress = db_.Prepare("SELECT run, evaluated_step FROM alert_progress");
  if (!progress.ok()) return OutboxError(progress.status());
  for (sqlite::Query q(*progress); q.Next(&status, "reading alert progress");) {
    saved.evaluated[q.Text(0)] = q.Unsigned(1);
  }
  if (!status.ok()) return OutboxError(status);
  return saved;
}

notify::Result<std::vector<uint64_t>> AlertStore::Write(std::vector<notify::OutboxEntry> entries,
                                                        const alerts::StateChanges& states) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  const bool fsync = HoldsUserChanges(states);
  if (fsync) {
    if (Status s = db_.Exec("PRAGMA synchronous=FULL"); !s.ok()) return OutboxError(s);
  }
  auto written = WriteLocked(std::move(entries), states);
  if (fsync) {
    if (Status s = db_.Exec("PRAGMA synchronous=NORMAL"); !s.ok()) {
      spdlog::error("outbox: restoring synchronous=NORMAL: {}", s.message());
    }
  }
  return written;
}

notify::Result<std::vector<uint64_t>> AlertStore::WriteLocked(std::vector<notify::OutboxEntry> entries,
                                                              const alerts::StateChanges& states) {
  sqlite::Transaction txn(db_, "outbox");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) return notify::NotifyError(s.message());
  auto insert = StatementLocked(
      "INSERT INTO outbox (receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at) "
      "VALUES (?, ?, ?, ?, ?, ?, ?)");
  if (!insert.ok()) return OutboxError(insert.status());
  std::vector<uint64_t> ids;
  for (const notify::OutboxEntry& e : entries) {
    sqlite::Query q(**insert);
    q.Bind(1, e.receiver);
    q.Bind(2, e.fingerprint);
    q.Bind(3, static_cast<int>(e.state));
    q.Bind(4, e.payload);
    q.Bind(5, e.created_at);
    q.Bind(6, e.attempts);
    q.Bind(7, e.next_attempt_at);
    if (Status s = q.Run("inserting an entry"); !s.ok()) return OutboxError(s);
    ids.push_back(static_cast<uint64_t>(db_.last_insert_rowid()));
  }
  if (auto s = ApplyLocked(states); !s.ok()) return s;
  if (Status s = txn.Commit(); !s.ok()) return notify::NotifyError(s.message());
  return ids;
}

notify::Result<std::vector<notify::OutboxEntry>> AlertStore::Pending(std::string_view receiver, size_t limit,
                                                                     double now) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  // Due entries first; an entry waits (is left out) while an older one of its fingerprint is not due.
  auto pending = StatementLocked(
      "SELECT id, receiver, fingerprint, state, payload, created_at, attempts, next_attempt_at FROM outbox o "
      "WHERE receiver = ?1 AND delivery = 0 AND NOT EXISTS (SELECT 1 FROM outbox p WHERE p.receiver = ?1 "
      "AND p.delivery = 0 AND p.fingerprint = o.fingerprint AND p.id < o.id AND p.next_attempt_at > ?3) "
      "ORDER BY next_attempt_at > ?3, id LIMIT ?2");
  if (!pending.ok()) return OutboxError(pending.status());
  sqlite::Query q(**pending);
  q.Bind(1, receiver);
  q.Bind(2, limit);
  q.Bind(3, now);
  std::vector<notify::OutboxEntry> out;
  Status status;
  while (q.Next(&status, "reading pending entries")) {
    notify::OutboxEntry e;
    e.id = q.Unsigned(0);
    e.receiver = q.Text(1);
    e.fingerprint = q.Text(2);
    e.state = static_cast<alerts::AlertState>(q.Int(3));
    e.payload = q.Text(4);
    e.created_at = q.Real(5);
    e.attempts = static_cast<uint32_t>(q.Int(6));
    e.next_attempt_at = q.Real(7);
    out.push_back(std::move(e));
  }
  if (!status.ok()) return OutboxError(status);
  return out;
}

notify::Result<uint64_t> AlertStore::PendingCount(std::string_view receiver) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto count = StatementLocked("SELECT count(*) FROM outbox WHERE receiver = ? AND delivery = 0");
  if (!count.ok()) return OutboxError(count.status());
  sqlite::Query q(**count);
  q.Bind(1, receiver);
  Status status;
  if (!q.Next(&status, "counting pending entries")) {
    return OutboxError(status.ok() ? Status::Internal("counting pending entries: no row") : status);
  }
  return q.Unsigned(0);
}

notify::Status AlertStore::SetState(uint64_t id, int state, std::string_view error) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto update = StatementLocked("UPDATE outbox SET delivery = ?, error = ? WHERE id = ?");
  if (!update.ok()) return OutboxError(update.status());
  sqlite::Query q(**update);
  q.Bind(1, state);
  q.Bind(2, error);
  q.Bind(3, id);
  if (Status s = q.Run("updating entry " + std::to_string(id)); !s.ok()) return OutboxError(s);
  return notify::Status::Ok();
}

notify::Result<uint64_t> AlertStore::PruneDone(double created_before, size_t max_rows) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto prune = db_.Prepare(
      "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE delivery IN (?, ?) AND created_at < ? "
      "ORDER BY id LIMIT ?)");
  if (!prune.ok()) return OutboxError(prune.status());
  sqlite::Query q(*prune);
  q.Bind(1, kDelivered);
  q.Bind(2, kFailed);
  q.Bind(3, created_before);
  q.Bind(4, static_cast<int64_t>(std::min<size_t>(max_rows, INT64_MAX)));
  if (Status s = q.Run("pruning delivered entries"); !s.ok()) return OutboxError(s);
  return static_cast<uint64_t>(db_.changes());
}

notify::Status AlertStore::MarkDelivered(uint64_t id) { return SetState(id, kDelivered, ""); }

notify::Status AlertStore::MarkFailed(uint64_t id, std::string_view error) { return SetState(id, kFailed, error); }

notify::Status AlertStore::MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) {
  MutexLock lock(&mu_);
  if (auto s = FollowFileLocked(); !s.ok()) return s;
  auto update = StatementLocked("UPDATE outbox SET attempts = ?, next_attempt_at = ?, error = ? WHERE id = ?");
  if (!update.ok()) return OutboxError(update.status());
  sqlite::Query q(**update);
  q.Bind(1, attempts);
  q.Bind(2, next_attempt_at);
  q.Bind(3, error);
  q.Bind(4, id);
  if (Status s = q.Run("updating entry " + std::to_string(id)); !s.ok()) return OutboxError(s);
  return notify::Status::Ok();
}

}  // namespace gradwatch::store

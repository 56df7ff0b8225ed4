// Reading the journal back: every run at start (Load), one run that comes back (LoadRun), a run's
// steps for a rebuild (LoadRunSteps), the runs only the journal holds (ListReleased), and which runs
// are held.
#include "server/store/journal_internal.h"

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
    if (Status s = journal_internal::ParseLabels(rows.Text(2), meta.run_id, meta.labels); !s.ok()) return s;
    if (Status s = journal_internal::ParseConfig(rows.Text(3), meta.run_id, meta.config); !s.ok()) return s;
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
        if (idx < 0 || idx >= journal_internal::kMaxParamIndex) {
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
    return journal_internal::VisitSteps(blocks, steps, meta.run_id, from_step, std::numeric_limits<uint64_t>::max(),
                                        damage, [&](const CompletedStep& step) { visitor.OnStep(meta.run_id, step); });
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
  return journal_internal::VisitSteps(reader.blocks, reader.steps, run_id, 0, before_step, damage_, on_step);
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
  if (run_id == pruner_->pruning_run()) {
    // Half pruned: finish the job, and the caller starts the run afresh.
    while (!pruner_->pruning_run().empty()) {
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
    if (IsHeld(r.meta.run_id) || r.meta.run_id == pruner_->pruning_run()) continue;
    r.meta.world_size = static_cast<uint32_t>(rows.Int(1));
    if (!journal_internal::ParseLabels(rows.Text(2), r.meta.run_id, r.meta.labels).ok()) r.meta.labels.clear();
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

}  // namespace gradwatch::store

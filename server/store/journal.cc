// The journal's commit queue (journal.h; the other rooms are named in journal_internal.h): records
// queued without blocking, one writer thread that commits them in groups, its fault back-off and
// the progress it reports.
#include "server/store/journal_internal.h"

#include "server/core/thread_name.h"

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

// Back-off between attempts at a commit that failed (full disk, read-only or vanished files).
constexpr std::chrono::milliseconds kFirstRetryDelay{50};
constexpr std::chrono::milliseconds kMaxRetryDelay{2000};
constexpr auto kIdleFileCheck = std::chrono::seconds(1);

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

}  // namespace

Journal::Journal(JournalOptions options, CommitCallback on_commit, Connection connection)
    : options_(std::move(options)), on_commit_(std::move(on_commit)) {
  MutexLock db_lock(&db_mu_);
  db_ = std::move(connection.db);
  statements_ = std::move(connection.statements);
  sealer_ = std::make_unique<journal_internal::StepSealer>(options_.block_steps, damage_);
  pruner_ = std::make_unique<journal_internal::RunPruner>(options_.block_steps);
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

JournalStats Journal::stats() const {
  JournalStats out;
  out.storage_faults = storage_faults_.load(std::memory_order_relaxed);
  out.dropped_records = dropped_records_.load(std::memory_order_relaxed);
  out.files_lost = files_lost_.load(std::memory_order_relaxed);
  out.rebuilds = rebuilds_.load(std::memory_order_relaxed);
  out.pruned_runs = pruned_runs_.load(std::memory_order_relaxed);
  out.pruned_rows = pruned_rows_.load(std::memory_order_relaxed);
  MutexLock lock(&mu_);
  out.queue_depth = queue_.size();
  out.commits = commits_;
  out.failed_commits = failed_commits_;
  return out;
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
  journal_internal::Statements& st = *statements_;
  return std::visit(
      [&](const auto& r) -> Status {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, RunRecord>) {
          const std::string labels = journal_internal::LabelsJson(r.meta.labels);
          const std::string config = journal_internal::ConfigJson(r.meta.config);
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
            journal_internal::EncodeValues(r.step.values, st.scratch);
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
          if (Status s = sealer_->NoteStep(st, r.run_id, r.step.step); !s.ok()) return s;
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

void Journal::SealDue() {
  MutexLock db_lock(&db_mu_);
  if (!sealer_->any_due() || !db_.is_open() || !CheckFilesLocked().ok()) return;
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
    if (status.ok()) status = sealer_->SealDue(*statements_);
    if (status.ok()) status = txn.Commit();
  }
  if (!status.ok()) {
    // The rows stay as they are; the runs' counts are learnt again at their next step.
    spdlog::warn("journal '{}': sealing blocks failed, the step rows stay: {}", options_.path, status.ToString());
    sealer_->ForgetAll();
  }
  if (Status s = db_.Exec("PRAGMA synchronous=FULL"); !s.ok()) {
    spdlog::error("journal '{}': restoring synchronous=FULL: {}", options_.path, s.message());
  }
}

Status Journal::ApplyRewind(const RewindRecord& r) {
  journal_internal::Statements& st = *statements_;
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
  if (Status s = sealer_->SplitBlocks(st, r.run_id, r.from_step, branch); !s.ok()) return s;
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

}  // namespace gradwatch::store

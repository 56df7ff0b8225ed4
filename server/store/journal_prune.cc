// Pruning: the rows of runs that ended before the cutoff and are not held, a bounded batch at a
// time on the writer thread, and abandoned branches older than the cutoff.
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
  journal_internal::RunPruner::Batch batch;
  if (Status s = pruner_->PruneBatch(
          db_, *statements_, cutoff, max_rows, [this](const std::string& run_id) { return IsHeld(run_id); }, batch);
      !s.ok()) {
    return s;
  }
  pruned_rows_.fetch_add(batch.rows, std::memory_order_relaxed);
  if (!batch.pruned_run.empty()) {
    spdlog::info("journal: run {} pruned (ended before the retention cutoff)", batch.pruned_run);
    sealer_->Forget(batch.pruned_run);
    pruned_runs_.fetch_add(1, std::memory_order_relaxed);
  }
  if (batch.nothing_left) {
    MutexLock lock(&mu_);
    // Done until the cutoff moves; if it moved while this pass ran, the next pass uses it.
    if (prune_cutoff_ == cutoff) prune_due_ = false;
  }
  return Status::Ok();
}

namespace journal_internal {

Status RunPruner::PruneBatch(sqlite::Database& db, Statements& st, double cutoff, size_t max_rows,
                             const std::function<bool(const std::string&)>& is_held, Batch& out) {
  out = {};
  sqlite::Transaction txn(db, "journal");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) return s;
  if (pruning_run_.empty()) {
    // Abandoned branches (of any run) rewound before the cutoff go first.
    uint64_t deleted = 0;
    for (sqlite::Statement* del : {&st.prune_old_branch_steps, &st.prune_old_branch_events}) {
      sqlite::Query use(*del);
      use.Bind(1, cutoff);
      use.Bind(2, static_cast<int64_t>(std::min<size_t>(max_rows - deleted, INT64_MAX)));
      if (Status s = use.Run("journal: pruning abandoned branches"); !s.ok()) return s;
      deleted += static_cast<uint64_t>(db.changes());
      if (deleted >= max_rows) break;
    }
    if (deleted > 0) {
      if (Status s = txn.Commit(); !s.ok()) return s;
      out.rows = deleted;
      return Status::Ok();  // the next round goes on
    }
    Status status;
    sqlite::Query rows(st.prune_candidates);
    rows.Bind(1, cutoff);
    while (rows.Next(&status, "journal: finding runs to prune")) {
      std::string id = rows.Text(0);
      if (!is_held(id)) {
        pruning_run_ = std::move(id);
        break;
      }
    }
    if (!status.ok()) return status;
    if (pruning_run_.empty()) {
      out.nothing_left = true;
      return Status::Ok();
    }
  }
  // A run's rows go table by table, at most max_rows per transaction; its runs row goes last.
  uint64_t deleted = 0;
  {
    // A block counts as block_steps rows; at least one goes per transaction.
    sqlite::Query use(st.prune_blocks);
    use.Bind(1, pruning_run_);
    const auto limit = static_cast<int64_t>(std::max<size_t>(std::min<size_t>(max_rows / block_rows_, INT64_MAX), 1));
    use.Bind(2, limit);
    if (Status s = use.Run("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    const auto changes = static_cast<uint64_t>(db.changes());
    deleted += changes * block_rows_;
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
    deleted += static_cast<uint64_t>(db.changes());
  }
  bool run_done = false;
  if (deleted < max_rows) {
    sqlite::Query use(st.prune_run);
    use.Bind(1, pruning_run_);
    if (Status s = use.Run("journal: pruning run '" + pruning_run_ + "'"); !s.ok()) return s;
    deleted += static_cast<uint64_t>(db.changes());
    run_done = true;
  }
  if (Status s = txn.Commit(); !s.ok()) return s;
  out.rows = deleted;
  if (run_done) out.pruned_run = std::exchange(pruning_run_, {});
  return Status::Ok();
}

}  // namespace journal_internal

}  // namespace gradwatch::store

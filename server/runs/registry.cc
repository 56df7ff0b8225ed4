#include "server/runs/registry.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <new>
#include <set>

#include <spdlog/spdlog.h>

#include "server/runs/run_restore.h"

namespace gradwatch::runs {

// Builds runs from what the journal hands out (start-up, or one run coming back). A run it cannot
// hold (its catalog beyond the memory budget, an allocation failing while it is rebuilt, or rows
// the journal cannot read) is skipped, with an error logged and counted: the daemon starts without it rather than not
// at all.
class RunRegistry::Loader final : public store::JournalVisitor {
 public:
  Loader(const RunRegistry& registry, bool skip_archived) : registry_(registry), skip_archived_(skip_archived) {}

  bool OnRun(const RunMeta& meta, const RunEnd& end) override {
    const double retention = std::chrono::duration<double>(registry_.options_.retention).count();
    if (skip_archived_ && end.ended() && registry_.clock_->UnixSeconds() - end.ended_at >= retention) {
      ++archived;
      return false;
    }
    const uint64_t bytes =
        MemoryBudget::CatalogBytes(meta.params) + MemoryBudget::WorldBytes(meta, registry_.options_.max_pending_steps);
    MemoryBudget* budget = registry_.options_.budget;
    if (budget != nullptr && !budget->TryCharge(bytes)) {
      Skip(meta.run_id, "its catalog of " + std::to_string(meta.params.size()) + " parameters and world of " +
                            std::to_string(meta.world_size) + " ranks need about " + std::to_string(bytes) +
                            " bytes, beyond the memory budget (limits.memory_budget_bytes " +
                            std::to_string(budget->limit()) + ", " + std::to_string(budget->used()) + " in use)");
      return false;
    }
    try {
      auto run = std::make_shared<Run>(meta, registry_.options_, registry_.journal_, registry_.stats_, registry_.clock_,
                                       false);
      if (const auto forecasts = registry_.Forecasts()) run->SetForecasts(*forecasts);
      run->AdoptCharge(bytes);
      RunRestore(*run).Ended(end);
      runs[meta.run_id] = std::move(run);
    } catch (const std::bad_alloc&) {
      if (budget != nullptr) budget->Release(bytes);
      Skip(meta.run_id, "out of memory while creating it");
      return false;
    }
    return true;
  }
  void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) override {
    Guarded(run_id, [&](Run& run) { RunRestore(run).Series(id, key); });
  }
  void OnRankProgress(const store::RankProgress& progress) override {
    Guarded(progress.run_id, [&](Run& run) { RunRestore(run).Progress(progress); });
  }
  void OnStep(const std::string& run_id, const CompletedStep& step) override {
    Guarded(run_id, [&](Run& run) { RunRestore(run).Step(step); });
  }
  void OnEvent(const std::string& run_id, const EventRecord& event) override {
    Guarded(run_id, [&](Run& run) { RunRestore(run).Event(event); });
  }
  void OnRewind(const std::string& run_id, uint64_t from_step) override {
    Guarded(run_id, [&](Run& run) { RunRestore(run).Rewind(from_step); });
  }
  uint64_t OnStepsBegin(const std::string& run_id, uint64_t branch) override {
    uint64_t from_step = 0;
    Guarded(run_id, [&](Run& run) {
      RunRestore(run).Branch(branch);
      if (registry_.snapshots_ == nullptr) return;
      auto payload = registry_.snapshots_->Read(run_id);
      if (!payload.ok()) {
        if (payload.status().code() != StatusCode::kNotFound) {
          spdlog::warn("run {}: its snapshot is not used ({}); replaying its steps from the journal", run_id,
                       payload.status().message());
        }
        return;
      }
      std::string why;
      const auto mark = RunRestore(run).Snapshot(*payload, &why);
      if (!mark) {
        spdlog::warn("run {}: its snapshot is not used: {}; replaying its steps from the journal", run_id, why);
        return;
      }
      snapshot_marks[run_id] = *mark;
      from_step = mark->step + 1;
      if (registry_.stats_) registry_.stats_->runs_restored_from_snapshot.fetch_add(1, std::memory_order_relaxed);
    });
    return from_step;
  }
  void OnRunFailed(const std::string& run_id, const Status& why) override {
    runs.erase(run_id);
    snapshot_marks.erase(run_id);
    Skip(run_id, "its rows cannot be read (" + why.message() + ")");
  }

  // Maps every restored run's series (Run::FinishRestore), skipping one that runs out of memory.
  void Finish() {
    for (auto it = runs.begin(); it != runs.end();) {
      try {
        RunRestore(*it->second).Finish();
        ++it;
      } catch (const std::bad_alloc&) {
        const std::string id = it->first;
        it = runs.erase(it);
        Skip(id, "out of memory while mapping its series");
      }
    }
  }

  std::map<std::string, std::shared_ptr<Run>> runs;
  std::map<std::string, Run::SnapshotMark> snapshot_marks;  // runs restored from a snapshot
  size_t archived = 0;
  std::vector<std::string> skipped;

 private:
  template <typename F>
  void Guarded(const std::string& run_id, F&& restore) {
    auto it = runs.find(run_id);
    if (it == runs.end()) return;
    try {
      restore(*it->second);
    } catch (const std::bad_alloc&) {
      runs.erase(it);
      snapshot_marks.erase(run_id);
      Skip(run_id, "out of memory while rebuilding it");
    }
  }

  void Skip(const std::string& run_id, const std::string& why) {
    spdlog::error("run {}: not restored from the journal, {}; the journal keeps it, the daemon goes on without it",
                  run_id, why);
    skipped.push_back(run_id);
    if (registry_.stats_) registry_.stats_->runs_not_restored.fetch_add(1, std::memory_order_relaxed);
  }

  const RunRegistry& registry_;
  const bool skip_archived_;
};

RunRegistry::RunRegistry(const RunOptions& options, size_t max_runs, DaemonStats* stats, const Clock* clock)
    : options_(options), max_runs_(max_runs), stats_(stats), clock_(clock) {}

Status RunRegistry::Load() {
  if (journal_ == nullptr) return Status::FailedPrecondition("no journal to load from");
  // A journal salvaged at start (set aside as damaged) may hold fewer steps of a run than its
  // snapshot: no snapshot is used, and those of the runs it lost are their last record, kept
  // beside the damaged journal.
  const store::RecoveryReport& recovery = journal_->recovery();
  std::vector<std::string> set_aside;
  std::string aside_dir;
  if (snapshots_ != nullptr && recovery.moved_aside && !recovery.moved_files.empty()) {
    aside_dir = recovery.moved_files.front() + ".snapshots";
    set_aside = snapshots_->SetAsideAllBut({}, aside_dir);
  }
  Loader loader(*this, /*skip_archived=*/true);
  Status s = journal_->Load(loader);
  const std::set<std::string> known_lost(recovery.lost_run_ids.begin(), recovery.lost_run_ids.end());
  for (const std::string& id : set_aside) {
    if (loader.runs.count(id) != 0 || known_lost.count(id) != 0) continue;
    if (stats_ != nullptr) stats_->runs_lost_known_from_snapshots.fetch_add(1, std::memory_order_relaxed);
    spdlog::error("run {}: lost with the damaged journal (its snapshot names it); the snapshot is kept in {}", id,
                  aside_dir);
  }
  loader.Finish();
  if (loader.archived > 0) spdlog::info("{} ended runs stay archived in the journal", loader.archived);
  if (snapshots_ != nullptr) {
    if (!loader.snapshot_marks.empty()) {
      spdlog::info("{} of {} runs restored from their snapshots and the journal's steps after them",
                   loader.snapshot_marks.size(), loader.runs.size());
    }
    std::vector<std::string> held;
    for (const auto& [id, run] : loader.runs) held.push_back(id);
    if (const size_t removed = snapshots_->RemoveAllBut(held)) {
      spdlog::info("deleted {} snapshot(s) of runs no longer held", removed);
    }
  }
  {
    std::lock_guard lock(snapshot_mu_);
    for (const auto& [id, mark] : loader.snapshot_marks) {
      if (loader.runs.count(id)) snapshot_marks_[id] = mark;
    }
  }
  std::unique_lock lock(mu_);
  for (auto& [id, run] : loader.runs) runs_[id] = std::move(run);
  return s;
}

RunRegistry::SnapshotReport RunRegistry::SaveSnapshots(
    const std::function<bool(const std::string&, uint64_t)>& settle) {
  SnapshotReport report;
  if (snapshots_ == nullptr || journal_ == nullptr) return report;
  ByteChunks payload;  // unmapped at the end of the pass: the memory goes back to the system
  for (const auto& run : All()) {
    std::optional<Run::SnapshotMark> last;
    size_t expected_bytes = 0;
    {
      std::lock_guard lock(snapshot_mu_);
      if (auto it = snapshot_marks_.find(run->id()); it != snapshot_marks_.end()) last = it->second;
      if (auto it = snapshot_bytes_.find(run->id()); it != snapshot_bytes_.end()) expected_bytes = it->second;
    }
    // The chunks a snapshot is expected to fill are mapped, their pages faulted in, before the
    // run's lock is taken: copying the run's state into memory already mapped is what keeps the
    // lock short (fresh pages cost 2.8 ms per MB in this VM, faulted under the lock). The size of
    // its last snapshot, or for its first the bytes counted by a pass that writes nothing.
    double counting_seconds = 0;
    if (expected_bytes == 0) {
      const auto counting = std::chrono::steady_clock::now();
      expected_bytes = run->SnapshotBytes(last).value_or(0);
      counting_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - counting).count();
    }
    std::chrono::steady_clock::time_point started;
    std::optional<Run::SnapshotMark> mark;
    try {
      payload.Reserve(expected_bytes + expected_bytes / 8);
      started = std::chrono::steady_clock::now();
      mark = run->SaveSnapshot(payload, last);
    } catch (const std::bad_alloc&) {
      ++report.failed;
      if (stats_) stats_->snapshot_failures.fetch_add(1, std::memory_order_relaxed);
      spdlog::warn("run {}: snapshot not taken: out of memory for its {} bytes; a restart replays its journal further",
                   run->id(), expected_bytes);
      payload.Clear();
      continue;
    }
    report.max_lock_seconds =
        std::max({report.max_lock_seconds, counting_seconds,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()});
    if (!mark) {
      ++report.unchanged;
      continue;
    }
    // What the snapshot covers must be committed before it is kept: a snapshot ahead of the
    // journal would restore steps the trainers were never told are durable.
    Status s = journal_->Flush();
    if (s.ok() && settle && !settle(run->id(), mark->step)) {
      ++report.deferred;
      spdlog::debug("run {}: snapshot through step {} deferred: the alert states saved do not cover it yet", run->id(),
                    mark->step);
      continue;
    }
    if (s.ok()) s = snapshots_->Write(run->id(), payload);
    if (!s.ok()) {
      ++report.failed;
      if (stats_) stats_->snapshot_failures.fetch_add(1, std::memory_order_relaxed);
      spdlog::warn("run {}: snapshot through step {} not written: {}; a restart replays its journal further", run->id(),
                   mark->step, s.message());
      continue;
    }
    ++report.written;
    report.bytes += payload.size();
    if (stats_) {
      stats_->snapshots_written.fetch_add(1, std::memory_order_relaxed);
      stats_->snapshot_bytes_written.fetch_add(payload.size(), std::memory_order_relaxed);
    }
    std::lock_guard lock(snapshot_mu_);
    snapshot_marks_[run->id()] = *mark;
    snapshot_bytes_[run->id()] = payload.size();
  }
  return report;
}

std::shared_ptr<Run> RunRegistry::Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info,
                                         IngestError* error) {
  // A run dropped from memory between Find and its Attach is attached to no more: go again, and
  // the second time it is restored from the journal.
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<Run> run = AttachOnce(hello, rank, sink, info, error);
    if (!run || Find(hello.run_id) == run || attempt > 0) return run;
    run->Detach(rank, sink);
  }
}

std::shared_ptr<Run> RunRegistry::AttachOnce(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info,
                                             IngestError* error) {
  std::shared_ptr<Run> run = Find(hello.run_id);
  bool created = false;
  if (!run) {
    std::lock_guard admit(admit_mu_);
    run = Find(hello.run_id);
    if (!run) {
      if (!MakeRoom()) {
        *error = {IngestErrorReason::kLimitExceeded, "the daemon already holds " + std::to_string(max_runs_) +
                                                         " active runs (limits.max_runs); ended runs make room"};
        return nullptr;
      }
      if (journal_ != nullptr) {
        Loader loader(*this, /*skip_archived=*/false);
        const Status s = journal_->LoadRun(hello.run_id, loader);
        loader.Finish();
        if (s.ok() && loader.runs.count(hello.run_id)) {
          run = loader.runs[hello.run_id];
          if (auto mark = loader.snapshot_marks.find(hello.run_id); mark != loader.snapshot_marks.end()) {
            std::lock_guard lock(snapshot_mu_);
            snapshot_marks_[hello.run_id] = mark->second;
          }
          spdlog::info("run {}: restored from the journal", hello.run_id);
        } else if (!loader.skipped.empty()) {
          *error = {IngestErrorReason::kLimitExceeded,
                    "the daemon cannot hold this run's history within its memory budget (limits.memory_budget_bytes)"};
          journal_->Release(hello.run_id);
          return nullptr;
        } else if (!s.ok() && s.code() != StatusCode::kNotFound) {
          spdlog::error("run {}: cannot restore it from the journal: {}", hello.run_id, s.ToString());
          *error = {IngestErrorReason::kLimitExceeded, "the daemon cannot read this run back from its journal"};
          journal_->Release(hello.run_id);
          return nullptr;
        }
      }
      if (!run) {
        // Charged before anything of the run is allocated or journaled.
        const uint64_t bytes =
            MemoryBudget::CatalogBytes(hello.params) + MemoryBudget::WorldBytes(hello, options_.max_pending_steps);
        if (options_.budget != nullptr && !options_.budget->TryCharge(bytes)) {
          *error = {IngestErrorReason::kLimitExceeded,
                    "a catalog of " + std::to_string(hello.params.size()) + " parameters and a world of " +
                        std::to_string(hello.world_size) + " ranks need about " + std::to_string(bytes) +
                        " bytes, beyond the daemon's memory budget " + "(limits.memory_budget_bytes " +
                        std::to_string(options_.budget->limit()) + ", " + std::to_string(options_.budget->used()) +
                        " in use)"};
          return nullptr;
        }
        RunMeta meta = hello;
        meta.created_at = clock_->UnixSeconds();
        run = std::make_shared<Run>(std::move(meta), options_, journal_, stats_, clock_, true);
        if (const auto forecasts = Forecasts()) run->SetForecasts(*forecasts);
        run->AdoptCharge(bytes);
        created = true;
        spdlog::info("run {}: created (world size {}, {} parameters)", hello.run_id, hello.world_size,
                     hello.params.size());
      }
      std::unique_lock lock(mu_);
      runs_.emplace(hello.run_id, run);
    }
  }
  if (auto err = run->Attach(hello, rank, sink, info)) {
    *error = std::move(*err);
    return nullptr;
  }
  info->created = created;
  return run;
}

bool RunRegistry::MakeRoom() {
  std::string evicted;
  {
    std::unique_lock lock(mu_);
    if (runs_.size() < max_runs_) return true;
    double first_end = 0;
    for (const auto& [id, run] : runs_) {
      const double ended_at = run->IdleEndedAt();
      if (ended_at > 0 && (evicted.empty() || ended_at < first_end)) {
        evicted = id;
        first_end = ended_at;
      }
    }
    if (evicted.empty()) return false;
    runs_.erase(evicted);
  }
  spdlog::info("run {}: dropped from memory before its retention to make room (limits.max_runs)", evicted);
  Forget({evicted});
  return true;
}

void RunRegistry::Forget(const std::vector<std::string>& run_ids) {
  const double now = clock_->UnixSeconds();
  for (const std::string& id : run_ids) {
    if (snapshots_ != nullptr) snapshots_->Remove(id);
    {
      std::lock_guard lock(snapshot_mu_);
      snapshot_marks_.erase(id);
      snapshot_bytes_.erase(id);
    }
    if (journal_ != nullptr) journal_->Release(id);
    if (options_.listener != nullptr) options_.listener->OnRunLeftMemory(id, now);
    if (stats_) stats_->runs_evicted.fetch_add(1, std::memory_order_relaxed);
  }
}

std::shared_ptr<Run> RunRegistry::Find(const std::string& run_id) const {
  std::shared_lock lock(mu_);
  auto it = runs_.find(run_id);
  return it == runs_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Run>> RunRegistry::All() const {
  std::vector<std::shared_ptr<Run>> out;
  {
    std::shared_lock lock(mu_);
    out.reserve(runs_.size());
    for (const auto& [id, run] : runs_) out.push_back(run);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a->id() < b->id(); });
  return out;
}

StatusOr<std::vector<store::StoredRun>> RunRegistry::Archived() const {
  if (journal_ == nullptr) return std::vector<store::StoredRun>{};
  return journal_->ListReleased();
}

std::optional<uint64_t> RunRegistry::SnapshotStep(const std::string& run_id) const {
  std::lock_guard lock(snapshot_mu_);
  const auto it = snapshot_marks_.find(run_id);
  if (it == snapshot_marks_.end()) return std::nullopt;
  return it->second.step;
}

size_t RunRegistry::run_count() const {
  std::shared_lock lock(mu_);
  return runs_.size();
}

void RunRegistry::Tick() {
  for (const auto& run : All()) run->Tick();
  const double now = clock_->UnixSeconds();
  const double retention = std::chrono::duration<double>(options_.retention).count();
  auto expired_run = [&](const Run& run) {
    const double ended_at = run.IdleEndedAt();
    return ended_at > 0 && now - ended_at >= retention;
  };
  std::vector<std::string> expired;
  for (const auto& run : All()) {
    if (expired_run(*run)) expired.push_back(run->id());
  }
  if (expired.empty()) return;
  {
    std::unique_lock lock(mu_);
    std::erase_if(expired, [&](const std::string& id) {
      auto it = runs_.find(id);
      if (it == runs_.end() || !expired_run(*it->second)) return true;  // came back meanwhile
      runs_.erase(it);
      return false;
    });
  }
  for (const std::string& id : expired) spdlog::info("run {}: dropped from memory (retention over)", id);
  Forget(expired);
}

void RunRegistry::OnCommit(const store::CommitReport& report) {
  if (stats_) stats_->journal_commit_seconds.Observe(report.duration.count());
  for (const store::RankProgress& p : report.progress) {
    if (auto run = Find(p.run_id)) run->OnDurable(p);
  }
  for (const std::string& run_id : report.clean_ends) {
    if (auto run = Find(run_id)) run->OnCleanEndDurable();
  }
  std::shared_lock lock(mu_);
  for (const auto& [id, run] : runs_) run->OnCommitted(report.committed_through);
}

void RunRegistry::SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts) {
  // admit_mu_ keeps a run from being created with the old list and added after the walk below.
  std::lock_guard admit(admit_mu_);
  {
    std::lock_guard lock(forecasts_mu_);
    forecasts_ = forecasts;
  }
  for (const std::shared_ptr<Run>& run : All()) run->SetForecasts(forecasts);
}

std::optional<std::vector<std::pair<std::string, double>>> RunRegistry::Forecasts() const {
  std::lock_guard lock(forecasts_mu_);
  return forecasts_;
}

}  // namespace gradwatch::runs

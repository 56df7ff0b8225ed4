#include "server/runs/registry.h"

#include <algorithm>
#include <map>

#include <spdlog/spdlog.h>

namespace gradwatch::runs {

// Builds runs from what the journal hands out (start-up, or one run coming back).
class RunRegistry::Loader final : public store::JournalVisitor {
 public:
  Loader(const RunRegistry& registry, bool skip_archived) : registry_(registry), skip_archived_(skip_archived) {}

  bool OnRun(const RunMeta& meta, const RunEnd& end) override {
    const double retention = std::chrono::duration<double>(registry_.options_.retention).count();
    if (skip_archived_ && end.ended() && registry_.clock_->UnixSeconds() - end.ended_at >= retention) {
      ++archived;
      return false;
    }
    auto run = std::make_shared<Run>(meta, registry_.options_, registry_.journal_, registry_.stats_,
                                     registry_.clock_, false);
    run->RestoreEnded(end);
    runs[meta.run_id] = std::move(run);
    return true;
  }
  void OnSeries(const std::string& run_id, SeriesId id, const std::string& key) override {
    if (auto* run = Get(run_id)) run->RestoreSeries(id, key);
  }
  void OnRankProgress(const store::RankProgress& progress) override {
    if (auto* run = Get(progress.run_id)) run->RestoreProgress(progress);
  }
  void OnStep(const std::string& run_id, const CompletedStep& step) override {
    if (auto* run = Get(run_id)) run->RestoreStep(step);
  }
  void OnEvent(const std::string& run_id, const EventRecord& event) override {
    if (auto* run = Get(run_id)) run->RestoreEvent(event);
  }
  void OnRewind(const std::string& run_id, uint64_t from_step) override {
    if (auto* run = Get(run_id)) run->RestoreRewind(from_step);
  }

  std::map<std::string, std::shared_ptr<Run>> runs;
  size_t archived = 0;

 private:
  Run* Get(const std::string& run_id) {
    auto it = runs.find(run_id);
    return it == runs.end() ? nullptr : it->second.get();
  }

  const RunRegistry& registry_;
  const bool skip_archived_;
};

RunRegistry::RunRegistry(const RunOptions& options, size_t max_runs, DaemonStats* stats,
                         const Clock* clock)
    : options_(options), max_runs_(max_runs), stats_(stats), clock_(clock) {}

Status RunRegistry::Load() {
  if (journal_ == nullptr) return Status::FailedPrecondition("no journal to load from");
  Loader loader(*this, /*skip_archived=*/true);
  Status s = journal_->Load(loader);
  for (auto& [id, run] : loader.runs) run->FinishRestore();
  if (loader.archived > 0) spdlog::info("{} ended runs stay archived in the journal", loader.archived);
  std::unique_lock lock(mu_);
  for (auto& [id, run] : loader.runs) runs_[id] = std::move(run);
  return s;
}

std::shared_ptr<Run> RunRegistry::Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink,
                                         AttachInfo* info, IngestError* error) {
  // A run dropped from memory between Find and its Attach is attached to no more: go again, and
  // the second time it is restored from the journal.
  for (int attempt = 0;; ++attempt) {
    std::shared_ptr<Run> run = AttachOnce(hello, rank, sink, info, error);
    if (!run || Find(hello.run_id) == run || attempt > 0) return run;
    run->Detach(rank, sink);
  }
}

std::shared_ptr<Run> RunRegistry::AttachOnce(const RunMeta& hello, uint32_t rank, StreamSink* sink,
                                             AttachInfo* info, IngestError* error) {
  std::shared_ptr<Run> run = Find(hello.run_id);
  bool created = false;
  if (!run) {
    std::lock_guard admit(admit_mu_);
    run = Find(hello.run_id);
    if (!run) {
      if (!MakeRoom()) {
        *error = {IngestErrorReason::kLimitExceeded,
                  "the daemon already holds " + std::to_string(max_runs_) +
                      " active runs (limits.max_runs); ended runs make room"};
        return nullptr;
      }
      if (journal_ != nullptr) {
        Loader loader(*this, /*skip_archived=*/false);
        const Status s = journal_->LoadRun(hello.run_id, loader);
        if (s.ok() && loader.runs.count(hello.run_id)) {
          run = loader.runs[hello.run_id];
          run->FinishRestore();
          spdlog::info("run {}: restored from the journal", hello.run_id);
        } else if (!s.ok() && s.code() != StatusCode::kNotFound) {
          spdlog::error("run {}: cannot restore it from the journal: {}", hello.run_id, s.ToString());
          *error = {IngestErrorReason::kLimitExceeded, "the daemon cannot read this run back from its journal"};
          journal_->Release(hello.run_id);
          return nullptr;
        }
      }
      if (!run) {
        RunMeta meta = hello;
        meta.created_at = clock_->UnixSeconds();
        run = std::make_shared<Run>(std::move(meta), options_, journal_, stats_, clock_, true);
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
    if (journal_ != nullptr) journal_->Release(id);
    if (options_.alert_hook != nullptr) options_.alert_hook->OnRunLeftMemory(id, now);
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

}  // namespace gradwatch::runs

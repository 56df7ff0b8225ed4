#include "server/runs/registry.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace gradwatch::runs {

RunRegistry::RunRegistry(const RunOptions& options, size_t max_runs, DaemonStats* stats,
                         const Clock* clock)
    : options_(options), max_runs_(max_runs), stats_(stats), clock_(clock) {}

Status RunRegistry::Load() {
  if (journal_ == nullptr) return Status::FailedPrecondition("no journal to load from");
  Status s = journal_->Load(*this);
  for (const auto& run : All()) run->FinishRestore();
  return s;
}

std::shared_ptr<Run> RunRegistry::Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink,
                                         AttachInfo* info, IngestError* error) {
  std::shared_ptr<Run> run = Find(hello.run_id);
  bool created = false;
  if (!run) {
    std::unique_lock lock(mu_);
    auto it = runs_.find(hello.run_id);
    if (it != runs_.end()) {
      run = it->second;
    } else {
      if (runs_.size() >= max_runs_) {
        *error = {IngestErrorReason::kLimitExceeded,
                  "the daemon already holds " + std::to_string(max_runs_) + " runs (limits.max_runs)"};
        return nullptr;
      }
      RunMeta meta = hello;
      meta.created_at = clock_->UnixSeconds();
      run = std::make_shared<Run>(std::move(meta), options_, journal_, stats_, clock_, true);
      runs_.emplace(hello.run_id, run);
      created = true;
      spdlog::info("run {}: created (world size {}, {} parameters)", hello.run_id, hello.world_size,
                   hello.params.size());
    }
  }
  if (auto err = run->Attach(hello, rank, sink, info)) {
    *error = std::move(*err);
    return nullptr;
  }
  info->created = created;
  return run;
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

size_t RunRegistry::run_count() const {
  std::shared_lock lock(mu_);
  return runs_.size();
}

void RunRegistry::Tick() {
  for (const auto& run : All()) run->Tick();
}

void RunRegistry::OnCommit(const store::CommitReport& report) {
  if (stats_) stats_->journal_commit_seconds.Observe(report.duration.count());
  for (const store::RankProgress& p : report.progress) {
    if (auto run = Find(p.run_id)) run->OnDurable(p);
  }
  for (const std::string& run_id : report.clean_ends) {
    if (auto run = Find(run_id)) run->OnCleanEndDurable();
  }
}

void RunRegistry::OnRun(const RunMeta& meta, const RunEnd& end) {
  auto run = std::make_shared<Run>(meta, options_, journal_, stats_, clock_, false);
  run->RestoreEnded(end);
  std::unique_lock lock(mu_);
  runs_[meta.run_id] = std::move(run);
}

void RunRegistry::OnSeries(const std::string& run_id, SeriesId id, const std::string& key) {
  if (auto run = Find(run_id)) run->RestoreSeries(id, key);
}

void RunRegistry::OnRankProgress(const store::RankProgress& progress) {
  if (auto run = Find(progress.run_id)) run->RestoreProgress(progress);
}

void RunRegistry::OnStep(const std::string& run_id, const CompletedStep& step) {
  if (auto run = Find(run_id)) run->RestoreStep(step);
}

void RunRegistry::OnEvent(const std::string& run_id, const EventRecord& event) {
  if (auto run = Find(run_id)) run->RestoreEvent(event);
}

}  // namespace gradwatch::runs

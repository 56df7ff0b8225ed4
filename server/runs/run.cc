#include "server/runs/run.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <spdlog/spdlog.h>

#include "server/core/prefetch.h"
#include "server/runs/catalog_change.h"

namespace gradwatch::runs {

namespace {

// The run's learning-rate schedule from its config (analytics/projection.h); `why` says what of
// it was ignored.
analytics::LearningRateSchedule ScheduleOf(const RunConfig& config, std::string* why) {
  return analytics::LearningRateSchedule::FromConfig(config.warmup_steps, config.total_steps, config.extra, why);
}

constexpr size_t kTotalGrad = 0, kLoss = 1, kZLoss = 2, kLearningRate = 3, kTokens = 4;
const std::array<std::string_view, 5> kScalarKeys = {keys::kTotalGradNorm, keys::kLoss, keys::kZLoss,
                                                     keys::kLearningRate, keys::kTokens};

std::string FieldKey(NormField field, std::string_view param) {
  switch (field) {
    case NormField::kGrad: return keys::GradNorm(param);
    case NormField::kParam: return keys::ParamNorm(param);
    case NormField::kUpdate: return keys::UpdateNorm(param);
  }
  return {};
}

// A Hello's entry and the run's are one parameter: its weight decay, kind, role and group may
// differ (a resume applies them: runs/catalog_change.h).
bool SameCatalogEntry(const ParamInfo& a, const ParamInfo& b) { return a.name == b.name && a.numel == b.numel; }

// Calls the channel's Deliver as it goes out of scope: declared before a method's MutexLock, it
// does so after the lock is released.
class DeliverOnExit {
 public:
  explicit DeliverOnExit(const std::shared_ptr<RunChannel>& channel) : channel_(channel.get()) {}
  ~DeliverOnExit() {
    if (channel_ != nullptr) channel_->Deliver();
  }
  DeliverOnExit(const DeliverOnExit&) = delete;
  DeliverOnExit& operator=(const DeliverOnExit&) = delete;

 private:
  RunChannel* const channel_;
};

}  // namespace

Run::Run(RunMeta meta, const RunOptions& options, store::Journal* journal, DaemonStats* stats, const Clock* clock,
         bool journal_new)
    : id_(meta.run_id),
      options_(options),
      journal_(journal),
      stats_(stats),
      clock_(clock),
      channel_(options.listener != nullptr ? options.listener->Open(meta, !journal_new) : nullptr),
      assembler_(std::max<uint32_t>(1, meta.world_size), options.assembly_timeout, options.max_pending_steps),
      ranks_(std::max<uint32_t>(1, meta.world_size)),
      analytics_(
          std::make_unique<RunAnalytics>(options.analytics, AnalyticsCharging{options.budget, stats, meta.run_id})),
      forecasts_(options.analytics.forecasts),
      last_activity_(clock->Now()),
      last_step_seen_(clock->Now()) {
  // MemoryBudget::WorldBytes charges 320 bytes a rank for this and its assembler entry.
  static_assert(sizeof(RankState) <= 300, "MemoryBudget::WorldBytes' kBytesPerRank no longer covers a rank");
  std::vector<ParamInfo> params = std::move(meta.params);
  meta.params.clear();
  meta_ = std::move(meta);
  analytics_->SetDefaultWeightDecay(meta_.config.weight_decay);
  std::string schedule_problem;
  analytics_->SetSchedule(ScheduleOf(meta_.config, &schedule_problem));
  if (!schedule_problem.empty()) spdlog::warn("run {}: {}", id_, schedule_problem);
  if (journal_new) {
    JournalLocked(store::RunRecord{meta_});
    for (size_t i = 0; i < kScalarKeys.size(); ++i) {
      scalar_series_[i] = SeriesForKeyLocked(std::string(kScalarKeys[i]), true);
    }
    ExtendCatalogLocked(params, /*prepaid=*/true);
  } else {
    // Restored: series ids come from the journal (RestoreSeries), mapped in FinishRestore.
    meta_.params = std::move(params);
    analytics_->SetCatalog(meta_.params);
    scalar_series_.fill(kNoSeries);
  }
}

Run::~Run() {
  if (options_.budget != nullptr) options_.budget->Release(charged_bytes_);
}

namespace {

uint64_t EventBytes(const EventRecord& event) {
  return sizeof(EventRecord) + event.text.size() + event.source.size() + event.data.size();
}

}  // namespace

void Run::ChargeEventLocked(const EventRecord& event) {
  const uint64_t bytes = EventBytes(event);
  if (options_.budget != nullptr) options_.budget->Charge(bytes);
  charged_bytes_ += bytes;
}

void Run::ReleaseLocked(uint64_t bytes) {
  bytes = std::min(bytes, charged_bytes_);
  if (options_.budget != nullptr) options_.budget->Release(bytes);
  charged_bytes_ -= bytes;
}

std::optional<IngestError> Run::RechargeWorldLocked(uint32_t world_size) {
  const uint64_t before = MemoryBudget::RankBytes(meta_.world_size, options_.max_pending_steps);
  const uint64_t after = MemoryBudget::RankBytes(world_size, options_.max_pending_steps);
  if (after <= before) {
    ReleaseLocked(before - after);
    return std::nullopt;
  }
  if (options_.budget != nullptr && !options_.budget->TryCharge(after - before)) {
    return IngestError{IngestErrorReason::kLimitExceeded,
                       "resuming run " + id_ + " with a world of " + std::to_string(world_size) +
                           " ranks needs about " + std::to_string(after - before) +
                           " more bytes, beyond the daemon's memory budget (limits.memory_budget_bytes " +
                           std::to_string(options_.budget->limit()) + ", " + std::to_string(options_.budget->used()) +
                           " in use)"};
  }
  charged_bytes_ += after - before;
  return std::nullopt;
}

void Run::AdoptCharge(uint64_t bytes) {
  MutexLock lock(&mu_);
  charged_bytes_ += bytes;
}

uint64_t Run::ChargedBytes() const {
  MutexLock lock(&mu_);
  return charged_bytes_ + analytics_->charged_bytes();
}

void Run::FinishRestore() {
  MutexLock lock(&mu_);
  for (size_t i = 0; i < kScalarKeys.size(); ++i) {
    scalar_series_[i] = SeriesForKeyLocked(std::string(kScalarKeys[i]), true);
  }
  param_series_.clear();
  for (const ParamInfo& p : meta_.params) {
    std::array<SeriesId, kNormFields> ids{};
    for (int f = 0; f < kNormFields; ++f) {
      ids[f] = SeriesForKeyLocked(FieldKey(static_cast<NormField>(f), p.name), true);
    }
    param_series_.push_back(ids);
  }
  assembler_.SetParamCount(meta_.params.size());
  // Changes due at steps a snapshot covered (no step of theirs was replayed).
  if (has_first_step_) ApplyDueCatalogChangesLocked(last_step_, /*live=*/false);
}

uint64_t Run::JournalLocked(store::JournalRecord record) {
  if (journal_ == nullptr) return 0;
  const uint64_t number = journal_->Enqueue(std::move(record));
  if (number == 0) {
    if (stats_) stats_->journal_dropped_records.fetch_add(1, std::memory_order_relaxed);
    spdlog::error("run {}: journal queue full or stopped; a record was not journaled", id_);
  }
  return number;
}

std::optional<IngestError> Run::StorageRefusalLocked(uint32_t rank, uint64_t step) {
  RankState& rs = ranks_[rank];
  if (journal_ == nullptr || (!rs.storage_refused && journal_->accepting())) return std::nullopt;
  rs.storage_refused = true;
  return IngestError{IngestErrorReason::kStorageUnavailable,
                     "the daemon cannot commit to its journal now (storage fault or a full commit queue, "
                     "see its log); this message and later ones on this stream are not taken: keep them "
                     "and resend on a new stream",
                     step};
}

void Run::DropEventAcksLocked(StreamSink* sink) {
  std::erase_if(event_acks_, [sink](const PendingEventAck& a) { return a.sink == sink; });
}

SeriesId Run::SeriesForKeyLocked(const std::string& key, bool journal) {
  if (auto it = series_by_key_.find(std::string_view(key)); it != series_by_key_.end()) return *it;
  if (series_.size() >= options_.max_series) return kNoSeries;
  const auto id = static_cast<SeriesId>(series_.size());
  AddSeriesLocked(id, key);
  series_.push_back({key, std::make_unique<store::Series>(SeriesOptionsLocked(id, key))});
  series_by_key_.insert(id);
  if (journal) JournalLocked(store::SeriesRecord{id_, id, key});
  return id;
}

std::optional<IngestError> Run::ValidateCatalogLocked(const RunMeta& hello, bool world_may_change) const {
  if (!world_may_change && hello.world_size != meta_.world_size) {
    return IngestError{IngestErrorReason::kWorldSizeChanged,
                       "run " + id_ + " has world size " + std::to_string(meta_.world_size) +
                           "; a hello cannot change it to " + std::to_string(hello.world_size) +
                           (hello.resume_from_step ? " (the ranks of one resume must agree on it)"
                                                   : " (only a resume, with resume_from_step, can)")};
  }
  const size_t common = std::min(hello.params.size(), meta_.params.size());
  for (size_t i = 0; i < common; ++i) {
    if (!SameCatalogEntry(hello.params[i], meta_.params[i])) {
      return IngestError{IngestErrorReason::kCatalogMismatch,
                         "catalog entry " + std::to_string(i) + " is '" + hello.params[i].name + "' but the run has '" +
                             meta_.params[i].name + "' (name and numel must match; new entries may only be appended)"};
    }
  }
  for (size_t i = common; i < hello.params.size(); ++i) {
    if (series_by_key_.contains(std::string_view(keys::GradNorm(hello.params[i].name)))) {
      return IngestError{IngestErrorReason::kCatalogMismatch, "catalog entry " + std::to_string(i) + " '" +
                                                                  hello.params[i].name +
                                                                  "' names a parameter or series the run already has"};
    }
  }
  if (meta_.params.size() + (hello.params.size() - common) > options_.max_params) {
    return IngestError{IngestErrorReason::kLimitExceeded,
                       "catalog would exceed " + std::to_string(options_.max_params) + " parameters"};
  }
  return std::nullopt;
}

const store::SeriesOptions& Run::SeriesOptionsLocked(SeriesId id, std::string_view key) const {
  const int param = analytics_->ParamOf(id);
  if (param < 0 || static_cast<size_t>(param) >= meta_.params.size()) return options_.series;
  const ParamKind kind = meta_.params[static_cast<size_t>(param)].kind;
  if (kind == ParamKind::kOutput) return options_.series;
  if (kind == ParamKind::kNormGain && key.starts_with(keys::kParamNormPrefix)) return options_.series;
  return options_.param_series;
}

std::optional<IngestError> Run::ExtendCatalogLocked(const std::vector<ParamInfo>& params, bool prepaid) {
  const size_t first = meta_.params.size();
  if (params.size() <= first) return std::nullopt;
  if (series_.size() + (params.size() - first) * kNormFields > options_.max_series) {
    return IngestError{IngestErrorReason::kLimitExceeded,
                       "catalog would exceed " + std::to_string(options_.max_series) + " series"};
  }
  if (!prepaid && options_.budget != nullptr) {
    const uint64_t bytes = MemoryBudget::CatalogBytes(params, first);
    if (!options_.budget->TryCharge(bytes)) {
      return IngestError{
          IngestErrorReason::kLimitExceeded,
          "extending the catalog by " + std::to_string(params.size() - first) + " parameters needs about " +
              std::to_string(bytes) + " bytes, beyond the daemon's memory budget (limits.memory_budget_bytes " +
              std::to_string(options_.budget->limit()) + ", " + std::to_string(options_.budget->used()) + " in use)"};
    }
    charged_bytes_ += bytes;
  }
  store::ParamsRecord record{id_, static_cast<uint32_t>(first), {}};
  for (size_t i = first; i < params.size(); ++i) {
    meta_.params.push_back(params[i]);
    record.params.push_back(params[i]);
  }
  JournalLocked(std::move(record));
  analytics_->SetCatalog(meta_.params);
  // The new parameters' series, allocated once rather than by doubling.
  const size_t series_after = std::min(series_.size() + kNormFields * (params.size() - first), options_.max_series);
  series_.reserve(series_after);
  param_series_.reserve(params.size());
  analytics_->ReserveSeries(series_after);
  for (size_t i = first; i < params.size(); ++i) {
    std::array<SeriesId, kNormFields> ids{};
    for (int f = 0; f < kNormFields; ++f) {
      ids[f] = SeriesForKeyLocked(FieldKey(static_cast<NormField>(f), params[i].name), true);
    }
    param_series_.push_back(ids);
  }
  assembler_.SetParamCount(meta_.params.size());
  return std::nullopt;
}

std::optional<IngestError> Run::Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info) {
  std::optional<RebuildJob> job;
  {
    DeliverOnExit deliver(channel_);
    MutexLock lock(&mu_);
    const bool rewind = hello.resume_from_step && RewindsLocked(*hello.resume_from_step, rank);
    if (auto err = ValidateCatalogLocked(hello, rewind)) return err;
    if (rewind) {
      if (auto err = RechargeWorldLocked(hello.world_size)) return err;
    }
    if (auto err = ExtendCatalogLocked(hello.params, /*prepaid=*/false)) {
      if (rewind) {
        // The world keeps its size: give back what was charged for the new one, or take back
        // what was released.
        const uint64_t now = MemoryBudget::RankBytes(meta_.world_size, options_.max_pending_steps);
        const uint64_t asked = MemoryBudget::RankBytes(hello.world_size, options_.max_pending_steps);
        if (asked > now) {
          ReleaseLocked(asked - now);
        } else {
          if (options_.budget != nullptr) options_.budget->Charge(now - asked);
          charged_bytes_ += now - asked;
        }
      }
      return err;
    }
    if (rewind) job = RewindLocked(*hello.resume_from_step, hello.world_size);
    if (std::vector<ParamChange> diff = CatalogDiff(meta_.params, hello.params); !diff.empty()) {
      if (hello.resume_from_step) {
        // The resumed job's catalog rules from its resume point, as its steps do.
        EventRecord e = CatalogChangeEvent(*hello.resume_from_step, diff, meta_.params, clock_->UnixSeconds());
        JournalLocked(store::EventJournalRecord{id_, e});
        events_.insert(std::upper_bound(events_.begin(), events_.end(), e.step,
                                        [](uint64_t s, const EventRecord& x) { return s < x.step; }),
                       e);
        analytics_->OnEvent(e);
        if (job) job->events = events_;
        ScheduleCatalogChangeLocked(*hello.resume_from_step, std::move(diff));
      } else {
        spdlog::info(
            "run {} rank {}: the hello's catalog differs from the run's in {} entr{} (weight decay, kind, role or "
            "group); only a resume or a CatalogUpdate changes them",
            id_, rank, diff.size(), diff.size() == 1 ? "y" : "ies");
      }
    }
    AttachLocked(rank, sink, info);
  }
  if (job) RebuildAnalytics(std::move(*job));
  return std::nullopt;
}

void Run::AttachLocked(uint32_t rank, StreamSink* sink, AttachInfo* info) {
  RankState& rs = ranks_[rank];
  rs.storage_refused = false;
  if (rs.sink != sink) {
    if (rs.sink != nullptr) {
      spdlog::warn("run {} rank {}: a new stream takes over from the previous one", id_, rank);
      DropEventAcksLocked(rs.sink);
      rs.sink->Supersede();
    } else {
      ++open_streams_;
    }
    rs.sink = sink;
    rs.goodbye_waiting = false;
  }
  if (end_.ended()) {
    spdlog::info("run {}: active again ({} before)", id_, EndReasonName(end_.reason));
    end_ = {};
    end_durable_ = false;
    JournalLocked(store::RunEndedRecord{id_, 0, EndReason::kNone, {}});
  }
  last_activity_ = clock_->Now();
  info->has_durable_step = rs.has_durable;
  info->last_durable_step = rs.durable_step;
  info->has_received_step = rs.has_received;
  info->last_received_step = rs.last_received;
}

bool Run::RewindsLocked(uint64_t from_step, uint32_t rank) const {
  if (last_resume_step_ != from_step) return true;
  // The same resume point again: another rank of the same resume, unless this rank has already
  // reported on the new branch (then it crashed and resumed from the same checkpoint again).
  return rank < ranks_.size() && ranks_[rank].has_received && ranks_[rank].last_received >= from_step;
}

Run::RebuildJob Run::RewindLocked(uint64_t from_step, uint32_t world_size) {
  const double now = clock_->UnixSeconds();
  spdlog::info(
      "run {}: resumed from the checkpoint at step {} (world size {} → {}); the branch from there on "
      "is abandoned",
      id_, from_step, meta_.world_size, world_size);
  // Pending steps below the resume point complete as they are (nobody will report them again).
  assembler_.Rewind(from_step, world_size, [this](const PendingStep& p) {
    mu_.AssertHeld();  // called back synchronously, under this function's lock
    CompleteLocked(p);
  });

  ApplyPointsLocked();
  std::optional<uint64_t> last_kept;
  for (SeriesEntry& e : series_) {
    if (!e.data) continue;
    e.data->TruncateFrom(from_step);
    if (const auto p = e.data->Latest()) last_kept = std::max(last_kept.value_or(0), p->last_step);
  }
  const auto dropped = std::lower_bound(events_.begin(), events_.end(), from_step,
                                        [](const EventRecord& e, uint64_t s) { return e.step < s; });
  uint64_t dropped_bytes = 0;
  for (auto e = dropped; e != events_.end(); ++e) dropped_bytes += EventBytes(*e);
  ReleaseLocked(dropped_bytes);
  events_.erase(dropped, events_.end());
  UndoCatalogChangesFromLocked(from_step);

  // Ranks beyond an elastic job's new size belong to the old world.
  for (size_t r = world_size; r < ranks_.size(); ++r) {
    if (ranks_[r].sink != nullptr) {
      ranks_[r].sink->Supersede();
      --open_streams_;
    }
  }
  ranks_.resize(world_size);
  meta_.world_size = world_size;
  for (RankState& rs : ranks_) {
    if (rs.has_received && rs.last_received >= from_step) {
      rs.has_received = from_step > 0;
      rs.last_received = from_step > 0 ? from_step - 1 : 0;
      rs.has_last_report = false;
    }
    if (rs.has_durable && rs.durable_step >= from_step) {
      rs.has_durable = from_step > 0;
      rs.durable_step = from_step > 0 ? from_step - 1 : 0;
    }
  }

  // Counts restart; the rebuild adds those of the kept steps.
  step_count_ = partial_steps_ = nonfinite_count_ = client_dropped_steps_ = 0;
  has_first_step_ = false;
  last_step_ = last_kept.value_or(0);
  if (last_nonfinite_step_ >= from_step) last_nonfinite_step_ = 0;
  std::array<std::pair<double, uint64_t>, kSpeedWindow> kept_speed{};
  size_t kept = 0;
  for (size_t i = speed_count_ > kSpeedWindow ? speed_count_ - kSpeedWindow : 0; i < speed_count_; ++i) {
    const auto& entry = speed_ring_[i % kSpeedWindow];
    if (entry.second < from_step) kept_speed[kept++] = entry;
  }
  speed_ring_ = kept_speed;
  speed_count_ = kept;

  JournalLocked(store::RewindRecord{id_, from_step, world_size, now});
  if (channel_) channel_->OnRewind(from_step, now);
  RebuildJob job;
  EventRecord resumed{from_step, "resumed from the checkpoint at step " + std::to_string(from_step), "daemon", now};
  ChargeEventLocked(resumed);
  events_.push_back(resumed);
  JournalLocked(store::EventJournalRecord{id_, std::move(resumed)});
  last_activity_ = clock_->Now();

  last_resume_step_ = from_step;
  ++branch_;
  ++journal_branch_;
  rebuilding_ = true;
  deferred_.clear();
  job.from_step = from_step;
  job.branch = branch_;
  job.params = meta_.params;
  for (size_t id = 0; id < series_.size(); ++id) {
    if (series_[id].data) job.series.emplace_back(static_cast<SeriesId>(id), series_[id].key);
  }
  job.events = events_;
  job.remediations = analytics_->RemediationsBefore(from_step);
  std::string ignored;  // said at the run's creation
  job.schedule = ScheduleOf(meta_.config, &ignored);
  // Until the rebuild is installed, the analytics hold only the kept events.
  analytics_ = std::make_unique<RunAnalytics>(options_.analytics, AnalyticsCharging{options_.budget, stats_, id_});
  analytics_->SetCatalog(job.params);
  analytics_->SetDefaultWeightDecay(meta_.config.weight_decay);
  analytics_->SetSchedule(job.schedule);
  for (const auto& [id, key] : job.series) analytics_->AddSeries(id, key);
  for (const EventRecord& e : job.events) analytics_->OnEvent(e);
  analytics_->SetForecasts(forecasts_);
  analytics_->SetBranchStart(from_step);
  analytics_->AdoptRemediations(job.remediations);
  job.forecasts = forecasts_;
  job.default_weight_decay = meta_.config.weight_decay;
  return job;
}

void Run::RebuildAnalytics(RebuildJob job) {
  auto rebuilt = std::make_unique<RunAnalytics>(options_.analytics, AnalyticsCharging{options_.budget, stats_, id_});
  rebuilt->SetCatalog(job.params);
  rebuilt->SetDefaultWeightDecay(job.default_weight_decay);
  rebuilt->SetSchedule(job.schedule);
  for (const auto& [id, key] : job.series) rebuilt->AddSeries(id, key);
  for (const EventRecord& e : job.events) rebuilt->OnEvent(e);
  rebuilt->SetForecasts(job.forecasts);
  rebuilt->SetBranchStart(job.from_step);
  rebuilt->AdoptRemediations(std::move(job.remediations));
  StepTotals kept;
  if (journal_ != nullptr) {
    // The rewind record and every step completed before it must be committed to be read back.
    Status s = journal_->Flush();
    if (s.ok()) {
      s = journal_->LoadRunSteps(id_, job.from_step, [&](const CompletedStep& step) {
        rebuilt->OnStep(step);
        if (!kept.has_first) kept.first_step = step.step, kept.has_first = true;
        ++kept.count;
        kept.last_step = step.step;
        if (step.partial) ++kept.partial;
        kept.client_dropped += step.client_dropped_steps;
        for (const SeriesValue& sv : step.values) {
          if (!std::isfinite(sv.value)) ++kept.nonfinite, kept.last_nonfinite_step = step.step;
        }
      });
    }
    if (!s.ok()) {
      spdlog::error("run {}: reading the history kept at the rewind to step {}: {}; analytics miss it", id_,
                    job.from_step, s.ToString());
    }
  }

  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  if (branch_ != job.branch) return;  // a newer rewind rebuilds for itself
  analytics_ = std::move(rebuilt);
  rebuilding_ = false;
  step_count_ += kept.count;
  partial_steps_ += kept.partial;
  nonfinite_count_ += kept.nonfinite;
  client_dropped_steps_ += kept.client_dropped;
  last_nonfinite_step_ = std::max(last_nonfinite_step_, kept.last_nonfinite_step);
  if (kept.has_first) {
    first_step_ = kept.first_step;
    has_first_step_ = true;
  }
  for (const CompletedStep& step : deferred_) {
    // A late step below the resume point may have been committed in time to be read back.
    if (!kept.has_first || step.step > kept.last_step) AnalyzeLocked(step, /*restored=*/false);
  }
  spdlog::info("run {}: analytics rebuilt from {} kept steps below step {}, then {} that arrived meanwhile", id_,
               kept.count, job.from_step, deferred_.size());
  deferred_.clear();
}

void Run::Detach(uint32_t rank, StreamSink* sink) {
  MutexLock lock(&mu_);
  if (rank >= ranks_.size() || ranks_[rank].sink != sink) return;
  ranks_[rank].sink = nullptr;
  ranks_[rank].goodbye_waiting = false;
  DropEventAcksLocked(sink);
  --open_streams_;
  last_activity_ = clock_->Now();
}

bool Run::MustHoldLocked(uint32_t rank, uint64_t step) const {
  if (!assembler_.FullFor(step)) return false;
  const PendingStep& oldest = assembler_.oldest();
  for (uint32_t r = 0; r < ranks_.size(); ++r) {
    if (r == rank || (r < oldest.world && oldest.Seen(r))) continue;
    // Ranks report in step order: one that reported a later step will never report this one.
    const RankState& rs = ranks_[r];
    if (!rs.has_received || rs.last_received < oldest.step) return true;
  }
  return false;
}

std::optional<IngestError> Run::ValidateStepLocked(const RankStep& report) {
  const size_t n = meta_.params.size();
  seen_scratch_.assign(n, 0);
  for (const ParamContribution& pc : report.params) {
    if (pc.index >= n) {
      return IngestError{
          IngestErrorReason::kUnknownParam,
          "parameter index " + std::to_string(pc.index) + " is not in the catalog (" + std::to_string(n) + " entries)",
          report.step};
    }
    if (seen_scratch_[pc.index]) {
      return IngestError{IngestErrorReason::kInvalidMessage,
                         "parameter index " + std::to_string(pc.index) + " ('" + meta_.params[pc.index].name +
                             "') appears twice in one step",
                         report.step};
    }
    seen_scratch_[pc.index] = 1;
  }
  return std::nullopt;
}

std::optional<IngestError> Run::AddStep(uint32_t rank, const RankStep& report, StreamSink* sink, bool* held) {
  if (held != nullptr) *held = false;
  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  if (auto err = OutsideWorldLocked(rank, "report", report.step)) return err;
  if (auto err = StorageRefusalLocked(rank, report.step)) return err;
  RankState& rs = ranks_[rank];
  if (rs.has_received && report.step < rs.last_received) {
    return IngestError{IngestErrorReason::kStepRegression,
                       "step " + std::to_string(report.step) + " is older than step " +
                           std::to_string(rs.last_received) + " already received from rank " + std::to_string(rank),
                       report.step};
  }
  if (rs.has_received && report.step == rs.last_received) {
    if (rs.has_last_report && !rs.last_report.SameValues(report)) {
      return IngestError{IngestErrorReason::kStepConflict,
                         "step " + std::to_string(report.step) + " was already received from rank " +
                             std::to_string(rank) + " with different values",
                         report.step};
    }
    // An idempotent repeat: acknowledge if already durable, else the pending ack covers it.
    if (rs.has_durable && rs.durable_step >= report.step && sink != nullptr) {
      sink->SendAck(rs.durable_step, std::max(rs.durable_seq, report.seq));
    }
    return std::nullopt;
  }
  if (auto err = ValidateStepLocked(report)) return err;

  const SteadyTime now = clock_->Now();
  last_activity_ = now;
  if (held != nullptr && MustHoldLocked(rank, report.step)) {
    *held = true;
    return std::nullopt;
  }
  const AddResult result = assembler_.Add(rank, report, now, [this](const PendingStep& p) {
    mu_.AssertHeld();  // called back synchronously, under this function's lock
    CompleteLocked(p);
  });
  rs.has_received = true;
  rs.last_received = report.step;
  if (result == AddResult::kLate) {
    rs.has_last_report = false;
    return IngestError{IngestErrorReason::kLateForStep,
                       "step " + std::to_string(report.step) + " was already completed without rank " +
                           std::to_string(rank) +
                           " (assembly timeout or a later step completed first); this report is not stored",
                       report.step};
  }
  rs.last_report = report;
  rs.has_last_report = true;
  return std::nullopt;
}

void Run::CompleteLocked(const PendingStep& p) {
  CompletedStep& out = scratch_;
  out.step = p.step;
  out.wall_time = p.wall_time;
  out.partial = p.partial;
  out.ranks_reported = p.ranks_reported;
  out.client_dropped_steps = p.client_dropped_steps;
  out.values.clear();
  auto put = [this, &out](SeriesId id, double v) {
    mu_.AssertHeld();  // called only below, under the caller's lock
    if (id != kNoSeries) out.values.push_back({id, v});
  };
  const size_t n = std::min(param_series_.size(), p.param_sq.size() / kNormFields);
  // Square roots of long double sums of squares: finite norms stay finite (NormContribution).
  if (p.total_grad.present) {
    put(scalar_series_[kTotalGrad], static_cast<double>(std::sqrt(p.total_grad.sq)));
  } else {
    // The trainer did not send a total: derive it from the parameters' gradient norms.
    long double sq = 0;
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      if (p.param_present[i * kNormFields]) sq += p.param_sq[i * kNormFields], any = true;
    }
    if (any) put(scalar_series_[kTotalGrad], static_cast<double>(std::sqrt(sq)));
  }
  if (p.loss_n) put(scalar_series_[kLoss], p.loss_sum / p.loss_n);
  if (p.z_loss_n) put(scalar_series_[kZLoss], p.z_loss_sum / p.z_loss_n);
  if (p.lr_n) put(scalar_series_[kLearningRate], p.lr_sum / p.lr_n);
  if (p.tokens_present) put(scalar_series_[kTokens], static_cast<double>(p.tokens_sum));
  for (size_t i = 0; i < n; ++i) {
    for (int f = 0; f < kNormFields; ++f) {
      if (p.param_present[i * kNormFields + f]) {
        put(param_series_[i][f], static_cast<double>(std::sqrt(p.param_sq[i * kNormFields + f])));
      }
    }
  }
  if (p.radial_any) PutRadialLocked(p, out);
  for (size_t e = 0; e < p.extra_used; ++e) {
    put(SeriesForKeyLocked(p.extra[e].key, true), p.extra[e].sum / p.extra[e].n);
  }
  AppendLocked(out);
  last_step_seen_ = clock_->Now();
  if (stats_) stats_->samples_received.fetch_add(out.values.size(), std::memory_order_relaxed);
  if (!rebuilding_) {
    AnalyzeLocked(out, /*restored=*/false);
  } else if (deferred_.size() < options_.max_pending_steps) {
    deferred_.push_back(out);
  } else {
    spdlog::warn(
        "run {}: step {} completed while the analytics are rebuilt after a rewind and more than {} "
        "steps wait; it is stored but its analytics and alerts are skipped",
        id_, out.step, options_.max_pending_steps);
  }

  if (journal_ == nullptr) return;
  // Reuse a committed record's buffers: assignments below keep their capacity.
  store::StepJournalRecord record = journal_->AcquireStepRecord();
  record.run_id = id_;
  record.step.step = out.step;
  record.step.wall_time = out.wall_time;
  record.step.partial = out.partial;
  record.step.ranks_reported = out.ranks_reported;
  record.step.client_dropped_steps = out.client_dropped_steps;
  record.step.values.assign(out.values.begin(), out.values.end());
  record.progress.resize(p.contributors.size());
  for (size_t i = 0; i < p.contributors.size(); ++i) {
    store::RankProgress& rp = record.progress[i];
    rp.run_id = id_;
    rp.rank = p.contributors[i].first;
    rp.step = p.step;
    rp.seq = p.contributors[i].second;
    rp.branch = branch_;
  }
  JournalLocked(std::move(record));
}

void Run::PutRadialLocked(const PendingStep& p, CompletedStep& out) {
  const size_t n = std::min({p.radial.size(), meta_.params.size(), p.param_sq.size() / kNormFields});
  if (radial_series_.size() < n) radial_series_.resize(n, kNoSeries);
  for (size_t i = 0; i < n; ++i) {
    const PendingStep::Radial& r = p.radial[i];
    if (!r.present) continue;
    double value = r.radial;
    if (r.has_dot) {
      // Every rank that sent a dot sent its part of the norm (ingest/convert.h).
      const long double norm = std::sqrt(p.param_sq[i * kNormFields + static_cast<int>(NormField::kParam)]);
      value += static_cast<double>(r.dot / norm);
    }
    if (radial_series_[i] == kNoSeries)
      radial_series_[i] = SeriesForKeyLocked(keys::RadialUpdate(meta_.params[i].name), true);
    if (radial_series_[i] != kNoSeries) out.values.push_back({radial_series_[i], value});
  }
}

void Run::AnalyzeLocked(const CompletedStep& step, bool restored) {
  if (!catalog_pending_.empty() && catalog_pending_.front().step <= step.step) {
    ApplyDueCatalogChangesLocked(step.step, /*live=*/true);
  }
  analytics_->OnStep(step);
  if (!channel_) return;
  const RunActivity activity = ActivityLocked();
  channel_->OnStep(PublishedStep{.step = step,
                                 .meta = meta_,
                                 .param_series = param_series_,
                                 .analytics = *analytics_,
                                 .activity = activity,
                                 .now = clock_->UnixSeconds(),
                                 .restored = restored});
}

void Run::AddSeriesLocked(SeriesId id, const std::string& key) {
  analytics_->AddSeries(id, key);
  if (channel_) channel_->OnSeries(id, key);
}

void Run::AppendLocked(const CompletedStep& step) {
  // The points go to the series a slice at a time (ApplySliceLocked): this step's samples are
  // set aside in their series' slice, and one slice, in turn, is appended to its series.
  const uint32_t slot = unapplied_.Begin(step.step);
  for (const SeriesValue& sv : step.values) {
    if (!std::isfinite(sv.value)) {
      ++nonfinite_count_;
      last_nonfinite_step_ = step.step;
    }
    if (sv.id >= series_.size() || !series_[sv.id].data) continue;
    SeriesEntry& entry = series_[sv.id];
    if (!entry.reported) {
      // A series' first point takes its first buffers: appended at once, so that they are
      // charged to the budget before the analytics' trackers of this step are.
      AppendPointLocked(*entry.data, step.step, sv.value);
      entry.reported = true;
      continue;
    }
    unapplied_.Add(sv.id, slot, sv.value);
  }
  ApplySliceLocked(unapplied_.End());
  if (!has_first_step_) {
    first_step_ = step.step;
    has_first_step_ = true;
  }
  ++step_count_;
  last_step_ = step.step;
  if (step.wall_time > 0) last_wall_time_ = step.wall_time;
  if (step.partial) ++partial_steps_;
  client_dropped_steps_ += step.client_dropped_steps;
  const double t =
      step.wall_time > 0 ? step.wall_time : std::chrono::duration<double>(clock_->Now().time_since_epoch()).count();
  speed_ring_[speed_count_ % kSpeedWindow] = {t, step.step};
  ++speed_count_;
}

void Run::AppendPointLocked(store::Series& series, uint64_t step, double value) const {
  const size_t before = series.MemoryBytes();
  // Growth is reserved in the budget first; refused, the series downsamples sooner instead.
  const uint64_t reserved = options_.budget != nullptr ? series.NextGrowthBytes() : 0;
  const bool may_grow = reserved == 0 || options_.budget->TryCharge(reserved);
  series.Append(step, value, may_grow);
  if (options_.budget == nullptr) return;
  const uint64_t grown = series.MemoryBytes() - before;
  // What it took is charged at once: at most what was reserved, or (refused) a series' first
  // buffers, which are always allowed.
  if (reserved > 0 && may_grow) {
    options_.budget->Release(reserved - std::min(reserved, grown));
    if (grown > reserved) options_.budget->Charge(grown - reserved);
  } else if (grown > 0) {
    options_.budget->Charge(grown);
  }
  charged_bytes_ += grown;
}

void Run::ApplyPointsLocked() const {
  for (size_t slice = 0; slice < kSetAsideSlices; ++slice) ApplySliceLocked(slice);
}

void Run::ApplySliceLocked(size_t slice) const {
  // A large run's series (20,001 at 10,000 parameters) outgrow the caches, and each one's state
  // is a chain of pointers (its Series, coding state, ring of chunks, words): the state of the
  // series kPrefetchStride ahead is fetched a stage further each time, so that the misses of
  // several series overlap instead of stalling every series in turn.
  constexpr size_t kPrefetchStride = 3;
  unapplied_.Apply(
      slice, kPrefetchStride, 4,
      [&](uint32_t id, size_t stage) {
        mu_.AssertHeld();  // called only here, under the caller's lock
        const store::Series* s = series_[id].data.get();
        switch (stage) {
          case 4: PrefetchRead(s); break;
          case 3: s->PrefetchHeld(); break;
          case 2: s->PrefetchSlots(); break;
          default: s->PrefetchWords(); break;
        }
      },
      [&](uint32_t id, uint64_t step, double value) {
        mu_.AssertHeld();
        AppendPointLocked(*series_[id].data, step, value);
      });
}

std::optional<IngestError> Run::AddEvent(EventRecord event) {
  MutexLock lock(&mu_);
  if (auto err = EventRoomLocked(event)) return err;
  auto pos = std::upper_bound(events_.begin(), events_.end(), event.step,
                              [](uint64_t s, const EventRecord& e) { return s < e.step; });
  events_.insert(pos, event);
  ChargeEventLocked(event);
  analytics_->OnEvent(event);
  JournalLocked(store::EventJournalRecord{id_, std::move(event)});
  last_activity_ = clock_->Now();
  return std::nullopt;
}

std::optional<IngestError> Run::AddEvent(EventRecord event, uint32_t rank, uint64_t seq, StreamSink* sink) {
  MutexLock lock(&mu_);
  if (auto err = OutsideWorldLocked(rank, "event", event.step)) return err;
  if (auto err = StorageRefusalLocked(rank, event.step)) return err;
  if (auto err = EventRoomLocked(event)) return err;
  RecordEventLocked(event, rank, seq, sink);
  return std::nullopt;
}

bool Run::HoldsEventLocked(const EventRecord& event) const {
  const auto [first, last] =
      std::equal_range(events_.begin(), events_.end(), event,
                       [](const EventRecord& a, const EventRecord& b) { return a.step < b.step; });
  // A catalog change is the same change whatever its text (which tells the catalog before it).
  return std::any_of(first, last, [&event](const EventRecord& e) {
    return e.source == event.source &&
           (event.source == kCatalogEventSource ? e.data == event.data : e.text == event.text);
  });
}

std::optional<IngestError> Run::EventRoomLocked(const EventRecord& event) const {
  if (events_.size() < options_.max_events || HoldsEventLocked(event)) return std::nullopt;
  return IngestError{IngestErrorReason::kLimitExceeded,
                     "run " + id_ + " holds " + std::to_string(events_.size()) +
                         " events, the most it may (limits.max_events_per_run); this one is not stored",
                     event.step};
}

std::optional<IngestError> Run::OutsideWorldLocked(uint32_t rank, std::string_view what, uint64_t step) const {
  if (rank < ranks_.size()) return std::nullopt;
  return IngestError{IngestErrorReason::kSuperseded,
                     "rank " + std::to_string(rank) + " is not in the run's world of " + std::to_string(ranks_.size()) +
                         " since it resumed; this " + std::string(what) + " is not stored",
                     step};
}

bool Run::RecordEventLocked(const EventRecord& event, uint32_t rank, uint64_t seq, StreamSink* sink) {
  last_activity_ = clock_->Now();
  const bool held = HoldsEventLocked(event);
  uint64_t record = 0;
  if (held) {
    // A resend: what the run holds was enqueued at the latest by the last record so far.
    record = journal_ != nullptr ? journal_->last_enqueued() : 0;
  } else {
    record = JournalLocked(store::EventJournalRecord{id_, event});
    if (journal_ != nullptr && record == 0) return false;  // dropped and counted: never acked
    const auto after = std::upper_bound(events_.begin(), events_.end(), event.step,
                                        [](uint64_t s, const EventRecord& e) { return s < e.step; });
    events_.insert(after, event);
    ChargeEventLocked(event);
    analytics_->OnEvent(event);
  }
  if (journal_ == nullptr || (held && journal_->last_committed() >= record)) {
    if (sink != nullptr) sink->SendEventAck(seq, event.step);
    return !held;
  }
  event_acks_.push_back({record, rank, sink, seq, event.step});
  return !held;
}

std::optional<IngestError> Run::AddCatalogChange(uint64_t from_step, std::vector<ParamChange> changes, uint32_t rank,
                                                 uint64_t seq, StreamSink* sink) {
  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  if (auto err = OutsideWorldLocked(rank, "catalog change", from_step)) return err;
  if (auto why = CheckCatalogChange(changes, meta_.params)) {
    return IngestError{
        IngestErrorReason::kInvalidMessage,
        "catalog update from step " + std::to_string(from_step) + ": " + *why + "; nothing of it is applied",
        from_step};
  }
  if (auto err = StorageRefusalLocked(rank, from_step)) return err;
  const EventRecord event = CatalogChangeEvent(from_step, changes, meta_.params, clock_->UnixSeconds());
  if (auto err = EventRoomLocked(event)) return err;
  if (RecordEventLocked(event, rank, seq, sink)) ScheduleCatalogChangeLocked(from_step, std::move(changes));
  return std::nullopt;
}

void Run::ScheduleCatalogChangeLocked(uint64_t step, std::vector<ParamChange> change) {
  const auto pos = std::upper_bound(catalog_pending_.begin(), catalog_pending_.end(), step,
                                    [](uint64_t s, const CatalogChangeEntry& e) { return s < e.step; });
  catalog_pending_.insert(pos, CatalogChangeEntry{step, std::move(change), {}});
  if (has_first_step_ && step <= last_step_) ApplyDueCatalogChangesLocked(last_step_, /*live=*/true);
}

void Run::ApplyDueCatalogChangesLocked(uint64_t through_step, bool live) {
  size_t due = 0;
  while (due < catalog_pending_.size() && catalog_pending_[due].step <= through_step) {
    CatalogChangeEntry& e = catalog_pending_[due++];
    spdlog::info("run {}: {} (from step {})", id_, DescribeCatalogChange(e.change, meta_.params), e.step);
    e.undo = ApplyCatalogChange(e.change, meta_.params);
    ++meta_.catalog_changes;
    // A live change starts its remediation check from the analytics as they are now.
    analytics_->UpdateCatalog(meta_.params, live ? std::optional<uint64_t>(e.step) : std::nullopt);
    catalog_applied_.push_back(std::move(e));
  }
  catalog_pending_.erase(catalog_pending_.begin(), catalog_pending_.begin() + static_cast<std::ptrdiff_t>(due));
}

void Run::UndoCatalogChangesFromLocked(uint64_t from_step) {
  catalog_pending_.erase(std::lower_bound(catalog_pending_.begin(), catalog_pending_.end(), from_step,
                                          [](const CatalogChangeEntry& e, uint64_t s) { return e.step < s; }),
                         catalog_pending_.end());
  // Undone newest first down to the oldest applied change from from_step on; the earlier-step
  // changes applied after it are applied again.
  const auto first = std::find_if(catalog_applied_.begin(), catalog_applied_.end(),
                                  [&](const CatalogChangeEntry& e) { return e.step >= from_step; });
  if (first == catalog_applied_.end()) return;
  for (auto it = catalog_applied_.end(); it != first;) {
    --it;
    ApplyCatalogChange(it->undo, meta_.params);
  }
  std::vector<CatalogChangeEntry> again;
  for (auto it = first; it != catalog_applied_.end(); ++it) {
    if (it->step < from_step) again.push_back(std::move(*it));
  }
  catalog_applied_.erase(first, catalog_applied_.end());
  for (CatalogChangeEntry& e : again) {
    e.undo = ApplyCatalogChange(e.change, meta_.params);
    catalog_applied_.push_back(std::move(e));
  }
  CatalogChangedLocked();
}

void Run::CatalogChangedLocked() {
  ++meta_.catalog_changes;
  analytics_->UpdateCatalog(meta_.params);
}

void Run::OnCommitted(uint64_t through) {
  MutexLock lock(&mu_);
  while (!event_acks_.empty() && event_acks_.front().record <= through) {
    const PendingEventAck& a = event_acks_.front();
    if (a.rank < ranks_.size() && ranks_[a.rank].sink == a.sink && a.sink != nullptr) {
      a.sink->SendEventAck(a.seq, a.step);
    }
    event_acks_.pop_front();
  }
}

void Run::Tick() {
  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  const SteadyTime now = clock_->Now();
  assembler_.Expire(now, [this](const PendingStep& p) {
    mu_.AssertHeld();  // called back synchronously, under this function's lock
    CompleteLocked(p);
  });
  if (!end_.ended() && open_streams_ == 0 && assembler_.pending() == 0 && now - last_activity_ >= options_.end_after) {
    end_ = {clock_->UnixSeconds(), EndReason::kInactive, {}};
    spdlog::info("run {}: ended without a Goodbye (no stream and no step for {:.0f} s)", id_,
                 std::chrono::duration<double>(options_.end_after).count());
    JournalLocked(store::RunEndedRecord{id_, end_.ended_at, end_.reason, {}});
    if (channel_) channel_->OnEnded(/*clean=*/false, end_.ended_at);
  }
}

void Run::Finish(uint32_t rank, EndReason reason, std::string message, uint64_t seq, StreamSink* sink) {
  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  last_activity_ = clock_->Now();
  if (rank < ranks_.size() && ranks_[rank].sink == sink) {
    ranks_[rank].goodbye_waiting = true;
    ranks_[rank].goodbye_seq = seq;
  }
  if (!end_.clean()) {
    end_ = {clock_->UnixSeconds(), reason, std::move(message)};
    end_durable_ = journal_ == nullptr;
    spdlog::info("run {}: {} (Goodbye from rank {}){}{}", id_, EndReasonName(reason), rank,
                 end_.message.empty() ? "" : ": ", end_.message);
    JournalLocked(store::RunEndedRecord{id_, end_.ended_at, end_.reason, end_.message});
    if (channel_) channel_->OnEnded(/*clean=*/true, end_.ended_at);
  }
  if (end_durable_) AnswerGoodbyesLocked();
}

void Run::OnCleanEndDurable() {
  MutexLock lock(&mu_);
  if (!end_.clean()) return;  // a Hello reopened the run since
  end_durable_ = true;
  AnswerGoodbyesLocked();
}

void Run::AnswerGoodbyesLocked() {
  for (RankState& rs : ranks_) {
    if (!rs.goodbye_waiting) continue;
    rs.goodbye_waiting = false;
    if (rs.sink != nullptr) rs.sink->SendFinished(id_, rs.goodbye_seq);
  }
}

RunActivity Run::Activity() const {
  MutexLock lock(&mu_);
  return ActivityLocked();
}

RunActivity Run::ActivityLocked() const {
  RunActivity a;
  a.last_step = last_step_;
  a.last_wall_time = last_wall_time_;
  a.ended = end_.ended();
  a.ended_cleanly = end_.clean();
  a.open_streams = a.ended ? 0 : open_streams_;
  const SteadyTime now = clock_->Now();
  a.seconds_since_last_step = std::chrono::duration<double>(now - last_step_seen_).count();
  a.seconds_since_activity = std::chrono::duration<double>(now - last_activity_).count();
  return a;
}

void Run::OnDurable(const store::RankProgress& progress) {
  MutexLock lock(&mu_);
  if (progress.rank >= ranks_.size()) return;
  RankState& rs = ranks_[progress.rank];
  if (progress.branch < branch_) return;  // committed before a rewind: that branch is gone
  if (rs.has_durable && progress.step < rs.durable_step) return;
  rs.has_durable = true;
  rs.durable_step = progress.step;
  rs.durable_seq = std::max(rs.durable_seq, progress.seq);
  if (rs.sink != nullptr) rs.sink->SendAck(rs.durable_step, rs.durable_seq);
}

RunInfo Run::InfoLocked() const {
  RunInfo info;
  info.run_id = id_;
  info.ended = end_.ended();
  info.end = end_;
  info.world_size = meta_.world_size;
  info.labels = meta_.labels;
  info.step_count = step_count_;
  info.first_step = first_step_;
  info.last_step = last_step_;
  info.last_wall_time = last_wall_time_;
  info.open_streams = open_streams_;
  info.partial_steps = partial_steps_;
  info.nonfinite_count = nonfinite_count_;
  info.last_nonfinite_step = last_nonfinite_step_;
  info.client_dropped_steps = client_dropped_steps_;
  if (speed_count_ >= 2) {
    const size_t n = std::min(speed_count_, kSpeedWindow);
    const auto& newest = speed_ring_[(speed_count_ - 1) % kSpeedWindow];
    const auto& oldest = speed_ring_[(speed_count_ - n) % kSpeedWindow];
    const double dt = newest.first - oldest.first;
    if (dt > 0) info.steps_per_second = static_cast<double>(newest.second - oldest.second) / dt;
  }
  return info;
}

double Run::IdleEndedAt() const {
  MutexLock lock(&mu_);
  return end_.ended() && open_streams_ == 0 ? end_.ended_at : 0;
}

RunInfo Run::Info() const {
  MutexLock lock(&mu_);
  return InfoLocked();
}

RunMetricsSnapshot Run::MetricsSnapshot() const {
  RunMetricsSnapshot s;
  MetricsSnapshot(s);
  return s;
}

void Run::MetricsSnapshot(RunMetricsSnapshot& out) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  out.info = InfoLocked();
  auto latest = [this](SeriesId id) -> std::optional<double> {
    mu_.AssertHeld();  // called only below, under this function's lock
    if (id == kNoSeries || id >= series_.size() || !series_[id].data) return std::nullopt;
    auto p = series_[id].data->Latest();
    if (!p) return std::nullopt;
    return p->last;
  };
  if (out.info.ended) {
    out.total_grad_norm = out.loss = out.z_loss = out.learning_rate = std::nullopt;
    out.params.clear();
    RunAnalysis& a = out.analysis;  // cleared, its buffers kept
    a.slopes.clear();
    a.slope_changes.clear();
    a.change_points.clear();
    a.forecasts.clear();
    a.shares.clear();
    a.amplifications.clear();
    a.growth_without_decay.clear();
    return;
  }
  out.total_grad_norm = latest(scalar_series_[kTotalGrad]);
  out.loss = latest(scalar_series_[kLoss]);
  out.z_loss = latest(scalar_series_[kZLoss]);
  out.learning_rate = latest(scalar_series_[kLearningRate]);
  out.params.resize(std::min(meta_.params.size(), param_series_.size()));
  for (size_t i = 0; i < out.params.size(); ++i) {
    RunMetricsSnapshot::Param& p = out.params[i];
    p.name = meta_.params[i].name;
    p.group = meta_.params[i].EffectiveGroup();
    p.kind = meta_.params[i].kind;
    p.weight_decay = meta_.params[i].weight_decay;
    for (int f = 0; f < kNormFields; ++f) p.norms[f] = latest(param_series_[i][f]);
  }
  analytics_->Analysis(out.analysis);
}

RunSummary Run::Summary(size_t max_events) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  RunSummary s;
  s.info = InfoLocked();
  s.config = meta_.config;
  s.params = meta_.params;
  for (const SeriesEntry& e : series_) {
    if (!e.data) continue;
    if (auto p = e.data->Latest()) s.latest.push_back({e.key, p->last_step, p->last});
  }
  s.event_count = events_.size();
  s.events.assign(events_.end() - static_cast<std::ptrdiff_t>(std::min(max_events, events_.size())), events_.end());
  s.analysis = analytics_->Analysis();
  return s;
}

std::optional<std::vector<store::Point>> Run::QuerySeries(const std::string& key, uint64_t from_step, uint64_t to_step,
                                                          size_t max_points) const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  auto it = series_by_key_.find(std::string_view(key));
  if (it == series_by_key_.end() || !series_[*it].data) return std::nullopt;
  return series_[*it].data->Query(from_step, to_step, max_points);
}

size_t Run::MemoryBytes() const {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  size_t bytes = sizeof(*this);
  for (const SetAsideSlice& pending : unapplied_.slices) bytes += pending.values.capacity() * sizeof(SetAsideValue);
  for (const SeriesEntry& e : series_) {
    if (e.data) bytes += e.data->MemoryBytes() + e.key.capacity();
  }
  return bytes;
}

void Run::RestoreSeries(SeriesId id, const std::string& key) {
  MutexLock lock(&mu_);
  ApplyPointsLocked();
  if (id >= series_.size()) series_.resize(id + 1);
  AddSeriesLocked(id, key);
  // The set hashes series_[id].key: the id leaves it before its key changes, and a key restored
  // under a second id maps to the later one, as the journal's records say.
  for (const std::string_view k : {std::string_view(series_[id].key), std::string_view(key)}) {
    if (auto it = series_by_key_.find(k); it != series_by_key_.end() && (*it == id || k == key)) {
      series_by_key_.erase(it);
    }
  }
  series_[id] = {key, std::make_unique<store::Series>(SeriesOptionsLocked(id, key))};
  series_by_key_.insert(id);
}

void Run::RestoreProgress(const store::RankProgress& progress) {
  MutexLock lock(&mu_);
  if (progress.rank >= ranks_.size()) return;
  RankState& rs = ranks_[progress.rank];
  rs.has_durable = rs.has_received = true;
  rs.durable_step = rs.last_received = progress.step;
  rs.durable_seq = progress.seq;
  rs.has_last_report = false;
}

void Run::RestoreStep(const CompletedStep& step) {
  DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  AppendLocked(step);
  assembler_.RestoreLastCompleted(step.step);
  AnalyzeLocked(step, /*restored=*/true);
}

void Run::RestoreEvent(const EventRecord& event) {
  MutexLock lock(&mu_);
  // The journal hands events out in the order they were recorded; an annotation may have been
  // made for an earlier step than the events before it. events_ stays ordered by step (stable).
  events_.insert(std::upper_bound(events_.begin(), events_.end(), event.step,
                                  [](uint64_t s, const EventRecord& e) { return s < e.step; }),
                 event);
  analytics_->OnEvent(event);
  if (event.source != kCatalogEventSource) return;
  auto change = ParseCatalogChangeData(event.data);
  if (!change.ok()) {
    spdlog::error("run {}: the catalog change journaled at step {} cannot be read ({}); the catalog goes without it",
                  id_, event.step, change.status().message());
    return;
  }
  if (auto why = CheckCatalogChange(*change, meta_.params)) {
    spdlog::error("run {}: the catalog change journaled at step {} does not fit the catalog ({}); skipped", id_,
                  event.step, *why);
    return;
  }
  catalog_pending_.insert(std::upper_bound(catalog_pending_.begin(), catalog_pending_.end(), event.step,
                                           [](uint64_t s, const CatalogChangeEntry& e) { return s < e.step; }),
                          CatalogChangeEntry{event.step, std::move(change).value(), {}});
}

void Run::RestoreSilentSince(double unix_seconds) {
  MutexLock lock(&mu_);
  if (open_streams_ > 0 || end_.ended()) return;
  const double ago = std::max(0.0, clock_->UnixSeconds() - unix_seconds);
  last_activity_ = std::min(last_activity_, clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                                std::chrono::duration<double>(ago)));
}

void Run::RestoreEnded(const RunEnd& end) {
  MutexLock lock(&mu_);
  end_ = end;
  end_durable_ = end.clean();
  if (!end.ended()) return;  // an active run gets a fresh grace period to reconnect
  // Its last sign of life: an inactive run ended end_after after it; a Goodbye was it.
  const double ago = std::max(0.0, clock_->UnixSeconds() - end.ended_at);
  last_activity_ =
      clock_->Now() - std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(ago));
  if (!end.clean()) last_activity_ -= options_.end_after;
}

void Run::SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts) {
  MutexLock lock(&mu_);
  forecasts_ = forecasts;
  analytics_->SetForecasts(forecasts);
}

void Run::RestoreRewind(uint64_t from_step) {
  MutexLock lock(&mu_);
  last_resume_step_ = from_step;
  analytics_->SetBranchStart(from_step);
}

}  // namespace gradwatch::runs

namespace gradwatch::runs {

namespace {

// Leads a run's snapshot payload: catches a payload of another kind before anything is read.
constexpr uint64_t kSnapshotTag = 0x344e5552'50414e53ull;  // "SNAPRUN4"

}  // namespace

uint64_t Run::SnapshotFingerprint() {
  // The sizes of what snapshots hold as bytes: a build that changes one of them does not read the
  // snapshots of another (state_io.h). Field order changes within the same sizes are covered by
  // kSnapshotTag, bumped with them.
  uint64_t h = kSnapshotTag;
  for (const uint64_t size :
       {sizeof(store::Point), sizeof(analytics::RegressionSums), sizeof(analytics::PackedSums),
        sizeof(analytics::LinearFit), sizeof(analytics::ChangePoint), sizeof(analytics::FilteredPoint),
        sizeof(analytics::GrowthWithoutDecay), sizeof(EventRecord), sizeof(double)}) {
    h = (h ^ size) * 1099511628211ull;
  }
  return h;
}

void Run::RestoreBranch(uint64_t branch) {
  MutexLock lock(&mu_);
  journal_branch_ = branch;
}

std::optional<Run::SnapshotMark> Run::SaveSnapshot(ByteChunks& out, std::optional<SnapshotMark> last) const {
  out.Clear();
  StateWriter w(out);
  return WriteSnapshot(w, last);
}

std::optional<size_t> Run::SnapshotBytes(std::optional<SnapshotMark> last) const {
  StateWriter w = StateWriter::Counting();
  if (!WriteSnapshot(w, last)) return std::nullopt;
  return w.size();
}

std::optional<Run::SnapshotMark> Run::WriteSnapshot(StateWriter& w, std::optional<SnapshotMark> last) const {
  MutexLock lock(&mu_);
  if (rebuilding_ || step_count_ == 0) return std::nullopt;
  const SnapshotMark mark{journal_branch_, last_step_};
  if (last == mark) return std::nullopt;
  ApplyPointsLocked();
  w.Put(kSnapshotTag);
  w.Put(journal_branch_);
  w.Put(last_step_);
  w.Put(step_count_);
  w.Put<uint8_t>(has_first_step_ ? 1 : 0);
  w.Put(first_step_);
  w.Put(last_wall_time_);
  w.Put(partial_steps_);
  w.Put(nonfinite_count_);
  w.Put(last_nonfinite_step_);
  w.Put(client_dropped_steps_);
  w.Put<uint64_t>(speed_count_);
  for (const auto& [time, step] : speed_ring_) {
    w.Put(time);
    w.Put(step);
  }
  w.Put<uint64_t>(series_.size());
  for (const SeriesEntry& e : series_) {
    w.PutString(e.key);
    w.Put<uint8_t>(e.data ? 1 : 0);
    if (e.data) e.data->SaveState(w);
  }
  analytics_->SaveState(w);
  return mark;
}

std::unique_ptr<RunAnalytics> Run::FreshAnalyticsLocked(const std::vector<bool>& tracked, bool with_events) {
  auto analytics = std::make_unique<RunAnalytics>(options_.analytics, AnalyticsCharging{options_.budget, stats_, id_});
  analytics->SetCatalog(meta_.params);
  analytics->SetDefaultWeightDecay(meta_.config.weight_decay);
  std::string ignored;  // said at the run's creation
  analytics->SetSchedule(ScheduleOf(meta_.config, &ignored));
  for (size_t id = 0; id < tracked.size(); ++id) {
    if (tracked[id]) analytics->AddSeries(static_cast<SeriesId>(id), series_[id].key);
  }
  if (with_events) {
    for (const EventRecord& e : events_) analytics->OnEvent(e);
  }
  analytics->SetForecasts(forecasts_);
  analytics->SetBranchStart(last_resume_step_.value_or(0));
  return analytics;
}

bool Run::LoadSnapshotStateLocked(StateReader& in, uint64_t count, const std::vector<bool>& had_data, uint64_t* bytes,
                                  std::string* why) {
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return false;
  };
  std::string key;
  for (uint64_t id = 0; id < count; ++id) {
    bool has_data = false;
    if (!in.GetString(key) || !in.GetBool(has_data)) return fail(in.why());
    if (key != series_[id].key) return fail("series " + std::to_string(id) + " is not the journal's");
    if (!has_data) continue;
    series_[id].data.reset();
    series_[id].data = std::make_unique<store::Series>(SeriesOptionsLocked(static_cast<SeriesId>(id), key));
    if (!series_[id].data->LoadState(in)) return fail("series '" + key + "': " + in.why());
    *bytes += series_[id].data->MemoryBytes();
  }
  analytics_.reset();
  analytics_ = FreshAnalyticsLocked(had_data, /*with_events=*/false);
  if (!analytics_->LoadState(in)) return fail(std::string("analytics: ") + in.why());
  if (!in.at_end()) return fail("bytes are left after its end");
  if (options_.budget != nullptr && !options_.budget->TryCharge(*bytes)) {
    return fail("its series need " + std::to_string(*bytes) + " bytes, beyond the memory budget");
  }
  return true;
}

std::optional<Run::SnapshotMark> Run::RestoreSnapshot(std::string_view payload, std::string* why) {
  MutexLock lock(&mu_);
  auto fail = [&](std::string reason) {
    *why = std::move(reason);
    return std::nullopt;
  };
  if (step_count_ != 0 || rebuilding_) return fail("the run already holds steps");
  StateReader in(payload);
  uint64_t tag = 0, branch = 0, last_step = 0;
  if (!in.Get(tag) || tag != kSnapshotTag) return fail("not a snapshot of a run");
  if (!in.Get(branch) || !in.Get(last_step)) return fail("truncated");
  if (branch != journal_branch_) {
    return fail("it was taken on branch " + std::to_string(branch) + " and the run rewound since (branch " +
                std::to_string(journal_branch_) + ")");
  }
  if (channel_ && !channel_->AcceptsRestoreThrough(last_step)) {
    return fail(
        "a listener has not seen the steps it covers (the alerting's saved state, or a remote-write "
        "receiver, is behind it), so they are published again");
  }
  uint64_t step_count = 0, first_step = 0, partial = 0, nonfinite = 0, last_nonfinite = 0, dropped = 0;
  uint64_t speed_count = 0;
  bool has_first = false;
  double last_wall_time = 0;
  std::array<std::pair<double, uint64_t>, kSpeedWindow> speed{};
  if (!in.Get(step_count) || !in.GetBool(has_first) || !in.Get(first_step) || !in.Get(last_wall_time) ||
      !in.Get(partial) || !in.Get(nonfinite) || !in.Get(last_nonfinite) || !in.Get(dropped) || !in.Get(speed_count)) {
    return fail("truncated");
  }
  for (auto& [time, step] : speed) {
    if (!in.Get(time) || !in.Get(step)) return fail("truncated");
  }
  uint64_t count = 0;
  if (!in.GetCount(count, 9, series_.size())) {
    return fail(in.failed() && std::string_view(in.why()) == "a count is beyond its bound"
                    ? "it holds series the journal does not"
                    : std::string(in.why()));
  }
  // Nothing is stepped yet: the run's series and analytics are replaced as the snapshot is read,
  // so that a large run is never held twice, and made again as they were if it is refused.
  ApplyPointsLocked();
  std::vector<bool> had_data(series_.size());
  for (size_t id = 0; id < series_.size(); ++id) had_data[id] = series_[id].data != nullptr;
  uint64_t bytes = 0;
  std::string reason;
  if (!LoadSnapshotStateLocked(in, count, had_data, &bytes, &reason)) {
    for (size_t id = 0; id < series_.size(); ++id) {
      series_[id].data =
          had_data[id]
              ? std::make_unique<store::Series>(SeriesOptionsLocked(static_cast<SeriesId>(id), series_[id].key))
              : nullptr;
    }
    analytics_ = FreshAnalyticsLocked(had_data, /*with_events=*/true);
    return fail(std::move(reason));
  }
  charged_bytes_ += bytes;
  for (const EventRecord& e : events_) analytics_->OnEvent(e);  // those after the snapshot
  last_step_ = last_step;
  step_count_ = step_count;
  has_first_step_ = has_first;
  first_step_ = first_step;
  last_wall_time_ = last_wall_time;
  partial_steps_ = partial;
  nonfinite_count_ = nonfinite;
  last_nonfinite_step_ = last_nonfinite;
  client_dropped_steps_ = dropped;
  speed_ring_ = speed;
  speed_count_ = speed_count;
  assembler_.RestoreLastCompleted(last_step);
  return SnapshotMark{branch, last_step};
}

}  // namespace gradwatch::runs

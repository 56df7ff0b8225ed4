#include "server/runs/run.h"

#include "server/runs/run_internal.h"

#include <algorithm>
#include <cmath>

#include <spdlog/spdlog.h>

#include "server/core/prefetch.h"
#include "server/runs/catalog_change.h"

namespace gradwatch::runs {

namespace {

// A Hello's entry and the run's are one parameter: its weight decay, kind, role and group may
// differ (a resume applies them: runs/catalog_change.h).
bool SameCatalogEntry(const ParamInfo& a, const ParamInfo& b) { return a.name == b.name && a.numel == b.numel; }

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
  analytics_->SetSchedule(run_internal::ScheduleOf(meta_.config, &schedule_problem));
  if (!schedule_problem.empty()) spdlog::warn("run {}: {}", id_, schedule_problem);
  if (journal_new) {
    JournalLocked(store::RunRecord{meta_});
    for (size_t i = 0; i < run_internal::kScalarKeys.size(); ++i) {
      scalar_series_[i] = SeriesForKeyLocked(std::string(run_internal::kScalarKeys[i]), true);
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

void Run::ChargeEventLocked(const EventRecord& event) {
  const uint64_t bytes = run_internal::EventBytes(event);
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
      ids[f] = SeriesForKeyLocked(run_internal::FieldKey(static_cast<NormField>(f), params[i].name), true);
    }
    param_series_.push_back(ids);
  }
  assembler_.SetParamCount(meta_.params.size());
  return std::nullopt;
}

std::optional<IngestError> Run::Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info) {
  std::optional<RewindJob> job;
  {
    run_internal::DeliverOnExit deliver(channel_);
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
  run_internal::DeliverOnExit deliver(channel_);
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
    put(scalar_series_[run_internal::kTotalGrad], static_cast<double>(std::sqrt(p.total_grad.sq)));
  } else {
    // The trainer did not send a total: derive it from the parameters' gradient norms.
    long double sq = 0;
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      if (p.param_present[i * kNormFields]) sq += p.param_sq[i * kNormFields], any = true;
    }
    if (any) put(scalar_series_[run_internal::kTotalGrad], static_cast<double>(std::sqrt(sq)));
  }
  if (p.loss_n) put(scalar_series_[run_internal::kLoss], p.loss_sum / p.loss_n);
  if (p.z_loss_n) put(scalar_series_[run_internal::kZLoss], p.z_loss_sum / p.z_loss_n);
  if (p.lr_n) put(scalar_series_[run_internal::kLearningRate], p.lr_sum / p.lr_n);
  if (p.tokens_present) put(scalar_series_[run_internal::kTokens], static_cast<double>(p.tokens_sum));
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
  run_internal::DeliverOnExit deliver(channel_);
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
  run_internal::DeliverOnExit deliver(channel_);
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

void Run::SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts) {
  MutexLock lock(&mu_);
  forecasts_ = forecasts;
  analytics_->SetForecasts(forecasts);
}

}  // namespace gradwatch::runs

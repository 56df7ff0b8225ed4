#include "server/export/metrics_collector.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include "server/export/text_format.h"

namespace gradwatch::exporter {

namespace {

// "5" for 5.0, "0.25" for 0.25: the shortest text that reads back as the same number.
std::string FormatThreshold(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

struct FamilyInfo {
  std::string_view name;
  std::string_view help;
  MetricType type;
};

// The families with samples per run, in the order they are served.
enum RunFamily : size_t {
  kTotalGradNorm,
  kGradNorm,
  kParamNorm,
  kUpdateNorm,
  kParamWeightDecay,
  kLoss,
  kZLoss,
  kLearningRate,
  kLastStep,
  kStepsPerSecond,
  kPartialSteps,
  kNonfinite,
  kClientDropped,
  kRunOpenStreams,
  kRunSnapshotStep,
  kSlope,
  kSlopeChangeRatio,
  kSlopeAtEvent,
  kChangePointStep,
  kChangePointRatio,
  kStepsToThreshold,
  kGradNormShare,
  kGroupGradNormShare,
  kAmplification,
  kGrowthWithoutDecay,
  kRunInfo,
  kRunSeriesCapped,
  kRunFamilyCount,
};

constexpr std::array<FamilyInfo, kRunFamilyCount> kRunFamilies = {{
    {"gradwatch_total_grad_norm", "Total gradient L2 norm of the run's latest step (merged over ranks).",
     MetricType::kGauge},
    {"gradwatch_grad_norm", "Gradient L2 norm of one parameter at the latest step.", MetricType::kGauge},
    {"gradwatch_param_norm", "L2 norm of one parameter at the latest step.", MetricType::kGauge},
    {"gradwatch_update_norm", "L2 norm of one parameter's optimizer update at the latest step.", MetricType::kGauge},
    {"gradwatch_param_weight_decay",
     "A parameter's weight decay in the run's catalog as of its latest step (a catalog change moves it).",
     MetricType::kGauge},
    {"gradwatch_loss", "Training loss at the latest step (nats per token).", MetricType::kGauge},
    {"gradwatch_z_loss", "Logit z-loss term at the latest step.", MetricType::kGauge},
    {"gradwatch_learning_rate", "Learning rate at the latest step.", MetricType::kGauge},
    {"gradwatch_last_step", "Latest completed optimizer step of the run.", MetricType::kGauge},
    {"gradwatch_steps_per_second", "Training speed over the recent steps.", MetricType::kGauge},
    {"gradwatch_partial_steps_total", "Steps completed without every rank (assembly timeout or overtaken).",
     MetricType::kCounter},
    {"gradwatch_nonfinite_values_total", "NaN or infinite values received for the run.", MetricType::kCounter},
    {"gradwatch_client_dropped_steps_total", "Steps the trainer's client dropped because its queue overflowed.",
     MetricType::kCounter},
    {"gradwatch_run_open_streams", "Trainer streams open for the run.", MetricType::kGauge},
    {"gradwatch_run_snapshot_step",
     "Last step of the run's latest snapshot: a restart replays only the journal's steps after it.",
     MetricType::kGauge},
    {"gradwatch_slope_per_kstep", "Least-squares slope of a series over a window of steps, per 1,000 steps.",
     MetricType::kGauge},
    {"gradwatch_slope_change_ratio", "Slope after an event over the slope before it.", MetricType::kGauge},
    {"gradwatch_slope_at_event_per_kstep", "Slope over the window before or after an event, per 1,000 steps.",
     MetricType::kGauge},
    {"gradwatch_change_point_step", "Step of the latest slope change found without an event.", MetricType::kGauge},
    {"gradwatch_change_point_ratio", "Slope after over slope before the latest change point.", MetricType::kGauge},
    {"gradwatch_steps_to_threshold",
     "Steps until a series reaches a threshold at its current slope (+Inf: not rising).", MetricType::kGauge},
    {"gradwatch_grad_norm_share", "A parameter's share of the squared total gradient norm.", MetricType::kGauge},
    {"gradwatch_group_grad_norm_share", "A parameter group's share of the squared total gradient norm.",
     MetricType::kGauge},
    {"gradwatch_norm_amplification", "A norm gain's norm over its initial norm.", MetricType::kGauge},
    {"gradwatch_growth_without_decay_factor",
     "Norm growth over the long window of a parameter with weight decay 0 whose norm rises.", MetricType::kGauge},
    {"gradwatch_run_info",
     "1 per run, with the run's own labels as label_<name> (join with group_left); no other series carries them.",
     MetricType::kGauge},
    {"gradwatch_run_series_capped",
     "A run's per-parameter and slope series left off /metrics by metrics.max_series_per_run (the Query API has them).",
     MetricType::kGauge},
}};

// Appends `,name="value"` for an unsigned value (digits need no escaping).
void AppendNumberLabel(std::string& out, std::string_view name, uint64_t value) {
  out.push_back(',');
  out.append(name);
  out.append("=\"");
  AppendValue(out, value);
  out.push_back('"');
}

// The daemon-wide families: one chunk for all of them.
class DaemonFamilies {
 public:
  explicit DaemonFamilies(std::string& out) : out_(out) {}

  // A family with one unlabelled sample.
  void One(std::string_view name, std::string_view help, MetricType type, double value) {
    AppendFamilyHeader(out_, name, help, type);
    AppendSample(out_, name, std::string_view(), value);
  }
  void Header(std::string_view name, std::string_view help, MetricType type) {
    AppendFamilyHeader(out_, name, help, type);
  }
  void Sample(std::string_view name, std::string_view label, std::string_view label_value, double value) {
    AppendSample(out_, name, {{label, label_value}}, value);
  }
  std::string& out() { return out_; }

 private:
  std::string& out_;
};

}  // namespace

MetricsCollector::MetricsCollector(const runs::RunRegistry* registry, const runs::DaemonStats* stats,
                                   const store::Journal* journal, ExportOptions options)
    : registry_(registry),
      stats_(stats),
      journal_(journal),
      options_(std::move(options)),
      all_params_(std::find(options_.params.begin(), options_.params.end(), "*") != options_.params.end()) {}

void MetricsCollector::SelectParams() {
  const auto& params = snapshot_.params;
  param_shown_.assign(params.size(), all_params_);
  shown_names_.clear();
  if (all_params_) return;
  const bool key = std::find(options_.params.begin(), options_.params.end(), "key") != options_.params.end();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    bool shown = key && (p.kind == ParamKind::kNormGain || p.kind == ParamKind::kOutput || p.weight_decay == 0.0);
    for (size_t k = 0; !shown && k < options_.params.size(); ++k) {
      shown = options_.params[k] != "key" && GlobMatches(options_.params[k], p.name);
    }
    if (shown) {
      param_shown_[i] = true;
      shown_names_.insert(p.name);
    }
  }
}

bool MetricsCollector::SlopeShown(const std::string& key) const {
  for (const std::string& pattern : options_.slope_series) {
    if (pattern == "key") {
      if (key == keys::kTotalGradNorm || key == keys::kLoss) return true;
      for (std::string_view prefix : {keys::kGradNormPrefix, keys::kParamNormPrefix, keys::kUpdateNormPrefix}) {
        if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0) {
          const std::string_view name = std::string_view(key).substr(prefix.size());
          if (all_params_ ? name != "total" : shown_names_.count(name) != 0) return true;
        }
      }
    } else if (GlobMatches(pattern, key)) {
      return true;
    }
  }
  return false;
}

void MetricsCollector::Render(Exposition& out) {
  std::array<std::string*, kRunFamilyCount> chunks{};
  for (size_t f = 0; f < kRunFamilyCount; ++f) {
    chunks[f] = &out.NewChunk();
    AppendFamilyHeader(*chunks[f], kRunFamilies[f].name, kRunFamilies[f].help, kRunFamilies[f].type);
  }
  // Appends one sample of per-run family `f` with the labels in labels_.
  auto sample = [&](RunFamily f, double value) { AppendSample(*chunks[f], kRunFamilies[f].name, labels_, value); };

  uint64_t active = 0, ended = 0, finished = 0;
  size_t memory = 0;
  std::string run_label;
  for (const auto& run : registry_->All()) {
    memory += run->MemoryBytes();
    run->MetricsSnapshot(snapshot_);
    const runs::RunMetricsSnapshot& s = snapshot_;
    if (s.info.ended) {
      ++(s.info.end.clean() ? finished : ended);
      continue;  // ended runs leave /metrics but stay queryable
    }
    ++active;
    run_label.clear();
    AppendLabel(run_label, "run", s.info.run_id, true);
    // The run's labels (job, cluster, ...) are on this one series, prefixed: a run label named
    // job or instance must not meet Prometheus's own target labels.
    labels_ = run_label;
    for (const auto& [name, value] : s.info.labels) AppendLabel(labels_, "label_" + name, value);
    sample(kRunInfo, 1);
    labels_ = run_label;
    if (s.total_grad_norm) sample(kTotalGradNorm, *s.total_grad_norm);
    if (s.loss) sample(kLoss, *s.loss);
    if (s.z_loss) sample(kZLoss, *s.z_loss);
    if (s.learning_rate) sample(kLearningRate, *s.learning_rate);
    if (s.info.step_count > 0) sample(kLastStep, static_cast<double>(s.info.last_step));
    sample(kStepsPerSecond, s.info.steps_per_second);
    sample(kPartialSteps, static_cast<double>(s.info.partial_steps));
    sample(kNonfinite, static_cast<double>(s.info.nonfinite_count));
    sample(kClientDropped, static_cast<double>(s.info.client_dropped_steps));
    sample(kRunOpenStreams, s.info.open_streams);
    if (const auto step = registry_->SnapshotStep(s.info.run_id)) sample(kRunSnapshotStep, static_cast<double>(*step));

    const runs::RunAnalysis& a = s.analysis;
    SelectParams();
    // The per-parameter and slope samples, against metrics.max_series_per_run.
    size_t budget = options_.max_series_per_run;
    uint64_t capped = 0;
    auto take = [&](size_t n) {
      if (budget >= n) {
        budget -= n;
        return true;
      }
      capped += n;
      return false;
    };
    // A series' windows come one after the other: its labels but the window are built once.
    const std::string* series_key = nullptr;
    bool series_shown = false;
    std::string series_labels;
    for (const auto& sl : a.slopes) {
      if (series_key == nullptr || sl.key != *series_key) {
        series_key = &sl.key;
        series_shown = SlopeShown(sl.key);
        series_labels = run_label;
        AppendLabel(series_labels, "series", sl.key);
      }
      if (!series_shown || !take(1)) continue;
      labels_ = series_labels;
      AppendNumberLabel(labels_, "window", sl.window_steps);
      sample(kSlope, sl.fit.slope_per_kstep());
    }
    for (const auto& c : a.slope_changes) {
      labels_ = run_label;
      AppendLabel(labels_, "series", c.key);
      AppendNumberLabel(labels_, "event", c.change.event_step);
      sample(kSlopeChangeRatio, c.change.ratio);
      const size_t base = labels_.size();
      AppendLabel(labels_, "side", "before");
      sample(kSlopeAtEvent, c.change.before.slope_per_kstep());
      labels_.resize(base);
      AppendLabel(labels_, "side", "after");
      sample(kSlopeAtEvent, c.change.after.slope_per_kstep());
    }
    {
      // Only the latest change point per series: one sample each.
      std::map<std::string_view, const runs::ChangePointInfo*> latest_change;
      for (const auto& c : a.change_points) latest_change[c.key] = &c;
      for (const auto& [key, c] : latest_change) {
        labels_ = run_label;
        AppendLabel(labels_, "series", key);
        sample(kChangePointStep, static_cast<double>(c->change.step));
        sample(kChangePointRatio, c->change.ratio);
      }
    }
    for (const auto& f : a.forecasts) {
      labels_ = run_label;
      AppendLabel(labels_, "series", f.key);
      AppendLabel(labels_, "threshold", FormatThreshold(f.threshold));
      sample(kStepsToThreshold, f.steps_to_threshold);
    }
    auto param_shown = [&](const std::string& name) { return all_params_ || shown_names_.count(name) != 0; };
    for (const auto& sh : a.shares) {
      if (!sh.is_group && (!param_shown(sh.name) || !take(1))) continue;
      labels_ = run_label;
      AppendLabel(labels_, sh.is_group ? "group" : "param", sh.name);
      sample(sh.is_group ? kGroupGradNormShare : kGradNormShare, sh.share);
    }
    for (const auto& am : a.amplifications) {
      if (!param_shown(am.param) || !take(1)) continue;
      labels_ = run_label;
      AppendLabel(labels_, "param", am.param);
      sample(kAmplification, am.amplification);
    }
    for (const auto& g : a.growth_without_decay) {
      if (!param_shown(g.param) || !take(1)) continue;
      labels_ = run_label;
      AppendLabel(labels_, "param", g.param);
      sample(kGrowthWithoutDecay, g.growth_factor);
    }
    for (size_t i = 0; i < s.params.size(); ++i) {
      const auto& p = s.params[i];
      if (!param_shown_[i]) continue;
      const size_t n = 1 + (p.norms[0] ? 1 : 0) + (p.norms[1] ? 1 : 0) + (p.norms[2] ? 1 : 0);
      if (!take(n)) continue;
      labels_ = run_label;
      AppendLabel(labels_, "param", p.name);
      AppendLabel(labels_, "group", p.group);
      sample(kParamWeightDecay, p.weight_decay);
      if (p.norms[0]) sample(kGradNorm, *p.norms[0]);
      if (p.norms[1]) sample(kParamNorm, *p.norms[1]);
      if (p.norms[2]) sample(kUpdateNorm, *p.norms[2]);
    }
    if (capped > 0) {
      labels_ = run_label;
      sample(kRunSeriesCapped, static_cast<double>(capped));
      if (capped_logged_.insert(s.info.run_id).second) {
        spdlog::warn(
            "run {}: /metrics shows {} of its per-parameter and slope series and leaves {} out "
            "(metrics.max_series_per_run); the Query API and remote write have them all",
            s.info.run_id, options_.max_series_per_run, capped);
      }
    }
  }

  DaemonFamilies d(out.NewChunk());
  d.Header("gradwatch_runs", "Runs the daemon holds in memory, by state (ended: without a Goodbye).",
           MetricType::kGauge);
  d.Sample("gradwatch_runs", "state", "active", static_cast<double>(active));
  d.Sample("gradwatch_runs", "state", "ended", static_cast<double>(ended));
  d.Sample("gradwatch_runs", "state", "finished", static_cast<double>(finished));
  d.One("gradwatch_insecure_listener",
        "1 when started with --insecure and a listener is open beyond loopback: gRPC without TLS and client "
        "authentication (any host that reaches it may write runs, silence alerts and reload rules), or HTTP "
        "without TLS (/metrics in clear).",
        MetricType::kGauge, options_.insecure_listener ? 1.0 : 0.0);
  d.One("gradwatch_open_streams", "Trainer streams open.", MetricType::kGauge,
        static_cast<double>(stats_->open_streams.load()));
  d.One("gradwatch_messages_received_total", "Trainer messages received.", MetricType::kCounter,
        static_cast<double>(stats_->messages_received.load()));
  d.One("gradwatch_samples_received_total", "Series samples stored from completed steps.", MetricType::kCounter,
        static_cast<double>(stats_->samples_received.load()));
  d.One("gradwatch_ingest_held_reports_total",
        "Step reports held back (their stream paused) until the ranks a run waits for catch up.", MetricType::kCounter,
        static_cast<double>(stats_->held_reports.load()));
  d.Header("gradwatch_ingest_errors_total", "Trainer messages refused, by reason.", MetricType::kCounter);
  for (runs::IngestErrorReason r : runs::AllIngestErrorReasons()) {
    d.Sample("gradwatch_ingest_errors_total", "reason", runs::IngestErrorReasonName(r),
             static_cast<double>(stats_->ErrorCount(r)));
  }
  d.One("gradwatch_journal_dropped_records_total",
        "Records never committed: not queued (queue full or stopped) or still failing at shutdown.",
        MetricType::kCounter,
        static_cast<double>(stats_->journal_dropped_records.load() +
                            (journal_ != nullptr ? journal_->stats().dropped_records : 0)));
  d.One("gradwatch_store_memory_bytes", "Memory held by the in-memory series store.", MetricType::kGauge,
        static_cast<double>(memory));
  d.Header("gradwatch_journal_commit_duration_seconds", "Duration of journal transactions (group commits).",
           MetricType::kHistogram);
  {
    const auto h = stats_->journal_commit_seconds.Read();
    AppendHistogram(d.out(), "gradwatch_journal_commit_duration_seconds", std::string_view(), h.bounds, h.cumulative,
                    h.sum, h.count);
  }
  d.One("gradwatch_runs_evicted_total",
        "Ended runs dropped from memory (retention over, or room needed); the journal keeps them.",
        MetricType::kCounter, static_cast<double>(stats_->runs_evicted.load()));
  d.One("gradwatch_outbox_pruned_rows_total",
        "Delivered or given-up notifications deleted from the outbox (retention.outbox_days).", MetricType::kCounter,
        static_cast<double>(stats_->outbox_pruned_rows.load()));
  d.One("gradwatch_runs_not_restored_total",
        "Journaled runs skipped when rebuilding (beyond the memory budget, out of memory, or rows that cannot be "
        "read); the journal keeps them.",
        MetricType::kCounter, static_cast<double>(stats_->runs_not_restored.load()));
  d.One("gradwatch_snapshots_written_total",
        "Snapshots of runs' in-memory state written (journal.snapshot_interval_seconds), which a restart loads "
        "instead of replaying the journal.",
        MetricType::kCounter, static_cast<double>(stats_->snapshots_written.load()));
  d.One("gradwatch_snapshot_failures_total",
        "Snapshots that could not be written (the journal not committing, a full disk); the next restart replays "
        "more of the journal.",
        MetricType::kCounter, static_cast<double>(stats_->snapshot_failures.load()));
  d.One("gradwatch_snapshot_written_bytes_total", "Bytes of snapshots written.", MetricType::kCounter,
        static_cast<double>(stats_->snapshot_bytes_written.load()));
  d.One("gradwatch_runs_restored_from_snapshot_total",
        "Runs restored at start-up from their snapshot and the journal's steps after it.", MetricType::kCounter,
        static_cast<double>(stats_->runs_restored_from_snapshot.load()));
  d.One("gradwatch_analytics_refused_series_total",
        "Series left without analytics (slopes, slope changes, forecasts) because their trackers did not fit in the "
        "memory budget; their points are still stored.",
        MetricType::kCounter, static_cast<double>(stats_->analytics_refused_series.load()));
  const runs::MemoryBudget* budget = registry_->budget();
  d.Header("gradwatch_memory_budget_bytes", "The memory all runs together may be charged (limits.memory_budget_bytes).",
           MetricType::kGauge);
  if (budget != nullptr) {
    AppendSample(d.out(), "gradwatch_memory_budget_bytes", std::string_view(), static_cast<double>(budget->limit()));
  }
  d.Header("gradwatch_memory_budget_used_bytes",
           "Memory charged to the budget by the runs held: catalogs, grown series and analytics.", MetricType::kGauge);
  if (budget != nullptr) {
    AppendSample(d.out(), "gradwatch_memory_budget_used_bytes", std::string_view(),
                 static_cast<double>(budget->used()));
  }
  if (journal_ == nullptr) return;
  const store::JournalStats js = journal_->stats();
  d.One("gradwatch_journal_queue_depth", "Records waiting for a journal commit.", MetricType::kGauge,
        static_cast<double>(js.queue_depth));
  d.One("gradwatch_journal_failed_commits_total",
        "Journal transaction attempts that failed (each is retried with its records).", MetricType::kCounter,
        static_cast<double>(js.failed_commits));
  d.One("gradwatch_storage_healthy",
        "1 while the journal commits, 0 from a failed commit to the next success (ingest refuses data and is "
        "NOT_SERVING meanwhile).",
        MetricType::kGauge, journal_->healthy() ? 1.0 : 0.0);
  d.One("gradwatch_journal_storage_faults_total",
        "Times the journal's commits started failing (full disk, read-only or vanished files, I/O errors).",
        MetricType::kCounter, static_cast<double>(js.storage_faults));
  d.Header("gradwatch_journal_recovery_problems",
           "Problems found when the journal was opened at start-up (1 when found), by kind: wal_missing, "
           "discarded_tail, damaged, moved_aside (a damaged journal renamed aside and salvaged into a fresh one).",
           MetricType::kGauge);
  const store::RecoveryReport& r = journal_->recovery();
  d.Sample("gradwatch_journal_recovery_problems", "problem", "wal_missing", r.wal_missing ? 1.0 : 0.0);
  d.Sample("gradwatch_journal_recovery_problems", "problem", "discarded_tail", r.discarded_frames > 0 ? 1.0 : 0.0);
  d.Sample("gradwatch_journal_recovery_problems", "problem", "damaged", r.damaged ? 1.0 : 0.0);
  d.Sample("gradwatch_journal_recovery_problems", "problem", "moved_aside", r.moved_aside ? 1.0 : 0.0);
  d.Header("gradwatch_journal_salvaged_runs",
           "Runs of a damaged journal copied into the fresh one at start-up (outcome=salvaged), and those it lost "
           "(outcome=lost): unreadable, or named only by their snapshots.",
           MetricType::kGauge);
  d.Sample("gradwatch_journal_salvaged_runs", "outcome", "salvaged", static_cast<double>(r.salvaged_runs));
  d.Sample("gradwatch_journal_salvaged_runs", "outcome", "lost",
           static_cast<double>(r.lost_runs + (stats_ != nullptr ? stats_->runs_lost_known_from_snapshots.load() : 0)));
  const store::DamageLog& damage = journal_->damage();
  d.Header("gradwatch_journal_damaged_total",
           "Step blocks (kind=block) and step rows (kind=row) whose checksum failed since start-up, each counted once: "
           "their steps are not served (the log names each run and step range; gradwatchd --repair).",
           MetricType::kCounter);
  d.Sample("gradwatch_journal_damaged_total", "kind", "block", static_cast<double>(damage.blocks()));
  d.Sample("gradwatch_journal_damaged_total", "kind", "row", static_cast<double>(damage.rows()));
  d.One("gradwatch_journal_damaged_steps_total", "Steps held by the damaged blocks and rows (not served).",
        MetricType::kCounter, static_cast<double>(damage.steps()));
  d.One("gradwatch_journal_files_lost_total",
        "Times the journal's files vanished or were replaced while the daemon ran (data directory deleted...).",
        MetricType::kCounter, static_cast<double>(js.files_lost));
  d.One("gradwatch_journal_rebuilds_total",
        "Times the journal was rebuilt from its open connection after its files were lost.", MetricType::kCounter,
        static_cast<double>(js.rebuilds));
  d.One("gradwatch_journal_disk_bytes",
        "Size of the journal database with its WAL and shared-memory files (outbox included).", MetricType::kGauge,
        static_cast<double>(journal_->DiskBytes()));
  d.One("gradwatch_journal_pruned_runs_total", "Ended runs deleted from the journal (retention.journal_days).",
        MetricType::kCounter, static_cast<double>(js.pruned_runs));
  d.One("gradwatch_journal_pruned_rows_total",
        "Rows (steps, events, series, catalog, progress, runs) deleted from the journal.", MetricType::kCounter,
        static_cast<double>(js.pruned_rows));
}

}  // namespace gradwatch::exporter

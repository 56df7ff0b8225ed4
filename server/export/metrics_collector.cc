#include "server/export/metrics_collector.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>

#include "server/export/families.h"

namespace gradwatch::exporter {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

// "5" for 5.0, "0.25" for 0.25: the shortest text that reads back as the same number.
std::string FormatThreshold(double v) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

}  // namespace

MetricsCollector::MetricsCollector(const runs::RunRegistry* registry, const runs::DaemonStats* stats,
                                   const store::Journal* journal)
    : registry_(registry), stats_(stats), journal_(journal) {}

std::vector<MetricFamily> MetricsCollector::Collect() const {
  auto grad_total = Family("gradwatch_total_grad_norm",
                           "Total gradient L2 norm of the run's latest step (merged over ranks).",
                           MetricType::Gauge);
  auto grad = Family("gradwatch_grad_norm", "Gradient L2 norm of one parameter at the latest step.",
                     MetricType::Gauge);
  auto param = Family("gradwatch_param_norm", "L2 norm of one parameter at the latest step.",
                      MetricType::Gauge);
  auto update = Family("gradwatch_update_norm", "L2 norm of one parameter's optimizer update at the latest step.",
                       MetricType::Gauge);
  auto loss = Family("gradwatch_loss", "Training loss at the latest step (nats per token).", MetricType::Gauge);
  auto z_loss = Family("gradwatch_z_loss", "Logit z-loss term at the latest step.", MetricType::Gauge);
  auto lr = Family("gradwatch_learning_rate", "Learning rate at the latest step.", MetricType::Gauge);
  auto last_step = Family("gradwatch_last_step", "Latest completed optimizer step of the run.", MetricType::Gauge);
  auto speed = Family("gradwatch_steps_per_second", "Training speed over the recent steps.", MetricType::Gauge);
  auto partial = Family("gradwatch_partial_steps_total",
                        "Steps completed without every rank (assembly timeout or overtaken).",
                        MetricType::Counter);
  auto nonfinite = Family("gradwatch_nonfinite_values_total", "NaN or infinite values received for the run.",
                          MetricType::Counter);
  auto dropped = Family("gradwatch_client_dropped_steps_total",
                        "Steps the trainer's client dropped because its queue overflowed.", MetricType::Counter);
  auto run_streams = Family("gradwatch_run_open_streams", "Trainer streams open for the run.", MetricType::Gauge);

  auto slope = Family("gradwatch_slope_per_kstep",
                      "Least-squares slope of a series over a window of steps, per 1,000 steps.", MetricType::Gauge);
  auto slope_ratio = Family("gradwatch_slope_change_ratio",
                            "Slope after an event over the slope before it.", MetricType::Gauge);
  auto slope_at_event = Family("gradwatch_slope_at_event_per_kstep",
                               "Slope over the window before or after an event, per 1,000 steps.", MetricType::Gauge);
  auto change_point = Family("gradwatch_change_point_step",
                             "Step of the latest slope change found without an event.", MetricType::Gauge);
  auto change_point_ratio = Family("gradwatch_change_point_ratio",
                                   "Slope after over slope before the latest change point.", MetricType::Gauge);
  auto to_threshold = Family("gradwatch_steps_to_threshold",
                             "Steps until a series reaches a threshold at its current slope (+Inf: not rising).",
                             MetricType::Gauge);
  auto share = Family("gradwatch_grad_norm_share",
                      "A parameter's share of the squared total gradient norm.", MetricType::Gauge);
  auto group_share = Family("gradwatch_group_grad_norm_share",
                            "A parameter group's share of the squared total gradient norm.", MetricType::Gauge);
  auto amplification = Family("gradwatch_norm_amplification",
                              "A norm gain's norm over its initial norm.", MetricType::Gauge);
  auto growth = Family("gradwatch_growth_without_decay_factor",
                       "Norm growth over the long window of a parameter with weight decay 0 whose norm rises.",
                       MetricType::Gauge);

  uint64_t active = 0, ended = 0, finished = 0;
  size_t memory = 0;
  for (const auto& run : registry_->All()) {
    memory += run->MemoryBytes();
    runs::RunMetricsSnapshot s = run->MetricsSnapshot();
    if (s.info.ended) {
      ++(s.info.end.clean() ? finished : ended);
      continue;  // ended runs leave /metrics but stay queryable
    }
    ++active;
    const ClientMetric::Label run_label{"run", s.info.run_id};
    if (s.total_grad_norm) Add(grad_total, {run_label}, *s.total_grad_norm);
    if (s.loss) Add(loss, {run_label}, *s.loss);
    if (s.z_loss) Add(z_loss, {run_label}, *s.z_loss);
    if (s.learning_rate) Add(lr, {run_label}, *s.learning_rate);
    if (s.info.step_count > 0) Add(last_step, {run_label}, static_cast<double>(s.info.last_step));
    Add(speed, {run_label}, s.info.steps_per_second);
    Add(partial, {run_label}, static_cast<double>(s.info.partial_steps));
    Add(nonfinite, {run_label}, static_cast<double>(s.info.nonfinite_count));
    Add(dropped, {run_label}, static_cast<double>(s.info.client_dropped_steps));
    Add(run_streams, {run_label}, s.info.open_streams);
    const runs::RunAnalysis& a = s.analysis;
    for (const auto& sl : a.slopes) {
      Add(slope, {run_label, {"series", sl.key}, {"window", std::to_string(sl.window_steps)}},
          sl.fit.slope_per_kstep());
    }
    for (const auto& c : a.slope_changes) {
      const std::string event = std::to_string(c.change.event_step);
      Add(slope_ratio, {run_label, {"series", c.key}, {"event", event}}, c.change.ratio);
      Add(slope_at_event, {run_label, {"series", c.key}, {"event", event}, {"side", "before"}},
          c.change.before.slope_per_kstep());
      Add(slope_at_event, {run_label, {"series", c.key}, {"event", event}, {"side", "after"}},
          c.change.after.slope_per_kstep());
    }
    {
      // Only the latest change point per series: one sample each.
      std::map<std::string, const runs::ChangePointInfo*> latest_change;
      for (const auto& c : a.change_points) latest_change[c.key] = &c;
      for (const auto& [key, c] : latest_change) {
        Add(change_point, {run_label, {"series", key}}, static_cast<double>(c->change.step));
        Add(change_point_ratio, {run_label, {"series", key}}, c->change.ratio);
      }
    }
    for (const auto& f : a.forecasts) {
      Add(to_threshold, {run_label, {"series", f.key}, {"threshold", FormatThreshold(f.threshold)}},
          f.steps_to_threshold);
    }
    for (const auto& sh : a.shares) {
      if (sh.is_group) {
        Add(group_share, {run_label, {"group", sh.name}}, sh.share);
      } else {
        Add(share, {run_label, {"param", sh.name}}, sh.share);
      }
    }
    for (const auto& am : a.amplifications) Add(amplification, {run_label, {"param", am.param}}, am.amplification);
    for (const auto& g : a.growth_without_decay) Add(growth, {run_label, {"param", g.param}}, g.growth_factor);
    for (const auto& p : s.params) {
      std::vector<ClientMetric::Label> labels{run_label, {"param", p.name}, {"group", p.group}};
      if (p.norms[0]) Add(grad, labels, *p.norms[0]);
      if (p.norms[1]) Add(param, labels, *p.norms[1]);
      if (p.norms[2]) Add(update, labels, *p.norms[2]);
    }
  }

  auto runs_family = Family("gradwatch_runs",
                            "Runs the daemon holds in memory, by state (ended: without a Goodbye).",
                            MetricType::Gauge);
  Add(runs_family, {{"state", "active"}}, static_cast<double>(active));
  Add(runs_family, {{"state", "ended"}}, static_cast<double>(ended));
  Add(runs_family, {{"state", "finished"}}, static_cast<double>(finished));
  auto evicted = Family("gradwatch_runs_evicted_total",
                        "Ended runs dropped from memory (retention over, or room needed); the journal keeps them.",
                        MetricType::Counter);
  Add(evicted, {}, static_cast<double>(stats_->runs_evicted.load()));
  auto outbox_pruned = Family("gradwatch_outbox_pruned_rows_total",
                              "Delivered or given-up notifications deleted from the outbox (retention.outbox_days).",
                              MetricType::Counter);
  Add(outbox_pruned, {}, static_cast<double>(stats_->outbox_pruned_rows.load()));
  auto not_restored = Family("gradwatch_runs_not_restored_total",
                             "Journaled runs skipped when rebuilding (beyond the memory budget, out of memory, or rows that "
                             "cannot be read); "
                             "the journal keeps them.",
                             MetricType::Counter);
  Add(not_restored, {}, static_cast<double>(stats_->runs_not_restored.load()));
  auto analytics_refused = Family("gradwatch_analytics_refused_series_total",
                                  "Series left without analytics (slopes, slope changes, forecasts) because their "
                                  "trackers did not fit in the memory budget; their points are still stored.",
                                  MetricType::Counter);
  Add(analytics_refused, {}, static_cast<double>(stats_->analytics_refused_series.load()));
  auto budget_limit = Family("gradwatch_memory_budget_bytes",
                             "The memory all runs together may be charged (limits.memory_budget_bytes).",
                             MetricType::Gauge);
  auto budget_used = Family("gradwatch_memory_budget_used_bytes",
                            "Memory charged to the budget by the runs held: catalogs, grown series and analytics.",
                            MetricType::Gauge);
  if (const runs::MemoryBudget* budget = registry_->budget()) {
    Add(budget_limit, {}, static_cast<double>(budget->limit()));
    Add(budget_used, {}, static_cast<double>(budget->used()));
  }
  auto open_streams = Family("gradwatch_open_streams", "Trainer streams open.", MetricType::Gauge);
  Add(open_streams, {}, static_cast<double>(stats_->open_streams.load()));
  auto messages = Family("gradwatch_messages_received_total", "Trainer messages received.", MetricType::Counter);
  Add(messages, {}, static_cast<double>(stats_->messages_received.load()));
  auto samples = Family("gradwatch_samples_received_total",
                        "Series samples stored from completed steps.", MetricType::Counter);
  Add(samples, {}, static_cast<double>(stats_->samples_received.load()));
  auto held = Family("gradwatch_ingest_held_reports_total",
                     "Step reports held back (their stream paused) until the ranks a run waits for catch up.",
                     MetricType::Counter);
  Add(held, {}, static_cast<double>(stats_->held_reports.load()));
  auto errors = Family("gradwatch_ingest_errors_total", "Trainer messages refused, by reason.", MetricType::Counter);
  for (runs::IngestErrorReason r : runs::AllIngestErrorReasons()) {
    Add(errors, {{"reason", std::string(runs::IngestErrorReasonName(r))}},
        static_cast<double>(stats_->ErrorCount(r)));
  }
  auto journal_dropped = Family("gradwatch_journal_dropped_records_total",
                                "Records never committed: not queued (queue full or stopped) or still failing at shutdown.",
                                MetricType::Counter);
  Add(journal_dropped, {},
      static_cast<double>(stats_->journal_dropped_records.load() +
                          (journal_ != nullptr ? journal_->dropped_record_count() : 0)));
  auto store_memory = Family("gradwatch_store_memory_bytes", "Memory held by the in-memory series store.",
                             MetricType::Gauge);
  Add(store_memory, {}, static_cast<double>(memory));

  auto commit = Family("gradwatch_journal_commit_duration_seconds",
                       "Duration of journal transactions (group commits).", MetricType::Histogram);
  {
    const auto h = stats_->journal_commit_seconds.Read();
    ClientMetric m;
    m.histogram.sample_count = h.count;
    m.histogram.sample_sum = h.sum;
    for (size_t i = 0; i < h.cumulative.size(); ++i) {
      const double bound = i < h.bounds.size() ? h.bounds[i] : std::numeric_limits<double>::infinity();
      m.histogram.bucket.push_back({h.cumulative[i], bound});
    }
    commit.metric.push_back(std::move(m));
  }

  std::vector<MetricFamily> out;
  for (auto* f : {&grad_total, &grad, &param, &update, &loss, &z_loss, &lr, &last_step, &speed, &partial,
                  &nonfinite, &dropped, &run_streams, &slope, &slope_ratio, &slope_at_event, &change_point,
                  &change_point_ratio, &to_threshold, &share, &group_share, &amplification, &growth, &runs_family, &open_streams, &messages, &samples, &held,
                  &errors, &journal_dropped, &store_memory, &commit, &evicted, &outbox_pruned,
                  &not_restored, &budget_limit, &budget_used}) {
    out.push_back(std::move(*f));
  }
  if (journal_ != nullptr) {
    auto depth = Family("gradwatch_journal_queue_depth", "Records waiting for a journal commit.",
                        MetricType::Gauge);
    Add(depth, {}, static_cast<double>(journal_->queue_depth()));
    auto failed = Family("gradwatch_journal_failed_commits_total",
                         "Journal transaction attempts that failed (each is retried with its records).",
                         MetricType::Counter);
    Add(failed, {}, static_cast<double>(journal_->failed_commit_count()));
    auto healthy = Family("gradwatch_storage_healthy",
                          "1 while the journal commits, 0 from a failed commit to the next success (ingest "
                          "refuses data and is NOT_SERVING meanwhile).",
                          MetricType::Gauge);
    Add(healthy, {}, journal_->healthy() ? 1.0 : 0.0);
    auto faults = Family("gradwatch_journal_storage_faults_total",
                         "Times the journal's commits started failing (full disk, read-only or vanished files, "
                         "I/O errors).",
                         MetricType::Counter);
    Add(faults, {}, static_cast<double>(journal_->storage_fault_count()));
    auto recovery = Family("gradwatch_journal_recovery_problems",
                           "Problems found when the journal was opened at start-up (1 when found), by kind: "
                           "wal_missing, discarded_tail, damaged, moved_aside (a damaged journal renamed aside "
                           "and salvaged into a fresh one).",
                           MetricType::Gauge);
    const store::RecoveryReport& r = journal_->recovery();
    Add(recovery, {{"problem", "wal_missing"}}, r.wal_missing ? 1.0 : 0.0);
    Add(recovery, {{"problem", "discarded_tail"}}, r.discarded_frames > 0 ? 1.0 : 0.0);
    Add(recovery, {{"problem", "damaged"}}, r.damaged ? 1.0 : 0.0);
    Add(recovery, {{"problem", "moved_aside"}}, r.moved_aside ? 1.0 : 0.0);
    auto salvage = Family("gradwatch_journal_salvaged_runs",
                          "Runs of a damaged journal copied into the fresh one at start-up (outcome=salvaged), "
                          "and those that could not be read (outcome=lost).",
                          MetricType::Gauge);
    Add(salvage, {{"outcome", "salvaged"}}, static_cast<double>(r.salvaged_runs));
    Add(salvage, {{"outcome", "lost"}}, static_cast<double>(r.lost_runs));
    auto files_lost = Family("gradwatch_journal_files_lost_total",
                             "Times the journal's files vanished or were replaced while the daemon ran (data "
                             "directory deleted...).",
                             MetricType::Counter);
    Add(files_lost, {}, static_cast<double>(journal_->files_lost_count()));
    auto rebuilds = Family("gradwatch_journal_rebuilds_total",
                           "Times the journal was rebuilt from its open connection after its files were lost.",
                           MetricType::Counter);
    Add(rebuilds, {}, static_cast<double>(journal_->rebuild_count()));
    auto disk = Family("gradwatch_journal_disk_bytes",
                       "Size of the journal database with its WAL and shared-memory files (outbox included).",
                       MetricType::Gauge);
    Add(disk, {}, static_cast<double>(journal_->DiskBytes()));
    auto pruned_runs = Family("gradwatch_journal_pruned_runs_total",
                              "Ended runs deleted from the journal (retention.journal_days).", MetricType::Counter);
    Add(pruned_runs, {}, static_cast<double>(journal_->pruned_runs()));
    auto pruned_rows = Family("gradwatch_journal_pruned_rows_total",
                              "Rows (steps, events, series, catalog, progress, runs) deleted from the journal.",
                              MetricType::Counter);
    Add(pruned_rows, {}, static_cast<double>(journal_->pruned_rows()));
    out.push_back(std::move(depth));
    out.push_back(std::move(failed));
    out.push_back(std::move(healthy));
    out.push_back(std::move(faults));
    out.push_back(std::move(recovery));
    out.push_back(std::move(salvage));
    out.push_back(std::move(files_lost));
    out.push_back(std::move(rebuilds));
    out.push_back(std::move(disk));
    out.push_back(std::move(pruned_runs));
    out.push_back(std::move(pruned_rows));
  }
  return out;
}

}  // namespace gradwatch::exporter

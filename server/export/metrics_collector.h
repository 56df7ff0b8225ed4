// The Prometheus view of the daemon, rendered at scrape time from live state straight into the
// scrape's text (text_format.h). A scrape copies each run's latest values under that run's lock
// for a moment (Run::MetricsSnapshot) and formats them after releasing it; it never waits on I/O.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "server/export/exposition.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"
#include "server/store/journal.h"

namespace gradwatch::exporter {

// What /metrics shows of each run beyond its scalars (config `metrics`); the Query API and remote
// write keep everything. A model of thousands of tensors would otherwise put tens of thousands of
// series per run on every scrape.
struct ExportOptions {
  // The parameters with per-parameter families (their three norms, grad norm share, amplification,
  // growth without decay): names matching one of these patterns ('*' wildcard). "key" stands for
  // the norm gains and the other parameters without weight decay, and the output layer. Groups'
  // shares are always shown.
  std::vector<std::string> params = {"key"};
  // The series with slopes per window: keys matching one of these patterns. "key" stands for the
  // total grad norm, the loss and the norms of the parameters shown per parameter.
  std::vector<std::string> slope_series = {"key"};
  // A run's per-parameter and slope samples at most; beyond it the rest is left out, logged once
  // per run and shown in gradwatch_run_series_capped{run}.
  size_t max_series_per_run = 10000;
  // The gRPC listener is reachable beyond loopback without mutual TLS (gradwatch_insecure_listener).
  bool insecure_listener = false;
};

class MetricsCollector {
 public:
  // journal may be null. The registry, stats and journal must outlive the collector.
  MetricsCollector(const runs::RunRegistry* registry, const runs::DaemonStats* stats, const store::Journal* journal,
                   ExportOptions options = {});

  // Appends the per-run families, then the daemon's own, one chunk per family. One call at a
  // time (it reuses its buffers); MetricsServer serialises its renders.
  void Render(Exposition& out);

 private:
  // Fills param_shown_ and shown_names_ for snapshot_.
  void SelectParams();
  bool SlopeShown(const std::string& key) const;
  const runs::RunRegistry* const registry_;
  const runs::DaemonStats* const stats_;
  const store::Journal* const journal_;
  const ExportOptions options_;
  const bool all_params_;  // options_.params has "*"
  // Whether the parameter (snapshot_.params[i]) gets per-parameter families; reused.
  std::vector<bool> param_shown_;
  std::unordered_set<std::string_view> shown_names_;  // their names, into snapshot_
  std::set<std::string> capped_logged_;               // runs whose cap was logged
  // Reused from one run and one scrape to the next.
  runs::RunMetricsSnapshot snapshot_;
  std::string labels_;  // the labels of the sample being written
};

}  // namespace gradwatch::exporter

// The Prometheus view of the daemon, rendered at scrape time from live state straight into the
// scrape's text (text_format.h). A scrape copies each run's latest values under that run's lock
// for a moment (Run::MetricsSnapshot) and formats them after releasing it; it never waits on I/O.
#pragma once

#include "server/export/exposition.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"
#include "server/store/journal.h"

namespace gradwatch::exporter {

class MetricsCollector {
 public:
  // journal may be null. The registry, stats and journal must outlive the collector.
  MetricsCollector(const runs::RunRegistry* registry, const runs::DaemonStats* stats,
                   const store::Journal* journal);

  // Appends the per-run families, then the daemon's own, one chunk per family. One call at a
  // time (it reuses its buffers); MetricsServer serialises its renders.
  void Render(Exposition& out);

 private:
  const runs::RunRegistry* const registry_;
  const runs::DaemonStats* const stats_;
  const store::Journal* const journal_;
  // Reused from one run and one scrape to the next.
  runs::RunMetricsSnapshot snapshot_;
  std::string labels_;  // the labels of the sample being written
};

}  // namespace gradwatch::exporter

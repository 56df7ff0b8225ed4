// The Prometheus view of the daemon, built at scrape time from live state. A scrape copies each
// run's latest values under that run's lock for a moment and never waits on I/O.
#pragma once

#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"
#include "server/store/journal.h"

namespace gradwatch::exporter {

class MetricsCollector final : public prometheus::Collectable {
 public:
  // journal may be null.
  MetricsCollector(const runs::RunRegistry* registry, const runs::DaemonStats* stats,
                   const store::Journal* journal);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const runs::RunRegistry* const registry_;
  const runs::DaemonStats* const stats_;
  const store::Journal* const journal_;
};

}  // namespace gradwatch::exporter

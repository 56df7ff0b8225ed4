// The Prometheus view of alerting, rendered at scrape time: alerts pending and firing (in the shape
// of Prometheus's own ALERTS series), transitions, silences, and each receiver's deliveries,
// retries, failures and queue, so that a dashboard shows when paging itself is broken; and every
// rule's bounds as they are in force (gradwatch_rule_bound), so that a chart draws the threshold
// the daemon pages at, overrides included, rather than a literal of its own.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "alerts/alert.h"
#include "alerts/notify/dispatcher.h"
#include "alerts/rules.h"
#include "server/export/exposition.h"

namespace gradwatch::exporter {

// What a scrape reads of the daemon's alerting.
struct AlertingView {
  std::vector<alerts::Alert> active;  // pending and firing
  size_t silences = 0;                // not ended
  uint64_t firing_transitions = 0;    // since start
  uint64_t resolved_transitions = 0;  // since start
  uint64_t store_write_failures = 0;  // since start
  std::vector<notify::ReceiverStats> receivers;
  // The rules in force (overrides applied), whose bounds gradwatch_rule_bound exports so that a
  // dashboard draws the page's own threshold.
  std::vector<alerts::Rule> rules;
  // Each run's own labels: an alert's label that is one of them (same name and value) is left off
  // gradwatch_alerts, where gradwatch_run_info carries it, so that a run label named job or
  // instance never meets Prometheus's target labels.
  std::map<std::string, std::map<std::string, std::string>> run_labels;
};

class AlertMetricsCollector {
 public:
  // `view` is called once per scrape, from the scrape's thread.
  explicit AlertMetricsCollector(std::function<AlertingView()> view) : view_(std::move(view)) {}

  // Appends the alerting families (one chunk).
  void Render(Exposition& out) const;

 private:
  const std::function<AlertingView()> view_;
};

}  // namespace gradwatch::exporter

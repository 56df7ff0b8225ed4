#include "server/export/alert_metrics.h"

#include <string>

#include "server/export/families.h"

namespace gradwatch::exporter {

using prometheus::MetricFamily;
using prometheus::MetricType;

std::vector<MetricFamily> AlertMetricsCollector::Collect() const {
  const AlertingView view = view_();
  auto alerts = Family("gradwatch_alerts",
                       "Alerts pending or firing: 1 per alert, with its labels and alertstate (as Prometheus's ALERTS).",
                       MetricType::Gauge);
  for (const alerts::Alert& a : view.active) {
    std::vector<prometheus::ClientMetric::Label> labels;
    labels.push_back({"alertname", a.name});
    labels.push_back({"alertstate", std::string(alerts::AlertStateName(a.state))});
    for (const auto& [name, value] : a.labels) {
      if (name != "alertname" && name != "alertstate") labels.push_back({name, value});
    }
    Add(alerts, std::move(labels), 1);
  }
  auto transitions = Family("gradwatch_alert_transitions_total",
                            "Alerts that started firing, and that resolved, since the daemon started.",
                            MetricType::Counter);
  Add(transitions, {{"to", "firing"}}, static_cast<double>(view.firing_transitions));
  Add(transitions, {{"to", "resolved"}}, static_cast<double>(view.resolved_transitions));
  auto silences = Family("gradwatch_silences", "Silences that have not ended (including ones that start later).", MetricType::Gauge);
  Add(silences, {}, static_cast<double>(view.silences));
  auto store_failures = Family("gradwatch_alert_store_write_failures_total",
                               "Failed writes of alert states and notifications to the journal's database (retried).",
                               MetricType::Counter);
  Add(store_failures, {}, static_cast<double>(view.store_write_failures));

  auto sent = Family("gradwatch_notifications_sent_total", "Alert notifications delivered, by receiver.",
                     MetricType::Counter);
  auto retries = Family("gradwatch_notification_retries_total",
                        "Delivery attempts that failed recoverably (network, 5xx, 429) and were rescheduled.",
                        MetricType::Counter);
  auto failures = Family("gradwatch_notification_failures_total",
                         "Notifications given up: permanent failures, or still failing after the give-up time.",
                         MetricType::Counter);
  auto queue = Family("gradwatch_notification_queue_depth", "Notifications waiting in the outbox, by receiver.",
                      MetricType::Gauge);
  for (const notify::ReceiverStats& r : view.receivers) {
    Add(sent, {{"receiver", r.receiver}}, static_cast<double>(r.sent));
    Add(retries, {{"receiver", r.receiver}}, static_cast<double>(r.retries));
    Add(failures, {{"receiver", r.receiver}}, static_cast<double>(r.failures));
    Add(queue, {{"receiver", r.receiver}}, static_cast<double>(r.queue_depth));
  }
  std::vector<MetricFamily> out;
  for (auto* f : {&alerts, &transitions, &silences, &store_failures, &sent, &retries, &failures, &queue}) {
    out.push_back(std::move(*f));
  }
  return out;
}

}  // namespace gradwatch::exporter

#include "server/export/alert_metrics.h"

#include <map>
#include <string>

#include "server/export/text_format.h"

namespace gradwatch::exporter {
namespace {

// Appends one gradwatch_rule_bound sample per series the rule names (one without a series label
// for rules that name none).
void AppendRuleBound(std::string& out, const alerts::Rule& rule, std::string_view bound, double value,
                     std::string_view op = {}) {
  std::string labels;
  AppendLabel(labels, "alertname", rule.name, true);
  AppendLabel(labels, "kind", alerts::RuleKindName(rule.kind));
  const auto severity = rule.labels.find("severity");
  if (severity != rule.labels.end()) AppendLabel(labels, "severity", severity->second);
  AppendLabel(labels, "bound", bound);
  if (!op.empty()) AppendLabel(labels, "op", op);
  if (rule.series.empty()) {
    AppendSample(out, "gradwatch_rule_bound", labels, value);
    return;
  }
  for (const std::string& series : rule.series) {
    std::string with_series = labels;
    AppendLabel(with_series, "series", series);
    AppendSample(out, "gradwatch_rule_bound", with_series, value);
  }
}

void AppendRuleBounds(std::string& out, const std::vector<alerts::Rule>& rules) {
  AppendFamilyHeader(
      out, "gradwatch_rule_bound",
      "A bound of an alert rule in force (overrides applied): bound=\"value\" is a threshold rule's "
      "(with its op), \"threshold\" a forecast's, \"clear_below\"/\"clear_above\" where a firing "
      "alert clears, \"min_share\", \"min_amplification\", \"min_growth\", \"min_ratio\", \"max_departure\".",
      MetricType::kGauge);
  for (const alerts::Rule& r : rules) {
    switch (r.kind) {
      case alerts::RuleKind::kThreshold:
        AppendRuleBound(out, r, "value", r.value, alerts::CompareOpSymbol(r.op));
        break;
      case alerts::RuleKind::kForecast: AppendRuleBound(out, r, "threshold", r.threshold); break;
      case alerts::RuleKind::kSlopeChange: AppendRuleBound(out, r, "min_ratio", r.min_ratio); break;
      case alerts::RuleKind::kShare: AppendRuleBound(out, r, "min_share", r.min_share); break;
      case alerts::RuleKind::kGrowthWithoutDecay:
        if (r.min_amplification) AppendRuleBound(out, r, "min_amplification", *r.min_amplification);
        if (r.min_growth) AppendRuleBound(out, r, "min_growth", *r.min_growth);
        break;
      case alerts::RuleKind::kRemediation: AppendRuleBound(out, r, "max_departure", r.max_departure); break;
      case alerts::RuleKind::kNonFinite:
      case alerts::RuleKind::kStalled:
      case alerts::RuleKind::kRunDied: break;
    }
    if (r.clear_below) AppendRuleBound(out, r, "clear_below", *r.clear_below);
    if (r.clear_above) AppendRuleBound(out, r, "clear_above", *r.clear_above);
  }
}

}  // namespace

void AlertMetricsCollector::Render(Exposition& exposition) const {
  const AlertingView view = view_();
  std::string& out = exposition.NewChunk();
  AppendFamilyHeader(out, "gradwatch_alerts",
                     "Alerts pending or firing: 1 per alert, with its labels and alertstate (as Prometheus's ALERTS).",
                     MetricType::kGauge);
  std::string labels;
  static const std::map<std::string, std::string> kNoLabels;
  for (const alerts::Alert& a : view.active) {
    labels.clear();
    AppendLabel(labels, "alertname", a.name, true);
    AppendLabel(labels, "alertstate", alerts::AlertStateName(a.state));
    const auto run = a.labels.find("run");
    const auto of_run = run == a.labels.end() ? view.run_labels.end() : view.run_labels.find(run->second);
    const auto& run_labels = of_run == view.run_labels.end() ? kNoLabels : of_run->second;
    for (const auto& [name, value] : a.labels) {
      if (name == "alertname" || name == "alertstate" || name == "run") {
        if (name == "run") AppendLabel(labels, name, value);
        continue;
      }
      const auto inherited = run_labels.find(name);
      if (inherited != run_labels.end() && inherited->second == value) continue;
      AppendLabel(labels, name, value);
    }
    AppendSample(out, "gradwatch_alerts", labels, 1);
  }
  AppendFamilyHeader(out, "gradwatch_alert_transitions_total",
                     "Alerts that started firing, and that resolved, since the daemon started.", MetricType::kCounter);
  AppendSample(out, "gradwatch_alert_transitions_total", {{"to", "firing"}},
               static_cast<double>(view.firing_transitions));
  AppendSample(out, "gradwatch_alert_transitions_total", {{"to", "resolved"}},
               static_cast<double>(view.resolved_transitions));
  AppendFamilyHeader(out, "gradwatch_silences", "Silences that have not ended (including ones that start later).",
                     MetricType::kGauge);
  AppendSample(out, "gradwatch_silences", std::string_view(), static_cast<double>(view.silences));
  AppendFamilyHeader(out, "gradwatch_alert_store_write_failures_total",
                     "Failed writes of alert states and notifications to the journal's database (retried).",
                     MetricType::kCounter);
  AppendSample(out, "gradwatch_alert_store_write_failures_total", std::string_view(),
               static_cast<double>(view.store_write_failures));

  AppendRuleBounds(out, view.rules);

  struct ReceiverFamily {
    const char* name;
    const char* help;
    MetricType type;
    uint64_t notify::ReceiverStats::*value;
  };
  static constexpr ReceiverFamily kReceiverFamilies[] = {
      {"gradwatch_notifications_sent_total", "Alert notifications delivered, by receiver.", MetricType::kCounter,
       &notify::ReceiverStats::sent},
      {"gradwatch_notification_retries_total",
       "Delivery attempts that failed recoverably (network, 5xx, 429) and were rescheduled.", MetricType::kCounter,
       &notify::ReceiverStats::retries},
      {"gradwatch_notification_failures_total",
       "Notifications given up: permanent failures, or still failing after the give-up time.", MetricType::kCounter,
       &notify::ReceiverStats::failures},
      {"gradwatch_notification_queue_depth", "Notifications waiting in the outbox, by receiver.", MetricType::kGauge,
       &notify::ReceiverStats::queue_depth},
  };
  for (const ReceiverFamily& f : kReceiverFamilies) {
    AppendFamilyHeader(out, f.name, f.help, f.type);
    for (const notify::ReceiverStats& r : view.receivers) {
      AppendSample(out, f.name, {{"receiver", r.receiver}}, static_cast<double>(r.*f.value));
    }
  }
}

}  // namespace gradwatch::exporter

#include <catch2/catch.hpp>

#include <map>
#include <string>

#include <prometheus/text_serializer.h>

#include "server/export/alert_metrics.h"

using namespace gradwatch;

namespace {

const prometheus::MetricFamily& FamilyNamed(const std::vector<prometheus::MetricFamily>& families,
                                            const std::string& name) {
  for (const auto& f : families) {
    if (f.name == name) return f;
  }
  FAIL("no family " << name);
  throw std::logic_error("unreachable");
}

std::map<std::string, std::string> Labels(const prometheus::ClientMetric& m) {
  std::map<std::string, std::string> out;
  for (const auto& l : m.label) out[l.name] = l.value;
  return out;
}

alerts::Alert MakeAlert(const std::string& name, alerts::AlertState state, const std::string& run) {
  alerts::Alert a;
  a.name = name;
  a.state = state;
  a.labels = {{"alertname", name}, {"run", run}, {"severity", "page"}};
  return a;
}

}  // namespace

TEST_CASE("alerting metrics: one ALERTS-shaped sample per active alert, receiver counters", "[export]") {
  exporter::AlertingView view;
  view.active = {MakeAlert("GradNormContingency", alerts::AlertState::kFiring, "r1"),
                 MakeAlert("GradNormForecast", alerts::AlertState::kPending, "r2")};
  view.silences = 2;
  view.firing_transitions = 3;
  view.resolved_transitions = 1;
  view.store_write_failures = 4;
  notify::ReceiverStats am;
  am.receiver = "am";
  am.sent = 7;
  am.retries = 2;
  am.failures = 1;
  am.queue_depth = 5;
  view.receivers = {am};
  exporter::AlertMetricsCollector collector([&] { return view; });
  const auto families = collector.Collect();

  const auto& alerts = FamilyNamed(families, "gradwatch_alerts");
  REQUIRE(alerts.metric.size() == 2);
  CHECK(Labels(alerts.metric[0]) == std::map<std::string, std::string>{{"alertname", "GradNormContingency"},
                                                                       {"alertstate", "firing"},
                                                                       {"run", "r1"},
                                                                       {"severity", "page"}});
  CHECK(alerts.metric[0].gauge.value == 1);
  CHECK(Labels(alerts.metric[1]).at("alertstate") == "pending");

  const auto& transitions = FamilyNamed(families, "gradwatch_alert_transitions_total");
  REQUIRE(transitions.metric.size() == 2);
  CHECK(Labels(transitions.metric[0]).at("to") == "firing");
  CHECK(transitions.metric[0].counter.value == 3);
  CHECK(transitions.metric[1].counter.value == 1);
  CHECK(FamilyNamed(families, "gradwatch_silences").metric[0].gauge.value == 2);
  CHECK(FamilyNamed(families, "gradwatch_alert_store_write_failures_total").metric[0].counter.value == 4);
  CHECK(FamilyNamed(families, "gradwatch_notifications_sent_total").metric[0].counter.value == 7);
  CHECK(Labels(FamilyNamed(families, "gradwatch_notifications_sent_total").metric[0]).at("receiver") == "am");
  CHECK(FamilyNamed(families, "gradwatch_notification_retries_total").metric[0].counter.value == 2);
  CHECK(FamilyNamed(families, "gradwatch_notification_failures_total").metric[0].counter.value == 1);
  CHECK(FamilyNamed(families, "gradwatch_notification_queue_depth").metric[0].gauge.value == 5);

  const std::string text = prometheus::TextSerializer().Serialize(families);
  CHECK(text.find("gradwatch_alerts{alertname=\"GradNormContingency\",alertstate=\"firing\",run=\"r1\","
                  "severity=\"page\"} 1") != std::string::npos);
}

TEST_CASE("alerting metrics with nothing active still expose the counters", "[export]") {
  exporter::AlertMetricsCollector collector([] { return exporter::AlertingView{}; });
  const auto families = collector.Collect();
  CHECK(FamilyNamed(families, "gradwatch_alerts").metric.empty());
  CHECK(FamilyNamed(families, "gradwatch_alert_transitions_total").metric.size() == 2);
  CHECK(FamilyNamed(families, "gradwatch_notifications_sent_total").metric.empty());
}

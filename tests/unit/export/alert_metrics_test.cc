#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "server/export/alert_metrics.h"
#include "tests/integration/daemon_process.h"
#include "tests/unit/export/exposition_checks.h"

using namespace gradwatch;

namespace {

using Samples = std::vector<testing::MetricSample>;

Samples Render(const exporter::AlertMetricsCollector& collector) {
  exporter::Exposition out;
  collector.Render(out);
  const std::string text = out.Text();
  CheckFamiliesContiguous(text);
  CheckWithPromtool(text);
  return testing::ParseExposition(text);
}

Samples Named(const Samples& samples, const std::string& name) {
  Samples out;
  for (const auto& s : samples) {
    if (s.name == name) out.push_back(s);
  }
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
  const Samples samples = Render(collector);

  const Samples alerts = Named(samples, "gradwatch_alerts");
  REQUIRE(alerts.size() == 2);
  CHECK(alerts[0].labels ==
        std::map<std::string, std::string>{
            {"alertname", "GradNormContingency"}, {"alertstate", "firing"}, {"run", "r1"}, {"severity", "page"}});
  CHECK(alerts[0].value == 1);
  CHECK(alerts[1].labels.at("alertstate") == "pending");

  const Samples transitions = Named(samples, "gradwatch_alert_transitions_total");
  REQUIRE(transitions.size() == 2);
  CHECK(transitions[0].labels.at("to") == "firing");
  CHECK(transitions[0].value == 3);
  CHECK(transitions[1].value == 1);
  CHECK(Named(samples, "gradwatch_silences").at(0).value == 2);
  CHECK(Named(samples, "gradwatch_alert_store_write_failures_total").at(0).value == 4);
  CHECK(Named(samples, "gradwatch_notifications_sent_total").at(0).value == 7);
  CHECK(Named(samples, "gradwatch_notifications_sent_total").at(0).labels.at("receiver") == "am");
  CHECK(Named(samples, "gradwatch_notification_retries_total").at(0).value == 2);
  CHECK(Named(samples, "gradwatch_notification_failures_total").at(0).value == 1);
  CHECK(Named(samples, "gradwatch_notification_queue_depth").at(0).value == 5);

  exporter::Exposition out;
  collector.Render(out);
  CHECK(out.Text().find("gradwatch_alerts{alertname=\"GradNormContingency\",alertstate=\"firing\",run=\"r1\","
                        "severity=\"page\"} 1\n") != std::string::npos);
}

TEST_CASE("alerting metrics with nothing active still expose the counters", "[export]") {
  exporter::AlertMetricsCollector collector([] { return exporter::AlertingView{}; });
  exporter::Exposition out;
  collector.Render(out);
  CHECK(out.Text().find("# TYPE gradwatch_alerts gauge\n") != std::string::npos);
  const Samples samples = Render(collector);
  CHECK(Named(samples, "gradwatch_alerts").empty());
  CHECK(Named(samples, "gradwatch_alert_transitions_total").size() == 2);
  CHECK(Named(samples, "gradwatch_notifications_sent_total").empty());
}

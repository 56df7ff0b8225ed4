#include "alerts/notify/payloads.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

using gradwatch::alerts::Alert;
using gradwatch::alerts::AlertState;
using gradwatch::alerts::FingerprintHex;
using gradwatch::alerts::LabelSet;
using nlohmann::json;
namespace notify = gradwatch::notify;

namespace {

constexpr double kNow = 1'800'000'000.5;  // 2027-01-15T08:00:00.500Z

Alert ContingencyAlert(AlertState state = AlertState::kFiring) {
  Alert alert;
  alert.name = "GradNormContingency";
  alert.state = state;
  alert.labels = {{"alertname", "GradNormContingency"}, {"run", "moe-incident-demo"}, {"severity", "page"}};
  alert.annotations = {{"summary", "total grad norm 5.02 at step 81726"},
                       {"recommendation", "enable weight decay 0.1 on final_norm.weight (wd 0, ×4.92 its init norm)"}};
  alert.step = 81726;
  alert.value = 5.02;
  alert.starts_at = 1'799'999'000.0;
  if (state == AlertState::kResolved) alert.ends_at = 1'799'999'900.125;
  return alert;
}

}  // namespace

TEST_CASE("timestamps are RFC 3339 in UTC with milliseconds", "[notify]") {
  CHECK(notify::FormatRfc3339(0) == "1970-01-01T00:00:00.000Z");
  CHECK(notify::FormatRfc3339(1'700'000'000.25) == "2023-11-14T22:13:20.250Z");
  CHECK(notify::FormatRfc3339(1'700'000'000.9996) == "2023-11-14T22:13:21.000Z");
  CHECK(notify::FormatRfc3339(kNow) == "2027-01-15T08:00:00.500Z");
}

TEST_CASE("generatorURL points at the run under the external URL", "[notify]") {
  Alert alert = ContingencyAlert();
  CHECK(notify::GeneratorUrl(notify::kDefaultExternalUrl, alert) == "http://127.0.0.1:9390/runs/moe-incident-demo");
  CHECK(notify::GeneratorUrl("https://gw.example/", alert) == "https://gw.example/runs/moe-incident-demo");
  alert.labels["run"] = "a b/c";
  CHECK(notify::GeneratorUrl("https://gw.example", alert) == "https://gw.example/runs/a%20b%2Fc");
  alert.labels.erase("run");
  CHECK(notify::GeneratorUrl("https://gw.example", alert) == "https://gw.example");
}

TEST_CASE("alertmanager firing alert ends 4 resend intervals from now", "[notify]") {
  const json body =
      json::parse(notify::AlertmanagerBody({ContingencyAlert()}, AlertState::kFiring, kNow, 60, "http://gw:9390"));
  REQUIRE(body.is_array());
  REQUIRE(body.size() == 1);
  const json& a = body[0];
  CHECK(a.at("endsAt") == notify::FormatRfc3339(kNow + 240));
  CHECK(a.at("endsAt") == "2027-01-15T08:04:00.500Z");
  CHECK(a.at("startsAt") == "2027-01-15T07:43:20.000Z");
  CHECK(a.at("generatorURL") == "http://gw:9390/runs/moe-incident-demo");
  CHECK(a.at("labels").at("alertname") == "GradNormContingency");
  CHECK(a.at("labels").at("severity") == "page");
  CHECK(a.at("annotations").at("recommendation").get<std::string>().find("weight decay") != std::string::npos);
  CHECK(a.size() == 5);
}

TEST_CASE("alertmanager resolved alert carries its real end time", "[notify]") {
  const json body = json::parse(notify::AlertmanagerBody({ContingencyAlert(AlertState::kResolved)},
                                                         AlertState::kResolved, kNow, 60, "http://gw"));
  CHECK(body[0].at("endsAt") == "2027-01-15T07:58:20.125Z");

  Alert unset_end = ContingencyAlert(AlertState::kResolved);
  unset_end.ends_at = 0;
  const json fallback =
      json::parse(notify::AlertmanagerBody({unset_end}, AlertState::kResolved, kNow, 60, "http://gw"));
  CHECK(fallback[0].at("endsAt") == notify::FormatRfc3339(kNow));
}

TEST_CASE("alertmanager labels always carry alertname", "[notify]") {
  Alert alert = ContingencyAlert();
  alert.labels.erase("alertname");
  const json body = json::parse(notify::AlertmanagerBody({alert}, AlertState::kFiring, kNow, 60, "http://gw"));
  CHECK(body[0].at("labels").at("alertname") == "GradNormContingency");
  CHECK(notify::NotifiedFingerprint(alert) == FingerprintHex(ContingencyAlert().labels));
}

TEST_CASE("webhook body has the alertmanager webhook shape", "[notify]") {
  Alert other = ContingencyAlert();
  other.labels["severity"] = "warning";
  other.annotations["summary"] = "something else";
  const json body = json::parse(notify::WebhookBody({ContingencyAlert(), other}, AlertState::kFiring, kNow,
                                                    "ops-webhook", "http://gw:9390/", {"alertname", "run"}));
  CHECK(body.at("version") == "4");
  CHECK(body.at("status") == "firing");
  CHECK(body.at("receiver") == "ops-webhook");
  CHECK(body.at("externalURL") == "http://gw:9390");
  CHECK(body.at("groupLabels") == json({{"alertname", "GradNormContingency"}, {"run", "moe-incident-demo"}}));
  CHECK(body.at("groupKey") == "{}:{alertname=\"GradNormContingency\", run=\"moe-incident-demo\"}");
  CHECK(body.at("commonLabels") == json({{"alertname", "GradNormContingency"}, {"run", "moe-incident-demo"}}));
  CHECK(body.at("commonAnnotations").contains("recommendation"));
  CHECK_FALSE(body.at("commonAnnotations").contains("summary"));
  REQUIRE(body.at("alerts").size() == 2);
  const json& first = body.at("alerts")[0];
  CHECK(first.at("status") == "firing");
  CHECK(first.at("fingerprint") == FingerprintHex(ContingencyAlert().labels));
  CHECK(first.at("startsAt") == "2027-01-15T07:43:20.000Z");
  CHECK(first.at("endsAt") == "0001-01-01T00:00:00Z");
  CHECK(first.at("generatorURL") == "http://gw:9390/runs/moe-incident-demo");
  CHECK(first.at("labels").at("severity") == "page");
  CHECK(body.at("alerts")[1].at("fingerprint") == FingerprintHex(other.labels));
}

TEST_CASE("webhook resolved body says resolved and gives the end time", "[notify]") {
  const json body = json::parse(notify::WebhookBody({ContingencyAlert(AlertState::kResolved)}, AlertState::kResolved,
                                                    kNow, "hook", "http://gw", {"alertname"}));
  CHECK(body.at("status") == "resolved");
  CHECK(body.at("alerts")[0].at("status") == "resolved");
  CHECK(body.at("alerts")[0].at("endsAt") == "2027-01-15T07:58:20.125Z");
  CHECK(body.at("groupLabels") == json({{"alertname", "GradNormContingency"}}));
}

TEST_CASE("pagerduty severity is mapped from the severity label", "[notify]") {
  const std::vector<std::pair<std::string, std::string>> cases = {{"page", "critical"},     {"warning", "warning"},
                                                                  {"critical", "critical"}, {"error", "error"},
                                                                  {"info", "info"},         {"ticket", "info"}};
  for (const auto& [label, expected] : cases) {
    INFO("severity label " << label);
    CHECK(notify::PagerDutySeverity({{"severity", label}}) == expected);
  }
  CHECK(notify::PagerDutySeverity({}) == "info");
}

TEST_CASE("pagerduty trigger carries the fingerprint as dedup_key and the details", "[notify]") {
  const Alert alert = ContingencyAlert();
  const json body = json::parse(notify::PagerDutyBody(alert, AlertState::kFiring, "rk-123", "http://gw"));
  CHECK(body.at("routing_key") == "rk-123");
  CHECK(body.at("event_action") == "trigger");
  CHECK(body.at("dedup_key") == FingerprintHex(alert.labels));
  const json& payload = body.at("payload");
  CHECK(payload.at("summary") == "total grad norm 5.02 at step 81726");
  CHECK(payload.at("source") == "moe-incident-demo");
  CHECK(payload.at("severity") == "critical");
  CHECK(payload.at("timestamp") == "2027-01-15T07:43:20.000Z");
  CHECK(payload.at("custom_details").at("labels").at("run") == "moe-incident-demo");
  CHECK(payload.at("custom_details").at("annotations").at("recommendation") == alert.annotations.at("recommendation"));
  CHECK(payload.at("custom_details").at("step") == 81726);
  CHECK(body.at("client_url") == "http://gw/runs/moe-incident-demo");
}

TEST_CASE("pagerduty resolve carries only routing_key, event_action and dedup_key", "[notify]") {
  const Alert alert = ContingencyAlert(AlertState::kResolved);
  const json body = json::parse(notify::PagerDutyBody(alert, AlertState::kResolved, "rk-123", "http://gw"));
  CHECK(body ==
        json({{"routing_key", "rk-123"}, {"event_action", "resolve"}, {"dedup_key", FingerprintHex(alert.labels)}}));
}

TEST_CASE("slack message gives summary, run, step, value and the recommendation", "[notify]") {
  const Alert alert = ContingencyAlert();
  const json body = json::parse(notify::SlackBody({alert}, AlertState::kFiring, "http://gw"));
  const std::string text = body.at("text");
  CHECK(text.find("[FIRING] GradNormContingency") != std::string::npos);
  CHECK(text.find("moe-incident-demo") != std::string::npos);
  CHECK(text.find("step 81726") != std::string::npos);
  CHECK(text.find("value 5.02") != std::string::npos);
  CHECK(text.find("total grad norm 5.02 at step 81726") != std::string::npos);
  CHECK(text.find(alert.annotations.at("recommendation")) != std::string::npos);
  REQUIRE(body.at("blocks").is_array());
  CHECK(body.at("blocks").dump().find("*Recommendation*") != std::string::npos);
  CHECK(body.at("blocks")[0].at("type") == "header");
}

TEST_CASE("slack resolved message says resolved", "[notify]") {
  const json body =
      json::parse(notify::SlackBody({ContingencyAlert(AlertState::kResolved)}, AlertState::kResolved, "http://gw"));
  const std::string text = body.at("text");
  CHECK(text.rfind("[RESOLVED] GradNormContingency", 0) == 0);
  CHECK(text.find("resolved at step 81726") != std::string::npos);
  CHECK(text.find("FIRING") == std::string::npos);
}

TEST_CASE("slack text escapes mrkdwn control characters", "[notify]") {
  Alert alert = ContingencyAlert();
  alert.annotations["summary"] = "norm <5 & rising> ";
  const json body = json::parse(notify::SlackBody({alert}, AlertState::kFiring, "http://gw"));
  CHECK(body.at("text").get<std::string>().find("norm &lt;5 &amp; rising&gt;") != std::string::npos);
}

TEST_CASE("non-finite values and invalid UTF-8 never break a payload", "[notify]") {
  Alert alert = ContingencyAlert();
  alert.value = std::numeric_limits<double>::quiet_NaN();
  alert.annotations["summary"] = std::string("bad \xff byte");
  const json pd = json::parse(notify::PagerDutyBody(alert, AlertState::kFiring, "rk", "http://gw"));
  CHECK(pd.at("payload").at("custom_details").at("value") == "NaN");
  const json slack = json::parse(notify::SlackBody({alert}, AlertState::kFiring, "http://gw"));
  CHECK(slack.at("text").get<std::string>().find("value NaN") != std::string::npos);
  CHECK(notify::FormatValue(std::numeric_limits<double>::infinity()) == "+Inf");
  CHECK(notify::FormatValue(-std::numeric_limits<double>::infinity()) == "-Inf");
}

TEST_CASE("an alert survives the outbox JSON round trip", "[notify]") {
  Alert alert = ContingencyAlert(AlertState::kResolved);
  alert.value = -std::numeric_limits<double>::infinity();
  auto back = notify::AlertFromJson(notify::AlertToJson(alert));
  REQUIRE(back.ok());
  CHECK(back->name == alert.name);
  CHECK(back->state == AlertState::kResolved);
  CHECK(back->labels == alert.labels);
  CHECK(back->annotations == alert.annotations);
  CHECK(back->step == alert.step);
  CHECK(std::isinf(back->value));
  CHECK(back->value < 0);
  CHECK(back->starts_at == alert.starts_at);
  CHECK(back->ends_at == alert.ends_at);

  CHECK_FALSE(notify::AlertFromJson("not json").ok());
  CHECK_FALSE(notify::AlertFromJson(R"({"labels": 3})").ok());
}

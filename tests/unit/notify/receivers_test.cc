#include "alerts/notify/receivers.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using gradwatch::alerts::Alert;
using gradwatch::alerts::AlertState;
using nlohmann::json;
namespace notify = gradwatch::notify;

namespace {

notify::ReceiverConfig Config(std::string url) {
  notify::ReceiverConfig config;
  config.name = "r";
  config.url = std::move(url);
  return config;
}

Alert FiringAlert() {
  Alert alert;
  alert.name = "GradNormContingency";
  alert.state = AlertState::kFiring;
  alert.labels = {{"alertname", "GradNormContingency"}, {"run", "r1"}, {"severity", "page"}};
  alert.annotations = {{"summary", "s"}, {"recommendation", "enable weight decay on final_norm"}};
  alert.starts_at = 1000;
  return alert;
}

notify::HttpResult Response(int status) {
  notify::HttpResult result;
  result.status = status;
  return result;
}

notify::HttpResult NoResponse(notify::HttpResult::Error error) {
  notify::HttpResult result;
  result.error = error;
  result.message = "x";
  return result;
}

std::string Header(const notify::HttpRequest& request, const std::string& name) {
  for (const auto& [n, v] : request.headers) {
    if (n == name) return v;
  }
  return {};
}

}  // namespace

TEST_CASE("classify: 2xx delivered, 408/429/5xx and no answer retried, other 4xx permanent", "[notify]") {
  const notify::SlackReceiver receiver({Config("http://127.0.0.1:1/hook")});
  using notify::Outcome;
  using Error = notify::HttpResult::Error;
  const std::vector<std::pair<int, Outcome>> statuses = {{200, Outcome::kDelivered},
                                                         {202, Outcome::kDelivered},
                                                         {204, Outcome::kDelivered},
                                                         {301, Outcome::kPermanentFailure},
                                                         {400, Outcome::kPermanentFailure},
                                                         {401, Outcome::kPermanentFailure},
                                                         {404, Outcome::kPermanentFailure},
                                                         {408, Outcome::kRetry},
                                                         {429, Outcome::kRetry},
                                                         {500, Outcome::kRetry},
                                                         {502, Outcome::kRetry},
                                                         {503, Outcome::kRetry}};
  for (const auto& [status, expected] : statuses) {
    INFO("HTTP " << status);
    CHECK(receiver.Classify(Response(status)) == expected);
  }
  CHECK(receiver.Classify(NoResponse(Error::kNetwork)) == Outcome::kRetry);
  CHECK(receiver.Classify(NoResponse(Error::kTimeout)) == Outcome::kRetry);
  CHECK(receiver.Classify(NoResponse(Error::kTls)) == Outcome::kRetry);
  CHECK(receiver.Classify(NoResponse(Error::kInvalidRequest)) == Outcome::kPermanentFailure);
}

TEST_CASE("alertmanager receiver posts to /api/v2/alerts with its resend interval", "[notify]") {
  notify::AlertmanagerConfig config{Config("http://127.0.0.1:9093/"), 30};
  config.receiver.external_url = "http://gw:1";
  const notify::AlertmanagerReceiver receiver(config);
  CHECK(receiver.resend_interval_seconds() == 30);
  const auto request = receiver.Build({FiringAlert()}, AlertState::kFiring, 2000);
  CHECK(request.method == "POST");
  CHECK(request.url == "http://127.0.0.1:9093/api/v2/alerts");
  const json body = json::parse(request.body);
  CHECK(body[0].at("endsAt") == notify::FormatRfc3339(2000 + 120));
  CHECK(body[0].at("generatorURL") == "http://gw:1/runs/r1");

  const notify::AlertmanagerReceiver full({Config("http://am:9093/api/v2/alerts"), 30});
  CHECK(full.Build({FiringAlert()}, AlertState::kFiring, 2000).url == "http://am:9093/api/v2/alerts");
}

TEST_CASE("webhook receiver sends its headers and the bearer token", "[notify]") {
  notify::WebhookConfig config{Config("http://127.0.0.1:8080/hook"), "s3cret", {"alertname"}};
  config.receiver.headers = {{"X-Team", "training"}};
  const notify::WebhookReceiver receiver(config);
  const auto request = receiver.Build({FiringAlert()}, AlertState::kFiring, 2000);
  CHECK(request.url == "http://127.0.0.1:8080/hook");
  CHECK(Header(request, "Authorization") == "Bearer s3cret");
  CHECK(Header(request, "X-Team") == "training");
  CHECK(json::parse(request.body).at("receiver") == "r");
  CHECK(receiver.resend_interval_seconds() == 0);
}

TEST_CASE("pagerduty receiver defaults to the events API URL", "[notify]") {
  const notify::PagerDutyReceiver receiver({Config(""), "rk"});
  const auto request = receiver.Build({FiringAlert()}, AlertState::kResolved, 2000);
  CHECK(request.url == "https://events.pagerduty.com/v2/enqueue");
  CHECK(json::parse(request.body).at("event_action") == "resolve");
}

TEST_CASE("receivers accept only alerts matching their labels", "[notify]") {
  notify::ReceiverConfig config = Config("http://127.0.0.1:1/");
  config.match = {{"severity", "page"}};
  const notify::SlackReceiver pages_only({config});
  Alert alert = FiringAlert();
  CHECK(pages_only.Accepts(alert));
  alert.labels["severity"] = "warning";
  CHECK_FALSE(pages_only.Accepts(alert));
  alert.labels.erase("severity");
  CHECK_FALSE(pages_only.Accepts(alert));

  config.match = {{"alertname", "GradNormContingency"}};
  const notify::SlackReceiver by_name({config});
  alert.labels.erase("alertname");
  CHECK(by_name.Accepts(alert));
  CHECK(notify::SlackReceiver({Config("http://x/")}).Accepts(alert));
}

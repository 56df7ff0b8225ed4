#include "alerts/notify/receivers.h"

namespace gradwatch::notify {

std::string_view OutcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::kDelivered: return "delivered";
    case Outcome::kRetry: return "retry";
    case Outcome::kPermanentFailure: return "permanent_failure";
  }
  return "permanent_failure";
}

bool Receiver::Accepts(const Alert& alert) const {
  for (const auto& [name, value] : config_.match) {
    auto it = alert.labels.find(name);
    const bool is_alertname = name == "alertname" && it == alert.labels.end();
    if (is_alertname ? alert.name != value : (it == alert.labels.end() || it->second != value)) {
      return false;
    }
  }
  return true;
}

Outcome Receiver::Classify(const HttpResult& result) const {
  if (!result.has_response()) {
    // A request that cannot even be formed will not get better by waiting.
    return result.error == HttpResult::Error::kInvalidRequest ? Outcome::kPermanentFailure : Outcome::kRetry;
  }
  if (result.status >= 200 && result.status < 300) return Outcome::kDelivered;
  if (result.status == 408 || result.status == 429 || result.status >= 500) return Outcome::kRetry;
  return Outcome::kPermanentFailure;
}

HttpRequest Receiver::MakeRequest(std::string url, std::string body) const {
  HttpRequest request;
  request.method = "POST";
  request.url = std::move(url);
  request.headers = config_.headers;
  request.body = std::move(body);
  return request;
}

namespace {

std::string AlertmanagerAlertsUrl(std::string base) {
  constexpr std::string_view kPath = "/api/v2/alerts";
  while (!base.empty() && base.back() == '/') base.pop_back();
  if (base.size() >= kPath.size() && base.compare(base.size() - kPath.size(), kPath.size(), kPath) == 0) {
    return base;
  }
  return base + std::string(kPath);
}

ReceiverConfig WithBearer(ReceiverConfig config, const std::string& token) {
  if (!token.empty()) config.headers.emplace_back("Authorization", "Bearer " + token);
  return config;
}

ReceiverConfig WithDefaultUrl(ReceiverConfig config, std::string_view url) {
  if (config.url.empty()) config.url = std::string(url);
  return config;
}

}  // namespace

AlertmanagerReceiver::AlertmanagerReceiver(AlertmanagerConfig config)
    : Receiver(std::move(config.receiver)), resend_interval_seconds_(config.resend_interval_seconds) {}

HttpRequest AlertmanagerReceiver::Build(const std::vector<Alert>& alerts, AlertState state, double now) const {
  return MakeRequest(AlertmanagerAlertsUrl(config().url),
                     AlertmanagerBody(alerts, state, now, resend_interval_seconds_, config().external_url));
}

WebhookReceiver::WebhookReceiver(WebhookConfig config)
    : Receiver(WithBearer(std::move(config.receiver), config.bearer_token)), group_by_(std::move(config.group_by)) {}

HttpRequest WebhookReceiver::Build(const std::vector<Alert>& alerts, AlertState state, double now) const {
  return MakeRequest(config().url, WebhookBody(alerts, state, now, name(), config().external_url, group_by_));
}

PagerDutyReceiver::PagerDutyReceiver(PagerDutyConfig config)
    : Receiver(WithDefaultUrl(std::move(config.receiver), kPagerDutyEventsUrl)),
      routing_key_(std::move(config.routing_key)) {}

HttpRequest PagerDutyReceiver::Build(const std::vector<Alert>& alerts, AlertState state, double now) const {
  const Alert empty;
  return MakeRequest(
      config().url, PagerDutyBody(alerts.empty() ? empty : alerts.front(), state, routing_key_, config().external_url));
}

SlackReceiver::SlackReceiver(SlackConfig config) : Receiver(std::move(config.receiver)) {}

HttpRequest SlackReceiver::Build(const std::vector<Alert>& alerts, AlertState state, double now) const {
  return MakeRequest(config().url, SlackBody(alerts, state, config().external_url));
}

}  // namespace gradwatch::notify

// Receivers turn alert state changes into HTTP requests and judge the answers. They hold no
// connection and no state beyond their configuration: Build() and Classify() are pure and safe to
// call from any thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "alerts/alert.h"
#include "alerts/notify/http_client.h"
#include "alerts/notify/payloads.h"

namespace gradwatch::notify {

// What to do with an outbox entry after one attempt.
enum class Outcome {
  kDelivered,         // 2xx
  kRetry,             // network error, timeout, TLS failure, 408, 429 or 5xx: try again later
  kPermanentFailure,  // any other answer (e.g. 400): retrying would not help
};

std::string_view OutcomeName(Outcome outcome);

// Settings every receiver has.
struct ReceiverConfig {
  std::string name;        // unique among the dispatcher's receivers; the outbox keys entries by it
  std::string url;         // http:// or https://
  Headers headers;         // sent with every request (e.g. Authorization)
  LabelSet match;          // only alerts carrying all these labels (equal values) go here; empty: all
  HttpClientOptions http;  // TLS and the per-request timeout
  std::string external_url = std::string(kDefaultExternalUrl);  // base of generatorURL links
};

class Receiver {
 public:
  explicit Receiver(ReceiverConfig config) : config_(std::move(config)) {}
  virtual ~Receiver() = default;

  const std::string& name() const { return config_.name; }
  const ReceiverConfig& config() const { return config_; }

  // True when the alert's labels carry every label of config().match.
  bool Accepts(const Alert& alert) const;

  // The request announcing that alerts entered state (kFiring or kResolved), at time now
  // (seconds since the Unix epoch).
  virtual HttpRequest Build(const std::vector<Alert>& alerts, AlertState state, double now) const = 0;

  // Delivered (2xx), retry (no answer, 408, 429, 5xx) or permanent failure (anything else).
  virtual Outcome Classify(const HttpResult& result) const;

  // > 0: while an alert fires, it is sent again at this interval (Alertmanager forgets alerts
  // that are not refreshed). 0: each state change is sent once.
  virtual double resend_interval_seconds() const { return 0; }

 protected:
  HttpRequest MakeRequest(std::string url, std::string body) const;

 private:
  ReceiverConfig config_;
};

// Alertmanager API v2. config.url is Alertmanager's base URL (http://host:9093); requests go to
// <url>/api/v2/alerts.
struct AlertmanagerConfig {
  ReceiverConfig receiver;
  double resend_interval_seconds = 60;
};

class AlertmanagerReceiver final : public Receiver {
 public:
  explicit AlertmanagerReceiver(AlertmanagerConfig config);
  HttpRequest Build(const std::vector<Alert>& alerts, AlertState state, double now) const override;
  double resend_interval_seconds() const override { return resend_interval_seconds_; }

 private:
  double resend_interval_seconds_;
};

// A generic webhook receiving the Alertmanager webhook JSON shape. bearer_token, when set, is sent
// as "Authorization: Bearer <token>".
struct WebhookConfig {
  ReceiverConfig receiver;
  std::string bearer_token;
  std::vector<std::string> group_by = {"alertname", "run"};
};

class WebhookReceiver final : public Receiver {
 public:
  explicit WebhookReceiver(WebhookConfig config);
  HttpRequest Build(const std::vector<Alert>& alerts, AlertState state, double now) const override;

 private:
  std::vector<std::string> group_by_;
};

// PagerDuty Events API v2. config.url defaults to PagerDuty's enqueue endpoint when empty.
// PagerDuty takes one event per request: Build() renders alerts.front() only (the dispatcher
// always passes a single alert).
inline constexpr std::string_view kPagerDutyEventsUrl = "https://events.pagerduty.com/v2/enqueue";

struct PagerDutyConfig {
  ReceiverConfig receiver;
  std::string routing_key;  // the integration key of the PagerDuty service
};

class PagerDutyReceiver final : public Receiver {
 public:
  explicit PagerDutyReceiver(PagerDutyConfig config);
  HttpRequest Build(const std::vector<Alert>& alerts, AlertState state, double now) const override;

 private:
  std::string routing_key_;
};

// Slack incoming webhook; config.url is the webhook URL Slack issued.
struct SlackConfig {
  ReceiverConfig receiver;
};

class SlackReceiver final : public Receiver {
 public:
  explicit SlackReceiver(SlackConfig config);
  HttpRequest Build(const std::vector<Alert>& alerts, AlertState state, double now) const override;
};

}  // namespace gradwatch::notify

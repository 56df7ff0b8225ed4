#include "alerts/notify/payloads.h"

#include <cmath>
#include <cstdio>
#include <ctime>
#include <limits>
#include <nlohmann/json.hpp>

namespace gradwatch::notify {

using nlohmann::json;

namespace {

constexpr std::string_view kGoZeroTime = "0001-01-01T00:00:00Z";
// Slack: section text ≤ 3000 characters, header ≤ 150; PagerDuty: summary ≤ 1024.
constexpr size_t kSlackSectionMax = 3000;
constexpr size_t kSlackHeaderMax = 150;
constexpr size_t kPagerDutySummaryMax = 1024;
constexpr size_t kSlackMaxAlertsDetailed = 10;  // Slack takes at most 50 blocks

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

const char* StatusName(AlertState state) { return state == AlertState::kResolved ? "resolved" : "firing"; }

// Cuts s to at most max_bytes without splitting a UTF-8 sequence, marking the cut with "…".
std::string Truncate(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  constexpr std::string_view kEllipsis = "…";
  size_t cut = max_bytes > kEllipsis.size() ? max_bytes - kEllipsis.size() : 0;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return std::string(s.substr(0, cut)) + std::string(kEllipsis);
}

std::string Lookup(const LabelSet& set, std::string_view key) {
  auto it = set.find(std::string(key));
  return it == set.end() ? std::string() : it->second;
}

std::string AlertName(const Alert& alert) {
  return alert.name.empty() ? Lookup(alert.labels, "alertname") : alert.name;
}

std::string PercentEncode(std::string_view s) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    const bool alnum = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (alnum || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
    }
  }
  return out;
}

// Labels (or annotations) equal in every alert.
LabelSet Common(const std::vector<Alert>& alerts, const LabelSet Alert::*member, bool labels) {
  if (alerts.empty()) return {};
  LabelSet common = labels ? NotifiedLabels(alerts.front()) : alerts.front().*member;
  for (size_t i = 1; i < alerts.size(); ++i) {
    const LabelSet other = labels ? NotifiedLabels(alerts[i]) : alerts[i].*member;
    for (auto it = common.begin(); it != common.end();) {
      auto found = other.find(it->first);
      it = (found == other.end() || found->second != it->second) ? common.erase(it) : std::next(it);
    }
  }
  return common;
}

// Alertmanager's group key: the route ("{}" for the root) and the group labels.
std::string GroupKey(const LabelSet& group_labels) {
  std::string key = "{}:{";
  bool first = true;
  for (const auto& [name, value] : group_labels) {
    if (!first) key += ", ";
    first = false;
    key += name + "=\"";
    for (char c : value) {
      if (c == '"' || c == '\\') key.push_back('\\');
      key.push_back(c);
    }
    key += "\"";
  }
  return key + "}";
}

// Slack mrkdwn needs &, < and > escaped; everything else is literal.
std::string SlackEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

json ValueJson(double value) {
  if (std::isfinite(value)) return value;
  return FormatValue(value);
}

double ValueFromJson(const json& j) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) {
    const std::string s = j.get<std::string>();
    if (s == "+Inf" || s == "Inf") return std::numeric_limits<double>::infinity();
    if (s == "-Inf") return -std::numeric_limits<double>::infinity();
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace

LabelSet NotifiedLabels(const Alert& alert) {
  LabelSet labels = alert.labels;
  if (!alert.name.empty()) labels.emplace("alertname", alert.name);  // keeps an existing one
  return labels;
}

std::string NotifiedFingerprint(const Alert& alert) { return alerts::FingerprintHex(NotifiedLabels(alert)); }

std::string FormatRfc3339(double unix_seconds) {
  if (!std::isfinite(unix_seconds) || unix_seconds < 0) unix_seconds = 0;
  long long millis = std::llround(unix_seconds * 1000.0);
  std::time_t seconds = static_cast<std::time_t>(millis / 1000);
  int ms = static_cast<int>(millis % 1000);
  std::tm tm{};
  gmtime_r(&seconds, &tm);
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

std::string GeneratorUrl(std::string_view external_url, const Alert& alert) {
  std::string base(external_url);
  while (!base.empty() && base.back() == '/') base.pop_back();
  const std::string run = Lookup(alert.labels, "run");
  if (run.empty()) return base;
  return base + "/runs/" + PercentEncode(run);
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", value);
  return buf;
}

std::string AlertmanagerBody(const std::vector<Alert>& alerts, AlertState state, double now,
                             double resend_interval_seconds, std::string_view external_url) {
  json body = json::array();
  for (const Alert& alert : alerts) {
    const double starts_at = alert.starts_at > 0 ? alert.starts_at : now;
    double ends_at;
    if (state == AlertState::kResolved) {
      ends_at = alert.ends_at > 0 ? alert.ends_at : now;
    } else {
      ends_at = now + 4 * resend_interval_seconds;
    }
    body.push_back({{"labels", NotifiedLabels(alert)},
                    {"annotations", alert.annotations},
                    {"startsAt", FormatRfc3339(starts_at)},
                    {"endsAt", FormatRfc3339(ends_at)},
                    {"generatorURL", GeneratorUrl(external_url, alert)}});
  }
  return Dump(body);
}

std::string WebhookBody(const std::vector<Alert>& alerts, AlertState state, double now, std::string_view receiver,
                        std::string_view external_url, const std::vector<std::string>& group_by) {
  const LabelSet common_labels = Common(alerts, &Alert::labels, true);
  LabelSet group_labels;
  for (const std::string& name : group_by) {
    auto it = common_labels.find(name);
    if (it != common_labels.end()) group_labels.insert(*it);
  }
  json items = json::array();
  for (const Alert& alert : alerts) {
    const LabelSet labels = NotifiedLabels(alert);
    std::string ends_at(kGoZeroTime);
    if (state == AlertState::kResolved) {
      ends_at = FormatRfc3339(alert.ends_at > 0 ? alert.ends_at : now);
    }
    items.push_back({{"status", StatusName(state)},
                     {"labels", labels},
                     {"annotations", alert.annotations},
                     {"startsAt", FormatRfc3339(alert.starts_at > 0 ? alert.starts_at : now)},
                     {"endsAt", ends_at},
                     {"generatorURL", GeneratorUrl(external_url, alert)},
                     {"fingerprint", alerts::FingerprintHex(labels)}});
  }
  std::string external(external_url);
  while (!external.empty() && external.back() == '/') external.pop_back();
  const json body = {{"version", "4"},
                     {"groupKey", GroupKey(group_labels)},
                     {"truncatedAlerts", 0},
                     {"status", StatusName(state)},
                     {"receiver", receiver},
                     {"groupLabels", group_labels},
                     {"commonLabels", common_labels},
                     {"commonAnnotations", Common(alerts, &Alert::annotations, false)},
                     {"externalURL", external},
                     {"alerts", items}};
  return Dump(body);
}

std::string PagerDutySeverity(const LabelSet& labels) {
  const std::string severity = Lookup(labels, "severity");
  if (severity == "page" || severity == "critical") return "critical";
  if (severity == "warning") return "warning";
  if (severity == "error") return "error";
  return "info";
}

std::string PagerDutyBody(const Alert& alert, AlertState state, std::string_view routing_key,
                          std::string_view external_url) {
  const LabelSet labels = NotifiedLabels(alert);
  json body = {{"routing_key", routing_key},
               {"event_action", state == AlertState::kResolved ? "resolve" : "trigger"},
               {"dedup_key", alerts::FingerprintHex(labels)}};
  if (state == AlertState::kResolved) return Dump(body);

  std::string summary = Lookup(alert.annotations, kSummaryAnnotation);
  if (summary.empty()) summary = AlertName(alert);
  const std::string run = Lookup(labels, "run");
  body["payload"] = {{"summary", Truncate(summary, kPagerDutySummaryMax)},
                     {"source", run.empty() ? std::string("gradwatch") : run},
                     {"severity", PagerDutySeverity(labels)},
                     {"timestamp", FormatRfc3339(alert.starts_at)},
                     {"class", AlertName(alert)},
                     {"custom_details",
                      {{"labels", labels},
                       {"annotations", alert.annotations},
                       {"step", alert.step},
                       {"value", ValueJson(alert.value)}}}};
  body["client"] = "gradwatch";
  body["client_url"] = GeneratorUrl(external_url, alert);
  return Dump(body);
}

std::string SlackBody(const std::vector<Alert>& alerts, AlertState state, std::string_view external_url) {
  const bool resolved = state == AlertState::kResolved;
  const std::string tag = resolved ? "[RESOLVED]" : "[FIRING]";
  std::string text;
  json blocks = json::array();
  for (size_t i = 0; i < alerts.size(); ++i) {
    const Alert& alert = alerts[i];
    const std::string name = AlertName(alert);
    const std::string run = Lookup(alert.labels, "run");
    const std::string summary = Lookup(alert.annotations, kSummaryAnnotation);
    const std::string recommendation = Lookup(alert.annotations, kRecommendationAnnotation);
    const std::string severity = Lookup(alert.labels, "severity");
    const std::string step = std::to_string(alert.step);
    const std::string value = FormatValue(alert.value);
    const std::string url = GeneratorUrl(external_url, alert);

    std::string line = tag + " " + name;
    if (!run.empty()) line += " · run " + run;
    line += resolved ? " · resolved at step " + step : " · step " + step;
    line += " · value " + value;
    if (!text.empty()) text += "\n\n";
    text += SlackEscape(line);
    if (!summary.empty()) text += "\n" + SlackEscape(summary);
    if (!recommendation.empty()) text += "\nRecommendation: " + SlackEscape(recommendation);

    if (i >= kSlackMaxAlertsDetailed) continue;
    blocks.push_back({{"type", "header"},
                      {"text", {{"type", "plain_text"}, {"text", Truncate(tag + " " + name, kSlackHeaderMax)}}}});
    if (!summary.empty()) {
      blocks.push_back({{"type", "section"},
                        {"text", {{"type", "mrkdwn"}, {"text", Truncate(SlackEscape(summary), kSlackSectionMax)}}}});
    }
    json fields = json::array();
    auto field = [&](std::string_view label, const std::string& v) {
      fields.push_back(
          {{"type", "mrkdwn"}, {"text", Truncate("*" + std::string(label) + "*\n" + SlackEscape(v), 2000)}});
    };
    field("Run", run.empty() ? "-" : run);
    field(resolved ? "Resolved at step" : "Step", step);
    field("Value", value);
    field("Severity", severity.empty() ? "-" : severity);
    blocks.push_back({{"type", "section"}, {"fields", fields}});
    if (!recommendation.empty()) {
      blocks.push_back({{"type", "section"},
                        {"text",
                         {{"type", "mrkdwn"},
                          {"text", Truncate("*Recommendation*\n" + SlackEscape(recommendation), kSlackSectionMax)}}}});
    }
    blocks.push_back(
        {{"type", "context"},
         {"elements", json::array({{{"type", "mrkdwn"}, {"text", "<" + SlackEscape(url) + "|gradwatch>"}}})}});
  }
  if (alerts.size() > kSlackMaxAlertsDetailed) {
    blocks.push_back({{"type", "context"},
                      {"elements", json::array({{{"type", "mrkdwn"},
                                                 {"text", std::to_string(alerts.size() - kSlackMaxAlertsDetailed) +
                                                              " more alerts in the text above"}}})}});
  }
  return Dump({{"text", text}, {"blocks", blocks}});
}

std::string AlertToJson(const Alert& alert) {
  return Dump({{"name", alert.name},
               {"state", std::string(alerts::AlertStateName(alert.state))},
               {"labels", alert.labels},
               {"annotations", alert.annotations},
               {"step", alert.step},
               {"value", ValueJson(alert.value)},
               {"starts_at", alert.starts_at},
               {"ends_at", alert.ends_at}});
}

Result<Alert> AlertFromJson(std::string_view text) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return NotifyError("alert: not a JSON object");
  try {
    Alert alert;
    alert.name = j.value("name", std::string());
    const std::string state = j.value("state", std::string());
    if (state == "pending") {
      alert.state = AlertState::kPending;
    } else if (state == "firing") {
      alert.state = AlertState::kFiring;
    } else if (state == "resolved") {
      alert.state = AlertState::kResolved;
    } else {
      alert.state = AlertState::kInactive;
    }
    if (j.contains("labels")) alert.labels = j.at("labels").get<LabelSet>();
    if (j.contains("annotations")) alert.annotations = j.at("annotations").get<LabelSet>();
    alert.step = j.value("step", uint64_t{0});
    alert.value = j.contains("value") ? ValueFromJson(j.at("value")) : 0.0;
    alert.starts_at = j.value("starts_at", 0.0);
    alert.ends_at = j.value("ends_at", 0.0);
    return alert;
  } catch (const json::exception& e) {
    return NotifyError(std::string("alert: ") + e.what());
  }
}

}  // namespace gradwatch::notify

// Request bodies for each receiver, as pure functions of the alerts and the time: no I/O, no
// clock reads. Every body is JSON text; invalid UTF-8 in labels or annotations is replaced, never
// thrown on.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "alerts/notify/status.h"

namespace gradwatch::notify {

using alerts::Alert;
using alerts::AlertState;
using alerts::LabelSet;

inline constexpr std::string_view kDefaultExternalUrl = "http://127.0.0.1:9390";
inline constexpr std::string_view kRecommendationAnnotation = "recommendation";
inline constexpr std::string_view kSummaryAnnotation = "summary";

// The alert's labels with "alertname" set to its name unless a label already gives it: the label
// set every payload carries.
LabelSet NotifiedLabels(const Alert& alert);
// FingerprintHex of NotifiedLabels: the outbox key, the webhook fingerprint and PagerDuty's
// dedup_key.
std::string NotifiedFingerprint(const Alert& alert);

// RFC 3339 in UTC with milliseconds, e.g. "2026-11-01T12:00:00.250Z".
std::string FormatRfc3339(double unix_seconds);

// <external_url>/runs/<run label, percent-encoded>; the external URL alone without a run label.
std::string GeneratorUrl(std::string_view external_url, const Alert& alert);

// A value as people read it: up to 6 significant digits; "NaN", "+Inf", "-Inf" when not finite.
std::string FormatValue(double value);

// Alertmanager API v2, POST /api/v2/alerts: a JSON array of
// {labels, annotations, startsAt, endsAt, generatorURL}. Firing alerts get
// endsAt = now + 4 × resend_interval (Alertmanager resolves them by itself if gradwatch goes
// silent); resolved alerts get their own ends_at (now when unset). startsAt is the alert's
// starts_at (now when unset). labels always carry alertname.
std::string AlertmanagerBody(const std::vector<Alert>& alerts, AlertState state, double now,
                             double resend_interval_seconds, std::string_view external_url);

// The Alertmanager webhook shape (version "4"): groupKey, status, receiver, groupLabels (the
// group_by labels common to all alerts), commonLabels, commonAnnotations, externalURL, and
// alerts with status, labels, annotations, startsAt, endsAt ("0001-01-01T00:00:00Z" while
// firing, as Alertmanager sends), generatorURL and fingerprint.
std::string WebhookBody(const std::vector<Alert>& alerts, AlertState state, double now, std::string_view receiver,
                        std::string_view external_url, const std::vector<std::string>& group_by);

// PagerDuty's severity for the alert's "severity" label: page → critical, warning → warning,
// PagerDuty's own critical / error / info kept, anything else (or none) → info.
std::string PagerDutySeverity(const LabelSet& labels);

// PagerDuty Events API v2 (POST /v2/enqueue), one event: trigger with dedup_key = fingerprint and
// payload {summary, source (the run), severity, timestamp, class, custom_details {labels,
// annotations, step, value}}, or resolve with routing_key, event_action and dedup_key only.
std::string PagerDutyBody(const Alert& alert, AlertState state, std::string_view routing_key,
                          std::string_view external_url);

// Slack incoming webhook: {text, blocks}. text alone tells the story (state, alert, run, step,
// value, summary, recommendation) for clients that show no blocks; resolved messages say
// RESOLVED.
std::string SlackBody(const std::vector<Alert>& alerts, AlertState state, std::string_view external_url);

// An alert as JSON for the outbox, and back. Non-finite values survive the round trip.
std::string AlertToJson(const Alert& alert);
Result<Alert> AlertFromJson(std::string_view json);

}  // namespace gradwatch::notify

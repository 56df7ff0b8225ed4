// Output of the query commands, human and JSON, as pure functions of the daemon's answers.
#pragma once

#include <google/protobuf/message.h>

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

// A value for people, the one number style of human output: 4 significant digits (5.123,
// 0.01235, 362), whole numbers with thousands separated from 1,000 (12,346), an exponent below
// 1e-4 and from 1e15 (1.235e-5); "NaN", "Infinity", "-Infinity". --json keeps full precision.
std::string FormatValue(double value);
// A whole number with thousands separated: 81716 -> "81,716" (steps in sentences and charts;
// tables write steps plainly, as they are typed back).
std::string GroupedStep(double step);
// How far a Unix time is from `now`: "5m 2s ago", "in 2h 13m"; "-" when unset.
std::string FormatAge(double seconds, double now);
// A step range, "100..200", or "100" when it is one step.
std::string FormatSteps(uint64_t first, uint64_t last);
// A double as JSON: a number, or the strings "NaN", "Infinity", "-Infinity" (protobuf's JSON
// spelling; nlohmann-json would print null).
nlohmann::ordered_json JsonValue(double value);

// Any message as JSON: proto field names, enums by name, 64-bit integers as numbers, maps as
// objects, proto3 scalars always, fields with presence only when set.
nlohmann::ordered_json ProtoToJson(const google::protobuf::Message& message);

// Rows of text as left-aligned columns separated by two spaces.
std::string FormatTable(const std::vector<std::vector<std::string>>& rows);
// "2h 13m", "5m 2s", "3d 4h": a span of time for people, its sign dropped.
std::string FormatDuration(double seconds);
// A Unix time as local time with how far it is from `now`: "2026-12-02 10:13:05 (in 2h 13m)",
// "... (5m 2s ago)"; "-" when unset.
std::string FormatLocalTime(double seconds, double now);

// `gradwatch runs`: a table, with how long ago each run's last step arrived.
std::string FormatRunsTable(const v1::ListRunsResponse& runs, double now);

// The figures `show` leads with, drawn from a RunSummary's latest values.
struct ParamLatest {
  std::string name;
  v1::ParamKind kind = v1::PARAM_KIND_UNSPECIFIED;
  std::optional<double> grad_norm;
  std::optional<double> param_norm;
  std::optional<double> update_norm;
};

struct RunOverview {
  // grad/norm/total, train/loss, train/z_loss, optim/learning_rate, those the daemon holds.
  std::vector<v1::LatestValue> key_series;
  // Parameters with a latest grad or param norm, by grad norm descending (non-finite first,
  // those without a grad norm last), at most `top_n`.
  std::vector<ParamLatest> top_params;
  size_t params_with_values = 0;
};

RunOverview BuildOverview(const v1::RunSummary& summary, size_t top_n = 10);

// `gradwatch show`: text, and JSON (the summary's fields plus "overview").
std::string FormatRunSummary(const v1::RunSummary& summary, double now);
// The analysis as a few sentences: total grad norm and slope, forecast, largest shares, growth
// without decay, slope changes at events and without them. Empty when there is nothing to say.
std::string FormatDiagnosis(const v1::RunSummary& summary);
nlohmann::ordered_json RunSummaryToJson(const v1::RunSummary& summary);

// `gradwatch alerts`: one line per alert (state, acked or silenced, name, run, severity, step,
// value, how long it has fired, summary), then who acknowledged which and when (local time), the
// silences muting them, then recommendations.
std::string FormatAlerts(const v1::ListAlertsResponse& alerts, double now);
// `gradwatch alerts --history`: every state change of the alerts, oldest first, with the step of
// the change and the summary as it read then.
std::string FormatAlertHistory(const v1::ListAlertHistoryResponse& history, double now);

// `gradwatch series`: a table, STEP VALUE MIN MAX STEPS (the steps a point stands for).
std::string FormatSeries(const v1::GetSeriesResponse& series);
nlohmann::ordered_json SeriesToJson(const v1::GetSeriesResponse& series);

}  // namespace gradwatch::cli

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

// A double as text: shortest round-trip form, "NaN", "Infinity" or "-Infinity".
std::string FormatValue(double value);
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

std::string FormatRunsTable(const v1::ListRunsResponse& runs);

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
std::string FormatRunSummary(const v1::RunSummary& summary);
// The analysis as a few sentences: total grad norm and slope, forecast, largest shares, growth
// without decay, slope changes at events and without them. Empty when there is nothing to say.
std::string FormatDiagnosis(const v1::RunSummary& summary);
nlohmann::ordered_json RunSummaryToJson(const v1::RunSummary& summary);

// `gradwatch alerts`: one line per alert (state, acked or silenced, name, run, severity, step,
// value, summary), then who acknowledged which and the silences muting them, then recommendations.
std::string FormatAlerts(const v1::ListAlertsResponse& alerts);

// `gradwatch series`: "step value min max count" per point.
std::string FormatSeries(const v1::GetSeriesResponse& series);
nlohmann::ordered_json SeriesToJson(const v1::GetSeriesResponse& series);

}  // namespace gradwatch::cli

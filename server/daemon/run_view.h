// The run view on gradwatchd's HTTP listener: a page (embedded in the binary at build time,
// server/daemon/ui/) that lists the runs and draws one run's charts, and the JSON API behind it.
//
//   GET /                         302 to /runs/
//   GET /runs/, /runs/RUN         the page (RUN percent-encoded, as alerts' generatorURL has it)
//   GET /ui/FILE                  its script and style sheet
//   GET /api/v1/runs              ListRunsResponse (?archived=1: with the archived runs)
//   GET /api/v1/runs/RUN          RunSummary
//   GET /api/v1/runs/RUN/series   GetSeriesResponse (?key=K&from=S&to=S&max_points=N)
//   GET /api/v1/alerts            ListAlertsResponse (?run=RUN)
//   GET /api/v1/alerts/history    ListAlertHistoryResponse (?run=RUN&limit=N)
//
// The JSON is the Query API's messages in protobuf's JSON mapping with the proto's field names
// (64-bit integers as strings, NaN and infinities as "NaN", "Infinity", "-Infinity"); errors are
// {"error": "...", "code": "NOT_FOUND"} with 400, 404, 500 or 503. docs/http-api.md documents them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "server/ingest/queries.h"
#include "server/web/server.h"

namespace gradwatch::daemon {

// Decides whether a request may read (nullopt) or answers it with a refusal (401 / 403).
using ReadGate = std::function<std::optional<web::Response>(const web::Request&)>;

// A route whose requests pass `gate` (when set) before `handler`.
web::Route GatedRoute(std::string path, bool prefix, ReadGate gate, web::Handler handler);

// The routes above over `sources`, each request passing `gate` first when it is set.
std::vector<web::Route> RunViewRoutes(ingest::QuerySources sources, ReadGate gate);

}  // namespace gradwatch::daemon

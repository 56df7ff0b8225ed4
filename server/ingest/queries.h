// The Query API's reads without a transport: the gRPC Query service and the HTTP JSON API behind
// the run view (server/daemon/run_view.h) answer with the same code, so they cannot disagree.
// Callers check the caller's scope first.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include <grpcpp/support/status.h>

#include "alerts/diagnosis.h"
#include "alerts/notify/status.h"
#include "alerts/state_machine.h"
#include "gradwatch/v1/gradwatch.pb.h"
#include "server/core/clock.h"
#include "server/runs/registry.h"

namespace gradwatch::ingest {

// NOT_FOUND for a run id the registry does not hold.
grpc::Status RunNotFound(const std::string& run_id);

// The latest `limit` alert state changes of a run (every run's when empty), oldest first
// (store::AlertStore::History).
using AlertHistoryReader =
    std::function<notify::Result<std::vector<alerts::HistoryEntry>>(std::string_view run, size_t limit)>;

// A run's diagnosis at the latest step its alerts evaluated; nullopt before the first evaluation
// (daemon::Alerting::DiagnosisOf).
using DiagnosisReader = std::function<std::optional<alerts::DiagnosisAt>(const std::string& run)>;

struct QuerySources {
  runs::RunRegistry* registry = nullptr;
  const Clock* clock = nullptr;
  alerts::AlertEngine* engine = nullptr;  // null: no alerting (no alerts listed)
  AlertHistoryReader alert_history;       // empty: no history kept
  DiagnosisReader diagnosis;              // empty: no diagnosis shown
};

// The most entries ListAlertHistory returns, and how many when the request does not say.
inline constexpr uint32_t kAlertHistoryMax = 10000, kAlertHistoryDefault = 1000;

grpc::Status ListRuns(const QuerySources& from, const v1::ListRunsRequest& request, v1::ListRunsResponse* response);
// NOT_FOUND for a run the daemon does not hold.
grpc::Status GetRun(const QuerySources& from, const v1::GetRunRequest& request, v1::RunSummary* response);
// NOT_FOUND for an unknown run or series, INVALID_ARGUMENT for to_step before from_step.
grpc::Status GetSeries(const QuerySources& from, const v1::GetSeriesRequest& request, v1::GetSeriesResponse* response);
// The pending and firing alerts (of one run when run_id is set), with their silences and acks.
grpc::Status ListAlerts(const QuerySources& from, const v1::ListAlertsRequest& request,
                        v1::ListAlertsResponse* response);
// Every state change (of one run when run_id is set), oldest first; INVALID_ARGUMENT for a limit
// over kAlertHistoryMax, UNAVAILABLE when the store cannot be read.
grpc::Status ListAlertHistory(const QuerySources& from, const v1::ListAlertHistoryRequest& request,
                              v1::ListAlertHistoryResponse* response);

}  // namespace gradwatch::ingest

// The Query service: unary calls over the run registry (list, summary, series, annotate).
#pragma once

#include "gradwatch/v1/gradwatch.grpc.pb.h"
#include "alerts/state_machine.h"
#include "server/core/clock.h"
#include "server/runs/registry.h"

namespace gradwatch::ingest {

class QueryService final : public v1::Query::CallbackService {
 public:
  // engine may be null (no alerting).
  QueryService(runs::RunRegistry* registry, const Clock* clock, const alerts::AlertEngine* engine = nullptr);

  grpc::ServerUnaryReactor* ListRuns(grpc::CallbackServerContext* context, const v1::ListRunsRequest* request,
                                     v1::ListRunsResponse* response) override;
  grpc::ServerUnaryReactor* GetRun(grpc::CallbackServerContext* context, const v1::GetRunRequest* request,
                                   v1::RunSummary* response) override;
  grpc::ServerUnaryReactor* GetSeries(grpc::CallbackServerContext* context,
                                      const v1::GetSeriesRequest* request,
                                      v1::GetSeriesResponse* response) override;
  grpc::ServerUnaryReactor* Annotate(grpc::CallbackServerContext* context,
                                     const v1::AnnotateRequest* request,
                                     v1::AnnotateResponse* response) override;
  grpc::ServerUnaryReactor* ListAlerts(grpc::CallbackServerContext* context,
                                       const v1::ListAlertsRequest* request,
                                       v1::ListAlertsResponse* response) override;

 private:
  runs::RunRegistry* const registry_;
  const Clock* const clock_;
  const alerts::AlertEngine* const engine_;
};

}  // namespace gradwatch::ingest

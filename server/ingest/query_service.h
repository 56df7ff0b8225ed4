// The Query service: unary calls over the run registry (list, summary, series, annotate).
#pragma once

#include <functional>
#include "alerts/state_machine.h"
#include "gradwatch/v1/gradwatch.grpc.pb.h"

#include "server/core/clock.h"
#include "server/core/status.h"
#include "server/ingest/authorizer.h"
#include "server/ingest/queries.h"
#include "server/runs/registry.h"

namespace gradwatch::ingest {

class QueryService final : public v1::Query::CallbackService {
 public:
  // Reloads the rule files; returns the number of rules in force or why nothing changed.
  using RuleReloader = std::function<StatusOr<size_t>()>;
  // engine may be null (no alerting); reload may be empty.
  QueryService(runs::RunRegistry* registry, const Clock* clock, alerts::AlertEngine* engine = nullptr,
               RuleReloader reload = {});

  // The longest a silence may last (security.max_silence_seconds); longer ones are refused. Call
  // before the service is registered.
  void set_max_silence_seconds(double seconds) { max_silence_seconds_ = seconds; }
  // Who may call what (null: everyone). Set before the service is registered.
  void set_authorizer(const Authorizer* authorizer) { authorizer_ = authorizer; }
  // Where ListAlertHistory reads (unset: no history). Set before the service is registered.
  void set_alert_history(AlertHistoryReader reader) { alert_history_ = std::move(reader); }
  // Where GetRun reads a run's diagnosis (unset: none shown). Set before the service is registered.
  void set_diagnosis(DiagnosisReader reader) { diagnosis_ = std::move(reader); }

  grpc::ServerUnaryReactor* ListRuns(grpc::CallbackServerContext* context, const v1::ListRunsRequest* request,
                                     v1::ListRunsResponse* response) override;
  grpc::ServerUnaryReactor* GetRun(grpc::CallbackServerContext* context, const v1::GetRunRequest* request,
                                   v1::RunSummary* response) override;
  grpc::ServerUnaryReactor* GetSeries(grpc::CallbackServerContext* context, const v1::GetSeriesRequest* request,
                                      v1::GetSeriesResponse* response) override;
  grpc::ServerUnaryReactor* Annotate(grpc::CallbackServerContext* context, const v1::AnnotateRequest* request,
                                     v1::AnnotateResponse* response) override;
  grpc::ServerUnaryReactor* ListAlerts(grpc::CallbackServerContext* context, const v1::ListAlertsRequest* request,
                                       v1::ListAlertsResponse* response) override;
  grpc::ServerUnaryReactor* ListAlertHistory(grpc::CallbackServerContext* context,
                                             const v1::ListAlertHistoryRequest* request,
                                             v1::ListAlertHistoryResponse* response) override;
  grpc::ServerUnaryReactor* ReloadRules(grpc::CallbackServerContext* context, const v1::ReloadRulesRequest* request,
                                        v1::ReloadRulesResponse* response) override;
  grpc::ServerUnaryReactor* AddSilence(grpc::CallbackServerContext* context, const v1::AddSilenceRequest* request,
                                       v1::AddSilenceResponse* response) override;
  grpc::ServerUnaryReactor* ListSilences(grpc::CallbackServerContext* context, const v1::ListSilencesRequest* request,
                                         v1::ListSilencesResponse* response) override;
  grpc::ServerUnaryReactor* RemoveSilence(grpc::CallbackServerContext* context, const v1::RemoveSilenceRequest* request,
                                          v1::RemoveSilenceResponse* response) override;
  grpc::ServerUnaryReactor* Ack(grpc::CallbackServerContext* context, const v1::AckRequest* request,
                                v1::AckResponse* response) override;

 private:
  runs::RunRegistry* const registry_;
  const Clock* const clock_;
  alerts::AlertEngine* const engine_;
  const RuleReloader reload_;
  double max_silence_seconds_ = 7 * 86400;
  const Authorizer* authorizer_ = nullptr;
  AlertHistoryReader alert_history_;
  DiagnosisReader diagnosis_;

  grpc::Status Allow(const grpc::CallbackServerContext* context, Scope scope, std::string_view run,
                     std::string_view what) const;
  QuerySources sources() const { return {registry_, clock_, engine_, alert_history_, diagnosis_}; }
};

}  // namespace gradwatch::ingest

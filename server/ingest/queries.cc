#include "server/ingest/queries.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "server/ingest/convert.h"

namespace gradwatch::ingest {

namespace {}  // namespace

grpc::Status ListRuns(const QuerySources& from, const v1::ListRunsRequest& request, v1::ListRunsResponse* response) {
  for (const auto& run : from.registry->All()) RunInfoToProto(run->Info(), response->add_runs());
  if (request.include_archived()) {
    auto archived = from.registry->Archived();
    if (!archived.ok()) return {grpc::StatusCode::INTERNAL, "reading archived runs: " + archived.status().message()};
    for (const store::StoredRun& r : archived.value()) StoredRunToProto(r, response->add_runs());
    std::sort(response->mutable_runs()->begin(), response->mutable_runs()->end(),
              [](const v1::RunInfo& a, const v1::RunInfo& b) { return a.run_id() < b.run_id(); });
  }
  return grpc::Status::OK;
}

grpc::Status GetRun(const QuerySources& from, const v1::GetRunRequest& request, v1::RunSummary* response) {
  auto run = from.registry->Find(request.run_id());
  if (!run) return RunNotFound(request.run_id());
  constexpr uint32_t kDefaultEvents = 1000;  // 1,000 events of at most 1 KiB: within gRPC's 4 MiB
  SummaryToProto(run->Summary(request.max_events() == 0 ? kDefaultEvents : request.max_events()), response);
  if (!from.diagnosis) return grpc::Status::OK;
  if (const std::optional<alerts::DiagnosisAt> d = from.diagnosis(request.run_id())) {
    v1::RunDiagnosis* out = response->mutable_diagnosis();
    out->set_step(d->step);
    out->set_cause(std::string(alerts::CauseName(d->diagnosis.cause)));
    out->set_text(d->diagnosis.text);
    out->set_recommendation(d->diagnosis.recommendation);
    out->set_remediation_param(d->diagnosis.remedy.param);
    out->set_remediation_weight_decay(d->diagnosis.remedy.weight_decay);
    out->set_remediation_supported(d->diagnosis.remedy.supported);
    out->set_remediation_why(d->diagnosis.remedy.why);
    out->set_page_held(d->page_held);
  }
  return grpc::Status::OK;
}

grpc::Status GetSeries(const QuerySources& from, const v1::GetSeriesRequest& request, v1::GetSeriesResponse* response) {
  auto run = from.registry->Find(request.run_id());
  if (!run) return RunNotFound(request.run_id());
  const uint64_t to = request.to_step() == 0 ? UINT64_MAX : request.to_step();
  if (to < request.from_step()) return {grpc::StatusCode::INVALID_ARGUMENT, "to_step is before from_step"};
  auto points = run->QuerySeries(request.key(), request.from_step(), to, request.max_points());
  if (!points) {
    return {grpc::StatusCode::NOT_FOUND, "run '" + request.run_id() + "' has no series '" + request.key() + "'"};
  }
  response->set_run_id(request.run_id());
  response->set_key(request.key());
  response->mutable_points()->Reserve(static_cast<int>(points->size()));
  for (const store::Point& p : *points) {
    v1::SeriesPoint* sp = response->add_points();
    sp->set_step(p.step);
    sp->set_last_step(p.last_step);
    sp->set_value(p.count == 1 ? p.last : p.mean);
    sp->set_min(p.count == 1 ? p.last : p.min);
    sp->set_max(p.count == 1 ? p.last : p.max);
    sp->set_count(p.count);
    sp->set_nonfinite(p.nonfinite);
  }
  return grpc::Status::OK;
}

grpc::Status ListAlerts(const QuerySources& from, const v1::ListAlertsRequest& request,
                        v1::ListAlertsResponse* response) {
  if (from.engine == nullptr) return grpc::Status::OK;
  const double now = from.clock->UnixSeconds();
  for (const alerts::Alert& a : from.engine->Active(request.run_id())) {
    v1::Alert* out = response->add_alerts();
    AlertToProto(a, out);
    for (std::string& id : from.engine->SilencesMuting(a, now)) out->add_silenced_by(std::move(id));
    if (auto ack = from.engine->AckOf(out->fingerprint())) {
      out->mutable_ack()->set_by(ack->by);
      out->mutable_ack()->set_comment(ack->comment);
      out->mutable_ack()->set_at(ack->at);
    }
  }
  return grpc::Status::OK;
}

grpc::Status ListAlertHistory(const QuerySources& from, const v1::ListAlertHistoryRequest& request,
                              v1::ListAlertHistoryResponse* response) {
  if (request.limit() > kAlertHistoryMax) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "limit is at most " + std::to_string(kAlertHistoryMax) + ", not " + std::to_string(request.limit())};
  }
  if (!from.alert_history) return grpc::Status::OK;
  auto entries = from.alert_history(request.run_id(), request.limit() == 0 ? kAlertHistoryDefault : request.limit());
  if (!entries.ok()) return {grpc::StatusCode::UNAVAILABLE, "reading the alert history: " + entries.status().message()};
  response->mutable_entries()->Reserve(static_cast<int>(entries->size()));
  for (const alerts::HistoryEntry& e : entries.value()) {
    v1::AlertHistoryEntry* out = response->add_entries();
    AlertToProto(e.alert, out->mutable_alert());
    out->set_from(e.from == alerts::AlertState::kInactive ? v1::ALERT_STATE_UNSPECIFIED : AlertStateToProto(e.from));
    out->set_at(e.at);
  }
  return grpc::Status::OK;
}

grpc::Status RunNotFound(const std::string& run_id) { return {grpc::StatusCode::NOT_FOUND, "no run '" + run_id + "'"}; }

}  // namespace gradwatch::ingest

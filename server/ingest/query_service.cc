#include "server/ingest/query_service.h"

#include <spdlog/spdlog.h>

#include "server/ingest/convert.h"

namespace gradwatch::ingest {

namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

grpc::Status RunNotFound(const std::string& run_id) {
  return {grpc::StatusCode::NOT_FOUND, "no run '" + run_id + "'"};
}

}  // namespace

QueryService::QueryService(runs::RunRegistry* registry, const Clock* clock, const alerts::AlertEngine* engine)
    : registry_(registry), clock_(clock), engine_(engine) {}

grpc::ServerUnaryReactor* QueryService::ListAlerts(grpc::CallbackServerContext* context,
                                                   const v1::ListAlertsRequest* request,
                                                   v1::ListAlertsResponse* response) {
  if (engine_ != nullptr) {
    for (const alerts::Alert& a : engine_->Active(request->run_id())) AlertToProto(a, response->add_alerts());
  }
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::ListRuns(grpc::CallbackServerContext* context,
                                                 const v1::ListRunsRequest*,
                                                 v1::ListRunsResponse* response) {
  for (const auto& run : registry_->All()) RunInfoToProto(run->Info(), response->add_runs());
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::GetRun(grpc::CallbackServerContext* context,
                                               const v1::GetRunRequest* request,
                                               v1::RunSummary* response) {
  auto run = registry_->Find(request->run_id());
  if (!run) return Done(context, RunNotFound(request->run_id()));
  SummaryToProto(run->Summary(), response);
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::GetSeries(grpc::CallbackServerContext* context,
                                                  const v1::GetSeriesRequest* request,
                                                  v1::GetSeriesResponse* response) {
  auto run = registry_->Find(request->run_id());
  if (!run) return Done(context, RunNotFound(request->run_id()));
  const uint64_t to = request->to_step() == 0 ? UINT64_MAX : request->to_step();
  if (to < request->from_step()) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, "to_step is before from_step"});
  }
  auto points = run->QuerySeries(request->key(), request->from_step(), to, request->max_points());
  if (!points) {
    return Done(context, {grpc::StatusCode::NOT_FOUND,
                          "run '" + request->run_id() + "' has no series '" + request->key() + "'"});
  }
  response->set_run_id(request->run_id());
  response->set_key(request->key());
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
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::Annotate(grpc::CallbackServerContext* context,
                                                 const v1::AnnotateRequest* request,
                                                 v1::AnnotateResponse*) {
  auto run = registry_->Find(request->run_id());
  if (!run) return Done(context, RunNotFound(request->run_id()));
  v1::Event in;
  in.set_step(request->step());
  in.set_text(request->text());
  EventRecord event;
  if (auto err = EventFromProto(in, &event)) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, err->message});
  }
  event.source = "annotate";
  event.recorded_at = clock_->UnixSeconds();
  spdlog::info("run {}: annotation at step {}: {}", request->run_id(), event.step, event.text);
  if (auto err = run->AddEvent(std::move(event))) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, err->message});
  }
  return Done(context, grpc::Status::OK);
}

}  // namespace gradwatch::ingest

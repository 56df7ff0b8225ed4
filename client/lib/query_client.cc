#include "gradwatch/query_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

namespace gradwatch::client {

QueryClient::QueryClient(std::string address, std::chrono::milliseconds timeout, const ChannelSecurity& tls)
    : address_(std::move(address)), timeout_(timeout), security_(tls) {
  const auto credentials = MakeChannelCredentials(tls, &setup_error_);
  if (credentials == nullptr) return;  // every call answers setup_error_
  grpc::ChannelArguments args;
  AddTlsArguments(tls, args);
  stub_ = v1::Query::NewStub(grpc::CreateCustomChannel(address_, credentials, args));
}

template <typename Request, typename Response, typename Method>
QueryResult<Response> QueryClient::Call(const Request& request, Method method) {
  if (stub_ == nullptr) return {grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, setup_error_), Response()};
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout_);
  AddToken(security_, context);
  QueryResult<Response> result;
  result.status = ((*stub_).*method)(&context, request, &result.response);
  return result;
}

QueryResult<v1::ListRunsResponse> QueryClient::ListRuns(bool include_archived) {
  v1::ListRunsRequest request;
  request.set_include_archived(include_archived);
  return Call<v1::ListRunsRequest, v1::ListRunsResponse>(request, &v1::Query::Stub::ListRuns);
}

QueryResult<v1::ListAlertHistoryResponse> QueryClient::ListAlertHistory(const std::string& run_id, uint32_t limit) {
  v1::ListAlertHistoryRequest request;
  request.set_run_id(run_id);
  request.set_limit(limit);
  return Call<v1::ListAlertHistoryRequest, v1::ListAlertHistoryResponse>(request, &v1::Query::Stub::ListAlertHistory);
}

QueryResult<v1::ListAlertsResponse> QueryClient::ListAlerts(const std::string& run_id) {
  v1::ListAlertsRequest request;
  request.set_run_id(run_id);
  return Call<v1::ListAlertsRequest, v1::ListAlertsResponse>(request, &v1::Query::Stub::ListAlerts);
}

QueryResult<v1::ReloadRulesResponse> QueryClient::ReloadRules() {
  return Call<v1::ReloadRulesRequest, v1::ReloadRulesResponse>(v1::ReloadRulesRequest{}, &v1::Query::Stub::ReloadRules);
}

QueryResult<v1::AddSilenceResponse> QueryClient::AddSilence(const v1::Silence& silence) {
  v1::AddSilenceRequest request;
  *request.mutable_silence() = silence;
  return Call<v1::AddSilenceRequest, v1::AddSilenceResponse>(request, &v1::Query::Stub::AddSilence);
}

QueryResult<v1::ListSilencesResponse> QueryClient::ListSilences() {
  return Call<v1::ListSilencesRequest, v1::ListSilencesResponse>(v1::ListSilencesRequest{},
                                                                 &v1::Query::Stub::ListSilences);
}

QueryResult<v1::RemoveSilenceResponse> QueryClient::RemoveSilence(const std::string& id) {
  v1::RemoveSilenceRequest request;
  request.set_id(id);
  return Call<v1::RemoveSilenceRequest, v1::RemoveSilenceResponse>(request, &v1::Query::Stub::RemoveSilence);
}

QueryResult<v1::AckResponse> QueryClient::Ack(const std::string& fingerprint, const std::string& by,
                                              const std::string& comment) {
  v1::AckRequest request;
  request.set_fingerprint(fingerprint);
  request.set_by(by);
  request.set_comment(comment);
  return Call<v1::AckRequest, v1::AckResponse>(request, &v1::Query::Stub::Ack);
}

QueryResult<v1::RunSummary> QueryClient::GetRun(const std::string& run_id) {
  v1::GetRunRequest request;
  request.set_run_id(run_id);
  request.set_max_params(2000);
  QueryResult<v1::RunSummary> whole = Call<v1::GetRunRequest, v1::RunSummary>(request, &v1::Query::Stub::GetRun);
  // The rest of the catalog, a page at a time (each answer stays under gRPC's 4 MiB).
  v1::RunSummary& all = whole.response;
  while (whole.ok() && static_cast<uint64_t>(all.params_size()) < all.param_count()) {
    request.set_params_offset(static_cast<uint32_t>(all.params_size()));
    QueryResult<v1::RunSummary> page = Call<v1::GetRunRequest, v1::RunSummary>(request, &v1::Query::Stub::GetRun);
    if (!page.ok()) return page;
    if (page.response.params_size() == 0) break;  // the catalog shrank meanwhile (a catalog update)
    v1::RunSummary& p = page.response;
    all.mutable_params()->MergeFrom(p.params());
    all.mutable_latest()->MergeFrom(p.latest());
    v1::Analysis* a = all.mutable_analysis();
    const v1::Analysis& more = p.analysis();
    a->mutable_slopes()->MergeFrom(more.slopes());
    a->mutable_slope_changes()->MergeFrom(more.slope_changes());
    a->mutable_change_points()->MergeFrom(more.change_points());
    a->mutable_forecasts()->MergeFrom(more.forecasts());
    a->mutable_shares()->MergeFrom(more.shares());
    a->mutable_amplifications()->MergeFrom(more.amplifications());
    a->mutable_growth_without_decay()->MergeFrom(more.growth_without_decay());
    a->mutable_projections()->MergeFrom(more.projections());
    a->mutable_remediations()->MergeFrom(more.remediations());
  }
  // Shares come largest first, as a single answer lists them.
  auto* shares = all.mutable_analysis()->mutable_shares();
  std::stable_sort(shares->begin(), shares->end(),
                   [](const v1::GradNormShare& x, const v1::GradNormShare& y) { return x.share() > y.share(); });
  return whole;
}

QueryResult<v1::GetSeriesResponse> QueryClient::GetSeries(const v1::GetSeriesRequest& request) {
  return Call<v1::GetSeriesRequest, v1::GetSeriesResponse>(request, &v1::Query::Stub::GetSeries);
}

QueryResult<v1::AnnotateResponse> QueryClient::Annotate(const std::string& run_id, uint64_t step,
                                                        const std::string& text) {
  v1::AnnotateRequest request;
  request.set_run_id(run_id);
  request.set_step(step);
  request.set_text(text);
  return Call<v1::AnnotateRequest, v1::AnnotateResponse>(request, &v1::Query::Stub::Annotate);
}

}  // namespace gradwatch::client

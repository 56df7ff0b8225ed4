// QueryClient: the unary Query service, one deadline per call. Thread-safe.
#pragma once

#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "gradwatch/channel_security.h"
#include "gradwatch/v1/gradwatch.grpc.pb.h"
#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::client {

// A response, or the gRPC status that prevented it (UNAVAILABLE when the daemon cannot be
// reached, DEADLINE_EXCEEDED when it did not answer in time, NOT_FOUND for an unknown run).
template <typename Response>
struct QueryResult {
  grpc::Status status;
  Response response;
  bool ok() const { return status.ok(); }
};

class QueryClient {
 public:
  // `timeout` is the deadline of each call, counted from its start. When the TLS files cannot be
  // read, every call fails with FAILED_PRECONDITION and the reason.
  QueryClient(std::string address, std::chrono::milliseconds timeout, const ChannelSecurity& tls = {});

  // The runs the daemon holds in memory; with `include_archived`, also those only its journal holds.
  QueryResult<v1::ListRunsResponse> ListRuns(bool include_archived = false);
  // The whole run: every page of its catalog (GetRunRequest.max_params), merged.
  QueryResult<v1::RunSummary> GetRun(const std::string& run_id);
  QueryResult<v1::GetSeriesResponse> GetSeries(const v1::GetSeriesRequest& request);
  QueryResult<v1::AnnotateResponse> Annotate(const std::string& run_id, uint64_t step, const std::string& text);

  QueryResult<v1::ListAlertsResponse> ListAlerts(const std::string& run_id);
  // The latest `limit` alert state changes of the run (0: the daemon's default), oldest first.
  QueryResult<v1::ListAlertHistoryResponse> ListAlertHistory(const std::string& run_id, uint32_t limit = 0);
  QueryResult<v1::ReloadRulesResponse> ReloadRules();
  QueryResult<v1::AddSilenceResponse> AddSilence(const v1::Silence& silence);
  QueryResult<v1::ListSilencesResponse> ListSilences();
  QueryResult<v1::RemoveSilenceResponse> RemoveSilence(const std::string& id);
  QueryResult<v1::AckResponse> Ack(const std::string& fingerprint, const std::string& by, const std::string& comment);

  const std::string& address() const { return address_; }

 private:
  template <typename Request, typename Response, typename Method>
  QueryResult<Response> Call(const Request& request, Method method);

  std::string address_;
  std::chrono::milliseconds timeout_;
  ChannelSecurity security_;
  std::unique_ptr<v1::Query::Stub> stub_;
  std::string setup_error_;  // why stub_ is null: the TLS files could not be read
};

}  // namespace gradwatch::client

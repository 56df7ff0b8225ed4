// A raw Ingest stream for integration tests: sends exactly the messages a test builds and
// collects every answer on a reader thread, so tests can wait for one with a bound.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "gradwatch/v1/gradwatch.grpc.pb.h"

namespace gradwatch::testing {

class StreamClient {
 public:
  explicit StreamClient(const std::string& target);
  ~StreamClient();

  bool Send(const v1::TrainerMessage& msg);
  bool Hello(const v1::Hello& hello, uint64_t seq = 0);
  bool Step(const v1::StepStats& step, uint64_t seq = 0);
  // Half-closes and waits for the call's status.
  grpc::Status Close();

  // Waits until some answer satisfies `pred`; returns it, or throws after `timeout`.
  v1::DaemonMessage WaitFor(const std::function<bool(const v1::DaemonMessage&)>& pred,
                            std::chrono::milliseconds timeout = std::chrono::seconds(10));
  v1::Accepted WaitAccepted();
  v1::Error WaitError(uint64_t seq);
  // Waits for an ack covering `step`.
  v1::Ack WaitAck(uint64_t step);
  std::vector<v1::DaemonMessage> Received();

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Ingest::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TrainerMessage, v1::DaemonMessage>> stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<v1::DaemonMessage> received_;
  bool done_ = false;
  std::thread reader_;
  bool closed_ = false;
};

// Builds a Hello with the given catalog of (name, kind) entries.
v1::Hello MakeHello(const std::string& run, uint32_t rank, uint32_t world,
                    const std::vector<std::pair<std::string, v1::ParamKind>>& params);

// A unary Query stub on `target`.
std::unique_ptr<v1::Query::Stub> QueryStub(const std::string& target);

// Query.ListAlerts on `target`: the pending and firing alerts of `run` (of every run when empty).
// Throws std::runtime_error, with the status, unless the call succeeds within `timeout`.
std::vector<v1::Alert> ListAlerts(const std::string& target, const std::string& run = "",
                                  std::chrono::milliseconds timeout = std::chrono::seconds(5));

// grpc.health.v1.Health/Check of `service` on `target`: "SERVING", "NOT_SERVING", "UNKNOWN" or
// "SERVICE_UNKNOWN", or "error: ..." when the call fails within `timeout`.
std::string HealthStatus(const std::string& target, const std::string& service,
                         std::chrono::milliseconds timeout = std::chrono::seconds(5));

}  // namespace gradwatch::testing

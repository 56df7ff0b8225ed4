// An in-process stand-in for gradwatchd: a sync Ingest service that records what it receives
// and acknowledges steps, and a Query service with canned answers. Binds 127.0.0.1.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/time_scale.h"

#include "gradwatch/v1/gradwatch.grpc.pb.h"

namespace gradwatch::testing {

class FakeIngest final : public v1::Ingest::Service {
 public:
  // What the daemon claims to hold when a Hello arrives.
  struct Progress {
    bool has_durable = false;
    uint64_t durable = 0;
    bool has_received = false;
    uint64_t received = 0;
  };

  FakeIngest() = default;
  explicit FakeIngest(Progress progress) : progress_(progress) {}

  // Steps above this are received but never acknowledged.
  void set_ack_limit(uint64_t limit) {
    std::lock_guard lock(mu_);
    ack_limit_ = limit;
  }
  // A slow daemon: each step is acknowledged this long after it arrived, one after the other.
  void set_ack_delay(std::chrono::milliseconds delay) {
    std::lock_guard lock(mu_);
    ack_delay_ = delay;
  }
  // Returns an Error to send instead of accepting/acknowledging the message.
  void set_reject(std::function<std::optional<v1::Error>(const v1::TrainerMessage&)> reject) {
    std::lock_guard lock(mu_);
    reject_ = std::move(reject);
  }
  void set_alert_on_step(uint64_t step, v1::Alert alert) {
    std::lock_guard lock(mu_);
    alert_step_ = step;
    alert_ = std::move(alert);
  }

  grpc::Status Stream(grpc::ServerContext*,
                      grpc::ServerReaderWriter<v1::DaemonMessage, v1::TrainerMessage>* stream) override {
    v1::TrainerMessage msg;
    while (stream->Read(&msg)) {
      std::vector<v1::DaemonMessage> replies;
      std::chrono::milliseconds delay{0};
      {
        std::lock_guard lock(mu_);
        messages_.push_back(msg);
        std::optional<v1::Error> error;
        if (reject_) error = reject_(msg);
        if (error) {
          *replies.emplace_back().mutable_error() = *error;
        } else if (msg.has_hello()) {
          if (msg.hello().has_resume_from_step()) {
            // As the daemon does at a rewind: what it held from the resume step on is dropped.
            const uint64_t from = msg.hello().resume_from_step();
            for (auto [has, step] : {std::pair{&progress_.has_durable, &progress_.durable},
                                     std::pair{&progress_.has_received, &progress_.received}}) {
              if (*has && *step >= from) {
                *has = from > 0;
                *step = from > 0 ? from - 1 : 0;
              }
            }
          }
          v1::Accepted* a = replies.emplace_back().mutable_accepted();
          a->set_run_id(msg.hello().run_id());
          a->set_rank(msg.hello().rank());
          a->set_has_durable_step(progress_.has_durable);
          a->set_last_durable_step(progress_.durable);
          a->set_has_received_step(progress_.has_received);
          a->set_last_received_step(progress_.received);
          a->set_max_message_bytes(4 << 20);
        } else if (msg.has_step()) {
          const uint64_t step = msg.step().step();
          progress_.has_received = true;
          progress_.received = std::max(progress_.received, step);
          if (step <= ack_limit_) {
            delay = ack_delay_;
            progress_.has_durable = true;
            progress_.durable = std::max(progress_.durable, step);
            v1::Ack* ack = replies.emplace_back().mutable_ack();
            ack->set_durable_step(progress_.durable);
            ack->set_seq(msg.seq());
          }
          if (alert_step_ && *alert_step_ == step) *replies.emplace_back().mutable_alert() = alert_;
        } else if (msg.has_goodbye()) {
          v1::Finished* f = replies.emplace_back().mutable_finished();
          f->set_seq(msg.seq());
          f->set_run_id("fake");
        }
      }
      cv_.notify_all();
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      for (const auto& reply : replies) stream->Write(reply);
    }
    return grpc::Status::OK;
  }

  std::vector<v1::TrainerMessage> Messages() const {
    std::lock_guard lock(mu_);
    return messages_;
  }

  std::vector<uint64_t> Steps() const {
    std::vector<uint64_t> steps;
    for (const auto& m : Messages()) {
      if (m.has_step()) steps.push_back(m.step().step());
    }
    return steps;
  }

  // Waits until `count` messages have arrived.
  bool WaitForMessages(size_t count, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, gradwatch::testing::Scaled(timeout), [&] { return messages_.size() >= count; });
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Progress progress_;
  uint64_t ack_limit_ = std::numeric_limits<uint64_t>::max();
  std::chrono::milliseconds ack_delay_{0};
  std::function<std::optional<v1::Error>(const v1::TrainerMessage&)> reject_;
  std::optional<uint64_t> alert_step_;
  v1::Alert alert_;
  std::vector<v1::TrainerMessage> messages_;
};

class FakeQuery final : public v1::Query::Service {
 public:
  std::map<std::string, v1::RunSummary> runs;
  std::map<std::string, v1::GetSeriesResponse> series;  // by key
  std::vector<v1::AnnotateRequest> annotations;

  grpc::Status ListRuns(grpc::ServerContext*, const v1::ListRunsRequest*, v1::ListRunsResponse* response) override {
    for (const auto& [id, summary] : runs) *response->add_runs() = summary.info();
    return grpc::Status::OK;
  }
  grpc::Status GetRun(grpc::ServerContext*, const v1::GetRunRequest* request, v1::RunSummary* response) override {
    auto it = runs.find(request->run_id());
    if (it == runs.end()) {
      return {grpc::StatusCode::NOT_FOUND, "run " + request->run_id() + " not found"};
    }
    *response = it->second;
    return grpc::Status::OK;
  }
  grpc::Status GetSeries(grpc::ServerContext*, const v1::GetSeriesRequest* request,
                         v1::GetSeriesResponse* response) override {
    auto it = series.find(request->key());
    if (!runs.contains(request->run_id()) || it == series.end()) {
      return {grpc::StatusCode::NOT_FOUND, "no series " + request->key()};
    }
    *response = it->second;
    return grpc::Status::OK;
  }
  grpc::Status Annotate(grpc::ServerContext*, const v1::AnnotateRequest* request, v1::AnnotateResponse*) override {
    annotations.push_back(*request);
    return grpc::Status::OK;
  }
  grpc::Status AddSilence(grpc::ServerContext*, const v1::AddSilenceRequest* request,
                          v1::AddSilenceResponse* response) override {
    silences.push_back(request->silence());
    response->set_id("s" + std::to_string(silences.size()));
    return grpc::Status::OK;
  }
  grpc::Status ListSilences(grpc::ServerContext*, const v1::ListSilencesRequest*,
                            v1::ListSilencesResponse* response) override {
    for (const v1::Silence& s : silences) *response->add_silences() = s;
    return grpc::Status::OK;
  }
  std::vector<v1::Silence> silences;
};

// Owns a running server for the given services.
class FakeServer {
 public:
  // port 0 picks a free one.
  explicit FakeServer(std::vector<grpc::Service*> services, int port = 0) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &port_);
    for (grpc::Service* s : services) builder.RegisterService(s);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() { Shutdown(); }

  bool ok() const { return server_ != nullptr && port_ > 0; }
  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  // Cancels open streams at once, like a daemon that dies.
  void Shutdown() {
    if (!server_) return;
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    server_.reset();
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace gradwatch::testing

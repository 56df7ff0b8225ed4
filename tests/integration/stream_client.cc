#include "tests/integration/stream_client.h"

#include <future>
#include <stdexcept>

#include <grpcpp/generic/generic_stub.h>

#include "tests/support/time_scale.h"

namespace gradwatch::testing {

StreamClient::StreamClient(const std::string& target)
    : channel_(grpc::CreateChannel(target, grpc::InsecureChannelCredentials())), stub_(v1::Ingest::NewStub(channel_)) {
  context_.set_deadline(std::chrono::system_clock::now() + Scaled(std::chrono::seconds(120)));
  stream_ = stub_->Stream(&context_);
  reader_ = std::thread([this] {
    v1::DaemonMessage msg;
    while (stream_->Read(&msg)) {
      std::lock_guard lock(mu_);
      received_.push_back(msg);
      cv_.notify_all();
    }
    std::lock_guard lock(mu_);
    done_ = true;
    cv_.notify_all();
  });
}

StreamClient::~StreamClient() {
  if (!closed_) {
    context_.TryCancel();
  }
  if (reader_.joinable()) reader_.join();
  if (!closed_) stream_->Finish().ok();
}

bool StreamClient::Send(const v1::TrainerMessage& msg) { return stream_->Write(msg); }

bool StreamClient::Hello(const v1::Hello& hello, uint64_t seq) {
  v1::TrainerMessage m;
  m.set_seq(seq);
  *m.mutable_hello() = hello;
  return Send(m);
}

bool StreamClient::Step(const v1::StepStats& step, uint64_t seq) {
  v1::TrainerMessage m;
  m.set_seq(seq);
  *m.mutable_step() = step;
  return Send(m);
}

grpc::Status StreamClient::Close() {
  stream_->WritesDone();
  if (reader_.joinable()) reader_.join();
  closed_ = true;
  return stream_->Finish();
}

v1::DaemonMessage StreamClient::WaitFor(const std::function<bool(const v1::DaemonMessage&)>& pred,
                                        std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  size_t checked = 0;
  const auto deadline = std::chrono::steady_clock::now() + Scaled(timeout);
  while (true) {
    for (; checked < received_.size(); ++checked) {
      if (pred(received_[checked])) return received_[checked];
    }
    if (done_) throw std::runtime_error("stream ended before the awaited answer");
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && checked == received_.size()) {
      throw std::runtime_error("timed out waiting for an answer on the stream");
    }
  }
}

v1::Accepted StreamClient::WaitAccepted() {
  return WaitFor([](const v1::DaemonMessage& m) { return m.has_accepted(); }).accepted();
}

v1::Error StreamClient::WaitError(uint64_t seq) {
  return WaitFor([seq](const v1::DaemonMessage& m) { return m.has_error() && m.error().seq() == seq; }).error();
}

v1::Ack StreamClient::WaitAck(uint64_t step) {
  return WaitFor([step](const v1::DaemonMessage& m) { return m.has_ack() && m.ack().durable_step() >= step; }).ack();
}

std::vector<v1::DaemonMessage> StreamClient::Received() {
  std::lock_guard lock(mu_);
  return received_;
}

v1::Hello MakeHello(const std::string& run, uint32_t rank, uint32_t world,
                    const std::vector<std::pair<std::string, v1::ParamKind>>& params) {
  v1::Hello h;
  h.set_run_id(run);
  h.set_rank(rank);
  h.set_world_size(world);
  h.set_client("integration-test");
  (*h.mutable_labels())["job"] = "it";
  h.mutable_config()->set_hidden_size(6144);
  h.mutable_config()->set_z_loss_coef(1e-4);
  for (const auto& [name, kind] : params) {
    auto* p = h.add_params();
    p->set_name(name);
    p->set_kind(kind);
  }
  return h;
}

std::unique_ptr<v1::Query::Stub> QueryStub(const std::string& target) {
  return v1::Query::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

std::vector<v1::Alert> ListAlerts(const std::string& target, const std::string& run,
                                  std::chrono::milliseconds timeout) {
  auto stub = QueryStub(target);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + Scaled(timeout));
  v1::ListAlertsRequest req;
  req.set_run_id(run);
  v1::ListAlertsResponse resp;
  const grpc::Status status = stub->ListAlerts(&ctx, req, &resp);
  if (!status.ok()) {
    throw std::runtime_error("Query.ListAlerts on " + target + " failed: code " +
                             std::to_string(static_cast<int>(status.error_code())) + ": " + status.error_message());
  }
  return {resp.alerts().begin(), resp.alerts().end()};
}

}  // namespace gradwatch::testing

namespace gradwatch::testing {

std::string HealthStatus(const std::string& target, const std::string& service, std::chrono::milliseconds timeout) {
  // HealthCheckRequest{service = 1} and HealthCheckResponse{status = 1}, encoded by hand: the
  // health proto's generated code is not part of the packages we build with.
  std::string request = "\x0a";
  request.push_back(static_cast<char>(service.size()));
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer in(&slice, 1);
  grpc::ByteBuffer out;
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + Scaled(timeout));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &in, &out,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return "error: " + status.error_message();
  std::vector<grpc::Slice> slices;
  if (!out.Dump(&slices).ok()) return "error: unreadable response";
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const int code = bytes.size() >= 2 && bytes[0] == 0x08 ? bytes[1] : 0;
  switch (code) {
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

}  // namespace gradwatch::testing

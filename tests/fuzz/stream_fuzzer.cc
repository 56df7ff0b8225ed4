// Fuzzes what the ingest service does with trainer messages, without gRPC: each message is
// converted and validated (server/ingest/convert.h) and handed to the run registry exactly as
// IngestService's stream reactor does (Hello → Attach, Step → AddStep, Event → AddEvent,
// CatalogUpdate → AddCatalogChange, Goodbye → Finish), with the daemon's alerting and its default rules evaluating
// every completed step and, on each tick, the timer rules.
//
// Input: frames of one control byte and one TrainerMessage in protobuf's delimited format (its
// length as a varint, then its bytes). The control byte's low two bits pick one of four streams;
// bit 6 closes that stream first (as a client half-close does); bit 7 advances the clock by
// (byte & 0x3f) seconds and ticks the registry (assembly timeouts, run ends, retention).
// tests/fuzz/make_stream_seeds.sh writes the seed corpus.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <spdlog/spdlog.h>

#include "alerts/rules.h"
#include "gradwatch/v1/gradwatch.pb.h"
#include "server/core/clock.h"
#include "server/daemon/alerting.h"
#include "server/ingest/convert.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/registry.h"

namespace {

using namespace gradwatch;
using runs::IngestError;
using runs::IngestErrorReason;

// One trainer stream: the reactor's read path, with answers counted instead of written.
class FuzzStream final : public runs::StreamSink {
 public:
  FuzzStream(runs::RunRegistry* registry, const Clock* clock) : registry_(registry), clock_(clock) {}
  ~FuzzStream() override { Close(); }

  void Handle(const v1::TrainerMessage& in) {
    const uint64_t seq = in.seq();
    switch (in.body_case()) {
      case v1::TrainerMessage::kHello: {
        RunMeta meta;
        uint32_t rank = 0;
        if (auto err = ingest::HelloFromProto(in.hello(), ingest::HelloLimits{}, &meta, &rank)) {
          return Count(*err);
        }
        if (run_ && (meta.run_id != run_id_ || rank != rank_)) {
          return Count({IngestErrorReason::kInvalidHello, ""});
        }
        runs::AttachInfo info;
        IngestError error{IngestErrorReason::kInvalidHello, ""};
        run_ = registry_->Attach(meta, rank, this, &info, &error);
        if (!run_) return Count(error);
        run_id_ = meta.run_id;
        rank_ = rank;
        return;
      }
      case v1::TrainerMessage::kStep: {
        if (!run_) return Count({IngestErrorReason::kNoHello, ""});
        if (auto err = ingest::StepFromProto(in.step(), seq, &step_)) return Count(*err);
        if (auto err = run_->AddStep(rank_, step_, this)) Count(*err);
        return;
      }
      case v1::TrainerMessage::kEvent: {
        if (!run_) return Count({IngestErrorReason::kNoHello, ""});
        EventRecord event;
        if (auto err = ingest::EventFromProto(in.event(), &event)) return Count(*err);
        event.source = "trainer";
        event.recorded_at = clock_->UnixSeconds();
        if (auto err = run_->AddEvent(std::move(event))) Count(*err);
        return;
      }
      case v1::TrainerMessage::kCatalogUpdate: {
        if (!run_) return Count({IngestErrorReason::kNoHello, ""});
        std::vector<ParamChange> changes;
        if (auto err = ingest::CatalogUpdateFromProto(in.catalog_update(), 65536, &changes)) return Count(*err);
        if (auto err = run_->AddCatalogChange(in.catalog_update().from_step(), std::move(changes), rank_, seq, this)) {
          Count(*err);
        }
        return;
      }
      case v1::TrainerMessage::kGoodbye: {
        if (!run_) return Count({IngestErrorReason::kNoHello, ""});
        EndReason reason = EndReason::kFinished;
        std::string message;
        if (auto err = ingest::GoodbyeFromProto(in.goodbye(), &reason, &message)) return Count(*err);
        run_->Finish(rank_, reason, std::move(message), seq, this);
        return;
      }
      case v1::TrainerMessage::BODY_NOT_SET: return Count({IngestErrorReason::kInvalidMessage, ""});
    }
  }

  void Close() {
    if (run_) run_->Detach(rank_, this);
    run_.reset();
  }

  void SendAck(uint64_t durable_step, uint64_t seq) override { ++answers_; }
  void SendError(const IngestError& error) override { ++answers_; }
  void Supersede() override { run_.reset(); }  // the run already detached this stream
  void SendFinished(const std::string& run_id, uint64_t seq) override { ++answers_; }

 private:
  void Count(const IngestError& error) {
    (void)ingest::ReasonToProto(error.reason);
    ++answers_;
  }

  runs::RunRegistry* const registry_;
  const Clock* const clock_;
  std::shared_ptr<runs::Run> run_;
  std::string run_id_;
  uint32_t rank_ = 0;
  RankStep step_;
  uint64_t answers_ = 0;
};

}  // namespace

// The runs log every Hello and rewind; at thousands of inputs a second that is only noise.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<alerts::Rule> rules = alerts::LoadDefaultRules().value();
  FakeClock clock;
  runs::DaemonStats stats;
  daemon::Alerting alerting(rules);  // without its store and notifiers
  runs::RunOptions options;
  options.listener = &alerting;
  options.assembly_timeout = std::chrono::seconds(30);
  options.end_after = std::chrono::seconds(60);
  options.retention = std::chrono::seconds(120);
  runs::RunRegistry registry(options, /*max_runs=*/4, &stats, &clock);
  std::array<std::unique_ptr<FuzzStream>, 4> streams;
  for (auto& s : streams) s = std::make_unique<FuzzStream>(&registry, &clock);

  google::protobuf::io::CodedInputStream input(data, static_cast<int>(size));
  uint8_t control = 0;
  uint32_t length = 0;
  while (input.ReadRaw(&control, 1) && input.ReadVarint32(&length)) {
    FuzzStream& stream = *streams[control & 3];
    if (control & 0x40) stream.Close();
    if (control & 0x80) {
      clock.Advance(std::chrono::seconds(control & 0x3f));
      registry.Tick();
      alerting.Tick(registry, clock.UnixSeconds());
    }
    const auto limit = input.PushLimit(static_cast<int>(length));
    v1::TrainerMessage message;
    const bool parsed = message.ParseFromCodedStream(&input) && input.ConsumedEntireMessage();
    input.PopLimit(limit);
    if (parsed) stream.Handle(message);
  }
  for (auto& s : streams) s->Close();
  registry.Tick();
  return 0;
}

#include "server/ingest/ingest_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>

#include <google/protobuf/arena.h>
#include <grpcpp/alarm.h>
#include <spdlog/spdlog.h>

#include "server/core/thread_annotations.h"
#include "server/ingest/authorizer.h"

namespace gradwatch::ingest {

namespace {

using runs::IngestError;
using runs::IngestErrorReason;

class IngestStream final : public grpc::ServerBidiReactor<v1::TrainerMessage, v1::DaemonMessage>,
                           public runs::StreamSink,
                           public AlertReceiver,
                           public HelloWaiter {
 public:
  IngestStream(IngestService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context), peer_(context->peer()) {
    service_->stats()->open_streams.fetch_add(1, std::memory_order_relaxed);
    // Authentication comes before a slot: a caller the policy refuses cannot hold one. Its Hello
    // is still read (until the Hello deadline), to answer it as a refused Hello.
    if (const Authorizer* auth = service_->authorizer(); auth != nullptr && auth->enabled()) {
      refused_ = auth->CheckScope(*context_, Scope::kWrite, "opening a stream");
      if (refused_.ok()) identity_ = auth->Who(*context_);
    }
    if (refused_.ok()) {
      if (grpc::Status slot = service_->TakeSlot(identity_, peer_); !slot.ok()) {
        FinishWhenDrained(std::move(slot));
        return;
      }
      has_slot_ = true;
    }
    service_->AwaitHello(this);
    StartRead(NextMessage());
  }

  // HelloWaiter: called by the service's sweep, with its list locked (OnDone waits for it).
  void CloseForNoHello() override {
    spdlog::debug("stream from {}: no Hello within {} ms of opening; closed", peer_,
                  service_->options().hello_timeout.count());
    context_->TryCancel();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or the call broke
      DetachFromRun();
      FinishWhenDrained(grpc::Status::OK);
      return;
    }
    bool held = false;
    try {
      held = Handle();
    } catch (const std::exception& e) {
      spdlog::error("stream from {}: unexpected error handling a message: {}", peer_, e.what());
      SendError({IngestErrorReason::kInvalidMessage, "internal error handling this message"}, in_->seq());
    }
    // A held step's retry (RetryHeld) starts the next read, and it may already have run on
    // another thread and cleared holding_: reading here too would start a second read (gRPC
    // aborts the daemon on it).
    if (!held) ReadNext();
  }

  // Reads the next message, unless the stream is finishing or its current step is held.
  void ReadNext() EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (finishing_ || holding_) return;
    }
    StartRead(NextMessage());
  }

  void OnWriteDone(bool ok) override EXCLUDES(mu_) {
    mu_.Lock();
    out_.pop_front();
    if (!ok) {
      broken_ = true;
      out_.clear();
    }
    if (!out_.empty()) {
      v1::DaemonMessage* next = &out_.front();
      mu_.Unlock();
      StartWrite(next);
      return;
    }
    writing_ = false;
    MaybeFinishLocked();
    mu_.Unlock();
  }

  void OnCancel() override {
    DetachFromRun();
    // A held step has no read outstanding to end the call: its retry finishes it.
    MutexLock lock(&mu_);
    cancelled_ = true;
  }

  void OnDone() override {
    DetachFromRun();
    service_->HelloDone(this);
    if (has_slot_) service_->ReleaseSlot(identity_);
    service_->stats()->open_streams.fetch_sub(1, std::memory_order_relaxed);
    delete this;
  }

  // StreamSink: called with the run's mutex held; only queue.
  void SendAck(uint64_t durable_step, uint64_t seq) override EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (finishing_ || broken_) return;
    // Coalesce with an ack that is still waiting to be written.
    if (out_.size() > (writing_ ? 1u : 0u) && out_.back().has_ack()) {
      v1::Ack* ack = out_.back().mutable_ack();
      ack->set_durable_step(std::max(ack->durable_step(), durable_step));
      ack->set_seq(std::max(ack->seq(), seq));
      return;
    }
    v1::DaemonMessage msg;
    msg.mutable_ack()->set_durable_step(durable_step);
    msg.mutable_ack()->set_seq(seq);
    QueueLocked(std::move(msg));
  }

  void SendError(const IngestError& error) override { SendError(error, 0); }

  // AlertReceiver: alerts that come before the stream's Accepted wait for it.
  void SendAlert(const alerts::Alert& alert) override EXCLUDES(mu_) {
    v1::DaemonMessage msg;
    AlertToProto(alert, msg.mutable_alert());
    MutexLock lock(&mu_);
    if (!accepted_) {
      early_alerts_.push_back(std::move(msg));
      return;
    }
    QueueLocked(std::move(msg));
  }

  void SendFinished(const std::string& run_id, uint64_t seq) override {
    v1::DaemonMessage msg;
    msg.mutable_finished()->set_seq(seq);
    msg.mutable_finished()->set_run_id(run_id);
    Queue(std::move(msg));
  }

  void SendEventAck(uint64_t seq, uint64_t step) override {
    v1::DaemonMessage msg;
    msg.mutable_event_ack()->set_seq(seq);
    msg.mutable_event_ack()->set_step(step);
    Queue(std::move(msg));
  }

  void Supersede() override EXCLUDES(mu_) {
    std::string run_id;
    uint32_t rank = 0;
    {
      MutexLock lock(&mu_);
      run_id = run_id_;
      rank = rank_;
    }
    SendError({IngestErrorReason::kSuperseded,
               "another stream opened for run " + run_id + " rank " + std::to_string(rank) + "; this one is closed"},
              0);
    Unsubscribe();
    MutexLock lock(&mu_);
    run_.reset();  // the run already detached us; do not detach the new stream
    finishing_ = true;
    finish_status_ = grpc::Status(grpc::StatusCode::ABORTED, "superseded by a newer stream");
    MaybeFinishLocked();
  }

 private:
  // Handles the message just read; true when it is a step the run holds (Hold: its retry reads
  // next).
  bool Handle() {
    runs::DaemonStats& stats = *service_->stats();
    stats.messages_received.fetch_add(1, std::memory_order_relaxed);
    const uint64_t seq = in_->seq();
    const size_t size = in_->ByteSizeLong();
    if (size > service_->options().max_message_bytes) {
      const uint64_t step = in_->has_step() ? in_->step().step() : in_->has_event() ? in_->event().step() : 0;
      Reject({IngestErrorReason::kOversized,
              "message of " + std::to_string(size) + " bytes exceeds the limit of " +
                  std::to_string(service_->options().max_message_bytes) + " bytes",
              step},
             seq);
      return false;
    }
    if (!refused_.ok() && !in_->has_hello()) {
      FinishWhenDrained(refused_);  // refused when it opened: nothing but its Hello is answered
      return false;
    }
    switch (in_->body_case()) {
      case v1::TrainerMessage::kHello: HandleHello(seq); return false;
      case v1::TrainerMessage::kStep: return HandleStep(seq);
      case v1::TrainerMessage::kEvent: HandleEvent(seq); return false;
      case v1::TrainerMessage::kGoodbye: HandleGoodbye(seq); return false;
      case v1::TrainerMessage::kCatalogUpdate: HandleCatalogUpdate(seq); return false;
      case v1::TrainerMessage::BODY_NOT_SET:
        Reject(
            {IngestErrorReason::kInvalidMessage, "message has no body (hello, step, event, catalog_update or goodbye)"},
            seq);
        return false;
    }
    return false;
  }

  // A Hello the authorizer refused: the Error tells the client to stop, and the stream ends with
  // the refusal's status (UNAUTHENTICATED or PERMISSION_DENIED).
  void RefuseHello(const grpc::Status& refusal, uint64_t seq) {
    Reject({IngestErrorReason::kInvalidHello,
            std::string(refusal.error_code() == grpc::StatusCode::UNAUTHENTICATED ? "UNAUTHENTICATED: "
                                                                                  : "PERMISSION_DENIED: ") +
                refusal.error_message()},
           seq);
    FinishWhenDrained(refusal);
  }

  void HandleHello(uint64_t seq) {
    service_->HelloDone(this);
    if (!refused_.ok()) {
      RefuseHello(refused_, seq);  // refused when it opened
      return;
    }
    RunMeta meta;
    uint32_t rank = 0;
    if (auto err = HelloFromProto(in_->hello(), service_->options().hello, &meta, &rank)) {
      Reject(*err, seq);
      return;
    }
    if (const Authorizer* auth = service_->authorizer()) {
      const grpc::Status allowed = auth->Check(*context_, Scope::kWrite, meta.run_id, "streaming run " + meta.run_id);
      if (!allowed.ok()) {
        RefuseHello(allowed, seq);
        return;
      }
    }
    std::string carried;
    {
      MutexLock lock(&mu_);
      if (run_ && (meta.run_id != run_id_ || rank != rank_)) {
        carried = "this stream already carries run " + run_id_ + " rank " + std::to_string(rank_) +
                  "; open a new stream for another run or rank";
      } else {
        // Set before Attach publishes this stream: a Supersede() may read them at once.
        run_id_ = meta.run_id;
        rank_ = rank;
      }
    }
    if (!carried.empty()) {
      Reject({IngestErrorReason::kInvalidHello, std::move(carried)}, seq);
      return;
    }
    // Subscribed before the attach, so that alerts the attach causes (a rewind resolves some)
    // reach this stream too, after its Accepted.
    Subscribe(meta.run_id);
    runs::AttachInfo info;
    IngestError error{IngestErrorReason::kInvalidHello, ""};
    auto run = service_->registry()->Attach(meta, rank, this, &info, &error);
    if (!run) {
      Unsubscribe();
      Reject(error, seq);
      return;
    }
    {
      MutexLock lock(&mu_);
      run_ = std::move(run);
    }
    spdlog::info("run {} rank {}/{}: stream from {} ({}), {} parameters", meta.run_id, rank, meta.world_size, peer_,
                 in_->hello().client().empty() ? "unknown client" : in_->hello().client(), meta.params.size());
    v1::DaemonMessage msg;
    v1::Accepted* a = msg.mutable_accepted();
    a->set_run_id(meta.run_id);
    a->set_rank(rank);
    a->set_has_durable_step(info.has_durable_step);
    a->set_last_durable_step(info.last_durable_step);
    a->set_has_received_step(info.has_received_step);
    a->set_last_received_step(info.last_received_step);
    a->set_max_message_bytes(service_->options().max_message_bytes);
    a->set_acks_events(true);
    MutexLock lock(&mu_);
    QueueLocked(std::move(msg));
    accepted_ = true;
    for (v1::DaemonMessage& early : early_alerts_) QueueLocked(std::move(early));
    early_alerts_.clear();
  }

  void Subscribe(const std::string& run_id) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      if (subscribed_ == run_id) return;
    }
    Unsubscribe();
    service_->Subscribe(run_id, this);
    MutexLock lock(&mu_);
    subscribed_ = run_id;
  }

  void Unsubscribe() EXCLUDES(mu_) {
    std::string run_id;
    {
      MutexLock lock(&mu_);
      run_id = std::move(subscribed_);
      subscribed_.clear();
      accepted_ = false;
      early_alerts_.clear();
    }
    if (!run_id.empty()) service_->Unsubscribe(run_id, this);
  }

  // True when the run holds the step (see Handle).
  bool HandleStep(uint64_t seq) {
    uint32_t rank = 0;
    std::shared_ptr<runs::Run> run = CurrentRun(&rank);
    if (!run) {
      Reject({IngestErrorReason::kNoHello, "step before hello: send a Hello first", in_->step().step()}, seq);
      return false;
    }
    if (auto err = StepFromProto(in_->step(), seq, &step_)) {
      Reject(*err, seq);
      return false;
    }
    bool held = false;
    if (auto err = run->AddStep(rank, step_, this, &held)) Reject(*err, seq);
    if (held) Hold(seq);
    return held;
  }

  // The run holds this step until the ranks it waits for catch up (Run::AddStep): offer it
  // again after a short wait, reading nothing more meanwhile, so that gRPC's flow control
  // pushes back on the client. The wait doubles up to kMaxHoldRetry while the step stays held.
  static constexpr std::chrono::milliseconds kFirstHoldRetry{2};
  static constexpr std::chrono::milliseconds kMaxHoldRetry{50};

  void Hold(uint64_t seq) EXCLUDES(mu_) {
    grpc::Alarm* alarm = nullptr;
    std::chrono::milliseconds wait{0};
    {
      MutexLock lock(&mu_);
      if (!holding_) {
        holding_ = true;
        hold_retry_ = kFirstHoldRetry;
        service_->stats()->held_reports.fetch_add(1, std::memory_order_relaxed);
        spdlog::debug("stream from {}: step {} (seq {}) held until the ranks the run waits for catch up", peer_,
                      step_.step, seq);
      } else {
        hold_retry_ = std::min(hold_retry_ * 2, std::chrono::milliseconds(kMaxHoldRetry));
      }
      // The stream cannot finish while the alarm is set (MaybeFinishLocked), so it outlives the
      // alarm; only this path replaces alarm_, and no read or other alarm is outstanding.
      alarm_pending_ = true;
      alarm_ = std::make_unique<grpc::Alarm>();
      alarm = alarm_.get();
      wait = hold_retry_;
    }
    // Set without mu_: gRPC calls are made without it (see mu_).
    alarm->Set(std::chrono::system_clock::now() + wait, [this, seq](bool) { RetryHeld(seq); });
  }

  void RetryHeld(uint64_t seq) EXCLUDES(mu_) {
    {
      MutexLock lock(&mu_);
      alarm_pending_ = false;
      if (finishing_ || cancelled_) {
        holding_ = false;
        if (!finishing_) {
          finishing_ = true;
          finish_status_ = grpc::Status::CANCELLED;
        }
        MaybeFinishLocked();
        return;
      }
    }
    uint32_t rank = 0;
    std::shared_ptr<runs::Run> run = CurrentRun(&rank);
    bool held = false;
    if (run) {
      if (auto err = run->AddStep(rank, step_, this, &held)) Reject(*err, seq);
    }
    if (held) {
      Hold(seq);
      return;
    }
    {
      MutexLock lock(&mu_);
      holding_ = false;
    }
    ReadNext();
  }

  void HandleEvent(uint64_t seq) {
    uint32_t rank = 0;
    std::shared_ptr<runs::Run> run = CurrentRun(&rank);
    if (!run) {
      Reject({IngestErrorReason::kNoHello, "event before hello: send a Hello first", in_->event().step()}, seq);
      return;
    }
    EventRecord event;
    if (auto err = EventFromProto(in_->event(), &event)) {
      Reject(*err, seq);
      return;
    }
    event.source = "trainer";
    event.recorded_at = service_->clock()->UnixSeconds();
    if (auto err = run->AddEvent(std::move(event), rank, seq, this)) Reject(*err, seq);
  }

  void HandleCatalogUpdate(uint64_t seq) {
    uint32_t rank = 0;
    std::shared_ptr<runs::Run> run = CurrentRun(&rank);
    const uint64_t from_step = in_->catalog_update().from_step();
    if (!run) {
      Reject({IngestErrorReason::kNoHello, "catalog update before hello: send a Hello first", from_step}, seq);
      return;
    }
    std::vector<ParamChange> changes;
    if (auto err = CatalogUpdateFromProto(in_->catalog_update(), service_->options().hello.max_params, &changes)) {
      Reject(*err, seq);
      return;
    }
    if (auto err = run->AddCatalogChange(from_step, std::move(changes), rank, seq, this)) Reject(*err, seq);
  }

  void HandleGoodbye(uint64_t seq) {
    uint32_t rank = 0;
    std::shared_ptr<runs::Run> run = CurrentRun(&rank);
    if (!run) {
      Reject({IngestErrorReason::kNoHello, "goodbye before hello: send a Hello first"}, seq);
      return;
    }
    EndReason reason = EndReason::kFinished;
    std::string message;
    if (auto err = GoodbyeFromProto(in_->goodbye(), &reason, &message)) {
      Reject(*err, seq);
      return;
    }
    run->Finish(rank, reason, std::move(message), seq, this);
  }

  // The run this stream carries (null before a Hello or once detached) and its rank here.
  std::shared_ptr<runs::Run> CurrentRun(uint32_t* rank) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    *rank = rank_;
    return run_;
  }

  void Reject(const IngestError& error, uint64_t seq) {
    service_->stats()->CountError(error.reason);
    spdlog::debug("stream from {}: rejected message seq {}: {} ({})", peer_, seq, error.message,
                  runs::IngestErrorReasonName(error.reason));
    SendError(error, seq);
  }

  void SendError(const IngestError& error, uint64_t seq) {
    v1::DaemonMessage msg;
    v1::Error* e = msg.mutable_error();
    e->set_seq(seq);
    e->set_reason(ReasonToProto(error.reason));
    e->set_step(error.step);
    e->set_message(error.message);
    Queue(std::move(msg));
  }

  void Queue(v1::DaemonMessage msg) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    QueueLocked(std::move(msg));
  }

  // Releases mu_ while it starts a write (gRPC may call OnWriteDone at once, which takes it).
  void QueueLocked(v1::DaemonMessage msg) REQUIRES(mu_) {
    if (finishing_ || broken_) return;
    if (out_.size() >= service_->options().max_queued_answers) {
      // The client is not reading its answers; acks coalesce, so only errors are dropped here.
      ++dropped_answers_;
      return;
    }
    out_.push_back(std::move(msg));
    if (writing_) return;
    writing_ = true;
    v1::DaemonMessage* next = &out_.front();
    mu_.Unlock();
    StartWrite(next);
    mu_.Lock();
  }

  void DetachFromRun() EXCLUDES(mu_) {
    Unsubscribe();
    std::shared_ptr<runs::Run> run;
    uint32_t rank = 0;
    {
      MutexLock lock(&mu_);
      run = std::move(run_);
      run_.reset();
      rank = rank_;
    }
    if (run) run->Detach(rank, this);
  }

  void FinishWhenDrained(grpc::Status status) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (finishing_) return;
    finishing_ = true;
    finish_status_ = std::move(status);
    MaybeFinishLocked();
  }

  // Finish once every queued answer is written (gRPC allows one outstanding write).
  void MaybeFinishLocked() REQUIRES(mu_) {
    if (!finishing_ || finished_ || writing_ || alarm_pending_) return;
    finished_ = true;
    Finish(finish_status_);
  }

  // The message the next read fills, on arena_ emptied first: the previous message (and whatever
  // points into it) is done with once a read is started. A step's thousands of nested messages
  // then cost no malloc or free: the arena's first block is this stream's own buffer, regrown
  // (up to kMaxKeptArenaBytes) when a message needed more, so that once warm a read allocates
  // nothing. Read path only.
  v1::TrainerMessage* NextMessage() {
    if (arena_) {
      const uint64_t used = arena_->SpaceAllocated();
      if (used > arena_block_size_ && arena_block_size_ < kMaxKeptArenaBytes) {
        arena_.reset();
        arena_block_size_ = std::min<size_t>(kMaxKeptArenaBytes, (used + used / 4 + 4095) / 4096 * 4096);
        arena_block_ = std::make_unique_for_overwrite<char[]>(arena_block_size_);
      } else {
        arena_->Reset();
      }
    }
    if (!arena_) {
      google::protobuf::ArenaOptions options;
      options.initial_block = arena_block_.get();
      options.initial_block_size = arena_block_ ? arena_block_size_ : 0;
      options.max_block_size = 1 << 20;
      arena_.emplace(options);
    }
    in_ = google::protobuf::Arena::CreateMessage<v1::TrainerMessage>(&*arena_);
    return in_;
  }

  static constexpr size_t kMaxKeptArenaBytes = size_t{1} << 20;

  IngestService* const service_;
  grpc::CallbackServerContext* const context_;  // valid for the reactor's life
  const std::string peer_;
  std::unique_ptr<char[]> arena_block_;  // outlives arena_ (declared first)
  size_t arena_block_size_ = 0;
  std::optional<google::protobuf::Arena> arena_;
  v1::TrainerMessage* in_ = nullptr;  // on arena_; only touched by the read path
  RankStep step_;                     // reused conversion buffer, read path only
  // Set in the constructor, read after: the policy's refusal of the caller (OK: allowed), its
  // name in the policy, and whether it holds a slot (IngestService::TakeSlot).
  grpc::Status refused_;
  std::string identity_;
  bool has_slot_ = false;

  // Lock order: a run's mutex, then this one (the run calls StreamSink methods with its mutex
  // held); never the other way round: run methods are called with mu_ released. gRPC calls
  // (StartWrite, Finish) are made without it, except Finish from MaybeFinishLocked.
  Mutex mu_;
  std::string run_id_ GUARDED_BY(mu_);  // of the run this stream carries, set at its Hello
  uint32_t rank_ GUARDED_BY(mu_) = 0;
  std::shared_ptr<runs::Run> run_ GUARDED_BY(mu_);
  std::deque<v1::DaemonMessage> out_ GUARDED_BY(mu_);  // front is being written when writing_
  bool writing_ GUARDED_BY(mu_) = false;
  bool finishing_ GUARDED_BY(mu_) = false;
  bool finished_ GUARDED_BY(mu_) = false;
  bool broken_ GUARDED_BY(mu_) = false;
  grpc::Status finish_status_ GUARDED_BY(mu_);
  uint64_t dropped_answers_ GUARDED_BY(mu_) = 0;
  bool cancelled_ GUARDED_BY(mu_) = false;
  // A step the run held (HandleStep) waits in step_ for its retry; no read is outstanding.
  bool holding_ GUARDED_BY(mu_) = false;
  bool alarm_pending_ GUARDED_BY(mu_) = false;
  std::chrono::milliseconds hold_retry_ GUARDED_BY(mu_){0};
  std::unique_ptr<grpc::Alarm> alarm_ GUARDED_BY(mu_);
  // The run whose alerts this stream hears (IngestService::Subscribe); empty: none.
  std::string subscribed_ GUARDED_BY(mu_);
  bool accepted_ GUARDED_BY(mu_) = false;  // Accepted is queued: alerts follow it at once
  std::vector<v1::DaemonMessage> early_alerts_ GUARDED_BY(mu_);
};

}  // namespace

IngestService::IngestService(const IngestOptions& options, runs::RunRegistry* registry, runs::DaemonStats* stats,
                             const Clock* clock)
    : options_(options), registry_(registry), stats_(stats), clock_(clock) {}

void IngestService::SendAlert(const alerts::Alert& alert) {
  const auto run = alert.labels.find("run");
  if (run == alert.labels.end()) return;
  std::lock_guard lock(receivers_mu_);
  const auto it = receivers_.find(run->second);
  if (it == receivers_.end()) return;
  for (AlertReceiver* r : it->second) r->SendAlert(alert);
}

void IngestService::Subscribe(const std::string& run_id, AlertReceiver* receiver) {
  std::lock_guard lock(receivers_mu_);
  receivers_[run_id].push_back(receiver);
}

void IngestService::Unsubscribe(const std::string& run_id, AlertReceiver* receiver) {
  std::lock_guard lock(receivers_mu_);
  const auto it = receivers_.find(run_id);
  if (it == receivers_.end()) return;
  std::erase(it->second, receiver);
  if (it->second.empty()) receivers_.erase(it);
}

grpc::Status IngestService::TakeSlot(const std::string& identity, const std::string& peer) {
  MutexLock lock(&slots_mu_);
  if (open_ >= options_.max_streams) {
    spdlog::warn("refusing a stream from {}: {} streams open (limits.max_streams)", peer, open_);
    return {grpc::StatusCode::RESOURCE_EXHAUSTED, "too many open streams (limits.max_streams)"};
  }
  size_t& mine = open_by_identity_[identity];
  if (mine >= options_.max_streams_per_identity) {
    const std::string who = identity.empty() ? "callers without a policy" : identity;
    spdlog::warn("refusing a stream from {}: {} has {} streams open (limits.max_streams_per_identity)", peer, who,
                 mine);
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            who + " has " + std::to_string(mine) + " streams open (limits.max_streams_per_identity)"};
  }
  ++mine;
  ++open_;
  return grpc::Status::OK;
}

void IngestService::ReleaseSlot(const std::string& identity) {
  MutexLock lock(&slots_mu_);
  --open_;
  const auto it = open_by_identity_.find(identity);
  if (it != open_by_identity_.end() && --it->second == 0) open_by_identity_.erase(it);
}

void IngestService::AwaitHello(HelloWaiter* stream) {
  MutexLock lock(&hello_mu_);
  awaiting_hello_.push_back({std::chrono::steady_clock::now(), stream});
  awaiting_index_[stream] = std::prev(awaiting_hello_.end());
}

void IngestService::HelloDone(HelloWaiter* stream) {
  MutexLock lock(&hello_mu_);
  const auto it = awaiting_index_.find(stream);
  if (it == awaiting_index_.end()) return;
  awaiting_hello_.erase(it->second);
  awaiting_index_.erase(it);
}

size_t IngestService::CloseStreamsWithoutHello(std::chrono::steady_clock::time_point now) {
  MutexLock lock(&hello_mu_);
  size_t closed = 0;
  while (!awaiting_hello_.empty() && now - awaiting_hello_.front().opened >= options_.hello_timeout) {
    HelloWaiter* stream = awaiting_hello_.front().stream;
    awaiting_index_.erase(stream);
    awaiting_hello_.pop_front();
    stream->CloseForNoHello();  // under hello_mu_: the stream's OnDone waits for it (HelloDone)
    ++closed;
  }
  return closed;
}

grpc::ServerBidiReactor<v1::TrainerMessage, v1::DaemonMessage>* IngestService::Stream(
    grpc::CallbackServerContext* context) {
  return new IngestStream(this, context);
}

}  // namespace gradwatch::ingest

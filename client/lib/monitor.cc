#include "gradwatch/monitor.h"

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "client/lib/stall_timer.h"
#include "gradwatch/v1/gradwatch.grpc.pb.h"

namespace gradwatch::client {
namespace {

using Stream = grpc::ClientReaderWriter<v1::TrainerMessage, v1::DaemonMessage>;

// Errors that name a message the daemon will never acknowledge.
bool RefersToStep(v1::ErrorReason reason) {
  switch (reason) {
    case v1::ERROR_REASON_STEP_REGRESSION:
    case v1::ERROR_REASON_STEP_CONFLICT:
    case v1::ERROR_REASON_UNKNOWN_PARAM:
    case v1::ERROR_REASON_NEGATIVE_NORM:
    case v1::ERROR_REASON_OVERSIZED:
    case v1::ERROR_REASON_INVALID_MESSAGE:
    case v1::ERROR_REASON_LATE_FOR_STEP: return true;
    default: return false;
  }
}

std::string ReasonName(v1::ErrorReason reason) {
  const std::string& name = v1::ErrorReason_Name(reason);
  return name.empty() ? "ERROR_REASON_" + std::to_string(static_cast<int>(reason)) : name;
}

template <typename Fn, typename Arg>
void InvokeCallback(const Fn& fn, const Arg& arg, const char* what) {
  if (!fn) return;
  try {
    fn(arg);
  } catch (const std::exception& e) {
    spdlog::error("gradwatch monitor: {} callback threw: {}", what, e.what());
  } catch (...) {
    spdlog::error("gradwatch monitor: {} callback threw", what);
  }
}

}  // namespace

struct Monitor::Connection {
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream;
  std::thread reader;
  // Guarded by Monitor::mu_.
  bool accepted = false;
  bool ended = false;       // the reader saw the end of the stream
  bool rejected = false;    // the daemon refused the Hello or superseded this stream
  bool superseded = false;  // another stream took over this run and rank: do not reconnect
  bool goodbye_sent = false;
  // The daemon cannot commit now (ERROR_REASON_STORAGE_UNAVAILABLE): end this stream, keep
  // everything, and reopen after a growing back-off.
  bool storage_unavailable = false;
  bool acks_events = false;  // Accepted.acks_events
  uint64_t max_message_bytes = 0;
};

Monitor::Monitor(MonitorOptions options)
    : options_(std::move(options)),
      buffer_(options_.queue_capacity, options_.event_capacity,
              SendWindow{options_.max_unacked_steps, options_.max_unacked_bytes}, options_.queue_capacity_bytes),
      backoff_(options_.initial_backoff),
      rng_(std::random_device{}()) {}

Monitor::~Monitor() { Stop(); }

void Monitor::Start() {
  std::lock_guard lock(mu_);
  if (started_ || stopping_) return;
  started_ = true;
  grpc::ChannelArguments args;
  // gRPC's own reconnect back-off (up to 120 s by default) would otherwise keep a restarted
  // daemon unreachable long after ours has expired.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, static_cast<int>(options_.initial_backoff.count()));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, static_cast<int>(options_.initial_backoff.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, static_cast<int>(options_.max_backoff.count()));
  std::string error;
  const auto credentials = MakeChannelCredentials(options_.tls, &error);
  if (credentials == nullptr) {
    // As a daemon's refusal: nothing can be sent, and trying again would not help.
    spdlog::error("gradwatch monitor: {}", error);
    stats_.rejected = true;
    stats_.last_error = error;
    flush_cv_.notify_all();
    return;
  }
  AddTlsArguments(options_.tls, args);
  channel_ = grpc::CreateCustomChannel(options_.address, credentials, args);
  sender_ = std::thread([this] { SenderLoop(); });
}

bool Monitor::Log(v1::StepStats step) {
  std::lock_guard lock(mu_);
  if (stopping_) {
    ++stats_.dropped;
    return false;
  }
  const bool pushed = buffer_.PushStep(std::move(step));
  NoteQueuedLocked(pushed);
  if (!pushed) return false;
  sender_cv_.notify_one();
  return true;
}

bool Monitor::LogBlocking(v1::StepStats step, std::chrono::milliseconds stall_timeout) {
  std::unique_lock lock(mu_);
  WaitWhileProgressing(lock, space_cv_, stall_timeout, [this] { return buffer_.HasRoomForStep(); });
  if (stopping_) {
    ++stats_.dropped;
    return false;
  }
  const bool pushed = buffer_.PushStep(std::move(step));
  NoteQueuedLocked(pushed);
  if (!pushed) return false;
  sender_cv_.notify_one();
  return true;
}

bool Monitor::MayWarnLocked(Warning kind) {
  if (!options_.warnings) return false;
  const auto now = std::chrono::steady_clock::now();
  auto& last = warned_at_[static_cast<int>(kind)];
  if (last && now - *last < options_.warn_interval) return false;
  last = now;
  return true;
}

void Monitor::NoteQueuedLocked(bool pushed) {
  const auto now = std::chrono::steady_clock::now();
  if (!first_step_at_) {
    first_step_at_ = now;
    if (!stats_.connected) down_since_ = now;
  }
  if (!stats_.connected && down_since_ && now - *down_since_ >= options_.unreachable_warning_after &&
      MayWarnLocked(Warning::kUnreachable)) {
    outage_warned_since_ = *down_since_;
    spdlog::warn(
        "gradwatch monitor: cannot reach the daemon at {} for run {} ({} for {:.0f} s); {} step(s) queued of {}, kept "
        "and sent once it answers (beyond the queue, steps are dropped)",
        options_.address, options_.hello.run_id(),
        stats_.last_error.empty() ? std::string("no answer") : stats_.last_error,
        std::chrono::duration<double>(now - *down_since_).count(), buffer_.steps(), options_.queue_capacity);
  }
  if (!pushed) {
    ++drops_untold_;
    if (MayWarnLocked(Warning::kDropped)) {
      spdlog::warn(
          "gradwatch monitor: dropped {} step(s) of run {}: the queue of {} is full and the daemon at {} is not "
          "taking them{}",
          drops_untold_, options_.hello.run_id(), options_.queue_capacity, options_.address,
          stats_.last_error.empty() ? std::string() : " (" + stats_.last_error + ")");
      drops_untold_ = 0;
    }
    return;
  }
  if (buffer_.steps() * 2 >= options_.queue_capacity && options_.queue_capacity >= 2 &&
      MayWarnLocked(Warning::kQueueHalf)) {
    spdlog::warn(
        "gradwatch monitor: {} of {} steps of run {} wait for the daemon at {}; once the queue is full, steps are "
        "dropped (counted in Stats().dropped)",
        buffer_.steps(), options_.queue_capacity, options_.hello.run_id(), options_.address);
  }
}

bool Monitor::Event(uint64_t step, std::string text) {
  v1::Event event;
  event.set_step(step);
  event.set_text(std::move(text));
  std::lock_guard lock(mu_);
  if (stopping_ || !buffer_.PushEvent(std::move(event))) return false;
  sender_cv_.notify_one();
  return true;
}

bool Monitor::EventBlocking(uint64_t step, std::string text, std::chrono::milliseconds stall_timeout) {
  v1::Event event;
  event.set_step(step);
  event.set_text(std::move(text));
  std::unique_lock lock(mu_);
  WaitWhileProgressing(lock, space_cv_, stall_timeout, [this] { return buffer_.HasRoomForEvent(); });
  if (stopping_ || !buffer_.PushEvent(std::move(event))) return false;
  sender_cv_.notify_one();
  return true;
}

bool Monitor::CatalogUpdateBlocking(v1::CatalogUpdate update, std::chrono::milliseconds stall_timeout) {
  std::unique_lock lock(mu_);
  WaitWhileProgressing(lock, space_cv_, stall_timeout, [this] { return buffer_.HasRoomForEvent(); });
  if (stopping_ || !buffer_.PushCatalogUpdate(std::move(update))) return false;
  sender_cv_.notify_one();
  return true;
}

bool Monitor::Flush(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return WaitThroughReconnect(
      lock, timeout, [this] { return DrainedLocked(); }, "flush");
}

template <typename Done>
bool Monitor::WaitThroughReconnect(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout, Done done,
                                   const char* what) {
  using SteadyClock = std::chrono::steady_clock;
  const uint64_t opened = streams_opened_;
  auto give_up_at = SteadyClock::now() + timeout;
  while (!done()) {
    if (stopping_ || stats_.rejected) return false;
    const auto now = SteadyClock::now();
    if (now >= give_up_at) {
      // Backing off with no stream opened since the wait began: the reconnect is part of the wait.
      if (reconnect_at_ && streams_opened_ == opened) {
        give_up_at = std::max(give_up_at, *reconnect_at_ + std::max(timeout, reconnect_delay_));
        continue;
      }
      spdlog::warn("gradwatch monitor: {} gave up on run {} rank {} at {}: {} steps and events not acknowledged{}",
                   what, options_.hello.run_id(), options_.hello.rank(), options_.address,
                   buffer_.queued() + buffer_.unacked(),
                   stats_.last_error.empty() ? "" : " (last error: " + stats_.last_error + ")");
      return false;
    }
    flush_cv_.wait_until(lock, std::min(give_up_at, now + std::chrono::seconds(1)));
  }
  return true;
}

bool Monitor::FlushWhileProgressing(std::chrono::milliseconds stall_timeout) {
  std::unique_lock lock(mu_);
  WaitWhileProgressing(lock, flush_cv_, stall_timeout, [this] { return DrainedLocked(); });
  return DrainedLocked();
}

template <typename Done>
bool Monitor::WaitWhileProgressing(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                                   std::chrono::milliseconds stall_timeout, Done done) {
  using SteadyClock = std::chrono::steady_clock;
  StallTimer timer(stall_timeout, SteadyClock::now(), progress_);
  while (!done()) {
    if (stopping_ || stats_.rejected) return false;
    const auto now = SteadyClock::now();
    timer.Observe(progress_, now);
    if (timer.Stalled(now)) return false;
    cv.wait_until(lock, timer.GiveUpAt());
  }
  return true;
}

void Monitor::ProgressLocked() {
  ++progress_;
  sender_cv_.notify_all();  // the window may have room again, or the Goodbye be due
  space_cv_.notify_all();
  flush_cv_.notify_all();
}

bool Monitor::DrainedLocked() const {
  return buffer_.empty() && (!owed_through_ || (stats_.has_acked && stats_.acked_through_step >= *owed_through_));
}

bool Monitor::Finish(std::chrono::milliseconds timeout, v1::GoodbyeReason reason, std::string message) {
  bool finished = false;
  {
    std::unique_lock lock(mu_);
    if (!started_ || stopping_) return false;
    v1::Goodbye goodbye;
    goodbye.set_reason(reason);
    goodbye.set_message(std::move(message));
    goodbye_ = std::move(goodbye);
    sender_cv_.notify_all();
    finished = WaitThroughReconnect(
        lock, timeout, [this] { return stats_.finished; }, "finish");
  }
  Stop();
  return finished;
}

bool Monitor::WaitAccepted(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  flush_cv_.wait_for(lock, timeout, [this] { return stats_.connected || stopping_ || stats_.rejected; });
  return stats_.connected;
}

void Monitor::Stop() {
  std::lock_guard stop_lock(stop_mu_);
  std::unique_lock lock(mu_);
  stopping_ = true;
  sender_cv_.notify_all();
  space_cv_.notify_all();
  flush_cv_.notify_all();
  if (!sender_.joinable()) return;
  // An accepted stream is closed by the sender itself, unless it is stuck in a blocking gRPC call
  // (a Write the daemon does not read); cancelling the context frees it. A stream not yet
  // accepted (still waiting for the daemon) has nothing to close cleanly.
  const bool closed = flush_cv_.wait_for(lock, options_.close_grace * 2, [this] {
    if (current_ != nullptr && !current_->accepted) current_->context.TryCancel();
    return current_ == nullptr;
  });
  if (!closed && current_ != nullptr) current_->context.TryCancel();
  lock.unlock();
  sender_.join();
}

MonitorStats Monitor::Stats() const {
  std::lock_guard lock(mu_);
  MonitorStats s = stats_;
  s.queued = buffer_.queued();
  s.unacked = buffer_.unacked();
  s.dropped += buffer_.dropped();
  return s;
}

void Monitor::SenderLoop() {
  try {
    while (true) {
      Connection conn;
      const bool accepted = RunConnection(conn);
      std::chrono::milliseconds delay;
      {
        std::lock_guard lock(mu_);
        if (stopping_) break;
        if (conn.superseded) {
          spdlog::warn("gradwatch monitor: another stream took over run {} rank {}; not reconnecting",
                       options_.hello.run_id(), options_.hello.rank());
          break;
        }
        if (accepted && !conn.storage_unavailable) backoff_ = options_.initial_backoff;
        // A refused Hello will be refused again until someone changes the daemon: retry slowly.
        if (conn.rejected) backoff_ = options_.max_backoff;
      }
      delay = NextBackoff();
      spdlog::debug("gradwatch monitor: reconnecting to {} in {} ms", options_.address, delay.count());
      {
        std::lock_guard lock(mu_);
        reconnect_at_ = std::chrono::steady_clock::now() + delay;
        reconnect_delay_ = delay;
      }
      SleepBackoff(delay);
    }
  } catch (const std::exception& e) {
    spdlog::error("gradwatch monitor: sender thread failed: {}", e.what());
  } catch (...) {
    spdlog::error("gradwatch monitor: sender thread failed");
  }
  std::lock_guard lock(mu_);
  current_ = nullptr;
  stats_.connected = false;
  flush_cv_.notify_all();
}

bool Monitor::RunConnection(Connection& conn) {
  v1::TrainerMessage hello;
  bool resumed = false;  // a stream was accepted before: the resume, if any, is done
  {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    current_ = &conn;
    ++streams_opened_;
    reconnect_at_.reset();
    flush_cv_.notify_all();
    hello.set_seq(next_seq_++);
    resumed = accepted_streams_ > 0;
  }
  *hello.mutable_hello() = options_.hello;
  if (resumed) hello.mutable_hello()->clear_resume_from_step();  // declared once, when it happened
  if (hello.hello().client().empty()) hello.mutable_hello()->set_client(kClientName);

  // Waiting for the channel, rather than failing fast, lets gRPC reconnect as soon as the daemon
  // listens again (a fail-fast call only sees the channel's cached failure until its own
  // back-off expires). Stop() cancels the wait.
  conn.context.set_wait_for_ready(true);
  AddToken(options_.tls, conn.context);
  auto stub = v1::Ingest::NewStub(channel_);
  conn.stream = stub->Stream(&conn.context);
  const bool hello_written = conn.stream->Write(hello);
  // The reader runs even when the Hello failed: it is what drains the stream so Finish can run.
  conn.reader = std::thread([this, &conn] { ReaderLoop(conn); });

  bool accepted = false;
  if (hello_written) {
    std::unique_lock lock(mu_);
    sender_cv_.wait(lock, [&] { return conn.accepted || conn.ended || conn.rejected || stopping_; });
    accepted = conn.accepted;
    while (conn.accepted && !conn.ended && !conn.rejected && !conn.storage_unavailable && !stopping_) {
      // The Goodbye goes once every step is durable, so the run ends with all of them kept.
      const auto goodbye_due = [&] { return goodbye_ && !conn.goodbye_sent && !stats_.finished && DrainedLocked(); };
      if (goodbye_due()) {
        v1::TrainerMessage goodbye;
        goodbye.set_seq(next_seq_++);
        *goodbye.mutable_goodbye() = *goodbye_;
        conn.goodbye_sent = true;
        lock.unlock();
        const bool ok = conn.stream->Write(goodbye);
        lock.lock();
        if (!ok) break;
        continue;
      }
      std::optional<StepBuffer::Claimed> claimed = buffer_.NextToWrite(next_seq_);
      if (!claimed) {
        sender_cv_.wait(lock, [&] {
          return conn.ended || conn.rejected || conn.storage_unavailable || stopping_ || buffer_.CanWrite() ||
                 goodbye_due();
        });
        continue;
      }
      ++next_seq_;
      const v1::TrainerMessage& msg = claimed->message;
      const size_t size = msg.ByteSizeLong();
      if (conn.max_message_bytes != 0 && size > conn.max_message_bytes) {
        const uint64_t step = msg.has_step()             ? msg.step().step()
                              : msg.has_catalog_update() ? msg.catalog_update().from_step()
                                                         : msg.event().step();
        const std::string text = "message of " + std::to_string(size) + " bytes exceeds the daemon's limit of " +
                                 std::to_string(conn.max_message_bytes);
        lock.unlock();
        RecordLocalError(v1::ERROR_REASON_OVERSIZED, step, text);
        lock.lock();
        buffer_.Release(claimed->id);
        ProgressLocked();
        continue;
      }
      lock.unlock();
      const bool ok = conn.stream->Write(msg);
      lock.lock();
      if (!ok) break;
      buffer_.MarkWritten(claimed->id, conn.acks_events);
      if (msg.has_step()) {
        ++stats_.sent;
      } else {
        ++stats_.events_sent;
      }
      if (DrainedLocked()) flush_cv_.notify_all();
    }
  }

  // Half-close and give the daemon a moment to finish the stream cleanly (it may still send
  // acks); cancel if it does not.
  conn.stream->WritesDone();
  {
    std::unique_lock lock(mu_);
    sender_cv_.wait_for(lock, options_.close_grace, [&] { return conn.ended; });
    if (!conn.ended) conn.context.TryCancel();
  }
  conn.reader.join();
  const grpc::Status status = conn.stream->Finish();
  bool stopping;
  {
    std::lock_guard lock(mu_);
    stopping = stopping_;
    current_ = nullptr;
    if (stats_.connected && !stopping_) down_since_ = std::chrono::steady_clock::now();
    stats_.connected = false;
    if (!status.ok() && !stopping_) {
      stats_.last_error = "stream to " + options_.address + " ended: " + status.error_message();
    }
    flush_cv_.notify_all();
  }
  if (stopping) {
    spdlog::debug("gradwatch monitor: stream closed");
  } else if (accepted) {
    spdlog::warn("gradwatch monitor: stream to {} ended: {} ({})", options_.address, status.error_message(),
                 static_cast<int>(status.error_code()));
  } else {
    spdlog::debug("gradwatch monitor: cannot open stream to {}: {}", options_.address, status.error_message());
  }
  return accepted;
}

void Monitor::ReaderLoop(Connection& conn) {
  try {
    v1::DaemonMessage msg;
    while (conn.stream->Read(&msg)) HandleMessage(conn, msg);
  } catch (const std::exception& e) {
    spdlog::error("gradwatch monitor: reader thread failed: {}", e.what());
    conn.context.TryCancel();
  } catch (...) {
    spdlog::error("gradwatch monitor: reader thread failed");
    conn.context.TryCancel();
  }
  std::lock_guard lock(mu_);
  conn.ended = true;
  stats_.connected = false;
  sender_cv_.notify_all();
  flush_cv_.notify_all();
}

void Monitor::HandleMessage(Connection& conn, const v1::DaemonMessage& msg) {
  switch (msg.body_case()) {
    case v1::DaemonMessage::kAccepted: {
      const v1::Accepted& a = msg.accepted();
      spdlog::info("gradwatch monitor: stream accepted for run {} rank {}", a.run_id(), a.rank());
      // Before the stream counts as accepted: once WaitAccepted returns, the callback has run.
      InvokeCallback(options_.on_accepted, a, "on_accepted");
      std::lock_guard lock(mu_);
      const bool advanced =
          a.has_durable_step() && (!stats_.has_acked || a.last_durable_step() > stats_.acked_through_step);
      if (buffer_.OnAccepted(a) > 0 || advanced) ++progress_;
      conn.accepted = true;
      conn.acks_events = a.acks_events();
      conn.max_message_bytes = a.max_message_bytes();
      if (a.has_durable_step()) {
        stats_.has_acked = true;
        stats_.acked_through_step = a.last_durable_step();
      }
      // Received is not kept: steps the daemon received but has not committed are owed an ack,
      // even those this Monitor no longer holds (logged by an earlier process, as a replay run
      // again skips them).
      owed_through_.reset();
      if (a.has_received_step() && (!a.has_durable_step() || a.last_received_step() > a.last_durable_step())) {
        owed_through_ = a.last_received_step();
      }
      stats_.connected = true;
      stats_.rejected = false;
      down_since_.reset();
      if (outage_warned_since_) {
        spdlog::warn(
            "gradwatch monitor: reached the daemon at {} again after {:.0f} s; {} step(s) queued are being sent",
            options_.address,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - *outage_warned_since_).count(),
            buffer_.steps());
        outage_warned_since_.reset();
      }
      if (++accepted_streams_ > 1) ++stats_.reconnects;
      if (!storage_retrying_) backoff_ = options_.initial_backoff;
      sender_cv_.notify_all();
      space_cv_.notify_all();
      flush_cv_.notify_all();
      break;
    }
    case v1::DaemonMessage::kAck: {
      std::lock_guard lock(mu_);
      const uint64_t durable = msg.ack().durable_step();
      const bool advanced = !stats_.has_acked || durable > stats_.acked_through_step;
      const size_t released = buffer_.OnAck(durable);
      storage_retrying_ = false;
      stats_.has_acked = true;
      stats_.acked_through_step = durable;
      if (released > 0 || advanced) {
        ProgressLocked();
      } else {
        flush_cv_.notify_all();
      }
      break;
    }
    case v1::DaemonMessage::kError: {
      const v1::Error& e = msg.error();
      const std::string text = ReasonName(e.reason()) + " at step " + std::to_string(e.step()) + ": " + e.message();
      spdlog::debug("gradwatch monitor: daemon error {}", text);
      // Before the step is released: once Flush returns, every callback about it has run.
      InvokeCallback(options_.on_error, e, "on_error");
      std::lock_guard lock(mu_);
      ++stats_.errors;
      ++stats_.errors_by_reason[ReasonName(e.reason())];
      stats_.last_error = text;
      if (!conn.accepted || e.reason() == v1::ERROR_REASON_SUPERSEDED) {
        conn.rejected = true;
        conn.superseded = e.reason() == v1::ERROR_REASON_SUPERSEDED;
        stats_.rejected = true;
        if (!conn.accepted && MayWarnLocked(Warning::kRefused)) {
          spdlog::warn("gradwatch monitor: the daemon at {} refused run {} rank {}: {}; its steps are not sent",
                       options_.address, options_.hello.run_id(), options_.hello.rank(), text);
        }
      } else if (e.reason() == v1::ERROR_REASON_STORAGE_UNAVAILABLE) {
        if (!conn.storage_unavailable) {
          spdlog::warn("gradwatch monitor: the daemon cannot store data now ({}); keeping it and retrying",
                       e.message());
        }
        conn.storage_unavailable = true;
        storage_retrying_ = true;
      } else if (RefersToStep(e.reason()) && buffer_.ReleaseRejected(e.seq(), e.step())) {
        ProgressLocked();
      }
      sender_cv_.notify_all();
      space_cv_.notify_all();
      flush_cv_.notify_all();
      break;
    }
    case v1::DaemonMessage::kEventAck: {
      std::lock_guard lock(mu_);
      storage_retrying_ = false;
      if (buffer_.OnEventAck(msg.event_ack().seq())) ProgressLocked();
      break;
    }
    case v1::DaemonMessage::kAlert: InvokeCallback(options_.on_alert, msg.alert(), "on_alert"); break;
    case v1::DaemonMessage::kFinished: {
      spdlog::info("gradwatch monitor: run {} recorded as finished", msg.finished().run_id());
      std::lock_guard lock(mu_);
      stats_.finished = true;
      ProgressLocked();
      break;
    }
    default: break;
  }
}

void Monitor::RecordLocalError(v1::ErrorReason reason, uint64_t step, std::string message) {
  v1::Error e;
  e.set_reason(reason);
  e.set_step(step);
  e.set_message(std::move(message));
  InvokeCallback(options_.on_error, e, "on_error");
  std::lock_guard lock(mu_);
  ++stats_.errors;
  ++stats_.errors_by_reason[ReasonName(reason)];
  stats_.last_error = ReasonName(reason) + " at step " + std::to_string(step) + ": " + e.message();
  space_cv_.notify_all();
  flush_cv_.notify_all();
}

std::chrono::milliseconds Monitor::NextBackoff() {
  std::lock_guard lock(mu_);
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  const auto delay =
      std::chrono::milliseconds(static_cast<int64_t>(static_cast<double>(backoff_.count()) * jitter(rng_)));
  backoff_ = std::min(backoff_ * 2, options_.max_backoff);
  return delay;
}

void Monitor::SleepBackoff(std::chrono::milliseconds delay) {
  std::unique_lock lock(mu_);
  sender_cv_.wait_for(lock, delay, [this] { return stopping_; });
}

}  // namespace gradwatch::client

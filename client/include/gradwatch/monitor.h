// Monitor: the trainer-side client of Ingest.Stream. It buffers steps in memory and sends them
// from a background thread, so the training loop never waits on the network.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "gradwatch/channel_security.h"
#include "gradwatch/step_buffer.h"
#include "gradwatch/v1/gradwatch.pb.h"
#include "gradwatch/version.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace gradwatch::client {

inline constexpr char kDefaultAddress[] = "127.0.0.1:7390";
inline constexpr char kClientName[] = "gradwatch-cpp/" GRADWATCH_CLIENT_VERSION;

struct MonitorOptions {
  // host:port of the daemon.
  std::string address = kDefaultAddress;
  // TLS to the daemon (off when no file is given). Files that cannot be read make every stream
  // fail: Start() logs why, and Stats().last_error says it.
  ChannelSecurity tls;
  // Sent at the start of every connection. `client` is filled in when empty. A trainer that
  // resumed from a checkpoint sets hello.resume_from_step to the first step it will log: it is
  // sent until the daemon accepts a stream, and left out of later reconnects, which must not
  // rewind the steps this process has already reported.
  v1::Hello hello;
  // Steps held in memory: queued plus written but not yet durable; and their bytes (serialized),
  // unbounded by default. A step is taken while both are below their bounds.
  size_t queue_capacity = 10'000;
  size_t queue_capacity_bytes = std::numeric_limits<size_t>::max();
  // Events waiting to be written.
  size_t event_capacity = 1'000;
  // Flow control: at most this many steps, and bytes of them, written and not yet acknowledged
  // durable; acks reopen the window (see SendWindow). Bounds what a stop can leave
  // unconfirmed and keeps acks prompt however fast steps are logged.
  size_t max_unacked_steps = 1024;
  size_t max_unacked_bytes = 8 << 20;
  // Reconnect back-off after a stream breaks or is refused: doubles from initial to max, with
  // ±20% jitter, and starts over once the daemon accepts a stream. While the daemon is down the
  // stream waits for the channel, whose connection back-off uses the same bounds.
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{10'000};
  // How long Stop() lets the daemon close the stream after WritesDone before cancelling it.
  std::chrono::milliseconds close_grace{500};
  // Loud when it matters: warnings (spdlog) when the daemon cannot be reached this long after the
  // first step was logged, when it refuses the Hello, when the queue passes half of
  // queue_capacity and when steps are dropped; each kind at most once per warn_interval, and a
  // line when the daemon is reached again after a warned outage. Nothing while all is well.
  std::chrono::milliseconds unreachable_warning_after{5'000};
  std::chrono::milliseconds warn_interval{60'000};
  // Off for callers that report these conditions in their own words (the CLI's replay and tail,
  // whose queue is full by design).
  bool warnings = true;

  // Called on the Monitor's reader thread, before the state they announce is visible (Flush
  // and WaitAccepted return after the callbacks of what they waited for). Keep them short, do
  // not call Stop() from them. Exceptions they throw are caught and logged.
  std::function<void(const v1::Error&)> on_error;
  std::function<void(const v1::Alert&)> on_alert;
  std::function<void(const v1::Accepted&)> on_accepted;
};

struct MonitorStats {
  uint64_t queued = 0;   // steps and events waiting to be written
  uint64_t unacked = 0;  // steps and events written, not yet durable
  uint64_t sent = 0;     // step messages written, resends included
  uint64_t events_sent = 0;
  bool has_acked = false;
  uint64_t acked_through_step = 0;                   // last durable step; valid when has_acked
  uint64_t dropped = 0;                              // steps refused because the buffer was full
  uint64_t errors = 0;                               // Errors from the daemon plus messages refused locally
  std::map<std::string, uint64_t> errors_by_reason;  // ErrorReason name → count
  uint64_t reconnects = 0;                           // streams accepted after the first one
  bool connected = false;                            // a stream is open and accepted
  // The daemon refused this rank's Hello or handed it to another stream: nothing more can
  // become durable, so Flush returns at once.
  bool rejected = false;
  bool finished = false;  // the daemon confirmed the Goodbye sent by Finish
  std::string last_error;
};

// Thread safety: every method may be called from any thread. Log, Event and Stats take a mutex
// that the background threads hold only for short bookkeeping, never across network calls.
class Monitor {
 public:
  explicit Monitor(MonitorOptions options);
  ~Monitor();  // calls Stop()
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Starts the sender thread, which connects in the background. Calling it again does nothing.
  void Start();
  // Enqueues a step without blocking. Returns false, and counts a drop, when the buffer is full
  // or the Monitor is stopped; the next step that is enqueued reports the drops to the daemon.
  bool Log(v1::StepStats step);
  // For callers that must not drop (replays): waits for room as long as the daemon makes
  // progress (see StallTimer), and gives up (false, a drop counted) once it has made none for
  // `stall_timeout`, or when stopped.
  bool LogBlocking(v1::StepStats step, std::chrono::milliseconds stall_timeout);
  // Enqueues an event, in order with the steps. It is held until the daemon acks it as committed
  // (daemons that do not ack events: until written) and resent on a new stream until then; the
  // daemon stores a resent event once. False when the event bound is reached or stopped.
  bool Event(uint64_t step, std::string text);
  // Event, waiting for room as LogBlocking does.
  bool EventBlocking(uint64_t step, std::string text, std::chrono::milliseconds stall_timeout);
  // Enqueues a catalog update (CatalogUpdate: entries' new weight decay, kind, role or group from
  // update.from_step on), held, resent and acked as an event is; waits for room as EventBlocking.
  bool CatalogUpdateBlocking(v1::CatalogUpdate update, std::chrono::milliseconds stall_timeout);
  // Waits until every logged step and event is durable, and every step the daemon said it had
  // received (Accepted.last_received_step, possibly from an earlier process) is acked: received is
  // not kept. False on timeout, when stopped, or when the daemon has rejected this stream (see
  // MonitorStats::rejected). A daemon that cannot store (ERROR_REASON_STORAGE_UNAVAILABLE) keeps
  // Flush waiting while the Monitor holds the data and reconnects with back-off: a Flush that
  // reaches its timeout while the Monitor waits to reconnect waits for that reconnect, and gives
  // the new stream `timeout` (or the back-off, if longer) too. Giving up logs a warning with what
  // is not acknowledged.
  bool Flush(std::chrono::milliseconds timeout);
  // Flush without a deadline: waits as long as the daemon makes progress (see StallTimer), and
  // returns false once it has made none for `stall_timeout` (stopped, gone, unable to store), when
  // stopped, or when the daemon has rejected this stream.
  bool FlushWhileProgressing(std::chrono::milliseconds stall_timeout);
  // Waits until the daemon has accepted a stream. False on timeout or rejection.
  bool WaitAccepted(std::chrono::milliseconds timeout);
  // Ends the run cleanly, then Stop()s: waits until every logged step is durable, sends a Goodbye
  // (`reason`, `message`) and waits for the daemon's answer that the run is recorded as finished
  // (its alerts resolve; it will not page as dead). Call it after the last Log. Returns true when
  // the daemon confirmed within `timeout`; false on timeout, rejection or a Monitor that is not
  // running (stopped either way). A run whose trainer stops without Finish is presumed dead by the
  // daemon once its streams are gone for runs.stalled_after_seconds, which pages (RunDied).
  bool Finish(std::chrono::milliseconds timeout, v1::GoodbyeReason reason = v1::GOODBYE_REASON_FINISHED,
              std::string message = {});
  // Closes the stream (WritesDone, then Finish; cancels it if the daemon does not close it
  // within close_grace) and joins the threads. Unsent steps are discarded. It says no Goodbye:
  // to end the run cleanly, call Finish instead. Idempotent.
  void Stop();

  MonitorStats Stats() const;

 private:
  struct Connection;

  void SenderLoop();
  // Runs one stream from Hello to its end. Returns whether the daemon accepted it.
  bool RunConnection(Connection& conn);
  void ReaderLoop(Connection& conn);
  void HandleMessage(Connection& conn, const v1::DaemonMessage& msg);
  // Everything held is acked and nothing is owed. Caller holds mu_.
  bool DrainedLocked() const;
  // Waits on `cv` until done() holds (true), or stop, rejection, or `stall_timeout` without
  // progress (false). Caller holds `lock` on mu_.
  template <typename Done>
  bool WaitWhileProgressing(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                            std::chrono::milliseconds stall_timeout, Done done);
  // The daemon settled something: counts progress and wakes every waiter. Caller holds mu_.
  void ProgressLocked();
  void RecordLocalError(v1::ErrorReason reason, uint64_t step, std::string message);
  void SleepBackoff(std::chrono::milliseconds delay);
  // Waits (lock held) until done(), as Flush says: past `timeout` only for one reconnect that is
  // due. False, logged with what is held and naming `what`, when it gives up, stops or is rejected.
  template <typename Done>
  bool WaitThroughReconnect(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout, Done done,
                            const char* what);
  std::chrono::milliseconds NextBackoff();

  const MonitorOptions options_;
  std::shared_ptr<grpc::Channel> channel_;

  // Guards everything from here to stop_mu_.
  mutable std::mutex mu_;
  std::condition_variable sender_cv_;  // work to write, accepted, connection ended, stop
  std::condition_variable space_cv_;   // room in the buffer
  std::condition_variable flush_cv_;   // buffer drained, accepted, rejected, stopped
  StepBuffer buffer_;
  bool started_ = false;
  bool stopping_ = false;
  std::optional<v1::Goodbye> goodbye_;  // set by Finish; sent once the buffer is drained
  uint64_t next_seq_ = 1;
  uint64_t accepted_streams_ = 0;
  std::optional<uint64_t> owed_through_;  // the latest Accepted's received step, when beyond durable
  bool storage_retrying_ = false;         // a STORAGE_UNAVAILABLE since the last ack: keep backing off
  // Counts what the daemon settled (acks that release or advance, errors that release, a
  // confirmed Goodbye); StallTimer watches it.
  uint64_t progress_ = 0;
  MonitorStats stats_;
  Connection* current_ = nullptr;  // the open stream, cancelled by Stop()
  uint64_t streams_opened_ = 0;    // RunConnection calls so far
  // Between streams: when the next one opens, and the back-off before it.
  std::optional<std::chrono::steady_clock::time_point> reconnect_at_;
  std::chrono::milliseconds reconnect_delay_{0};
  std::chrono::milliseconds backoff_;
  std::mt19937 rng_;
  // Warnings (MonitorOptions::warn_interval): when each kind was last given, the first step's
  // time, an outage warned of (for the line when it ends), drops not yet told.
  enum class Warning { kUnreachable, kRefused, kQueueHalf, kDropped, kCount };
  bool MayWarnLocked(Warning kind);
  void NoteQueuedLocked(bool pushed);
  std::optional<std::chrono::steady_clock::time_point> warned_at_[static_cast<int>(Warning::kCount)];
  std::optional<std::chrono::steady_clock::time_point> first_step_at_;
  // Since when no stream is accepted (from the first step, or from the loss of an accepted one).
  std::optional<std::chrono::steady_clock::time_point> down_since_;
  std::optional<std::chrono::steady_clock::time_point> outage_warned_since_;
  uint64_t drops_untold_ = 0;

  std::mutex stop_mu_;  // serialises Stop()
  std::thread sender_;
};

}  // namespace gradwatch::client

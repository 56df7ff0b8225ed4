// When a wait on the daemon gives up: not at a fixed deadline, but once the daemon has made no
// progress for a while. Progress is anything showing that the daemon is still working through what
// was sent (a step or event acknowledged durable, a message answered with an error that settles
// it, a Goodbye confirmed); the owner counts it. A daemon that keeps acknowledging is waited for
// however long the whole takes; one that is stopped, gone or unable to store is given up on
// `stall_timeout` after its last sign of progress, or after the wait began if that is later.
//
// Pure: time is passed in, nothing here sleeps or reads a clock. Not thread-safe: the Monitor uses
// one per wait, under its mutex.
#pragma once

#include <chrono>
#include <cstdint>

namespace gradwatch::client {

class StallTimer {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // A wait that begins at `start`, when the owner's progress counter reads `progress`.
  StallTimer(std::chrono::nanoseconds stall_timeout, Time start, uint64_t progress)
      : stall_timeout_(stall_timeout), last_progress_at_(start), progress_(progress) {}

  // Notes the progress counter at `now`: a counter that moved restarts the timer from `now`.
  void Observe(uint64_t progress, Time now) {
    if (progress == progress_) return;
    progress_ = progress;
    last_progress_at_ = now;
  }

  // When the wait gives up unless progress is observed before.
  Time GiveUpAt() const { return last_progress_at_ + stall_timeout_; }
  bool Stalled(Time now) const { return now >= GiveUpAt(); }
  // How long the daemon has shown no progress, as of `now`.
  std::chrono::nanoseconds Quiet(Time now) const { return now - last_progress_at_; }

 private:
  std::chrono::nanoseconds stall_timeout_;
  Time last_progress_at_;
  uint64_t progress_;
};

}  // namespace gradwatch::client

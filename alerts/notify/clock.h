// Wall time for the notifiers, injected so that tests control it.
#pragma once

#include <chrono>

namespace gradwatch::notify {

// Thread-safe: read from the caller's thread and from every delivery worker.
class Clock {
 public:
  virtual ~Clock() = default;
  // Seconds since the Unix epoch.
  virtual double UnixSeconds() const = 0;
};

class SystemClock final : public Clock {
 public:
  double UnixSeconds() const override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  // A process-wide instance; never destroyed before exit.
  static const SystemClock* Default() {
    static const SystemClock clock;
    return &clock;
  }
};

}  // namespace gradwatch::notify

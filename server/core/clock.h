// Time is injected so that logic can be tested without sleeping. The one clock of the daemon:
// runs, ingest, queries, alerting and the notifiers (alerts/notify) all read it.
#pragma once

#include <atomic>
#include <chrono>

namespace gradwatch {

using SteadyTime = std::chrono::steady_clock::time_point;

// Thread-safe: implementations may be read from any thread.
class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic time for timeouts and rates.
  virtual SteadyTime Now() const = 0;
  // Wall time, seconds since the Unix epoch, for records shown to people.
  virtual double UnixSeconds() const = 0;
};

class SystemClock final : public Clock {
 public:
  SteadyTime Now() const override { return std::chrono::steady_clock::now(); }
  double UnixSeconds() const override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }
  // A process-wide instance; never destroyed before exit.
  static SystemClock* Default();
};

// A clock that moves only when told to; for tests.
class FakeClock final : public Clock {
 public:
  SteadyTime Now() const override { return SteadyTime(std::chrono::nanoseconds(ns_.load())); }
  double UnixSeconds() const override { return 1.7e9 + ns_.load() / 1e9; }
  void Advance(std::chrono::nanoseconds d) { ns_ += d.count(); }

 private:
  std::atomic<long long> ns_{1'000'000'000};
};

inline SystemClock* SystemClock::Default() {
  static SystemClock clock;
  return &clock;
}

}  // namespace gradwatch

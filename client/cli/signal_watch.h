// SIGINT and SIGTERM as an event a command can act on: stop cleanly, report what it did, exit with
// its own code, instead of dying wherever the signal finds it.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace gradwatch::cli {

// While a SignalWatch exists, SIGINT and SIGTERM are blocked in the thread that made it and in
// every thread started after it (threads inherit the mask: make it before starting any), and a
// thread of its own waits for them (sigwait). The first one calls `on_signal(signal)` on that
// thread; a second one ends the process at once with exit code 128 + signal, as an impatient user
// expects. The destructor stops the thread and restores the previous mask of the thread that made
// it. Not copyable; make and destroy it on the same thread.
class SignalWatch {
 public:
  explicit SignalWatch(std::function<void(int)> on_signal);
  ~SignalWatch();
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;

  // The first signal received, or 0.
  int received() const { return received_.load(); }
  // Sleeps until `until`, or less when a signal arrives. Returns false if one has arrived.
  bool SleepUntil(std::chrono::steady_clock::time_point until);

 private:
  void Loop();

  std::function<void(int)> on_signal_;
  sigset_t signals_;
  sigset_t previous_mask_;
  std::atomic<int> received_{0};
  std::atomic<bool> closing_{false};
  std::mutex mu_;
  std::condition_variable signalled_;
  std::thread thread_;
};

// "SIGINT", "SIGTERM", else "signal N".
std::string SignalName(int signal);

}  // namespace gradwatch::cli

#include "client/cli/signal_watch.h"

#include <cstdlib>

namespace gradwatch::cli {

SignalWatch::SignalWatch(std::function<void(int)> on_signal) : on_signal_(std::move(on_signal)) {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGINT);
  sigaddset(&signals_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals_, &previous_mask_);
  thread_ = std::thread([this] { Loop(); });
}

SignalWatch::~SignalWatch() {
  closing_ = true;
  // Wakes the sigwait: the signal is blocked in that thread too, so it is only ever taken there.
  pthread_kill(thread_.native_handle(), SIGTERM);
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
}

void SignalWatch::Loop() {
  while (true) {
    int signal = 0;
    if (sigwait(&signals_, &signal) != 0) continue;
    if (closing_) return;
    int expected = 0;
    if (!received_.compare_exchange_strong(expected, signal)) std::_Exit(128 + signal);
    { std::lock_guard lock(mu_); }
    signalled_.notify_all();
    if (on_signal_) on_signal_(signal);
  }
}

bool SignalWatch::SleepUntil(std::chrono::steady_clock::time_point until) {
  std::unique_lock lock(mu_);
  return !signalled_.wait_until(lock, until, [this] { return received_.load() != 0; });
}

std::string SignalName(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    default: return "signal " + std::to_string(signal);
  }
}

}  // namespace gradwatch::cli

// A count-down latch for tests and benchmarks that wait for many streams to finish.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>

namespace gradwatch::testing {

class Latch {
 public:
  explicit Latch(size_t count) : count_(count) {}
  void CountDown() {
    std::lock_guard lock(mu_);
    if (count_ > 0 && --count_ == 0) cv_.notify_all();
  }
  // True once the count reached zero, false when `timeout` passed first.
  bool WaitFor(std::chrono::steady_clock::duration timeout) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t count_;
};

}  // namespace gradwatch::testing

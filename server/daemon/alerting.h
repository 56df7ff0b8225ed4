// The daemon's alerting: loads the rules, evaluates them on every completed step (through the
// runs' AlertHook) and on a timer (stalled runs), and sends firing and resolved alerts to the
// trainers' streams. Thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "alerts/notify/dispatcher.h"

#include "alerts/state_machine.h"
#include "server/core/status.h"
#include "server/runs/registry.h"

namespace gradwatch::daemon {

// The rules in force: the built-in defaults (unless disabled) and the given files. Rule names
// must be unique across all of them.
StatusOr<std::vector<alerts::Rule>> LoadConfiguredRules(bool default_rules, const std::vector<std::string>& files);

class Alerting final : public runs::AlertHook {
 public:
  explicit Alerting(std::vector<alerts::Rule> rules);
  ~Alerting() override;

  // Starts notifying through `dispatcher` (owned): state changes are handed to it on a thread of
  // their own, so evaluation (on the ingest path) never waits for the outbox.
  void StartNotifying(std::unique_ptr<notify::Dispatcher> dispatcher);
  // Delivers what is queued to the outbox and stops the dispatcher. Idempotent.
  void Stop();
  std::vector<notify::ReceiverStats> ReceiverStats() const;

  std::vector<alerts::Transition> OnStep(const alerts::RunFacts& facts) override;
  // Replaces the rules with freshly loaded ones; on any error the rules in force stay unchanged
  // and the status says exactly why. Alerts of deleted rules resolve.
  StatusOr<size_t> Reload(bool default_rules, const std::vector<std::string>& files, double now);

  // Timer rules over every run the registry holds; sends transitions to the runs' streams.
  void Tick(const runs::RunRegistry& registry, double now);

  alerts::AlertEngine& engine() { return engine_; }
  uint64_t firing_transitions() const { return firing_.load(); }
  uint64_t resolved_transitions() const { return resolved_.load(); }

 private:
  void Count(const std::vector<alerts::Transition>& transitions);

  void NotifyLoop();

  alerts::AlertEngine engine_;
  std::unique_ptr<notify::Dispatcher> dispatcher_;
  std::thread notifier_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<alerts::Alert> to_notify_;  // guarded by mu_
  bool stopping_ = false;                // guarded by mu_
  std::atomic<uint64_t> firing_{0};
  std::atomic<uint64_t> resolved_{0};
};

}  // namespace gradwatch::daemon

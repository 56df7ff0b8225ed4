// The daemon's alerting: loads the rules, evaluates them on every completed step (through the
// runs' AlertHook) and on a timer (stalled runs), and sends firing and resolved alerts to the
// trainers' streams. Thread-safe.
#pragma once

#include <atomic>
#include <string>
#include <vector>

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

  std::vector<alerts::Transition> OnStep(const alerts::RunFacts& facts) override;
  // Timer rules over every run the registry holds; sends transitions to the runs' streams.
  void Tick(const runs::RunRegistry& registry, double now);

  alerts::AlertEngine& engine() { return engine_; }
  uint64_t firing_transitions() const { return firing_.load(); }
  uint64_t resolved_transitions() const { return resolved_.load(); }

 private:
  void Count(const std::vector<alerts::Transition>& transitions);

  alerts::AlertEngine engine_;
  std::atomic<uint64_t> firing_{0};
  std::atomic<uint64_t> resolved_{0};
};

}  // namespace gradwatch::daemon

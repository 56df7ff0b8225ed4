// Several step listeners behind one (runs::RunOptions takes one): the alerting and each
// remote-write receiver. Each run's channel forwards every call to the listeners' channels in
// order; a restored run may skip steps through a snapshot only when every listener accepts it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "server/runs/step_listener.h"

namespace gradwatch::daemon {

class StepFanout final : public runs::StepListener {
 public:
  explicit StepFanout(std::vector<runs::StepListener*> listeners) : listeners_(std::move(listeners)) {}

  std::shared_ptr<runs::RunChannel> Open(const RunMeta& meta, bool restored) override;
  void OnRunLeftMemory(const std::string& run_id, double now) override;

 private:
  const std::vector<runs::StepListener*> listeners_;
};

}  // namespace gradwatch::daemon

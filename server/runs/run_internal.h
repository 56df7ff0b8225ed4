// What the rooms of a Run share, and no one else: run.cc (the session: streams, assembly, series,
// journaling and acks, end of life), run_events.cc (events and catalog changes), run_rewind.cc
// (rewinds and the rebuild after one), run_views.cc (the read views), run_snapshot.cc (its
// snapshot) and RunRestore (run_restore.h: restore from the journal and snapshots).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "server/core/types.h"
#include "server/runs/run.h"

namespace gradwatch::runs::run_internal {

// The run's learning-rate schedule from its config (analytics/projection.h); `why` says what of
// it was ignored.
inline analytics::LearningRateSchedule ScheduleOf(const RunConfig& config, std::string* why) {
  return analytics::LearningRateSchedule::FromConfig(config.warmup_steps, config.total_steps, config.extra, why);
}

// Leads a run's snapshot payload: catches a payload of another kind before anything is read.
inline constexpr uint64_t kSnapshotTag = 0x344e5552'50414e53ull;  // "SNAPRUN4"

// The run-wide scalar series, by their index in Run::scalar_series_.
inline constexpr size_t kTotalGrad = 0, kLoss = 1, kZLoss = 2, kLearningRate = 3, kTokens = 4;
inline constexpr std::array<std::string_view, 5> kScalarKeys = {keys::kTotalGradNorm, keys::kLoss, keys::kZLoss,
                                                                keys::kLearningRate, keys::kTokens};

inline std::string FieldKey(NormField field, std::string_view param) {
  switch (field) {
    case NormField::kGrad: return keys::GradNorm(param);
    case NormField::kParam: return keys::ParamNorm(param);
    case NormField::kUpdate: return keys::UpdateNorm(param);
  }
  return {};
}

// Calls the channel's Deliver as it goes out of scope: declared before a method's MutexLock, it
// does so after the lock is released.
class DeliverOnExit {
 public:
  explicit DeliverOnExit(const std::shared_ptr<RunChannel>& channel) : channel_(channel.get()) {}
  ~DeliverOnExit() {
    if (channel_ != nullptr) channel_->Deliver();
  }
  DeliverOnExit(const DeliverOnExit&) = delete;
  DeliverOnExit& operator=(const DeliverOnExit&) = delete;

 private:
  RunChannel* const channel_;
};

// What an event held in memory is charged to the budget.
inline uint64_t EventBytes(const EventRecord& event) {
  return sizeof(EventRecord) + event.text.size() + event.source.size() + event.data.size();
}

}  // namespace gradwatch::runs::run_internal

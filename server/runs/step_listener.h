// What a run tells the rest of the daemon about itself, without knowing who listens. Data flows
// one way: a run publishes its series, each completed step (ids and values), rewinds and its end
// through a RunChannel; the listener (the alerting, server/daemon/alert_feed.h) keeps its own
// per-run state from them and does its work (rule evaluation) off the run's lock.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/core/types.h"

namespace gradwatch::runs {

class RunAnalytics;

// A run's activity now, as timer rules see it (Run::Activity).
struct RunActivity {
  uint64_t last_step = 0;
  double last_wall_time = 0;  // of last_step; 0 when unknown
  uint32_t open_streams = 0;  // 0 once the run ended
  double seconds_since_last_step = 0;
  // Since the last sign of life: a hello, a stream closing, a step or an event.
  double seconds_since_activity = 0;
  bool ended = false;
  bool ended_cleanly = false;  // with a Goodbye
};

// One completed step as a run publishes it (RunChannel::OnStep). It refers into the run and is
// valid during the call only.
struct PublishedStep {
  const CompletedStep& step;  // its values, by series id
  const RunMeta& meta;        // labels, configuration, catalog
  // The series of each catalog parameter's norms, by catalog index (kNoSeries: none).
  const std::vector<std::array<SeriesId, kNormFields>>& param_series;
  const RunAnalytics& analytics;  // after this step (RunAnalytics::StepAnalysis)
  const RunActivity& activity;
  double now = 0;         // seconds since the Unix epoch
  bool restored = false;  // read back from the journal at start-up, not received now
};

// One run's channel to the listener (StepListener::Open). The On* calls are made with the run's
// mutex held, in the order things happen to the run, and only copy and queue. Deliver is called
// without it, by the thread that made them, once it has released the mutex: the listener then
// handles what was queued, in order. A listener may handle some queued work during an On* call to
// keep what it queues bounded (a burst of steps completed under one lock).
class RunChannel {
 public:
  virtual ~RunChannel() = default;
  // A series of the run (new, or restored from the journal): its id and key.
  virtual void OnSeries(SeriesId id, const std::string& key) = 0;
  virtual void OnStep(const PublishedStep& step) = 0;
  // The run rewound to a checkpoint at from_step (see Run::Attach).
  virtual void OnRewind(uint64_t from_step, double now) = 0;
  // The run ended: said Goodbye (`clean`), or had no stream and no step for end_after.
  virtual void OnEnded(bool clean, double now) = 0;
  virtual void Deliver() = 0;
  // Whether the listener can take a restored run up after `step` without being shown the restored
  // steps up to it (Run::RestoreSnapshot): it needs none of them. Called like the On* calls (under
  // the run's lock), at restore, before any OnStep.
  virtual bool AcceptsRestoreThrough(uint64_t step) {
    (void)step;
    return true;
  }
};

class StepListener {
 public:
  virtual ~StepListener() = default;
  // The channel of a run being constructed (`restored`: from the journal, at start-up). Called
  // without any lock held.
  virtual std::shared_ptr<RunChannel> Open(const RunMeta& meta, bool restored) = 0;
  // The daemon dropped the ended run from memory (its retention is over, or room was needed): its
  // channel is used no more. Called without any lock held.
  virtual void OnRunLeftMemory(const std::string& run_id, double now) = 0;
};

}  // namespace gradwatch::runs

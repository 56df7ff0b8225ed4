// The rebuild of a run's analytics after a rewind (Run::Attach): fresh analytics fed the kept
// catalog, series and events, then the kept steps read back from the journal, so that slopes,
// event windows, change points and forecasts see the steps below the resume point followed by the
// new branch, never the jump between them. O(the kept history); made without the run's lock, which
// then installs the result unless a newer rewind came first.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/core/types.h"
#include "server/runs/run_analytics.h"
#include "server/store/journal.h"

namespace gradwatch::runs {

// What the locked part of a rewind hands to the rebuild.
struct RewindJob {
  uint64_t from_step = 0;
  uint64_t branch = 0;  // the run's rewind count when it was made
  std::vector<ParamInfo> params;
  std::vector<std::pair<SeriesId, std::string>> series;
  std::vector<EventRecord> events;  // kept events and the resume event
  std::vector<std::pair<std::string, double>> forecasts;
  std::optional<double> default_weight_decay;
  std::vector<RunAnalytics::Remediation> remediations;  // checks of changes before from_step
  analytics::LearningRateSchedule schedule;
};

// Totals of the kept steps, counted as they are read back.
struct StepTotals {
  uint64_t count = 0;
  bool has_first = false;
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  uint64_t partial = 0;
  uint64_t nonfinite = 0;
  uint64_t last_nonfinite_step = 0;
  uint64_t client_dropped = 0;
};

struct RebuiltAnalytics {
  std::unique_ptr<RunAnalytics> analytics;
  StepTotals kept;
};

// The analytics of run `run_id` rebuilt for `job`, charged through `charging`. The journal (null:
// the analytics restart from the job alone) is flushed first, so that the rewind record and every
// step completed before it are read back; a failed read is logged and the analytics miss what
// it did not read.
RebuiltAnalytics RebuildAfterRewind(const std::string& run_id, RewindJob job, const AnalyticsOptions& options,
                                    AnalyticsCharging charging, store::Journal* journal);

}  // namespace gradwatch::runs

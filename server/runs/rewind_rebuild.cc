#include "server/runs/rewind_rebuild.h"

#include <cmath>

#include <spdlog/spdlog.h>

namespace gradwatch::runs {

RebuiltAnalytics RebuildAfterRewind(const std::string& run_id, RewindJob job, const AnalyticsOptions& options,
                                    AnalyticsCharging charging, store::Journal* journal) {
  RebuiltAnalytics out;
  out.analytics = std::make_unique<RunAnalytics>(options, std::move(charging));
  RunAnalytics& rebuilt = *out.analytics;
  rebuilt.SetCatalog(job.params);
  rebuilt.SetDefaultWeightDecay(job.default_weight_decay);
  rebuilt.SetSchedule(job.schedule);
  for (const auto& [id, key] : job.series) rebuilt.AddSeries(id, key);
  for (const EventRecord& e : job.events) rebuilt.OnEvent(e);
  rebuilt.SetForecasts(job.forecasts);
  rebuilt.SetBranchStart(job.from_step);
  rebuilt.AdoptRemediations(std::move(job.remediations));
  if (journal == nullptr) return out;
  StepTotals& kept = out.kept;
  Status s = journal->Flush();
  if (s.ok()) {
    s = journal->LoadRunSteps(run_id, job.from_step, [&](const CompletedStep& step) {
      rebuilt.OnStep(step);
      if (!kept.has_first) kept.first_step = step.step, kept.has_first = true;
      ++kept.count;
      kept.last_step = step.step;
      if (step.partial) ++kept.partial;
      kept.client_dropped += step.client_dropped_steps;
      for (const SeriesValue& sv : step.values) {
        if (!std::isfinite(sv.value)) ++kept.nonfinite, kept.last_nonfinite_step = step.step;
      }
    });
  }
  if (!s.ok()) {
    spdlog::error("run {}: reading the history kept at the rewind to step {}: {}; analytics miss it", run_id,
                  job.from_step, s.ToString());
  }
  return out;
}

}  // namespace gradwatch::runs

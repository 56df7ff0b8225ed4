// Daemon self-metrics as plain atomics: the hot path only increments; /metrics reads at scrape.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "server/runs/errors.h"

namespace gradwatch::runs {

// A histogram with fixed bucket bounds (seconds), safe for concurrent Observe and Read.
class LatencyHistogram {
 public:
  explicit LatencyHistogram(std::vector<double> bounds);
  void Observe(double seconds);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf last
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> bounds_;
  std::vector<std::atomic<uint64_t>> buckets_;  // non-cumulative, +Inf last
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0};
};

struct DaemonStats {
  std::atomic<int64_t> open_streams{0};
  std::atomic<uint64_t> messages_received{0};
  std::atomic<uint64_t> samples_received{0};
  std::atomic<uint64_t> journal_dropped_records{0};
  std::atomic<uint64_t> runs_evicted{0};  // ended runs dropped from memory
  // Runs a damaged journal lost that only their snapshots still name (not among the journal's own
  // lost_run_ids): their snapshots were set aside with the damaged journal.
  std::atomic<uint64_t> runs_lost_known_from_snapshots{0};
  std::atomic<uint64_t> runs_not_restored{0};         // journaled runs skipped: beyond the budget, or out of memory
  std::atomic<uint64_t> outbox_pruned_rows{0};        // delivered or given-up notifications deleted
  std::atomic<uint64_t> analytics_refused_series{0};  // series left without analytics: beyond the budget
  // Step reports held until the ranks a run waits for catch up (runs::Run::AddStep back-pressure).
  std::atomic<uint64_t> held_reports{0};
  // Snapshots of runs (RunRegistry::SaveSnapshots): written, failed to write, and the runs a
  // restart restored from one (replaying only the journal's steps after it).
  std::atomic<uint64_t> snapshots_written{0};
  std::atomic<uint64_t> snapshot_failures{0};
  std::atomic<uint64_t> snapshot_bytes_written{0};
  std::atomic<uint64_t> runs_restored_from_snapshot{0};
  std::array<std::atomic<uint64_t>, kIngestErrorReasonCount> errors{};
  LatencyHistogram journal_commit_seconds{{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5}};

  void CountError(IngestErrorReason reason) {
    errors[static_cast<int>(reason)].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t ErrorCount(IngestErrorReason reason) const {
    return errors[static_cast<int>(reason)].load(std::memory_order_relaxed);
  }
};

}  // namespace gradwatch::runs

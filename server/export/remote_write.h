// Prometheus remote write: every completed step's samples, timestamped with the step's wall time,
// sent to a receiver that speaks the protocol (Prometheus with --web.enable-remote-write-receiver,
// Mimir, Thanos Receive, VictoriaMetrics), so that the TSDB holds every step and not only the
// latest one a scrape happens to see.
//
// A RemoteWriter is one receiver. It listens to the runs like the alerting does (a StepListener):
// each run's channel copies the step's selected samples into the writer's queue, under the run's
// lock and without I/O; the writer's own thread takes them out in batches of whole steps, encodes
// a WriteRequest (protobuf, snappy block compression) and POSTs it. A 2xx moves the run's progress
// (store::RemoteWriteProgress); a 5xx, a 429 or a network failure retries the same batch with
// exponential back-off while new steps queue up; any other 4xx means the receiver will never take
// the batch (out-of-order or too old samples, a bad label): it is counted as failed and dropped.
//
// Bounded and durable: the queue holds at most capacity_samples (the oldest steps are dropped
// beyond it, counted and logged); the progress is in the journal's database, so after a restart a
// run restored from the journal publishes again the steps its receiver had not accepted (the
// channel refuses a snapshot that would skip them) and they are sent. A run the receiver has no
// progress for (remote write configured after it started) is taken up from its next step: nothing
// is backfilled.
//
// Series and labels are those of /metrics (gradwatch_total_grad_norm{run}, gradwatch_grad_norm
// {run, param, group}, ...); series without a /metrics family go as gradwatch_series{run, series}.
// gradwatch_last_step{run} carries each step's number, so steps map to times in the TSDB. A
// series' timestamps strictly increase (a step with the same millisecond as the one before it is
// put 1 ms later), as receivers require.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/runs/step_listener.h"

namespace gradwatch::notify {
class HttpClient;
}
namespace gradwatch::store {
class RemoteWriteProgress;
}

namespace gradwatch::exporter {

struct RemoteWriteOptions {
  std::string name;  // in logs and in the metrics' receiver label
  std::string url;   // http:// or https://
  // Series keys sent ("grad/norm/total", "params/norm/final_norm.weight"); '*' matches any run of
  // characters. Empty: every series.
  std::vector<std::string> series;
  size_t max_samples_per_send = 2000;   // a batch is whole steps, at least one
  size_t capacity_samples = 1'000'000;  // queued samples at most; the oldest steps go beyond it
  std::chrono::milliseconds timeout{30'000};
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{30'000};
  std::string bearer_token;  // sent as "Authorization: Bearer ..."
};

// One series as sent: its labels, sorted by name, __name__ first.
struct RemoteSeries {
  std::vector<std::pair<std::string, std::string>> labels;
};

// The series a run's series key is sent as: `param` and `group` are the catalog parameter's name
// and group when the key is one of its three norms (`field` 0 grad, 1 param, 2 update).
RemoteSeries RemoteSeriesFor(const std::string& run_id, const std::string& key, const ParamInfo* param, int field);

struct RemoteWriteStats {
  uint64_t sent_samples = 0;
  uint64_t failed_samples = 0;   // refused by the receiver for good (4xx), dropped
  uint64_t dropped_samples = 0;  // the queue was full
  uint64_t retried_requests = 0;
  uint64_t sent_requests = 0;
  uint64_t queued_samples = 0;  // waiting or in flight
  double lag_seconds = 0;       // age of the oldest step waiting or in flight; 0 when none
};

class RemoteWriter final : public runs::StepListener {
 public:
  // Fails on a bad URL.
  static StatusOr<std::unique_ptr<RemoteWriter>> Create(RemoteWriteOptions options);
  ~RemoteWriter() override;
  RemoteWriter(const RemoteWriter&) = delete;
  RemoteWriter& operator=(const RemoteWriter&) = delete;

  // Reads the receiver's progress from `progress` (null: nothing survives a restart) and starts
  // sending. Call before runs are opened; `progress` must outlive the writer.
  Status Start(store::RemoteWriteProgress* progress) EXCLUDES(mu_);
  // Waits up to `timeout` for every queued step to be sent (a clean shutdown); false if some are
  // left (a restart sends them).
  bool Drain(std::chrono::milliseconds timeout) EXCLUDES(mu_);
  // Stops sending (a request in flight is aborted). What was not sent is sent after a restart.
  void Stop() EXCLUDES(mu_);

  std::shared_ptr<runs::RunChannel> Open(const RunMeta& meta, bool restored) override EXCLUDES(mu_);
  void OnRunLeftMemory(const std::string& run_id, double now) override;

  const RemoteWriteOptions& options() const { return options_; }
  RemoteWriteStats stats(double now) const EXCLUDES(mu_);

  // The gradwatch_remote_write_* families for these writers.
  static void RenderMetrics(const std::vector<const RemoteWriter*>& writers, std::string& out, double now);

  struct RunState;
  struct Step;

 private:
  class Channel;
  RemoteWriter(RemoteWriteOptions options, std::unique_ptr<notify::HttpClient> http);

  void Enqueue(Step step) EXCLUDES(mu_);
  void Rewind(const std::shared_ptr<RunState>& run, uint64_t from_step) EXCLUDES(mu_);
  void Wake() EXCLUDES(mu_);
  void Loop() EXCLUDES(mu_);
  // Encodes and sends `batch`; true when it is dealt with (accepted, or refused for good).
  bool Send(const std::vector<Step>& batch) EXCLUDES(mu_);
  void SaveProgress(const std::vector<Step>& batch);

  const RemoteWriteOptions options_;
  store::RemoteWriteProgress* progress_ = nullptr;  // set by Start, before the thread
  const std::unique_ptr<notify::HttpClient> http_;

  mutable Mutex mu_;
  CondVar cv_;  // work queued, a batch done (Drain), stop
  bool stopping_ GUARDED_BY(mu_) = false;
  bool started_ GUARDED_BY(mu_) = false;
  std::map<std::string, uint64_t> saved_progress_ GUARDED_BY(mu_);  // run id → step, as loaded
  std::deque<Step> queue_ GUARDED_BY(mu_);
  uint64_t queued_samples_ GUARDED_BY(mu_) = 0;
  uint64_t inflight_samples_ GUARDED_BY(mu_) = 0;
  // A batch is taken from the queue and not yet done with (a rewind carries no samples).
  bool inflight_ GUARDED_BY(mu_) = false;
  double inflight_oldest_wall_ GUARDED_BY(mu_) = 0;
  RemoteWriteStats stats_ GUARDED_BY(mu_);
  double last_drop_log_ GUARDED_BY(mu_) = 0;
  double last_retry_log_ GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace gradwatch::exporter

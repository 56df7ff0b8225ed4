// The daemon's alerting: loads the rules, evaluates them on every completed step (it listens to
// every run, runs::StepListener, through one AlertFeed per run, which evaluates off the run's
// lock) and on a timer (stalled and dead runs), and sends firing and resolved alerts to the
// trainers' streams (SetTrainerSink). Every durable change of the engine (alert instances, acks, silences, level
// trackers, the last step evaluated per run) is written to the alert store together with the
// notifications it causes, in one transaction and in order, so a restart restores the engine as
// it was after some evaluation, exactly as the receivers were told of it; the runs then evaluate
// the journaled steps after it (alerts::AlertEngine::Restore). Changes that notify nobody (a
// tracker's new report, the evaluated step) are fetched from the engine every kProgressInterval
// (or with the next change that does), so that neither the evaluation nor the alert store does
// work for them on every step. Every transition is also written, in the same transaction, to the
// store's alert history (StateChanges::history), which the run view's timeline reads. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <functional>
#include <unordered_map>

#include "alerts/notify/dispatcher.h"
#include "alerts/state_machine.h"
#include "alerts/warmup.h"
#include "server/core/status.h"
#include "server/daemon/alert_feed.h"
#include "server/runs/registry.h"

namespace gradwatch::daemon {

// The rules in force: the built-in defaults (unless disabled) and the given files. Rule names
// must be unique across all of them. run_died rules without `seconds` get `run_died_seconds`
// (runs.stalled_after_seconds).
// The rules in force: the built-in ones (when default_rules), those of `files`, then `overrides`
// applied (alerts::ApplyOverrides).
StatusOr<std::vector<alerts::Rule>> LoadConfiguredRules(bool default_rules, const std::vector<std::string>& files,
                                                        double run_died_seconds,
                                                        const std::vector<alerts::RuleOverride>& overrides = {});

class Alerting final : public runs::StepListener {
 public:
  // Pages of threshold rules are held below step `min_steps_before_page` (alerts/warmup.h).
  explicit Alerting(std::vector<alerts::Rule> rules,
                    uint64_t min_steps_before_page = alerts::kDefaultMinStepsBeforePage);
  ~Alerting() override;

  // Starts writing state changes to `store` (not owned; it must outlive Stop()) and, when
  // receivers are configured, notifying through `dispatcher` (owned, may be null), on a thread of
  // their own, so evaluation (on the ingest path) never waits for the disk. Call once, before
  // Restore and before any evaluation.
  void Start(notify::Outbox* store, std::unique_ptr<notify::Dispatcher> dispatcher);
  // At most this long between a level tracker's or evaluated step's change and its write, while
  // nothing else changes.
  static constexpr std::chrono::milliseconds kProgressInterval{200};

  // Restores the engine's state saved in the store: call before the runs are rebuilt from the
  // journal, which evaluate their journaled steps past EvaluatedThrough. Fails only if the store
  // cannot be read at all.
  Status RestoreState(double now);
  // Once the runs are rebuilt, before serving: ends the alerts of runs that ended or that the
  // daemon no longer holds, and keeps dead runs' pages paging.
  void FinishRestore(const runs::RunRegistry& registry, double now);
  // Writes what is queued to the store and stops the dispatcher. Idempotent.
  void Stop();
  // Blocks until the saved alert states record every step of `run` up to `step` as evaluated (a
  // run's snapshot through `step` may then be kept: a restart from it evaluates no step again
  // that the alerting already judged, and skips none it did not): waits for the run's feed to
  // evaluate it, then has the progress written. False when that takes longer than `timeout` or the
  // write fails. After Stop() (which writes the progress), true at once.
  bool SaveEvaluatedThrough(const std::string& run, uint64_t step, std::chrono::milliseconds timeout);
  std::vector<notify::ReceiverStats> ReceiverStats() const;

  // Where firing and resolved alerts go for the trainers (the ingest streams of their run). Set
  // once, before any run is opened.
  void SetTrainerSink(std::function<void(const alerts::Alert&)> sink) { trainer_sink_ = std::move(sink); }

  // The diagnosis of `run` at the latest step its alerts evaluated (with the rules' bounds in
  // force); nullopt for a run without one yet.
  std::optional<alerts::DiagnosisAt> DiagnosisOf(const std::string& run);

  // runs::StepListener. A restored run's feed evaluates its journaled steps after the engine's
  // EvaluatedThrough (RestoreState first).
  std::shared_ptr<runs::RunChannel> Open(const RunMeta& meta, bool restored) override;
  void OnRunLeftMemory(const std::string& run_id, double now) override;
  // Replaces the rules with freshly loaded ones (as LoadConfiguredRules); on any error the rules
  // in force stay unchanged and the status says exactly why. Alerts of deleted rules resolve.
  StatusOr<size_t> Reload(bool default_rules, const std::vector<std::string>& files, double run_died_seconds,
                          const std::vector<alerts::RuleOverride>& overrides, double now);
  // Pages are held below this step number from the next step on, in every run (alerts/warmup.h).
  void SetMinStepsBeforePage(uint64_t steps) { min_steps_before_page_.store(steps, std::memory_order_relaxed); }

  // Timer rules over every run the registry holds; sends transitions to the runs' streams.
  void Tick(const runs::RunRegistry& registry, double now);

  alerts::AlertEngine& engine() { return engine_; }
  uint64_t firing_transitions() const { return firing_.load(); }
  uint64_t resolved_transitions() const { return resolved_.load(); }
  // Failed writes of alert states and notifications to the store (each is retried).
  uint64_t store_write_failures() const { return write_failures_.load(); }

 private:
  // State changes and the notifications they cause, waiting for the writer.
  struct Batch {
    alerts::StateChanges changes;
    std::vector<alerts::Alert> notify;
  };

  void Count(const std::vector<alerts::Transition>& transitions);
  // Counts and logs a feed's transitions; sends firing and resolved ones to the trainers.
  void Handle(std::vector<alerts::Transition> transitions, bool to_trainers);
  std::shared_ptr<AlertFeed> FeedOf(const std::string& run_id);
  // The engine's change sink: queues, never blocks on I/O.
  void OnChanges(alerts::StateChanges changes, const std::vector<alerts::Transition>& transitions);
  void WriterLoop();
  notify::Status Write(const Batch& batch);

  alerts::AlertEngine engine_;
  std::atomic<uint64_t> min_steps_before_page_;  // read by every feed at every step
  notify::Outbox* store_ = nullptr;
  std::unique_ptr<notify::Dispatcher> dispatcher_;
  std::thread writer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;  // guarded by mu_
  bool stopping_ = false;    // guarded by mu_
  // Batches queued since start, and how many of them are written (guarded by mu_); written_cv_
  // wakes SaveEvaluatedThrough.
  uint64_t queued_batches_ = 0;
  uint64_t written_batches_ = 0;
  std::condition_variable written_cv_;
  std::atomic<uint64_t> write_failures_{0};
  std::function<void(const alerts::Alert&)> trainer_sink_;
  std::mutex feeds_mu_;
  std::unordered_map<std::string, std::weak_ptr<AlertFeed>> feeds_;  // guarded by feeds_mu_
  std::atomic<uint64_t> firing_{0};
  std::atomic<uint64_t> resolved_{0};
  // Evaluates the feeds' bursts off the runs' locks (AlertFeed). Last: its thread, which hands
  // transitions to Handle, ends before the members above go.
  FeedDrainer drainer_;
};

}  // namespace gradwatch::daemon

// AlertFeed: the alerting's side of one run's channel (runs::RunChannel). It keeps the run's alert
// facts up to date from what the run publishes and has the engine evaluate them off the run's
// lock:
//  - OnStep (under the run's lock) copies the step into a queued alerts::RunFacts, tagged with its
//    step and time: its values listed by key through a key rank per series id (no string
//    comparisons), the analytics' per-step view, the catalog; O(the step's values + parameters),
//    into reused buffers;
//  - Deliver (without the run's lock) evaluates what is queued, in order, under the feed's own
//    mutex, and hands the transitions to the alerting (counted, logged, sent to the trainers);
//  - the last evaluated facts stay, for the timer rules (EvaluateTimer).
// At most kMaxQueued steps wait. A burst of steps completed under one lock (an assembly timeout,
// a rewind, the end of a rebuild) is back-pressure, not work under the lock: the run's thread
// waits for room while the FeedDrainer's thread evaluates the queue, in order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "alerts/facts.h"
#include "alerts/state_machine.h"
#include "alerts/warmup.h"
#include "server/core/thread_annotations.h"
#include "server/runs/run_analytics.h"
#include "server/runs/step_listener.h"

namespace gradwatch::daemon {

class AlertFeed;

// Evaluates, on its own thread, the queues of feeds that filled up: the run that filled one waits
// for room under its lock while this thread works through it. One per Alerting, shared by its feeds.
class FeedDrainer {
 public:
  FeedDrainer();
  ~FeedDrainer();
  FeedDrainer(const FeedDrainer&) = delete;
  FeedDrainer& operator=(const FeedDrainer&) = delete;

  // Has `feed`'s queue evaluated soon. False once stopped (the caller evaluates it then).
  bool Request(std::weak_ptr<AlertFeed> feed);
  // Evaluates what was requested, then ends the thread; later requests are refused.
  void Stop();

 private:
  void Loop();

  Mutex mu_;
  CondVar cv_;
  std::deque<std::weak_ptr<AlertFeed>> requests_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class AlertFeed final : public runs::RunChannel, public std::enable_shared_from_this<AlertFeed> {
 public:
  // What the feed hands its evaluations' transitions to (the alerting), in order per run.
  // `to_trainers`: firing and resolved alerts among them go to the run's streams too.
  using TransitionSink = std::function<void(std::vector<alerts::Transition> transitions, bool to_trainers)>;
  static constexpr size_t kMaxQueued = 8;

  // `evaluated_through`: for a restored run, the last step the engine evaluated before the
  // restart (AlertEngine::EvaluatedThrough). Restored steps after it are evaluated (the daemon
  // stopped before what that evaluation changed was saved), none when it is nullopt; live steps
  // up to it are not evaluated again (a resend).
  // `min_steps_before_page` (not owned, read at every step; null: the default): pages of threshold
  // rules are held below this step number (alerts/warmup.h).
  // `drainer` (not owned) evaluates a full queue while the run waits; the feed must then be owned
  // by a shared_ptr. Null (a feed tested alone): the run's thread evaluates it, under its lock.
  AlertFeed(const RunMeta& meta, std::optional<uint64_t> evaluated_through, alerts::AlertEngine& engine,
            TransitionSink sink, const std::atomic<uint64_t>* min_steps_before_page = nullptr,
            FeedDrainer* drainer = nullptr);

  void OnSeries(SeriesId id, const std::string& key) override;
  void OnStep(const runs::PublishedStep& step) override;
  void OnRewind(uint64_t from_step, double now) override;
  void OnEnded(bool clean, double now) override;
  void Deliver() override;
  // Evaluates what is queued, in order (the FeedDrainer's thread).
  void Drain();
  // Restored steps up to evaluated_through are not evaluated again: a run restored from a
  // snapshot through `step` needs none of them when step ≤ evaluated_through (or no evaluation of
  // the run was kept, and restored steps are not evaluated at all).
  bool AcceptsRestoreThrough(uint64_t step) override { return !evaluated_through_ || step <= *evaluated_through_; }

  // The timer rules against the run's latest facts and `activity`; transitions go to the sink.
  void EvaluateTimer(const runs::RunActivity& activity, double now);

  const std::string& run_id() const { return run_id_; }
  // The diagnosis at the latest step evaluated (nullopt before the first), with `bounds`.
  std::optional<alerts::DiagnosisAt> Diagnose(const alerts::DiagnosisBounds& bounds);

 private:
  struct Item {
    enum class Kind { kStep, kRewind, kEnded } kind = Kind::kStep;
    std::unique_ptr<alerts::RunFacts> facts;  // kStep
    uint64_t from_step = 0;                   // kRewind
    bool clean = false;                       // kEnded
    double now = 0;
  };

  // Fills `f` from the published step. Under the run's lock.
  void Fill(const runs::PublishedStep& p, alerts::RunFacts& f);
  void RankKeys();
  void Push(Item item);
  // Evaluates queued items, in order, until none is left; `queue_lock` holds queue_mu_ and is
  // released while each is evaluated. Requires eval_mu_.
  void DrainLocked(std::unique_lock<std::mutex>& queue_lock);
  void Evaluate(Item& item);

  const std::string run_id_;
  alerts::AlertEngine& engine_;
  const TransitionSink sink_;
  FeedDrainer* const drainer_;

  // Touched only in the On* calls, which the run makes under its lock, one at a time.
  std::vector<std::string> keys_;     // by series id
  std::vector<uint32_t> key_rank_;    // by series id: its key's rank in key order
  std::vector<SeriesId> ids_by_key_;  // series ids in key order
  bool keys_ranked_ = true;
  std::vector<std::pair<uint32_t, double>> ranked_values_;
  // The keys of the latest step's values (their ranks, in order), and its id in
  // RunFacts::latest_layout: a step with the same keys as the one before keeps the id, and facts
  // filled with that id already hold those keys.
  std::vector<uint32_t> layout_ranks_;
  uint64_t layout_id_ = 0;
  // The current step's value of each series id, valid where value_stamp_[id] == value_epoch_.
  std::vector<double> value_by_id_;
  std::vector<uint64_t> value_stamp_;
  uint64_t value_epoch_ = 0;
  runs::RunAnalysis analysis_;
  // The latest step's shares (their ShareInfo::source, in order), and its id in
  // RunFacts::shares_layout: as layout_ranks_ and layout_id_ are for the values.
  std::vector<uint64_t> share_sources_;
  uint64_t shares_layout_id_ = 0;
  std::vector<runs::ParamAnalysis> params_;
  // The per-parameter fits the rules read (AlertEngine::ReadFits), for the catalog's first
  // fits_params_ entries under the rules of fits_generation_; marks are only ever added, so a
  // step filled just before a reload holds every fit the instances that already existed read.
  runs::StepFits fits_;
  size_t fits_params_ = 0;
  uint64_t fits_generation_ = 0;
  std::optional<uint64_t> evaluated_through_;
  // The learning rate's series (kNoSeries: none yet), followed step by step for the warm-up and
  // the diagnosis; the latest rewind; the newest step filled.
  SeriesId learning_rate_id_ = kNoSeries;
  alerts::LearningRateTracker learning_rate_;
  const std::atomic<uint64_t>* const min_steps_before_page_;
  alerts::RewindFact rewind_;
  std::string schedule_problem_;  // scratch: a config's schedule read each step
  uint64_t last_filled_step_ = 0;
  // Fill's scratch: (share, catalog index) of the step's parameter shares.
  std::vector<std::pair<double, uint32_t>> top_shares_;

  // Lock order: the run's mutex, then eval_mu_, then queue_mu_, then the engine's.
  std::mutex eval_mu_;                      // one evaluation of this run at a time, in queue order
  std::unique_ptr<alerts::RunFacts> last_;  // guarded by eval_mu_: the latest evaluated facts
  bool evaluated_any_ = false;              // guarded by eval_mu_: last_ holds a step's facts
  std::mutex queue_mu_;
  // Guarded by queue_mu_. A vector: at most kMaxQueued + 1 items, so shifting them is cheap and,
  // unlike a deque's blocks, its buffer is allocated once.
  std::vector<Item> queue_;
  std::condition_variable room_;                          // with queue_mu_: the queue shrank
  bool drain_requested_ = false;                          // guarded by queue_mu_: the drainer will evaluate the queue
  std::vector<std::unique_ptr<alerts::RunFacts>> spare_;  // guarded by queue_mu_
  bool queued_ = false;                                   // guarded by queue_mu_: an item waits or is being evaluated
};

}  // namespace gradwatch::daemon

// The live state of one training run: its catalog, the assembly of steps across ranks, its
// series, events and the streams attached to it. Thread-safe: every public method takes the run's
// mutex for a bounded, I/O-free amount of work (journal records are only queued); the one
// exception is a rewind (see Attach), which reads the kept history back from the journal
// without holding the mutex. Its code is in rooms (run_internal.h names them): the session and the
// step path in run.cc, events and catalog changes, rewinds, read views and restore in their own files.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "server/core/clock.h"
#include "server/core/set_aside.h"
#include "server/core/thread_annotations.h"
#include "server/core/types.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/errors.h"
#include "server/runs/memory_budget.h"
#include "server/runs/rewind_rebuild.h"
#include "server/runs/run_analytics.h"
#include "server/runs/step_assembler.h"
#include "server/runs/step_listener.h"
#include "server/store/journal.h"
#include "server/store/series.h"

namespace gradwatch::runs {

struct RunOptions {
  std::chrono::nanoseconds assembly_timeout = std::chrono::seconds(30);
  size_t max_pending_steps = 1024;
  // What each series keeps (store::Series). Full size for the run's own scalars (total grad norm,
  // loss, z-loss, learning rate, tokens, extra keys), the norms of the output layer and the
  // parameter norms of norm gains: the series the incident lives in (DESIGN.md).
  store::SeriesOptions series;
  // Every other parameter series (most of a large run's): kept smaller, a tier that takes most of
  // a large run's memory otherwise (docs/operations.md, "What each series keeps"). Their analytics keep their
  // resolution (analytics.param_max_buckets), and the journal every step.
  store::SeriesOptions param_series = {.recent_points = 128, .history_buckets = 32};
  size_t max_params = 65536;
  size_t max_series = 262144;
  // Events (trainer events, annotations, catalog changes) a run holds at most; one more is refused
  // with LIMIT_EXCEEDED. Each is charged to the budget.
  size_t max_events = 10000;
  // A run with no open stream and no step for this long is ended (dropped from /metrics).
  std::chrono::nanoseconds end_after = std::chrono::minutes(10);
  // An ended run with no open stream stays in memory this long, then the registry drops it.
  std::chrono::nanoseconds retention = std::chrono::hours(24);
  AnalyticsOptions analytics;
  // Told of every run's series, completed steps, rewinds and end (the alerting); not owned; may
  // be null.
  StepListener* listener = nullptr;
  // The daemon-wide budget runs are charged to (see MemoryBudget); not owned; null: unlimited.
  MemoryBudget* budget = nullptr;
};

// Where a run sends answers to a trainer's stream. Implemented by the ingest reactor; methods are
// called with the run's mutex held, from ingest and journal threads, and must only queue.
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  // Every step ≤ durable_step from this stream's rank is durable.
  virtual void SendAck(uint64_t durable_step, uint64_t seq) = 0;
  // An error not tied to the message being processed (late step, superseded stream).
  virtual void SendError(const IngestError& error) = 0;
  // Another stream took over this run and rank: finish this one.
  virtual void Supersede() = 0;
  // The Goodbye sent with `seq` on this stream is durable: run `run_id` is recorded as finished.
  virtual void SendFinished(const std::string& run_id, uint64_t seq) = 0;
  // The Event sent with `seq` on this stream (at `step`) is durable. Sinks that do not ack
  // events (tests) may ignore it.
  virtual void SendEventAck(uint64_t seq, uint64_t step) {
    (void)seq;
    (void)step;
  }
};

struct AttachInfo {
  bool has_durable_step = false;
  uint64_t last_durable_step = 0;
  bool has_received_step = false;
  uint64_t last_received_step = 0;
  bool created = false;  // this hello created the run
};

struct RunInfo {
  std::string run_id;
  bool ended = false;  // end.ended()
  RunEnd end;
  uint32_t world_size = 1;
  std::map<std::string, std::string> labels;
  uint64_t step_count = 0;
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  double last_wall_time = 0;
  uint32_t open_streams = 0;
  double steps_per_second = 0;
  uint64_t partial_steps = 0;
  uint64_t nonfinite_count = 0;
  uint64_t last_nonfinite_step = 0;
  uint64_t client_dropped_steps = 0;
};

struct LatestSample {
  std::string key;
  uint64_t step = 0;
  double value = 0;
};

// What /metrics needs of a run, copied under the lock.
struct RunMetricsSnapshot {
  RunInfo info;
  std::optional<double> total_grad_norm, loss, z_loss, learning_rate;
  struct Param {
    std::string name;
    std::string group;
    ParamKind kind = ParamKind::kUnspecified;
    double weight_decay = 0;
    std::array<std::optional<double>, kNormFields> norms;
  };
  std::vector<Param> params;
  RunAnalysis analysis;
};

struct RunSummary {
  RunInfo info;
  RunConfig config;
  std::vector<ParamInfo> params;
  std::vector<LatestSample> latest;
  std::vector<EventRecord> events;  // the latest `max_events` the caller asked for, in step order
  size_t event_count = 0;           // events the run holds
  RunAnalysis analysis;
};

class Run {
 public:
  // journal and stats may be null (tests). The run registers its fixed series on creation; when
  // `journal_new` is true it journals the run, its catalog and series (a new run, not a restore).
  Run(RunMeta meta, const RunOptions& options, store::Journal* journal, DaemonStats* stats, const Clock* clock,
      bool journal_new);

  // Releases what the run was charged to options.budget.
  ~Run();

  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  // Memory: the caller charges options.budget for the catalog the run is constructed with
  // (MemoryBudget::CatalogBytes) before constructing it and hands the charge over here; the run
  // charges its catalog's later extensions (refusing a Hello that does not fit with
  // LIMIT_EXCEEDED, before anything is journaled) and its series' growth (a series that does not
  // fit stops growing, store::Series::Append's may_grow), and releases it all when destroyed.
  // Its analytics charge their trackers themselves (RunAnalytics: a series that does not fit
  // gets no analytics), released when the run is destroyed or rewinds.
  void AdoptCharge(uint64_t bytes);
  // Bytes the run is charged to the budget, analytics included.
  uint64_t ChargedBytes() const;

  const std::string& id() const { return id_; }

  // Validates a Hello against the run (world size, catalog prefix), extends the catalog, and
  // attaches `sink` to `rank` (a stream already attached there is superseded).
  //
  // A Hello with resume_from_step N rewinds the run to N, unless the run's latest rewind was to
  // N and this rank has reported no step ≥ N since (another rank of the same resume: idempotent,
  // so steps of the new branch that other ranks already reported are kept). A rewind:
  //  - completes pending steps below N (as partial) and discards pending steps ≥ N;
  //  - drops every point ≥ N from the series (store::Series::TruncateFrom), and the events ≥ N
  //    (they happened on the abandoned branch; a trainer that re-reaches them reports them again);
  //  - rewinds every rank's progress to N − 1 (none when N is 0), so Accepted tells a resumed
  //    rank to send from N; progress of an older branch arriving late is ignored;
  //  - may change the world size (an elastic job): streams of ranks beyond it are superseded;
  //  - journals the rewind (the abandoned branch is moved aside, see store::RewindRecord), has
  //    tells the listener (which judges alert states again from N), and records the event "resumed from the
  //    checkpoint at step N" (source "daemon") at step N;
  //  - rebuilds the analytics from the kept history: the kept events, then the kept steps read
  //    back from the journal, so that slopes, event windows, change points and forecasts see
  //    steps < N followed by the new branch, never the jump between them. The read is
  //    O(history), once per rewind, and runs after the mutex is released (Attach returns when it
  //    is done, so the resumed rank's first steps follow it). Steps that complete meanwhile are
  //    stored and journaled at once; their analytics and publication to the listener wait for
  //    the rebuild and then run in step order. Without a journal (tests) the analytics restart empty.
  // A Hello without resume_from_step never rewinds: a changed world size is refused, and steps
  // the run holds are still answered with STEP_REGRESSION / STEP_CONFLICT.
  std::optional<IngestError> Attach(const RunMeta& hello, uint32_t rank, StreamSink* sink, AttachInfo* info);
  // Detaches `sink` if it is still the one attached to `rank`.
  void Detach(uint32_t rank, StreamSink* sink);

  // Validates and adds one rank's step. An idempotent repeat that is already durable is acked
  // through `sink` at once. Returns the error to send on the stream, if any. While the journal is
  // not accepting (store::Journal::accepting) the step, and every later report of this rank until
  // its next Hello, is refused with STORAGE_UNAVAILABLE before anything is changed.
  //
  // Back-pressure: when max_pending_steps steps already wait for ranks, a report of a new step
  // would complete the oldest as partial (its total grad norm summed over fewer ranks: wrong, not
  // just incomplete). With `held` non-null, if a rank other than `rank` may still report that
  // oldest step (it has not reported it nor any later step), the report is not taken: *held is
  // set to true (else false), nothing changes, and the caller offers the same report again later
  // without reading further from its stream. A rank that reconnects late after an outage thus
  // catches up instead of finding its steps completed without it; a rank that never comes back
  // is cut short by the assembly timeout (Tick), as before. With `held` null (restores, tests),
  // the oldest step is completed as partial.
  std::optional<IngestError> AddStep(uint32_t rank, const RankStep& report, StreamSink* sink, bool* held = nullptr);

  // Adds an event (from a trainer or an annotation).
  std::optional<IngestError> AddEvent(EventRecord event);
  // Adds an event sent by `rank` with `seq` on `sink`, which gets SendEventAck(seq) once the
  // event is committed. An event the run already holds (same step, text and source: a resend
  // after a reconnect or a daemon restart) is not stored again, only acked once what it holds
  // is committed. While the journal is not accepting (store::Journal::accepting) the event is
  // refused with STORAGE_UNAVAILABLE, as steps are.
  std::optional<IngestError> AddEvent(EventRecord event, uint32_t rank, uint64_t seq, StreamSink* sink);
  // A catalog change from `from_step` on (runs/catalog_change.h), sent by `rank` as message `seq`:
  // checked against the catalog (INVALID_MESSAGE naming what is wrong), then recorded as an event
  // of the run (source "catalog"; journaled and acked as AddEvent does, a resend acked again but
  // not applied twice) and applied from from_step on: at once when the run has completed a step at
  // or after it, else when it does. A rewind to a step at or before from_step undoes it.
  std::optional<IngestError> AddCatalogChange(uint64_t from_step, std::vector<ParamChange> changes, uint32_t rank,
                                              uint64_t seq, StreamSink* sink);

  // A Goodbye from `rank` on `sink`: the run ends at once, cleanly (`reason` is kFinished or
  // kStopped), for every rank; its alerts resolve. `sink` gets SendFinished(seq) once the end is
  // durable (at once without a journal). A Goodbye on a run that already ended cleanly is only
  // answered. Streams still open stay attached and may still deliver steps; a later Hello makes
  // the run active again.
  void Finish(uint32_t rank, EndReason reason, std::string message, uint64_t seq, StreamSink* sink);
  // The journal committed this run's clean end: answers the Goodbyes waiting for it.
  void OnCleanEndDurable();

  // Completes steps whose assembly timed out; ends the run when idle long enough. Steps still
  // pending at shutdown are not completed: they were never acked, so their ranks resend them.
  void Tick();

  // The run's activity now (for timer rules such as stalled).
  RunActivity Activity() const;

  // The journal committed progress for a rank of this run.
  void OnDurable(const store::RankProgress& progress);
  // The journal committed every record numbered ≤ through: acks the events waiting for it.
  void OnCommitted(uint64_t through);

  RunInfo Info() const;
  // When the run ended (seconds since the Unix epoch) if it has and no stream is open; else 0.
  double IdleEndedAt() const;
  RunMetricsSnapshot MetricsSnapshot() const;
  // The same, overwriting `out` in place (a scrape reusing one snapshot for every run stops
  // allocating once warm). An ended run leaves /metrics: only its info is filled, the rest
  // cleared.
  void MetricsSnapshot(RunMetricsSnapshot& out) const;
  // The run's summary, with its latest `max_events` events.
  RunSummary Summary(size_t max_events = 1000) const;
  // nullopt when the key is unknown.
  std::optional<std::vector<store::Point>> QuerySeries(const std::string& key, uint64_t from_step, uint64_t to_step,
                                                       size_t max_points) const;
  size_t MemoryBytes() const;

  // The (series, threshold) pairs to forecast from now on (RunAnalytics::SetForecasts), kept for
  // the analytics a rewind or a restore rebuilds.
  void SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts);
  // Where a snapshot stands: the journal branch (RunRestore::Branch) it was taken on and the last
  // step it covers.
  struct SnapshotMark {
    uint64_t branch = 0;
    uint64_t step = 0;
    bool operator==(const SnapshotMark&) const = default;
  };
  // Snapshots (server/store/snapshots.h). Writes into `out` (overwritten) the run's state after
  // its last completed step: its counters, every series' points and its analytics, so that a
  // restart restores them and replays only the steps after it. Returns the branch and step it covers;
  // nullopt (out unspecified) when there is nothing new to save since `last`, or the run
  // cannot be saved now (a rewind's rebuild is running). Holds the run's lock while it copies:
  // O(the run's memory), 0.4 ms per MB into chunks already mapped (ByteChunks::Reserve). The
  // caller makes sure the steps it covers are committed to the journal (Journal::Flush) before it
  // keeps the snapshot.
  std::optional<SnapshotMark> SaveSnapshot(ByteChunks& out, std::optional<SnapshotMark> last) const;
  // The bytes SaveSnapshot would write now, counted without writing them (under the lock, about a
  // third of a copy's time): what a run's first snapshot maps beforehand, outside the lock.
  std::optional<size_t> SnapshotBytes(std::optional<SnapshotMark> last) const;
  // A fingerprint of the layouts a snapshot holds, for store::SnapshotStore.
  static uint64_t SnapshotFingerprint();

 private:
  // Restore from the journal and snapshots reads the run back through its private state
  // (run_restore.h).
  friend class RunRestore;

  struct SeriesEntry {
    std::string key;
    std::unique_ptr<store::Series> data;
    // A point reached data since it was made; its next ones are set aside (AppendLocked).
    bool reported = false;
  };
  struct RankState {
    StreamSink* sink = nullptr;
    bool has_received = false;
    uint64_t last_received = 0;
    bool has_last_report = false;  // last_report holds the values of last_received
    RankStep last_report;
    bool has_durable = false;
    uint64_t durable_step = 0;
    uint64_t durable_seq = 0;
    bool goodbye_waiting = false;  // a Goodbye from this rank awaits its durable end
    uint64_t goodbye_seq = 0;
    // A step or event of this stream was refused with STORAGE_UNAVAILABLE: every later one is
    // refused too until the rank says Hello again, so that nothing after a refused step is taken
    // (its resend would then be a regression).
    bool storage_refused = false;
  };
  // An event waiting for its commit before it is acked on the stream that sent it.
  struct PendingEventAck {
    uint64_t record = 0;  // journal record number that covers it
    uint32_t rank = 0;
    StreamSink* sink = nullptr;  // acked only while still attached to `rank`
    uint64_t seq = 0;
    uint64_t step = 0;
  };

  // Whether a Hello resuming from `from_step` on `rank` rewinds (see Attach).
  bool RewindsLocked(uint64_t from_step, uint32_t rank) const REQUIRES(mu_);
  // The locked part of a rewind: everything but the analytics rebuild, which it prepares.
  RewindJob RewindLocked(uint64_t from_step, uint32_t world_size) REQUIRES(mu_);
  // SUPERSEDED for a rank beyond the world of a resumed run (`what` it sent, at `step`).
  std::optional<IngestError> OutsideWorldLocked(uint32_t rank, std::string_view what, uint64_t step) const
      REQUIRES(mu_);
  // Records an event sent on a stream (AddEvent, AddCatalogChange): false when the run already
  // held it (a resend); the ack is arranged either way.
  bool RecordEventLocked(const EventRecord& event, uint32_t rank, uint64_t seq, StreamSink* sink) REQUIRES(mu_);
  // Charges a held event's bytes to the budget (MemoryBudget::Charge: it is already kept).
  void ChargeEventLocked(const EventRecord& event) REQUIRES(mu_);
  // Gives back to the budget what the run no longer holds (events a rewind dropped, ranks of a
  // smaller world).
  void ReleaseLocked(uint64_t bytes) REQUIRES(mu_);
  // Charges the change of world size a resume makes (refused beyond the budget), or releases it.
  std::optional<IngestError> RechargeWorldLocked(uint32_t world_size) REQUIRES(mu_);
  // Whether the run holds `event` already (a resend).
  bool HoldsEventLocked(const EventRecord& event) const REQUIRES(mu_);
  // LIMIT_EXCEEDED when the run holds max_events and `event` is not one of them.
  std::optional<IngestError> EventRoomLocked(const EventRecord& event) const REQUIRES(mu_);
  // A catalog change due from `step` on: applied now if the run completed a step at or after it,
  // else kept until it does (ApplyDueCatalogChangesLocked).
  void ScheduleCatalogChangeLocked(uint64_t step, std::vector<ParamChange> change) REQUIRES(mu_);
  // Applies the kept catalog changes due at or before `through_step`, in step order; `live` (not a
  // restore catching up past a snapshot) starts the remediation checks of raised weight decays.
  void ApplyDueCatalogChangesLocked(uint64_t through_step, bool live) REQUIRES(mu_);
  // Undoes the applied catalog changes from `from_step` on and drops the kept ones (a rewind).
  void UndoCatalogChangesFromLocked(uint64_t from_step) REQUIRES(mu_);
  // meta_.params changed in place (undone): the analytics and the listener's readers follow.
  void CatalogChangedLocked() REQUIRES(mu_);
  // Rebuilds the analytics off the lock (RebuildAfterRewind) and installs them, unless a newer
  // rewind came first.
  void RebuildAnalytics(RewindJob job);
  std::optional<IngestError> ValidateCatalogLocked(const RunMeta& hello, bool world_may_change) const REQUIRES(mu_);
  void AttachLocked(uint32_t rank, StreamSink* sink, AttachInfo* info) REQUIRES(mu_);
  // The options of series `id` under `key` (RunOptions::series or param_series).
  const store::SeriesOptions& SeriesOptionsLocked(SeriesId id, std::string_view key) const REQUIRES(mu_);
  // Charges the budget for the new entries unless `prepaid` (the constructor's catalog).
  std::optional<IngestError> ExtendCatalogLocked(const std::vector<ParamInfo>& params, bool prepaid) REQUIRES(mu_);
  // Whether `rank`'s report of `step` must wait (see AddStep's back-pressure).
  bool MustHoldLocked(uint32_t rank, uint64_t step) const REQUIRES(mu_);
  std::optional<IngestError> ValidateStepLocked(const RankStep& report) REQUIRES(mu_);
  RunInfo InfoLocked() const REQUIRES(mu_);
  RunActivity ActivityLocked() const REQUIRES(mu_);
  void AnswerGoodbyesLocked() REQUIRES(mu_);
  SeriesId SeriesForKeyLocked(const std::string& key, bool journal) REQUIRES(mu_);
  void CompleteLocked(const PendingStep& p) REQUIRES(mu_);
  // Puts the step's merged radial updates into `out` (RadialContribution).
  void PutRadialLocked(const PendingStep& p, CompletedStep& out) REQUIRES(mu_);
  // Analytics of one completed step and its publication to the listener (deferred while
  // rebuilding).
  void AnalyzeLocked(const CompletedStep& step, bool restored) REQUIRES(mu_);
  // Registers series `id` under `key` with the analytics and the listener.
  void AddSeriesLocked(SeriesId id, const std::string& key) REQUIRES(mu_);
  // SaveSnapshot and SnapshotBytes: the snapshot through `w`.
  std::optional<SnapshotMark> WriteSnapshot(StateWriter& w, std::optional<SnapshotMark> last) const;
  // Adds a completed step to the run: its points to series_ (a slice of the series at a time,
  // see ApplySliceLocked), and its counts.
  void AppendLocked(const CompletedStep& step) REQUIRES(mu_);
  // A large run's series outgrow the caches, and a series' state is about a dozen lines: appended
  // step by step, every point misses on each. So each step's points are set aside by series
  // (core/set_aside.h), and each step appends one slice of the series, in turn: every series
  // receives kSetAsideSlices points at once, its state fetched once for them, and a step's work
  // stays even (no step applies them all). Every reader of series_ calls ApplyPointsLocked first.
  void ApplySliceLocked(size_t slice) const REQUIRES(mu_);
  void ApplyPointsLocked() const REQUIRES(mu_);
  // Appends one point to `series`, charging its growth to the budget (refused, the series
  // downsamples sooner instead).
  void AppendPointLocked(store::Series& series, uint64_t step, double value) const REQUIRES(mu_);
  // Returns the record's journal number, 0 when it was not journaled (counted as dropped).
  uint64_t JournalLocked(store::JournalRecord record) REQUIRES(mu_);
  // Refuses a report from `rank` while the journal is not accepting (a storage fault, or its queue
  // three quarters full: what is taken always finds room) — see RankState::storage_refused.
  std::optional<IngestError> StorageRefusalLocked(uint32_t rank, uint64_t step) REQUIRES(mu_);
  void DropEventAcksLocked(StreamSink* sink) REQUIRES(mu_);

  const std::string id_;
  const RunOptions options_;
  store::Journal* const journal_;
  DaemonStats* const stats_;
  const Clock* const clock_;

  // The listener's channel (null without a listener). Its On* calls are made under mu_; every
  // public method that may make one calls Deliver after releasing mu_ (DeliverOnExit).
  const std::shared_ptr<RunChannel> channel_;

  // Lock order: RunRegistry's locks, then this one, then the journal's, the stream sinks' and
  // the channel's (a StreamSink and the channel's On* calls are made with mu_ held). Never held
  // while reading the journal (RebuildAnalytics) nor while the listener does its work (Deliver).
  mutable Mutex mu_;
  RunMeta meta_ GUARDED_BY(mu_);
  StepAssembler assembler_ GUARDED_BY(mu_);
  std::vector<SeriesEntry> series_ GUARDED_BY(mu_);
  // The ids of series_ by their key, which only series_ holds: the set hashes and compares
  // series_[id].key, and finds a key (a string_view) without a copy of it.
  struct KeyOfId {
    const std::vector<SeriesEntry>* series;
    std::string_view operator()(SeriesId id) const { return (*series)[id].key; }
    std::string_view operator()(std::string_view key) const { return key; }
  };
  struct KeyHash {
    using is_transparent = void;
    KeyOfId key;
    template <typename T>
    size_t operator()(const T& t) const {
      return std::hash<std::string_view>{}(key(t));
    }
  };
  struct KeyEqual {
    using is_transparent = void;
    KeyOfId key;
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      return key(a) == key(b);
    }
  };
  std::unordered_set<SeriesId, KeyHash, KeyEqual> series_by_key_ GUARDED_BY(mu_){0, KeyHash{KeyOfId{&series_}},
                                                                                 KeyEqual{KeyOfId{&series_}}};
  std::vector<std::array<SeriesId, kNormFields>> param_series_ GUARDED_BY(mu_);
  // Per catalog index: its updates/radial/ series, made on its first value (kNoSeries until then).
  std::vector<SeriesId> radial_series_ GUARDED_BY(mu_);
  std::array<SeriesId, 5> scalar_series_ GUARDED_BY(mu_){};  // total grad, loss, z-loss, lr, tokens
  std::vector<RankState> ranks_ GUARDED_BY(mu_);
  std::vector<EventRecord> events_ GUARDED_BY(mu_);          // ordered by step
  std::deque<PendingEventAck> event_acks_ GUARDED_BY(mu_);   // ordered by record
  std::unique_ptr<RunAnalytics> analytics_ GUARDED_BY(mu_);  // replaced at a rewind
  // The forecasts in force (RunOptions::analytics.forecasts until SetForecasts).
  std::vector<std::pair<std::string, double>> forecasts_ GUARDED_BY(mu_);
  // Catalog changes (AddCatalogChange, a resuming Hello, the journal's catalog events): those not
  // yet due, by step; and those applied, in the order applied, each with what undoes it.
  struct CatalogChangeEntry {
    uint64_t step = 0;
    std::vector<ParamChange> change;
    std::vector<ParamChange> undo;
  };
  std::vector<CatalogChangeEntry> catalog_pending_ GUARDED_BY(mu_);
  std::vector<CatalogChangeEntry> catalog_applied_ GUARDED_BY(mu_);
  std::optional<uint64_t> last_resume_step_ GUARDED_BY(mu_);  // the latest rewind's step (journaled)
  uint64_t branch_ GUARDED_BY(mu_) = 0;                       // rewinds in this process's life; tags journal progress
  uint64_t journal_branch_ GUARDED_BY(mu_) = 0;               // rewinds the journal holds (RestoreBranch)
  bool rebuilding_ GUARDED_BY(mu_) = false;                   // a rewind's analytics rebuild is running off the lock
  // Steps completed while rebuilding, for the rebuilt analytics; at most max_pending_steps.
  std::vector<CompletedStep> deferred_ GUARDED_BY(mu_);
  uint32_t open_streams_ GUARDED_BY(mu_) = 0;
  mutable uint64_t charged_bytes_ GUARDED_BY(mu_) = 0;  // to options_.budget
  // Completed steps' points not yet in series_ (see ApplySliceLocked), by series id. They are
  // applied, and so series_ complete, whenever series_ is read (ApplyPointsLocked, which changes
  // no result: it is const, and these members mutable, for the readers).
  mutable SetAsideSlices unapplied_ GUARDED_BY(mu_);
  RunEnd end_ GUARDED_BY(mu_);
  bool end_durable_ GUARDED_BY(mu_) = false;  // end_ is clean and committed
  SteadyTime last_activity_ GUARDED_BY(mu_);  // the last hello, detach, step or event
  // When the last step completed (or the run was created/restored).
  SteadyTime last_step_seen_ GUARDED_BY(mu_);

  uint64_t step_count_ GUARDED_BY(mu_) = 0;
  bool has_first_step_ GUARDED_BY(mu_) = false;
  uint64_t first_step_ GUARDED_BY(mu_) = 0;
  uint64_t last_step_ GUARDED_BY(mu_) = 0;
  double last_wall_time_ GUARDED_BY(mu_) = 0;
  uint64_t partial_steps_ GUARDED_BY(mu_) = 0;
  uint64_t nonfinite_count_ GUARDED_BY(mu_) = 0;
  uint64_t last_nonfinite_step_ GUARDED_BY(mu_) = 0;
  uint64_t client_dropped_steps_ GUARDED_BY(mu_) = 0;
  // Recent (time, step) pairs for the speed estimate; time is trainer wall time when known.
  static constexpr size_t kSpeedWindow = 64;
  std::array<std::pair<double, uint64_t>, kSpeedWindow> speed_ring_ GUARDED_BY(mu_){};
  size_t speed_count_ GUARDED_BY(mu_) = 0;

  CompletedStep scratch_ GUARDED_BY(mu_);              // reused for every completed step
  std::vector<uint8_t> seen_scratch_ GUARDED_BY(mu_);  // reused by ValidateStepLocked
};

}  // namespace gradwatch::runs

// The alert state machine, with Prometheus semantics counted in steps:
//
//   inactive → pending → firing → resolved
//
// Instances are keyed by the fingerprint of their labels (alert.h). For a rule with
// `for_steps: N`, s0 is the first step at which an instance's condition held; it fires at the
// first evaluation whose step is ≥ s0 + N, so a trainer reporting every step or every 10 steps
// pages at the same point. N = 0 fires at once (inactive → firing), as do non_finite and
// timer (stalled, run_died) rules. A pending instance whose condition stops holding goes back to inactive
// silently: pending is never notified.
//
// A firing instance stays firing while its condition holds or its value has not crossed the
// rule's clear bound (clear_below / clear_above), so a value flapping around the threshold does
// not re-fire. Once the condition has stopped holding (and the value crossed the clear bound) at
// step r0, it resolves at the first evaluation whose step is ≥ r0 + resolve_for_steps: one more
// transition, with ends_at = now. An instance the rule no longer produces (its series or event
// is gone) counts as not holding.
//
// Noisy series. Every kind that holds (threshold, forecast, slope_change, share,
// growth_without_decay) is judged on the level of its recent reports, not on one sample; the
// engine keeps the last reports of every instance such a rule produces (ReportWindow), firing or
// not. Let σ be the series' report-to-report noise (ReportWindow::Noise) and the level the median
// of the last kLevelReports (9) reports, or of those since s0 (r0) when fewer:
//  - pending starts at the first report that holds (s0), as above, and goes back to inactive
//    when the median of the reports since s0 no longer holds: a lone spike does not stay
//    pending, a lone dip does not cancel a pending alert;
//  - it fires at the first report with step ≥ s0 + for_steps at which the level holds
//    significantly: the median of the last 9 reports, moved kLevelZ (2) standard errors of a
//    median (1.2533 σ / √9) against the alert, still holds;
//  - a firing alert starts clearing (r0) at the first report past the clear bound, stops
//    clearing when the median of the reports since r0 is no longer past it, and resolves at the
//    first report with step ≥ r0 + resolve_for_steps at which the level is significantly past it.
// On a noise-free series (σ ≤ 1e-4 of the bound: a constant, a line, a step) "every report since
// s0 (r0) held" is enough too, which keeps the exact timing of the rules above: a first
// report ≥ 5 at s0 fires at the first report with step ≥ s0 + 10, reported every step or every
// 10 steps. On a noisy one the level lags the reports by about 4 of them, so a sustained jump
// pages at s0 + for_steps or 5 reports after s0, whichever is later; a trend that rises through
// the threshold under 5 % noise fires once, while the trend is within a few percent of it; and
// the clear band plus the median keep it from resolving until the trend has really fallen.
// Estimates (slope ratios) carry their error bars in the measure (evaluator.h), so they fire
// only once significant. A NaN measure is no report: it changes nothing.
//
// The value and step of a transition are those that decided it: a firing alert carries the
// level that fired it, a resolved one the level and step that resolved it, and its summary is
// the rule's `resolved_summary` annotation rendered with them (or "<alert> resolved at step S in
// run R: value V"); its other annotations stay as they were while it fired. `resolved_summary`
// is a template, never an annotation of its own.
//
// Notifications: Transition::notify is true for pending → firing (or inactive → firing) unless a
// silence or an acknowledgement mutes the alert, and for firing → resolved exactly when its
// firing was notified, so a receiver is told of the end of every incident it was told of and of
// no other. A firing alert that was muted when it fired and is no longer muted (its silence
// ended or was removed) is notified at the next evaluation, as a firing → firing transition.
// Muting never changes states: muted alerts are still listed by Active(). An acknowledged
// firing alert stays muted (IsMuted, used by the notifier's resends) until it resolves; the next
// incident of the same instance is notified again.
//
// Time is passed in (`now`, seconds since the Unix epoch), never read. Thread-safe: every method
// may be called from any thread; calls are serialised by an internal mutex.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "alerts/alert.h"
#include "alerts/diagnosis.h"
#include "alerts/evaluator.h"
#include "alerts/facts.h"
#include "alerts/matcher.h"
#include "alerts/report_window.h"
#include "alerts/rules.h"
#include "alerts/templates.h"
#include "server/core/status.h"

namespace gradwatch::alerts {

struct Transition {
  Alert alert;  // as it is after the transition (state == to)
  AlertState from = AlertState::kInactive;
  AlertState to = AlertState::kInactive;
  bool notify = false;  // send it to the receivers; false when pending, muted or never notified
};

// Mutes notifications of every alert all `matchers` match (an alert without a matcher's label is
// taken to carry it empty) while starts_at ≤ now < ends_at.
struct Silence {
  std::string id;
  std::vector<Matcher> matchers;
  double starts_at = 0;  // seconds since the Unix epoch
  double ends_at = 0;
  std::string comment;
  std::string created_by;
  bool operator==(const Silence&) const = default;
};

struct Acknowledgement {
  std::string by;
  std::string comment;
  double at = 0;  // seconds since the Unix epoch
  bool operator==(const Acknowledgement&) const = default;
};

// Everything the engine keeps of one pending or firing alert: what a restart must restore.
struct InstanceState {
  std::string rule;
  std::string run;
  Alert alert;
  uint64_t held_since_step = 0;  // s0
  bool clearing = false;
  uint64_t clearing_since_step = 0;  // r0
  bool notified = false;             // its firing was notified
  std::optional<Acknowledgement> ack;
};

// The recent reports of one instance of a rule judged on its level (ReportWindow), with the
// count of those since its mark (s0 or r0): what a restart must restore for the engine to judge
// the next report as it would have without the restart.
struct LevelState {
  std::string rule;
  std::string run;
  ReportWindow::Raw window;
  uint64_t since_mark = 0;
  bool all_since_mark = true;
  bool operator==(const LevelState&) const = default;
};

// One entry of the alert history (the run view's alert timeline): an alert's state change, with
// the alert as it was after it (alert.state is the new state; kInactive: a pending alert whose
// condition cleared before it fired).
struct HistoryEntry {
  Alert alert;
  AlertState from = AlertState::kInactive;
  double at = 0;  // seconds since the Unix epoch
};

// Changes of the engine's durable state since the last report, latest wins per key: an
// instance created or changed (its state, s0, r0, notified or ack; not merely its value) maps to
// its new state, an instance that ended maps to nullopt; likewise silences by id, level trackers
// by fingerprint (every report changes one), and the last step evaluated per run. `history` is
// appended to, never replaced: every state change, in order, for the alert history.
struct StateChanges {
  std::map<uint64_t, std::optional<InstanceState>> instances;  // by fingerprint
  std::map<std::string, std::optional<Silence>> silences;      // by id
  std::map<uint64_t, std::optional<LevelState>> levels;        // by fingerprint
  std::map<std::string, std::optional<uint64_t>> evaluated;    // by run
  std::vector<HistoryEntry> history;

  bool empty() const {
    return instances.empty() && silences.empty() && levels.empty() && evaluated.empty() && history.empty();
  }
  // Folds later changes into these.
  void Merge(StateChanges later);
};

// What a restart gives back to the engine.
struct SavedState {
  std::vector<InstanceState> instances;
  std::vector<Silence> silences;
  std::map<uint64_t, LevelState> levels;      // by fingerprint
  std::map<std::string, uint64_t> evaluated;  // the last step evaluated, by run
};

// The level of a noisy series: the median of this many recent reports (state_machine.h).
inline constexpr size_t kLevelReports = 9;
// How many standard errors of that median the level must clear its bound by.
inline constexpr double kLevelZ = 2.0;
// A series whose noise is at most this fraction of its bound counts as noise-free.
inline constexpr double kNoiseFreeRelative = 1e-4;

class AlertEngine {
 public:
  explicit AlertEngine(std::vector<Rule> rules);

  AlertEngine(const AlertEngine&) = delete;
  AlertEngine& operator=(const AlertEngine&) = delete;

  // Reload. Instances of rules whose name still exists keep their state (s0, firing, acks),
  // even if the rule's definition changed; their labels decide at the next evaluation whether
  // they are still the same instances. Instances of removed rules end: firing ones resolve
  // (returned, with notify as for any resolve), pending ones go inactive silently.
  std::vector<Transition> ReplaceRules(std::vector<Rule> rules, double now);
  std::vector<Rule> Rules() const;
  // Changes with every ReplaceRules: a reader that derived something from the rules (ReadFits)
  // derives it again when it changes.
  uint64_t rules_generation() const { return rules_generation_.load(std::memory_order_acquire); }
  // The diagnosis' bounds from the rules in force (BoundsFromRules).
  DiagnosisBounds diagnosis_bounds() const;
  // RulesReadFits (evaluator.h) with the rules in force.
  void ReadFits(const std::vector<ParamInfo>& catalog, size_t from, std::vector<uint8_t>& norm,
                std::vector<uint8_t>& share) const;

  // Called, under the engine's lock and so in the order the changes happened, at the end of
  // every call that changed the durable state or produced transitions, with the changes and the
  // transitions of that call, and the progress (level reports, evaluated steps) made since the
  // last call; an evaluation that changed nothing else keeps its progress for the next call or
  // FlushProgress, so that the sink is not called on every step. Each call is a consistent cut
  // (see Restore). The daemon writes both to disk in one transaction. It must not call back
  // into the engine. Set it before the first evaluation.
  using ChangeSink = std::function<void(StateChanges changes, const std::vector<Transition>& transitions)>;
  void SetChangeSink(ChangeSink sink);

  // Takes back a saved state (call on a fresh engine, before any evaluation): instances,
  // silences, level trackers and the last step evaluated per run are restored as they were.
  // Instances of rules that no longer exist end, as on ReplaceRules (returned), and their
  // trackers are dropped; silences that have ended are dropped.
  //
  // Restarts. Every change sink call hands over a consistent cut of the engine (instances,
  // trackers and evaluated steps after the same evaluation), so a store that applies them in
  // order holds, after a crash, the engine as it was after evaluating some step P of each run.
  // The steps after P that the run's journal holds must then be evaluated again, once, in step
  // order, and the steps up to P never again (EvaluatedThrough): the engine then makes exactly
  // the transitions, in the same order, that it would have made without the crash.
  std::vector<Transition> Restore(SavedState saved, double now);
  // The last step of `run` that EvaluateStep evaluated (kept across restarts, see Restore);
  // nullopt when none was, or since the run left memory (EndRun with kLeftMemory, ForgetRun).
  // A rewind to step N makes it N − 1 at most.
  std::optional<uint64_t> EvaluatedThrough(std::string_view run) const;
  // Hands the progress made since the last change sink call to the sink (the daemon's writer
  // calls it periodically and when it stops). Must not be called from the sink.
  void FlushProgress();

  // Evaluates every rule except timer rules against one run's completed step. Transitions in
  // rule order.
  std::vector<Transition> EvaluateStep(const RunFacts& facts, double now);
  // Evaluates the timer rules (stalled, run_died) against every run the daemon holds (`runs`); a
  // stalled alert of a run not listed resolves, a run_died alert of a run not listed resolves once
  // acknowledged. Also notifies firing alerts whose mute ended and drops silences that have ended.
  // `idle` names runs the daemon also holds but whose timer rules need no evaluation (ended with
  // a Goodbye: neither stalled nor run_died can hold for them); they count as listed.
  std::vector<Transition> EvaluateTimer(const std::vector<RunFacts>& runs, double now,
                                        const std::vector<std::string>& idle = {});
  // EvaluateTimer in two parts, for a caller that holds each run's facts only for a moment:
  // EvaluateTimerRun for each run to evaluate, then EndTimers with every run the daemon holds.
  std::vector<Transition> EvaluateTimerRun(const RunFacts& facts, double now);
  std::vector<Transition> EndTimers(const std::vector<std::string>& held, double now);
  // Whether any stalled or run_died rule is in force.
  bool HasTimerRules() const;
  // The run is gone (finished and forgotten, or deleted): its firing alerts resolve, its pending
  // ones go inactive, and it holds no state any more.
  std::vector<Transition> ForgetRun(const std::string& run_id, double now);

  // The run rewound to a checkpoint: its steps ≥ from_step were abandoned and will be reported
  // again with other values, so states are judged again from from_step. A pending instance
  // whose s0 ≥ from_step goes inactive (silently); a firing one that fired at a step ≥ from_step
  // resolves (notified as any resolve). Instances that started before from_step keep their
  // state and s0, as the kept history still supports them; a resolve countdown that started at
  // r0 ≥ from_step is forgotten. Returns the transitions.
  std::vector<Transition> RewindRun(const std::string& run_id, uint64_t from_step, double now);
  // How a run stopped being watched, for EndRun.
  enum class RunEnding {
    kGoodbye,         // it said Goodbye: every alert of the run ends
    kWithoutGoodbye,  // it ended by inactivity: every alert ends except its run_died ones
    kLeftMemory,      // the daemon dropped it: every alert ends except unacknowledged run_died ones
  };
  // Ends the alerts of a run that ended. A run_died alert outlives the run's end: it pages until
  // the run comes back (the timer evaluation resolves it) or, once acknowledged, until the run
  // leaves memory; EvaluateTimer also ends the acknowledged run_died alerts of runs not listed.
  std::vector<Transition> EndRun(const std::string& run_id, RunEnding how, double now);

  // Pending and firing alerts, of one run (or of all runs when `run` is empty), sorted by name
  // and labels. Muted ones included.
  std::vector<Alert> Active(std::string_view run = {}) const;

  // Adds a silence, or replaces the one with the same id. InvalidArgument when the id or the
  // matchers are empty or ends_at ≤ starts_at.
  Status AddSilence(Silence silence);
  // NotFound when no silence has this id.
  Status RemoveSilence(std::string_view id);
  std::vector<Silence> Silences() const;  // sorted by id

  // Acknowledges the firing alert with this fingerprint (16 hex digits, FingerprintHex):
  // NotFound when there is none, FailedPrecondition when it is only pending.
  Status Ack(std::string_view fingerprint, std::string by, std::string comment, double now);
  std::optional<Acknowledgement> AckOf(std::string_view fingerprint) const;

  // Whether notifications of `alert` are muted at `now`: an active silence matches it, or it is
  // a firing alert that was acknowledged.
  bool IsMuted(const Alert& alert, double now) const;
  // The ids of the silences that mute `alert` at `now`, sorted.
  std::vector<std::string> SilencesMuting(const Alert& alert, double now) const;

 private:
  using Instance = InstanceState;
  // The recent reports of one instance of a rule that holds, whether it is active or not.
  struct LevelTracker {
    std::string rule;
    std::string run;
    ReportWindow window;
    size_t since_mark = 0;       // reports since s0 (pending, firing) or r0 (clearing)
    bool all_since_mark = true;  // every one of them held (pending) / was past the clear band
    bool dirty = false;          // listed in dirty_levels_
    void Mark() { since_mark = 1, all_since_mark = true; }
    void Count(bool ok) { ++since_mark, all_since_mark = all_since_mark && ok; }
  };

  // Per run: each rule's base labels (BaseLabels) and its conditions, reused at every
  // evaluation so that a warm one allocates nothing (ConditionList). Rebuilt when the run's
  // labels change; dropped when the rules change or the run is forgotten.
  struct RunScratch {
    LabelSet run_labels;
    std::vector<LabelSet> base;             // by rule index
    std::vector<ConditionList> conditions;  // by rule index
  };
  RunScratch& ScratchLocked(const RunFacts& facts);

  void SetRulesLocked(std::vector<Rule> rules);
  bool IsMutedLocked(const Alert& alert, double now) const;
  // Advances one instance. `cond` is null when the rule did not produce the instance this time.
  // Returns false when the instance ended and must be erased.
  // `cond` is null when the instance has no condition at this step (`facts` then say why it ended).
  bool Advance(const Rule& rule, Instance& inst, const Condition* cond, const RunFacts& facts, double now,
               const Diagnosis* recommendation, std::vector<Transition>* out);
  // Advance for a condition judged on its level (Condition::level), with the instance's reports
  // (this one already added).
  bool AdvanceLevel(const Rule& rule, Instance& inst, const Condition& cond, LevelTracker& tracker, uint64_t step,
                    double now, const Diagnosis* recommendation, std::vector<Transition>* out);
  // Drops the trackers for which `drop` is true.
  template <typename Pred>
  void DropTrackers(Pred drop);
  // Evaluates `rule` for one run and advances its instances of that run.
  void EvaluateRule(size_t rule_index, const RunFacts& facts, double now, std::optional<Diagnosis>* recommendation,
                    std::vector<Transition>* out);
  // Ends every instance for which `ends` is true (resolve firing, drop pending).
  template <typename Pred>
  void EndInstances(Pred ends, double now, std::vector<Transition>* out);
  bool IsRunDiedRuleLocked(std::string_view rule_name) const;
  // Ends the run_died instances for which `of_run` is true, as EndRun does for `how`.
  template <typename Pred>
  void EndRunDiedLocked(RunEnding how, Pred of_run, double now, std::vector<Transition>* out);
  // Notifies firing alerts (of `run`, or all when empty) that were muted and no longer are.
  void CatchUpLocked(std::string_view run, double now, std::vector<Transition>* out);
  // Records that an instance changed or ended, for the next Publish.
  void Touch(uint64_t fingerprint) { dirty_instances_.insert(fingerprint); }
  // Lists the tracker for the next Publish, once: every level instance is touched at every step.
  void TouchLevel(uint64_t fingerprint, LevelTracker& tracker) {
    if (tracker.dirty) return;
    tracker.dirty = true;
    dirty_levels_.push_back(fingerprint);
  }
  // An instance's state is unchanged but the value it shows (and its annotations) moved: written
  // with the progress (every 200 ms, or with the next durable change), so that a restart shows
  // what the alert showed, not the value it had when it last changed state.
  // A vector (few alerts fire at once): cleared, it keeps its buffer, so a firing alert costs the
  // step path no allocation.
  void TouchShown(uint64_t fingerprint) {
    if (std::find(dirty_shown_.begin(), dirty_shown_.end(), fingerprint) == dirty_shown_.end()) {
      dirty_shown_.push_back(fingerprint);
    }
  }
  void SetEvaluatedLocked(const std::string& run, std::optional<uint64_t> step);
  void TouchSilence(const std::string& id) { dirty_silences_.insert(id); }
  // Hands the changes and transitions of this call to the sink.
  // Progress alone (level reports, evaluated steps) stays dirty when `progress_may_wait`, to be
  // handed over with the next durable change or FlushProgress.
  void PublishLocked(const std::vector<Transition>& transitions, bool progress_may_wait = false);

  mutable std::mutex mu_;
  std::atomic<uint64_t> rules_generation_{0};
  std::vector<Rule> rules_;
  std::vector<bool> uses_recommendation_;                   // by rule index: its templates show the diagnosis
  DiagnosisBounds bounds_;                                  // BoundsFromRules(rules_)
  std::unordered_map<uint64_t, Instance> instances_;        // by fingerprint
  std::unordered_map<uint64_t, LevelTracker> levels_;       // by fingerprint
  std::map<std::string, uint64_t, std::less<>> evaluated_;  // the last step evaluated, by run
  std::map<std::string, Silence, std::less<>> silences_;    // by id
  ChangeSink sink_;
  std::set<uint64_t> dirty_instances_;                   // since the last Publish
  std::set<std::string> dirty_silences_;                 // since the last Publish
  std::vector<uint64_t> dirty_levels_;                   // since the last Publish (may repeat one)
  std::set<std::string> dirty_evaluated_;                // since the last Publish
  std::vector<uint64_t> dirty_shown_;                    // since the last Publish (progress)
  std::unordered_map<std::string, RunScratch> scratch_;  // by run
  // EvaluateRule's scratch: (fingerprint, condition index), the fingerprints seen (sorted), which
  // conditions are evaluated (the first of each fingerprint), the series with an instance.
  std::vector<std::pair<uint64_t, size_t>> fingerprints_;
  std::vector<uint64_t> seen_;
  std::vector<uint8_t> first_of_fingerprint_;
  std::vector<std::string_view> with_instance_;
};

}  // namespace gradwatch::alerts

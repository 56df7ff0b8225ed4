// The analytics of one run: windowed slopes of every series, slope changes at events and without
// them, forecasts to thresholds, grad-norm attribution, norm-gain amplification and growth
// without decay. Owned by its Run and guarded by the run's mutex; O(series × windows) per step.
//
// A function of the run's steps (in step order) and of its events keyed by step, whatever the
// order they arrive in: an event that arrives after steps past it (a resend after a restart,
// another rank's timing) gives the same slope change as one that arrived first, as long as the
// robust tracker still holds its before window (event_slope.h); the max_events kept are the
// latest by step, ordered by (step, text). So analytics rebuilt at a restart or a rewind equal
// the live ones.
//
// Memory grows with what the run reports: a series' trackers are allocated on its first sample
// (a catalog entry that never reports costs a few hundred bytes), charged to the memory budget
// at their full size (about 34 KB for a key series with the default windows) before they are
// allocated, and released when the analytics are destroyed (the run is dropped, or rewinds). A
// series whose trackers do not fit gets no analytics (no slopes, slope changes, forecasts or
// share trend) until the analytics are rebuilt; it is counted (DaemonStats::
// analytics_refused_series) and the first one of a run is logged.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "server/analytics/attribution.h"
#include "server/analytics/change_point.h"
#include "server/analytics/event_slope.h"
#include "server/analytics/projection.h"
#include "server/analytics/regression.h"
#include "server/analytics/spike_filter.h"
#include "server/core/set_aside.h"
#include "server/core/state_io.h"
#include "server/core/types.h"
#include "server/runs/daemon_stats.h"
#include "server/runs/memory_budget.h"

namespace gradwatch::runs {

struct AnalyticsOptions {
  // Slope windows (steps); the forecast and share trends use forecast_window_steps, which is
  // added to the list when missing.
  std::vector<uint64_t> windows = {1000, 5000, 20000};
  // Buckets per window: memory per tracked series is about windows × max_buckets × 40 bytes;
  // a window's edge has a granularity of window / max_buckets steps.
  size_t max_buckets = 128;
  // Buckets per window for the series of parameters other than the output layer that are not key
  // series (most of a large run's series), and for their share trends; the run's scalars, the key
  // series and the output layer keep max_buckets. About 3.1 KB per series with 16.
  size_t param_max_buckets = 16;
  // The samples of trackers no rule reads at each step are set aside and fed a slice at a time
  // once the run's trackers take at least this many bytes (the caches no longer hold them);
  // below it, where the trackers stay cached, each sample is added at once.
  uint64_t set_aside_min_bytes = uint64_t{32} << 20;
  uint64_t event_window_steps = 5000;
  size_t event_min_after_samples = 10;
  // Events kept per series for slope changes (the most recent).
  size_t max_events = 16;
  uint64_t forecast_window_steps = 20000;
  // (series key, threshold) pairs to forecast.
  std::vector<std::pair<std::string, double>> forecasts = {{"grad/norm/total", 5.0}};
  analytics::ChangePointOptions change_points;
  // Growth without decay is reported when the norm rose by at least this fraction over the
  // longest window.
  double min_growth = 0.02;
  // How far ahead the what-if of weight decay on a growing parameter looks (steps).
  uint64_t projection_steps = 20000;
};

struct SeriesSlopeInfo {
  std::string key;
  uint64_t window_steps = 0;
  analytics::LinearFit fit;
};
struct SlopeChangeInfo {
  std::string key;
  std::string event_text;
  // Fit on the spike-filtered series; its standard errors are scaled by √(filter width) for
  // the correlation between neighbouring medians (run_analytics.cc).
  analytics::SlopeChange change;
  size_t after_samples = 0;
};
struct ChangePointInfo {
  std::string key;
  analytics::ChangePoint change;
};
struct ForecastInfo {
  std::string key;
  double threshold = 0;
  uint64_t window_steps = 0;
  bool reachable = false;
  double steps_to_threshold = 0;
  uint64_t at_step = 0;
  double current_value = 0;
  double slope_per_kstep = 0;
  // What the fit holds: its reports and the steps from its first to its last (less than
  // window_steps while the window is not yet full, and after a rewind).
  uint64_t fit_samples = 0;
  uint64_t fit_span_steps = 0;
};
struct ShareInfo {
  std::string name;
  // Who the entry is about, unique in the process: entries with the same source have the same
  // name (a run's catalog and groups only grow), so a caller refilling entries in place need not
  // copy a name that did not move. 0: none yet.
  uint64_t source = 0;
  bool is_group = false;
  double share = 0;
  double slope_per_kstep = 0;
  ParamKind kind = ParamKind::kUnspecified;  // a parameter's catalog kind (not for groups)
  // Where the share stood at the start of its trend's window: the mean of its oldest bucket, over
  // steps [earlier_first_step, earlier_last_step]; and the reports the trend holds. Set with the
  // slope (NaN and 0 when the slope is not fitted).
  double earlier_share = 0;
  uint64_t earlier_first_step = 0;
  uint64_t earlier_last_step = 0;
  uint64_t trend_samples = 0;
};
struct AmplificationInfo {
  std::string param;
  double norm = 0;
  double init_norm = 0;
  double amplification = 0;
};
struct GrowthInfo {
  std::string param;
  double growth_factor = 0;
  double slope_per_kstep = 0;
  uint64_t window_steps = 0;  // the steps it was measured over: the longest window, or less while it fills
  double amplification = 0;   // NaN when the init norm is unknown
  double norm = 0;
};

// What weight decay would do to a parameter whose norm grows without it (analytics/projection.h),
// from the run's latest step, with the learning rate and the update's parts held.
struct ProjectionInfo {
  std::string param;
  double weight_decay = 0;  // the decay projected (the run's default, else its decayed parameters')
  uint64_t from_step = 0;
  uint64_t to_step = 0;  // from_step + AnalyticsOptions::projection_steps, or the run's last step
  std::string schedule;  // the learning-rate schedule followed (LearningRateSchedule::Describe), or empty: held
  double norm_now = 0;
  double norm = 0;  // projected at to_step
  double equilibrium_norm = 0;
  double time_constant_steps = 0;
  double learning_rate = 0;
  double radial = 0;      // ρ, per unit learning rate
  double orthogonal = 0;  // |u⊥|, per unit learning rate (0 when no update norm is reported)
  bool orthogonal_known = false;
  bool radial_known = false;  // ρ from the reported radial update (updates/radial/), else from the slope
  // Where the output layer's gradient scales with the norm: the total grad norm at to_step (NaN
  // when the run has no total or no output share).
  double total_grad_norm = 0;
};

// The check after a remediation: a catalog change that gave a parameter weight decay (or more of
// it), the projection made at that step held against what the norm did since.
struct RemediationInfo {
  std::string param;
  uint64_t step = 0;  // the change's
  double weight_decay = 0;
  double previous_weight_decay = 0;
  double norm_at_step = 0;
  uint64_t at_step = 0;  // the run's latest
  double projected_norm = 0;
  double actual_norm = 0;
  double unchanged_norm = 0;  // where the previous weight decay would have taken it
  double time_constant_steps = 0;
  // "too early" (before half a time constant), "working" (within 25% of the projection),
  // "faster than projected" (more than 25% below it), "slower than projected" (more than 25%
  // above it, nearer it than where the norm would be without the change), "not working" (nearer
  // where it would be without the change).
  std::string verdict;
};

// A catalog parameter's analytics, as the alert rules read them at each step. Unknown fields are
// empty.
struct ParamAnalysis {
  std::optional<double> norm;  // the param norm's latest value
  // Norm gains with a known init norm only (as RunAnalysis::amplifications lists them).
  std::optional<double> init_norm;
  std::optional<double> amplification;
  // Growth without decay (as RunAnalysis::growth_without_decay lists it).
  std::optional<GrowthInfo> growth;
  // The norm's slope over forecast_window_steps, raw samples (as RunAnalysis::slopes lists it).
  std::optional<double> norm_slope_per_kstep;
  // Its radial update ⟨Δw, w⟩/|w| as it is now (updates/radial/<param>: the line fitted over the
  // shortest window, at its last step), when the trainer sends it; filled with the norm's fits.
  std::optional<double> radial_per_step;
};

struct RunAnalysis {
  std::vector<SeriesSlopeInfo> slopes;
  std::vector<SlopeChangeInfo> slope_changes;
  std::vector<ChangePointInfo> change_points;
  std::vector<ForecastInfo> forecasts;
  // Largest first in Analysis(); in catalog order (parameters, then groups) in StepAnalysis(),
  // whose readers (the alert rules) look at every share: no per-step sort.
  std::vector<ShareInfo> shares;
  std::vector<AmplificationInfo> amplifications;
  std::vector<GrowthInfo> growth_without_decay;
  // Analysis() only (not StepAnalysis).
  std::vector<ProjectionInfo> projections;
  // Analysis() and StepAnalysis().
  std::vector<RemediationInfo> remediations;
};

// The per-parameter fits a reader of StepAnalysis uses, by catalog index (an index beyond a
// vector: not used): `norm`, the param norm's slope and growth without decay; `share`, the slope
// of the parameter's share trend. The fits nobody reads are left out of the step's view (no norm
// slope or growth; a share slope of NaN): in a large run most parameters are read by no rule, and
// fitting two windows of each at every step took about a tenth of the daemon's CPU. Analysis()
// fits them all.
struct StepFits {
  std::vector<uint8_t> norm;
  std::vector<uint8_t> share;
};

// Where a run's analytics charge their memory.
struct AnalyticsCharging {
  MemoryBudget* budget = nullptr;  // not owned; null: unlimited
  DaemonStats* stats = nullptr;    // not owned; may be null
  std::string run_id;              // for the log
};

class RunAnalytics {
 public:
  explicit RunAnalytics(const AnalyticsOptions& options, AnalyticsCharging charging = {});

  // The catalog, grown or not; call before adding the series of new parameters.
  void SetCatalog(const std::vector<ParamInfo>& params);
  // The catalog's entries changed in place (a catalog change: runs/catalog_change.h): their kind,
  // weight decay, role and group are taken from `params` (same entries, same order), a parameter
  // moved to another group counts in that group's share from the next step. A series keeps the
  // trackers it was given (a norm that gains weight decay keeps its change-point detector).
  // A weight decay raised from `from_step` on (a live change, not a restore catching up) starts
  // a remediation check (RunAnalysis::remediations), from the dynamics measured before it.
  void UpdateCatalog(const std::vector<ParamInfo>& params, std::optional<uint64_t> from_step = std::nullopt);
  // The run's default weight decay (config.weight_decay), which projections use first.
  void SetDefaultWeightDecay(std::optional<double> weight_decay) { default_weight_decay_ = weight_decay; }
  // The run's learning-rate schedule and last step (its config), which projections follow.
  void SetSchedule(const analytics::LearningRateSchedule& schedule) { schedule_ = schedule; }
  // A series exists under `id`; its role is read from the key and the catalog.
  void AddSeries(SeriesId id, const std::string& key);
  // Room for `count` series ids in all, so that a catalog's series do not grow the entries by
  // doubling (a quarter of them left unused on average).
  void ReserveSeries(size_t count) { series_.reserve(count); }
  // The catalog index of the parameter series `id` (added) belongs to; -1 for the run's scalars,
  // extra keys and unknown ids.
  int ParamOf(SeriesId id) const { return id < series_.size() ? series_[id].param : -1; }
  // One completed step's values.
  void OnStep(const CompletedStep& step);
  // An event: the slopes of the key series before and after it are tracked.
  void OnEvent(const EventRecord& event);
  // The (series, threshold) pairs to forecast from now on, in place of options.forecasts (a reload
  // of the rules moved a forecast rule's threshold): a series already forecast keeps its fit, a
  // series first forecast now is forecast if its trackers hold the forecast window (key series
  // do; others from the next rebuild).
  void SetForecasts(const std::vector<std::pair<std::string, double>>& forecasts);
  // The run resumed from its checkpoint at `step` (its latest rewind; 0: none). A forecast fits
  // only the samples from there on while its window still holds earlier ones, so that the jump a
  // resume often brings is not extrapolated; with few samples yet its fit reports them
  // (ForecastInfo::fit_samples), and the alert rules wait for enough (alerts/evaluator.h).
  // Call before the steps from `step` on.
  void SetBranchStart(uint64_t step);

  RunAnalysis Analysis() const;
  // The same, overwriting `out` in place: buffers reused from one call to the next (a /metrics
  // scrape's) stop allocating once warm.
  void Analysis(RunAnalysis& out) const;
  // What the alert rules read at each step: Analysis() without the slopes of every series, the
  // per-parameter entries by catalog index in `params` (amplifications and growth_without_decay
  // stay empty; the shares in catalog order), with only the per-parameter fits `fits` names.
  // O(key series × events + parameters + fits), not O(series × windows); `out` and `params` are
  // overwritten in place, so buffers reused across steps stop allocating once warm.
  void StepAnalysis(RunAnalysis& out, std::vector<ParamAnalysis>& params, const StepFits& fits) const;

  // A remediation under check: the parameter, the change, and the projection's inputs then.
  struct Remediation {
    size_t param = 0;
    uint64_t step = 0;
    double weight_decay = 0;
    double previous_weight_decay = 0;
    double norm = 0;
    double learning_rate = 0;
    analytics::NormDynamics dynamics;
    // The two paths as far as they were iterated (FillRemediations carries them on from there, so
    // that a reader pays for the steps since its last read, not since the change): with the new
    // weight decay, and with the previous one.
    uint64_t advanced_to = 0;
    double projected = 0;
    double unchanged = 0;
  };
  // A rewind to `step` keeps the checks of changes before it (their projections were made from
  // the kept branch): RemediationsBefore of the old analytics, AdoptRemediations into the new.
  std::vector<Remediation> RemediationsBefore(uint64_t step) const;
  void AdoptRemediations(std::vector<Remediation> kept);

  // Snapshots (Run::SaveSnapshot). SaveState writes what the steps and events made of the
  // analytics: every series' trackers, the events, the shares and the parameters' fits.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into fresh analytics (no step yet) constructed with the same
  // options, whose catalog and series (SetCatalog, AddSeries) hold at least those of the saved
  // ones under the same keys. Trackers are charged to the budget as OnStep would; false (the
  // reader failed) when the bytes do not fit these analytics, or the budget refuses a series the
  // saved analytics tracked: the caller discards them.
  bool LoadState(StateReader& in);

  // Bytes charged to the budget (held until destruction).
  uint64_t charged_bytes() const { return charge_.bytes(); }
  // How far the weight-decay what-if projects (AnalyticsOptions::projection_steps).
  uint64_t projection_steps() const { return options_.projection_steps; }
  // Series refused analytics for memory.
  uint64_t refused_series() const { return refused_series_; }

 private:
  enum class Role : uint8_t {
    kTotalGrad,
    kScalar,
    kParamGrad,
    kParamNorm,
    kParamUpdate,
    kParamRadial,
    kParamLearningRate,
    kExtra
  };
  // The fields every sample reads (OnStep, ApplySetAside) come first: 75 bytes, two cache lines
  // wherever an entry falls in series_; the rest is read when a series is added or an event is.
  struct Tracked {
    // Raw samples: the slopes shown, as Prometheus's deriv. Empty until the first sample
    // (Materialize), and so are the trackers below. Held in the entry (its windows in one block):
    // a sample reaches them without another pointer to follow.
    std::optional<analytics::SlopeTracker> slopes;
    std::unique_ptr<analytics::SlopeChangeDetector> detector;  // key series only
    // Key series and forecast series: a spike filter's output, which feeds event slopes and
    // forecasts so that a one-step spike does not bend them (the longest window, and the
    // forecast's).
    std::unique_ptr<analytics::SpikeFilter> spike_filter;
    double last_value = 0;
    int param = -1;
    Role role = Role::kExtra;
    bool added = false;    // AddSeries was called for this id
    bool refused = false;  // its trackers did not fit in the memory budget
    bool has_value = false;
    bool key_series = false;
    // A parameter series with raw trackers only: its samples are set aside (set_aside_) unless a
    // per-step reader fits it (read_each_step, set by StepAnalysis, which reads only those).
    bool sets_aside = false;
    bool read_each_step = false;
    std::unique_ptr<analytics::SlopeTracker> robust;
    std::vector<std::pair<std::string, analytics::EventSlope>> events;  // (event text, slope)
    std::string key;
  };
  struct ParamState {
    SeriesId grad = kNoSeries;
    SeriesId norm = kNoSeries;
    SeriesId update = kNoSeries;
    SeriesId radial = kNoSeries;
    SeriesId learning_rate = kNoSeries;  // optim/learning_rate/<param>, when its group's differs
    int group = 0;
    std::optional<double> init_norm;
    std::unique_ptr<analytics::WindowedSlope> share_trend;
    double share = 0;
    bool has_share = false;
    bool grad_tracked = false;          // its gradient series has trackers: share_trend is fed
    bool share_read_each_step = false;  // StepAnalysis fits share_trend: fed at once, not set aside
    // The param norm's latest value (its fits are made when read: FillNormFits).
    double norm_value = 0;
    bool has_norm_value = false;
  };
  struct GroupState {
    std::string name;
    std::unique_ptr<analytics::WindowedSlope> share_trend;
    double share = 0;
    bool has_share = false;
  };

  bool IsKeySeries(Role role, int param) const;
  // Buckets per window of a series' trackers (max_buckets or param_max_buckets).
  size_t BucketsFor(const Tracked& t) const;
  size_t ShareBucketsFor(const ParamInfo& p) const;
  // Allocates a series' trackers (on its first sample) if the budget has room for them; false
  // (and the series marked refused) otherwise.
  bool Materialize(Tracked& t);
  void ClassifyLocked(Tracked& t) const;
  // The step's shares, from the parameters' gradient norms OnStep gathered in grad_scratch_.
  void UpdateShares(uint64_t step, std::optional<double> total, uint32_t slot, bool set_aside);
  // Feeds the samples set aside in one slice (of set_aside_ and set_aside_shares_), or in all, to
  // their trackers. Const for the const readers: it changes no result, only when the trackers
  // take their samples (the trackers and the slices are mutable).
  void ApplySetAside(size_t slice) const;
  void ApplyAllSetAside() const;
  // Marks the trackers StepAnalysis fits (fitted_scratch_'s norms, `fits`' shares) as read at
  // each step: their samples are no longer set aside.
  void MarkReadEachStep(const StepFits& fits) const;
  // The window of this length of the series' robust tracker (its raw one when it has none).
  const analytics::WindowedSlope* Window(const Tracked& t, uint64_t window_steps) const;
  bool IsForecastKey(const std::string& key) const;
  // Analysis() and StepAnalysis() but the slopes and the per-parameter entries. The shares are
  // ordered largest first when order_shares, else left in catalog order (parameters, then groups).
  // A parameter's share slope is fitted when share_fits is null or names it (StepFits::share);
  // NaN otherwise. Groups' share slopes are always fitted.
  void EventsForecastsShares(RunAnalysis& out, bool order_shares, const std::vector<uint8_t>* share_fits) const;
  // Parameter i's entry, written over `out` in place (a kept entry's strings keep their buffers);
  // its norm's slope and growth only when fit_norm (left empty otherwise).
  void FillParamEntry(size_t i, ParamAnalysis& out, bool fit_norm) const;
  // Parameter i's norm slope over forecast_window_steps and its growth without decay over the
  // longest window, from its norm series' raw tracker, into `out`.
  void FillNormFits(size_t i, ParamAnalysis& out) const;

  const AnalyticsOptions options_;
  // ShareInfo::source's high bits: unique to this object in the process.
  const uint64_t instance_;
  AnalyticsCharging charging_;
  MemoryCharge charge_;
  uint64_t refused_series_ = 0;
  // The index of forecast_window_steps among options_.windows, which every raw tracker has, in
  // that order.
  const size_t forecast_window_index_;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, int> param_by_name_;
  // Mutable for ApplySetAside.
  mutable std::vector<ParamState> param_state_;
  std::vector<GroupState> groups_;
  mutable std::vector<Tracked> series_;  // by SeriesId
  // A large run's trackers outgrow the caches, and most of them (the raw slopes of parameter
  // series, parameters' share trends) are read by no rule at each step: their samples are set
  // aside by series id (by catalog index for shares) and fed a slice at a time, as Run does its
  // points (core/set_aside.h), so that each tracker takes kSetAsideSlices samples while cached.
  // Every reader of those trackers (Analysis, SaveState, StepAnalysis for what it fits) applies
  // them first.
  mutable SetAsideSlices set_aside_;
  mutable SetAsideSlices set_aside_shares_;
  // Ids of the key series with trackers (those with events and change points), ascending: a
  // step's analysis visits them, not every series.
  std::vector<SeriesId> key_ids_;
  // The (series, threshold) pairs forecast: options_.forecasts, or SetForecasts'.
  std::vector<std::pair<std::string, double>> forecasts_;
  // The series of each forecasts_ entry (the lowest id with its key), or kNoSeries.
  std::vector<SeriesId> forecast_ids_;
  // SetBranchStart's step, and per forecast (forecasts_' order) the spike-filtered
  // samples of its series from that step on.
  uint64_t branch_start_ = 0;
  std::vector<std::optional<analytics::RegressionSums>> branch_sums_;
  SeriesId total_grad_ = kNoSeries;
  SeriesId learning_rate_ = kNoSeries;
  uint64_t last_step_ = 0;  // the latest step analysed
  std::optional<double> default_weight_decay_;
  analytics::LearningRateSchedule schedule_;
  // Mutable: FillRemediations, a const reader under the run's lock, advances the paths.
  mutable std::vector<Remediation> remediations_;
  // The line fitted over a series' shortest window (what it is doing now); nullopt without one.
  std::optional<analytics::LinearFit> RecentFit(SeriesId id) const;
  // Parameter i's radial update now (RecentFit of updates/radial/<param> at its last step); NaN
  // when the trainer does not send it.
  double RadialOf(size_t i) const;
  // The parameter's norm dynamics now (its norm's recent slope, its update norm, its radial update
  // when sent, the learning rate `lr`); nullopt without a norm or a slope.
  std::optional<analytics::NormDynamics> DynamicsOf(size_t i, double lr) const;
  // The learning rate's latest report; NaN when unknown.
  double LearningRate() const;
  // Parameter i's: its own (optim/learning_rate/<param>) when reported, else the run's.
  double LearningRateOf(size_t i) const;
  // The weight decay a projection uses: the run's default, else the most common one among its
  // decayed parameters; 0: none known.
  double ProjectedWeightDecay() const;
  // The what-if of weight decay on each parameter growing without it (Analysis only).
  void FillProjections(RunAnalysis& out) const;
  // The check of each remediation (Analysis and StepAnalysis: the remediation rule reads it).
  void FillRemediations(RunAnalysis& out) const;
  std::vector<EventRecord> events_;
  // Per-step scratch, reused.
  std::vector<double> grad_scratch_;
  std::vector<uint32_t> group_of_param_;
  std::vector<double> param_share_scratch_;
  std::vector<double> group_share_scratch_;
  // EventsForecastsShares' scratch for ordering the shares, reused across steps. Mutable: the
  // const readers are serialised like every other call (the run's mutex).
  mutable std::vector<std::pair<double, uint32_t>> share_order_;
  mutable std::vector<ShareInfo> share_sorted_;
  // StepAnalysis' scratch: the catalog indices of the parameters whose norm it fits.
  mutable std::vector<uint32_t> fitted_scratch_;
};

}  // namespace gradwatch::runs

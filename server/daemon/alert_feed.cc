#include "server/daemon/alert_feed.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "server/core/thread_name.h"

namespace gradwatch::daemon {

namespace {
constexpr uint32_t kUnknown = std::numeric_limits<uint32_t>::max();
// Facts objects kept for reuse beyond those queued and the latest: enough for steady ingest.
constexpr size_t kSpares = 2;
}  // namespace

FeedDrainer::FeedDrainer()
    : thread_([this] {
        NameThisThread("gw-alert-drain");
        Loop();
      }) {}

FeedDrainer::~FeedDrainer() { Stop(); }

bool FeedDrainer::Request(std::weak_ptr<AlertFeed> feed) {
  MutexLock lock(&mu_);
  if (stopping_) return false;
  requests_.push_back(std::move(feed));
  cv_.Signal();
  return true;
}

void FeedDrainer::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
    cv_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

void FeedDrainer::Loop() {
  MutexLock lock(&mu_);
  for (;;) {
    while (requests_.empty() && !stopping_) cv_.Wait(&mu_);
    if (requests_.empty()) return;  // stopping, and every request is served
    std::weak_ptr<AlertFeed> request = std::move(requests_.front());
    requests_.pop_front();
    mu_.Unlock();
    // A feed whose run is gone has no one waiting on it.
    if (const std::shared_ptr<AlertFeed> feed = request.lock()) feed->Drain();
    mu_.Lock();
  }
}

AlertFeed::AlertFeed(const RunMeta& meta, std::optional<uint64_t> evaluated_through, alerts::AlertEngine& engine,
                     TransitionSink sink, const std::atomic<uint64_t>* min_steps_before_page, FeedDrainer* drainer)
    : run_id_(meta.run_id),
      engine_(engine),
      sink_(std::move(sink)),
      drainer_(drainer),
      evaluated_through_(evaluated_through),
      min_steps_before_page_(min_steps_before_page),
      last_(std::make_unique<alerts::RunFacts>()) {
  last_->run_id = run_id_;
  last_->run_labels = meta.labels;
}

void AlertFeed::OnSeries(SeriesId id, const std::string& key) {
  if (id >= keys_.size()) {
    keys_.resize(id + 1);
    key_rank_.resize(id + 1, kUnknown);
  }
  keys_[id] = key;
  key_rank_[id] = kUnknown;
  if (key == keys::kLearningRate && (learning_rate_id_ == kNoSeries || id < learning_rate_id_)) learning_rate_id_ = id;
  keys_ranked_ = false;
}

void AlertFeed::RankKeys() {
  ids_by_key_.clear();
  for (SeriesId id = 0; id < keys_.size(); ++id) {
    if (!keys_[id].empty()) ids_by_key_.push_back(id);
  }
  std::sort(ids_by_key_.begin(), ids_by_key_.end(), [this](SeriesId a, SeriesId b) { return keys_[a] < keys_[b]; });
  key_rank_.assign(keys_.size(), kUnknown);
  for (size_t r = 0; r < ids_by_key_.size(); ++r) key_rank_[ids_by_key_[r]] = static_cast<uint32_t>(r);
  value_by_id_.assign(keys_.size(), 0.0);
  value_stamp_.assign(keys_.size(), 0);
  keys_ranked_ = true;
  // A rank may stand for another key now: the next step's keys get a new layout id.
  layout_ranks_.clear();
  ++layout_id_;
}

void AlertFeed::OnStep(const runs::PublishedStep& p) {
  const uint64_t step = p.step.step;
  // The learning rate's history is the run's, evaluated or not (a restored step the engine
  // already judged still tells where the warm-up ended).
  for (const SeriesValue& sv : p.step.values) {
    if (sv.id == learning_rate_id_) learning_rate_.Add(step, sv.value);
  }
  last_filled_step_ = std::max(last_filled_step_, step);
  if (p.restored) {
    // Restored steps after the last one evaluated before the restart are evaluated now; none if
    // the engine kept no evaluation of the run.
    if (!evaluated_through_ || step <= *evaluated_through_) return;
    evaluated_through_ = step;
  } else if (evaluated_through_) {
    if (step <= *evaluated_through_) return;  // a resend of a step evaluated before a restart
    evaluated_through_.reset();
  }
  Item item;
  item.kind = Item::Kind::kStep;
  {
    std::lock_guard lock(queue_mu_);
    if (!spare_.empty()) {
      item.facts = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  if (!item.facts) item.facts = std::make_unique<alerts::RunFacts>();
  Fill(p, *item.facts);
  item.now = p.now;
  Push(std::move(item));
}

void AlertFeed::OnRewind(uint64_t from_step, double now) {
  evaluated_through_.reset();  // the new branch's steps are evaluated as they complete
  learning_rate_.Rewind(from_step);
  rewind_.from_step = from_step;
  rewind_.abandoned_through = last_filled_step_;
  last_filled_step_ = from_step > 0 ? from_step - 1 : 0;
  Item item;
  item.kind = Item::Kind::kRewind;
  item.from_step = from_step;
  item.now = now;
  Push(std::move(item));
}

void AlertFeed::OnEnded(bool clean, double now) {
  Item item;
  item.kind = Item::Kind::kEnded;
  item.clean = clean;
  item.now = now;
  Push(std::move(item));
}

void AlertFeed::Push(Item item) {
  std::unique_lock queue_lock(queue_mu_);
  queue_.push_back(std::move(item));
  queued_ = true;
  if (queue_.size() <= kMaxQueued) return;
  // A burst: the queue is full. Back-pressure: the run's thread waits for room while the drainer
  // evaluates, never evaluating under the run's lock itself.
  if (std::weak_ptr<AlertFeed> self = weak_from_this(); drainer_ != nullptr && !self.expired()) {
    if (!drain_requested_) drain_requested_ = drainer_->Request(std::move(self));
    if (drain_requested_) {
      room_.wait(queue_lock, [this] { return queue_.size() <= kMaxQueued; });
      return;
    }
  }
  // No drainer (a feed tested alone, or the daemon stopping): evaluate what waits now rather
  // than let it grow.
  queue_lock.unlock();
  std::lock_guard eval(eval_mu_);
  queue_lock.lock();
  DrainLocked(queue_lock);
}

void AlertFeed::Drain() {
  std::lock_guard eval(eval_mu_);
  std::unique_lock queue_lock(queue_mu_);
  drain_requested_ = false;
  DrainLocked(queue_lock);
}

void AlertFeed::Deliver() {
  std::unique_lock queue_lock(queue_mu_);
  if (!queued_) return;
  queue_lock.unlock();
  std::lock_guard eval(eval_mu_);
  queue_lock.lock();
  DrainLocked(queue_lock);
}

void AlertFeed::DrainLocked(std::unique_lock<std::mutex>& queue_lock) {
  while (!queue_.empty()) {
    Item item = std::move(queue_.front());
    queue_.erase(queue_.begin());
    room_.notify_all();
    queue_lock.unlock();
    Evaluate(item);
    queue_lock.lock();
    if (item.facts && spare_.size() < kSpares) spare_.push_back(std::move(item.facts));
  }
  // Only now: a Deliver that finds the queue empty while the drainer still evaluates its last item
  // waits for it (on eval_mu_), so that what its caller queued is evaluated when it returns.
  queued_ = false;
}

void AlertFeed::Evaluate(Item& item) {
  using Ending = alerts::AlertEngine::RunEnding;
  switch (item.kind) {
    case Item::Kind::kStep: {
      std::vector<alerts::Transition> transitions = engine_.EvaluateStep(*item.facts, item.now);
      std::swap(last_, item.facts);  // the previous facts go back to the spares
      evaluated_any_ = true;
      if (!transitions.empty()) sink_(std::move(transitions), /*to_trainers=*/true);
      break;
    }
    case Item::Kind::kRewind: sink_(engine_.RewindRun(run_id_, item.from_step, item.now), /*to_trainers=*/true); break;
    case Item::Kind::kEnded:
      sink_(engine_.EndRun(run_id_, item.clean ? Ending::kGoodbye : Ending::kWithoutGoodbye, item.now),
            /*to_trainers=*/false);
      break;
  }
}

std::optional<alerts::DiagnosisAt> AlertFeed::Diagnose(const alerts::DiagnosisBounds& bounds) {
  std::lock_guard eval(eval_mu_);
  if (!evaluated_any_) return std::nullopt;
  return alerts::DiagnosisAt{last_->step, alerts::Diagnose(*last_, bounds), last_->warmup.reason};
}

void AlertFeed::EvaluateTimer(const runs::RunActivity& activity, double now) {
  std::lock_guard eval(eval_mu_);
  alerts::RunFacts& f = *last_;
  f.step = activity.last_step;
  f.wall_time = activity.last_wall_time;
  f.now = now;
  f.open_streams = activity.open_streams;
  f.seconds_since_last_step = activity.seconds_since_last_step;
  f.seconds_since_activity = activity.seconds_since_activity;
  f.ended_cleanly = activity.ended_cleanly;
  f.nonfinite.clear();  // those of the last step, not of now
  std::vector<alerts::Transition> transitions = engine_.EvaluateTimerRun(f, now);
  if (!transitions.empty()) sink_(std::move(transitions), /*to_trainers=*/true);
}

void AlertFeed::Fill(const runs::PublishedStep& p, alerts::RunFacts& f) {
  if (!keys_ranked_) RankKeys();
  const CompletedStep& step = p.step;
  f.run_id = run_id_;
  if (f.run_labels != p.meta.labels) f.run_labels = p.meta.labels;
  f.step = step.step;
  f.wall_time = step.wall_time;
  f.now = p.now;
  f.open_streams = p.activity.open_streams;
  f.seconds_since_last_step = p.activity.seconds_since_last_step;
  f.seconds_since_activity = p.activity.seconds_since_activity;
  f.ended_cleanly = p.activity.ended_cleanly;

  // The step's values in key order.
  ++value_epoch_;
  ranked_values_.clear();
  size_t known = 0;
  for (const SeriesValue& sv : step.values) {
    if (sv.id >= key_rank_.size() || key_rank_[sv.id] == kUnknown) continue;
    ++known;
    value_by_id_[sv.id] = sv.value;
    value_stamp_[sv.id] = value_epoch_;
  }
  // A step that holds most of the run's series (a trainer reports them all) is read in key order
  // by walking the keys: O(series), no sort. A sparse step's few values are sorted instead.
  if (known * 4 >= ids_by_key_.size()) {
    for (uint32_t rank = 0; rank < ids_by_key_.size(); ++rank) {
      const SeriesId id = ids_by_key_[rank];
      if (value_stamp_[id] == value_epoch_) ranked_values_.emplace_back(rank, value_by_id_[id]);
    }
  } else {
    for (const SeriesValue& sv : step.values) {
      if (sv.id >= key_rank_.size() || key_rank_[sv.id] == kUnknown) continue;
      ranked_values_.emplace_back(key_rank_[sv.id], sv.value);
    }
    std::sort(ranked_values_.begin(), ranked_values_.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
  }
  // The same keys as the step before (a trainer reports the same series every step): facts that
  // already hold them take the values alone, without copying a key a series a step.
  bool same_keys = !layout_ranks_.empty() && layout_ranks_.size() == ranked_values_.size();
  for (size_t i = 0; same_keys && i < ranked_values_.size(); ++i) {
    same_keys = layout_ranks_[i] == ranked_values_[i].first;
  }
  if (!same_keys) {
    ++layout_id_;
    layout_ranks_.clear();
    for (const auto& ranked : ranked_values_) layout_ranks_.push_back(ranked.first);
  }
  const bool keys_held = f.latest_layout == layout_id_ && f.latest.size() == ranked_values_.size();
  f.latest.resize(ranked_values_.size());
  size_t latest = 0, nonfinite = 0;
  for (const auto& [rank, value] : ranked_values_) {
    alerts::SeriesValue& v = f.latest[latest++];
    if (!keys_held) v.key = keys_[ids_by_key_[rank]];
    v.value = value;
    if (!std::isfinite(value)) {
      if (nonfinite == f.nonfinite.size()) f.nonfinite.emplace_back();
      alerts::NonFiniteFact& n = f.nonfinite[nonfinite++];
      n.key = keys_[ids_by_key_[rank]];
      n.step = step.step;
    }
  }
  f.latest_layout = layout_id_;
  f.nonfinite.resize(nonfinite);

  // The catalog only grows; a reload of the rules marks the whole catalog again.
  const uint64_t generation = engine_.rules_generation();
  if (generation != fits_generation_) fits_params_ = 0;
  if (fits_params_ < p.meta.params.size()) {
    engine_.ReadFits(p.meta.params, fits_params_, fits_.norm, fits_.share);
    fits_params_ = p.meta.params.size();
    fits_generation_ = generation;
  }
  p.analytics.StepAnalysis(analysis_, params_, fits_);
  const runs::RunAnalysis& a = analysis_;
  f.forecasts.resize(a.forecasts.size());
  for (size_t i = 0; i < a.forecasts.size(); ++i) {
    const runs::ForecastInfo& x = a.forecasts[i];
    alerts::ForecastFact& y = f.forecasts[i];
    y.key = x.key;
    y.threshold = x.threshold;
    y.reachable = x.reachable;
    y.steps_to_threshold = x.steps_to_threshold;
    y.at_step = x.at_step;
    y.current_value = x.current_value;
    y.slope_per_kstep = x.slope_per_kstep;
    y.fit_samples = x.fit_samples;
    y.fit_span_steps = x.fit_span_steps;
  }
  f.slope_changes.resize(a.slope_changes.size());
  for (size_t i = 0; i < a.slope_changes.size(); ++i) {
    const runs::SlopeChangeInfo& x = a.slope_changes[i];
    alerts::SlopeChangeFact& y = f.slope_changes[i];
    y.key = x.key;
    y.event_step = x.change.event_step;
    y.event_text = x.event_text;
    y.ratio = x.change.ratio;
    y.before_per_kstep = x.change.before.slope_per_kstep();
    y.after_per_kstep = x.change.after.slope_per_kstep();
    y.after_samples = x.after_samples;
    y.before_stderr_per_kstep = x.change.before_stderr_per_kstep;
    y.after_stderr_per_kstep = x.change.after_stderr_per_kstep;
  }
  f.change_points.resize(a.change_points.size());
  for (size_t i = 0; i < a.change_points.size(); ++i) {
    const runs::ChangePointInfo& x = a.change_points[i];
    alerts::ChangePointFact& y = f.change_points[i];
    y.key = x.key;
    y.step = x.change.step;
    y.ratio = x.change.ratio;
    y.before_per_kstep = x.change.slope_before_per_kstep;
    y.after_per_kstep = x.change.slope_after_per_kstep;
    y.z_score = x.change.z_score;
  }
  // The same shares as the step before, in the same order (the analytics list them in catalog
  // order): facts that already hold them take the figures alone, without copying a name a
  // parameter a step.
  bool same_shares = shares_layout_id_ != 0 && share_sources_.size() == a.shares.size();
  for (size_t i = 0; same_shares && i < a.shares.size(); ++i) same_shares = share_sources_[i] == a.shares[i].source;
  if (!same_shares) {
    ++shares_layout_id_;
    share_sources_.clear();
    for (const runs::ShareInfo& x : a.shares) share_sources_.push_back(x.source);
  }
  const bool names_held = f.shares_layout == shares_layout_id_ && f.shares.size() == a.shares.size();
  f.shares.resize(a.shares.size());
  for (size_t i = 0; i < a.shares.size(); ++i) {
    const runs::ShareInfo& x = a.shares[i];
    alerts::ShareFact& y = f.shares[i];
    if (!names_held) y.name = x.name;
    y.is_group = x.is_group;
    y.share = x.share;
    y.slope_per_kstep = x.slope_per_kstep;
    y.kind = x.kind;
    y.earlier_share = x.earlier_share;
    y.earlier_first_step = x.earlier_first_step;
    y.earlier_last_step = x.earlier_last_step;
    y.trend_samples = x.trend_samples;
  }
  f.shares_layout = shares_layout_id_;
  // A run's catalog grows, and its entries change only by a catalog change (counted in
  // meta.catalog_changes), and these facts are always this run's: entries filled at an earlier
  // step keep their info, so only new ones are copied (each holds a name and a group, two strings a
  // parameter a step otherwise), all of them after a change.
  const std::vector<ParamInfo>& catalog = p.meta.params;
  const size_t filled = f.catalog_changes == p.meta.catalog_changes ? std::min(f.params.size(), catalog.size()) : 0;
  f.catalog_changes = p.meta.catalog_changes;
  f.params.resize(catalog.size());
  for (size_t i = filled; i < catalog.size(); ++i) f.params[i].info = catalog[i];
  for (size_t i = 0; i < catalog.size(); ++i) {
    alerts::ParamFact& pf = f.params[i];
    const auto value_of = [&](NormField field) -> std::optional<double> {
      const SeriesId id = i < p.param_series.size() ? p.param_series[i][static_cast<int>(field)] : kNoSeries;
      if (id == kNoSeries || id >= value_stamp_.size() || value_stamp_[id] != value_epoch_) return std::nullopt;
      return value_by_id_[id];
    };
    pf.norm = value_of(NormField::kParam);
    pf.grad_norm = value_of(NormField::kGrad);
    pf.update_norm = value_of(NormField::kUpdate);
    static const runs::ParamAnalysis kNone;
    const runs::ParamAnalysis& pa = i < params_.size() ? params_[i] : kNone;
    pf.init_norm = pa.init_norm;
    pf.amplification = pa.amplification;
    if (!pf.norm && pa.amplification) pf.norm = pa.norm;
    pf.growth_factor.reset();
    pf.growth_slope_per_kstep.reset();
    if (pa.growth) {
      pf.growth_factor = pa.growth->growth_factor;
      pf.growth_slope_per_kstep = pa.growth->slope_per_kstep;
    }
    pf.norm_slope_per_kstep = pa.norm_slope_per_kstep;
    pf.radial_per_step = pa.radial_per_step;
  }
  f.config.z_loss_coef = p.meta.config.z_loss_coef;
  f.config.weight_decay = p.meta.config.weight_decay;
  f.config.warmup_steps = p.meta.config.warmup_steps;
  f.config.total_steps = p.meta.config.total_steps;
  schedule_problem_.clear();  // the run said what was wrong at its creation
  f.config.schedule = analytics::LearningRateSchedule::FromConfig(p.meta.config.warmup_steps, p.meta.config.total_steps,
                                                                  p.meta.config.extra, &schedule_problem_);
  f.learning_rate = learning_rate_.fact();
  f.warmup = alerts::JudgeWarmup(step.step, f.learning_rate, f.config.warmup_steps,
                                 min_steps_before_page_ ? min_steps_before_page_->load(std::memory_order_relaxed)
                                                        : alerts::kDefaultMinStepsBeforePage);
  f.rewind = rewind_;
  f.projection_steps = p.analytics.projection_steps();
  f.remediations.resize(a.remediations.size());
  for (size_t i = 0; i < a.remediations.size(); ++i) {
    const runs::RemediationInfo& x = a.remediations[i];
    alerts::RemediationFact& y = f.remediations[i];
    y.param = x.param;  // keeps the slot's buffer
    y.step = x.step;
    y.weight_decay = x.weight_decay;
    y.previous_weight_decay = x.previous_weight_decay;
    y.norm_at_step = x.norm_at_step;
    y.projected_norm = x.projected_norm;
    y.unchanged_norm = x.unchanged_norm;
    y.actual_norm = x.actual_norm;
    y.time_constant_steps = x.time_constant_steps;
  }

  // The diagnosis names the top contributors with how their shares move: their share trends are
  // fitted from the next step on (marks are only ever added; a handful over a run's life).
  top_shares_.clear();
  for (const runs::ShareInfo& x : a.shares) {
    if (!x.is_group && std::isfinite(x.share)) top_shares_.emplace_back(x.share, static_cast<uint32_t>(x.source));
  }
  const size_t top = std::min<size_t>(3, top_shares_.size());
  std::partial_sort(top_shares_.begin(), top_shares_.begin() + static_cast<std::ptrdiff_t>(top), top_shares_.end(),
                    [](const auto& x, const auto& y) { return x.first > y.first; });
  for (size_t i = 0; i < top; ++i) {
    const uint32_t index = top_shares_[i].second;
    if (index >= fits_.share.size()) fits_.share.resize(index + 1, 0);
    fits_.share[index] = 1;
  }
}

}  // namespace gradwatch::daemon

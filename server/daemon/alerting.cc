#include "server/daemon/alerting.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <spdlog/spdlog.h>

#include "alerts/rules.h"
#include "server/core/thread_name.h"
#include "server/runs/run_restore.h"

namespace gradwatch::daemon {

StatusOr<std::vector<alerts::Rule>> LoadConfiguredRules(bool default_rules, const std::vector<std::string>& files,
                                                        double run_died_seconds,
                                                        const std::vector<alerts::RuleOverride>& overrides) {
  auto loaded = alerts::LoadRulesInForce(default_rules, files, overrides);
  if (!loaded.ok()) return loaded.status();
  std::vector<alerts::Rule> rules = std::move(loaded).value();
  for (alerts::Rule& r : rules) {
    if (r.kind == alerts::RuleKind::kRunDied && r.stalled_seconds == 0) r.stalled_seconds = run_died_seconds;
  }
  return rules;
}

namespace {
constexpr auto kRetryFirst = std::chrono::milliseconds(200);
constexpr auto kRetryMax = std::chrono::seconds(10);
}  // namespace

Alerting::Alerting(std::vector<alerts::Rule> rules, uint64_t min_steps_before_page)
    : engine_(std::move(rules)), min_steps_before_page_(min_steps_before_page) {}

Alerting::~Alerting() { Stop(); }

void Alerting::Start(notify::Outbox* store, std::unique_ptr<notify::Dispatcher> dispatcher) {
  store_ = store;
  dispatcher_ = std::move(dispatcher);
  engine_.SetChangeSink([this](alerts::StateChanges changes, const std::vector<alerts::Transition>& transitions) {
    OnChanges(std::move(changes), transitions);
  });
  writer_ = std::thread([this] {
    NameThisThread("gw-alert-store");
    WriterLoop();
  });
}

void Alerting::OnChanges(alerts::StateChanges changes, const std::vector<alerts::Transition>& transitions) {
  Batch batch;
  batch.changes = std::move(changes);
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const alerts::Transition& t : transitions) batch.changes.history.push_back({t.alert, t.from, now});
  if (dispatcher_) {
    for (const alerts::Transition& t : transitions) {
      if (t.notify) batch.notify.push_back(t.alert);
    }
  }
  if (batch.changes.empty() && batch.notify.empty()) return;
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(batch));
    ++queued_batches_;
  }
  cv_.notify_one();
}

bool Alerting::SaveEvaluatedThrough(const std::string& run, uint64_t step, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  {
    std::lock_guard lock(mu_);
    if (stopping_ || !writer_.joinable()) return true;
  }
  // The step was published to the run's feed before its snapshot was copied; the thread that
  // completed it evaluates it as soon as it leaves the run's lock.
  for (;;) {
    const std::optional<uint64_t> evaluated = engine_.EvaluatedThrough(run);
    if (!evaluated || *evaluated >= step) break;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  engine_.FlushProgress();  // queues the progress, if any is not yet queued
  std::unique_lock lock(mu_);
  const uint64_t target = queued_batches_;
  return written_cv_.wait_until(lock, deadline, [&] { return written_batches_ >= target || stopping_; }) &&
         written_batches_ >= target;
}

notify::Status Alerting::Write(const Batch& batch) {
  // Runs on the writer thread: nothing may escape it (a throw would terminate the daemon).
  try {
    if (dispatcher_) return dispatcher_->Record(batch.notify, batch.changes);
    auto written = store_->Write({}, batch.changes);
    return written.ok() ? notify::Status::Ok() : written.status();
  } catch (const std::exception& e) {
    return notify::NotifyError(std::string("writing alert states: ") + e.what());
  }
}

void Alerting::WriterLoop() {
  std::unique_lock lock(mu_);
  std::optional<Batch> carry;  // a batch whose write failed: it goes first, with what followed it
  auto retry_delay = kRetryFirst;
  for (;;) {
    if (!carry && !cv_.wait_for(lock, kProgressInterval, [this] { return stopping_ || !queue_.empty(); })) {
      // Nothing changed that anyone is told of: the progress made meanwhile (a tracker's
      // reports, the evaluated steps) is fetched, through the change sink, and written next.
      lock.unlock();
      engine_.FlushProgress();
      lock.lock();
      continue;
    }
    if (!carry && queue_.empty()) return;  // stopping and drained
    Batch batch = carry ? std::move(*carry) : Batch{};
    carry.reset();
    for (Batch& next : queue_) {
      batch.changes.Merge(std::move(next.changes));
      for (alerts::Alert& a : next.notify) batch.notify.push_back(std::move(a));
    }
    queue_.clear();
    const uint64_t through = queued_batches_;  // the batches merged into this one
    const bool stopping = stopping_;
    lock.unlock();
    const notify::Status written = Write(batch);
    lock.lock();
    if (written.ok()) {
      written_batches_ = through;
      written_cv_.notify_all();
      retry_delay = kRetryFirst;
      continue;
    }
    ++write_failures_;
    if (stopping_ && stopping) {
      spdlog::error("alerts: {} alert state change(s) and {} notification(s) are lost: {}",
                    batch.changes.instances.size() + batch.changes.silences.size(), batch.notify.size(),
                    written.message());
      if (queue_.empty()) return;
      continue;
    }
    spdlog::error("alerts: cannot write alert states and notifications, retrying in {} ms: {}", retry_delay.count(),
                  written.message());
    carry = std::move(batch);
    cv_.wait_for(lock, retry_delay, [this] { return stopping_; });
    retry_delay = std::min<std::chrono::milliseconds>(retry_delay * 2, kRetryMax);
  }
}

void Alerting::Stop() {
  drainer_.Stop();                                  // what the runs queued is evaluated before the progress is kept
  if (writer_.joinable()) engine_.FlushProgress();  // the evaluated steps are kept for the restart
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  written_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  if (dispatcher_) dispatcher_->Stop();
}

Status Alerting::RestoreState(double now) {
  auto saved = store_->LoadState();
  if (!saved.ok()) return Status::IoError("alert store: " + saved.status().message());
  const size_t silences = saved->silences.size();
  Count(engine_.Restore(std::move(saved).value(), now));
  if (engine_.Silences().size() != silences) {
    spdlog::info("alerts: {} silence(s) ended while the daemon was down", silences - engine_.Silences().size());
  }
  return Status::Ok();
}

void Alerting::FinishRestore(const runs::RunRegistry& registry, double now) {
  // A dead run that was still active when the daemon stopped stays dead: it keeps its page.
  std::set<std::string> run_died_rules;
  for (const alerts::Rule& r : engine_.Rules()) {
    if (r.kind == alerts::RuleKind::kRunDied) run_died_rules.insert(r.name);
  }
  for (const alerts::Alert& a : engine_.Active()) {
    auto run = a.labels.find("run");
    if (!run_died_rules.count(a.name) || run == a.labels.end()) continue;
    if (auto held = registry.Find(run->second)) runs::RunRestore(*held).SilentSince(a.starts_at - a.value);
  }
  // Alerts of runs that ended or that the daemon no longer holds resolve, but for the run_died
  // pages of runs that ended without a Goodbye (see AlertEngine::EndRun).
  std::map<std::string, alerts::AlertEngine::RunEnding> gone;
  for (const alerts::Alert& a : engine_.Active()) {
    auto run = a.labels.find("run");
    if (run == a.labels.end()) continue;
    auto held = registry.Find(run->second);
    if (!held) {
      gone[run->second] = alerts::AlertEngine::RunEnding::kLeftMemory;
    } else if (const runs::RunInfo info = held->Info(); info.ended) {
      gone[run->second] =
          info.end.clean() ? alerts::AlertEngine::RunEnding::kGoodbye : alerts::AlertEngine::RunEnding::kWithoutGoodbye;
    }
  }
  for (const auto& [run, how] : gone) Count(engine_.EndRun(run, how, now));
  size_t firing = 0, pending = 0;
  for (const alerts::Alert& a : engine_.Active()) (a.state == alerts::AlertState::kFiring ? firing : pending)++;
  spdlog::info("alerts: restored {} firing and {} pending alert(s) and {} silence(s)", firing, pending,
               engine_.Silences().size());
}

std::vector<notify::ReceiverStats> Alerting::ReceiverStats() const {
  return dispatcher_ ? dispatcher_->Stats() : std::vector<notify::ReceiverStats>{};
}

void Alerting::Count(const std::vector<alerts::Transition>& transitions) {
  for (const alerts::Transition& t : transitions) {
    if (t.to == alerts::AlertState::kFiring && t.from != alerts::AlertState::kFiring) {
      ++firing_;
      auto summary = t.alert.annotations.find("summary");
      spdlog::warn("alert {} firing for run {} at step {}: {}", t.alert.name,
                   t.alert.labels.count("run") ? t.alert.labels.at("run") : "-", t.alert.step,
                   summary != t.alert.annotations.end() ? summary->second : "");
    } else if (t.to == alerts::AlertState::kResolved) {
      ++resolved_;
      spdlog::info("alert {} resolved for run {} at step {}", t.alert.name,
                   t.alert.labels.count("run") ? t.alert.labels.at("run") : "-", t.alert.step);
    }
  }
}

StatusOr<size_t> Alerting::Reload(bool default_rules, const std::vector<std::string>& files, double run_died_seconds,
                                  const std::vector<alerts::RuleOverride>& overrides, double now) {
  auto rules = LoadConfiguredRules(default_rules, files, run_died_seconds, overrides);
  if (!rules.ok()) {
    spdlog::error("rule reload refused, the rules in force are unchanged: {}", rules.status().message());
    return rules.status();
  }
  const size_t count = rules->size();
  Count(engine_.ReplaceRules(std::move(rules).value(), now));
  spdlog::info("rules reloaded: {} rules in force", count);
  return count;
}

std::shared_ptr<runs::RunChannel> Alerting::Open(const RunMeta& meta, bool restored) {
  auto feed = std::make_shared<AlertFeed>(
      meta, restored ? engine_.EvaluatedThrough(meta.run_id) : std::nullopt, engine_,
      [this](std::vector<alerts::Transition> transitions, bool to_trainers) {
        Handle(std::move(transitions), to_trainers);
      },
      &min_steps_before_page_, &drainer_);
  std::lock_guard lock(feeds_mu_);
  feeds_[meta.run_id] = feed;
  return feed;
}

std::optional<alerts::DiagnosisAt> Alerting::DiagnosisOf(const std::string& run) {
  const std::shared_ptr<AlertFeed> feed = FeedOf(run);
  if (!feed) return std::nullopt;
  return feed->Diagnose(engine_.diagnosis_bounds());
}

std::shared_ptr<AlertFeed> Alerting::FeedOf(const std::string& run_id) {
  std::lock_guard lock(feeds_mu_);
  auto it = feeds_.find(run_id);
  return it == feeds_.end() ? nullptr : it->second.lock();
}

void Alerting::Handle(std::vector<alerts::Transition> transitions, bool to_trainers) {
  Count(transitions);
  if (!to_trainers || !trainer_sink_) return;
  for (const alerts::Transition& t : transitions) {
    // The trainer hears of firing and resolved alerts even when a silence mutes the pagers.
    if (t.to == alerts::AlertState::kFiring || t.to == alerts::AlertState::kResolved) trainer_sink_(t.alert);
  }
}

void Alerting::OnRunLeftMemory(const std::string& run_id, double now) {
  Count(engine_.EndRun(run_id, alerts::AlertEngine::RunEnding::kLeftMemory, now));
  std::lock_guard lock(feeds_mu_);
  // A run of the same id created since keeps its feed.
  if (auto it = feeds_.find(run_id); it != feeds_.end() && it->second.expired()) feeds_.erase(it);
}

void Alerting::Tick(const runs::RunRegistry& registry, double now) {
  // Timer rules only for the runs they can change: none without timer rules, and none for runs
  // that said Goodbye (still listed as held, so their alerts are not ended as those of a run
  // not held).
  std::vector<std::string> held;
  const bool timer_rules = engine_.HasTimerRules();
  for (const auto& run : registry.All()) {
    held.push_back(run->id());
    if (!timer_rules) continue;
    const runs::RunActivity activity = run->Activity();
    if (activity.ended_cleanly) continue;
    if (auto feed = FeedOf(run->id())) feed->EvaluateTimer(activity, now);
  }
  Handle(engine_.EndTimers(held, now), /*to_trainers=*/true);
  {
    std::lock_guard lock(feeds_mu_);
    std::erase_if(feeds_, [](const auto& entry) { return entry.second.expired(); });
  }
  if (dispatcher_) {
    // Alertmanager forgets alerts that are not re-sent before their endsAt.
    std::vector<alerts::Alert> active;
    for (alerts::Alert& a : engine_.Active()) {
      if (a.state == alerts::AlertState::kFiring && !engine_.IsMuted(a, now)) active.push_back(std::move(a));
    }
    if (notify::Status s = dispatcher_->Refresh(active, now); !s.ok()) {
      spdlog::error("alerts: re-sending firing alerts: {}", s.message());
    }
  }
}

}  // namespace gradwatch::daemon

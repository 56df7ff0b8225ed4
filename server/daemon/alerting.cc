#include "server/daemon/alerting.h"

#include <set>

#include <spdlog/spdlog.h>

#include "alerts/rules.h"

namespace gradwatch::daemon {

StatusOr<std::vector<alerts::Rule>> LoadConfiguredRules(bool default_rules, const std::vector<std::string>& files) {
  std::vector<alerts::Rule> rules;
  if (default_rules) {
    auto defaults = alerts::LoadDefaultRules();
    if (!defaults.ok()) return Status(defaults.status().code(), "built-in rules: " + defaults.status().message());
    rules = std::move(defaults).value();
  }
  if (!files.empty()) {
    auto loaded = alerts::LoadRuleFiles(files);
    if (!loaded.ok()) return loaded.status();
    std::set<std::string> names;
    for (const alerts::Rule& r : rules) names.insert(r.name);
    for (alerts::Rule& r : loaded.value()) {
      if (!names.insert(r.name).second) {
        return Status::InvalidArgument(r.source + ": rule '" + r.name +
                                       "' has the name of a built-in rule; rename it or set alerts.default_rules: false");
      }
      rules.push_back(std::move(r));
    }
  }
  return rules;
}

Alerting::Alerting(std::vector<alerts::Rule> rules) : engine_(std::move(rules)) {}

Alerting::~Alerting() { Stop(); }

void Alerting::StartNotifying(std::unique_ptr<notify::Dispatcher> dispatcher) {
  dispatcher_ = std::move(dispatcher);
  notifier_ = std::thread([this] { NotifyLoop(); });
}

void Alerting::NotifyLoop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !to_notify_.empty(); });
    if (to_notify_.empty()) return;  // stopping and drained
    alerts::Alert alert = std::move(to_notify_.front());
    to_notify_.pop_front();
    lock.unlock();
    if (notify::Status s = dispatcher_->Enqueue(alert); !s.ok()) {
      spdlog::error("alert {}: cannot queue its notification: {}", alert.name, s.message());
    }
    lock.lock();
  }
}

void Alerting::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (notifier_.joinable()) notifier_.join();
  if (dispatcher_) dispatcher_->Stop();
}

std::vector<notify::ReceiverStats> Alerting::ReceiverStats() const {
  return dispatcher_ ? dispatcher_->Stats() : std::vector<notify::ReceiverStats>{};
}

void Alerting::Count(const std::vector<alerts::Transition>& transitions) {
  if (dispatcher_) {
    std::lock_guard lock(mu_);
    for (const alerts::Transition& t : transitions) {
      if (t.notify && !stopping_) to_notify_.push_back(t.alert);
    }
  }
  cv_.notify_one();
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

StatusOr<size_t> Alerting::Reload(bool default_rules, const std::vector<std::string>& files, double now) {
  auto rules = LoadConfiguredRules(default_rules, files);
  if (!rules.ok()) {
    spdlog::error("rule reload refused, the rules in force are unchanged: {}", rules.status().message());
    return rules.status();
  }
  const size_t count = rules->size();
  Count(engine_.ReplaceRules(std::move(rules).value(), now));
  spdlog::info("rules reloaded: {} rules in force", count);
  return count;
}

std::vector<alerts::Transition> Alerting::OnStep(const alerts::RunFacts& facts) {
  std::vector<alerts::Transition> transitions = engine_.EvaluateStep(facts, facts.now);
  Count(transitions);
  return transitions;
}

void Alerting::Tick(const runs::RunRegistry& registry, double now) {
  std::vector<alerts::RunFacts> facts;
  const auto runs = registry.All();
  facts.reserve(runs.size());
  for (const auto& run : runs) facts.push_back(run->Facts());
  const std::vector<alerts::Transition> transitions = engine_.EvaluateTimer(facts, now);
  Count(transitions);
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
  for (const alerts::Transition& t : transitions) {
    if (t.to != alerts::AlertState::kFiring && t.to != alerts::AlertState::kResolved) continue;
    auto run = t.alert.labels.find("run");
    if (run == t.alert.labels.end()) continue;
    if (auto r = registry.Find(run->second)) r->BroadcastAlert(t.alert);
  }
}

}  // namespace gradwatch::daemon

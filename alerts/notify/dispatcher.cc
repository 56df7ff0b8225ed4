#include "alerts/notify/dispatcher.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <thread>

#include "alerts/notify/payloads.h"

namespace gradwatch::notify {

using alerts::AlertState;

std::chrono::duration<double> BackoffDelay(const BackoffOptions& options, uint32_t attempts, double random01) {
  const double initial = std::chrono::duration<double>(options.initial).count();
  const double max = std::chrono::duration<double>(options.max).count();
  const double exponent = attempts > 0 ? static_cast<double>(attempts - 1) : 0.0;
  double delay = initial * std::pow(std::max(options.multiplier, 1.0), exponent);
  if (!std::isfinite(delay) || delay > max) delay = max;
  const double jitter = std::clamp(options.jitter, 0.0, 1.0);
  delay *= 1.0 - jitter * std::clamp(random01, 0.0, 1.0);
  return std::chrono::duration<double>(std::max(delay, 0.0));
}

struct Dispatcher::Worker {
  size_t index = 0;
  std::unique_ptr<Receiver> receiver;
  std::unique_ptr<HttpClient> http;
  std::thread thread;
  std::mt19937_64 rng{std::random_device{}()};

  // Lock order: Dispatcher::mu_, then mu, then error_mu.
  Mutex mu;
  CondVar cv;  // with mu
  bool wake GUARDED_BY(mu) = false;
  bool stop GUARDED_BY(mu) = false;
  std::atomic<bool> stopping{false};

  std::atomic<uint64_t> sent{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> failures{0};
  std::atomic<uint64_t> queue_depth{0};
  mutable Mutex error_mu;
  std::string last_error GUARDED_BY(error_mu);

  void Wake() EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      wake = true;
    }
    cv.Signal();
  }
  void SetLastError(std::string error) EXCLUDES(error_mu) {
    MutexLock lock(&error_mu);
    last_error = std::move(error);
  }
};

namespace {

std::string Describe(const HttpResult& result) {
  if (result.has_response()) {
    std::string body = result.body.substr(0, 200);
    std::replace(body.begin(), body.end(), '\n', ' ');
    return "HTTP " + std::to_string(result.status) + (body.empty() ? "" : ": " + body);
  }
  return std::string(HttpErrorName(result.error)) + ": " + result.message;
}

bool IsNotified(AlertState state) { return state == AlertState::kFiring || state == AlertState::kResolved; }

}  // namespace

Dispatcher::Dispatcher(Outbox& outbox, std::vector<std::unique_ptr<Receiver>> receivers, DispatcherOptions options)
    : outbox_(outbox), options_(std::move(options)) {
  if (options_.clock == nullptr) options_.clock = SystemClock::Default();
  if (options_.batch_limit == 0) options_.batch_limit = 1;
  for (auto& receiver : receivers) {
    auto worker = std::make_unique<Worker>();
    worker->index = workers_.size();
    worker->receiver = std::move(receiver);
    workers_.push_back(std::move(worker));
  }
}

Dispatcher::~Dispatcher() { Stop(); }

double Dispatcher::Now() const { return options_.clock->UnixSeconds(); }

Status Dispatcher::Start() {
  MutexLock lock(&mu_);
  if (started_ || stopped_) return NotifyError("dispatcher: already started or stopped");
  std::set<std::string> names;
  for (auto& worker : workers_) {
    const Receiver& receiver = *worker->receiver;
    if (receiver.name().empty()) return NotifyError("dispatcher: a receiver has no name");
    if (!names.insert(receiver.name()).second) {
      return NotifyError("dispatcher: duplicate receiver name '" + receiver.name() + "'");
    }
    auto url = ParseUrl(receiver.config().url);
    if (!url.ok()) {
      return NotifyError("receiver " + receiver.name() + ": " + url.status().message());
    }
    auto http = HttpClient::Create(receiver.config().http);
    if (!http.ok()) {
      return NotifyError("receiver " + receiver.name() + ": " + http.status().message());
    }
    worker->http = std::move(http).value();
  }
  started_ = true;
  for (auto& worker : workers_) {
    Worker* w = worker.get();
    w->thread = std::thread([this, w] { RunWorker(*w); });
  }
  return Status::Ok();
}

void Dispatcher::Stop() {
  {
    MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  for (auto& worker : workers_) {
    worker->stopping = true;
    {
      MutexLock lock(&worker->mu);
      worker->stop = true;
    }
    worker->cv.Signal();
    if (worker->http) worker->http->Abort();
  }
  for (auto& worker : workers_) {
    if (worker->thread.joinable()) worker->thread.join();
  }
}

void Dispatcher::Wake() {
  for (auto& worker : workers_) worker->Wake();
}

Status Dispatcher::Record(const std::vector<Alert>& alerts, const alerts::StateChanges& states) {
  const double now = Now();
  std::vector<OutboxEntry> entries;
  struct Target {
    size_t alert;
    size_t worker;
    std::string fingerprint;
  };
  std::vector<Target> targets;
  for (size_t a = 0; a < alerts.size(); ++a) {
    const Alert& alert = alerts[a];
    if (!IsNotified(alert.state)) continue;
    const std::string fingerprint = NotifiedFingerprint(alert);
    const std::string payload = AlertToJson(alert);
    for (const auto& worker : workers_) {
      if (!worker->receiver->Accepts(alert)) continue;
      OutboxEntry entry;
      entry.receiver = worker->receiver->name();
      entry.fingerprint = fingerprint;
      entry.state = alert.state;
      entry.payload = payload;
      entry.created_at = now;
      entry.next_attempt_at = now;
      entries.push_back(std::move(entry));
      targets.push_back({a, worker->index, fingerprint});
    }
  }
  if (entries.empty() && states.empty()) return Status::Ok();

  MutexLock lock(&mu_);
  auto ids = outbox_.Write(std::move(entries), states);
  if (!ids.ok()) return ids.status();
  for (size_t i = 0; i < targets.size(); ++i) {
    const Alert& alert = alerts[targets[i].alert];
    FingerprintRecord& record = records_[targets[i].fingerprint];
    if (alert.state == AlertState::kResolved) {
      record.resolved_ends_at = alert.ends_at > 0 ? alert.ends_at : now;
    }
    Worker& worker = *workers_[targets[i].worker];
    if (worker.receiver->resend_interval_seconds() > 0) {
      if (alert.state == AlertState::kFiring) {
        record.receivers[worker.index] = ResendState{ids.value()[i], false, 0};
      } else {
        record.receivers.erase(worker.index);
      }
    }
    ++worker.queue_depth;
    worker.Wake();
    if (record.receivers.empty() && record.resolved_ends_at == 0) records_.erase(targets[i].fingerprint);
  }
  return Status::Ok();
}

Status Dispatcher::Refresh(const std::vector<Alert>& active, double now) {
  MutexLock lock(&mu_);
  std::set<std::string> active_fingerprints;
  std::vector<OutboxEntry> entries;
  struct Target {
    size_t worker;
    std::string fingerprint;
  };
  std::vector<Target> targets;
  for (const Alert& alert : active) {
    if (alert.state != AlertState::kFiring) continue;
    const std::string fingerprint = NotifiedFingerprint(alert);
    if (!active_fingerprints.insert(fingerprint).second) continue;
    auto found = records_.find(fingerprint);
    if (found != records_.end() && found->second.resolved_ends_at > 0 &&
        alert.starts_at <= found->second.resolved_ends_at) {
      continue;  // resolved since this snapshot was taken
    }
    std::string payload;
    for (const auto& worker : workers_) {
      const double interval = worker->receiver->resend_interval_seconds();
      if (interval <= 0 || !worker->receiver->Accepts(alert)) continue;
      if (found != records_.end()) {
        auto state = found->second.receivers.find(worker->index);
        if (state != found->second.receivers.end()) {
          if (!state->second.settled) continue;  // still in the outbox
          if (now - state->second.settled_at < interval) continue;
        }
      }
      if (payload.empty()) payload = AlertToJson(alert);
      OutboxEntry entry;
      entry.receiver = worker->receiver->name();
      entry.fingerprint = fingerprint;
      entry.state = AlertState::kFiring;
      entry.payload = payload;
      entry.created_at = now;
      entry.next_attempt_at = now;
      entries.push_back(std::move(entry));
      targets.push_back({worker->index, fingerprint});
    }
  }
  // Forget fingerprints no longer firing once nothing of theirs waits for settlement.
  for (auto it = records_.begin(); it != records_.end();) {
    const bool unsettled = std::any_of(it->second.receivers.begin(), it->second.receivers.end(),
                                       [](const auto& r) { return !r.second.settled; });
    it = (!active_fingerprints.count(it->first) && !unsettled) ? records_.erase(it) : std::next(it);
  }
  if (entries.empty()) return Status::Ok();
  auto ids = outbox_.Add(std::move(entries));
  if (!ids.ok()) return ids.status();
  for (size_t i = 0; i < targets.size(); ++i) {
    records_[targets[i].fingerprint].receivers[targets[i].worker] = ResendState{ids.value()[i], false, 0};
    Worker& worker = *workers_[targets[i].worker];
    ++worker.queue_depth;
    worker.Wake();
  }
  return Status::Ok();
}

void Dispatcher::OnSettled(size_t receiver, const std::string& fingerprint, uint64_t id, double now) {
  MutexLock lock(&mu_);
  auto record = records_.find(fingerprint);
  if (record == records_.end()) return;
  auto state = record->second.receivers.find(receiver);
  if (state == record->second.receivers.end() || state->second.entry_id != id) return;
  state->second.settled = true;
  state->second.settled_at = now;
}

std::vector<ReceiverStats> Dispatcher::Stats() const {
  std::vector<ReceiverStats> stats;
  stats.reserve(workers_.size());
  for (const auto& worker : workers_) {
    ReceiverStats s;
    s.receiver = worker->receiver->name();
    s.sent = worker->sent.load();
    s.retries = worker->retries.load();
    s.failures = worker->failures.load();
    s.queue_depth = worker->queue_depth.load();
    {
      MutexLock lock(&worker->error_mu);
      s.last_error = worker->last_error;
    }
    stats.push_back(std::move(s));
  }
  return stats;
}

void Dispatcher::RunWorker(Worker& worker) {
  while (true) {
    {
      MutexLock lock(&worker.mu);
      if (worker.stop) return;
      worker.wake = false;
    }
    double wait_seconds = 0;
    try {
      wait_seconds = RunPass(worker);
    } catch (const std::exception& e) {
      // Nothing may escape a thread; the entry stays pending and is tried again.
      spdlog::error("notify {}: delivery pass failed: {}", worker.receiver->name(), e.what());
      wait_seconds = std::chrono::duration<double>(options_.idle_poll).count();
    }
    if (wait_seconds <= 0) continue;
    const auto idle = std::chrono::duration<double>(options_.idle_poll);
    const auto wait = std::min(std::chrono::duration<double>(wait_seconds), idle);
    using Steady = std::chrono::steady_clock;
    const auto deadline = Steady::now() + std::chrono::duration_cast<Steady::duration>(wait);
    MutexLock lock(&worker.mu);
    while (!worker.stop && !worker.wake) {
      if (!worker.cv.WaitUntil(&worker.mu, deadline)) break;
    }
  }
}

double Dispatcher::RunPass(Worker& worker) {
  const double idle = std::chrono::duration<double>(options_.idle_poll).count();
  Receiver& receiver = *worker.receiver;
  auto pending = outbox_.Pending(receiver.name(), options_.batch_limit, Now());
  if (!pending.ok()) {
    spdlog::warn("notify {}: cannot read the outbox: {}", receiver.name(), pending.status().message());
    return idle;
  }
  if (auto count = outbox_.PendingCount(receiver.name()); count.ok()) {
    worker.queue_depth = count.value();
  }

  std::set<std::string> held;  // fingerprints with an earlier entry not yet delivered
  double next_due = std::numeric_limits<double>::infinity();
  bool progressed = false;
  double now = Now();
  auto settle = [&](const OutboxEntry& entry, Status marked) {
    if (!marked.ok()) {
      spdlog::warn("notify {}: outbox entry {}: {}", receiver.name(), entry.id, marked.message());
      return false;
    }
    if (worker.queue_depth > 0) --worker.queue_depth;
    OnSettled(worker.index, entry.fingerprint, entry.id, now);
    progressed = true;
    return true;
  };

  for (const OutboxEntry& entry : pending.value()) {
    if (worker.stopping) return 0;
    if (held.count(entry.fingerprint)) continue;
    if (entry.next_attempt_at > now) {
      held.insert(entry.fingerprint);
      next_due = std::min(next_due, entry.next_attempt_at);
      continue;
    }
    auto alert = AlertFromJson(entry.payload);
    if (!alert.ok()) {
      worker.SetLastError(alert.status().message());
      spdlog::error("notify {}: dropping outbox entry {} (fingerprint {}): {}", receiver.name(), entry.id,
                    entry.fingerprint, alert.status().message());
      if (!settle(entry, outbox_.MarkFailed(entry.id, alert.status().message()))) return idle;
      ++worker.failures;
      continue;
    }
    HttpRequest request = receiver.Build({alert.value()}, entry.state, now);
    // The same on every attempt, and after a restart: a receiver that got the request but whose
    // answer the daemon never saw (a crash, a timeout) can tell the repeat from a new change.
    request.headers.emplace_back(std::string(kIdempotencyHeader), IdempotencyKey(entry.id));
    const HttpResult result = worker.http->Send(request);
    if (result.error == HttpResult::Error::kAborted) return 0;  // stopping; the entry stays
    now = Now();
    const Outcome outcome = receiver.Classify(result);
    const uint32_t attempts = entry.attempts + 1;
    const std::string state_name(alerts::AlertStateName(entry.state));

    if (outcome == Outcome::kDelivered) {
      spdlog::debug("notify {}: delivered {} {} (entry {}, attempt {})", receiver.name(), state_name, entry.fingerprint,
                    entry.id, attempts);
      if (!settle(entry, outbox_.MarkDelivered(entry.id))) return idle;
      ++worker.sent;  // counted once settled, so that a reader of Stats() sees a settled entry
      continue;
    }
    const std::string error = Describe(result);
    worker.SetLastError(error);
    const bool expired = options_.give_up_after_seconds > 0 && now - entry.created_at >= options_.give_up_after_seconds;
    if (outcome == Outcome::kPermanentFailure || expired) {
      const std::string reason = outcome == Outcome::kPermanentFailure
                                     ? error
                                     : "gave up after " + std::to_string(attempts) + " attempts: " + error;
      spdlog::error("notify {}: dropping {} {} (entry {}): {}", receiver.name(), state_name, entry.fingerprint,
                    entry.id, reason);
      if (!settle(entry, outbox_.MarkFailed(entry.id, reason))) return idle;
      ++worker.failures;
      continue;
    }

    ++worker.retries;
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const double delay = BackoffDelay(options_.backoff, attempts, uniform(worker.rng)).count();
    const double next_at = now + delay;
    spdlog::warn("notify {}: {} {} (entry {}) attempt {} failed, retrying in {:.3f} s: {}", receiver.name(), state_name,
                 entry.fingerprint, entry.id, attempts, delay, error);
    Status marked = outbox_.MarkRetry(entry.id, next_at, attempts, error);
    if (!marked.ok()) {
      spdlog::warn("notify {}: outbox entry {}: {}", receiver.name(), entry.id, marked.message());
      return idle;
    }
    held.insert(entry.fingerprint);
    next_due = std::min(next_due, next_at);
    // Unreachable or rate-limited: the other entries would fare no better now, so end the pass.
    // A 5xx may concern this request only, so the other fingerprints go on.
    if (!result.has_response() || result.status == 429) return next_due - now;
  }
  if (progressed) return 0;  // look again at once: more entries may be due beyond this batch
  return next_due - now;     // +inf when nothing waits: sleep until woken or idle_poll
}

}  // namespace gradwatch::notify

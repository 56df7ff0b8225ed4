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
#include "server/core/thread_name.h"

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

  // Entries Record and Refresh wrote to the outbox, handed over with their alerts so that a worker
  // with nothing older pending sends them without reading them back. Everything here is in the
  // outbox already: a worker that reads the outbox drops what is here. Bounded by batch_limit;
  // beyond it the entries are dropped and `overflowed` set, and the outbox is read instead.
  std::vector<Handed> handed GUARDED_BY(mu);
  bool overflowed GUARDED_BY(mu) = false;
  // The worker thread's own: whether the outbox may hold entries not yet settled that it has not
  // been handed (true at start, and while a retry waits); the newest entry id it read from there.
  bool backlog = true;
  uint64_t read_through_id = 0;

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
  void Hand(Handed entry, size_t limit) EXCLUDES(mu) {
    {
      MutexLock lock(&mu);
      if (handed.size() < limit) {
        handed.push_back(std::move(entry));
      } else {
        overflowed = true;
      }
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
    w->thread = std::thread([this, w] {
      NameThisThread("gw-notify");
      RunWorker(*w);
    });
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
    worker.Hand({HandedEntry(ids.value()[i], *worker.receiver, targets[i].fingerprint, alert.state, now), alert},
                options_.batch_limit);
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
    const Alert* alert;
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
      targets.push_back({worker->index, &alert, fingerprint});
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
    worker.Hand({HandedEntry(ids.value()[i], *worker.receiver, targets[i].fingerprint, AlertState::kFiring, now),
                 *targets[i].alert},
                options_.batch_limit);
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

OutboxEntry Dispatcher::HandedEntry(uint64_t id, const Receiver& receiver, const std::string& fingerprint,
                                    AlertState state, double now) {
  OutboxEntry entry;
  entry.id = id;
  entry.receiver = receiver.name();
  entry.fingerprint = fingerprint;
  entry.state = state;
  entry.created_at = now;
  entry.next_attempt_at = now;
  return entry;
}

double Dispatcher::RunPass(Worker& worker) {
  std::vector<Handed> handed;
  bool overflowed = false;
  {
    MutexLock lock(&worker.mu);
    handed.swap(worker.handed);
    std::swap(overflowed, worker.overflowed);
  }
  if (overflowed) worker.backlog = true;
  // What was handed over is in the outbox: a pass that reads it needs none of it.
  if (worker.backlog || handed.empty()) return OutboxPass(worker);
  return HandedPass(worker, handed);
}

double Dispatcher::HandedPass(Worker& worker, std::vector<Handed>& handed) {
  double now = Now();
  for (const Handed& h : handed) {
    if (worker.stopping) return 0;
    // Already read from the outbox by an earlier pass (ids increase in the order written).
    if (h.entry.id <= worker.read_through_id) continue;
    double next_at = 0;
    const Attempt attempt = Deliver(worker, h.entry, h.alert, &now, &next_at);
    if (attempt == Attempt::kSettled) continue;
    if (attempt == Attempt::kAborted) return 0;
    // A retry now waits in the outbox, and later entries of its fingerprint must wait behind it:
    // from here on the outbox decides, the rest of what was handed over included.
    worker.backlog = true;
    if (attempt == Attempt::kNotMarked) return std::chrono::duration<double>(options_.idle_poll).count();
    return 0;
  }
  return std::numeric_limits<double>::infinity();
}

double Dispatcher::OutboxPass(Worker& worker) {
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
  // Once the outbox holds nothing pending, entries handed over from now on are the oldest.
  worker.backlog = !pending.value().empty();
  for (const OutboxEntry& entry : pending.value()) worker.read_through_id = std::max(worker.read_through_id, entry.id);

  std::set<std::string> held;  // fingerprints with an earlier entry not yet delivered
  double next_due = std::numeric_limits<double>::infinity();
  bool progressed = false;
  double now = Now();
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
      if (!Settle(worker, entry, outbox_.MarkFailed(entry.id, alert.status().message()), now)) return idle;
      ++worker.failures;
      progressed = true;
      continue;
    }
    double next_at = 0;
    switch (Deliver(worker, entry, alert.value(), &now, &next_at)) {
      case Attempt::kSettled: progressed = true; continue;
      case Attempt::kAborted: return 0;
      case Attempt::kNotMarked: return idle;
      case Attempt::kRetry:
        held.insert(entry.fingerprint);
        next_due = std::min(next_due, next_at);
        continue;
      case Attempt::kRetryLater: return std::min(next_due, next_at) - now;
    }
  }
  if (progressed) return 0;  // look again at once: more entries may be due beyond this batch
  return next_due - now;     // +inf when nothing waits: sleep until woken or idle_poll
}

bool Dispatcher::Settle(Worker& worker, const OutboxEntry& entry, const Status& marked, double now) {
  if (!marked.ok()) {
    spdlog::warn("notify {}: outbox entry {}: {}", worker.receiver->name(), entry.id, marked.message());
    return false;
  }
  if (worker.queue_depth > 0) --worker.queue_depth;
  OnSettled(worker.index, entry.fingerprint, entry.id, now);
  return true;
}

Dispatcher::Attempt Dispatcher::Deliver(Worker& worker, const OutboxEntry& entry, const Alert& alert, double* now,
                                        double* next_at) {
  Receiver& receiver = *worker.receiver;
  HttpRequest request = receiver.Build({alert}, entry.state, *now);
  // The same on every attempt, and after a restart: a receiver that got the request but whose
  // answer the daemon never saw (a crash, a timeout) can tell the repeat from a new change.
  request.headers.emplace_back(std::string(kIdempotencyHeader), IdempotencyKey(entry.id));
  const HttpResult result = worker.http->Send(request);
  if (result.error == HttpResult::Error::kAborted) return Attempt::kAborted;  // stopping; the entry stays
  *now = Now();
  const Outcome outcome = receiver.Classify(result);
  const uint32_t attempts = entry.attempts + 1;
  const std::string state_name(alerts::AlertStateName(entry.state));

  if (outcome == Outcome::kDelivered) {
    spdlog::debug("notify {}: delivered {} {} (entry {}, attempt {})", receiver.name(), state_name, entry.fingerprint,
                  entry.id, attempts);
    if (!Settle(worker, entry, outbox_.MarkDelivered(entry.id), *now)) return Attempt::kNotMarked;
    ++worker.sent;  // counted once settled, so that a reader of Stats() sees a settled entry
    return Attempt::kSettled;
  }
  const std::string error = Describe(result);
  worker.SetLastError(error);
  const bool expired = options_.give_up_after_seconds > 0 && *now - entry.created_at >= options_.give_up_after_seconds;
  if (outcome == Outcome::kPermanentFailure || expired) {
    const std::string reason = outcome == Outcome::kPermanentFailure
                                   ? error
                                   : "gave up after " + std::to_string(attempts) + " attempts: " + error;
    spdlog::error("notify {}: dropping {} {} (entry {}): {}", receiver.name(), state_name, entry.fingerprint, entry.id,
                  reason);
    if (!Settle(worker, entry, outbox_.MarkFailed(entry.id, reason), *now)) return Attempt::kNotMarked;
    ++worker.failures;
    return Attempt::kSettled;
  }

  ++worker.retries;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double delay = BackoffDelay(options_.backoff, attempts, uniform(worker.rng)).count();
  *next_at = *now + delay;
  spdlog::warn("notify {}: {} {} (entry {}) attempt {} failed, retrying in {:.3f} s: {}", receiver.name(), state_name,
               entry.fingerprint, entry.id, attempts, delay, error);
  Status marked = outbox_.MarkRetry(entry.id, *next_at, attempts, error);
  if (!marked.ok()) {
    spdlog::warn("notify {}: outbox entry {}: {}", receiver.name(), entry.id, marked.message());
    return Attempt::kNotMarked;
  }
  // Unreachable or rate-limited: the other entries would fare no better now, so end the pass.
  // A 5xx may concern this request only, so the other fingerprints go on.
  if (!result.has_response() || result.status == 429) return Attempt::kRetryLater;
  return Attempt::kRetry;
}

}  // namespace gradwatch::notify

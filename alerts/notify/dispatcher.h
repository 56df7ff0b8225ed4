// Delivers alert state changes to receivers through the outbox. Enqueue() only writes to the
// outbox and hands each entry written, with its alert, to its receiver's worker; one worker thread
// per receiver does the network I/O, so a slow or dead receiver delays neither the caller nor the
// other receivers. A worker sends what it is handed without reading it back from the outbox while
// nothing older waits there (no retry, no entry from before a restart); otherwise it reads the
// outbox, which holds everything it could be handed.
//
// Delivery is at least once and in order per fingerprint and receiver: an entry that waits for a
// retry holds back the later entries of its fingerprint (entries of other fingerprints go on).
// A request whose answer was lost (a timeout, the daemon killed before it recorded the delivery)
// is sent again; every request carries its outbox entry's key in an Idempotency-Key header, the
// same on every attempt, so a receiver can drop the repeats and see each change once.
// Recoverable failures (see Receiver::Classify) are retried with exponential back-off; permanent
// ones are logged, counted and dropped. Entries pending when a Dispatcher stops are delivered by
// the next one started on the same outbox.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "alerts/notify/outbox.h"
#include "alerts/notify/receivers.h"
#include "alerts/notify/status.h"
#include "server/core/clock.h"
#include "server/core/thread_annotations.h"

namespace gradwatch::notify {

// The header, and its value for outbox entry `id` ("gradwatch-<id>"; ids are unique per data
// directory).
inline constexpr std::string_view kIdempotencyHeader = "Idempotency-Key";
inline std::string IdempotencyKey(uint64_t entry_id) { return "gradwatch-" + std::to_string(entry_id); }

struct BackoffOptions {
  std::chrono::milliseconds initial{500};
  std::chrono::milliseconds max{300'000};
  double multiplier = 2.0;
  // Each delay is shortened by a random fraction of at most `jitter` (0 ≤ jitter ≤ 1), so that
  // receivers coming back are not hit by every retry at once.
  double jitter = 0.2;
};

// The wait after the attempts-th consecutive recoverable failure (attempts ≥ 1):
// min(max, initial × multiplier^(attempts − 1)) × (1 − jitter × random01), random01 in [0, 1).
std::chrono::duration<double> BackoffDelay(const BackoffOptions& options, uint32_t attempts, double random01);

struct DispatcherOptions {
  BackoffOptions backoff;
  // An entry still failing recoverably this long after it was created is given up (logged and
  // counted as a failure). 0: retry for ever.
  double give_up_after_seconds = 24 * 3600;
  // Most entries a worker reads from the outbox per pass.
  size_t batch_limit = 256;
  // Longest a worker sleeps before looking at the outbox again, even when not woken.
  std::chrono::milliseconds idle_poll{1000};
  // Wall time (Clock::UnixSeconds) for created_at, back-off and payload times; the system clock
  // when null. A worker sleeps in real time for the clock's differences; after moving a fake
  // clock, call Wake().
  const Clock* clock = nullptr;
};

// Counters of one receiver, for metrics. Monotonic except queue_depth.
struct ReceiverStats {
  std::string receiver;
  uint64_t sent = 0;         // entries delivered
  uint64_t retries = 0;      // attempts that failed recoverably and were rescheduled
  uint64_t failures = 0;     // entries given up: permanent failures and give_up_after_seconds
  uint64_t queue_depth = 0;  // pending entries in the outbox as of the worker's last look
  std::string last_error;    // of the last failed attempt; empty if none
};

class Dispatcher {
 public:
  // The outbox must outlive the Dispatcher. Receiver names must be unique.
  Dispatcher(Outbox& outbox, std::vector<std::unique_ptr<Receiver>> receivers, DispatcherOptions options = {});
  // Stops (see Stop()).
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // Starts one worker per receiver; they begin with the entries already pending in the outbox.
  // Fails, starting nothing, on duplicate receiver names, a bad URL or unloadable TLS settings.
  // Call once.
  Status Start();

  // Records an alert's state change for every receiver that accepts it. Only kFiring and
  // kResolved are sent; other states are ignored (a pending alert is never notified). Writes to
  // the outbox and returns; never waits for the network. Thread-safe; may be called before
  // Start() (entries wait in the outbox).
  Status Enqueue(const Alert& alert) { return Record({alert}, {}); }
  // Enqueue for several alerts, in order, and the engine's state changes that produced them, all
  // in one outbox write (Outbox::Write).
  Status Record(const std::vector<Alert>& alerts, const alerts::StateChanges& states);

  // Called periodically with every alert currently firing: for receivers with a resend interval
  // (Alertmanager), re-sends each firing alert whose last notification was delivered at least an
  // interval before now (the timer's time, from the same clock; new entries are due at now). An
  // alert whose earlier notification is still in the outbox is skipped (it is rendered with a
  // fresh endsAt when sent), and so is an alert this dispatcher has seen resolve after it started
  // (a stale snapshot). Thread-safe.
  Status Refresh(const std::vector<Alert>& active, double now);

  // A snapshot, one element per receiver in construction order. Thread-safe.
  std::vector<ReceiverStats> Stats() const;

  // Makes every worker look at the outbox now.
  void Wake();

  // Aborts requests in flight (their entries stay pending, so they may be delivered twice) and
  // joins the workers. Idempotent. Enqueue() still writes to the outbox afterwards.
  void Stop();

 private:
  struct Worker;
  // An entry as written to the outbox (without its payload) and the alert it carries.
  struct Handed {
    OutboxEntry entry;
    Alert alert;
  };
  // Per receiver: the latest firing entry enqueued for a fingerprint and when it was settled.
  struct ResendState {
    uint64_t entry_id = 0;
    bool settled = false;
    double settled_at = 0;
  };
  struct FingerprintRecord {
    double resolved_ends_at = 0;              // of the last resolved notification; 0 if none
    std::map<size_t, ResendState> receivers;  // by receiver index
  };

  void RunWorker(Worker& worker) EXCLUDES(mu_);
  // One pass, each returning the seconds until the next entry is due (may be +inf): the entries
  // handed over, when nothing older waits in the outbox; else the outbox's pending entries.
  double RunPass(Worker& worker) EXCLUDES(mu_);
  double HandedPass(Worker& worker, std::vector<Handed>& handed) EXCLUDES(mu_);
  double OutboxPass(Worker& worker) EXCLUDES(mu_);
  // One attempt at an entry, and what it settled.
  enum class Attempt {
    kSettled,     // delivered or given up, and marked so
    kRetry,       // marked for a retry at *next_at; the pass goes on with other fingerprints
    kRetryLater,  // marked for a retry at *next_at; the receiver is unreachable, the pass ends
    kAborted,     // Stop() aborted it; the entry stays pending
    kNotMarked,   // the outcome could not be written to the outbox
  };
  Attempt Deliver(Worker& worker, const OutboxEntry& entry, const Alert& alert, double* now, double* next_at)
      EXCLUDES(mu_);
  bool Settle(Worker& worker, const OutboxEntry& entry, const Status& marked, double now) EXCLUDES(mu_);
  static OutboxEntry HandedEntry(uint64_t id, const Receiver& receiver, const std::string& fingerprint,
                                 alerts::AlertState state, double now);
  void OnSettled(size_t receiver, const std::string& fingerprint, uint64_t id, double now) EXCLUDES(mu_);
  double Now() const;

  Outbox& outbox_;
  DispatcherOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;

  // Orders outbox additions with the resend records. Lock order: mu_, then the outbox's lock and
  // a worker's locks (Worker::mu, then Worker::error_mu); receivers' I/O runs with none held.
  Mutex mu_;
  std::map<std::string, FingerprintRecord> records_ GUARDED_BY(mu_);  // by fingerprint
  bool started_ GUARDED_BY(mu_) = false;
  bool stopped_ GUARDED_BY(mu_) = false;
};

}  // namespace gradwatch::notify

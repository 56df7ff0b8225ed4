// The durable outbox: every alert state change is written here for each receiver before any
// delivery is tried, so a receiver that is down, or a daemon restart, loses nothing. The engine's
// durable state (alert instances, silences, level trackers, evaluated steps; see
// alerts::StateChanges) is written with it, in the same transaction, so that
// after a crash the restored states and the notifications agree: a firing alert whose page was
// recorded is restored firing, and is sent resolved when it ends. The daemon implements Outbox on
// its journal's database; MemoryOutbox serves tests.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "alerts/notify/status.h"
#include "alerts/state_machine.h"

namespace gradwatch::notify {

struct OutboxEntry {
  uint64_t id = 0;          // assigned by Add(); increases in the order entries were added
  std::string receiver;     // Receiver::name()
  std::string fingerprint;  // NotifiedFingerprint(alert): its labels with alertname, in hex
  alerts::AlertState state = alerts::AlertState::kFiring;  // kFiring or kResolved
  std::string payload;         // the alert as JSON (AlertToJson), rendered into a request at send time
  double created_at = 0;       // seconds since the Unix epoch
  uint32_t attempts = 0;       // attempts made so far
  double next_attempt_at = 0;  // not tried again before this time (seconds since the Unix epoch)
};

// Implementations must be safe for concurrent use: the dispatcher's caller adds while every
// receiver's worker reads and marks.
class Outbox {
 public:
  virtual ~Outbox() = default;

  // Stores the entries and applies the state changes atomically (all or none), ignoring the
  // entries' ids, and returns their ids in order. Each entry starts pending.
  virtual Result<std::vector<uint64_t>> Write(std::vector<OutboxEntry> entries, const alerts::StateChanges& states) = 0;
  Result<std::vector<uint64_t>> Add(std::vector<OutboxEntry> entries) { return Write(std::move(entries), {}); }

  // The alert states and silences stored by Write, for a restart.
  virtual Result<alerts::SavedState> LoadState() = 0;

  // Up to limit pending entries of the receiver that the dispatcher may act on at `now` (seconds
  // since the Unix epoch): the due ones first, oldest (lowest id) first, then those not due yet,
  // oldest first (they tell the dispatcher when to wake up). An entry is left out while an older
  // entry of its fingerprint is not due: it must wait for that one, so that a fingerprint's
  // entries are delivered in order. So entries in back-off never fill the batch ahead of due
  // ones, whatever their number.
  virtual Result<std::vector<OutboxEntry>> Pending(std::string_view receiver, size_t limit, double now) = 0;

  // Pending entries of the receiver (for the queue-depth gauge).
  virtual Result<uint64_t> PendingCount(std::string_view receiver) = 0;

  // The entry leaves the pending set for good.
  virtual Status MarkDelivered(uint64_t id) = 0;
  virtual Status MarkFailed(uint64_t id, std::string_view error) = 0;

  // The entry stays pending with these attempts and is not due before next_attempt_at.
  virtual Status MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) = 0;
};

// An Outbox in memory: survives a Dispatcher, not the process.
class MemoryOutbox final : public Outbox {
 public:
  enum class EntryState { kPending, kDelivered, kFailed };
  struct Record {
    OutboxEntry entry;
    EntryState state = EntryState::kPending;
    std::string last_error;
  };

  Result<std::vector<uint64_t>> Write(std::vector<OutboxEntry> entries, const alerts::StateChanges& states) override;
  Result<alerts::SavedState> LoadState() override;
  Result<std::vector<OutboxEntry>> Pending(std::string_view receiver, size_t limit, double now) override;
  Result<uint64_t> PendingCount(std::string_view receiver) override;
  Status MarkDelivered(uint64_t id) override;
  Status MarkFailed(uint64_t id, std::string_view error) override;
  Status MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) override;

  // Every entry ever added, by id, for inspection.
  std::vector<Record> Snapshot() const;

 private:
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;                                 // guarded by mu_
  std::map<uint64_t, Record> records_;                   // guarded by mu_
  std::map<uint64_t, alerts::InstanceState> instances_;  // guarded by mu_
  std::map<std::string, alerts::Silence> silences_;      // guarded by mu_
  std::map<uint64_t, alerts::LevelState> levels_;        // guarded by mu_
  std::map<std::string, uint64_t> evaluated_;            // guarded by mu_
};

}  // namespace gradwatch::notify

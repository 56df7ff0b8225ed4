// The alerting's durable state in the journal's SQLite database, on a connection of its own:
// the notifier outbox (so that notifications survive a receiver being down and a daemon
// restart), the alert instances (pending and firing, with s0, acks...), the silences and the
// alert history (every state change, for the run view's timeline). Write()
// stores notifications and state changes in one transaction. Thread-safe.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "alerts/notify/outbox.h"
#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/store/sqlite.h"

namespace gradwatch::store {

class AlertStore final : public notify::Outbox {
 public:
  // Opens `path` (the journal's file; WAL mode lets both connections work) and creates the tables.
  // When the file at `path` is replaced (the journal rebuilt it after its data directory was
  // deleted), every call switches to the new file first; while there is none, calls fail (and are
  // retried by their callers).
  static StatusOr<std::unique_ptr<AlertStore>> Open(const std::string& path);
  ~AlertStore() override;

  notify::Result<std::vector<uint64_t>> Write(std::vector<notify::OutboxEntry> entries,
                                              const alerts::StateChanges& states) override EXCLUDES(mu_);
  // A row that cannot be read (bad JSON) is skipped with an error in the log: one damaged alert
  // must not keep the daemon from starting.
  notify::Result<alerts::SavedState> LoadState() override EXCLUDES(mu_);
  notify::Result<std::vector<notify::OutboxEntry>> Pending(std::string_view receiver, size_t limit, double now) override
      EXCLUDES(mu_);
  notify::Result<uint64_t> PendingCount(std::string_view receiver) override EXCLUDES(mu_);
  notify::Status MarkDelivered(uint64_t id) override EXCLUDES(mu_);
  notify::Status MarkFailed(uint64_t id, std::string_view error) override EXCLUDES(mu_);
  notify::Status MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) override
      EXCLUDES(mu_);

  // Deletes at most `max_rows` delivered or given-up notifications queued before `created_before`
  // (seconds since the Unix epoch), oldest first, in one short transaction; returns how many. Pending
  // ones are never deleted. Call periodically (the daemon's ticker does, off the ingest path).
  notify::Result<uint64_t> PruneDone(double created_before, size_t max_rows) EXCLUDES(mu_);

  // The alert history (StateChanges::history, written by Write): the latest `limit` state changes
  // of `run` (of every run when empty), oldest first. An entry that cannot be read is skipped with
  // an error in the log.
  notify::Result<std::vector<alerts::HistoryEntry>> History(std::string_view run, size_t limit) EXCLUDES(mu_);
  // Deletes at most `max_rows` history entries from before `before` (seconds since the Unix
  // epoch), oldest first; returns how many. The daemon's ticker calls it with the journal's
  // retention.
  notify::Result<uint64_t> PruneHistory(double before, size_t max_rows) EXCLUDES(mu_);

 private:
  AlertStore(std::string path, sqlite::Database db);
  notify::Status FollowFileLocked() REQUIRES(mu_);                               // see Open
  notify::Status ApplyLocked(const alerts::StateChanges& states) REQUIRES(mu_);  // inside a transaction
  // Write's transaction.
  notify::Result<std::vector<uint64_t>> WriteLocked(std::vector<notify::OutboxEntry> entries,
                                                    const alerts::StateChanges& states) REQUIRES(mu_);
  notify::Status SetState(uint64_t id, int state, std::string_view error) EXCLUDES(mu_);
  // The statement of `sql` (a string literal), prepared once per connection: preparing the eight
  // statements of a Write each time cost about half a millisecond of every notification's way out.
  StatusOr<sqlite::Statement*> StatementLocked(std::string_view sql) REQUIRES(mu_);
  // Replaces the connection; the statements of the old one are finalized first.
  void ReplaceDbLocked(sqlite::Database db) REQUIRES(mu_);

  const std::string path_;
  Mutex mu_;
  sqlite::Database db_ GUARDED_BY(mu_);
  std::unordered_map<std::string_view, sqlite::Statement> statements_ GUARDED_BY(mu_);
  uint64_t dev_ GUARDED_BY(mu_) = 0, ino_ GUARDED_BY(mu_) = 0;  // the file db_ opened
};

}  // namespace gradwatch::store

// The notifier outbox in the journal's SQLite database (its own connection and table), so that
// alert notifications survive a receiver being down and a daemon restart. Thread-safe.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "alerts/notify/outbox.h"
#include "server/core/status.h"

struct sqlite3;

namespace gradwatch::store {

class SqliteOutbox final : public notify::Outbox {
 public:
  // Opens `path` (the journal's file; WAL mode lets both connections work) and creates the table.
  static StatusOr<std::unique_ptr<SqliteOutbox>> Open(const std::string& path);
  ~SqliteOutbox() override;

  notify::Result<std::vector<uint64_t>> Add(std::vector<notify::OutboxEntry> entries) override;
  notify::Result<std::vector<notify::OutboxEntry>> Pending(std::string_view receiver, size_t limit) override;
  notify::Result<uint64_t> PendingCount(std::string_view receiver) override;
  notify::Status MarkDelivered(uint64_t id) override;
  notify::Status MarkFailed(uint64_t id, std::string_view error) override;
  notify::Status MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) override;

 private:
  explicit SqliteOutbox(sqlite3* db) : db_(db) {}
  notify::Status Exec(const char* sql);
  notify::Status SetState(uint64_t id, int state, std::string_view error);

  std::mutex mu_;
  sqlite3* db_;  // guarded by mu_
};

}  // namespace gradwatch::store

// Where each remote-write receiver got to, per run: the highest step of the run's current branch
// that the receiver accepted. Kept in the journal's database (a table of its own, on a connection
// of its own) so that a restart sends what the receiver did not take, and nothing twice.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/core/status.h"
#include "server/core/thread_annotations.h"
#include "server/store/sqlite.h"

namespace gradwatch::store {

class RemoteWriteProgress {
 public:
  // Opens `path` (the journal's file) and creates the table when missing.
  static StatusOr<std::unique_ptr<RemoteWriteProgress>> Open(const std::string& path);

  // The receiver's progress: run id → step sent through.
  StatusOr<std::map<std::string, uint64_t>> Load(const std::string& receiver) EXCLUDES(mu_);
  // Sets the receiver's progress of each (run, step) pair, in one transaction.
  Status Save(const std::string& receiver, const std::vector<std::pair<std::string, uint64_t>>& steps) EXCLUDES(mu_);

 private:
  explicit RemoteWriteProgress(sqlite::Database db) : db_(std::move(db)) {}
  Mutex mu_;
  sqlite::Database db_ GUARDED_BY(mu_);
};

}  // namespace gradwatch::store

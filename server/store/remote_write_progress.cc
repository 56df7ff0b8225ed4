#include "server/store/remote_write_progress.h"

namespace gradwatch::store {

StatusOr<std::unique_ptr<RemoteWriteProgress>> RemoteWriteProgress::Open(const std::string& path) {
  auto db = sqlite::Database::Open(path, {.create = true});
  if (!db.ok()) return db.status();
  if (Status s = db->Exec("PRAGMA synchronous=FULL"); !s.ok()) return s;
  if (Status s = db->Exec("CREATE TABLE IF NOT EXISTS remote_write_progress ("
                          "receiver TEXT NOT NULL, run TEXT NOT NULL, step INTEGER NOT NULL, "
                          "PRIMARY KEY (receiver, run)) WITHOUT ROWID");
      !s.ok()) {
    return s;
  }
  return std::unique_ptr<RemoteWriteProgress>(new RemoteWriteProgress(std::move(db).value()));
}

StatusOr<std::map<std::string, uint64_t>> RemoteWriteProgress::Load(const std::string& receiver) {
  MutexLock lock(&mu_);
  auto select = db_.Prepare("SELECT run, step FROM remote_write_progress WHERE receiver = ?");
  if (!select.ok()) return select.status();
  std::map<std::string, uint64_t> out;
  Status status;
  sqlite::Query q(*select);
  q.Bind(1, std::string_view(receiver));
  while (q.Next(&status, "reading remote-write progress")) out[q.Text(0)] = q.Unsigned(1);
  if (!status.ok()) return status;
  return out;
}

Status RemoteWriteProgress::Save(const std::string& receiver,
                                 const std::vector<std::pair<std::string, uint64_t>>& steps) {
  MutexLock lock(&mu_);
  sqlite::Transaction txn(db_, "remote-write progress");
  if (Status s = txn.Begin(sqlite::Transaction::Mode::kImmediate); !s.ok()) return s;
  auto upsert = db_.Prepare(
      "INSERT INTO remote_write_progress (receiver, run, step) VALUES (?, ?, ?) "
      "ON CONFLICT (receiver, run) DO UPDATE SET step = excluded.step");
  if (!upsert.ok()) return upsert.status();
  for (const auto& [run, step] : steps) {
    sqlite::Query q(*upsert);
    q.Bind(1, std::string_view(receiver));
    q.Bind(2, std::string_view(run));
    q.Bind(3, step);
    if (Status s = q.Run("saving remote-write progress"); !s.ok()) return s;
  }
  return txn.Commit();
}

}  // namespace gradwatch::store

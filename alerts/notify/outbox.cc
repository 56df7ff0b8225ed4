#include "alerts/notify/outbox.h"

#include <set>

namespace gradwatch::notify {

Result<std::vector<uint64_t>> MemoryOutbox::Write(std::vector<OutboxEntry> entries,
                                                  const alerts::StateChanges& states) {
  std::lock_guard lock(mu_);
  for (const auto& [fp, inst] : states.instances) {
    if (inst) {
      instances_[fp] = *inst;
    } else {
      instances_.erase(fp);
    }
  }
  for (const auto& [id, silence] : states.silences) {
    if (silence) {
      silences_[id] = *silence;
    } else {
      silences_.erase(id);
    }
  }
  for (const auto& [fp, level] : states.levels) {
    if (level) {
      levels_[fp] = *level;
    } else {
      levels_.erase(fp);
    }
  }
  for (const auto& [run, step] : states.evaluated) {
    if (step) {
      evaluated_[run] = *step;
    } else {
      evaluated_.erase(run);
    }
  }
  std::vector<uint64_t> ids;
  ids.reserve(entries.size());
  for (OutboxEntry& entry : entries) {
    entry.id = next_id_++;
    ids.push_back(entry.id);
    records_.emplace(entry.id, Record{std::move(entry), EntryState::kPending, {}});
  }
  return ids;
}

Result<alerts::SavedState> MemoryOutbox::LoadState() {
  std::lock_guard lock(mu_);
  alerts::SavedState saved;
  for (const auto& [fp, inst] : instances_) saved.instances.push_back(inst);
  for (const auto& [id, silence] : silences_) saved.silences.push_back(silence);
  saved.levels = levels_;
  saved.evaluated = evaluated_;
  return saved;
}

Result<std::vector<OutboxEntry>> MemoryOutbox::Pending(std::string_view receiver, size_t limit, double now) {
  std::lock_guard lock(mu_);
  std::vector<OutboxEntry> due, later;
  std::set<std::string> waiting;               // fingerprints with an older pending entry not due
  for (const auto& [id, record] : records_) {  // ordered by id
    if (record.state != EntryState::kPending || record.entry.receiver != receiver) continue;
    if (waiting.count(record.entry.fingerprint)) continue;
    if (record.entry.next_attempt_at > now) {
      waiting.insert(record.entry.fingerprint);
      later.push_back(record.entry);
    } else {
      due.push_back(record.entry);
    }
  }
  due.insert(due.end(), later.begin(), later.end());
  if (due.size() > limit) due.resize(limit);
  return due;
}

Result<uint64_t> MemoryOutbox::PendingCount(std::string_view receiver) {
  std::lock_guard lock(mu_);
  uint64_t count = 0;
  for (const auto& [id, record] : records_) {
    if (record.state == EntryState::kPending && record.entry.receiver == receiver) ++count;
  }
  return count;
}

Status MemoryOutbox::MarkDelivered(uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return NotifyError("outbox: no entry " + std::to_string(id));
  it->second.state = EntryState::kDelivered;
  return Status::Ok();
}

Status MemoryOutbox::MarkFailed(uint64_t id, std::string_view error) {
  std::lock_guard lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return NotifyError("outbox: no entry " + std::to_string(id));
  it->second.state = EntryState::kFailed;
  it->second.last_error = std::string(error);
  return Status::Ok();
}

Status MemoryOutbox::MarkRetry(uint64_t id, double next_attempt_at, uint32_t attempts, std::string_view error) {
  std::lock_guard lock(mu_);
  auto it = records_.find(id);
  if (it == records_.end()) return NotifyError("outbox: no entry " + std::to_string(id));
  it->second.entry.next_attempt_at = next_attempt_at;
  it->second.entry.attempts = attempts;
  it->second.last_error = std::string(error);
  return Status::Ok();
}

std::vector<MemoryOutbox::Record> MemoryOutbox::Snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<Record> all;
  all.reserve(records_.size());
  for (const auto& [id, record] : records_) all.push_back(record);
  return all;
}

}  // namespace gradwatch::notify

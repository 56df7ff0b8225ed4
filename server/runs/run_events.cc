// Run: events and catalog changes, journaled and held in step order with the steps.
#include "server/runs/run_internal.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "server/runs/catalog_change.h"

namespace gradwatch::runs {

std::optional<IngestError> Run::AddEvent(EventRecord event) {
  MutexLock lock(&mu_);
  if (auto err = EventRoomLocked(event)) return err;
  auto pos = std::upper_bound(events_.begin(), events_.end(), event.step,
                              [](uint64_t s, const EventRecord& e) { return s < e.step; });
  events_.insert(pos, event);
  ChargeEventLocked(event);
  analytics_->OnEvent(event);
  JournalLocked(store::EventJournalRecord{id_, std::move(event)});
  last_activity_ = clock_->Now();
  return std::nullopt;
}

std::optional<IngestError> Run::AddEvent(EventRecord event, uint32_t rank, uint64_t seq, StreamSink* sink) {
  MutexLock lock(&mu_);
  if (auto err = OutsideWorldLocked(rank, "event", event.step)) return err;
  if (auto err = StorageRefusalLocked(rank, event.step)) return err;
  if (auto err = EventRoomLocked(event)) return err;
  RecordEventLocked(event, rank, seq, sink);
  return std::nullopt;
}

bool Run::HoldsEventLocked(const EventRecord& event) const {
  const auto [first, last] =
      std::equal_range(events_.begin(), events_.end(), event,
                       [](const EventRecord& a, const EventRecord& b) { return a.step < b.step; });
  // A catalog change is the same change whatever its text (which tells the catalog before it).
  return std::any_of(first, last, [&event](const EventRecord& e) {
    return e.source == event.source &&
           (event.source == kCatalogEventSource ? e.data == event.data : e.text == event.text);
  });
}

std::optional<IngestError> Run::EventRoomLocked(const EventRecord& event) const {
  if (events_.size() < options_.max_events || HoldsEventLocked(event)) return std::nullopt;
  return IngestError{IngestErrorReason::kLimitExceeded,
                     "run " + id_ + " holds " + std::to_string(events_.size()) +
                         " events, the most it may (limits.max_events_per_run); this one is not stored",
                     event.step};
}

std::optional<IngestError> Run::OutsideWorldLocked(uint32_t rank, std::string_view what, uint64_t step) const {
  if (rank < ranks_.size()) return std::nullopt;
  return IngestError{IngestErrorReason::kSuperseded,
                     "rank " + std::to_string(rank) + " is not in the run's world of " + std::to_string(ranks_.size()) +
                         " since it resumed; this " + std::string(what) + " is not stored",
                     step};
}

bool Run::RecordEventLocked(const EventRecord& event, uint32_t rank, uint64_t seq, StreamSink* sink) {
  last_activity_ = clock_->Now();
  const bool held = HoldsEventLocked(event);
  uint64_t record = 0;
  if (held) {
    // A resend: what the run holds was enqueued at the latest by the last record so far.
    record = journal_ != nullptr ? journal_->last_enqueued() : 0;
  } else {
    record = JournalLocked(store::EventJournalRecord{id_, event});
    if (journal_ != nullptr && record == 0) return false;  // dropped and counted: never acked
    const auto after = std::upper_bound(events_.begin(), events_.end(), event.step,
                                        [](uint64_t s, const EventRecord& e) { return s < e.step; });
    events_.insert(after, event);
    ChargeEventLocked(event);
    analytics_->OnEvent(event);
  }
  if (journal_ == nullptr || (held && journal_->last_committed() >= record)) {
    if (sink != nullptr) sink->SendEventAck(seq, event.step);
    return !held;
  }
  event_acks_.push_back({record, rank, sink, seq, event.step});
  return !held;
}

std::optional<IngestError> Run::AddCatalogChange(uint64_t from_step, std::vector<ParamChange> changes, uint32_t rank,
                                                 uint64_t seq, StreamSink* sink) {
  run_internal::DeliverOnExit deliver(channel_);
  MutexLock lock(&mu_);
  if (auto err = OutsideWorldLocked(rank, "catalog change", from_step)) return err;
  if (auto why = CheckCatalogChange(changes, meta_.params)) {
    return IngestError{
        IngestErrorReason::kInvalidMessage,
        "catalog update from step " + std::to_string(from_step) + ": " + *why + "; nothing of it is applied",
        from_step};
  }
  if (auto err = StorageRefusalLocked(rank, from_step)) return err;
  const EventRecord event = CatalogChangeEvent(from_step, changes, meta_.params, clock_->UnixSeconds());
  if (auto err = EventRoomLocked(event)) return err;
  if (RecordEventLocked(event, rank, seq, sink)) ScheduleCatalogChangeLocked(from_step, std::move(changes));
  return std::nullopt;
}

void Run::ScheduleCatalogChangeLocked(uint64_t step, std::vector<ParamChange> change) {
  const auto pos = std::upper_bound(catalog_pending_.begin(), catalog_pending_.end(), step,
                                    [](uint64_t s, const CatalogChangeEntry& e) { return s < e.step; });
  catalog_pending_.insert(pos, CatalogChangeEntry{step, std::move(change), {}});
  if (has_first_step_ && step <= last_step_) ApplyDueCatalogChangesLocked(last_step_, /*live=*/true);
}

void Run::ApplyDueCatalogChangesLocked(uint64_t through_step, bool live) {
  size_t due = 0;
  while (due < catalog_pending_.size() && catalog_pending_[due].step <= through_step) {
    CatalogChangeEntry& e = catalog_pending_[due++];
    spdlog::info("run {}: {} (from step {})", id_, DescribeCatalogChange(e.change, meta_.params), e.step);
    e.undo = ApplyCatalogChange(e.change, meta_.params);
    ++meta_.catalog_changes;
    // A live change starts its remediation check from the analytics as they are now.
    analytics_->UpdateCatalog(meta_.params, live ? std::optional<uint64_t>(e.step) : std::nullopt);
    catalog_applied_.push_back(std::move(e));
  }
  catalog_pending_.erase(catalog_pending_.begin(), catalog_pending_.begin() + static_cast<std::ptrdiff_t>(due));
}

void Run::UndoCatalogChangesFromLocked(uint64_t from_step) {
  catalog_pending_.erase(std::lower_bound(catalog_pending_.begin(), catalog_pending_.end(), from_step,
                                          [](const CatalogChangeEntry& e, uint64_t s) { return e.step < s; }),
                         catalog_pending_.end());
  // Undone newest first down to the oldest applied change from from_step on; the earlier-step
  // changes applied after it are applied again.
  const auto first = std::find_if(catalog_applied_.begin(), catalog_applied_.end(),
                                  [&](const CatalogChangeEntry& e) { return e.step >= from_step; });
  if (first == catalog_applied_.end()) return;
  for (auto it = catalog_applied_.end(); it != first;) {
    --it;
    ApplyCatalogChange(it->undo, meta_.params);
  }
  std::vector<CatalogChangeEntry> again;
  for (auto it = first; it != catalog_applied_.end(); ++it) {
    if (it->step < from_step) again.push_back(std::move(*it));
  }
  catalog_applied_.erase(first, catalog_applied_.end());
  for (CatalogChangeEntry& e : again) {
    e.undo = ApplyCatalogChange(e.change, meta_.params);
    catalog_applied_.push_back(std::move(e));
  }
  CatalogChangedLocked();
}

void Run::CatalogChangedLocked() {
  ++meta_.catalog_changes;
  analytics_->UpdateCatalog(meta_.params);
}

}  // namespace gradwatch::runs

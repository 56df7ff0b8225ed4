#include "gradwatch/step_buffer.h"

#include <algorithm>
#include <utility>

namespace gradwatch::client {

StepBuffer::StepBuffer(size_t step_capacity, size_t event_capacity, SendWindow window, size_t byte_capacity)
    : step_capacity_(step_capacity), event_capacity_(event_capacity), window_(window), byte_capacity_(byte_capacity) {}

bool StepBuffer::PushStep(v1::StepStats step) {
  if (!HasRoomForStep()) {
    ++dropped_;
    ++dropped_since_push_;
    return false;
  }
  // Attached at enqueue rather than at write so that a resend carries identical values.
  step.set_client_dropped_steps(step.client_dropped_steps() + dropped_since_push_);
  dropped_since_push_ = 0;
  Entry e;
  e.id = next_id_++;
  *e.message.mutable_step() = std::move(step);
  e.bytes = e.message.ByteSizeLong();
  Count(e);
  entries_.push_back(std::move(e));
  return true;
}

bool StepBuffer::PushEvent(v1::Event event) {
  v1::TrainerMessage message;
  *message.mutable_event() = std::move(event);
  return PushAcked(std::move(message));
}

bool StepBuffer::PushCatalogUpdate(v1::CatalogUpdate update) {
  v1::TrainerMessage message;
  *message.mutable_catalog_update() = std::move(update);
  return PushAcked(std::move(message));
}

bool StepBuffer::PushAcked(v1::TrainerMessage message) {
  if (!HasRoomForEvent()) return false;
  Entry e;
  e.id = next_id_++;
  e.message = std::move(message);
  Count(e);
  entries_.push_back(std::move(e));
  return true;
}

bool StepBuffer::HasUnwritten() {
  while (cursor_ < entries_.size() && entries_[cursor_].written) ++cursor_;
  return cursor_ < entries_.size();
}

bool StepBuffer::WindowAdmits(const Entry& e) const {
  if (!e.is_step() || written_steps_ == 0) return true;
  return written_steps_ < window_.steps && written_bytes_ + e.bytes <= window_.bytes;
}

bool StepBuffer::CanWrite() { return HasUnwritten() && WindowAdmits(entries_[cursor_]); }

std::optional<StepBuffer::Claimed> StepBuffer::NextToWrite(uint64_t seq) {
  if (!CanWrite()) return std::nullopt;
  Entry& e = entries_[cursor_];
  e.last_seq = seq;
  Claimed claimed{e.id, e.message};
  claimed.message.set_seq(seq);
  return claimed;
}

void StepBuffer::MarkWritten(uint64_t id, bool events_acked) {
  size_t index = (cursor_ < entries_.size() && entries_[cursor_].id == id) ? cursor_ : IndexOf(id);
  if (index == entries_.size()) return;
  Entry& e = entries_[index];
  if (!e.is_step()) {
    if (events_acked) {
      if (!e.written) ++written_events_;
      e.written = true;
    } else {
      Erase(index);
    }
    return;
  }
  if (!e.written) {
    e.written = true;
    ++written_steps_;
    written_bytes_ += e.bytes;
  }
}

bool StepBuffer::OnEventAck(uint64_t seq) {
  if (seq == 0) return false;
  // Unacked events are few and sit near the front, among steps awaiting their acks. The ack may
  // arrive before the sender marks the event written (it writes without the Monitor's lock, and
  // the daemon acks an event it already holds at once): the seq it was claimed with is enough.
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (!e.is_step() && e.last_seq == seq) {
      Erase(i);
      return true;
    }
  }
  return false;
}

size_t StepBuffer::OnAccepted(const v1::Accepted& accepted) {
  size_t released = 0;
  if (accepted.has_durable_step()) {
    const uint64_t durable = accepted.last_durable_step();
    released = EraseFront(entries_.size(), [durable](const Entry& e) { return e.is_step() && e.step() <= durable; });
  }
  written_steps_ = 0;
  written_bytes_ = 0;
  written_events_ = 0;
  for (Entry& e : entries_) {
    e.written = e.is_step() && accepted.has_received_step() && e.step() <= accepted.last_received_step();
    e.last_seq = 0;
    if (e.written) {
      ++written_steps_;
      written_bytes_ += e.bytes;
    }
  }
  cursor_ = 0;
  return released;
}

size_t StepBuffer::OnAck(uint64_t durable_step) {
  // Steps arrive in increasing order, so the released ones sit at the front (with at most a few
  // unwritten events among them); stop at the first step the ack does not cover.
  size_t limit = 0;
  while (limit < entries_.size() && (!entries_[limit].is_step() || entries_[limit].step() <= durable_step)) {
    ++limit;
  }
  return EraseFront(limit, [durable_step](const Entry& e) { return e.is_step() && e.step() <= durable_step; });
}

bool StepBuffer::ReleaseRejected(uint64_t seq, uint64_t step) {
  size_t found = entries_.size();
  if (seq != 0) {
    // An unmatched seq named a message already released (by an ack, or an event not acked).
    for (size_t i = 0; i < entries_.size() && found == entries_.size(); ++i) {
      if (entries_[i].last_seq == seq) found = i;
    }
  } else {
    // Prefer a written step: an unwritten one with the same number is a later, separate call.
    for (int pass = 0; pass < 2 && found == entries_.size(); ++pass) {
      for (size_t i = 0; i < entries_.size(); ++i) {
        const Entry& e = entries_[i];
        if (e.is_step() && e.step() == step && (pass == 1 || e.written)) {
          found = i;
          break;
        }
      }
    }
  }
  if (found == entries_.size()) return false;
  Erase(found);
  return true;
}

bool StepBuffer::Release(uint64_t id) {
  size_t index = IndexOf(id);
  if (index == entries_.size()) return false;
  Erase(index);
  return true;
}

template <typename Pred>
size_t StepBuffer::EraseFront(size_t limit, Pred pred) {
  // Compact the kept entries towards `limit`, then drop the gap left at the front: a deque
  // erases its front in time proportional to what is erased.
  size_t write = limit;
  size_t removed_before_cursor = 0;
  for (size_t i = limit; i-- > 0;) {
    if (pred(entries_[i])) {
      Uncount(entries_[i]);
      if (i < cursor_) ++removed_before_cursor;
      continue;
    }
    --write;
    if (write != i) entries_[write] = std::move(entries_[i]);
  }
  entries_.erase(entries_.begin(), entries_.begin() + static_cast<std::ptrdiff_t>(write));
  cursor_ -= removed_before_cursor;
  return write;
}

void StepBuffer::Erase(size_t index) {
  Uncount(entries_[index]);
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(index));
  if (index < cursor_) --cursor_;
}

size_t StepBuffer::IndexOf(uint64_t id) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), id, [](const Entry& e, uint64_t v) { return e.id < v; });
  if (it == entries_.end() || it->id != id) return entries_.size();
  return static_cast<size_t>(it - entries_.begin());
}

void StepBuffer::Count(const Entry& e) {
  if (e.is_step()) {
    ++steps_;
    held_bytes_ += e.bytes;
    if (e.written) {
      ++written_steps_;
      written_bytes_ += e.bytes;
    }
  } else {
    ++events_;
    if (e.written) ++written_events_;
  }
}

void StepBuffer::Uncount(const Entry& e) {
  if (e.is_step()) {
    --steps_;
    held_bytes_ -= e.bytes;
    if (e.written) {
      --written_steps_;
      written_bytes_ -= e.bytes;
    }
  } else {
    --events_;
    if (e.written) --written_events_;
  }
}

}  // namespace gradwatch::client

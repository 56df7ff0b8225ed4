// The Monitor's send buffer: steps and events in log order, with what the daemon still owes us,
// and the flow-control window that bounds what is written but not yet acknowledged. Pure
// bookkeeping, no I/O and no locking: the Monitor guards it with its mutex, tests drive it
// directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <optional>

#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::client {

// The flow-control window: steps written and not yet acknowledged durable. The sender writes the
// next step only while the window has room for it, so what the daemon has not confirmed stays
// bounded (and in the buffer, not queued in a socket), and acks reopen the window. A step larger
// than `bytes` alone still goes when nothing else is in flight. Events are small and rare: they
// do not count, but they keep their place in the order.
struct SendWindow {
  size_t steps = 1024;
  size_t bytes = 8 << 20;
};

class StepBuffer {
 public:
  // One logged message. `message` holds a step, an event or a catalog update (held and acked as
  // an event); its seq is set by the sender.
  struct Entry {
    uint64_t id = 0;        // buffer-local, increasing in log order
    bool written = false;   // written on the current connection
    uint64_t last_seq = 0;  // seq of the last claim, to match an Error to its step
    size_t bytes = 0;       // serialized size of a step's message (0 for events)
    v1::TrainerMessage message;

    bool is_step() const { return message.has_step(); }
    uint64_t step() const {
      return is_step()                      ? message.step().step()
             : message.has_catalog_update() ? message.catalog_update().from_step()
                                            : message.event().step();
    }
  };

  // `step_capacity` bounds steps held (queued plus written but not yet durable), and
  // `byte_capacity` their serialized bytes (a step is taken while the bytes held are below it);
  // events have their own bound so a burst of them cannot starve steps.
  StepBuffer(size_t step_capacity, size_t event_capacity, SendWindow window = {},
             size_t byte_capacity = std::numeric_limits<size_t>::max());

  // Appends a step. When the buffer is full the step is dropped, counted, and false returned;
  // the next step that gets in carries the count in client_dropped_steps.
  bool PushStep(v1::StepStats step);
  // Appends an event; false (and nothing counted as a dropped step) when the event bound is hit.
  bool PushEvent(v1::Event event);
  // Appends a catalog update, under the events' bound, as PushEvent.
  bool PushCatalogUpdate(v1::CatalogUpdate update);

  bool HasRoomForStep() const { return steps_ < step_capacity_ && held_bytes_ < byte_capacity_; }
  bool HasRoomForEvent() const { return events_ < event_capacity_; }

  // A message claimed for writing: a copy, its seq set.
  struct Claimed {
    uint64_t id = 0;
    v1::TrainerMessage message;
  };

  // Whether NextToWrite would claim an entry: one is unwritten and the window has room for it.
  bool CanWrite();
  // Claims the oldest entry not yet written on this connection for a write with `seq`, or
  // nullopt when there is none or the window is full. The seq is recorded first, because the
  // daemon may answer before the write returns.
  std::optional<Claimed> NextToWrite(uint64_t seq);
  // Records that entry `id` was written: a step now waits for its durable ack; an event waits for
  // its EventAck when `events_acked` (the daemon said Accepted.acks_events), else leaves the
  // buffer. Unknown ids (released meanwhile) are ignored.
  void MarkWritten(uint64_t id, bool events_acked);

  // Applies the daemon's answer to a Hello: steps already durable leave; steps the daemon has
  // received wait for their ack; everything else is written again, in order.
  // Returns the number of steps released.
  size_t OnAccepted(const v1::Accepted& accepted);
  // Releases every step ≤ durable_step. Returns the number released.
  size_t OnAck(uint64_t durable_step);
  // Releases the event last claimed (NextToWrite) with `seq`, written or still being written: its
  // ack may overtake MarkWritten. Returns whether one was released.
  bool OnEventAck(uint64_t seq);
  // Releases the message an Error refers to, which will never be acknowledged: the step or event
  // last written with `seq`; when the daemon did not echo a seq (0), the first step numbered `step`,
  // written ones first. Returns whether a step was released.
  bool ReleaseRejected(uint64_t seq, uint64_t step);
  // Releases one entry by id (a message the sender refused to write, e.g. oversized).
  bool Release(uint64_t id);

  size_t steps() const { return steps_; }    // steps held
  size_t events() const { return events_; }  // events not yet acked (or written)
  // Steps and events written, not yet durable.
  size_t unacked() const { return written_steps_ + written_events_; }
  size_t queued() const { return entries_.size() - unacked(); }  // waiting to be written
  size_t unacked_bytes() const { return written_bytes_; }        // of the written steps
  size_t held_bytes() const { return held_bytes_; }              // of every step held
  bool empty() const { return entries_.empty(); }
  uint64_t dropped() const { return dropped_; }  // steps refused since construction

 private:
  // Appends an event or a catalog update: held until its EventAck, under the events' bound.
  bool PushAcked(v1::TrainerMessage message);
  // Removes the entries of [0, limit) that match `pred`, keeping order; cheap at the front.
  template <typename Pred>
  size_t EraseFront(size_t limit, Pred pred);
  void Erase(size_t index);
  size_t IndexOf(uint64_t id) const;
  void Count(const Entry& e);
  void Uncount(const Entry& e);

  // Whether some entry is not yet written on this connection; moves cursor_ to it.
  bool HasUnwritten();
  // Whether the window has room for entry `e`.
  bool WindowAdmits(const Entry& e) const;

  size_t step_capacity_;
  size_t event_capacity_;
  SendWindow window_;
  size_t byte_capacity_;
  std::deque<Entry> entries_;
  // Every entry before cursor_ is written; NextToWrite scans from here.
  size_t cursor_ = 0;
  uint64_t next_id_ = 1;
  size_t steps_ = 0;
  size_t events_ = 0;
  size_t written_steps_ = 0;
  size_t written_bytes_ = 0;   // of the written steps
  size_t held_bytes_ = 0;      // of every step held
  size_t written_events_ = 0;  // written, waiting for their EventAck
  uint64_t dropped_ = 0;
  uint64_t dropped_since_push_ = 0;
};

}  // namespace gradwatch::client

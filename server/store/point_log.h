// A list of Points, oldest first, compressed as Prometheus's head chunks are (the Gorilla scheme,
// Pelkonen et al., VLDB 2015; prometheus/tsdb/chunkenc/xor.go): steps as delta-of-delta, values
// XORed with the previous value of the same field (a window of meaningful bits narrowed when it
// has grown too wide, point_log.cc), bit-packed into fixed-size chunks.
//
// A full-resolution point (a sample: count 1, see IsSamplePoint) is coded as its step and one
// value: a step one past the previous step's delta takes 1 bit, a value equal to the previous one
// 1 bit, a value that changes in its low mantissa bits only a few bits more; noisy doubles (a
// gradient norm) take 50–64 bits, against 448 bits for the Point. A downsampled bucket also codes
// its span, count and non-finite count (1 bit each when unchanged) and its mean, min and max.
// Decoding is bit-exact: NaN payloads, ±Inf, −0 and denormals come back as they went in.
//
// Chunks hold kChunkBytes each and restart the coding (their first point is coded against zero),
// so the oldest chunk can be dropped alone. They are kept in a ring of slots: a chunk emptied by
// PopFront, Truncate or Clear keeps its buffer for the next chunk, so a log that pops as it
// appends (a series' recent points) allocates nothing once warm.
//
// Not thread-safe: the owner serialises access.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "server/core/prefetch.h"
#include "server/core/state_io.h"
#include "server/store/point.h"

namespace gradwatch::store {

class PointLog {
 public:
  static constexpr size_t kChunkWords = 64;
  static constexpr size_t kChunkBytes = kChunkWords * sizeof(uint64_t);
  // The most bits one point can take: a sample, and a bucket.
  static constexpr size_t kMaxSampleBits = 1 + 68 + 77;
  static constexpr size_t kMaxBucketBits = 1 + 68 + 3 * 71 + 4 * 77;

  // Appends p. When it does not fit in the newest chunk and no emptied chunk is held, a chunk is
  // allocated if may_allocate; otherwise nothing is appended and false is returned.
  bool Append(const Point& p, bool may_allocate);
  // Append(SamplePoint(step, value), may_allocate), coded in place when it surely fits.
  bool AppendSample(uint64_t step, double value, bool may_allocate);
  // Bytes the next Append may allocate (0 when it will not): a chunk and, if the ring of slots is
  // full, its growth.
  size_t NextGrowthBytes() const;

  // Removes and returns the oldest point. Requires !empty().
  Point PopFront();
  // Keeps the oldest `count` points (all when count ≥ size()). O(points held).
  void Truncate(size_t count);
  // Removes every point; the chunks are kept for reuse.
  void Clear();

  // The newest point. Requires !empty().
  const Point& Back() const { return write_.prev; }
  // Calls f(const Point&) for every point, oldest first.
  template <typename F>
  void ForEach(F&& f) const;

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Chunk buffers allocated (in use or kept for reuse).
  size_t chunks_allocated() const { return slots_.size(); }
  // Bytes held on the heap (chunks and the ring of slots), not counting sizeof(PointLog).
  size_t MemoryBytes() const;
  // The most MemoryBytes() of a log that never holds more than `points` points of at most
  // `max_bits` bits each.
  static size_t MaxMemoryBytes(size_t points, size_t max_bits);
  // MemoryBytes() of a log with one chunk.
  static size_t OneChunkBytes() { return kChunkBytes + sizeof(Chunk); }

  // Cache hints for an owner that appends to many logs in turn (Series::PrefetchSlots and
  // PrefetchWords), each reading only what the one before brought into cache: the ring of slots,
  // then the words the next append writes and the next PopFront reads. They change nothing.
  void PrefetchSlots() const {
    if (chunks_used_ == 0) return;
    PrefetchRead(&slot(0));
    PrefetchRead(&slot(chunks_used_ - 1));
  }
  void PrefetchWords() const {
    if (chunks_used_ == 0) return;
    PrefetchRead(slot(chunks_used_ - 1).words.get() + write_.bit / 64);
    PrefetchRead(slot(0).words.get() + front_.bit / 64);
  }

  // Writes the points for LoadState: the chunks in use, oldest first (the words their bits take),
  // and where the oldest point is read and the next one written. Spare chunks are not written.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this log (its points, if any, are replaced). False (with
  // in.Fail(...) called, the reader failed) when the bytes are damaged; the log is then left in an
  // unspecified but valid, destructible state: the caller discards it. Every chunk read is decoded
  // once, with bounds checked, so a log loaded never decodes bits that no Append wrote.
  //
  // The log loaded allocates exactly the chunks in use, with no spare: its MemoryBytes() may be
  // below the original's and its NextGrowthBytes() above, and an Append the original would have
  // coded into a spare chunk allocates one (or, refused the allocation, fails where the
  // original's succeeded). With allocation allowed, every later call returns what the original's
  // would.
  bool LoadState(StateReader& in);

 private:
  static constexpr uint32_t kChunkBits = kChunkWords * 64;

  struct Chunk {
    std::unique_ptr<uint64_t[]> words;
    uint32_t bits = 0;    // bits written
    uint32_t points = 0;  // points written (PopFront does not change it)
  };
  // What coding the next point of a chunk depends on, and where it goes.
  struct CodecState {
    Point prev;                           // the previous point (all zero before a chunk's first)
    uint64_t delta = 0;                   // prev.step minus the step before it, modulo 2^64
    std::array<uint8_t, 4> leading{};     // XOR windows of mean, min, max, last
    std::array<uint8_t, 4> meaningful{};  // 0: no window yet
    uint32_t bit = 0;                     // position in the chunk
    uint32_t points = 0;                  // points of the chunk before `bit`
  };

  // Writes p at `state` into `chunk`; false (state and chunk.bits unchanged) when it does not fit.
  static bool Encode(Chunk& chunk, CodecState& state, const Point& p);
  // Writes the sample (step, value) at `state`, which must leave room for kMaxSampleBits.
  static void EncodeSampleInPlace(Chunk& chunk, CodecState& state, uint64_t step, double value);
  // Reads the point at `state` and advances it.
  static Point Decode(const Chunk& chunk, CodecState& state);
  // Decode for bits read from a snapshot: false, state unspecified, when the point at `state` is
  // not one Encode could have written ending at or before `end_bit` (a read past it, a value
  // window out of range).
  static bool DecodeChecked(const Chunk& chunk, uint32_t end_bit, CodecState& state);
  static bool SameState(const CodecState& a, const CodecState& b);

  // The ring index of the ith chunk from head_ (i < slots_.size()): a compare, not a division
  // (a 64-bit div costs tens of cycles, and a step takes several per series).
  size_t SlotIndex(size_t i) const {
    const size_t s = head_ + i;
    return s < slots_.size() ? s : s - slots_.size();
  }
  Chunk& slot(size_t i) { return slots_[SlotIndex(i)]; }
  const Chunk& slot(size_t i) const { return slots_[SlotIndex(i)]; }
  // Makes the slot after the newest chunk the new newest chunk (allocating one if every slot is in
  // use and may_allocate); false when none is available.
  bool OpenChunk(bool may_allocate);

  std::vector<Chunk> slots_;  // a ring: chunks_used_ chunks from head_, then emptied ones
  size_t head_ = 0;
  size_t chunks_used_ = 0;
  size_t size_ = 0;
  CodecState front_;  // where the oldest point is read (in the head chunk)
  CodecState write_;  // where the next point is written (in the newest chunk)
};

template <typename F>
void PointLog::ForEach(F&& f) const {
  for (size_t i = 0; i < chunks_used_; ++i) {
    const Chunk& chunk = slot(i);
    CodecState state = i == 0 ? front_ : CodecState{};
    while (state.points < chunk.points) f(Decode(chunk, state));
  }
}

}  // namespace gradwatch::store

// In-memory series with bounded memory: the most recent points at full resolution, older ones
// merged into buckets that keep min, max and mean so spikes survive downsampling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "server/core/prefetch.h"
#include "server/core/state_io.h"
#include "server/store/point.h"
#include "server/store/point_log.h"

namespace gradwatch::store {

// Capacities below 2 are raised to 2.
struct SeriesOptions {
  // Points kept at full resolution (≥ 2).
  size_t recent_points = 4096;
  // Downsampled buckets kept for older history (≥ 2). When they are all used, adjacent buckets
  // are merged pairwise (halving resolution) so the whole history stays within the bound.
  size_t history_buckets = 1024;
};

// Not thread-safe: the owner serialises access.
//
// Points are held compressed (PointLog: steps as delta-of-delta, values XORed with the previous
// one, in 512-byte chunks): a recent sample takes from 3 bits (a constant at regular steps) to 19
// bytes, about 7 for a noisy norm; a bucket about 28 bytes with noisy values, 74 at most. The
// newest bucket is held as a Point, as merges go into it.
// Memory grows with the samples held, not with the options: a new series allocates nothing; a
// chunk is allocated when the held ones are full, up to what recent_points and history_buckets
// need; from then on Append reuses the chunks it empties, and allocates only when the values held
// compress worse than they ever did (a chunk at a time, within MaxMemoryBytes). An owner with a
// memory budget may refuse growth (Append's may_grow): the series then keeps the chunks it has
// (one for recent points and one for history at least) and moves its oldest recent points into
// history sooner (compacting history sooner too), losing no sample.
class Series {
 public:
  explicit Series(const SeriesOptions& options = {});

  // Appends a sample. Steps must strictly increase: returns false and keeps nothing otherwise.
  // NaN and ±Inf are kept (counted in `nonfinite`), bit for bit in `last`. With may_grow false no
  // chunk is allocated beyond the first of each kind (see the class comment).
  bool Append(uint64_t step, double value, bool may_grow = true);
  // Bytes the next Append may allocate (0 when it will not): what an owner with a budget
  // reserves before it. An upper bound: the Append may allocate less.
  size_t NextGrowthBytes() const;

  // Drops every point covering a step ≥ from_step (a rewind to a checkpoint: those steps belong
  // to an abandoned branch). A downsampled bucket that straddles from_step (its first step below
  // it, its last at or above it) is dropped whole, since its mean, min and max cannot be split:
  // no abandoned value is ever shown, at the cost of up to one bucket of older history just
  // before from_step. Later appends need only exceed the newest kept step. Returns the samples
  // dropped. O(points held).
  uint64_t TruncateFrom(uint64_t from_step);

  // The newest sample (or, after a truncation emptied the recent points, the newest bucket), if
  // any. O(1).
  std::optional<Point> Latest() const;

  // Points overlapping [from_step, to_step], oldest first: history buckets, then recent points.
  // With max_points > 0 the result is merged into at most max_points points: the matching points
  // are split into max_points runs of (nearly) equal length and each run is combined by MergeInto,
  // so a one-step spike keeps its min/max. Empty when from_step > to_step. O(points held): every
  // point is decoded.
  std::vector<Point> Query(uint64_t from_step, uint64_t to_step, size_t max_points = 0) const;

  // Samples appended and not truncated (not only those kept at full resolution).
  uint64_t sample_count() const { return sample_count_; }
  // Points held at full resolution, and downsampled buckets held.
  size_t recent_size() const;
  size_t history_size() const;
  // Bytes this series holds now.
  size_t MemoryBytes() const;
  // Bytes a series with these options holds at most (once full, with values that do not
  // compress at all).
  static size_t MaxMemoryBytes(const SeriesOptions& options);
  // Bytes a series that reported holds at least, growth refused or not: its coding state and a
  // chunk each of recent points and history.
  static size_t FloorBytes();

  // Cache hints for an owner that appends to many series in turn (runs::Run), whose states
  // outgrow the caches: issued a few series ahead, in this order and a series or more apart, each
  // reads only what the one before brought in (the first, this object), so that the misses of
  // several series overlap instead of stalling each Append in turn. They change nothing.
  void PrefetchHeld() const {
    if (!held_) return;
    const char* p = reinterpret_cast<const char*>(held_.get());
    for (size_t offset = 0; offset < sizeof(Held); offset += 64) PrefetchRead(p + offset);
  }
  void PrefetchSlots() const {
    if (!held_) return;
    held_->recent.PrefetchSlots();
    if (held_->recent.size() >= options_.recent_points) held_->history.PrefetchSlots();
  }
  void PrefetchWords() const {
    if (!held_) return;
    held_->recent.PrefetchWords();
  }

  // Writes the state (everything but the options, and the options for LoadState to check) for
  // LoadState.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this object, constructed with the same options as the one
  // saved. False (with in.Fail(...) called, the reader failed) when the bytes are damaged or were
  // written by a series with other options; the object is then left in an unspecified but valid,
  // destructible state: the caller discards it. The points read must fit the options and add up
  // to sample_count(). As PointLog::LoadState says, the series loaded holds no spare chunk: its
  // MemoryBytes() may be below the original's and its NextGrowthBytes() above, and with growth
  // refused (Append's may_grow) it may move points to history sooner than the original would; with
  // growth allowed, every later call returns what the original's would.
  bool LoadState(StateReader& in);

 private:
  // Moves a point evicted from recent_ into the newest history bucket, or opens a new one.
  void PushHistory(const Point& evicted, bool may_grow);
  // Merges adjacent history buckets pairwise and doubles bucket_width_.
  void CompactHistory();

  // What a series holds once it has reported (a series that never reports costs sizeof(Series)).
  struct Held {
    // The newest samples, at most options_.recent_points.
    PointLog recent;
    // Buckets older than open_bucket, oldest first; with it at most options_.history_buckets.
    PointLog history;
    // The newest bucket (while has_open_bucket): evicted points merge into it while it covers
    // fewer than bucket_width samples.
    Point open_bucket;
    bool has_open_bucket = false;
    uint64_t bucket_width = 1;  // samples per history bucket
  };

  SeriesOptions options_;
  std::unique_ptr<Held> held_;  // null until the first Append
  uint64_t sample_count_ = 0;
  uint64_t last_step_ = 0;
};

}  // namespace gradwatch::store

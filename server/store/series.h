// In-memory series with bounded memory: the most recent points at full resolution, older ones
// merged into buckets that keep min, max and mean so spikes survive downsampling.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace gradwatch::store {

// Capacities below 2 are raised to 2.
struct SeriesOptions {
  // Points kept at full resolution (≥ 2).
  size_t recent_points = 4096;
  // Downsampled buckets kept for older history (≥ 2). When they are all used, adjacent buckets
  // are merged pairwise (halving resolution) so the whole history stays within the bound.
  size_t history_buckets = 1024;
};

// A point covers the steps [step, last_step]; at full resolution step == last_step, count == 1.
struct Point {
  uint64_t step = 0;
  uint64_t last_step = 0;
  double mean = 0;  // mean of the finite samples; NaN when none was finite
  double min = 0;   // of the finite samples; NaN when none was finite
  double max = 0;
  uint32_t count = 0;      // samples covered
  uint32_t nonfinite = 0;  // of which NaN or ±Inf
  // The last sample's value (NaN/Inf kept as is); equals mean at full resolution.
  double last = 0;
};

// Not thread-safe: the owner serialises access. Memory grows with the samples held, not with the
// options: a new series allocates nothing; its buffers grow by doubling (from 8 points) as samples
// arrive, up to recent_points and history_buckets, and from then on Append never allocates. An
// owner with a memory budget may refuse growth (Append's may_grow): the series then keeps its
// current buffers (8 points at least) and downsamples into history sooner, losing no sample.
class Series {
 public:
  explicit Series(const SeriesOptions& options = {});

  // Appends a sample. Steps must strictly increase: returns false and keeps nothing otherwise.
  // NaN and ±Inf are kept (counted in `nonfinite`). With may_grow false the buffers grow no
  // further than their first 8 points (see the class comment).
  bool Append(uint64_t step, double value, bool may_grow = true);
  // Bytes the next Append may allocate (0 when it will not grow): what an owner with a budget
  // reserves before it.
  size_t NextGrowthBytes() const;

  // Drops every point covering a step ≥ from_step (a rewind to a checkpoint: those steps belong
  // to an abandoned branch). A downsampled bucket that straddles from_step (its first step below
  // it, its last at or above it) is dropped whole, since its mean, min and max cannot be split:
  // no abandoned value is ever shown, at the cost of up to one bucket of older history just
  // before from_step. Later appends need only exceed the newest kept step. Returns the samples
  // dropped. O(points held).
  uint64_t TruncateFrom(uint64_t from_step);

  // The newest sample (or, after a truncation emptied the recent points, the newest bucket), if
  // any.
  std::optional<Point> Latest() const;

  // Points overlapping [from_step, to_step], oldest first: history buckets, then recent points.
  // With max_points > 0 the result is merged into at most max_points points: the matching points
  // are split into max_points runs of (nearly) equal length and each run is combined by MergeInto,
  // so a one-step spike keeps its min/max. Empty when from_step > to_step.
  std::vector<Point> Query(uint64_t from_step, uint64_t to_step, size_t max_points = 0) const;

  // Samples appended and not truncated (not only those kept at full resolution).
  uint64_t sample_count() const { return sample_count_; }
  // Bytes this series holds now.
  size_t MemoryBytes() const;
  // Bytes a series with these options holds at most (once full).
  static size_t MaxMemoryBytes(const SeriesOptions& options);

 private:
  static constexpr size_t kFirstAllocation = 8;
  // The next buffer size: doubled, at least kFirstAllocation, at most capacity.
  static size_t GrownSize(size_t size, size_t capacity);

  // Merges a point evicted from recent_ into the newest history bucket, or opens a new one.
  void PushHistory(const Point& evicted, bool may_grow);
  // Whether a full buffer grows now rather than wrapping (recent_) or compacting (history_).
  bool RecentMayGrow(bool may_grow) const;
  bool HistoryMayGrow(bool may_grow) const;
  // Merges adjacent history buckets pairwise and doubles bucket_width_.
  void CompactHistory();

  SeriesOptions options_;
  // Ring buffer of recent_.size() slots, at most options_.recent_points; unwrapped when it grows.
  std::vector<Point> recent_;
  size_t recent_start_ = 0;     // index of the oldest
  size_t recent_size_ = 0;
  // Buckets, oldest first, at most options_.history_buckets. It only grows at the end and is
  // compacted in place when full and not growing, so unlike recent_ it needs no ring offset.
  std::vector<Point> history_;
  size_t history_size_ = 0;
  uint64_t bucket_width_ = 1;   // samples per history bucket
  uint64_t sample_count_ = 0;
  uint64_t last_step_ = 0;
};

// Combines b (later) into a (earlier): a covers [a.step, b.last_step] afterwards; counts add,
// mean is weighted by finite counts, min/max ignore non-finite samples, last becomes b.last.
// A point with count 0 is treated as empty.
void MergeInto(Point& a, const Point& b);

}  // namespace gradwatch::store

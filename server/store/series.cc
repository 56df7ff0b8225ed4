#include "server/store/series.h"

#include <algorithm>

namespace gradwatch::store {
namespace {

SeriesOptions Sanitised(SeriesOptions options) {
  // Below two slots neither the ring nor pairwise compaction can make progress.
  options.recent_points = std::max<size_t>(options.recent_points, 2);
  options.history_buckets = std::max<size_t>(options.history_buckets, 2);
  return options;
}

}  // namespace

Series::Series(const SeriesOptions& options) : options_(Sanitised(options)) {}

size_t Series::NextGrowthBytes() const {
  size_t bytes = recent_.NextGrowthBytes();
  // A full ring evicts its oldest point into history, which may flush the open bucket.
  if (recent_.size() + 1 >= options_.recent_points) bytes += history_.NextGrowthBytes();
  return bytes;
}

bool Series::Append(uint64_t step, double value, bool may_grow) {
  if (sample_count_ > 0 && step <= last_step_) return false;
  const Point point = SamplePoint(step, value);
  if (recent_.size() >= options_.recent_points) PushHistory(recent_.PopFront(), may_grow);
  // Refused a chunk, the oldest points go to history until one is emptied (the last one held
  // empties with the log, so this ends).
  while (!recent_.Append(point, may_grow || recent_.chunks_allocated() == 0)) {
    PushHistory(recent_.PopFront(), may_grow);
  }
  ++sample_count_;
  last_step_ = step;
  return true;
}

void Series::PushHistory(const Point& evicted, bool may_grow) {
  if (has_open_bucket_ && open_bucket_.count < bucket_width_) {
    MergeInto(open_bucket_, evicted);
    return;
  }
  if (!has_open_bucket_) {
    open_bucket_ = evicted;
    has_open_bucket_ = true;
    return;
  }
  if (history_size() >= options_.history_buckets) {
    CompactHistory();
    // After compaction with an odd count the unpaired newest bucket is only half full.
    if (open_bucket_.count < bucket_width_) {
      MergeInto(open_bucket_, evicted);
      return;
    }
  }
  // The full open bucket joins the compressed ones and the evicted point opens the next.
  if (!history_.Append(open_bucket_, may_grow || history_.chunks_allocated() == 0)) {
    // Refused a chunk: halving the buckets frees room in the chunks held.
    CompactHistory();
    if (open_bucket_.count < bucket_width_) {
      MergeInto(open_bucket_, evicted);
      return;
    }
    // Buckets that compress badly may still not fit after one compaction: a chunk is allocated
    // rather than a sample lost (the growth is charged like any other).
    history_.Append(open_bucket_, true);
  }
  open_bucket_ = evicted;
}

void Series::CompactHistory() {
  // Decoded into a scratch buffer kept by the thread, so compaction allocates only on a thread's
  // first use (or a larger history than it has seen).
  thread_local std::vector<Point> scratch;
  scratch.clear();
  history_.ForEach([](const Point& p) { scratch.push_back(p); });
  if (has_open_bucket_) scratch.push_back(open_bucket_);
  history_.Clear();
  has_open_bucket_ = false;
  for (size_t i = 0; i < scratch.size(); i += 2) {
    Point merged = scratch[i];
    if (i + 1 < scratch.size()) MergeInto(merged, scratch[i + 1]);
    if (has_open_bucket_) history_.Append(open_bucket_, true);
    open_bucket_ = merged;
    has_open_bucket_ = true;
  }
  bucket_width_ *= 2;
}

uint64_t Series::TruncateFrom(uint64_t from_step) {
  uint64_t dropped = 0;
  // Recent points are ordered and newer than every bucket: keep those before from_step.
  size_t keep = 0;
  recent_.ForEach([&](const Point& p) { keep += p.last_step < from_step ? 1 : 0; });
  dropped += recent_.size() - keep;
  recent_.Truncate(keep);
  if (recent_.empty() && has_open_bucket_ && open_bucket_.last_step >= from_step) {
    dropped += open_bucket_.count;
    has_open_bucket_ = false;
    size_t kept_buckets = 0;
    history_.ForEach([&](const Point& p) {
      if (p.last_step < from_step) {
        ++kept_buckets;
      } else {
        dropped += p.count;
      }
    });
    history_.Truncate(kept_buckets);
    if (!history_.empty()) {
      // The newest kept bucket is open again (it may be short of bucket_width_).
      open_bucket_ = history_.Back();
      has_open_bucket_ = true;
      history_.Truncate(history_.size() - 1);
    }
  }
  sample_count_ -= dropped;
  if (const auto latest = Latest()) {
    last_step_ = latest->last_step;
  } else {
    sample_count_ = 0;
    last_step_ = 0;
  }
  return dropped;
}

std::optional<Point> Series::Latest() const {
  if (!recent_.empty()) return recent_.Back();
  if (has_open_bucket_) return open_bucket_;
  return std::nullopt;
}

std::vector<Point> Series::Query(uint64_t from_step, uint64_t to_step, size_t max_points) const {
  std::vector<Point> result;
  if (from_step > to_step) return result;
  const auto add = [&](const Point& p) {
    if (p.last_step >= from_step && p.step <= to_step) result.push_back(p);
  };
  result.reserve(history_size() + recent_.size());
  history_.ForEach(add);
  if (has_open_bucket_) add(open_bucket_);
  recent_.ForEach(add);

  const size_t n = result.size();
  if (max_points == 0 || n <= max_points) return result;
  // Run k covers [k*n/m, (k+1)*n/m): its first index is ≥ k, so merging in place is safe.
  for (size_t k = 0; k < max_points; ++k) {
    const size_t begin = k * n / max_points;
    const size_t end = (k + 1) * n / max_points;
    Point merged = result[begin];
    for (size_t i = begin + 1; i < end; ++i) MergeInto(merged, result[i]);
    result[k] = merged;
  }
  result.resize(max_points);
  return result;
}

size_t Series::MemoryBytes() const {
  return sizeof(*this) + recent_.MemoryBytes() + history_.MemoryBytes();
}

size_t Series::MaxMemoryBytes(const SeriesOptions& options) {
  const SeriesOptions o = Sanitised(options);
  return sizeof(Series) + PointLog::MaxMemoryBytes(o.recent_points, PointLog::kMaxSampleBits) +
         PointLog::MaxMemoryBytes(o.history_buckets, PointLog::kMaxBucketBits);
}

}  // namespace gradwatch::store

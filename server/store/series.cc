#include "server/store/series.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace gradwatch::store {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Point SamplePoint(uint64_t step, double value) {
  Point p;
  p.step = step;
  p.last_step = step;
  p.count = 1;
  p.last = value;
  if (std::isfinite(value)) {
    p.mean = p.min = p.max = value;
  } else {
    p.nonfinite = 1;
    p.mean = p.min = p.max = kNaN;
  }
  return p;
}

SeriesOptions Sanitised(SeriesOptions options) {
  // Below two slots neither the ring nor pairwise compaction can make progress.
  options.recent_points = std::max<size_t>(options.recent_points, 2);
  options.history_buckets = std::max<size_t>(options.history_buckets, 2);
  return options;
}

}  // namespace

void MergeInto(Point& a, const Point& b) {
  if (b.count == 0) return;
  if (a.count == 0) {
    a = b;
    return;
  }
  const uint64_t finite_a = a.count - a.nonfinite;
  const uint64_t finite_b = b.count - b.nonfinite;
  if (finite_a == 0) {
    a.mean = b.mean;
    a.min = b.min;
    a.max = b.max;
  } else if (finite_b != 0) {
    // Incremental form: stays within [min, max] and does not overflow for large magnitudes.
    a.mean += (b.mean - a.mean) * (static_cast<double>(finite_b) /
                                   static_cast<double>(finite_a + finite_b));
    a.min = std::min(a.min, b.min);
    a.max = std::max(a.max, b.max);
  }
  a.last_step = b.last_step;
  a.count += b.count;
  a.nonfinite += b.nonfinite;
  a.last = b.last;
}

Series::Series(const SeriesOptions& options) : options_(Sanitised(options)) {}

size_t Series::GrownSize(size_t size, size_t capacity) {
  return std::min(capacity, std::max(kFirstAllocation, size * 2));
}

bool Series::RecentMayGrow(bool may_grow) const {
  return recent_size_ == recent_.size() && recent_.size() < options_.recent_points &&
         (may_grow || recent_.empty());
}

bool Series::HistoryMayGrow(bool may_grow) const {
  return history_size_ == history_.size() && history_.size() < options_.history_buckets &&
         (may_grow || history_.empty());
}

size_t Series::NextGrowthBytes() const {
  if (RecentMayGrow(true)) {
    return (GrownSize(recent_.size(), options_.recent_points) - recent_.size()) * sizeof(Point);
  }
  if (recent_size_ == recent_.size() && HistoryMayGrow(true)) {
    return (GrownSize(history_.size(), options_.history_buckets) - history_.size()) * sizeof(Point);
  }
  return 0;
}

bool Series::Append(uint64_t step, double value, bool may_grow) {
  if (sample_count_ > 0 && step <= last_step_) return false;
  const Point point = SamplePoint(step, value);
  if (RecentMayGrow(may_grow)) {
    // A ring that wrapped at a smaller size (growth refused) is unwrapped first, keeping its order.
    std::rotate(recent_.begin(), recent_.begin() + static_cast<std::ptrdiff_t>(recent_start_), recent_.end());
    recent_start_ = 0;
    const size_t grown = GrownSize(recent_.size(), options_.recent_points);
    recent_.reserve(grown);
    recent_.resize(grown);
  }
  const size_t capacity = recent_.size();
  if (recent_size_ < capacity) {
    recent_[(recent_start_ + recent_size_) % capacity] = point;
    ++recent_size_;
  } else {
    PushHistory(recent_[recent_start_], may_grow);
    recent_[recent_start_] = point;
    recent_start_ = (recent_start_ + 1) % capacity;
  }
  ++sample_count_;
  last_step_ = step;
  return true;
}

void Series::PushHistory(const Point& evicted, bool may_grow) {
  const auto newest_is_open = [this] {
    return history_size_ > 0 && history_[history_size_ - 1].count < bucket_width_;
  };
  if (!newest_is_open() && history_size_ == history_.size()) {
    if (HistoryMayGrow(may_grow)) {
      const size_t grown = GrownSize(history_.size(), options_.history_buckets);
      history_.reserve(grown);
      history_.resize(grown);
    } else {
      CompactHistory();
    }
  }
  // After compaction with an odd capacity the unpaired newest bucket is only half full.
  if (newest_is_open()) {
    MergeInto(history_[history_size_ - 1], evicted);
  } else {
    history_[history_size_++] = evicted;
  }
}

void Series::CompactHistory() {
  // Writing to k while reading 2k and 2k+1 never overwrites a bucket not yet read.
  size_t out = 0;
  for (size_t i = 0; i < history_size_; i += 2, ++out) {
    Point merged = history_[i];
    if (i + 1 < history_size_) MergeInto(merged, history_[i + 1]);
    history_[out] = merged;
  }
  history_size_ = out;
  bucket_width_ *= 2;
}

uint64_t Series::TruncateFrom(uint64_t from_step) {
  uint64_t dropped = 0;
  // Recent points are ordered and newer than every bucket: drop from the newest end.
  while (recent_size_ > 0) {
    const Point& newest = recent_[(recent_start_ + recent_size_ - 1) % recent_.size()];
    if (newest.last_step < from_step) break;
    dropped += newest.count;
    --recent_size_;
  }
  if (recent_size_ == 0) {
    recent_start_ = 0;
    while (history_size_ > 0 && history_[history_size_ - 1].last_step >= from_step) {
      dropped += history_[history_size_ - 1].count;
      --history_size_;
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
  if (recent_size_ == 0) {
    if (history_size_ == 0) return std::nullopt;
    return history_[history_size_ - 1];
  }
  return recent_[(recent_start_ + recent_size_ - 1) % recent_.size()];
}

std::vector<Point> Series::Query(uint64_t from_step, uint64_t to_step, size_t max_points) const {
  std::vector<Point> result;
  if (from_step > to_step) return result;
  const auto overlaps = [&](const Point& p) {
    return p.last_step >= from_step && p.step <= to_step;
  };
  result.reserve(history_size_ + recent_size_);
  for (size_t i = 0; i < history_size_; ++i) {
    if (overlaps(history_[i])) result.push_back(history_[i]);
  }
  for (size_t i = 0; i < recent_size_; ++i) {
    const Point& p = recent_[(recent_start_ + i) % recent_.size()];
    if (overlaps(p)) result.push_back(p);
  }

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
  return sizeof(*this) + (recent_.capacity() + history_.capacity()) * sizeof(Point);
}

size_t Series::MaxMemoryBytes(const SeriesOptions& options) {
  const SeriesOptions o = Sanitised(options);
  return sizeof(Series) + (o.recent_points + o.history_buckets) * sizeof(Point);
}

}  // namespace gradwatch::store

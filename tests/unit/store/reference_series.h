// The uncompressed series store::Series replaced (a ring of Points and an array of buckets), kept
// as the reference model its tests compare with. Growth is never refused here: a store::Series
// whose growth is never refused must hold exactly the same points.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "server/store/point.h"

namespace gradwatch::store::testing {

class ReferenceSeries {
 public:
  ReferenceSeries(size_t recent_points, size_t history_buckets)
      : recent_(std::max<size_t>(recent_points, 2)), history_(std::max<size_t>(history_buckets, 2)) {}

  bool Append(uint64_t step, double value) {
    if (sample_count_ > 0 && step <= last_step_) return false;
    const Point point = SamplePoint(step, value);
    if (recent_size_ < recent_.size()) {
      recent_[(recent_start_ + recent_size_) % recent_.size()] = point;
      ++recent_size_;
    } else {
      PushHistory(recent_[recent_start_]);
      recent_[recent_start_] = point;
      recent_start_ = (recent_start_ + 1) % recent_.size();
    }
    ++sample_count_;
    last_step_ = step;
    return true;
  }

  uint64_t TruncateFrom(uint64_t from_step) {
    uint64_t dropped = 0;
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

  std::optional<Point> Latest() const {
    if (recent_size_ == 0) {
      if (history_size_ == 0) return std::nullopt;
      return history_[history_size_ - 1];
    }
    return recent_[(recent_start_ + recent_size_ - 1) % recent_.size()];
  }

  // Every point held, oldest first.
  std::vector<Point> All() const {
    std::vector<Point> out(history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(history_size_));
    for (size_t i = 0; i < recent_size_; ++i) out.push_back(recent_[(recent_start_ + i) % recent_.size()]);
    return out;
  }
  uint64_t sample_count() const { return sample_count_; }

 private:
  void PushHistory(const Point& evicted) {
    const auto newest_is_open = [this] {
      return history_size_ > 0 && history_[history_size_ - 1].count < bucket_width_;
    };
    if (!newest_is_open() && history_size_ == history_.size()) {
      size_t out = 0;
      for (size_t i = 0; i < history_size_; i += 2, ++out) {
        Point merged = history_[i];
        if (i + 1 < history_size_) MergeInto(merged, history_[i + 1]);
        history_[out] = merged;
      }
      history_size_ = out;
      bucket_width_ *= 2;
    }
    if (newest_is_open()) {
      MergeInto(history_[history_size_ - 1], evicted);
    } else {
      history_[history_size_++] = evicted;
    }
  }

  std::vector<Point> recent_;
  size_t recent_start_ = 0;
  size_t recent_size_ = 0;
  std::vector<Point> history_;
  size_t history_size_ = 0;
  uint64_t bucket_width_ = 1;
  uint64_t sample_count_ = 0;
  uint64_t last_step_ = 0;
};

}  // namespace gradwatch::store::testing

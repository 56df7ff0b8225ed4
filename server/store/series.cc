#include "server/store/series.h"

#include <algorithm>
#include <bit>

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
  if (!held_) return sizeof(Held) + PointLog().NextGrowthBytes();
  size_t bytes = held_->recent.NextGrowthBytes();
  // A full ring evicts its oldest point into history, which may flush the open bucket.
  if (held_->recent.size() + 1 >= options_.recent_points) bytes += held_->history.NextGrowthBytes();
  return bytes;
}

bool Series::Append(uint64_t step, double value, bool may_grow) {
  if (sample_count_ > 0 && step <= last_step_) return false;
  if (!held_) held_ = std::make_unique<Held>();
  if (held_->recent.size() >= options_.recent_points) PushHistory(held_->recent.PopFront(), may_grow);
  // Refused a chunk, the oldest points go to history until one is emptied (the last one held
  // empties with the log, so this ends).
  while (!held_->recent.AppendSample(step, value, may_grow || held_->recent.chunks_allocated() == 0)) {
    PushHistory(held_->recent.PopFront(), may_grow);
  }
  ++sample_count_;
  last_step_ = step;
  return true;
}

void Series::PushHistory(const Point& evicted, bool may_grow) {
  if (held_->has_open_bucket && held_->open_bucket.count < held_->bucket_width) {
    MergeInto(held_->open_bucket, evicted);
    return;
  }
  if (!held_->has_open_bucket) {
    held_->open_bucket = evicted;
    held_->has_open_bucket = true;
    return;
  }
  if (history_size() >= options_.history_buckets) {
    CompactHistory();
    // After compaction with an odd count the unpaired newest bucket is only half full.
    if (held_->open_bucket.count < held_->bucket_width) {
      MergeInto(held_->open_bucket, evicted);
      return;
    }
  }
  // The full open bucket joins the compressed ones and the evicted point opens the next.
  if (!held_->history.Append(held_->open_bucket, may_grow || held_->history.chunks_allocated() == 0)) {
    // Refused a chunk: halving the buckets frees room in the chunks held.
    CompactHistory();
    if (held_->open_bucket.count < held_->bucket_width) {
      MergeInto(held_->open_bucket, evicted);
      return;
    }
    // Buckets that compress badly may still not fit after one compaction: a chunk is allocated
    // rather than a sample lost (the growth is charged like any other).
    held_->history.Append(held_->open_bucket, true);
  }
  held_->open_bucket = evicted;
}

void Series::CompactHistory() {
  // Decoded into a scratch buffer kept by the thread, so compaction allocates only on a thread's
  // first use (or a larger history than it has seen).
  thread_local std::vector<Point> scratch;
  scratch.clear();
  held_->history.ForEach([](const Point& p) { scratch.push_back(p); });
  if (held_->has_open_bucket) scratch.push_back(held_->open_bucket);
  held_->history.Clear();
  held_->has_open_bucket = false;
  for (size_t i = 0; i < scratch.size(); i += 2) {
    Point merged = scratch[i];
    if (i + 1 < scratch.size()) MergeInto(merged, scratch[i + 1]);
    if (held_->has_open_bucket) held_->history.Append(held_->open_bucket, true);
    held_->open_bucket = merged;
    held_->has_open_bucket = true;
  }
  held_->bucket_width *= 2;
}

uint64_t Series::TruncateFrom(uint64_t from_step) {
  if (!held_) return 0;
  uint64_t dropped = 0;
  // Recent points are ordered and newer than every bucket: keep those before from_step.
  size_t keep = 0;
  held_->recent.ForEach([&](const Point& p) { keep += p.last_step < from_step ? 1 : 0; });
  dropped += held_->recent.size() - keep;
  held_->recent.Truncate(keep);
  if (held_->recent.empty() && held_->has_open_bucket && held_->open_bucket.last_step >= from_step) {
    dropped += held_->open_bucket.count;
    held_->has_open_bucket = false;
    size_t kept_buckets = 0;
    held_->history.ForEach([&](const Point& p) {
      if (p.last_step < from_step) {
        ++kept_buckets;
      } else {
        dropped += p.count;
      }
    });
    held_->history.Truncate(kept_buckets);
    if (!held_->history.empty()) {
      // The newest kept bucket is open again (it may be short of bucket_width).
      held_->open_bucket = held_->history.Back();
      held_->has_open_bucket = true;
      held_->history.Truncate(held_->history.size() - 1);
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
  if (!held_) return std::nullopt;
  if (!held_->recent.empty()) return held_->recent.Back();
  if (held_->has_open_bucket) return held_->open_bucket;
  return std::nullopt;
}

std::vector<Point> Series::Query(uint64_t from_step, uint64_t to_step, size_t max_points) const {
  std::vector<Point> result;
  if (!held_ || from_step > to_step) return result;
  const auto add = [&](const Point& p) {
    if (p.last_step >= from_step && p.step <= to_step) result.push_back(p);
  };
  result.reserve(history_size() + held_->recent.size());
  held_->history.ForEach(add);
  if (held_->has_open_bucket) add(held_->open_bucket);
  held_->recent.ForEach(add);

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
  if (!held_) return sizeof(*this);
  return sizeof(*this) + sizeof(Held) + held_->recent.MemoryBytes() + held_->history.MemoryBytes();
}

size_t Series::FloorBytes() { return sizeof(Series) + sizeof(Held) + 2 * PointLog::OneChunkBytes(); }

size_t Series::recent_size() const { return held_ ? held_->recent.size() : 0; }

size_t Series::history_size() const { return held_ ? held_->history.size() + (held_->has_open_bucket ? 1 : 0) : 0; }

void Series::SaveState(StateWriter& out) const {
  out.Put<uint64_t>(options_.recent_points);
  out.Put<uint64_t>(options_.history_buckets);
  out.Put<uint8_t>(held_ ? 1 : 0);
  if (held_) {
    held_->recent.SaveState(out);
    held_->history.SaveState(out);
    // A stale open bucket (none held) is written as an empty one, so that equal series give equal
    // bytes.
    out.Put(held_->has_open_bucket ? held_->open_bucket : Point{});
    out.Put<uint8_t>(held_->has_open_bucket ? 1 : 0);
    out.Put(held_->bucket_width);
  }
  out.Put(sample_count_);
  out.Put(last_step_);
}

bool Series::LoadState(StateReader& in) {
  uint64_t recent_points = 0, history_buckets = 0;
  bool has_held = false;
  if (!in.Get(recent_points) || !in.Get(history_buckets) || !in.GetBool(has_held)) return false;
  if (recent_points != options_.recent_points || history_buckets != options_.history_buckets) {
    return in.Fail("a series was saved with other options");
  }
  held_.reset();
  uint64_t samples = 0;  // what the points held cover
  if (has_held) {
    held_ = std::make_unique<Held>();
    if (!held_->recent.LoadState(in) || !held_->history.LoadState(in) || !in.Get(held_->open_bucket) ||
        !in.GetBool(held_->has_open_bucket) || !in.Get(held_->bucket_width)) {
      return false;
    }
    // Append keeps to these bounds, and buckets only ever double.
    if (held_->recent.size() > options_.recent_points || history_size() > options_.history_buckets ||
        !std::has_single_bit(held_->bucket_width) || (!held_->has_open_bucket && !held_->history.empty())) {
      return in.Fail("a series' points do not fit its options or its buckets");
    }
    const auto add = [&](const Point& p) { samples += p.count; };
    held_->recent.ForEach(add);
    held_->history.ForEach(add);
    if (held_->has_open_bucket) add(held_->open_bucket);
  }
  if (!in.Get(sample_count_) || !in.Get(last_step_)) return false;
  const std::optional<Point> latest = Latest();
  if (samples != sample_count_ || (latest ? latest->last_step : 0) != last_step_) {
    return in.Fail("a series' sample count or last step is not its points'");
  }
  return true;
}

size_t Series::MaxMemoryBytes(const SeriesOptions& options) {
  const SeriesOptions o = Sanitised(options);
  return sizeof(Series) + sizeof(Held) + PointLog::MaxMemoryBytes(o.recent_points, PointLog::kMaxSampleBits) +
         PointLog::MaxMemoryBytes(o.history_buckets, PointLog::kMaxBucketBits);
}

}  // namespace gradwatch::store

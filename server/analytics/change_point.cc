#include "server/analytics/change_point.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>

#include "server/analytics/regression.h"

namespace gradwatch::analytics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

ChangePointOptions Sanitised(ChangePointOptions o) {
  const ChangePointOptions defaults;
  o.window_steps = std::max<uint64_t>(o.window_steps, 2);
  o.buckets_per_window = std::max<uint32_t>(o.buckets_per_window, 2);
  if (o.min_segment_steps == 0) o.min_segment_steps = o.window_steps / 3;
  o.min_segment_steps = std::clamp<uint64_t>(o.min_segment_steps, 1, o.window_steps);
  o.min_samples = std::max<uint32_t>(o.min_samples, 3);
  o.prefilter_samples = std::clamp<uint32_t>(o.prefilter_samples, 1, 9);
  if (o.prefilter_samples % 2 == 0) ++o.prefilter_samples;
  if (!(o.z_threshold >= 0)) o.z_threshold = std::isnan(o.z_threshold) ? defaults.z_threshold : 0;
  if (!(o.min_relative_change >= 0)) {
    o.min_relative_change = std::isnan(o.min_relative_change) ? defaults.min_relative_change : 0;
  }
  o.persistence = std::max<uint32_t>(o.persistence, 1);
  o.max_changes = std::max<size_t>(o.max_changes, 1);
  return o;
}

// The options written by SaveState, field by field (the struct has padding).
void PutOptions(StateWriter& out, const ChangePointOptions& o) {
  out.Put(o.window_steps);
  out.Put(o.buckets_per_window);
  out.Put(o.min_segment_steps);
  out.Put(o.min_samples);
  out.Put(o.prefilter_samples);
  out.Put(o.z_threshold);
  out.Put(o.min_relative_change);
  out.Put(o.persistence);
  out.Put<uint64_t>(o.max_changes);
}

// Reads options written by PutOptions; false, `in` failed, unless they equal `expected` (the
// doubles bit for bit).
bool GetOptionsEqual(StateReader& in, const ChangePointOptions& expected) {
  ChangePointOptions o;
  uint64_t max_changes = 0;
  if (!in.Get(o.window_steps) || !in.Get(o.buckets_per_window) || !in.Get(o.min_segment_steps) ||
      !in.Get(o.min_samples) || !in.Get(o.prefilter_samples) || !in.Get(o.z_threshold) ||
      !in.Get(o.min_relative_change) || !in.Get(o.persistence) || !in.Get(max_changes)) {
    return false;
  }
  const bool equal =
      o.window_steps == expected.window_steps && o.buckets_per_window == expected.buckets_per_window &&
      o.min_segment_steps == expected.min_segment_steps && o.min_samples == expected.min_samples &&
      o.prefilter_samples == expected.prefilter_samples &&
      std::bit_cast<uint64_t>(o.z_threshold) == std::bit_cast<uint64_t>(expected.z_threshold) &&
      std::bit_cast<uint64_t>(o.min_relative_change) == std::bit_cast<uint64_t>(expected.min_relative_change) &&
      o.persistence == expected.persistence && max_changes == expected.max_changes;
  return equal ? true : in.Fail("a change detector was saved with other options");
}

// Above this z the data reject a kink in favour of two free lines (a level shift).
constexpr double kLevelShiftZ = 3.0;

double ZScore(double diff, double se) {
  if (se > 0) return std::abs(diff) / se;
  return diff != 0 ? kInf : 0.0;
}

}  // namespace

void SlopeChangeDetector::Moments::Add(double x, double y) {
  n += 1;
  const double dx = x - mean_x;
  const double dy = y - mean_y;
  mean_x += dx / n;
  mean_y += dy / n;
  cxx += dx * (x - mean_x);
  cxy += dx * (y - mean_y);
  cyy += dy * (y - mean_y);
}

void SlopeChangeDetector::Moments::Merge(const Moments& other) {
  if (other.n == 0) return;
  if (n == 0) {
    *this = other;
    return;
  }
  const double total = n + other.n;
  const double dx = other.mean_x - mean_x;
  const double dy = other.mean_y - mean_y;
  const double weight = n * other.n / total;
  mean_x += dx * (other.n / total);
  mean_y += dy * (other.n / total);
  cxx += other.cxx + dx * dx * weight;
  cxy += other.cxy + dx * dy * weight;
  cyy += other.cyy + dy * dy * weight;
  n = total;
}

SlopeChangeDetector::SlopeChangeDetector(const ChangePointOptions& options) : options_(Sanitised(options)) {
  bucket_steps_ = std::max<uint64_t>(1, options_.window_steps / options_.buckets_per_window);
  span_buckets_ = std::max<uint64_t>(2, (2 * options_.window_steps + bucket_steps_ - 1) / bucket_steps_);
  block_values_.resize(options_.prefilter_samples);
  block_sorted_.resize(options_.prefilter_samples);
  block_steps_.resize(options_.prefilter_samples);
  buckets_.resize(span_buckets_ + 1);
}

size_t SlopeChangeDetector::MemoryBytesFor(const ChangePointOptions& options) {
  const ChangePointOptions o = Sanitised(options);
  const uint64_t bucket_steps = std::max<uint64_t>(1, o.window_steps / o.buckets_per_window);
  const uint64_t span = std::max<uint64_t>(2, (2 * o.window_steps + bucket_steps - 1) / bucket_steps);
  return sizeof(SlopeChangeDetector) + o.prefilter_samples * (2 * sizeof(double) + sizeof(uint64_t)) +
         (span + 1) * sizeof(Bucket) + o.max_changes * sizeof(ChangePoint);
}

std::optional<ChangePoint> SlopeChangeDetector::AddSample(uint64_t step, double value) {
  if (have_step_ && step <= last_step_) return std::nullopt;
  have_step_ = true;
  last_step_ = step;
  if (!std::isfinite(value)) return std::nullopt;

  block_values_[block_size_] = value;
  block_steps_[block_size_] = step;
  if (++block_size_ < block_values_.size()) return std::nullopt;
  block_size_ = 0;
  std::copy(block_values_.begin(), block_values_.end(), block_sorted_.begin());
  const size_t middle = block_sorted_.size() / 2;
  std::nth_element(block_sorted_.begin(), block_sorted_.begin() + middle, block_sorted_.end());
  return AddPoint(block_steps_[middle], block_sorted_[middle], step);
}

std::optional<ChangePoint> SlopeChangeDetector::AddPoint(uint64_t step, double value, uint64_t now_step) {
  const uint64_t index = step / bucket_steps_;
  std::optional<ChangePoint> detected;
  if (!have_point_ || index != open_bucket_) {
    // Points arrive in step order, so a new index closes every bucket before it. Slots are
    // reused lazily: a slot whose index differs from the one asked for reads as empty.
    const bool first = !have_point_;
    have_point_ = true;
    open_bucket_ = index;
    Bucket& open = BucketAt(index);
    open.index = index;
    open.moments = {};
    if (first) {
      baseline_bucket_ = index;
    } else {
      detected = Evaluate(now_step);
    }
  }
  BucketAt(index).moments.Add(static_cast<double>(step), value);
  return detected;
}

SlopeChangeDetector::SplitFit SlopeChangeDetector::FitTwoLines(const Moments& before, const Moments& after) {
  SplitFit fit;
  fit.slope_before = before.cxy / before.cxx;
  fit.slope_after = after.cxy / after.cxx;
  // cyy − cxy²/cxx cancels for a near-perfect line; rounding may leave it slightly negative.
  fit.rss = std::max(0.0, before.cyy - before.cxy * fit.slope_before) +
            std::max(0.0, after.cyy - after.cxy * fit.slope_after);
  // One residual variance for both sides (as in the Chow test): far steadier than each side's own
  // when a side holds few points.
  const double variance = fit.rss / (before.n + after.n - 4);
  const double se = std::sqrt(variance * (1 / before.cxx + 1 / after.cxx));
  fit.z = ZScore(fit.slope_after - fit.slope_before, se);
  return fit;
}

SlopeChangeDetector::SplitFit SlopeChangeDetector::FitKink(const Moments& before, const Moments& after, double at) {
  // Model: y = a + b_s·u on side s, with u = x − at, so both lines meet at the break. With each
  // side's moments, m = mean(u) and d = mean(y) − mean(y over both sides):
  //   Σ_s (y − a − b_s·u)² = rss_s(b_s) + n_s·(d_s − a − b_s·m_s)²,
  //   rss_s(b) = rss_free_s + cxx_s·(b − cxy_s/cxx_s)².
  // Setting the derivatives to zero gives b_s = (R_s − a·Q_s)/P_s and a·D = −Σ Q_s·R_s/P_s, with
  // P = Σu² = cxx + n·m², Q = Σu = n·m, R = Σu·(y − ȳ) = cxy + n·m·d, D = N − Σ Q_s²/P_s.
  const double n = before.n + after.n;
  const double mean_y = (before.n * before.mean_y + after.n * after.mean_y) / n;
  struct Side {
    double n, m, d, p, q, r, free_slope, free_rss, cxx;
  };
  auto side = [&](const Moments& s) {
    Side out;
    out.n = s.n;
    out.m = s.mean_x - at;
    out.d = s.mean_y - mean_y;
    out.p = s.cxx + s.n * out.m * out.m;
    out.q = s.n * out.m;
    out.r = s.cxy + s.n * out.m * out.d;
    out.free_slope = s.cxy / s.cxx;
    out.free_rss = std::max(0.0, s.cyy - s.cxy * out.free_slope);
    out.cxx = s.cxx;
    return out;
  };
  const Side b = side(before);
  const Side a = side(after);
  const double det = n - b.q * b.q / b.p - a.q * a.q / a.p;  // = Σ n_s·cxx_s/P_s > 0
  const double value_at_break = -(b.q * b.r / b.p + a.q * a.r / a.p) / det;
  SplitFit fit;
  fit.slope_before = (b.r - value_at_break * b.q) / b.p;
  fit.slope_after = (a.r - value_at_break * a.q) / a.p;
  // Every term is a square: no cancellation.
  auto side_rss = [&](const Side& s, double slope) {
    const double off_slope = slope - s.free_slope;
    const double off_mean = s.d - value_at_break - slope * s.m;
    return s.free_rss + s.cxx * off_slope * off_slope + s.n * off_mean * off_mean;
  };
  fit.rss = side_rss(b, fit.slope_before) + side_rss(a, fit.slope_after);
  // Var(b_after − b_before) = σ²·cᵀ(XᵀX)⁻¹c with c = (0, −1, 1) over (a, b_before, b_after).
  const double v0 = (b.q / b.p - a.q / a.p) / det;
  const double contrast = (1 - a.q * v0) / a.p + (1 + b.q * v0) / b.p;
  const double variance = fit.rss / (n - 3);
  fit.z = ZScore(fit.slope_after - fit.slope_before, std::sqrt(variance * contrast));
  return fit;
}

std::optional<ChangePoint> SlopeChangeDetector::Evaluate(uint64_t now_step) {
  if (refining_) Refine(now_step);

  const std::optional<Candidate> candidate = BestSplit(baseline_bucket_, 0, std::numeric_limits<uint64_t>::max());
  if (!candidate) {
    streak_ = 0;
    return std::nullopt;
  }
  const SplitFit& fit = candidate->fit;
  const double diff = std::abs(fit.slope_after - fit.slope_before);
  const double relative = fit.slope_before != 0 ? diff / std::abs(fit.slope_before) : (diff > 0 ? kInf : 0);
  if (!(fit.z >= options_.z_threshold) || !(relative >= options_.min_relative_change)) {
    streak_ = 0;
    return std::nullopt;
  }
  // A break pinned at the newest or oldest split allowed is not located yet: the after-segment
  // may end (or the before-segment begin) with a jump that a steep slope imitates until the
  // split can reach it.
  if (candidate->pinned) {
    streak_ = 0;
    return std::nullopt;
  }
  // A streak counts evaluations that agree on where the break is; a different break starts anew.
  const uint64_t distance = candidate->break_step > streak_break_ ? candidate->break_step - streak_break_
                                                                  : streak_break_ - candidate->break_step;
  if (streak_ > 0 && distance > options_.min_segment_steps) streak_ = 0;
  ++streak_;
  streak_break_ = candidate->break_step;
  if (streak_ < options_.persistence) return std::nullopt;

  streak_ = 0;
  if (refining_ && !changes_.empty()) changes_.back().settled = true;
  ChangePoint change;
  change.step = candidate->break_step;
  change.slope_before_per_kstep = fit.slope_before * kStepsPerKstep;
  change.slope_after_per_kstep = fit.slope_after * kStepsPerKstep;
  change.ratio = fit.slope_after / fit.slope_before;
  change.z_score = fit.z;
  change.detected_at_step = now_step;
  Record(change);

  // Re-baseline: from now on new changes are searched only after the break, so this one cannot
  // be found again.
  refining_ = true;
  refine_first_bucket_ = std::max(baseline_bucket_, OldestSearched());
  refine_break_bucket_ = candidate->break_step / bucket_steps_;
  baseline_bucket_ = refine_break_bucket_;
  return change;
}

void SlopeChangeDetector::Refine(uint64_t now_step) {
  const uint64_t tolerance = std::max<uint64_t>(1, options_.window_steps / 2 / bucket_steps_);
  const uint64_t min_break = refine_break_bucket_ > tolerance ? refine_break_bucket_ - tolerance : 0;
  const std::optional<Candidate> candidate =
      BestSplit(refine_first_bucket_, min_break, refine_break_bucket_ + tolerance);
  if (candidate && !changes_.empty()) {
    const SplitFit& fit = candidate->fit;
    ChangePoint& change = changes_.back();
    change.step = candidate->break_step;
    change.slope_before_per_kstep = fit.slope_before * kStepsPerKstep;
    change.slope_after_per_kstep = fit.slope_after * kStepsPerKstep;
    change.ratio = fit.slope_after / fit.slope_before;
    change.z_score = fit.z;
    baseline_bucket_ = candidate->break_step / bucket_steps_;
  }
  // Settled once the after-segment covers a window and the break had min_segment_steps more to
  // move (an early first estimate already spans a window), or when no split qualifies any more
  // (the data before the break left the searched span).
  const bool done = candidate && candidate->after_steps >= options_.window_steps && !changes_.empty() &&
                    now_step - changes_.back().detected_at_step >= options_.min_segment_steps;
  if (!candidate || done || changes_.empty()) {
    if (!changes_.empty()) changes_.back().settled = true;
    refining_ = false;
  }
}

std::optional<SlopeChangeDetector::Candidate> SlopeChangeDetector::BestSplit(uint64_t first_bucket,
                                                                             uint64_t min_break_bucket,
                                                                             uint64_t max_break_bucket) {
  if (open_bucket_ == 0) return std::nullopt;
  const uint64_t hi = open_bucket_ - 1;
  const uint64_t lo = std::max(OldestSearched(), first_bucket);
  if (hi < lo + 1) return std::nullopt;
  const size_t count = hi - lo + 1;

  // suffix[k]: buckets lo + k .. hi merged; suffix_filled[k]: how many of them hold points.
  // Scratch of this thread's searches, shared by every detector: a run's thousands of detectors
  // would each hold 3 KB of it. It grows to the largest span searched, once per thread.
  thread_local std::vector<Moments> suffix;
  thread_local std::vector<uint32_t> suffix_filled;
  if (suffix.size() < count) {
    suffix.resize(count);
    suffix_filled.resize(count);
  }
  Moments running;
  uint32_t filled = 0;
  for (size_t k = count; k-- > 0;) {
    const Bucket& bucket = BucketAt(lo + k);
    if (bucket.index == lo + k && bucket.moments.n > 0) {
      running.Merge(bucket.moments);
      ++filled;
    }
    suffix[k] = running;
    suffix_filled[k] = filled;
  }

  // The break is where the residual sum of squares is least: as a kink, and as two free lines.
  const double min_samples = options_.min_samples;
  const uint64_t min_segment = options_.min_segment_steps;
  Moments prefix;
  uint32_t prefix_filled = 0;
  std::optional<Candidate> best_kink;
  std::optional<Candidate> best_two_lines;
  std::optional<uint64_t> oldest_break;
  uint64_t newest_break = 0;
  for (size_t split = 1; split < count; ++split) {
    const Bucket& bucket = BucketAt(lo + split - 1);
    if (bucket.index == lo + split - 1 && bucket.moments.n > 0) {
      prefix.Merge(bucket.moments);
      ++prefix_filled;
    }
    const uint64_t break_bucket = lo + split;
    const Moments& after = suffix[split];
    const uint64_t after_steps = suffix_filled[split] * bucket_steps_;
    if (after_steps < min_segment) break;
    if (break_bucket < min_break_bucket || break_bucket > max_break_bucket) continue;
    if (prefix_filled * bucket_steps_ < min_segment) continue;
    if (prefix.n < min_samples || after.n < min_samples) continue;
    if (!(prefix.cxx > 0) || !(after.cxx > 0)) continue;
    const uint64_t break_step = break_bucket * bucket_steps_;
    if (!oldest_break) oldest_break = break_step;
    newest_break = break_step;
    const SplitFit kink = FitKink(prefix, after, static_cast<double>(break_step));
    if (!best_kink || kink.rss < best_kink->fit.rss) {
      best_kink = Candidate{break_step, after_steps, false, kink};
    }
    const SplitFit two_lines = FitTwoLines(prefix, after);
    if (!best_two_lines || two_lines.rss < best_two_lines->fit.rss) {
      best_two_lines = Candidate{break_step, after_steps, false, two_lines};
    }
  }
  if (!best_kink) return std::nullopt;

  // A level shift (two free lines fitting significantly better than any kink, as an F test on
  // the one extra parameter) would otherwise pass for a steep slope: then judge two free lines,
  // whose slopes ignore the shift.
  const double residual_variance = best_two_lines->fit.rss / (suffix[0].n - 4);
  const double extra_rss = std::max(0.0, best_kink->fit.rss - best_two_lines->fit.rss);
  const double shift_z =
      residual_variance > 0 ? std::sqrt(extra_rss / residual_variance) : (extra_rss > 0 ? kInf : 0.0);
  std::optional<Candidate>& best = shift_z < kLevelShiftZ ? best_kink : best_two_lines;
  best->pinned = best->break_step == newest_break || best->break_step == *oldest_break;
  return best;
}

void SlopeChangeDetector::SaveState(StateWriter& out) const {
  PutOptions(out, options_);
  out.Put(bucket_steps_);
  out.Put(span_buckets_);
  // Only the block's samples so far: the rest of block_values_ and block_steps_ is rewritten before
  // it is read.
  out.Put<uint64_t>(block_size_);
  for (size_t i = 0; i < block_size_; ++i) {
    out.Put(block_values_[i]);
    out.Put(block_steps_[i]);
  }
  // Every slot, stale ones too: a slot is told stale by its index, so a ring copied whole reads
  // the same.
  static_assert(std::is_trivially_copyable_v<Bucket> && sizeof(Bucket) == sizeof(uint64_t) + 6 * sizeof(double));
  out.PutVector(buckets_);
  out.Put<uint8_t>(have_point_ ? 1 : 0);
  out.Put(open_bucket_);
  out.Put(baseline_bucket_);
  out.Put(streak_);
  out.Put(streak_break_);
  out.Put<uint8_t>(refining_ ? 1 : 0);
  out.Put(refine_first_bucket_);
  out.Put(refine_break_bucket_);
  out.Put<uint8_t>(have_step_ ? 1 : 0);
  out.Put(last_step_);
  out.Put<uint64_t>(changes_.size());
  for (const ChangePoint& change : changes_) {
    out.Put(change.step);
    out.Put(change.slope_before_per_kstep);
    out.Put(change.slope_after_per_kstep);
    out.Put(change.ratio);
    out.Put(change.z_score);
    out.Put(change.detected_at_step);
    out.Put<uint8_t>(change.settled ? 1 : 0);
  }
}

bool SlopeChangeDetector::LoadState(StateReader& in) {
  uint64_t bucket_steps = 0, span_buckets = 0;
  if (!GetOptionsEqual(in, options_) || !in.Get(bucket_steps) || !in.Get(span_buckets)) return false;
  if (bucket_steps != bucket_steps_ || span_buckets != span_buckets_) {
    return in.Fail("a change detector was saved with other buckets");
  }
  uint64_t block_size = 0;
  // A full block is turned into a point at once: at most prefilter_samples − 1 wait.
  if (!in.GetCount(block_size, 2 * sizeof(uint64_t), block_values_.size() - 1)) return false;
  block_size_ = static_cast<size_t>(block_size);
  for (size_t i = 0; i < block_size_; ++i) {
    if (!in.Get(block_values_[i]) || !in.Get(block_steps_[i])) return false;
  }
  // Read in place, as PutVector wrote it: the ring keeps its size, which the split search's
  // bounds rely on.
  uint64_t ring_size = 0;
  if (!in.Get(ring_size)) return false;
  if (ring_size != buckets_.size()) return in.Fail("a change detector's ring has another size");
  for (Bucket& bucket : buckets_) {
    if (!in.Get(bucket)) return false;
  }
  if (!in.GetBool(have_point_) || !in.Get(open_bucket_) || !in.Get(baseline_bucket_) || !in.Get(streak_) ||
      !in.Get(streak_break_) || !in.GetBool(refining_) || !in.Get(refine_first_bucket_) ||
      !in.Get(refine_break_bucket_) || !in.GetBool(have_step_) || !in.Get(last_step_)) {
    return false;
  }
  // The split search spans the buckets from these to open_bucket_: one past it would make the span
  // wrap around (and overrun the search's scratch).
  if (baseline_bucket_ > open_bucket_ || refine_first_bucket_ > open_bucket_ || refine_break_bucket_ > open_bucket_) {
    return in.Fail("a change detector's baseline is past its newest bucket");
  }
  // And open_bucket_ must never move back: every sample to come (past last_step_) and every one
  // waiting in the block lies in it or after it.
  if (block_size_ > 0 && !have_step_) return in.Fail("a change detector's block has samples but no step");
  for (size_t i = 0; i < block_size_; ++i) {
    if (block_steps_[i] > last_step_ || (i > 0 && block_steps_[i] <= block_steps_[i - 1]) ||
        (have_point_ && block_steps_[i] / bucket_steps_ < open_bucket_)) {
      return in.Fail("a change detector's block is out of order");
    }
  }
  if (have_point_ && (!have_step_ || last_step_ / bucket_steps_ < open_bucket_)) {
    return in.Fail("a change detector's newest bucket is past its last step");
  }
  uint64_t count = 0;
  if (!in.GetCount(count, 6 * sizeof(uint64_t) + 1, options_.max_changes)) return false;
  changes_.clear();
  if (count > 0) changes_.reserve(options_.max_changes);
  for (uint64_t i = 0; i < count; ++i) {
    ChangePoint change;
    if (!in.Get(change.step) || !in.Get(change.slope_before_per_kstep) || !in.Get(change.slope_after_per_kstep) ||
        !in.Get(change.ratio) || !in.Get(change.z_score) || !in.Get(change.detected_at_step) ||
        !in.GetBool(change.settled)) {
      return false;
    }
    changes_.push_back(change);
  }
  return true;
}

void SlopeChangeDetector::Record(const ChangePoint& change) {
  // Allocated at the first change only: most series never have one.
  if (changes_.capacity() == 0) changes_.reserve(options_.max_changes);
  if (changes_.size() >= options_.max_changes) changes_.erase(changes_.begin());
  changes_.push_back(change);
}

}  // namespace gradwatch::analytics

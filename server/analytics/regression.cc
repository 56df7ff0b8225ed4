#include "server/analytics/regression.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>

#include "server/core/types.h"

namespace gradwatch::analytics {
namespace {

// Written whole by RegressionSums::SaveState: two doubles, no padding. (RegressionSums itself is
// trivially copyable too, but has padding after its flag: it is written field by field.)
static_assert(std::is_trivially_copyable_v<CompensatedSum> && sizeof(CompensatedSum) == 2 * sizeof(double));
static_assert(sizeof(PackedSums) == 40);
// The rings' two pointers and sizes fit the first cache line's padding: a window is six lines.
static_assert(sizeof(WindowedSlope) == 384);

// a + b, or UINT64_MAX when that overflows (the window's bookkeeping steps saturate so).
uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return a + b > a ? a + b : UINT64_MAX; }

// a − b as a double, for steps on either side of each other.
double StepDelta(uint64_t a, uint64_t b) { return a >= b ? static_cast<double>(a - b) : -static_cast<double>(b - a); }

}  // namespace

double LinearFit::PredictAt(uint64_t step) const {
  return value_at_last_step + slope_per_step * StepDelta(step, last_step);
}

void CompensatedSum::Add(const CompensatedSum& other) {
  Add(other.sum_);
  Add(other.compensation_);
}

void CompensatedSum::Subtract(const CompensatedSum& other) {
  Add(-other.sum_);
  Add(-other.compensation_);
}

RegressionSums::RegressionSums(uint64_t origin_step, double value_origin)
    : has_origin_(true), origin_step_(origin_step), value_origin_(value_origin) {}

bool RegressionSums::Add(uint64_t step, double value) {
  if (!std::isfinite(value)) {
    return false;
  }
  if (!has_origin_) {
    has_origin_ = true;
    origin_step_ = step;
    value_origin_ = value;
  }
  const double x = StepDelta(step, origin_step_);
  const double y = value - value_origin_;
  sum_x_.Add(x);
  sum_y_.Add(y);
  sum_xx_.Add(x * x);
  sum_xy_.Add(x * y);
  sum_yy_.Add(y * y);
  if (count_ == 0) {
    first_step_ = last_step_ = step;
  } else {
    first_step_ = std::min(first_step_, step);
    last_step_ = std::max(last_step_, step);
  }
  ++count_;
  return true;
}

void RegressionSums::Merge(const RegressionSums& other) {
  if (other.count_ == 0) {
    return;
  }
  const bool was_empty = count_ == 0;
  Accumulate(other, 1.0);
  if (was_empty) {
    first_step_ = other.first_step_;
    last_step_ = other.last_step_;
  } else {
    first_step_ = std::min(first_step_, other.first_step_);
    last_step_ = std::max(last_step_, other.last_step_);
  }
}

void RegressionSums::Subtract(const RegressionSums& other) {
  if (other.count_ == 0) {
    return;
  }
  if (other.count_ >= count_) {
    Clear();
    return;
  }
  Accumulate(other, -1.0);
}

void RegressionSums::Accumulate(const RegressionSums& other, double sign) {
  if (!has_origin_) {
    has_origin_ = true;
    origin_step_ = other.origin_step_;
    value_origin_ = other.value_origin_;
  }
  // other's samples are (x + d, y + e) in this object's coordinates.
  const double d = StepDelta(other.origin_step_, origin_step_);
  const double e = other.value_origin_ - value_origin_;
  const double n = static_cast<double>(other.count_);
  const double ox = other.sum_x_.value();
  const double oy = other.sum_y_.value();

  auto add = [sign](CompensatedSum& sum, const CompensatedSum& term) {
    if (sign > 0) {
      sum.Add(term);
    } else {
      sum.Subtract(term);
    }
  };
  add(sum_x_, other.sum_x_);
  add(sum_y_, other.sum_y_);
  add(sum_xx_, other.sum_xx_);
  add(sum_xy_, other.sum_xy_);
  add(sum_yy_, other.sum_yy_);
  if (d != 0) {
    sum_x_.Add(sign * n * d);
    sum_xx_.Add(sign * 2 * d * ox);
    sum_xx_.Add(sign * n * d * d);
    sum_xy_.Add(sign * d * oy);
  }
  if (e != 0) {
    sum_y_.Add(sign * n * e);
    sum_xy_.Add(sign * e * ox);
    sum_yy_.Add(sign * 2 * e * oy);
    sum_yy_.Add(sign * n * e * e);
  }
  if (d != 0 && e != 0) {
    sum_xy_.Add(sign * n * d * e);
  }
  if (sign > 0) {
    count_ += other.count_;
  } else {
    count_ -= other.count_;
  }
}

void RegressionSums::SetStepRange(uint64_t first_step, uint64_t last_step) {
  first_step_ = first_step;
  last_step_ = last_step;
}

void RegressionSums::Clear() {
  count_ = 0;
  first_step_ = last_step_ = 0;
  sum_x_ = sum_y_ = sum_xx_ = sum_xy_ = sum_yy_ = CompensatedSum();
}

double RegressionSums::mean() const {
  if (count_ == 0) return std::numeric_limits<double>::quiet_NaN();
  return value_origin_ + sum_y_.value() / static_cast<double>(count_);
}

std::optional<LinearFit> RegressionSums::Fit() const {
  return FitSums(count_, sum_x_.value(), sum_y_.value(), sum_xx_.value(), sum_xy_.value(), sum_yy_.value(),
                 origin_step_, value_origin_, first_step_, last_step_);
}

std::optional<LinearFit> RegressionSums::FitWith(const RegressionSums& other, uint64_t first_step,
                                                 uint64_t last_step) const {
  RegressionSums merged = *this;
  merged.Merge(other);
  merged.SetStepRange(first_step, last_step);
  return merged.Fit();
}

std::optional<LinearFit> RegressionSums::FitSums(size_t count, double sx, double sy, double sxx, double sxy, double syy,
                                                 uint64_t origin_step, double value_origin, uint64_t first_step,
                                                 uint64_t last_step) {
  if (count < 2 || first_step == last_step) {
    return std::nullopt;
  }
  const double n = static_cast<double>(count);
  // Prometheus's covXY and varX.
  const double cov_xy = sxy - sx * sy / n;
  const double var_x = sxx - sx * sx / n;
  if (!(var_x > 0) || !std::isfinite(cov_xy)) {
    return std::nullopt;
  }
  LinearFit fit;
  fit.samples = count;
  fit.first_step = first_step;
  fit.last_step = last_step;
  fit.slope_per_step = cov_xy / var_x;
  // The line passes through the means; evaluate it at last_step (Prometheus's intercept at the
  // evaluation time, sumY/n − slope·sumX/n with x measured from there).
  const double mean_x = sx / n;
  const double mean_y = sy / n;
  fit.value_at_last_step = value_origin + (mean_y + fit.slope_per_step * (StepDelta(last_step, origin_step) - mean_x));
  if (count >= 3) {
    const double var_y = syy - sy * sy / n;
    const double residual_ss = std::max(0.0, var_y - fit.slope_per_step * cov_xy);
    fit.residual_stddev = std::sqrt(residual_ss / (n - 2));
    fit.slope_stderr_per_step = fit.residual_stddev / std::sqrt(var_x);
  } else {
    fit.residual_stddev = kNaN;
    fit.slope_stderr_per_step = kNaN;
  }
  return fit;
}

void RegressionSums::SaveState(StateWriter& out) const {
  out.Put<uint8_t>(has_origin_ ? 1 : 0);
  out.Put(origin_step_);
  out.Put(value_origin_);
  out.Put<uint64_t>(count_);
  out.Put(first_step_);
  out.Put(last_step_);
  for (const CompensatedSum* sum : {&sum_x_, &sum_y_, &sum_xx_, &sum_xy_, &sum_yy_}) out.Put(*sum);
}

bool RegressionSums::LoadState(StateReader& in) {
  uint64_t count = 0;
  if (!in.GetBool(has_origin_) || !in.Get(origin_step_) || !in.Get(value_origin_) || !in.Get(count) ||
      !in.Get(first_step_) || !in.Get(last_step_)) {
    return false;
  }
  count_ = static_cast<size_t>(count);
  for (CompensatedSum* sum : {&sum_x_, &sum_y_, &sum_xx_, &sum_xy_, &sum_yy_}) {
    if (!in.Get(*sum)) return false;
  }
  return true;
}

PackedSums::PackedSums(const RegressionSums& given) {
  assert(!given.empty() && given.origin_step() == given.first_step() && given.count() <= kMaxCount &&
         given.last_step() - given.first_step() <= kMaxSpan);
  // Shifted to a packable origin if need be (never for a WindowedSlope's buckets).
  std::optional<RegressionSums> shifted;
  if (!IsPackableOrigin(given.value_origin())) {
    shifted.emplace(given.origin_step(), PackableOrigin(given.value_origin()));
    shifted->Merge(given);
  }
  const RegressionSums& sums = shifted ? *shifted : given;
  first_step_low_ = static_cast<uint32_t>(sums.first_step());
  origin_high_ = static_cast<uint32_t>(std::bit_cast<uint64_t>(sums.value_origin()) >> 32);
  count_word_ = static_cast<uint32_t>(sums.count());
  span_ = static_cast<uint32_t>(sums.last_step() - sums.first_step());
  sum_y_ = sums.sum_y_.value();
  sum_xy_ = sums.sum_xy_.value();
  sum_yy_ = sums.sum_yy_.value();
  SetStepSums(StepSumsOf(sums));
}

StepSums PackedSums::StepSumsOf(const RegressionSums& sums) { return {sums.sum_x_.value(), sums.sum_xx_.value()}; }

RegressionSums PackedSums::Rounded(const RegressionSums& sums) {
  return PackedSums(sums).Unpack(sums.first_step(), StepSumsOf(sums));
}

std::optional<StepSums> PackedSums::EvenStepSums(uint64_t count, uint64_t span) {
  if (count < 2) return StepSums{};
  if (span % (count - 1) != 0) return std::nullopt;
  // Steps first + d·i for i < n: Σx = d·n(n−1)/2, Σx² = d²·(n−1)n(2n−1)/6, exact in 128 bits
  // (n ≤ 2^31, d ≤ 2^32) as long as d² · (n−1)n(2n−1)/6 stays below 2^120, which any bucket whose
  // sums a double holds exactly does.
  __extension__ using Wide = unsigned __int128;
  const Wide n = count, d = span / (count - 1);
  const Wide pairs = n * (n - 1) / 2;
  const Wide squares = (n - 1) * n * (2 * n - 1) / 6;
  if (d > 1 && squares > (Wide{1} << 120) / (d * d)) return std::nullopt;
  return StepSums{static_cast<double>(d * pairs), static_cast<double>(d * d * squares)};
}

void PackedSums::SetStepSums(const StepSums& sums) {
  const std::optional<StepSums> even = EvenStepSums(count(), span_);
  const bool uneven = !even || even->sum_x != sums.sum_x || even->sum_xx != sums.sum_xx;
  count_word_ = uneven ? (count_word_ | kUneven) : (count_word_ & ~kUneven);
}

RegressionSums PackedSums::Unpack(uint64_t reference, const StepSums& uneven) const {
  const uint64_t first = first_step(reference);
  RegressionSums out(first, value_origin());
  if (empty()) return out;
  const StepSums steps = evenly_spaced() ? *EvenStepSums(count(), span_) : uneven;
  out.count_ = count();
  out.first_step_ = first;
  out.last_step_ = first + span_;
  out.sum_x_.Add(steps.sum_x);
  out.sum_y_.Add(sum_y_);
  out.sum_xx_.Add(steps.sum_xx);
  out.sum_xy_.Add(sum_xy_);
  out.sum_yy_.Add(sum_yy_);
  return out;
}

void PackedSums::SaveState(StateWriter& out, uint64_t reference, const StepSums& uneven) const {
  const StepSums steps = evenly_spaced() ? *EvenStepSums(count(), span_) : uneven;
  out.Put(first_step(reference));
  out.Put(value_origin());
  out.Put(static_cast<uint32_t>(count()));
  out.Put(span_);
  for (const double sum : {steps.sum_x, sum_y_, steps.sum_xx, sum_xy_, sum_yy_}) out.Put(sum);
}

bool PackedSums::LoadState(StateReader& in, uint64_t& first_step, StepSums& step_sums) {
  uint32_t count = 0;
  double origin = 0;
  if (!in.Get(first_step) || !in.Get(origin) || !in.Get(count) || !in.Get(span_)) return false;
  for (double* sum : {&step_sums.sum_x, &sum_y_, &step_sums.sum_xx, &sum_xy_, &sum_yy_}) {
    if (!in.Get(*sum)) return false;
  }
  if (count > kMaxCount) return in.Fail("a bucket holds too many samples");
  if (first_step + span_ < first_step) return in.Fail("a bucket's steps overflow");
  if (!IsPackableOrigin(origin)) return in.Fail("a bucket's value origin is not a packed one");
  first_step_low_ = static_cast<uint32_t>(first_step);
  origin_high_ = static_cast<uint32_t>(std::bit_cast<uint64_t>(origin) >> 32);
  count_word_ = count;
  SetStepSums(step_sums);
  return true;
}

WindowedSlope::WindowedSlope(uint64_t window_steps, size_t max_buckets)
    : window_steps_(std::max<uint64_t>(window_steps, 1)),
      bucket_steps_(1),
      max_buckets_(static_cast<uint32_t>(std::clamp<size_t>(max_buckets, 1, kMaxBuckets))) {
  const uint64_t buckets = max_buckets_;
  // So a bucket spans at most PackedSums::kMaxSpan + 1 steps too.
  window_steps_ = std::min(window_steps_, kMaxWindowSteps);
  bucket_steps_ = window_steps_ / buckets + (window_steps_ % buckets != 0 ? 1 : 0);
  // Samples in a window of window_steps steps fall into at most ceil(window / bucket) + 1 buckets,
  // at most max_buckets + 1.
  const uint64_t spanned = window_steps_ / bucket_steps_ + (window_steps_ % bucket_steps_ != 0 ? 1 : 0) + 1;
  ring_capacity_ = static_cast<uint32_t>(spanned);
}

void WindowedSlope::ResizeRing(uint32_t size) {
  assert(size >= held_);
  std::unique_ptr<Bucket[]> ring(new Bucket[size]);
  std::unique_ptr<StepSums[]> uneven(uneven_ ? new StepSums[size] : nullptr);
  for (size_t i = 0; i < held_; ++i) {
    ring[i] = ring_[slot(i)];
    if (uneven) uneven[i] = uneven_[slot(i)];
  }
  ring_ = std::move(ring);
  uneven_ = std::move(uneven);
  ring_size_ = size;
  head_ = 0;
}

void WindowedSlope::GrowRing() {
  ResizeRing(static_cast<uint32_t>(
      std::min<size_t>(ring_capacity_ - 1, std::max<size_t>(kFirstRingSize, size_t{ring_size_} * 2))));
}

void WindowedSlope::Pack(uint32_t s, const RegressionSums& sums) {
  ring_[s] = PackedSums(sums);
  if (ring_[s].evenly_spaced()) return;
  if (!uneven_) uneven_.reset(new StepSums[ring_size_]);
  uneven_[s] = PackedSums::StepSumsOf(sums);
  ++uneven_held_;
}

void WindowedSlope::DropOldest() {
  if (!ring_[head_].evenly_spaced() && --uneven_held_ == 0) uneven_.reset();
  head_ = slot(1);
  --held_;
}

void WindowedSlope::CloseOpenBucket() {
  if (held_ == ring_size_) GrowRing();
  assert(held_ < ring_size_);
  // closed_ takes the packed sums, which ExpireBefore subtracts again.
  const uint32_t s = slot(held_);
  Pack(s, open_);
  closed_.Merge(Unpacked(s, open_.first_step()));
  ++held_;
}

void WindowedSlope::OpenBucket(uint64_t step, double value) {
  open_ = RegressionSums(step, PackedSums::PackableOrigin(value));
  has_open_ = true;
  if (held_ == 0) expire_step_ = step + window_steps_ > step ? step + window_steps_ : UINT64_MAX;
  const uint64_t index = step / bucket_steps_;
  const uint64_t end = (index + 1) * bucket_steps_;
  open_end_step_ = end > step ? end : UINT64_MAX;
}

bool WindowedSlope::AddSample(uint64_t step, double value) {
  if (!std::isfinite(value)) {
    ++ignored_non_finite_;
    return false;
  }
  if (has_samples_ && step < last_step_) {
    ++ignored_out_of_order_;
    return false;
  }
  if (has_open_ && step < open_end_step_ && open_.count() >= PackedSums::kMaxCount) {
    ++ignored_bucket_full_;
    return false;
  }
  // Every held bucket is read with the newest step before this one: this one may be far ahead.
  const uint64_t reference = last_step_;
  has_samples_ = true;
  last_step_ = step;
  if (has_open_ && step >= expire_step_) ExpireBefore(step, reference);
  if (!has_open_) {
    closed_ = RegressionSums(step, value);
    expiries_since_recompute_ = 0;
    OpenBucket(step, value);
  } else if (step >= open_end_step_) {
    CloseOpenBucket();
    OpenBucket(step, value);
    MaybeRecompute();
  }
  open_.Add(step, value);
  return true;
}

void WindowedSlope::ExpireBefore(uint64_t newest_step, uint64_t reference) {
  while (held_ > 0 && newest_step - ring_[head_].first_step(reference) >= window_steps_) {
    closed_.Subtract(Unpacked(head_, reference));
    DropOldest();
    ++expiries_since_recompute_;
  }
  if (held_ > 0) {
    // What is left lies within the window of newest_step, which reads it from now on.
    const uint64_t first = FirstStep(ring_[head_]);
    expire_step_ = first + window_steps_ > first ? first + window_steps_ : UINT64_MAX;
    MaybeRecompute();
    return;
  }
  closed_.Clear();
  if (newest_step - open_.first_step() >= window_steps_) {
    // The open bucket expires too: nothing is left.
    has_open_ = false;
    ++expiries_since_recompute_;
  } else {
    const uint64_t first = open_.first_step();
    expire_step_ = first + window_steps_ > first ? first + window_steps_ : UINT64_MAX;
  }
}

void WindowedSlope::MaybeRecompute() {
  if (expiries_since_recompute_ >= max_buckets_ ||
      (closed_.count() > 0 && ((last_step_ - closed_.origin_step()) >> 2) >= window_steps_)) {
    Recompute();
  }
}

void WindowedSlope::Recompute() {
  if (held_ == 0) return;
  RegressionSums exact = Unpacked(head_);
  for (size_t i = 1; i < held_; ++i) {
    exact.Merge(Unpacked(slot(i)));
  }
  closed_ = exact;
  expiries_since_recompute_ = 0;
  ++recomputes_;
}

size_t WindowedSlope::CapacityBytes() const { return sizeof(*this) + (ring_capacity_ - 1) * sizeof(Bucket); }

std::optional<LinearFit> WindowedSlope::Fit() const {
  if (!has_open_) return std::nullopt;
  return closed_.FitWith(open_, held_ > 0 ? FirstStep(ring_[head_]) : open_.first_step(), last_step_);
}

RegressionSums WindowedSlope::SumsOfHeldInRange(size_t count, uint64_t from_step, uint64_t to_step) const {
  RegressionSums sums;
  for (size_t i = 0; i < count; ++i) {
    const HeldSpan span = held(i);
    if (span.first_step > to_step) {
      break;
    }
    if (span.first_step >= from_step && span.last_step <= to_step) {
      sums.Merge(i < held_ ? Unpacked(slot(i)) : open_);
    }
  }
  return sums;
}

RegressionSums WindowedSlope::SumsInRange(uint64_t from_step, uint64_t to_step) const {
  return SumsOfHeldInRange(held_ + (has_open_ ? 1 : 0), from_step, to_step);
}

RegressionSums WindowedSlope::ClosedSumsInRange(uint64_t from_step, uint64_t to_step) const {
  return SumsOfHeldInRange(held_, from_step, to_step);
}

std::optional<RegressionSums> WindowedSlope::ClosedBy(uint64_t step, double value) const {
  if (!has_open_ || !std::isfinite(value) || step < last_step_ || step < open_end_step_) {
    return std::nullopt;
  }
  return PackedSums::Rounded(open_);
}

std::optional<LinearFit> WindowedSlope::FitRange(uint64_t from_step, uint64_t to_step) const {
  return SumsInRange(from_step, to_step).Fit();
}

void WindowedSlope::SaveState(StateWriter& out) const {
  out.Put(window_steps_);
  out.Put(bucket_steps_);
  out.Put<uint64_t>(max_buckets_);
  out.Put<uint64_t>(ring_capacity_);
  // The ring's size, not its rotation, decides when it grows.
  out.Put<uint64_t>(ring_size_);
  out.Put<uint64_t>(held_);
  for (size_t i = 0; i < held_; ++i) {
    const uint32_t s = slot(i);
    ring_[s].SaveState(out, last_step_, uneven_held_ > 0 ? uneven_[s] : StepSums{});
  }
  out.Put(last_step_);
  out.Put(open_end_step_);
  out.Put(expire_step_);
  out.Put<uint8_t>(has_open_ ? 1 : 0);
  out.Put<uint8_t>(has_samples_ ? 1 : 0);
  open_.SaveState(out);
  closed_.SaveState(out);
  out.Put(expiries_since_recompute_);
  out.Put(recomputes_);
  out.Put(ignored_non_finite_);
  out.Put(ignored_out_of_order_);
  out.Put(ignored_bucket_full_);
}

bool WindowedSlope::LoadState(StateReader& in) {
  uint64_t window_steps = 0, bucket_steps = 0, max_buckets = 0, ring_capacity = 0;
  if (!in.Get(window_steps) || !in.Get(bucket_steps) || !in.Get(max_buckets) || !in.Get(ring_capacity)) {
    return false;
  }
  if (window_steps != window_steps_ || bucket_steps != bucket_steps_ || max_buckets != max_buckets_ ||
      ring_capacity != ring_capacity_) {
    return in.Fail("a window was saved with other steps or buckets");
  }
  uint64_t ring_size = 0, held_count = 0;
  if (!in.Get(ring_size)) return false;
  // The ring never exceeds ring_capacity_ − 1 slots (GrowRing).
  if (ring_size > ring_capacity_ - 1) return in.Fail("a window's ring is larger than its capacity");
  if (!in.GetCount(held_count, 1, ring_size)) return false;
  // Loaded unrotated: the held buckets first, the free slots after them.
  ring_.reset(new Bucket[ring_size]);
  uneven_.reset();
  ring_size_ = static_cast<uint32_t>(ring_size);
  uneven_held_ = 0;
  head_ = 0;
  held_ = 0;
  // The first steps read, checked against last_step_ once it is read (PackedSums keeps 32 bits).
  std::vector<uint64_t> first_steps(held_count);
  for (size_t i = 0; i < held_count; ++i) {
    StepSums step_sums;
    if (!ring_[i].LoadState(in, first_steps[i], step_sums)) return false;
    if (!ring_[i].evenly_spaced()) {
      if (!uneven_) uneven_.reset(new StepSums[ring_size_]);
      uneven_[i] = step_sums;
      ++uneven_held_;
    }
    ++held_;
  }
  bool has_open = false, has_samples = false;
  if (!in.Get(last_step_) || !in.Get(open_end_step_) || !in.Get(expire_step_) || !in.GetBool(has_open) ||
      !in.GetBool(has_samples) || !open_.LoadState(in) || !closed_.LoadState(in) ||
      !in.Get(expiries_since_recompute_) || !in.Get(recomputes_) || !in.Get(ignored_non_finite_) ||
      !in.Get(ignored_out_of_order_) || !in.Get(ignored_bucket_full_)) {
    return false;
  }
  has_open_ = has_open;
  has_samples_ = has_samples;
  if (!has_open_) {
    // Nothing held; the bookkeeping steps are set again when a bucket opens.
    return held_ == 0 ? true : in.Fail("a window holds closed buckets but no open one");
  }
  if (!has_samples_) return in.Fail("a window holds a bucket but never took a sample");
  // Every held bucket (the open one last) must be a non-empty bucket of its own index, the indices
  // increasing, all of them within the window that ends at last_step_: then they are at most
  // ring_capacity_, and the window keeps to its ring as it moves on.
  first_steps.push_back(open_.first_step());
  for (const uint64_t first : first_steps) {
    if (first > last_step_ || last_step_ - first >= window_steps_) return in.Fail("a window holds buckets outside it");
  }
  const uint64_t oldest_first = first_steps.front();
  if (open_.last_step() > last_step_) return in.Fail("a window holds buckets outside it");
  for (size_t i = 0; i <= held_; ++i) {
    const HeldSpan bucket = held(i);
    const uint64_t index = bucket.first_step / bucket_steps_;
    if (bucket.count == 0 || bucket.first_step > bucket.last_step || bucket.last_step / bucket_steps_ != index) {
      return in.Fail("a window's bucket is empty or spans several buckets");
    }
    if (i > 0 && index <= held(i - 1).last_step / bucket_steps_) {
      return in.Fail("a window's buckets are out of order");
    }
  }
  // The open bucket is packed when it closes: its origins are its first step and a packable value
  // (OpenBucket).
  if (open_.origin_step() != open_.first_step() || !PackedSums::IsPackableOrigin(open_.value_origin()) ||
      open_.count() > PackedSums::kMaxCount) {
    return in.Fail("a window's open bucket has another origin or too many samples");
  }
  // As OpenBucket and ExpireBefore set them.
  const uint64_t open_index = open_.first_step() / bucket_steps_;
  const uint64_t open_end = (open_index + 1) * bucket_steps_;
  if (open_end_step_ != (open_end > open_.first_step() ? open_end : UINT64_MAX) ||
      expire_step_ != SaturatingAdd(oldest_first, window_steps_)) {
    return in.Fail("a window's bookkeeping steps do not match its buckets");
  }
  return true;
}

SlopeTracker::SlopeTracker(std::vector<uint64_t> windows, size_t max_buckets) {
  if (windows.empty()) {
    windows = DefaultWindows();
  }
  windows_.reserve(windows.size());
  for (uint64_t window_steps : windows) {
    windows_.emplace_back(window_steps, max_buckets);
  }
  for (size_t i = 1; i < windows_.size(); ++i) {
    if (windows_[i].window_steps() > windows_[longest_].window_steps()) {
      longest_ = i;
    }
  }
}

size_t SlopeTracker::CapacityBytes() const {
  size_t bytes = sizeof(*this);
  for (const WindowedSlope& window : windows_) bytes += window.CapacityBytes();
  return bytes;
}

bool SlopeTracker::AddSample(uint64_t step, double value) {
  bool accepted = false;
  for (WindowedSlope& window : windows_) {
    accepted = window.AddSample(step, value);
  }
  return accepted;
}

std::optional<LinearFit> SlopeTracker::FitRange(uint64_t from_step, uint64_t to_step) const {
  return longest().FitRange(from_step, to_step);
}

RegressionSums SlopeTracker::SumsInRange(uint64_t from_step, uint64_t to_step) const {
  return longest().SumsInRange(from_step, to_step);
}

void SlopeTracker::SaveState(StateWriter& out) const {
  out.Put<uint64_t>(windows_.size());
  out.Put<uint64_t>(longest_);
  for (const WindowedSlope& window : windows_) window.SaveState(out);
}

bool SlopeTracker::LoadState(StateReader& in) {
  uint64_t count = 0, longest = 0;
  if (!in.Get(count) || !in.Get(longest)) return false;
  if (count != windows_.size() || longest != longest_) return in.Fail("a tracker was saved with other windows");
  for (WindowedSlope& window : windows_) {
    if (!window.LoadState(in)) return false;
  }
  return true;
}

}  // namespace gradwatch::analytics

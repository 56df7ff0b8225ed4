// Least-squares slopes over steps: running sums with compensated summation, a sliding window
// with O(1) updates, and several windows per series.
//
// The arithmetic is Prometheus's `linearRegression` (promql/functions.go), which `deriv()` and
// `predict_linear()` use: sums of x, y, xy and x² with Kahan–Neumaier compensation,
// slope = (Σxy − ΣxΣy/n) / (Σx² − (Σx)²/n). With one step taken as one second and the evaluation
// time at the last sample, `slope_per_step` is `deriv(v[W])` and
// `PredictAt(last_step + d)` is `predict_linear(v[W], d)`.
//
// Pure maths: no I/O, no locks. Not thread-safe: the owner serialises access.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "server/core/prefetch.h"
#include "server/core/state_io.h"

namespace gradwatch::analytics {

inline constexpr double kStepsPerKstep = 1000.0;

// A fitted line over `samples` samples with steps in [first_step, last_step].
struct LinearFit {
  size_t samples = 0;
  uint64_t first_step = 0;
  uint64_t last_step = 0;
  double slope_per_step = 0;
  // The line's value at last_step (Prometheus's intercept at the evaluation time).
  double value_at_last_step = 0;
  // Standard error of the slope, from the residuals; NaN with fewer than 3 samples.
  double slope_stderr_per_step = 0;
  // sqrt(Σ residual² / (samples − 2)); NaN with fewer than 3 samples.
  double residual_stddev = 0;

  double slope_per_kstep() const { return slope_per_step * kStepsPerKstep; }
  double slope_stderr_per_kstep() const { return slope_stderr_per_step * kStepsPerKstep; }
  // value_at_last_step + slope_per_step · (step − last_step); steps before last_step work too.
  double PredictAt(uint64_t step) const;
};

// A Kahan–Neumaier compensated sum (the variant Prometheus's kahanSumInc uses). The error of each
// addition is computed branch-free with Knuth's TwoSum, which gives the same exact error as
// Neumaier's branch on the larger magnitude (so the same sums, bit for bit) without a
// mispredicted branch when terms of either sign alternate.
class CompensatedSum {
 public:
  void Add(double x) {
    const double t = sum_ + x;
    const double x_part = t - sum_;
    const double error = (sum_ - (t - x_part)) + (x - x_part);
    // As Prometheus does: the compensation of an overflowed sum means nothing.
    compensation_ = std::isinf(t) ? 0.0 : compensation_ + error;
    sum_ = t;
  }
  // Adds another compensated sum, keeping its compensation term.
  void Add(const CompensatedSum& other);
  void Subtract(const CompensatedSum& other);
  double value() const { return sum_ + compensation_; }

 private:
  double sum_ = 0;
  double compensation_ = 0;
};

// Running least-squares sums n, Σx, Σy, Σxx, Σxy, Σyy with x = step − origin_step and
// y = value − value_origin: both origins keep the terms small, so a window far along the step axis
// or values near 1e6 with a small slope lose no precision to cancellation. The origins are fixed
// at construction (or by the first Add of a default-constructed object); Merge and Subtract shift
// the other object's sums to this object's origins. 128 bytes, aligned to a cache line: an Add
// touches two lines.
class alignas(64) RegressionSums {
 public:
  // Origins are taken from the first sample added (or the first object merged).
  RegressionSums() = default;
  RegressionSums(uint64_t origin_step, double value_origin);

  // Adds one sample. A non-finite value is ignored and false returned.
  bool Add(uint64_t step, double value);
  // Adds all of other's samples; the step range becomes the union.
  void Merge(const RegressionSums& other);
  // Removes other's samples, which must have been added to (or merged into) this object. The sums
  // cannot know which steps remain, so the step range is left as it was: callers that know it
  // (a window dropping its oldest samples) set it with SetStepRange. Removing every sample clears
  // the sums exactly.
  void Subtract(const RegressionSums& other);
  void SetStepRange(uint64_t first_step, uint64_t last_step);
  void Clear();  // keeps the origins

  // Needs ≥ 2 samples at distinct steps; the standard errors need ≥ 3 samples (NaN otherwise).
  std::optional<LinearFit> Fit() const;
  // The fit of this object's samples and other's merged, their steps spanning
  // [first_step, last_step].
  std::optional<LinearFit> FitWith(const RegressionSums& other, uint64_t first_step, uint64_t last_step) const;

  size_t count() const { return count_; }
  bool empty() const { return count_ == 0; }
  // The mean of the values added; NaN when empty.
  double mean() const;
  uint64_t first_step() const { return first_step_; }  // meaningful when !empty()
  uint64_t last_step() const { return last_step_; }
  uint64_t origin_step() const { return origin_step_; }
  double value_origin() const { return value_origin_; }

  // Writes every field for LoadState, one by one: a copy of the whole object would carry its
  // padding, so equal sums would not always give equal bytes.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote; false (in.Fail called) on a truncated input or a flag that is
  // neither 0 nor 1, the sums then unspecified. Any other bytes make sums that are safe to use
  // (their values are only ever added, compared and divided): the owner checks what it relies on.
  bool LoadState(StateReader& in);

 private:
  friend class PackedSums;

  // Adds (sign = +1) or removes (sign = −1) other's sums, shifted to this object's origins.
  void Accumulate(const RegressionSums& other, double sign);
  // The fit of n samples with these sums, x and y measured from the origins.
  static std::optional<LinearFit> FitSums(size_t count, double sx, double sy, double sxx, double sxy, double syy,
                                          uint64_t origin_step, double value_origin, uint64_t first_step,
                                          uint64_t last_step);

  bool has_origin_ = false;
  uint64_t origin_step_ = 0;
  double value_origin_ = 0;
  size_t count_ = 0;
  uint64_t first_step_ = 0;
  uint64_t last_step_ = 0;
  CompensatedSum sum_x_, sum_y_, sum_xx_, sum_xy_, sum_yy_;
};

// A bucket's Σx and Σx², x measured from its first step (PackedSums).
struct StepSums {
  double sum_x = 0;
  double sum_xx = 0;
};

// What a window keeps of a closed bucket: a RegressionSums whose step origin is its first step,
// its sums rounded to plain doubles (their compensation folded in), in 40 bytes: a window holds up
// to max_buckets of them, most of a slope's memory. The rounding is half an ulp of sums taken from
// the bucket's own origins (small terms), and a window adds and removes the same rounded values, so
// its sums stay exact up to the usual summation error.
//
// Two fields are kept in 32 bits. The first step keeps its low 32 bits: its owner reads it with a
// `reference` step at or after it and at most kMaxReach past it (a window's newest step: every
// bucket it holds started within the window, at most 2^32 steps). The value origin is a packable
// one (PackableOrigin: the high 32 bits of a double, sign, exponent and 20 bits of mantissa), as a
// WindowedSlope opens every bucket with the packable origin nearest its first value; sums with
// another origin are shifted to it as they are packed, which rounds them once more.
//
// The sums of x and x² (x the step less the first step) are integers that the steps alone decide:
// when the bucket's steps are evenly spaced (every step, every k steps, a single step), its count
// and span give them exactly, and they are not kept. Otherwise (a gap, a repeated step) the bucket
// is `uneven` and its owner keeps them beside it (StepSums), to be handed back to Unpack. Either
// way Unpack gives back the same doubles, bit for bit.
class PackedSums {
 public:
  // Most samples a packed bucket holds, and most steps it spans (last − first).
  static constexpr uint64_t kMaxCount = INT32_MAX;
  static constexpr uint64_t kMaxSpan = UINT32_MAX;
  // Most steps from a bucket's first step to the reference step it is read with.
  static constexpr uint64_t kMaxReach = UINT32_MAX;

  // `value` with the low 32 bits of its double cleared: a value origin PackedSums keeps as it is,
  // within 2^-20 of `value` relatively (2^-1042 for a subnormal one; ±0 and ±Inf are kept whole).
  static double PackableOrigin(double value) {
    return std::bit_cast<double>(std::bit_cast<uint64_t>(value) & ~uint64_t{UINT32_MAX});
  }
  static bool IsPackableOrigin(double value) { return (std::bit_cast<uint64_t>(value) & UINT32_MAX) == 0; }

  PackedSums() = default;
  // sums must be non-empty, with origin_step() == first_step(), at most kMaxCount samples and
  // last_step() − first_step() ≤ kMaxSpan (as a WindowedSlope's open bucket always is). A value
  // origin that is not packable is replaced by PackableOrigin(sums.value_origin()).
  explicit PackedSums(const RegressionSums& sums);

  // sums' Σx and Σx² as PackedSums(sums) rounds them: what an owner keeps of an uneven bucket.
  static StepSums StepSumsOf(const RegressionSums& sums);
  // PackedSums(sums).Unpack(sums.first_step(), StepSumsOf(sums)): the sums a window keeps of a
  // bucket it closes.
  static RegressionSums Rounded(const RegressionSums& sums);

  // Whether Σx and Σx² are not kept (count and span give them): see the class comment.
  bool evenly_spaced() const { return (count_word_ & kUneven) == 0; }
  // The RegressionSums these sums stand for (origins at the first step and the value origin),
  // read with `reference` (see the class comment). `uneven` is what StepSumsOf gave for this
  // bucket when !evenly_spaced(), ignored otherwise.
  RegressionSums Unpack(uint64_t reference, const StepSums& uneven = {}) const;

  size_t count() const { return count_word_ & ~kUneven; }
  bool empty() const { return count() == 0; }
  // The first and last steps, read with `reference`.
  uint64_t first_step(uint64_t reference) const {
    return reference - static_cast<uint32_t>(static_cast<uint32_t>(reference) - first_step_low_);
  }
  uint64_t last_step(uint64_t reference) const { return first_step(reference) + span_; }
  double value_origin() const { return std::bit_cast<double>(uint64_t{origin_high_} << 32); }

  // Every field in full, Σx and Σx² too (`uneven` as for Unpack): the bytes a 48-byte bucket with
  // both step sums kept would write.
  void SaveState(StateWriter& out, uint64_t reference, const StepSums& uneven = {}) const;
  // Reads what SaveState wrote; false (in.Fail called) on a truncated input, a count above
  // kMaxCount, a span that overflows the step axis or a value origin that is not packable. Sets
  // `first_step` to the first step read, which the owner checks lies within kMaxReach of the
  // reference it reads the bucket with, and `step_sums` to the Σx and Σx² read: the owner keeps
  // them when !evenly_spaced(). Other bytes give sums that are safe to use (see RegressionSums).
  bool LoadState(StateReader& in, uint64_t& first_step, StepSums& step_sums);

 private:
  static constexpr uint32_t kUneven = 0x8000'0000u;
  static_assert(kMaxCount < kUneven);

  // The Σx and Σx² of `count` steps evenly spaced over `span`; nullopt when they cannot be (the
  // span does not divide) or would not fit the arithmetic.
  static std::optional<StepSums> EvenStepSums(uint64_t count, uint64_t span);
  // Packs Σx and Σx²: marks the bucket uneven unless they are EvenStepSums(count, span).
  void SetStepSums(const StepSums& sums);

  uint32_t first_step_low_ = 0;
  uint32_t origin_high_ = 0;  // the value origin's high 32 bits (a packable origin)
  uint32_t count_word_ = 0;   // the count, and kUneven
  uint32_t span_ = 0;         // last step − first step
  double sum_y_ = 0, sum_xy_ = 0, sum_yy_ = 0;
};

// Least-squares slope over the samples whose step lies in the left-open window
// (last_step − window_steps, last_step], last_step being the newest sample's step: with one step
// as one second that is the range Prometheus 3 gives `deriv(v[W])` at the newest sample (Prometheus
// 2 includes the left edge, i.e. equals WindowedSlope(W + 1) for integer steps).
//
// O(1) amortised per sample. Memory grows with the buckets held: the ring starts empty and
// doubles (from 4 buckets) up to the most a window can span, after which AddSample never
// allocates. Samples are aggregated into buckets of bucket_steps = ceil(window_steps / max_buckets)
// consecutive steps (bucket k holds steps [k·bucket_steps, (k+1)·bucket_steps)), kept in a ring,
// each closed one packed into 40 bytes (PackedSums; the step sums of uneven buckets, 16 bytes
// more each, in a second ring allocated only while the window holds one). A sample is added to
// the newest (open) bucket only: the sums of the closed buckets in the window add each bucket's
// packed sums as it closes and subtract them as it expires, and are recomputed exactly
// from the buckets every max_buckets expiries (or when the window has moved 4 windows past the
// sums' origin), so rounding error cannot build up; Fit combines them with the open bucket. A
// sample thus costs one bucket update, and reads only the window's bookkeeping and its open bucket.
//
// Window edge: a bucket expires, with all its samples, as soon as its oldest sample leaves the
// window. With bucket_steps == 1 (window_steps ≤ max_buckets) the window is exact for every
// sample; otherwise up to bucket_steps − 1 of the oldest steps may be dropped early, never a sample
// outside the window kept. Every sample held counts in the fit (buckets hold sums, not averages).
//
// The x-axis is the step number, so irregular reporting (every 10 steps, gaps) needs nothing
// special; a gap longer than the window empties it. Non-finite values are ignored and counted, and
// so are samples whose step is older than the newest one (a repeated step is accepted).
class WindowedSlope {
 public:
  static constexpr size_t kDefaultMaxBuckets = 1024;
  static constexpr size_t kMaxBuckets = size_t{1} << 31;
  // The longest window: a bucket is read with the window's newest step (PackedSums::kMaxReach).
  static constexpr uint64_t kMaxWindowSteps = PackedSums::kMaxReach + 1;

  // window_steps and max_buckets below 1 are raised to 1; max_buckets above kMaxBuckets and
  // window_steps above kMaxWindowSteps (2^32, far beyond any run) are lowered to them.
  explicit WindowedSlope(uint64_t window_steps, size_t max_buckets = kDefaultMaxBuckets);
  // Moved, never copied: a copy of every bucket is never what a caller wants.
  WindowedSlope(const WindowedSlope&) = delete;
  WindowedSlope& operator=(const WindowedSlope&) = delete;
  WindowedSlope(WindowedSlope&&) noexcept = default;
  WindowedSlope& operator=(WindowedSlope&&) noexcept = default;

  // Returns false when the sample was ignored: a non-finite value, a step older than last_step(),
  // or a bucket already holding PackedSums::kMaxCount samples (repeated steps only).
  bool AddSample(uint64_t step, double value);

  // The fit over the window; nullopt until it holds samples at 2 distinct steps.
  std::optional<LinearFit> Fit() const;
  // The fit over the held buckets whose samples all lie in [from_step, to_step]; nullopt when fewer
  // than 2 distinct steps qualify. O(buckets held).
  std::optional<LinearFit> FitRange(uint64_t from_step, uint64_t to_step) const;
  // The sums behind FitRange (empty when no bucket qualifies), for callers that keep adding.
  RegressionSums SumsInRange(uint64_t from_step, uint64_t to_step) const;
  // Like SumsInRange over the held buckets but the newest (those no sample can join any more).
  RegressionSums ClosedSumsInRange(uint64_t from_step, uint64_t to_step) const;
  // The newest held bucket (samples may still join it); null when none is held.
  const RegressionSums* open_bucket() const { return has_open_ ? &open_ : nullptr; }
  // The sums the window keeps of its open bucket (PackedSums) if AddSample(step, value) would
  // close it (the sample is accepted and starts a newer bucket); else nullopt.
  std::optional<RegressionSums> ClosedBy(uint64_t step, double value) const;

  // A cache hint for an owner that adds samples to many windows in turn (runs::RunAnalytics):
  // brings in what AddSample reads for every sample (see the members). It changes nothing.
  void Prefetch() const {
    PrefetchRead(this);
    PrefetchRead(&open_);
    PrefetchRead(reinterpret_cast<const char*>(&open_) + sizeof(open_) - 1);
  }

  // Cache hints for an owner that fits many windows in turn (runs::RunAnalytics::StepAnalysis):
  // PrefetchFitSums brings in the bookkeeping and sums Fit reads; PrefetchOldest, issued later
  // (it reads the bookkeeping), the oldest held bucket, the only other line Fit reads. They
  // change nothing.
  void PrefetchFitSums() const {
    PrefetchRead(this);
    PrefetchRead(&open_);
    PrefetchRead(reinterpret_cast<const char*>(&open_) + sizeof(open_) - 1);
    PrefetchRead(&closed_);
    PrefetchRead(reinterpret_cast<const char*>(&closed_) + sizeof(closed_) - 1);
  }
  void PrefetchOldest() const {
    if (held_ == 0) return;
    PrefetchRead(&ring_[head_]);
    PrefetchRead(reinterpret_cast<const char*>(&ring_[head_]) + sizeof(Bucket) - 1);
  }

  uint64_t window_steps() const { return window_steps_; }
  uint64_t bucket_steps() const { return bucket_steps_; }
  // The most memory the window can come to hold (its ring at full size), in bytes.
  size_t CapacityBytes() const;
  size_t samples_in_window() const { return has_open_ ? closed_.count() + open_.count() : 0; }
  // Whether any sample was ever accepted; last_step() is meaningful only then.
  bool has_samples() const { return has_samples_; }
  uint64_t last_step() const { return last_step_; }
  uint64_t ignored_non_finite() const { return ignored_non_finite_; }
  uint64_t ignored_out_of_order() const { return ignored_out_of_order_; }
  uint64_t ignored_bucket_full() const { return ignored_bucket_full_; }
  // Exact recomputations of the window sums so far.
  uint64_t recomputes() const { return recomputes_; }
  // Closed buckets held whose steps are not evenly spaced (PackedSums), their step sums kept aside.
  size_t uneven_buckets() const { return uneven_held_; }

  // Writes the state (everything but what the constructor's arguments fix, and those arguments for
  // LoadState to check) for LoadState: the held buckets oldest first, so equal windows give equal
  // bytes whatever their ring's rotation.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this object, constructed with the same arguments as the one
  // saved. False (with in.Fail(...) called, the reader failed) when the bytes are damaged or were
  // written by an object constructed differently; the object is then left in an unspecified but
  // valid, destructible state: the caller discards it. The buckets read must lie in the window
  // and in distinct buckets (so the ring can never overflow later), the bookkeeping steps must
  // match them.
  bool LoadState(StateReader& in);

 private:
  // A closed bucket is its packed sums: its index is first_step() / bucket_steps_.
  using Bucket = PackedSums;
  // The steps and samples of a held bucket.
  struct HeldSpan {
    uint64_t first_step;
    uint64_t last_step;
    size_t count;
  };

  // Ring slot of the ith closed bucket, oldest first (i < held_).
  uint32_t slot(size_t i) const {
    const size_t s = head_ + i;
    return static_cast<uint32_t>(s < ring_size_ ? s : s - ring_size_);
  }
  // The sums of the closed bucket in ring slot s, read with `reference` (last_step_ but while a
  // sample far ahead expires them: see AddSample).
  RegressionSums Unpacked(uint32_t s, uint64_t reference) const {
    return uneven_held_ > 0 ? ring_[s].Unpack(reference, uneven_[s]) : ring_[s].Unpack(reference);
  }
  RegressionSums Unpacked(uint32_t s) const { return Unpacked(s, last_step_); }
  uint64_t FirstStep(const Bucket& b) const { return b.first_step(last_step_); }
  // Stores PackedSums(sums) in ring slot s, its step sums aside if it is uneven.
  void Pack(uint32_t s, const RegressionSums& sums);
  // Drops the oldest closed bucket (held_ > 0).
  void DropOldest();
  // The ith held bucket's span, oldest first: the closed ones, then the open one (i ≤ held_).
  HeldSpan held(size_t i) const {
    if (i < held_) {
      const Bucket& b = ring_[slot(i)];
      return {b.first_step(last_step_), b.last_step(last_step_), b.count()};
    }
    return {open_.first_step(), open_.last_step(), open_.count()};
  }
  // The sums of the first `count` held buckets whose samples all lie in [from_step, to_step].
  RegressionSums SumsOfHeldInRange(size_t count, uint64_t from_step, uint64_t to_step) const;
  static constexpr size_t kFirstRingSize = 4;
  // Drops the buckets newest_step leaves behind; `reference` is the newest step before it, which
  // every held bucket is read with.
  void ExpireBefore(uint64_t newest_step, uint64_t reference);
  // Recomputes closed_ if due (see the class comment).
  void MaybeRecompute();
  void Recompute();
  // Doubles the ring (up to ring_capacity_ − 1); called when every slot holds a bucket.
  void GrowRing();
  // Reallocates the ring (and the uneven step sums, if held) with `size` slots, the held buckets
  // first and head_ 0.
  void ResizeRing(uint32_t size);
  // Moves the open bucket into the ring and its sums into closed_.
  void CloseOpenBucket();
  // Opens a bucket with its first sample's step and the packable origin of its value as origins.
  void OpenBucket(uint64_t step, double value);

  // What AddSample reads for every sample, contiguous: this first cache line, then the open
  // bucket; no division, and no closed bucket.
  std::unique_ptr<Bucket[]> ring_;  // closed buckets, oldest first from head_
  // Beside ring_, slot for slot: the step sums of its uneven buckets. Allocated while any is held.
  std::unique_ptr<StepSums[]> uneven_;
  uint32_t ring_size_ = 0;  // at most ring_capacity_ − 1
  uint32_t uneven_held_ = 0;
  uint64_t last_step_ = 0;
  // The open bucket takes samples at steps below this (the next bucket's first step).
  uint64_t open_end_step_ = 0;
  // The oldest held bucket expires once the newest step reaches this (its first step + window).
  uint64_t expire_step_ = 0;
  uint32_t head_ = 0;
  uint32_t held_ = 0;      // closed buckets in the ring
  bool has_open_ = false;  // whether any bucket is held: the newest one is always open
  bool has_samples_ = false;
  RegressionSums open_;
  RegressionSums closed_;  // the sums of the closed buckets (their packed sums)
  uint64_t expiries_since_recompute_ = 0;

  uint64_t window_steps_;
  uint64_t bucket_steps_;
  uint32_t max_buckets_;
  uint32_t ring_capacity_ = 0;  // buckets a window can span: ceil(window / bucket_steps) + 1
  uint64_t recomputes_ = 0;
  uint64_t ignored_non_finite_ = 0;
  uint64_t ignored_out_of_order_ = 0;
  uint64_t ignored_bucket_full_ = 0;
};

// One series, several windows (by default 1k, 5k and 20k steps), each a WindowedSlope with the
// same max_buckets.
class SlopeTracker {
 public:
  static std::vector<uint64_t> DefaultWindows() { return {1000, 5000, 20000}; }

  // An empty list means DefaultWindows(). Windows keep the given order.
  explicit SlopeTracker(std::vector<uint64_t> windows = DefaultWindows(),
                        size_t max_buckets = WindowedSlope::kDefaultMaxBuckets);

  // Feeds every window; false when the sample was ignored (see WindowedSlope::AddSample).
  bool AddSample(uint64_t step, double value);

  // WindowedSlope::Prefetch of every window.
  void Prefetch() const {
    for (const WindowedSlope& w : windows_) w.Prefetch();
  }

  size_t window_count() const { return windows_.size(); }
  // The most memory the tracker can come to hold (WindowedSlope::CapacityBytes), in bytes.
  size_t CapacityBytes() const;
  const WindowedSlope& window(size_t i) const { return windows_.at(i); }
  const std::vector<WindowedSlope>& windows() const { return windows_; }
  // The window with the most steps (the first of them on a tie).
  const WindowedSlope& longest() const { return windows_[longest_]; }

  // Delegated to the longest window: only steps it still holds, at its bucket granularity.
  std::optional<LinearFit> FitRange(uint64_t from_step, uint64_t to_step) const;
  RegressionSums SumsInRange(uint64_t from_step, uint64_t to_step) const;

  bool has_samples() const { return longest().has_samples(); }
  uint64_t last_step() const { return longest().last_step(); }

  // Every window's state, for LoadState (see WindowedSlope::SaveState).
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into a tracker constructed with the same windows and max_buckets;
  // false (in.Fail called, the tracker to be discarded) otherwise or on damaged bytes.
  bool LoadState(StateReader& in);

 private:
  std::vector<WindowedSlope> windows_;
  size_t longest_ = 0;
};

}  // namespace gradwatch::analytics

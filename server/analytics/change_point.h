// Online detection of slope changes in a series that has no event to explain them: "the total
// grad norm's slope doubled near step 81,700". Steps are the x-axis; slopes are per 1,000 steps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "server/core/state_io.h"

namespace gradwatch::analytics {

// Defaults suit a series reported every step or every few steps with a few percent of noise (the
// total grad norm): a doubling of the incident's slope (5e-6 → 1e-5 per step, 3% noise) is
// confirmed 0.9k–2.2k steps after the break. A sparser or noisier series needs a longer window:
// each side of a split needs min_samples prefiltered points (min_samples × prefilter_samples raw
// samples), and the z of a slope change grows as the window's length to the power 1.5. Reported
// every 50 steps, the incident needs window_steps of 10,000–15,000 (confirmed ~6k steps after).
struct ChangePointOptions {
  // The detector searches the last 2 × window_steps steps for the best split into two straight
  // segments. A change is refined until the segment after it covers window_steps.
  uint64_t window_steps = 3000;
  // The break step is estimated to window_steps / buckets_per_window steps (100 by default);
  // the detector evaluates once per such bucket.
  uint32_t buckets_per_window = 30;
  // Each side of a split must cover at least this many steps (counted as non-empty buckets ×
  // bucket width): shorter segments give slopes too noisy to compare, and a break must lie at
  // least this far back to be reported. 0: window_steps / 3.
  uint64_t min_segment_steps = 0;
  // Prefiltered points each side of a split needs (at least 3).
  uint32_t min_samples = 20;
  // Raw samples are grouped in consecutive blocks of this many and each block becomes one point
  // (its median value at its middle sample's step). A block of 5 removes any one- or two-sample
  // spike entirely; blocks are disjoint, so the points stay independent and the least-squares
  // standard errors stay honest. Odd, 1 (no filter) to 9.
  uint32_t prefilter_samples = 5;
  // The slope difference over its standard error must reach this. The break is the best of
  // many candidate splits and is tested once per bucket, so the threshold is well above the
  // 2–3 of a single test.
  double z_threshold = 5.0;
  // |slope_after − slope_before| / |slope_before| must reach this: a significant but small
  // change in a very smooth series is not news.
  double min_relative_change = 0.3;
  // Consecutive evaluations (one per bucket) that must find the change, at break steps that
  // agree to within min_segment_steps, before it is reported.
  uint32_t persistence = 3;
  // Changes kept by changes(); older ones are dropped.
  size_t max_changes = 16;
};

struct ChangePoint {
  // The estimated step at which the slope changed: the bucket boundary where the two-segment
  // fit leaves the least residual sum of squares.
  uint64_t step = 0;
  double slope_before_per_kstep = 0;
  double slope_after_per_kstep = 0;
  // slope_after / slope_before; ±inf when the slope before was exactly 0.
  double ratio = 0;
  // The slope difference over its standard error (least squares, one residual variance for
  // both sides). +inf for noise-free data.
  double z_score = 0;
  // The step of the sample that confirmed the change: detection delay = detected_at_step − step.
  uint64_t detected_at_step = 0;
  // Until settled, each evaluation re-estimates step (within window_steps / 2 of the first
  // estimate), both slopes, ratio and z_score with the data that arrived since. Settled once the
  // segment after the break covers window_steps and min_segment_steps have passed since the
  // detection, or when the next change is found.
  bool settled = false;

  bool operator==(const ChangePoint&) const = default;
};

// Finds where a series' slope changes, online. Every bucket (window_steps / buckets_per_window
// steps) it splits the last 2 × window_steps steps at every bucket boundary and fits
//  - a kink: two lines that meet at the split (the shape of a slope change, and about twice as
//    precise as two free lines when the segment after the break is short), and
//  - two free lines (a slope change with a level shift),
// and takes the split with the least residual sum of squares; the kink unless two free lines fit
// significantly better (z ≥ 3), so that a level shift is not read as a steep slope. The change is
// reported when, for `persistence` evaluations in a row,
//  - the slope difference is significant (z ≥ z_threshold) and material (min_relative_change),
//  - the best split is not the oldest or newest split allowed (a jump near either end of the
//    span would otherwise pass for a steep slope until a split can reach it).
//
// Robust to one-step spikes: the block-median prefilter removes them before any fit. A smoothly
// curving series is reported as a sequence of changes, each once its slope has moved by
// min_relative_change with significance.
//
// After a detection the detector re-baselines at the break: new changes are searched only after
// it, so one break is reported once.
//
// Not thread-safe. The buckets are sized at construction, the changes kept at the first change,
// and the split search's scratch is the thread's, shared by every detector: AddSample allocates
// only at a detector's first change. Each sample costs O(1); each bucket an O(2 ×
// buckets_per_window) search.
class SlopeChangeDetector {
 public:
  explicit SlopeChangeDetector(const ChangePointOptions& options = {});

  // Feeds one sample. Steps must strictly increase (others are ignored) and may be irregular.
  // Non-finite values are ignored: they are not a slope, and the caller alerts on them.
  // Returns the change this sample confirmed, if any; it is also appended to changes().
  std::optional<ChangePoint> AddSample(uint64_t step, double value);

  // Detected changes, oldest first, at most max_changes (the most recent ones).
  const std::vector<ChangePoint>& changes() const { return changes_; }

  // The options in effect, defaults and bounds applied.
  const ChangePointOptions& options() const { return options_; }

  // The memory a detector with these options holds (all of it allocated at construction), in
  // bytes: what to charge before constructing one.
  static size_t MemoryBytesFor(const ChangePointOptions& options);

  // Writes the state (everything but what the constructor's arguments fix, and the options in
  // effect for LoadState to check) for LoadState. The scratch of the prefilter's median and of the
  // split search is not written: each use overwrites what it reads.
  void SaveState(StateWriter& out) const;
  // Reads what SaveState wrote into this object, constructed with the same options as the one
  // saved. False (with in.Fail(...) called, the reader failed) when the bytes are damaged or were
  // written by a detector with other options; the object is then left in an unspecified but
  // valid, destructible state: the caller discards it. Nothing is allocated: every buffer keeps
  // the size the constructor gave it.
  bool LoadState(StateReader& in);

 private:
  // Moments of a set of points about their own means (Welford / Chan et al.): numerically
  // stable, and two sets merge exactly, so any run of buckets gives an exact least-squares fit.
  struct Moments {
    double n = 0;
    double mean_x = 0;
    double mean_y = 0;
    double cxx = 0;  // Σ (x − mean_x)²
    double cxy = 0;  // Σ (x − mean_x)(y − mean_y)
    double cyy = 0;  // Σ (y − mean_y)²

    void Add(double x, double y);
    void Merge(const Moments& other);
  };
  struct Bucket {
    uint64_t index = 0;  // step / bucket_steps_
    Moments moments;
  };
  // The fit of one split: both slopes per step and the z of their difference.
  struct SplitFit {
    double slope_before = 0;
    double slope_after = 0;
    double z = 0;
    double rss = 0;  // residual sum of squares
  };
  struct Candidate {
    uint64_t break_step = 0;
    uint64_t after_steps = 0;  // steps the after-segment covers (non-empty buckets × width)
    // At the newest or oldest split the minimums allow: where the search ran out, not a minimum.
    bool pinned = false;
    SplitFit fit;
  };

  // Two lines joined at `at` (a kink): the model of a slope change, about twice as precise on a
  // short after-segment as two free lines. Needs n ≥ 2 each side, N ≥ 4 and cxx > 0 each side.
  static SplitFit FitKink(const Moments& before, const Moments& after, double at);
  // Two free lines: a slope change with a level shift. Needs n ≥ 3 each side and cxx > 0.
  static SplitFit FitTwoLines(const Moments& before, const Moments& after);

  // Adds one prefiltered point; `now_step` is the raw sample that completed it.
  std::optional<ChangePoint> AddPoint(uint64_t step, double value, uint64_t now_step);
  // Runs the split search over the closed buckets; returns a confirmed change, if any.
  std::optional<ChangePoint> Evaluate(uint64_t now_step);
  // The best split of the closed buckets from first_bucket on (within the searched span), with
  // the break between min_break_bucket and max_break_bucket, if one satisfies the minimums.
  std::optional<Candidate> BestSplit(uint64_t first_bucket, uint64_t min_break_bucket, uint64_t max_break_bucket);
  // Re-estimates the newest change (break, slopes, ratio, z) with the data that arrived since.
  void Refine(uint64_t now_step);
  void Record(const ChangePoint& change);
  // The oldest closed bucket within the searched span (2 × window_steps).
  uint64_t OldestSearched() const { return open_bucket_ >= span_buckets_ ? open_bucket_ - span_buckets_ : 0; }
  const Bucket& BucketAt(uint64_t index) const { return buckets_[index % buckets_.size()]; }
  Bucket& BucketAt(uint64_t index) { return buckets_[index % buckets_.size()]; }

  ChangePointOptions options_;
  uint64_t bucket_steps_ = 1;
  uint64_t span_buckets_ = 2;  // buckets searched: 2 × window_steps

  // Prefilter block of raw samples.
  std::vector<double> block_values_;
  std::vector<double> block_sorted_;
  std::vector<uint64_t> block_steps_;
  size_t block_size_ = 0;

  // Ring of span_buckets_ + 1 buckets: the closed ones searched plus the open one.
  std::vector<Bucket> buckets_;
  bool have_point_ = false;
  uint64_t open_bucket_ = 0;
  // Buckets before this one belong to the regime before the last change: not searched.
  uint64_t baseline_bucket_ = 0;

  uint32_t streak_ = 0;
  uint64_t streak_break_ = 0;

  // While the newest change's after-segment fills, it is re-estimated over the data the detection
  // searched, with the break kept within min_segment_steps of where it was first found.
  bool refining_ = false;
  uint64_t refine_first_bucket_ = 0;
  uint64_t refine_break_bucket_ = 0;

  bool have_step_ = false;
  uint64_t last_step_ = 0;
  std::vector<ChangePoint> changes_;
};

}  // namespace gradwatch::analytics

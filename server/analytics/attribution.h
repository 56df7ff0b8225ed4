// Where the total grad norm comes from, and which parameters grow with nothing to hold them back:
// grad-norm shares, norm-gain amplification and growth without weight decay. Pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "server/core/types.h"

namespace gradwatch::analytics {

// Each parameter's and each group's share of the squared total grad norm: g_i² / total².
//
// grad_norms[i] is parameter i's grad norm; NaN (absent), ±inf or a negative value is skipped:
// its param_share is NaN and it adds to no group. total² is total_grad_norm² when given (finite
// and > 0; the trainer's figure also covers parameters it did not report one by one, so shares
// then sum to less than 1), else Σ g_i² over the parameters not skipped. Shares are not clamped:
// a reported total below the parameters' own sum gives shares summing to more than 1.
//
// group_of_param[i] is parameter i's group in [0, group_count); a parameter without an entry
// (group_of_param shorter than grad_norms) or with an index ≥ group_count belongs to no group.
// group_share[g] is the sum of its members' shares, NaN when no member had a usable grad norm.
// With no usable total (every grad norm skipped, or all zero), every share is NaN.
//
// param_share and group_share are resized to grad_norms.size() and group_count: once they have
// the capacity, no allocation.
void ComputeShares(std::span<const double> grad_norms, std::span<const uint32_t> group_of_param, size_t group_count,
                   std::optional<double> total_grad_norm, std::vector<double>& param_share,
                   std::vector<double>& group_share);

// Share trends: the caller feeds each share (a fraction, 0..1) into the regression module's
// SlopeTracker like any other series and passes its slope here; attribution keeps no history.

// Below this |slope| (share per 1,000 steps: 0.001 = 0.1 percentage point per 1k steps, 10 points
// per 100k steps) a share is steady.
inline constexpr double kSteadyShareSlopePerKstep = 0.001;

enum class Trend : int { kFalling = -1, kSteady = 0, kRising = 1 };

// kSteady when |slope_per_kstep| < steady_below_per_kstep or the slope is not finite.
Trend ClassifyTrend(double slope_per_kstep, double steady_below_per_kstep = kSteadyShareSlopePerKstep);

// "95% and rising", "3.2% and falling", "40% and steady"; "95%" when the slope is not finite,
// "unknown" when the share is not. Percentages below 10% keep one decimal, below 0.1% read
// "<0.1%".
std::string DescribeShare(double share, double slope_per_kstep,
                          double steady_below_per_kstep = kSteadyShareSlopePerKstep);

// The norm a parameter started from: the catalog's init_norm when given (finite and > 0), else
// sqrt(numel) for a norm gain (kind kNormGain), which is initialised at ones; nullopt otherwise.
std::optional<double> InitNorm(const ParamInfo& param);

// How many times its initial norm a parameter's norm has become: norm / init_norm. For a norm
// gain γ this is the factor by which it scales the normalised activations it multiplies (the
// final norm's γ scales the lm_head's inputs, hence its gradients). NaN when init_norm is not
// finite and > 0.
double Amplification(double norm, double init_norm);

struct GrowthOptions {
  // The norm must have grown by more than this fraction over the window: 0.05 = 5%.
  double min_growth = 0.05;
  // Weight decay at or below this counts as none.
  double max_weight_decay = 0.0;
};

// A parameter whose norm grows while no weight decay holds it back.
struct GrowthWithoutDecay {
  uint32_t param_index = 0;
  double growth_factor = 0;    // norm now / norm at the window's start
  double slope_per_kstep = 0;  // the norm's slope, per 1,000 steps, as passed in
  double amplification = 0;    // norm now / InitNorm; NaN when the initial norm is unknown
  bool operator==(const GrowthWithoutDecay&) const = default;
};

// Reports `param` (catalog index `index`) when its weight decay is at most
// options.max_weight_decay, its norm rose over the long window (norm_now / norm_at_window_start
// > 1 + options.min_growth, both finite and the start > 0) and it is still rising
// (slope_per_kstep > 0). nullopt otherwise.
std::optional<GrowthWithoutDecay> AssessGrowth(const ParamInfo& param, uint32_t index, double norm_at_window_start,
                                               double norm_now, double slope_per_kstep,
                                               const GrowthOptions& options = {});

}  // namespace gradwatch::analytics

#include "server/analytics/attribution.h"

#include <cmath>
#include <cstdio>
#include <limits>

namespace gradwatch::analytics {
namespace {

bool Usable(double grad_norm) { return std::isfinite(grad_norm) && grad_norm >= 0; }

// "95%", "3.2%", "<0.1%": whole percents from 10% up, one decimal below.
std::string FormatPercent(double share) {
  const double percent = 100 * share;
  if (percent > 0 && percent < 0.1) return "<0.1%";
  char buf[32];
  std::snprintf(buf, sizeof buf, percent >= 9.95 ? "%.0f%%" : "%.1f%%", percent);
  return buf;
}

}  // namespace

void ComputeShares(std::span<const double> grad_norms, std::span<const uint32_t> group_of_param, size_t group_count,
                   std::optional<double> total_grad_norm, std::vector<double>& param_share,
                   std::vector<double>& group_share) {
  param_share.assign(grad_norms.size(), kNaN);
  group_share.assign(group_count, kNaN);

  // Squares in long double: a finite norm above 1.3e154 squares to +Inf as a double.
  long double total_sq = 0;
  if (total_grad_norm && std::isfinite(*total_grad_norm) && *total_grad_norm > 0) {
    total_sq = static_cast<long double>(*total_grad_norm) * *total_grad_norm;
  } else {
    for (double g : grad_norms) {
      if (Usable(g)) total_sq += static_cast<long double>(g) * g;
    }
  }
  if (!(total_sq > 0) || !std::isfinite(total_sq)) return;

  for (size_t i = 0; i < grad_norms.size(); ++i) {
    const double g = grad_norms[i];
    if (!Usable(g)) continue;
    param_share[i] = static_cast<double>(static_cast<long double>(g) * g / total_sq);
    if (i >= group_of_param.size() || group_of_param[i] >= group_count) continue;
    double& group = group_share[group_of_param[i]];
    group = std::isnan(group) ? param_share[i] : group + param_share[i];
  }
}

Trend ClassifyTrend(double slope_per_kstep, double steady_below_per_kstep) {
  if (!std::isfinite(slope_per_kstep) || std::abs(slope_per_kstep) < steady_below_per_kstep) {
    return Trend::kSteady;
  }
  return slope_per_kstep > 0 ? Trend::kRising : Trend::kFalling;
}

std::string DescribeShare(double share, double slope_per_kstep, double steady_below_per_kstep) {
  if (!std::isfinite(share)) return "unknown";
  std::string out = FormatPercent(share);
  if (!std::isfinite(slope_per_kstep)) return out;
  switch (ClassifyTrend(slope_per_kstep, steady_below_per_kstep)) {
    case Trend::kRising: return out + " and rising";
    case Trend::kFalling: return out + " and falling";
    case Trend::kSteady: return out + " and steady";
  }
  return out;
}

std::optional<double> InitNorm(const ParamInfo& param) {
  if (param.init_norm && std::isfinite(*param.init_norm) && *param.init_norm > 0) {
    return *param.init_norm;
  }
  if (param.kind == ParamKind::kNormGain && param.numel > 0) {
    return std::sqrt(static_cast<double>(param.numel));
  }
  return std::nullopt;
}

double Amplification(double norm, double init_norm) {
  if (!std::isfinite(init_norm) || !(init_norm > 0)) return kNaN;
  return norm / init_norm;
}

std::optional<GrowthWithoutDecay> AssessGrowth(const ParamInfo& param, uint32_t index, double norm_at_window_start,
                                               double norm_now, double slope_per_kstep, const GrowthOptions& options) {
  if (!(param.weight_decay <= options.max_weight_decay)) return std::nullopt;
  if (!std::isfinite(norm_at_window_start) || !(norm_at_window_start > 0)) return std::nullopt;
  if (!std::isfinite(norm_now) || !std::isfinite(slope_per_kstep) || !(slope_per_kstep > 0)) {
    return std::nullopt;
  }
  const double growth_factor = norm_now / norm_at_window_start;
  if (!(growth_factor > 1 + options.min_growth)) return std::nullopt;
  GrowthWithoutDecay growth;
  growth.param_index = index;
  growth.growth_factor = growth_factor;
  growth.slope_per_kstep = slope_per_kstep;
  const std::optional<double> init_norm = InitNorm(param);
  growth.amplification = init_norm ? Amplification(norm_now, *init_norm) : kNaN;
  return growth;
}

}  // namespace gradwatch::analytics

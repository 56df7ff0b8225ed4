#include "server/analytics/projection.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numbers>

namespace gradwatch::analytics {

NormDynamics EstimateDynamics(double norm, double slope_per_step, double learning_rate, double weight_decay,
                              double update_norm, double radial_per_step, const LearningRateSchedule* convention) {
  NormDynamics d;
  if (!(norm > 0) || !(learning_rate > 0) || !std::isfinite(slope_per_step)) return d;
  const double eta = learning_rate;
  const bool update_known = std::isfinite(update_norm) && update_norm > 0;
  // R: a step's change of the weight along it (decay included), ηρ − ηλ·n. With the update's norm
  // U and its part across the weight η|u⊥|, U² = R² + η²|u⊥|² and (n + slope)² = (n + R)² + η²|u⊥|²,
  // so that R = ((n + slope)² − U² − n²) / 2n exactly.
  double along = slope_per_step;
  if (std::isfinite(radial_per_step)) {
    along = radial_per_step;
    d.radial_known = true;
  } else if (update_known) {
    along = ((norm + slope_per_step) * (norm + slope_per_step) - update_norm * update_norm - norm * norm) / (2 * norm);
  }
  const double decay = convention != nullptr ? convention->DecayPerStep(eta, weight_decay) : eta * weight_decay;
  d.radial = (along + decay * norm) / eta;
  if (update_known) {
    d.orthogonal = std::sqrt(std::max(0.0, update_norm * update_norm - along * along)) / eta;
    d.orthogonal_known = true;
  }
  return d;
}

LearningRateSchedule LearningRateSchedule::FromConfig(std::optional<uint64_t> warmup_steps,
                                                      std::optional<uint64_t> total_steps,
                                                      const std::map<std::string, std::string>& extra,
                                                      std::string* why) {
  LearningRateSchedule s;
  s.warmup_steps = warmup_steps.value_or(0);
  s.total_steps = total_steps;
  // Looked up without making a key (a step's alert facts read the config: no allocation).
  const auto find = [&extra](std::string_view key) {
    return std::find_if(extra.begin(), extra.end(), [key](const auto& kv) { return kv.first == key; });
  };
  if (auto it = find("lr_schedule"); it != extra.end()) {
    if (it->second == "cosine") {
      s.shape = Shape::kCosine;
    } else if (it->second == "linear") {
      s.shape = Shape::kLinear;
    } else if (it->second != "constant") {
      *why = "config lr_schedule '" + it->second + "' is not cosine, linear or constant: the rate is held";
    }
    if (s.shape != Shape::kConstant && !total_steps) {
      *why = "config lr_schedule '" + it->second + "' needs total_steps (the run's last step): the rate is held";
      s.shape = Shape::kConstant;
    }
  }
  if (auto it = find("weight_decay_convention"); it != extra.end()) {
    if (it->second == "independent") {
      s.decay = Decay::kIndependent;
    } else if (it->second != "decoupled") {
      *why =
          "config weight_decay_convention '" + it->second + "' is not decoupled or independent: decoupled is assumed";
    }
  }
  if (auto it = find("min_lr"); it != extra.end()) {
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (errno != 0 || end == it->second.c_str() || *end != '\0' || !std::isfinite(v) || v < 0) {
      *why = "config min_lr '" + it->second + "' is not a rate ≥ 0: 0 is assumed";
    } else {
      s.min_lr = v;
    }
  }
  return s;
}

double LearningRateSchedule::RateAt(double rate_now, uint64_t now, uint64_t step) const {
  if (shape == Shape::kConstant || !total_steps || *total_steps <= warmup_steps || step > *total_steps) return rate_now;
  const auto f = [&](uint64_t t) {
    const double span = static_cast<double>(*total_steps - warmup_steps);
    const double p = t <= warmup_steps ? 0.0 : std::min(1.0, static_cast<double>(t - warmup_steps) / span);
    return shape == Shape::kCosine ? 0.5 * (1 + std::cos(std::numbers::pi * p)) : 1 - p;
  };
  const double at_now = f(now);
  if (!(at_now > 1e-9)) return rate_now;
  return min_lr + (rate_now - min_lr) * f(step) / at_now;
}

std::string_view LearningRateSchedule::DecayText() const {
  return decay == Decay::kIndependent ? "independent decay, λ a step" : "decoupled decay, ηλ a step";
}

std::string LearningRateSchedule::Describe() const {
  if (shape == Shape::kConstant || !total_steps) return "";
  char min[32];
  std::snprintf(min, sizeof(min), "%.4g", min_lr);
  // The step with thousands separators, as every text of the daemon writes steps.
  const std::string digits = std::to_string(*total_steps);
  std::string step;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) step += ',';
    step += digits[i];
  }
  return std::string(shape == Shape::kCosine ? "following its cosine schedule" : "following its linear schedule") +
         " to " + min + " at step " + step;
}

NormProjection ProjectNorm(double norm, const NormDynamics& dynamics, double learning_rate, double weight_decay,
                           uint64_t steps, const LearningRateSchedule* schedule, uint64_t from_step) {
  NormProjection p;
  double n = norm;
  if (schedule != nullptr && schedule->total_steps) {
    // No step past the run's last one.
    steps = *schedule->total_steps > from_step ? std::min(steps, *schedule->total_steps - from_step) : 0;
  }
  const LearningRateSchedule held;  // decoupled, the rate held
  const LearningRateSchedule& s = schedule != nullptr ? *schedule : held;
  if (s.shape == LearningRateSchedule::Shape::kConstant) {
    const double a = 1 - s.DecayPerStep(learning_rate, weight_decay);
    const double b = learning_rate * dynamics.radial;
    const double c = learning_rate * learning_rate * dynamics.orthogonal * dynamics.orthogonal;
    for (uint64_t i = 0; i < steps; ++i) {
      const double along = a * n + b;
      n = std::sqrt(along * along + c);
    }
  } else {
    const double u2 = dynamics.orthogonal * dynamics.orthogonal;
    for (uint64_t i = 1; i <= steps; ++i) {
      const double eta = s.RateAt(learning_rate, from_step, from_step + i);
      const double along = (1 - s.DecayPerStep(eta, weight_decay)) * n + eta * dynamics.radial;
      n = std::sqrt(along * along + eta * eta * u2);
    }
  }
  p.norm_at_end = n;
  const double a = 1 - s.DecayPerStep(learning_rate, weight_decay);
  const double b = learning_rate * dynamics.radial;
  const double c = learning_rate * learning_rate * dynamics.orthogonal * dynamics.orthogonal;
  // The fixed point of n² = (a·n + b)² + c: (1 − a²)·n² − 2ab·n − (b² + c) = 0.
  const double q = 1 - a * a;
  if (q > 0) {
    p.equilibrium_norm = (a * b + std::sqrt(a * a * b * b + q * (b * b + c))) / q;
  } else {
    p.equilibrium_norm = b < 0 ? -(b * b + c) / (2 * b) : std::numeric_limits<double>::infinity();
  }
  // Near the fixed point a gap shrinks by f'(n*) = a·(a·n* + b)/n* a step.
  p.time_constant_steps = std::numeric_limits<double>::infinity();
  if (std::isfinite(p.equilibrium_norm) && p.equilibrium_norm > 0) {
    const double rate = a * (a * p.equilibrium_norm + b) / p.equilibrium_norm;
    if (rate > 0 && rate < 1) p.time_constant_steps = -1 / std::log(rate);
  }
  return p;
}

}  // namespace gradwatch::analytics

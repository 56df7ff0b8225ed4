#include "server/analytics/projection.h"

#include <cmath>
#include <limits>

namespace gradwatch::analytics {

NormDynamics EstimateDynamics(double norm, double slope_per_step, double learning_rate, double weight_decay,
                              double update_norm, double radial_per_step) {
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
  d.radial = (along + eta * weight_decay * norm) / eta;
  if (update_known) {
    d.orthogonal = std::sqrt(std::max(0.0, update_norm * update_norm - along * along)) / eta;
    d.orthogonal_known = true;
  }
  return d;
}

NormProjection ProjectNorm(double norm, const NormDynamics& dynamics, double learning_rate, double weight_decay,
                           uint64_t steps) {
  const double a = 1 - learning_rate * weight_decay;
  const double b = learning_rate * dynamics.radial;
  const double c = learning_rate * learning_rate * dynamics.orthogonal * dynamics.orthogonal;
  NormProjection p;
  double n = norm;
  for (uint64_t i = 0; i < steps; ++i) {
    const double along = a * n + b;
    n = std::sqrt(along * along + c);
  }
  p.norm_at_end = n;
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

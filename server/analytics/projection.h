// What weight decay would do to a parameter's norm: the AdamW what-if.
//
// With decoupled weight decay (PyTorch's AdamW: w ← (1 − ηλ)·w − η·u, the decay ηλ per step) and
// the update split into its radial part and the rest, u = −ρ·ŵ + u⊥, the norm follows exactly
//
//   n(t+1)² = ((1 − ηλ)·n(t) + η·ρ)² + η²·|u⊥|²
//
// (Kosson et al., "Rotational equilibrium", 2023; Wang & Aitchison, "How to set AdamW's weight
// decay", 2024). ρ > 0 pushes the norm outward (a norm gain the loss wants larger); |u⊥| rotates
// the weight and grows its norm too, by the Pythagorean term. The map's fixed point is the
// equilibrium norm n*; a weight whose radial part dominates approaches it with the time constant
// 1/(ηλ), a rotational one about twice as fast. The projection iterates the map step by step
// with ρ, |u⊥| and η held at their recent values.
//
// Pure maths: no I/O.
#pragma once

#include <cstdint>

namespace gradwatch::analytics {

// A parameter's update, per unit learning rate, in the parameter's norm units.
struct NormDynamics {
  double radial = 0;              // ρ: the update's part along the weight (signed: > 0 grows the norm)
  double orthogonal = 0;          // |u⊥|: the norm of the rest
  bool orthogonal_known = false;  // from an update norm; else 0 was assumed
  bool radial_known = false;      // from a reported radial update; else from the norm's slope
};

// The dynamics behind a norm `norm` moving `slope_per_step` per step under weight decay
// `weight_decay` at learning rate `learning_rate`, with `update_norm` the norm of a step's change
// of the weight (|Δw|; NaN or ≤ 0 when unknown: then |u⊥| = 0, all of the slope radial). A
// `radial_per_step` (⟨Δw, w⟩/|w|, a step's change along the weight; NaN when unknown) gives ρ
// directly.
NormDynamics EstimateDynamics(double norm, double slope_per_step, double learning_rate, double weight_decay,
                              double update_norm, double radial_per_step);

struct NormProjection {
  double norm_at_end = 0;          // after `steps` steps
  double equilibrium_norm = 0;     // the map's fixed point (+inf without decay and with growth)
  double time_constant_steps = 0;  // steps to close 1 − 1/e of a small gap to it (+inf without decay)
};

// Iterates the map `steps` times from `norm` with weight decay `weight_decay`.
NormProjection ProjectNorm(double norm, const NormDynamics& dynamics, double learning_rate, double weight_decay,
                           uint64_t steps);

}  // namespace gradwatch::analytics

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
// with ρ and |u⊥| held at their recent values, and η held too unless the run's schedule is known
// (LearningRateSchedule); no step is iterated past the run's last step when that is known.
//
// Pure maths: no I/O.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace gradwatch::analytics {

// A parameter's update, per unit learning rate, in the parameter's norm units.
struct NormDynamics {
  double radial = 0;              // ρ: the update's part along the weight (signed: > 0 grows the norm)
  double orthogonal = 0;          // |u⊥|: the norm of the rest
  bool orthogonal_known = false;  // from an update norm; else 0 was assumed
  bool radial_known = false;      // from a reported radial update; else from the norm's slope
};

// The run's learning-rate schedule after its warm-up, as the trainer names it in its config:
// extra "lr_schedule" (cosine, linear or constant) and "min_lr" (the rate at the last step,
// default 0), with warmup_steps and total_steps. Its shape is anchored at the rate reported now,
// so its peak need not be known.
struct LearningRateSchedule {
  enum class Shape : uint8_t { kConstant, kCosine, kLinear };
  Shape shape = Shape::kConstant;
  // How weight decay meets the rate, from extra "weight_decay_convention": decoupled (PyTorch's
  // AdamW, the default: w ← (1 − ηλ)·w, the decay scales with the rate) or independent
  // (w ← (1 − λ)·w, λ a step whatever the rate: a trainer that applies decay apart from the rate).
  enum class Decay : uint8_t { kDecoupled, kIndependent };
  Decay decay = Decay::kDecoupled;
  uint64_t warmup_steps = 0;
  std::optional<uint64_t> total_steps;  // the run's last step; no step is projected past it
  double min_lr = 0;

  // From a config's fields; `why` says what is wrong with an "lr_schedule", "min_lr" or
  // "weight_decay_convention" given.
  static LearningRateSchedule FromConfig(std::optional<uint64_t> warmup_steps, std::optional<uint64_t> total_steps,
                                         const std::map<std::string, std::string>& extra, std::string* why);
  // "following its cosine schedule to 3e-05 at step 150,000" and the like; empty for a constant
  // rate.
  std::string Describe() const;
  // The rate at `step`, given `rate_now` at `now`: min_lr + (rate_now − min_lr)·f(step)/f(now),
  // f the shape's decay from 1 at the warm-up's end to 0 at total_steps; rate_now when the shape
  // is constant, unknown past total_steps, or spent (f(now) ≈ 0).
  double RateAt(double rate_now, uint64_t now, uint64_t step) const;
  // The fraction of the weight a step's decay removes at rate `rate`: ηλ, or λ (Decay).
  double DecayPerStep(double rate, double weight_decay) const {
    return decay == Decay::kIndependent ? weight_decay : rate * weight_decay;
  }
  // "decoupled decay, ηλ a step" or "independent decay, λ a step".
  std::string_view DecayText() const;
};

// The dynamics behind a norm `norm` moving `slope_per_step` per step under weight decay
// `weight_decay` at learning rate `learning_rate`, with `update_norm` the norm of a step's change
// of the weight (|Δw|; NaN or ≤ 0 when unknown: then |u⊥| = 0, all of the slope radial). A
// `radial_per_step` (⟨Δw, w⟩/|w|, a step's change along the weight; NaN when unknown) gives ρ
// directly. `convention` says how the decay meets the rate (its Decay; decoupled without one).
NormDynamics EstimateDynamics(double norm, double slope_per_step, double learning_rate, double weight_decay,
                              double update_norm, double radial_per_step,
                              const LearningRateSchedule* convention = nullptr);

struct NormProjection {
  double norm_at_end = 0;          // after `steps` steps
  double equilibrium_norm = 0;     // the map's fixed point (+inf without decay and with growth)
  double time_constant_steps = 0;  // steps to close 1 − 1/e of a small gap to it (+inf without decay)
};

// Iterates the map `steps` times from `norm` with weight decay `weight_decay`: with `schedule`,
// from step `from_step` at its rates, with its decay convention, and never past its total_steps.
NormProjection ProjectNorm(double norm, const NormDynamics& dynamics, double learning_rate, double weight_decay,
                           uint64_t steps, const LearningRateSchedule* schedule = nullptr, uint64_t from_step = 0);

}  // namespace gradwatch::analytics

// The AdamW what-if against AdamW itself: a weight trained by the exact AdamW update (bias-corrected
// moments, decoupled decay), its dynamics estimated as the daemon does from its norm's slope and
// update norm without decay, then decay switched on and the projection compared with what the
// weight does.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "server/analytics/projection.h"

using namespace gradwatch::analytics;

namespace {

// A d-dimensional weight under AdamW (β1 0.9, β2 0.999, ε 1e-8). Its gradient is −pull·ŵ (the loss
// wants the norm larger: a norm gain's case) plus Gaussian noise of scale `noise`: with pull
// large the update is mostly radial, with pull 0 rotational.
class AdamWWeight {
 public:
  AdamWWeight(size_t d, double pull, double noise, uint32_t seed)
      : w_(d), m_(d), v_(d), pull_(pull), noise_(noise), rng_(seed) {
    std::normal_distribution<double> init(0.0, 1.0);
    for (double& x : w_) x = init(rng_);
  }

  // One step at learning rate `lr` with weight decay `wd`; returns |Δw|.
  double Step(double lr, double wd) {
    ++t_;
    const double n = Norm();
    const double c1 = 1 - std::pow(0.9, static_cast<double>(t_));
    const double c2 = 1 - std::pow(0.999, static_cast<double>(t_));
    double change2 = 0;
    for (size_t i = 0; i < w_.size(); ++i) {
      const double g = -pull_ * w_[i] / n + noise_ * normal_(rng_);
      m_[i] = 0.9 * m_[i] + 0.1 * g;
      v_[i] = 0.999 * v_[i] + 0.001 * g * g;
      const double u = (m_[i] / c1) / (std::sqrt(v_[i] / c2) + 1e-8);
      const double next = (1 - lr * wd) * w_[i] - lr * u;
      change2 += (next - w_[i]) * (next - w_[i]);
      w_[i] = next;
    }
    return std::sqrt(change2);
  }

  double Norm() const {
    double s = 0;
    for (double x : w_) s += x * x;
    return std::sqrt(s);
  }

 private:
  std::vector<double> w_, m_, v_;
  double pull_, noise_;
  std::mt19937 rng_;
  std::normal_distribution<double> normal_{0.0, 1.0};
  uint64_t t_ = 0;
};

}  // namespace

TEST_CASE("the projection of a norm under AdamW weight decay tracks AdamW within 5% after a time constant",
          "[analytics][projection]") {
  constexpr double kLr = 1e-3;
  constexpr size_t kDim = 256;
  constexpr uint64_t kWarm = 3000;  // steps without decay
  constexpr uint64_t kFit = 500;    // the last of them, where slope and update norm are measured
  struct Regime {
    const char* name;
    double pull;
    double noise;
  };
  for (const Regime regime : {Regime{"radial", 1.0, 0.05}, Regime{"rotational", 0.0, 1.0}}) {
    for (const double wd : {0.1, 0.3, 1.0}) {
      INFO(regime.name << " regime, weight decay " << wd);
      AdamWWeight w(kDim, regime.pull, regime.noise, 7);
      double norm_before_fit = 0, update_sum = 0;
      for (uint64_t t = 0; t < kWarm; ++t) {
        if (t == kWarm - kFit) norm_before_fit = w.Norm();
        const double update = w.Step(kLr, 0.0);
        if (t >= kWarm - kFit) update_sum += update;
      }
      const double norm = w.Norm();
      const double slope = (norm - norm_before_fit) / static_cast<double>(kFit);
      const NormDynamics d = EstimateDynamics(norm, slope, kLr, 0.0, update_sum / kFit, std::nan(""));
      CHECK(d.orthogonal_known);
      if (regime.pull > 0) {
        CHECK(d.radial > d.orthogonal);  // mostly along the weight
      } else {
        CHECK(std::abs(d.radial) < 0.2 * d.orthogonal);  // mostly across it
      }
      // One time constant of the decay, 1/(ηλ), from the moment it is switched on.
      const auto tau = static_cast<uint64_t>(std::round(1 / (kLr * wd)));
      const NormProjection p = ProjectNorm(norm, d, kLr, wd, tau);
      for (uint64_t t = 0; t < tau; ++t) w.Step(kLr, wd);
      INFO("from " << norm << ": projected " << p.norm_at_end << " (equilibrium " << p.equilibrium_norm
                   << ", time constant " << p.time_constant_steps << "), AdamW " << w.Norm());
      CHECK(p.norm_at_end == Approx(w.Norm()).epsilon(0.05));
      CHECK(std::isfinite(p.equilibrium_norm));
      CHECK(p.time_constant_steps > 0);
      CHECK(p.time_constant_steps <= 1.05 / (kLr * wd));
    }
  }
}

TEST_CASE("a projection that follows the run's cosine schedule tracks AdamW on it and stops at the run's last step",
          "[analytics][projection]") {
  constexpr double kPeak = 1e-3, kMin = 1e-4;
  constexpr uint64_t kNow = 3000, kFit = 500, kLast = 13000;
  std::string why;
  const LearningRateSchedule schedule =
      LearningRateSchedule::FromConfig(std::nullopt, kLast, {{"lr_schedule", "cosine"}, {"min_lr", "1e-4"}}, &why);
  REQUIRE(why.empty());
  CHECK(schedule.Describe() == "following its cosine schedule to 0.0001 at step 13,000");
  const auto rate = [&](uint64_t t) {
    return kMin + (kPeak - kMin) * 0.5 * (1 + std::cos(M_PI * static_cast<double>(t) / kLast));
  };
  // Anchored at the rate now, the schedule gives the rate at any later step without knowing its peak.
  CHECK(schedule.RateAt(rate(kNow), kNow, 8000) == Approx(rate(8000)));
  CHECK(schedule.RateAt(rate(kNow), kNow, kLast) == Approx(kMin));

  AdamWWeight w(256, 1.0, 0.05, 7);
  double norm_before_fit = 0, update_sum = 0;
  for (uint64_t t = 0; t < kNow; ++t) {
    if (t == kNow - kFit) norm_before_fit = w.Norm();
    const double update = w.Step(rate(t), 0.0);
    if (t >= kNow - kFit) update_sum += update;
  }
  const double norm = w.Norm();
  const double lr = rate(kNow);
  const NormDynamics d =
      EstimateDynamics(norm, (norm - norm_before_fit) / kFit, lr, 0.0, update_sum / kFit, std::nan(""));
  // 20,000 steps asked for, 10,000 left in the run: the projection stops at its last step.
  const NormProjection scheduled = ProjectNorm(norm, d, lr, 0.3, 20000, &schedule, kNow);
  CHECK(scheduled.norm_at_end == ProjectNorm(norm, d, lr, 0.3, kLast - kNow, &schedule, kNow).norm_at_end);
  const NormProjection held = ProjectNorm(norm, d, lr, 0.3, kLast - kNow);
  for (uint64_t t = kNow; t < kLast; ++t) w.Step(rate(t + 1), 0.3);
  INFO("from " << norm << ": scheduled " << scheduled.norm_at_end << ", held " << held.norm_at_end << ", AdamW "
               << w.Norm());
  CHECK(scheduled.norm_at_end == Approx(w.Norm()).epsilon(0.05));
  CHECK(std::abs(scheduled.norm_at_end - w.Norm()) < std::abs(held.norm_at_end - w.Norm()));
}

TEST_CASE("a schedule the config names wrongly is held, and says why", "[analytics][projection]") {
  std::string why;
  LearningRateSchedule s = LearningRateSchedule::FromConfig(std::nullopt, 1000, {{"lr_schedule", "cosin"}}, &why);
  CHECK(s.shape == LearningRateSchedule::Shape::kConstant);
  CHECK(why == "config lr_schedule 'cosin' is not cosine, linear or constant: the rate is held");
  why.clear();
  s = LearningRateSchedule::FromConfig(std::nullopt, std::nullopt, {{"lr_schedule", "linear"}}, &why);
  CHECK(s.shape == LearningRateSchedule::Shape::kConstant);
  CHECK(why == "config lr_schedule 'linear' needs total_steps (the run's last step): the rate is held");
  why.clear();
  s = LearningRateSchedule::FromConfig(100, 1100, {{"lr_schedule", "linear"}, {"min_lr", "-1"}}, &why);
  CHECK(s.shape == LearningRateSchedule::Shape::kLinear);
  CHECK(s.min_lr == 0);
  CHECK(why == "config min_lr '-1' is not a rate ≥ 0: 0 is assumed");
  // Linear from the warm-up's end (step 100) to step 1,100: half way, half the rate left.
  CHECK(s.RateAt(1.0, 100, 600) == Approx(0.5));
  CHECK(s.RateAt(1.0, 600, 1100) == Approx(0.0).margin(1e-12));
  // Past the run's last step the rate is not known: held.
  CHECK(s.RateAt(0.25, 600, 2000) == 0.25);
  // Without a schedule no step is projected past the run's last either.
  LearningRateSchedule held;
  held.total_steps = 1000;
  const NormDynamics d{.radial = 1.0, .orthogonal = 0, .orthogonal_known = true};
  CHECK(ProjectNorm(10, d, 1e-3, 0.1, 5000, &held, 1000).norm_at_end == 10);
}

TEST_CASE("the norm map's fixed point, time constant and limits", "[analytics][projection]") {
  // Radial only: n* = ρ/λ, approached with the time constant 1/(ηλ).
  const NormDynamics radial{.radial = 2.0, .orthogonal = 0.0};
  NormProjection p = ProjectNorm(100, radial, 1e-3, 0.1, 2'000'000);
  CHECK(p.equilibrium_norm == Approx(2.0 / 0.1).epsilon(1e-9));
  CHECK(p.norm_at_end == Approx(p.equilibrium_norm).epsilon(1e-6));
  CHECK(p.time_constant_steps == Approx(1 / 1e-4).epsilon(1e-3));
  // Rotational only: n* = η|u⊥|/√(1 − a²) ≈ √(η/2λ)·|u⊥|, approached twice as fast.
  const NormDynamics rotational{.radial = 0.0, .orthogonal = 10.0};
  p = ProjectNorm(100, rotational, 1e-3, 0.1, 10);
  CHECK(p.equilibrium_norm == Approx(std::sqrt(1e-6 * 100 / (1 - (1 - 1e-4) * (1 - 1e-4)))).epsilon(1e-9));
  CHECK(p.time_constant_steps == Approx(1 / 2e-4).epsilon(1e-3));
  // Without decay a growing norm has no equilibrium.
  p = ProjectNorm(100, radial, 1e-3, 0.0, 1000);
  CHECK(std::isinf(p.equilibrium_norm));
  CHECK(std::isinf(p.time_constant_steps));
  CHECK(p.norm_at_end == Approx(102.0));
  // The estimate inverts the map: a step of the map gives back the dynamics it was made with.
  const NormDynamics both{.radial = 3.0, .orthogonal = 4.0};
  const double n0 = 50, lr = 1e-3, wd = 0.05;
  const double along = (1 - lr * wd) * n0 + lr * both.radial;
  const double n1 = std::sqrt(along * along + lr * lr * 16);
  const double update = std::sqrt(std::pow(lr * both.radial - lr * wd * n0, 2) + lr * lr * 16);
  const NormDynamics back = EstimateDynamics(n0, n1 - n0, lr, wd, update, std::nan(""));
  CHECK(back.radial == Approx(3.0).epsilon(1e-6));
  CHECK(back.orthogonal == Approx(4.0).epsilon(1e-6));
  // Without an update norm the whole slope is radial.
  const NormDynamics slope_only = EstimateDynamics(n0, 0.002, lr, 0.0, std::nan(""), std::nan(""));
  CHECK(slope_only.radial == Approx(2.0));
  CHECK_FALSE(slope_only.orthogonal_known);
}

TEST_CASE("a trainer's independent decay convention projects λ a step, whatever the rate", "[analytics][projection]") {
  std::string why;
  const LearningRateSchedule independent =
      LearningRateSchedule::FromConfig(std::nullopt, std::nullopt, {{"weight_decay_convention", "independent"}}, &why);
  REQUIRE(why.empty());
  CHECK(independent.DecayText() == "independent decay, λ a step");
  CHECK(LearningRateSchedule{}.DecayText() == "decoupled decay, ηλ a step");
  // A norm growing 0.01 a step under λ 1e-4 a step at rate 1e-3: ρ = (0.01 + 1e-4·100)/1e-3.
  const NormDynamics d = EstimateDynamics(100, 0.01, 1e-3, 1e-4, std::nan(""), std::nan(""), &independent);
  CHECK(d.radial == Approx(20));
  // The map with a = 1 − λ: iterated by hand.
  double n = 100;
  for (int i = 0; i < 500; ++i) n = (1 - 1e-3) * n + 1e-3 * d.radial;
  const NormProjection p = ProjectNorm(100, d, 1e-3, 1e-3, 500, &independent);
  CHECK(p.norm_at_end == Approx(n));
  CHECK(p.time_constant_steps == Approx(1000).epsilon(0.01));
  why.clear();
  LearningRateSchedule::FromConfig(std::nullopt, std::nullopt, {{"weight_decay_convention", "coupled"}}, &why);
  CHECK(why == "config weight_decay_convention 'coupled' is not decoupled or independent: decoupled is assumed");
}

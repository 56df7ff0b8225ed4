#include "alerts/diagnosis.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string_view>

#include "alerts/recommendation.h"
#include "alerts/templates.h"
#include "server/analytics/projection.h"

namespace gradwatch::alerts {
namespace {

constexpr size_t kTopContributors = 3;

std::string Capitalised(std::string s) {
  // A sentence may open with a parameter name, which keeps its case.
  if (s.rfind("the ", 0) == 0 || s.rfind("no ", 0) == 0) s[0] = static_cast<char>(std::toupper(s[0]));
  return s;
}

std::string Join(const std::vector<std::string>& sentences) {
  std::string out;
  for (const std::string& s : sentences) {
    if (s.empty()) continue;
    if (!out.empty()) out += ' ';
    out += Capitalised(s) + ".";
  }
  return out;
}

// "up from 28% at step 61,200" (or "over steps 61,200–62,449" for a mean over several steps)
// when the share's trend holds enough reports and the share moved; "" otherwise.
std::string ShareMove(const Contributor& c) {
  if (c.trend_samples < kShareTrendMinReports || !std::isfinite(c.earlier_share) ||
      std::fabs(c.share - c.earlier_share) < kShareMoveMin) {
    return "";
  }
  std::string s = std::string(c.share > c.earlier_share ? "up" : "down") + " from " + FormatPercent(c.earlier_share);
  if (c.earlier_first_step == c.earlier_last_step) return s + " at step " + FormatStep(c.earlier_first_step);
  return s + " over steps " + FormatStep(c.earlier_first_step) + "–" + FormatStep(c.earlier_last_step);
}

// "layers.7.mlp.w2.weight carries 81% of the squared grad norm, up from 28% at step 61,200;
// lm_head.weight 12%, down from 50% at step 61,200; ..."
std::string TopSentence(const std::vector<Contributor>& top) {
  std::string s;
  for (size_t i = 0; i < top.size(); ++i) {
    const Contributor& c = top[i];
    const std::string move = ShareMove(c);
    if (i == 0) {
      s = c.name + " carries " + FormatPercent(c.share) + " of the squared grad norm";
    } else {
      s += "; " + c.name + " " + FormatPercent(c.share);
    }
    if (!move.empty()) s += ", " + move;
  }
  return s;
}

// "With weight decay 0.1 from step 101,316 (learning rate 7.7e-4; final_norm.weight growing 6.9 per
// 1k steps without decay), final_norm.weight goes from 410 to ~287 by step 121,316 (equilibrium
// ~180, time constant ~13,000 steps), ..." (analytics/projection.h), without its closing period;
// "" without the learning rate, the norm or its slope.
std::string WhatIfSentence(const RunFacts& facts, const ParamFact& gain, double weight_decay, double output_share) {
  const std::optional<double> slope =
      gain.norm_slope_per_kstep ? gain.norm_slope_per_kstep : gain.growth_slope_per_kstep;
  // The parameter's own learning rate when its param group has one (optim/learning_rate/<name>).
  const SeriesValue* own = FindLatest(facts, std::string(keys::kParamLearningRatePrefix) + gain.info.name);
  const bool own_lr = own != nullptr && own->value > 0 && std::isfinite(own->value);
  if (!(weight_decay > 0) || !(own_lr || (facts.learning_rate.known && facts.learning_rate.value > 0)) || !gain.norm ||
      !slope) {
    return "";
  }
  const double lr = own_lr ? own->value : facts.learning_rate.value;
  const analytics::LearningRateSchedule& schedule = facts.config.schedule;
  const analytics::NormDynamics dynamics = analytics::EstimateDynamics(
      *gain.norm, *slope / 1000, lr, gain.info.weight_decay, gain.update_norm.value_or(std::nan("")),
      gain.radial_per_step.value_or(std::nan("")), &schedule);
  const analytics::NormProjection p =
      analytics::ProjectNorm(*gain.norm, dynamics, lr, weight_decay, facts.projection_steps, &schedule, facts.step);
  // No further than the run's last step, when the trainer said which it is.
  uint64_t to_step = facts.step + facts.projection_steps;
  const bool to_end = schedule.total_steps && *schedule.total_steps < to_step;
  if (to_end) to_step = std::max(facts.step, *schedule.total_steps);
  const std::string& name = gain.info.name;
  const std::string followed = schedule.Describe();
  std::string s = "With weight decay " + FormatNumber(weight_decay) + " from step " + FormatStep(facts.step) +
                  (own_lr ? " (its learning rate " : " (learning rate ") + FormatNumber(lr) +
                  (followed.empty() ? "" : ", " + followed) + "; " + name + " " +
                  (*slope >= 0 ? "growing " : "shrinking ") + FormatNumber(std::fabs(*slope)) + " per 1k steps " +
                  (gain.info.weight_decay > 0 ? "with weight decay " + FormatNumber(gain.info.weight_decay)
                                              : std::string("without decay")) +
                  "), " + name + " goes from " + FormatNumber(*gain.norm) + " to ~" + FormatNumber(p.norm_at_end) +
                  " by step " + FormatStep(to_step) + (to_end ? ", the run's last" : "");
  if (std::isfinite(p.equilibrium_norm)) {
    s += " (equilibrium ~" + FormatNumber(p.equilibrium_norm) + ", time constant ~" +
         FormatCount(p.time_constant_steps) + " steps)";
  }
  // The radial part as the trainer reports it, else as the norm's slope implies.
  const std::string radial_source = gain.radial_per_step
                                        ? " (reported: ⟨Δw, w⟩/|w| " + FormatNumber(*gain.radial_per_step) + " a step)"
                                        : std::string();
  s += std::string(followed.empty() ? ", if the learning rate and its update's radial" : ", if its update's radial") +
       radial_source +
       (dynamics.orthogonal_known ? " and rotational parts" : " part (no update norm is reported, so no rotation)") +
       (followed.empty() || dynamics.orthogonal_known ? " stay at their recent values" : " stays at its recent value") +
       (followed.empty() ? "" : " and the learning rate follows its schedule") + " (" +
       std::string(schedule.DecayText()) + ")";
  const SeriesValue* total = FindLatest(facts, keys::kTotalGradNorm);
  if (total != nullptr && std::isfinite(total->value) && output_share > 0 && output_share <= 1) {
    // If the output layer's gradient scales with the gain's norm: its part of the squared total
    // scales with the norm's square.
    const double k = p.norm_at_end / *gain.norm;
    const double out_sq = output_share * k * k;
    s += "; if the output layer's gradient scales with " + name +
         "'s norm, its share of the squared grad norm goes "
         "from " +
         FormatPercent(output_share) + " to ~" + FormatPercent(out_sq / (out_sq + 1 - output_share)) +
         " and the total grad norm from " + FormatNumber(total->value) + " to ~" +
         FormatNumber(total->value * std::sqrt(out_sq + 1 - output_share));
  }
  return s;
}

// The learning rate's state: "the learning rate is 2.8e-4, past its peak of 3e-4 at step 2,000;
// it jumped from 3e-4 to 1e-3 at step 61,200".
std::string LearningRateSentence(const RunFacts& facts) {
  const LearningRateFact& lr = facts.learning_rate;
  if (!lr.known) return "";
  std::string s = "the learning rate is " + FormatNumber(lr.value);
  if (lr.warming_up) {
    s += ", still rising in its warm-up";
  } else if (lr.peak > lr.value) {
    s += ", past its peak of " + FormatNumber(lr.peak) + " at step " + FormatStep(lr.peak_step);
  }
  if (lr.jump_step != 0) {
    s += "; it jumped from " + FormatNumber(lr.jump_from) + " to " + FormatNumber(lr.jump_to) + " at step " +
         FormatStep(lr.jump_step);
  }
  return s;
}

// The newest event (with its slope change) and the newest change point of the total grad norm at
// or before the evaluated step.
std::string EventSentence(const RunFacts& facts) {
  const SlopeChangeFact* event = nullptr;
  for (const SlopeChangeFact& s : facts.slope_changes) {
    if (s.key != keys::kTotalGradNorm || s.event_step > facts.step) continue;
    if (!event || s.event_step >= event->event_step) event = &s;
  }
  const ChangePointFact* change = nullptr;
  for (const ChangePointFact& c : facts.change_points) {
    if (c.key != keys::kTotalGradNorm || c.step > facts.step || !std::isfinite(c.ratio)) continue;
    if (!change || c.step >= change->step) change = &c;
  }
  std::vector<std::string> parts;
  if (event) {
    std::string s = "the latest event is at step " + FormatStep(event->event_step);
    if (!event->event_text.empty()) s += " (\"" + event->event_text + "\")";
    if (std::isfinite(event->ratio) && event->after_samples > 0) {
      s += ", since when the grad norm's slope is ×" + FormatNumber(event->ratio);
    }
    parts.push_back(s);
  }
  if (change) {
    parts.push_back("the grad norm's slope changed ×" + FormatNumber(change->ratio) + " near step " +
                    FormatStep(change->step) + " (no event there)");
  }
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out;
}

std::string RewindSentence(const RunFacts& facts) {
  if (facts.rewind.from_step == 0) return "";
  std::string s = "the run rewound to step " + FormatStep(facts.rewind.from_step);
  if (facts.rewind.abandoned_through >= facts.rewind.from_step) {
    s += " (the abandoned branch reached step " + FormatStep(facts.rewind.abandoned_through) + ")";
  }
  return s;
}

bool HasPerParameterGradNorms(const RunFacts& facts) {
  for (const ShareFact& s : facts.shares) {
    if (!s.is_group && std::isfinite(s.share)) return true;
  }
  for (const ParamFact& p : facts.params) {
    if (p.grad_norm) return true;
  }
  return false;
}

}  // namespace

DiagnosisBounds BoundsFromRules(const std::vector<Rule>& rules) {
  DiagnosisBounds b;
  bool growth = false, share = false;
  for (const Rule& r : rules) {
    if (!growth && r.kind == RuleKind::kGrowthWithoutDecay && r.param_kind == ParamKind::kNormGain &&
        r.min_amplification) {
      b.min_amplification = *r.min_amplification;
      b.max_weight_decay = r.max_weight_decay;
      growth = true;
    }
    if (!share && r.kind == RuleKind::kShare && r.param_kind == ParamKind::kOutput) {
      b.min_share = r.min_share;
      share = true;
    }
  }
  return b;
}

std::string_view CauseName(Cause cause) {
  switch (cause) {
    case Cause::kNone: return "none";
    case Cause::kNoPerParameterNorms: return "no_per_parameter_norms";
    case Cause::kNormGainInflatesOutput: return "norm_gain_inflates_output";
  }
  return "none";
}

Diagnosis Diagnose(const RunFacts& facts, const DiagnosisBounds& bounds) {
  Diagnosis d;

  // Top contributors among the parameters, and the output layer's share.
  std::vector<const ShareFact*> params;
  double output_share = 0;
  bool output_known = false;
  for (const ShareFact& s : facts.shares) {
    if (s.is_group || !std::isfinite(s.share)) continue;
    params.push_back(&s);
    if (s.kind == ParamKind::kOutput) output_share += s.share, output_known = true;
  }
  if (output_known) d.output_share = output_share;
  const size_t top = std::min(kTopContributors, params.size());
  std::partial_sort(params.begin(), params.begin() + static_cast<std::ptrdiff_t>(top), params.end(),
                    [](const ShareFact* a, const ShareFact* b) { return a->share > b->share; });
  for (size_t i = 0; i < top; ++i) {
    const ShareFact& s = *params[i];
    d.top.push_back({s.name, s.share, s.slope_per_kstep, s.earlier_share, s.earlier_first_step, s.earlier_last_step,
                     s.trend_samples});
  }

  // Norm gains without decay, as the growth rule judges them.
  const ParamFact* final_norm = FindFinalNorm(facts);
  const ParamFact* grown = nullptr;
  // A gain grown to the bound that has weight decay (above the growth rule's): a remedy already
  // made (a catalog change), or a decay too weak for it.
  const ParamFact* decayed_grown = nullptr;
  for (const ParamFact& p : facts.params) {
    if (p.info.kind != ParamKind::kNormGain && p.info.role != "final_norm") continue;
    if (!(p.info.weight_decay <= bounds.max_weight_decay)) {
      const std::optional<double> a = AmplificationOf(p);
      if (a && *a >= bounds.min_amplification &&
          (!decayed_grown || &p == final_norm ||
           (decayed_grown != final_norm && *a > AmplificationOf(*decayed_grown).value_or(0)))) {
        decayed_grown = &p;
      }
      continue;
    }
    GainEvidence g;
    g.name = p.info.name;
    g.weight_decay = p.info.weight_decay;
    g.norm = p.norm;
    g.init_norm = InitNormOf(p);
    g.amplification = AmplificationOf(p);
    g.slope_per_kstep = p.norm_slope_per_kstep ? p.norm_slope_per_kstep : p.growth_slope_per_kstep;
    g.rising = NormRising(p);
    g.grown = g.rising && g.amplification && *g.amplification >= bounds.min_amplification;
    if (g.grown && (!grown || &p == final_norm ||
                    (grown != final_norm && *g.amplification > AmplificationOf(*grown).value_or(0)))) {
      grown = &p;
    }
    d.gains.push_back(std::move(g));
  }
  std::stable_sort(d.gains.begin(), d.gains.end(),
                   [](const GainEvidence& a, const GainEvidence& b) { return a.grown && !b.grown; });

  const bool per_parameter = HasPerParameterGradNorms(facts);
  const bool output_dominates = output_known && output_share >= bounds.min_share;
  const double suggested_wd = DecayedParamsWeightDecay(facts);

  std::vector<std::string> evidence;
  if (grown && output_dominates) {
    d.cause = Cause::kNormGainInflatesOutput;
    evidence.push_back(GainSentence(facts, *grown));
    std::string share = OutputShareSentence(facts);
    if (facts.config.z_loss_coef) {
      const std::string z =
          *facts.config.z_loss_coef > 0 ? "z-loss coefficient " + FormatNumber(*facts.config.z_loss_coef) : "no z-loss";
      share = share.empty() ? z : share + "; " + z;
    }
    evidence.push_back(share);
    const std::string& name = grown->info.name;
    d.remedy.param = name;
    d.remedy.weight_decay = suggested_wd;
    d.remedy.supported = true;
    d.remedy.why = name + " has grown to " + FormatNumber(AmplificationOf(*grown).value_or(0)) +
                   "× its init norm without weight decay and is still rising, and the output layer carries " +
                   FormatPercent(output_share) + " of the squared grad norm (at least " +
                   FormatPercent(bounds.min_share) + ")";
    std::string action = (grown->info.weight_decay > 0 ? "Recommendation: raise the weight decay on "
                                                       : "Recommendation: enable weight decay on ") +
                         name;
    if (suggested_wd > 0) action += " (the run uses " + FormatNumber(suggested_wd) + " for its decayed parameters)";
    if (const std::string what_if = WhatIfSentence(facts, *grown, suggested_wd, output_share); !what_if.empty()) {
      action += ". " + what_if;
    }
    d.text = Join(evidence) + " A norm gain without weight decay inflates the output layer: " + name +
             " scales the output layer's inputs, and so its gradients, by its amplification.";
    d.recommendation = Join(evidence) + " " + action + ".";
    return d;
  }

  if (!per_parameter) {
    d.cause = Cause::kNoPerParameterNorms;
    std::vector<std::string> s = {LearningRateSentence(facts), EventSentence(facts), RewindSentence(facts)};
    const std::string context = Join(s);
    d.text = "This run reports only its total grad norm, so no cause can be named." +
             (context.empty() ? std::string() : " " + context);
    d.recommendation =
        "No cause can be named from the total alone: send per-parameter norms (gradwatch.torch.Watch, or the "
        "JSONL keys grad/norm/<param> and params/norm/<param>) and gradwatch will say where the grad norm comes "
        "from.";
    if (facts.warmup.holds_pages) {
      d.recommendation = "The run is in its warm-up (" + facts.warmup.reason + "), when large grad norms are usual. " +
                         d.recommendation;
    }
    d.remedy.why = "the run reports no per-parameter norms";
    return d;
  }

  evidence.push_back(TopSentence(d.top));
  if (!d.gains.empty()) {
    const GainEvidence* shown = nullptr;
    for (const GainEvidence& g : d.gains) {
      if (g.grown) {
        shown = &g;
        break;
      }
      if (final_norm && g.name == final_norm->info.name) shown = &g;
    }
    if (shown && shown->grown) {
      evidence.push_back(shown->name + " (weight decay " + FormatNumber(shown->weight_decay) + ") has grown to " +
                         FormatNumber(*shown->amplification) + "× its init norm and is rising, but the output layer " +
                         (output_known ? "carries " + FormatPercent(output_share) +
                                             " of the squared grad norm, below " + FormatPercent(bounds.min_share)
                                       : "reports no share of the grad norm"));
    } else {
      std::string s = decayed_grown ? "no norm gain without weight decay is growing" : "no norm gain is growing";
      if (shown && shown->amplification) {
        s += " (" + shown->name + " at " + FormatNumber(*shown->amplification) + "× its init norm";
        s += std::string(shown->rising ? ", rising" : ", not rising") + ")";
      }
      evidence.push_back(s);
    }
  }
  if (decayed_grown && !grown) {
    evidence.push_back(decayed_grown->info.name + " is at " + FormatNumber(*AmplificationOf(*decayed_grown)) +
                       "× its init norm with weight decay " + FormatNumber(decayed_grown->info.weight_decay) +
                       (NormRising(*decayed_grown) ? ", still rising" : ", no longer rising"));
  }
  evidence.push_back(LearningRateSentence(facts));
  evidence.push_back(EventSentence(facts));
  evidence.push_back(RewindSentence(facts));
  d.text = Join(evidence) + " No cause found in the per-parameter norms.";

  const std::string& top_name = d.top.empty() ? std::string() : d.top[0].name;
  std::string rec;
  if (facts.warmup.holds_pages) {
    rec = "The run is in its warm-up (" + facts.warmup.reason + "), when large grad norms are usual: no action " +
          "unless it persists past the warm-up.";
  } else if (decayed_grown && !grown) {
    rec = decayed_grown->info.name + " already has weight decay " + FormatNumber(decayed_grown->info.weight_decay) +
          ": no further weight-decay change is indicated; follow its norm as the decay acts" +
          (top_name.empty()
               ? std::string(".")
               : ", and look at " + top_name + " (" + FormatPercent(d.top[0].share) + " of the squared grad norm).");
  } else if (!top_name.empty()) {
    rec = "No cause found in the per-parameter norms, and no weight-decay change is indicated: look at " + top_name +
          " (" + FormatPercent(d.top[0].share) + " of the squared grad norm), its inputs and the data at these steps.";
  } else {
    rec = "No cause found in the per-parameter norms.";
  }
  d.recommendation = rec;
  if (final_norm) {
    d.remedy.param = final_norm->info.name;
    d.remedy.weight_decay = suggested_wd;
  }
  if (decayed_grown && !grown) {
    d.remedy.param = decayed_grown->info.name;
    d.remedy.why =
        decayed_grown->info.name + " already has weight decay " + FormatNumber(decayed_grown->info.weight_decay);
  } else if (grown) {
    d.remedy.param = grown->info.name;
    d.remedy.why = "the output layer carries " +
                   (output_known ? FormatPercent(output_share) : std::string("no known share")) +
                   " of the squared grad norm, below " + FormatPercent(bounds.min_share);
  } else if (final_norm) {
    const std::optional<double> a = AmplificationOf(*final_norm);
    d.remedy.why = final_norm->info.name + " has not grown significantly (" +
                   (a ? FormatNumber(*a) + "× its init norm" : std::string("its norm is unknown")) +
                   (NormRising(*final_norm) ? "" : ", not rising") + ")";
  } else {
    d.remedy.why = "the run has no norm gain without weight decay";
  }
  return d;
}

}  // namespace gradwatch::alerts

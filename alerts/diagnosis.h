// The diagnosis of a run at one step: what its data shows about where the total grad norm comes
// from, and what that evidence supports doing. Every alert's recommendation, its `diagnosis`
// template variable and its remediation fields are rendered from it, so a page states a cause
// only when the run's data holds it:
//  - kNormGainInflatesOutput, the incident's cause: a norm gain with weight decay at most the
//    growth rule's max_weight_decay has grown significantly (amplification at least the growth
//    rule's min_amplification, and still rising) AND the output layer carries at least the share
//    rule's min_share of the squared grad norm. Only then is weight decay on that gain advised,
//    with a value (the run's decayed parameters' weight decay);
//  - kNoPerParameterNorms: the run reports no per-parameter grad norms (a log tail, a trainer
//    sending the total alone): no cause can be named, and the text says how to send them;
//  - kNone: the top contributors, the norm gains' state, the learning rate, the nearest event or
//    change point and a rewind are named as they are, and "no cause found in the per-parameter
//    norms" is said outright.
// The bounds are the rules' own (BoundsFromRules), so a team that tunes its rules tunes the
// diagnosis with them. Pure: facts in, text out.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/facts.h"
#include "alerts/rules.h"

namespace gradwatch::alerts {

// The annotations every alert whose rule shows the diagnosis (`{{ recommendation }}` or
// `{{ diagnosis }}`) carries besides its templates: fields for machines (gradwatch.torch.Remediation,
// a receiver), so that nobody parses prose. remediation_param and remediation_weight_decay are
// absent when there is no parameter to name; remediation_supported is "true" only when the
// evidence holds the cause (Remedy::supported).
inline constexpr std::string_view kCauseAnnotation = "cause";
inline constexpr std::string_view kRemediationParamAnnotation = "remediation_param";
inline constexpr std::string_view kRemediationWeightDecayAnnotation = "remediation_weight_decay";
inline constexpr std::string_view kRemediationSupportedAnnotation = "remediation_supported";
inline constexpr std::string_view kRemediationWhyAnnotation = "remediation_why";

struct DiagnosisBounds {
  double min_amplification = 4.0;  // a norm gain has grown significantly from here
  double max_weight_decay = 0.0;   // a gain with at most this weight decay is "without decay"
  double min_share = 0.9;          // the output layer dominates the squared grad norm from here
};
// The bounds of the first growth_without_decay rule on norm gains with a min_amplification and
// the first share rule on the output kind among `rules`; the defaults above where there is none.
DiagnosisBounds BoundsFromRules(const std::vector<Rule>& rules);

enum class Cause {
  kNone,                    // no cause found in the per-parameter norms
  kNoPerParameterNorms,     // nothing to look for one in
  kNormGainInflatesOutput,  // the incident's cause
};
// "none", "no_per_parameter_norms", "norm_gain_inflates_output": the `cause` annotation.
std::string_view CauseName(Cause cause);

// One parameter's (or group's) share of the squared grad norm.
struct Contributor {
  std::string name;
  double share = 0;               // a fraction
  double slope_per_kstep = kNaN;  // of the share (a fraction per 1,000 steps); NaN: unknown
  // Where the share stood at the start of its trend's window (ShareFact), and the reports the
  // trend holds: the diagnosis says "up from 28% at step 61,200" only once the trend holds
  // kShareTrendMinReports and the share moved by at least kShareMoveMin.
  double earlier_share = kNaN;
  uint64_t earlier_first_step = 0;
  uint64_t earlier_last_step = 0;
  uint64_t trend_samples = 0;
};
// A share's movement is stated once its trend holds this many reports...
inline constexpr uint64_t kShareTrendMinReports = 20;
// ...and it moved by at least this much (a fraction: 5 points of the squared grad norm).
inline constexpr double kShareMoveMin = 0.05;

// A norm gain as the evidence rule sees it.
struct GainEvidence {
  std::string name;
  double weight_decay = 0;
  std::optional<double> norm;
  std::optional<double> init_norm;
  std::optional<double> amplification;
  std::optional<double> slope_per_kstep;  // of its norm
  bool rising = false;
  bool grown = false;  // amplification ≥ min_amplification and rising, weight decay ≤ max
};

// What the evidence supports doing, as structured fields (the alert's remediation_* annotations,
// which gradwatch.torch.Remediation reads).
struct Remedy {
  std::string param;        // the parameter to act on; empty when none
  double weight_decay = 0;  // the weight decay to give it; 0 when the run has no decayed value
  bool supported = false;   // the evidence holds the cause this remedy treats
  std::string why;          // one sentence: why it is, or is not, supported
};

struct Diagnosis {
  Cause cause = Cause::kNone;
  std::vector<Contributor> top;     // parameters, largest share first (at most 3)
  double output_share = kNaN;       // the output parameters' share together; NaN: unknown
  std::vector<GainEvidence> gains;  // norm gains without decay, the grown ones first
  Remedy remedy;
  // Sentences for people: the evidence, then the cause or "no cause found".
  std::string text;
  // The action: "Recommendation: enable weight decay on final_norm.weight (...)" or what the
  // evidence supports instead.
  std::string recommendation;
};

Diagnosis Diagnose(const RunFacts& facts, const DiagnosisBounds& bounds);

// A run's diagnosis at a step, and why pages are held then (WarmupFact::reason; empty: not held).
struct DiagnosisAt {
  uint64_t step = 0;
  Diagnosis diagnosis;
  std::string page_held;
};

}  // namespace gradwatch::alerts

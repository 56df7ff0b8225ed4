// The pieces the diagnosis (diagnosis.h) names things with: which norm gain feeds the lm_head,
// the weight decay the run gives its decayed parameters, and the sentences that state a gain's
// and the output layer's evidence.
#pragma once

#include <optional>
#include <string>

#include "alerts/facts.h"

namespace gradwatch::alerts {

// The norm gain feeding the lm_head, found in order by
//  1. the catalog role "final_norm";
//  2. a norm_gain parameter named like a final norm: final_norm, ln_f, norm_f, final_layernorm,
//     final_layer_norm, model.norm (any prefix, with or without .weight), or a top-level norm;
//  3. the norm_gain with the largest amplification over its initial norm.
// nullptr when the run has no norm gain.
const ParamFact* FindFinalNorm(const RunFacts& facts);
// Whether FindFinalNorm may pick p (whose norm slope Recommend then reads).
bool MayBeFinalNorm(const ParamInfo& p);

// The weight decay the run uses for its decayed parameters: the config's weight decay when
// positive, else the most common non-zero weight decay in the catalog; 0 when there is none.
double DecayedParamsWeightDecay(const RunFacts& facts);

// A parameter's init norm (the fact's, the catalog's, else sqrt(numel) for a norm gain) and its
// norm over it; nullopt when unknown.
std::optional<double> InitNormOf(const ParamFact& p);
std::optional<double> AmplificationOf(const ParamFact& p);
// Whether its norm is rising: growth reported by the analytics, or a positive slope.
bool NormRising(const ParamFact& p);

// "final_norm.weight has weight decay 0; its norm is 362.1, 4.62× its init norm 78.38, rising
// 2.5 per 1k steps (×2.5 since step 81,716: switched to near-dropless EP routing)" (no final
// period); facts the run lacks are left out.
std::string GainSentence(const RunFacts& facts, const ParamFact& gain);
// "lm_head.weight carries 93.9% of the squared grad norm", from the output parameters' shares;
// "" when none is known.
std::string OutputShareSentence(const RunFacts& facts);

}  // namespace gradwatch::alerts

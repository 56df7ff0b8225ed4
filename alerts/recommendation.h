// The recommendation for the grad-norm contingency: which norm gain is inflating the lm_head's
// inputs, the evidence, and what to do about it.
#pragma once

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

// E.g. "final_norm.weight has weight decay 0; its norm is 362.1, 4.62× its init norm 78.38,
// rising 2.5 per 1k steps (×2.5 since step 81,716: switched to near-dropless EP routing).
// lm_head.weight carries 93.9% of the squared grad norm; z-loss coefficient 1e-4.
// Recommendation: enable weight decay on final_norm.weight (the run uses 0.1 for its decayed
// parameters)." Facts the run lacks are left out; "" when there is nothing to say.
std::string Recommend(const RunFacts& facts);

}  // namespace gradwatch::alerts

#include "alerts/recommendation.h"

#include <cctype>
#include <cmath>
#include <map>
#include <string_view>
#include <vector>

#include "alerts/templates.h"

namespace gradwatch::alerts {
namespace {

std::vector<std::string_view> Components(std::string_view name) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    parts.push_back(name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  if (parts.size() > 1 && (parts.back() == "weight" || parts.back() == "scale" || parts.back() == "gamma")) {
    parts.pop_back();
  }
  return parts;
}

bool NamedLikeFinalNorm(std::string_view name) {
  const std::vector<std::string_view> parts = Components(name);
  const std::string_view last = parts.back();
  if (last == "final_norm" || last == "ln_f" || last == "norm_f" || last == "final_layernorm" ||
      last == "final_layer_norm") {
    return true;
  }
  if (last == "norm" && parts.size() >= 2 && parts[parts.size() - 2] == "model") return true;
  return last == "norm" && parts.size() == 1;  // "norm.weight" at the top level
}

// "(×2.5 since step 81,716: switched to near-dropless EP routing)", from the newest event of the
// parameter's norm series, else its newest change point; "" when neither is known.
std::string SlopeChangeNote(const RunFacts& facts, const std::string& norm_key) {
  const SlopeChangeFact* event = nullptr;
  for (const SlopeChangeFact& s : facts.slope_changes) {
    if (s.key == norm_key && std::isfinite(s.ratio) && (!event || s.event_step >= event->event_step)) {
      event = &s;
    }
  }
  if (event) {
    std::string note = "×" + FormatNumber(event->ratio) + " since step " + FormatStep(event->event_step);
    if (!event->event_text.empty()) note += ": " + event->event_text;
    return note;
  }
  const ChangePointFact* change = nullptr;
  for (const ChangePointFact& c : facts.change_points) {
    if (c.key == norm_key && std::isfinite(c.ratio) && (!change || c.step >= change->step)) change = &c;
  }
  if (change) return "×" + FormatNumber(change->ratio) + " since a change near step " + FormatStep(change->step);
  return "";
}

}  // namespace

std::string OutputShareSentence(const RunFacts& facts) {
  std::map<std::string_view, double> share_of;
  for (const ShareFact& s : facts.shares) {
    if (!s.is_group && std::isfinite(s.share)) share_of[s.name] = s.share;
  }
  std::vector<std::pair<std::string_view, double>> outputs;
  for (const ParamFact& p : facts.params) {
    if (p.info.kind != ParamKind::kOutput) continue;
    auto it = share_of.find(p.info.name);
    if (it != share_of.end()) outputs.emplace_back(p.info.name, it->second);
  }
  if (outputs.empty()) return "";
  if (outputs.size() == 1) {
    return std::string(outputs[0].first) + " carries " + FormatPercent(outputs[0].second) + " of the squared grad norm";
  }
  double sum = 0;
  for (const auto& [name, share] : outputs) sum += share;
  return "the " + std::to_string(outputs.size()) + " output parameters carry " + FormatPercent(sum) +
         " of the squared grad norm";
}

std::optional<double> InitNormOf(const ParamFact& p) {
  if (p.init_norm && *p.init_norm > 0) return p.init_norm;
  if (p.info.init_norm && *p.info.init_norm > 0) return p.info.init_norm;
  if (p.info.kind == ParamKind::kNormGain && p.info.numel > 0) {
    return std::sqrt(static_cast<double>(p.info.numel));
  }
  return std::nullopt;
}

std::optional<double> AmplificationOf(const ParamFact& p) {
  if (p.amplification && std::isfinite(*p.amplification)) return p.amplification;
  const std::optional<double> init = InitNormOf(p);
  if (p.norm && std::isfinite(*p.norm) && init) return *p.norm / *init;
  return std::nullopt;
}

bool NormRising(const ParamFact& p) {
  return (p.growth_factor && (!p.growth_slope_per_kstep || *p.growth_slope_per_kstep > 0)) ||
         (p.norm_slope_per_kstep && *p.norm_slope_per_kstep > 0);
}

const ParamFact* FindFinalNorm(const RunFacts& facts) {
  for (const ParamFact& p : facts.params) {
    if (p.info.role == "final_norm") return &p;
  }
  for (const ParamFact& p : facts.params) {
    if (p.info.kind == ParamKind::kNormGain && NamedLikeFinalNorm(p.info.name)) return &p;
  }
  const ParamFact* best = nullptr;
  double best_amplification = -1;
  for (const ParamFact& p : facts.params) {
    if (p.info.kind != ParamKind::kNormGain) continue;
    const double a = AmplificationOf(p).value_or(0);
    if (a > best_amplification) {
      best = &p;
      best_amplification = a;
    }
  }
  return best;
}

bool MayBeFinalNorm(const ParamInfo& p) { return p.role == "final_norm" || p.kind == ParamKind::kNormGain; }

double DecayedParamsWeightDecay(const RunFacts& facts) {
  if (facts.config.weight_decay && *facts.config.weight_decay > 0) return *facts.config.weight_decay;
  std::map<double, size_t> counts;
  for (const ParamFact& p : facts.params) {
    if (p.info.weight_decay > 0 && std::isfinite(p.info.weight_decay)) ++counts[p.info.weight_decay];
  }
  double best = 0;
  size_t best_count = 0;
  for (const auto& [wd, n] : counts) {
    if (n > best_count) {  // ties: the smaller weight decay, the gentler suggestion
      best = wd;
      best_count = n;
    }
  }
  return best;
}

std::string GainSentence(const RunFacts& facts, const ParamFact& gain) {
  const std::string& name = gain.info.name;
  std::string s = name + " has weight decay " + FormatNumber(gain.info.weight_decay);
  if (!gain.norm || !std::isfinite(*gain.norm)) return s;
  s += "; its norm is " + FormatNumber(*gain.norm);
  const std::optional<double> init = InitNormOf(gain);
  const double amplification = AmplificationOf(gain).value_or(0);
  if (init && amplification > 0) s += ", " + FormatNumber(amplification) + "× its init norm " + FormatNumber(*init);
  std::optional<double> slope = gain.norm_slope_per_kstep;
  if (!slope) slope = gain.growth_slope_per_kstep;
  if (slope && std::isfinite(*slope)) {
    s += std::string(*slope >= 0 ? ", rising " : ", falling ") + FormatNumber(std::fabs(*slope)) + " per 1k steps";
  }
  const std::string note = SlopeChangeNote(facts, keys::ParamNorm(name));
  if (!note.empty()) s += " (" + note + ")";
  return s;
}

}  // namespace gradwatch::alerts

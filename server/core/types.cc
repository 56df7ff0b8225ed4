#include "server/core/types.h"

#include <cmath>
#include <cstring>

namespace gradwatch {

std::string_view ParamKindName(ParamKind kind) {
  switch (kind) {
    case ParamKind::kUnspecified: return "unspecified";
    case ParamKind::kNormGain: return "norm_gain";
    case ParamKind::kOutput: return "output";
    case ParamKind::kEmbedding: return "embedding";
    case ParamKind::kRouter: return "router";
    case ParamKind::kAttention: return "attention";
    case ParamKind::kMlp: return "mlp";
    case ParamKind::kOther: return "other";
  }
  return "unspecified";
}

std::optional<ParamKind> ParseParamKind(std::string_view name) {
  struct Alias {
    std::string_view name;
    ParamKind kind;
  };
  static constexpr Alias kAliases[] = {
      {"unspecified", ParamKind::kUnspecified},
      {"", ParamKind::kUnspecified},
      {"norm_gain", ParamKind::kNormGain},
      {"norm", ParamKind::kNormGain},
      {"gain", ParamKind::kNormGain},
      {"output", ParamKind::kOutput},
      {"lm_head", ParamKind::kOutput},
      {"embedding", ParamKind::kEmbedding},
      {"embed", ParamKind::kEmbedding},
      {"router", ParamKind::kRouter},
      {"gate", ParamKind::kRouter},
      {"attention", ParamKind::kAttention},
      {"attn", ParamKind::kAttention},
      {"mlp", ParamKind::kMlp},
      {"expert", ParamKind::kMlp},
      {"other", ParamKind::kOther},
  };
  for (const auto& a : kAliases) {
    if (a.name == name) return a.kind;
  }
  return std::nullopt;
}

std::string_view ParamInfo::EffectiveGroup() const {
  return group.empty() ? ParamKindName(kind) : std::string_view(group);
}

std::string_view EndReasonName(EndReason reason) {
  switch (reason) {
    case EndReason::kNone: return "active";
    case EndReason::kInactive: return "inactive";
    case EndReason::kFinished: return "finished";
    case EndReason::kStopped: return "stopped";
  }
  return "active";
}

bool GlobMatches(std::string_view pattern, std::string_view text) {
  // The common shape, "prefix*" (every parameter's grad norm: grad/norm/*): a prefix comparison.
  if (!pattern.empty() && pattern.back() == '*' && pattern.find_first_of("*?") == pattern.size() - 1) {
    return text.substr(0, pattern.size() - 1) == pattern.substr(0, pattern.size() - 1);
  }
  // Iterative matcher with single-star backtracking: O(|pattern| × |text|) at worst.
  size_t p = 0, t = 0;
  size_t star = std::string_view::npos, mark = 0;
  while (t < text.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == text[t])) {
      ++p;
      ++t;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

namespace keys {
std::string GradNorm(std::string_view param) { return std::string(kGradNormPrefix) + std::string(param); }
std::string ParamNorm(std::string_view param) { return std::string(kParamNormPrefix) + std::string(param); }
std::string UpdateNorm(std::string_view param) { return std::string(kUpdateNormPrefix) + std::string(param); }
std::string RadialUpdate(std::string_view param) { return std::string(kRadialUpdatePrefix) + std::string(param); }
}  // namespace keys

namespace {
// Bitwise equality so that NaN repeats compare equal to themselves.
bool SameDouble(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }
bool SameOpt(const std::optional<double>& a, const std::optional<double>& b) {
  if (a.has_value() != b.has_value()) return false;
  return !a || SameDouble(*a, *b);
}
bool SameNorm(const NormContribution& a, const NormContribution& b) {
  // Compared by value (a long double's padding bytes are unspecified); NaN matches NaN.
  return a.present == b.present && (!a.present || a.sq == b.sq || (std::isnan(a.sq) && std::isnan(b.sq)));
}
}  // namespace

bool RankStep::SameValues(const RankStep& o) const {
  if (step != o.step || !SameDouble(wall_time, o.wall_time) || !SameOpt(loss, o.loss) || !SameOpt(z_loss, o.z_loss) ||
      !SameOpt(learning_rate, o.learning_rate) || tokens != o.tokens || !SameNorm(total_grad, o.total_grad) ||
      params.size() != o.params.size() || extra.size() != o.extra.size()) {
    return false;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].index != o.params[i].index) return false;
    for (int f = 0; f < kNormFields; ++f) {
      if (!SameNorm(params[i].norms[f], o.params[i].norms[f])) return false;
    }
    const RadialContribution &a = params[i].radial, &b = o.params[i].radial;
    if (a.form != b.form || (a.present() && !SameDouble(a.value, b.value))) return false;
  }
  for (size_t i = 0; i < extra.size(); ++i) {
    if (extra[i].first != o.extra[i].first || !SameDouble(extra[i].second, o.extra[i].second)) {
      return false;
    }
  }
  return true;
}

bool IsFinite(double v) { return std::isfinite(v); }

}  // namespace gradwatch

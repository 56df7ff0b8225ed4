#include "alerts/templates.h"

#include <cmath>
#include <cstdio>
#include <optional>

namespace gradwatch::alerts {
namespace {

constexpr std::string_view kOpen = "{{";
constexpr std::string_view kClose = "}}";
constexpr std::string_view kLabelsPrefix = "labels.";

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

bool IsSpace(char c) { return c == ' ' || c == '\t'; }

// A valid placeholder name: an identifier, or labels.<identifier>.
bool ValidName(std::string_view name) {
  if (name.substr(0, kLabelsPrefix.size()) == kLabelsPrefix) name.remove_prefix(kLabelsPrefix.size());
  if (name.empty()) return false;
  for (char c : name) {
    if (!IsNameChar(c)) return false;
  }
  return true;
}

struct Placeholder {
  size_t begin = 0;  // offset of "{{"
  size_t end = 0;    // offset just past "}}"
  std::string_view name;
};

// Finds the next placeholder at or after `from`. nullopt with *error empty: no more
// placeholders; with *error set: a syntax error.
std::optional<Placeholder> Next(std::string_view text, size_t from, std::string* error) {
  const size_t open = text.find(kOpen, from);
  if (open == std::string_view::npos) return std::nullopt;
  const size_t close = text.find(kClose, open + kOpen.size());
  if (close == std::string_view::npos) {
    *error = "unclosed '{{' at offset " + std::to_string(open);
    return std::nullopt;
  }
  std::string_view inner = text.substr(open + kOpen.size(), close - open - kOpen.size());
  while (!inner.empty() && IsSpace(inner.front())) inner.remove_prefix(1);
  while (!inner.empty() && IsSpace(inner.back())) inner.remove_suffix(1);
  if (inner.empty()) {
    *error = "empty placeholder at offset " + std::to_string(open);
    return std::nullopt;
  }
  if (!ValidName(inner)) {
    *error = "bad variable name '" + std::string(inner) + "' at offset " + std::to_string(open);
    return std::nullopt;
  }
  return Placeholder{open, close + kClose.size(), inner};
}

std::string WithSeparators(std::string digits) {
  std::string out;
  const size_t n = digits.size();
  out.reserve(n + n / 3);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && (n - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// Drops trailing zeros of a fixed or %g mantissa: "4.620" → "4.62", "5.000" → "5".
std::string TrimZeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

std::string NonFinite(double v) {
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+Inf" : "-Inf";
}

}  // namespace

StatusOr<std::vector<std::string>> TemplateVariables(std::string_view text) {
  std::vector<std::string> names;
  size_t pos = 0;
  std::string error;
  while (auto p = Next(text, pos, &error)) {
    names.emplace_back(p->name);
    pos = p->end;
  }
  if (!error.empty()) return Status::InvalidArgument(error);
  return names;
}

Status CheckTemplate(std::string_view text, const std::set<std::string>& allowed) {
  auto names = TemplateVariables(text);
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    if (name.rfind(kLabelsPrefix, 0) == 0 || allowed.count(name)) continue;
    std::string known;
    for (const std::string& a : allowed) known += (known.empty() ? "" : ", ") + a;
    return Status::InvalidArgument("unknown variable '" + name + "' (known: " + known +
                                   ", labels.<name>)");
  }
  return Status::Ok();
}

std::string RenderTemplate(std::string_view text, const TemplateVars& vars, const LabelSet& labels) {
  std::string out;
  out.reserve(text.size() + 32);
  size_t pos = 0;
  std::string error;
  while (auto p = Next(text, pos, &error)) {
    out.append(text.substr(pos, p->begin - pos));
    if (p->name.substr(0, kLabelsPrefix.size()) == kLabelsPrefix) {
      auto it = labels.find(std::string(p->name.substr(kLabelsPrefix.size())));
      if (it != labels.end()) out.append(it->second);
    } else {
      auto it = vars.find(std::string(p->name));
      if (it != vars.end()) out.append(it->second);
    }
    pos = p->end;
  }
  out.append(text.substr(pos));
  return out;
}

bool TemplateUses(std::string_view text, std::string_view name) {
  auto names = TemplateVariables(text);
  if (!names.ok()) return false;
  for (const std::string& n : *names) {
    if (n == name) return true;
  }
  return false;
}

std::string FormatNumber(double value) {
  if (!std::isfinite(value)) return NonFinite(value);
  if (value == 0) return "0";
  const double mag = std::fabs(value);
  char buf[64];
  if (mag >= 9999.5) {
    if (mag >= 1e15) {
      std::snprintf(buf, sizeof(buf), "%.3e", value);
    } else {
      std::snprintf(buf, sizeof(buf), "%.0f", mag);
      return (value < 0 ? "-" : "") + WithSeparators(buf);
    }
  } else if (mag < 1e-3) {
    std::snprintf(buf, sizeof(buf), "%.3e", value);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", value);
    return TrimZeros(buf);
  }
  // Scientific: trim the mantissa, shorten the exponent ("1.000e-04" → "1e-4").
  std::string s(buf);
  const size_t e = s.find('e');
  std::string mantissa = TrimZeros(s.substr(0, e));
  std::string exponent = s.substr(e + 1);
  std::string sign;
  if (!exponent.empty() && (exponent[0] == '-' || exponent[0] == '+')) {
    if (exponent[0] == '-') sign = "-";
    exponent.erase(0, 1);
  }
  while (exponent.size() > 1 && exponent[0] == '0') exponent.erase(0, 1);
  return mantissa + "e" + sign + exponent;
}

std::string FormatStep(uint64_t step) { return WithSeparators(std::to_string(step)); }

std::string FormatCount(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "∞" : "-∞";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.0f", std::fabs(value));
  return (value < 0 && std::llround(value) != 0 ? "-" : "") + WithSeparators(buf);
}

std::string FormatPercent(double fraction) {
  if (!std::isfinite(fraction)) return NonFinite(fraction);
  if (fraction > 0 && fraction < 0.001) return "<0.1%";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f", fraction * 100);
  return TrimZeros(buf) + "%";
}

}  // namespace gradwatch::alerts

#include "alerts/templates.h"

#include <charconv>
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

// out = sign + digits with thousands separators, in out's own buffer.
void AssignWithSeparators(std::string& out, std::string_view sign, std::string_view digits) {
  out.assign(sign);
  const size_t n = digits.size();
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && (n - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
}

std::string TrimZeros(std::string s) {
  if (s.find('.') == std::string::npos) return s;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
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
    return Status::InvalidArgument("unknown variable '" + name + "' (known: " + known + ", labels.<name>)");
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

void FormatNumberTo(std::string& out, double value) {
  if (!std::isfinite(value)) {
    out.assign(std::isnan(value) ? "NaN" : value > 0 ? "+Inf" : "-Inf");
    return;
  }
  if (value == 0) {
    out.assign("0");
    return;
  }
  const double mag = std::fabs(value);
  char buf[64];
  if (mag >= 9999.5) {
    if (mag >= 1e15) {
      std::snprintf(buf, sizeof(buf), "%.3e", value);
    } else {
      std::snprintf(buf, sizeof(buf), "%.0f", mag);
      AssignWithSeparators(out, value < 0 ? "-" : "", buf);
      return;
    }
  } else if (mag < 1e-3) {
    std::snprintf(buf, sizeof(buf), "%.3e", value);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", value);
    out.assign(TrimZeros(buf));
    return;
  }
  // Scientific: trim the mantissa, shorten the exponent ("1.000e-04" → "1e-4"). Short strings.
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
  out.assign(mantissa);
  out.push_back('e');
  out.append(sign);
  out.append(exponent);
}

void FormatStepTo(std::string& out, uint64_t step) {
  char buf[24];
  const auto end = std::to_chars(buf, buf + sizeof(buf), step).ptr;
  AssignWithSeparators(out, "", std::string_view(buf, static_cast<size_t>(end - buf)));
}

void FormatCountTo(std::string& out, double value) {
  if (std::isnan(value)) {
    out.assign("NaN");
  } else if (std::isinf(value)) {
    out.assign(value > 0 ? "∞" : "-∞");
  } else {
    char buf[400];  // %.0f of the largest double: 309 digits
    std::snprintf(buf, sizeof(buf), "%.0f", std::fabs(value));
    AssignWithSeparators(out, value < 0 && std::llround(value) != 0 ? "-" : "", buf);
  }
}

void FormatPercentTo(std::string& out, double fraction) {
  if (!std::isfinite(fraction)) {
    out.assign(std::isnan(fraction) ? "NaN" : fraction > 0 ? "+Inf" : "-Inf");
  } else if (fraction > 0 && fraction < 0.001) {
    out.assign("<0.1%");
  } else {
    char buf[400];
    std::snprintf(buf, sizeof(buf), "%.1f", fraction * 100);
    std::string_view text(buf);
    if (text.find('.') != std::string_view::npos) {
      while (!text.empty() && text.back() == '0') text.remove_suffix(1);
      if (!text.empty() && text.back() == '.') text.remove_suffix(1);
    }
    out.assign(text);
    out.push_back('%');
  }
}

std::string FormatNumber(double value) {
  std::string out;
  FormatNumberTo(out, value);
  return out;
}

std::string FormatStep(uint64_t step) {
  std::string out;
  FormatStepTo(out, step);
  return out;
}

std::string FormatCount(double value) {
  std::string out;
  FormatCountTo(out, value);
  return out;
}

std::string FormatPercent(double fraction) {
  std::string out;
  FormatPercentTo(out, fraction);
  return out;
}

}  // namespace gradwatch::alerts

#include "alerts/matcher.h"

#include "alerts/rules.h"

#include <re2/re2.h>

#include <tuple>

namespace gradwatch::alerts {
namespace {

// Bounds on what a client may send: a silence's matchers are kept, stored and evaluated for every
// alert notification.
constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxValueBytes = 4096;

bool PlainValueChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' ||
         c == ':' || c == '/' || c == '-';
}

const std::string kForms = "write name=value, name!=value, name=~regex or name!~regex";

StatusOr<std::string> Unquote(std::string_view text, std::string_view whole) {
  if (text.size() < 2 || text.back() != '"') {
    return Status::InvalidArgument("matcher '" + std::string(whole) + "': the value's opening quote is never closed");
  }
  std::string out;
  for (size_t i = 1; i + 1 < text.size(); ++i) {
    char c = text[i];
    if (c == '\\') {
      if (i + 2 >= text.size()) {
        return Status::InvalidArgument("matcher '" + std::string(whole) + "': a backslash ends the quoted value");
      }
      c = text[++i];
      if (c == 'n') c = '\n';
    } else if (c == '"') {
      return Status::InvalidArgument("matcher '" + std::string(whole) + "': a quote inside a quoted value needs \\\"");
    }
    out += c;
  }
  return out;
}

}  // namespace

std::string_view MatchOperator(MatchType type) {
  switch (type) {
    case MatchType::kEqual: return "=";
    case MatchType::kNotEqual: return "!=";
    case MatchType::kRegex: return "=~";
    case MatchType::kNotRegex: return "!~";
  }
  return "=";
}

std::optional<MatchType> MatchTypeFromNumber(int number) {
  if (number < 0 || number > static_cast<int>(MatchType::kNotRegex)) return std::nullopt;
  return static_cast<MatchType>(number);
}

StatusOr<Matcher> Matcher::Make(std::string name, MatchType type, std::string value) {
  if (name.empty()) return Status::InvalidArgument("a matcher needs a label name: " + kForms);
  if (name.size() > kMaxNameBytes || !IsLabelName(name)) {
    return Status::InvalidArgument("matcher label '" + name.substr(0, 64) +
                                   "' is not a label name: letters, digits and _, not starting with a digit, "
                                   "at most 256 bytes");
  }
  if (value.size() > kMaxValueBytes) {
    return Status::InvalidArgument("matcher " + name + ": its value is " + std::to_string(value.size()) +
                                   " bytes, more than 4096");
  }
  Matcher m;
  m.name_ = std::move(name);
  m.type_ = type;
  m.value_ = std::move(value);
  if (type == MatchType::kRegex || type == MatchType::kNotRegex) {
    RE2::Options options;
    options.set_log_errors(false);
    auto regex = std::make_shared<const RE2>(m.value_, options);
    if (!regex->ok()) {
      return Status::InvalidArgument("matcher " + m.name_ + std::string(MatchOperator(type)) + "'" + m.value_ +
                                     "': not a regular expression (RE2 syntax): " + regex->error());
    }
    m.regex_ = std::move(regex);
  }
  return m;
}

StatusOr<Matcher> Matcher::Parse(std::string_view text) {
  const size_t op = text.find_first_of("=!");
  if (op == std::string_view::npos) {
    if (text.empty()) return Status::InvalidArgument("an empty matcher: " + kForms);
    return Make("alertname", MatchType::kEqual, std::string(text));
  }
  const std::string name(text.substr(0, op));
  if (name.empty()) {
    return Status::InvalidArgument("matcher '" + std::string(text) + "' has no label name: " + kForms);
  }
  MatchType type;
  size_t value_at;
  if (text.substr(op, 2) == "=~") {
    type = MatchType::kRegex;
    value_at = op + 2;
  } else if (text.substr(op, 2) == "!=") {
    type = MatchType::kNotEqual;
    value_at = op + 2;
  } else if (text.substr(op, 2) == "!~") {
    type = MatchType::kNotRegex;
    value_at = op + 2;
  } else if (text[op] == '=') {
    type = MatchType::kEqual;
    value_at = op + 1;
  } else {
    return Status::InvalidArgument("matcher '" + std::string(text) + "': '!' must be followed by = or ~: " + kForms);
  }
  std::string_view raw = text.substr(value_at);
  std::string value(raw);
  if (!raw.empty() && raw.front() == '"') {
    auto unquoted = Unquote(raw, text);
    if (!unquoted.ok()) return unquoted.status();
    value = std::move(*unquoted);
  }
  return Make(name, type, std::move(value));
}

bool Matcher::Matches(std::string_view value) const {
  switch (type_) {
    case MatchType::kEqual: return value == value_;
    case MatchType::kNotEqual: return value != value_;
    case MatchType::kRegex: return RE2::FullMatch(value, *regex_);
    case MatchType::kNotRegex: return !RE2::FullMatch(value, *regex_);
  }
  return false;
}

bool Matcher::Matches(const LabelSet& labels) const {
  auto it = labels.find(name_);
  return Matches(it == labels.end() ? std::string_view() : std::string_view(it->second));
}

std::string Matcher::ToString() const {
  std::string out = name_ + std::string(MatchOperator(type_));
  bool plain = !value_.empty();
  for (char c : value_) plain = plain && PlainValueChar(c);
  if (plain) return out + value_;
  out += '"';
  for (char c : value_) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out + '"';
}

bool Matcher::operator<(const Matcher& other) const {
  return std::tie(name_, type_, value_) < std::tie(other.name_, other.type_, other.value_);
}

Status CheckSilenceMatchers(const std::vector<Matcher>& matchers) {
  if (matchers.empty())
    return Status::InvalidArgument("a silence needs at least one matcher: it would mute every alert");
  for (const Matcher& m : matchers) {
    if (!m.Matches(std::string_view())) return Status::Ok();
  }
  return Status::InvalidArgument(
      "every matcher of this silence also matches an alert without its label, so it would mute every alert: "
      "add one that names something, such as run=RUN or alertname=NAME");
}

StatusOr<std::vector<Matcher>> EqualityMatchers(const LabelSet& labels) {
  std::vector<Matcher> out;
  for (const auto& [name, value] : labels) {
    auto m = Matcher::Make(name, MatchType::kEqual, value);
    if (!m.ok()) return m.status();
    out.push_back(std::move(*m));
  }
  return out;
}

}  // namespace gradwatch::alerts

// Label matchers as Alertmanager and amtool write them: `name=value`, `name!=value`,
// `name=~regex`, `name!~regex`. Silences mute the alerts every one of their matchers matches.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "server/core/status.h"

namespace re2 {
class RE2;
}

namespace gradwatch::alerts {

// Numbered as the wire's v1::MatchType (checked where they meet), so either converts by number.
enum class MatchType { kEqual = 0, kNotEqual = 1, kRegex = 2, kNotRegex = 3 };

// The type numbered `number`, if there is one.
std::optional<MatchType> MatchTypeFromNumber(int number);

// "=", "!=", "=~", "!~".
std::string_view MatchOperator(MatchType type);

class Matcher {
 public:
  // Checks the label name ([A-Za-z_][A-Za-z0-9_]*) and compiles a regular expression (RE2 syntax,
  // anchored at both ends, as Alertmanager does: `run=~moe.*` matches "moe-6b", not "old-moe").
  static StatusOr<Matcher> Make(std::string name, MatchType type, std::string value);

  // Parses one matcher as amtool takes it: `name=value`, `name!=value`, `name=~regex`,
  // `name!~regex`; the value may be double-quoted (`name="a b"`, with \" and \\ inside). A bare
  // label value with no operator means `alertname=VALUE`, as in `amtool silence add Foo`.
  static StatusOr<Matcher> Parse(std::string_view text);

  // An alert without the label is taken to carry it with an empty value.
  bool Matches(const LabelSet& labels) const;
  bool Matches(std::string_view value) const;

  const std::string& name() const { return name_; }
  MatchType type() const { return type_; }
  const std::string& value() const { return value_; }

  // As Parse takes it back: the value quoted when it is empty or holds anything but
  // [A-Za-z0-9_.:/-].
  std::string ToString() const;

  bool operator==(const Matcher& other) const {
    return name_ == other.name_ && type_ == other.type_ && value_ == other.value_;
  }
  bool operator<(const Matcher& other) const;

 private:
  std::string name_;
  MatchType type_ = MatchType::kEqual;
  std::string value_;
  std::shared_ptr<const re2::RE2> regex_;  // kRegex and kNotRegex only; shared by copies
};

// Checks a silence's matchers as Alertmanager does: at least one, and at least one that does not
// match an empty label value (otherwise the silence would mute every alert).
Status CheckSilenceMatchers(const std::vector<Matcher>& matchers);

// Equality matchers from a label set (what silences held before other operators existed); an
// error if a name is not a label name (a matcher is never dropped: that would widen the silence).
StatusOr<std::vector<Matcher>> EqualityMatchers(const LabelSet& labels);

}  // namespace gradwatch::alerts

#include "client/cli/values.h"

#include <charconv>
#include <cmath>
#include <string>

namespace gradwatch::cli {

namespace {

std::optional<double> Number(std::string_view text) {
  if (text.empty()) return std::nullopt;
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

}  // namespace

std::optional<double> ParseDuration(std::string_view text) {
  if (text.empty()) return std::nullopt;
  if (auto seconds = Number(text)) return seconds;
  struct Unit {
    std::string_view name;
    double seconds;
  };
  // In the order they must appear; "ms" before "m" so that it is matched whole.
  static constexpr Unit kUnits[] = {{"y", 365 * 86400.0}, {"w", 7 * 86400.0}, {"d", 86400.0}, {"h", 3600.0},
                                    {"ms", 0.001},        {"m", 60.0},        {"s", 1.0}};
  double total = 0;
  size_t next_unit = 0;  // units must come largest first, each once
  while (!text.empty()) {
    size_t digits = 0;
    while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
      ++digits;
    }
    const auto value = Number(text.substr(0, digits));
    if (!value) return std::nullopt;
    text.remove_prefix(digits);
    bool matched = false;
    for (size_t u = next_unit; u < std::size(kUnits) && !matched; ++u) {
      const std::string_view name = kUnits[u].name;
      if (text.substr(0, name.size()) != name) continue;
      if (name == "m" && text.substr(0, 2) == "ms") continue;
      total += *value * kUnits[u].seconds;
      text.remove_prefix(name.size());
      next_unit = u + 1;
      matched = true;
    }
    if (!matched) return std::nullopt;
  }
  return total;
}

CLI::Validator PositiveDuration() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const auto seconds = ParseDuration(text);
        if (!seconds) return "'" + text + "' is not a duration: write 90s, 15m, 1h30m, 2d or a number of seconds";
        if (!(*seconds > 0)) return "must be longer than 0, not '" + text + "'";
        char buffer[32];
        const auto [end, ec] = std::to_chars(buffer, buffer + sizeof buffer, *seconds);
        text.assign(buffer, end);
        return "";
      },
      "");
}

CLI::Validator PositiveValue() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const auto value = Number(text);
        if (!value) return "'" + text + "' is not a number";
        if (!(*value > 0)) return "must be above 0, not '" + text + "'";
        return "";
      },
      "POSITIVE");
}

}  // namespace gradwatch::cli

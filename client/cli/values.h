// The CLI's value syntax: durations as Prometheus and amtool write them (90s, 15m, 1h30m, 2d, or a
// number of seconds), and positive numbers, with errors that say what to write instead of
// "Value 0 not in range 0.000000 to 1.79769e+308".
#pragma once

#include <optional>
#include <string_view>

#include <CLI/CLI.hpp>

namespace gradwatch::cli {

// Seconds in `text`: a number of seconds ("90", "2.5") or one or more number-unit pairs, largest
// unit first ("1h30m", "500ms"), with units ms, s, m, h, d (24 h), w (7 d), y (365 d). nullopt
// when it is neither.
std::optional<double> ParseDuration(std::string_view text);

// An option's validator: a positive duration, replaced by its seconds for the option to store.
CLI::Validator PositiveDuration();
// A positive number.
CLI::Validator PositiveValue();

}  // namespace gradwatch::cli

// "Did you mean": the known name closest to a mistyped one, as git and kubectl suggest (the CLI's
// commands, runs and series; the daemon's configuration keys).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gradwatch {

// Edits (insertions, deletions, substitutions, swaps of adjacent characters) from a to b.
size_t EditDistance(std::string_view a, std::string_view b);

// The candidate closest to `word` when it is close enough to be a typo of it: at most a third of
// its length in edits (at least one, at most three), or when one starts with the other (a
// prefix of at least three characters). Ties go to the earlier candidate.
std::optional<std::string> Closest(std::string_view word, const std::vector<std::string>& candidates);

// "\n  did you mean 'X'?" for the closest candidate, or "".
std::string DidYouMean(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace gradwatch

#include "server/core/suggest.h"

#include <algorithm>

namespace gradwatch {

size_t EditDistance(std::string_view a, std::string_view b) {
  // Optimal string alignment distance over three rows.
  std::vector<size_t> before(b.size() + 1), previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        current[j] = std::min(current[j], before[j - 2] + 1);
      }
    }
    std::swap(before, previous);
    std::swap(previous, current);
  }
  return previous[b.size()];
}

std::optional<std::string> Closest(std::string_view word, const std::vector<std::string>& candidates) {
  const size_t limit = std::clamp<size_t>(word.size() / 3, 1, 3);
  std::optional<std::string> best;
  size_t best_distance = limit + 1;
  for (const std::string& c : candidates) {
    if (c == word) continue;
    size_t d = EditDistance(word, c);
    const bool prefix = std::min(word.size(), c.size()) >= 3 &&
                        (c.compare(0, word.size(), word) == 0 || word.compare(0, c.size(), c) == 0);
    if (prefix) d = std::min(d, limit);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  return best;
}

std::string DidYouMean(std::string_view word, const std::vector<std::string>& candidates) {
  const auto closest = Closest(word, candidates);
  return closest ? "\n  did you mean '" + *closest + "'?" : "";
}

}  // namespace gradwatch

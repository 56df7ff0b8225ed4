// Fuzzes the JSONL parser of `gradwatch replay` as the replay command uses it: every line parsed
// (a header allowed on the first that is not blank), the catalog built, each step converted.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <variant>
#include <vector>

#include "client/cli/replay_parser.h"

using namespace gradwatch::cli;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  ReplayCatalog catalog;
  std::vector<StepRecord> steps;
  bool first = true;
  while (!input.empty()) {
    const size_t end = input.find('\n');
    const std::string_view text = input.substr(0, end);
    input = end == std::string_view::npos ? std::string_view() : input.substr(end + 1);
    LineResult result = ParseReplayLine(text, first);
    if (!result.ok()) {
      first = false;
      continue;
    }
    if (std::holds_alternative<BlankLine>(*result.line)) continue;
    first = false;
    if (auto* header = std::get_if<HeaderRecord>(&*result.line)) {
      catalog.SetHeader(*header);
    } else {
      catalog.AddFrom(std::get<StepRecord>(*result.line));
      steps.push_back(std::get<StepRecord>(std::move(*result.line)));
    }
  }
  for (const StepRecord& step : steps) (void)ToStepStats(step, catalog);
  (void)catalog.Params();
  return 0;
}

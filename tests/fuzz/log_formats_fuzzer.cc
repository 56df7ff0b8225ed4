// Fuzzes the line parsers of `gradwatch tail` as the command uses them: every line cleaned, its
// format detected, then parsed as that format and as every other.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "client/cli/log_formats.h"

using namespace gradwatch::cli;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  while (!input.empty()) {
    const size_t end = input.find('\n');
    const std::string_view raw = input.substr(0, end);
    input = end == std::string_view::npos ? std::string_view() : input.substr(end + 1);
    const std::string cleaned = CleanLogLine(raw);
    (void)DetectLogFormat(cleaned);
    for (const LogFormat format : AllLogFormats()) (void)ParseLogLine(format, cleaned);
    (void)LineTime(cleaned, LogTimeZone{});
    (void)LineTime(cleaned, LogTimeZone{.local = false, .offset_seconds = 3600});
    (void)ParseLogTimeZone(cleaned);
  }
  return 0;
}

// Fuzzes gradwatchd's configuration file: any text parses to a Config or an error, never a crash,
// and a parsed Config validates without one.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/daemon/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  gradwatch::StatusOr<gradwatch::daemon::Config> config = gradwatch::daemon::ParseConfig(text, "fuzz.yaml");
  if (config.ok()) (void)gradwatch::daemon::ValidateConfig(*config);
  return 0;
}

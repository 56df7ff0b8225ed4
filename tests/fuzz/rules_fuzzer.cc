// Fuzzes the alert rule loader: any text loads to rules or to errors, never a crash, and the rules
// it accepts can drive an alert engine (whose template checks they passed).
#include <cstddef>
#include <cstdint>
#include <string>

#include "alerts/rules.h"
#include "alerts/state_machine.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  gradwatch::StatusOr<std::vector<gradwatch::alerts::Rule>> rules = gradwatch::alerts::LoadRules(text, "fuzz.yaml");
  if (rules.ok()) gradwatch::alerts::AlertEngine engine(std::move(rules).value());
  return 0;
}

// Fuzzes annotation templates and number formatting: any text parses, checks and renders without a
// crash; a template that checks has a valid syntax, and with one-character values it renders no
// longer than itself (every placeholder is at least five characters).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "alerts/rules.h"
#include "alerts/templates.h"

using gradwatch::alerts::LabelSet;
using gradwatch::alerts::TemplateVars;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto names = gradwatch::alerts::TemplateVariables(text);
  const auto& allowed = gradwatch::alerts::TemplateVariablesFor(gradwatch::alerts::RuleKind::kThreshold);
  const bool checks = gradwatch::alerts::CheckTemplate(text, allowed).ok();
  if (checks && !names.ok()) std::abort();  // a template that checks has a valid syntax

  TemplateVars vars;
  for (const std::string& name : allowed) vars[name] = "v";
  LabelSet labels;
  if (names.ok()) {
    for (const std::string& name : names.value()) {
      if (name.rfind("labels.", 0) == 0) labels[name.substr(7)] = "l";
      (void)gradwatch::alerts::TemplateUses(text, name);
    }
  }
  const std::string rendered = gradwatch::alerts::RenderTemplate(text, vars, labels);
  if (checks && rendered.size() > text.size()) std::abort();

  double number = 0;
  if (size >= sizeof number) {
    std::memcpy(&number, data, sizeof number);
    (void)gradwatch::alerts::FormatNumber(number);
    (void)gradwatch::alerts::FormatCount(number);
    (void)gradwatch::alerts::FormatPercent(number);
  }
  uint64_t step = 0;
  if (size >= sizeof step) {
    std::memcpy(&step, data, sizeof step);
    (void)gradwatch::alerts::FormatStep(step);
  }
  return 0;
}

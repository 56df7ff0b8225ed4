// Annotation templates: "Total grad norm {{ value }} ≥ 5 at step {{ step }} in run {{ run }}".
//
// A placeholder is `{{ name }}` (spaces optional) where name is a variable ([A-Za-z0-9_]+) or
// `labels.<label name>`. Text outside placeholders is copied as is; a lone `}}` is plain text.
// Templates are checked when rules load (syntax and variable names), so rendering never fails:
// a variable without a value at render time renders as the empty string.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "alerts/alert.h"
#include "server/core/status.h"

namespace gradwatch::alerts {

using TemplateVars = std::map<std::string, std::string, std::less<>>;

// The placeholder names of `text`, in order of appearance (with repeats), or what is wrong with
// its syntax ("unclosed '{{' at offset 12", "empty placeholder at offset 3", "bad variable name
// 'a b' at offset 7").
StatusOr<std::vector<std::string>> TemplateVariables(std::string_view text);

// OK when the syntax is valid and every placeholder is in `allowed` or is `labels.<name>`;
// otherwise InvalidArgument naming the first unknown variable and listing the allowed ones.
Status CheckTemplate(std::string_view text, const std::set<std::string>& allowed);

// Fills the placeholders from `vars` and `labels` (for labels.<name>). Never fails: a syntax
// error (unchecked template) leaves the rest of the text as is, a missing value renders empty.
std::string RenderTemplate(std::string_view text, const TemplateVars& vars, const LabelSet& labels);

// Whether `text` has a placeholder named `name` (false for an invalid template).
bool TemplateUses(std::string_view text, std::string_view name);

// Numbers for people: 4 significant digits ("4.62", "362.1", "0.5912"), trailing zeros dropped;
// magnitudes ≥ 10,000 rounded to an integer with thousands separators ("48,213"); magnitudes
// below 0.001 in short scientific form ("1e-4", "2.5e-7"); "NaN", "+Inf", "-Inf" as Prometheus
// prints them.
std::string FormatNumber(double value);
// A step with thousands separators: "81,716".
std::string FormatStep(uint64_t step);
// A count of steps given as a double (a forecast): rounded, with separators; "∞" when infinite,
// "NaN" when NaN.
std::string FormatCount(double value);
// A fraction as a percentage with one decimal at most: 0.9394 → "93.9%", 0.5 → "50%",
// below 0.001 (but above 0) "<0.1%".
std::string FormatPercent(double fraction);
// The same, written into `out` (its text replaced, its buffer reused: no allocation once it is
// large enough).
void FormatNumberTo(std::string& out, double value);
void FormatStepTo(std::string& out, uint64_t step);
void FormatCountTo(std::string& out, double value);
void FormatPercentTo(std::string& out, double fraction);

}  // namespace gradwatch::alerts

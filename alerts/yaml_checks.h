// Checks on YAML documents that yaml-cpp does not make: a mapping that repeats a key keeps both
// entries, and readers that walk the mapping let the last one win without a word. Used by the
// rule files and the daemon's configuration.
#pragma once

#include <string>
#include <string_view>

#include "server/core/status.h"

namespace gradwatch::alerts {

// InvalidArgument "source:LINE: duplicate key 'k' (first at line N)" for the first mapping, at any
// depth, that repeats a key; Ok when there is none. Text that is not valid YAML is Ok here: the
// caller's own parse reports it.
Status CheckNoDuplicateKeys(std::string_view yaml_text, const std::string& source);

}  // namespace gradwatch::alerts

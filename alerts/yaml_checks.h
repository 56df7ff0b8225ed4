// Checks on YAML documents that yaml-cpp does not make: a mapping that repeats a key keeps both
// entries, and readers that walk the mapping let the last one win without a word. Used by the
// rule files and the daemon's configuration.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "server/core/status.h"

namespace gradwatch::alerts {

// InvalidArgument "source:LINE: duplicate key 'k' (first at line N)" for the first mapping, at any
// depth, that repeats a key; Ok when there is none. Text that is not valid YAML is Ok here: the
// caller's own parse reports it.
Status CheckNoDuplicateKeys(std::string_view yaml_text, const std::string& source);

// The most nodes a document may hold once its aliases (*name) are expanded.
inline constexpr size_t kMaxExpandedNodes = 1'000'000;

// InvalidArgument "source:LINE: ..." when the document's aliases expand it past
// kMaxExpandedNodes (a "billion laughs": nine anchors of nine aliases each are 387 million nodes
// to every reader that walks the tree); Ok otherwise, and for text that is not valid YAML (the
// caller's own parse reports it). Reads the event stream only: it never builds the tree.
Status CheckAliasExpansion(std::string_view yaml_text, const std::string& source);

}  // namespace gradwatch::alerts

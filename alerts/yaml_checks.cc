#include "alerts/yaml_checks.h"

#include <map>

#include <yaml-cpp/yaml.h>

namespace gradwatch::alerts {

namespace {

Status Check(const YAML::Node& node, const std::string& source, int depth) {
  // Deeper than any rule file or configuration: a hostile document cannot recurse without end.
  if (depth > 64) return Status::Ok();
  if (node.IsMap()) {
    std::map<std::string, int> first_line;
    for (const auto& kv : node) {
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : std::string();
      const int line = kv.first.Mark().line + 1;
      if (kv.first.IsScalar()) {
        auto [it, inserted] = first_line.emplace(key, line);
        if (!inserted) {
          return Status::InvalidArgument(source + ":" + std::to_string(line) + ": duplicate key '" + key +
                                         "' (first at line " + std::to_string(it->second) + ")");
        }
      }
      if (Status s = Check(kv.second, source, depth + 1); !s.ok()) return s;
    }
  } else if (node.IsSequence()) {
    for (const auto& item : node) {
      if (Status s = Check(item, source, depth + 1); !s.ok()) return s;
    }
  }
  return Status::Ok();
}

}  // namespace

Status CheckNoDuplicateKeys(std::string_view yaml_text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
    return Check(root, source, 0);
  } catch (const YAML::Exception&) {
    return Status::Ok();
  }
}

}  // namespace gradwatch::alerts

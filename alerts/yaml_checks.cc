#include "alerts/yaml_checks.h"

#include <map>
#include <sstream>
#include <vector>

#include <yaml-cpp/eventhandler.h>
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

// Sizes of the document's nodes with their aliases expanded, from the parser's events: an open
// collection counts what it holds, a closed anchored one records its size for its aliases.
class ExpansionCounter : public YAML::EventHandler {
 public:
  size_t total() const { return total_; }
  int over_line() const { return over_line_; }

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& mark, YAML::anchor_t anchor) override { Leaf(mark, anchor, 1); }
  void OnAlias(const YAML::Mark& mark, YAML::anchor_t anchor) override {
    const auto it = sizes_.find(anchor);
    Leaf(mark, 0, it == sizes_.end() ? 1 : it->second);
  }
  void OnScalar(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor, const std::string&) override {
    Leaf(mark, anchor, 1);
  }
  void OnSequenceStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                       YAML::EmitterStyle::value) override {
    open_.push_back({anchor, 1, mark.line});
  }
  void OnSequenceEnd() override { Close(); }
  void OnMapStart(const YAML::Mark& mark, const std::string&, YAML::anchor_t anchor,
                  YAML::EmitterStyle::value) override {
    open_.push_back({anchor, 1, mark.line});
  }
  void OnMapEnd() override { Close(); }

 private:
  struct Open {
    YAML::anchor_t anchor;
    size_t size;  // nodes so far, itself included, aliases expanded (saturating)
    int line;
  };

  static size_t Add(size_t a, size_t b) {
    return a > kMaxExpandedNodes || b > kMaxExpandedNodes ? kMaxExpandedNodes + 1 : a + b;
  }

  void Leaf(const YAML::Mark& mark, YAML::anchor_t anchor, size_t size) {
    if (anchor != 0) sizes_[anchor] = size;
    Count(size, mark.line);
  }

  void Count(size_t size, int line) {
    if (open_.empty()) {
      total_ = Add(total_, size);
    } else {
      open_.back().size = Add(open_.back().size, size);
    }
    if (over_line_ < 0 && Add(total_, Pending()) > kMaxExpandedNodes) over_line_ = line;
  }

  // Nodes counted in the collections still open.
  size_t Pending() const {
    size_t n = 0;
    for (const Open& o : open_) n = Add(n, o.size);
    return n;
  }

  void Close() {
    const Open done = open_.back();
    open_.pop_back();
    if (done.anchor != 0) sizes_[done.anchor] = done.size;
    Count(done.size, done.line);
  }

  std::map<YAML::anchor_t, size_t> sizes_;
  std::vector<Open> open_;
  size_t total_ = 0;
  int over_line_ = -1;
};

}  // namespace

Status CheckAliasExpansion(std::string_view yaml_text, const std::string& source) {
  if (yaml_text.find('*') == std::string_view::npos) return Status::Ok();  // no alias, nothing expands
  std::istringstream in{std::string(yaml_text)};
  ExpansionCounter counter;
  try {
    // The first document only, as YAML::Load reads it: on some damaged text yaml-cpp's parser
    // reports a next document for ever without moving on (a fuzzer found one).
    YAML::Parser parser(in);
    parser.HandleNextDocument(counter);
  } catch (const YAML::Exception&) {
    return Status::Ok();
  }
  if (counter.over_line() < 0) return Status::Ok();
  return Status::InvalidArgument(source + ":" + std::to_string(counter.over_line() + 1) +
                                 ": the document's aliases (*name) expand it past " +
                                 std::to_string(kMaxExpandedNodes) + " nodes; write the values out");
}

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

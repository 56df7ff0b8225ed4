#include "server/runs/catalog_change.h"

#include <charconv>
#include <cmath>
#include <set>

#include <nlohmann/json.hpp>

namespace gradwatch::runs {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxLabelBytes = 256;

// The shortest text that reads back as `v` ("0.1", "1e-05").
std::string Number(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

std::string Quoted(const std::string& s) { return s.empty() ? "\"\"" : s; }

const ParamInfo* Find(const std::vector<ParamInfo>& catalog, const std::string& name) {
  for (const ParamInfo& p : catalog) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

ParamInfo* Find(std::vector<ParamInfo>& catalog, const std::string& name) {
  for (ParamInfo& p : catalog) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

}  // namespace

std::optional<std::string> CheckCatalogChange(const std::vector<ParamChange>& changes,
                                              const std::vector<ParamInfo>& catalog) {
  if (changes.empty()) return "the change names no parameter";
  std::set<std::string> seen;
  for (const ParamChange& c : changes) {
    const ParamInfo* p = Find(catalog, c.name);
    if (p == nullptr) return "'" + c.name + "' is not in the run's catalog (a Hello adds parameters)";
    if (!seen.insert(c.name).second) return "'" + c.name + "' is named twice";
    if (c.weight_decay && !(std::isfinite(*c.weight_decay) && *c.weight_decay >= 0)) {
      return "'" + c.name + "': weight_decay must be finite and ≥ 0";
    }
    if (c.role && c.role->size() > kMaxLabelBytes) return "'" + c.name + "': role is over 256 bytes";
    if (c.group && c.group->size() > kMaxLabelBytes) return "'" + c.name + "': group is over 256 bytes";
    if (!c.weight_decay && !c.kind && !c.role && !c.group) {
      return "'" + c.name + "': no field to change (weight_decay, kind, role or group)";
    }
  }
  return std::nullopt;
}

std::vector<ParamChange> CatalogDiff(const std::vector<ParamInfo>& held, const std::vector<ParamInfo>& wanted) {
  std::vector<ParamChange> out;
  const size_t common = std::min(held.size(), wanted.size());
  for (size_t i = 0; i < common; ++i) {
    const ParamInfo& a = held[i];
    const ParamInfo& b = wanted[i];
    if (a.name != b.name) continue;
    ParamChange c{.name = a.name};
    if (a.weight_decay != b.weight_decay) c.weight_decay = b.weight_decay;
    if (a.kind != b.kind) c.kind = b.kind;
    if (a.role != b.role) c.role = b.role;
    if (a.group != b.group) c.group = b.group;
    if (c.weight_decay || c.kind || c.role || c.group) out.push_back(std::move(c));
  }
  return out;
}

std::vector<ParamChange> ApplyCatalogChange(const std::vector<ParamChange>& changes, std::vector<ParamInfo>& catalog) {
  std::vector<ParamChange> undo;
  for (const ParamChange& c : changes) {
    ParamInfo* p = Find(catalog, c.name);
    if (p == nullptr) continue;
    ParamChange before{.name = c.name};
    if (c.weight_decay) before.weight_decay = std::exchange(p->weight_decay, *c.weight_decay);
    if (c.kind) before.kind = std::exchange(p->kind, *c.kind);
    if (c.role) before.role = std::exchange(p->role, *c.role);
    if (c.group) before.group = std::exchange(p->group, *c.group);
    undo.push_back(std::move(before));
  }
  return undo;
}

std::string DescribeCatalogChange(const std::vector<ParamChange>& changes, const std::vector<ParamInfo>& catalog) {
  std::string s = "catalog change:";
  for (size_t i = 0; i < changes.size(); ++i) {
    const ParamChange& c = changes[i];
    const ParamInfo* p = Find(catalog, c.name);
    s += (i == 0 ? " " : "; ") + c.name;
    std::string fields;
    const auto field = [&](std::string_view what, const std::string& from, const std::string& to) {
      fields += (fields.empty() ? " " : ", ") + std::string(what) + " " + from + " → " + to;
    };
    if (c.weight_decay) field("weight decay", p ? Number(p->weight_decay) : "?", Number(*c.weight_decay));
    if (c.kind) field("kind", p ? std::string(ParamKindName(p->kind)) : "?", std::string(ParamKindName(*c.kind)));
    if (c.role) field("role", p ? Quoted(p->role) : "?", Quoted(*c.role));
    if (c.group) field("group", p ? Quoted(p->group) : "?", Quoted(*c.group));
    s += fields;
  }
  return s;
}

std::string CatalogChangeData(const std::vector<ParamChange>& changes) {
  json out = json::array();
  for (const ParamChange& c : changes) {
    json o = {{"name", c.name}};
    if (c.weight_decay) o["weight_decay"] = *c.weight_decay;
    if (c.kind) o["kind"] = std::string(ParamKindName(*c.kind));
    if (c.role) o["role"] = *c.role;
    if (c.group) o["group"] = *c.group;
    out.push_back(std::move(o));
  }
  return out.dump();
}

StatusOr<std::vector<ParamChange>> ParseCatalogChangeData(std::string_view data) {
  const json parsed = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!parsed.is_array()) return Status::InvalidArgument("a catalog change is not a JSON array");
  std::vector<ParamChange> out;
  for (const json& o : parsed) {
    if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) {
      return Status::InvalidArgument("a catalog change's entry has no name");
    }
    ParamChange c{.name = o["name"].get<std::string>()};
    if (o.contains("weight_decay")) {
      if (!o["weight_decay"].is_number()) return Status::InvalidArgument("'" + c.name + "': weight_decay is no number");
      c.weight_decay = o["weight_decay"].get<double>();
    }
    if (o.contains("kind")) {
      const auto kind = o["kind"].is_string() ? ParseParamKind(o["kind"].get<std::string>()) : std::nullopt;
      if (!kind) return Status::InvalidArgument("'" + c.name + "': unknown kind");
      c.kind = *kind;
    }
    for (const auto& [key, field] : {std::pair{"role", &c.role}, std::pair{"group", &c.group}}) {
      if (!o.contains(key)) continue;
      if (!o[key].is_string()) return Status::InvalidArgument("'" + c.name + "': " + key + " is no string");
      *field = o[key].get<std::string>();
    }
    out.push_back(std::move(c));
  }
  return out;
}

EventRecord CatalogChangeEvent(uint64_t step, const std::vector<ParamChange>& changes,
                               const std::vector<ParamInfo>& catalog, double now) {
  return EventRecord{step, DescribeCatalogChange(changes, catalog), std::string(kCatalogEventSource), now,
                     CatalogChangeData(changes)};
}

}  // namespace gradwatch::runs

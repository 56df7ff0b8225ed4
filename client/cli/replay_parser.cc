#include "client/cli/replay_parser.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

namespace gradwatch::cli {
namespace {

using nlohmann::json;

constexpr std::string_view kGradPrefix = "grad/norm/";
constexpr std::string_view kParamPrefix = "params/norm/";
constexpr std::string_view kUpdatePrefix = "updates/norm/";
constexpr std::string_view kRadialPrefix = "updates/radial/";
constexpr std::string_view kTotalGradKey = "grad/norm/total";
constexpr std::string_view kTotalParamKey = "params/norm/total";
constexpr std::string_view kTotalUpdateKey = "updates/norm/total";

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

bool IsValueEnd(char c) { return c == ',' || c == '}' || c == ']' || std::isspace(static_cast<unsigned char>(c)); }

bool IsValueStart(char c) { return c == ':' || c == ',' || c == '[' || std::isspace(static_cast<unsigned char>(c)); }

// A number, or one of the spellings of NaN and ±infinity as a string.
std::optional<double> AsNumber(const json& v) {
  if (v.is_number()) return v.get<double>();
  if (!v.is_string()) return std::nullopt;
  std::string s = AsciiLower(v.get_ref<const std::string&>());
  double sign = 1.0;
  if (!s.empty() && (s[0] == '-' || s[0] == '+')) {
    if (s[0] == '-') sign = -1.0;
    s.erase(0, 1);
  }
  if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (s == "inf" || s == "infinity") return sign * std::numeric_limits<double>::infinity();
  return std::nullopt;
}

// Text of a config or label value: strings as they are, anything else as JSON.
std::string AsText(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::optional<uint64_t> AsCount(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) return std::nullopt;  // negative
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d >= 0 && d < 18446744073709551616.0 && std::floor(d) == d) {
      return static_cast<uint64_t>(d);
    }
  }
  return std::nullopt;
}

std::string StripJsonExceptionPrefix(std::string what) {
  // "[json.exception.parse_error.101] parse error at ..." → "parse error at ..."
  if (!what.empty() && what[0] == '[') {
    const size_t close = what.find("] ");
    if (close != std::string::npos) what.erase(0, close + 2);
  }
  return what;
}

// The largest step the daemon keeps (2^63 - 1: its journal stores signed 64-bit integers), and
// the float it rounds up to.
constexpr uint64_t kMaxStep = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
constexpr double kLargestStepBound = 9223372036854775808.0;

std::string TooLargeStep(std::string_view what, const json& v) {
  return std::string(what) + " " + v.dump() + " is above the largest step the daemon keeps, " +
         std::to_string(kMaxStep) + " (2^63 - 1)";
}

// The first key that appears twice in one object of `text` (valid JSON); empty when none does.
std::string RepeatedKey(const std::string& text) {
  std::vector<std::set<std::string>> open;  // keys of each object being read
  std::string repeated;
  const json whole = json::parse(text, [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) open.emplace_back();
    if (event == json::parse_event_t::object_end) open.pop_back();
    if (event == json::parse_event_t::key && !open.back().insert(parsed.get<std::string>()).second &&
        repeated.empty()) {
      repeated = parsed.get<std::string>();
    }
    return true;
  });
  return whole.is_discarded() ? std::string() : repeated;
}

LineResult Error(std::string reason) {
  LineResult r;
  r.error = std::move(reason);
  return r;
}

LineResult ParseHeader(const json& obj) {
  HeaderRecord h;
  if (auto it = obj.find("run"); it != obj.end()) {
    if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
      return Error("header \"run\" must be a non-empty string");
    }
    h.run = it->get<std::string>();
  }
  if (auto it = obj.find("resume_from_step"); it != obj.end()) {
    const std::optional<uint64_t> n = AsCount(*it);
    if (!n) return Error("header \"resume_from_step\" must be a non-negative integer (a step)");
    if (*n > kMaxStep) return Error(TooLargeStep("header \"resume_from_step\"", *it));
    h.resume_from_step = *n;
  }
  if (auto it = obj.find("config"); it != obj.end()) {
    if (!it->is_object()) return Error("header \"config\" must be an object");
    for (const auto& [key, value] : it->items()) {
      if (key == "hidden_size") {
        auto n = AsCount(value);
        if (!n) return Error("config.hidden_size must be a non-negative integer");
        h.config.set_hidden_size(*n);
      } else if (key == "z_loss_coef") {
        auto d = AsNumber(value);
        if (!d) return Error("config.z_loss_coef must be a number");
        h.config.set_z_loss_coef(*d);
      } else if (key == "weight_decay") {
        auto d = AsNumber(value);
        if (!d) return Error("config.weight_decay must be a number");
        h.config.set_weight_decay(*d);
      } else if (key == "warmup_steps") {
        auto n = AsCount(value);
        if (!n) return Error("config.warmup_steps must be a non-negative integer (steps)");
        h.config.set_warmup_steps(*n);
      } else if (key == "total_steps" || key == "train_steps" || key == "max_steps" || key == "train_iters") {
        // The run's length, under the names trainers give it.
        auto n = AsCount(value);
        if (!n) return Error("config." + key + " must be a non-negative integer (steps)");
        h.config.set_total_steps(*n);
      } else if (key == "optimizer") {
        h.config.set_optimizer(AsText(value));
      } else {
        (*h.config.mutable_extra())[key] = AsText(value);
      }
    }
  }
  if (auto it = obj.find("labels"); it != obj.end()) {
    if (!it->is_object()) return Error("header \"labels\" must be an object");
    for (const auto& [key, value] : it->items()) h.labels[key] = AsText(value);
  }
  if (auto it = obj.find("params"); it != obj.end()) {
    if (!it->is_array()) return Error("header \"params\" must be an array");
    size_t i = 0;
    for (const json& p : *it) {
      const std::string where = "params[" + std::to_string(i++) + "]";
      if (!p.is_object()) return Error(where + " must be an object");
      auto name = p.find("name");
      if (name == p.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
        return Error(where + " needs a non-empty string \"name\"");
      }
      v1::ParamInfo info;
      info.set_name(name->get<std::string>());
      for (const v1::ParamInfo& seen : h.params) {
        if (seen.name() == info.name()) return Error(where + " repeats the name " + info.name());
      }
      bool kind_given = false;
      bool wd_given = false;
      if (auto f = p.find("numel"); f != p.end()) {
        auto n = AsCount(*f);
        if (!n) return Error(where + ".numel must be a non-negative integer");
        info.set_numel(*n);
      }
      if (auto f = p.find("kind"); f != p.end()) {
        auto kind = f->is_string() ? ParseParamKind(f->get_ref<const std::string&>()) : std::nullopt;
        if (!kind) return Error(where + ".kind " + f->dump() + " is not a known kind");
        info.set_kind(*kind);
        kind_given = true;
      }
      if (auto f = p.find("weight_decay"); f != p.end()) {
        auto d = AsNumber(*f);
        if (!d) return Error(where + ".weight_decay must be a number");
        info.set_weight_decay(*d);
        wd_given = true;
      }
      if (auto f = p.find("init_norm"); f != p.end() && !f->is_null()) {
        auto d = AsNumber(*f);
        if (!d) return Error(where + ".init_norm must be a number");
        info.set_init_norm(*d);
      }
      if (auto f = p.find("role"); f != p.end() && !f->is_null()) info.set_role(AsText(*f));
      if (auto f = p.find("group"); f != p.end() && !f->is_null()) info.set_group(AsText(*f));
      h.params.push_back(std::move(info));
      h.kind_given.push_back(kind_given);
      h.weight_decay_given.push_back(wd_given);
    }
  }
  LineResult r;
  r.line = std::move(h);
  return r;
}

// A key the daemon fills from a StepStats field: its value must be a number.
bool IsBuiltInKey(const std::string& key) {
  if (key == kTotalGradKey || key == "train/loss" || key == "train/z_loss" || key == "optim/learning_rate" ||
      key == "train/tokens") {
    return true;
  }
  for (std::string_view prefix : {kGradPrefix, kParamPrefix, kUpdatePrefix, kRadialPrefix}) {
    if (key.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

// A string holding a decimal number, such as "1.0": a number written as text by mistake.
bool IsQuotedNumber(const json& v) {
  if (!v.is_string()) return false;
  const std::string& s = v.get_ref<const std::string&>();
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}

// Adds one numeric value; returns why it cannot be sent, if it cannot (the line is then skipped).
std::optional<std::string> AddMetric(StepRecord& rec, const std::string& key, double value) {
  v1::StepStats& s = rec.stats;
  rec.has_metrics = true;
  if (key == kTotalGradKey) {
    s.mutable_total_grad()->set_norm(value);
    return std::nullopt;
  }
  if (key == kTotalParamKey || key == kTotalUpdateKey) {
    (*s.mutable_extra())[key] = value;  // the whole model's norm: no parameter is named "total"
    return std::nullopt;
  }
  const std::pair<std::string_view, NormField> prefixes[] = {
      {kGradPrefix, NormField::kGrad},
      {kParamPrefix, NormField::kParam},
      {kUpdatePrefix, NormField::kUpdate},
      {kRadialPrefix, NormField::kRadial},
  };
  for (const auto& [prefix, field] : prefixes) {
    if (key.size() > prefix.size() && key.compare(0, prefix.size(), prefix) == 0) {
      rec.params.push_back({key.substr(prefix.size()), field, value});
      return std::nullopt;
    }
    if (key == prefix) return "\"" + key + "\" names no parameter";
  }
  if (key == "train/loss") {
    s.set_loss(value);
  } else if (key == "train/z_loss") {
    s.set_z_loss(value);
  } else if (key == "optim/learning_rate") {
    s.set_learning_rate(value);
  } else if (key == "train/tokens") {
    // The daemon keeps train/tokens only as a count: anything else cannot be sent under its key.
    if (!(std::isfinite(value) && value >= 0 && value < 18446744073709551616.0)) {
      return "\"train/tokens\" must be a non-negative count";
    }
    s.set_tokens(static_cast<uint64_t>(std::llround(value)));
  } else {
    (*s.mutable_extra())[key] = value;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::string> ParseCatalogChanges(const json& list, std::vector<v1::ParamChange>* out) {
  if (!list.is_array() || list.empty()) return "\"params\" on a step line must be a non-empty array";
  size_t i = 0;
  for (const json& p : list) {
    const std::string where = "params[" + std::to_string(i++) + "]";
    if (!p.is_object()) return where + " must be an object";
    auto name = p.find("name");
    if (name == p.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) {
      return where + " needs a non-empty string \"name\"";
    }
    v1::ParamChange c;
    c.set_name(name->get<std::string>());
    for (const auto& [key, value] : p.items()) {
      if (key == "name") continue;
      if (key == "weight_decay") {
        const auto d = AsNumber(value);
        if (!d || !std::isfinite(*d) || *d < 0) return where + ".weight_decay must be a number ≥ 0";
        c.set_weight_decay(*d);
      } else if (key == "kind") {
        const auto kind = value.is_string() ? ParseParamKind(value.get_ref<const std::string&>()) : std::nullopt;
        if (!kind) return where + ".kind " + value.dump() + " is not a known kind";
        c.set_kind(*kind);
      } else if (key == "role") {
        c.set_role(AsText(value));
      } else if (key == "group") {
        c.set_group(AsText(value));
      } else {
        return where + "." + key + " cannot change during a run (weight_decay, kind, role and group can)";
      }
    }
    if (!c.has_weight_decay() && !c.has_kind() && !c.has_role() && !c.has_group()) {
      return where + " changes nothing: give weight_decay, kind, role or group";
    }
    out->push_back(std::move(c));
  }
  return std::nullopt;
}

std::string QuoteNonFiniteTokens(std::string_view line) {
  static constexpr std::string_view kTokens[] = {"-Infinity", "Infinity", "-NaN", "NaN"};
  // Most lines have neither token: skip the character walk for them.
  if (line.find("NaN") == std::string_view::npos && line.find("Infinity") == std::string_view::npos) {
    return std::string(line);
  }
  std::string out;
  out.reserve(line.size() + 16);
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool replaced = false;
    if ((c == 'N' || c == 'I' || c == '-') && (i == 0 || IsValueStart(line[i - 1]))) {
      for (std::string_view token : kTokens) {
        if (line.substr(i, token.size()) == token &&
            (i + token.size() == line.size() || IsValueEnd(line[i + token.size()]))) {
          out += '"';
          out += token;
          out += '"';
          i += token.size() - 1;
          replaced = true;
          break;
        }
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

json ParseJsonLine(std::string_view line, std::string* error) {
  const std::string text = QuoteNonFiniteTokens(line);
  std::vector<size_t> keys;  // keys read so far in each object being read
  bool repeats = false;
  json obj;
  try {
    obj = json::parse(text, [&](int, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::object_start) keys.push_back(0);
      if (event == json::parse_event_t::key) ++keys.back();
      if (event == json::parse_event_t::object_end) {
        repeats = repeats || keys.back() != parsed.size();
        keys.pop_back();
      }
      return true;
    });
  } catch (const json::exception& e) {
    *error = "invalid JSON: " + StripJsonExceptionPrefix(e.what());
    return json(json::value_t::discarded);
  }
  if (repeats) {
    *error = "key \"" + RepeatedKey(text).substr(0, 256) +
             "\" appears twice in one object (a JSON object keeps one value per key; which one is meant?)";
    return json(json::value_t::discarded);
  }
  return obj;
}

LineResult ParseReplayLine(std::string_view text, bool first_line) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) {
    LineResult r;
    r.line = BlankLine{};
    return r;
  }
  std::string parse_error;
  const json obj = ParseJsonLine(text, &parse_error);
  if (!parse_error.empty()) return Error(std::move(parse_error));
  if (!obj.is_object()) return Error("not a JSON object");

  auto step_it = obj.find("_step");
  if (step_it == obj.end()) {
    const bool looks_like_header = obj.contains("run") || obj.contains("config") || obj.contains("labels") ||
                                   obj.contains("params") || obj.contains("resume_from_step");
    if (looks_like_header && first_line) return ParseHeader(obj);
    if (looks_like_header) return Error("a header is only allowed on the first line");
    return Error("missing _step");
  }
  StepRecord rec;
  const json& step = *step_it;
  if (step.is_number_integer() && !step.is_number_unsigned()) return Error("negative _step");
  if (step.is_number_float() && step.get<double>() < 0) return Error("negative _step");
  if (!step.is_number()) return Error("_step is not a number: " + step.dump());
  auto step_value = AsCount(step);
  if (step.is_number_float() && step.get<double>() >= kLargestStepBound) return Error(TooLargeStep("_step", step));
  if (!step_value) return Error("non-integer _step: " + step.dump());
  if (*step_value > kMaxStep) return Error(TooLargeStep("_step", step));
  rec.step = *step_value;
  rec.stats.set_step(rec.step);

  if (auto it = obj.find("_timestamp"); it != obj.end()) {
    auto ts = AsNumber(*it);
    if (ts && std::isfinite(*ts)) {
      rec.timestamp = *ts;
      rec.stats.set_wall_time(*ts);
    }
  }
  for (const auto& [key, value] : obj.items()) {
    if (!key.empty() && key[0] == '_') continue;
    if (key == "event") {
      if (!value.is_string()) return Error("\"event\" must be a string");
      if (value.get_ref<const std::string&>().empty()) return Error("empty event text");
      rec.event = value.get<std::string>();
      continue;
    }
    if (key == "params") {
      if (auto problem = ParseCatalogChanges(value, &rec.catalog_update)) return Error(*problem);
      continue;
    }
    if (auto number = AsNumber(value)) {
      if (auto problem = AddMetric(rec, key, *number)) return Error(*problem);
      continue;
    }
    // Text, flags, null and media under keys of the user's own are not metrics and are ignored;
    // a series the daemon gives meaning to must be a number, and a quoted number is one.
    if (!IsBuiltInKey(key) && !IsQuotedNumber(value)) continue;
    std::string shown = value.dump(-1, ' ', true, json::error_handler_t::replace);
    if (shown.size() > 64) shown = shown.substr(0, 61) + "...";
    return Error("\"" + key + "\": " + shown +
                 " is not a number (write a JSON number, or \"NaN\", \"Infinity\", \"-Infinity\")");
  }
  LineResult r;
  r.line = std::move(rec);
  return r;
}

v1::ParamKind InferParamKind(std::string_view name) {
  const std::string n = AsciiLower(name);
  if (Contains(n, "norm") || Contains(n, "ln_f") || Contains(n, "ln_")) {
    return v1::PARAM_KIND_NORM_GAIN;
  }
  if (Contains(n, "lm_head")) return v1::PARAM_KIND_OUTPUT;
  if (Contains(n, "embed")) return v1::PARAM_KIND_EMBEDDING;
  // Attention and MLP before "gate" and "output": `mlp.gate_proj` is not a router and
  // `attention.output.dense` is not the lm_head.
  if (Contains(n, "attn") || Contains(n, "attention")) return v1::PARAM_KIND_ATTENTION;
  if (Contains(n, "mlp") || Contains(n, "expert") || Contains(n, "ffn") || Contains(n, "gate_proj") ||
      Contains(n, "up_proj") || Contains(n, "down_proj")) {
    return v1::PARAM_KIND_MLP;
  }
  if (Contains(n, "router") || Contains(n, "gate")) return v1::PARAM_KIND_ROUTER;
  if (Contains(n, "output")) return v1::PARAM_KIND_OUTPUT;
  return v1::PARAM_KIND_OTHER;
}

std::optional<v1::ParamKind> ParseParamKind(std::string_view name) {
  std::string n = AsciiLower(name);
  if (n.rfind("param_kind_", 0) == 0) n.erase(0, 11);
  if (n == "norm_gain" || n == "norm") return v1::PARAM_KIND_NORM_GAIN;
  if (n == "output" || n == "lm_head") return v1::PARAM_KIND_OUTPUT;
  if (n == "embedding" || n == "embed") return v1::PARAM_KIND_EMBEDDING;
  if (n == "router") return v1::PARAM_KIND_ROUTER;
  if (n == "attention") return v1::PARAM_KIND_ATTENTION;
  if (n == "mlp") return v1::PARAM_KIND_MLP;
  if (n == "other") return v1::PARAM_KIND_OTHER;
  return std::nullopt;
}

std::string_view ParamKindName(v1::ParamKind kind) {
  switch (kind) {
    case v1::PARAM_KIND_NORM_GAIN: return "norm_gain";
    case v1::PARAM_KIND_OUTPUT: return "output";
    case v1::PARAM_KIND_EMBEDDING: return "embedding";
    case v1::PARAM_KIND_ROUTER: return "router";
    case v1::PARAM_KIND_ATTENTION: return "attention";
    case v1::PARAM_KIND_MLP: return "mlp";
    case v1::PARAM_KIND_OTHER: return "other";
    default: return "unspecified";
  }
}

void ReplayCatalog::SetHeader(const HeaderRecord& header) {
  params_ = header.params;
  kind_given_ = header.kind_given;
  weight_decay_given_ = header.weight_decay_given;
  kind_given_.resize(params_.size(), false);
  weight_decay_given_.resize(params_.size(), false);
  if (header.config.has_weight_decay()) default_weight_decay_ = header.config.weight_decay();
  index_.clear();
  for (uint32_t i = 0; i < params_.size(); ++i) index_.emplace(params_[i].name(), i);
}

void ReplayCatalog::AddFrom(const StepRecord& record) {
  for (const ParamValue& v : record.params) {
    if (index_.contains(v.param)) continue;
    index_.emplace(v.param, static_cast<uint32_t>(params_.size()));
    v1::ParamInfo info;
    info.set_name(v.param);
    params_.push_back(std::move(info));
    kind_given_.push_back(false);
    weight_decay_given_.push_back(false);
  }
}

std::optional<uint32_t> ReplayCatalog::IndexOf(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

std::vector<v1::ParamInfo> ReplayCatalog::Params() const {
  std::vector<v1::ParamInfo> out = params_;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!kind_given_[i]) out[i].set_kind(InferParamKind(out[i].name()));
    if (!weight_decay_given_[i]) {
      // Norm gains are conventionally excluded from weight decay.
      out[i].set_weight_decay(out[i].kind() == v1::PARAM_KIND_NORM_GAIN ? 0.0 : default_weight_decay_.value_or(0.0));
    }
  }
  return out;
}

v1::StepStats ToStepStats(const StepRecord& record, const ReplayCatalog& catalog) {
  v1::StepStats stats = record.stats;
  std::map<uint32_t, v1::ParamStats> by_index;
  for (const ParamValue& v : record.params) {
    auto index = catalog.IndexOf(v.param);
    if (!index) continue;
    v1::ParamStats& p = by_index[*index];
    p.set_index(*index);
    switch (v.field) {
      case NormField::kGrad: p.mutable_grad()->set_norm(v.value); break;
      case NormField::kParam: p.mutable_param()->set_norm(v.value); break;
      case NormField::kUpdate: p.mutable_update()->set_norm(v.value); break;
      case NormField::kRadial: p.mutable_radial_update()->set_radial(v.value); break;
    }
  }
  for (auto& [index, p] : by_index) *stats.add_params() = std::move(p);
  return stats;
}

std::string AsciiLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

}  // namespace gradwatch::cli

#include "client/cli/format.h"

#include <cctype>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <sstream>

#include "client/cli/replay_parser.h"

namespace gradwatch::cli {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using json = nlohmann::ordered_json;

constexpr std::string_view kGradPrefix = "grad/norm/";
constexpr std::string_view kParamPrefix = "params/norm/";
constexpr std::string_view kUpdatePrefix = "updates/norm/";
constexpr std::string_view kKeySeries[] = {"grad/norm/total", "train/loss", "train/z_loss", "optim/learning_rate"};

// An enum value as the CLI's JSON writes it: its name without the enum's prefix, lower case
// (RUN_STATE_ACTIVE of RunState -> "active", PARAM_KIND_NORM_GAIN -> "norm_gain").
std::string EnumJsonName(const google::protobuf::EnumValueDescriptor& value) {
  std::string prefix;  // RunState -> RUN_STATE_
  for (const char c : value.type()->name()) {
    if (std::isupper(static_cast<unsigned char>(c)) && !prefix.empty()) prefix += '_';
    prefix += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  prefix += '_';
  std::string name = value.name();
  if (name.rfind(prefix, 0) == 0) name.erase(0, prefix.size());
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

// One field value; `index` < 0 for a singular field.
json FieldToJson(const Message& m, const Reflection* r, const FieldDescriptor* f, int index) {
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64: return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32: return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64: return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return JsonValue(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT: return JsonValue(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_BOOL: return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int number = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const auto* value = f->enum_type()->FindValueByNumber(number);
      return value != nullptr ? json(EnumJsonName(*value)) : json(number);
    }
    case FieldDescriptor::CPPTYPE_STRING: return rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
  }
  return nullptr;
}

std::string MapKey(const json& key) { return key.is_string() ? key.get<std::string>() : key.dump(); }

std::string StateName(v1::RunState state) {
  switch (state) {
    case v1::RUN_STATE_ACTIVE: return "active";
    case v1::RUN_STATE_ENDED: return "ended";
    case v1::RUN_STATE_FINISHED: return "finished";
    case v1::RUN_STATE_ARCHIVED: return "archived";
    default: return "unknown";
  }
}

std::string FormatOptional(const std::optional<double>& v) { return v ? FormatValue(*v) : "-"; }

std::string JoinMap(const google::protobuf::Map<std::string, std::string>& map) {
  std::map<std::string, std::string> sorted(map.begin(), map.end());
  std::string out;
  for (const auto& [k, v] : sorted) {
    if (!out.empty()) out += ", ";
    out += k + "=" + v;
  }
  return out.empty() ? "-" : out;
}

std::string Indent(const std::string& block, const std::string& prefix) {
  std::istringstream in(block);
  std::string line, out;
  while (std::getline(in, line)) out += prefix + line + "\n";
  return out;
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.size() > prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

// Larger first; NaN and ±Inf ahead of every finite value; absent last.
bool GradNormBefore(const ParamLatest& a, const ParamLatest& b) {
  auto rank = [](const std::optional<double>& v) {
    if (!v) return 2;
    return std::isfinite(*v) ? 1 : 0;
  };
  const int ra = rank(a.grad_norm), rb = rank(b.grad_norm);
  if (ra != rb) return ra < rb;
  if (ra == 1 && *a.grad_norm != *b.grad_norm) return *a.grad_norm > *b.grad_norm;
  return a.name < b.name;
}

}  // namespace

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds)) return "-";
  const auto total = static_cast<long long>(std::llround(std::fabs(seconds)));
  const long long d = total / 86400, h = total % 86400 / 3600, m = total % 3600 / 60, sec = total % 60;
  char buf[48];
  if (d > 0) {
    std::snprintf(buf, sizeof buf, "%lldd %lldh", d, h);
  } else if (h > 0) {
    std::snprintf(buf, sizeof buf, "%lldh %lldm", h, m);
  } else if (m > 0) {
    std::snprintf(buf, sizeof buf, "%lldm %llds", m, sec);
  } else {
    std::snprintf(buf, sizeof buf, "%llds", sec);
  }
  return buf;
}

std::string FormatLocalTime(double seconds, double now) {
  if (!(seconds > 0) || !std::isfinite(seconds)) return "-";
  const std::time_t t = static_cast<std::time_t>(seconds);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[40];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return std::string(buf) + " (" + FormatAge(seconds, now) + ")";
}

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  if (value == 0) return "0";
  const double magnitude = std::fabs(value);
  char buf[64];
  if (magnitude >= 1e3 && magnitude < 1e15) return GroupedStep(value);
  if (magnitude >= 1e-4) {
    std::snprintf(buf, sizeof buf, "%.4g", value);  // fixed notation in this range, trailing zeros dropped
    return buf;
  }
  // 1.235e-05 -> 1.235e-5; 1.000e+20 -> 1e+20.
  std::snprintf(buf, sizeof buf, "%.3e", value);
  std::string text = buf;
  const size_t e = text.find('e');
  std::string mantissa = text.substr(0, e);
  if (mantissa.find('.') != std::string::npos) {
    mantissa.erase(mantissa.find_last_not_of('0') + 1);
    if (mantissa.back() == '.') mantissa.pop_back();
  }
  std::string exponent = text.substr(e + 2);
  exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
  return mantissa + "e" + text[e + 1] + exponent;
}

std::string GroupedStep(double step) {
  const long long v = std::llround(step);
  const std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out = v < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string FormatAge(double seconds, double now) {
  if (!(seconds > 0) || !std::isfinite(seconds)) return "-";
  const double delta = seconds - now;
  return delta >= 0 ? "in " + FormatDuration(delta) : FormatDuration(delta) + " ago";
}

std::string FormatSteps(uint64_t first, uint64_t last) {
  return first == last ? std::to_string(first) : std::to_string(first) + ".." + std::to_string(last);
}

json JsonValue(double value) {
  if (std::isfinite(value)) return value;
  if (std::isnan(value)) return "NaN";
  return value > 0 ? "Infinity" : "-Infinity";
}

json ProtoToJson(const Message& message) {
  json out = json::object();
  const auto* descriptor = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* f = descriptor->field(i);
    if (f->is_map()) {
      json obj = json::object();
      const FieldDescriptor* key = f->message_type()->map_key();
      const FieldDescriptor* value = f->message_type()->map_value();
      for (int j = 0; j < r->FieldSize(message, f); ++j) {
        const Message& entry = r->GetRepeatedMessage(message, f, j);
        const Reflection* er = entry.GetReflection();
        obj[MapKey(FieldToJson(entry, er, key, -1))] = FieldToJson(entry, er, value, -1);
      }
      out[f->name()] = std::move(obj);
    } else if (f->is_repeated()) {
      json arr = json::array();
      for (int j = 0; j < r->FieldSize(message, f); ++j) arr.push_back(FieldToJson(message, r, f, j));
      out[f->name()] = std::move(arr);
    } else if (!f->has_presence() || r->HasField(message, f)) {
      out[f->name()] = FieldToJson(message, r, f, -1);
    }
  }
  return out;
}

std::string FormatTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(widths[c] - row[c].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

std::string FormatRunsTable(const v1::ListRunsResponse& runs, double now) {
  if (runs.runs().empty()) return "no runs\n";
  std::vector<std::vector<std::string>> rows = {
      {"RUN", "STATE", "WORLD", "STEPS", "FIRST..LAST", "STEPS/S", "STREAMS", "LAST STEP"}};
  for (const v1::RunInfo& run : runs.runs()) {
    rows.push_back({
        run.run_id(),
        StateName(run.state()),
        std::to_string(run.world_size()),
        FormatValue(static_cast<double>(run.step_count())),
        run.step_count() > 0 ? FormatSteps(run.first_step(), run.last_step()) : "-",
        run.steps_per_second() > 0 ? FormatValue(run.steps_per_second()) : "-",
        std::to_string(run.open_streams()),
        FormatAge(run.last_wall_time(), now),
    });
  }
  return FormatTable(rows);
}

RunOverview BuildOverview(const v1::RunSummary& summary, size_t top_n) {
  RunOverview overview;
  std::map<std::string, const v1::LatestValue*> by_key;
  for (const v1::LatestValue& v : summary.latest()) by_key[v.key()] = &v;
  for (std::string_view key : kKeySeries) {
    if (auto it = by_key.find(std::string(key)); it != by_key.end()) {
      overview.key_series.push_back(*it->second);
    }
  }
  std::map<std::string, ParamLatest> params;
  for (const v1::ParamInfo& p : summary.params()) {
    ParamLatest& latest = params[p.name()];
    latest.name = p.name();
    latest.kind = p.kind();
  }
  for (const v1::LatestValue& v : summary.latest()) {
    const std::string& key = v.key();
    if (key == kKeySeries[0]) continue;
    std::optional<double> ParamLatest::*field = nullptr;
    size_t prefix = 0;
    if (StartsWith(key, kGradPrefix)) {
      field = &ParamLatest::grad_norm;
      prefix = kGradPrefix.size();
    } else if (StartsWith(key, kParamPrefix)) {
      field = &ParamLatest::param_norm;
      prefix = kParamPrefix.size();
    } else if (StartsWith(key, kUpdatePrefix)) {
      field = &ParamLatest::update_norm;
      prefix = kUpdatePrefix.size();
    } else {
      continue;
    }
    auto& p = params[key.substr(prefix)];
    if (p.name.empty()) p.name = key.substr(prefix);
    p.*field = v.value();
  }
  std::vector<ParamLatest> with_values;
  for (auto& [name, p] : params) {
    if (p.grad_norm || p.param_norm) with_values.push_back(std::move(p));
  }
  overview.params_with_values = with_values.size();
  std::sort(with_values.begin(), with_values.end(), GradNormBefore);
  if (with_values.size() > top_n) with_values.resize(top_n);
  overview.top_params = std::move(with_values);
  return overview;
}

namespace {

// 48000 → "48,000".
std::string Percent(double share) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * share);
  return buf;
}

std::string Trend(double slope_per_kstep, double scale) {
  const double relative = scale != 0 ? slope_per_kstep / scale : slope_per_kstep;
  if (!std::isfinite(relative) || std::abs(relative) < 1e-3) return "steady";
  return slope_per_kstep > 0 ? "rising" : "falling";
}

// "(over the last 20,000-step window)", or what a young window holds: "(over the last 300 steps;
// the 20,000-step window is not yet full)".
std::string WindowHeld(const v1::ThresholdForecast& f) {
  const uint64_t window = f.window_steps();
  const uint64_t span = f.fit_samples() > 0 ? f.fit_span_steps() + 1 : window;
  if (span >= window) return "(over the last " + GroupedStep(static_cast<double>(window)) + "-step window)";
  return "(over the last " + GroupedStep(static_cast<double>(span)) + " steps; the " +
         GroupedStep(static_cast<double>(window)) + "-step window is not yet full)";
}

// Four significant digits: enough to read a slope or a ratio.
std::string Signed(double v) { return (v >= 0 ? "+" : "") + FormatValue(v); }

}  // namespace

std::string FormatDiagnosis(const v1::RunSummary& summary) {
  const v1::Analysis& a = summary.analysis();
  std::ostringstream out;
  if (summary.has_diagnosis()) {
    // What every alert of the run says, from the same evidence (the daemon's diagnosis).
    const v1::RunDiagnosis& d = summary.diagnosis();
    out << "diagnosis at step " << GroupedStep(static_cast<double>(d.step())) << ": " << d.text() << "\n";
    if (!d.recommendation().empty()) out << "recommendation: " << d.recommendation() << "\n";
    if (!d.page_held().empty()) out << "pages held: " << d.page_held() << "\n";
  }
  const std::string total_key = "grad/norm/total";
  // The total grad norm and its slope over the forecast window (the middle one by default).
  const v1::ThresholdForecast* forecast = nullptr;
  for (const auto& f : a.forecasts()) {
    if (f.key() == total_key) forecast = &f;
  }
  double total_now = std::nan("");
  for (const auto& v : summary.latest()) {
    if (v.key() == total_key) total_now = v.value();
  }
  if (std::isfinite(total_now) || forecast != nullptr) {
    out << "total grad norm " << FormatValue(total_now);
    if (forecast != nullptr) {
      out << ", " << Trend(forecast->slope_per_kstep(), forecast->current_value()) << " "
          << Signed(forecast->slope_per_kstep()) << " per 1k steps " << WindowHeld(*forecast);
    }
    out << "\n";
  }
  for (const auto& f : a.forecasts()) {
    out << "forecast: " << f.key() << " ";
    if (f.current_value() >= f.threshold()) {
      out << "is at or above " << FormatValue(f.threshold()) << " now\n";
    } else if (!f.reachable()) {
      out << "is not rising: it does not reach " << FormatValue(f.threshold()) << " at the current slope\n";
    } else {
      out << "reaches " << FormatValue(f.threshold()) << " in ~" << FormatValue(std::round(f.steps_to_threshold()))
          << " steps, near step " << GroupedStep(static_cast<double>(f.at_step()));
      if (summary.config().has_total_steps()) {
        out << (f.at_step() > summary.config().total_steps() ? ", after" : ", before") << " the run's last step "
            << GroupedStep(static_cast<double>(summary.config().total_steps()));
      }
      out << "\n";
    }
  }
  for (const auto& p : a.projections()) {
    out << "what-if: weight decay " << FormatValue(p.weight_decay()) << " on " << p.param() << " from step "
        << GroupedStep(static_cast<double>(p.from_step())) << ": " << FormatValue(p.norm_now()) << " → ~"
        << FormatValue(p.norm()) << " by step " << GroupedStep(static_cast<double>(p.to_step()));
    if (std::isfinite(p.equilibrium_norm())) {
      out << " (equilibrium ~" << FormatValue(p.equilibrium_norm()) << ", time constant ~"
          << FormatValue(std::round(p.time_constant_steps())) << " steps)";
    }
    if (std::isfinite(p.total_grad_norm())) out << "; total grad norm ~" << FormatValue(p.total_grad_norm());
    out << (p.radial_known() ? " [radial update as reported]" : " [radial update from the norm's slope]");
    out << (p.schedule().empty() ? " [learning rate held]" : " [learning rate " + p.schedule() + "]") << "\n";
  }
  for (const auto& r : a.remediations()) {
    out << "remediation: " << r.param() << " weight decay " << FormatValue(r.previous_weight_decay()) << " → "
        << FormatValue(r.weight_decay()) << " at step " << GroupedStep(static_cast<double>(r.step())) << ": "
        << r.verdict() << " (norm " << FormatValue(r.norm_at_step()) << " then, " << FormatValue(r.actual_norm())
        << " at step " << GroupedStep(static_cast<double>(r.at_step())) << ", projected ~"
        << FormatValue(r.projected_norm()) << ", ~" << FormatValue(r.unchanged_norm()) << " without the change)\n";
  }
  int shown = 0;
  std::string shares;
  for (const auto& s : a.shares()) {
    if (s.is_group() || shown == 3) continue;
    shares += (shown++ ? "; " : "") + s.name() + " " + Percent(s.share()) + " and " + Trend(s.slope_per_kstep(), 1.0) +
              " (" + Signed(100.0 * s.slope_per_kstep()) + " pts per 1k steps)";
  }
  if (!shares.empty()) out << "largest shares of the squared grad norm: " << shares << "\n";
  for (const auto& g : a.growth_without_decay()) {
    out << "growing without weight decay: " << g.param() << " ×" << FormatValue(g.growth_factor()) << " over the last "
        << FormatValue(static_cast<double>(g.window_steps())) << " steps, " << Signed(g.slope_per_kstep())
        << " per 1k steps, norm " << FormatValue(g.norm());
    if (std::isfinite(g.amplification())) out << " (" << FormatValue(g.amplification()) << "× its init norm)";
    out << "\n";
  }
  for (const auto& am : a.amplifications()) {
    bool listed = false;
    for (const auto& g : a.growth_without_decay()) listed = listed || g.param() == am.param();
    if (!listed) {
      out << "norm gain " << am.param() << ": " << FormatValue(am.amplification()) << "× its init norm ("
          << FormatValue(am.norm()) << " / " << FormatValue(am.init_norm()) << ")\n";
    }
  }
  for (const auto& c : a.slope_changes()) {
    if (c.key() != total_key && c.key().rfind("params/norm/", 0) != 0) continue;
    out << "at step " << GroupedStep(static_cast<double>(c.event_step())) << " (" << c.event_text() << "): " << c.key()
        << " slope ×" << FormatValue(c.ratio()) << ", " << FormatValue(c.before_per_kstep()) << " → "
        << FormatValue(c.after_per_kstep()) << " per 1k steps"
        << (c.after_window_full() ? "" : " (after-window still filling)") << "\n";
  }
  for (const auto& c : a.change_points()) {
    out << "slope change without an event: " << c.key() << " at step " << GroupedStep(static_cast<double>(c.step()))
        << ", " << FormatValue(c.before_per_kstep()) << " → " << FormatValue(c.after_per_kstep()) << " per 1k steps (×"
        << FormatValue(c.ratio()) << ")\n";
  }
  return out.str();
}

std::string FormatAlertHistory(const v1::ListAlertHistoryResponse& history, double now) {
  if (history.entries().empty()) return "no alert changed state\n";
  std::vector<std::vector<std::string>> rows = {
      {"AT", "STEP", "ALERT", "RUN", "SEVERITY", "FROM", "TO", "VALUE", "SUMMARY"}};
  const auto state = [](v1::AlertState s) -> std::string {
    switch (s) {
      case v1::ALERT_STATE_PENDING: return "pending";
      case v1::ALERT_STATE_FIRING: return "firing";
      case v1::ALERT_STATE_RESOLVED: return "resolved";
      case v1::ALERT_STATE_INACTIVE: return "cleared";
      default: return "-";
    }
  };
  for (const v1::AlertHistoryEntry& e : history.entries()) {
    const v1::Alert& a = e.alert();
    auto label = [&a](const char* name) {
      auto it = a.labels().find(name);
      return it == a.labels().end() ? std::string("-") : it->second;
    };
    auto summary = a.annotations().find("summary");
    rows.push_back({FormatLocalTime(e.at(), now), std::to_string(a.step()), a.name(), label("run"), label("severity"),
                    state(e.from()), state(a.state()), FormatValue(a.value()),
                    summary == a.annotations().end() ? "" : summary->second});
  }
  return "Oldest first. STEP: the step of the change; SUMMARY: as the alert read then\n\n" + FormatTable(rows);
}

std::string FormatAlerts(const v1::ListAlertsResponse& alerts, double now) {
  if (alerts.alerts().empty()) return "no pending or firing alerts\n";
  std::vector<std::vector<std::string>> rows = {
      {"STATE", "ALERT", "RUN", "SEVERITY", "STATE AT STEP", "VALUE", "SINCE", "FINGERPRINT", "SUMMARY NOW"}};
  for (const v1::Alert& a : alerts.alerts()) {
    auto label = [&a](const char* name) {
      auto it = a.labels().find(name);
      return it == a.labels().end() ? std::string("-") : it->second;
    };
    auto summary = a.annotations().find("summary");
    std::string state = a.state() == v1::ALERT_STATE_FIRING    ? "firing"
                        : a.state() == v1::ALERT_STATE_PENDING ? "pending"
                                                               : "resolved";
    if (a.has_ack()) {
      state += " (acked)";
    } else if (!a.silenced_by().empty()) {
      state += " (silenced)";
    }
    rows.push_back({state, a.name(), label("run"), label("severity"), std::to_string(a.step()), FormatValue(a.value()),
                    FormatAge(a.starts_at(), now), a.fingerprint(),
                    summary == a.annotations().end() ? "" : summary->second});
  }
  std::string out =
      "STATE AT STEP: the step at which the alert entered its state; SUMMARY NOW: as of the latest step "
      "evaluated\n\n" +
      FormatTable(rows);
  for (const v1::Alert& a : alerts.alerts()) {
    if (a.has_ack()) {
      out += "\n" + a.name() + " " + a.fingerprint() + " acknowledged by " + a.ack().by() + " at " +
             FormatLocalTime(a.ack().at(), now) + (a.ack().comment().empty() ? "" : ": " + a.ack().comment()) + "\n";
    }
    if (!a.silenced_by().empty()) {
      std::string ids;
      for (const std::string& id : a.silenced_by()) ids += (ids.empty() ? "" : ", ") + id;
      out += "\n" + a.name() + " " + a.fingerprint() + " silenced by " + ids + "\n";
    }
  }
  // Alerts of one run share their recommendation: print each text once, headed by the alerts carrying it.
  std::vector<std::pair<std::string, std::string>> recommendations;  // names, text
  for (const v1::Alert& a : alerts.alerts()) {
    auto rec = a.annotations().find("recommendation");
    if (rec == a.annotations().end() || rec->second.empty()) continue;
    auto same = std::find_if(recommendations.begin(), recommendations.end(),
                             [&](const auto& r) { return r.second == rec->second; });
    if (same == recommendations.end()) {
      recommendations.emplace_back(a.name(), rec->second);
    } else {
      same->first += ", " + a.name();
    }
  }
  for (const auto& [names, text] : recommendations) out += "\n" + names + ": " + text + "\n";
  return out;
}

std::string FormatRunSummary(const v1::RunSummary& summary, double now) {
  const v1::RunInfo& info = summary.info();
  const RunOverview overview = BuildOverview(summary);
  std::ostringstream out;

  std::vector<std::vector<std::string>> head = {
      {"run", info.run_id()},
      {"state", StateName(info.state()) + ", world size " + std::to_string(info.world_size()) + ", " +
                    std::to_string(info.open_streams()) + " open stream(s)"},
  };
  std::string steps = FormatValue(static_cast<double>(info.step_count()));
  if (info.step_count() > 0) steps += " (" + FormatSteps(info.first_step(), info.last_step()) + ")";
  if (info.steps_per_second() > 0) steps += ", " + FormatValue(info.steps_per_second()) + " steps/s";
  head.push_back({"steps", steps});
  head.push_back({"last step at", FormatLocalTime(info.last_wall_time(), now)});
  if (info.ended_at() > 0) head.push_back({"ended at", FormatLocalTime(info.ended_at(), now)});
  head.push_back({"partial steps", FormatValue(static_cast<double>(info.partial_steps()))});
  head.push_back({"labels", JoinMap(info.labels())});

  const v1::RunConfig& c = summary.config();
  std::string config;
  auto add = [&config](const std::string& k, const std::string& v) {
    config += (config.empty() ? "" : ", ") + k + "=" + v;
  };
  if (c.hidden_size() != 0) add("hidden_size", std::to_string(c.hidden_size()));
  if (c.has_z_loss_coef()) add("z_loss_coef", FormatValue(c.z_loss_coef()));
  if (!c.optimizer().empty()) add("optimizer", c.optimizer());
  if (c.has_weight_decay()) add("weight_decay", FormatValue(c.weight_decay()));
  if (c.has_warmup_steps()) add("warmup_steps", std::to_string(c.warmup_steps()));
  if (c.has_total_steps()) add("total_steps", std::to_string(c.total_steps()));
  std::map<std::string, std::string> extra(c.extra().begin(), c.extra().end());
  for (const auto& [k, v] : extra) add(k, v);
  head.push_back({"config", config.empty() ? "-" : config});
  head.push_back(
      {"non-finite values",
       std::to_string(summary.nonfinite_count()) +
           (summary.nonfinite_count() > 0 ? " (last at step " + std::to_string(summary.last_nonfinite_step()) + ")"
                                          : "")});
  head.push_back({"client-dropped steps", std::to_string(summary.client_dropped_steps())});
  out << FormatTable(head);

  const std::string diagnosis = FormatDiagnosis(summary);
  if (!diagnosis.empty()) out << "\ndiagnosis\n" << Indent(diagnosis, "  ");

  out << "\nlatest values\n";
  if (overview.key_series.empty()) {
    out << "  -\n";
  } else {
    std::vector<std::vector<std::string>> rows = {{"SERIES", "VALUE", "STEP"}};
    for (const v1::LatestValue& v : overview.key_series) {
      rows.push_back({v.key(), FormatValue(v.value()), std::to_string(v.step())});
    }
    out << Indent(FormatTable(rows), "  ");
  }

  out << "\nparameters by grad norm (top " << overview.top_params.size() << " of " << overview.params_with_values
      << ")\n";
  if (overview.top_params.empty()) {
    out << "  -\n";
  } else {
    std::vector<std::vector<std::string>> rows = {{"PARAM", "KIND", "GRAD NORM", "PARAM NORM"}};
    for (const ParamLatest& p : overview.top_params) {
      rows.push_back(
          {p.name, std::string(ParamKindName(p.kind)), FormatOptional(p.grad_norm), FormatOptional(p.param_norm)});
    }
    out << Indent(FormatTable(rows), "  ");
  }

  out << "\ncatalog (" << summary.params_size() << " parameters)\n";
  if (summary.params().empty()) {
    out << "  -\n";
  } else {
    std::vector<std::vector<std::string>> rows = {{"NAME", "KIND", "NUMEL", "WD", "ROLE"}};
    for (const v1::ParamInfo& p : summary.params()) {
      rows.push_back({p.name(), std::string(ParamKindName(p.kind())), std::to_string(p.numel()),
                      FormatValue(p.weight_decay()), p.role().empty() ? "-" : p.role()});
    }
    out << Indent(FormatTable(rows), "  ");
  }

  // The daemon lists the latest events (GetRunRequest.max_events) and counts them all.
  const uint64_t event_count = std::max<uint64_t>(summary.event_count(), summary.events_size());
  out << "\nevents (" << event_count;
  if (event_count > static_cast<uint64_t>(summary.events_size()))
    out << ", the latest " << summary.events_size() << " shown";
  out << ")\n";
  if (summary.events().empty()) {
    out << "  -\n";
  } else {
    std::vector<std::vector<std::string>> rows = {{"STEP", "SOURCE", "TEXT"}};
    for (const v1::EventInfo& e : summary.events()) {
      rows.push_back({std::to_string(e.step()), e.source().empty() ? "-" : e.source(), e.text()});
    }
    out << Indent(FormatTable(rows), "  ");
  }
  return out.str();
}

json RunSummaryToJson(const v1::RunSummary& summary) {
  json out = ProtoToJson(summary);
  const RunOverview overview = BuildOverview(summary);
  json key_series = json::array();
  for (const v1::LatestValue& v : overview.key_series) key_series.push_back(ProtoToJson(v));
  json top = json::array();
  for (const ParamLatest& p : overview.top_params) {
    json entry = {{"name", p.name}, {"kind", std::string(ParamKindName(p.kind))}};
    entry["grad_norm"] = p.grad_norm ? JsonValue(*p.grad_norm) : json(nullptr);
    entry["param_norm"] = p.param_norm ? JsonValue(*p.param_norm) : json(nullptr);
    entry["update_norm"] = p.update_norm ? JsonValue(*p.update_norm) : json(nullptr);
    top.push_back(std::move(entry));
  }
  out["overview"] = {{"key_series", std::move(key_series)},
                     {"top_params", std::move(top)},
                     {"params_with_values", overview.params_with_values}};
  return out;
}

std::string FormatSeries(const v1::GetSeriesResponse& series) {
  if (series.points().empty()) return "no points in this range\n";
  std::vector<std::vector<std::string>> rows = {{"STEP", "VALUE", "MIN", "MAX", "STEPS"}};
  for (const v1::SeriesPoint& p : series.points()) {
    rows.push_back({std::to_string(p.step()), FormatValue(p.value()), FormatValue(p.min()), FormatValue(p.max()),
                    std::to_string(p.count())});
  }
  return FormatTable(rows);
}

json SeriesToJson(const v1::GetSeriesResponse& series) {
  json out = json::array();
  for (const v1::SeriesPoint& p : series.points()) out.push_back(ProtoToJson(p));
  return out;
}

}  // namespace gradwatch::cli

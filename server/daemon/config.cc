#include "server/daemon/config.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "alerts/notify/http_client.h"
#include "alerts/yaml_checks.h"
#include "server/analytics/regression.h"
#include "server/core/file_text.h"
#include "server/core/suggest.h"
#include "server/daemon/alerting.h"
#include "server/daemon/tls.h"
#include "server/ingest/authorizer.h"

namespace gradwatch::daemon {

namespace {

std::string Where(const std::string& source, const YAML::Node& node, const std::string& key) {
  const YAML::Mark mark = node.Mark();
  std::string where = source;
  if (mark.line >= 0) {
    where += ':';
    where += std::to_string(mark.line + 1);
  }
  where += ": ";
  where += key;
  return where;
}

// 4096, 0.001, 1e+30: whole numbers in full below 10^16.
std::string FormatNumber(double v) {
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e16) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%g", v);
  }
  return buf;
}

const SettingRange* RangeOf(const std::string& key) {
  for (const auto& [name, range] : SettingRanges()) {
    if (name == key) return &range;
  }
  return nullptr;
}

// A number read for `key` outside its documented range (SettingRanges) is an error naming
// source:line (yaml-cpp itself refuses a negative number for an unsigned setting).
template <typename T>
Status CheckNumber(const YAML::Node& node, const std::string& source, const std::string& key, T value) {
  const SettingRange* range = RangeOf(key);
  if (range == nullptr || range->Admits(static_cast<double>(value))) return Status::Ok();
  return Status::InvalidArgument(Where(source, node, key) + ": " + node.Scalar() + " is out of range: must be " +
                                 range->Text());
}

template <typename T>
struct IsNumberList : std::false_type {};
template <typename T>
struct IsNumberList<std::vector<T>> : std::is_arithmetic<T> {};

// Reads one scalar (or a list of them) into *out, with a message naming source:line and key on
// failure; a number outside its setting's range is a failure.
template <typename T>
Status Read(const YAML::Node& node, const std::string& source, const std::string& key, T* out) {
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return Status::InvalidArgument(Where(source, node, key) + ": cannot read '" +
                                   (node.IsScalar() ? node.Scalar() : std::string("(not a scalar)")) +
                                   "' as the expected type");
  }
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    return CheckNumber(node, source, key, *out);
  } else if constexpr (IsNumberList<T>::value) {
    for (size_t i = 0; i < out->size(); ++i) {
      if (Status s = CheckNumber(node[i], source, key, (*out)[i]); !s.ok()) return s;
    }
  }
  return Status::Ok();
}

// A mapping key as text. A key that is not a scalar (`? [a, b]: c`, `{[x]: 1}`) is an error:
// yaml-cpp would throw converting it.
Status ReadKey(const YAML::Node& node, const std::string& source, const std::string& parent, std::string* out) {
  if (!node.IsScalar()) {
    return Status::InvalidArgument(Where(source, node, parent.empty() ? "top level" : parent) +
                                   ": a key must be a plain name, not a list or a mapping");
  }
  *out = node.Scalar();
  return Status::Ok();
}

using Setter = std::function<Status(const YAML::Node&, const std::string&, const std::string&, Config*)>;

template <typename T>
Setter Field(T Config::*member) {
  return [member](const YAML::Node& n, const std::string& src, const std::string& key, Config* c) {
    return Read(n, src, key, &(c->*member));
  };
}

// forecasts: [{series: grad/norm/total, threshold: 5.0}, ...]
Status ReadForecasts(const YAML::Node& node, const std::string& source, const std::string& key, Config* c) {
  if (!node.IsSequence()) return Status::InvalidArgument(Where(source, node, key) + ": must be a list");
  std::vector<std::pair<std::string, double>> forecasts;
  for (const auto& item : node) {
    if (!item.IsMap() || !item["series"] || !item["threshold"]) {
      return Status::InvalidArgument(Where(source, item, key) + ": each entry needs series and threshold");
    }
    std::string series;
    double threshold = 0;
    if (Status s = Read(item["series"], source, key + ".series", &series); !s.ok()) return s;
    if (Status s = Read(item["threshold"], source, key + ".threshold", &threshold); !s.ok()) return s;
    forecasts.emplace_back(series, threshold);
  }
  c->forecasts = std::move(forecasts);
  return Status::Ok();
}

// receivers: [{type: alertmanager, name: am, url: http://127.0.0.1:9093, resend_interval_seconds: 60}, ...]
Status ReadReceivers(const YAML::Node& node, const std::string& source, const std::string& key, Config* c) {
  if (!node.IsSequence()) return Status::InvalidArgument(Where(source, node, key) + ": must be a list");
  std::vector<Config::Receiver> receivers;
  for (const auto& item : node) {
    if (!item.IsMap()) return Status::InvalidArgument(Where(source, item, key) + ": each receiver is a mapping");
    Config::Receiver r;
    for (const auto& kv : item) {
      std::string k;
      if (Status s = ReadKey(kv.first, source, key, &k); !s.ok()) return s;
      const std::string full = key + "[]." + k;
      Status s;
      if (k == "type")
        s = Read(kv.second, source, full, &r.type);
      else if (k == "name")
        s = Read(kv.second, source, full, &r.name);
      else if (k == "url")
        s = Read(kv.second, source, full, &r.url);
      else if (k == "routing_key")
        s = Read(kv.second, source, full, &r.routing_key);
      else if (k == "bearer_token")
        s = Read(kv.second, source, full, &r.bearer_token);
      else if (k == "resend_interval_seconds")
        s = Read(kv.second, source, full, &r.resend_interval_seconds);
      else
        s = Status::InvalidArgument(Where(source, kv.first, full) + ": unknown key");
      if (!s.ok()) return s;
    }
    if (r.type != "alertmanager" && r.type != "webhook" && r.type != "pagerduty" && r.type != "slack") {
      return Status::InvalidArgument(Where(source, item, key) +
                                     ": type must be alertmanager, webhook, pagerduty or slack");
    }
    if (r.url.empty() && r.type != "pagerduty") {
      return Status::InvalidArgument(Where(source, item, key) + ": url is required");
    }
    if (r.type == "pagerduty" && r.routing_key.empty()) {
      return Status::InvalidArgument(Where(source, item, key) + ": routing_key is required for pagerduty");
    }
    if (r.name.empty()) r.name = r.type + "-" + std::to_string(receivers.size());
    receivers.push_back(std::move(r));
  }
  c->receivers = std::move(receivers);
  return Status::Ok();
}

// remote_write: [{url: http://127.0.0.1:9090/api/v1/write, name: tsdb, series: [grad/norm/total],
//                 queue_config: {max_samples_per_send: 2000, capacity: 1000000},
//                 remote_timeout_seconds: 30, bearer_token: ...}, ...]
Status ReadRemoteWrite(const YAML::Node& node, const std::string& source, const std::string& key, Config* c) {
  if (!node.IsSequence()) return Status::InvalidArgument(Where(source, node, key) + ": must be a list");
  std::vector<Config::RemoteWrite> out;
  for (const auto& item : node) {
    if (!item.IsMap()) return Status::InvalidArgument(Where(source, item, key) + ": each receiver is a mapping");
    Config::RemoteWrite r;
    for (const auto& kv : item) {
      std::string k;
      if (Status s = ReadKey(kv.first, source, key, &k); !s.ok()) return s;
      const std::string full = key + "[]." + k;
      Status s;
      if (k == "url")
        s = Read(kv.second, source, full, &r.url);
      else if (k == "name")
        s = Read(kv.second, source, full, &r.name);
      else if (k == "series")
        s = Read(kv.second, source, full, &r.series);
      else if (k == "remote_timeout_seconds")
        s = Read(kv.second, source, full, &r.remote_timeout_seconds);
      else if (k == "bearer_token")
        s = Read(kv.second, source, full, &r.bearer_token);
      else if (k == "queue_config") {
        if (!kv.second.IsMap()) return Status::InvalidArgument(Where(source, kv.second, full) + ": must be a mapping");
        for (const auto& q : kv.second) {
          std::string qk;
          if (Status qs = ReadKey(q.first, source, full, &qk); !qs.ok()) return qs;
          const std::string qfull = full + "." + qk;  // remote_write[].queue_config.capacity
          if (qk == "max_samples_per_send")
            s = Read(q.second, source, qfull, &r.max_samples_per_send);
          else if (qk == "capacity")
            s = Read(q.second, source, qfull, &r.capacity);
          else
            s = Status::InvalidArgument(Where(source, q.first, qfull) + ": unknown key");
          if (!s.ok()) return s;
        }
      } else {
        s = Status::InvalidArgument(Where(source, kv.first, full) + ": unknown key");
      }
      if (!s.ok()) return s;
    }
    if (r.url.empty()) return Status::InvalidArgument(Where(source, item, key) + ": url is required");
    if (r.name.empty()) r.name = "remote-write-" + std::to_string(out.size());
    out.push_back(std::move(r));
  }
  c->remote_write = std::move(out);
  return Status::Ok();
}

const std::map<std::string, std::map<std::string, Setter>>& Schema() {
  static const auto* kSchema = new std::map<std::string, std::map<std::string, Setter>>{
      {"",
       {{"listen", Field(&Config::listen)},
        {"metrics_listen", Field(&Config::metrics_listen)},
        {"data_dir", Field(&Config::data_dir)},
        {"remote_write", ReadRemoteWrite}}},
      {"log", {{"format", Field(&Config::log_format)}, {"level", Field(&Config::log_level)}}},
      {"security",
       {{"tls_cert_file", Field(&Config::tls_cert_file)},
        {"tls_key_file", Field(&Config::tls_key_file)},
        {"tls_client_ca_file", Field(&Config::tls_client_ca_file)},
        {"tokens_file", Field(&Config::tokens_file)},
        {"metrics_require_token", Field(&Config::metrics_require_token)},
        {"http_tls", Field(&Config::http_tls)},
        {"http_client_ca_file", Field(&Config::http_client_ca_file)},
        {"allow_insecure", Field(&Config::allow_insecure)},
        {"max_silence_seconds", Field(&Config::max_silence_seconds)}}},
      {"http",
       {{"max_connections", Field(&Config::http_max_connections)},
        {"max_connections_per_peer", Field(&Config::http_max_connections_per_peer)},
        {"header_timeout_seconds", Field(&Config::http_header_timeout_seconds)},
        {"idle_timeout_seconds", Field(&Config::http_idle_timeout_seconds)}}},
      {"metrics",
       {{"params", Field(&Config::metrics_params)},
        {"slope_series", Field(&Config::metrics_slope_series)},
        {"max_series_per_run", Field(&Config::metrics_max_series_per_run)}}},
      {"limits",
       {{"max_message_bytes", Field(&Config::max_message_bytes)},
        {"max_runs", Field(&Config::max_runs)},
        {"max_params_per_run", Field(&Config::max_params_per_run)},
        {"max_series_per_run", Field(&Config::max_series_per_run)},
        {"max_events_per_run", Field(&Config::max_events_per_run)},
        {"max_streams", Field(&Config::max_streams)},
        {"max_streams_per_identity", Field(&Config::max_streams_per_identity)},
        {"hello_timeout_seconds", Field(&Config::hello_timeout_seconds)},
        {"memory_budget_bytes", Field(&Config::memory_budget_bytes)}}},
      {"assembly", {{"timeout_seconds", Field(&Config::assembly_timeout_seconds)}}},
      {"store",
       {{"recent_points", Field(&Config::recent_points)},
        {"history_buckets", Field(&Config::history_buckets)},
        {"param_recent_points", Field(&Config::param_recent_points)},
        {"param_history_buckets", Field(&Config::param_history_buckets)}}},
      {"journal",
       {{"batch_max", Field(&Config::journal_batch_max)},
        {"max_delay_ms", Field(&Config::journal_max_delay_ms)},
        {"block_steps", Field(&Config::journal_block_steps)},
        {"snapshot_interval_seconds", Field(&Config::journal_snapshot_interval_seconds)}}},
      {"runs",
       {{"end_after_seconds", Field(&Config::run_end_after_seconds)},
        {"stalled_after_seconds", Field(&Config::run_stalled_after_seconds)},
        {"retention_seconds", Field(&Config::run_retention_seconds)}}},
      {"retention",
       {{"journal_days", Field(&Config::journal_retention_days)},
        {"outbox_days", Field(&Config::outbox_retention_days)}}},
      {"analytics",
       {{"windows", Field(&Config::slope_windows)},
        {"max_buckets", Field(&Config::slope_max_buckets)},
        {"param_max_buckets", Field(&Config::slope_param_max_buckets)},
        {"event_window_steps", Field(&Config::event_window_steps)},
        {"forecast_window_steps", Field(&Config::forecast_window_steps)},
        {"projection_steps", Field(&Config::projection_steps)},
        {"forecasts", ReadForecasts},
        {"change_point_window_steps", Field(&Config::change_point_window_steps)}}},
      {"alerts",
       {{"default_rules", Field(&Config::default_rules)},
        {"rule_files", Field(&Config::rule_files)},
        {"receivers", ReadReceivers},
        {"external_url", Field(&Config::external_url)},
        {"min_steps_before_page", Field(&Config::min_steps_before_page)},
        // Read from the whole text after the schema pass (alerts::ReadAlertsSection), which keeps
        // each override's line for its errors.
        {"overrides",
         [](const YAML::Node&, const std::string&, const std::string&, Config*) { return Status::Ok(); }}}},
  };
  return *kSchema;
}

// " (did you mean 'retention.journal_days'?)" when a known key is close to `key`, else "".
std::string Suggestion(const std::string& key, const std::vector<std::string>& known) {
  const std::optional<std::string> closest = Closest(key, known);
  return closest ? " (did you mean '" + *closest + "'?)" : "";
}

bool ValidAddress(const std::string& addr) {
  const auto colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 >= addr.size()) return false;
  const std::string port = addr.substr(colon + 1);
  if (port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5) return false;
  return std::stoi(port) <= 65535;
}

}  // namespace

std::string SettingRange::Text() const {
  return "between " + FormatNumber(lo) + " and " + FormatNumber(hi) + (zero_is_off ? ", or 0 (off)" : "");
}

const std::vector<std::pair<std::string, SettingRange>>& SettingRanges() {
  constexpr double kDay = 86400;
  constexpr double kTenYears = 3650 * kDay;
  // A window's buckets keep 32 bits of their first step (analytics::PackedSums).
  constexpr double kMaxWindow = static_cast<double>(analytics::WindowedSlope::kMaxWindowSteps);
  static const auto* kRanges = new std::vector<std::pair<std::string, SettingRange>>{
      {"security.max_silence_seconds", {1, kTenYears, false, [](const Config& c) { return c.max_silence_seconds; }}},
      {"http.max_connections",
       {1, 65536, false, [](const Config& c) { return static_cast<double>(c.http_max_connections); }}},
      {"http.max_connections_per_peer",
       {1, 65536, false, [](const Config& c) { return static_cast<double>(c.http_max_connections_per_peer); }}},
      {"http.header_timeout_seconds",
       {0.1, 3600, false, [](const Config& c) { return c.http_header_timeout_seconds; }}},
      {"http.idle_timeout_seconds", {0.1, 86400, false, [](const Config& c) { return c.http_idle_timeout_seconds; }}},
      {"metrics.max_series_per_run",
       {0, 1 << 30, false, [](const Config& c) { return static_cast<double>(c.metrics_max_series_per_run); }}},
      {"limits.max_message_bytes",
       {1024, 256 << 20, false, [](const Config& c) { return static_cast<double>(c.max_message_bytes); }}},
      {"limits.max_runs", {1, 65536, false, [](const Config& c) { return static_cast<double>(c.max_runs); }}},
      {"limits.max_params_per_run",
       {1, 1 << 20, false, [](const Config& c) { return static_cast<double>(c.max_params_per_run); }}},
      {"limits.max_series_per_run",
       {8, 1 << 24, false, [](const Config& c) { return static_cast<double>(c.max_series_per_run); }}},
      {"limits.max_events_per_run",
       {1, 1000000, false, [](const Config& c) { return static_cast<double>(c.max_events_per_run); }}},
      {"limits.max_streams", {1, 1 << 20, false, [](const Config& c) { return static_cast<double>(c.max_streams); }}},
      {"limits.max_streams_per_identity",
       {1, 1 << 20, false, [](const Config& c) { return static_cast<double>(c.max_streams_per_identity); }}},
      {"limits.hello_timeout_seconds", {0.1, 3600, false, [](const Config& c) { return c.hello_timeout_seconds; }}},
      {"limits.memory_budget_bytes",
       {1 << 20, 1125899906842624.0, true,
        [](const Config& c) { return static_cast<double>(c.memory_budget_bytes); }}},  // 1 MiB .. 1 PiB
      {"assembly.timeout_seconds", {0.001, kDay, false, [](const Config& c) { return c.assembly_timeout_seconds; }}},
      {"store.recent_points",
       {2, 1 << 24, false, [](const Config& c) { return static_cast<double>(c.recent_points); }}},
      {"store.history_buckets",
       {2, 1 << 24, false, [](const Config& c) { return static_cast<double>(c.history_buckets); }}},
      {"store.param_recent_points",
       {2, 1 << 24, false, [](const Config& c) { return static_cast<double>(c.param_recent_points); }}},
      {"store.param_history_buckets",
       {2, 1 << 24, false, [](const Config& c) { return static_cast<double>(c.param_history_buckets); }}},
      {"journal.batch_max",
       {1, 1 << 20, false, [](const Config& c) { return static_cast<double>(c.journal_batch_max); }}},
      {"journal.max_delay_ms",
       {0, 10000, false, [](const Config& c) { return static_cast<double>(c.journal_max_delay_ms); }}},
      {"journal.block_steps",
       {1, 4096, false, [](const Config& c) { return static_cast<double>(c.journal_block_steps); }}},
      {"journal.snapshot_interval_seconds",
       {0.1, kDay, true, [](const Config& c) { return c.journal_snapshot_interval_seconds; }}},
      {"runs.end_after_seconds", {0.1, kTenYears, false, [](const Config& c) { return c.run_end_after_seconds; }}},
      {"runs.stalled_after_seconds",
       {0.1, kTenYears, false, [](const Config& c) { return c.run_stalled_after_seconds; }}},
      {"runs.retention_seconds", {0, kTenYears, false, [](const Config& c) { return c.run_retention_seconds; }}},
      {"retention.journal_days", {0, 3650, false, [](const Config& c) { return c.journal_retention_days; }}},
      {"retention.outbox_days", {0.0001, 3650, false, [](const Config& c) { return c.outbox_retention_days; }}},
      {"analytics.windows", {2, kMaxWindow}},
      {"analytics.max_buckets",
       {2, 65536, false, [](const Config& c) { return static_cast<double>(c.slope_max_buckets); }}},
      {"analytics.param_max_buckets",
       {2, 65536, false, [](const Config& c) { return static_cast<double>(c.slope_param_max_buckets); }}},
      {"analytics.event_window_steps",
       {2, kMaxWindow, false, [](const Config& c) { return static_cast<double>(c.event_window_steps); }}},
      {"analytics.forecast_window_steps",
       {2, kMaxWindow, false, [](const Config& c) { return static_cast<double>(c.forecast_window_steps); }}},
      {"analytics.projection_steps",
       {1, 200000, false,
        [](const Config& c) {
          return static_cast<double>(c.projection_steps);
        }}},  // iterated a step at a time when advice renders
      {"analytics.change_point_window_steps",
       {10, kMaxWindow, false, [](const Config& c) { return static_cast<double>(c.change_point_window_steps); }}},
      {"alerts.min_steps_before_page",
       {0, 1e15, false, [](const Config& c) { return static_cast<double>(c.min_steps_before_page); }}},
      {"alerts.receivers[].resend_interval_seconds", {0.1, kDay}},
      {"remote_write[].remote_timeout_seconds", {0.1, 3600}},
      {"remote_write[].queue_config.max_samples_per_send", {1, 1000000}},
      {"remote_write[].queue_config.capacity", {1, 1e9}},
  };
  return *kRanges;
}

StatusOr<Config> ParseConfig(const std::string& yaml, const std::string& source, Config base) {
  if (Status s = alerts::CheckAliasExpansion(yaml, source); !s.ok()) return s;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    return Status::InvalidArgument(source + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  if (root.IsNull()) return base;
  if (!root.IsMap()) return Status::InvalidArgument(source + ": the top level must be a mapping");
  if (Status s = alerts::CheckNoDuplicateKeys(yaml, source); !s.ok()) return s;
  const auto& schema = Schema();
  const auto& top = schema.at("");
  for (const auto& kv : root) {
    std::string key;
    if (Status s = ReadKey(kv.first, source, "", &key); !s.ok()) return s;
    if (auto it = top.find(key); it != top.end()) {
      if (Status s = it->second(kv.second, source, key, &base); !s.ok()) return s;
      continue;
    }
    auto section = schema.find(key);
    if (section == schema.end() || key.empty()) {
      std::vector<std::string> known;
      for (const auto& [name, fields] : schema) {
        if (!name.empty()) known.push_back(name);
      }
      for (const auto& [name, read] : top) known.push_back(name);
      return Status::InvalidArgument(Where(source, kv.first, key) + ": unknown key" + Suggestion(key, known));
    }
    if (kv.second.IsNull()) continue;
    if (!kv.second.IsMap()) {
      return Status::InvalidArgument(Where(source, kv.second, key) + ": must be a mapping");
    }
    for (const auto& sub : kv.second) {
      std::string subkey;
      if (Status s = ReadKey(sub.first, source, key, &subkey); !s.ok()) return s;
      const std::string full = key + "." + subkey;
      auto field = section->second.find(subkey);
      if (field == section->second.end()) {
        std::vector<std::string> known;
        for (const auto& [name, read] : section->second) known.push_back(key + "." + name);
        return Status::InvalidArgument(Where(source, sub.first, full) + ": unknown key" + Suggestion(full, known));
      }
      if (Status s = field->second(sub.second, source, full, &base); !s.ok()) return s;
    }
  }
  if (root["alerts"] && root["alerts"].IsMap() && root["alerts"]["overrides"]) {
    auto section = alerts::ReadAlertsSection(yaml, source);
    if (!section.ok()) return section.status();
    base.alert_overrides = std::move(section->overrides);
  }
  return base;
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  auto text = ReadRegularFile("config file", path);
  if (!text.ok()) return Status::NotFound("cannot read " + text.status().message());
  return ParseConfig(*text, path);
}

bool IsLoopbackAddress(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1") return true;
  unsigned a = 0, b = 0, c = 0, d = 0;
  char rest = 0;
  return std::sscanf(host.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &rest) == 4 && a == 127 && b < 256 && c < 256 &&
         d < 256;
}

bool InsecureListener(const Config& c) {
  const bool authenticated = !c.tls_cert_file.empty() && (!c.tls_client_ca_file.empty() || !c.tokens_file.empty());
  return !IsLoopbackAddress(c.listen) && !authenticated;
}

bool HttpTls(const Config& c) { return c.http_tls && !c.tls_cert_file.empty(); }

std::string ExternalUrl(const Config& c) {
  if (!c.external_url.empty()) return c.external_url;
  const size_t colon = c.metrics_listen.rfind(':');
  std::string host = c.metrics_listen.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : c.metrics_listen.substr(colon);
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]") {
    char name[256] = {0};
    host = ::gethostname(name, sizeof name - 1) == 0 && name[0] != '\0' ? name : "localhost";
  }
  return std::string(HttpTls(c) ? "https://" : "http://") + host + port;
}

bool InsecureHttpListener(const Config& c) { return !IsLoopbackAddress(c.metrics_listen) && !HttpTls(c); }

Status ValidateConfig(const Config& c) {
  auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  if (!ValidAddress(c.listen)) return bad("listen: '" + c.listen + "' is not HOST:PORT");
  if (!ValidAddress(c.metrics_listen)) return bad("metrics_listen: '" + c.metrics_listen + "' is not HOST:PORT");
  if (c.data_dir.empty()) return bad("data_dir: must not be empty");
  if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
    return bad(c.tls_cert_file.empty() ? "security.tls_key_file: needs security.tls_cert_file"
                                       : "security.tls_cert_file: needs security.tls_key_file");
  }
  if (!c.tls_client_ca_file.empty() && c.tls_cert_file.empty()) {
    return bad(
        "security.tls_client_ca_file: client certificates need TLS: set security.tls_cert_file and tls_key_file");
  }
  if (InsecureListener(c) && !c.allow_insecure) {
    return bad("listen: " + c.listen +
               " is not loopback: any host that reaches the port could stream steps into runs, silence alerts and "
               "reload rules. Serve TLS (security.tls_cert_file and tls_key_file) with client certificates "
               "(tls_client_ca_file) or tokens (tokens_file), or accept the risk with --insecure "
               "(security.allow_insecure: true)");
  }
  if (!c.http_client_ca_file.empty() && !HttpTls(c)) {
    return bad(
        "security.http_client_ca_file: client certificates need TLS on the HTTP listener: set "
        "security.tls_cert_file and tls_key_file, and leave http_tls true");
  }
  if (InsecureHttpListener(c) && !c.allow_insecure) {
    return bad("metrics_listen: " + c.metrics_listen +
               " is not loopback: /metrics, with what it shows of every run (and any token a scraper sends), would "
               "cross the network in clear. Serve HTTPS (security.tls_cert_file and tls_key_file, with http_tls "
               "true), or accept the risk with --insecure (security.allow_insecure: true)");
  }
  if (c.metrics_require_token && c.tokens_file.empty()) {
    return bad("security.metrics_require_token: needs security.tokens_file (the tokens /metrics accepts)");
  }
  if (c.log_format != "text" && c.log_format != "json") return bad("log.format: must be text or json");
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  bool level_ok = false;
  for (const char* l : kLevels) level_ok = level_ok || c.log_level == l;
  if (!level_ok) return bad("log.level: must be one of trace, debug, info, warn, error, critical, off");
  for (const auto& [key, range] : SettingRanges()) {
    if (range.of == nullptr) continue;
    if (const double value = range.of(c); !range.Admits(value)) {
      return bad(key + ": " + FormatNumber(value) + " is out of range: must be " + range.Text());
    }
  }
  if (c.journal_retention_days > 0 && c.journal_retention_days * 86400 < c.run_retention_seconds) {
    return bad("retention.journal_days: must cover runs.retention_seconds (a run in memory stays in the journal)");
  }
  if (c.slope_windows.empty() || c.slope_windows.size() > 8) {
    return bad("analytics.windows: give 1 to 8 windows (steps)");
  }
  for (uint64_t w : c.slope_windows) {
    if (!RangeOf("analytics.windows")->Admits(static_cast<double>(w))) {
      return bad("analytics.windows: " + std::to_string(w) + " is out of range: every window must be " +
                 RangeOf("analytics.windows")->Text() + " steps");
    }
  }
  for (const auto& [series, threshold] : c.forecasts) {
    if (series.empty() || !std::isfinite(threshold)) {
      return bad("analytics.forecasts: every entry needs a series key and a finite threshold");
    }
  }
  for (const Config::Receiver& r : c.receivers) {
    if (r.url.empty()) continue;
    if (auto url = notify::ParseUrl(r.url); !url.ok()) {
      return bad("alerts.receivers: receiver '" + r.name + "': url '" + r.url + "': " + url.status().message());
    }
  }
  for (const std::string& pattern : c.metrics_params) {
    if (pattern.empty()) return bad("metrics.params: an empty pattern matches nothing");
  }
  for (const std::string& pattern : c.metrics_slope_series) {
    if (pattern.empty()) return bad("metrics.slope_series: an empty pattern matches nothing");
  }
  std::set<std::string> remote_names;
  for (const Config::RemoteWrite& r : c.remote_write) {
    const std::string where = "remote_write: receiver '" + r.name + "': ";
    if (auto url = notify::ParseUrl(r.url); !url.ok())
      return bad(where + "url '" + r.url + "': " + url.status().message());
    if (!remote_names.insert(r.name).second) return bad(where + "two receivers have this name");
    if (r.max_samples_per_send < 1) return bad(where + "queue_config.max_samples_per_send: must be at least 1");
    if (r.capacity < r.max_samples_per_send) {
      return bad(where + "queue_config.capacity: must be at least max_samples_per_send");
    }
    if (!(r.remote_timeout_seconds > 0) || !std::isfinite(r.remote_timeout_seconds)) {
      return bad(where + "remote_timeout_seconds: must be > 0");
    }
    for (const std::string& pattern : r.series) {
      if (pattern.empty()) return bad(where + "series: an empty pattern matches nothing");
    }
  }
  if (!c.external_url.empty()) {
    if (auto url = notify::ParseUrl(c.external_url); !url.ok()) {
      return bad("alerts.external_url: '" + c.external_url + "': " + url.status().message());
    }
  }
  return Status::Ok();
}

Status CheckConfigFiles(const Config& c) {
  auto rules = LoadConfiguredRules(c.default_rules, c.rule_files, c.run_stalled_after_seconds, c.alert_overrides);
  if (!rules.ok()) return Status::InvalidArgument("alerts: " + rules.status().message());
  if (auto tls = CheckTlsFiles({c.tls_cert_file, c.tls_key_file, c.tls_client_ca_file}); !tls.ok()) {
    return tls.status();
  }
  if (!c.http_client_ca_file.empty()) {
    if (auto ca = CheckCaFile("security.http_client_ca_file", c.http_client_ca_file); !ca.ok()) return ca.status();
  }
  if (!c.tokens_file.empty()) {
    if (auto policy = ingest::LoadPolicy(c.tokens_file); !policy.ok()) return policy.status();
  }
  return Status::Ok();
}

}  // namespace gradwatch::daemon

namespace gradwatch::daemon {

namespace {

// A YAML node as JSON, for --check-config's view of the overrides: mappings and lists as they
// are, a scalar as a number or a bool when it reads as one (YAML's own reading), else as text.
nlohmann::json YamlToJson(const YAML::Node& node) {
  if (node.IsMap()) {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& kv : node) out[kv.first.Scalar()] = YamlToJson(kv.second);
    return out;
  }
  if (node.IsSequence()) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& item : node) out.push_back(YamlToJson(item));
    return out;
  }
  if (!node.IsScalar()) return nullptr;
  const std::string& text = node.Scalar();
  if (node.Tag() != "!") {  // unquoted: YAML may read it as a number or a bool
    double number = 0;
    bool flag = false;
    if (YAML::convert<double>::decode(node, number)) return number;
    if (YAML::convert<bool>::decode(node, flag)) return flag;
  }
  return text;
}

nlohmann::json Secret(const std::string& value) {
  return value.empty() ? nlohmann::json("") : nlohmann::json("<secret>");
}

}  // namespace

std::string ConfigJson(const Config& c) {
  nlohmann::json forecasts = nlohmann::json::array();
  for (const auto& [series, threshold] : c.forecasts)
    forecasts.push_back({{"series", series}, {"threshold", threshold}});
  nlohmann::json receivers = nlohmann::json::array();
  for (const Config::Receiver& r : c.receivers) {
    receivers.push_back({{"type", r.type},
                         {"name", r.name},
                         {"url", r.url},
                         {"routing_key", Secret(r.routing_key)},
                         {"bearer_token", Secret(r.bearer_token)},
                         {"resend_interval_seconds", r.resend_interval_seconds}});
  }
  nlohmann::json overrides = nlohmann::json::object();
  for (const alerts::RuleOverride& o : c.alert_overrides) {
    try {
      overrides[o.rule] = YamlToJson(YAML::Load(o.yaml));
    } catch (const YAML::Exception&) {
      overrides[o.rule] = o.yaml;  // read once already: not expected
    }
  }
  nlohmann::json remote_write = nlohmann::json::array();
  for (const Config::RemoteWrite& r : c.remote_write) {
    remote_write.push_back(
        {{"name", r.name},
         {"url", r.url},
         {"series", r.series},
         {"queue_config", {{"max_samples_per_send", r.max_samples_per_send}, {"capacity", r.capacity}}},
         {"remote_timeout_seconds", r.remote_timeout_seconds},
         {"bearer_token", Secret(r.bearer_token)}});
  }
  const nlohmann::json shown = {
      {"listen", c.listen},
      {"metrics_listen", c.metrics_listen},
      {"data_dir", c.data_dir},
      {"remote_write", remote_write},
      {"log", {{"format", c.log_format}, {"level", c.log_level}}},
      {"security",
       {{"tls_cert_file", c.tls_cert_file},
        {"tls_key_file", c.tls_key_file},
        {"tls_client_ca_file", c.tls_client_ca_file},
        {"tokens_file", c.tokens_file},
        {"metrics_require_token", c.metrics_require_token},
        {"http_tls", c.http_tls},
        {"http_client_ca_file", c.http_client_ca_file},
        {"allow_insecure", c.allow_insecure},
        {"max_silence_seconds", c.max_silence_seconds}}},
      {"http",
       {{"max_connections", c.http_max_connections},
        {"max_connections_per_peer", c.http_max_connections_per_peer},
        {"header_timeout_seconds", c.http_header_timeout_seconds},
        {"idle_timeout_seconds", c.http_idle_timeout_seconds}}},
      {"metrics",
       {{"params", c.metrics_params},
        {"slope_series", c.metrics_slope_series},
        {"max_series_per_run", c.metrics_max_series_per_run}}},
      {"limits",
       {{"max_message_bytes", c.max_message_bytes},
        {"max_runs", c.max_runs},
        {"max_params_per_run", c.max_params_per_run},
        {"max_series_per_run", c.max_series_per_run},
        {"max_events_per_run", c.max_events_per_run},
        {"max_streams", c.max_streams},
        {"max_streams_per_identity", c.max_streams_per_identity},
        {"hello_timeout_seconds", c.hello_timeout_seconds},
        {"memory_budget_bytes", c.memory_budget_bytes}}},
      {"assembly", {{"timeout_seconds", c.assembly_timeout_seconds}}},
      {"store",
       {{"recent_points", c.recent_points},
        {"history_buckets", c.history_buckets},
        {"param_recent_points", c.param_recent_points},
        {"param_history_buckets", c.param_history_buckets}}},
      {"journal",
       {{"batch_max", c.journal_batch_max},
        {"max_delay_ms", c.journal_max_delay_ms},
        {"block_steps", c.journal_block_steps},
        {"snapshot_interval_seconds", c.journal_snapshot_interval_seconds}}},
      {"runs",
       {{"end_after_seconds", c.run_end_after_seconds},
        {"stalled_after_seconds", c.run_stalled_after_seconds},
        {"retention_seconds", c.run_retention_seconds}}},
      {"retention", {{"journal_days", c.journal_retention_days}, {"outbox_days", c.outbox_retention_days}}},
      {"analytics",
       {{"windows", c.slope_windows},
        {"max_buckets", c.slope_max_buckets},
        {"param_max_buckets", c.slope_param_max_buckets},
        {"event_window_steps", c.event_window_steps},
        {"forecast_window_steps", c.forecast_window_steps},
        {"projection_steps", c.projection_steps},
        {"forecasts", forecasts},
        {"change_point_window_steps", c.change_point_window_steps}}},
      {"alerts",
       {{"default_rules", c.default_rules},
        {"rule_files", c.rule_files},
        {"receivers", receivers},
        {"external_url", ExternalUrl(c)},
        {"min_steps_before_page", c.min_steps_before_page},
        {"overrides", overrides}}},
  };
  return shown.dump(2);
}

std::vector<std::string> ConfigKeys() {
  std::vector<std::string> keys;
  for (const auto& [section, fields] : Schema()) {
    for (const auto& [field, setter] : fields) keys.push_back(section.empty() ? field : section + "." + field);
  }
  // The entries of the lists of mappings.
  for (const char* k : {"analytics.forecasts[].series", "analytics.forecasts[].threshold", "alerts.receivers[].type",
                        "alerts.receivers[].name", "alerts.receivers[].url", "alerts.receivers[].routing_key",
                        "alerts.receivers[].bearer_token", "alerts.receivers[].resend_interval_seconds",
                        "remote_write[].name", "remote_write[].url", "remote_write[].series",
                        "remote_write[].queue_config.max_samples_per_send", "remote_write[].queue_config.capacity",
                        "remote_write[].remote_timeout_seconds", "remote_write[].bearer_token"}) {
    keys.emplace_back(k);
  }
  // A list of mappings is named by its entries' keys alone.
  std::set<std::string> lists;
  for (const std::string& k : keys) {
    if (const auto at = k.find("[]."); at != std::string::npos) lists.insert(k.substr(0, at));
  }
  std::erase_if(keys, [&](const std::string& k) { return lists.count(k) != 0; });
  std::sort(keys.begin(), keys.end());
  return keys;
}

}  // namespace gradwatch::daemon

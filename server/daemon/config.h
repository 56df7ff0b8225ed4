// gradwatchd's configuration: a YAML file, then command-line flags on top (flags win).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "alerts/rules.h"
#include "server/core/status.h"

namespace gradwatch::daemon {

struct Config {
  std::string listen = "127.0.0.1:7390";          // gRPC: Ingest, Query, health, reflection
  std::string metrics_listen = "127.0.0.1:9390";  // Prometheus /metrics
  std::string data_dir = "/var/lib/gradwatch";
  std::string log_format = "text";  // text | json
  std::string log_level = "info";   // trace | debug | info | warn | error

  size_t max_message_bytes = 4 << 20;
  size_t max_runs = 256;
  size_t max_params_per_run = 65536;
  size_t max_series_per_run = 262144;
  // Events (trainer events, annotations, catalog changes) one run holds at most.
  size_t max_events_per_run = 10000;
  size_t max_streams = 4096;
  // Streams one caller (a token's or certificate's name in the policy) may hold open: a job, or a
  // runaway client, cannot take every slot from the others. Streams the policy refuses hold none.
  size_t max_streams_per_identity = 4096;
  // A stream that sends no Hello this long after opening is closed.
  double hello_timeout_seconds = 30;
  // The memory all runs together may be charged (runs::MemoryBudget); 0: a quarter of the
  // machine's physical memory.
  size_t memory_budget_bytes = 0;

  double assembly_timeout_seconds = 30;
  // Points kept by the run's scalars, the output layer's norms and the norm gains' parameter norms.
  size_t recent_points = 4096;
  size_t history_buckets = 1024;
  // Points kept by every other parameter series (runs::RunOptions::param_series).
  size_t param_recent_points = 128;
  size_t param_history_buckets = 32;
  size_t journal_batch_max = 4096;
  int journal_max_delay_ms = 20;
  size_t journal_block_steps = 128;  // store::JournalOptions::block_steps
  // Every this many seconds, runs with new steps are snapshotted (store::SnapshotStore), so that a
  // restart replays only the journal's steps after their snapshot; 0: never (a restart replays
  // the whole journal). Runs are also snapshotted at a clean shutdown.
  double journal_snapshot_interval_seconds = 300;
  double run_end_after_seconds = 600;
  // A run with no open stream that said no Goodbye and showed no sign of life for this long is
  // presumed dead: the RunDied page (rules of kind run_died without their own `seconds`).
  double run_stalled_after_seconds = 600;
  // An ended run stays in memory (queryable) this long, then only the journal has it.
  double run_retention_seconds = 86400;
  // Ended runs leave the journal this long after they ended (0: never); must cover the retention.
  double journal_retention_days = 30;
  // Delivered or given-up notifications leave the outbox this long after they were queued.
  double outbox_retention_days = 7;

  std::vector<uint64_t> slope_windows = {1000, 5000, 20000};  // steps
  size_t slope_max_buckets = 128;
  // Buckets per slope window of ordinary parameters' series (runs::AnalyticsOptions).
  size_t slope_param_max_buckets = 16;
  uint64_t event_window_steps = 5000;
  uint64_t forecast_window_steps = 20000;
  // How far the weight-decay what-if projects (steps; runs::AnalyticsOptions::projection_steps).
  uint64_t projection_steps = 20000;
  // (series key, threshold) pairs forecast for every run.
  std::vector<std::pair<std::string, double>> forecasts = {{"grad/norm/total", 5.0}};
  uint64_t change_point_window_steps = 3000;

  struct Receiver {
    std::string type;  // alertmanager | webhook | pagerduty | slack
    std::string name;
    std::string url;
    std::string routing_key;              // pagerduty
    std::string bearer_token;             // webhook
    double resend_interval_seconds = 60;  // alertmanager
  };
  std::vector<Receiver> receivers;
  // Base of generatorURL links; empty: derived from metrics_listen (ExternalUrl).
  std::string external_url;

  // remote_write: [{url: ..., name: ..., series: [...], queue_config: {...}}] at the top level, as
  // Prometheus names it (exporter::RemoteWriteOptions).
  struct RemoteWrite {
    std::string name;
    std::string url;
    std::vector<std::string> series;  // series-key patterns ('*' wildcard); empty: every series
    size_t max_samples_per_send = 2000;
    size_t capacity = 1'000'000;  // samples queued at most
    double remote_timeout_seconds = 30;
    std::string bearer_token;
  };
  std::vector<RemoteWrite> remote_write;

  // The HTTP listener's limits against slow and hostile clients (web::ServerOptions).
  size_t http_max_connections = 256;
  size_t http_max_connections_per_peer = 64;
  double http_header_timeout_seconds = 10;
  double http_idle_timeout_seconds = 60;

  // What /metrics shows per run beyond its scalars (exporter::ExportOptions).
  std::vector<std::string> metrics_params = {"key"};
  std::vector<std::string> metrics_slope_series = {"key"};
  size_t metrics_max_series_per_run = 10000;

  // TLS on the gRPC listener (security.tls_*; daemon::TlsFiles): the daemon's certificate and key,
  // and the CA of the clients' certificates for mutual TLS. Empty: plain text.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Bearer tokens (hashed) and client-certificate identities with their scopes
  // (ingest::LoadPolicy); empty: every caller may do everything. Reloaded on SIGHUP.
  std::string tokens_file;
  // /metrics needs a token with the read scope too (Prometheus: authorization.credentials_file).
  bool metrics_require_token = false;
  // The HTTP listener (/metrics) serves HTTPS with tls_cert_file and tls_key_file when they are
  // set (security.http_tls); false keeps it plain (a TLS proxy in front, a loopback scraper).
  bool http_tls = true;
  // HTTP clients must present a certificate this CA signed (security.http_client_ca_file).
  std::string http_client_ca_file;
  // A gRPC listener beyond loopback without mutual TLS lets any host that reaches the port write
  // runs, silence alerts and reload rules, and an HTTP listener beyond loopback without TLS shows
  // every run in clear: both refused unless this is set (--insecure).
  bool allow_insecure = false;
  // The longest a silence may last (security.max_silence_seconds).
  double max_silence_seconds = 7 * 86400;

  bool default_rules = true;  // load alerts/rules/default.yaml (built in)
  // Pages of threshold rules are held (sent as warnings that say why) for steps numbered below
  // this, as during a learning-rate warm-up (alerts/warmup.h; alerts::kDefaultMinStepsBeforePage).
  uint64_t min_steps_before_page = 200;
  // alerts.overrides: rule name → the keys it changes (alerts::ApplyOverrides), in file order.
  std::vector<alerts::RuleOverride> alert_overrides;
  std::vector<std::string> rule_files;  // more rule files
};

// Reads a YAML config file over the defaults. Unknown keys, repeated keys and bad values are
// errors that name the file, line and key.
StatusOr<Config> LoadConfigFile(const std::string& path);
// Parses YAML text (the file's contents) over `base`; `source` names it in errors.
StatusOr<Config> ParseConfig(const std::string& yaml, const std::string& source, Config base = {});

// The documented range of a numeric setting, both ends included, in the unit its key names; with
// `zero_is_off`, 0 is allowed too and turns the feature off. Durations stay far inside int64
// nanoseconds (292 years), so no conversion or sum of them can overflow.
struct Config;
struct SettingRange {
  double lo = 0;
  double hi = 0;
  bool zero_is_off = false;
  // The setting's value in a Config, for ValidateConfig; null for list entries (receivers[],
  // remote_write[], analytics.windows), which are checked as they are read.
  double (*of)(const Config&) = nullptr;
  bool Admits(double v) const { return (zero_is_off && v == 0) || (v >= lo && v <= hi); }
  // "between 1 and 86400, or 0 (off)"
  std::string Text() const;
};

// Every numeric setting's range, by key (receivers[] and remote_write[] entries under their list's
// key): ParseConfig checks each value as it reads it (its error names file:line), ValidateConfig
// checks a whole Config, and docs/configuration.md states each one (a test holds them equal).
const std::vector<std::pair<std::string, SettingRange>>& SettingRanges();
// Checks ranges, addresses and receiver URLs; the message names the offending key.
Status ValidateConfig(const Config& config);
// Whether HOST:PORT's host is a loopback address (127.0.0.0/8, ::1, localhost).
bool IsLoopbackAddress(const std::string& address);
// A gRPC listener any host may reach and use: beyond loopback, and neither mutual TLS nor TLS with
// tokens (allowed only with security.allow_insecure).
bool InsecureListener(const Config& config);
// Whether the HTTP listener serves HTTPS (TLS files set and security.http_tls).
bool HttpTls(const Config& config);
// The base of the links notifications carry: alerts.external_url when set, else the HTTP
// listener's own address (https when it serves TLS; this machine's name for a wildcard host such as
// 0.0.0.0), so that links follow --metrics-listen.
std::string ExternalUrl(const Config& config);
// An HTTP listener beyond loopback without TLS (allowed only with security.allow_insecure).
bool InsecureHttpListener(const Config& config);
// Reads and checks what the configuration names on disk: the rule files (with the built-in rules,
// as the daemon loads them). Run by --check-config and before start, so that a bad configuration
// exits 2 and never reaches the daemon.
Status CheckConfigFiles(const Config& config);

// The configuration in effect as JSON (`gradwatchd --check-config`), shaped like the YAML: every
// key of the schema, secrets (bearer_token, routing_key) shown as "<secret>" when set.
std::string ConfigJson(const Config& config);

// Every key the YAML accepts, as "section.key" ("listen" at the top level); a list's entries'
// keys as "alerts.receivers[].url", "remote_write[].queue_config.capacity".
std::vector<std::string> ConfigKeys();

}  // namespace gradwatch::daemon

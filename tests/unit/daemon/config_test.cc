#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "server/daemon/config.h"

using namespace gradwatch::daemon;

TEST_CASE("an empty config gives the loopback defaults", "[daemon]") {
  auto c = ParseConfig("", "test.yaml");
  REQUIRE(c.ok());
  CHECK(c->listen == "127.0.0.1:7390");
  CHECK(c->metrics_listen == "127.0.0.1:9390");
  CHECK(ValidateConfig(*c).ok());
}

TEST_CASE("config keys are read from their sections", "[daemon]") {
  auto c = ParseConfig(R"(
listen: 127.0.0.1:7000
data_dir: /tmp/x
log: {format: json, level: debug}
limits: {max_message_bytes: 65536, max_runs: 3}
assembly: {timeout_seconds: 2.5}
store: {recent_points: 100, history_buckets: 10, param_recent_points: 50, param_history_buckets: 5}
journal: {batch_max: 10, max_delay_ms: 5, block_steps: 16}
runs: {end_after_seconds: 30, stalled_after_seconds: 45, retention_seconds: 3600}
retention: {journal_days: 0.5, outbox_days: 2}
)",
                       "test.yaml");
  REQUIRE(c.ok());
  CHECK(c->listen == "127.0.0.1:7000");
  CHECK(c->log_format == "json");
  CHECK(c->max_message_bytes == 65536);
  CHECK(c->max_runs == 3);
  CHECK(c->assembly_timeout_seconds == 2.5);
  CHECK(c->recent_points == 100);
  CHECK(c->history_buckets == 10);
  CHECK(c->param_recent_points == 50);
  CHECK(c->param_history_buckets == 5);
  CHECK(c->journal_max_delay_ms == 5);
  CHECK(c->journal_block_steps == 16);
  CHECK(c->run_end_after_seconds == 30);
  CHECK(c->run_stalled_after_seconds == 45);
  CHECK(c->run_retention_seconds == 3600);
  CHECK(c->journal_retention_days == 0.5);
  CHECK(c->outbox_retention_days == 2);
  CHECK(ValidateConfig(*c).ok());
}

TEST_CASE("config errors name the file, line and key", "[daemon]") {
  auto unknown = ParseConfig("listen: 127.0.0.1:1\nstore:\n  recent_pints: 5\n", "gw.yaml");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().message() ==
        "gw.yaml:3: store.recent_pints: unknown key (did you mean 'store.recent_points'?)");
  auto section = ParseConfig("retension:\n  journal_days: 5\n", "gw.yaml");
  REQUIRE_FALSE(section.ok());
  CHECK(section.status().message() == "gw.yaml:1: retension: unknown key (did you mean 'retention'?)");
  auto far = ParseConfig("colour: blue\n", "gw.yaml");
  REQUIRE_FALSE(far.ok());
  CHECK(far.status().message() == "gw.yaml:1: colour: unknown key");

  auto badtype = ParseConfig("limits:\n  max_runs: many\n", "gw.yaml");
  REQUIRE_FALSE(badtype.ok());
  CHECK(badtype.status().message().find("gw.yaml:2: limits.max_runs") == 0);

  auto syntax = ParseConfig("listen: [\n", "gw.yaml");
  CHECK_FALSE(syntax.ok());
}

TEST_CASE("validation rejects bad values with the key's name", "[daemon]") {
  Config c;
  c.listen = "nowhere";
  CHECK(ValidateConfig(c).message().find("listen") == 0);
  c = Config{};
  c.log_format = "xml";
  CHECK(ValidateConfig(c).message().find("log.format") == 0);
  c = Config{};
  c.run_stalled_after_seconds = 0;
  CHECK(ValidateConfig(c).message().find("runs.stalled_after_seconds") == 0);
  c = Config{};
  c.run_retention_seconds = 86400;
  c.journal_retention_days = 0.5;  // the journal must keep what memory keeps
  CHECK(ValidateConfig(c).message().find("retention.journal_days") == 0);
  c.journal_retention_days = 0;  // never prune
  CHECK(ValidateConfig(c).ok());
  c = Config{};
  c.assembly_timeout_seconds = 0;
  CHECK(ValidateConfig(c).message().find("assembly.timeout_seconds") == 0);
  c = Config{};
  c.journal_block_steps = 0;
  CHECK(ValidateConfig(c).message().find("journal.block_steps") == 0);
  c.journal_block_steps = 4097;
  CHECK(ValidateConfig(c).message().find("journal.block_steps") == 0);
  // A slope window's buckets keep 32 bits of their first step: windows up to 2^32 steps.
  c = Config{};
  c.slope_windows = {1000, (uint64_t{1} << 32) + 1};
  CHECK(ValidateConfig(c).message().find("analytics.windows") == 0);
  c.slope_windows = {1000, uint64_t{1} << 32};
  CHECK(ValidateConfig(c).ok());
  c = Config{};
  c.forecast_window_steps = (uint64_t{1} << 32) + 1;
  CHECK(ValidateConfig(c).message().find("analytics.forecast_window_steps") == 0);
  c = Config{};
  c.event_window_steps = UINT64_MAX;
  CHECK(ValidateConfig(c).message().find("analytics.event_window_steps") == 0);
  c = Config{};
  c.change_point_window_steps = UINT64_MAX;
  CHECK(ValidateConfig(c).message().find("analytics.change_point_window_steps") == 0);
  c = Config{};
  c.projection_steps = 0;
  CHECK(ValidateConfig(c).message() == "analytics.projection_steps: 0 is out of range: must be between 1 and 200000");
  c.projection_steps = 200001;
  CHECK_FALSE(ValidateConfig(c).ok());
  c.projection_steps = 50000;
  CHECK(ValidateConfig(c).ok());
}

TEST_CASE("every number in the configuration is checked against its range, naming the file and line", "[daemon]") {
  // Found by a hostile pass: each passed the check, then misbehaved (int64 nanoseconds overflowed,
  // a run ended within 2 s, an idle daemon burned 48% CPU snapshotting).
  for (const auto& [yaml, message] : std::vector<std::pair<std::string, std::string>>{
           {"assembly:\n  timeout_seconds: 1e10\n",
            "c.yaml:2: assembly.timeout_seconds: 1e10 is out of range: must be between 0.001 and 86400"},
           {"runs: {end_after_seconds: 1e10}\n",
            "c.yaml:1: runs.end_after_seconds: 1e10 is out of range: must be between 0.1 and 315360000"},
           {"journal:\n  snapshot_interval_seconds: 1e-300\n",
            "c.yaml:2: journal.snapshot_interval_seconds: 1e-300 is out of range: must be between 0.1 and 86400, or 0 "
            "(off)"},
           {"runs: {retention_seconds: .nan}\n", "c.yaml:1: runs.retention_seconds: .nan is out of range"},
           {"limits:\n  max_runs: -1\n", "c.yaml:2: limits.max_runs: cannot read '-1'"},
           {"analytics:\n  windows: [1000, 5000000000]\n", "c.yaml:2: analytics.windows: 5000000000 is out of range"},
           {"alerts:\n  receivers: [{type: webhook, url: 'http://a/', resend_interval_seconds: 1e12}]\n",
            "c.yaml:2: alerts.receivers[].resend_interval_seconds: 1e12 is out of range"},
           {"remote_write: [{url: 'http://a/', remote_timeout_seconds: 1e300}]\n",
            "c.yaml:1: remote_write[].remote_timeout_seconds: 1e300 is out of range"},
       }) {
    auto parsed = ParseConfig(yaml, "c.yaml");
    REQUIRE_FALSE(parsed.ok());
    CHECK_THAT(parsed.status().message(), Catch::StartsWith(message));
  }
  CHECK(ParseConfig("journal: {snapshot_interval_seconds: 0}\n", "c.yaml").ok());

  // Every plain key's range holds at both ends, through the file and through ValidateConfig.
  const auto number = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  size_t checked = 0;
  for (const auto& [key, range] : SettingRanges()) {
    if (key.find("[]") != std::string::npos) continue;
    const std::string section = key.substr(0, key.find('.'));
    const std::string name = key.substr(key.find('.') + 1);
    const bool list = key == "analytics.windows";
    const auto yaml = [&](const std::string& value) {
      return section + ":\n  " + name + ": " + (list ? "[" + value + "]" : value) + "\n";
    };
    INFO(key);
    auto at_hi = ParseConfig(yaml(number(range.hi)), "c.yaml");
    INFO((at_hi.ok() ? "" : at_hi.status().message()));
    CHECK(at_hi.ok());
    auto above = ParseConfig(yaml(number(range.hi * 2 + 1)), "c.yaml");
    REQUIRE_FALSE(above.ok());
    CHECK_THAT(above.status().message(), Catch::StartsWith("c.yaml:2: " + key + ": ") &&
                                             Catch::EndsWith("is out of range: must be " + range.Text()));
    if (range.lo > 0) {
      CHECK(ParseConfig(yaml(number(range.lo)), "c.yaml").ok());
      const double below = range.lo >= 1 ? range.lo - 1 : range.lo / 2;
      if (!(range.zero_is_off && below == 0)) CHECK_FALSE(ParseConfig(yaml(number(below)), "c.yaml").ok());
    }
    ++checked;
  }
  CHECK(checked >= 25);
}

TEST_CASE("docs/configuration.md states every numeric setting's range as the daemon checks it", "[daemon]") {
  std::ifstream in(std::string(GRADWATCH_SOURCE_DIR) + "/docs/configuration.md");
  REQUIRE(in);
  std::map<std::string, std::string> rows;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find('`', 3);
    std::string lower = line;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    rows[line.substr(3, end - 3)] = lower;
  }
  for (const auto& [key, range] : SettingRanges()) {
    INFO(key);
    REQUIRE(rows.count(key) == 1);
    CHECK_THAT(rows[key], Catch::Contains(range.Text()));
  }
}

TEST_CASE("a repeated key is an error naming the file and line, at any depth", "[daemon]") {
  auto c = ParseConfig("listen: 127.0.0.1:7000\nlimits:\n  max_runs: 3\n  max_runs: 4\n", "dup.yaml");
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().message() == "dup.yaml:4: duplicate key 'max_runs' (first at line 3)");
  c = ParseConfig("data_dir: /a\nlog: {level: info}\ndata_dir: /b\n", "dup.yaml");
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().message() == "dup.yaml:3: duplicate key 'data_dir' (first at line 1)");
  c = ParseConfig("alerts:\n  receivers:\n    - {type: webhook, url: 'http://a/', url: 'http://b/'}\n", "dup.yaml");
  REQUIRE_FALSE(c.ok());
  CHECK_THAT(c.status().message(), Catch::StartsWith("dup.yaml:3: duplicate key 'url'"));
}

TEST_CASE("a receiver URL without a scheme or host is invalid", "[daemon]") {
  for (const std::string url : {"127.0.0.1:9093/api/v2/alerts", "ftp://host/x", "http://", "hooks.example.com/x"}) {
    CAPTURE(url);
    auto c = ParseConfig("alerts:\n  receivers:\n    - {type: webhook, name: hook, url: '" + url + "'}\n", "t.yaml");
    REQUIRE(c.ok());
    const auto s = ValidateConfig(*c);
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::StartsWith("alerts.receivers: receiver 'hook': url '" + url + "'"));
  }
  auto c = ParseConfig("alerts:\n  receivers:\n    - {type: webhook, url: 'https://hooks.example.com/x'}\n", "t.yaml");
  REQUIRE(c.ok());
  CHECK(ValidateConfig(*c).ok());
}

TEST_CASE("the rule files a configuration names are read and checked before start", "[daemon]") {
  Config c;
  CHECK(CheckConfigFiles(c).ok());
  c.rule_files = {"/nonexistent/gradwatch-rules.yaml"};
  const auto s = CheckConfigFiles(c);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(s.message(), Catch::Contains("/nonexistent/gradwatch-rules.yaml"));
}

TEST_CASE("the memory budget is read from limits", "[daemon]") {
  auto c = ParseConfig("limits: {memory_budget_bytes: 1073741824}\n", "t.yaml");
  REQUIRE(c.ok());
  CHECK(c->memory_budget_bytes == 1073741824u);
  CHECK(ParseConfig("", "t.yaml")->memory_budget_bytes == 0u);  // 0: a quarter of the machine's memory
}

// Found by fuzzing (tests/fuzz/corpus/config/crash-key-not-scalar): yaml-cpp throws converting a
// list or mapping key to text, which ended the process.
TEST_CASE("a config key that is a list or a mapping is an error, not a crash", "[daemon]") {
  const char* cases[] = {
      "{[!ml]}: 1\n",
      "? [listen]\n: 127.0.0.1:1\n",
      "log: {? {a: b} : json}\n",
      "alerts: {receivers: [{? [type] : webhook, url: 'http://x'}]}\n",
  };
  for (const char* yaml : cases) {
    INFO(yaml);
    auto c = ParseConfig(yaml, "test.yaml");
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("test.yaml:") && Catch::Contains("a key must be a plain name"));
  }
}

TEST_CASE("remote_write receivers are read at the top level, as Prometheus names them", "[daemon]") {
  auto c = ParseConfig(
      "remote_write:\n"
      "  - url: http://127.0.0.1:9090/api/v1/write\n"
      "    name: tsdb\n"
      "    series: [grad/norm/total, '*final_norm*']\n"
      "    queue_config: {max_samples_per_send: 500, capacity: 10000}\n"
      "    remote_timeout_seconds: 5\n"
      "  - url: https://mimir.example.com/api/v1/push\n"
      "    bearer_token: t0k\n",
      "rw.yaml");
  REQUIRE(c.ok());
  REQUIRE(c->remote_write.size() == 2);
  const Config::RemoteWrite& a = c->remote_write[0];
  CHECK(a.name == "tsdb");
  CHECK(a.url == "http://127.0.0.1:9090/api/v1/write");
  CHECK(a.series == std::vector<std::string>{"grad/norm/total", "*final_norm*"});
  CHECK(a.max_samples_per_send == 500);
  CHECK(a.capacity == 10000);
  CHECK(a.remote_timeout_seconds == 5);
  CHECK(c->remote_write[1].name == "remote-write-1");
  CHECK(c->remote_write[1].bearer_token == "t0k");
  CHECK(c->remote_write[1].series.empty());
  CHECK(ValidateConfig(*c).ok());

  auto unknown = ParseConfig("remote_write: [{url: 'http://a/', queue_config: {shards: 4}}]\n", "rw.yaml");
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(unknown.status().message(), Catch::Contains("remote_write[].queue_config.shards: unknown key"));
  auto no_url = ParseConfig("remote_write: [{name: x}]\n", "rw.yaml");
  REQUIRE_FALSE(no_url.ok());
  CHECK_THAT(no_url.status().message(), Catch::Contains("url is required"));
  for (const auto& [yaml, message] : std::vector<std::pair<std::string, std::string>>{
           {"remote_write: [{url: 'ftp://a/'}]", "remote_write: receiver 'remote-write-0': url 'ftp://a/'"},
           {"remote_write: [{url: 'http://a/', name: x}, {url: 'http://b/', name: x}]", "two receivers have this name"},
           {"remote_write: [{url: 'http://a/', queue_config: {capacity: 10}}]", "queue_config.capacity"},
           {"remote_write: [{url: 'http://a/', remote_timeout_seconds: 0}]", "remote_timeout_seconds"},
       }) {
    auto parsed = ParseConfig(yaml + "\n", "rw.yaml");
    const gradwatch::Status s = parsed.ok() ? ValidateConfig(*parsed) : parsed.status();
    CHECK_THAT(s.message(), Catch::Contains(message));
  }
}

namespace {
// The keys of a JSON document as ConfigKeys names them: "a.b", and "a[].b" inside lists of mappings;
// an empty mapping (alerts.overrides: {}) is a value.
void Flatten(const nlohmann::json& j, const std::string& prefix, std::set<std::string>& out) {
  if (j.is_object() && (!j.empty() || prefix.empty())) {
    for (const auto& [k, v] : j.items()) Flatten(v, prefix.empty() ? k : prefix + "." + k, out);
  } else if (j.is_array() && !j.empty() && j.front().is_object()) {
    for (const auto& item : j) Flatten(item, prefix + "[]", out);
  } else {
    out.insert(prefix);
  }
}
}  // namespace

TEST_CASE("the configuration printed by check-config shows every key the schema accepts, and masks secrets",
          "[daemon]") {
  auto c = ParseConfig(
      "alerts: {receivers: [{type: pagerduty, routing_key: rk-secret}, {type: webhook, url: 'http://h/', "
      "bearer_token: wh-secret}]}\n"
      "remote_write: [{url: 'http://p/api/v1/write', bearer_token: rw-secret}]\n",
      "all.yaml");
  REQUIRE(c.ok());
  const std::string text = ConfigJson(*c);
  std::set<std::string> shown;
  Flatten(nlohmann::json::parse(text), "", shown);
  const std::vector<std::string> keys = ConfigKeys();
  CHECK(std::vector<std::string>(shown.begin(), shown.end()) == keys);
  CHECK(text.find("secret\"") == std::string::npos);
  CHECK(text.find("rk-secret") == std::string::npos);
  CHECK(text.find("\"<secret>\"") != std::string::npos);
}

TEST_CASE("the links in notifications follow the HTTP listener unless alerts.external_url is set", "[daemon]") {
  Config c;
  CHECK(ExternalUrl(c) == "http://127.0.0.1:9390");
  c.metrics_listen = "127.0.0.1:9500";  // as --metrics-listen sets it
  CHECK(ExternalUrl(c) == "http://127.0.0.1:9500");
  c.metrics_listen = "[::1]:9501";
  CHECK(ExternalUrl(c) == "http://[::1]:9501");
  char name[256] = {0};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  c.metrics_listen = "0.0.0.0:9502";  // a wildcard host: this machine's name
  CHECK(ExternalUrl(c) == "http://" + std::string(name) + ":9502");
  c.tls_cert_file = "server.pem";
  c.tls_key_file = "server.key";
  CHECK(ExternalUrl(c) == "https://" + std::string(name) + ":9502");
  c.external_url = "https://gradwatch.example.com";  // a proxy in front
  CHECK(ExternalUrl(c) == "https://gradwatch.example.com");
  auto parsed = ParseConfig("metrics_listen: 127.0.0.1:9600\n", "gw.yaml", Config{});
  REQUIRE(parsed.ok());
  CHECK(nlohmann::json::parse(ConfigJson(*parsed))["alerts"]["external_url"] == "http://127.0.0.1:9600");
}

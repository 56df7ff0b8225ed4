// The run view on gradwatchd's HTTP listener: its JSON API answers what the Query API answers
// for a replayed run, with clear errors; the page, its script and style are served from the
// binary; an alert's link (<external_url>/runs/<run>) opens the page; a token gate covers it all.
#include <catch2/catch.hpp>

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/integration/daemon_process.h"

using namespace gradwatch::testing;
using nlohmann::json;

namespace {

constexpr const char* kRun = "view:run/1";  // a colon and a slash: percent-encoded in URLs
constexpr const char* kRunPath = "view%3Arun%2F1";

// Steps 1..60 of a run whose total grad norm crosses 5 at step 50 (the page fires), with the
// final norm's norm rising, then an event at step 30.
std::string WriteRun(const TempDir& dir) {
  const auto path = dir.path() / "run.jsonl";
  std::ofstream out(path);
  for (int step = 1; step <= 60; ++step) {
    const double total = step < 50 ? 1.0 + step * 0.01 : 5.5;
    out << R"({"_step": )" << step << R"(, "grad/norm/total": )" << total << R"(, "params/norm/final_norm.weight": )"
        << 78.0 + step * 0.5 << R"(, "train/loss": 2.0)" << (step == 30 ? R"(, "event": "switched routing")" : "")
        << "}\n";
  }
  return path.string();
}

HttpResponse Get(const DaemonProcess& daemon, const std::string& path,
                 const std::map<std::string, std::string>& headers = {}) {
  return HttpRequest("GET", "127.0.0.1", daemon.metrics_port(), path, "", headers);
}

json GetJson(const DaemonProcess& daemon, const std::string& path, int status = 200) {
  const HttpResponse r = Get(daemon, path);
  INFO(path << " -> " << r.status << ": " << r.body);
  REQUIRE(r.status == status);
  REQUIRE(r.headers.at("content-type") == "application/json");
  return json::parse(r.body);
}

}  // namespace

TEST_CASE("the run view's JSON API answers for a replayed run, and its errors say what is wrong", "[integration]") {
  TempDir dir("gradwatch-run-view");
  DaemonProcess daemon;
  const CommandResult replay = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", WriteRun(dir), "--run", kRun, "--max", "--json"},
      std::nullopt, std::chrono::seconds(120));
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);

  const json runs = GetJson(daemon, "/api/v1/runs");
  REQUIRE(runs["runs"].size() == 1);
  CHECK(runs["runs"][0]["run_id"] == kRun);
  CHECK(runs["runs"][0]["last_step"] == "60");  // 64-bit integers are strings in protobuf's JSON

  const json summary = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath);
  CHECK(summary["info"]["run_id"] == kRun);
  CHECK(summary["info"]["step_count"] == "60");
  REQUIRE(summary["events"].size() == 1);
  CHECK(summary["events"][0]["text"] == "switched routing");

  json series = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath + "/series?key=grad%2Fnorm%2Ftotal");
  REQUIRE(series["points"].size() == 60);
  CHECK(series["points"][59]["value"] == 5.5);
  CHECK(series["points"][0]["step"] == "1");
  // A range and a point budget: buckets keep min, max and mean.
  series = GetJson(daemon,
                   std::string("/api/v1/runs/") + kRunPath + "/series?key=grad/norm/total&from=41&to=60&max_points=4");
  REQUIRE(series["points"].size() <= 4);
  double max = 0;
  for (const json& p : series["points"]) max = std::max(max, p["max"].get<double>());
  CHECK(max == 5.5);

  // The alert the crossing fired, with its recommendation.
  const json alerts = GetJson(daemon, "/api/v1/alerts?run=view%3Arun%2F1");
  REQUIRE(alerts["alerts"].size() >= 1);
  CHECK(alerts["alerts"][0]["labels"]["run"] == kRun);
  CHECK_FALSE(alerts["alerts"][0]["annotations"]["recommendation"].get<std::string>().empty());

  json error = GetJson(daemon, "/api/v1/runs/nope", 404);
  CHECK(error["error"] == "no run 'nope'");
  CHECK(error["code"] == "NOT_FOUND");
  error = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath + "/series?key=no/such", 404);
  CHECK(error["error"] == "run 'view:run/1' has no series 'no/such'");
  error = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath + "/series", 400);
  CHECK(error["error"] == "key is required: ?key=grad/norm/total");
  error = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath + "/series?key=train/loss&from=x", 400);
  CHECK(error["error"] == "from must be a step number, not 'x'");
  error = GetJson(daemon, std::string("/api/v1/runs/") + kRunPath + "/series?key=train/loss&from=9&to=3", 400);
  CHECK(error["error"] == "to_step is before from_step");
  error = GetJson(daemon, "/api/v1/runs/%zz", 400);
  CHECK(error["error"] == "bad run name in /api/v1/runs/%zz");
  error = GetJson(daemon, "/api/v2/anything", 404);
  CHECK_THAT(error["error"].get<std::string>(), Catch::StartsWith("no API at /api/v2/anything"));
}

TEST_CASE("the run view's page is served from the binary, and an alert's link opens it", "[integration]") {
  DaemonProcess daemon;
  HttpResponse r = Get(daemon, "/");
  CHECK(r.status == 302);
  CHECK(r.headers.at("location") == "/runs/");
  // generatorURL is <external_url>/runs/<run, percent-encoded>.
  for (const std::string& path : {std::string("/runs/"), std::string("/runs/") + kRunPath}) {
    r = Get(daemon, path);
    INFO(path);
    CHECK(r.status == 200);
    CHECK(r.headers.at("content-type") == "text/html; charset=utf-8");
    CHECK_THAT(r.body, Catch::Contains("<script src=\"/ui/app.js\" defer></script>"));
    CHECK_THAT(r.headers.at("content-security-policy"), Catch::Contains("default-src 'self'"));
  }
  r = Get(daemon, "/ui/app.js");
  CHECK(r.status == 200);
  CHECK(r.headers.at("content-type") == "text/javascript; charset=utf-8");
  CHECK_THAT(r.body, Catch::Contains("window.gradwatch = state;"));
  CHECK(Get(daemon, "/ui/style.css").headers.at("content-type") == "text/css; charset=utf-8");
  CHECK(Get(daemon, "/ui/nothing.js").status == 404);
  CHECK(Get(daemon, "/metrics").status == 200);
}

TEST_CASE("with metrics_require_token, the run view and its API need a read token too", "[integration][security]") {
  TempDir dir("gradwatch-run-view-token");
  const auto tokens = dir.path() / "tokens.yaml";
  const CommandResult sha = RunCommand({"bash", "-c", "printf %s view-secret | sha256sum | cut -d' ' -f1"},
                                       std::nullopt, std::chrono::seconds(30));
  std::ofstream(tokens) << "tokens:\n  - {name: viewer, sha256: " << sha.out.substr(0, 64) << ", scopes: [read]}\n";
  DaemonOptions options;
  options.config_yaml = "security: {tokens_file: " + tokens.string() + ", metrics_require_token: true}\n";
  DaemonProcess daemon(options);
  for (const char* path : {"/runs/", "/api/v1/runs", "/ui/app.js", "/metrics"}) {
    INFO(path);
    HttpResponse r = Get(daemon, path);
    CHECK(r.status == 401);
    CHECK_THAT(r.body, Catch::Contains("requires a bearer token"));
    r = Get(daemon, path, {{"Authorization", "Bearer view-secret"}});
    CHECK(r.status == 200);
  }
}

TEST_CASE("the alert history lists a page's pending, firing and resolved states in order, and survives a restart",
          "[integration]") {
  TempDir dir("gradwatch-alert-history");
  const auto path = dir.path() / "run.jsonl";
  {
    // Steady at 1, one spike at step 20, above 5 from step 50 to 99, back to 1 until step 200.
    std::ofstream out(path);
    for (int step = 1; step <= 200; ++step) {
      const double total = step == 20 ? 5.6 : step >= 50 && step < 100 ? 5.5 : 1.0;
      out << R"({"_step": )" << step << R"(, "grad/norm/total": )" << total << R"(, "train/loss": 2.0})"
          << "\n";
    }
  }
  DaemonOptions options;
  options.data_dir = dir.path() / "data";
  options.config_yaml += "alerts: {min_steps_before_page: 0}\n";  // a short run: its first steps page too
  DaemonProcess daemon(options);
  const CommandResult replay = RunCommand(
      {CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", path.string(), "--run", "hist-1", "--max", "--json"},
      std::nullopt, std::chrono::seconds(120));
  INFO(replay.out << replay.err);
  REQUIRE(replay.exit_code == 0);

  // The contingency's changes, oldest first; the store is written off the ingest path, so wait.
  auto contingency = [&](const DaemonProcess& d) {
    const json history = GetJson(d, "/api/v1/alerts/history?run=hist-1");
    std::vector<json> out;
    for (const json& e : history["entries"]) {
      if (e["alert"]["name"] == "GradNormContingency") out.push_back(e);
    }
    return out;
  };
  std::vector<json> changes;
  REQUIRE(WaitUntil(
      [&] {
        changes = contingency(daemon);
        return !changes.empty() && changes.back()["alert"]["state"] == "ALERT_STATE_RESOLVED";
      },
      std::chrono::seconds(60)));
  INFO(json(changes).dump(1));
  REQUIRE(changes.size() >= 3);
  const size_t n = changes.size();
  CHECK(changes[n - 3]["alert"]["state"] == "ALERT_STATE_PENDING");
  CHECK(changes[n - 3]["from"] == "ALERT_STATE_UNSPECIFIED");
  CHECK(changes[n - 2]["alert"]["state"] == "ALERT_STATE_FIRING");
  CHECK(changes[n - 2]["from"] == "ALERT_STATE_PENDING");
  CHECK(changes[n - 1]["from"] == "ALERT_STATE_FIRING");
  const auto step = [](const json& e) { return std::stoull(e["alert"]["step"].get<std::string>()); };
  CHECK(step(changes[n - 3]) >= 50);
  CHECK(step(changes[n - 2]) >= 59);  // for_steps: 10
  CHECK(step(changes[n - 2]) < 100);
  CHECK(step(changes[n - 1]) >= 100);  // back below clear_below from step 100
  CHECK(step(changes[n - 1]) <= 200);
  CHECK_THAT(changes[n - 1]["alert"]["annotations"]["summary"].get<std::string>(), Catch::Contains("back to"));
  CHECK(changes[n - 1]["at"].get<double>() >= changes[n - 2]["at"].get<double>());
  // Any earlier change is the spike's: pending, then cleared without firing.
  for (size_t i = 0; i + 3 < n; ++i) {
    CHECK(step(changes[i]) < 50);
    CHECK(changes[i]["alert"]["state"] != "ALERT_STATE_FIRING");
  }
  // Resolved: no longer listed as active, still in the history.
  CHECK(GetJson(daemon, "/api/v1/alerts?run=hist-1")["alerts"].empty());

  // The latest N; a limit beyond the maximum is refused; an unknown run has no history.
  CHECK(GetJson(daemon, "/api/v1/alerts/history?run=hist-1&limit=1")["entries"].size() == 1);
  CHECK(GetJson(daemon, "/api/v1/alerts/history?limit=10001", 400)["error"] ==
        "limit must be a number up to 10000, not '10001'");
  CHECK(GetJson(daemon, "/api/v1/alerts/history?run=nobody")["entries"].empty());

  // Kept in the journal's database: a restart serves the same history.
  REQUIRE(daemon.Restart() == 0);
  const std::vector<json> after = contingency(daemon);
  REQUIRE(after.size() == changes.size());
  for (size_t i = 0; i < n; ++i) CHECK(after[i] == changes[i]);
}

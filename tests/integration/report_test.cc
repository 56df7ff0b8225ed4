// `gradwatch plot` and `gradwatch report` on the replayed incident of DESIGN.md: the charts hold
// the replayed series, the threshold and the slopes at the event; every number of the report is
// the Query API's, as the report rounds it (three significant digits).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "client/cli/format.h"
#include "client/cli/report.h"
#include "gradwatch/v1/gradwatch.pb.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/stream_client.h"

using namespace gradwatch;
using namespace gradwatch::testing;

namespace {

constexpr const char* kRun = "moe-incident-demo";

// The report writes numbers as every human output of the CLI does.
std::string Num(double v) { return gradwatch::cli::FormatValue(v); }

std::string Step(uint64_t v) { return gradwatch::cli::GroupedStep(static_cast<double>(v)); }

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string Annotation(const v1::Alert& alert, const std::string& name) {
  const auto it = alert.annotations().find(name);
  return it == alert.annotations().end() ? "<no " + name + ">" : it->second;
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

v1::ListAlertHistoryResponse AlertHistory(const DaemonProcess& daemon, const std::string& run) {
  auto stub = QueryStub(daemon.grpc_target());
  grpc::ClientContext ctx;
  v1::ListAlertHistoryRequest req;
  req.set_run_id(run);
  v1::ListAlertHistoryResponse history;
  REQUIRE(stub->ListAlertHistory(&ctx, req, &history).ok());
  return history;
}

struct Incident {
  Incident() : dir("gradwatch-report") {
    const std::string file = (dir.path() / "incident.jsonl").string();
    CommandResult r =
        RunCommand({"/usr/bin/python3", SourceDir() + "/deploy/examples/make_incident_run.py", "--out", file},
                   std::nullopt, std::chrono::seconds(120));
    REQUIRE(r.exit_code == 0);
    r = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", file, "--max", "--json"}, std::nullopt,
                   std::chrono::seconds(300));
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
  v1::RunSummary Summary() const {
    auto stub = QueryStub(daemon.grpc_target());
    grpc::ClientContext ctx;
    v1::GetRunRequest req;
    req.set_run_id(kRun);
    v1::RunSummary summary;
    REQUIRE(stub->GetRun(&ctx, req, &summary).ok());
    return summary;
  }
  v1::ListAlertHistoryResponse History() const { return AlertHistory(daemon, kRun); }
  CommandResult Cli(std::vector<std::string> args) const {
    std::vector<std::string> argv = {CliBinaryPath(), "--addr", daemon.grpc_target()};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, std::nullopt, std::chrono::seconds(120));
  }
  TempDir dir;
  DaemonProcess daemon;
};

}  // namespace

TEST_CASE("gradwatch plot draws the total grad norm and the final norm with its slopes at the event", "[integration]") {
  Incident incident;
  const std::string svg_path = (incident.dir.path() / "incident.svg").string();
  CommandResult r = incident.Cli({"plot", kRun, "-o", svg_path});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Catch::Contains("total grad norm (1201 points) and final_norm.weight (1201 points)"));
  const std::string svg = ReadFile(svg_path);
  CHECK(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  CHECK(Count(svg, "<path class=\"series\"") == 2);
  CHECK(Count(svg, "class=\"threshold\"") == 1);
  CHECK_THAT(svg, Catch::Contains("threshold 5"));
  CHECK(Count(svg, "<line class=\"fit-before\"") == 1);
  CHECK(Count(svg, "<line class=\"fit-after\"") == 1);
  CHECK_THAT(svg, Catch::Contains("switched to near-dropless EP routing (step 81,716)"));
  // Every point of the 1,201 replayed steps: one path command each.
  const size_t series = svg.find("<path class=\"series\" d=\"");
  const std::string d = svg.substr(series, svg.find("\"/>", series) - series);
  CHECK(Count(d, "L") == 1200);

  const std::string png = (incident.dir.path() / "incident.png").string();
  r = incident.Cli({"plot", kRun, "-o", png});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(ReadFile(png).rfind("\x89PNG", 0) == 0);

  r = incident.Cli({"plot", kRun, "-o", "chart.pdf"});
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.err, Catch::Contains("-o must name a .svg or .png file"));
  r = incident.Cli({"plot", "no-such-run", "-o", svg_path});
  CHECK(r.exit_code == 1);
}

TEST_CASE("gradwatch report writes the incident up from the analysis, every number the Query API's", "[integration]") {
  Incident incident;
  const auto out = incident.dir.path() / "report";
  const CommandResult r = incident.Cli({"report", kRun, "-o", out.string()});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const std::string md = ReadFile(out / "report.md");
  INFO(md);
  CHECK(std::filesystem::file_size(out / "total-grad-norm.svg") > 1000);
  CHECK(std::filesystem::file_size(out / "final-norm.svg") > 1000);
  CHECK_THAT(md, Catch::Contains("![total grad norm](total-grad-norm.svg)") &&
                     Catch::Contains("![norm of final\\_norm.weight](final-norm.svg)"));

  const v1::RunSummary summary = incident.Summary();
  const v1::Analysis& a = summary.analysis();
  // The final norm's slope change at the routing switch.
  bool found = false;
  for (const auto& c : a.slope_changes()) {
    if (c.key() != "params/norm/final_norm.weight") continue;
    found = true;
    CHECK(c.event_step() == 81716);
    CHECK_THAT(md, Catch::Contains("the event changed its slope ×" + Num(c.ratio()) + ", from " +
                                   Num(c.before_per_kstep()) + " to " + Num(c.after_per_kstep()) + " per 1k steps"));
    CHECK_THAT(md, Catch::Contains("before step 81,716 (switched to near-dropless EP routing)"));
  }
  CHECK(found);
  // The parameter that dominates the grad norm.
  REQUIRE(a.shares_size() > 0);
  CHECK_THAT(md, Catch::Contains("**" + cli::MarkdownText(a.shares(0).name()) + "** carries " +
                                 Num(a.shares(0).share() * 100) + " %"));
  // Amplification, growth without decay, the forecast.
  for (const auto& amp : a.amplifications()) {
    CHECK_THAT(md, Catch::Contains("| " + cli::MarkdownText(amp.param()) + " | " + Num(amp.norm()) + " | " +
                                   Num(amp.init_norm()) + " | " + Num(amp.amplification()) + "× |"));
  }
  REQUIRE(a.growth_without_decay_size() > 0);
  CHECK_THAT(md, Catch::Contains("The norm of **" + cli::MarkdownText(a.growth_without_decay(0).param()) +
                                 "** (weight decay 0) grew ×" + Num(a.growth_without_decay(0).growth_factor())));
  for (const auto& f : a.forecasts()) {
    if (f.key() != "grad/norm/total") continue;
    CHECK_THAT(md, Catch::Contains("**grad/norm/total** is " + Num(f.current_value()) + " against a threshold of " +
                                   Num(f.threshold())));
    if (f.reachable()) CHECK_THAT(md, Catch::Contains("reaches it at step " + Step(f.at_step())));
  }
  // Every alert that fired, as the alert history has it.
  size_t fired = 0;
  const v1::ListAlertHistoryResponse history = incident.History();
  for (const auto& e : history.entries()) {
    if (e.alert().state() != v1::ALERT_STATE_FIRING) continue;
    ++fired;
    CHECK_THAT(md, Catch::Contains("- **" + cli::MarkdownText(e.alert().name()) + "** fired at step " +
                                   Step(e.alert().step()) + ", value " + Num(e.alert().value()) + ": " +
                                   cli::MarkdownText(Annotation(e.alert(), "summary")) + ". Still firing."));
  }
  CHECK(fired >= 2);
  CHECK_THAT(md, Catch::Contains("## Recommendation\n\n- final\\_norm.weight has weight decay 0"));
}

TEST_CASE("gradwatch report lists the alerts that fired and resolved, from the alert history", "[integration]") {
  TempDir dir("gradwatch-report-resolved");
  const auto path = dir.path() / "run.jsonl";
  {
    // Above 5 from step 50 to 99, back to 1 after: the contingency fires, then resolves.
    std::ofstream out(path);
    for (int step = 1; step <= 200; ++step) {
      out << R"({"_step": )" << step << R"(, "grad/norm/total": )" << (step >= 50 && step < 100 ? 5.5 : 1.0) << "}\n";
    }
  }
  DaemonOptions options;
  options.config_yaml += "alerts: {min_steps_before_page: 0}\n";  // a short run: its first steps page too
  DaemonProcess daemon(options);
  CommandResult r =
      RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", path.string(), "--run", "spiky", "--max"},
                 std::nullopt, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  // The history is written off the ingest path: wait for the resolution.
  std::vector<v1::Alert> changes;  // the contingency's
  REQUIRE(WaitUntil(
      [&] {
        changes.clear();
        const v1::ListAlertHistoryResponse history = AlertHistory(daemon, "spiky");
        for (const auto& e : history.entries()) {
          if (e.alert().name() == "GradNormContingency") changes.push_back(e.alert());
        }
        return !changes.empty() && changes.back().state() == v1::ALERT_STATE_RESOLVED;
      },
      std::chrono::seconds(60)));
  REQUIRE(changes.size() >= 2);
  const v1::Alert& fired = changes[changes.size() - 2];
  const v1::Alert& resolved = changes.back();
  REQUIRE(fired.state() == v1::ALERT_STATE_FIRING);

  const auto out = dir.path() / "report";
  r = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "report", "spiky", "-o", out.string()}, std::nullopt,
                 std::chrono::seconds(120));
  REQUIRE(r.exit_code == 0);
  const std::string md = ReadFile(out / "report.md");
  INFO(md);
  CHECK_THAT(md, Catch::Contains("- **GradNormContingency** fired at step " + Step(fired.step()) + ", value " +
                                 Num(fired.value()) + ": " + cli::MarkdownText(Annotation(fired, "summary")) +
                                 ". Resolved at step " + Step(resolved.step()) + ": " +
                                 cli::MarkdownText(Annotation(resolved, "summary")) + "."));
  CHECK_THAT(md, Catch::Contains("Total grad norm back to"));
  CHECK_THAT(md, Catch::Contains("## Recommendation\n\n- "));
}

TEST_CASE("gradwatch report writes names as text: markup in a parameter's name or an event renders as itself",
          "[integration]") {
  // Found by a hostile pass: a parameter named with an <img onerror> and a <script> went raw into
  // report.md, which Markdown renderers that pass HTML render.
  TempDir dir("gradwatch-report-markup");
  const std::string hostile = "lm_head\"><img src=x onerror=alert(1)><script>alert(2)</script>";
  const auto path = dir.path() / "run.jsonl";
  {
    std::ofstream out(path);
    const nlohmann::json header = {{"run", "markup"},
                                   {"params", {{{"name", hostile}, {"kind", "output"}, {"weight_decay", 0.1}}}}};
    out << header.dump() << "\n";
    for (int step = 1; step <= 300; ++step) {
      nlohmann::json line = {{"_step", step}, {"grad/norm/total", 1.0 + step * 0.001}};
      line["grad/norm/" + hostile] = 1.0 + step * 0.001;
      if (step == 150) line["event"] = "[click](javascript:alert(3)) | <b>bold</b>";
      out << line.dump() << "\n";
    }
  }
  DaemonProcess daemon;
  CommandResult r = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "replay", path.string(), "--max"},
                               std::nullopt, std::chrono::seconds(120));
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const auto out = dir.path() / "report";
  r = RunCommand({CliBinaryPath(), "--addr", daemon.grpc_target(), "report", "markup", "-o", out.string()},
                 std::nullopt, std::chrono::seconds(120));
  REQUIRE(r.exit_code == 0);
  const std::string md = ReadFile(out / "report.md");
  INFO(md);
  CHECK(md.find("<img") == std::string::npos);
  CHECK(md.find("<script") == std::string::npos);
  CHECK(md.find("<b>") == std::string::npos);
  CHECK(md.find("[click](") == std::string::npos);  // escaped when shown: never a link
  CHECK_THAT(md, Catch::Contains(
                     "**lm\\_head\"&gt;&lt;img src=x onerror=alert(1)&gt;&lt;script&gt;alert(2)&lt;/script&gt;**"));
}

#include "client/cli/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "client/cli/commands.h"

namespace gradwatch::cli {

namespace {

// Every number of the report in the CLI's one style (FormatValue), so that a reader (and the
// test) can match it with the Query API's value.
std::string Num(double v) { return FormatValue(v); }

std::string Step(uint64_t v) { return GroupedStep(static_cast<double>(v)); }

std::string Percent(double share) { return Num(share * 100) + " %"; }

// The value of `points` at the last point that starts before `step` (mean of its bucket).
const v1::SeriesPoint* Before(const std::vector<v1::SeriesPoint>& points, uint64_t step) {
  const v1::SeriesPoint* found = nullptr;
  for (const auto& p : points) {
    if (p.step() < step && std::isfinite(p.value())) found = &p;
  }
  return found;
}

// An enum value's name without its prefix, lower-cased: ALERT_STATE_FIRING -> firing.
std::string ShortName(std::string name, std::string_view prefix) {
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name;
}

// MarkdownText, short.
std::string Md(std::string_view text) { return MarkdownText(text); }

}  // namespace

std::string MarkdownText(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '\n':
      case '\r': out += ' '; break;
      case '\\':
      case '`':
      case '*':
      case '_':
      case '[':
      case ']':
      case '|':
      case '~':
        out += '\\';
        out += c;
        break;
      default: out += c;
    }
  }
  return out;
}

namespace {

std::string RunStateName(v1::RunState state) { return ShortName(v1::RunState_Name(state), "RUN_STATE_"); }

}  // namespace

std::string RenderReport(const PlotData& data, const v1::ListAlertsResponse& alerts,
                         const v1::ListAlertHistoryResponse& history, const std::string& daemon) {
  const v1::RunSummary& s = data.summary;
  const v1::Analysis& a = s.analysis();
  std::ostringstream md;
  md << "# " << Md(s.info().run_id()) << ": what the gradients did\n\n";
  md << "From gradwatchd at " << daemon << ": steps " << Step(s.info().first_step()) << " to "
     << Step(s.info().last_step()) << " (" << Step(s.info().step_count()) << " held), run "
     << RunStateName(s.info().state()) << ". Every number below is the daemon's analysis "
     << "(`gradwatch show " << s.info().run_id() << " --json`), rounded to three digits.\n\n";
  md << "![total grad norm](total-grad-norm.svg)\n\n";
  if (!data.final_param.empty()) md << "![norm of " << Md(data.final_param) << "](final-norm.svg)\n\n";
  if (s.has_diagnosis()) {
    // The evidence every alert's words come from (the daemon's diagnosis).
    md << "## Diagnosis at step " << Step(s.diagnosis().step()) << "\n\n" << Md(s.diagnosis().text()) << "\n\n";
    if (!s.diagnosis().recommendation().empty()) md << Md(s.diagnosis().recommendation()) << "\n\n";
  }

  md << "## What grew, and since when\n\n";
  bool grew = false;
  for (const auto& g : a.growth_without_decay()) {
    grew = true;
    md << "- The norm of **" << Md(g.param()) << "** (weight decay 0) grew ×" << Num(g.growth_factor())
       << " over the last " << Step(g.window_steps()) << " steps, at " << Num(g.slope_per_kstep())
       << " per 1k steps; it is now " << Num(g.norm());
    if (std::isfinite(g.amplification())) md << ", " << Num(g.amplification()) << "× its initial norm";
    md << ".\n";
  }
  const std::string final_key = "params/norm/" + data.final_param;
  for (const auto& c : a.slope_changes()) {
    if (c.key() != final_key) continue;
    const v1::SeriesPoint* at = Before(data.final, c.event_step());
    double init = NAN;
    for (const auto& amp : a.amplifications()) {
      if (amp.param() == data.final_param) init = amp.init_norm();
    }
    if (at != nullptr) {
      grew = true;
      md << "- The norm of **" << Md(data.final_param) << "** had reached " << Num(at->value());
      if (std::isfinite(init) && init > 0)
        md << " (" << Num(at->value() / init) << "× its initial norm " << Num(init) << ")";
      md << " before step " << Step(c.event_step()) << " (" << Md(c.event_text()) << "); the event changed its slope ×"
         << Num(c.ratio()) << ", from " << Num(c.before_per_kstep()) << " to " << Num(c.after_per_kstep())
         << " per 1k steps.\n";
    }
  }
  if (!grew) md << "Nothing grew without weight decay.\n";
  md << "\n## Where the total grad norm comes from\n\n";
  if (a.shares().empty()) md << "No attribution: the run reports no per-parameter grad norms.\n";
  int listed = 0;
  for (const auto& share : a.shares()) {
    if (listed++ == 5) break;
    md << "- " << (share.is_group() ? "group " : "") << "**" << Md(share.name()) << "** carries "
       << Percent(share.share()) << " of the squared total grad norm (trend " << Num(share.slope_per_kstep() * 100)
       << " points per 1k steps).\n";
  }
  md << "\n## Amplification\n\n";
  if (a.amplifications().empty()) {
    md << "No norm gain with a known initial norm.\n";
  } else {
    md << "| parameter | norm | initial norm | amplification |\n| --- | ---: | ---: | ---: |\n";
    for (const auto& amp : a.amplifications()) {
      md << "| " << Md(amp.param()) << " | " << Num(amp.norm()) << " | " << Num(amp.init_norm()) << " | "
         << Num(amp.amplification()) << "× |\n";
    }
  }
  md << "\n## Slope changes at events\n\n";
  if (a.slope_changes().empty()) {
    md << "No event, or no slope measured around one.\n";
  } else {
    md << "| series | event | before (per 1k steps) | after (per 1k steps) | ratio |\n| --- | --- | ---: | ---: | ---: "
          "|\n";
    for (const auto& c : a.slope_changes()) {
      md << "| " << Md(c.key()) << " | step " << Step(c.event_step()) << ": " << Md(c.event_text()) << " | "
         << Num(c.before_per_kstep()) << " | " << Num(c.after_per_kstep()) << " | ×" << Num(c.ratio()) << " |\n";
    }
  }
  md << "\n## Forecast\n\n";
  bool forecast = false;
  for (const auto& f : a.forecasts()) {
    forecast = true;
    md << "- **" << Md(f.key()) << "** is " << Num(f.current_value()) << " against a threshold of "
       << Num(f.threshold()) << ": ";
    if (f.reachable()) {
      md << "at " << Num(f.slope_per_kstep()) << " per 1k steps it reaches it at step " << Step(f.at_step()) << ", "
         << Step(static_cast<uint64_t>(std::llround(f.steps_to_threshold()))) << " steps after the last one.\n";
    } else {
      md << "not rising, so it does not reach it at this slope.\n";
    }
  }
  if (!forecast) md << "No forecast configured for this run's series.\n";
  if (a.projections_size() > 0 || a.remediations_size() > 0) {
    md << "\n## Weight decay: what-if and remediations\n\n";
    for (const auto& p : a.projections()) {
      md << "- With weight decay " << Num(p.weight_decay()) << " from step " << Step(p.from_step()) << ", **"
         << Md(p.param()) << "** goes from " << Num(p.norm_now()) << " to ~" << Num(p.norm()) << " by step "
         << Step(p.to_step());
      if (std::isfinite(p.equilibrium_norm())) {
        md << " (equilibrium ~" << Num(p.equilibrium_norm()) << ", time constant ~"
           << Step(static_cast<uint64_t>(std::llround(p.time_constant_steps()))) << " steps)";
      }
      if (std::isfinite(p.total_grad_norm())) {
        md << "; if the output layer's gradient scales with its norm, the total grad norm reaches ~"
           << Num(p.total_grad_norm());
      }
      md << " (learning rate " << Num(p.learning_rate())
         << (p.schedule().empty() ? " held" : " now, " + Md(p.schedule())) << "; the update's "
         << (p.orthogonal_known() ? "radial and rotational parts" : "radial part") << " held, the radial part "
         << (p.radial_known() ? "as the trainer reports it" : "from the norm's slope") << ").\n";
    }
    for (const auto& r : a.remediations()) {
      md << "- **" << Md(r.param()) << "**: weight decay " << Num(r.previous_weight_decay()) << " → "
         << Num(r.weight_decay()) << " from step " << Step(r.step()) << " (norm " << Num(r.norm_at_step())
         << "); at step " << Step(r.at_step()) << " it is " << Num(r.actual_norm()) << " against ~"
         << Num(r.projected_norm()) << " projected and ~" << Num(r.unchanged_norm()) << " without the change: **"
         << Md(r.verdict()) << "**.\n";
    }
  }
  md << "\n## Alerts\n\n";
  // Each alert's latest recommendation: as it is now for the alerts still active, as it was when
  // it last fired for the others; the same text once.
  std::vector<std::pair<std::string, std::string>> by_alert;  // fingerprint, recommendation
  auto recommend = [&](const v1::Alert& alert) {
    const auto it = alert.annotations().find("recommendation");
    if (it == alert.annotations().end()) return;
    auto known =
        std::find_if(by_alert.begin(), by_alert.end(), [&](const auto& r) { return r.first == alert.fingerprint(); });
    if (known == by_alert.end()) {
      by_alert.emplace_back(alert.fingerprint(), it->second);
    } else {
      known->second = it->second;
    }
  };
  auto annotation = [](const v1::Alert& alert, const std::string& name) {
    const auto it = alert.annotations().find(name);
    return it == alert.annotations().end() ? std::string() : it->second;
  };
  // Every time an alert fired, from the alert history, with how it ended.
  size_t fired = 0;
  const auto& entries = history.entries();
  // The next change of the same alert after each entry (one pass from the end), or -1.
  std::vector<int> next(static_cast<size_t>(entries.size()), -1);
  std::unordered_map<std::string, int> later;
  for (int i = entries.size() - 1; i >= 0; --i) {
    auto [it, fresh] = later.try_emplace(entries[i].alert().fingerprint(), i);
    if (!fresh) {
      next[static_cast<size_t>(i)] = it->second;
      it->second = i;
    }
  }
  for (int i = 0; i < entries.size(); ++i) {
    const v1::Alert& alert = entries[i].alert();
    if (alert.state() != v1::ALERT_STATE_FIRING) continue;
    ++fired;
    md << "- **" << Md(alert.name()) << "** fired at step " << Step(alert.step()) << ", value " << Num(alert.value());
    if (const std::string summary = annotation(alert, "summary"); !summary.empty()) md << ": " << Md(summary);
    const int j = next[static_cast<size_t>(i)];
    const v1::Alert* end = j < 0 ? nullptr : &entries[j].alert();
    if (end != nullptr && end->state() == v1::ALERT_STATE_RESOLVED) {
      md << ". Resolved at step " << Step(end->step());
      if (const std::string summary = annotation(*end, "summary"); !summary.empty()) md << ": " << Md(summary);
    } else {
      md << ". Still firing";
    }
    md << ".\n";
    recommend(alert);
  }
  for (const auto& alert : alerts.alerts()) {
    if (alert.state() != v1::ALERT_STATE_PENDING) continue;
    md << "- **" << Md(alert.name()) << "** pending since step " << Step(alert.step()) << ", value "
       << Num(alert.value());
    if (const std::string summary = annotation(alert, "summary"); !summary.empty()) md << ": " << Md(summary);
    md << ".\n";
  }
  for (const auto& alert : alerts.alerts()) recommend(alert);
  if (fired == 0 && alerts.alerts().empty()) md << "No alert fired, and none is pending.\n";
  std::vector<std::string> recommendations;
  for (const auto& [fingerprint, text] : by_alert) {
    if (std::find(recommendations.begin(), recommendations.end(), text) == recommendations.end()) {
      recommendations.push_back(text);
    }
  }
  md << "\n## Recommendation\n\n";
  if (recommendations.empty()) md << "No alert carries a recommendation.\n";
  for (const std::string& r : recommendations) md << "- " << Md(r) << "\n";
  return md.str();
}

int RunReport(const GlobalOptions& global, client::QueryClient& query, const std::string& run,
              const std::string& directory, std::ostream& out, std::ostream& err) {
  PlotData data;
  std::string what;
  if (grpc::Status s = FetchPlotData(query, run, 2000, &data, &what); !s.ok()) {
    return ReportRpcError(global, what, s, err, [&] { return NotFoundHint(query, run); });
  }
  auto alerts = query.ListAlerts(run);
  if (!alerts.ok()) return ReportRpcError(global, "alerts of run " + run, alerts.status, err);
  auto history = query.ListAlertHistory(run, 10000);
  if (!history.ok()) return ReportRpcError(global, "alert history of run " + run, history.status, err);
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    err << "gradwatch report: cannot create " << directory << ": " << ec.message() << "\n";
    return kExitFailure;
  }
  const std::filesystem::path dir(directory);
  std::vector<std::pair<std::filesystem::path, std::string>> files = {
      {dir / "report.md", RenderReport(data, alerts.response, history.response, global.address)},
      {dir / "total-grad-norm.svg", RenderChartSvg(data, "total")}};
  if (!data.final_param.empty()) files.emplace_back(dir / "final-norm.svg", RenderChartSvg(data, "final"));
  for (const auto& [path, text] : files) {
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.flush()) {
      err << "gradwatch report: cannot write " << path.string() << "\n";
      return kExitFailure;
    }
  }
  if (global.json) {
    nlohmann::ordered_json written = nlohmann::ordered_json::array();
    for (const auto& f : files) written.push_back(f.first.string());
    out << nlohmann::ordered_json{{"run", run}, {"files", written}}.dump(2) << "\n";
  } else {
    out << "wrote " << (dir / "report.md").string() << " and its charts\n";
  }
  return kExitOk;
}

}  // namespace gradwatch::cli

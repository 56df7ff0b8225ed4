#include "client/cli/plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "client/cli/commands.h"

namespace gradwatch::cli {

namespace {

constexpr const char* kTotalKey = "grad/norm/total";
constexpr double kWidth = 900, kHeight = 340;
constexpr double kLeft = 78, kRight = 20, kTop = 40, kBottom = 40;

std::string Escape(std::string_view text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v, int digits = 4) {
  if (!std::isfinite(v)) return v != v ? "NaN" : (v > 0 ? "+Inf" : "-Inf");
  if (v == 0) return "0";
  char text[32];
  const double a = std::fabs(v);
  if (a != 0 && (a >= 1e6 || a < 1e-3)) {
    std::snprintf(text, sizeof text, "%.2e", v);
  } else {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
  }
  return text;
}

std::string Step(double v) { return GroupedStep(v); }

std::vector<double> Ticks(double lo, double hi, int count) {
  std::vector<double> out;
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / count;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * power;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * power >= raw) {
      step = m * power;
      break;
    }
  }
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    out.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  }
  return out;
}

struct Line {
  double x0, y0, x1, y1;
  std::string cls, label;
};

struct Chart {
  std::string title, note;
  const std::vector<v1::SeriesPoint>* points = nullptr;
  std::vector<std::pair<double, std::string>> hlines;  // threshold lines
  std::vector<Line> segments;
  std::vector<std::pair<double, std::string>> events;
};

// A chart drawn at vertical offset `top` into `svg`.
void Draw(std::ostringstream& svg, const Chart& c, double top) {
  const auto& pts = *c.points;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& p : pts) {
    if (!std::isfinite(p.value())) continue;
    x0 = std::min(x0, static_cast<double>(p.step()));
    x1 = std::max(x1, static_cast<double>(p.last_step()));
    for (double v : {p.min(), p.max(), p.value()}) {
      if (std::isfinite(v)) y0 = std::min(y0, v), y1 = std::max(y1, v);
    }
  }
  for (const auto& [y, label] : c.hlines) y0 = std::min(y0, y), y1 = std::max(y1, y);
  // A forecast may reach far beyond the data: the axis goes at most half the data's span further,
  // and a longer segment is cut there (its label still says where it ends).
  const double x_limit = x1 + (x1 - x0) * 0.5;
  std::vector<Line> segments = c.segments;
  for (Line& l : segments) {
    if (l.x1 > x_limit && l.x1 > l.x0) {
      l.y1 = l.y0 + (l.y1 - l.y0) * (x_limit - l.x0) / (l.x1 - l.x0);
      l.x1 = x_limit;
    }
    x1 = std::max(x1, l.x1);
    y0 = std::min({y0, l.y0, l.y1});
    y1 = std::max({y1, l.y0, l.y1});
  }
  svg << "<text class=\"title\" x=\"" << kLeft << "\" y=\"" << top + 18 << "\">" << Escape(c.title) << "</text>\n";
  svg << "<text class=\"note\" x=\"" << kLeft << "\" y=\"" << top + 33 << "\">" << Escape(c.note) << "</text>\n";
  if (!std::isfinite(x0) || !std::isfinite(y0)) {
    svg << "<text class=\"note\" x=\"" << kWidth / 2 << "\" y=\"" << top + kHeight / 2 << "\">no data</text>\n";
    return;
  }
  if (x1 <= x0) x1 = x0 + 1;
  if (!(y1 > y0)) y0 -= 1, y1 += 1;
  const double margin = (y1 - y0) * 0.06;
  y0 -= margin;
  y1 += margin;
  const double plot_top = top + kTop, plot_bottom = top + kHeight - kBottom;
  auto X = [&](double v) { return kLeft + (v - x0) / (x1 - x0) * (kWidth - kLeft - kRight); };
  auto Y = [&](double v) { return plot_bottom - (v - y0) / (y1 - y0) * (plot_bottom - plot_top); };
  char buf[128];
  for (double t : Ticks(y0, y1, 5)) {
    std::snprintf(buf, sizeof buf, "%.1f", Y(t));
    svg << "<line class=\"grid\" x1=\"" << kLeft << "\" x2=\"" << kWidth - kRight << "\" y1=\"" << buf << "\" y2=\""
        << buf << "\"/><text class=\"tick\" x=\"" << kLeft - 6 << "\" y=\"" << Y(t) + 4 << "\" text-anchor=\"end\">"
        << Num(t, 3) << "</text>\n";
  }
  for (double t : Ticks(x0, x1, 6)) {
    svg << "<text class=\"tick\" x=\"" << X(t) << "\" y=\"" << plot_bottom + 16 << "\" text-anchor=\"middle\">"
        << Step(t) << "</text>\n";
  }
  svg << "<path class=\"axis\" d=\"M" << kLeft << "," << plot_top << "V" << plot_bottom << "H" << kWidth - kRight
      << "\"/>\n";
  bool banded = false;
  for (const auto& p : pts) banded = banded || (p.count() > 1 && p.max() > p.min());
  if (banded) {
    svg << "<polygon class=\"band\" points=\"";
    for (const auto& p : pts) {
      if (std::isfinite(p.max())) svg << X(static_cast<double>(p.step())) << "," << Y(p.max()) << " ";
    }
    for (auto it = pts.rbegin(); it != pts.rend(); ++it) {
      if (std::isfinite(it->min())) svg << X(static_cast<double>(it->step())) << "," << Y(it->min()) << " ";
    }
    svg << "\"/>\n";
  }
  svg << "<path class=\"series\" d=\"";
  bool first = true;
  for (const auto& p : pts) {
    if (!std::isfinite(p.value())) continue;
    std::snprintf(buf, sizeof buf, "%s%.1f,%.1f", first ? "M" : "L", X(static_cast<double>(p.step())), Y(p.value()));
    svg << buf;
    first = false;
  }
  svg << "\"/>\n";
  for (const Line& l : segments) {
    svg << "<line class=\"" << l.cls << "\" x1=\"" << X(l.x0) << "\" y1=\"" << Y(l.y0) << "\" x2=\"" << X(l.x1)
        << "\" y2=\"" << Y(l.y1) << "\"/>";
    if (!l.label.empty()) {
      svg << "<text class=\"" << l.cls << "-label\" x=\"" << X(l.x1) - 4 << "\" y=\"" << Y(l.y1) + 16
          << "\" text-anchor=\"end\">" << Escape(l.label) << "</text>";
    }
    svg << "\n";
  }
  for (const auto& [y, label] : c.hlines) {
    svg << "<line class=\"threshold\" x1=\"" << kLeft << "\" x2=\"" << kWidth - kRight << "\" y1=\"" << Y(y)
        << "\" y2=\"" << Y(y) << "\"/><text class=\"threshold-label\" x=\"" << kLeft + 6 << "\" y=\"" << Y(y) - 5
        << "\">" << Escape(label) << "</text>\n";
  }
  for (const auto& [x, label] : c.events) {
    if (x < x0 || x > x1) continue;
    svg << "<line class=\"event\" x1=\"" << X(x) << "\" x2=\"" << X(x) << "\" y1=\"" << plot_top << "\" y2=\""
        << plot_bottom << "\"/><text class=\"event-label\" x=\"" << X(x) + 4 << "\" y=\"" << plot_bottom - 6 << "\">"
        << Escape(label) << " (step " << Step(x) << ")</text>\n";
  }
}

// A least-squares line with the daemon's slope through the centroid of the points in [lo, hi).
bool Fit(const std::vector<v1::SeriesPoint>& points, double lo, double hi, double slope_per_kstep, Line* line) {
  double sx = 0, sy = 0, a = std::numeric_limits<double>::infinity(), b = -a;
  int n = 0;
  for (const auto& p : points) {
    const double x = static_cast<double>(p.step());
    if (x < lo || x >= hi || !std::isfinite(p.value())) continue;
    sx += x;
    sy += p.value();
    a = std::min(a, x);
    b = std::max(b, x);
    ++n;
  }
  if (n < 2 || !std::isfinite(slope_per_kstep)) return false;
  const double mx = sx / n, my = sy / n, slope = slope_per_kstep / 1000;
  line->x0 = a;
  line->y0 = my + slope * (a - mx);
  line->x1 = b;
  line->y1 = my + slope * (b - mx);
  return true;
}

std::vector<std::pair<double, std::string>> Events(const v1::RunSummary& s) {
  std::vector<std::pair<double, std::string>> out;
  for (const auto& e : s.events()) out.emplace_back(static_cast<double>(e.step()), e.text());
  return out;
}

Chart TotalChart(const PlotData& d) {
  Chart c;
  c.title = "Total grad norm — " + d.summary.info().run_id();
  c.note = "mean per point; band: min–max where a point covers several steps";
  c.points = &d.total;
  c.events = Events(d.summary);
  for (const auto& f : d.summary.analysis().forecasts()) {
    if (f.key() != kTotalKey) continue;
    c.hlines.emplace_back(f.threshold(), "threshold " + Num(f.threshold()));
    if (f.reachable()) {
      c.segments.push_back({static_cast<double>(d.summary.info().last_step()), f.current_value(),
                            static_cast<double>(f.at_step()), f.threshold(), "forecast",
                            "reaches " + Num(f.threshold()) + " at step " + Step(static_cast<double>(f.at_step()))});
      c.note +=
          "; at " + Num(f.slope_per_kstep()) + " per 1k steps it crosses in " + Step(f.steps_to_threshold()) + " steps";
    }
  }
  return c;
}

Chart FinalChart(const PlotData& d) {
  Chart c;
  c.title = "Norm of " + d.final_param;
  c.points = &d.final;
  c.events = Events(d.summary);
  c.note = "lines: the daemon's slopes before (green) and after (red) each event";
  const std::string key = "params/norm/" + d.final_param;
  std::vector<const v1::SlopeChangeAtEvent*> changes;
  for (const auto& ch : d.summary.analysis().slope_changes()) {
    if (ch.key() == key) changes.push_back(&ch);
  }
  std::sort(changes.begin(), changes.end(), [](auto* a, auto* b) { return a->event_step() < b->event_step(); });
  const double first = d.final.empty() ? 0 : static_cast<double>(d.final.front().step());
  const double last = d.final.empty() ? 0 : static_cast<double>(d.final.back().last_step()) + 1;
  for (size_t i = 0; i < changes.size(); ++i) {
    const double at = static_cast<double>(changes[i]->event_step());
    const double lo = i > 0 ? static_cast<double>(changes[i - 1]->event_step()) : first;
    const double hi = i + 1 < changes.size() ? static_cast<double>(changes[i + 1]->event_step()) : last;
    Line before{0, 0, 0, 0, "fit-before", Num(changes[i]->before_per_kstep(), 3) + " per 1k"};
    if (Fit(d.final, lo, at, changes[i]->before_per_kstep(), &before)) c.segments.push_back(before);
    Line after{0,           0,
               0,           0,
               "fit-after", Num(changes[i]->after_per_kstep(), 3) + " per 1k (x" + Num(changes[i]->ratio(), 2) + ")"};
    if (Fit(d.final, at, hi, changes[i]->after_per_kstep(), &after)) c.segments.push_back(after);
  }
  for (const auto& a : d.summary.analysis().amplifications()) {
    if (a.param() == d.final_param) {
      c.note += "; now " + Num(a.norm()) + ", " + Num(a.amplification(), 3) + "x its initial norm";
    }
  }
  return c;
}

const char* kStyle =
    "<style>text{font:12px sans-serif;fill:#1d2430}.title{font-size:15px;font-weight:bold}.note{fill:#6b7380}"
    ".tick{fill:#6b7380;font-size:11px}.grid{stroke:#eef0f3}.axis{fill:none;stroke:#b8bec8}"
    ".series{fill:none;stroke:#2563eb;stroke-width:1.5}.band{fill:#2563eb;fill-opacity:0.16}"
    ".threshold{stroke:#dc2626;stroke-dasharray:6 4}.threshold-label{fill:#dc2626}"
    ".forecast{stroke:#d97706;stroke-width:1.5;stroke-dasharray:3 3}.forecast-label{fill:#d97706}"
    ".event{stroke:#7c3aed;stroke-dasharray:2 3}.event-label{fill:#7c3aed}"
    ".fit-before{stroke:#059669;stroke-width:2.5;stroke-opacity:0.8;stroke-dasharray:10 "
    "5}.fit-before-label{fill:#059669}"
    ".fit-after{stroke:#dc2626;stroke-width:2.5;stroke-opacity:0.8;stroke-dasharray:10 5}.fit-after-label{fill:#dc2626}"
    "</style>\n";

std::string Document(const std::vector<Chart>& charts) {
  std::ostringstream svg;
  const double height = kHeight * static_cast<double>(charts.size());
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << kWidth << " " << height << "\">\n"
      << kStyle << "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  for (size_t i = 0; i < charts.size(); ++i) Draw(svg, charts[i], kHeight * static_cast<double>(i));
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace

std::string PickFinalParam(const v1::RunSummary& summary) {
  for (const auto& p : summary.params()) {
    if (p.role() == "final_norm") return p.name();
  }
  const v1::NormAmplification* best = nullptr;
  for (const auto& a : summary.analysis().amplifications()) {
    if (best == nullptr || a.amplification() > best->amplification()) best = &a;
  }
  if (best != nullptr) return best->param();
  if (summary.analysis().growth_without_decay_size() > 0) return summary.analysis().growth_without_decay(0).param();
  for (const auto& p : summary.params()) {
    if (p.kind() == v1::PARAM_KIND_NORM_GAIN) return p.name();
  }
  return "";
}

grpc::Status FetchPlotData(client::QueryClient& query, const std::string& run, uint32_t max_points, PlotData* data,
                           std::string* what) {
  auto summary = query.GetRun(run);
  if (!summary.ok()) {
    *what = "run " + run;
    return summary.status;
  }
  data->summary = std::move(summary.response);
  data->final_param = PickFinalParam(data->summary);
  auto read = [&](const std::string& key, std::vector<v1::SeriesPoint>* out) {
    v1::GetSeriesRequest request;
    request.set_run_id(run);
    request.set_key(key);
    request.set_max_points(max_points);
    auto series = query.GetSeries(request);
    if (!series.ok()) {
      *what = "series " + key + " of run " + run;
      return series.status;
    }
    out->assign(series.response.points().begin(), series.response.points().end());
    return grpc::Status::OK;
  };
  if (grpc::Status s = read(kTotalKey, &data->total); !s.ok()) return s;
  if (!data->final_param.empty()) {
    if (grpc::Status s = read("params/norm/" + data->final_param, &data->final); !s.ok()) return s;
  }
  return grpc::Status::OK;
}

std::string RenderChartSvg(const PlotData& data, const std::string& which) {
  return Document({which == "final" ? FinalChart(data) : TotalChart(data)});
}

std::string RenderPlotSvg(const PlotData& data) {
  std::vector<Chart> charts = {TotalChart(data)};
  if (!data.final_param.empty()) charts.push_back(FinalChart(data));
  return Document(charts);
}

int RunPlot(const GlobalOptions& global, client::QueryClient& query, const std::string& run, const std::string& output,
            std::ostream& out, std::ostream& err) {
  const bool png = output.size() > 4 && output.substr(output.size() - 4) == ".png";
  const bool svg = output.size() > 4 && output.substr(output.size() - 4) == ".svg";
  if (!png && !svg) {
    err << "gradwatch plot: -o must name a .svg or .png file, not '" << output << "'\n";
    return kExitUsage;
  }
  PlotData data;
  std::string what;
  if (grpc::Status s = FetchPlotData(query, run, 2000, &data, &what); !s.ok()) {
    return ReportRpcError(global, what, s, err, [&] { return NotFoundHint(query, run); });
  }
  const std::string document = RenderPlotSvg(data);
  const std::string svg_path = png ? output + ".svg.tmp" : output;
  {
    std::ofstream file(svg_path, std::ios::binary | std::ios::trunc);
    file << document;
    if (!file.flush()) {
      err << "gradwatch plot: cannot write " << svg_path << "\n";
      return kExitFailure;
    }
  }
  if (png) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execlp("rsvg-convert", "rsvg-convert", "--format", "png", "--output", output.c_str(), svg_path.c_str(),
               static_cast<char*>(nullptr));
      ::_exit(127);
    }
    int status = 0;
    if (pid > 0) ::waitpid(pid, &status, 0);
    std::remove(svg_path.c_str());
    if (pid < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      err << "gradwatch plot: cannot make " << output
          << (pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 127
                  ? ": rsvg-convert is not installed (apt-get install librsvg2-bin), or write .svg"
                  : ": rsvg-convert failed")
          << "\n";
      return kExitFailure;
    }
  }
  if (global.json) {
    out << nlohmann::ordered_json{{"run", run},
                                  {"file", output},
                                  {"total_points", data.total.size()},
                                  {"final_param", data.final_param},
                                  {"final_points", data.final.size()}}
               .dump(2)
        << "\n";
  } else {
    out << "wrote " << output << ": total grad norm (" << data.total.size() << " points)";
    if (!data.final_param.empty()) out << " and " << data.final_param << " (" << data.final.size() << " points)";
    out << "\n";
  }
  return kExitOk;
}

}  // namespace gradwatch::cli

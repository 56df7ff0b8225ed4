// `gradwatch plot RUN -o FILE.svg|.png`: the run view's two main charts, drawn offline for
// post-mortems and issue threads: the total grad norm with its threshold, forecast and events, and
// the final norm gain's norm with the daemon's slopes before and after each event.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "client/cli/format.h"
#include "client/cli/options.h"
#include "gradwatch/query_client.h"
#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

// What the charts are drawn from.
struct PlotData {
  v1::RunSummary summary;
  std::vector<v1::SeriesPoint> total;  // grad/norm/total
  std::string final_param;             // the norm gain charted with its slopes; empty: none
  std::vector<v1::SeriesPoint> final;  // params/norm/<final_param>
};

// The norm gain whose slopes are charted: role final_norm, else the most amplified norm gain,
// else the first parameter that grew without weight decay; empty when none.
std::string PickFinalParam(const v1::RunSummary& summary);

// Reads the summary and the two series (at most `max_points` points each) into `data`. On an
// error, `what` says which call failed.
grpc::Status FetchPlotData(client::QueryClient& query, const std::string& run, uint32_t max_points, PlotData* data,
                           std::string* what);

// One chart as a standalone SVG document: "total" or "final".
std::string RenderChartSvg(const PlotData& data, const std::string& which);

// Both charts, one above the other, as one SVG document.
std::string RenderPlotSvg(const PlotData& data);

// `gradwatch plot`: writes FILE.svg, or FILE.png through rsvg-convert (librsvg2-bin).
int RunPlot(const GlobalOptions& global, client::QueryClient& query, const std::string& run, const std::string& output,
            std::ostream& out, std::ostream& err);

}  // namespace gradwatch::cli

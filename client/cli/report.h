// `gradwatch report RUN -o DIR`: the incident write-up people otherwise write by hand, from the
// daemon's analysis only: DIR/report.md with what grew and since when, where the grad norm comes
// from, amplification, slope changes at events, the forecast, every alert that fired (resolved ones
// too, from the alert history) or is pending, and the recommendation,
// and beside it the charts of `gradwatch plot` as DIR/total-grad-norm.svg and DIR/final-norm.svg.
#pragma once

#include <ostream>
#include <string>

#include "client/cli/options.h"
#include "client/cli/plot.h"
#include "client/lib/query_client.h"

namespace gradwatch::cli {

// The Markdown text of the report (its charts named as RunReport writes them).
std::string RenderReport(const PlotData& data, const v1::ListAlertsResponse& alerts,
                         const v1::ListAlertHistoryResponse& history, const std::string& daemon);

int RunReport(const GlobalOptions& global, client::QueryClient& query, const std::string& run,
              const std::string& directory, std::ostream& out, std::ostream& err);

}  // namespace gradwatch::cli

// `gradwatch report RUN -o DIR`: the incident write-up people otherwise write by hand, from the
// daemon's analysis only: DIR/report.md with what grew and since when, where the grad norm comes
// from, amplification, slope changes at events, the forecast, every alert that fired (resolved ones
// too, from the alert history) or is pending, and the recommendation,
// and beside it the charts of `gradwatch plot` as DIR/total-grad-norm.svg and DIR/final-norm.svg.
#pragma once

#include <ostream>
#include <string>
#include <string_view>

#include "client/cli/options.h"
#include "client/cli/plot.h"
#include "gradwatch/query_client.h"

namespace gradwatch::cli {

// Text from the run (names, event texts, summaries, the daemon's words) as literal Markdown:
// HTML's specials become entities and Markdown's emphasis, code, link and table punctuation is
// backslash-escaped, line breaks become spaces. No name can open a tag, a link or a table cell,
// whatever renderer reads report.md.
std::string MarkdownText(std::string_view text);

// The Markdown text of the report (its charts named as RunReport writes them); every text from
// the run goes through MarkdownText.
std::string RenderReport(const PlotData& data, const v1::ListAlertsResponse& alerts,
                         const v1::ListAlertHistoryResponse& history, const std::string& daemon);

int RunReport(const GlobalOptions& global, client::QueryClient& query, const std::string& run,
              const std::string& directory, std::ostream& out, std::ostream& err);

}  // namespace gradwatch::cli

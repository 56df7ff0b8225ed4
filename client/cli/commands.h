// The query subcommands. Each returns the process exit code.
#pragma once

#include <functional>

#include <grpcpp/support/status.h>

#include <cstdint>
#include <ostream>
#include <string>

#include "client/cli/options.h"
#include "gradwatch/query_client.h"

namespace gradwatch::cli {

struct SeriesOptions {
  std::string run;
  std::string key;
  uint64_t from_step = 0;
  uint64_t to_step = 0;  // 0: to the end
  uint32_t max_points = 0;
};

// `gradwatch runs [--all]`: with `all`, runs that left memory but are in the journal too
// (state archived).
int RunRuns(const GlobalOptions& global, client::QueryClient& query, bool all, std::ostream& out, std::ostream& err);
int RunShow(const GlobalOptions& global, client::QueryClient& query, const std::string& run, std::ostream& out,
            std::ostream& err);
int RunSeries(const GlobalOptions& global, client::QueryClient& query, const SeriesOptions& options, std::ostream& out,
              std::ostream& err);
// `gradwatch alerts [RUN]`: pending and firing alerts.
// With `history`, every state change (the alert history) instead.
int RunAlerts(const GlobalOptions& global, client::QueryClient& query, const std::string& run, bool history,
              std::ostream& out, std::ostream& err);
// `gradwatch rules check [FILE...] [--config CONFIG]`: loads the files as the daemon would; with a
// daemon configuration, the rules it would load (built-in unless alerts.default_rules is false,
// alerts.rule_files, then FILEs) with its alerts.overrides applied. Exit 1 with file:line errors
// when one is invalid. Needs no daemon.
int RunRulesCheck(const GlobalOptions& global, const std::vector<std::string>& files, const std::string& config,
                  std::ostream& out, std::ostream& err);
// `gradwatch rules reload`: the daemon reloads its rule files, or says why it kept the old ones.
int RunRulesReload(const GlobalOptions& global, client::QueryClient& query, std::ostream& out, std::ostream& err);

struct SilenceOptions {
  std::vector<std::string> matchers;  // name=value, name!=value, name=~regex, name!~regex
  double duration_seconds = 3600;
  std::string comment;
  std::string by;
};
// `gradwatch silence add|list|remove`.
int RunSilenceAdd(const GlobalOptions& global, client::QueryClient& query, const SilenceOptions& options,
                  std::ostream& out, std::ostream& err);
int RunSilenceList(const GlobalOptions& global, client::QueryClient& query, std::ostream& out, std::ostream& err);
// A silence's matchers as `silence add` takes them (run=moe-6b, alertname=~"Grad.*").
std::vector<std::string> SilenceMatcherTexts(const v1::Silence& silence);
int RunSilenceRemove(const GlobalOptions& global, client::QueryClient& query, const std::string& id, std::ostream& out,
                     std::ostream& err);
// `gradwatch ack FINGERPRINT`: a firing alert is not re-notified until it resolves.
int RunAck(const GlobalOptions& global, client::QueryClient& query, const std::string& fingerprint,
           const std::string& by, const std::string& comment, std::ostream& out, std::ostream& err);
int RunAnnotate(const GlobalOptions& global, client::QueryClient& query, const std::string& run, uint64_t step,
                const std::string& text, std::ostream& out, std::ostream& err);

// Explains a failed call on `err` ("cannot reach the daemon at ...") and returns kExitFailure.
// For NOT_FOUND, `hint` (when set) adds what to do instead (NotFoundHint).
int ReportRpcError(const GlobalOptions& global, const std::string& what, const grpc::Status& status, std::ostream& err,
                   const std::function<std::string()>& hint = {});

// What to say when `run` (or its series `key`) was not found: the closest run or series the
// daemon has ("did you mean ..."), or where to look.
std::string NotFoundHint(client::QueryClient& query, const std::string& run, const std::string& key = "");

}  // namespace gradwatch::cli

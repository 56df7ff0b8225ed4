#include "client/cli/commands.h"

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>

#include "alerts/matcher.h"
#include "alerts/rules.h"
#include "client/cli/format.h"
#include "server/core/suggest.h"

namespace gradwatch::cli {

namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::vector<std::string> SilenceMatcherTexts(const v1::Silence& silence) {
  std::vector<std::string> out;
  if (silence.label_matchers().empty()) {  // a daemon that only knows equality matchers
    std::map<std::string, std::string> sorted(silence.matchers().begin(), silence.matchers().end());
    for (const auto& [name, value] : sorted) {
      auto m = alerts::Matcher::Make(name, alerts::MatchType::kEqual, value);
      out.push_back(m.ok() ? m->ToString() : name + "=" + value);
    }
    return out;
  }
  for (const v1::Matcher& m : silence.label_matchers()) {
    const alerts::MatchType type = alerts::MatchTypeFromNumber(m.type()).value_or(alerts::MatchType::kEqual);
    auto matcher = alerts::Matcher::Make(m.name(), type, m.value());
    out.push_back(matcher.ok() ? matcher->ToString() : m.name() + std::string(alerts::MatchOperator(type)) + m.value());
  }
  return out;
}

std::string NotFoundHint(client::QueryClient& query, const std::string& run, const std::string& key) {
  auto summary = query.GetRun(run);
  if (summary.ok()) {
    if (key.empty()) return "";
    std::vector<std::string> keys;
    for (const auto& latest : summary.response.latest()) keys.push_back(latest.key());
    const std::string hint = DidYouMean(key, keys);
    return hint.empty() ? "\n  `gradwatch show " + run + "` lists its series" : hint;
  }
  if (summary.status.error_code() != grpc::StatusCode::NOT_FOUND) return "";
  auto runs = query.ListRuns(/*include_archived=*/true);
  if (!runs.ok()) return "";
  std::vector<std::string> ids;
  for (const auto& r : runs.response.runs()) ids.push_back(r.run_id());
  if (ids.empty()) return "\n  the daemon holds no run yet";
  const std::string hint = DidYouMean(run, ids);
  return hint.empty() ? "\n  `gradwatch runs --all` lists the runs" : hint;
}

int ReportRpcError(const GlobalOptions& global, const std::string& what, const grpc::Status& status, std::ostream& err,
                   const std::function<std::string()>& hint) {
  err << "gradwatch: ";
  // A failed TLS handshake comes back as UNKNOWN: the daemon was not reached either.
  const bool handshake =
      status.error_code() == grpc::StatusCode::UNKNOWN && status.error_message().find("andshake") != std::string::npos;
  switch (handshake ? grpc::StatusCode::UNAVAILABLE : status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE: {
      const std::string& message = status.error_message();
      err << "cannot reach the daemon at " << global.address << ": " << message;
      // What a TLS mismatch looks like from this side: a listener that closes a plain-text
      // connection, or a handshake that fails.
      if (message.find("HTTP/2") != std::string::npos || message.find("http1") != std::string::npos ||
          message.find("HTTP/1") != std::string::npos) {
        err << "\n  (this looks like gradwatchd's HTTP port, for /metrics and the run view; its gRPC listener "
               "is another port, 7390 unless `listen` says otherwise)";
      } else if (message.find("onnection refused") != std::string::npos) {
        err << "\n  (nothing listens there: is gradwatchd running? give its gRPC address with --addr or "
               "GRADWATCH_ADDR)";
      } else if (!global.tls.enabled() && message.find("Socket closed") != std::string::npos) {
        err << "\n  (a daemon with TLS closes plain-text connections: give its CA with --tls-ca, and for mutual "
               "TLS --tls-cert and --tls-key)";
      } else if (message.find("andshake") != std::string::npos) {
        err << "\n  (the TLS handshake failed: "
            << (message.find("certificate verify failed") != std::string::npos
                    ? "the daemon's certificate is not signed by --tls-ca, or does not name this address "
                      "(--tls-server-name), or the daemon refused this client's certificate"
                    : "check --tls-ca, --tls-cert and --tls-key")
            << ")";
      }
      break;
    }
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      err << "no answer from the daemon at " << global.address << " within " << FormatValue(global.timeout_seconds)
          << " s (" << what << ")";
      break;
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      err << what << " refused by the daemon at " << global.address << ": " << status.error_message();
      break;
    case grpc::StatusCode::NOT_FOUND:
      err << what << ": " << (status.error_message().empty() ? "not found" : status.error_message());
      if (hint) err << hint();
      break;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
    case grpc::StatusCode::ALREADY_EXISTS:
      err << "the daemon refused " << what << ": " << status.error_message();
      break;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      err << "the daemon at " << global.address << " is at a limit and refused " << what << ": "
          << status.error_message();
      break;
    default:
      // INTERNAL, UNKNOWN, ...: the daemon's own failure, in its words; the code for a bug report.
      err << what << " failed in the daemon: " << status.error_message() << " (gRPC status "
          << static_cast<int>(status.error_code()) << ")";
      break;
  }
  err << "\n";
  return kExitFailure;
}

int RunAlerts(const GlobalOptions& global, client::QueryClient& query, const std::string& run, bool history,
              std::ostream& out, std::ostream& err) {
  if (!run.empty()) {
    // A run the daemon does not know is an error, not "no alerts": a typo must not look like
    // all-clear.
    auto known = query.GetRun(run);
    if (!known.ok() && known.status.error_code() == grpc::StatusCode::NOT_FOUND) {
      return ReportRpcError(global, "alerts of run " + run, known.status, err,
                            [&] { return NotFoundHint(query, run); });
    }
  }
  if (history) {
    auto changes = query.ListAlertHistory(run);
    if (!changes.ok()) return ReportRpcError(global, "alert history", changes.status, err);
    out << (global.json ? ProtoToJson(changes.response).dump(2) + "\n"
                        : FormatAlertHistory(changes.response, NowSeconds()));
    return kExitOk;
  }
  auto result = query.ListAlerts(run);
  if (!result.ok()) return ReportRpcError(global, "list alerts", result.status, err);
  if (global.json) {
    out << ProtoToJson(result.response).dump(2) << "\n";
  } else {
    out << FormatAlerts(result.response, NowSeconds());
  }
  return kExitOk;
}

namespace {

// The rules a daemon with the configuration at `path` would load, plus `files`, overrides applied.
StatusOr<std::vector<alerts::Rule>> ConfiguredRules(const std::vector<std::string>& files, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot read the configuration");
  std::ostringstream text;
  text << in.rdbuf();
  auto section = alerts::ReadAlertsSection(text.str(), path);
  if (!section.ok()) return section.status();
  std::vector<std::string> all_files = section->rule_files;
  all_files.insert(all_files.end(), files.begin(), files.end());
  return alerts::LoadRulesInForce(section->default_rules, all_files, section->overrides);
}

}  // namespace

int RunRulesCheck(const GlobalOptions& global, const std::vector<std::string>& files, const std::string& config,
                  std::ostream& out, std::ostream& err) {
  auto rules = config.empty() ? alerts::LoadRuleFiles(files) : ConfiguredRules(files, config);
  if (!rules.ok()) {
    if (global.json) {
      out << nlohmann::ordered_json{{"ok", false}, {"error", rules.status().message()}}.dump(2) << "\n";
    }
    err << rules.status().message() << "\n";
    return kExitFailure;
  }
  if (global.json) {
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    for (const alerts::Rule& r : rules.value()) names.push_back(r.name);
    out << nlohmann::ordered_json{{"ok", true}, {"rules", names}}.dump(2) << "\n";
  } else {
    out << rules->size() << " rule(s) OK:";
    for (const alerts::Rule& r : rules.value()) out << " " << r.name;
    out << "\n";
  }
  return kExitOk;
}

int RunRulesReload(const GlobalOptions& global, client::QueryClient& query, std::ostream& out, std::ostream& err) {
  auto result = query.ReloadRules();
  if (!result.ok()) {
    err << "gradwatch: rules not reloaded (the rules in force are unchanged):\n"
        << result.status.error_message() << "\n";
    return kExitFailure;
  }
  if (global.json) {
    out << ProtoToJson(result.response).dump(2) << "\n";
  } else {
    out << "rules reloaded: " << result.response.rule_count() << " rule(s) in force\n";
  }
  return kExitOk;
}

int RunSilenceAdd(const GlobalOptions& global, client::QueryClient& query, const SilenceOptions& options,
                  std::ostream& out, std::ostream& err) {
  v1::Silence silence;
  std::vector<alerts::Matcher> matchers;
  for (const std::string& text : options.matchers) {
    auto m = alerts::Matcher::Parse(text);
    if (!m.ok()) {
      err << "gradwatch: " << m.status().message() << "\n";
      return kExitUsage;
    }
    matchers.push_back(*m);
    // Equality matchers also go in the map, which daemons before `label_matchers` read.
    if (m->type() == alerts::MatchType::kEqual) (*silence.mutable_matchers())[m->name()] = m->value();
    v1::Matcher* out = silence.add_label_matchers();
    out->set_name(m->name());
    out->set_type(static_cast<v1::MatchType>(m->type()));  // numbered alike
    out->set_value(m->value());
  }
  if (Status s = alerts::CheckSilenceMatchers(matchers); !s.ok()) {
    err << "gradwatch: " << s.message() << "\n";
    return kExitUsage;
  }
  const double now = NowSeconds();
  silence.set_starts_at(now);
  silence.set_ends_at(now + options.duration_seconds);
  silence.set_comment(options.comment);
  silence.set_created_by(options.by);
  auto result = query.AddSilence(silence);
  if (!result.ok()) return ReportRpcError(global, "add silence", result.status, err);
  if (global.json) {
    out << ProtoToJson(result.response).dump(2) << "\n";
  } else {
    out << "silence " << result.response.id() << " added\n";
  }
  return kExitOk;
}

int RunSilenceList(const GlobalOptions& global, client::QueryClient& query, std::ostream& out, std::ostream& err) {
  auto result = query.ListSilences();
  if (!result.ok()) return ReportRpcError(global, "list silences", result.status, err);
  if (global.json) {
    out << ProtoToJson(result.response).dump(2) << "\n";
    return kExitOk;
  }
  if (result.response.silences().empty()) {
    out << "no silences\n";
    return kExitOk;
  }
  const double now = NowSeconds();
  std::vector<std::vector<std::string>> rows = {{"ID", "MATCHERS", "STARTS", "ENDS", "BY", "COMMENT"}};
  for (const v1::Silence& s : result.response.silences()) {
    std::string matchers;
    for (const std::string& m : SilenceMatcherTexts(s)) matchers += (matchers.empty() ? "" : " ") + m;
    rows.push_back({s.id(), matchers, FormatLocalTime(s.starts_at(), now), FormatLocalTime(s.ends_at(), now),
                    s.created_by().empty() ? "-" : s.created_by(), s.comment()});
  }
  out << FormatTable(rows);
  return kExitOk;
}

int RunSilenceRemove(const GlobalOptions& global, client::QueryClient& query, const std::string& id, std::ostream& out,
                     std::ostream& err) {
  auto result = query.RemoveSilence(id);
  if (!result.ok()) {
    return ReportRpcError(global, "remove silence " + id, result.status, err, [&] {
      auto silences = query.ListSilences();
      std::vector<std::string> ids;
      if (silences.ok()) {
        for (const auto& s : silences.response.silences()) ids.push_back(s.id());
      }
      const std::string hint = DidYouMean(id, ids);
      return hint.empty() ? "\n  `gradwatch silence list` lists the silences" : hint;
    });
  }
  if (!global.json) out << "silence " << id << " removed\n";
  return kExitOk;
}

int RunAck(const GlobalOptions& global, client::QueryClient& query, const std::string& fingerprint,
           const std::string& by, const std::string& comment, std::ostream& out, std::ostream& err) {
  auto result = query.Ack(fingerprint, by, comment);
  if (!result.ok()) {
    return ReportRpcError(global, "ack " + fingerprint, result.status, err, [&] {
      auto alerts = query.ListAlerts("");
      std::vector<std::string> fingerprints;
      if (alerts.ok()) {
        for (const auto& a : alerts.response.alerts()) fingerprints.push_back(a.fingerprint());
      }
      const std::string hint = DidYouMean(fingerprint, fingerprints);
      return hint.empty() ? "\n  `gradwatch alerts` lists the alerts and their fingerprints" : hint;
    });
  }
  if (!global.json) out << "alert " << fingerprint << " acknowledged\n";
  return kExitOk;
}

int RunRuns(const GlobalOptions& global, client::QueryClient& query, bool all, std::ostream& out, std::ostream& err) {
  auto result = query.ListRuns(all);
  if (!result.ok()) return ReportRpcError(global, "list runs", result.status, err);
  if (global.json) {
    out << ProtoToJson(result.response).dump(2) << "\n";
  } else {
    out << FormatRunsTable(result.response, NowSeconds());
  }
  return kExitOk;
}

int RunShow(const GlobalOptions& global, client::QueryClient& query, const std::string& run, std::ostream& out,
            std::ostream& err) {
  auto result = query.GetRun(run);
  if (!result.ok()) {
    return ReportRpcError(global, "run " + run, result.status, err, [&] { return NotFoundHint(query, run); });
  }
  if (global.json) {
    out << RunSummaryToJson(result.response).dump(2) << "\n";
  } else {
    out << FormatRunSummary(result.response, NowSeconds());
  }
  return kExitOk;
}

int RunSeries(const GlobalOptions& global, client::QueryClient& query, const SeriesOptions& options, std::ostream& out,
              std::ostream& err) {
  v1::GetSeriesRequest request;
  request.set_run_id(options.run);
  request.set_key(options.key);
  request.set_from_step(options.from_step);
  request.set_to_step(options.to_step);
  request.set_max_points(options.max_points);
  auto result = query.GetSeries(request);
  if (!result.ok()) {
    return ReportRpcError(global, "series " + options.key + " of run " + options.run, result.status, err,
                          [&] { return NotFoundHint(query, options.run, options.key); });
  }
  if (global.json) {
    out << SeriesToJson(result.response).dump(2) << "\n";
  } else {
    out << FormatSeries(result.response);
  }
  return kExitOk;
}

int RunAnnotate(const GlobalOptions& global, client::QueryClient& query, const std::string& run, uint64_t step,
                const std::string& text, std::ostream& out, std::ostream& err) {
  auto result = query.Annotate(run, step, text);
  if (!result.ok()) {
    return ReportRpcError(global, "annotate run " + run, result.status, err, [&] { return NotFoundHint(query, run); });
  }
  if (global.json) {
    out << nlohmann::ordered_json{{"run", run}, {"step", step}, {"text", text}}.dump(2) << "\n";
  } else {
    out << "annotated run " << run << " at step " << step << "\n";
  }
  return kExitOk;
}

}  // namespace gradwatch::cli

#include "server/daemon/run_view.h"

#include <google/protobuf/util/json_util.h>

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>

#include "server/daemon/ui_assets.h"

namespace gradwatch::daemon {

namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decoding ('+' as a space in a query); nullopt for a malformed escape.
std::optional<std::string> Decode(std::string_view text, bool query) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '%') {
      if (i + 2 >= text.size()) return std::nullopt;
      const int hi = HexDigit(text[i + 1]), lo = HexDigit(text[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out.push_back(static_cast<char>(hi * 16 + lo));
      i += 2;
    } else if (query && text[i] == '+') {
      out.push_back(' ');
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
}

// The value of `name` in a query string; nullopt when absent or malformed.
std::optional<std::string> QueryParam(std::string_view query, std::string_view name) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) != name) continue;
    return Decode(eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1), true);
  }
  return std::nullopt;
}

web::Response Json(int status, std::string body) {
  web::Response r;
  r.status = status;
  r.content_type = "application/json";
  r.body = std::move(body);
  r.headers.emplace_back("Cache-Control", "no-store");
  return r;
}

std::string Quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static constexpr char kHex[] = "0123456789abcdef";
          out += "\\u00";
          out += kHex[(c >> 4) & 15];
          out += kHex[c & 15];
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

web::Response JsonError(int status, std::string_view code, std::string_view message) {
  return Json(status, "{\"error\": " + Quote(message) + ", \"code\": " + Quote(code) + "}\n");
}

web::Response FromStatus(const grpc::Status& status, const google::protobuf::Message& message) {
  if (!status.ok()) {
    switch (status.error_code()) {
      case grpc::StatusCode::NOT_FOUND: return JsonError(404, "NOT_FOUND", status.error_message());
      case grpc::StatusCode::INVALID_ARGUMENT: return JsonError(400, "INVALID_ARGUMENT", status.error_message());
      case grpc::StatusCode::UNAVAILABLE: return JsonError(503, "UNAVAILABLE", status.error_message());
      default: return JsonError(500, "INTERNAL", status.error_message());
    }
  }
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string body;
  const auto printed = google::protobuf::util::MessageToJsonString(message, &body, options);
  if (!printed.ok()) return JsonError(500, "INTERNAL", "cannot print JSON: " + std::string(printed.message()));
  body += '\n';
  return Json(200, std::move(body));
}

std::optional<uint64_t> Number(const std::optional<std::string>& text) {
  if (!text || text->empty()) return std::nullopt;
  uint64_t value = 0;
  const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), value);
  if (ec != std::errc() || end != text->data() + text->size()) return std::nullopt;
  return value;
}

web::Response Series(const ingest::QuerySources& sources, const std::string& run, const web::Request& request) {
  v1::GetSeriesRequest q;
  q.set_run_id(run);
  const auto key = QueryParam(request.query, "key");
  if (!key || key->empty()) return JsonError(400, "INVALID_ARGUMENT", "key is required: ?key=grad/norm/total");
  q.set_key(*key);
  for (const auto& [name, param] :
       {std::pair{"from", &v1::GetSeriesRequest::set_from_step}, std::pair{"to", &v1::GetSeriesRequest::set_to_step}}) {
    const auto text = QueryParam(request.query, name);
    if (!text) continue;
    const auto value = Number(text);
    if (!value)
      return JsonError(400, "INVALID_ARGUMENT", std::string(name) + " must be a step number, not '" + *text + "'");
    (q.*param)(*value);
  }
  if (const auto text = QueryParam(request.query, "max_points")) {
    const auto value = Number(text);
    if (!value || *value > 100000) {
      return JsonError(400, "INVALID_ARGUMENT", "max_points must be a number up to 100000, not '" + *text + "'");
    }
    q.set_max_points(static_cast<uint32_t>(*value));
  }
  v1::GetSeriesResponse response;
  return FromStatus(ingest::GetSeries(sources, q, &response), response);
}

web::Response Api(const ingest::QuerySources& sources, const web::Request& request) {
  constexpr std::string_view kRuns = "/api/v1/runs";
  const std::string_view path = request.path;
  if (path == "/api/v1/alerts") {
    v1::ListAlertsRequest q;
    if (auto run = QueryParam(request.query, "run")) q.set_run_id(*run);
    v1::ListAlertsResponse response;
    return FromStatus(ingest::ListAlerts(sources, q, &response), response);
  }
  if (path == "/api/v1/alerts/history") {
    v1::ListAlertHistoryRequest q;
    if (auto run = QueryParam(request.query, "run")) q.set_run_id(*run);
    if (const auto text = QueryParam(request.query, "limit")) {
      const auto value = Number(text);
      if (!value || *value > ingest::kAlertHistoryMax) {
        return JsonError(
            400, "INVALID_ARGUMENT",
            "limit must be a number up to " + std::to_string(ingest::kAlertHistoryMax) + ", not '" + *text + "'");
      }
      q.set_limit(static_cast<uint32_t>(*value));
    }
    v1::ListAlertHistoryResponse response;
    return FromStatus(ingest::ListAlertHistory(sources, q, &response), response);
  }
  if (path == kRuns || path == "/api/v1/runs/") {
    v1::ListRunsRequest q;
    const auto archived = QueryParam(request.query, "archived");
    q.set_include_archived(archived && (*archived == "1" || *archived == "true"));
    v1::ListRunsResponse response;
    return FromStatus(ingest::ListRuns(sources, q, &response), response);
  }
  if (path.substr(0, kRuns.size() + 1) == "/api/v1/runs/") {
    std::string_view rest = path.substr(kRuns.size() + 1);
    constexpr std::string_view kSeries = "/series";
    const bool series = rest.size() > kSeries.size() && rest.substr(rest.size() - kSeries.size()) == kSeries;
    if (series) rest.remove_suffix(kSeries.size());
    const auto run = Decode(rest, false);
    if (!run || run->empty()) return JsonError(400, "INVALID_ARGUMENT", "bad run name in " + request.path);
    if (series) return Series(sources, *run, request);
    v1::GetRunRequest q;
    q.set_run_id(*run);
    // The view reloads the run every few seconds: the latest 200 events by default (?events=N).
    q.set_max_events(200);
    // ?events=N (1 or more), ?params=N (a page of the catalog, 1 or more) and ?params_offset=K.
    for (const auto& [name, set, min] : {std::tuple<const char*, void (v1::GetRunRequest::*)(uint32_t), uint32_t>{
                                             "events", &v1::GetRunRequest::set_max_events, 1},
                                         {"params", &v1::GetRunRequest::set_max_params, 1},
                                         {"params_offset", &v1::GetRunRequest::set_params_offset, 0}}) {
      const auto text = QueryParam(request.query, name);
      if (!text) continue;
      uint32_t n = 0;
      const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), n);
      if (ec != std::errc() || end != text->data() + text->size() || n < min) {
        return JsonError(400, "INVALID_ARGUMENT",
                         std::string(name) + "=" + *text + " is not a count of " + std::to_string(min) + " or more");
      }
      (q.*set)(n);
    }
    v1::RunSummary response;
    return FromStatus(ingest::GetRun(sources, q, &response), response);
  }
  return JsonError(404, "NOT_FOUND",
                   "no API at " + request.path +
                       " (/api/v1/runs, /api/v1/runs/RUN, /api/v1/runs/RUN/series, "
                       "/api/v1/alerts, /api/v1/alerts/history)");
}

web::Response Asset(std::string_view name) {
  const UiAsset* asset = FindUiAsset(name);
  if (asset == nullptr) return web::Response::Text(404, "no file " + std::string(name) + " in the run view");
  web::Response r;
  r.content_type = asset->content_type;
  r.pieces.emplace_back(asset->data, asset->size);  // static: nothing to keep alive
  r.headers.emplace_back("Cache-Control", "no-cache");
  r.headers.emplace_back("X-Content-Type-Options", "nosniff");
  // The page loads nothing from elsewhere: scripts, styles and data come from this listener only.
  r.headers.emplace_back("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'");
  return r;
}

}  // namespace

web::Route GatedRoute(std::string path, bool prefix, ReadGate gate, web::Handler handler) {
  web::Route route;
  route.path = std::move(path);
  route.prefix = prefix;
  route.handler = [gate = std::move(gate), handler = std::move(handler)](const web::Request& request) {
    if (gate) {
      if (auto refusal = gate(request)) return std::move(*refusal);
    }
    return handler(request);
  };
  return route;
}

std::vector<web::Route> RunViewRoutes(ingest::QuerySources sources, ReadGate gate) {
  std::vector<web::Route> routes;
  routes.push_back(GatedRoute("/", false, gate, [](const web::Request&) {
    web::Response r = web::Response::Text(302, "the run view is at /runs/");
    r.headers.emplace_back("Location", "/runs/");
    return r;
  }));
  routes.push_back(GatedRoute("/runs/", true, gate, [](const web::Request&) { return Asset("index.html"); }));
  routes.push_back(GatedRoute("/runs", false, gate, [](const web::Request&) {
    web::Response r = web::Response::Text(301, "the run view is at /runs/");
    r.headers.emplace_back("Location", "/runs/");
    return r;
  }));
  routes.push_back(GatedRoute(
      "/ui/", true, gate, [](const web::Request& request) { return Asset(std::string_view(request.path).substr(4)); }));
  routes.push_back(
      GatedRoute("/api/", true, gate, [sources](const web::Request& request) { return Api(sources, request); }));
  return routes;
}

}  // namespace gradwatch::daemon

#include "server/ingest/query_service.h"

#include <algorithm>
#include <cmath>

#include <spdlog/spdlog.h>

#include "server/ingest/convert.h"
#include "server/ingest/queries.h"

namespace gradwatch::ingest {

namespace {

grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

}  // namespace

QueryService::QueryService(runs::RunRegistry* registry, const Clock* clock, alerts::AlertEngine* engine,
                           RuleReloader reload)
    : registry_(registry), clock_(clock), engine_(engine), reload_(std::move(reload)) {}

namespace {
grpc::Status NoAlerting() { return {grpc::StatusCode::FAILED_PRECONDITION, "alerting is not configured"}; }
}  // namespace

grpc::ServerUnaryReactor* QueryService::ReloadRules(grpc::CallbackServerContext* context, const v1::ReloadRulesRequest*,
                                                    v1::ReloadRulesResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kAdmin, "", "reload rules"); !allowed.ok())
    return Done(context, allowed);
  if (!reload_) return Done(context, NoAlerting());
  auto result = reload_();
  if (!result.ok()) return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, result.status().message()});
  response->set_rule_count(static_cast<uint32_t>(result.value()));
  return Done(context, grpc::Status::OK);
}

namespace {

// "7d", "36h", "90m", "45s": the largest unit that divides the duration, as Alertmanager's do.
std::string FormatDuration(double seconds) {
  const auto s = static_cast<long long>(std::llround(seconds));
  for (const auto& [unit, size] : {std::pair{"d", 86400LL}, {"h", 3600LL}, {"m", 60LL}}) {
    if (s >= size && s % size == 0) return std::to_string(s / size) + unit;
  }
  return std::to_string(s) + "s";
}

static_assert(static_cast<int>(alerts::MatchType::kEqual) == v1::MATCH_TYPE_EQUAL &&
              static_cast<int>(alerts::MatchType::kNotEqual) == v1::MATCH_TYPE_NOT_EQUAL &&
              static_cast<int>(alerts::MatchType::kRegex) == v1::MATCH_TYPE_REGEX &&
              static_cast<int>(alerts::MatchType::kNotRegex) == v1::MATCH_TYPE_NOT_REGEX);

// Both fields' matchers, each checked (label name, regular expression) and the whole as a silence
// (at least one that does not match everything).
StatusOr<std::vector<alerts::Matcher>> SilenceMatchers(const v1::Silence& in) {
  auto equal = alerts::EqualityMatchers({in.matchers().begin(), in.matchers().end()});
  if (!equal.ok()) return equal.status();
  std::vector<alerts::Matcher> out = std::move(*equal);
  for (const v1::Matcher& m : in.label_matchers()) {
    const std::optional<alerts::MatchType> type = alerts::MatchTypeFromNumber(m.type());
    if (!type)
      return Status::InvalidArgument("matcher " + m.name() + ": unknown match type " + std::to_string(m.type()));
    auto matcher = alerts::Matcher::Make(m.name(), *type, m.value());
    if (!matcher.ok()) return matcher.status();
    out.push_back(std::move(*matcher));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (Status s = alerts::CheckSilenceMatchers(out); !s.ok()) return s;
  return out;
}

std::string Caller(const grpc::CallbackServerContext& context) {
  const auto auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    const auto identity = auth->GetPeerIdentity();
    if (!identity.empty()) return "certificate " + std::string(identity.front().data(), identity.front().size());
  }
  return context.peer();
}

}  // namespace

grpc::Status QueryService::Allow(const grpc::CallbackServerContext* context, Scope scope, std::string_view run,
                                 std::string_view what) const {
  return authorizer_ == nullptr ? grpc::Status::OK : authorizer_->Check(*context, scope, run, what);
}

grpc::ServerUnaryReactor* QueryService::AddSilence(grpc::CallbackServerContext* context,
                                                   const v1::AddSilenceRequest* request,
                                                   v1::AddSilenceResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kSilence, "", "add a silence"); !allowed.ok())
    return Done(context, allowed);
  if (engine_ == nullptr) return Done(context, NoAlerting());
  const v1::Silence& in = request->silence();
  alerts::Silence silence;
  if (auto matchers = SilenceMatchers(in); matchers.ok()) {
    silence.matchers = std::move(*matchers);
  } else {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, matchers.status().message()});
  }
  silence.id = in.id().empty() ? "s" + std::to_string(static_cast<long long>(clock_->UnixSeconds() * 1e6)) : in.id();
  silence.starts_at = in.starts_at() > 0 ? in.starts_at() : clock_->UnixSeconds();
  silence.ends_at = in.ends_at();
  silence.comment = in.comment();
  // Who made it: the name the client gives, and the caller's identity, which the client cannot
  // choose: its token's name, else its certificate under mutual TLS, else its address.
  std::string caller = authorizer_ != nullptr ? authorizer_->Who(*context) : std::string();
  if (caller.empty()) caller = Caller(*context);
  silence.created_by = in.created_by().empty() ? caller : in.created_by() + " (" + caller + ")";
  if (!(silence.ends_at > silence.starts_at)) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, "a silence must end after it starts"});
  }
  if (silence.ends_at - silence.starts_at > max_silence_seconds_) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT,
                          "a silence may last at most " + FormatDuration(max_silence_seconds_) +
                              " (security.max_silence_seconds); this one would last " +
                              (std::isfinite(silence.ends_at) ? FormatDuration(silence.ends_at - silence.starts_at)
                                                              : std::string("forever")) +
                              ": add a shorter one, and renew it if it must go on"});
  }
  if (auto s = engine_->AddSilence(silence); !s.ok()) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, s.message()});
  }
  spdlog::info("silence {} added until {:.0f} by '{}': {}", silence.id, silence.ends_at, silence.created_by,
               silence.comment);
  response->set_id(silence.id);
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::ListSilences(grpc::CallbackServerContext* context,
                                                     const v1::ListSilencesRequest*,
                                                     v1::ListSilencesResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "list silences"); !allowed.ok())
    return Done(context, allowed);
  if (engine_ == nullptr) return Done(context, NoAlerting());
  for (const alerts::Silence& s : engine_->Silences()) {
    v1::Silence* out = response->add_silences();
    out->set_id(s.id);
    for (const alerts::Matcher& m : s.matchers) {
      v1::Matcher* matcher = out->add_label_matchers();
      matcher->set_name(m.name());
      matcher->set_type(static_cast<v1::MatchType>(m.type()));
      matcher->set_value(m.value());
      if (m.type() == alerts::MatchType::kEqual) (*out->mutable_matchers())[m.name()] = m.value();
    }
    out->set_starts_at(s.starts_at);
    out->set_ends_at(s.ends_at);
    out->set_comment(s.comment);
    out->set_created_by(s.created_by);
  }
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::RemoveSilence(grpc::CallbackServerContext* context,
                                                      const v1::RemoveSilenceRequest* request,
                                                      v1::RemoveSilenceResponse*) {
  if (grpc::Status allowed = Allow(context, Scope::kSilence, "", "remove a silence"); !allowed.ok())
    return Done(context, allowed);
  if (engine_ == nullptr) return Done(context, NoAlerting());
  if (auto s = engine_->RemoveSilence(request->id()); !s.ok()) {
    return Done(context, {grpc::StatusCode::NOT_FOUND, s.message()});
  }
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::Ack(grpc::CallbackServerContext* context, const v1::AckRequest* request,
                                            v1::AckResponse*) {
  if (grpc::Status allowed = Allow(context, Scope::kAck, "", "ack an alert"); !allowed.ok())
    return Done(context, allowed);
  if (engine_ == nullptr) return Done(context, NoAlerting());
  if (auto s = engine_->Ack(request->fingerprint(), request->by(), request->comment(), clock_->UnixSeconds());
      !s.ok()) {
    return Done(context, {s.code() == StatusCode::kNotFound ? grpc::StatusCode::NOT_FOUND
                                                            : grpc::StatusCode::FAILED_PRECONDITION,
                          s.message()});
  }
  spdlog::info("alert {} acknowledged by '{}': {}", request->fingerprint(), request->by(), request->comment());
  return Done(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* QueryService::ListAlerts(grpc::CallbackServerContext* context,
                                                   const v1::ListAlertsRequest* request,
                                                   v1::ListAlertsResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "list alerts"); !allowed.ok())
    return Done(context, allowed);
  return Done(context, ingest::ListAlerts(sources(), *request, response));
}

grpc::ServerUnaryReactor* QueryService::ListAlertHistory(grpc::CallbackServerContext* context,
                                                         const v1::ListAlertHistoryRequest* request,
                                                         v1::ListAlertHistoryResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "read the alert history"); !allowed.ok()) {
    return Done(context, allowed);
  }
  return Done(context, ingest::ListAlertHistory(sources(), *request, response));
}

grpc::ServerUnaryReactor* QueryService::ListRuns(grpc::CallbackServerContext* context,
                                                 const v1::ListRunsRequest* request, v1::ListRunsResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "list runs"); !allowed.ok())
    return Done(context, allowed);
  return Done(context, ingest::ListRuns(sources(), *request, response));
}

grpc::ServerUnaryReactor* QueryService::GetRun(grpc::CallbackServerContext* context, const v1::GetRunRequest* request,
                                               v1::RunSummary* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "read a run"); !allowed.ok())
    return Done(context, allowed);
  return Done(context, ingest::GetRun(sources(), *request, response));
}

grpc::ServerUnaryReactor* QueryService::GetSeries(grpc::CallbackServerContext* context,
                                                  const v1::GetSeriesRequest* request,
                                                  v1::GetSeriesResponse* response) {
  if (grpc::Status allowed = Allow(context, Scope::kRead, "", "read a series"); !allowed.ok())
    return Done(context, allowed);
  return Done(context, ingest::GetSeries(sources(), *request, response));
}

grpc::ServerUnaryReactor* QueryService::Annotate(grpc::CallbackServerContext* context,
                                                 const v1::AnnotateRequest* request, v1::AnnotateResponse*) {
  if (grpc::Status allowed = Allow(context, Scope::kWrite, request->run_id(), "annotate run " + request->run_id());
      !allowed.ok()) {
    return Done(context, allowed);
  }
  auto run = registry_->Find(request->run_id());
  if (!run) return Done(context, RunNotFound(request->run_id()));
  v1::Event in;
  in.set_step(request->step());
  in.set_text(request->text());
  EventRecord event;
  if (auto err = EventFromProto(in, &event)) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, err->message});
  }
  event.source = "annotate";
  event.recorded_at = clock_->UnixSeconds();
  spdlog::info("run {}: annotation at step {}: {}", request->run_id(), event.step, event.text);
  if (auto err = run->AddEvent(std::move(event))) {
    return Done(context, {grpc::StatusCode::INVALID_ARGUMENT, err->message});
  }
  return Done(context, grpc::Status::OK);
}

}  // namespace gradwatch::ingest

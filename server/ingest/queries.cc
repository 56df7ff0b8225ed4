#include "server/ingest/queries.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "server/ingest/convert.h"

namespace gradwatch::ingest {

namespace {

constexpr size_t kDefaultParams = 1000;
constexpr size_t kMaxParams = 2000;
// A page's entries take at most this much (protobuf bytes), so that the answer, events included,
// stays under gRPC's default 4 MiB limit however many series each parameter has.
constexpr size_t kPageBytes = size_t{3} << 20;
constexpr size_t kRunWide = static_cast<size_t>(-1);

// Removes the elements of `field` that `keep` refuses, keeping the order of the others.
template <typename Field, typename Keep>
void KeepOnly(Field* field, Keep keep) {
  int kept = 0;
  for (int i = 0; i < field->size(); ++i) {
    if (!keep(field->Get(i))) continue;
    if (kept != i) field->SwapElements(kept, i);
    ++kept;
  }
  field->DeleteSubrange(kept, field->size() - kept);
}

// Applies `visit(owner, bytes)` to every per-series or per-parameter entry of `s`, with the catalog
// position of the parameter it belongs to (kRunWide for the run's own: the total grad norm, the
// loss, groups) and its size. A series key belongs to the parameter its last segments name
// ("grad/norm/<param>", "updates/radial/<param>").
class Owners {
 public:
  explicit Owners(const v1::RunSummary& s) {
    position_.reserve(static_cast<size_t>(s.params_size()));
    for (int i = 0; i < s.params_size(); ++i) position_.emplace(s.params(i).name(), static_cast<size_t>(i));
  }
  size_t OfName(const std::string& name) const {
    const auto it = position_.find(name);
    return it == position_.end() ? kRunWide : it->second;
  }
  size_t OfKey(const std::string& key) const {
    for (size_t slash = key.find('/'); slash != std::string::npos; slash = key.find('/', slash + 1)) {
      if (const auto it = position_.find(std::string_view(key).substr(slash + 1)); it != position_.end()) {
        return it->second;
      }
    }
    return kRunWide;
  }

 private:
  std::unordered_map<std::string_view, size_t> position_;  // views into the summary's names
};

template <typename Visit>
void ForEachEntry(v1::RunSummary* s, const Owners& owners, Visit visit) {
  v1::Analysis* a = s->mutable_analysis();
  auto by_key = [&](auto* field) {
    KeepOnly(field, [&](const auto& e) { return visit(owners.OfKey(e.key()), e.ByteSizeLong()); });
  };
  auto by_param = [&](auto* field) {
    KeepOnly(field, [&](const auto& e) { return visit(owners.OfName(e.param()), e.ByteSizeLong()); });
  };
  by_key(s->mutable_latest());
  by_key(a->mutable_slopes());
  by_key(a->mutable_slope_changes());
  by_key(a->mutable_change_points());
  by_key(a->mutable_forecasts());
  KeepOnly(a->mutable_shares(), [&](const v1::GradNormShare& e) {
    return visit(e.is_group() ? kRunWide : owners.OfName(e.name()), e.ByteSizeLong());
  });
  by_param(a->mutable_amplifications());
  by_param(a->mutable_growth_without_decay());
  by_param(a->mutable_projections());
  by_param(a->mutable_remediations());
}

// Keeps in `s` the catalog page the request asks for and what belongs to it (see GetRunRequest):
// as many parameters from `offset` as were asked, fewer when their entries would pass kPageBytes
// (at least one).
void KeepParamPage(v1::RunSummary* s, size_t offset, size_t asked) {
  const size_t total = static_cast<size_t>(s->params_size());
  s->set_param_count(total);
  offset = std::min(offset, total);
  asked = std::min(asked == 0 ? kDefaultParams : asked, kMaxParams);
  const bool first = offset == 0;
  if (!first) s->clear_events();
  {
    // First pass: what each parameter of the page would cost; nothing is removed.
    const Owners owners(*s);
    std::vector<size_t> bytes(std::min(asked, total - offset), 0);
    size_t run_wide = 0;
    ForEachEntry(s, owners, [&](size_t owner, size_t b) {
      if (owner == kRunWide) {
        run_wide += b;
      } else if (owner >= offset && owner - offset < bytes.size()) {
        bytes[owner - offset] += b;
      }
      return true;
    });
    size_t used = first ? run_wide : 0;
    for (const v1::EventInfo& e : s->events()) used += e.ByteSizeLong() + 4;
    size_t count = 0;
    for (; count < bytes.size(); ++count) {
      used += bytes[count] + static_cast<size_t>(s->params(static_cast<int>(offset + count)).ByteSizeLong());
      if (count > 0 && used > kPageBytes) break;
    }
    asked = count;
  }
  {
    const Owners owners(*s);
    ForEachEntry(s, owners, [&](size_t owner, size_t) {
      return owner == kRunWide ? first : owner >= offset && owner - offset < asked;
    });
  }
  auto* params = s->mutable_params();
  params->DeleteSubrange(static_cast<int>(offset + asked), params->size() - static_cast<int>(offset + asked));
  params->DeleteSubrange(0, static_cast<int>(offset));
}

}  // namespace

grpc::Status ListRuns(const QuerySources& from, const v1::ListRunsRequest& request, v1::ListRunsResponse* response) {
  for (const auto& run : from.registry->All()) RunInfoToProto(run->Info(), response->add_runs());
  if (request.include_archived()) {
    auto archived = from.registry->Archived();
    if (!archived.ok()) return {grpc::StatusCode::INTERNAL, "reading archived runs: " + archived.status().message()};
    for (const store::StoredRun& r : archived.value()) StoredRunToProto(r, response->add_runs());
    std::sort(response->mutable_runs()->begin(), response->mutable_runs()->end(),
              [](const v1::RunInfo& a, const v1::RunInfo& b) { return a.run_id() < b.run_id(); });
  }
  return grpc::Status::OK;
}

grpc::Status GetRun(const QuerySources& from, const v1::GetRunRequest& request, v1::RunSummary* response) {
  auto run = from.registry->Find(request.run_id());
  if (!run) return RunNotFound(request.run_id());
  constexpr uint32_t kDefaultEvents = 1000;  // 1,000 events of at most 1 KiB: within gRPC's 4 MiB
  SummaryToProto(run->Summary(request.max_events() == 0 ? kDefaultEvents : request.max_events()), response);
  KeepParamPage(response, request.params_offset(), request.max_params());
  if (!from.diagnosis) return grpc::Status::OK;
  if (const std::optional<alerts::DiagnosisAt> d = from.diagnosis(request.run_id())) {
    v1::RunDiagnosis* out = response->mutable_diagnosis();
    out->set_step(d->step);
    out->set_cause(std::string(alerts::CauseName(d->diagnosis.cause)));
    out->set_text(d->diagnosis.text);
    out->set_recommendation(d->diagnosis.recommendation);
    out->set_remediation_param(d->diagnosis.remedy.param);
    out->set_remediation_weight_decay(d->diagnosis.remedy.weight_decay);
    out->set_remediation_supported(d->diagnosis.remedy.supported);
    out->set_remediation_why(d->diagnosis.remedy.why);
    out->set_page_held(d->page_held);
  }
  return grpc::Status::OK;
}

grpc::Status GetSeries(const QuerySources& from, const v1::GetSeriesRequest& request, v1::GetSeriesResponse* response) {
  auto run = from.registry->Find(request.run_id());
  if (!run) return RunNotFound(request.run_id());
  const uint64_t to = request.to_step() == 0 ? UINT64_MAX : request.to_step();
  if (to < request.from_step()) return {grpc::StatusCode::INVALID_ARGUMENT, "to_step is before from_step"};
  auto points = run->QuerySeries(request.key(), request.from_step(), to, request.max_points());
  if (!points) {
    return {grpc::StatusCode::NOT_FOUND, "run '" + request.run_id() + "' has no series '" + request.key() + "'"};
  }
  response->set_run_id(request.run_id());
  response->set_key(request.key());
  response->mutable_points()->Reserve(static_cast<int>(points->size()));
  for (const store::Point& p : *points) {
    v1::SeriesPoint* sp = response->add_points();
    sp->set_step(p.step);
    sp->set_last_step(p.last_step);
    sp->set_value(p.count == 1 ? p.last : p.mean);
    sp->set_min(p.count == 1 ? p.last : p.min);
    sp->set_max(p.count == 1 ? p.last : p.max);
    sp->set_count(p.count);
    sp->set_nonfinite(p.nonfinite);
  }
  return grpc::Status::OK;
}

grpc::Status ListAlerts(const QuerySources& from, const v1::ListAlertsRequest& request,
                        v1::ListAlertsResponse* response) {
  if (from.engine == nullptr) return grpc::Status::OK;
  const double now = from.clock->UnixSeconds();
  for (const alerts::Alert& a : from.engine->Active(request.run_id())) {
    v1::Alert* out = response->add_alerts();
    AlertToProto(a, out);
    for (std::string& id : from.engine->SilencesMuting(a, now)) out->add_silenced_by(std::move(id));
    if (auto ack = from.engine->AckOf(out->fingerprint())) {
      out->mutable_ack()->set_by(ack->by);
      out->mutable_ack()->set_comment(ack->comment);
      out->mutable_ack()->set_at(ack->at);
    }
  }
  return grpc::Status::OK;
}

grpc::Status ListAlertHistory(const QuerySources& from, const v1::ListAlertHistoryRequest& request,
                              v1::ListAlertHistoryResponse* response) {
  if (request.limit() > kAlertHistoryMax) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "limit is at most " + std::to_string(kAlertHistoryMax) + ", not " + std::to_string(request.limit())};
  }
  if (!from.alert_history) return grpc::Status::OK;
  auto entries = from.alert_history(request.run_id(), request.limit() == 0 ? kAlertHistoryDefault : request.limit());
  if (!entries.ok()) return {grpc::StatusCode::UNAVAILABLE, "reading the alert history: " + entries.status().message()};
  response->mutable_entries()->Reserve(static_cast<int>(entries->size()));
  for (const alerts::HistoryEntry& e : entries.value()) {
    v1::AlertHistoryEntry* out = response->add_entries();
    AlertToProto(e.alert, out->mutable_alert());
    out->set_from(e.from == alerts::AlertState::kInactive ? v1::ALERT_STATE_UNSPECIFIED : AlertStateToProto(e.from));
    out->set_at(e.at);
  }
  return grpc::Status::OK;
}

grpc::Status RunNotFound(const std::string& run_id) { return {grpc::StatusCode::NOT_FOUND, "no run '" + run_id + "'"}; }

}  // namespace gradwatch::ingest

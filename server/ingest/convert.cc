#include "server/ingest/convert.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

namespace gradwatch::ingest {

using runs::IngestError;
using runs::IngestErrorReason;

namespace {

constexpr size_t kMaxParamName = 256;
constexpr size_t kMaxEventText = 1024;
constexpr size_t kMaxLabelBytes = 1024;
// Labels become label names on /metrics and ride on every alert: a handful is what a run needs.
constexpr size_t kMaxLabels = 64;

// Prometheus's label name syntax, [a-zA-Z_][a-zA-Z0-9_]*, without the reserved "__" prefix: run
// labels become label names on /metrics (the alerts' labels).
std::optional<std::string> LabelKeyProblem(const std::string& key) {
  if (key.empty()) return "is empty";
  if (std::isdigit(static_cast<unsigned char>(key[0]))) return "starts with a digit";
  if (key.size() >= 2 && key[0] == '_' && key[1] == '_') return "starts with '__' (reserved by Prometheus)";
  for (unsigned char c : key) {
    if (!(std::isalnum(c) || c == '_') || c >= 0x80) return "has a character outside [a-zA-Z0-9_]";
  }
  return std::nullopt;
}

// A key shown in an error message: printable ASCII only, at most 64 bytes.
std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 64)) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

// Keys the daemon fills from a step's own fields: an extra value under one of them would give
// the step two values for one series.
bool IsBuiltInKey(std::string_view key) {
  if (key == keys::kTotalParamNorm || key == keys::kTotalUpdateNorm) return false;
  for (std::string_view fixed : {keys::kTotalGradNorm, keys::kLoss, keys::kZLoss, keys::kLearningRate, keys::kTokens}) {
    if (key == fixed) return true;
  }
  for (std::string_view prefix :
       {keys::kGradNormPrefix, keys::kParamNormPrefix, keys::kUpdateNormPrefix, keys::kRadialUpdatePrefix}) {
    if (key.substr(0, prefix.size()) == prefix) return true;
  }
  return false;
}

bool ValidParamName(const std::string& name) {
  if (name.empty() || name.size() > kMaxParamName || name == "total") return false;
  return std::none_of(name.begin(), name.end(), [](unsigned char c) { return c < 0x20 || c == 0x7f; });
}

std::string TooLargeStep(std::string_view what, uint64_t step) {
  return std::string(what) + " " + std::to_string(step) + " is above the largest step the daemon keeps, " +
         std::to_string(kMaxStep) + " (2^63 - 1)";
}

// Reads a NormValue; a negative value (−Inf too: a norm is ≥ 0, +Inf or NaN) is an error.
std::optional<IngestError> ReadNorm(const v1::NormValue& in, const char* what, uint64_t step, NormContribution* out) {
  switch (in.value_case()) {
    case v1::NormValue::kNorm: {
      const double v = in.norm();
      if (v < 0) {
        return IngestError{IngestErrorReason::kNegativeNorm,
                           std::string(what) + " norm is negative (" + std::to_string(v) + ")", step};
      }
      *out = NormContribution::FromNorm(v);
      return std::nullopt;
    }
    case v1::NormValue::kSqSum: {
      const double v = in.sq_sum();
      if (v < 0) {
        return IngestError{IngestErrorReason::kNegativeNorm,
                           std::string(what) + " squared sum is negative (" + std::to_string(v) + ")", step};
      }
      *out = NormContribution::FromSqSum(v);
      return std::nullopt;
    }
    case v1::NormValue::VALUE_NOT_SET: *out = {}; return std::nullopt;
  }
  *out = {};
  return std::nullopt;
}

}  // namespace

bool ValidRunId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
  });
}

std::optional<IngestError> HelloFromProto(const v1::Hello& in, const HelloLimits& limits, RunMeta* meta,
                                          uint32_t* rank) {
  auto invalid = [](std::string m) { return IngestError{IngestErrorReason::kInvalidHello, std::move(m)}; };
  if (!ValidRunId(in.run_id())) {
    return invalid("run_id '" + in.run_id().substr(0, 160) +
                   "' is invalid: use 1 to 128 characters of [A-Za-z0-9._:/-]");
  }
  if (in.world_size() == 0 || in.world_size() > limits.max_world_size) {
    return invalid("world_size " + std::to_string(in.world_size()) + " is out of range 1.." +
                   std::to_string(limits.max_world_size));
  }
  if (in.rank() >= in.world_size()) {
    return invalid("rank " + std::to_string(in.rank()) + " is not below world_size " + std::to_string(in.world_size()));
  }
  if (static_cast<size_t>(in.params_size()) > limits.max_params) {
    return IngestError{IngestErrorReason::kLimitExceeded, "catalog has " + std::to_string(in.params_size()) +
                                                              " parameters; the limit is " +
                                                              std::to_string(limits.max_params)};
  }
  if (static_cast<size_t>(in.labels_size()) > kMaxLabels) {
    return IngestError{IngestErrorReason::kLimitExceeded, "a run has at most " + std::to_string(kMaxLabels) +
                                                              " labels; this Hello has " +
                                                              std::to_string(in.labels_size())};
  }
  for (const auto& [k, v] : in.labels()) {
    if (k.empty() || k.size() > kMaxLabelBytes || v.size() > kMaxLabelBytes) {
      return invalid("label '" + Printable(k) + "' has an empty or oversized name or value");
    }
    if (auto problem = LabelKeyProblem(k)) {
      return invalid("label name '" + Printable(k) + "' " + *problem +
                     ": run label names must match [a-zA-Z_][a-zA-Z0-9_]* and not start with '__'");
    }
  }
  if (in.has_resume_from_step() && in.resume_from_step() > kMaxStep) {
    return invalid(TooLargeStep("resume_from_step", in.resume_from_step()));
  }
  meta->run_id = in.run_id();
  meta->world_size = in.world_size();
  meta->resume_from_step = in.has_resume_from_step() ? std::optional<uint64_t>(in.resume_from_step()) : std::nullopt;
  meta->labels = {in.labels().begin(), in.labels().end()};
  const v1::RunConfig& c = in.config();
  meta->config.hidden_size = c.hidden_size();
  meta->config.z_loss_coef = c.has_z_loss_coef() ? std::optional(c.z_loss_coef()) : std::nullopt;
  meta->config.optimizer = c.optimizer();
  meta->config.weight_decay = c.has_weight_decay() ? std::optional(c.weight_decay()) : std::nullopt;
  meta->config.warmup_steps = c.has_warmup_steps() ? std::optional<uint64_t>(c.warmup_steps()) : std::nullopt;
  meta->config.total_steps = c.has_total_steps() ? std::optional<uint64_t>(c.total_steps()) : std::nullopt;
  meta->config.extra = {c.extra().begin(), c.extra().end()};
  meta->params.clear();
  meta->params.reserve(in.params_size());
  std::unordered_set<std::string> names;
  for (int i = 0; i < in.params_size(); ++i) {
    const v1::ParamInfo& p = in.params(i);
    const std::string where = "catalog entry " + std::to_string(i);
    if (!ValidParamName(p.name())) {
      return invalid(where + ": name '" + p.name().substr(0, 64) +
                     "' is invalid (1..256 printable bytes, not 'total')");
    }
    if (!names.insert(p.name()).second) return invalid(where + ": duplicate name '" + p.name() + "'");
    if (!v1::ParamKind_IsValid(p.kind())) return invalid(where + ": unknown kind");
    if (!std::isfinite(p.weight_decay()) || p.weight_decay() < 0) {
      return invalid(where + " '" + p.name() + "': weight_decay must be finite and ≥ 0");
    }
    if (p.has_init_norm() && (!std::isfinite(p.init_norm()) || p.init_norm() <= 0)) {
      return invalid(where + " '" + p.name() + "': init_norm must be finite and > 0");
    }
    ParamInfo info;
    info.name = p.name();
    info.numel = p.numel();
    info.kind = static_cast<ParamKind>(p.kind());
    info.weight_decay = p.weight_decay();
    if (p.has_init_norm()) info.init_norm = p.init_norm();
    info.role = p.role();
    info.group = p.group();
    meta->params.push_back(std::move(info));
  }
  *rank = in.rank();
  return std::nullopt;
}

std::optional<IngestError> StepFromProto(const v1::StepStats& in, uint64_t seq, RankStep* out) {
  if (in.step() > kMaxStep)
    return IngestError{IngestErrorReason::kInvalidMessage, TooLargeStep("step", in.step()), in.step()};
  out->step = in.step();
  out->seq = seq;
  out->wall_time = in.wall_time();
  out->loss = in.has_loss() ? std::optional(in.loss()) : std::nullopt;
  out->z_loss = in.has_z_loss() ? std::optional(in.z_loss()) : std::nullopt;
  out->learning_rate = in.has_learning_rate() ? std::optional(in.learning_rate()) : std::nullopt;
  out->tokens = in.has_tokens() ? std::optional(in.tokens()) : std::nullopt;
  out->client_dropped_steps = in.client_dropped_steps();
  if (auto err = ReadNorm(in.total_grad(), "total gradient", in.step(), &out->total_grad)) return err;
  out->params.resize(in.params_size());
  static constexpr const char* kFieldNames[kNormFields] = {"gradient", "parameter", "update"};
  for (int i = 0; i < in.params_size(); ++i) {
    const v1::ParamStats& ps = in.params(i);
    ParamContribution& pc = out->params[i];
    pc.index = ps.index();
    const v1::NormValue* fields[kNormFields] = {&ps.grad(), &ps.param(), &ps.update()};
    for (int f = 0; f < kNormFields; ++f) {
      if (auto err = ReadNorm(*fields[f], kFieldNames[f], in.step(), &pc.norms[f])) {
        err->message = "parameter index " + std::to_string(ps.index()) + ": " + err->message;
        return err;
      }
    }
    switch (ps.radial_update().value_case()) {
      case v1::RadialValue::kRadial:
        pc.radial = {RadialContribution::Form::kRadial, ps.radial_update().radial()};
        break;
      case v1::RadialValue::kDot:
        // The merged step divides the ranks' dots by the merged parameter norm: a rank that sends
        // its part of the inner product sends its part of the norm.
        if (!pc.norms[static_cast<int>(NormField::kParam)].present) {
          return IngestError{IngestErrorReason::kInvalidMessage,
                             "parameter index " + std::to_string(ps.index()) +
                                 ": radial_update.dot needs this rank's parameter norm (param) in the same report",
                             in.step()};
        }
        pc.radial = {RadialContribution::Form::kDot, ps.radial_update().dot()};
        break;
      case v1::RadialValue::VALUE_NOT_SET: pc.radial = {}; break;
    }
  }
  // Protobuf maps iterate in no fixed order: sort so repeats compare equal.
  out->extra.resize(in.extra_size());
  size_t e = 0;
  for (const auto& [k, v] : in.extra()) {
    out->extra[e].first.assign(k);
    out->extra[e].second = v;
    ++e;
  }
  std::sort(out->extra.begin(), out->extra.end());
  for (const auto& [k, v] : out->extra) {
    if (k.empty() || k.size() > kMaxParamName) {
      return IngestError{IngestErrorReason::kInvalidMessage,
                         "extra series key '" + k.substr(0, 64) + "' is empty or longer than 256 bytes", in.step()};
    }
    if (IsBuiltInKey(k)) {
      return IngestError{IngestErrorReason::kInvalidMessage,
                         "extra series key '" + k.substr(0, 64) +
                             "' names a built-in series (send it in its own field: total_grad, loss, z_loss, "
                             "learning_rate, tokens or params)",
                         in.step()};
    }
  }
  return std::nullopt;
}

std::optional<IngestError> EventFromProto(const v1::Event& in, EventRecord* out) {
  if (in.step() > kMaxStep) {
    return IngestError{IngestErrorReason::kInvalidMessage, TooLargeStep("event step", in.step()), in.step()};
  }
  if (in.text().empty() || in.text().size() > kMaxEventText) {
    return IngestError{IngestErrorReason::kInvalidMessage,
                       "event text must be 1 to 1024 bytes (got " + std::to_string(in.text().size()) + ")", in.step()};
  }
  out->step = in.step();
  out->text = in.text();
  return std::nullopt;
}

std::optional<IngestError> CatalogUpdateFromProto(const v1::CatalogUpdate& in, size_t max_params,
                                                  std::vector<ParamChange>* out) {
  const auto invalid = [&](std::string why) {
    return IngestError{IngestErrorReason::kInvalidMessage,
                       "catalog update from step " + std::to_string(in.from_step()) + ": " + std::move(why),
                       in.from_step()};
  };
  if (in.from_step() > kMaxStep) return invalid(TooLargeStep("from_step", in.from_step()));
  if (in.params_size() == 0) return invalid("it names no parameter");
  if (static_cast<size_t>(in.params_size()) > max_params) {
    return invalid("it names " + std::to_string(in.params_size()) + " parameters, more than the " +
                   std::to_string(max_params) + " a catalog may hold");
  }
  out->clear();
  for (const v1::ParamChange& p : in.params()) {
    if (!ValidParamName(p.name())) return invalid("name '" + p.name().substr(0, 64) + "' is invalid");
    ParamChange c{.name = p.name()};
    if (p.has_weight_decay()) {
      if (!std::isfinite(p.weight_decay()) || p.weight_decay() < 0) {
        return invalid("'" + p.name() + "': weight_decay must be finite and ≥ 0");
      }
      c.weight_decay = p.weight_decay();
    }
    if (p.has_kind()) {
      if (!v1::ParamKind_IsValid(p.kind())) return invalid("'" + p.name() + "': unknown kind");
      c.kind = static_cast<ParamKind>(p.kind());
    }
    if (p.has_role()) c.role = p.role();
    if (p.has_group()) c.group = p.group();
    out->push_back(std::move(c));
  }
  return std::nullopt;
}

std::optional<IngestError> GoodbyeFromProto(const v1::Goodbye& in, EndReason* reason, std::string* message) {
  if (in.message().size() > kMaxEventText) {
    return IngestError{IngestErrorReason::kInvalidMessage,
                       "goodbye message must be at most 1024 bytes (got " + std::to_string(in.message().size()) + ")"};
  }
  switch (in.reason()) {
    case v1::GOODBYE_REASON_UNSPECIFIED:
    case v1::GOODBYE_REASON_FINISHED: *reason = EndReason::kFinished; break;
    case v1::GOODBYE_REASON_STOPPED: *reason = EndReason::kStopped; break;
    default:
      return IngestError{IngestErrorReason::kInvalidMessage,
                         "unknown goodbye reason " + std::to_string(static_cast<int>(in.reason()))};
  }
  *message = in.message();
  return std::nullopt;
}

v1::ErrorReason ReasonToProto(runs::IngestErrorReason reason) {
  const int r = static_cast<int>(reason);
  return v1::ErrorReason_IsValid(r) ? static_cast<v1::ErrorReason>(r) : v1::ERROR_REASON_UNSPECIFIED;
}

void ConfigToProto(const RunConfig& in, v1::RunConfig* out) {
  out->set_hidden_size(in.hidden_size);
  if (in.z_loss_coef) out->set_z_loss_coef(*in.z_loss_coef);
  out->set_optimizer(in.optimizer);
  if (in.weight_decay) out->set_weight_decay(*in.weight_decay);
  if (in.warmup_steps) out->set_warmup_steps(*in.warmup_steps);
  if (in.total_steps) out->set_total_steps(*in.total_steps);
  out->mutable_extra()->insert(in.extra.begin(), in.extra.end());
}

void ParamToProto(const ParamInfo& in, v1::ParamInfo* out) {
  out->set_name(in.name);
  out->set_numel(in.numel);
  out->set_kind(static_cast<v1::ParamKind>(in.kind));
  out->set_weight_decay(in.weight_decay);
  if (in.init_norm) out->set_init_norm(*in.init_norm);
  out->set_role(in.role);
  out->set_group(in.group);
}

void RunInfoToProto(const runs::RunInfo& in, v1::RunInfo* out) {
  out->set_run_id(in.run_id);
  out->set_state(!in.ended ? v1::RUN_STATE_ACTIVE : in.end.clean() ? v1::RUN_STATE_FINISHED : v1::RUN_STATE_ENDED);
  out->set_world_size(in.world_size);
  out->mutable_labels()->insert(in.labels.begin(), in.labels.end());
  out->set_step_count(in.step_count);
  out->set_first_step(in.first_step);
  out->set_last_step(in.last_step);
  out->set_last_wall_time(in.last_wall_time);
  out->set_open_streams(in.open_streams);
  out->set_steps_per_second(in.steps_per_second);
  out->set_partial_steps(in.partial_steps);
  out->set_ended_at(in.end.ended_at);
  if (in.end.clean()) {
    out->set_end_reason(in.end.reason == EndReason::kStopped ? v1::GOODBYE_REASON_STOPPED
                                                             : v1::GOODBYE_REASON_FINISHED);
    out->set_end_message(in.end.message);
  }
}

void StoredRunToProto(const store::StoredRun& in, v1::RunInfo* out) {
  out->set_run_id(in.meta.run_id);
  out->set_state(v1::RUN_STATE_ARCHIVED);
  out->set_world_size(in.meta.world_size);
  out->mutable_labels()->insert(in.meta.labels.begin(), in.meta.labels.end());
  out->set_step_count(in.step_count);
  out->set_first_step(in.first_step);
  out->set_last_step(in.last_step);
  out->set_last_wall_time(in.last_wall_time);
  out->set_ended_at(in.end.ended_at);
  if (in.end.clean()) {
    out->set_end_reason(in.end.reason == EndReason::kStopped ? v1::GOODBYE_REASON_STOPPED
                                                             : v1::GOODBYE_REASON_FINISHED);
    out->set_end_message(in.end.message);
  }
}

v1::AlertState AlertStateToProto(alerts::AlertState state) {
  switch (state) {
    case alerts::AlertState::kPending: return v1::ALERT_STATE_PENDING;
    case alerts::AlertState::kFiring: return v1::ALERT_STATE_FIRING;
    case alerts::AlertState::kResolved: return v1::ALERT_STATE_RESOLVED;
    case alerts::AlertState::kInactive: return v1::ALERT_STATE_INACTIVE;
  }
  return v1::ALERT_STATE_UNSPECIFIED;
}

void AlertToProto(const alerts::Alert& in, v1::Alert* out) {
  out->set_fingerprint(alerts::FingerprintHex(in.labels));
  out->set_name(in.name);
  out->set_state(AlertStateToProto(in.state));
  out->mutable_labels()->insert(in.labels.begin(), in.labels.end());
  out->mutable_annotations()->insert(in.annotations.begin(), in.annotations.end());
  out->set_step(in.step);
  out->set_value(in.value);
  out->set_starts_at(in.starts_at);
  out->set_ends_at(in.ends_at);
}

void AnalysisToProto(const runs::RunAnalysis& in, v1::Analysis* out) {
  for (const auto& s : in.slopes) {
    v1::SeriesSlope* p = out->add_slopes();
    p->set_key(s.key);
    p->set_window_steps(s.window_steps);
    p->set_slope_per_kstep(s.fit.slope_per_kstep());
    p->set_stderr_per_kstep(s.fit.slope_stderr_per_kstep());
    p->set_samples(static_cast<uint32_t>(s.fit.samples));
    p->set_fitted_value(s.fit.value_at_last_step);
  }
  for (const auto& c : in.slope_changes) {
    v1::SlopeChangeAtEvent* p = out->add_slope_changes();
    p->set_key(c.key);
    p->set_event_step(c.change.event_step);
    p->set_event_text(c.event_text);
    p->set_before_per_kstep(c.change.before.slope_per_kstep());
    p->set_after_per_kstep(c.change.after.slope_per_kstep());
    p->set_before_stderr_per_kstep(c.change.before_stderr_per_kstep);
    p->set_after_stderr_per_kstep(c.change.after_stderr_per_kstep);
    p->set_ratio(c.change.ratio);
    p->set_difference_per_kstep(c.change.difference_per_kstep);
    p->set_after_samples(static_cast<uint32_t>(c.after_samples));
    p->set_after_window_full(c.change.after_window_full);
  }
  for (const auto& c : in.change_points) {
    v1::ChangePoint* p = out->add_change_points();
    p->set_key(c.key);
    p->set_step(c.change.step);
    p->set_before_per_kstep(c.change.slope_before_per_kstep);
    p->set_after_per_kstep(c.change.slope_after_per_kstep);
    p->set_ratio(c.change.ratio);
  }
  for (const auto& f : in.forecasts) {
    v1::ThresholdForecast* p = out->add_forecasts();
    p->set_key(f.key);
    p->set_threshold(f.threshold);
    p->set_current_value(f.current_value);
    p->set_slope_per_kstep(f.slope_per_kstep);
    p->set_window_steps(f.window_steps);
    p->set_reachable(f.reachable);
    p->set_steps_to_threshold(f.steps_to_threshold);
    p->set_at_step(f.at_step);
    p->set_fit_samples(f.fit_samples);
    p->set_fit_span_steps(f.fit_span_steps);
  }
  for (const auto& s : in.shares) {
    v1::GradNormShare* p = out->add_shares();
    p->set_name(s.name);
    p->set_is_group(s.is_group);
    p->set_share(s.share);
    p->set_slope_per_kstep(s.slope_per_kstep);
  }
  for (const auto& a : in.amplifications) {
    v1::NormAmplification* p = out->add_amplifications();
    p->set_param(a.param);
    p->set_norm(a.norm);
    p->set_init_norm(a.init_norm);
    p->set_amplification(a.amplification);
  }
  for (const auto& g : in.growth_without_decay) {
    v1::GrowthWithoutDecay* p = out->add_growth_without_decay();
    p->set_param(g.param);
    p->set_growth_factor(g.growth_factor);
    p->set_slope_per_kstep(g.slope_per_kstep);
    p->set_window_steps(g.window_steps);
    p->set_amplification(g.amplification);
    p->set_norm(g.norm);
  }
  for (const runs::ProjectionInfo& x : in.projections) {
    v1::NormProjection* p = out->add_projections();
    p->set_param(x.param);
    p->set_weight_decay(x.weight_decay);
    p->set_from_step(x.from_step);
    p->set_to_step(x.to_step);
    p->set_norm_now(x.norm_now);
    p->set_norm(x.norm);
    p->set_equilibrium_norm(x.equilibrium_norm);
    p->set_time_constant_steps(x.time_constant_steps);
    p->set_learning_rate(x.learning_rate);
    p->set_radial(x.radial);
    p->set_orthogonal(x.orthogonal);
    p->set_orthogonal_known(x.orthogonal_known);
    p->set_radial_known(x.radial_known);
    p->set_schedule(x.schedule);
    p->set_total_grad_norm(x.total_grad_norm);
  }
  for (const runs::RemediationInfo& x : in.remediations) {
    v1::RemediationCheck* p = out->add_remediations();
    p->set_param(x.param);
    p->set_step(x.step);
    p->set_weight_decay(x.weight_decay);
    p->set_previous_weight_decay(x.previous_weight_decay);
    p->set_norm_at_step(x.norm_at_step);
    p->set_at_step(x.at_step);
    p->set_projected_norm(x.projected_norm);
    p->set_actual_norm(x.actual_norm);
    p->set_time_constant_steps(x.time_constant_steps);
    p->set_unchanged_norm(x.unchanged_norm);
    p->set_verdict(x.verdict);
  }
}

void SummaryToProto(const runs::RunSummary& in, v1::RunSummary* out) {
  RunInfoToProto(in.info, out->mutable_info());
  ConfigToProto(in.config, out->mutable_config());
  for (const ParamInfo& p : in.params) ParamToProto(p, out->add_params());
  for (const runs::LatestSample& l : in.latest) {
    v1::LatestValue* v = out->add_latest();
    v->set_key(l.key);
    v->set_step(l.step);
    v->set_value(l.value);
  }
  for (const EventRecord& e : in.events) {
    v1::EventInfo* ev = out->add_events();
    ev->set_step(e.step);
    ev->set_text(e.text);
    ev->set_source(e.source);
    ev->set_recorded_at(e.recorded_at);
  }
  AnalysisToProto(in.analysis, out->mutable_analysis());
  out->set_nonfinite_count(in.info.nonfinite_count);
  out->set_last_nonfinite_step(in.info.last_nonfinite_step);
  out->set_client_dropped_steps(in.info.client_dropped_steps);
  out->set_event_count(in.event_count);
}

}  // namespace gradwatch::ingest

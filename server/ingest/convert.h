// Conversion between the wire schema and core types, with the validation that needs only the
// message itself. Generated proto types stop at this module.
#pragma once

#include <optional>

#include "alerts/alert.h"
#include "gradwatch/v1/gradwatch.pb.h"
#include "server/core/types.h"
#include "server/runs/errors.h"
#include "server/runs/run.h"
#include "server/store/journal.h"

namespace gradwatch::ingest {

struct HelloLimits {
  uint32_t max_world_size = 1 << 20;
  size_t max_params = 65536;
};

// Validates a Hello (run id, rank < world size, catalog entries, run labels) and converts it.
// Run label names must be Prometheus label names ([a-zA-Z_][a-zA-Z0-9_]*, not starting with the
// reserved "__"): they are written as label names on /metrics; any other is refused with
// INVALID_HELLO naming it. Label values may hold any bytes (the exporter escapes them).
std::optional<runs::IngestError> HelloFromProto(const v1::Hello& in, const HelloLimits& limits, RunMeta* meta,
                                                uint32_t* rank);

// Converts StepStats into *out (whose buffers are reused). Rejects negative finite norms and extra
// keys that name a built-in series (grad/norm/total, train/loss, train/z_loss,
// optim/learning_rate, train/tokens, or under grad/norm/, params/norm/, updates/norm/,
// updates/radial/) and a radial update's `dot` without the rank's parameter norm; NaN and ±Inf
// pass (they are signals). Catalog checks happen in the run.
std::optional<runs::IngestError> StepFromProto(const v1::StepStats& in, uint64_t seq, RankStep* out);

// Validates an event's text (1..1024 bytes) and converts it.
std::optional<runs::IngestError> EventFromProto(const v1::Event& in, EventRecord* out);
// A CatalogUpdate's changes, checked for what needs no catalog (names, kinds, the weight decay's
// range, at most max_params entries); Run::AddCatalogChange checks them against the run's.
std::optional<runs::IngestError> CatalogUpdateFromProto(const v1::CatalogUpdate& in, size_t max_params,
                                                        std::vector<ParamChange>* out);

// Validates a Goodbye (message of at most 1024 bytes, a known reason; UNSPECIFIED reads as
// FINISHED) and converts it.
std::optional<runs::IngestError> GoodbyeFromProto(const v1::Goodbye& in, EndReason* reason, std::string* message);

// A run id is 1..128 bytes of [A-Za-z0-9._:/-].
bool ValidRunId(const std::string& id);

v1::ErrorReason ReasonToProto(runs::IngestErrorReason reason);
void RunInfoToProto(const runs::RunInfo& in, v1::RunInfo* out);
// A run only the journal holds: state ARCHIVED.
void StoredRunToProto(const store::StoredRun& in, v1::RunInfo* out);
v1::AlertState AlertStateToProto(alerts::AlertState state);
void AlertToProto(const alerts::Alert& in, v1::Alert* out);
void AnalysisToProto(const runs::RunAnalysis& in, v1::Analysis* out);
void SummaryToProto(const runs::RunSummary& in, v1::RunSummary* out);
void ParamToProto(const ParamInfo& in, v1::ParamInfo* out);
void ConfigToProto(const RunConfig& in, v1::RunConfig* out);

}  // namespace gradwatch::ingest

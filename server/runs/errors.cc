#include "server/runs/errors.h"

namespace gradwatch::runs {

std::string_view IngestErrorReasonName(IngestErrorReason reason) {
  switch (reason) {
    case IngestErrorReason::kNoHello: return "no_hello";
    case IngestErrorReason::kInvalidHello: return "invalid_hello";
    case IngestErrorReason::kWorldSizeChanged: return "world_size_changed";
    case IngestErrorReason::kCatalogMismatch: return "catalog_mismatch";
    case IngestErrorReason::kUnknownParam: return "unknown_param";
    case IngestErrorReason::kNegativeNorm: return "negative_norm";
    case IngestErrorReason::kStepRegression: return "step_regression";
    case IngestErrorReason::kStepConflict: return "step_conflict";
    case IngestErrorReason::kOversized: return "oversized";
    case IngestErrorReason::kInvalidMessage: return "invalid_message";
    case IngestErrorReason::kLimitExceeded: return "limit_exceeded";
    case IngestErrorReason::kSuperseded: return "superseded";
    case IngestErrorReason::kLateForStep: return "late_for_step";
    case IngestErrorReason::kStorageUnavailable: return "storage_unavailable";
  }
  return "unknown";
}

const std::array<IngestErrorReason, 14>& AllIngestErrorReasons() {
  static const std::array<IngestErrorReason, 14> kAll = {
      IngestErrorReason::kNoHello,         IngestErrorReason::kInvalidHello,       IngestErrorReason::kWorldSizeChanged,
      IngestErrorReason::kCatalogMismatch, IngestErrorReason::kUnknownParam,       IngestErrorReason::kNegativeNorm,
      IngestErrorReason::kStepRegression,  IngestErrorReason::kStepConflict,       IngestErrorReason::kOversized,
      IngestErrorReason::kInvalidMessage,  IngestErrorReason::kLimitExceeded,      IngestErrorReason::kSuperseded,
      IngestErrorReason::kLateForStep,     IngestErrorReason::kStorageUnavailable,
  };
  return kAll;
}

}  // namespace gradwatch::runs

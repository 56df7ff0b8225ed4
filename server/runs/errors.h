// Why an ingest message was refused. Mirrors gradwatch.v1.ErrorReason; ingest converts.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace gradwatch::runs {

enum class IngestErrorReason : int {
  kNoHello = 1,
  kInvalidHello = 2,
  kWorldSizeChanged = 3,
  kCatalogMismatch = 4,
  kUnknownParam = 5,
  kNegativeNorm = 6,
  kStepRegression = 7,
  kStepConflict = 8,
  kOversized = 9,
  kInvalidMessage = 10,
  kLimitExceeded = 11,
  kSuperseded = 12,
  kLateForStep = 13,
  kStorageUnavailable = 14,
};
inline constexpr int kIngestErrorReasonCount = 15;  // indices 1..14 used

// Label value for metrics and logs: "no_hello", "unknown_param", ...
std::string_view IngestErrorReasonName(IngestErrorReason reason);
// Every reason, for pre-creating per-reason counters.
const std::array<IngestErrorReason, 14>& AllIngestErrorReasons();

struct IngestError {
  IngestErrorReason reason;
  std::string message;
  uint64_t step = 0;
};

}  // namespace gradwatch::runs

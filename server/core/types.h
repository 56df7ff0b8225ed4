// Leaf types shared by every server module. No gRPC, no protobuf: ingest converts into these.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gradwatch {

// A value not known: no point, too few points to fit, a ratio of zero.
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum class ParamKind : int {
  kUnspecified = 0,
  kNormGain = 1,
  kOutput = 2,
  kEmbedding = 3,
  kRouter = 4,
  kAttention = 5,
  kMlp = 6,
  kOther = 7,
};

// "norm_gain", "output", ... ; the names used in YAML, JSON and the `group` label.
std::string_view ParamKindName(ParamKind kind);
// Accepts the names above and common aliases ("lm_head", "norm", "embed"); nullopt when unknown.
std::optional<ParamKind> ParseParamKind(std::string_view name);

struct ParamInfo {
  std::string name;
  uint64_t numel = 0;
  ParamKind kind = ParamKind::kUnspecified;
  double weight_decay = 0.0;
  std::optional<double> init_norm;
  std::string role;
  std::string group;  // empty: the kind's name

  // The aggregation group: `group` if set, else the kind's name.
  std::string_view EffectiveGroup() const;
  bool operator==(const ParamInfo&) const = default;
};

struct RunConfig {
  uint64_t hidden_size = 0;
  std::optional<double> z_loss_coef;
  std::string optimizer;
  std::optional<double> weight_decay;
  std::optional<uint64_t> warmup_steps;  // the learning-rate warm-up's length (steps)
  std::optional<uint64_t> total_steps;   // the run's last step (steps)
  std::map<std::string, std::string> extra;
  bool operator==(const RunConfig&) const = default;
};

// What a run is: fixed by its first Hello, catalog extended by later ones.
struct RunMeta {
  std::string run_id;
  uint32_t world_size = 1;
  std::map<std::string, std::string> labels;
  RunConfig config;
  std::vector<ParamInfo> params;
  double created_at = 0;  // seconds since the Unix epoch
  // Hello only (never journaled with the run): the step this process resumed from, when it
  // resumed from a checkpoint (see Hello.resume_from_step).
  std::optional<uint64_t> resume_from_step;
  // Changes of existing catalog entries applied so far (runs/catalog_change.h; not journaled): a
  // reader that keeps a copy of the catalog's entries refreshes it when this moves.
  uint64_t catalog_changes = 0;
};

// How a run ended. A Goodbye on the wire is a clean end (finished or stopped); a run whose streams
// closed without one ends by inactivity and is presumed dead.
enum class EndReason : int {
  kNone = 0,      // not ended
  kInactive = 1,  // no stream and no step for runs.end_after_seconds, without a Goodbye
  kFinished = 2,  // Goodbye FINISHED
  kStopped = 3,   // Goodbye STOPPED
};
// "active", "inactive", "finished", "stopped".
std::string_view EndReasonName(EndReason reason);

struct RunEnd {
  double ended_at = 0;  // seconds since the Unix epoch; 0 while the run is active
  EndReason reason = EndReason::kNone;
  std::string message;  // the Goodbye's message

  bool ended() const { return ended_at > 0; }
  // Said on the wire: such a run never pages as dead.
  bool clean() const { return reason == EndReason::kFinished || reason == EndReason::kStopped; }
  bool operator==(const RunEnd&) const = default;
};

// The largest step the daemon keeps (2^63 - 1): the journal stores steps as SQLite's signed 64-bit
// integers, so a larger step is refused where it arrives, never acknowledged.
inline constexpr uint64_t kMaxStep = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Index of a series within its run's SeriesCatalog.
using SeriesId = uint32_t;
inline constexpr SeriesId kNoSeries = std::numeric_limits<SeriesId>::max();

// Series keys follow the W&B / Levanter convention.
namespace keys {
inline constexpr std::string_view kTotalGradNorm = "grad/norm/total";
inline constexpr std::string_view kLoss = "train/loss";
inline constexpr std::string_view kZLoss = "train/z_loss";
inline constexpr std::string_view kLearningRate = "optim/learning_rate";
// A parameter's own learning rate, when its param group's differs from the run's (an extra series
// the trainer sends: the what-if projects that parameter with it).
inline constexpr std::string_view kParamLearningRatePrefix = "optim/learning_rate/";
inline constexpr std::string_view kTokens = "train/tokens";
inline constexpr std::string_view kGradNormPrefix = "grad/norm/";
inline constexpr std::string_view kParamNormPrefix = "params/norm/";
inline constexpr std::string_view kUpdateNormPrefix = "updates/norm/";
// A parameter's radial update ⟨Δw, w⟩/|w| (signed: RadialContribution).
inline constexpr std::string_view kRadialUpdatePrefix = "updates/radial/";
// The whole model's parameter and update norms, as a trainer's log prints them ("params norm"):
// extra series, since no parameter may be named "total".
inline constexpr std::string_view kTotalParamNorm = "params/norm/total";
inline constexpr std::string_view kTotalUpdateNorm = "updates/norm/total";
// Iterations of the last logging interval whose optimizer step was skipped (an overflow, a
// non-finite gradient), and those of them whose loss was NaN or infinite: counts, which the
// non_finite rules read as non-finite when above 0.
inline constexpr std::string_view kSkippedIterations = "train/skipped_iterations";
inline constexpr std::string_view kNanIterations = "train/nan_iterations";
std::string GradNorm(std::string_view param);
std::string ParamNorm(std::string_view param);
std::string UpdateNorm(std::string_view param);
std::string RadialUpdate(std::string_view param);
}  // namespace keys

// Whether `text` matches `pattern`, where '*' matches any run of characters (none included), '?'
// any one character, and every other character itself: series keys, parameter names and groups in
// rules and in the configuration.
bool GlobMatches(std::string_view pattern, std::string_view text);

// Which of a parameter's three norms.
enum class NormField : int { kGrad = 0, kParam = 1, kUpdate = 2 };
inline constexpr int kNormFields = 3;

// A norm as a rank reported it. Ranks merge as sqrt(sum of squares), so both forms become a
// squared contribution. Squares are long double: the square of a finite double norm above 1.3e154
// overflows a double to +Inf, and a finite norm must merge back to a finite norm (long double's
// exponent reaches 1e4932 on x86-64 and AArch64).
struct NormContribution {
  bool present = false;
  long double sq = 0.0L;  // squared contribution (norm² or the reported squared sum)

  static NormContribution FromNorm(double norm) {
    return {true, static_cast<long double>(norm) * static_cast<long double>(norm)};
  }
  static NormContribution FromSqSum(double sq_sum) { return {true, sq_sum}; }
  bool operator==(const NormContribution&) const = default;
};

// A parameter's radial update ⟨Δw, w⟩/|w| as a rank reported it: ranks merge by summing, so a
// rank holding the whole parameter gives `radial`, a rank holding a shard its partial inner
// product ⟨Δw_s, w_s⟩ (`dot`), which the merged step divides by the merged parameter norm.
struct RadialContribution {
  enum class Form : uint8_t { kNone, kRadial, kDot };
  Form form = Form::kNone;
  double value = 0;
  bool present() const { return form != Form::kNone; }
  bool operator==(const RadialContribution&) const = default;
};

struct ParamContribution {
  uint32_t index = 0;
  NormContribution norms[kNormFields];
  RadialContribution radial;
  bool operator==(const ParamContribution&) const = default;
};

// One rank's report of one step, after validation against the catalog.
struct RankStep {
  uint64_t step = 0;
  double wall_time = 0;
  std::optional<double> loss;
  std::optional<double> z_loss;
  std::optional<double> learning_rate;
  std::optional<uint64_t> tokens;
  NormContribution total_grad;
  std::vector<ParamContribution> params;
  std::vector<std::pair<std::string, double>> extra;  // sorted by key
  uint64_t client_dropped_steps = 0;
  uint64_t seq = 0;

  // Equality of the reported values (not seq or client_dropped_steps): a repeat that compares
  // equal is idempotent.
  bool SameValues(const RankStep& other) const;
};

struct SeriesValue {
  SeriesId id = kNoSeries;
  double value = 0;
};

// A step of a run once every rank reported it (or the assembly timed out): the unit that is
// stored, journaled and analysed.
struct CompletedStep {
  uint64_t step = 0;
  double wall_time = 0;  // seconds since the Unix epoch; 0 when unknown
  bool partial = false;  // completed by timeout or overtaken, not every rank reported
  uint32_t ranks_reported = 0;
  std::vector<SeriesValue> values;
  uint64_t client_dropped_steps = 0;
};

struct EventRecord {
  uint64_t step = 0;
  std::string text;
  // "trainer", "annotate", "daemon" (recorded by the daemon itself) or "catalog" (a catalog change,
  // whose `data` holds the change: runs/catalog_change.h).
  std::string source;
  double recorded_at = 0;
  std::string data;  // what a machine reads of the event; empty for most
};

// New values of one catalog entry (by name) from a step on; an unset field keeps its value.
struct ParamChange {
  std::string name;
  std::optional<double> weight_decay;
  std::optional<ParamKind> kind;
  std::optional<std::string> role;
  std::optional<std::string> group;
  bool operator==(const ParamChange&) const = default;
};

bool IsFinite(double v);

}  // namespace gradwatch

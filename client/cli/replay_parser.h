// Parsing of W&B-history-style JSONL for `gradwatch replay`: one JSON object per line, keyed by
// the series keys the daemon uses. No I/O here, so every rule is unit-testable.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "gradwatch/v1/gradwatch.pb.h"

namespace gradwatch::cli {

// Python's json module writes bare NaN, Infinity and -Infinity, which are not JSON. Rewrites
// those tokens (outside strings) as the strings "NaN", "Infinity" and "-Infinity", which the
// parser then reads as numbers.
std::string QuoteNonFiniteTokens(std::string_view line);

// Parses one line of JSON as replay and tail read it (bare NaN and ±Infinity allowed). A key
// that appears twice in one object is an error, never a silent last-one-wins. On an error sets
// *error (why, naming the key) and returns a discarded value.
nlohmann::json ParseJsonLine(std::string_view line, std::string* error);

// Which of a parameter's values a key names: its three norms, or its radial update
// (updates/radial/<param>, ⟨Δw, w⟩/|w|, signed).
enum class NormField { kGrad, kParam, kUpdate, kRadial };

struct ParamValue {
  std::string param;
  NormField field;
  double value;
};

// A line with a `_step`: the metrics it carries, an event and/or a catalog change.
struct StepRecord {
  uint64_t step = 0;
  std::optional<double> timestamp;  // `_timestamp`, seconds since the Unix epoch
  // Scalar fields, total grad norm and extra are filled; per-parameter values wait for the
  // catalog in `params`.
  v1::StepStats stats;
  std::vector<ParamValue> params;
  bool has_metrics = false;          // at least one numeric key besides `_`-keys
  std::optional<std::string> event;  // `"event": "text"`
  // `"params": [{"name": ..., "weight_decay": ...}, ...]`: catalog entries' new weight decay,
  // kind, role or group from this step on (the header's `params` shape; numel and init_norm are
  // the header's alone).
  std::vector<v1::ParamChange> catalog_update;

  // A step's metrics are sent for this line: it has some, or it is a bare `_step` line.
  bool is_step() const { return has_metrics || (!event && catalog_update.empty()); }
};

// A step line's `"params"` (a non-empty array of the header's entries, by name): the catalog
// changes it makes from its step on, or why they cannot be sent. `replay` and `tail` read it.
std::optional<std::string> ParseCatalogChanges(const nlohmann::json& list, std::vector<v1::ParamChange>* out);

// The optional first line: run name, config, labels, parameter catalog.
struct HeaderRecord {
  std::string run;
  v1::RunConfig config;
  std::map<std::string, std::string> labels;
  // `"resume_from_step": N`: the history resumes a run from its checkpoint at step N (steps).
  std::optional<uint64_t> resume_from_step;
  std::vector<v1::ParamInfo> params;
  // Which params entries gave a kind / weight decay (the others are inferred).
  std::vector<bool> kind_given;
  std::vector<bool> weight_decay_given;
};

struct BlankLine {};

using ReplayLine = std::variant<BlankLine, HeaderRecord, StepRecord>;

// A parsed line, or why it was rejected.
struct LineResult {
  std::optional<ReplayLine> line;
  std::string error;
  bool ok() const { return line.has_value(); }
};

// Parses one line. `first_line` allows a header.
LineResult ParseReplayLine(std::string_view text, bool first_line);

// Kind inferred from a parameter's name (see the replay documentation for the rules).
v1::ParamKind InferParamKind(std::string_view name);
// Parses "norm_gain", "output", ... and the aliases "lm_head", "norm"; nullopt when unknown.
std::optional<v1::ParamKind> ParseParamKind(std::string_view name);
// "norm_gain", "output", ...
std::string_view ParamKindName(v1::ParamKind kind);

// The parameter catalog of a replay: the header's entries first, then every parameter a key
// names, in order of first appearance, with kind and weight decay inferred.
class ReplayCatalog {
 public:
  // Starts from the header's entries (none when there is no header).
  void SetHeader(const HeaderRecord& header);
  // Registers the parameters named by a step line.
  void AddFrom(const StepRecord& record);
  // Index of a parameter, or nullopt.
  std::optional<uint32_t> IndexOf(const std::string& name) const;
  // The final catalog. Inferred entries get weight decay 0 for norm gains, else the header
  // config's weight_decay (0 when unknown).
  std::vector<v1::ParamInfo> Params() const;

 private:
  std::vector<v1::ParamInfo> params_;
  std::vector<bool> kind_given_;
  std::vector<bool> weight_decay_given_;
  std::optional<double> default_weight_decay_;
  std::unordered_map<std::string, uint32_t> index_;
};

// Completes a record's StepStats with its per-parameter values, in catalog order. Parameters
// missing from the catalog (impossible after a pre-scan) are skipped.
v1::StepStats ToStepStats(const StepRecord& record, const ReplayCatalog& catalog);

// `s` with A-Z lowered; other bytes as they are (keys and format names are ASCII).
std::string AsciiLower(std::string_view s);

}  // namespace gradwatch::cli

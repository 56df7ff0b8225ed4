// A run's catalog changes over its life: from a step on, a trainer may change entries' weight
// decay, kind, role or group (a CatalogUpdate, or a Hello whose catalog differs in those fields
// only). A change is kept as an event of the run (source "catalog"): its text says what changed for
// people, its data holds the change for the daemon (JSON), so that it is journaled, read back at a
// restart and undone by a rewind exactly as events are.
//
// Pure functions: no I/O, no locks.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/core/status.h"
#include "server/core/types.h"

namespace gradwatch::runs {

inline constexpr std::string_view kCatalogEventSource = "catalog";

// Why `changes` cannot apply to `catalog` (an unknown or repeated name, a weight decay that is not
// finite and ≥ 0, a role or group over 256 bytes, a change that changes nothing); nullopt: it can.
std::optional<std::string> CheckCatalogChange(const std::vector<ParamChange>& changes,
                                              const std::vector<ParamInfo>& catalog);

// The changes that turn `held` into `wanted` in the entries both have (by index, same names):
// weight decay, kind, role and group; empty when they agree.
std::vector<ParamChange> CatalogDiff(const std::vector<ParamInfo>& held, const std::vector<ParamInfo>& wanted);

// Applies `changes` (checked) to `catalog` and returns what undoes them (the previous values of the
// fields changed).
std::vector<ParamChange> ApplyCatalogChange(const std::vector<ParamChange>& changes, std::vector<ParamInfo>& catalog);

// "catalog change: final_norm.weight weight decay 0 → 0.1; lm_head.weight kind output → other",
// from `catalog` as it is before the change.
std::string DescribeCatalogChange(const std::vector<ParamChange>& changes, const std::vector<ParamInfo>& catalog);

// The change as the event's data: [{"name": ..., "weight_decay": ..., "kind": "norm_gain", ...}],
// and back. Parse errors name what is wrong.
std::string CatalogChangeData(const std::vector<ParamChange>& changes);
StatusOr<std::vector<ParamChange>> ParseCatalogChangeData(std::string_view data);

// The catalog event of `changes` at `step` (text from `catalog` before the change).
EventRecord CatalogChangeEvent(uint64_t step, const std::vector<ParamChange>& changes,
                               const std::vector<ParamInfo>& catalog, double now);

}  // namespace gradwatch::runs

#include "server/runs/memory_budget.h"

#include <unistd.h>

#include <algorithm>

namespace gradwatch::runs {

namespace {

// Bytes an empty parameter costs a run, beside its name: the catalog entry (and its copies in the
// analytics), three series entries with their keys and maps, three empty store::Series, three
// empty analytics trackers and its share state. Measured with a 65,536-parameter catalog
// (tests/integration/memory_test.cc) and rounded up.
constexpr uint64_t kBytesPerParam = 4096;
// Each name is held about eight times (catalog entries, series keys, map keys).
constexpr uint64_t kNameCopies = 8;

// A rank's state in its run (Run's RankState with an empty last report, and its
// StepAssembler contributor entry), rounded up; run.cc checks sizeof(RankState) against it.
constexpr uint64_t kBytesPerRank = 320;

}  // namespace

uint64_t MemoryBudget::RankBytes(uint32_t world_size, size_t max_pending_steps) {
  const uint64_t world = std::max<uint32_t>(1, world_size);
  uint64_t bytes = world * kBytesPerRank;
  if (world > 32) bytes += (world + 63) / 64 * 8 * max_pending_steps;  // PendingStep::rank_bits
  return bytes;
}

uint64_t MemoryBudget::WorldBytes(const RunMeta& meta, size_t max_pending_steps) {
  uint64_t bytes = RankBytes(meta.world_size, max_pending_steps);
  for (const auto& [key, value] : meta.labels) bytes += kNameCopies * (key.size() + value.size());
  return bytes;
}

bool MemoryBudget::TryCharge(uint64_t bytes) {
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (limit_ != 0 && (bytes > limit_ || used > limit_ - bytes)) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

uint64_t MemoryBudget::CatalogBytes(const std::vector<ParamInfo>& params, size_t first) {
  uint64_t bytes = 0;
  for (size_t i = first; i < params.size(); ++i) {
    bytes += kBytesPerParam + kNameCopies * (params[i].name.size() + params[i].group.size() + params[i].role.size());
  }
  return bytes;
}

uint64_t MemoryBudget::DefaultLimitBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return uint64_t{4} << 30;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) / 4;
}

}  // namespace gradwatch::runs

#include "server/runs/memory_budget.h"

#include <unistd.h>

namespace gradwatch::runs {

namespace {

// Bytes an empty parameter costs a run, beside its name: the catalog entry (and its copies in the
// analytics), three series entries with their keys and maps, three empty store::Series, three
// empty analytics trackers and its share state. Measured with a 65,536-parameter catalog
// (tests/integration/memory_test.cc) and rounded up.
constexpr uint64_t kBytesPerParam = 4096;
// Each name is held about eight times (catalog entries, series keys, map keys).
constexpr uint64_t kNameCopies = 8;

}  // namespace

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

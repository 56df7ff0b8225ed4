// The daemon-wide memory budget for runs: every held run is charged for its catalog when the
// catalog is accepted, for its series as their buffers grow, and for a series' analytics
// trackers when it first reports (RunAnalytics; a series whose trackers do not fit gets none).
// A Hello (or a run restored from the journal) whose catalog would not fit is refused before
// anything of it is allocated or journaled; a series whose growth would not fit stops growing and
// downsamples sooner (no step is refused for memory). The figures are estimates of the bytes the
// run's structures hold, not of the heap's overhead or fragmentation: configure the budget with
// headroom (the default is a quarter of the machine's memory).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "server/core/types.h"

namespace gradwatch::runs {

// Thread-safe: charges and releases are atomic.
class MemoryBudget {
 public:
  // limit_bytes 0 means unlimited.
  explicit MemoryBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}

  // Charges `bytes` if the total stays within the limit; false (and nothing charged) otherwise.
  bool TryCharge(uint64_t bytes);
  // Charges `bytes` whatever the limit (buffers that already grew).
  void Charge(uint64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Release(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }

  // What a catalog of params[first..] costs a run before any of them reports: the entries, their
  // names, their three series and their analytics state, all of it still empty.
  static uint64_t CatalogBytes(const std::vector<ParamInfo>& params, size_t first = 0);
  // What a run of `meta` costs before any step, beyond its catalog (CatalogBytes): its state per
  // rank of the world, a rank set per pending step at most (`max_pending_steps`, once more than
  // a few ranks report a step) and its labels. A world of 2^20 ranks is hundreds of MiB.
  static uint64_t WorldBytes(const RunMeta& meta, size_t max_pending_steps);
  // The part of WorldBytes that depends on the world's size (a resume may change it).
  static uint64_t RankBytes(uint32_t world_size, size_t max_pending_steps);
  // The default limit: a quarter of the machine's physical memory (sysconf), or 4 GiB when it
  // cannot be read.
  static uint64_t DefaultLimitBytes();

 private:
  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

// Bytes held against a MemoryBudget by one owner, released when it is destroyed. Movable (the
// moved-from charge holds nothing). Not thread-safe: its owner serialises access.
class MemoryCharge {
 public:
  explicit MemoryCharge(MemoryBudget* budget) : budget_(budget) {}  // budget null: unlimited
  MemoryCharge(MemoryCharge&& other) noexcept : budget_(other.budget_), bytes_(std::exchange(other.bytes_, 0)) {}
  MemoryCharge& operator=(MemoryCharge&&) = delete;
  ~MemoryCharge() {
    if (budget_ != nullptr) budget_->Release(bytes_);
  }

  // Charges `bytes` if they fit (MemoryBudget::TryCharge); false and nothing charged otherwise.
  bool TryAdd(uint64_t bytes) {
    if (budget_ != nullptr && !budget_->TryCharge(bytes)) return false;
    bytes_ += bytes;
    return true;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  MemoryBudget* budget_;
  uint64_t bytes_ = 0;
};

}  // namespace gradwatch::runs

// Assembles one step of a run from the reports of its ranks. A step is complete when every rank
// of the world has reported it; a step still waiting when a later step completes, or when the
// assembly timeout passes, is completed as partial (ranks report steps in increasing order, so a
// rank that reported a later step will never report the earlier one). Norms merge as the sum of
// squared contributions, radial updates as the sum of the ranks' parts.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/core/clock.h"
#include "server/core/types.h"

namespace gradwatch::runs {

// Sums of one step's reports so far. Buffers are reused across steps (allocation-free once warm).
struct PendingStep {
  uint64_t step = 0;
  SteadyTime first_seen{};
  double wall_time = 0;  // the latest wall time any rank reported
  uint32_t ranks_reported = 0;
  bool partial = false;                                     // set when completed without every rank
  std::vector<std::pair<uint32_t, uint64_t>> contributors;  // (rank, seq), in order of arrival
  // Which ranks reported: `contributors` while at most kSparseRanks did (a scan), then a bitset of
  // the world, so that a large world with few ranks reporting holds no world-sized array per
  // pending step.
  static constexpr uint32_t kSparseRanks = 32;
  uint32_t world = 1;
  std::vector<uint64_t> rank_bits;  // empty while sparse
  bool Seen(uint32_t rank) const {
    if (rank_bits.empty()) {
      return std::any_of(contributors.begin(), contributors.end(), [rank](const auto& c) { return c.first == rank; });
    }
    return (rank_bits[rank / 64] >> (rank % 64)) & 1;
  }

  NormContribution total_grad;  // summed squares
  double loss_sum = 0, z_loss_sum = 0, lr_sum = 0;
  uint32_t loss_n = 0, z_loss_n = 0, lr_n = 0;
  uint64_t tokens_sum = 0;
  bool tokens_present = false;
  // Per catalog index × NormField: summed squares (long double, see NormContribution) and whether
  // any rank reported it.
  std::vector<long double> param_sq;
  std::vector<uint8_t> param_present;
  // Per catalog index: the ranks' radial updates, summed (RadialContribution); sized on the
  // step's first radial report only (most runs send none).
  struct Radial {
    double radial = 0;  // summed `radial` forms
    double dot = 0;     // summed `dot` forms, divided by the merged parameter norm at completion
    bool present = false;
    bool has_dot = false;
  };
  std::vector<Radial> radial;
  bool radial_any = false;
  struct Extra {
    std::string key;
    double sum = 0;
    uint32_t n = 0;
  };
  std::vector<Extra> extra;
  size_t extra_used = 0;
  uint64_t client_dropped_steps = 0;

  void Reset(uint64_t step, SteadyTime now, uint32_t world_size, size_t param_count);
  void Accumulate(uint32_t rank, const RankStep& report);
};

enum class AddResult {
  kAccepted,   // the report was added (the step may have completed)
  kDuplicate,  // this rank already reported this pending step
  kLate,       // the step was already completed without this rank
};

class StepAssembler {
 public:
  // world_size ≥ 1; pending steps beyond max_pending complete the oldest as partial.
  StepAssembler(uint32_t world_size, std::chrono::nanoseconds timeout, size_t max_pending = 1024);

  // The catalog grew: later steps have room for param_count parameters.
  void SetParamCount(size_t param_count) { param_count_ = param_count; }

  // Adds one rank's report. Completed steps are passed to on_complete in step order, then recycled
  // (on_complete must not keep the reference).
  template <typename OnComplete>
  AddResult Add(uint32_t rank, const RankStep& report, SteadyTime now, OnComplete&& on_complete);

  // Completes (as partial) the steps whose first report is older than the timeout.
  template <typename OnComplete>
  void Expire(SteadyTime now, OnComplete&& on_complete);

  // A rewind to from_step (a resume from a checkpoint). Pending steps below from_step complete
  // now, as partial, through on_complete: the resumed ranks start at from_step and will never
  // report them. Pending steps at or above it are discarded: their reports belong to the
  // abandoned branch. Completed steps at or above it no longer make reports late (the high-water
  // mark drops to from_step − 1), and the world becomes world_size ranks (≥ 1), so an elastic
  // job may resume with another size.
  template <typename OnComplete>
  void Rewind(uint64_t from_step, uint32_t world_size, OnComplete&& on_complete);

  size_t pending() const { return pending_.size(); }
  // Whether a report of `step` would now complete the oldest pending step as partial: every
  // pending slot is taken, and `step` is neither pending nor late.
  bool FullFor(uint64_t step) const;
  // The oldest pending step; only when pending() > 0.
  const PendingStep& oldest() const { return *pending_.front(); }
  bool has_completed() const { return has_completed_; }
  uint64_t last_completed_step() const { return last_completed_step_; }
  // Restores the high-water mark after a restart from the journal.
  void RestoreLastCompleted(uint64_t step);

 private:
  PendingStep* FindOrInsert(uint64_t step, SteadyTime now);
  template <typename OnComplete>
  void CompleteFront(OnComplete& on_complete);

  uint32_t world_size_;
  const std::chrono::nanoseconds timeout_;
  const size_t max_pending_;
  size_t param_count_ = 0;
  // Ordered by step; a vector (a few entries, rarely up to max_pending_): a deque would allocate
  // a block every few steps as it moves.
  std::vector<std::unique_ptr<PendingStep>> pending_;
  std::vector<std::unique_ptr<PendingStep>> free_;
  bool has_completed_ = false;
  uint64_t last_completed_step_ = 0;
};

template <typename OnComplete>
void StepAssembler::CompleteFront(OnComplete& on_complete) {
  std::unique_ptr<PendingStep> p = std::move(pending_.front());
  pending_.erase(pending_.begin());
  p->partial = p->ranks_reported < world_size_;
  has_completed_ = true;
  last_completed_step_ = p->step;
  on_complete(static_cast<const PendingStep&>(*p));
  free_.push_back(std::move(p));
}

template <typename OnComplete>
AddResult StepAssembler::Add(uint32_t rank, const RankStep& report, SteadyTime now, OnComplete&& on_complete) {
  if (has_completed_ && report.step <= last_completed_step_) return AddResult::kLate;
  PendingStep* p = FindOrInsert(report.step, now);
  if (p->Seen(rank)) return AddResult::kDuplicate;
  p->Accumulate(rank, report);
  if (p->ranks_reported == world_size_) {
    // Every step before it can no longer get reports: complete them (partial) and then it.
    while (!pending_.empty() && pending_.front()->step <= report.step) CompleteFront(on_complete);
  }
  while (pending_.size() > max_pending_) CompleteFront(on_complete);
  return AddResult::kAccepted;
}

template <typename OnComplete>
void StepAssembler::Expire(SteadyTime now, OnComplete&& on_complete) {
  // Steps are ordered by number, not by age; a step whose first report is old completes and
  // takes every earlier step with it.
  size_t last_expired = pending_.size();
  for (size_t i = 0; i < pending_.size(); ++i) {
    if (now - pending_[i]->first_seen >= timeout_) last_expired = i;
  }
  if (last_expired == pending_.size()) return;
  for (size_t i = 0; i <= last_expired; ++i) CompleteFront(on_complete);
}

template <typename OnComplete>
void StepAssembler::Rewind(uint64_t from_step, uint32_t world_size, OnComplete&& on_complete) {
  while (!pending_.empty() && pending_.front()->step < from_step) CompleteFront(on_complete);
  while (!pending_.empty()) {
    free_.push_back(std::move(pending_.back()));
    pending_.pop_back();
  }
  if (has_completed_ && last_completed_step_ >= from_step) {
    has_completed_ = from_step > 0;
    last_completed_step_ = has_completed_ ? from_step - 1 : 0;
  }
  world_size_ = std::max<uint32_t>(1, world_size);
}

}  // namespace gradwatch::runs
